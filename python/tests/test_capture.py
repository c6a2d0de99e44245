"""transformers capture (moeconf.capture) on the built-in tiny DeepSeek-V4 fixture,
against the Rust reference runtime (docs/interop.md).

Marked ``transformers`` and skipped unless torch and transformers import AND
``MOECONF_TRANSFORMERS_TESTS=1`` (torch + transformers are a ~5.6 GB install, so the
default CI run skips these). One command installs and runs them:
``python/run_interop.sh``.
"""

import glob
import json
import os
import subprocess

import numpy as np
import pytest

pytestmark = pytest.mark.transformers

if os.environ.get("MOECONF_TRANSFORMERS_TESTS") != "1":
    pytest.skip("transformers tests are opt-in: MOECONF_TRANSFORMERS_TESTS=1 (python/run_interop.sh)",
                allow_module_level=True)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import moeconf  # noqa: E402
from moeconf import read_trace  # noqa: E402
from moeconf.capture import original_name, save_original  # noqa: E402

PROMPT = "why the sheep"
STEPS = 8
#: Records the reference runtime emits that the transformers capture does not observe.
REFERENCE_ONLY = {"embed.output", "attn.hc_pre_weights", "attn.hc_post_weights", "attn.hc_comb",
                  "ffn.hc_pre_weights", "ffn.hc_post_weights", "ffn.hc_comb", "attn.window_read",
                  "attn.compressed_read", "attn.indexer_read", "attn.indexer_scores"}


def _key(r):
    return (r.coord.step, r.level, r.coord.layer, r.coord.position, r.coord.phase, r.coord.path)


@pytest.fixture(scope="module")
def env(moeconf_bin, tmp_path_factory):
    """The materialized built-in fixture, Rust traces of it (f32, bf16, --capture all) and a
    helper to run the binary, all in a private cache directory."""
    root = tmp_path_factory.mktemp("interop")
    run_env = dict(os.environ, MOECONF_CACHE_DIR=str(root / "cache"), NO_COLOR="1")

    def run(*args, check=True):
        p = subprocess.run([moeconf_bin, *map(str, args)], capture_output=True, text=True, env=run_env)
        if check and p.returncode != 0:
            raise AssertionError(f"moeconf {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr}")
        return p

    traces = {}
    for prec in ("f32", "bf16"):
        traces[prec] = root / f"ref_{prec}.bin"
        run("run", "--model", "builtin:tiny-v4", "--prompt", PROMPT, "--max-new-tokens", STEPS,
            "--precision", prec, "--capture", "all", "-o", traces[prec])
    dirs = glob.glob(str(root / "cache" / "*" / "config.json"))
    assert len(dirs) == 1, dirs
    return {"root": root, "run": run, "model": os.path.dirname(dirs[0]), "ref": traces}


def _load(model_dir, dtype):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _capture(env, prec):
    from tokenizers import Tokenizer

    torch.set_num_threads(1)
    model = _load(env["model"], {"f32": torch.float32, "bf16": torch.bfloat16}[prec])
    tok = Tokenizer.from_file(os.path.join(env["model"], "tokenizer.json"))
    out = env["root"] / f"hf_{prec}.bin"
    res = moeconf.capture(model, tok, PROMPT, STEPS, out, model_name="builtin:tiny-v4")  # the callable module
    return out, res


