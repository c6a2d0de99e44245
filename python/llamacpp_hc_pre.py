"""Recompute layer 0's ``attn.hc_pre_weights`` bit for bit, as the reference runtime computes it
and as llama.cpp (llama-cpp-python 0.3.36) computes it, and attribute every differing value to
its causes by swapping them in, one subset at a time (docs/interop-llamacpp.md section 4.6).

    python3 python/llamacpp_hc_pre.py --gguf G.gguf --ref REF.bin [--cand LLAMACPP.bin]
        [--cpu-path AVX-512|AVX2|'AVX (no FMA)'] [--json]

``--gguf`` is a GGUF written by ``moeconf export gguf`` (Phi = ``blk.0.hc_attn_fn``, b, alpha and
the two epsilons are read from it; the export checked them bit for bit against the checkpoint).
``--ref`` is a reference trace (``moeconf run --capture all``, bf16, f32 or official profile) and
``--cand`` a llama.cpp capture (``python -m moeconf llamacpp``) of the same prompt: both hold
``embed.output`` (which must match at step 0, position 0) and layer 0's ``attn.hc_pre_weights``.
The detailed attribution is for the first token; every token both traces hold is recomputed too
(the prompt's with llama.cpp's prefill kernel, decode steps with its decode kernel). Exit status 1
when a recomputed value is not its trace's. Without ``--cand`` only the reference is checked.

Every operation is one IEEE binary32 operation emulated exactly in numpy (float32 arrays round
each operation; a fused multiply-add is computed exactly in float64 with an error-free
correction, then rounded once). The causes, each read in the source (paths relative to
llama-cpp-python 0.3.36's ``vendor/llama.cpp/``, the reference's in this repository):

* ``norm``  the RMS statistic. Reference: ``rms_factor`` (reference-runtime/src/rmsnorm.rs):
  ``dot8(x, x)`` in FP32 (8 lanes, products rounded, no FMA), ``/ n`` in FP32.
  llama.cpp: ``ggml_compute_forward_rms_norm_f32`` (ggml/src/ggml-cpu/ops.cpp): each square
  rounded to FP32, then summed **in double** (``ggml_float``) sequentially, ``mean = (float)(sum /
  n)``. Both then ``1 / sqrtf(mean + eps)`` in FP32 and ``u_i = x_i * r``.
* the matmul kernel of the mixes ``mu = Phi . u`` (dot products of length N*D), in three parts,
  ``lanes`` (8 or 16), ``fma`` (fused or multiply-then-add) and ``fold`` (the horizontal sum:
  ``pairs`` = dot8's ((l0+l1)+(l2+l3))+..., ``halves`` = upper + lower half, recursively).
  Reference: dot8 = (8, no, pairs) (docs/operators.md section 2). llama.cpp at the prefill
  (n_tokens >= 2): ``llamafile_sgemm`` (ggml/src/ggml-cpu/llamafile/sgemm.cpp), one accumulator
  register per output from 0: ``tinyBLAS<16, __m512>`` with ``_mm512_fmadd_ps`` and GCC's
  ``_mm512_reduce_add_ps`` on AVX-512F = (16, yes, halves); ``tinyBLAS<8, __m256>`` with
  ``_mm256_fmadd_ps`` and ``hsum(__m256)`` on AVX2 + FMA = (8, yes, halves); without FMA the
  generic ``madd`` = (8, no, halves). At decode steps (n_tokens = 1): ``ggml_vec_dot_f32``
  (ggml/src/ggml-cpu/vec.cpp), 4 accumulators of 16 or 8 lanes (``mm = "vecdot"``).
* ``order`` where the factor r is applied: ``before`` (``Phi . (x r)``: the reference's bf16/f32
  profiles and llama.cpp, src/models/deepseek4.cpp ``build_hc_pre``) or ``after`` (``(Phi . x) r``:
  the official profile, DeepSeek's ``F.linear(x, hc_fn) * rsqrt``).
* ``exp``   sigmoid ``1 / (1 + expf(-z))`` in both; reference expf = the Rust ``libm`` crate 0.2.16
  (FreeBSD ``e_expf.c``, ported below), llama.cpp = the C library's ``expf`` (``op_sigmoid``,
  ggml/src/ggml-cpu/unary-ops.cpp; this process's C library, called through ctypes).

The affine ``alpha0 * mu + b`` (two separate ggml ops, two FP32 roundings; the reference the
same) and ``+ eps_hc`` (``ggml_scale_bias`` with s = 1: ``fma(x, 1, eps) = x + eps``) are the
same on both sides and not varied.
"""
import argparse
import ctypes
import ctypes.util
import itertools
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

