"""The transformers capture (:mod:`moeconf.capture`) re-expressed as a :mod:`moeconf.torch` mapping.

:func:`transformers_mapping` is the mapping of a transformers ``DeepseekV4ForCausalLM`` onto the
catalogue: every record ``moeconf.capture`` takes from a forward hook is a :class:`moeconf.torch.Rule`
(``attn.hc_pre``, ``attn.norm``, ``attn.q`` (recomputed: the rotation HF applies next),
``attn.output``, ``layer.post_attn_mhc``, ``ffn.hc_pre``, ``ffn.norm``, ``router.scores`` /
``router.margin`` (recomputed), ``router.topk``, ``router.gates``, ``moe.term.*`` (recomputed by
the experts module's own forward), ``moe.routed``, ``moe.shared``, ``moe.combine``,
``layer.post_ffn_mhc``); what no module boundary exposes stays what it is in ``moeconf.capture``
and is given to the engine as manual records (``attn.kv`` and ``attn.compressed`` /
``attn.indexer_compressed`` from wraps of the cache methods, ``attn.core`` from a wrap of the
module-global attention function, ``attn.indexer_topk`` from the indexer's output, with its
``-1`` sentinels dropped) and persistent state (the L2 records of every layer after every step).

:func:`capture` runs it: the same greedy loop, binding and provenance as ``moeconf.capture.capture``
and, for a batch of one, the same trace byte for byte (python/tests/test_capture_mapping.py, in
the opt-in transformers suite, asserts it). A batch (``batch_with``) is not re-expressed: the
engine takes a batch of one. Requires torch and transformers (imported lazily).
"""

from .capture import (
    RECOMPUTED, ROUTED_SUMS, CaptureResult, _checked_arguments, _f32, _make_batch, _recompute_terms, _routed_sums, _state_records,
)
from .torch import Mapping, Rule
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


def transformers_mapping(model, ctx):
    """The :class:`moeconf.torch.Mapping` of a transformers ``DeepseekV4ForCausalLM``. ``ctx`` is the
    capture's scratch dict: ``cos_sin`` (per layer, set by the attention pre-hook :func:`capture`
    installs) and the MoE diagnostics ``events`` / ``unexplained`` / ``reproduced``."""
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
        t = _recompute_terms(m, x, idx, w)
        for s in range(t.shape[0]):
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
    if kinds - {"sliding_attention"}:
        manual["attn.compressed"] = False
    if "compressed_sparse_attention" in kinds:
        manual["attn.indexer_compressed"] = False
        manual["attn.indexer_topk"] = False
    return Mapping(rules, state=state_layers(cfg), manual=manual, name="transformers DeepseekV4ForCausalLM")


def _wrap_cache(cache, cap, undo):
    """The current kv (argument of ``update``) and emitted compressed entries (argument of
    ``update_compressor_states``) as manual records of the open step (``moeconf.capture._wrap_cache``)."""
    wants = bool(cap.mask & 16)
    for i, cl in enumerate(cache.layers):
        orig_update = cl.update

        def update(key_states, value_states, *a, _orig=orig_update, _i=i, **kw):
            s = cap.current
            if wants and s is not None:
                rows = _f32(key_states[:, 0][0])
                for k in range(rows.shape[0]):
                    s.record("attn.kv", rows[k], layer=_i, position=s.start + k)
            return _orig(key_states, value_states, *a, **kw)

        cl.update = update
        if hasattr(cl, "update_compressor_states"):
            orig_ucs = cl.update_compressor_states

            def ucs(name, compressed, _orig=orig_ucs, _i=i, _cl=cl):
                s = cap.current
                if wants and s is not None:
                    first = _cl.entry_count[name]
                    path = "attn.compressed" if name == "compressor" else "attn.indexer_compressed"
                    rows = _f32(compressed[0])
                    for j in range(rows.shape[0]):
                        s.record(path, rows[j:j + 1], layer=_i, position=(first + j + 1) * _cl.compress_rate - 1)
                return _orig(name, compressed)

            cl.update_compressor_states = ucs


