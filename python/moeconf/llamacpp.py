"""Capture a canonical moeconf trace from llama.cpp's DeepSeek-V4 (architecture ``deepseek4``)
through ``llama-cpp-python`` (docs/interop-llamacpp.md).

:func:`capture` loads a GGUF written by ``moeconf export gguf`` (the checkpoint the reference
runtime runs, verified bit for bit), tokenizes the prompt with llama.cpp's own tokenizer, decodes
greedily (step 0 = one ``llama_decode`` of the whole prompt, step s >= 1 = one decode of the
generated token g_s) and records what llama.cpp's graph evaluation callback (``cb_eval``) shows:
every named ggml node as it is computed, read with ``ggml_backend_tensor_get`` through a ctypes
definition of ``struct ggml_tensor`` whose size is checked against ``ggml_tensor_overhead()``.

Mapping (:data:`NODE_RULES`): a node name is ``<base>-<layer>`` (``cb(t, name, il)``); names
collide (the attention and FFN halves of a layer share ``hc_pre``, ``hc_post``, ``hc_comb``;
several internal nodes are called ``norm``), so a rule keys on ``(base, op, occurrence)``, the
occurrence counted in graph order among the layer's nodes of that base and op. Only the nodes a
rule names are observed (the callback answers ``ask`` with False for every other node), so the
scheduler's graph splits never separate llama.cpp's CPU fusion (RMS_NORM + MUL is fused; no
observed node is an RMS_NORM).

Records are observed unless :data:`RECOMPUTED` lists them (the trace's ``moeconf.recomputed``
note, docs/format.md section 5.2.1). Components llama.cpp computes inside fused kernels or stores
in another basis are not captured, and the trace says so (:data:`NOT_CAPTURED`, provenance note
``moeconf.not_captured``): they are never guessed.

Requires ``llama-cpp-python`` (imported lazily) and ``gguf``; the mapping, the GGUF checks and the
struct layout are testable without llama.cpp (python/tests/test_llamacpp.py).
"""

import ctypes
import json
import os
import re
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .binding import Provenance
from .fingerprint import Coord
from .trace import TraceWriter, WriteSummary

__all__ = ["capture", "CaptureResult", "NodeRule", "NODE_RULES", "RECOMPUTED", "NOT_CAPTURED",
           "NOT_CAPTURED_NOTE", "LlamaCppError", "GgmlTensor", "check_gguf", "GgufModel",
           "split_name", "StepNodes", "assemble_layer", "layer_state_records", "check_tensor_struct",
           "LEVEL_BITS", "Knobs", "check_knobs", "parse_batch_with_json", "ContextSizes", "context_sizes",
           "split_ubatches", "Entry", "step_entries", "chunks", "describe_composition", "knob_notes", "TRACED_SEQ"]

#: Level name -> bit of the binding capture masks (as moeconf.capture).
LEVEL_BITS = {"L0": 1, "L1": 2, "L2": 4, "L3": 8, "L4": 16}
#: Entries of ``lm.topk_ids`` / ``lm.topk_logits``.
LM_TOPK = 8
#: The provenance note listing what the capture could not observe: ``path: reason`` items
#: separated by ``; `` (docs/format.md section 5.2.2).
NOT_CAPTURED_NOTE = "moeconf.not_captured"


class LlamaCppError(ValueError):
    """A GGUF, a llama.cpp build or a capture that cannot give a faithful trace; the message names
    the file or node and what is wrong."""


class NodeRule(NamedTuple):
    """One ggml node -> one moeconf record: the node's base name, ggml op and occurrence among
    the layer's nodes of that (base, op) in graph order, the record path (``moe.term.*`` for the
    k slots of ``ffn_moe_weighted``), its level and the per-token record shape (``None``: the
    rule has its own assembly)."""

    base: str
    op: str
    occurrence: int
    path: str
    level: str
    shape: Optional[Tuple[int, ...]]


def _rules(cfg):
    """The rules of a model (shapes from its dimensions)."""
    d, n, h, hd, e, k = cfg.hidden, cfg.hc_mult, cfg.n_head, cfg.head_dim, cfg.n_expert, cfg.k
    return [
        NodeRule("hc_pre", "SCALE", 0, "attn.hc_pre_weights", "L4", (n,)),
        NodeRule("hc_post", "SCALE", 0, "attn.hc_post_weights", "L4", (n,)),
        NodeRule("hc_comb", "DSV4_HC_COMB", 0, "attn.hc_comb", "L4", (n, n)),
        NodeRule("hc_attn_pre", "DSV4_HC_PRE", 0, "attn.hc_pre", "L4", (d,)),
        NodeRule("attn_norm", "MUL", 0, "attn.norm", "L4", (d,)),
        NodeRule("q", "ROPE", 0, "attn.q", "L4", (h, hd)),
        NodeRule("kv", "ROPE", 0, "attn.kv", "L4", (hd,)),
        NodeRule("csa_state_compress", "ROPE", 0, "attn.compressed", "L4", None),
        NodeRule("hca_state_compress", "ROPE", 0, "attn.compressed", "L4", None),
        NodeRule("lid_state_compress", "ROPE", 0, "attn.indexer_compressed", "L4", None),
        NodeRule("lid_score_masked", "LIGHTNING_INDEXER", 0, "attn.indexer_scores", "L4", None),
        NodeRule("lid_top_k", "CONT", 0, "attn.indexer_topk", "L4", None),
        NodeRule("attn_raw", "*", 0, "attn.core", "L4", (h, hd)),
        NodeRule("attn_csa_lid", "*", 0, "attn.core", "L4", (h, hd)),
        NodeRule("attn_hca", "*", 0, "attn.core", "L4", (h, hd)),
        NodeRule("attn_out", "MUL_MAT", 0, "attn.output", "L4", (d,)),
        NodeRule("hc_attn_post", "DSV4_HC_POST", 0, "layer.post_attn_mhc", "L3", (n, d)),
        NodeRule("hc_pre", "SCALE", 1, "ffn.hc_pre_weights", "L4", (n,)),
        NodeRule("hc_post", "SCALE", 1, "ffn.hc_post_weights", "L4", (n,)),
        NodeRule("hc_comb", "DSV4_HC_COMB", 1, "ffn.hc_comb", "L4", (n, n)),
        NodeRule("hc_ffn_pre", "DSV4_HC_PRE", 0, "ffn.hc_pre", "L4", (d,)),
        NodeRule("ffn_norm", "MUL", 0, "ffn.norm", "L4", (d,)),
        NodeRule("ffn_moe_probs", "SQRT", 0, "router.scores", "L3", (e,)),
        NodeRule("ffn_moe_topk", "*", 0, "router.topk", "L3", (k,)),
        NodeRule("ffn_moe_weights_scaled", "SCALE", 0, "router.gates", "L3", (k,)),
        NodeRule("ffn_moe_probs_biased", "ADD", 0, "router.margin", "L3", None),
        NodeRule("ffn_moe_weighted", "MUL", 0, "moe.term.*", "L4", (k, d)),
        NodeRule("ffn_moe_out", "ADD", 0, "moe.routed", "L4", (d,)),
        NodeRule("ffn_shexp", "MUL_MAT", 0, "moe.shared", "L4", (d,)),
        NodeRule("ffn_out", "ADD", 0, "moe.combine", "L4", (d,)),
        NodeRule("l_last", "DSV4_HC_POST", 0, "layer.post_ffn_mhc", "L3", (n, d)),
    ]


#: The rules' node bases (without shapes), for the documentation table and tests.
NODE_RULES = [(r.base, r.op, r.occurrence, r.path) for r in _rules(
    type("Dims", (), dict(hidden=1, hc_mult=1, n_head=1, head_dim=1, n_expert=1, k=1)))]

#: Records the capture derives from observed nodes rather than reads (docs/format.md 5.2.1):
#: ``router.margin`` (rank k minus rank k+1 of the observed selection scores
#: ``ffn_moe_probs_biased``), ``attn.indexer_topk`` (the observed selection set, ordered by the
#: observed scores: ggml's top_k returns an unspecified order, its first two swapped on purpose,
#: ggml-cpu/ops.cpp ``ggml_compute_forward_top_k_f32``), and the L2 counters.
RECOMPUTED = ["router.margin", "attn.indexer_topk", "state.cumulative_length",
              "state.compressor.entry_count", "state.indexer.entry_count"]

#: What the capture cannot observe, with the reason (the ``moeconf.not_captured`` note).
NOT_CAPTURED = {
    "attn.window_read": "the sliding-window cache is read inside the attention graph from an F16 "
                        "cache whose cell order the callback does not expose",
    "attn.compressed_read": "compressed entries are read through a mask over the whole compressed "
                            "cache (no gathered read tensor)",
    "attn.indexer_read": "indexer keys are stored Hadamard-rotated (lid_state_compress_rot), "
                         "not in the reference's basis",
    "state.compressor.buffer_gate": "the compressor state stores gate + ape, not the raw gate",
    "state.indexer.buffer_gate": "the indexer compressor state stores gate + ape, not the raw gate",
    "state.indexer.compressed_kv": "indexer entries are stored Hadamard-rotated",
}