F32 = np.float32
N_HC = 4

# ---------------------------------------------------------------------------------------------
# exact float32 primitives


def fma32(a, b, c):
    """Exact ``fma(a, b, c)`` rounded once to float32 (elementwise; a, b, c float32)."""
    a, b, c = (np.asarray(v, dtype=np.float64) for v in (a, b, c))
    p = a * b                        # exact: 24 + 24 significant bits
    s = p + c                        # rounded to double
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # TwoSum: p + c = s + err exactly
    r = np.atleast_1d(s.astype(np.float32))
    # s rounds like s + err unless s is exactly halfway between two float32 values (every such
    # midpoint is a double) and err breaks the tie.
    s, err = np.atleast_1d(s), np.atleast_1d(err)
    up = np.nextafter(r, np.float32(np.inf))
    down = np.nextafter(r, np.float32(-np.inf))
    r64 = r.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        to_up = (err > 0) & (s == (r64 + up.astype(np.float64)) / 2)
        to_down = (err < 0) & (s == (r64 + down.astype(np.float64)) / 2)
    return np.where(to_up, up, np.where(to_down, down, r))


def ordered(x):
    """float32 -> integers in the order of the values (for ulp distances)."""
    b = np.asarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.where(b < 0, -(b & 0x7FFFFFFF), b)


def ulps(a, b):
    return (ordered(b) - ordered(a)).tolist()


def bits(x):
    return [f"{int(v):08x}" for v in np.asarray(x, dtype=np.float32).view(np.uint32)]


# ---------------------------------------------------------------------------------------------
# the RMS factor


def rms_dot8(x, eps):
    """Reference: ``1 / sqrt(dot8(x, x) / n + eps)``, all FP32."""
    ss = dot8(x, x)
    return F32(1.0) / np.sqrt(F32(ss / F32(len(x)) + F32(eps)))


def rms_ggml(x, eps):
    """ggml ``rms_norm_f32``: ``sum += (ggml_float)(x*x)`` in double, in index order;
    ``mean = (float)(sum / n)``; ``1.0f / sqrtf(mean + eps)``."""
    sq = (x * x).astype(np.float64)  # each square rounded to FP32 first
    s = 0.0
    for v in sq:
        s += float(v)
    mean = F32(s / len(x))
    return F32(1.0) / np.sqrt(F32(mean + F32(eps)))


def rms_f32_seq(x, eps):
    """For the attribution only: FP32 squares summed sequentially in FP32 (ggml's order, the
    reference's precision)."""
    s = F32(0.0)
    for v in x * x:
        s = F32(s + v)
    return F32(1.0) / np.sqrt(F32(s / F32(len(x)) + F32(eps)))


def rms_exact(x, eps):
    """For the attribution only: the exact sum of the exact squares (math.fsum of doubles, each
    square exact in double), one rounding to FP32 of the mean."""
    import math

    xd = np.asarray(x, dtype=np.float64)
    mean = F32(math.fsum((xd * xd).tolist()) / len(x))
    return F32(1.0) / np.sqrt(F32(mean + F32(eps)))


NORMS = {"ref": rms_dot8, "ggml": rms_ggml, "f32-seq": rms_f32_seq, "exact": rms_exact}

# ---------------------------------------------------------------------------------------------
# dot products (rows of W against one vector)


def dot8(w, x):
    """Reference dot8: lane i mod 8, products rounded (no FMA), lanes from +0, fold
    ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))."""
    out = lane_dot(w, x, 8, False, "pairs")
    return out if out.shape[0] > 1 else out[0]


