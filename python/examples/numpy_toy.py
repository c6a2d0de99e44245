"""A toy MoE model in numpy whose modules have torch's hook interface
(``named_modules``, ``register_forward_hook``, ``register_forward_pre_hook``
with ``with_kwargs``, removable handles), its mapping onto the catalogue and
the greedy loop: ``moeconf.torch`` without torch. ``generic_capture.py``
runs it end to end (``python/run_wheel.sh`` does, in a venv holding only the
wheel); ``python/tests/test_torch_capture.py`` tests the engine on it."""

import numpy as np

from moeconf.torch import Mapping, Rule, capture


class _Handle:
    def __init__(self, hooks, entry):
        self.hooks, self.entry = hooks, entry

    def remove(self):
        if self.entry in self.hooks:
            self.hooks.remove(self.entry)


class Module:
    """torch.nn.Module's hook protocol, in numpy."""

    def __init__(self):
        self._children = {}
        self._pre, self._post = [], []

    def add(self, name, m):
        self._children[name] = m
        return m

    def named_modules(self, prefix=""):
        yield prefix, self
        for n, c in self._children.items():
            yield from c.named_modules(f"{prefix}.{n}" if prefix else n)

    def register_forward_hook(self, hook, *, with_kwargs=False):
        e = (hook, with_kwargs)
        self._post.append(e)
        return _Handle(self._post, e)

    def register_forward_pre_hook(self, hook, *, with_kwargs=False):
        e = (hook, with_kwargs)
        self._pre.append(e)
        return _Handle(self._pre, e)

    def hooks(self):
        return sum(len(m._pre) + len(m._post) for _, m in self.named_modules())

    def __call__(self, *args, **kwargs):
        for h, kw in list(self._pre):
            h(self, args, kwargs) if kw else h(self, args)
        out = self.forward(*args, **kwargs)
        for h, kw in list(self._post):
            h(self, args, kwargs, out) if kw else h(self, args, out)
        return out


class Fn(Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *a, **kw):
        return self.fn(*a, **kw)


D, E, K, V, LAYERS = 8, 4, 2, 16, 2
CONFIG = {"hidden_size": D, "n_routed_experts": E, "num_experts_per_tok": K, "vocab_size": V,
          "num_hidden_layers": LAYERS, "model_type": "toy-moe"}


class Router(Module):
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        logits = x @ self.w
        p = _softmax(logits)
        ids = np.argsort(-p, axis=-1, kind="stable")[:, :K]
        gates = np.take_along_axis(p, ids, -1)
        return gates.astype(np.float32), ids, logits.astype(np.float32)


class Experts(Module):
    def __init__(self, w):
        super().__init__()
        self.w = w  # [E, D, D]

    def terms(self, x, gates, ids):
        return np.stack([gates[:, j:j + 1] * np.einsum("td,tde->te", x, self.w[ids[:, j]]) for j in range(K)], 1)

    #: The dtype the routed terms are summed in (float32; a candidate backend may use float16).
    sum_dtype = np.float32

    def forward(self, x, gates, ids):
        return self.terms(x, gates, ids).astype(self.sum_dtype).sum(1).astype(np.float32)


class Layer(Module):
    def __init__(self, rng):
        super().__init__()
        self.norm = self.add("norm", Fn(lambda x: (x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6))
                                        .astype(np.float32)))
        self.router = self.add("router", Router(rng.standard_normal((D, E)).astype(np.float32)))
        self.experts = self.add("experts", Experts((rng.standard_normal((E, D, D)) / D).astype(np.float32)))

    def forward(self, x):
        h = self.norm(x)
        gates, ids, _ = self.router(h)
        return (x + self.experts(h, gates, ids)).astype(np.float32)


class Toy(Module):
    """Embedding, LAYERS MoE layers, head; one sequence, no attention and so no cache: a forward
    runs the ids it is given (a step's own ids) and returns one row of logits per id."""

    def __init__(self, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.embed = self.add("embed", Fn(lambda ids: self.table[np.asarray(ids)]))
        self.table = rng.standard_normal((V, D)).astype(np.float32)
        self.layers = [self.add(f"layers.{i}", Layer(rng)) for i in range(LAYERS)]
        self.head = rng.standard_normal((D, V)).astype(np.float32)

    def state_dict(self):
        out = {"embed.weight": self.table, "head.weight": self.head}
        for i, layer in enumerate(self.layers):
            out[f"layers.{i}.router.weight"] = layer.router.w
            out[f"layers.{i}.experts.weight"] = layer.experts.w
        return out

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x @ self.head


def _softmax(z):
    """The router's probabilities from its logits, as the router computes them (f32)."""
    p = np.exp(z - z.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).astype(np.float32)


MAPPING = Mapping([
    Rule("embed", "embed.output"),
    Rule("layers.{layer}.norm", "ffn.norm"),
    Rule("layers.{layer}.router", "router.scores", output=2, transform=_softmax, recomputed=True),
    Rule("layers.{layer}.router", "router.topk", output=1),
    Rule("layers.{layer}.router", "router.gates", output=0),
    Rule("layers.{layer}.experts", "moe.term.*", select=lambda m, a, kw, out: m.terms(*a), recomputed=True),
    Rule("layers.{layer}.experts", "moe.routed"),
    Rule("layers.{layer}.experts", "moe.combine"),
    Rule("layers.{layer}", "layer.post_ffn_mhc"),
], not_captured={"attn.*": "the toy model has no attention"}, name="toy")

PROMPT = [3, 1, 4, 1, 5]
STEPS = 4


def run(model, out, mapping=MAPPING, steps=STEPS, **kw):
    """The greedy loop. The toy model has no attention, so a step's forward needs only the ids it
    consumes (no cache)."""
    kw.setdefault("config", CONFIG)
    kw.setdefault("precision", "numpy-f32")
    with capture(model, mapping, out, prompt_ids=PROMPT, max_new_tokens=STEPS, **kw) as cap:
        feed = list(PROMPT)
        for _ in range(steps):
            with cap.step(feed) as s:
                logits = model(feed)
                feed = [s.logits(logits[-1])]
    return cap
