"""Across the language boundary, both ways, through the Rust ``moeconf`` binary:

* a Python-written trace is accepted by ``moeconf inspect`` (full verification)
  with the root and counts Python computed, and ``moeconf diff`` finds two
  Python traces of the same tensors equivalent;
* a Rust-written trace (``moeconf run``) is read and fully verified in Python
  with the same root; its model binding equals the identity Python computes
  from the model directory; re-writing every record of a ``--capture all``
  trace with the Python writer reproduces the Rust root bit for bit.

The Rust side of "same tensors, same root" with ``moeconf_schema::TraceWriter``
is ``tests/python_interop.rs``; ``tests/test_import.py`` does it through
``moeconf import``.
"""

import glob
import json
import os

import numpy as np

from moeconf import Provenance, TraceWriter, model_identity, read_trace, tokenizer_digest
from test_roundtrip import _write_sample


def _inspect(run_moeconf, path):
    return json.loads(run_moeconf("inspect", path, "--format", "json").stdout)


def test_rust_inspect_reads_python_trace(run_moeconf, tmp_path):
    for alg in ("blake3", "sha256"):
        p = tmp_path / f"py-{alg}.bin"
        items, s = _write_sample(p, alg, fold=True)
        doc = _inspect(run_moeconf, p)
        assert doc["algorithm"] == alg
        assert doc["root"] == s.root.hex()
        assert doc["records"]["total"] == len(items) == s.records
        assert doc["records"]["with_payload"] == s.payloads
        assert doc["verified"]["payloads"] == s.payloads   # every payload re-hashed by Rust
        assert doc["binding"]["prompt"]["ids"] == [11, 12, 13]
        assert doc["binding"]["canonicalization"]["fold_negative_zero"] is True
        assert doc["provenance"]["runtime"] == "pytest"
        assert doc["steps"]["count"] == 2
        assert doc["binding_digest"] == read_trace(p).binding_digest.hex()


def test_rust_diff_of_python_traces(run_moeconf, tmp_path):
    a, b, c = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"
    items, _ = _write_sample(a)
    _write_sample(b, keep=False)        # same tensors, fingerprints only
    assert run_moeconf("diff", a, b, check=False).returncode == 0
    # One changed logit: diff must find it (exit 1) at L1.
    t = read_trace(a)
    w = TraceWriter(c, t.binding, Provenance("pytest", "1", 1))
    for i, (coord, lv, arr) in enumerate(items):
        if coord.path == "lm.logits":
            arr = arr.copy()
            arr[0] = np.nextafter(arr[0], np.float32(np.inf))
        w.append(coord, lv, arr, keep_payload=True)
    w.finish()
    p = run_moeconf("diff", a, c, "--format", "json", check=False)
    assert p.returncode == 1, p.stderr
    assert "lm.logits" in p.stdout


def _rust_run(run_moeconf, tmp_path, out, *extra):
    run_moeconf("run", "--model", "builtin:tiny-v4", "--prompt", "why the sheep", "--max-new-tokens", "2",
                "-o", out, *extra)
    (model_dir,) = glob.glob(str(tmp_path / "cache" / "tiny-v4-*"))
    return model_dir


def test_python_reads_rust_run_trace(run_moeconf, tmp_path):
    x = tmp_path / "x.bin"
    model_dir = _rust_run(run_moeconf, tmp_path, x)
    doc = _inspect(run_moeconf, x)
    t = read_trace(x)
    assert t.root.hex() == doc["root"]
    assert len(t.records) == doc["records"]["total"]
    assert t.payload_count() == doc["records"]["with_payload"]
    assert t.binding.prompt_text == "why the sheep" and t.binding.max_new_tokens == 2
    assert {r.coord.step for r in t.records} == {0, 1}
    # Model identity and tokenizer digest computed in Python equal the Rust binding.
    ident = model_identity("builtin:tiny-v4", model_dir)
    assert ident.config_digest == t.binding.config_digest
    assert ident.weights_digest == t.binding.weights_digest
    assert [(x.name, x.dtype, x.shape, x.digest) for x in ident.tensors] == \
        [(x.name, x.dtype, x.shape, x.digest) for x in t.binding.tensors]
    assert tokenizer_digest(os.path.join(model_dir, "tokenizer.json")) == t.binding.tokenizer_digest
    # The generated ids: token.output payloads agree with token.input of the next step.
    out = [t.array(i)[0] for i, r in enumerate(t.records) if r.coord.path == "token.output"]
    nxt = [t.array(i)[0] for i, r in enumerate(t.records) if r.coord.path == "token.input" and r.coord.step == 1]
    assert len(out) == 2 and nxt == out[:1]


def test_python_rewrite_of_rust_trace_has_the_same_root(run_moeconf, tmp_path):
    for alg in ("blake3", "sha256"):
        x = tmp_path / f"all-{alg}.bin"
        _rust_run(run_moeconf, tmp_path, x, "--capture", "all", "--digest", alg, "--fold-negative-zero")
        t = read_trace(x)
        assert t.payload_count() == len(t.records) > 1000
        y = tmp_path / f"py-{alg}.bin"
        w = TraceWriter(y, t.binding, Provenance("pytest-rewrite", "1", 1), alg)
        for i, r in enumerate(t.records):
            w.append(r.coord, r.level, t.payload(i), r.dtype, r.shape, keep_payload=(i % 2 == 0))
        s = w.finish()
        assert s.root == t.root, alg
        assert _inspect(run_moeconf, y)["root"] == t.root.hex()
        assert run_moeconf("diff", x, y, check=False).returncode == 0