def fold(v, how):
    """Folds [rows, L] lanes (L a power of two) to [rows]. ``pairs``: adjacent pairs, recursively
    (dot8's ((l0+l1)+(l2+l3))+...); ``halves``: upper half + lower half, recursively, which is
    GCC 12's ``_mm512_reduce_add_ps`` (avx512fintrin.h ``__MM512_REDUCE_OP``: 256 + 256, 128 + 128,
    then (t0 + t2) + (t1 + t3)) and sgemm.cpp's ``hsum(__m256)`` (128 + 128, ``x + movehl(x)``,
    ``add_ss(x, movehdup(x))``)."""
    while v.shape[1] > 1:
        h = v.shape[1] // 2
        v = v[:, 0::2] + v[:, 1::2] if how == "pairs" else v[:, h:] + v[:, :h]
    return v[:, 0]


def lane_dot(w, x, lanes, fma, how):
    """Rows of w against x: element i into lane i mod ``lanes`` (every lane from 0, increasing i),
    multiply-add fused (one rounding) or not (two), then ``fold(how)``. llamafile's tinyBLAS<KN>
    is (KN, fused, halves): one register per output, ``madd`` over l = 0, KN, 2 KN, ... (k % KN
    == 0, else llamafile_sgemm declines), then ``hsum``."""
    w = np.atleast_2d(np.asarray(w, dtype=F32))
    x = np.asarray(x, dtype=F32)
    n = x.shape[0]
    assert n % lanes == 0
    acc = np.zeros((w.shape[0], lanes), dtype=F32)
    for l in range(0, n, lanes):
        xs = np.broadcast_to(x[l:l + lanes], acc.shape)
        if fma:
            acc = fma32(w[:, l:l + lanes], xs, acc).reshape(acc.shape)
        else:
            acc = acc + w[:, l:l + lanes] * xs
    return fold(acc, how)


def vec_dot(w, x, epr, fma=True):
    """``ggml_vec_dot_f32`` (ggml/src/ggml-cpu/vec.cpp), x86 GGML_SIMD branch, the kernel of the
    decode steps (n_tokens = 1, llamafile_sgemm declines): GGML_F32_STEP = 4 * epr, 4
    accumulators of epr lanes (``sum[j]``, element i + j*epr + lane), ``GGML_F32_VEC_FMA``, then
    ``GGML_F32_VEC_REDUCE`` (simd-mappings.h: sum0 += sum2, sum1 += sum3, sum0 += sum1, then
    ``_mm512_reduce_add_ps`` (epr 16) or lo128 + hi128 and two ``_mm_hadd_ps`` (epr 8))."""
    w = np.atleast_2d(np.asarray(w, dtype=F32))
    x = np.asarray(x, dtype=F32)
    n = x.shape[0]
    step = 4 * epr
    assert n % step == 0, "leftover elements not emulated"
    acc = [np.zeros((w.shape[0], epr), dtype=F32) for _ in range(4)]
    for i in range(0, n, step):
        for j in range(4):
            sl = slice(i + j * epr, i + (j + 1) * epr)
            xs = np.broadcast_to(x[sl], acc[j].shape)
            if fma:
                acc[j] = fma32(w[:, sl], xs, acc[j]).reshape(acc[j].shape)
            else:                    # GGML_F32x8_FMA without __FMA__: add(mul(b, c), a)
                acc[j] = acc[j] + w[:, sl] * xs
    a0 = (acc[0] + acc[2]) + (acc[1] + acc[3])
    if epr == 16:
        return fold(a0, "halves")
    t = a0[:, 4:8] + a0[:, 0:4]
    return (t[:, 0] + t[:, 1]) + (t[:, 2] + t[:, 3])


def matmul(cfg, w, x):
    if cfg["mm"] == "vecdot":
        return vec_dot(w, x, cfg["lanes"], cfg["fma"])
    return lane_dot(w, x, cfg["lanes"], cfg["fma"], cfg["fold"])


