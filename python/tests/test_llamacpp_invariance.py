"""``llamacpp_invariance.py`` without llama.cpp: the flash-attention kernels it emulates against
float64 attention and against each other's definitions (docs/invariance.md section 5.1): the
exponential ``ggml_v_expf`` close to the true one and exact where the softmax relies on it, the F16
accumulator's single roundings, the split-KV reduction equal to one chunk when the second chunk sees
no key, and the three kernels giving softmax-weighted values (with the head's sink) within F16
accuracy. Which kernel a real capture ran is checked against real captures (python/run_llamacpp.sh,
and the opt-in live tests)."""

import numpy as np

import llamacpp_invariance as inv

F32 = np.float32


def test_v_expf_is_the_exponential_and_exact_at_zero_and_minus_infinity():
    x = np.linspace(-80, 0, 4001, dtype=F32)
    got = inv.v_expf(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    rel = np.abs(got - want) / want
    assert rel.max() < 4e-7, rel.max()             # a few ulps: a polynomial, not correctly rounded
    assert inv.v_expf(np.array([0.0], F32))[0] == 1.0
    assert inv.v_expf(np.array([-np.inf], F32))[0] == 0.0


def test_the_f16_accumulator_rounds_once_in_the_vector_part_and_through_f32_in_the_tail():
    rng = np.random.default_rng(3)
    y = rng.standard_normal(192).astype(np.float16)
    x = rng.standard_normal(192).astype(np.float16)
    v = F32(0.3330078)
    got = inv._mad_f16(y, x, v)
    vh = float(np.float16(v))
    head = (x[:128].astype(np.float64) * vh + y[:128].astype(np.float64)).astype(np.float16)
    assert got[:128].tobytes() == head.tobytes()                  # (_Float16) v, one rounding
    tail = (x[128:].astype(np.float64) * float(v) + y[128:].astype(np.float64)).astype(F32).astype(np.float16)
    assert got[128:].tobytes() == tail.tobytes()                  # fma in F32, then to F16
    s = inv._scale_f16(y, F32(0.5))
    assert s.tobytes() == (y.astype(np.float64) * 0.5).astype(np.float16).tobytes()   # exact halving


def _attention(q, k, vis, sink, scale):
    s = (k[vis].astype(np.float64) @ q.astype(np.float64)) * float(scale)
    m = max(s.max(), float(sink))
    w = np.exp(s - m)
    return (w @ k[vis].astype(np.float64)) / (w.sum() + np.exp(float(sink) - m))


def test_the_three_kernels_are_attention_within_f16_accuracy_and_split_equals_one_chunk_when_it_must():
    rng = np.random.default_rng(11)
    d, cells = 192, 512
    k16 = (rng.standard_normal((cells, d)) * 0.5).astype(np.float16)
    q = (rng.standard_normal(d) * 0.5).astype(F32)
    scale = F32(F32(1) / np.sqrt(F32(d)))
    vis = np.zeros(cells, bool)
    vis[[3, 9, 40, 41, 70, 300, 301, 477]] = True
    want = _attention(q, k16, vis, F32(0.7), scale)
    outs = {name: f(q, k16, vis, F32(0.7), scale) for name, f in inv.FA_KERNELS.items()}
    for name, o in outs.items():
        err = np.abs(o - want).max() / np.abs(want).max()
        assert err < 3e-3, (name, err)                  # F16 Q and accumulator: ~2^-11 relative
    # The tiled kernel keeps Q and the accumulator in F32: much closer than the F16 kernels.
    assert np.abs(outs["tiled (>= 64 query rows)"] - want).max() < 1e-5 * np.abs(want).max()
    # Keys on both sides of the 256-cell chunk boundary: the two-thread split is another result;
    # keys in the first chunk only: the second chunk is empty and the bits are one chunk's.
    assert outs["split KV over 2 threads"].tobytes() != outs["one chunk (< 64 query rows, or 1 thread)"].tobytes()
    first = vis.copy()
    first[256:] = False
    a = inv.fa_chunks(q, k16, first, F32(0.7), scale, 2)
    b = inv.fa_chunks(q, k16, first, F32(0.7), scale, 1)
    assert a.tobytes() == b.tobytes()


def test_one_visible_key_gives_the_key_times_a_factor_of_the_score_and_the_sink():
    rng = np.random.default_rng(5)
    k16 = rng.standard_normal((256, 192)).astype(np.float16)
    q = rng.standard_normal(192).astype(F32)
    vis = np.zeros(256, bool)
    vis[0] = True
    scale = F32(F32(1) / np.sqrt(F32(192)))
    for name, f in inv.FA_KERNELS.items():
        if name.startswith("split"):
            continue
        o = f(q, k16, vis, F32(-1.0), scale)
        ratio = o.astype(np.float64) / k16[0].astype(np.float64)
        assert np.ptp(ratio[np.abs(k16[0]) > 0.1]) < 1e-6 * abs(ratio).max(), name