@pytest.mark.parametrize("prec", ["f32", "bf16"])
def test_capture_has_every_record_of_the_reference_with_its_shape(env, prec):
    out, res = _capture(env, prec)
    hf, ref = read_trace(out), read_trace(env["ref"][prec])
    # binding: same model, tokenizer, prompt ids and decoding as `moeconf run` (diff refuses otherwise)
    for f in ("config_digest", "weights_digest", "tokenizer_digest", "prompt_ids", "prompt_text",
              "max_new_tokens", "decoding_strategy"):
        assert getattr(hf.binding, f) == getattr(ref.binding, f), f
    assert hf.binding.precision == f"hf-{prec}" and hf.binding.contract == "hf-native"
    # coverage and canonical layout: the same coordinates, each with the same dtype and shape
    # (router.topk shapes included; L2 state in the docs/operators.md layout)
    a = {_key(r): (r.dtype, r.shape) for r in ref.records}
    b = {_key(r): (r.dtype, r.shape) for r in hf.records}
    # the records one side alone holds, by component: the capture does not observe the mHC
    # weights, the cache reads, the indexer scores or the embedding; the reference runtime never
    # emits the capture-only routed sum
    assert {k[5] for k in set(a) - set(b)} == REFERENCE_ONLY, sorted({k[5] for k in set(a) - set(b)})
    assert {k[5] for k in set(b) - set(a)} == {"moe.routed"}
    a = {k: v for k, v in a.items() if k in b}
    assert hf.provenance.recomputed() == ["attn.q", "router.scores", "router.margin", "moe.term.*"]
    bad = [k for k in a if a[k] != b[k] and k[5] != "text.continuation"]  # text length follows the tokens
    assert not bad, [(k, a[k], b[k]) for k in bad[:5]]
    assert len(res.generated) == STEPS
    # the binary reads the Python capture and compares it (exit 1 = divergent, comparable; 2 = error)
    p = env["run"]("diff", "--format", "json", env["ref"][prec], out, check=False)
    assert p.returncode == 1, p.stdout + p.stderr
    j = json.loads(p.stdout)
    one = {(g["component"], g["present_in"]) for g in j["one_side_only"]}
    assert one == {(c, "reference") for c in REFERENCE_ONLY} | {("moe.routed", "candidate")}, one


def test_f32_tokens_match_and_state_is_close(env):
    out, _ = _capture(env, "f32")
    hf, ref = read_trace(out), read_trace(env["ref"]["f32"])
    ih = {_key(r): i for i, r in enumerate(hf.records)}
    toks = [(int(ref.array(i)[0]), int(hf.array(ih[_key(r)])[0]))
            for i, r in enumerate(ref.records) if r.coord.path == "token.output"]
    assert all(a == b for a, b in toks), toks
    # layer 0, prefill position 0: everything before the MoE combine agrees to f32 rounding
    # (reduction order), the combine itself by the reference's BF16 output rounding
    for i, r in enumerate(ref.records):
        c = r.coord
        if c.step == 0 and c.position == 0 and c.layer == 0 and r.level in (3, 4) and _key(r) in ih:
            x, y = ref.array(i).astype(np.float64), hf.array(ih[_key(r)]).astype(np.float64)
            tol = 1e-2 * max(1.0, float(np.abs(x).max())) if c.path in ("moe.combine", "layer.post_ffn_mhc") \
                else 1e-5 * max(1.0, float(np.abs(x).max()))
            assert np.abs(x - y).max() <= tol, (c.path, float(np.abs(x - y).max()))


def test_l2_state_invariants_in_the_capture(env):
    out, _ = _capture(env, "f32")
    hf = read_trace(out)
    cfg = transformers.AutoConfig.from_pretrained(env["model"])
    state = {}
    for i, r in enumerate(hf.records):
        if r.level == 2:
            state[(r.coord.step, r.coord.layer, r.coord.path)] = hf.array(i)
    for (step, layer, path), arr in state.items():
        if path != "state.cumulative_length":
            continue
        c = int(arr[0])
        kind = cfg.layer_types[layer]
        assert state[(step, layer, "state.window_kv")].shape[0] == min(c, cfg.sliding_window - 1)
        if kind == "sliding_attention":
            continue
        rate = cfg.compress_rates[kind]
        assert state[(step, layer, "state.compressor.buffer_kv")].shape[0] == c % rate
        assert int(state[(step, layer, "state.compressor.entry_count")][0]) == c // rate
        if kind == "compressed_sparse_attention":
            assert (state[(step, layer, "state.compressor.overlap_kv")].shape[0] == 0) == (c < rate)


def test_original_name_mapping():
    assert original_name("model.embed_tokens.weight") == "embed.weight"
    assert original_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert original_name("model.layers.3.attn.norm.weight") == "layers.3.attn.kv_norm.weight"
    assert original_name("model.layers.3.attn.compressor.norm.weight") == "layers.3.attn.compressor.norm.weight"
    assert original_name("model.layers.0.ffn.experts.7.w2.weight") == "layers.0.ffn.experts.7.w2.weight"
    assert original_name("head.weight") == "head.weight"
    assert original_name("layers.3.attn.kv_norm.weight") == "layers.3.attn.kv_norm.weight"


