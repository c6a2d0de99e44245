"""``moeconf.llamacpp`` against a real llama.cpp (llama-cpp-python 0.3.36): a capture of the
quantized fixture's native GGUF (MXFP4 experts) with its tokenization checked against the
reference and its logits against a run without the callback, diffed against the reference
(the first divergence is an L4 operator of step 0), ``moeconf explain`` naming llama.cpp's MoE
combine as read in its source (FP32 products, FP32 sequential sum in router slot order, the
shared expert added last: ``p32+output=f32``), layer 0's mHC pre weights recomputed bit for bit
on both sides for the CPU path this llama.cpp was built for (``llamacpp_hc_pre.py``), and the bad
inputs (another architecture, a tokenization that differs, a GGUF of another checkpoint) refused
with clear errors.

Only properties that hold on any CPU are asserted (how many values differ, and where the first
difference is, depend on the CPU path: docs/interop-llamacpp.md section 4.6).

Marked ``llamacpp`` and skipped unless llama_cpp imports AND ``MOECONF_LLAMACPP_TESTS=1``;
``python/run_llamacpp.sh`` installs the pinned stack and runs them.
"""

import glob
import json
import os
import subprocess

import numpy as np
import pytest

pytestmark = pytest.mark.llamacpp

if os.environ.get("MOECONF_LLAMACPP_TESTS") != "1":
    pytest.skip("llama.cpp tests are opt-in: MOECONF_LLAMACPP_TESTS=1 (python/run_llamacpp.sh)",
                allow_module_level=True)
llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")
if not hasattr(gguf, "GGUFWriter"):
    # Run from the repository root, `import gguf` finds the Rust crate's folder gguf/ as a
    # namespace package, not the PyPI package.
    pytest.skip("the gguf package is not installed (found a folder named gguf instead)", allow_module_level=True)

from moeconf import llamacpp as lc  # noqa: E402
from moeconf.trace import read_trace  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = open(os.path.join(HERE, "..", "..", "fixtures", "prompts", "llamacpp.txt"), encoding="utf-8").read()
STEPS = 3


@pytest.fixture(scope="module")
def setup(moeconf_bin, tmp_path_factory):
    d = tmp_path_factory.mktemp("llamacpp")
    env = dict(os.environ, MOECONF_CACHE_DIR=str(d / "cache"), NO_COLOR="1")

    def mc(*a, ok=(0,)):
        p = subprocess.run([moeconf_bin, *map(str, a)], capture_output=True, text=True, env=env)
        assert p.returncode in ok, p.stderr
        return p

    g = d / "native.gguf"
    mc("export", "gguf", "--model", "builtin:tiny-v4-fp8", "--type", "native", "-o", g)
    ref = d / "ref.bin"
    mc("run", "--model", "builtin:tiny-v4-fp8", "--prompt", PROMPT, "--max-new-tokens", STEPS, "--precision", "bf16",
       "--capture", "all", "-o", ref)
    model_dir = glob.glob(str(d / "cache" / "tiny-v4-fp8-[0-9]*"))[0]
    ids = json.loads(mc("inspect", "--format", "json", ref).stdout)["binding"]["prompt"]["ids"]
    return dict(dir=d, mc=mc, gguf=g, ref=ref, model_dir=model_dir, ids=ids, env=env)


@pytest.fixture(scope="module")
def captured(setup):
    s = setup
    out = s["dir"] / "lc.bin"
    r = lc.capture(s["gguf"], PROMPT, STEPS, out, model_dir=s["model_dir"], model_name="builtin:tiny-v4-fp8",
                   reference_ids=s["ids"])
    return r, out


def test_capture_checks_tokens_and_observation_and_localizes_the_first_divergence(setup, captured):
    s = setup
    r, out = captured
    assert r.tokenization_checked and r.prompt_ids == s["ids"] and len(r.generated) == STEPS
    t = read_trace(out)
    notes = dict(t.provenance.notes)
    assert notes["observation"] == "logits bit-identical to a run without the callback"
    assert notes["tokenization"] == "checked against the reference"
    assert t.provenance.recomputed() == lc.RECOMPUTED
    assert t.binding.weights_digest == read_trace(s["ref"]).binding.weights_digest
    paths = {rec.coord.path for rec in t.records}
    assert {"attn.compressed", "attn.indexer_topk", "moe.routed", "state.window_kv"} <= paths
    assert not paths & set(lc.NOT_CAPTURED)
    d = json.loads(s["mc"]("diff", "--format", "json", s["ref"], out, ok=(1,)).stdout)
    fd = d["first_divergence"]
    assert (fd["level"], fd["step"]) == ("L4", 0), fd
    e = json.loads(s["mc"]("explain", "--format", "json", out).stdout)["verdict"]
    assert e["rule"] == "p32+output=f32", e["headline"]


