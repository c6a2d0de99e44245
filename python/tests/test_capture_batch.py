"""Opt-in: ``python3 -m moeconf transformers`` and the batched capture (``moeconf.capture(...,
batch_with=, padding_side=)``) on the built-in tiny fixture, and the transformers invariance matrix
(docs/invariance.md section 5.2).

Marked ``transformers`` and skipped unless torch and transformers import AND
``MOECONF_TRANSFORMERS_TESTS=1`` (python/run_interop.sh runs them). Like test_capture.py they
assert what holds on any CPU: which rows and positions the capture records, coverage, the
provenance, values that a batch cannot change by construction (hash routing is a table lookup of
the token ids), the capture against the same batched forward run without it, and the shapes of the
sliding window under padding; never which values torch's kernels round differently on this CPU
(docs/invariance.md keeps those, with the CPU named).
"""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.transformers

from conftest import require_transformers  # noqa: E402

torch, transformers = require_transformers()

from moeconf import read_trace  # noqa: E402
from moeconf.capture import NOT_CAPTURED_NOTE, PADDED_NOT_CAPTURED, capture  # noqa: E402

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "why the sheep"  # 5 tokens
SHORTER = "hello"  # 3 tokens: the traced row has no pad slot beside it
LONGER = "the quick brown fox"  # 10 tokens: the traced row gets 5 pad slots
STEPS = 3
#: Per-position records of a layer (L3/L4) whose positions are the forward's own tokens.
PER_TOKEN = {"layer.post_attn_mhc", "layer.post_ffn_mhc", "attn.hc_pre", "attn.norm", "attn.q", "attn.kv",
             "attn.core", "attn.output", "ffn.hc_pre", "ffn.norm", "router.scores", "router.topk",
             "router.gates", "moe.routed", "moe.shared", "moe.combine"}


def _key(r):
    return (r.coord.step, r.level, r.coord.layer, r.coord.position, r.coord.phase, r.coord.path)


def _component(path):
    return "moe.term.*" if path.startswith("moe.term.") else path


def _omitted(path):
    """Whether ``path`` is one of PADDED_NOT_CAPTURED's patterns."""
    return any(path == p or (p.endswith("*") and path.startswith(p[:-1])) for p in PADDED_NOT_CAPTURED)


@pytest.fixture(scope="module")
def env(moeconf_bin, tmp_path_factory):
    """The fixture's BF16 checkpoint (materialized by the Rust binary), the model, its tokenizer,
    and the solo capture every batched one is compared with."""
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    root = tmp_path_factory.mktemp("batch")
    p = subprocess.run([moeconf_bin, "run", "--model", "builtin:tiny-v4", "--prompt", PROMPT, "--max-new-tokens",
                        "1", "--capture", "L0", "-o", str(root / "fixture.bin")], capture_output=True, text=True,
                       env=dict(os.environ, MOECONF_CACHE_DIR=str(root / "cache")))
    assert p.returncode == 0, p.stderr
    model_dir = os.path.dirname(glob.glob(str(root / "cache" / "*" / "config.json"))[0])
    torch.set_num_threads(1)
    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    solo = root / "solo.bin"
    capture(model, tok, PROMPT, STEPS, solo, model_name="builtin:tiny-v4")
    return {"root": root, "bin": moeconf_bin, "model_dir": model_dir, "model": model, "tok": tok,
            "solo": read_trace(solo), "solo_path": solo}


def _cli(env, out, *args):
    p = subprocess.run([sys.executable, "-m", "moeconf", "transformers", env["model_dir"], "--name", "builtin:tiny-v4",
                        "--prompt", PROMPT, "--max-new-tokens", str(STEPS), "-o", str(out), *map(str, args)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=PYTHON_DIR))
    return p


def test_the_cli_is_the_library_capture_under_its_settings(env):
    out = env["root"] / "cli.bin"
    p = _cli(env, out)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    t = read_trace(out)
    assert t.root == env["solo"].root and doc["root"] == t.root.hex()  # the same execution, the same root
    assert t.provenance.threads == 1 and doc["batch_sequences"] == 1
    out2 = env["root"] / "cli2.bin"
    p = _cli(env, out2, "--threads", "2", "--experts-implementation", "eager", "--dtype", "fp32")
    assert p.returncode == 0, p.stderr
    t = read_trace(out2)
    notes = dict(t.provenance.notes)
    assert t.provenance.threads == 2 and notes["experts_implementation"] == "eager"
    assert t.binding.precision == "hf-f32" and "batch_sequences" not in notes