# ---------------------------------------------------------------------------------------------
# expf


_LN2_HI, _LN2_LO, _INV_LN2 = F32(6.9314575195e-01), F32(1.4286067653e-06), F32(1.4426950216e+00)
_P1, _P2 = F32(1.6666625440e-1), F32(-2.7667332906e-3)


def expf_rust_libm(x):
    """The Rust ``libm`` crate 0.2.16 ``expf`` (src/math/expf.rs, FreeBSD e_expf.c), every step a
    float32 operation in the crate's order (Rust never contracts to FMA). Finite, non-extreme
    arguments only (|x| < 87)."""
    x = F32(x)
    hx = int(np.array(x, dtype=F32).view(np.uint32)) & 0x7FFFFFFF
    sign = int(np.array(x, dtype=F32).view(np.uint32)) >> 31
    assert hx < 0x42AEAC50, "overflow/underflow range not emulated"
    if hx > 0x3EB17218:
        if hx > 0x3F851592:
            k = int(np.trunc(_INV_LN2 * x + (F32(0.5) if sign == 0 else F32(-0.5))))
        else:
            k = 1 - sign - sign
        kf = F32(k)
        hi = F32(x - kf * _LN2_HI)
        lo = F32(kf * _LN2_LO)
        x = F32(hi - lo)
    elif hx > 0x39000000:
        k, hi, lo = 0, x, F32(0.0)
    else:
        return F32(F32(1.0) + x)
    xx = F32(x * x)
    c = F32(x - xx * (_P1 + xx * _P2))
    y = F32(F32(1.0) + (F32(x * c / (F32(2.0) - c)) - lo + hi))
    return y if k == 0 else F32(y * F32(2.0) ** k)


_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.expf.restype = ctypes.c_float
_libm.expf.argtypes = [ctypes.c_float]


def expf_c(x):
    """This process's C library ``expf`` (the one llama.cpp's ``op_sigmoid`` calls)."""
    return F32(_libm.expf(float(F32(x))))


EXPS = {"rust-libm": expf_rust_libm, "libc": expf_c}

# ---------------------------------------------------------------------------------------------
# the operator


def hc_pre_weights(inp, cfg):
    """``pre_j = sigmoid(alpha0 * mu_j + b_j) + eps_hc`` under configuration ``cfg``; returns
    (pre, mu, r) for the first N rows of Phi (the pre weights)."""
    streams, phi, base, scale, eps, hc_eps = inp
    r = NORMS[cfg["norm"]](streams, eps)
    if cfg["order"] == "before":
        mu = matmul(cfg, phi[:N_HC], streams * r)
    else:
        mu = matmul(cfg, phi[:N_HC], streams) * r
    mu = np.asarray(mu, dtype=F32)
    z = scale[0] * mu + base[:N_HC]            # two FP32 operations (ggml MUL, then ADD)
    e = np.array([EXPS[cfg["exp"]](-v) for v in z], dtype=F32)
    pre = F32(1.0) / (F32(1.0) + e) + F32(hc_eps)
    return pre, mu, r


#: The causes, in the order they are swapped. ``lanes``, ``fma`` and ``fold`` together are the
#: matmul kernel.
CAUSES = ("norm", "lanes", "fma", "fold", "order", "exp")
#: The reference's bf16/f32 profiles (docs/operators.md section 3 #2) and its official profile.
REFERENCE = {"norm": "ref", "mm": "lanes", "lanes": 8, "fma": False, "fold": "pairs", "order": "before",
             "exp": "rust-libm"}