def test_layer0_mhc_pre_weights_are_recomputed_bit_for_bit_on_both_sides(setup, captured):
    """Whatever the CPU: llama.cpp's captured attn.hc_pre_weights of layer 0 are the emulation of
    the kernels its build selects (prefill: llamafile tinyBLAS; decode: ggml_vec_dot_f32), the
    reference's are its own, at every token both runs share; and diff's headline is that record
    exactly when the recomputation says the first token's values differ."""
    import llamacpp_hc_pre as h

    s = setup
    _, out = captured
    path = h.cpu_path(llama_cpp.llama_print_system_info().decode())
    if path is None:
        pytest.skip("llama.cpp's CPU backend takes a matmul path llamacpp_hc_pre.py does not emulate")
    res = h.analyse(str(s["gguf"]), str(s["ref"]), str(out), path)
    tk = res["tokens"]
    assert not tk["mismatches"], tk["mismatches"]
    assert tk["reference"][0] >= len(s["ids"]) and tk["llama.cpp prefill"][0] == len(s["ids"]), tk
    assert res["ok"]
    rec = res["recomputed"][f"llama.cpp prefill {path}"]
    assert rec["matches_trace"]
    differs = any(res["traces_ulps"])
    d = json.loads(s["mc"]("diff", "--format", "json", s["ref"], out, ok=(1,)).stdout)
    fd = d["first_divergence"]
    at_pre = (fd["step"], fd["position"], fd["layer"], fd["operator"]) == (0, 0, 0, "attn.hc_pre_weights")
    assert at_pre == differs, (fd, res["traces_ulps"])


def test_bad_inputs_are_refused_with_clear_errors(setup, tmp_path):
    s = setup
    with pytest.raises(lc.LlamaCppError, match="tokenizes the prompt"):
        lc.capture(s["gguf"], PROMPT, 1, tmp_path / "x.bin", model_dir=s["model_dir"],
                   reference_ids=s["ids"][:-1] + [s["ids"][-1] + 1])
    tiny = subprocess.run([os.environ.get("MOECONF_BIN", "moeconf"), "run", "--model", "builtin:tiny-v4", "--prompt",
                           "a", "--max-new-tokens", "1", "-o", str(tmp_path / "t.bin")], env=s["env"],
                          capture_output=True)
    other = glob.glob(str(s["dir"] / "cache" / "tiny-v4-1-*"))
    if tiny.returncode == 0 and other:
        with pytest.raises(lc.LlamaCppError, match="not the checkpoint the reference runs"):
            lc.capture(s["gguf"], PROMPT, 1, tmp_path / "y.bin", model_dir=other[0])
    # Another architecture: the GGUF rewritten with general.architecture = llama.
    r = gguf.GGUFReader(str(s["gguf"]))
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_token_list(["a"])
    for t in r.tensors[:3]:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(lc.LlamaCppError, match="'llama', not 'deepseek4'"):
        lc.capture(tmp_path / "llama.gguf", PROMPT, 1, tmp_path / "z.bin", model_dir=s["model_dir"])


# --------------------------------------------------------------------------- llama.cpp's settings

OTHER = "Three boats came up the river before noon."


def _records(path, steps=None, levels=None):
    return {(r.coord.step, r.coord.position, r.coord.layer, r.coord.path): r for r in read_trace(path).records
            if (steps is None or r.coord.step in steps) and (levels is None or r.level in levels)}


