"""``python3 -m moeconf``: inspect, write (from a JSON spec) and identity, with exit code 2
and a message naming the file on bad input."""

import json
import os
import subprocess
import sys

from moeconf import read_trace
from moeconf.dump import write_safetensors

import numpy as np

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    return subprocess.run([sys.executable, "-m", "moeconf", *map(str, args)], capture_output=True, text=True,
                          env=env)


def _spec():
    return {
        "algorithm": "sha256",
        "binding": {"model_name": "m", "prompt_text": "hi", "prompt_ids": [1], "max_new_tokens": 1,
                    "precision": "f32", "extra": [["a", "b"]]},
        "provenance": {"runtime": "cli-test", "version": "1", "threads": 2},
        "records": [
            {"step": 0, "position": 0, "phase": "prefill", "layer": None, "path": "token.output", "level": "L0",
             "dtype": "i32", "shape": [1], "data_hex": "05000000", "keep_payload": True},
            {"step": 0, "position": 0, "phase": 0, "layer": 3, "path": "moe.combine", "level": 4,
             "dtype": "f32", "shape": [2], "data_hex": "0000803f010080ff"},
        ],
    }


def test_write_then_inspect(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec()))
    out = tmp_path / "t.bin"
    p = _run("write", spec, "-o", out)
    assert p.returncode == 0, p.stderr
    written = json.loads(p.stdout)
    t = read_trace(out)
    assert written["root"] == t.root.hex() and t.algorithm == "sha256"
    assert t.binding.extra == [("a", "b")] and t.provenance.threads == 2
    assert t.records[1].coord.layer == 3 and t.records[1].payload is None
    p = _run("inspect", out)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["root"] == t.root.hex() and doc["records"] == 2 and doc["payloads"] == 1
    assert doc["by_level"]["L4"] == 1


def test_errors_exit_2_naming_the_file(tmp_path):
    spec = tmp_path / "spec.json"
    s = _spec()
    del s["records"][0]["dtype"]
    spec.write_text(json.dumps(s))
    p = _run("write", spec, "-o", tmp_path / "t.bin")
    assert p.returncode == 2 and "spec.json" in p.stderr and "dtype" in p.stderr, p.stderr
    assert not (tmp_path / "t.bin").exists()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".t.bin.tmp")]   # no temp file left
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"MOECONF\x00" + b"\x00" * 200)
    p = _run("inspect", bad)
    assert p.returncode == 2 and f"{bad}: byte 8: unsupported format version 0" in p.stderr, p.stderr


def test_identity(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    write_safetensors(tmp_path / "model.safetensors", {"b": np.zeros(2, np.float32), "a": np.ones(1, np.int64)})
    p = _run("identity", tmp_path, "--name", "x")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert [t["name"] for t in doc["tensors"]] == ["a", "b"]
    assert [t["dtype"] for t in doc["tensors"]] == ["i64", "f32"]
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    p = _run("identity", tmp_path)
    assert p.returncode == 2 and "broken.safetensors" in p.stderr, p.stderr
