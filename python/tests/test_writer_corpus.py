"""The shared writer corpus (tests/writer_corpus.json): the Python writer accepts
exactly the cases marked ``accept`` (the Rust side, tests/writer_corpus.rs, checks
the same list and that both writers write byte-identical files), and whatever it
accepts, the Python reader and the Rust ``moeconf inspect`` accept."""

import os
import subprocess

import pytest
import writer_corpus

from moeconf import read_trace


@pytest.mark.parametrize("version", [1, 2, 3])
def test_python_writer_matches_the_corpus(repo, tmp_path, version):
    corpus = os.path.join(repo, "tests", "writer_corpus.json")
    results = writer_corpus.run_all(corpus, str(tmp_path), version)
    cases = writer_corpus.load(corpus)["cases"]
    assert len(results) == len(cases) >= 40
    wrong = [(r["name"], r["error"]) for r, c in zip(results, cases)
             if r["accepted"] != writer_corpus.expected(c, version)]
    assert not wrong, wrong
    for i, r in enumerate(results):
        p = tmp_path / f"case{i:03}.bin"
        if r["accepted"]:
            t = read_trace(p)
            assert t.root.hex() == r["root"]
        else:
            assert not p.exists(), r["name"]
    # Nothing but the accepted traces: no temporary file survives a refusal.
    assert sorted(os.listdir(tmp_path)) == sorted(f"case{i:03}.bin" for i, r in enumerate(results)
                                                  if r["accepted"])


def test_rust_reader_accepts_what_the_python_writer_accepts(repo, tmp_path, moeconf_bin):
    corpus = os.path.join(repo, "tests", "writer_corpus.json")
    for i, r in enumerate(writer_corpus.run_all(corpus, str(tmp_path))):
        if r["accepted"]:
            p = subprocess.run([moeconf_bin, "inspect", str(tmp_path / f"case{i:03}.bin"), "--format", "json"],
                               capture_output=True, text=True)
            assert p.returncode == 0, (r["name"], p.stderr)
            assert f'"root": "{r["root"]}"' in p.stdout
