"""The transformers capture's own hook path as it was before it ran through moeconf.torch (commit
97335df, python/moeconf/capture.py: ``_Recorder``, the per-layer hooks, the cache and attention wraps
and the greedy loop), kept only as the oracle of python/tests/test_capture_mapping.py: the mapping
path (moeconf.capture_mapping, which moeconf.capture now calls) must write the same trace, byte for
byte, in the same process on the same CPU. It shares the argument checks, batch, binding helpers,
state reader and term recomputation with moeconf.capture (imported), so what it checks is the
recording: which rows, positions, records, order, payloads and notes. Not part of the package."""

import os

import numpy as np

from moeconf import binding_from_model
from moeconf.binding import Provenance
from moeconf.capture import (
    RECOMPUTED, ROUTED_SUMS, CaptureResult, _batch_notes, _checked_arguments, _f32, _greedy, _make_batch,
    _recompute_terms, _routed_sums, _state_records,
)
from moeconf.catalogue import LEVEL_BITS
from moeconf.catalogue import lm_records as _lm_records
from moeconf.fingerprint import Coord
from moeconf.trace import TraceWriter


class _Recorder:
    """Buffers per-(layer, position) records of one forward and writes them in the
    canonical per-position order (notes/capture.md) when the layer ends.

    The forward may run a batch: ``b`` is the traced sequence's batch index, ``slots`` the
    indices along the forward's sequence axis of its own tokens (its pad slots left out), in
    order, the k-th at position ``start + k``; ``width`` is that axis' length (row ``b * width
    + slot`` of the tensors the MoE flattens to ``[batch * width, ...]``). ``unpadded``: the
    traced sequence has no pad slot in the cache (cache slot = its own position), so records
    that index cache slots are its own (see :data:`PADDED_NOT_CAPTURED`)."""

    def __init__(self, writer, mask, payload_mask):
        self.w = writer
        self.mask = mask
        self.payload_mask = payload_mask
        self.step = 0
        self.start = 0
        self.phase = "prefill"
        self.b = 0
        self.slots = []
        self.width = 0
        self.unpadded = True
        self.pending = {}  # layer -> {position: [(level, path, array)]}

    def select(self, start, slots, width):
        """The rows of the next forward: the traced sequence's ``slots`` of ``width``, the first
        at position ``start``."""
        self.start, self.slots, self.width = start, list(slots), width

    def flat(self, k):
        """Row of the k-th own token in a tensor flattened to ``[batch * width, ...]``."""
        return self.b * self.width + self.slots[k]

    def wants(self, level):
        return bool(self.mask & LEVEL_BITS[level])

    def emit(self, position, layer, level, path, arr):
        if not self.wants(level):
            return
        keep = bool(self.payload_mask & LEVEL_BITS[level])
        self.w.append(Coord.make(self.step, int(position), self.phase, layer, path), level,
                      np.ascontiguousarray(arr), keep_payload=keep)

    def add(self, layer, position, level, path, arr):
        """Queues one record of a layer (flushed by :meth:`flush`)."""
        if self.wants(level):
            self.pending.setdefault(layer, {}).setdefault(int(position), []).append((level, path, arr))

    def add_rows(self, layer, level, path, t):
        """Queues the traced sequence's rows of ``t`` (``[batch, width, ...]``): row ``slots[k]`` of
        batch entry ``b`` at position ``start + k``; pad rows and other sequences are left out."""
        if self.wants(level):
            rows = _f32(t[self.b][self.slots])
            for k in range(rows.shape[0]):
                self.add(layer, self.start + k, level, path, rows[k])

    def flush(self, layer):
        for position in sorted(self.pending.get(layer, {})):
            for level, path, arr in self.pending[layer][position]:
                self.emit(position, layer, level, path, arr)
        self.pending.pop(layer, None)



