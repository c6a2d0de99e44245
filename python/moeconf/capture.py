"""Capture a canonical moeconf trace from a Hugging Face transformers
``DeepseekV4ForCausalLM`` during greedy generation (docs/interop.md).

:func:`capture` drives the model itself, token by token with its own
``DynamicCache`` (step 0 = the prefill forward over all prompt ids, step s >= 1
consumes generated token g_s; notes/capture.md), and records what forward hooks
on the HF modules and thin wrappers around the per-layer cache methods expose.
The hooks are those of the generic PyTorch capture :mod:`moeconf.torch` under the
mapping :func:`moeconf.capture_mapping.transformers_mapping` (the greedy loop and
the wraps are in :mod:`moeconf.capture_mapping`); this module keeps the public
entry point, the argument checks, the batch, the L2 state reader and the
recomputation of the MoE terms it uses:

* L0 ``token.input`` / ``token.output`` / ``text.continuation``;
* L1 ``lm.logits`` / ``lm.topk_ids`` / ``lm.topk_logits`` / ``lm.margin``;
* L3 ``layer.post_attn_mhc`` (input of ``ffn_hc``), ``layer.post_ffn_mhc``
  (decoder-layer output), ``router.scores`` (``score_fn`` of the gate logits),
  ``router.topk`` (indices as returned, i.e. the order in which the experts
  implementation combines them), ``router.gates``, ``router.margin`` (score-routed
  layers: selection score ``scores + e_score_correction_bias`` of rank k minus
  rank k+1, in fp32);
* L2 the cache of every layer after every step, in the canonical logical layout
  of docs/operators.md section 4;
* L4 ``attn.hc_pre``, ``attn.norm``, ``attn.q`` (``q_b_norm`` output rotated with
  the same ``apply_rotary_pos_emb`` call HF makes), ``attn.kv`` (the argument of
  the cache ``update``), ``attn.compressed`` / ``attn.indexer_compressed`` (the
  entries passed to ``update_compressor_states``, at the position that closes
  their window), ``attn.indexer_topk`` (indexer output, ``-1`` sentinels
  dropped), ``attn.core`` (the attention-interface output, before de-rotation),
  ``attn.output``, ``ffn.hc_pre``, ``ffn.norm``, ``moe.term.j`` (recomputed, see
  below), ``moe.routed`` (the ``mlp.experts`` output: the routed sum **before**
  the shared-expert merge, as the experts implementation stored it),
  ``moe.shared`` and ``moe.combine`` (the MoE block output, routed + shared).

What the capture recomputes rather than observes is marked in the trace's
provenance (``moeconf.recomputed``, docs/format.md 5.2.1): ``moe.term.*``,
``router.scores``, ``router.margin`` (HF's ``score_fn`` and selection scores,
not returned by the gate) and ``attn.q`` (the rotation HF applies next, applied
by the capture). ``moeconf diff`` says so whenever it calls such inputs
matching.

``moe.term.j`` is not a tensor HF materializes under a module boundary (every
experts implementation is one fused module). The capture recomputes
``g_j * down(gate(gate_up(x)))`` with the experts module's own forward (the
active implementation), once per slot with the other slots' gate weights set
to zero: every implementation applies the gate after the down projection, so
the GEMMs are those of the real call (an eager-style per-expert recompute
differs from ``batched_mm``'s per-row products in fp32). As a diagnostic it then checks whether the recomputed terms
reproduce the observed ``moe.routed`` under any of the summations in
:data:`ROUTED_SUMS` (FP32 or model-dtype accumulation; router slot order or
ascending expert id). ``CaptureResult.moe_routed_reproduced`` counts, per
summation, the (position, layer) events it reproduces bitwise;
``moe_terms_unexplained`` counts the events none reproduces (the recomputed
terms then differ from the kernel's, or the kernel sums another way).

The traced sequence may be decoded inside a batch beside other prompts (``batch_with``,
``padding_side``): only its own rows are recorded, at its own positions, and the batch
composition goes into the provenance notes (docs/invariance.md section 5.2).

Everything is recorded as f32 (bf16 values are exact in f32), ids as i32,
counters as i64, as the reference runtime does. Requires torch and
transformers (imported lazily; the rest of the package does not need them).
"""

