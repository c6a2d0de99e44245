"""The transformers capture (:mod:`moeconf.capture`) as a :mod:`moeconf.torch` mapping: its only path.

:func:`transformers_mapping` is the mapping of a transformers ``DeepseekV4ForCausalLM`` onto the
catalogue: every record taken from a forward hook is a :class:`moeconf.torch.Rule` (``attn.hc_pre``,
``attn.norm``, ``attn.q`` (recomputed: the rotation HF applies next), ``attn.output``,
``layer.post_attn_mhc``, ``ffn.hc_pre``, ``ffn.norm``, ``router.scores`` / ``router.margin``
(recomputed), ``router.topk``, ``router.gates``, ``moe.term.*`` (recomputed by the experts module's
own forward), ``moe.routed``, ``moe.shared``, ``moe.combine``, ``layer.post_ffn_mhc``); what no
module boundary exposes is given to the engine as manual records (``attn.kv`` and
``attn.compressed`` / ``attn.indexer_compressed`` from wraps of the cache methods, ``attn.core``
from a wrap of the module-global attention function, ``attn.indexer_topk`` from the indexer's
output, with its ``-1`` sentinels dropped) and persistent state (the L2 records of every layer
after every step).

:func:`capture` runs it, and ``moeconf.capture.capture`` (so ``python3 -m moeconf transformers``)
is this function: the greedy loop with the capture's own ``DynamicCache``, the binding and the
provenance ``moeconf.capture`` has always written. With ``batch_with`` the traced prompt is batch
entry 0 and every step's forward runs the whole padded batch (2D attention mask, position ids
counted over each row's own tokens); each step gives the engine a :class:`moeconf.torch.BatchRows`
(the prefill: the prompt's own slots of the padded width; a decode step: slot 0 of width 1), so
the rules record the traced row only, and the wraps cut the same row themselves. A padded traced
row (a longer prompt beside it) shares its cache slots' pooling with its pads, so the mapping then
declares none of ``moeconf.capture.PADDED_NOT_CAPTURED`` (of the state only ``state.window_kv``,
which keeps its own slots) and the batch notes name them.

Why one path: the hook path ``moeconf.capture`` had before (python/tests/transformers_hooks_reference.py,
kept as the test oracle) and this mapping wrote the same files, and keeping one means one set of
shape, level, order and provenance rules. The mapping keeps the old provenance exactly
(``rules_note=False``, ``not_captured_note=False``, ``recomputed_order=RECOMPUTED``), so the trace
is the old file byte for byte: python/tests/test_capture_mapping.py (opt-in, marker ``transformers``)
asserts it in one process, alone and in batches, left and right padding, under every capture set,
in f32 and bf16. Requires torch and transformers (imported lazily).
"""

from .capture import (
    RECOMPUTED, ROUTED_SUMS, CaptureResult, _batch_notes, _checked_arguments, _f32, _greedy, _make_batch,
    _recompute_terms, _routed_sums, _state_records,
)
from .catalogue import LEVEL_BITS
from .torch import BatchRows, Mapping, Rule
from .torch import capture as torch_capture

__all__ = ["transformers_mapping", "capture", "state_layers"]

_L = "model.layers.{layer}"


def state_layers(cfg):
    """{state path: the layers that have it} of a DeepSeek-V4 config (as ``_state_records`` writes:
    every layer its length and window, compressed layers their compressor, CSA layers the overlap
    and the indexer)."""
    n = cfg.num_hidden_layers
    kinds = list(cfg.layer_types)
    cmp = [i for i in range(n) if kinds[i] != "sliding_attention"]
    csa = [i for i in range(n) if kinds[i] == "compressed_sparse_attention"]
    out = {"state.cumulative_length": list(range(n)), "state.window_kv": list(range(n))}
    for name in ("compressor", "indexer"):
        for f in ("buffer_kv", "buffer_gate", "compressed_kv", "entry_count"):
            out[f"state.{name}.{f}"] = cmp if name == "compressor" else csa
        for f in ("overlap_kv", "overlap_gate"):
            out[f"state.{name}.{f}"] = csa
    return {p: v for p, v in out.items() if v}