REFERENCE_OFFICIAL = dict(REFERENCE, order="after")
#: llama.cpp at step 0 (the prefill, n_tokens >= 2: llamafile_sgemm), by the CPU path it was built for.
LLAMACPP = {
    "AVX-512": {"norm": "ggml", "mm": "lanes", "lanes": 16, "fma": True, "fold": "halves", "order": "before",
                "exp": "libc"},
    "AVX2": {"norm": "ggml", "mm": "lanes", "lanes": 8, "fma": True, "fold": "halves", "order": "before",
             "exp": "libc"},
    # tinyBLAS<8, __m256> without __FMA__: the generic madd = add(mul(a, b), c)
    "AVX (no FMA)": {"norm": "ggml", "mm": "lanes", "lanes": 8, "fma": False, "fold": "halves",
                     "order": "before", "exp": "libc"},
}
#: llama.cpp at the decode steps (n_tokens = 1: ggml_vec_dot_f32), for comparison only.
LLAMACPP_DECODE = {k: dict(v, mm="vecdot") for k, v in LLAMACPP.items()}


def describe(cfg):
    if cfg["mm"] == "vecdot":
        mm = f"ggml_vec_dot_f32 4x{cfg['lanes']} lanes {'FMA' if cfg['fma'] else 'mul+add'}"
    else:
        mm = f"{cfg['lanes']} lanes {'FMA' if cfg['fma'] else 'mul+add'} fold {cfg['fold']}"
    return f"norm {cfg['norm']}, {mm}, r {cfg['order']} the matmul, expf {cfg['exp']}"


def load_gguf(path):
    import gguf

    r = gguf.GGUFReader(path)
    t = {x.name: np.asarray(x.data) for x in r.tensors if x.name.startswith("blk.0.hc_attn_")}
    kv = {k: f.parts[f.data[0]][0] for k, f in r.fields.items()
          if k in ("deepseek4.attention.layer_norm_rms_epsilon", "deepseek4.hyper_connection.epsilon")}
    phi = t["blk.0.hc_attn_fn.weight"]
    if phi.dtype != F32 or phi.shape[0] != (2 + N_HC) * N_HC:
        raise SystemExit(f"{path}: blk.0.hc_attn_fn.weight is {phi.dtype} {phi.shape}, not F32 "
                         f"[{(2 + N_HC) * N_HC}, N*D]")
    return (phi, t["blk.0.hc_attn_base.weight"].astype(F32), t["blk.0.hc_attn_scale.weight"].astype(F32),
            F32(kv["deepseek4.attention.layer_norm_rms_epsilon"]), F32(kv["deepseek4.hyper_connection.epsilon"]))


def records(path):
    """``{(step, position): (embed.output, layer 0's attn.hc_pre_weights)}`` for every token the
    trace holds both for, and the binding."""
    from moeconf.trace import read_trace

    t = read_trace(path, verify=False)
    emb, pre = {}, {}
    for i, r in enumerate(t.records):
        c = r.coord
        if c.path == "embed.output":
            emb[c.step, c.position] = i
        elif c.layer == 0 and c.path == "attn.hc_pre_weights":
            pre[c.step, c.position] = i
    out = {}
    for k in sorted(emb.keys() & pre.keys()):
        e, p = t.array(emb[k]), t.array(pre[k])
        if e is not None and p is not None:
            out[k] = (e.astype(F32), p.astype(F32))
    if (0, 0) not in out:
        raise SystemExit(f"{path}: no embed.output and attn.hc_pre_weights payloads at step 0, position 0 "
                         f"(capture with --capture all)")
    return out, t.binding


def cpu_path(system_info):
    """The matmul path llama.cpp's CPU backend was compiled for, from ``llama_print_system_info()``
    (compile-time flags: ggml_cpu_has_avx512 = __AVX512F__, ...), or None for one not emulated."""
    has = {k for k, v in (f.split(" = ") for f in system_info.replace("CPU : ", "").split(" | ") if " = " in f)
           if v.strip() == "1"}
    if "AVX512" in has:
        return "AVX-512"
    if "AVX" in has or "AVX2" in has:
        return "AVX2" if "FMA" in has else "AVX (no FMA)"
    return None


def pre_eq(a, b):
    return np.asarray(a, dtype=F32).tobytes() == np.asarray(b, dtype=F32).tobytes()