#: Inside llama.cpp's fused kernels (not records of the catalogue, listed in the report): the
#: mHC collapse sum and the Sinkhorn iterations (DSV4_HC_PRE, DSV4_HC_COMB), the post mixing
#: (DSV4_HC_POST), per-head indexer scores (LIGHTNING_INDEXER), SWIGLU_CLAMP.
FUSED_OPS = ("DSV4_HC_PRE", "DSV4_HC_COMB", "DSV4_HC_POST", "LIGHTNING_INDEXER", "SWIGLU_CLAMP")

#: Per (layer, position), the records in the reference runtime's execution order
#: (docs/operators.md section 5).
LAYER_ORDER = ["attn.hc_pre_weights", "attn.hc_post_weights", "attn.hc_comb", "attn.hc_pre", "attn.norm",
               "attn.q", "attn.kv", "attn.compressed", "attn.indexer_compressed", "attn.indexer_scores",
               "attn.indexer_topk", "attn.core", "attn.output", "layer.post_attn_mhc",
               "ffn.hc_pre_weights", "ffn.hc_post_weights", "ffn.hc_comb", "ffn.hc_pre", "ffn.norm",
               "router.scores", "router.topk", "router.gates", "router.margin", "moe.term.*",
               "moe.routed", "moe.shared", "moe.combine", "layer.post_ffn_mhc"]


# --------------------------------------------------------------------------- ggml structures

class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of the vendored ggml (ggml/include/ggml.h; GGML_MAX_DIMS 4,
    GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64). :func:`check_tensor_struct`
    compares its size with the library's ``ggml_tensor_overhead()``."""


GgmlTensor._fields_ = [
    ("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
    ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GgmlTensor) * 10), ("view_src", ctypes.POINTER(GgmlTensor)),
    ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
    ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8),
]

#: ``sizeof(struct ggml_object)`` (offs, size, next, type, padding[4]): ggml_tensor_overhead() is
#: GGML_OBJECT_SIZE + GGML_TENSOR_SIZE.
GGML_OBJECT_SIZE = 32

#: ggml types the capture reads: id -> numpy dtype.
GGML_DTYPES = {0: np.float32, 1: np.float16, 26: np.int32, 27: np.int64}


def check_tensor_struct(overhead):
    """Fails unless ``sizeof(GgmlTensor) + GGML_OBJECT_SIZE`` equals the library's
    ``ggml_tensor_overhead()`` (a ggml whose tensor struct changed would be read wrongly)."""
    size = ctypes.sizeof(GgmlTensor)
    if size + GGML_OBJECT_SIZE != overhead:
        raise LlamaCppError(f"ggml_tensor_overhead() is {overhead} but the ctypes struct ggml_tensor is {size} "
                            f"bytes (+{GGML_OBJECT_SIZE} for ggml_object): this ggml's tensor layout is not the "
                            f"one the capture was written for")


def split_name(name):
    """``(base, layer)`` of a node name: ``"hc_pre-3"`` -> ``("hc_pre", 3)``; names without a
    layer suffix give ``(name, None)``."""
    m = re.fullmatch(r"(.+)-(\d+)", name)
    if m:
        return m.group(1), int(m.group(2))
    return name, None


# --------------------------------------------------------------------------- GGUF checks

class GgufModel(NamedTuple):
    """The dimensions of a ``deepseek4`` GGUF the capture needs."""

    path: str
    n_layer: int
    hidden: int
    hc_mult: int
    n_head: int
    head_dim: int
    n_expert: int
    k: int
    n_vocab: int
    ratios: List[int]
    n_hash: int
    index_head_dim: int
    index_topk: int
    window: int
    export_type: Optional[str]
    source_weights_digest: Optional[str]
    source_config_digest: Optional[str]
    source_tokenizer_digest: Optional[str]


def _field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    import gguf

    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.parts[i].tolist()[0] if f.types[-1] != gguf.GGUFValueType.STRING else bytes(f.parts[i]).decode()
                for i in f.data]
    if f.types and f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def _layer_tensors(il, ratio, hashed):
    """The tensor names llama.cpp's deepseek4 loader requires for layer ``il``
    (src/models/deepseek4.cpp load_arch_tensors)."""
    b = f"blk.{il}."
    names = [b + s for s in ("attn_norm.weight", "attn_sinks.weight", "attn_q_a.weight", "attn_q_a_norm.weight",
                             "attn_q_b.weight", "attn_kv.weight", "attn_kv_a_norm.weight", "attn_output_a.weight",
                             "attn_output_b.weight", "hc_attn_fn.weight", "hc_attn_base.weight",
                             "hc_attn_scale.weight", "hc_ffn_fn.weight", "hc_ffn_base.weight", "hc_ffn_scale.weight",
                             "ffn_gate_inp.weight", "ffn_norm.weight", "ffn_gate_exps.weight", "ffn_down_exps.weight",
                             "ffn_up_exps.weight", "ffn_gate_shexp.weight", "ffn_down_shexp.weight",
                             "ffn_up_shexp.weight")]
    names.append(b + ("ffn_gate_tid2eid.weight" if hashed else "exp_probs_b.bias"))
    if ratio:
        names += [b + s for s in ("attn_compressor_kv.weight", "attn_compressor_gate.weight",
                                  "attn_compressor_ape.weight", "attn_compressor_norm.weight")]
    if ratio == 4:
        names += [b + s for s in ("indexer.proj.weight", "indexer.attn_q_b.weight", "indexer_compressor_kv.weight",
                                  "indexer_compressor_gate.weight", "indexer_compressor_ape.weight",
                                  "indexer_compressor_norm.weight")]
    return names