def _attention_hooks(i, layer, rec, ctx, hook):
    """Registers (through ``hook``) the hooks that record layer ``i``'s attention half, its
    post-FFN state (the layer output, which also flushes the layer's records) and indexer."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

    attn = layer.self_attn

    def on_layer(m, args, out, i=i):
        rec.add_rows(i, "L3", "layer.post_ffn_mhc", out)
        rec.flush(i)

    def on_attn_hc(m, args, out, i=i):
        rec.add_rows(i, "L4", "attn.hc_pre", out[2])

    def on_attn_norm(m, args, out, i=i):
        rec.add_rows(i, "L4", "attn.norm", out)

    def on_attn_pre(m, args, kw, i=i, attn=attn):
        ctx["cos_sin"][i] = kw["position_embeddings"][attn.rope_layer_type]

    def on_q(m, args, out, i=i):
        if rec.wants("L4"):
            cos, sin = ctx["cos_sin"][i]
            q = mdv4.apply_rotary_pos_emb(out, cos, sin)  # the call HF makes next, same inputs
            rec.add_rows(i, "L4", "attn.q", q.transpose(1, 2))

    def on_attn(m, args, out, i=i):
        rec.add_rows(i, "L4", "attn.output", out[0])

    hook(layer, on_layer)
    hook(layer.attn_hc, on_attn_hc)
    hook(layer.input_layernorm, on_attn_norm)
    hook(attn, on_attn_pre, pre=True, kwargs=True)
    hook(attn.q_b_norm, on_q)
    hook(attn, on_attn)
    comp = attn.compressor
    if comp is not None and getattr(comp, "indexer", None) is not None:
        def on_indexer(m, args, out, i=i):
            if not rec.unpadded:  # indices into entries pooled over cache slots (PADDED_NOT_CAPTURED)
                return
            for n, s in enumerate(rec.slots):
                ids = out[rec.b, s]
                rec.add(i, rec.start + n, "L4", "attn.indexer_topk", ids[ids >= 0].to(torch.int32).numpy())

        hook(comp.indexer, on_indexer)


def _ffn_hooks(i, layer, rec, ctx, k, hook):
    """Registers (through ``hook``) the hooks that record layer ``i``'s FFN half: mHC, norm,
    router, the recomputed terms, the observed routed sum, the shared expert and the MoE output."""
    import torch

    mlp = layer.mlp

    def on_ffn_hc_pre(m, args, i=i):
        rec.add_rows(i, "L3", "layer.post_attn_mhc", args[0])

    def on_ffn_hc(m, args, out, i=i):
        rec.add_rows(i, "L4", "ffn.hc_pre", out[2])

    def on_ffn_norm(m, args, out, i=i):
        rec.add_rows(i, "L4", "ffn.norm", out)

    def on_gate(m, args, out, i=i, is_hash=mlp.is_hash):
        logits, weights, indices = out
        scores = m.score_fn(logits)
        rows = []
        if not is_hash:
            sel = (scores + m.e_score_correction_bias).float()  # the selection scores HF ranks
            top = torch.sort(sel, dim=-1, descending=True, stable=True).values
            rows = (top[:, k - 1] - top[:, k]).reshape(-1, 1) if sel.shape[-1] > k else None
        for n in range(len(rec.slots)):
            pos, s = rec.start + n, rec.flat(n)
            rec.add(i, pos, "L3", "router.scores", _f32(scores[s]))
            rec.add(i, pos, "L3", "router.topk", indices[s].to(torch.int32).numpy())
            rec.add(i, pos, "L3", "router.gates", _f32(weights[s]))
            if not is_hash and rows is not None:
                rec.add(i, pos, "L3", "router.margin", _f32(rows[s]))

    def on_experts(m, args, out, i=i):
        if not rec.wants("L4"):
            return
        x, idx, w = args[0], args[1], args[2]
        terms = _recompute_terms(m, x, idx, w)
        for n in range(len(rec.slots)):
            pos, s = rec.start + n, rec.flat(n)
            for j in range(idx.shape[1]):
                rec.add(i, pos, "L4", f"moe.term.{j}", _f32(terms[s, j]))
            rec.add(i, pos, "L4", "moe.routed", _f32(out[s]))  # observed
            ids = [int(e) for e in idx[s].tolist()]
            hits = [torch.equal(y, out[s]) for y in _routed_sums(terms[s], ids, out.dtype)]
            ctx["events"] += 1
            ctx["unexplained"] += not any(hits)
            for n, h in enumerate(hits):
                ctx["reproduced"][n] += h

    def on_shared(m, args, out, i=i):
        rec.add_rows(i, "L4", "moe.shared", out)

    def on_mlp(m, args, out, i=i):
        rec.add_rows(i, "L4", "moe.combine", out)

    hook(layer.ffn_hc, on_ffn_hc_pre, pre=True)
    hook(layer.ffn_hc, on_ffn_hc)
    hook(layer.post_attention_layernorm, on_ffn_norm)
    hook(mlp.gate, on_gate)
    hook(mlp.experts, on_experts)
    hook(mlp.shared_experts, on_shared)
    hook(mlp, on_mlp)


def _wrap_cache(cache, rec):
    """Wraps the per-layer cache methods: the current kv (argument of ``update``) and emitted
    compressed entries (argument of ``update_compressor_states``)."""
    for i, cl in enumerate(cache.layers):
        orig_update = cl.update

        def update(key_states, value_states, *a, _orig=orig_update, _i=i, **kw):
            rec.add_rows(_i, "L4", "attn.kv", key_states[:, 0])
            return _orig(key_states, value_states, *a, **kw)

        cl.update = update
        if hasattr(cl, "update_compressor_states"):
            orig_ucs = cl.update_compressor_states

            def ucs(name, compressed, _orig=orig_ucs, _i=i, _cl=cl):
                first = _cl.entry_count[name]
                path = "attn.compressed" if name == "compressor" else "attn.indexer_compressed"
                # entry j pools cache slots [(first + j) * rate, (first + j + 1) * rate): the traced
                # sequence's own positions only when it has no pad slot (PADDED_NOT_CAPTURED)
                rows = _f32(compressed[rec.b]) if rec.unpadded else np.zeros((0, 1), np.float32)
                for j in range(rows.shape[0]):
                    rec.add(_i, (first + j + 1) * _cl.compress_rate - 1, "L4", path, rows[j:j + 1])
                return _orig(name, compressed)

            cl.update_compressor_states = ucs


def _wrap_attention(rec, restore):
    """Wraps the module-global attention interface to record ``attn.core`` (its output before
    de-rotation); appends the undo to ``restore``."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

    orig_eager = mdv4.eager_attention_forward

    def eager(module, *a, **kw):
        out, weights = orig_eager(module, *a, **kw)
        rec.add_rows(module.layer_idx, "L4", "attn.core", out)
        return out, weights

    mdv4.eager_attention_forward = eager
    restore.append(lambda: setattr(mdv4, "eager_attention_forward", orig_eager))