def transformers_mapping(model, ctx, padded=False):
    """The :class:`moeconf.torch.Mapping` of a transformers ``DeepseekV4ForCausalLM``. ``ctx`` is the
    capture's scratch dict: ``cos_sin`` (per layer, set by the attention pre-hook :func:`capture`
    installs), the MoE diagnostics ``events`` / ``unexplained`` / ``reproduced`` (counted over the
    traced sequence's rows) and ``cap`` (the running :class:`moeconf.torch.Capture`, whose open step
    says which rows those are). ``padded``: the traced sequence has pad slots in the cache (a shorter
    prompt of a batch), so the records of ``moeconf.capture.PADDED_NOT_CAPTURED`` are not declared:
    of the state, only ``state.window_kv``, and no compressed entry nor indexer selection."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

    cfg = model.config
    layers = list(model.model.layers)
    k = cfg.num_experts_per_tok
    layer_of = {}
    for i, layer in enumerate(layers):
        layer_of[id(layer.self_attn.q_b_norm)] = i

    def q(m, args, kw, out):
        cos, sin = ctx["cos_sin"][layer_of[id(m)]]
        return mdv4.apply_rotary_pos_emb(out, cos, sin).transpose(1, 2)  # the call HF makes next, same inputs

    def scores(m, args, kw, out):
        return m.score_fn(out[0])

    def margin(m, args, kw, out):
        sel = (m.score_fn(out[0]) + m.e_score_correction_bias).float()  # the selection scores HF ranks
        top = torch.sort(sel, dim=-1, descending=True, stable=True).values
        return (top[:, k - 1] - top[:, k]).reshape(-1, 1)

    def terms(m, args, kw, out):
        x, idx, w = args[0], args[1], args[2]
        t = _recompute_terms(m, x, idx, w)  # over the whole batch: the GEMMs of the real call
        st = ctx["cap"].current
        for s in (range(t.shape[0]) if st.batch is None else st.batch.flat):
            ids = [int(e) for e in idx[s].tolist()]
            hits = [torch.equal(y, out[s]) for y in _routed_sums(t[s], ids, out.dtype)]
            ctx["events"] += 1
            ctx["unexplained"] += not any(hits)
            for n, h in enumerate(hits):
                ctx["reproduced"][n] += h
        return t

    score_layers = [i for i, layer in enumerate(layers) if not layer.mlp.is_hash]
    rules = [
        Rule(f"{_L}.attn_hc", "attn.hc_pre", output=2),
        Rule(f"{_L}.input_layernorm", "attn.norm"),
        Rule(f"{_L}.self_attn.q_b_norm", "attn.q", select=q, recomputed=True),
        Rule(f"{_L}.self_attn", "attn.output", output=0),
        Rule(f"{_L}.ffn_hc", "layer.post_attn_mhc", input=0),
        Rule(f"{_L}.ffn_hc", "ffn.hc_pre", output=2),
        Rule(f"{_L}.post_attention_layernorm", "ffn.norm"),
        Rule(f"{_L}.mlp.gate", "router.scores", select=scores, recomputed=True),
        Rule(f"{_L}.mlp.gate", "router.topk", output=2),
        Rule(f"{_L}.mlp.gate", "router.gates", output=1),
    ]
    if score_layers and cfg.n_routed_experts > k:
        rules.append(Rule(r"model\.layers\.(?P<layer>" + "|".join(map(str, score_layers)) + r")\.mlp\.gate",
                          "router.margin", select=margin, recomputed=True, regex=True))
    rules += [
        Rule(f"{_L}.mlp.experts", "moe.term.*", select=terms, recomputed=True),
        Rule(f"{_L}.mlp.experts", "moe.routed"),
        Rule(f"{_L}.mlp.shared_experts", "moe.shared"),
        Rule(f"{_L}.mlp", "moe.combine"),
        Rule(_L, "layer.post_ffn_mhc"),
    ]
    manual = {"attn.kv": False, "attn.core": False}
    kinds = set(cfg.layer_types)
    if kinds - {"sliding_attention"} and not padded:
        manual["attn.compressed"] = False
    if "compressed_sparse_attention" in kinds and not padded:
        manual["attn.indexer_compressed"] = False
        manual["attn.indexer_topk"] = False
    state = state_layers(cfg)
    if padded:
        state = {"state.window_kv": state["state.window_kv"]}
    return Mapping(rules, state=state, manual=manual, name="transformers DeepseekV4ForCausalLM")


def _own(s):
    """(batch index, slots) of the traced sequence in step ``s``'s forward."""
    return (0, list(range(s.n))) if s.batch is None else (s.batch.index, list(s.batch.slots))


