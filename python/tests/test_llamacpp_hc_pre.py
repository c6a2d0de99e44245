"""``llamacpp_hc_pre.py``, the bitwise recomputation of layer 0's ``attn.hc_pre_weights`` on both
sides (docs/interop-llamacpp.md section 4.6), without llama.cpp: its float32 primitives against
exact arithmetic and against the intrinsics' definitions written out, the CPU path read from
llama.cpp's system info, and the reference side reproducing real reference traces bit for bit
(bf16 and official profiles; the reference's numerics do not depend on the CPU). The llama.cpp
side is checked against real captures in tests/test_llamacpp_live.py."""

import json
import os
from fractions import Fraction

import numpy as np
import pytest

import llamacpp_hc_pre as h

F32 = np.float32


def _round_exact(fr):
    """The float32 nearest to the Fraction ``fr``, ties to even."""
    x = F32(float(fr))
    cands = [np.nextafter(x, F32(-np.inf)), x, np.nextafter(x, F32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - fr), int(np.array(c).view(np.uint32)) & 1))


def test_fma32_rounds_once_like_exact_arithmetic():
    rng = np.random.default_rng(7)
    n = 3000
    a = rng.standard_normal(n).astype(F32)
    b = rng.standard_normal(n).astype(F32)
    c = (rng.standard_normal(n) * rng.choice([1e-9, 1e-4, 1.0, 1e4], n)).astype(F32)
    # exact ties and near-ties: (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is halfway between two floats
    t = F32(1 + 2.0 ** -12)
    a = np.concatenate([a, [t] * 4])
    b = np.concatenate([b, [t] * 4])
    c = np.concatenate([c, np.array([0.0, -(2.0 ** -24), 2.0 ** -30, -(2.0 ** -30)], dtype=F32)])
    got = h.fma32(a, b, c)
    for i in range(len(a)):
        want = _round_exact(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])))
        assert got[i] == want, (i, a[i], b[i], c[i])
    # the tie broken by a tiny addend: one rounding gives 1 + 2^-11 + 2^-23, a rounded product
    # (ties to even: 1 + 2^-11) plus the addend gives 1 + 2^-11
    assert got[-2] == F32(1 + 2.0 ** -11 + 2.0 ** -23) and (a[-2] * b[-2]) + c[-2] == F32(1 + 2.0 ** -11)


def test_folds_are_the_kernels_written_out():
    rng = np.random.default_rng(3)
    v = (rng.standard_normal((50, 16)) * 10.0 ** rng.integers(-3, 4, (50, 16))).astype(F32)
    # GCC 12 _mm512_reduce_add_ps (avx512fintrin.h __MM512_REDUCE_OP)
    t3 = [v[:, 8 + i] + v[:, i] for i in range(8)]
    t6 = [t3[4 + i] + t3[i] for i in range(4)]
    want = (t6[0] + t6[2]) + (t6[1] + t6[3])
    assert h.fold(v, "halves").tobytes() == want.tobytes()
    # sgemm.cpp hsum(__m256): _mm_add_ps(hi128, lo128), x + movehl(x), add_ss(x, movehdup(x))
    w = v[:, :8]
    x = [w[:, 4 + i] + w[:, i] for i in range(4)]
    assert h.fold(w, "halves").tobytes() == ((x[0] + x[2]) + (x[1] + x[3])).tobytes()
    # the reference's dot8 fold ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))
    l_ = [w[:, i] for i in range(8)]
    want = ((l_[0] + l_[1]) + (l_[2] + l_[3])) + ((l_[4] + l_[5]) + (l_[6] + l_[7]))
    assert h.fold(w, "pairs").tobytes() == want.tobytes()
    # a dot product with lanes: lane i mod L accumulates in increasing i
    wr = rng.standard_normal((3, 64)).astype(F32)
    xr = rng.standard_normal(64).astype(F32)
    acc = np.zeros((3, 8), dtype=F32)
    for i in range(64):
        acc[:, i % 8] = acc[:, i % 8] + wr[:, i] * xr[i]
    assert h.lane_dot(wr, xr, 8, False, "pairs").tobytes() == h.fold(acc, "pairs").tobytes()


def test_the_cpu_path_is_read_from_llama_cpps_system_info():
    avx512 = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
              "AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |")
    assert h.cpu_path(avx512) == "AVX-512"
    assert h.cpu_path("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | LLAMAFILE = 1 |") == "AVX2"
    assert h.cpu_path("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | LLAMAFILE = 1 |") == "AVX (no FMA)"
    assert h.cpu_path("CPU : NEON = 1 | ARM_FMA = 1 | LLAMAFILE = 1 |") is None
    assert h.LLAMACPP["AVX-512"]["lanes"] == 16 and h.LLAMACPP["AVX2"]["lanes"] == 8


def test_expf_port_is_the_freebsd_algorithm_within_one_ulp_of_exp():
    xs = np.linspace(-6.0, 6.0, 2001, dtype=F32)
    xs = xs[np.abs(xs) > 2.0 ** -13]
    got = np.array([h.expf_rust_libm(x) for x in xs], dtype=F32)
    want = np.exp(xs.astype(np.float64)).astype(F32)
    assert np.abs(h.ordered(got) - h.ordered(want)).max() <= 1


@pytest.fixture(scope="module")
def reference_traces(moeconf_bin, tmp_path_factory):
    import subprocess

    gguf = pytest.importorskip("gguf")  # the GGUF reader (run_tests.sh installs it)
    if not hasattr(gguf, "GGUFReader"):
        pytest.skip("the gguf package is not installed (found a folder named gguf instead)")

    d = tmp_path_factory.mktemp("hc_pre")
    env = dict(os.environ, MOECONF_CACHE_DIR=str(d / "cache"), NO_COLOR="1")

    def mc(*a):
        p = subprocess.run([moeconf_bin, *map(str, a)], capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr
        return p

    g = d / "native.gguf"
    mc("export", "gguf", "--model", "builtin:tiny-v4-fp8", "--type", "native", "-o", g)
    out = {}
    for prof in ("bf16", "official"):
        out[prof] = d / f"ref_{prof}.bin"
        p = subprocess.run([moeconf_bin, "run", "--model", "builtin:tiny-v4-fp8", "--prompt", "why the sheep sleep",
                            "--max-new-tokens", "2", "--precision", prof, "--capture", "all", "-o", out[prof]],
                           capture_output=True, text=True, env=env)
        if p.returncode != 0 and prof == "official":
            out.pop(prof)               # a build without the official profile
            continue
        assert p.returncode == 0, p.stderr
    return g, out


def test_the_reference_side_is_reproduced_bit_for_bit_at_every_token(reference_traces):
    g, refs = reference_traces
    for prof, ref in refs.items():
        r = h.analyse(str(g), str(ref))
        rec = r["recomputed"][f"reference {prof}"]
        assert rec["matches_trace"], (prof, rec)
        n, ok = r["tokens"]["reference"]
        assert n >= 3 and ok == n, (prof, r["tokens"])
        assert r["ok"]
        # the attribution table covers every subset of the causes the two sides differ in
        causes = r["reference_to_llamacpp"]["causes"]
        assert len(r["reference_to_llamacpp"]["subsets"]) == 2 ** len(causes)
        assert ("order" in causes) == (prof == "official")
        assert {"norm", "lanes", "fma", "fold", "exp"} <= set(causes)
        json.dumps(r)                   # --json works
