"""moeconf.catalogue against its source of truth, fingerprint/src/catalogue.rs (the ``SPECS``
rows: path, level, value kind, half, rank, layer kinds, presence) and docs/format.md (the named
capture sets). Reads the Rust source as text: no build needed."""

import os
import re

import numpy as np
import pytest

from moeconf import catalogue as cat

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

_KIND = {"Float": "float", "Ids": "ids", "Count": "count", "Text": "text"}
_HALF = {"None": None, "Some(ATT)": "attn", "Some(FFN)": "ffn"}
_LAYERS = {"ALL": "all", "CMP": "cmp", "CSA": "csa", "LayerKinds::SCORE_ROUTED": "score"}
_PRESENCE = {"": "always", "capture_only": "capture_only", "quantized": "quantized",
             "quantized_on_emit": "quantized_on_emit", "on_emit": "on_emit", "append_only": "always"}


def _rust_rows():
    src = open(os.path.join(REPO, "fingerprint", "src", "catalogue.rs"), encoding="utf-8").read()
    body = src[src.index("pub const SPECS"):]
    body = body[:body.index("\n];")]
    rows = []
    for m in re.finditer(r"(?:(\w+)\()?spec\(\s*C::\w+,\s*\"([^\"]+)\",\s*(L\d),\s*(\w+),\s*([^,]+),\s*(\d+),"
                         r"\s*([^,]+),", body):
        wrap, path, level, kind, half, rank, layers = m.groups()
        rows.append(cat.Component(path, level, _KIND[kind], None, _HALF[half.strip()], int(rank),
                                  _LAYERS[layers.strip()], _PRESENCE[wrap or ""]))
    return rows


def test_every_row_matches_the_rust_catalogue():
    rust = _rust_rows()
    assert len(rust) == len(cat.COMPONENTS) > 60
    for r, p in zip(rust, cat.COMPONENTS):
        assert (r.path, r.level, r.kind, r.half, r.rank, r.layers, r.presence) == \
               (p.path, p.level, p.kind, p.half, p.rank, p.layers, p.presence), p.path


def test_groups_and_ranks():
    for c in cat.COMPONENTS:
        want = "state" if c.path.startswith("state.") else ("layer" if c.half else "step")
        assert c.group == want, c.path
    for g in ("step", "layer", "state"):
        ranks = [c.rank for c in cat.COMPONENTS if c.group == g]
        assert sorted(ranks) == list(range(len(ranks))), g


def test_capture_sets_are_the_documented_ones():
    doc = " ".join(open(os.path.join(REPO, "docs", "format.md"), encoding="utf-8").read().split())
    documented = {m.group(1): (int(m.group(2), 2), int(m.group(3), 2))
                  for m in re.finditer(r"`(\w+)` 0b([01]{5}) / (?:0b)?([01]+)", doc)}
    assert documented == cat.CAPTURE_SETS
    assert cat.capture_set("replay")[1] == cat.parse_levels(cat.REPLAY_PAYLOAD_LEVELS)
    with pytest.raises(ValueError, match="unknown capture set 'everything'"):
        cat.capture_set("everything")


def test_lookup_families_and_refusals():
    assert cat.lookup("moe.term.3")[1] == 3 and cat.lookup("moe.term.3")[0].path == "moe.term."
    assert cat.lookup("router.topk")[0].dtype is np.int32
    for bad in ("moe.term.", "moe.term.03", "moe.term.x", "router.top", "", None, "moe.term.٣"):
        assert cat.lookup(bad) is None, bad
    with pytest.raises(ValueError, match="not a record path"):
        cat.component("router.top")
    assert set(cat.SHAPES) <= {c.path for c in cat.COMPONENTS}


def test_captures_share_the_catalogue_helpers():
    from moeconf import capture, vllm

    assert capture.parse_levels is cat.parse_levels and capture.LEVEL_BITS is cat.LEVEL_BITS
    assert capture._lm_records is cat.lm_records and vllm._lm_records is cat.lm_records
    assert capture.NOT_CAPTURED_NOTE == vllm.NOT_CAPTURED_NOTE == cat.NOT_CAPTURED_NOTE
    recs, top = cat.lm_records(np.array([1.0, 3.0, 3.0, -1.0], np.float32))
    assert top == 1 and recs[1][1].tolist() == [1, 2, 0, 3] and recs[3][1].tolist() == [0.0]
    with pytest.raises(ValueError, match="separator"):
        cat.not_captured_note({"attn.kv": "a; b"})