import os
import sys
import types
from typing import Dict, List, NamedTuple

import numpy as np

from .catalogue import LEVEL_BITS, LM_TOPK, NOT_CAPTURED_NOTE, REPLAY_PAYLOAD_LEVELS, parse_levels  # noqa: F401
from .catalogue import lm_records as _lm_records  # noqa: F401
from .trace import WriteSummary

__all__ = ["capture", "CaptureResult", "LEVEL_BITS", "NOT_CAPTURED_NOTE", "PADDED_NOT_CAPTURED", "RECOMPUTED",
           "REPLAY_PAYLOAD_LEVELS", "ROUTED_SUMS", "parse_levels",
           "original_name",
           "save_original"]

# LEVEL_BITS, REPLAY_PAYLOAD_LEVELS (the payload levels of the capture set ``replay``: with
# ``levels="all"``, ``capture(..., payload_levels=REPLAY_PAYLOAD_LEVELS)`` records what ``moeconf
# replay`` needs, docs/replay.md section 3), LM_TOPK, parse_levels and lm_records (as _lm_records) are
# shared with the other captures (moeconf.catalogue) and stay importable from here.


#: The records the capture recomputes (the trace's ``moeconf.recomputed`` note).
RECOMPUTED = ["attn.q", "router.scores", "router.margin", "moe.term.*"]

#: The summations of the recomputed terms checked against the observed routed sum, by name.
ROUTED_SUMS = (
    "fp32 accumulation in router slot order, one rounding",
    "fp32 accumulation in ascending expert id, one rounding",
    "model-dtype accumulation in ascending expert id (one rounding per expert, as index_add_)",
)


class CaptureResult(NamedTuple):
    """What :func:`capture` returns: the generated ids, the writer's summary (root,
    record counts), the number of (position, MoE layer) events, per summation of
    :data:`ROUTED_SUMS` how many events it reproduces the observed ``moe.routed``
    from the recomputed terms bitwise, and how many events no summation reproduces."""

    generated: List[int]
    summary: WriteSummary
    moe_events: int
    moe_routed_reproduced: Dict[str, int]
    moe_terms_unexplained: int


def _f32(t):
    """A detached CPU float32 numpy copy of a tensor (bf16 -> f32 is exact)."""
    import torch

    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()


