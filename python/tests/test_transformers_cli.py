"""``python3 -m moeconf transformers``: argument, model-directory and output checks (exit 2, a
message, no trace, torch never imported), the batch layout of ``moeconf.capture``, and the
transformers invariance matrix (python/invariance/transformers.toml) rendered into valid commands.
None of this needs torch or transformers; the captures themselves are tested, opt-in, in
test_capture_batch.py."""

import argparse
import json
import os
import re
import subprocess
import sys
import types

import pytest

from moeconf.capture import (NOT_CAPTURED_NOTE, PADDED_NOT_CAPTURED, _Batch, _batch_notes, _make_batch,
                             _Tokenizer)
from moeconf.transformers_cli import (EXPERTS_IMPLEMENTATIONS, TransformersCaptureError, add_arguments,
                                      request_from_args)

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATRIX = os.path.join(PYTHON_DIR, "invariance", "transformers.toml")


@pytest.fixture
def model_dir(tmp_path):
    """A directory that passes the pre-torch checks: a deepseek_v4 config and a tokenizer file."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    (d / "tokenizer.json").write_text("{}")
    return d


def _run(*args):
    """Runs the subcommand in a fresh interpreter; returns (exit code, stderr, torch imported?)."""
    code = ("import sys\nfrom moeconf.__main__ import main\ntry:\n    rc = main(sys.argv[1:])\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\nsys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, "transformers", *map(str, args)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=PYTHON_DIR))
    return p.returncode, p.stderr, "NO-TORCH" in p.stdout


def _base(model_dir, out, *extra):
    return [model_dir, "--prompt", "why the sheep", "--max-new-tokens", "2", "-o", out, *extra]


@pytest.mark.parametrize("case, extra, message", [
    ("no tokens", ["--max-new-tokens", "0"], "--max-new-tokens 0: expected 1..4096"),
    ("too many tokens", ["--max-new-tokens", "4097"], "expected 1..4096"),
    ("no threads", ["--threads", "0"], "--threads 0: expected 1.."),
    ("empty prompt", ["--prompt", ""], "the prompt is empty"),
    ("batch JSON", ["--batch-with-json", "[\"a\""], "not JSON"),
    ("batch not a list", ["--batch-with-json", "{\"a\": 1}"], "expected a JSON list of strings"),
    ("batch not strings", ["--batch-with-json", "[\"a\", 3]"], "expected a JSON list of strings"),
    ("empty other prompt", ["--batch-with", "a", "--batch-with", ""], "other prompt #2 of the batch is empty"),
    ("empty other prompt in JSON", ["--batch-with-json", "[\"\"]"], "other prompt #1 of the batch is empty"),
    ("levels", ["--levels", "L0,L7"], "unknown level 'L7'"),
])
def test_bad_values_exit_2_before_torch_without_a_trace(model_dir, tmp_path, case, extra, message):
    out = tmp_path / "t.bin"
    rc, err, no_torch = _run(*_base(model_dir, out), *extra)
    assert rc == 2, (case, err)
    assert message in err and err.startswith("moeconf (python): "), (case, err)
    assert no_torch, f"{case}: torch was imported before the arguments were checked"
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".t.bin")]


@pytest.mark.parametrize("flag, value", [("--experts-implementation", "fused"), ("--padding-side", "middle"),
                                         ("--dtype", "fp16"), ("--threads", "two")])
def test_values_outside_the_choices_are_usage_errors(model_dir, tmp_path, flag, value):
    out = tmp_path / "t.bin"
    rc, err, no_torch = _run(*_base(model_dir, out), flag, value)
    assert rc == 2 and flag in err and no_torch, err
    assert not out.exists()


def test_model_directory_checks_name_the_cause(tmp_path, model_dir):
    out = tmp_path / "t.bin"
    cases = []
    cases.append((tmp_path / "missing", "no such model directory"))
    f = tmp_path / "file"
    f.write_text("x")
    cases.append((f, "not a directory"))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((empty, "no config.json"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    cases.append((bad, "not a readable JSON config"))
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (llama / "tokenizer.json").write_text("{}")
    cases.append((llama, "model_type 'llama', not 'deepseek_v4'"))
    notok = tmp_path / "notok"
    notok.mkdir()
    (notok / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    cases.append((notok, "no tokenizer.json"))
    for d, message in cases:
        rc, err, no_torch = _run(*_base(d, out))
        assert rc == 2 and message in err and str(d) in err and no_torch, (d, err)
    # the output: a missing directory, or a file of the checkpoint (an input is never overwritten)
    rc, err, _ = _run(*_base(model_dir, tmp_path / "nowhere" / "t.bin"))
    assert rc == 2 and "does not exist" in err, err
    rc, err, _ = _run(*_base(model_dir, model_dir / "config.json"))
    assert rc == 2 and "refusing to overwrite an input" in err, err
    assert json.loads((model_dir / "config.json").read_text()) == {"model_type": "deepseek_v4"}
    assert not out.exists()


def _parse(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([str(a) for a in argv])


def test_a_valid_request_keeps_every_setting(model_dir, tmp_path):
    out = tmp_path / "t.bin"
    r = request_from_args(_parse(_base(model_dir, out)))
    assert (r.threads, r.padding_side, r.dtype, r.experts_implementation, r.batch_with, r.levels) == \
        (1, "left", "bf16", None, [], "all")
    assert r.model_dir == os.path.abspath(model_dir) and r.max_new_tokens == 2
    r = request_from_args(_parse(_base(model_dir, out, "--batch-with", "b", "--batch-with-json", '["c", "d"]',
                                       "--padding-side", "right", "--threads", "2", "--experts-implementation",
                                       "eager", "--dtype", "fp32", "--levels", "L0,L3")))
    assert r.batch_with == ["b", "c", "d"] and r.padding_side == "right" and r.threads == 2
    assert r.experts_implementation == "eager" and r.dtype == "fp32" and r.levels == 0b1001
    prompt = tmp_path / "p.txt"
    prompt.write_text("from a file")
    args = _parse([model_dir, "--prompt-file", prompt, "--max-new-tokens", "1", "-o", out])
    assert request_from_args(args).prompt == "from a file"
    with pytest.raises(TransformersCaptureError, match="--prompt-file"):
        request_from_args(_parse([model_dir, "--prompt-file", tmp_path / "none", "--max-new-tokens", "1", "-o", out]))


def _cfg(**kw):
    return types.SimpleNamespace(**{"vocab_size": 100, "pad_token_id": None, "eos_token_id": 1, **kw})


def test_batch_rows_pad_every_sequence_to_the_longest_on_its_side():
    b = _Batch([[5, 6, 7], [8], [9, 10, 11, 12, 13]], "left", 0)
    ids, mask = b.rows()
    assert ids == [[0, 0, 5, 6, 7], [0, 0, 0, 0, 8], [9, 10, 11, 12, 13]]
    assert mask == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]]
    assert list(b.own_slots(0)) == [2, 3, 4] and b.pads(0) == 2 and b.pads(2) == 0
    b = _Batch([[5, 6, 7], [8]], "right", 4)
    ids, mask = b.rows()
    assert ids == [[5, 6, 7], [8, 4, 4]] and mask == [[1, 1, 1], [1, 0, 0]]
    assert list(b.own_slots(0)) == [0, 1, 2] and list(b.own_slots(1)) == [0]


def test_make_batch_checks_its_prompts_and_finds_a_pad_id():
    tok = _Tokenizer(None)
    b = _make_batch(_cfg(), tok, [3, 4], [[5], (6, 7, 8)], "right", None)
    assert b.ids == [[3, 4], [5], [6, 7, 8]] and b.pad_id == 1 and b.side == "right"  # eos, as generate() does
    assert _make_batch(_cfg(pad_token_id=9), tok, [3], [[5]], "left", None).pad_id == 9
    assert _make_batch(_cfg(eos_token_id=[2, 1]), tok, [3], [[5]], "left", None).pad_id == 2
    assert _make_batch(_cfg(), tok, [3], [[5]], "left", 7).pad_id == 7
    for bad, msg in [(dict(batch_with=[[]]), "empty prompt"), (dict(batch_with=[[100]]), "outside the vocabulary"),
                     (dict(batch_with="abc"), "not one string"), (dict(padding_side="up"), "padding_side"),
                     (dict(batch_with=["text"]), "given ids, not a tokenizer")]:
        kw = {"batch_with": [[5]], "padding_side": "left", **bad}
        with pytest.raises(ValueError, match=msg):
            _make_batch(_cfg(), tok, [3], kw["batch_with"], kw["padding_side"], None)
    with pytest.raises(ValueError, match="pad token id"):
        _make_batch(_cfg(eos_token_id=None), tok, [3], [[5]], "left", None)
    assert _make_batch(_cfg(eos_token_id=None), tok, [3], [], "left", None).ids == [[3]]  # alone: no pad needed


def test_batch_notes_name_the_composition_and_what_a_padded_sequence_leaves_out():
    assert _batch_notes(_Batch([[3, 4]], "left", 1), []) == []
    notes = dict(_batch_notes(_Batch([[3, 4, 5], [6]], "right", 1), ["hi"]))
    assert notes["batch_sequences"].startswith("2 ") and json.loads(notes["batch_with"]) == ["hi"]
    assert notes["padding_side"] == "right" and notes["pad_token_id"] == "1"
    assert notes["batch_prompt_tokens"] == "3,1" and notes["batch_pad_slots"].startswith("none")
    assert NOT_CAPTURED_NOTE not in notes
    notes = dict(_batch_notes(_Batch([[3], [6, 7, 8]], "left", 1), ["a b"]))
    assert notes["batch_pad_slots"].startswith("2 pad slots before")
    items = dict(x.split(": ", 1) for x in notes[NOT_CAPTURED_NOTE].split("; "))
    assert items == PADDED_NOT_CAPTURED  # every reason parses back (docs/format.md 5.2.2)


def _fill(template, values):
    """`moeconf invariance`'s placeholder substitution (invariance/src/command.rs `fill`)."""
    def one(m):
        if m.group(0) in ("{{", "}}"):
            return m.group(0)[0]
        return str(values[m.group(1)])
    return re.sub(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}", one, template)


