"""The generic capture's engine (moeconf.torch) without torch: a toy MoE model in numpy whose
modules have torch's hook interface (``named_modules``, ``register_forward_hook``,
``register_forward_pre_hook`` with ``with_kwargs``, removable handles), a mapping onto the
catalogue, a greedy loop, and the trace checked by the reader and by the Rust binary (``moeconf
inspect`` / ``moeconf diff``; skipped without it). The hostile cases check that every mistake
is a CaptureError naming its cause and leaves no file (and no temporary file) behind."""

import glob
import json
import os
import sys

import numpy as np
import pytest

from conftest import PYTHON_DIR

sys.path.insert(0, os.path.join(PYTHON_DIR, "examples"))

from moeconf import read_trace  # noqa: E402
from moeconf.torch import CaptureError, Mapping, Rule, capture  # noqa: E402
from numpy_toy import CONFIG, D, K, LAYERS, MAPPING, PROMPT, STEPS, Toy, run  # noqa: E402


def files(d):
    return sorted(os.listdir(d))


def test_trace_records_notes_and_order(tmp_path):
    out = tmp_path / "toy.bin"
    cap = run(Toy(), out, capture="all", decode=lambda ids: " ".join(map(str, ids)))
    t = read_trace(str(out))
    assert t.root == cap.summary.root
    paths = [r.coord.path for r in t.records]
    n_pos = len(PROMPT) + STEPS - 1
    per_layer = 1 + 3 + K + 3  # ffn.norm; scores, topk, gates; k terms; routed, combine, post_ffn_mhc
    per_step = 1 + 4 + 2  # token.input; lm.*; token.output, text.continuation
    assert len(t.records) == STEPS * per_step + n_pos * (1 + LAYERS * per_layer)
    step0 = [r for r in t.records if r.coord.step == 0]
    assert step0[0].coord.path == "token.input" and step0[0].coord.position == 0
    assert [r.coord.path for r in step0[-6:]][:4] == ["lm.logits", "lm.topk_ids", "lm.topk_logits", "lm.margin"]
    # per layer and position, catalogue order
    lay = [r.coord.path for r in step0 if r.coord.layer == 1 and r.coord.position == 2]
    assert lay == ["ffn.norm", "router.scores", "router.topk", "router.gates", "moe.term.0", "moe.term.1",
                   "moe.routed", "moe.combine", "layer.post_ffn_mhc"]
    assert "embed.output" in paths and "text.continuation" in paths
    i = paths.index("router.topk")
    assert t.records[i].dtype == "i32" if isinstance(t.records[i].dtype, str) else True
    assert t.array(i).dtype == np.int32 and t.array(i).shape == (K,)
    assert t.array(paths.index("layer.post_ffn_mhc")).shape == (1, D)  # N = 1 residual stream
    notes = dict(t.provenance.notes)
    assert t.provenance.recomputed() == ["router.scores", "moe.term.*"]
    nc = notes["moeconf.not_captured"]
    assert nc.startswith("attn.*: the toy model has no attention; ")
    assert "state.window_kv: no rule" in nc and "router.margin: no rule" in nc and "moe.routed" not in nc
    assert "ffn.norm" not in nc and "attn.norm_fp8" not in nc
    assert dict(t.binding.extra)["model_identity"].startswith("in-memory")
    assert len(t.binding.tensors) == 2 + 2 * LAYERS
    assert t.payload_count() == len(t.records)