def _wrap_cache(cache, cap, wants, padded):
    """The current kv (argument of ``update``) and emitted compressed entries (argument of
    ``update_compressor_states``) of the traced sequence as manual records of the open step. A padded
    traced sequence gives no compressed entry (they pool its pad slots: ``PADDED_NOT_CAPTURED``)."""
    for i, cl in enumerate(cache.layers):
        orig_update = cl.update

        def update(key_states, value_states, *a, _orig=orig_update, _i=i, **kw):
            s = cap.current
            if wants and s is not None:
                b, slots = _own(s)
                rows = _f32(key_states[:, 0][b][slots])
                for k in range(rows.shape[0]):
                    s.record("attn.kv", rows[k], layer=_i, position=s.start + k)
            return _orig(key_states, value_states, *a, **kw)

        cl.update = update
        if hasattr(cl, "update_compressor_states"):
            orig_ucs = cl.update_compressor_states

            def ucs(name, compressed, _orig=orig_ucs, _i=i, _cl=cl):
                s = cap.current
                if wants and not padded and s is not None:
                    # entry j pools cache slots [(first + j) * rate, (first + j + 1) * rate): with no pad
                    # slot in the traced row, its own positions
                    first = _cl.entry_count[name]
                    path = "attn.compressed" if name == "compressor" else "attn.indexer_compressed"
                    rows = _f32(compressed[_own(s)[0]])
                    for j in range(rows.shape[0]):
                        s.record(path, rows[j:j + 1], layer=_i, position=(first + j + 1) * _cl.compress_rate - 1)
                return _orig(name, compressed)

            cl.update_compressor_states = ucs


def capture(model, tokenizer_or_ids, prompt, max_new_tokens, out_path, *, model_dir=None, model_name=None,
            precision=None, levels="all", payload_levels="all", algorithm="blake3", contract="hf-native",
            schedule="identity", batch_with=(), padding_side="left", pad_token_id=None):
    """``moeconf.capture.capture`` (the same parameters and :class:`moeconf.capture.CaptureResult`; that
    function calls this one): the greedy run of a transformers ``DeepseekV4ForCausalLM`` through
    :mod:`moeconf.torch` and :func:`transformers_mapping`, the traced prompt alone or decoded beside
    ``batch_with`` (each step a :class:`moeconf.torch.BatchRows` of the traced row)."""
    import torch
    import transformers
    from transformers.cache_utils import DynamicCache
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

    cfg, model_dir, mask, payload_mask, precision, tok, prompt_ids = _checked_arguments(
        model, tokenizer_or_ids, prompt, max_new_tokens, model_dir, levels, payload_levels, precision)
    batch = _make_batch(cfg, tok, prompt_ids, batch_with, padding_side, pad_token_id)
    padded = batch.pads(0) > 0
    ctx = {"events": 0, "unexplained": 0, "reproduced": [0] * len(ROUTED_SUMS), "cos_sin": {}}
    mapping = transformers_mapping(model, ctx, padded=padded)
    notes = [("torch", torch.__version__),
             ("experts_implementation", str(getattr(cfg, "_experts_implementation", None)))]
    notes += _batch_notes(batch, batch_with)
    cap = torch_capture(model, mapping, out_path, prompt_ids=prompt_ids, max_new_tokens=int(max_new_tokens),
                        config=cfg, prompt_text=prompt or "", model_dir=model_dir, model_name=model_name or model_dir,
                        levels=mask, payload_levels=payload_mask, precision=precision, contract=contract,
                        schedule=schedule, decode=None if tok.tok is None else tok.decode, runtime="transformers",
                        runtime_version=transformers.__version__, threads=torch.get_num_threads(), notes=notes,
                        allow_nan=True, algorithm=algorithm, rules_note=False, not_captured_note=False,
                        recomputed_order=RECOMPUTED)
    ctx["cap"] = cap
    wants = bool(mask & LEVEL_BITS["L4"])
    handles, restore = [], []
    try:
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn

            def on_attn_pre(m, args, kw, i=i, attn=attn):
                ctx["cos_sin"][i] = kw["position_embeddings"][attn.rope_layer_type]

            handles.append(attn.register_forward_pre_hook(on_attn_pre, with_kwargs=True))
            comp = attn.compressor
            if comp is not None and getattr(comp, "indexer", None) is not None and wants and not padded:
                def on_indexer(m, args, out, i=i):
                    # indices into the entries of attn.indexer_compressed (none for a padded row)
                    s = cap.current
                    b, slots = _own(s)
                    for n, slot in enumerate(slots):
                        ids = out[b, slot]
                        s.record("attn.indexer_topk", ids[ids >= 0].to(torch.int32).numpy(), layer=i,
                                 position=s.start + n)

                handles.append(comp.indexer.register_forward_hook(on_indexer))
        orig_eager = mdv4.eager_attention_forward

        def eager(module, *a, **kw):
            out, weights = orig_eager(module, *a, **kw)
            s = cap.current
            if wants and s is not None:
                b, slots = _own(s)
                rows = _f32(out[b][slots])
                for n in range(rows.shape[0]):
                    s.record("attn.core", rows[n], layer=module.layer_idx, position=s.start + n)
            return out, weights

        mdv4.eager_attention_forward = eager
        restore.append(lambda: setattr(mdv4, "eager_attention_forward", orig_eager))
        cache = DynamicCache(config=cfg)
        _wrap_cache(cache, cap, wants, padded)
        with torch.no_grad(), cap:
            _generate(model, cfg, cache, cap, batch, max_new_tokens, bool(mask & LEVEL_BITS["L2"]))
    finally:
        cap.close()
        for h in handles:
            h.remove()
        for r in restore:
            r()
    return CaptureResult(list(cap.generated), cap.summary, ctx["events"], dict(zip(ROUTED_SUMS, ctx["reproduced"])),
                         ctx["unexplained"])