def attribute(inp, src, dst):
    """Every subset of the causes on which ``src`` and ``dst`` differ swapped from ``src`` to
    ``dst``: per subset the pre weights' ulps from ``src``'s; per value the smallest subsets that
    give ``dst``'s value exactly."""
    diff = [c for c in CAUSES if src[c] != dst[c]]
    base_pre, base_mu, base_r = hc_pre_weights(inp, src)
    want = hc_pre_weights(inp, dst)[0]
    rows = []
    for k in range(len(diff) + 1):
        for subset in itertools.combinations(diff, k):
            pre, mu, r = hc_pre_weights(inp, dict(src, **{c: dst[c] for c in subset}))
            rows.append({"swapped": list(subset), "pre_ulps": ulps(base_pre, pre), "mu_ulps": ulps(base_mu, mu),
                         "r_ulps": ulps([base_r], [r])[0], "equals_target": [bool(a == b) for a, b in zip(pre, want)]})
    per_value = []
    for j in range(N_HC):
        if base_pre[j] == want[j]:
            per_value.append({"value": j, "ulps": 0, "minimal_causes": []})
            continue
        sets = [set(r["swapped"]) for r in rows if r["equals_target"][j]]
        minimal = [sorted(s, key=CAUSES.index) for s in sets if not any(o < s for o in sets)]
        # every superset of a minimal set need not reproduce it; say which do not
        per_value.append({"value": j, "ulps": ulps([base_pre[j]], [want[j]])[0], "minimal_causes": minimal,
                          "all_reproducing": [sorted(s, key=CAUSES.index) for s in sets]})
    return {"causes": diff, "subsets": rows, "per_value": per_value}


#: Groups of causes swapped together in the per-token counts: each cause, and the matmul kernel.
GROUPS = {"norm": ("norm",), "kernel": ("lanes", "fma", "fold"), "lanes": ("lanes",), "fma": ("fma",),
          "fold": ("fold",), "order": ("order",), "exp": ("exp",)}


