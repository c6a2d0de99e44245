"""The component catalogue (docs/format.md section 6) and the capture sets, for Python captures.

This is the Python form of the rows of ``fingerprint/src/catalogue.rs`` a capture needs: each
record path's level, value kind (which decides the stored dtype: f32, i32, i64 or u8), execution
group and rank (the order in which a capture writes a step's records), the half-layer and layer
kinds that have it, and its presence (always, only where a compressor emits, only in profiles that
quantize activations, or capture-only). ``python/tests/test_catalogue.py`` checks every row against
the Rust source, so the two cannot drift apart silently.

It also holds what every capture shares (the level bits of the binding masks, :func:`parse_levels`,
the named capture sets of ``moeconf run --capture``, the ``lm.*`` records of a logits row and the
``moeconf.not_captured`` note), so that ``moeconf.capture`` (transformers), ``moeconf.vllm`` and
the generic ``moeconf.torch`` capture agree on them by construction rather than by copy.
Needs numpy only.
"""

from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

__all__ = ["LEVEL_BITS", "CAPTURE_SETS", "REPLAY_PAYLOAD_LEVELS", "LM_TOPK", "NOT_CAPTURED_NOTE", "Component",
           "COMPONENTS", "component", "lookup", "parse_levels", "capture_set", "lm_records", "not_captured_note",
           "SHAPES"]

#: Level name -> bit of the binding capture masks (bit i = level Li).
LEVEL_BITS = {"L0": 1, "L1": 2, "L2": 4, "L3": 8, "L4": 16}

#: The payload levels of the capture set ``replay`` (``moeconf run --capture replay``, docs/replay.md
#: section 3): payloads for L0-L3, L4 as fingerprints.
REPLAY_PAYLOAD_LEVELS = ("L0", "L1", "L2", "L3")

#: The named capture sets of ``moeconf run --capture`` as (capture_levels, capture_payload_levels)
#: masks (docs/format.md section 5.2): every level fingerprinted, payloads as named.
CAPTURE_SETS = {
    "default": (0b11111, 0b01010),
    "all": (0b11111, 0b11111),
    "fingerprints": (0b11111, 0b00000),
    "replay": (0b11111, 0b01111),
}

#: Entries of ``lm.topk_ids`` / ``lm.topk_logits``.
LM_TOPK = 8

#: The provenance note naming what a capture left out, with the reason (docs/format.md 5.2.2).
NOT_CAPTURED_NOTE = "moeconf.not_captured"


def parse_levels(levels):
    """A level mask from ``"all"``, an int mask, or an iterable of names (``["L0", "L3"]``)."""
    if levels == "all" or levels is None:
        return 0b11111
    if isinstance(levels, int):
        if not 0 <= levels <= 0b11111:
            raise ValueError(f"level mask {levels!r} is not a bit mask of L0..L4")
        return levels
    mask = 0
    for name in levels:
        if name not in LEVEL_BITS:
            raise ValueError(f"unknown level {name!r} (expected L0..L4)")
        mask |= LEVEL_BITS[name]
    return mask


def capture_set(name):
    """The (capture_levels, capture_payload_levels) masks of a named capture set
    (:data:`CAPTURE_SETS`); raises ValueError naming the known sets."""
    try:
        return CAPTURE_SETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown capture set {name!r} (expected one of {', '.join(CAPTURE_SETS)})") from None


def lm_records(logits):
    """``lm.logits``, ``lm.topk_ids``, ``lm.topk_logits``, ``lm.margin`` and the greedy id
    (ties to the lowest id) from one f32 logits row."""
    order = np.argsort(-logits.astype(np.float64), kind="stable")  # descending, ties -> lower id
    top = order[:LM_TOPK]
    margin = np.float32(logits[order[0]]) - np.float32(logits[order[1]]) if logits.size > 1 else np.float32(0)
    recs = [("lm.logits", logits.astype(np.float32)),
            ("lm.topk_ids", top.astype(np.int32)),
            ("lm.topk_logits", logits[top].astype(np.float32)),
            ("lm.margin", np.array([margin], dtype=np.float32))]
    return recs, int(order[0])


def not_captured_note(items):
    """The ``moeconf.not_captured`` note value of ``{pattern: reason}`` (insertion order). A reason
    may not hold ``"; "``, the note's item separator (it would split the item)."""
    for p, why in items.items():
        if "; " in why:
            raise ValueError(f"{NOT_CAPTURED_NOTE}: the reason for {p!r} holds '; ', the note's item separator")
    return "; ".join(f"{a}: {b}" for a, b in items.items())