def check_gguf(path):
    """Reads the metadata of ``path`` with the ``gguf`` package and checks that it is a
    ``deepseek4`` model llama.cpp can load and the capture can map: the architecture, the keys the
    loader reads, compress ratios 0/4/128, and every tensor the loader requires. Returns a
    :class:`GgufModel`; raises :class:`LlamaCppError` naming the file and the problem."""
    try:
        import gguf
    except ImportError as e:
        raise LlamaCppError(f"the gguf package is not importable ({e}); pip install gguf==0.19.0") from None

    path = os.fspath(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct.error on bad files
        raise LlamaCppError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _field(reader, "general.architecture")
    if arch != "deepseek4":
        raise LlamaCppError(f"{path}: general.architecture is {arch!r}, not 'deepseek4' (a GGUF of another model)")

    def need(key):
        v = _field(reader, "deepseek4." + key)
        if v is None:
            raise LlamaCppError(f"{path}: metadata key deepseek4.{key} is missing (llama.cpp's deepseek4 loader reads it)")
        return v

    def integer(key, v):
        # llama.cpp's loader reads these keys as integers; a string, float or bool of the same
        # name is refused there too (and int() would accept "12" or 1.5 here).
        if isinstance(v, bool) or not isinstance(v, int):
            raise LlamaCppError(f"{path}: metadata key deepseek4.{key} is {v!r} ({type(v).__name__}), "
                                "not an integer (llama.cpp's deepseek4 loader reads an integer)")
        return v

    def need_int(key):
        return integer(key, need(key))

    raw_ratios = need("attention.compress_ratios")
    if not isinstance(raw_ratios, list):
        raise LlamaCppError(f"{path}: metadata key deepseek4.attention.compress_ratios is {raw_ratios!r}, "
                            "not an array of integers")
    ratios = [integer("attention.compress_ratios", r) for r in raw_ratios]
    n_layer = need_int("block_count")
    if len(ratios) < n_layer:
        raise LlamaCppError(f"{path}: deepseek4.attention.compress_ratios has {len(ratios)} entries for {n_layer} layers")
    bad = sorted({r for r in ratios if r not in (0, 4, 128)})
    if bad:
        raise LlamaCppError(f"{path}: compress ratios {bad}: llama.cpp's deepseek4 loader accepts only 0, 4 and 128")
    m = GgufModel(
        path=path, n_layer=n_layer, hidden=need_int("embedding_length"), hc_mult=need_int("hyper_connection.count"),
        n_head=need_int("attention.head_count"), head_dim=need_int("attention.key_length"),
        n_expert=need_int("expert_count"), k=need_int("expert_used_count"),
        n_vocab=len(_field(reader, "tokenizer.ggml.tokens") or []), ratios=ratios[:n_layer],
        n_hash=need_int("hash_layer_count"), index_head_dim=need_int("attention.indexer.key_length"),
        index_topk=need_int("attention.indexer.top_k"), window=need_int("attention.sliding_window"),
        export_type=_field(reader, "moeconf.export.type"),
        source_weights_digest=_field(reader, "moeconf.source.weights_digest"),
        source_config_digest=_field(reader, "moeconf.source.config_digest"),
        source_tokenizer_digest=_field(reader, "moeconf.source.tokenizer_digest"))
    if m.hc_mult != 4:
        raise LlamaCppError(f"{path}: deepseek4.hyper_connection.count is {m.hc_mult}; llama.cpp's graph asserts 4")
    if 4 in m.ratios and m.index_head_dim % 64:
        raise LlamaCppError(f"{path}: deepseek4.attention.indexer.key_length {m.index_head_dim} is not a multiple of 64 "
                            "(llama.cpp's indexer Hadamard rotation aborts)")
    if m.n_vocab == 0:
        raise LlamaCppError(f"{path}: no tokenizer.ggml.tokens: llama.cpp cannot tokenize the prompt")
    names = {t.name for t in reader.tensors}
    required = ["token_embd.weight", "output_norm.weight", "output.weight", "output_hc_fn.weight",
                "output_hc_base.weight", "output_hc_scale.weight"]
    for il in range(n_layer):
        required += _layer_tensors(il, m.ratios[il], il < m.n_hash)
    missing = [n for n in required if n not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LlamaCppError(f"{path}: tensor {missing[0]} is missing{more}; llama.cpp's deepseek4 loader requires it")
    return m


def llama_supports_deepseek4(lib_dir):
    """Whether the libllama in ``lib_dir`` knows the ``deepseek4`` architecture (its name table
    holds the string; llama.cpp's own error would be 'unknown model architecture')."""
    for name in ("libllama.so", "libllama.dylib", "llama.dll"):
        p = os.path.join(lib_dir, name)
        if os.path.exists(p):
            with open(p, "rb") as f:
                return b"deepseek4\0" in f.read()
    raise LlamaCppError(f"{lib_dir}: no libllama shared library")


# --------------------------------------------------------------------------- mapping

class StepNodes:
    """The observed nodes of one ``llama_decode``: per (layer, base, op) the arrays in graph
    order (numpy, dimensions reversed from ggml's ``ne``)."""

    def __init__(self):
        self.nodes: Dict[Tuple[Optional[int], str, str], List[np.ndarray]] = {}

    def add(self, layer, base, op, arr):
        self.nodes.setdefault((layer, base, op), []).append(arr)

    def get(self, layer, base, op, occurrence=0):
        if op == "*":
            hits = [v for (l, b, _), v in self.nodes.items() if l == layer and b == base]
            seq = hits[0] if hits else []
        else:
            seq = self.nodes.get((layer, base, op), [])
        return seq[occurrence] if occurrence < len(seq) else None


def _rows(arr, n_rows, shape, what):
    """``arr`` as ``n_rows`` records of ``shape`` (the token dimension is ggml's outermost)."""
    per = int(np.prod(shape)) if shape else 1
    flat = np.ascontiguousarray(arr).reshape(-1)
    if flat.size != n_rows * per:
        raise LlamaCppError(f"node {what}: {flat.size} values, expected {n_rows} rows of {tuple(shape)}")
    return flat.reshape((n_rows,) + tuple(shape))


def assemble_layer(nodes, cfg, layer, positions, wanted=("L3", "L4"), layout=None):
    """The L3/L4 records of ``layer`` for the traced tokens at ``positions`` (one graph, i.e. one
    ubatch): ``{position: [(level, path, array)]}`` in :data:`LAYER_ORDER`. ``layout`` is the
    graph's rows in order as ``(seq_id, position)`` pairs (default: every row is the traced
    sequence's, ``[(0, p) for p in positions]``); only the rows of sequence 0, the traced one, are
    recorded, and ``positions`` must be theirs in order. Nodes a rule names but the graph did not
    show are errors (a llama.cpp build whose graph differs), except the alternatives of a rule
    (``attn_raw`` / ``attn_csa_lid`` / ``attn_hca``; the compressors)."""
    ratio = cfg.ratios[layer]
    hashed = layer < cfg.n_hash
    if layout is None:
        layout = [(0, p) for p in positions]
    layout = [(int(s), int(p)) for s, p in layout]
    sel = [j for j, (s, _) in enumerate(layout) if s == 0]
    if [layout[j][1] for j in sel] != list(positions):
        raise LlamaCppError(f"layer {layer}: the traced rows of the graph hold positions "
                            f"{[layout[j][1] for j in sel][:4]}..., not {list(positions)[:4]}...")
    traced = list(zip(sel, positions))
    nt = len(layout)
    out = {p: {} for p in positions}
    rules = _rules(cfg)

    def put(p, level, path, arr):
        if level in wanted:
            out[p][path] = (level, path, arr)

    core_seen = False
    for r in rules:
        arr = nodes.get(layer, r.base, r.op, r.occurrence)
        optional = r.base in ("attn_raw", "attn_csa_lid", "attn_hca", "csa_state_compress", "hca_state_compress",
                              "lid_state_compress", "lid_score_masked", "lid_top_k", "ffn_moe_probs_biased")
        if arr is None:
            if optional:
                continue
            raise LlamaCppError(f"layer {layer}: node {r.base}-{layer} ({r.op}, occurrence {r.occurrence}) was not "
                                f"computed: this llama.cpp's deepseek4 graph is not the one the mapping was written for")
        what = f"{r.base}-{layer}"
        if r.path == "attn.core":
            core_seen = True
        if r.shape is not None and r.path != "moe.term.*":
            rows = _rows(arr, nt, r.shape, what)
            dtype = np.int32 if r.path == "router.topk" else np.float32
            for j, p in traced:
                put(p, r.level, r.path, rows[j].astype(dtype))
        elif r.path == "moe.term.*":
            rows = _rows(arr, nt, r.shape, what)
            for j, p in traced:
                for s in range(cfg.k):
                    put(p, r.level, f"moe.term.{s}", rows[j, s].astype(np.float32))
        elif r.path == "router.margin":
            if hashed:
                continue
            rows = _rows(arr, nt, (cfg.n_expert,), what)
            for j, p in traced:
                top = np.sort(rows[j].astype(np.float32))[::-1]
                if top.size > cfg.k:
                    put(p, r.level, r.path, np.array([top[cfg.k - 1] - top[cfg.k]], dtype=np.float32))
        elif r.path in ("attn.compressed", "attn.indexer_compressed"):
            if ratio == 0 or (r.path == "attn.indexer_compressed" and ratio != 4):
                continue
            width = cfg.index_head_dim if r.path == "attn.indexer_compressed" else cfg.head_dim
            # One block per row that closes a window, in row order (every sequence's), then any
            # padding ("dummy") blocks (llama-kv-cache-dsv4.cpp dsv4_build_comp_plan: the graph
            # keeps its topology when no window closes, and pads each stream's block count).
            closing = [j for j, (_, p) in enumerate(layout) if (p + 1) % ratio == 0]
            block = {j: b for b, j in enumerate(closing)}
            flat = np.ascontiguousarray(arr).reshape(-1)
            n_blocks = flat.size // width
            if flat.size % width or n_blocks < len(closing):
                raise LlamaCppError(f"node {what}: {flat.size} values for {len(closing)} closing windows of {width}")
            rows = flat.reshape(n_blocks, width)
            for j, p in traced:
                if j in block:
                    put(p, r.level, r.path, rows[block[j]:block[j] + 1].astype(np.float32))
        elif r.path in ("attn.indexer_scores", "attn.indexer_topk"):
            if ratio != 4:
                continue
            scores_arr = nodes.get(layer, "lid_score_masked", "LIGHTNING_INDEXER", 0)
            if scores_arr is None:
                raise LlamaCppError(f"layer {layer}: lid_score_masked-{layer} was not computed")
            flat = np.ascontiguousarray(scores_arr).reshape(-1)
            n_lid = flat.size // nt
            srows = flat.reshape(nt, n_lid)
            if r.path == "attn.indexer_scores":
                for j, p in traced:
                    t = (p + 1) // ratio
                    put(p, r.level, r.path, srows[j, :t].astype(np.float32))
            else:
                kk = np.ascontiguousarray(arr).reshape(nt, -1)
                for j, p in traced:
                    t = (p + 1) // ratio
                    sel = [int(i) for i in kk[j] if 0 <= int(i) < t]  # masked (not yet visible) entries dropped
                    sel.sort(key=lambda i: (-float(srows[j, i]), i))
                    put(p, r.level, r.path, np.array(sel, dtype=np.int32))
    if not core_seen:
        raise LlamaCppError(f"layer {layer}: no attention output node (attn_raw/attn_csa_lid/attn_hca-{layer})")
    result = {}
    for p in positions:
        recs = []
        for path in LAYER_ORDER:
            if path == "moe.term.*":
                recs += [out[p][f"moe.term.{s}"] for s in range(cfg.k) if f"moe.term.{s}" in out[p]]
            elif path in out[p]:
                recs.append(out[p][path])
        result[p] = recs
    return result


def layer_state_records(nodes, cfg, layer, c, cells=None):
    """The L2 records of ``layer`` after ``c`` tokens, from the observed state tensors: the
    window cache (``cache_k_l<i>``, the SET_ROWS whose rows are the layer's ``kv``: the cell of
    each position is the index tensor the write used, collected in ``cells`` {position: cell}),
    the compressor rings (``dsv4_{csa,hca,lid}_state_{kv,score}_l<i>``, row ``p mod state_size``
    for position p; the score ring holds gate + ape) and the compressed cache (the SET_ROWS of
    ``cache_k_l<i>`` whose rows come from the compressor). ``[(path, array)]`` in
    docs/operators.md §4 order, without the records :data:`NOT_CAPTURED` lists."""
    ratio = cfg.ratios[layer]
    recs = [("state.cumulative_length", np.array([c], dtype=np.int64))]
    raw = nodes.get(None, f"raw_cache_l{layer}", "SET_ROWS")
    if raw is None or cells is None:
        raise LlamaCppError(f"layer {layer}: the window cache write was not observed")
    rows = np.ascontiguousarray(raw).reshape(-1, cfg.head_dim)
    keep = range(max(0, c - (cfg.window - 1)), c)
    missing = [p for p in keep if p not in cells or cells[p] >= rows.shape[0]]
    if missing:
        raise LlamaCppError(f"layer {layer}: no window cache cell known for position {missing[0]}")
    recs.append(("state.window_kv", np.stack([rows[cells[p]] for p in keep]).astype(np.float32) if keep
                 else np.zeros((0, cfg.head_dim), np.float32)))
    if ratio == 0:
        return recs
    d, di = cfg.head_dim, cfg.index_head_dim
    groups = [("compressor", "csa" if ratio == 4 else "hca", d)]
    if ratio == 4:
        groups.append(("indexer", "lid", di))
    for name, tag, dim in groups:
        overlap = ratio == 4
        width = 2 * dim if overlap else dim
        size = 2 * ratio if overlap else ratio
        kv = nodes.get(None, f"dsv4_{tag}_state_kv_l{layer}", "SET_ROWS")
        score = nodes.get(None, f"dsv4_{tag}_state_score_l{layer}", "SET_ROWS")
        if kv is None or score is None:
            raise LlamaCppError(f"layer {layer}: the {tag} compressor state was not observed")
        kv = np.ascontiguousarray(kv).reshape(-1, width)[:size]
        score = np.ascontiguousarray(score).reshape(-1, width)[:size]
        t = c // ratio
        open_start = t * ratio
        pre = f"state.{name}."
        recs.append((pre + "buffer_kv", np.stack([kv[p % size] for p in range(open_start, c)]).astype(np.float32)
                     if c > open_start else np.zeros((0, width), np.float32)))
        if name == "compressor":
            cache = nodes.get(None, f"compressed_cache_l{layer}", "SET_ROWS")
            if cache is None:
                raise LlamaCppError(f"layer {layer}: the compressed cache write was not observed")
            rows = np.ascontiguousarray(cache).reshape(-1, dim)
            recs.append((pre + "compressed_kv", rows[:t].astype(np.float32)))
        recs.append((pre + "entry_count", np.array([t], dtype=np.int64)))
        if overlap:
            if t == 0:
                ok = np.zeros((0, dim), np.float32)
                og = np.zeros((0, dim), np.float32)
            else:
                prev = range(open_start - ratio, open_start)
                ok = np.stack([kv[p % size, :dim] for p in prev]).astype(np.float32)
                og = np.stack([score[p % size, :dim] for p in prev]).astype(np.float32)
            recs.append((pre + "overlap_kv", ok))
            recs.append((pre + "overlap_gate", og))
    return recs


def _lm_records(logits):
    """``lm.*`` records and the greedy id (ties to the lowest id), as moeconf.capture."""
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    top = order[:LM_TOPK]
    margin = np.float32(logits[order[0]]) - np.float32(logits[order[1]]) if logits.size > 1 else np.float32(0)
    return ([("lm.logits", logits.astype(np.float32)), ("lm.topk_ids", top.astype(np.int32)),
             ("lm.topk_logits", logits[top].astype(np.float32)), ("lm.margin", np.array([margin], dtype=np.float32))],
            int(order[0]))


# --------------------------------------------------------------------------- the run

class CaptureResult(NamedTuple):
    """What :func:`capture` returns: the generated ids, llama.cpp's prompt ids, the writer's
    summary, the number of callback reads, whether the tokenization was checked, the ids the other
    sequences of the batch generated (``batch_with``) and the number of graphs (ubatches)
    llama.cpp computed."""

    generated: List[int]
    prompt_ids: List[int]
    summary: WriteSummary
    nodes_read: int
    tokenization_checked: bool
    batch_generated: List[List[int]] = []
    graphs: int = 0


def parse_levels(levels):
    """A level mask from ``"all"``, an int mask or level names."""
    from .capture import parse_levels as p

    return p(levels)


class _Ggml:
    """The ggml functions the capture calls, from the llama_cpp package's libggml-base."""

    def __init__(self, lib_dir):
        path = None
        for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
            if os.path.exists(os.path.join(lib_dir, name)):
                path = os.path.join(lib_dir, name)
        if path is None:
            raise LlamaCppError(f"{lib_dir}: no libggml-base shared library")
        lib = ctypes.CDLL(path)
        lib.ggml_tensor_overhead.restype = ctypes.c_size_t
        lib.ggml_nbytes.restype = ctypes.c_size_t
        lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
        lib.ggml_op_name.restype = ctypes.c_char_p
        lib.ggml_op_name.argtypes = [ctypes.c_int]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.lib = lib
        check_tensor_struct(lib.ggml_tensor_overhead())
        self._ops = {}

    def op_name(self, op):
        n = self._ops.get(op)
        if n is None:
            n = self._ops[op] = self.lib.ggml_op_name(op).decode()
        return n

    def read(self, ptr, t):
        """The tensor's values as a numpy array of shape reversed(ne), honouring its strides."""
        dtype = GGML_DTYPES.get(t.type)
        if dtype is None:
            raise LlamaCppError(f"node {t.name.decode(errors='replace')}: ggml type {t.type} is not read by the capture")
        nbytes = self.lib.ggml_nbytes(ptr)
        buf = (ctypes.c_uint8 * nbytes)()
        self.lib.ggml_backend_tensor_get(ptr, buf, 0, nbytes)
        raw = np.frombuffer(buf, dtype=np.uint8)
        ne = [int(x) for x in t.ne]
        nb = [int(x) for x in t.nb]
        view = np.lib.stride_tricks.as_strided(raw.view(dtype) if nb[0] == np.dtype(dtype).itemsize else raw,
                                               shape=tuple(reversed(ne)), strides=tuple(reversed(nb)))
        return np.array(view)


def _cache_kind(t):
    """``compressed`` / ``raw`` for a cache write (SET_ROWS of ``cache_k_l<i>``) by the name of the
    rows it writes (``src[0]``), ``None`` for the indexer cache."""
    src = t.src[0]
    name = src.contents.name.decode("utf-8", errors="replace") if src else ""
    if name.startswith(("csa_state_compress", "hca_state_compress")):
        return "compressed"
    if re.match(r"kv-\d+", name):
        return "raw"
    return None


_WANTED_L2 = re.compile(r"dsv4_(csa|hca|lid)_state_(kv|score)_l(\d+) \(view\) \(view\)")
#: A cache write: ``cache_k_l<i> (view)``; with several streams (``n_seq_max`` > 1) the cache is
#: first merged across them, ``cache_k_l<i> (reshaped) (view)`` (src/llama-kv-cache.cpp ``cpy_k``:
#: the write indices are global over the streams).
_CACHE = re.compile(r"cache_k_l(\d+)(?: \(reshaped\))? \(view\)")


#: llama.cpp's bound on the sequences of one context (src/llama-cparams.h ``LLAMA_MAX_SEQ``).
LLAMA_MAX_SEQ = 256
#: The traced sequence's id in every ``llama_batch``. Its streams are the first of every cache and
#: compressor ring (src/llama-kv-cache-dsv4.cpp ``dsv4_stream_offset``: seq_id × stream size), which
#: is where :func:`layer_state_records` reads them.
TRACED_SEQ = 0
_FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
_KV_TYPES = {"f16": 1, "f32": 0}


class Knobs(NamedTuple):
    """The llama.cpp settings a capture runs under, named as ``llama_context_params`` names them
    (``kv_type`` sets ``type_k`` and ``type_v``; ``flash_attn`` is ``flash_attn_type``;
    ``batch_with``: the prompts of the other sequences decoded in the same batches). ``None``: the
    capture's default, resolved once the prompts are tokenized (:func:`context_sizes`)."""

    n_threads: int
    n_threads_batch: int
    n_batch: Optional[int]
    n_ubatch: Optional[int]
    batch_with: Tuple[str, ...]
    kv_unified: bool
    flash_attn: str
    kv_type: str
    n_ctx: Optional[int]


def _count(name, v, optional=False):
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} {v!r}: not an integer (at least 1)")
    if v < 1:
        raise ValueError(f"{name} {v}: must be at least 1")
    return int(v)


def check_knobs(n_threads=1, n_threads_batch=None, n_batch=None, n_ubatch=None, batch_with=(), kv_unified=False,
                flash_attn="auto", kv_type="f16", n_ctx=None):
    """Validates a capture's llama.cpp settings before anything is loaded and returns them as
    :class:`Knobs` (``n_threads_batch`` defaults to ``n_threads``). Raises ``ValueError`` naming the
    setting: a count that is not an integer of at least 1; ``n_ubatch`` larger than ``n_batch``
    (llama.cpp would clamp it silently, ``n_ubatch = min(n_batch, n_ubatch)`` in ``llama_context``,
    and the trace would name a setting that did not run); an ``n_ctx`` that is not a multiple of 256
    (llama.cpp pads it); ``batch_with`` that is not a list of non-empty prompts, or holds more than
    ``LLAMA_MAX_SEQ - 1``; an unknown ``flash_attn`` or ``kv_type``; a ``kv_unified`` that is not a
    bool."""
    n_threads = _count("n_threads", n_threads)
    n_threads_batch = n_threads if n_threads_batch is None else _count("n_threads_batch", n_threads_batch)
    n_batch = _count("n_batch", n_batch, optional=True)
    n_ubatch = _count("n_ubatch", n_ubatch, optional=True)
    n_ctx = _count("n_ctx", n_ctx, optional=True)
    if n_ctx is not None and n_ctx % 256:
        raise ValueError(f"n_ctx {n_ctx}: not a multiple of 256 (llama.cpp pads n_ctx to one, so {n_ctx} would not "
                         "be the context it runs)")
    if n_batch is not None and n_ubatch is not None and n_ubatch > n_batch:
        raise ValueError(f"n_ubatch {n_ubatch} is larger than n_batch {n_batch}: llama.cpp would use {n_batch} "
                         "(n_ubatch = min(n_batch, n_ubatch)); give n_ubatch <= n_batch")
    if isinstance(batch_with, (str, bytes)) or not isinstance(batch_with, (list, tuple)):
        raise ValueError(f"batch_with {batch_with!r}: a list of prompts (the other sequences of the batch)")
    for i, b in enumerate(batch_with):
        if not isinstance(b, str):
            raise ValueError(f"batch_with prompt {i + 1} is {b!r}, not a string")
        if not b:
            raise ValueError(f"batch_with prompt {i + 1} is empty")
    if len(batch_with) > LLAMA_MAX_SEQ - 1:
        raise ValueError(f"batch_with has {len(batch_with)} prompts; llama.cpp holds at most {LLAMA_MAX_SEQ} sequences "
                         "in one context (LLAMA_MAX_SEQ), the traced one included")
    if not isinstance(kv_unified, bool):
        raise ValueError(f"kv_unified {kv_unified!r}: true or false")
    if flash_attn not in _FLASH_ATTN:
        raise ValueError(f"flash_attn {flash_attn!r}: auto, on or off")
    if kv_type not in _KV_TYPES:
        raise ValueError(f"kv_type {kv_type!r}: f16 or f32")
    return Knobs(n_threads, n_threads_batch, n_batch, n_ubatch, tuple(batch_with), kv_unified, flash_attn, kv_type,
                 n_ctx)


def parse_batch_with_json(text):
    """The prompts of ``--batch-with-json``: one argument holding a JSON array of strings (``[]``:
    the traced sequence alone), so that a command whose placeholders are scalars (``moeconf
    invariance``) can pass any batch composition."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--batch-with-json {text!r}: not JSON ({e})") from None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"--batch-with-json {text!r}: not a JSON array of strings")
    return v


class ContextSizes(NamedTuple):
    """What the capture asks of ``llama_context_params``: ``n_ctx`` (llama.cpp's, for every
    sequence together unless ``kv_unified``), ``n_ctx_seq`` (each sequence's: the DSV4 caches'
    ``kv_size``), ``n_batch``, ``n_ubatch``, ``n_seq_max`` (the sequences of the batch)."""

    n_ctx: int
    n_ctx_seq: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int


def context_sizes(knobs, lengths, max_new_tokens):
    """The context of a run whose sequences have prompts of ``lengths`` tokens (the traced one
    first) and decode ``max_new_tokens`` steps. Each sequence gets the same context whatever the
    batch: ``n_ctx_seq`` = ``knobs.n_ctx`` or the smallest multiple of 256 (at least 512) holding
    the longest run, and llama.cpp's ``n_ctx`` = ``n_ctx_seq`` × ``n_seq_max`` unless
    ``kv_unified`` (src/llama-context.cpp: ``n_ctx_seq = n_ctx / n_seq_max`` when not unified).
    ``n_batch`` defaults to ``n_ctx`` and ``n_ubatch`` to ``n_batch`` (one sequence: both
    ``n_ctx``, the capture's setting before these knobs). Raises ``ValueError`` when the run does
    not fit or ``n_batch`` exceeds ``n_ctx`` (llama.cpp would clamp it)."""
    n_seq = len(lengths)
    need = max(lengths) + max_new_tokens
    n_ctx_seq = knobs.n_ctx or max(512, -(-need // 256) * 256)
    if need > n_ctx_seq:
        raise ValueError(f"n_ctx {n_ctx_seq} is smaller than the {need} positions of the run")
    n_ctx = n_ctx_seq if (knobs.kv_unified or n_seq == 1) else n_ctx_seq * n_seq
    n_batch = knobs.n_batch or n_ctx
    if n_batch > n_ctx:
        raise ValueError(f"n_batch {n_batch} is larger than n_ctx {n_ctx}: llama.cpp would clamp it to {n_ctx}")
    n_ubatch = knobs.n_ubatch or n_batch
    if n_ubatch > n_batch:
        raise ValueError(f"n_ubatch {n_ubatch} is larger than n_batch {n_batch}: llama.cpp would use {n_batch}")
    return ContextSizes(n_ctx, n_ctx_seq, n_batch, n_ubatch, n_seq)


def split_ubatches(seq_ids, n_ubatch, per_seq):
    """How llama.cpp splits one ``llama_batch`` into ubatches (one graph each) for ``deepseek4``:
    for each ubatch, the batch indices of its rows in row order. ``seq_ids``: the sequence of each
    batch entry (exactly one each). With ``per_seq`` False (``n_seq_max`` 1) llama.cpp takes
    ``split_simple``: the next ``n_ubatch`` entries. With per-sequence streams (``n_seq_max`` > 1;
    the DSV4 caches never share one, even with ``kv_unified``: src/llama-kv-cache-dsv4.cpp
    ``init_batch``) it takes ``split_equal(n_ubatch, sequential = true)``: consecutive sequence ids
    starting at the first unused entry's, the same number of entries of each, concatenated
    sequence by sequence (src/llama-batch.cpp ``split_simple``, ``split_equal``). A port of those
    two functions for such batches; the capture checks every graph's tokens and positions against
    it and refuses the run when they differ."""
    n = len(seq_ids)
    out = []
    if not per_seq:
        return [list(range(i, min(n, i + n_ubatch))) for i in range(0, n, n_ubatch)]
    used = [False] * n
    seq_map = {}
    for i, s in enumerate(seq_ids):
        seq_map.setdefault(s, []).append(i)
    while True:
        cur, last = [], -1
        for i in range(n):
            if used[i]:
                continue
            s = seq_ids[i]
            if s not in cur and (not cur or s == last + 1):
                cur.append(s)
                last = s
                if len(cur) > n_ubatch:
                    break
        if not cur:
            return out
        at = []
        for s in cur:
            k = 0
            while used[seq_map[s][k]]:
                k += 1
            at.append(k)
        per = [[] for _ in cur]
        while all(at[k] < len(seq_map[s]) for k, s in enumerate(cur)):
            for k, s in enumerate(cur):
                j = seq_map[s][at[k]]
                per[k].append(j)
                used[j] = True
                at[k] += 1
            if (len(per[0]) + 1) * len(cur) > n_ubatch:
                break
        out.append([j for p in per for j in p])


class Entry(NamedTuple):
    """One entry of a ``llama_batch``: token id, sequence id, position."""

    token: int
    seq: int
    pos: int


def step_entries(feeds, starts):
    """A step's entries: every sequence's tokens ``feeds[s]`` from position ``starts[s]``,
    sequence after sequence (the traced one, id 0, first), as llama.cpp's servers fill a batch."""
    return [Entry(int(t), s, starts[s] + i) for s, feed in enumerate(feeds) for i, t in enumerate(feed)]


def chunks(entries, n_batch):
    """The ``llama_decode`` calls of a step: consecutive runs of at most ``n_batch`` entries (a
    larger batch aborts llama.cpp: ``GGML_ASSERT(n_tokens_all <= cparams.n_batch)``)."""
    return [entries[i:i + n_batch] for i in range(0, len(entries), n_batch)]


def describe_composition(lengths, max_new_tokens, sizes):
    """The batch composition of a run, for the provenance: per step, every ``llama_decode`` call
    (how many tokens of each sequence) and the ubatches llama.cpp splits it into
    (:func:`split_ubatches`; ``N × (...)``: N equal ubatches in a row); equal consecutive steps are
    merged (``steps 1-7: ...``). Depends only on the prompts' lengths and the sizes, so it is known
    before the run."""
    per_seq = sizes.n_seq_max > 1

    def counts(entries):
        c = {}
        for e in entries:
            c[e.seq] = c.get(e.seq, 0) + 1
        return ", ".join(f"seq {s}: {k}" for s, k in sorted(c.items()))

    def step_text(feeds, starts):
        calls = []
        for chunk in chunks(step_entries(feeds, starts), sizes.n_batch):
            ubs = [counts([chunk[j] for j in ub]) for ub in split_ubatches([e.seq for e in chunk], sizes.n_ubatch,
                                                                            per_seq)]
            runs = []
            for u in ubs:
                if runs and runs[-1][0] == u:
                    runs[-1][1] += 1
                else:
                    runs.append([u, 1])
            parts = [f"{k} × ({u})" if k > 1 else f"({u})" for u, k in runs]
            calls.append(f"llama_decode({counts(chunk)}) = " + " + ".join(parts))
        return " then ".join(calls)

    texts = []
    starts = [0] * len(lengths)
    feeds = [[0] * n for n in lengths]
    for step in range(max_new_tokens):
        texts.append(step_text(feeds, starts))
        starts = [s + len(f) for s, f in zip(starts, feeds)]
        feeds = [[0] for _ in lengths]
    out, i = [], 0
    while i < len(texts):
        j = i
        while j + 1 < len(texts) and texts[j + 1] == texts[i]:
            j += 1
        out.append((f"step {i}" if i == j else f"steps {i}-{j}") + ": " + texts[i])
        i = j + 1
    return "; ".join(out)


def knob_notes(knobs, sizes, batch_ids=(), flash_attn_resolved=None, composition=None):
    """The provenance notes naming every llama.cpp setting of the run (effective values, as the
    context reports them) and the batch composition: ``n_threads``, ``n_threads_batch`` (llama.cpp
    computes a ubatch of one token with ``n_threads``, any larger one with ``n_threads_batch``:
    ``llama_context::graph_compute``), ``n_batch``, ``n_ubatch``, ``n_seq_max``, ``n_ctx_seq``,
    ``kv_unified``, ``flash_attn.resolved`` (what ``auto`` became), ``batch.sequences``,
    ``batch.with`` (the other prompts, JSON), ``batch.with_prompt_ids`` and
    ``batch.composition``."""
    notes = [("n_threads", str(knobs.n_threads)), ("n_threads_batch", str(knobs.n_threads_batch)),
             ("n_batch", str(sizes.n_batch)), ("n_ubatch", str(sizes.n_ubatch)), ("n_seq_max", str(sizes.n_seq_max)),
             ("n_ctx_seq", str(sizes.n_ctx_seq)), ("kv_unified", "true" if knobs.kv_unified else "false")]
    if flash_attn_resolved:
        notes.append(("flash_attn.resolved", flash_attn_resolved))
    others = len(knobs.batch_with)
    notes.append(("batch.sequences", "1: the traced sequence (seq_id 0) alone" if not others else
                  f"{others + 1}: the traced sequence (seq_id 0, the only one recorded) and {others} other "
                  f"sequence{'s' if others > 1 else ''} (seq_id 1..{others}) prefilled and decoded greedily in the "
                  "same batches"))
    if others:
        notes.append(("batch.with", json.dumps(list(knobs.batch_with), ensure_ascii=False)))
        notes.append(("batch.with_prompt_ids", "; ".join(f"seq {i + 1}: " + ",".join(map(str, ids))
                                                         for i, ids in enumerate(batch_ids))))
    if composition:
        notes.append(("batch.composition", composition))
    return notes


class _Graph:
    """The observed nodes of one graph evaluation (one ubatch), with the token ids and positions of
    its rows as its inputs held them (``inp_tokens``, the source of ``embd``; ``inp_pos``, the
    positions of layer 0's ``q`` rope)."""

    def __init__(self, tokens):
        self.nodes = StepNodes()
        self.tokens = tokens
        self.positions = None


def _decode_step(LL, ctx, entries, n_batch, n_vocab, after_call=None):
    """``llama_decode`` of one step's ``entries`` in batches of at most ``n_batch``; the last entry
    of every sequence is an output. ``after_call(chunk)`` runs after each call. Returns
    ``{seq_id: logits}``."""
    last = {}
    for i, e in enumerate(entries):
        last[e.seq] = i
    outs = {}
    done = 0
    for chunk in chunks(entries, n_batch):
        b = LL.llama_batch_init(len(chunk), 0, 1)
        try:
            for i, e in enumerate(chunk):
                b.token[i] = e.token
                b.pos[i] = e.pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = e.seq
                b.logits[i] = 1 if last[e.seq] == done + i else 0
            b.n_tokens = len(chunk)
            rc = LL.llama_decode(ctx, b)
            if rc != 0:
                raise LlamaCppError(f"llama_decode returned {rc} (a batch of {len(chunk)} entries)")
            for i, e in enumerate(chunk):
                if last[e.seq] == done + i:
                    lg = LL.llama_get_logits_ith(ctx, i)
                    outs[e.seq] = np.ctypeslib.as_array(lg, shape=(n_vocab,)).astype(np.float32).copy()
        finally:
            LL.llama_batch_free(b)
        if after_call is not None:
            after_call(chunk)
        done += len(chunk)
    return outs


def _greedy_run(LL, ctx, seqs, steps, n_batch, n_vocab):
    """Every step's ``{seq_id: logits}`` of a greedy run of the sequences ``seqs`` (prompt ids) in
    ``ctx`` (no observation)."""
    out = []
    feeds = [list(ids) for ids in seqs]
    starts = [0] * len(seqs)
    for step in range(steps):
        try:
            outs = _decode_step(LL, ctx, step_entries(feeds, starts), n_batch, n_vocab)
        except LlamaCppError as e:
            raise LlamaCppError(f"step {step} (run without the callback): {e}") from None
        out.append(outs)
        starts = [s + len(f) for s, f in zip(starts, feeds)]
        feeds = [[_lm_records(outs[s])[1]] for s in range(len(seqs))]
    return out


def capture(gguf_path, prompt, max_new_tokens, out_path, *, model_dir, model_name=None, reference_ids=None,
            levels="all", payload_levels="all", algorithm="blake3", n_threads=1, n_threads_batch=None,
            kv_type="f16", flash_attn="auto", n_ctx=None, n_batch=None, n_ubatch=None, batch_with=(),
            kv_unified=False, check_identity=True, check_unobserved=True):
    """Runs the GGUF ``gguf_path`` greedily for ``max_new_tokens`` steps on ``prompt`` and writes a
    canonical trace to ``out_path`` (atomically).

    ``model_dir`` is the checkpoint the GGUF was exported from: its identity is bound (as
    ``moeconf run`` binds it), and with ``check_identity`` the GGUF's ``moeconf.source.*``
    digests must equal it. ``reference_ids``: the reference's token ids of the prompt; llama.cpp's
    tokenization must equal them (a mismatch raises :class:`LlamaCppError` instead of a silent
    divergence).

    llama.cpp's settings (:func:`check_knobs`, all recorded in the provenance, :func:`knob_notes`):
    ``n_threads`` and ``n_threads_batch`` (default ``n_threads``), ``kv_type`` (``f16``, llama.cpp's
    default, or ``f32``), ``flash_attn`` (``auto``, ``on``, ``off``), ``n_batch`` (the most entries
    of one ``llama_decode``: a longer step is decoded in several calls, as llama.cpp's own tools
    do), ``n_ubatch`` (llama.cpp splits each call into ubatches of at most this many rows, one graph
    each), ``n_ctx`` (each sequence's context), ``kv_unified``, and ``batch_with``: the prompts of
    other sequences (seq_id 1, 2, …) prefilled and decoded greedily in the same batches as the
    traced one (seq_id 0). Only the traced sequence's rows are recorded: each graph's rows are
    attributed to sequences by llama.cpp's ubatch split (:func:`split_ubatches`), checked against
    the token ids and positions the graph's inputs hold.

    With ``check_unobserved`` the same greedy run (the same batches) is first made in a context
    without the callback, and the captured run's logits of every sequence must be bit-identical to
    it at every step (else :class:`LlamaCppError`: observing would have changed what llama.cpp
    computes). Returns a :class:`CaptureResult`.
    """
    from . import binding_from_model
    from .capture import parse_levels as _parse_levels
    from .identity import model_identity

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    knobs = check_knobs(n_threads=n_threads, n_threads_batch=n_threads_batch, n_batch=n_batch, n_ubatch=n_ubatch,
                        batch_with=batch_with, kv_unified=kv_unified, flash_attn=flash_attn, kv_type=kv_type,
                        n_ctx=n_ctx)
    # The file first: what is wrong with it is said even where llama.cpp is not installed.
    cfg = check_gguf(gguf_path)
    try:
        import llama_cpp
        from llama_cpp import llama_cpp as LL
    except ImportError as e:
        raise LlamaCppError(f"llama-cpp-python is not importable ({e}); python/run_llamacpp.sh installs the pinned "
                            "llama-cpp-python==0.3.36") from None
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    if not llama_supports_deepseek4(lib_dir):
        raise LlamaCppError(f"llama-cpp-python {llama_cpp.__version__} ({lib_dir}): this llama.cpp build has no "
                            "'deepseek4' architecture (pin llama-cpp-python==0.3.36)")
    model_dir = os.fspath(model_dir)
    ident = model_identity(model_name or model_dir, model_dir, algorithm)
    if check_identity:
        if cfg.source_weights_digest is None:
            raise LlamaCppError(f"{gguf_path}: no moeconf.source.weights_digest: not written by `moeconf export gguf`, "
                                "so the weights cannot be bound to the checkpoint (pass check_identity=False to bind "
                                "them anyway)")
        if algorithm == "blake3" and cfg.source_weights_digest != ident.weights_digest.hex():
            raise LlamaCppError(f"{gguf_path}: exported from weights {cfg.source_weights_digest[:12]}, but {model_dir} "
                                f"holds weights {ident.weights_digest.hex()[:12]}: not the checkpoint the reference runs")
    mask, payload_mask = _parse_levels(levels), _parse_levels(payload_levels)
    ggml = _Ggml(lib_dir)

    messages = []

    @LL.llama_log_callback
    def on_log(level, text, user):
        if text:
            messages.append(text.decode("utf-8", errors="replace"))

    _KEEP_ALIVE.append(on_log)  # llama.cpp may log after this call returns
    LL.llama_log_set(on_log, ctypes.c_void_p(0))
    LL.llama_backend_init()
    mp = LL.llama_model_default_params()
    # Extra (AMX / repack) buffer types abort quantized DeepSeek-V4 models at context creation on
    # CPUs with AMX (GGML_ASSERT(*cur_backend_id != -1)); off, every weight stays in its file type.
    mp.use_extra_bufts = False
    model = LL.llama_model_load_from_file(os.fspath(gguf_path).encode(), mp)
    if not model:
        tail = "".join(messages[-6:]).strip()
        raise LlamaCppError(f"{gguf_path}: llama.cpp could not load the model: {tail}")
    ctx = None
    writer = None
    try:
        vocab = LL.llama_model_get_vocab(model)

        def tokenize(text_str, what):
            text = text_str.encode("utf-8")
            cap = len(text) + 16
            buf = (LL.llama_token * cap)()
            n = LL.llama_tokenize(vocab, text, len(text), buf, cap, False, False)
            if n < 0:
                raise LlamaCppError(f"llama_tokenize needs {-n} tokens")
            ids = [int(i) for i in buf[:n]]
            if not ids:
                raise ValueError(f"{what} tokenizes to no tokens")
            return ids

        prompt_ids = tokenize(prompt, "the prompt") if prompt else []
        if not prompt_ids:
            raise ValueError("empty prompt")
        checked = reference_ids is not None
        if checked and list(reference_ids) != prompt_ids:
            first = next((i for i, (a, b) in enumerate(zip(prompt_ids, reference_ids)) if a != b),
                         min(len(prompt_ids), len(reference_ids)))
            raise LlamaCppError(f"llama.cpp tokenizes the prompt into {len(prompt_ids)} ids, the reference into "
                                f"{len(reference_ids)}; first difference at index {first}: "
                                f"{prompt_ids[first:first + 4]} vs {list(reference_ids)[first:first + 4]}")
        batch_ids = [tokenize(b, f"batch_with prompt {i + 1}") for i, b in enumerate(knobs.batch_with)]
        seqs = [prompt_ids] + batch_ids
        sizes = context_sizes(knobs, [len(ids) for ids in seqs], max_new_tokens)
        per_seq = sizes.n_seq_max > 1

        graphs = []
        failures = []
        reads = [0]

        def wanted(name, op, t):
            if op == "SET_ROWS" and _WANTED_L2.fullmatch(name):
                return bool(mask & LEVEL_BITS["L2"])
            if op == "SET_ROWS" and _CACHE.fullmatch(name):
                # The compressed caches (rows from the compressor) and the window cache (rows from
                # the layer's kv), not the rotated indexer cache.
                return bool(mask & LEVEL_BITS["L2"]) and _cache_kind(t) is not None
            base, layer = split_name(name)
            if layer is None:
                return name == "embd" and op == "GET_ROWS"
            return base in _RULE_BASES

        def observe(ptr, t, name, op):
            arr = ggml.read(ptr, t)
            reads[0] += 1
            if name == "embd":
                # The first node of every graph: a new ubatch. Its rows' token ids are its source.
                graphs.append(_Graph(ggml.read(ctypes.cast(t.src[1], ctypes.c_void_p), t.src[1].contents)))
            if not graphs:
                raise LlamaCppError(f"node {name} was computed before the graph's embd")
            nodes = graphs[-1].nodes
            m2 = _WANTED_L2.fullmatch(name)
            if m2:
                nodes.add(None, f"dsv4_{m2.group(1)}_state_{m2.group(2)}_l{m2.group(3)}", op, arr)
                return
            mc = _CACHE.fullmatch(name)
            if mc:
                kind = _cache_kind(t)
                nodes.add(None, f"{kind}_cache_l{mc.group(1)}", op, arr)
                if kind == "raw":
                    idx = ggml.read(ctypes.cast(t.src[1], ctypes.c_void_p), t.src[1].contents)
                    nodes.add(None, f"raw_cache_idx_l{mc.group(1)}", op, idx)
                return
            base, layer = split_name(name)
            if base == "q" and layer == 0 and op == "ROPE" and graphs[-1].positions is None:
                graphs[-1].positions = ggml.read(ctypes.cast(t.src[1], ctypes.c_void_p), t.src[1].contents)
            nodes.add(layer, base, op, arr)

        @LL.ggml_backend_sched_eval_callback
        def on_eval(ptr, ask, user):
            t = ctypes.cast(ptr, ctypes.POINTER(GgmlTensor)).contents
            name = t.name.decode("utf-8", errors="replace")
            op = ggml.op_name(t.op)
            if ask:
                return wanted(name, op, t)
            if failures:
                return False
            if not wanted(name, op, t):
                return True
            try:
                observe(ptr, t, name, op)
            except BaseException as e:  # an exception cannot cross the C callback: stop, raise after
                failures.append(e)
                return False
            return True

        def context(callback):
            cp = LL.llama_context_default_params()
            cp.n_ctx = sizes.n_ctx
            cp.n_batch = sizes.n_batch
            cp.n_ubatch = sizes.n_ubatch
            cp.n_seq_max = sizes.n_seq_max
            cp.kv_unified = knobs.kv_unified
            cp.n_threads = knobs.n_threads
            cp.n_threads_batch = knobs.n_threads_batch
            cp.type_k = _KV_TYPES[knobs.kv_type]
            cp.type_v = _KV_TYPES[knobs.kv_type]
            cp.flash_attn_type = _FLASH_ATTN[knobs.flash_attn]
            if callback is not None:
                _KEEP_ALIVE.append(callback)
                cp.cb_eval = callback
                cp.cb_eval_user_data = None
            first = len(messages)
            c = LL.llama_init_from_model(model, cp)
            if not c:
                tail = "".join(messages[-6:]).strip()
                raise LlamaCppError(f"{gguf_path}: llama.cpp could not create a context: {tail}")
            got = {"n_ctx": LL.llama_n_ctx(c), "n_ctx_seq": LL.llama_n_ctx_seq(c), "n_batch": LL.llama_n_batch(c),
                   "n_ubatch": LL.llama_n_ubatch(c), "n_seq_max": LL.llama_n_seq_max(c),
                   "n_threads": LL.llama_n_threads(c), "n_threads_batch": LL.llama_n_threads_batch(c)}
            want = dict(sizes._asdict(), n_threads=knobs.n_threads, n_threads_batch=knobs.n_threads_batch)
            for k, v in got.items():
                if int(v) != int(want[k]):
                    LL.llama_free(c)
                    raise LlamaCppError(f"llama.cpp runs {k} = {v}, not the {want[k]} asked for: the trace would name a "
                                        "setting that did not run")
            fa = [m.strip() for m in messages[first:] if "Flash Attention" in m and ("enabled" in m or "disabled" in m)]
            return c, (re.sub(r"^\S+: ", "", fa[-1]) if fa else None)

        n_vocab = LL.llama_vocab_n_tokens(vocab)
        unobserved = None
        if check_unobserved:
            plain, _ = context(None)
            try:
                unobserved = _greedy_run(LL, plain, seqs, max_new_tokens, sizes.n_batch, n_vocab)
            finally:
                LL.llama_free(plain)
        ctx, fa_resolved = context(on_eval)

        binding = binding_from_model(model_dir, model_name or model_dir, prompt_text=prompt, prompt_ids=prompt_ids,
                                     max_new_tokens=int(max_new_tokens), precision=f"llamacpp-{cfg.export_type or 'gguf'}",
                                     contract="llamacpp-native", schedule="identity", capture_levels=mask,
                                     capture_payload_levels=payload_mask, algorithm=algorithm)
        composition = describe_composition([len(ids) for ids in seqs], max_new_tokens, sizes)
        notes = [("llama-cpp-python", llama_cpp.__version__), ("gguf", os.path.basename(os.fspath(gguf_path))),
                 ("gguf.digest", _file_digest(os.fspath(gguf_path), algorithm)),
                 ("gguf.export_type", str(cfg.export_type)), ("kv_type", knobs.kv_type),
                 ("flash_attn", knobs.flash_attn), ("n_ctx", str(sizes.n_ctx))]
        notes += knob_notes(knobs, sizes, batch_ids, fa_resolved, composition)
        notes += [("llamacpp.prompt_ids", ",".join(map(str, prompt_ids))),
                  ("observation", "logits bit-identical to a run without the callback" if check_unobserved
                   else "not checked against a run without the callback"),
                  ("tokenization", "checked against the reference" if checked else "not checked (no reference ids)"),
                  (NOT_CAPTURED_NOTE, "; ".join(f"{k}: {v}" for k, v in NOT_CAPTURED.items()))]
        prov = Provenance("llama.cpp", llama_cpp.__version__, knobs.n_threads, notes)
        prov.with_recomputed(RECOMPUTED)
        inputs = [os.fspath(gguf_path)] + [os.path.join(model_dir, f) for f in os.listdir(model_dir)]
        writer = TraceWriter(out_path, binding, prov, algorithm, inputs=inputs)

        def emit(step, pos, phase, layer, level, path, arr):
            if not mask & LEVEL_BITS[level]:
                return
            keep = bool(payload_mask & LEVEL_BITS[level])
            writer.append(Coord.make(step, int(pos), phase, layer, path), level, np.ascontiguousarray(arr),
                          keep_payload=keep)

        generated = []
        others_generated = [[] for _ in batch_ids]
        cells = {layer: {} for layer in range(cfg.n_layer)}
        pieces = b""
        feeds = [list(ids) for ids in seqs]
        starts = [0] * len(seqs)
        n_graphs = 0
        for step in range(max_new_tokens):
            phase = "prefill" if step == 0 else "decode"
            positions = list(range(starts[0], starts[0] + len(feeds[0])))
            embed = {}
            layer_recs = {layer: {} for layer in range(cfg.n_layer)}
            last_nodes = [None]

            def after_call(chunk, step=step):
                nonlocal n_graphs
                if failures:
                    raise LlamaCppError(f"step {step}: reading llama.cpp's nodes failed: {failures[0]}")
                plan = split_ubatches([e.seq for e in chunk], sizes.n_ubatch, per_seq)
                if len(graphs) != len(plan):
                    raise LlamaCppError(f"step {step}: llama_decode of {len(chunk)} entries computed {len(graphs)} "
                                        f"graphs, but llama.cpp's ubatch split gives {len(plan)}: the rows cannot be "
                                        "attributed to sequences")
                for g, ub in zip(graphs, plan):
                    rows = [chunk[j] for j in ub]
                    toks = np.asarray(g.tokens).reshape(-1).tolist()
                    pos = None if g.positions is None else np.asarray(g.positions).reshape(-1)[:len(rows)].tolist()
                    if toks != [e.token for e in rows] or pos != [e.pos for e in rows]:
                        raise LlamaCppError(f"step {step}: a graph's rows (tokens {toks[:6]}…, positions "
                                            f"{(pos or [])[:6]}…) are not the ubatch llama.cpp's split gives "
                                            f"({[(e.seq, e.pos) for e in rows][:6]}…): the rows cannot be attributed "
                                            "to sequences")
                    layout = [(e.seq, e.pos) for e in rows]
                    mine = [p for s, p in layout if s == TRACED_SEQ]
                    if mine:
                        e_arr = g.nodes.get(None, "embd", "GET_ROWS")
                        erows = _rows(e_arr, len(rows), (cfg.hidden,), "embd")
                        for j, (s, p) in enumerate(layout):
                            if s == TRACED_SEQ:
                                embed[p] = erows[j].astype(np.float32)
                        for layer in range(cfg.n_layer):
                            layer_recs[layer].update(assemble_layer(g.nodes, cfg, layer, mine, layout=layout))
                    if mask & LEVEL_BITS["L2"]:
                        for layer in range(cfg.n_layer):
                            idx = g.nodes.get(None, f"raw_cache_idx_l{layer}", "SET_ROWS")
                            if idx is None or np.asarray(idx).size != len(rows):
                                raise LlamaCppError(f"layer {layer}: the window cache write indices were not observed")
                            for (s, p), cell in zip(layout, np.asarray(idx).reshape(-1).tolist()):
                                if s == TRACED_SEQ:
                                    cells[layer][p] = int(cell)
                    last_nodes[0] = g.nodes
                n_graphs += len(graphs)
                graphs.clear()

            outs = _decode_step(LL, ctx, step_entries(feeds, starts), sizes.n_batch, n_vocab, after_call)
            if sorted(embed) != positions or any(sorted(layer_recs[layer]) != positions for layer in layer_recs):
                raise LlamaCppError(f"step {step}: not every position of the traced sequence was computed once")
            if unobserved is not None:
                for s, lg in outs.items():
                    if not np.array_equal(unobserved[step][s].view(np.uint32), lg.view(np.uint32)):
                        raise LlamaCppError(f"step {step}: the logits of sequence {s} with the evaluation callback "
                                            "differ from the run without it: observing changed llama.cpp's "
                                            "computation, the trace would not be faithful")
            emit(step, starts[0], phase, None, "L0", "token.input", np.array(feeds[0], dtype=np.int32))
            for p in positions:
                emit(step, p, phase, None, "L4", "embed.output", embed[p])
            for layer in range(cfg.n_layer):
                for p in positions:
                    for level, path, a in layer_recs[layer][p]:
                        emit(step, p, phase, layer, level, path, a)
            last = positions[-1]
            lm, nxt = _lm_records(outs[TRACED_SEQ])
            for path, a in lm:
                emit(step, last, phase, None, "L1", path, a)
            generated.append(nxt)
            emit(step, last, phase, None, "L0", "token.output", np.array([nxt], dtype=np.int32))
            pbuf = ctypes.create_string_buffer(256)
            k = LL.llama_token_to_piece(vocab, nxt, pbuf, 256, 0, False)
            pieces += pbuf.raw[:max(k, 0)]
            text_so_far = pieces.decode("utf-8", errors="replace")
            emit(step, last, phase, None, "L0", "text.continuation",
                 np.frombuffer(text_so_far.encode("utf-8"), np.uint8))
            if mask & LEVEL_BITS["L2"]:
                for layer in range(cfg.n_layer):
                    for path, a in layer_state_records(last_nodes[0], cfg, layer, last + 1, cells[layer]):
                        emit(step, last, phase, layer, "L2", path, a)
            nexts = [nxt] + [_lm_records(outs[s])[1] for s in range(1, len(seqs))]
            for s in range(1, len(seqs)):
                others_generated[s - 1].append(nexts[s])
            starts = [st + len(f) for st, f in zip(starts, feeds)]
            feeds = [[t] for t in nexts]
        summary = writer.finish()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        if ctx:
            LL.llama_free(ctx)
        LL.llama_model_free(model)
    return CaptureResult(generated, prompt_ids, summary, reads[0], checked, others_generated, n_graphs)


_RULE_BASES = {r[0] for r in NODE_RULES}
#: ctypes callbacks handed to llama.cpp, kept alive for the life of the process.
_KEEP_ALIVE = []


def _file_digest(path, algorithm):
    """Hex digest of a file's bytes, streamed."""
    from .fingerprint import hasher

    h = hasher(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest() if hasattr(h, "hexdigest") else h.digest().hex()