def test_the_cli_refuses_a_checkpoint_missing_a_weight(env, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    part = tmp_path / "partial"
    part.mkdir()
    tensors = load_file(os.path.join(env["model_dir"], "model.safetensors"))
    tensors.pop(sorted(tensors)[0])
    save_file(tensors, str(part / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(os.path.join(env["model_dir"], f), part / f)
    out = tmp_path / "t.bin"
    p = subprocess.run([sys.executable, "-m", "moeconf", "transformers", str(part), "--prompt", PROMPT,
                        "--max-new-tokens", "1", "-o", str(out)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=PYTHON_DIR))
    assert p.returncode == 2 and "does not hold every weight" in p.stderr, p.stderr
    assert not out.exists() and os.listdir(tmp_path) == ["partial"]


def _independent(env, prompts, side):
    """The same batch run without the capture, prefill and one decode step (greedy, ties to the lowest
    id, every row): per step the layer outputs ``[batch, width, hc, D]`` and the logits."""
    from transformers.cache_utils import DynamicCache

    from moeconf.capture import _Batch

    model, tok = env["model"], env["tok"]
    batch = _Batch([tok.encode(p, add_special_tokens=False).ids for p in prompts], side, model.config.eos_token_id)
    ids, mask = batch.rows()
    am, inp = torch.tensor(mask), torch.tensor(ids)
    cache = DynamicCache(config=model.config)
    steps = []
    for step in range(2):
        outs = []
        hooks = [layer.register_forward_hook(lambda m, a, o: outs.append(o.detach().clone()))
                 for layer in model.model.layers]
        pos = (am.cumsum(-1) - 1).masked_fill(am == 0, 0)[:, -inp.shape[1]:]
        with torch.no_grad():
            o = model(input_ids=inp, attention_mask=am, position_ids=pos, past_key_values=cache, use_cache=True)
        for h in hooks:
            h.remove()
        lasts = [batch.own_slots(b)[-1] for b in range(len(prompts))] if step == 0 else [0] * len(prompts)
        logits = torch.stack([o.logits[b, s] for b, s in enumerate(lasts)]).float()
        steps.append({"layers": outs, "logits": logits, "slots": list(batch.own_slots(0)) if step == 0 else [0]})
        inp = torch.tensor([[int(np.argsort(-logits[b].double().numpy(), kind="stable")[0])] for b in range(len(prompts))])
        am = torch.cat([am, torch.ones((len(prompts), 1), dtype=am.dtype)], dim=1)
    return steps, batch


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("others", [[SHORTER], [LONGER], [SHORTER, LONGER]], ids=["shorter", "longer", "both"])
def test_a_batched_capture_records_the_traced_rows_at_their_own_positions(env, side, others):
    out = env["root"] / f"b_{side}_{len(others)}_{len(others[-1])}.bin"
    res = capture(env["model"], env["tok"], PROMPT, STEPS, out, model_name="builtin:tiny-v4", batch_with=others,
                  padding_side=side)
    t, solo = read_trace(out), env["solo"]
    prompt_ids = list(solo.binding.prompt_ids)
    padded = any(len(env["tok"].encode(p, add_special_tokens=False).ids) > len(prompt_ids) for p in others)
    # provenance: the batch composition, and what a padded sequence leaves out, with the reasons
    notes = dict(t.provenance.notes)
    assert notes["batch_sequences"].startswith(f"{1 + len(others)} ") and json.loads(notes["batch_with"]) == others
    assert notes["padding_side"] == side and (notes["batch_pad_slots"].startswith("none") != padded)
    assert (NOT_CAPTURED_NOTE in notes) == padded
    if padded:
        assert dict(x.split(": ", 1) for x in notes[NOT_CAPTURED_NOTE].split("; ")) == PADDED_NOT_CAPTURED
    # coverage: the solo capture's coordinates (no pad row, no other sequence), minus what padding leaves out
    a = {_key(r): (r.dtype, r.shape) for r in solo.records}
    b = {_key(r): (r.dtype, r.shape) for r in t.records}
    expected = {k for k in a if not (padded and _omitted(k[5]))}
    assert set(b) == expected, sorted({_component(k[5]) for k in set(b) ^ expected})
    for k in b:
        if k[5] == "state.window_kv" and padded:
            continue  # below
        if k[5] != "text.continuation":
            assert a[k] == b[k], k
    # positions: the prompt's own 0..P-1 at the prefill, P+s-1 at decode step s
    for k in b:
        if k[5] in PER_TOKEN:
            assert (k[3] in range(len(prompt_ids))) if k[0] == 0 else k[3] == len(prompt_ids) + k[0] - 1, k
    ti = {_key(r): i for i, r in enumerate(t.records)}
    si = {_key(r): i for i, r in enumerate(solo.records)}
    first = next(k for k in ti if k[5] == "token.input" and k[0] == 0)
    assert t.array(ti[first]).tolist() == prompt_ids
    # hash routing is tid2eid[input_ids]: the prefill's routes of layers 0-2 cannot depend on the batch
    hashed = [k for k in ti if k[5] == "router.topk" and k[0] == 0 and k[2] < 3]
    assert len(hashed) == 3 * len(prompt_ids)
    for k in hashed:
        assert np.array_equal(t.array(ti[k]), solo.array(si[k])), k
    # the values are the traced row's: the same batch run without the capture, at its slots
    steps, batch = _independent(env, [PROMPT, *others], side)
    assert res.generated[:2] == [int(np.argsort(-s["logits"][0].double().numpy(), kind="stable")[0]) for s in steps]
    for step, s in enumerate(steps):
        for k in ti:
            if k[0] != step:
                continue
            if k[5] == "layer.post_ffn_mhc":
                slot = s["slots"][k[3] - (0 if step == 0 else len(prompt_ids) + step - 1)]
                assert np.array_equal(t.array(ti[k]), s["layers"][k[2]][0, slot].float().numpy()), k
            elif k[5] == "lm.logits":
                assert np.array_equal(t.array(ti[k]), s["logits"][0].numpy()), k
    # the sliding window under padding: left pads sit before the prompt and are dropped, so the window
    # holds the solo's rows; right pads sit between the prompt and the generated tokens, and the cache
    # keeps the batch's last sliding_window - 1 slots, so the prompt's tokens leave it early
    win = [k for k in b if k[5] == "state.window_kv"]
    if not padded or side == "left":
        assert all(a[k] == b[k] for k in win)
    else:
        w = env["model"].config.sliding_window - 1
        k0 = next(k for k in win if k[0] == 0 and k[2] == 0)
        total = batch.width
        own_in_window = sum(1 for s in range(max(0, total - w), total) if s < len(prompt_ids))
        assert b[k0][1][0] == own_in_window < a[k0][1][0], (b[k0], a[k0])


def test_the_transformers_matrix_runs_its_knobs_through_the_cli(env, tmp_path):
    """python/invariance/transformers.toml through `moeconf invariance`, cut to three configurations and
    two tokens: every configuration gets a verdict (exit 0: its knobs are `info`) and its trace records
    the setting it ran under."""
    with open(os.path.join(PYTHON_DIR, "invariance", "transformers.toml"), encoding="utf-8") as f:
        text = f.read()
    head, *blocks = text.split("\n[[config]]")
    keep = [b for b in blocks if any(n in b for n in ('"2 threads"', '"beside 1 longer prompt, right padding"',
                                                        '"experts eager"'))]
    last = blocks[-1]
    expect = last[last.index("\n[expect]"):]
    keep = [b.split("\n[expect]")[0] for b in keep]
    matrix = tmp_path / "m.toml"
    matrix.write_text(head + "".join("\n[[config]]" + b for b in keep) + expect)
    out = tmp_path / "inv"
    p = subprocess.run([env["bin"], "invariance", str(matrix), "--model", env["model_dir"], "--max-new-tokens", "2",
                        "--out", str(out), "--no-pages", "--format", "json"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=PYTHON_DIR), cwd=PYTHON_DIR)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    j = json.loads(p.stdout)
    names = [c["name"] for c in j["configurations"]]
    assert names == ["2 threads", "beside 1 longer prompt, right padding", "experts eager"]
    assert all(c["status"] == "info" for c in j["configurations"]), j["configurations"]
    traces = {c["name"]: read_trace(out / f"c{n:02d}.bin") for n, c in enumerate(j["configurations"], 1)}
    assert traces["2 threads"].provenance.threads == 2
    notes = dict(traces["beside 1 longer prompt, right padding"].provenance.notes)
    assert notes["padding_side"] == "right" and json.loads(notes["batch_with"]) == [LONGER]
    assert dict(traces["experts eager"].provenance.notes)["experts_implementation"] == "eager"
    assert read_trace(out / "base.bin").provenance.threads == 1