class _Tokenizer:
    """Uniform encode/decode over a ``tokenizers.Tokenizer``, a transformers tokenizer, or None."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text):
        t = self.tok
        if hasattr(t, "encode_batch"):  # tokenizers.Tokenizer
            return list(t.encode(text, add_special_tokens=False).ids)
        return list(t.encode(text, add_special_tokens=False))

    def decode(self, ids):
        # special tokens (e.g. an emitted end-of-sentence) are left out, as the reference's decode does
        t = self.tok
        if t is None:
            return None
        if hasattr(t, "encode_batch"):
            return t.decode(list(ids), skip_special_tokens=True)
        return t.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _state_records(cfg, cache, b=0, slot_mask=None):
    """The L2 records of every layer: ``[(layer, path, array)]`` in canonical order
    (docs/operators.md section 4), of batch entry ``b``. ``slot_mask`` (one 0/1 per cache slot
    so far, the sequence's attention mask) is given when the sequence has pad slots: its
    ``window_kv`` then keeps its own slots only, and the records that count or pool cache slots
    are left out (:data:`PADDED_NOT_CAPTURED`)."""
    out = []
    d = cfg.head_dim
    d_i = getattr(cfg, "index_head_dim", d)
    for i, layer in enumerate(cache.layers):
        kind = cfg.layer_types[i]
        if slot_mask is None:
            out.append((i, "state.cumulative_length", np.array([int(layer.cumulative_length)], dtype=np.int64)))
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            window = np.zeros((0, d), np.float32)
        elif slot_mask is None:
            window = _f32(keys[b, 0])
        else:
            # the window holds the last keys.shape[2] of the layer's cumulative_length slots
            n, total = keys.shape[2], int(layer.cumulative_length)
            own = [r for r in range(n) if slot_mask[total - n + r]]
            window = _f32(keys[b, 0][own])
        out.append((i, "state.window_kv", window))
        if kind == "sliding_attention" or slot_mask is not None:
            continue
        csa = kind == "compressed_sparse_attention"
        names = [("compressor", d, 2 * d if csa else d)]
        if csa:
            names.append(("indexer", d_i, 2 * d_i))
        for name, dim, width in names:
            pre = f"state.{name}."

            def rows(t, cols):
                return np.zeros((0, cols), np.float32) if t is None else _f32(t[b]).reshape(-1, cols)

            out.append((i, pre + "buffer_kv", rows(layer.buffer_kv[name], width)))
            out.append((i, pre + "buffer_gate", rows(layer.buffer_gate[name], width)))
            out.append((i, pre + "compressed_kv", rows(layer.compressed_kv[name], dim)))
            out.append((i, pre + "entry_count", np.array([int(layer.entry_count[name])], dtype=np.int64)))
            if csa:
                out.append((i, pre + "overlap_kv", rows(layer.overlap_kv[name], dim)))
                out.append((i, pre + "overlap_gate", rows(layer.overlap_gate[name], dim)))
    return out


def _recompute_terms(m, x, idx, w):
    """``[T, k, D]`` gate-weighted terms in the model dtype, computed by the experts module's own
    forward (whichever implementation is active: transformers reads
    ``config._experts_implementation`` at every call), once per slot ``j`` with the gate weights
    of every other slot set to zero.

    Why this gives the implementation's own products: every implementation multiplies by the
    gate *after* the down projection (modeling_deepseek_v4 ``DeepseekV4Experts.forward``
    L1065; integrations/moe.py L175 ``batched_mm``, L524 ``grouped_mm``), so the GEMMs see the
    same rows, in the same batch, as in the real call (``batched_mm``'s per-row products depend
    on the batch: a one-slot call differs in fp32 at decode). The other slots' products become
    ``±0``, and a routed sum of one term and zeros from ``+0`` is that term. Limits: a ``-0``
    term reads as ``+0``; an infinite product times a zero gate would read as NaN."""
    import torch

    k = idx.shape[1]
    cols = []
    for j in range(k):
        wj = torch.zeros_like(w)
        wj[:, j] = w[:, j]
        cols.append(m.forward(x, idx, wj))
    return torch.stack(cols, dim=1)


def _routed_sums(v, ids, dtype):
    """The summations of :data:`ROUTED_SUMS` of one token's terms ``v`` ``[k, D]`` (model dtype)
    with expert ids ``ids``, each rounded to ``dtype`` as the experts output is."""
    import torch

    f = v.float()
    k = f.shape[0]
    slot = torch.zeros_like(f[0])
    for j in range(k):
        slot = slot + f[j]
    asc = torch.zeros_like(f[0])
    for j in sorted(range(k), key=lambda j: (ids[j], j)):
        asc = asc + f[j]
    acc = torch.zeros_like(v[0])
    for e in sorted(set(ids)):  # one index_add_ per expert: an fp32 buffer seeded with acc, one rounding
        buf = acc.float()
        for j in range(k):
            if ids[j] == e:
                buf = buf + f[j]
        acc = buf.to(dtype)
    return [slot.to(dtype), asc.to(dtype), acc]


def _greedy(logits):
    """The greedy id of one f32 logits row (ties to the lowest id), as :func:`_lm_records`."""
    return int(np.argsort(-logits.astype(np.float64), kind="stable")[0])


class _Batch(NamedTuple):
    """The sequences of one run: ``ids[0]`` the traced one, then the others; every row padded
    with ``pad_id`` on ``side`` to the longest."""

    ids: List[List[int]]
    side: str
    pad_id: int

    @property
    def width(self):
        return max(len(x) for x in self.ids)

    def pads(self, b):
        return self.width - len(self.ids[b])

    def rows(self):
        """(input ids, attention mask) of the prefill, one padded row per sequence."""
        ids, mask = [], []
        for x in self.ids:
            p = [self.pad_id] * (self.width - len(x))
            ids.append(p + x if self.side == "left" else x + p)
            m = [0] * len(p)
            mask.append(m + [1] * len(x) if self.side == "left" else [1] * len(x) + m)
        return ids, mask

    def own_slots(self, b):
        """The slots of sequence ``b``'s prompt in the prefill."""
        first = self.pads(b) if self.side == "left" else 0
        return range(first, first + len(self.ids[b]))


#: What a capture of a *padded* sequence (shorter than another prompt of its batch) leaves out, and
#: why: records that count or pool the cache's slots, which include this sequence's pad slots. (A
#: reason never holds "; ", the note's item separator.)
PADDED_NOT_CAPTURED = {
    "state.cumulative_length": "the cache layer counts the batch's slots, this sequence's pad slots "
                               "included, and transformers keeps no count of the sequence's own tokens",
    "state.compressor.*": "transformers' compressor (DeepseekV4CSACompressor / DeepseekV4HCACompressor.forward, "
                          "DeepseekV4HCACache.store_compression_weights) pools windows of compress_rate cache "
                          "slots under no attention mask: this sequence's pad slots are pooled into its windows "
                          "and shift their boundaries, so no buffer or entry is the sequence's own",
    "state.indexer.*": "as state.compressor.* (the indexer's own compressor, DeepseekV4Indexer.forward)",
    "attn.compressed": "as state.compressor.*: each entry pools cache slots, pads included, at no position of "
                       "the sequence's own",
    "attn.indexer_compressed": "as attn.compressed",
    "attn.indexer_topk": "indices into the entries of attn.indexer_compressed, which pool cache slots "
                         "(see attn.compressed)",
}


def _make_batch(cfg, tok, prompt_ids, batch_with, padding_side, pad_token_id):
    """The :class:`_Batch` of a run: the traced prompt's ids first, then each of ``batch_with``
    (texts encoded with ``tok``, or id lists), validated."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side {padding_side!r}: expected 'left' or 'right'")
    if isinstance(batch_with, (str, bytes)):
        raise ValueError("batch_with is a list of prompts, not one string")
    ids = [list(prompt_ids)]
    for n, p in enumerate(batch_with):
        if isinstance(p, str):
            if tok.tok is None:
                raise ValueError("batch_with holds texts but the capture was given ids, not a tokenizer")
            x = tok.encode(p)
        else:
            x = [int(i) for i in p]
        if not x:
            raise ValueError(f"batch_with[{n}] {p!r}: an empty prompt")
        if any(not 0 <= i < cfg.vocab_size for i in x):
            raise ValueError(f"batch_with[{n}]: an id outside the vocabulary (0..{cfg.vocab_size - 1})")
        ids.append(x)
    if pad_token_id is None:
        pad_token_id = getattr(cfg, "pad_token_id", None)
    if pad_token_id is None:
        eos = getattr(cfg, "eos_token_id", None)
        pad_token_id = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if len(ids) > 1 and pad_token_id is None:
        raise ValueError("a batch needs a pad token id: the config has neither pad_token_id nor eos_token_id "
                         "(pass pad_token_id=)")
    return _Batch(ids, padding_side, 0 if pad_token_id is None else int(pad_token_id))


def _batch_notes(batch, batch_with):
    """The provenance notes of a batched run: its composition, padding and what a padded traced
    sequence leaves out (empty for a batch of one)."""
    import json

    if len(batch.ids) == 1:
        return []
    pads = batch.pads(0)
    where = "before" if batch.side == "left" else "after"
    notes = [("batch_sequences", f"{len(batch.ids)} (the traced sequence first)"),
             ("batch_with", json.dumps([p if isinstance(p, str) else [int(i) for i in p] for p in batch_with],
                                       ensure_ascii=False)),
             ("batch_prompt_tokens", ",".join(str(len(x)) for x in batch.ids)),
             ("padding_side", batch.side),
             ("pad_token_id", str(batch.pad_id)),
             ("batch_pad_slots", f"{pads} pad slots {where} the traced prompt's {len(batch.ids[0])} tokens"
              if pads else f"none: the traced prompt ({len(batch.ids[0])} tokens) is the longest"),
             ("position_ids", "each token's count of its own sequence's tokens before it (attention_mask "
                              "cumsum), at every step")]
    if pads:
        notes.append((NOT_CAPTURED_NOTE, "; ".join(f"{a}: {b}" for a, b in PADDED_NOT_CAPTURED.items())))
    return notes


def _checked_arguments(model, tokenizer_or_ids, prompt, max_new_tokens, model_dir, levels, payload_levels,
                       precision):
    """The arguments of :func:`capture` (and of ``moeconf.capture_mapping.capture``) checked and
    resolved: ``(config, model_dir, level mask, payload mask, precision, tokenizer, prompt ids)``.
    Refuses another model type, no new tokens, a directory without config.json and an empty
    prompt."""
    import torch

    cfg = model.config
    if getattr(cfg, "model_type", None) != "deepseek_v4":
        raise ValueError(f"capture supports model_type deepseek_v4, got {getattr(cfg, 'model_type', None)!r}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    model_dir = os.fspath(model_dir or model.name_or_path)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir}: no config.json (pass model_dir= the checkpoint directory)")
    mask, payload_mask = parse_levels(levels), parse_levels(payload_levels)
    dtype = next(model.parameters()).dtype
    if precision is None:
        precision = {torch.float32: "hf-f32", torch.bfloat16: "hf-bf16"}.get(dtype, "hf-" + str(dtype).replace("torch.", ""))
    if isinstance(tokenizer_or_ids, (list, tuple)):
        tok, prompt_ids = _Tokenizer(None), [int(i) for i in tokenizer_or_ids]
    else:
        tok = _Tokenizer(tokenizer_or_ids)
        prompt_ids = tok.encode(prompt)
    if not prompt_ids:
        raise ValueError("empty prompt")
    return cfg, model_dir, mask, payload_mask, precision, tok, prompt_ids


def capture(model, tokenizer_or_ids, prompt, max_new_tokens, out_path, *, model_dir=None, model_name=None,
            precision=None, levels="all", payload_levels="all", algorithm="blake3", contract="hf-native",
            schedule="identity", batch_with=(), padding_side="left", pad_token_id=None):
    """Runs ``model`` (a transformers ``DeepseekV4ForCausalLM``) greedily for
    ``max_new_tokens`` forward steps on ``prompt`` and writes a canonical trace
    to ``out_path`` (atomically).

    ``tokenizer_or_ids``: a ``tokenizers.Tokenizer`` or transformers tokenizer
    (the prompt is encoded without special tokens; ``text.continuation`` is
    decoded with it), or the prompt ids themselves (then ``prompt`` is only bound
    as text and no ``text.continuation`` is recorded). ``model_dir`` (default
    ``model.name_or_path``) is the checkpoint directory whose identity is bound,
    computed as ``moeconf run`` does; ``model_name`` the bound display name
    (default: the directory). ``precision`` defaults to ``hf-f32`` / ``hf-bf16``
    from the model dtype. ``levels`` / ``payload_levels``: ``"all"``, a mask or
    level names. Returns a :class:`CaptureResult`.

    ``batch_with``: other prompts (texts, or id lists when ``tokenizer_or_ids`` is ids) decoded
    in the same batch, after the traced prompt (batch index 0), every row padded to the longest
    on ``padding_side`` (``"left"`` or ``"right"``) with ``pad_token_id`` (default: the config's,
    else its first ``eos_token_id``, as ``generate()`` falls back). Every sequence is decoded
    greedily for ``max_new_tokens`` steps; only the traced sequence's rows are recorded, at its own
    positions (its pad slots never), and the batch composition is written in the provenance notes
    (``batch_sequences``, ``batch_with``, ``padding_side``, ``pad_token_id``, ``batch_pad_slots``).
    When the traced sequence is padded (shorter than another prompt), the records of
    :data:`PADDED_NOT_CAPTURED` are left out and named, with the reason, in the
    ``moeconf.not_captured`` note.

    The run is :func:`moeconf.capture_mapping.capture`: the :mod:`moeconf.torch` engine under
    :func:`moeconf.capture_mapping.transformers_mapping` (the one capture path; the trace is
    byte for byte what this function's own hooks wrote before, python/tests/test_capture_mapping.py).
    """
    from .capture_mapping import capture as mapped

    return mapped(model, tokenizer_or_ids, prompt, max_new_tokens, out_path, model_dir=model_dir,
                  model_name=model_name, precision=precision, levels=levels, payload_levels=payload_levels,
                  algorithm=algorithm, contract=contract, schedule=schedule, batch_with=batch_with,
                  padding_side=padding_side, pad_token_id=pad_token_id)


def original_name(name):
    """The DeepSeek original (scheme B) name of a tensor that transformers'
    ``save_pretrained(save_original_format=True)`` wrote under its hybrid names
    (scheme C of the architecture notes, section 5): the ``model.`` prefix is
    dropped, ``embed_tokens`` becomes ``embed``, ``hc_head.hc_{fn,base,scale}``
    becomes ``hc_head_{fn,base,scale}`` and the attention ``attn.norm`` (HF's
    reversal of ``kv_norm``) becomes ``attn.kv_norm``. Everything else (per-expert
    ``ffn.experts.e.w1/w2/w3``, ``head.weight``, ``norm.weight``, ...) is
    already original. Idempotent on scheme-B names."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name.startswith("hc_head."):
        return "hc_head_" + name[len("hc_head.hc_"):] if name.startswith("hc_head.hc_") else name
    parts = name.split(".")
    # layers.{i}.attn.norm.weight -> layers.{i}.attn.kv_norm.weight (not attn.compressor.norm etc.)
    if len(parts) == 5 and parts[0] == "layers" and parts[2:] == ["attn", "norm", "weight"]:
        parts[3] = "kv_norm"
    return ".".join(parts)


def save_original(model, out_dir, tokenizer_json=None):
    """Saves ``model`` (a transformers ``DeepseekV4ForCausalLM``) as a DeepSeek
    original-names checkpoint (scheme B) that the reference runtime loads:
    ``save_pretrained(save_original_format=True)`` into a temporary directory
    (transformers' own reverse conversion: per-expert tensors, original module
    names), then every tensor renamed with :func:`original_name` into
    ``out_dir/model.safetensors`` (tensor bytes and dtypes unchanged), the
    ``config.json`` transformers wrote, and ``tokenizer_json`` copied as
    ``tokenizer.json`` when given. Returns the list of (hybrid, original) names
    that changed."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    renamed = []
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_original_format=True)
        tensors = {}
        for f in sorted(os.listdir(tmp)):
            if not f.endswith(".safetensors"):
                continue
            for name, t in load_file(os.path.join(tmp, f)).items():
                new = original_name(name)
                if new in tensors:
                    raise ValueError(f"{f}: tensors {name!r} and another both map to {new!r}")
                if new != name:
                    renamed.append((name, new))
                tensors[new] = t.contiguous()
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(os.path.join(tmp, "config.json"), os.path.join(out_dir, "config.json"))
    if tokenizer_json is not None:
        shutil.copyfile(tokenizer_json, os.path.join(out_dir, "tokenizer.json"))
    return renamed


class _CallableModule(types.ModuleType):
    """Makes ``moeconf.capture(model, ...)`` call :func:`capture` while the module keeps
    its other names (``moeconf.capture.save_original``, ...)."""

    def __call__(self, *args, **kwargs):
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