def test_deterministic_and_capture_sets(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    run(Toy(), a)
    run(Toy(), b)
    assert a.read_bytes() == b.read_bytes()
    t = read_trace(str(a))
    assert (t.binding.capture_levels, t.binding.capture_payload_levels) == (0b11111, 0b01010)
    assert all((r.payload is not None) == (r.level in (1, 3)) for r in t.records)
    for name, (lv, pl) in {"fingerprints": (31, 0), "replay": (31, 15), "all": (31, 31)}.items():
        p = tmp_path / f"{name}.bin"
        run(Toy(), p, capture=name)
        t2 = read_trace(str(p))
        assert (t2.binding.capture_levels, t2.binding.capture_payload_levels) == (lv, pl)
        # the same records (the masks are bound, so the roots differ)
        assert [r.digest for r in t2.records] == [r.digest for r in t.records]
    m = Toy()
    run(m, tmp_path / "l01.bin", levels=["L0", "L1"])
    t3 = read_trace(str(tmp_path / "l01.bin"))
    assert {r.level for r in t3.records} == {0, 1}
    # of L0/L1 only the text is missing, for want of a detokenizer
    assert dict(t3.provenance.notes)["moeconf.not_captured"] == "text.continuation: no detokenizer given (decode=)"
    assert m.hooks() == 0


def test_rust_inspect_and_diff(tmp_path, run_moeconf):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    run(Toy(), a, capture="all")
    run(Toy(), b, capture="all")
    p = run_moeconf("inspect", a, "--format", "json")
    j = json.loads(p.stdout)
    assert j["provenance"]["recomputed"] == ["router.scores", "moe.term.*"]
    assert run_moeconf("diff", a, b, check=False).returncode == 0
    assert run_moeconf("diff", a, a, check=False).returncode == 0


def test_moeconf_diff_localizes_a_changed_expert(tmp_path, run_moeconf):
    a, c = tmp_path / "a.bin", tmp_path / "c.bin"
    run(Toy(), a, capture="all", weights=False)
    m = Toy()
    m.layers[1].experts.w = m.layers[1].experts.w.copy()
    m.layers[1].experts.w[:, 0, 0] += 1e-3
    run(m, c, capture="all", weights=False)
    d = run_moeconf("diff", a, c, check=False)
    assert d.returncode == 1, d.stdout + d.stderr
    last = d.stdout.strip().splitlines()[-1]
    assert "layer 1" in last and "moe." in last, d.stdout


def test_binding_identity(tmp_path):
    run(Toy(), tmp_path / "a.bin")
    run(Toy(seed=1), tmp_path / "b.bin")
    a, b = read_trace(str(tmp_path / "a.bin")), read_trace(str(tmp_path / "b.bin"))
    assert a.binding.config_digest == b.binding.config_digest
    assert a.binding.weights_digest != b.binding.weights_digest
    assert [t.dtype for t in a.binding.tensors] == ["f32"] * len(a.binding.tensors)


# --- hostile and mistaken use ------------------------------------------------------------------


def _no_output(tmp_path, out):
    assert not out.exists()
    assert not glob.glob(str(tmp_path / ".*moeconf-tmp*")), files(tmp_path)


@pytest.mark.parametrize("rules,match", [
    ([Rule("layers.{layer}.gate", "router.topk")], r"matches no module of Toy.*close names: layers.0.router"),
    ([Rule("layers.{layer}.router", "router.topk", output=1),
      Rule("layers.{layer}.router", "router.topk", output=1)], "both record router.topk of layer 0"),
    ([Rule("layers.{layer}.experts", "moe.term.*", select=lambda *a: a[3], recomputed=True),
      Rule("layers.{layer}.experts", "moe.term.1")], "both record moe.term.1"),
    ([Rule("**.{layer}", "moe.routed")], "is not a decimal integer"),
])
def test_mapping_refusals(tmp_path, rules, match):
    out = tmp_path / "x.bin"
    m = Toy()
    with pytest.raises(CaptureError, match=match):
        run(m, out, mapping=Mapping(rules))
    _no_output(tmp_path, out)
    assert m.hooks() == 0


def test_rule_refusals():
    with pytest.raises(CaptureError, match="not a record path"):
        Rule("layers.{layer}.router", "router.top")
    with pytest.raises(CaptureError, match="say recomputed=True"):
        Rule("layers.{layer}.router", "router.scores", transform=lambda x: x)
    with pytest.raises(CaptureError, match="names no layer"):
        Rule("layers.0.router", "router.topk")
    with pytest.raises(CaptureError, match="model-global"):
        Rule("layers.{layer}", "embed.output")
    with pytest.raises(CaptureError, match="Step.logits"):
        Rule("head", "lm.logits")
    with pytest.raises(CaptureError, match="Step.state"):
        Rule("layers.{layer}", "state.window_kv")
    with pytest.raises(CaptureError, match="no fixed per-position shape"):
        Rule("layers.{layer}", "attn.window_read")
    with pytest.raises(CaptureError, match="one of output=, input=, select="):
        Rule("layers.{layer}", "moe.routed", output=0, input=0)
    # a reason for a component the mapping records (refused before any file is opened)
    with pytest.raises(CaptureError, match="names ffn.norm, which the mapping records"):
        capture(Toy(), Mapping([Rule("layers.{layer}.norm", "ffn.norm")], not_captured={"ffn.*": "x"}),
                "/nonexistent/x.bin", prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG)


def test_layer_outside_the_model(tmp_path):
    out = tmp_path / "x.bin"
    with pytest.raises(CaptureError, match="layer 1, the model has 1 layers"):
        run(Toy(), out, config=dict(CONFIG, num_hidden_layers=1))
    _no_output(tmp_path, out)


def test_wrong_shape_aborts(tmp_path):
    out = tmp_path / "x.bin"
    m = Toy()
    bad = Mapping([Rule("layers.{layer}.experts", "router.gates")])  # [n, D] where [n, k] is due
    with pytest.raises(CaptureError, match=r"step 0: rule .*layers.0.experts.*shape \[5, 8\], expected 5 position"):
        run(m, out, mapping=bad)
    _no_output(tmp_path, out)
    assert m.hooks() == 0


def test_nan_aborts_unless_allowed(tmp_path):
    out = tmp_path / "x.bin"
    m = Toy()
    m.layers[0].experts.w = m.layers[0].experts.w.copy()
    m.layers[0].experts.w[m.layers[0].experts.w != 0] = np.nan
    with pytest.raises(CaptureError, match=r"position 0 moe.term.0 .*NaN at index 0 \(pass allow_nan=True"):
        run(m, out)
    _no_output(tmp_path, out)


def test_ids_must_be_ids(tmp_path):
    out = tmp_path / "x.bin"
    bad = Mapping([Rule("layers.{layer}.router", "router.topk", output=0)])  # the gates: floats
    with pytest.raises(CaptureError, match="float32 values for an ids record: give integers"):
        run(Toy(), out, mapping=bad)
    _no_output(tmp_path, out)


def test_loop_mistakes(tmp_path):
    out = tmp_path / "x.bin"
    # fewer steps than max_new_tokens
    with pytest.raises(CaptureError, match="3 step\\(s\\) captured, max_new_tokens is 4"):
        run(Toy(), out, steps=3)
    _no_output(tmp_path, out)
    # a forward outside a step
    m = Toy()
    with pytest.raises(CaptureError, match="a forward ran outside a step"):
        with capture(m, MAPPING, out, prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG):
            m(PROMPT)
    _no_output(tmp_path, out)
    assert m.hooks() == 0
    # feeding another token than the greedy one
    m = Toy()
    with pytest.raises(CaptureError, match="step 1 feeds \\[99\\].*greedy token"):
        with capture(m, MAPPING, out, prompt_ids=PROMPT, max_new_tokens=2, config=CONFIG) as cap:
            with cap.step(PROMPT) as s:
                s.logits(m(PROMPT)[-1])
            cap.step([99])
    _no_output(tmp_path, out)
    # no logits
    with pytest.raises(CaptureError, match="no logits"):
        with capture(Toy(), MAPPING, out, prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG) as cap:
            with cap.step(PROMPT):
                m(PROMPT)
    _no_output(tmp_path, out)
    # a module the forward did not run
    m = Toy()
    with pytest.raises(CaptureError, match="module 'layers.1.norm' \\(layer 1\\) did not run"):
        with capture(m, MAPPING, out, prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG) as cap:
            with cap.step(PROMPT) as s:
                x = m.embed(PROMPT)
                x = m.layers[0](x)
                s.logits((x @ m.head)[-1])
    _no_output(tmp_path, out)
    # an exception in the user's loop
    with pytest.raises(KeyboardInterrupt):
        with capture(Toy(), MAPPING, out, prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG) as cap:
            raise KeyboardInterrupt
    _no_output(tmp_path, out)


def with_extra_norm_calls(m, extra):
    """``m`` with each layer calling its norm ``extra`` more times before the real forward (so the
    real call is call ``extra`` of the step)."""
    for layer in m.layers:
        orig = layer.forward

        def forward(x, _l=layer, _o=orig):
            for _ in range(extra):
                _l.norm(x)
            return _o(x)

        layer.forward = forward
    return m


def test_call_index_and_inputs(tmp_path):
    """A module run twice per layer (call=) and a rule on an input argument."""
    out = tmp_path / "x.bin"
    m = with_extra_norm_calls(Toy(), 1)
    mp = Mapping([Rule("layers.{layer}.norm", "ffn.norm", call=1),
                  Rule("layers.{layer}.experts", "ffn.norm", input=0, optional=True)])
    with pytest.raises(CaptureError, match="both record ffn.norm"):
        run(m, out, mapping=mp)
    mp = Mapping([Rule("layers.{layer}.norm", "ffn.norm", call=1),
                  Rule("layers.{layer}.experts", "router.gates", input=1),
                  Rule("layers.{layer}.experts", "router.topk", input=2)])
    run(m, out, mapping=mp)
    t = read_trace(str(out))
    ref = tmp_path / "ref.bin"
    run(Toy(), ref, mapping=Mapping([Rule("layers.{layer}.norm", "ffn.norm"),
                                     Rule("layers.{layer}.router", "router.gates", output=0),
                                     Rule("layers.{layer}.router", "router.topk", output=1)]))
    assert t.root == read_trace(str(ref)).root
    with pytest.raises(CaptureError, match="ran twice in one step"):
        run(m, tmp_path / "y.bin", mapping=Mapping([Rule("layers.{layer}.norm", "ffn.norm")]))
    _no_output(tmp_path, tmp_path / "y.bin")


def test_state_and_manual_records(tmp_path):
    out = tmp_path / "x.bin"
    mp = Mapping([Rule("layers.{layer}.norm", "ffn.norm")], state=["state.cumulative_length"],
                 manual={"moe.shared": True})
    m = Toy()
    with capture(m, mp, out, prompt_ids=PROMPT, max_new_tokens=2, config=CONFIG) as cap:
        seq, feed = list(PROMPT), list(PROMPT)
        for step in range(2):
            with cap.step(feed) as s:
                logits = m(feed)
                for layer in range(LAYERS):
                    s.state(layer, "state.cumulative_length", np.array([len(seq)], np.int64))
                    for k, pos in enumerate(s.positions):
                        s.record("moe.shared", np.zeros(D, np.float32), layer=layer, position=pos)
                nxt = s.logits(logits[-1])
            seq.append(nxt)
            feed = [nxt]
    t = read_trace(str(out))
    st = [r for r in t.records if r.coord.path == "state.cumulative_length"]
    assert [(r.coord.step, r.coord.layer, r.coord.position) for r in st] == [(0, 0, 4), (0, 1, 4), (1, 0, 5), (1, 1, 5)]
    assert t.provenance.recomputed() == ["moe.shared"]
    assert "state.cumulative_length" not in dict(t.provenance.notes)["moeconf.not_captured"]
    m = Toy()
    with pytest.raises(CaptureError, match="state state.cumulative_length of layer 1 was not given"):
        with capture(m, mp, tmp_path / "y.bin", prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG) as cap:
            with cap.step(PROMPT) as s:
                s.state(0, "state.cumulative_length", np.array([5], np.int64))
                s.logits(m(PROMPT)[-1])
    _no_output(tmp_path, tmp_path / "y.bin")


def test_a_declared_manual_record_never_recorded_is_refused(tmp_path):
    # Declared paths count as covered (not in moeconf.not_captured): a loop that never records one
    # would write a trace claiming it. Not refused when its level is not captured.
    mp = Mapping([Rule("layers.{layer}.norm", "ffn.norm")], manual={"moe.shared": False})
    out = tmp_path / "x.bin"
    m = Toy()
    with pytest.raises(CaptureError, match="moe.shared: declared in Mapping.manual=.... but no step recorded it"):
        with capture(m, mp, out, prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG) as cap:
            with cap.step(PROMPT) as s:
                s.logits(m(PROMPT)[-1])
    _no_output(tmp_path, out)
    with capture(Toy(), mp, out, prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG, levels=["L0", "L1", "L3"]) as cap:
        with cap.step(PROMPT) as s:
            s.logits(m(PROMPT)[-1])
    assert out.exists()


def test_generate_helper(tmp_path):
    m = Toy()
    out = tmp_path / "g.bin"
    with capture(m, MAPPING, out, prompt_ids=PROMPT, max_new_tokens=STEPS, config=CONFIG,
                 precision="numpy-f32") as cap:
        gen = cap.generate(lambda ids: m(ids)[-1])
    assert len(gen) == STEPS
    run(Toy(), tmp_path / "r.bin")
    assert read_trace(str(out)).root == read_trace(str(tmp_path / "r.bin")).root


def test_the_example_script_runs_end_to_end(tmp_path, moeconf_bin):
    """python/examples/generic_capture.py (what run_wheel.sh runs in the wheel's venv) passes its
    own checks: the trace against itself equivalent, the float16 routed sum found at layer 1."""
    import generic_capture

    assert generic_capture.main(["--out", str(tmp_path), "--moeconf", moeconf_bin]) == 0
    assert sorted(os.listdir(tmp_path)) == ["cand.bin", "ref.bin"]


# --- review findings: ids, layouts, calls, bindings, coverage ---------------------------------


def test_float_ids_are_refused_even_whole(tmp_path):
    """Whole-valued floats are not ids (a bf16 tensor rounds ids above 256): refused for an ids
    record and for the prompt and step ids; booleans too. Integers of any width are taken."""
    out = tmp_path / "x.bin"
    bad = Mapping([Rule("layers.{layer}.router", "router.topk", output=1, transform=lambda i: i.astype(np.float64),
                        recomputed=False)])
    with pytest.raises(CaptureError, match="float64 values for an ids record: give integers"):
        run(Toy(), out, mapping=bad)
    _no_output(tmp_path, out)
    for ids in ([3.0, 1.0, 4.0, 1.0, 5.0], np.array(PROMPT, np.float32), np.array([True, False])):
        with pytest.raises(CaptureError, match="prompt_ids: .*ids must be integers"):
            capture(Toy(), MAPPING, out, prompt_ids=ids, max_new_tokens=1, config=CONFIG)
    _no_output(tmp_path, out)
    m = Toy()
    with pytest.raises(CaptureError, match="step 1: tokens: float64 values: ids must be integers"):
        with capture(m, MAPPING, out, prompt_ids=PROMPT, max_new_tokens=2, config=CONFIG) as cap:
            with cap.step(PROMPT) as s:
                nxt = s.logits(m(PROMPT)[-1])
            cap.step(np.array([nxt], np.float64))
    _no_output(tmp_path, out)
    good = Mapping([Rule("layers.{layer}.router", "router.topk", output=1, transform=lambda i: i.astype(np.uint8),
                         recomputed=False)])
    run(Toy(), tmp_path / "u8.bin", mapping=good)
    run(Toy(), tmp_path / "i64.bin", mapping=Mapping([Rule("layers.{layer}.router", "router.topk", output=1)]))
    u8, i64 = read_trace(str(tmp_path / "u8.bin")), read_trace(str(tmp_path / "i64.bin"))
    assert [r.digest for r in u8.records] == [r.digest for r in i64.records]


def test_ids_of_more_than_one_sequence_are_refused(tmp_path):
    out = tmp_path / "x.bin"
    with pytest.raises(CaptureError, match=r"prompt_ids: ids of shape \[2, 2\]: give one sequence"):
        capture(Toy(), MAPPING, out, prompt_ids=[[3, 1], [4, 1]], max_new_tokens=1, config=CONFIG)
    _no_output(tmp_path, out)
    # a batch of one is one sequence
    with capture(Toy(), MAPPING, out, prompt_ids=np.array([PROMPT]), max_new_tokens=1, config=CONFIG) as cap:
        assert cap.prompt_ids == PROMPT
        cap.generate(lambda ids: cap.model(ids)[-1])


def _scores_transposed(tmp_path, prompt, steps):
    """router.scores given as [E, n] (experts first) by the transform, the prompt as long as E."""
    m = Toy()
    mp = Mapping([Rule("layers.{layer}.router", "router.scores", output=2, transform=lambda z: z.T,
                       recomputed=False)])
    out = tmp_path / "t.bin"
    with capture(m, mp, out, prompt_ids=prompt, max_new_tokens=steps, config=CONFIG) as cap:
        cap.generate(lambda ids: m(ids)[-1])
    return out


def test_positions_must_lead(tmp_path):
    """A value whose positions are not its leading axis (after a batch axis of 1) is refused with
    the advice to transform it; when the sizes coincide (n == E at the prefill) the shape cannot
    tell, but the next step (one position, [E, 1]) does."""
    with pytest.raises(CaptureError, match=r"shape \[4, 5\], expected 5 position.*another layout.*transform="):
        _scores_transposed(tmp_path, PROMPT, 2)
    with pytest.raises(CaptureError, match=r"step 1: .*shape \[4, 1\], expected 1 position.*another layout"):
        _scores_transposed(tmp_path, PROMPT[:4], 2)
    _no_output(tmp_path, tmp_path / "t.bin")
    # [1, n, *item] (a batch of one) and, for one position, [*item] are taken
    for f in (lambda z: z[None], lambda z: z[None] if z.shape[0] > 1 else z[0]):
        m = Toy()
        mp = Mapping([Rule("layers.{layer}.router", "router.scores", output=2, transform=f, recomputed=False)])
        with capture(m, mp, tmp_path / "b.bin", prompt_ids=PROMPT, max_new_tokens=2, config=CONFIG) as cap:
            cap.generate(lambda ids: m(ids)[-1])
    # an extra size-1 axis inside the value is refused ([n, 1, E] is not [n, E])
    m = Toy()
    mp = Mapping([Rule("layers.{layer}.router", "router.scores", output=2, transform=lambda z: z[:, None],
                       recomputed=False)])
    with pytest.raises(CaptureError, match=r"shape \[5, 1, 4\]"):
        with capture(m, mp, tmp_path / "c.bin", prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG) as cap:
            cap.generate(lambda ids: m(ids)[-1])


def test_extra_calls_past_the_last_call_index_are_refused(tmp_path):
    out = tmp_path / "x.bin"
    m = with_extra_norm_calls(Toy(), 2)
    with pytest.raises(CaptureError, match=r"layers.0.norm.*ran 2 times in one step; the rules on module "
                                           r"'layers.0.norm' read calls up to 0"):
        run(m, out, mapping=Mapping([Rule("layers.{layer}.norm", "ffn.norm", call=0)]))
    _no_output(tmp_path, out)
    # the highest call index over the module's rules counts: calls 0..2 are read
    run(m, out, mapping=Mapping([Rule("layers.{layer}.norm", "ffn.norm", call=0),
                                 Rule("layers.{layer}.norm", "attn.norm", call=2)]))
    with pytest.raises(CaptureError, match=r"ran 3 time\(s\), the rules on module 'layers.0.norm' read calls up to 3"):
        run(m, tmp_path / "y.bin", mapping=Mapping([Rule("layers.{layer}.norm", "ffn.norm", call=3)]))


class _Engine(Toy):
    """A duck-typed engine: modules with hooks, no state_dict()."""

    state_dict = None


def test_weights_must_be_bound_or_declared_unbound(tmp_path):
    out = tmp_path / "x.bin"
    with pytest.raises(CaptureError, match=r"_Engine has no state_dict\(\).*Pass weights=False.*or model_dir="):
        run(_Engine(), out)
    e = Toy()
    e.state_dict = lambda: {}
    with pytest.raises(CaptureError, match=r"an empty state_dict\(\)"):
        run(e, out)
    _no_output(tmp_path, out)
    run(_Engine(), out, weights=False)
    b = read_trace(str(out)).binding
    assert b.tensors == [] and "weights not bound (weights=False)" in dict(b.extra)["model_identity"]


def test_config_digest_ignores_load_paths_and_versions(tmp_path):
    a, b, c = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"
    run(Toy(), a, config=dict(CONFIG, _name_or_path="/models/x", transformers_version="5.23.0", _commit_hash="ab"))
    run(Toy(), b, config=dict(CONFIG, _name_or_path="/elsewhere/x", transformers_version="5.24.0"))
    run(Toy(), c, config=dict(CONFIG, model_type="toy-moe-2"))
    ta, tb, tc = (read_trace(str(p)).binding for p in (a, b, c))
    assert ta.config_digest == tb.config_digest != tc.config_digest


def _note(path):
    return dict(read_trace(str(path)).provenance.notes).get("moeconf.not_captured", "")


def test_not_captured_counts_matched_modules_and_layers(tmp_path):
    """The note (in the header, written before any record) counts a rule only for the layers of
    the modules it matched: an optional rule matching nothing covers nothing, a rule for layer 0
    of 2 names layer 1."""
    out = tmp_path / "a.bin"
    run(Toy(), tmp_path / "full.bin")
    full = _note(tmp_path / "full.bin")
    assert "moe.combine" not in full and "router.margin: no rule" in full
    rules = [r for r in MAPPING.rules if r.component != "moe.combine"]
    run(Toy(), out, mapping=Mapping(rules + [Rule("layers.{layer}.mlp", "moe.combine", optional=True)],
                                    not_captured=MAPPING.not_captured))
    assert "moe.combine: no rule of this capture's mapping records it" in _note(out)
    run(Toy(), out, mapping=Mapping(rules + [Rule(r"layers\.(?P<layer>0)\.experts", "moe.combine", regex=True)],
                                    not_captured=MAPPING.not_captured))
    note = _note(out)
    assert note.startswith("moe.combine: layers 1 (no rule of this capture's mapping records it); attn.*: "), note
    assert note.replace("moe.combine: layers 1 (no rule of this capture's mapping records it); ", "") == full
    # the mapping's reason for the layers left out
    run(Toy(), out, mapping=Mapping(rules + [Rule(r"layers\.(?P<layer>0)\.experts", "moe.combine", regex=True)],
                                    not_captured=dict(MAPPING.not_captured, **{"moe.combine": "layer 1 is dense"})))
    assert _note(out).startswith("moe.combine: layers 1 (layer 1 is dense); attn.*: ")
    # declared state of some layers only
    mp = Mapping(MAPPING.rules, state={"state.cumulative_length": [0]}, not_captured=MAPPING.not_captured)
    with capture(Toy(), mp, out, prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG, capture="all") as cap:
        with cap.step(PROMPT) as s:
            s.state(0, "state.cumulative_length", np.array([5], np.int64))
            s.logits(cap.model(PROMPT)[-1])
    assert _note(out).startswith("state.cumulative_length: layers 1 (no rule")


def test_late_notes_write_the_same_file(tmp_path):
    """notes= a callable (what only the finished run knows): called once, by finish; the file is the
    one the same notes given up front write, byte for byte. A failure before finish leaves no file
    and never calls it."""
    notes = [("runtime.forwards", "4"), ("observed", "after the run")]
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    run(Toy(), a, capture="all", notes=notes)
    calls = []

    def late():
        calls.append(1)
        return list(notes)

    run(Toy(), b, capture="all", notes=late)
    assert calls == [1]
    assert a.read_bytes() == b.read_bytes()
    assert dict(read_trace(str(b)).provenance.notes)["observed"] == "after the run"
    c = tmp_path / "c.bin"
    calls.clear()
    with pytest.raises(CaptureError, match="did not run"):
        with capture(Toy(), MAPPING, c, prompt_ids=PROMPT, max_new_tokens=STEPS, config=CONFIG, notes=late) as cap:
            with cap.step(PROMPT) as s:
                s.logits(np.zeros(CONFIG["vocab_size"], np.float32))
    assert calls == []
    _no_output(tmp_path, c)
    with pytest.raises(CaptureError, match=r"notes\(\) must return a list of \(key, value\) pairs"):
        run(Toy(), c, notes=lambda: "a note")
    _no_output(tmp_path, c)


def test_step_end_for_a_runtime_driven_loop(tmp_path):
    """A step opened in one hook and ended in another (Step.end: a loop the runtime drives, as the
    vLLM mapping's) writes what the with-block loop writes."""
    m = Toy()
    out = tmp_path / "hooked.bin"
    cap = capture(m, MAPPING, out, prompt_ids=PROMPT, max_new_tokens=STEPS, config=CONFIG, precision="numpy-f32")
    feed = list(PROMPT)
    for _ in range(STEPS):
        s = cap.step(feed)
        logits = m(feed)
        nxt = s.logits(logits[-1])
        s.end()
        feed = [nxt]
    cap.finish()
    run(Toy(), tmp_path / "ref.bin")
    assert out.read_bytes() == (tmp_path / "ref.bin").read_bytes()


def test_calls_reads_the_first_of_more_calls(tmp_path):
    """calls=n: a module that runs n times per step, of which a rule reads one (vLLM's mhc_post runs
    for both halves of a layer); the records are those of a model calling it once."""
    m = with_extra_norm_calls(Toy(), 2)  # the real call is call 2 of 3
    rules = [r for r in MAPPING.rules if r.module != "layers.{layer}.norm"]
    run(m, tmp_path / "x.bin", mapping=Mapping(rules + [Rule("layers.{layer}.norm", "ffn.norm", call=2, calls=3)],
                                              not_captured=MAPPING.not_captured, name="toy"))
    run(Toy(), tmp_path / "ref.bin")
    # the same records (the rules note differs: it names the call)
    assert read_trace(str(tmp_path / "x.bin")).root == read_trace(str(tmp_path / "ref.bin")).root
    with pytest.raises(CaptureError, match="ran 3 time"):  # runs fewer times than declared
        run(with_extra_norm_calls(Toy(), 2), tmp_path / "y.bin",
            mapping=Mapping([Rule("layers.{layer}.norm", "ffn.norm", call=2, calls=4)]))
    with pytest.raises(CaptureError, match="ran 4 times in one step"):  # or more
        run(with_extra_norm_calls(Toy(), 3), tmp_path / "y.bin",
            mapping=Mapping([Rule("layers.{layer}.norm", "ffn.norm", call=2, calls=3)]))
    _no_output(tmp_path, tmp_path / "y.bin")
    for kw in ({"calls": 2}, {"call": 1, "calls": 1}, {"call": 0, "calls": True}):
        with pytest.raises(CaptureError, match="calls="):
            Rule("layers.{layer}.norm", "ffn.norm", **kw)


def test_manual_family(tmp_path):
    """Mapping(manual={"moe.term.*": True}): the loop gives each member with Step.record (what a
    wrap of a kernel method recomputes); the trace is the one of the family rule."""
    rules = [r for r in MAPPING.rules if r.component != "moe.term.*"]
    mp = Mapping(rules, manual={"moe.term.*": True}, not_captured=MAPPING.not_captured, name="toy")
    m = Toy()
    out = tmp_path / "x.bin"
    with capture(m, mp, out, prompt_ids=PROMPT, max_new_tokens=STEPS, config=CONFIG, precision="numpy-f32") as cap:
        for i, layer in enumerate(m.layers):
            def terms(mod, args, output, i=i):  # a wrap outside the rules, recording into the open step
                s = cap.current
                t = mod.terms(*args)
                for n, pos in enumerate(s.positions):
                    for j in range(K):
                        s.record(f"moe.term.{j}", t[n, j], layer=i, position=pos)

            layer.experts.register_forward_hook(terms)
        feed = list(PROMPT)
        for _ in range(STEPS):
            with cap.step(feed) as s:
                feed = [s.logits(m(feed)[-1])]
    run(Toy(), tmp_path / "ref.bin")
    a, b = read_trace(str(out)), read_trace(str(tmp_path / "ref.bin"))
    assert [r.digest for r in a.records] == [r.digest for r in b.records]
    assert a.provenance.recomputed() == ["router.scores", "moe.term.*"]
    with pytest.raises(CaptureError, match="not declared in Mapping"):
        with capture(Toy(), mp, tmp_path / "y.bin", prompt_ids=PROMPT, max_new_tokens=1, config=CONFIG) as cap:
            with cap.step(PROMPT) as s:
                s.record("moe.term_h_fp8.0", np.zeros(D, np.float32), layer=0)
    with pytest.raises(CaptureError, match="a family"):
        Mapping([], manual={"router.*": True})
    with pytest.raises(CaptureError, match="both a manual record and mapped"):
        run(Toy(), tmp_path / "z.bin", mapping=Mapping(MAPPING.rules, manual={"moe.term.*": True}))


# --- a batched forward (BatchRows) ---------------------------------------------------------------


def _batched_run(model, out, others, index, side="left", mapping=MAPPING, **kw):
    """The greedy loop with the traced PROMPT as batch entry ``index`` beside ``others`` (id lists,
    decoded greedily alongside), rows padded to the longest on ``side`` with id 0. The toy has no
    attention: a forward runs the flattened ``[size * width]`` ids, so each tensor is ``[size *
    width, ...]``. Returns (capture, per step the whole batch's layer outputs ``[size * width, D]``
    recorded by a plain hook of the same forward, per step the BatchRows)."""
    from moeconf.torch import BatchRows

    seqs = list(others)
    seqs.insert(index, list(PROMPT))
    width = max(len(x) for x in seqs)
    rows = [([0] * (width - len(x)) + x) if side == "left" else (x + [0] * (width - len(x))) for x in seqs]
    first = width - len(PROMPT) if side == "left" else 0
    seen, batches = [], []
    h = model.layers[-1].register_forward_hook(lambda m, a, o: seen[-1].append(np.array(o)))
    kw.setdefault("config", CONFIG)
    kw.setdefault("precision", "numpy-f32")
    with capture(model, mapping, out, prompt_ids=PROMPT, max_new_tokens=STEPS, **kw) as cap:
        feed, lasts = list(PROMPT), [width - 1 if side == "left" else len(x) - 1 for x in seqs]
        flat = [i for r in rows for i in r]
        br = BatchRows(len(seqs), index, width, tuple(range(first, first + len(PROMPT))))
        for _ in range(STEPS):
            seen.append([])
            batches.append(br)
            with cap.step(feed, batch=br) as s:
                logits = model(flat)
                w = br.width
                nxt = [int(np.argsort(-logits[b * w + lasts[b]].astype(np.float64), kind="stable")[0])
                       for b in range(len(seqs))]
                feed = [s.logits(logits[index * w + lasts[index]])]
            assert nxt[index] == feed[0]
            flat, lasts = nxt, [0] * len(seqs)
            br = BatchRows(len(seqs), index, 1, (0,))
    h.remove()
    return cap, [x[0] for x in seen], batches


@pytest.mark.parametrize("index,side", [(0, "left"), (1, "left"), (1, "right")])
def test_a_batched_step_records_the_traced_rows_only(tmp_path, index, side):
    """The traced sequence beside a longer one (it is padded) and a shorter one: the trace holds the
    coordinates of a batch of one (own positions, no pad, no other sequence) and each value is the
    traced row of the batched forward's tensor."""
    out = tmp_path / "b.bin"
    cap, outs, batches = _batched_run(Toy(), out, [[7, 2, 9, 9, 2, 6, 5], [8, 8]], index, side, capture="all")
    solo = tmp_path / "solo.bin"
    run(Toy(), solo, capture="all")
    t, s = read_trace(str(out)), read_trace(str(solo))
    assert [(r.coord, r.level, r.dtype, r.shape) for r in t.records] == \
           [(r.coord, r.level, r.dtype, r.shape) for r in s.records]
    for i, r in enumerate(t.records):
        if r.coord.path == "layer.post_ffn_mhc" and r.coord.layer == LAYERS - 1:
            br = batches[r.coord.step]
            k = r.coord.position - (0 if r.coord.step == 0 else len(PROMPT) + r.coord.step - 1)
            row = outs[r.coord.step][br.index * br.width + br.slots[k]]
            assert np.array_equal(t.array(i).reshape(-1), row), r.coord
    assert cap.generated == [int(t.array(i)[0]) for i, r in enumerate(t.records) if r.coord.path == "token.output"]


def test_a_batched_step_takes_the_batch_as_size_by_width(tmp_path):
    """A tensor of ``[size, width, *item]`` gives the same records as its flattened ``[size * width,
    *item]``."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    _batched_run(Toy(), a, [[7, 2, 9, 9, 2, 6, 5]], 1, capture="all")
    rules = [r for r in MAPPING.rules if r.component != "layer.post_ffn_mhc"]
    rules.append(Rule("layers.{layer}", "layer.post_ffn_mhc", transform=lambda t: t.reshape(2, -1, t.shape[-1]),
                      recomputed=False))  # [2 sequences, width, D]
    mapping = Mapping(rules, not_captured=MAPPING.not_captured, name=MAPPING.name)
    _batched_run(Toy(), b, [[7, 2, 9, 9, 2, 6, 5]], 1, mapping=mapping, capture="all")
    ta, tb = read_trace(str(a)), read_trace(str(b))
    assert [r.digest for r in ta.records] == [r.digest for r in tb.records]
    assert dict(tb.provenance.notes)["moeconf.torch.rules"].count("transformed") == 2  # scores, post_ffn_mhc


def test_batch_rows_refusals(tmp_path):
    from moeconf.torch import BatchRows

    for br, match in [(BatchRows(2, 2, 5, tuple(range(5))), "size >= 1 sequences"),
                      (BatchRows(2, 0, 5, (0, 1, 2)), r"one slot index per token of the step \(5\)"),
                      (BatchRows(2, 0, 6, (0, 1, 3, 2, 4)), "increasing"),
                      (BatchRows(2, 0, 4, (0, 1, 2, 3, 4)), r"within 0\.\.3"),
                      ((2, 0, 5, tuple(range(5))), "must be a moeconf.torch.BatchRows")]:
        out = tmp_path / "x.bin"
        m = Toy()
        with pytest.raises(CaptureError, match=match):
            with capture(m, MAPPING, out, prompt_ids=PROMPT, max_new_tokens=STEPS, config=CONFIG) as cap:
                with cap.step(PROMPT, batch=br):
                    pass
        _no_output(tmp_path, out)
        assert m.hooks() == 0
    # a tensor that is not the whole batch
    out = tmp_path / "y.bin"
    m = Toy()
    with pytest.raises(CaptureError, match=r"in a batched step: expected the whole batch, \[3, 5, \.\.\.\] or \[15"):
        with capture(m, MAPPING, out, prompt_ids=PROMPT, max_new_tokens=STEPS, config=CONFIG) as cap:
            with cap.step(PROMPT, batch=BatchRows(3, 0, 5, tuple(range(5)))) as s:
                s.logits(m(PROMPT)[-1])
    _no_output(tmp_path, out)


def test_the_transformers_capture_runs_through_its_mapping(monkeypatch):
    """``moeconf.capture.capture`` (and so ``python3 -m moeconf transformers``) is
    ``moeconf.capture_mapping.capture``, this engine under the transformers mapping, with every
    argument passed on: there is no second hook path (whose trace test_capture_mapping.py compares)."""
    import moeconf
    from moeconf import capture_mapping

    seen = []
    monkeypatch.setattr(capture_mapping, "capture", lambda *a, **kw: seen.append((a, kw)) or "ran")
    assert moeconf.capture("m", [1, 2], "p", 3, "o.bin", batch_with=[[4]], padding_side="right", pad_token_id=0,
                           levels=1, payload_levels=0, model_dir="d", model_name="n", precision="x",
                           algorithm="sha256", contract="c", schedule="s") == "ran"
    assert seen == [(("m", [1, 2], "p", 3, "o.bin"),
                     dict(model_dir="d", model_name="n", precision="x", levels=1, payload_levels=0, algorithm="sha256",
                          contract="c", schedule="s", batch_with=[[4]], padding_side="right", pad_token_id=0))]
    assert not any(hasattr(moeconf.capture, n) for n in ("_Recorder", "_attention_hooks", "_ffn_hooks", "_generate"))