def test_recomputed_marker_is_read_by_rust_and_leaves_the_root(run_moeconf, tmp_path):
    """The Python writer's ``moeconf.recomputed`` note (docs/format.md 5.2.1): Rust inspect
    reports it, the root is that of the unmarked trace, and a malformed note is refused by both
    readers (exit 2 from Rust)."""
    from moeconf.binding import RECOMPUTED_NOTE
    from moeconf.trace import TraceFormatError
    import pytest

    plain, marked, bad = tmp_path / "plain.bin", tmp_path / "marked.bin", tmp_path / "bad.bin"
    items, s0 = _write_sample(plain)
    t = read_trace(plain)
    bad_prov = Provenance("pytest", "1", 1, [(RECOMPUTED_NOTE, "moe term")])
    # The Python writer itself refuses the malformed note (writers obey the reader) ...
    with pytest.raises(ValueError, match=RECOMPUTED_NOTE):
        TraceWriter(bad, t.binding, bad_prov)
    assert not bad.exists()
    # ... so a foreign writer is simulated by switching that check off for one write.
    import moeconf.trace as trace_mod

    def unchecked_header(binding, provenance):
        e = trace_mod.Encoder()
        binding.encode(e)
        provenance.encode(e)
        return e.bytes()

    for path, prov in ((marked, Provenance("pytest", "1", 1).with_recomputed(["moe.term.*"])),
                       (bad, bad_prov)):
        check = trace_mod.check_header
        if path == bad:
            trace_mod.check_header = unchecked_header
        try:
            w = TraceWriter(path, t.binding, prov)
        finally:
            trace_mod.check_header = check
        for coord, lv, arr in items:
            w.append(coord, lv, arr, keep_payload=True)
        s = w.finish()
        assert s.root == s0.root
    doc = _inspect(run_moeconf, marked)
    assert doc["provenance"]["recomputed"] == ["moe.term.*"]
    assert doc["root"] == s0.root.hex()
    assert _inspect(run_moeconf, plain)["provenance"]["recomputed"] == []
    assert read_trace(marked).provenance.is_recomputed("moe.term.3")
    from moeconf.__main__ import main as py_main
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert py_main(["inspect", str(marked)]) == 0
    assert json.loads(buf.getvalue())["provenance"]["recomputed"] == ["moe.term.*"]
    assert not read_trace(marked).provenance.is_recomputed("moe.shared")
    p = run_moeconf("inspect", bad, check=False)
    assert p.returncode == 2 and RECOMPUTED_NOTE in p.stderr, p.stderr
    with pytest.raises(TraceFormatError, match=RECOMPUTED_NOTE):
        read_trace(bad)


def test_python_reads_rust_version_4_paged_trace(run_moeconf, tmp_path):
    """A long prompt's layer groups are longer than a page: ``moeconf run`` writes them
    paged (format version 4, docs/format.md section 11.9); Python reads every page, checks
    it and recomputes every group digest, and reads the same records as the version 3
    conversion; a page falsified in one byte is refused."""
    import pytest
    import struct
    from collections import Counter

    from moeconf import v2
    from moeconf.trace import TraceFormatError

    x = tmp_path / "long.bin"
    run_moeconf("run", "--model", "builtin:tiny-v4", "--prompt-tokens", "300", "--max-new-tokens", "1",
                "--capture", "L0,L4", "-o", x)
    doc = _inspect(run_moeconf, x)
    t = read_trace(x)
    assert t.format_version == 4
    assert t.root.hex() == doc["root"]
    assert len(t.records) == doc["records"]["total"]
    sizes = Counter((r.coord.step, r.level, r.coord.layer) for r in t.records)
    assert max(sizes.values()) * 32 + 45 > v2.PAGE_BYTES, "no group long enough to be paged"
    y = tmp_path / "v3.bin"
    run_moeconf("convert", x, "-o", y, "--to", "3")
    t3 = read_trace(y)
    assert t3.format_version == 3 and t3.root == t.root
    assert [(r.coord, r.digest) for r in t3.records] == [(r.coord, r.digest) for r in t.records]
    # A page block's entry count raised by one: the page no longer decodes (or holds
    # more records than its layout) even with its block digest recomputed; here the
    # digest is not, so the page table's reference refuses it first.
    b = bytearray(x.read_bytes())
    head = struct.pack("<III", v2.KIND_PAGE, 0, 4)  # a page block of step 0, level L4, a layer, page 0

    def page_block(o):
        return (b[o:o + 12] == head and b[o + 12] == 1 and struct.unpack_from("<I", b, o + 17)[0] == 0
                and 1000 < struct.unpack_from("<Q", b, o + 21)[0] < 10**6)

    at = next(o for o in range(64, len(b), 64) if page_block(o))
    b[at + 40] ^= 0x01
    z = tmp_path / "bad.bin"
    z.write_bytes(bytes(b))
    with pytest.raises(TraceFormatError, match="page"):
        read_trace(z)