def causes_over_tokens(inps, src, dst):
    """Over many tokens' inputs: how many pre values differ between ``src`` and ``dst``, and per
    group of causes (on which the two differ) in how many of those values swapping the group alone
    from ``src`` to ``dst`` gives ``dst``'s value (``alone``), and reverting it alone from ``dst``
    changes ``dst``'s value (``needed``)."""
    groups = {g: cs for g, cs in GROUPS.items() if any(src[c] != dst[c] for c in cs)}
    out = {"tokens": len(inps), "values": 0, "differing": 0,
           "alone": dict.fromkeys(groups, 0), "needed": dict.fromkeys(groups, 0),
           "changes_alone": dict.fromkeys(groups, 0)}
    for inp in inps:
        a, b = hc_pre_weights(inp, src)[0], hc_pre_weights(inp, dst)[0]
        d = a != b
        out["values"] += len(a)
        out["differing"] += int(d.sum())
        for g, cs in groups.items():
            fwd = hc_pre_weights(inp, dict(src, **{c: dst[c] for c in cs}))[0]
            back = hc_pre_weights(inp, dict(dst, **{c: src[c] for c in cs}))[0]
            out["alone"][g] += int((d & (fwd == b)).sum())
            out["needed"][g] += int((d & (back != b)).sum())
            out["changes_alone"][g] += int((fwd != a).sum())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--ref", required=True, help="reference trace (moeconf run --capture all)")
    ap.add_argument("--cand", help="llama.cpp trace (python -m moeconf llamacpp)")
    ap.add_argument("--cpu-path", choices=sorted(LLAMACPP),
                    help="the matmul path of the llama.cpp build (default: from llama_cpp.llama_print_system_info() "
                         "when llama_cpp imports, else AVX-512)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    path, info = a.cpu_path, None
    if path is None:
        try:
            import llama_cpp

            info = llama_cpp.llama_print_system_info().decode()
            path = cpu_path(info)
            if path is None:
                raise SystemExit(f"llama.cpp's CPU backend ({info.strip()}) takes a matmul path not emulated here")
        except ImportError:
            path = "AVX-512"
    res = analyse(a.gguf, a.ref, a.cand, path)
    res["system_info"] = info
    print(json.dumps(res, indent=1) if a.json else text(res))
    return 0 if res["ok"] else 1


def analyse(gguf_path, ref_path, cand_path=None, path="AVX-512"):
    """The recomputation and the attribution as a dict (``ok``: every recomputed value of a trace
    equals the trace's bit for bit)."""
    phi, base, scale, eps, hc_eps = load_gguf(gguf_path)
    ref, binding = records(ref_path)
    ref_cfg = REFERENCE_OFFICIAL if binding.precision == "official" else REFERENCE
    prefill = len(binding.prompt_ids) >= 2      # llamafile_sgemm only for n_tokens >= 2
    cand = None
    if cand_path:
        cand, _ = records(cand_path)
        if cand[0, 0][0].tobytes() != ref[0, 0][0].tobytes():
            raise SystemExit("embed.output differs between the traces: the recomputation needs equal inputs")

    def inputs(emb):
        return (np.tile(emb, N_HC), phi, base, scale, eps, hc_eps)   # layer 0: the embedding N times

    def lc_cfg(step):
        return (LLAMACPP if step == 0 and prefill else LLAMACPP_DECODE)[path]

    inp = inputs(ref[0, 0][0])
    res = {"reference_profile": binding.precision, "rms_eps": float(eps), "hc_eps": float(hc_eps),
           "llamacpp_path": path, "recomputed": {}}
    configs = {f"reference {binding.precision}": ref_cfg}
    configs.update({f"llama.cpp prefill {k}": v for k, v in LLAMACPP.items()})
    configs.update({f"llama.cpp decode kernel {k}": v for k, v in LLAMACPP_DECODE.items()})
    ok = True
    for name, cfg in configs.items():
        pre, mu, r = hc_pre_weights(inp, cfg)
        o = {"config": describe(cfg), "pre_bits": bits(pre), "mu_bits": bits(mu), "r_bits": bits([r])[0]}
        if name.startswith("reference"):
            o["trace_bits"], o["matches_trace"] = bits(ref[0, 0][1]), pre_eq(pre, ref[0, 0][1])
        elif cand is not None and cfg is lc_cfg(0):
            o["trace_bits"], o["matches_trace"] = bits(cand[0, 0][1]), pre_eq(pre, cand[0, 0][1])
        ok &= o.get("matches_trace", True)
        res["recomputed"][name] = o
    if cand is not None:
        res["traces_ulps"] = ulps(ref[0, 0][1], cand[0, 0][1])
    res["reference_to_llamacpp"] = attribute(inp, ref_cfg, lc_cfg(0))
    res["rms_factor"] = {k: bits([f(inp[0], eps)])[0] for k, f in NORMS.items()}
    zs = []
    for cfg in (ref_cfg, lc_cfg(0)):
        mu = hc_pre_weights(inp, cfg)[1]
        zs += [float(v) for v in scale[0] * mu + base[:N_HC]]
    res["expf"] = [{"arg": -z, "libc": bits([expf_c(-z)])[0], "rust_libm": bits([expf_rust_libm(-z)])[0]}
                   for z in dict.fromkeys(zs)]
    # Every token both traces hold: each side's recomputation against its own capture, and how
    # many values the two captures differ in.
    tokens = {"reference": [0, 0], "llama.cpp prefill": [0, 0], "llama.cpp decode": [0, 0],
              "tokens_differing": 0, "values_differing": 0, "values": 0, "max_ulps": 0, "mismatches": []}
    for k, (emb, want) in sorted(ref.items()):
        i = inputs(emb)
        got = hc_pre_weights(i, ref_cfg)[0]
        tokens["reference"][0] += 1
        tokens["reference"][1] += pre_eq(got, want)
        if not pre_eq(got, want):
            tokens["mismatches"].append({"side": "reference", "step": k[0], "position": k[1]})
        if cand is None or k not in cand:
            continue
        cemb, cwant = cand[k]
        if cemb.tobytes() != emb.tobytes():
            continue                               # other tokens (the two runs generated differently)
        kind = "llama.cpp prefill" if k[0] == 0 and prefill else "llama.cpp decode"
        got = hc_pre_weights(i, lc_cfg(k[0]))[0]
        tokens[kind][0] += 1
        tokens[kind][1] += pre_eq(got, cwant)
        if not pre_eq(got, cwant):
            tokens["mismatches"].append({"side": kind, "step": k[0], "position": k[1]})
        u = np.abs(ulps(want, cwant))
        tokens["tokens_differing"] += bool(u.any())
        tokens["values_differing"] += int((u != 0).sum())
        tokens["values"] += len(u)
        tokens["max_ulps"] = max(tokens["max_ulps"], int(u.max()))
    res["tokens"] = tokens
    res["causes_over_tokens"] = causes_over_tokens(
        [inputs(emb) for k, (emb, _) in sorted(ref.items()) if k[0] == 0], ref_cfg, lc_cfg(0))
    res["ok"] = bool(ok and not tokens["mismatches"])
    return res


def text(res):
    out = [f"reference profile {res['reference_profile']}; rms eps {res['rms_eps']:.9g}, hc eps {res['hc_eps']:.9g}"]
    for name, o in res["recomputed"].items():
        m = o.get("matches_trace")
        tag = "" if m is None else ("  = its trace, bit for bit" if m else f"  DIFFERS from its trace {o['trace_bits']}")
        out.append(f"{name}: pre {' '.join(o['pre_bits'])}{tag}")
        out.append(f"    ({o['config']}); r {o['r_bits']}; mu {' '.join(o['mu_bits'])}")
    if "traces_ulps" in res:
        out.append(f"captured: llama.cpp - reference = {res['traces_ulps']} ulps")
    out.append("RMS factor r by accumulation: " + ", ".join(f"{k} {v}" for k, v in res["rms_factor"].items()))
    if res.get("system_info"):
        out.append(f"llama.cpp build: {res['system_info'].strip()}")
    at = res["reference_to_llamacpp"]
    out.append(f"from the reference to llama.cpp {res['llamacpp_path']}, causes swapped (ulps of pre, mu, r "
               f"from the reference's):")
    for s in at["subsets"]:
        out.append(f"  {'+'.join(s['swapped']) or '(none)':<28} pre {s['pre_ulps']}  mu {s['mu_ulps']}  "
                   f"r {s['r_ulps']}")
    out.append("per value: smallest sets of causes that give llama.cpp's value")
    for v in at["per_value"]:
        sets = " or ".join("{" + ", ".join(m) + "}" for m in v["minimal_causes"]) or "(equal)"
        out.append(f"  pre[{v['value']}]: {v['ulps']:+d} ulp: {sets}")
    tk = res["tokens"]
    out.append("every token (layer 0; reproduced / recomputed): " + ", ".join(
        f"{k} {tk[k][1]}/{tk[k][0]}" for k in ("reference", "llama.cpp prefill", "llama.cpp decode") if tk[k][0]))
    if tk["values"]:
        out.append(f"  the captures differ in {tk['values_differing']} of {tk['values']} values "
                   f"({tk['tokens_differing']} tokens), at most {tk['max_ulps']} ulp")
    ct = res["causes_over_tokens"]
    out.append(f"over the {ct['tokens']} tokens of step 0: reference and llama.cpp differ in {ct['differing']} of "
               f"{ct['values']} values; per cause (or the kernel: lanes+fma+fold), values where it alone gives "
               f"llama.cpp's value / is needed for it / changes the reference's value when swapped alone:")
    for g in ct["alone"]:
        out.append(f"  {g:<7} alone {ct['alone'][g]:>4}  needed {ct['needed'][g]:>4}  changes {ct['changes_alone'][g]:>4}")
    for m in tk["mismatches"][:10]:
        out.append(f"  NOT reproduced: {m['side']} step {m['step']} position {m['position']}")
    out.append("expf on the sigmoid arguments of both sides:")
    for e in res["expf"]:
        out.append(f"  expf({e['arg']:+.9g}): libc {e['libc']}, rust libm {e['rust_libm']}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