def _generate(model, cfg, cache, cap, batch, max_new_tokens, states):
    """The greedy loop: one forward per step with the capture's own cache; the traced sequence
    (``batch.ids[0]``) is stepped through ``cap`` (its logits, its L2 state after the forward when
    ``states``), every other sequence of the batch decoded greedily alongside (its own argmax).

    A batch of one runs with no attention mask, positions from the cache. A larger batch passes the
    padded rows with their 2D attention mask and position ids: each token's position is its
    sequence's count of real tokens before it (``attention_mask.cumsum(-1) - 1``, pads 0, as
    transformers' ``GenerationMixin._prepare_position_ids_for_generation`` does for the prompt), at
    every step: ``generate()`` itself continues a row from its last slot's position + 1
    (``_update_model_kwargs_for_generation``), which for a right-padded row is a pad's."""
    import torch

    nb = len(batch.ids)
    others = [[] for _ in range(nb)]
    ids_rows, mask_rows = batch.rows()
    am = torch.tensor(mask_rows, dtype=torch.long)
    slot_mask = list(mask_rows[0])  # the traced sequence's attention mask over the cache slots
    padded = batch.pads(0) > 0
    feed = list(batch.ids[0])
    for step in range(max_new_tokens):
        if step == 0:
            ids = torch.tensor(ids_rows, dtype=torch.long)
            rows = BatchRows(nb, 0, batch.width, tuple(batch.own_slots(0)))
            lasts = [batch.own_slots(b)[-1] for b in range(nb)]
        else:
            ids = torch.tensor([[feed[0]]] + [[g[-1]] for g in others[1:]], dtype=torch.long)
            am = torch.cat([am, torch.ones((nb, 1), dtype=am.dtype)], dim=1)
            slot_mask.append(1)
            rows = BatchRows(nb, 0, 1, (0,))
            lasts = [0] * nb
        with cap.step(feed, batch=rows if nb > 1 else None) as s:
            if nb == 1:
                out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            else:
                pos = am.cumsum(-1) - 1
                pos = pos.masked_fill(am == 0, 0)[:, -ids.shape[1]:]
                out = model(input_ids=ids, attention_mask=am, position_ids=pos, past_key_values=cache,
                            use_cache=True)
            nxt = s.logits(out.logits[0, lasts[0]])
            for b in range(1, nb):
                others[b].append(_greedy(_f32(out.logits[b, lasts[b]])))
            if states:
                for layer, path, arr in _state_records(cfg, cache, 0, slot_mask if padded else None):
                    s.state(layer, path, arr)
        feed = [nxt]
