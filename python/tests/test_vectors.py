"""The package against the pinned vectors of fixtures/test-vectors (docs/format.md section 8)."""

import json
import os

import pytest

from moeconf import Coord, canonicalize, read_trace, record_digest, record_prefix
from moeconf.fingerprint import hash_bytes


def _vectors(repo):
    with open(os.path.join(repo, "fixtures", "test-vectors", "fingerprint.json")) as f:
        return json.load(f)["records"]


def test_every_record_vector(repo):
    cases = _vectors(repo)
    assert len(cases) >= 5
    for r in cases:
        canon = canonicalize(r["dtype"], bytes.fromhex(r["input_hex"]), r["fold_negative_zero"])
        assert canon.hex() == r["canonical_hex"], r["name"]
        c = r["coord"]
        coord = Coord.make(c["step"], c["position"], c["phase"], c["layer"], c["path"])
        pre = record_prefix(coord, r["level"], r["dtype"], r["shape"], len(canon)) + canon
        assert pre.hex() == r["preimage_hex"], r["name"]
        for alg in ("blake3", "sha256"):
            assert hash_bytes(alg, pre).hex() == r[alg], (r["name"], alg)
            assert record_digest(alg, coord, r["level"], r["dtype"], r["shape"], canon).hex() == r[alg]


def test_vectors_cover_every_dtype_and_both_policies(repo):
    cases = _vectors(repo)
    assert {r["dtype"] for r in cases} >= {"f32", "bf16", "f64", "i32", "i64", "u32", "u8"}
    assert {r["fold_negative_zero"] for r in cases} == {False, True}


@pytest.mark.parametrize("key,version", [("file", 1), ("file_v2", 2)])
def test_minimal_trace_root(repo, key, version):
    d = os.path.join(repo, "fixtures", "test-vectors")
    with open(os.path.join(d, "minimal-trace.json")) as f:
        pinned = json.load(f)
    t = read_trace(os.path.join(d, pinned[key]))
    assert t.format_version == version
    assert t.algorithm == pinned["algorithm"]
    assert t.root.hex() == pinned["root"]
    assert len(t.records) == pinned["records"]
    assert t.payload_count() == pinned["payloads"]
    # The one payload is the f32 logits with -0 kept and the NaN canonicalized.
    (i,) = [i for i, r in enumerate(t.records) if r.payload is not None]
    assert t.payload(i).hex() == "0000803f000000800000c07f"


@pytest.mark.parametrize("dtype,raw,fold,want", [
    ("f32", "0100807f", False, "0000c07f"),          # signalling NaN -> quiet NaN
    ("f32", "00000080", True, "00000000"),           # -0 folded
    ("f32", "00000080", False, "00000080"),          # -0 kept
    ("bf16", "c1ff", False, "c07f"),
    ("f64", "010000000000f0ff", False, "000000000000f87f"),
    ("f32", "0000807f0000000001000000", True, "0000807f0000000001000000"),  # inf, +0, subnormal unchanged
    ("i32", "00000080", True, "00000080"),           # integers never change
])
def test_canonicalization_rules(dtype, raw, fold, want):
    assert canonicalize(dtype, bytes.fromhex(raw), fold).hex() == want