class Component(NamedTuple):
    """One catalogue row. ``path`` ends in ``.`` for a family (``moe.term.`` names ``moe.term.J``);
    ``group`` is ``step`` (model-global records of a step, in ``rank`` order), ``layer`` (one
    layer's operators) or ``state`` (one layer's persistent state at the decode boundary);
    ``kind`` is ``float``, ``ids``, ``count`` or ``text``; ``layers`` ``all``, ``cmp`` (CSA and
    HCA layers), ``csa`` or ``score`` (score-routed MoE layers); ``presence`` ``always``,
    ``on_emit``, ``quantized``, ``quantized_on_emit`` or ``capture_only``."""

    path: str
    level: str
    kind: str
    group: str
    half: Optional[str]
    rank: int
    layers: str
    presence: str

    @property
    def is_family(self):
        return self.path.endswith(".")

    @property
    def dtype(self):
        """The dtype a capture stores: f32 / i32 / i64 / u8."""
        return {"float": np.float32, "ids": np.int32, "count": np.int64, "text": np.uint8}[self.kind]


def _rows():
    s, lay, st = "step", "layer", "state"
    A, F = "attn", "ffn"
    rows = [
        ("token.input", "L0", "ids", s, None, 0, "all", "always"),
        ("embed.output", "L4", "float", s, None, 1, "all", "always"),
        ("token.output", "L0", "ids", s, None, 6, "all", "always"),
        ("text.continuation", "L0", "text", s, None, 7, "all", "always"),
        ("lm.logits", "L1", "float", s, None, 2, "all", "always"),
        ("lm.topk_ids", "L1", "ids", s, None, 3, "all", "always"),
        ("lm.topk_logits", "L1", "float", s, None, 4, "all", "always"),
        ("lm.margin", "L1", "float", s, None, 5, "all", "always"),
        ("state.cumulative_length", "L2", "count", st, None, 0, "all", "always"),
        ("state.window_kv", "L2", "float", st, None, 1, "all", "always"),
        ("state.compressor.buffer_kv", "L2", "float", st, None, 2, "cmp", "always"),
        ("state.compressor.buffer_gate", "L2", "float", st, None, 3, "cmp", "always"),
        ("state.compressor.compressed_kv", "L2", "float", st, None, 4, "cmp", "always"),
        ("state.compressor.entry_count", "L2", "count", st, None, 5, "cmp", "always"),
        ("state.compressor.overlap_kv", "L2", "float", st, None, 6, "csa", "always"),
        ("state.compressor.overlap_gate", "L2", "float", st, None, 7, "csa", "always"),
        ("state.indexer.buffer_kv", "L2", "float", st, None, 8, "csa", "always"),
        ("state.indexer.buffer_gate", "L2", "float", st, None, 9, "csa", "always"),
        ("state.indexer.compressed_kv", "L2", "float", st, None, 10, "csa", "always"),
        ("state.indexer.entry_count", "L2", "count", st, None, 11, "csa", "always"),
        ("state.indexer.overlap_kv", "L2", "float", st, None, 12, "csa", "always"),
        ("state.indexer.overlap_gate", "L2", "float", st, None, 13, "csa", "always"),
        ("attn.hc_pre_weights", "L4", "float", lay, A, 0, "all", "always"),
        ("attn.hc_post_weights", "L4", "float", lay, A, 1, "all", "always"),
        ("attn.hc_comb", "L4", "float", lay, A, 2, "all", "always"),
        ("attn.hc_pre", "L4", "float", lay, A, 3, "all", "always"),
        ("attn.norm", "L4", "float", lay, A, 4, "all", "always"),
        ("attn.norm_fp8", "L4", "float", lay, A, 5, "all", "quantized"),
        ("attn.q_lat_fp8", "L4", "float", lay, A, 6, "all", "quantized"),
        ("attn.q", "L4", "float", lay, A, 7, "all", "always"),
        ("attn.kv", "L4", "float", lay, A, 8, "all", "always"),
        ("attn.kv_fp8", "L4", "float", lay, A, 9, "all", "quantized"),
        ("attn.compressed", "L4", "float", lay, A, 10, "cmp", "on_emit"),
        ("attn.compressed_fp8", "L4", "float", lay, A, 11, "cmp", "quantized_on_emit"),
        ("attn.indexer_compressed", "L4", "float", lay, A, 12, "csa", "on_emit"),
        ("attn.indexer_compressed_fp4", "L4", "float", lay, A, 13, "csa", "quantized_on_emit"),
        ("attn.indexer_read", "L4", "float", lay, A, 14, "csa", "always"),
        ("attn.indexer_q_fp4", "L4", "float", lay, A, 15, "csa", "quantized"),
        ("attn.indexer_scores", "L4", "float", lay, A, 16, "csa", "always"),
        ("attn.indexer_topk", "L4", "ids", lay, A, 17, "csa", "always"),
        ("attn.window_read", "L4", "float", lay, A, 18, "all", "always"),
        ("attn.compressed_read", "L4", "float", lay, A, 19, "cmp", "always"),
        ("attn.core", "L4", "float", lay, A, 20, "all", "always"),
        ("attn.o_lat_fp8", "L4", "float", lay, A, 21, "all", "quantized"),
        ("attn.output", "L4", "float", lay, A, 22, "all", "always"),
        ("layer.post_attn_mhc", "L3", "float", lay, A, 23, "all", "always"),
        ("ffn.hc_pre_weights", "L4", "float", lay, F, 24, "all", "always"),
        ("ffn.hc_post_weights", "L4", "float", lay, F, 25, "all", "always"),
        ("ffn.hc_comb", "L4", "float", lay, F, 26, "all", "always"),
        ("ffn.hc_pre", "L4", "float", lay, F, 27, "all", "always"),
        ("ffn.norm", "L4", "float", lay, F, 28, "all", "always"),
        ("ffn.norm_fp8", "L4", "float", lay, F, 29, "all", "quantized"),
        ("router.scores", "L3", "float", lay, F, 30, "all", "always"),
        ("router.topk", "L3", "ids", lay, F, 31, "all", "always"),
        ("router.gates", "L3", "float", lay, F, 32, "all", "always"),
        ("router.margin", "L3", "float", lay, F, 33, "score", "always"),
        ("moe.term_h_fp8.", "L4", "float", lay, F, 34, "all", "quantized"),
        ("moe.term.", "L4", "float", lay, F, 35, "all", "always"),
        ("moe.routed", "L4", "float", lay, F, 36, "all", "capture_only"),
        ("moe.shared_h_fp8", "L4", "float", lay, F, 37, "all", "quantized"),
        ("moe.shared", "L4", "float", lay, F, 38, "all", "always"),
        ("moe.combine", "L4", "float", lay, F, 39, "all", "always"),
        ("layer.post_ffn_mhc", "L3", "float", lay, F, 40, "all", "always"),
    ]
    # docs/format.md marks the state.compressor.* rows and attn.indexer_read / compressed_kv
    # append-only; a capture does not need that.
    return [Component(*r) for r in rows]