@pytest.mark.parametrize("prec", ["f32", "bf16"])
def test_transformers_saved_original_checkpoint_runs_identically_in_rust(env, prec):
    saved = env["root"] / "hf_saved_b"
    if not (saved / "model.safetensors").exists():
        save_original(_load(env["model"], torch.bfloat16), saved,
                      tokenizer_json=os.path.join(env["model"], "tokenizer.json"))
    out = env["root"] / f"ref_saved_{prec}.bin"
    env["run"]("run", "--model", saved, "--prompt", PROMPT, "--max-new-tokens", STEPS, "--precision", prec,
               "--capture", "all", "-o", out)
    # weights/config bytes differ (HF keeps norms in f32, writes its own config.json), values do not:
    # every record of the run is bit-identical to the run on the fixture
    p = env["run"]("diff", "--force", env["ref"][prec], out, check=False)
    assert p.returncode == 0, p.stdout
    # and transformers reloads its scheme-B output to the same logits
    ids = torch.tensor([[88, 73, 90, 263, 550]])
    with torch.no_grad():
        a = _load(env["model"], torch.float32)(input_ids=ids).logits
        b = _load(str(saved), torch.float32)(input_ids=ids).logits
    assert torch.equal(a, b)


def test_every_feature_is_captured_over_40_tokens(env):
    # 44 positions: window wrap (w = 8), HCA entries (rate 16), sparse indexer selections (T > 4)
    from tokenizers import Tokenizer

    steps = 40
    ref_path = env["root"] / "ref_f32_40.bin"
    env["run"]("run", "--model", "builtin:tiny-v4", "--prompt", PROMPT, "--max-new-tokens", steps,
               "--precision", "f32", "--capture", "all", "-o", ref_path)
    torch.set_num_threads(1)
    model = _load(env["model"], torch.float32)
    out = env["root"] / "hf_f32_40.bin"
    moeconf.capture(model, Tokenizer.from_file(os.path.join(env["model"], "tokenizer.json")), PROMPT, steps, out,
                    model_name="builtin:tiny-v4")
    hf, ref = read_trace(out), read_trace(ref_path)
    assert {_key(r) for r in hf.records if r.coord.path != "moe.routed"} == \
        {_key(r) for r in ref.records if r.coord.path not in REFERENCE_ONLY}
    cfg = model.config
    hca = [i for i, t in enumerate(cfg.layer_types) if t == "heavily_compressed_attention"]
    entries = [r for r in hf.records if r.coord.path == "attn.compressed" and r.coord.layer in hca]
    assert len(entries) == len(hca) * (44 // cfg.compress_rates["heavily_compressed_attention"])
    assert all(r.coord.position % 16 == 15 and r.shape == [1, cfg.head_dim] for r in entries)
    sparse = [r for r in hf.records if r.coord.path == "attn.indexer_topk" and r.shape == [cfg.index_topk]
              and (r.coord.position + 1) // 4 > cfg.index_topk]
    assert sparse, "no sparse indexer selection captured"
    ih = {_key(r): i for i, r in enumerate(hf.records)}
    ids = [(ref.array(i).tolist(), hf.array(ih[_key(r)]).tolist())
           for i, r in enumerate(ref.records) if r.coord.path == "attn.indexer_topk" and r.coord.step < 8]
    assert all(a == b for a, b in ids)  # identical selections while the tokens agree


# What each experts implementation computes (notes: transformers-experts.md section 3.2), as the
# capture's diagnostic sees it: which summation of the recomputed terms reproduces the observed
# routed sum (moe.routed), per implementation and dtype, on 3 new tokens (7 positions x 9 layers
# = 63 events). Measured 2026-12-01 with python/interop_experts.py.
ROUTED = {
    ("eager", "f32"): (0, 63, 63),        # FP32 in ascending expert id (index_add_ in fp32: the same)
    ("grouped_mm", "f32"): (63, 0, 0),    # FP32 in router slot order
    ("batched_mm", "f32"): (63, 0, 0),    # FP32 in router slot order (its own per-row products)
    ("eager", "bf16"): (0, 0, 63),        # BF16 accumulation per expert, ascending id (scheme B)
    ("grouped_mm", "bf16"): (63, 63, 0),  # FP32 sum, one rounding (exact for these terms in any order)
    ("batched_mm", "bf16"): (63, 63, 0),
}

# The member of the combine grammar each implementation computes, established from transformers'
# source and checked bitwise (/work/notes/transformers-experts.md section 3.2; contract/src/
# backends.rs KNOWN_BACKENDS cites the lines): `moeconf explain` must report it as the trace's rule
# or list it among the rule's equivalents on that trace.
TRUTH = {
    ("eager", "bf16"): "b+order=asc-id",            # BF16 index_add_ per expert, ascending id; R(a + s)
    ("grouped_mm", "bf16"): "c+routed=bf16",        # FP32 sum in slot order, R(R(a) + s)
    ("batched_mm", "bf16"): "c+routed=bf16",
    ("eager", "f32"): "p32+output=f32+order=asc-id",  # FP32 in ascending id, a + s unrounded
    ("grouped_mm", "f32"): "p32+output=f32",        # FP32 in slot order, a + s unrounded
    ("batched_mm", "f32"): "p32+output=f32",
}
# The rule `moeconf explain` reports (measured 2026-12-01; equal to TRUTH on every capture).
EXPLAIN_RULE = dict(TRUTH)


def _impl_capture(env, impl, prec, steps=3):
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(1)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[prec]
    out = env["root"] / f"hf_{impl}_{prec}_{steps}.bin"
    if out.exists():
        return out, None
    tok = Tokenizer.from_file(os.path.join(env["model"], "tokenizer.json"))
    model = DeepseekV4ForCausalLM.from_pretrained(env["model"], dtype=dtype, experts_implementation=impl).eval()
    assert model.config._experts_implementation == impl
    res = moeconf.capture(model, tok, PROMPT, steps, out, model_name="builtin:tiny-v4")
    return out, res


def _explain(env, path):
    p = env["run"]("explain", "--format", "json", path, check=False)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _members(verdict):
    return {verdict["rule"], *(e["contract"] for e in verdict["equivalents"])}


def _without(src, dst, path):
    """A copy of trace ``src`` without the records of component ``path`` (Python writer)."""
    from moeconf import Provenance, TraceWriter

    t = read_trace(src)
    prov = Provenance("pytest-strip", "1", 1).with_recomputed(["moe.term.*"])
    w = TraceWriter(dst, t.binding, prov)
    for i, r in enumerate(t.records):
        if r.coord.path != path:
            w.append(r.coord, r.level, t.payload(i), r.dtype, r.shape, keep_payload=True)
    w.finish()
    return dst


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("prec", ["f32", "bf16"])
def test_each_experts_implementation_is_captured_and_diffed(env, impl, prec):
    from moeconf.capture import ROUTED_SUMS

    outs = {}
    for name in ("eager", impl):
        outs[name], res = _impl_capture(env, name, prec)
        if res is None:
            continue
        got = tuple(res.moe_routed_reproduced[n] for n in ROUTED_SUMS)
        assert res.moe_events == 63
        # the recomputed terms are the implementation's own products: some summation of them
        # reproduces the observed routed sum at every event
        assert got == ROUTED[name, prec], (name, prec, got)
        assert res.moe_terms_unexplained == 0
    if impl == "eager":
        return
    p = env["run"]("diff", "--format", "json", outs["eager"], outs[impl], check=False)
    assert p.returncode == 1, p.stderr
    j = json.loads(p.stdout)
    fd, d0 = j["first_divergence"], j["divergences"][0]
    assert (fd["step"], fd["layer"], fd["position"]) == (0, 0, 0), fd
    if (impl, prec) == ("batched_mm", "f32"):
        # batched_mm's per-row fp32 products differ from eager's per-expert GEMM: the walk stops
        # at the first term, which both captures recomputed (and the report says so)
        assert fd["operator"] == "moe.term.0", fd
        assert d0["recomputed"] == "both", d0
    else:
        # the routed reduction is where the implementations part; its terms match only because
        # both captures recomputed them the same way, and the report says so
        assert fd["operator"] == "moe.routed", fd
        assert [(i["status"], i["recomputed"]) for i in d0["inputs"]] == [("match", "both")], d0
        assert "recomputed by the capture: moe.term.*" in j["summary"], j["summary"]
    assert j["one_side_only"] == [] and j["storage_precision"] == []


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("prec", ["f32", "bf16"])
def test_explain_names_what_each_experts_implementation_computes(env, impl, prec):
    """``moeconf explain`` on each implementation's capture: one rule reproduces all 63 combine
    events, and the source-established member is that rule or one of its equivalents."""
    out, _ = _impl_capture(env, impl, prec)
    v = _explain(env, out)["verdict"]
    assert (v["events"], v["explained_events"], v["unexplained_events"]) == (63, 63, 0), v["headline"]
    assert v["rule"] == EXPLAIN_RULE[impl, prec], v["headline"]
    assert TRUTH[impl, prec] in _members(v), (TRUTH[impl, prec], v["headline"])
    # the members the source rules out are not in the set: the other order family, and (bf16)
    # the other accumulator / merge
    wrong = {"b+order=asc-id": "c+routed=bf16", "c+routed=bf16": "b+order=asc-id",
             "p32+output=f32+order=asc-id": "p32+output=f32", "p32+output=f32": "p32+output=f32+order=asc-id"}
    assert wrong[TRUTH[impl, prec]] not in _members(v), v["headline"]
    if prec == "bf16":
        assert "c" not in _members(v)  # the paper's one-rounding C merge is not what any of them does


@pytest.mark.parametrize("prec", ["f32", "bf16"])
def test_diff_between_implementations_explains_both_sides_at_the_combine(env, prec, tmp_path):
    """Without the capture-only ``moe.routed`` the walk reaches ``moe.combine`` (its inputs, the
    recomputed terms and the shared expert, match): ``moeconf diff`` then explains each side with
    its own implementation's member."""
    eager, _ = _impl_capture(env, "eager", prec)
    grouped, _ = _impl_capture(env, "grouped_mm", prec)
    a = _without(eager, tmp_path / "eager.bin", "moe.routed")
    b = _without(grouped, tmp_path / "grouped.bin", "moe.routed")
    p = env["run"]("diff", "--format", "json", a, b, check=False)
    assert p.returncode == 1, p.stderr
    j = json.loads(p.stdout)
    fd = j["first_divergence"]
    assert (fd["operator"], fd["step"], fd["layer"], fd["position"]) == ("moe.combine", 0, 0, 0), fd
    c = j["levels"]["L4"]["contract"]
    assert c["at"]["path"] == "moe.combine" and (c["at"]["step"], c["at"]["layer"]) == (0, 0), c["at"]
    ref, cand = c["reference_explanation"], c["candidate_explanation"]
    assert ref["status"] == cand["status"] == "explained", c
    assert fd["contract"] == c["candidate"] == cand["simplest"] == TRUTH["grouped_mm", prec], fd
    assert f"candidate contract: {cand['simplest']}" in j["summary"], j["summary"]
    ref_set = {ref["simplest"], *(e["contract"] for e in ref["equivalents"])}
    cand_set = {cand["simplest"], *(e["contract"] for e in cand["equivalents"])}
    assert TRUTH["eager", prec] in ref_set, ref["simplest"]
    assert TRUTH["grouped_mm", prec] in cand_set, cand["simplest"]


def test_reference_vs_transformers_bf16_walks_past_storage_precision(env):
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(1)
    ref = env["root"] / "ref_bf16_3.bin"
    env["run"]("run", "--model", "builtin:tiny-v4", "--prompt", PROMPT, "--max-new-tokens", 3,
               "--precision", "bf16", "--capture", "all", "-o", ref)
    model = DeepseekV4ForCausalLM.from_pretrained(env["model"], dtype=torch.bfloat16,
                                                  experts_implementation="eager").eval()
    out = env["root"] / "hf_eager_bf16_3w.bin"
    moeconf.capture(model, Tokenizer.from_file(os.path.join(env["model"], "tokenizer.json")), PROMPT, 3, out,
                    model_name="builtin:tiny-v4")
    p = env["run"]("diff", "--format", "json", ref, out, check=False)
    assert p.returncode == 1, p.stderr
    j = json.loads(p.stdout)
    # moe.term.0 of the first event differs only by storage precision (the reference keeps FP32
    # terms, transformers bf16); the walk passes it and stops at the first term that storage
    # precision does not explain: 1 value of moe.term.1 (the capture's recomputed product)
    (g,) = j["storage_precision"]
    assert (g["component"], g["coarser"], g["coarse_storage"]) == ("moe.term.*", "candidate", "bf16 values in f32")
    assert g["records"] == 1 and g["first"]["path"] == "moe.term.0"
    fd, d0 = j["first_divergence"], j["divergences"][0]
    assert (fd["operator"], fd["step"], fd["layer"], fd["position"]) == ("moe.term.1", 0, 0, 0), fd
    assert d0["recomputed"] == "candidate"
    assert d0["beyond_storage_precision"] == {"coarser": "candidate", "differing_values": 1, "values": 256}


# `moeconf replay --precision P --contract X` on each 3-token capture (9 layers x 3 steps = 27 FFN
# halves), measured 2026-12-01: how many FFN halves are origins whose output the reference still
# reproduces bitwise (`absorbed`: only intermediate records differ; in bf16 the FP32-recorded terms
# against HF's bf16 terms, and on score-routed layers the selection order of topk(sorted=False))
# under the implementation's own member and under the paper's C.
REPLAY_FFN_ABSORBED = {
    ("eager", "bf16"): 25, ("grouped_mm", "bf16"): 25, ("batched_mm", "bf16"): 27,
    ("eager", "f32"): 0, ("grouped_mm", "f32"): 0, ("batched_mm", "f32"): 0,
}


def _replay(env, path, prec, contract):
    p = env["run"]("replay", path, "--precision", prec, "--contract", contract, "--model", env["model"],
                   "--allow-incomplete", "--format", "json", check=False)
    assert p.returncode == 1, p.stderr   # origins exist in every case (exit 1, not 0 or 2)
    return json.loads(p.stdout)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("prec", ["f32", "bf16"])
def test_replay_reports_per_layer_origins_for_each_experts_implementation(env, impl, prec):
    out, _ = _impl_capture(env, impl, prec)
    own = _replay(env, out, prec, TRUTH[impl, prec])
    assert own["reference"]["contract"] == TRUTH[impl, prec]
    s = own["summary"]
    # 3 steps x (embed + 9 x 2 halves + head); the capture has no embed.output (layer-0 attention
    # and the embedding are not replayable), everything else is replayed
    assert (s["units"], s["not_replayable"]) == (60, 6), s
    assert {m["record"] for m in own["missing"]} == {"embed.output"}
    ffn = [u for u in own["origins"] if u["part"] == "ffn"]
    assert sum(u["absorbed"] for u in ffn) == REPLAY_FFN_ABSORBED[impl, prec], [
        (u["step"], u["layer"], u["first_difference"], u["absorbed"]) for u in ffn]
    if prec == "f32":
        # every half parts at its first operator: the mHC collapse (torch's BLAS against the
        # reference's fixed 8-lane dot product, a few ulp), whatever the contract
        assert s["origins"] == 54 and s["reproduced"] == 0, s
        firsts = {u["first_difference"]["record"] for u in own["origins"] if u["part"] != "head"}
        assert firsts <= {"attn.hc_pre", "ffn.hc_pre", "ffn.norm", "router.scores"}, firsts
    else:
        # every FFN half is an origin (bf16 terms against the reference's FP32 terms; the
        # selection order on score layers), but under the implementation's own member its output
        # is bitwise the reference's at most of them, and under the paper's C at none
        assert len(ffn) == 27
        assert {u["first_difference"]["record"] for u in ffn} <= {"moe.term.0", "moe.term.1", "router.topk"}
        under_c = _replay(env, out, prec, "c")
        assert sum(u["absorbed"] for u in under_c["origins"] if u["part"] == "ffn") == 0
        other = {"b+order=asc-id": "c+routed=bf16", "c+routed=bf16": "b+order=asc-id"}[TRUTH[impl, prec]]
        under_other = _replay(env, out, prec, other)
        assert sum(u["absorbed"] for u in under_other["origins"] if u["part"] == "ffn") == 0