def capture(model, tokenizer_or_ids, prompt, max_new_tokens, out_path, *, model_dir=None, model_name=None,
            precision=None, levels="all", payload_levels="all", algorithm="blake3", contract="hf-native",
            schedule="identity", batch_with=()):
    """``moeconf.capture.capture`` for a batch of one, through :mod:`moeconf.torch` and
    :func:`transformers_mapping`: the same parameters (``batch_with`` must be empty), the same
    :class:`moeconf.capture.CaptureResult`, the same trace."""
    import torch
    import transformers
    from transformers.cache_utils import DynamicCache
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

    if batch_with:
        raise ValueError("capture_mapping.capture takes a batch of one (use moeconf.capture for batch_with)")
    cfg, model_dir, mask, payload_mask, precision, tok, prompt_ids = _checked_arguments(
        model, tokenizer_or_ids, prompt, max_new_tokens, model_dir, levels, payload_levels, precision)
    _make_batch(cfg, tok, prompt_ids, (), "left", None)  # the same checks as moeconf.capture
    ctx = {"events": 0, "unexplained": 0, "reproduced": [0] * len(ROUTED_SUMS), "cos_sin": {}}
    mapping = transformers_mapping(model, ctx)
    notes = [("torch", torch.__version__),
             ("experts_implementation", str(getattr(cfg, "_experts_implementation", None)))]
    cap = torch_capture(model, mapping, out_path, prompt_ids=prompt_ids, max_new_tokens=int(max_new_tokens),
                        config=cfg, prompt_text=prompt or "", model_dir=model_dir, model_name=model_name or model_dir,
                        levels=mask, payload_levels=payload_mask, precision=precision, contract=contract,
                        schedule=schedule, decode=None if tok.tok is None else tok.decode, runtime="transformers",
                        runtime_version=transformers.__version__, threads=torch.get_num_threads(), notes=notes,
                        allow_nan=True, algorithm=algorithm, rules_note=False, not_captured_note=False,
                        recomputed_order=RECOMPUTED)
    handles, restore = [], []
    try:
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn

            def on_attn_pre(m, args, kw, i=i, attn=attn):
                ctx["cos_sin"][i] = kw["position_embeddings"][attn.rope_layer_type]

            handles.append(attn.register_forward_pre_hook(on_attn_pre, with_kwargs=True))
            comp = attn.compressor
            if comp is not None and getattr(comp, "indexer", None) is not None and mask & 16:
                def on_indexer(m, args, out, i=i):
                    s = cap.current
                    for n in range(s.n):
                        ids = out[0, n]
                        s.record("attn.indexer_topk", ids[ids >= 0].to(torch.int32).numpy(), layer=i,
                                 position=s.start + n)

                handles.append(comp.indexer.register_forward_hook(on_indexer))
        orig_eager = mdv4.eager_attention_forward

        def eager(module, *a, **kw):
            out, weights = orig_eager(module, *a, **kw)
            s = cap.current
            if mask & 16 and s is not None:
                rows = _f32(out[0])
                for n in range(rows.shape[0]):
                    s.record("attn.core", rows[n], layer=module.layer_idx, position=s.start + n)
            return out, weights

        mdv4.eager_attention_forward = eager
        restore.append(lambda: setattr(mdv4, "eager_attention_forward", orig_eager))
        cache = DynamicCache(config=cfg)
        _wrap_cache(cache, cap, restore)
        with torch.no_grad(), cap:
            feed = list(prompt_ids)
            for step in range(max_new_tokens):
                with cap.step(feed) as s:
                    ids = torch.tensor([feed], dtype=torch.long)
                    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                    nxt = s.logits(out.logits[0, len(feed) - 1])
                    if mask & 4:
                        for layer, path, arr in _state_records(cfg, cache, 0, None):
                            s.state(layer, path, arr)
                feed = [nxt]
    finally:
        cap.close()
        for h in handles:
            h.remove()
        for r in restore:
            r()
    return CaptureResult(list(cap.generated), cap.summary, ctx["events"], dict(zip(ROUTED_SUMS, ctx["reproduced"])),
                         ctx["unexplained"])