#: Every catalogue row, in the order of ``fingerprint/src/catalogue.rs`` ``SPECS``.
COMPONENTS: List[Component] = _rows()
_BY_PATH: Dict[str, Component] = {c.path: c for c in COMPONENTS}

#: The per-position value shape of the per-layer records (and ``embed.output``) with a fixed
#: shape, in the symbols of docs/format.md section 6: D hidden size, N residual streams
#: (``hc_mult``), H attention heads, d head dimension, d_I indexer head dimension, E routed
#: experts, k experts per token. Records of variable length (window and cache reads, indexer
#: scores and selections, the quantization sites' hidden activations) are absent.
SHAPES: Dict[str, Tuple[str, ...]] = {
    "embed.output": ("D",),
    "attn.hc_pre_weights": ("N",), "attn.hc_post_weights": ("N",), "attn.hc_comb": ("N", "N"),
    "attn.hc_pre": ("D",), "attn.norm": ("D",), "attn.norm_fp8": ("D",), "attn.q": ("H", "d"),
    "attn.kv": ("d",), "attn.kv_fp8": ("d",), "attn.core": ("H", "d"), "attn.output": ("D",),
    "layer.post_attn_mhc": ("N", "D"),
    "ffn.hc_pre_weights": ("N",), "ffn.hc_post_weights": ("N",), "ffn.hc_comb": ("N", "N"),
    "ffn.hc_pre": ("D",), "ffn.norm": ("D",), "ffn.norm_fp8": ("D",),
    "router.scores": ("E",), "router.topk": ("k",), "router.gates": ("k",), "router.margin": (1,),
    "moe.term.": ("D",), "moe.routed": ("D",), "moe.shared": ("D",), "moe.combine": ("D",),
    "layer.post_ffn_mhc": ("N", "D"),
}


def lookup(path) -> Optional[Tuple[Component, Optional[int]]]:
    """The catalogue row of a record path and, for a family member (``moe.term.3``), its index;
    None when the path is not in the catalogue."""
    if not isinstance(path, str):
        return None
    c = _BY_PATH.get(path)
    if c is not None and not c.is_family:
        return c, None
    head, dot, tail = path.rpartition(".")
    fam = _BY_PATH.get(head + dot) if dot else None
    if fam is not None and fam.is_family and tail.isdigit() and tail.isascii() and (tail == "0" or tail[0] != "0"):
        return fam, int(tail)
    return None


def component(path) -> Component:
    """The catalogue row of ``path`` (a record path, or a family's prefix such as ``moe.term.``);
    raises ValueError naming the path."""
    c = _BY_PATH.get(path)
    if c is not None:
        return c
    hit = lookup(path)
    if hit is None:
        raise ValueError(f"{path!r} is not a record path of the component catalogue (docs/format.md section 6)")
    return hit[0]