def _generate(model, cfg, cache, rec, tok, batch, max_new_tokens):
    """The greedy loop: one forward per step with the capture's own cache, the step's L0/L1
    records and the L2 state after it, of the traced sequence (``batch.ids[0]``). Every other
    sequence of the batch is decoded greedily alongside (one token per step, its own argmax).
    Returns the traced sequence's generated ids.

    A batch of one runs as before (no attention mask, positions from the cache). A larger batch
    passes the padded rows with their 2D attention mask and position ids: each token's position
    is its sequence's count of real tokens before it (``attention_mask.cumsum(-1) - 1``, pads 0,
    as transformers' ``GenerationMixin._prepare_position_ids_for_generation`` does for the prompt),
    at every step: ``generate()`` itself continues a row from its last slot's position + 1
    (``_update_model_kwargs_for_generation``), which for a right-padded row is a pad's."""
    import torch

    prompt_ids = batch.ids[0]
    nb = len(batch.ids)
    generated = [[] for _ in range(nb)]
    ids_rows, mask_rows = batch.rows()
    am = torch.tensor(mask_rows, dtype=torch.long)
    slot_mask = list(mask_rows[0])  # the traced sequence's attention mask over the cache slots
    rec.b, rec.unpadded = 0, batch.pads(0) == 0
    with torch.no_grad():
        for step in range(max_new_tokens):
            rec.step = step
            rec.phase = "prefill" if step == 0 else "decode"
            if step == 0:
                feed = list(prompt_ids)
                ids = torch.tensor(ids_rows, dtype=torch.long)
                rec.select(0, batch.own_slots(0), batch.width)
                lasts = [batch.own_slots(b)[-1] for b in range(nb)]
            else:
                feed = [generated[0][-1]]
                ids = torch.tensor([[g[-1]] for g in generated], dtype=torch.long)
                am = torch.cat([am, torch.ones((nb, 1), dtype=am.dtype)], dim=1)
                slot_mask.append(1)
                rec.select(len(prompt_ids) + step - 1, [0], 1)
                lasts = [0] * nb
            last = rec.start + len(feed) - 1
            rec.emit(rec.start, None, "L0", "token.input", np.array(feed, dtype=np.int32))
            if nb == 1:
                out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            else:
                pos = am.cumsum(-1) - 1
                pos = pos.masked_fill(am == 0, 0)[:, -ids.shape[1]:]
                out = model(input_ids=ids, attention_mask=am, position_ids=pos, past_key_values=cache,
                            use_cache=True)
            logits = _f32(out.logits[0, lasts[0]])
            lm, nxt = _lm_records(logits)
            for path, arr in lm:
                rec.emit(last, None, "L1", path, arr)
            generated[0].append(nxt)
            for b in range(1, nb):
                generated[b].append(_greedy(_f32(out.logits[b, lasts[b]])))
            rec.emit(last, None, "L0", "token.output", np.array([nxt], dtype=np.int32))
            text = tok.decode(generated[0])
            if text is not None:
                rec.emit(last, None, "L0", "text.continuation", np.frombuffer(text.encode("utf-8"), np.uint8))
            if rec.wants("L2"):
                for layer, path, arr in _state_records(cfg, cache, 0, None if rec.unpadded else slot_mask):
                    rec.emit(last, layer, "L2", path, arr)
    return generated[0]