def test_the_transformers_matrix_renders_valid_captures_of_every_knob(model_dir, tmp_path):
    tomllib = pytest.importorskip("tomllib")
    with open(MATRIX, "rb") as f:
        m = tomllib.load(f)
    run, base, configs = m["run"], m["base"], m["config"]
    assert run["backend"] == "command" and "model" not in run, "the model is given with --model"
    argv = run["command"]
    assert argv[:4] == ["python3", "-m", "moeconf", "transformers"] and "{output}" in argv
    # the base: the prompt alone, 1 thread, transformers' default experts implementation, bf16
    assert base == {"num_threads": 1, "experts_implementation": "grouped_mm", "dtype": "bf16", "batch_with": "[]",
                    "padding_side": "left"}
    assert run["env"] == {"OMP_NUM_THREADS": "{num_threads}"}
    # every knob reported, never failed: the matrix exits 0 whatever it finds
    assert m["expect"] == {k: "info" for k in [*base, "rerun"]}
    seen = {"threads": set(), "batch": set(), "experts": set()}
    for c in [{}] + configs:
        knobs = {k: v for k, v in c.items() if k != "name"}
        assert set(knobs) <= set(base), c
        values = {**base, **knobs, "model": model_dir, "prompt": run["prompt"],
                  "max_new_tokens": run["max_new_tokens"], "output": tmp_path / "t.bin"}
        rendered = [_fill(a, values) for a in argv]
        r = request_from_args(_parse(rendered[4:]))  # a command the capture accepts, whole
        assert r.threads == knobs.get("num_threads", 1)
        seen["threads"].add(r.threads)
        seen["batch"].add((len(r.batch_with), r.padding_side if r.batch_with else None))
        seen["experts"].add(r.experts_implementation)
    assert seen["threads"] == {1, 2}
    assert {(1, "left"), (1, "right"), (2, "left"), (2, "right"), (0, None)} <= seen["batch"]
    assert seen["experts"] == set(EXPERTS_IMPLEMENTATIONS)
    assert sum(1 for c in configs if set(c) <= {"name"}) == 1, "one rerun of the base"