def test_a_batched_capture_holds_the_traced_sequences_rows_at_their_positions(setup, captured, tmp_path):
    """Another, shorter prompt in the batch: llama.cpp's split_equal cuts the traced prefill into a
    ubatch mixing both sequences' rows and one of the traced rows alone. The trace holds exactly
    the solo trace's records (coordinates), its embedding rows are the traced prompt's (an exact
    copy of the embedding table on any CPU; the other prompt's tokens differ), and the provenance
    names the batch and the split llama.cpp computed (checked graph by graph against its inputs)."""
    s = setup
    _, solo = captured
    out = tmp_path / "batched.bin"
    r = lc.capture(s["gguf"], PROMPT, STEPS, out, model_dir=s["model_dir"], model_name="builtin:tiny-v4-fp8",
                   reference_ids=s["ids"], batch_with=[OTHER])
    mine, ref = _records(out), _records(solo)
    assert set(mine) == set(ref)
    emb = [k for k in ref if k[3] in ("embed.output", "token.input")]
    assert len(emb) == len(s["ids"]) + 2 * STEPS - 1
    for k in emb:
        assert mine[k].digest == ref[k].digest, k
    t = read_trace(out)
    notes = dict(t.provenance.notes)
    other_ids = [int(x) for x in notes["batch.with_prompt_ids"].split(": ")[1].split(",")]
    assert json.loads(notes["batch.with"]) == [OTHER] and notes["n_seq_max"] == "2"
    assert any(a != b for a, b in zip(other_ids, s["ids"]))          # the rows are distinguishable
    sizes = lc.ContextSizes(int(notes["n_ctx"]), int(notes["n_ctx_seq"]), int(notes["n_batch"]),
                            int(notes["n_ubatch"]), 2)
    comp = lc.describe_composition([len(s["ids"]), len(other_ids)], STEPS, sizes)
    assert notes["batch.composition"] == comp
    n = len(other_ids)
    assert comp.startswith(f"step 0: llama_decode(seq 0: {len(s['ids'])}, seq 1: {n}) = (seq 0: {n}, seq 1: {n}) + "
                           f"(seq 0: {len(s['ids']) - n})"), comp
    assert r.graphs == 2 + (STEPS - 1) and len(r.batch_generated) == 1 and len(r.batch_generated[0]) == STEPS


def test_a_traced_sequence_batched_with_its_own_prompt_keeps_its_prefill_records(setup, captured, tmp_path):
    """The traced prompt twice in one batch (seq 0 and seq 1, one ubatch of both): llama.cpp's CPU
    kernels compute every row of a graph alone (one accumulator per output in the matmuls, per row
    in attention and the MoE), so both sequences generate the same tokens, and the traced rows of
    the prefill (L2-L4 of step 0) are the solo run's bit for bit; the rows were selected right.
    (The logits may differ: two output rows take another matmul kernel than one, section 5.1 of
    docs/invariance.md.)"""
    s = setup
    _, solo = captured
    out = tmp_path / "twice.bin"
    r = lc.capture(s["gguf"], PROMPT, STEPS, out, model_dir=s["model_dir"], model_name="builtin:tiny-v4-fp8",
                   reference_ids=s["ids"], batch_with=[PROMPT])
    assert r.batch_generated == [r.generated]
    assert dict(read_trace(out).provenance.notes)["batch.composition"].startswith(
        f"step 0: llama_decode(seq 0: {len(s['ids'])}, seq 1: {len(s['ids'])}) = (seq 0: {len(s['ids'])}, "
        f"seq 1: {len(s['ids'])}); ")
    mine, ref = _records(out, {0}, {2, 3, 4}), _records(solo, {0}, {2, 3, 4})
    assert set(mine) == set(ref) and len(ref) > 1000
    differ = [k for k in ref if mine[k].digest != ref[k].digest]
    assert not differ, differ[:5]


def test_ubatches_and_llama_decode_calls_follow_n_batch_and_n_ubatch(setup, tmp_path):
    """n_batch 64, n_ubatch 8: the 124-token prompt is two llama_decode calls (64 + 60 entries)
    and 16 graphs; the settings and the split are in the provenance, and the trace holds every
    position of the prompt once."""
    s = setup
    out = tmp_path / "split.bin"
    r = lc.capture(s["gguf"], PROMPT, 2, out, model_dir=s["model_dir"], model_name="builtin:tiny-v4-fp8",
                   reference_ids=s["ids"], n_batch=64, n_ubatch=8, n_threads_batch=2)
    n = len(s["ids"])
    assert r.graphs == -(-64 // 8) + -(-(n - 64) // 8) + 1
    notes = dict(read_trace(out).provenance.notes)
    assert (notes["n_batch"], notes["n_ubatch"], notes["n_threads"], notes["n_threads_batch"]) == ("64", "8", "1", "2")
    assert notes["batch.composition"].startswith(f"step 0: llama_decode(seq 0: 64) = 8 × (seq 0: 8) then "
                                                 f"llama_decode(seq 0: {n - 64}) = ")
    pos = sorted(k[1] for k in _records(out, {0}) if k[3] == "embed.output")
    assert pos == list(range(n))