def reference_capture(model, tokenizer_or_ids, prompt, max_new_tokens, out_path, *, model_dir=None,
                      model_name=None, precision=None, levels="all", payload_levels="all", algorithm="blake3",
                      contract="hf-native", schedule="identity", batch_with=(), padding_side="left",
                      pad_token_id=None):
    """``moeconf.capture.capture`` as it was at 97335df: the same parameters, result and trace."""
    import torch
    import transformers
    from transformers.cache_utils import DynamicCache

    cfg, model_dir, mask, payload_mask, precision, tok, prompt_ids = _checked_arguments(
        model, tokenizer_or_ids, prompt, max_new_tokens, model_dir, levels, payload_levels, precision)
    batch = _make_batch(cfg, tok, prompt_ids, batch_with, padding_side, pad_token_id)

    binding = binding_from_model(model_dir, model_name or model_dir, prompt_text=prompt or "",
                                 prompt_ids=prompt_ids, max_new_tokens=int(max_new_tokens),
                                 precision=precision, contract=contract, schedule=schedule,
                                 capture_levels=mask, capture_payload_levels=payload_mask,
                                 algorithm=algorithm)
    notes = [("torch", torch.__version__),
             ("experts_implementation", str(getattr(cfg, "_experts_implementation", None)))]
    notes += _batch_notes(batch, batch_with)
    prov = Provenance("transformers", transformers.__version__, torch.get_num_threads(), notes)
    prov.with_recomputed(RECOMPUTED)
    # The checkpoint's files are inputs: the trace may never overwrite one of them.
    inputs = [os.path.join(model_dir, f) for f in os.listdir(model_dir)]
    writer = TraceWriter(out_path, binding, prov, algorithm, inputs=inputs)
    rec = _Recorder(writer, mask, payload_mask)
    cache = DynamicCache(config=cfg)
    base = model.model
    k = cfg.num_experts_per_tok
    handles, restore = [], []
    ctx = {"events": 0, "unexplained": 0, "reproduced": [0] * len(ROUTED_SUMS), "cos_sin": {}}

    def hook(module, fn, pre=False, kwargs=False):
        if pre:
            handles.append(module.register_forward_pre_hook(fn, with_kwargs=kwargs))
        else:
            handles.append(module.register_forward_hook(fn, with_kwargs=kwargs))

    for i, layer in enumerate(base.layers):
        _attention_hooks(i, layer, rec, ctx, hook)
        _ffn_hooks(i, layer, rec, ctx, k, hook)
    _wrap_cache(cache, rec)
    _wrap_attention(rec, restore)
    try:
        generated = _generate(model, cfg, cache, rec, tok, batch, max_new_tokens)
        summary = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        for h in handles:
            h.remove()
        for r in restore:
            r()
    return CaptureResult(generated, summary, ctx["events"], dict(zip(ROUTED_SUMS, ctx["reproduced"])),
                         ctx["unexplained"])
