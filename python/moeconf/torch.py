"""A generic PyTorch capture: declare how a model's modules map onto the component catalogue, get a
canonical trace (docs/capture.md).

The transformers (:mod:`moeconf.capture`) and vLLM (:mod:`moeconf.vllm`) captures are written for
one model each. This module is the part of them that does not depend on the model: a
:class:`Mapping` of :class:`Rule` s says which module (a pattern over ``model.named_modules()``
names, with the layer index taken from the name) gives which catalogue record (``moe.routed``,
``router.topk``, ``layer.post_ffn_mhc``, ...) from which output or argument; :func:`capture`
installs one forward hook per matched module and the user's own greedy loop marks the steps::

    from moeconf.torch import Mapping, Rule, capture

    mapping = Mapping([
        Rule("layers.{layer}.router", "router.topk", output=1),
        Rule("layers.{layer}.experts", "moe.routed"),
        Rule("layers.{layer}", "layer.post_ffn_mhc"),
    ])
    with capture(model, mapping, "toy.bin", prompt_ids=ids, max_new_tokens=4, config=cfg) as cap:
        feed = ids
        for _ in range(4):
            with cap.step(feed) as s:
                logits = model(torch.tensor([feed]))
                feed = [s.logits(logits[0, -1])]

What it does for the mapping, as the other captures do:

* **Steps and positions.** Step 0 is the prefill forward over the prompt, step s >= 1 the forward
  of the greedy token of step s - 1 (checked on the ids each step declares, ``cap.step(ids)``, which
  ``token.input`` records: the capture is greedy, ties to the lowest id; what the forward actually
  consumes is not seen); the leading axis of each hooked tensor is the step's positions
  (``[n, *item]`` or ``[1, n, *item]``: a batch of one; ``[*item]`` for one position), in order.
  L0/L1 (``token.*``, ``lm.*``, ``text.continuation`` with ``decode=``) come from
  :meth:`Step.logits`; persistent state (L2) from :meth:`Step.state`.
* **A batched forward** (the traced sequence beside others, ``cap.step(ids, batch=BatchRows(size,
  index, width, slots))``): each hooked tensor holds the whole batch, ``[size, width, *item]`` or
  ``[size * width, *item]``, and only the traced rows ``index * width + slots[k]`` are recorded, at
  the step's positions; records not per slot are the loop's to cut (:class:`BatchRows`).
* **Values** as the catalogue stores them (:mod:`moeconf.catalogue`): floats as f32 (bf16/f16 are
  exact in f32), ids as i32, counters as i64, each per-position value checked against its shape in
  the model's dimensions (from its config, or ``dims=``).
* **Levels and payloads** from a named capture set (``fingerprints``, ``default``, ``replay``,
  ``all``: docs/format.md section 5.2) or explicit ``levels`` / ``payload_levels``; records of a
  level not captured are not even converted.
* **Binding** from the checkpoint directory (``model_dir=``, as ``moeconf run`` computes it:
  :func:`moeconf.binding_from_model`) or, for a model that has none, from the model in memory
  (its config as canonical JSON without load-path keys, every ``state_dict()`` tensor's bytes,
  marked in the binding's ``extra``; a model without a non-empty ``state_dict()`` needs
  ``weights=False``).
* **Observed or recomputed.** A rule with ``recomputed=True`` (a value the capture computes from
  what it observed, e.g. router scores from the gate logits) is listed in the ``moeconf.recomputed``
  note (docs/format.md 5.2.1); every other record is the backend's own value.
* **What is not captured.** Every catalogue component of a captured level that no matched rule,
  state or manual record covers is named in the ``moeconf.not_captured`` note with a reason (the
  mapping's, or "not mapped") (docs/format.md 5.2.2), with the layers it lacks when the matched
  modules give it on some layers only. The note is in the header, written before the records: it
  is computed from the mapping and the matched modules (manual paths count as declared).
  Quantization sites and ``moe.routed`` (capture-only) are listed only when mapped.

Hostile or mistaken use fails with :class:`CaptureError` naming the rule, module, step, layer and
position: a rule matching no module, a layer index that is not a decimal integer or exceeds the
model's layers, two rules for one record, a hook that did not fire (or fired twice, or past the
highest ``call=`` index) in a step, a tensor of the wrong shape, layout (positions not leading) or
dtype (floats for ids, even whole-valued), ids of more than one sequence, a model without a
``state_dict()`` whose weights are to be bound, a NaN (unless ``allow_nan=True``), a forward
outside a step, a step declaring another token than the greedy one, fewer steps than
``max_new_tokens``. Any error
aborts the trace: the writer (:class:`moeconf.TraceWriter`) writes a temporary file and renames it
into place only when the last step is complete, so no half-written trace ever appears, and the
hooks are removed on every exit.

numpy only at import; torch is used only through the tensors and modules it is given, so the
engine runs on any object with ``named_modules()`` and ``register_forward_hook`` /
``register_forward_pre_hook`` (python/tests/test_torch_capture.py drives it with numpy).
"""

import difflib
import json
import re
import sys
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .binding import Binding, Provenance, TensorDigest, weights_digest
from .catalogue import component as component_row
from .catalogue import not_captured_note as _note_value
from .catalogue import (
    COMPONENTS, LEVEL_BITS, NOT_CAPTURED_NOTE, SHAPES, capture_set, lm_records, lookup, parse_levels,
)
from .fingerprint import Coord, hash_bytes, validate_path
from .trace import TraceWriter, check_output

__all__ = ["Rule", "Mapping", "Capture", "Step", "BatchRows", "CaptureError", "capture", "DIM_ALIASES",
           "DEFAULT_NOT_CAPTURED", "model_binding"]


class CaptureError(ValueError):
    """A mapping, a model or a run that cannot give a faithful trace; the message names the cause."""


#: Config keys each dimension symbol of the catalogue's shapes (:data:`moeconf.catalogue.SHAPES`)
#: is read from, first found wins. ``N`` (residual streams) is 1 for a model without
#: hyper-connections.
DIM_ALIASES = {
    "D": ("hidden_size", "d_model", "n_embd", "dim"),
    "N": ("hc_mult",),
    "H": ("num_attention_heads", "n_heads", "n_head"),
    "d": ("head_dim",),
    "E": ("n_routed_experts", "num_experts", "num_local_experts", "n_experts"),
    "k": ("num_experts_per_tok", "top_k", "moe_topk", "n_activated_experts"),
    "V": ("vocab_size",),
    "L": ("num_hidden_layers", "num_layers", "n_layers", "n_layer"),
}

#: The reason given for an uncovered catalogue component the mapping says nothing about.
DEFAULT_NOT_CAPTURED = "no rule of this capture's mapping records it"

_WHOLE = object()


def _is_tensor(x):
    return isinstance(x, np.ndarray) or (hasattr(x, "detach") and hasattr(x, "shape"))


def _numpy(x, what):
    """A numpy copy of a torch tensor (floats widened to f32: bf16/f16 exactly) or numpy array."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if hasattr(x, "detach"):
        t = x.detach().to("cpu")
        if t.is_floating_point():
            t = t.float()
        return t.contiguous().numpy().copy()
    raise CaptureError(f"{what}: got {type(x).__name__}, not a tensor")


def _ids(x, what):
    """A list of Python ints from ids given as a list, numpy array or tensor of integers: floats
    (even whole-valued: bf16 rounds ids above 256) and booleans are refused, and so is more than
    one dimension unless the leading ones are all 1 (a batch of one)."""
    if hasattr(x, "detach") and hasattr(x, "is_floating_point") and x.is_floating_point():
        raise CaptureError(f"{what}: {str(x.dtype).replace('torch.', '')} values: ids must be integers (a float "
                           "dtype may hold an id rounded; give the integer tensor)")
    a = _numpy(x, what) if _is_tensor(x) else np.asarray(list(x))
    if a.ndim > 1 and any(d != 1 for d in a.shape[:-1]):
        raise CaptureError(f"{what}: ids of shape {list(a.shape)}: give one sequence (a list, or [1, n]: a batch "
                           "of one)")
    a = a.reshape(-1)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise CaptureError(f"{what}: {a.dtype} values: ids must be integers" +
                           (" (a float dtype may hold an id rounded; give the integer array)"
                            if np.issubdtype(a.dtype, np.floating) else ""))
    out = [int(v) for v in a.tolist()]
    if any(not 0 <= v < 2**31 for v in out):
        raise CaptureError(f"{what}: an id outside 0..2^31-1")
    return out


def _batch_rows(batch, n, what):
    """``batch`` as a checked :class:`BatchRows` for a step of ``n`` tokens."""
    if not isinstance(batch, BatchRows):
        raise CaptureError(f"{what}: batch= must be a moeconf.torch.BatchRows")

    def count(v):
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    size, index, width = batch.size, batch.index, batch.width
    if not (count(size) and count(index) and count(width) and size >= 1 and 0 <= index < size and width >= 1):
        raise CaptureError(f"{what}: batch size {size!r}, index {index!r}, width {width!r}: the traced sequence must "
                           "be one of size >= 1 sequences of width >= 1 slots")
    slots = tuple(batch.slots)
    if len(slots) != n or any(not count(x) for x in slots):
        raise CaptureError(f"{what}: batch slots {list(slots)[:8]}: one slot index per token of the step ({n})")
    slots = tuple(int(x) for x in slots)
    if any(not 0 <= x < width for x in slots) or any(a >= b for a, b in zip(slots, slots[1:])):
        raise CaptureError(f"{what}: batch slots {list(slots)[:8]}: increasing, within 0..{width - 1}")
    return BatchRows(int(size), int(index), int(width), slots)


def _fits(shape, item):
    """Whether the axes ``shape`` (after the positions) hold one value of catalogue shape ``item``
    in its own order: ``item`` with some of its size-1 axes left out (``[D]`` for ``[1, D]``), never
    an axis it does not have (a ``[H, 1, d]`` is a heads-first layout of one position, not a
    ``[H, d]``)."""
    i = 0
    for d in shape:
        while i < len(item) and item[i] != d and item[i] == 1:
            i += 1
        if i == len(item) or item[i] != d:
            return False
        i += 1
    return all(x == 1 for x in item[i:])


def _compile(pattern, regex):
    """(compiled regex, whether it has a ``layer`` group) of a rule's module pattern. Glob syntax:
    ``*`` one name segment, ``**`` any run of segments, ``{layer}`` the segment holding the layer
    index (any segment: one that is not a decimal integer is refused when matched)."""
    if regex:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise CaptureError(f"module regex {pattern!r}: {e}") from None
        return rx, "layer" in rx.groupindex
    out, i, layer = [], 0, False
    while i < len(pattern):
        if pattern.startswith("{layer}", i):
            if layer:
                raise CaptureError(f"module pattern {pattern!r}: {{layer}} appears twice")
            out.append(r"(?P<layer>[^.]+)")
            layer, i = True, i + 7
        elif pattern.startswith("**", i):
            out.append(r".+")
            i += 2
        elif pattern[i] == "*":
            out.append(r"[^.]+")
            i += 1
        elif pattern[i] in "{}":
            raise CaptureError(f"module pattern {pattern!r}: only {{layer}} may be written in braces")
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out)), layer


class Rule:
    """One module -> one catalogue record (or the ``moe.term.J`` family).

    ``module``: a pattern over ``named_modules()`` names (glob: ``*`` one segment, ``**`` several,
    ``{layer}`` the layer index; or a regular expression with ``regex=True`` and a named group
    ``layer``), matched against the whole name. ``component``: a catalogue record path
    (``router.topk``), a family member (``moe.term.2``) or a family (``moe.term.*``: the value holds
    the k members along the first axis after the positions, ``[n, k, D]``).

    Where the value comes from (one of):

    * ``output``: the module's output (default), ``output=i`` its i-th element (a tuple output),
      ``output="name"`` an attribute or key of it;
    * ``input``: the i-th positional argument, or a keyword argument by name, as the module is
      called (a pre-hook: before the forward can change it in place);
    * ``select``: ``select(module, args, kwargs, output)`` returns the tensor.

    ``transform(tensor) -> tensor`` is applied to the selected value. A ``select`` or ``transform``
    may compute new values, so a rule with either must say ``recomputed=True`` (a value the capture
    computes: marked in ``moeconf.recomputed``) or ``recomputed=False`` (it only picks what the
    module computed). ``call=i``: the i-th call of the module in a step (a module called twice per
    layer, e.g. one mHC module for both halves): the module must then run exactly max(call) + 1
    times per step, over all its rules; by default a matched module must run exactly once per
    step. ``calls=n`` (with ``call=``): the module runs exactly n times per step, more than the
    calls the rules read (vLLM's ``mhc_post`` runs for both halves of a layer; a rule reads the
    first). ``optional=True``: the pattern may match no module (otherwise an error).
    """

    def __init__(self, module, component, *, output=_WHOLE, input=None, select=None, transform=None,
                 recomputed=None, call=None, calls=None, optional=False, regex=False):
        if not isinstance(module, str):
            raise CaptureError(f"rule module pattern {module!r} is not a string")
        self.module, self.regex = module, bool(regex)
        self.rx, has_layer = _compile(module, regex)
        self.component = component
        fam = component[:-1] if isinstance(component, str) and component.endswith(".*") else None
        if fam is not None and any(c.path == fam and c.is_family for c in COMPONENTS):
            self.spec, self.index = component_row(fam), None
        else:
            hit = lookup(component)
            if hit is None:
                raise CaptureError(f"rule {module!r}: {component!r} is not a record path of the component catalogue "
                                   "(docs/format.md section 6; a family is written moe.term.*)")
            self.spec, self.index = hit
        c = self.spec
        if c.group == "state":
            raise CaptureError(f"rule {module!r}: {component} is persistent state, read after the step: record it "
                               "with Step.state and declare it in Mapping(state=...)")
        if c.group == "step" and c.path != "embed.output":
            raise CaptureError(f"rule {module!r}: {component} is recorded by the capture itself (Step.logits)")
        if c.path not in SHAPES:
            raise CaptureError(f"rule {module!r}: {component} has no fixed per-position shape; record it with "
                               "Step.record and declare it in Mapping(manual=...)")
        if c.group == "layer" and not has_layer:
            raise CaptureError(f"rule {module!r}: {component} is a per-layer record but the pattern names no layer "
                               "({layer}, or a regex group named 'layer')")
        if c.group == "step" and has_layer:
            raise CaptureError(f"rule {module!r}: {component} is model-global but the pattern names a layer")
        sources = [output is not _WHOLE, input is not None, select is not None]
        if sum(sources) > 1:
            raise CaptureError(f"rule {module!r} -> {component}: give one of output=, input=, select=")
        self.output = None if output is _WHOLE else output
        if input is not None and not (isinstance(input, str) or (isinstance(input, int) and input >= 0)):
            raise CaptureError(f"rule {module!r} -> {component}: input={input!r} is not an argument index or name")
        self.input, self.select, self.transform = input, select, transform
        for name, f in (("select", select), ("transform", transform)):
            if f is not None and not callable(f):
                raise CaptureError(f"rule {module!r} -> {component}: {name} is not callable")
        if (select is not None or transform is not None) and recomputed is None:
            raise CaptureError(f"rule {module!r} -> {component}: a select/transform may compute new values: say "
                               "recomputed=True (the capture computes it) or recomputed=False (it only picks the "
                               "module's own value)")
        self.recomputed = bool(recomputed)
        if call is not None and not (isinstance(call, int) and not isinstance(call, bool) and call >= 0):
            raise CaptureError(f"rule {module!r} -> {component}: call={call!r} is not a call index")
        if calls is not None and (call is None or isinstance(calls, bool) or not isinstance(calls, int)
                                  or calls <= call):
            raise CaptureError(f"rule {module!r} -> {component}: calls={calls!r} needs call= and must exceed it (the "
                               "calls the module makes per step)")
        self.call, self.calls, self.optional = call, calls, bool(optional)

    @property
    def paths_pattern(self):
        """The record path(s) this rule writes, as a note pattern (``moe.term.*`` for a family)."""
        return self.spec.path + "*" if self.spec.is_family and self.index is None else (
            self.spec.path + str(self.index) if self.spec.is_family else self.spec.path)

    def describe(self):
        """``component <- module[source]`` for notes and messages."""
        if self.select is not None:
            src = "select()"
        elif self.input is not None:
            src = f"input {self.input!r}"
        elif self.output is not None:
            src = f"output {self.output!r}"
        else:
            src = "output"
        return (f"{self.paths_pattern} <- {self.module} {src}" + (" transformed" if self.transform else "")
                + (" (recomputed)" if self.recomputed else "") + (f" call {self.call}" if self.call is not None else ""))

    def __repr__(self):
        return f"Rule({self.describe()})"


class Mapping:
    """How a model's modules map onto the catalogue: the hook :class:`Rule` s, the persistent-state
    records the loop supplies per step (``state``: record paths, every layer of the model, each
    step, with :meth:`Step.state`), records the loop supplies itself (``manual``: ``{path:
    recomputed}``, a family written ``moe.term.*``, with :meth:`Step.record`) and the reasons for components it leaves out
    (``not_captured``: ``{pattern: reason}``, pattern a record path or ``prefix*``). ``name`` is
    recorded in the provenance."""

    def __init__(self, rules, *, state=(), manual=None, not_captured=None, name=""):
        self.rules: List[Rule] = list(rules)
        for r in self.rules:
            if not isinstance(r, Rule):
                raise CaptureError(f"{r!r} is not a Rule")
        if isinstance(state, str):
            raise CaptureError("Mapping(state=...) is a list of paths (or a dict path -> layers), not one string")
        if not isinstance(state, dict):
            paths = list(state)
            if len(set(paths)) != len(paths):
                raise CaptureError("Mapping(state=...) lists a path twice")
            state = {p: None for p in paths}
        #: {state path: the layers that have it (None: every layer)}.
        self.state = {}
        for p, layers in state.items():
            hit = lookup(p)
            if hit is None or hit[0].group != "state":
                raise CaptureError(f"Mapping(state=...): {p!r} is not a persistent-state record path (state.*)")
            if layers is not None:
                layers = sorted(set(layers))
                if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers):
                    raise CaptureError(f"Mapping(state=...): the layers of {p} are not layer indices")
            self.state[p] = layers
        self.manual = dict(manual or {})
        for p, rec in self.manual.items():
            c = _manual_component(p)
            if c is None or c.group not in ("layer",) and p != "embed.output":
                raise CaptureError(f"Mapping(manual=...): {p!r} is not a per-layer record path, a family (moe.term.*) "
                                   "or embed.output")
            if not isinstance(rec, bool):
                raise CaptureError(f"Mapping(manual=...): {p!r} maps to {rec!r}; give True (recomputed) or False "
                                   "(observed)")
        self.not_captured = dict(not_captured or {})
        for p, why in self.not_captured.items():
            stem = p[:-1] if isinstance(p, str) and p.endswith("*") else p
            try:
                validate_path(stem)
            except (ValueError, TypeError) as e:
                raise CaptureError(f"Mapping(not_captured=...): {p!r} is not a record path or prefix*: {e}") from None
            if not isinstance(why, str) or not why or "; " in why:
                raise CaptureError(f"Mapping(not_captured=...): the reason for {p!r} must be non-empty text without "
                                   "'; ' (the note's separator)")
        self.name = str(name)

    def manual_pattern(self, path):
        """The ``manual`` key that declares record ``path`` (the path itself, or its family
        ``moe.term.*``), or None."""
        if path in self.manual:
            return path
        for p in self.manual:
            if p.endswith(".*") and path.startswith(p[:-1]) and path[len(p) - 1:].isdigit():
                return p
        return None


def _manual_component(p):
    """The catalogue component of a ``Mapping(manual=...)`` key: a record path, or a family written
    ``moe.term.*`` (its members are given with :meth:`Step.record`); None if neither."""
    if isinstance(p, str) and p.endswith(".*"):
        hit = [c for c in COMPONENTS if c.path == p[:-1] and c.is_family]
        return hit[0] if hit else None
    hit = lookup(p) if isinstance(p, str) else None
    return None if hit is None else hit[0]


def _matches(pattern, path):
    return path.startswith(pattern[:-1]) if pattern.endswith("*") else path == pattern


def _overlap(p, q):
    """Whether two path patterns (path or ``prefix*``) can name one record."""
    if p.endswith("*") and q.endswith("*"):
        return p[:-1].startswith(q[:-1]) or q[:-1].startswith(p[:-1])
    return _matches(p, q.rstrip("*")) if p.endswith("*") else _matches(q, p)


def _config_dict(config):
    """A JSON-able dict of a model config (transformers ``PretrainedConfig``, dict, dataclass or
    namespace)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    import dataclasses

    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    if hasattr(config, "__dict__"):
        return {k: v for k, v in vars(config).items() if not k.startswith("_")}
    raise CaptureError(f"config of type {type(config).__name__}: give a dict, a dataclass or an object with "
                       "attributes")


#: Config keys left out of an in-memory config digest besides those starting with ``_``
#: (``_name_or_path``, ``_commit_hash``, ``_attn_implementation``...): where and by which library
#: version the config was loaded, not what the model is.
_NOT_IDENTITY_KEYS = ("transformers_version",)


def _identity_config(config):
    """The config dict an in-memory binding digests: without keys starting with ``_`` nor
    ``transformers_version`` (at any depth), so that one checkpoint loaded from two paths, or by
    two transformers versions, binds alike."""
    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items()
                    if not (isinstance(k, str) and (k.startswith("_") or k in _NOT_IDENTITY_KEYS))}
        if isinstance(v, (list, tuple)):
            return [strip(x) for x in v]
        return v

    return strip(_config_dict(config))


def _canonical_json(d):
    def default(v):
        s = str(v)
        if " at 0x" in s:
            raise CaptureError(f"config value {s} has no stable text (an object address): give a plain config")
        return s

    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=default).encode("utf-8")


_TORCH_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64", "int64": "i64",
                 "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "bool",
                 "float8_e4m3fn": "f8_e4m3", "float8_e5m2": "f8_e5m2"}


def _tensor_bytes(t, name):
    """(safetensors dtype name, shape, raw little-endian bytes) of a weight tensor."""
    if isinstance(t, np.ndarray):
        a = np.ascontiguousarray(t)
        dt = {"f": "f", "i": "i", "u": "u", "b": "bool"}.get(a.dtype.kind)
        if dt is None:
            raise CaptureError(f"weight {name}: numpy dtype {a.dtype} has no safetensors name")
        dtype = "bool" if dt == "bool" else f"{dt}{a.dtype.itemsize * 8}"
        return dtype, list(a.shape), a.astype(a.dtype.newbyteorder("<")).tobytes()
    if hasattr(t, "detach"):
        import torch

        x = t.detach().to("cpu").contiguous()
        key = str(x.dtype).replace("torch.", "")
        if key not in _TORCH_DTYPES:
            raise CaptureError(f"weight {name}: dtype {x.dtype} has no safetensors name")
        raw = x.view(torch.int16) if key == "bfloat16" else x.view(torch.uint8) if key.startswith("float8") else x
        return _TORCH_DTYPES[key], list(x.shape), raw.numpy().tobytes()
    raise CaptureError(f"weight {name}: {type(t).__name__} is not a tensor")


def model_binding(model, config, name, algorithm="blake3", weights=True, **fields):
    """A :class:`moeconf.Binding` of a model held in memory, without a checkpoint directory: the
    config digest is that of its canonical JSON (sorted keys, no spaces), the tensor list every
    ``state_dict()`` tensor (name, safetensors dtype, shape, digest of its raw bytes, as
    :func:`moeconf.identity.tensor_digests` digests a file's), and the binding's ``extra`` says
    so (``model_identity``), so that it is never taken for a directory's identity. Two captures of
    the same model object are comparable; a capture and ``moeconf run`` of a directory are not
    (use ``model_dir=`` for that)."""
    b = Binding(model_name=name, config_digest=hash_bytes(algorithm, _canonical_json(_identity_config(config))))
    if weights:
        sd = model.state_dict() if callable(getattr(model, "state_dict", None)) else None
        if not sd:
            raise CaptureError(f"{type(model).__name__} has " + ("no state_dict()" if sd is None else
                               "an empty state_dict()") + ": its weights cannot be bound, and two different models "
                               "would bind alike. Pass weights=False (the binding then says the weights are not "
                               "bound) or model_dir= (the checkpoint directory's identity)")
        tensors = []
        for n, t in sd.items():
            dtype, shape, raw = _tensor_bytes(t, n)
            tensors.append(TensorDigest(str(n), dtype, shape, hash_bytes(algorithm, raw)))
        tensors.sort(key=lambda t: t.name.encode("utf-8"))
        b.tensors = tensors
        b.weights_digest = weights_digest(algorithm, tensors)
    what = "state_dict() tensors" if weights else "weights not bound (weights=False)"
    extra = [("model_identity", f"in-memory (moeconf.torch): config digest of its canonical JSON, {what}")]
    for k, v in fields.items():
        if k == "extra":
            extra += list(v)
            continue
        if not hasattr(b, k):
            raise TypeError(f"Binding has no field {k!r}")
        setattr(b, k, v)
    b.extra = sorted(extra, key=lambda kv: kv[0].encode("utf-8"))
    return b


class _HeldWriter:
    """The writer of a capture whose notes are known only when it finishes (``notes=`` a callable):
    the records are held in memory, in order, and :meth:`finish` makes the real
    :class:`moeconf.TraceWriter` (``make()``, which calls the notes) and appends them, so the file
    is the one a writer made at the start with those notes would have written."""

    def __init__(self, make):
        self._make, self._held = make, []

    def append(self, *args, **kwargs):
        if self._held is None:
            raise ValueError("trace writer already finished")
        self._held.append((args, kwargs))

    def abort(self):
        self._held = None

    def finish(self):
        if self._held is None:
            raise ValueError("trace writer already finished or aborted")
        held, self._held = self._held, None
        w = self._make()
        try:
            for args, kwargs in held:
                w.append(*args, **kwargs)
            return w.finish()
        except BaseException:
            w.abort()
            raise


class _Site:
    """One matched (rule, module, layer): the hook's target."""

    def __init__(self, rule, name, module, layer):
        self.rule, self.name, self.module, self.layer = rule, name, module, layer

    def where(self):
        return f"rule {self.rule.describe()!r}, module {self.name!r}" + (
            f" (layer {self.layer})" if self.layer is not None else "")


class BatchRows(NamedTuple):
    """Where the traced sequence's tokens sit in a step's batched forward (``cap.step(tokens,
    batch=BatchRows(...))``): the forward runs ``size`` sequences over a sequence axis of ``width``
    slots; the traced one is batch entry ``index`` and its tokens are at ``slots`` (increasing, one
    per token of the step, pads and other sequences' tokens left out).

    Every hooked tensor of such a step holds the whole batch, ``[size, width, *item]`` or flattened
    ``[size * width, *item]`` (row ``index * width + slot``, as an MoE flattens its tokens); the
    capture records rows ``index * width + slots[k]`` at position ``start + k``. Records that are not
    per slot (cache contents, pooled entries) are the loop's: it gives them with :meth:`Step.record`
    / :meth:`Step.state`, selecting the traced sequence itself."""

    size: int
    index: int
    width: int
    slots: Tuple[int, ...]

    @property
    def flat(self):
        """The traced tokens' rows in a tensor flattened to ``[size * width, ...]``, in order."""
        return [self.index * self.width + s for s in self.slots]


class Step:
    """One step of a :class:`Capture` (``with cap.step(tokens) as s``): the hooks record into it
    while the model's forward runs; :meth:`logits` gives the L1 records and the greedy token,
    :meth:`state` the persistent state after the forward, :meth:`record` a declared manual record.
    Leaving the block checks that every hook fired and writes the step's records in the catalogue's
    execution order."""

    def __init__(self, cap, index, tokens, start, batch=None):
        self.cap, self.index, self.tokens, self.start = cap, index, tokens, start
        #: The :class:`BatchRows` of a batched forward, None for a batch of one.
        self.batch: Optional[BatchRows] = batch
        self.n = len(tokens)
        self.phase = "prefill" if index == 0 else "decode"
        self.calls: Dict[int, int] = {}
        self.layer_recs: Dict[tuple, tuple] = {}
        self.global_recs: Dict[tuple, tuple] = {}
        self.state_recs: Dict[tuple, tuple] = {}
        self.lm = None
        #: The greedy id of the step's last position (set by :meth:`logits`).
        self.next_token: Optional[int] = None
        self.done = False

    @property
    def positions(self):
        return range(self.start, self.start + self.n)

    def logits(self, row):
        """Records ``lm.*`` (the logits of the step's last position, a vector of the vocabulary's size)
        and returns the greedy id (ties to the lowest id), which the next step must feed."""
        self.cap._check_open(self)
        if self.lm is not None:
            raise self.cap._fail(CaptureError(f"step {self.index}: logits given twice"))
        a = _numpy(row, f"step {self.index}: logits")
        if a.ndim != 1 and not (a.ndim > 1 and a.size == a.shape[-1]):
            raise self.cap._fail(CaptureError(f"step {self.index}: logits of shape {list(a.shape)}: give the last "
                                              "position's row (one vector over the vocabulary)"))
        a = a.reshape(-1).astype(np.float32)
        v = self.cap.dims.get("V")
        if v is not None and a.size != v:
            raise self.cap._fail(CaptureError(f"step {self.index}: logits of {a.size} values, the vocabulary has {v}"))
        if a.size == 0:
            raise self.cap._fail(CaptureError(f"step {self.index}: empty logits"))
        if not self.cap.allow_nan and np.isnan(a).any():
            raise self.cap._fail(CaptureError(f"step {self.index}: NaN in the logits (pass allow_nan=True to record "
                                              "them; NaN then ranks as numpy's argsort ranks it)"))
        self.lm, self.next_token = lm_records(a)
        return self.next_token

    def state(self, layer, path, array):
        """Records persistent state ``path`` (declared in ``Mapping(state=...)``) of ``layer`` after
        this step's forward."""
        self.cap._check_open(self)
        if path not in self.cap.mapping.state:
            raise self.cap._fail(CaptureError(f"step {self.index}: state {path!r} is not declared in "
                                              "Mapping(state=...)"))
        layer = self.cap._check_layer(layer, f"step {self.index}: state {path}")
        layers = self.cap.mapping.state[path]
        if layers is not None and layer not in layers:
            raise self.cap._fail(CaptureError(f"step {self.index}: state {path} of layer {layer}: the mapping declares "
                                              f"it for layers {layers}"))
        c = lookup(path)[0]
        if (layer, c.rank) in self.state_recs:
            raise self.cap._fail(CaptureError(f"step {self.index}: state {path} of layer {layer} given twice"))
        if not self.cap._wants(c.level):
            return
        arr = self.cap._convert(_numpy(array, path) if _is_tensor(array) else np.asarray(array), c,
                                f"step {self.index} layer {layer} {path}")
        self.state_recs[(layer, c.rank)] = (path, c.level, arr)

    def record(self, path, array, layer=None, position=None):
        """Records one value of ``path`` (declared in ``Mapping(manual=...)``) at ``layer`` and
        ``position`` (default: the step's last position), as given (one position's value)."""
        self.cap._check_open(self)
        if self.cap.mapping.manual_pattern(path) is None:
            raise self.cap._fail(CaptureError(f"step {self.index}: {path!r} is not declared in Mapping(manual=...)"))
        c, idx = lookup(path)
        position = self.start + self.n - 1 if position is None else position
        if isinstance(position, np.integer):
            position = int(position)
        if not (isinstance(position, int) and position in self.positions):
            raise self.cap._fail(CaptureError(f"step {self.index}: {path} at position {position!r}, the step runs "
                                              f"positions {self.start}..{self.start + self.n - 1}"))
        if c.group == "layer":
            layer = self.cap._check_layer(layer, f"step {self.index}: {path}")
        elif layer is not None:
            raise self.cap._fail(CaptureError(f"step {self.index}: {path} is model-global, given layer {layer}"))
        if not self.cap._wants(c.level):
            return
        self.cap._manual_seen.add(self.cap.mapping.manual_pattern(path))
        arr = self.cap._convert(_numpy(array, path) if _is_tensor(array) else np.asarray(array), c,
                                f"step {self.index} layer {layer} position {position} {path}")
        self.cap._put(self, layer, position, c, idx, path, arr, f"Step.record({path!r})")

    def end(self):
        """Ends the step as leaving its ``with`` block does: for a loop the runtime drives (the step
        opened in one hook, e.g. at the start of each forward, and ended in another, after the
        logits)."""
        self.cap._end_step(self)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.cap._fail(exc if isinstance(exc, Exception) else CaptureError(f"step {self.index} interrupted"))
            return False
        self.cap._end_step(self)
        return False


class Capture:
    """A trace being written from forward hooks (made by :func:`capture`; see its parameters). A
    context manager: leaving the block normally finishes the trace (:meth:`finish`), leaving it
    by an exception aborts it (no file appears); the hooks are removed either way."""

    def __init__(self, model, mapping, out_path, *, prompt_ids, max_new_tokens, config=None, prompt_text="",
                 model_dir=None, model_name=None, capture="default", levels=None, payload_levels=None,
                 precision=None, contract="torch-native", schedule="identity", decode=None, runtime="torch",
                 runtime_version=None, threads=None, notes=(), dims=None, allow_nan=False, algorithm="blake3",
                 weights=True, tokenizer_json=None, inputs=(), rules_note=True, not_captured_note=True,
                 recomputed_order=None):
        if not isinstance(mapping, Mapping):
            raise CaptureError("mapping must be a moeconf.torch.Mapping")
        if not hasattr(model, "named_modules"):
            raise CaptureError(f"{type(model).__name__} has no named_modules(): not a torch.nn.Module")
        self.model, self.mapping, self.decode, self.allow_nan = model, mapping, decode, bool(allow_nan)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise CaptureError(f"max_new_tokens={max_new_tokens!r}: at least 1")
        self.max_new_tokens = max_new_tokens
        self.prompt_ids = _ids(prompt_ids, "prompt_ids")
        if not self.prompt_ids:
            raise CaptureError("empty prompt")
        if decode is not None and not callable(decode):
            raise CaptureError("decode must be a callable ids -> text")
        if levels is None and payload_levels is None:
            self.mask, self.payload_mask = capture_set(capture)
        else:
            if capture != "default":
                raise CaptureError("give a capture set or levels/payload_levels, not both")
            self.mask = parse_levels("all" if levels is None else levels)
            self.payload_mask = parse_levels(0 if payload_levels is None else payload_levels)
        if config is None:
            config = getattr(model, "config", None)
        self.config = config
        cfgd = _config_dict(config)
        self.dims = {}
        for sym, keys in DIM_ALIASES.items():
            for k in keys:
                v = cfgd.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    self.dims[sym] = v
                    break
        self.dims.setdefault("N", 1)
        for sym, v in (dims or {}).items():
            if sym not in DIM_ALIASES or isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CaptureError(f"dims: {sym}={v!r} (symbols {', '.join(DIM_ALIASES)}, positive integers)")
            self.dims[sym] = v
        self.sites = self._match(model, mapping)
        #: {module name: the calls a step must make of it (max(call) + 1 over the rules with call=)}.
        self._calls = {}
        for site in self.sites:
            if site.rule.call is not None:
                self._calls[site.name] = max(self._calls.get(site.name, 0), site.rule.call + 1, site.rule.calls or 0)
        self.observed, self.recomputed = self._marks()
        self.not_captured = self._not_captured()

        torch = sys.modules.get("torch")
        if precision is None:
            dt = None
            if hasattr(model, "parameters"):
                for p in model.parameters():
                    dt = str(getattr(p, "dtype", "")).replace("torch.", "")
                    break
            precision = "torch-" + {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dt, dt or "unknown")
        fields = dict(prompt_text=prompt_text or "", prompt_ids=self.prompt_ids, max_new_tokens=max_new_tokens,
                      precision=precision, contract=contract, schedule=schedule, capture_levels=self.mask,
                      capture_payload_levels=self.payload_mask)
        self._inputs = [str(i) for i in inputs]
        if model_dir is not None:
            import os

            from . import binding_from_model

            model_dir = os.fspath(model_dir)
            binding = binding_from_model(model_dir, model_name or model_dir, algorithm=algorithm, **fields)
            self._inputs += [os.path.join(model_dir, f) for f in os.listdir(model_dir)]
        else:
            binding = model_binding(model, config, model_name or type(model).__name__, algorithm, weights, **fields)
            if tokenizer_json is not None:
                from .identity import tokenizer_digest

                binding.tokenizer_name = "tokenizer.json"
                binding.tokenizer_digest = tokenizer_digest(tokenizer_json, algorithm)
                self._inputs.append(str(tokenizer_json))
        if runtime_version is None:
            runtime_version = getattr(torch, "__version__", "") if torch is not None else ""
        if threads is None:
            threads = torch.get_num_threads() if torch is not None else 1
        late = callable(notes)
        pnotes = [] if late else list(notes)
        if rules_note:
            pnotes.append(("moeconf.torch.rules", "; ".join(r.describe() for r in mapping.rules)))
            if mapping.name:
                pnotes.append(("moeconf.torch.mapping", mapping.name))
        if self.not_captured and not_captured_note:
            pnotes.append((NOT_CAPTURED_NOTE, _note_value(self.not_captured)))
        if recomputed_order is not None:
            order = list(recomputed_order)
            lost = [p for p in self.recomputed if p not in order]
            wrong = [p for p in order if p in self.observed]
            if lost or wrong or len(set(order)) != len(order):
                raise CaptureError(f"recomputed_order {order}: it must list every recomputed path of the mapping "
                                   f"{self.recomputed} once and no observed one ({', '.join(lost + wrong) or 'twice'})")
            self.recomputed = order
        self.binding = binding
        if late:
            # The header waits for finish(): the records are held until the notes are known.
            check_output(out_path, self._inputs)

            def make(_notes=notes, _tail=pnotes, _rt=runtime, _v=str(runtime_version), _t=int(threads)):
                head = _notes()
                if isinstance(head, (str, bytes)) or any(not (isinstance(kv, tuple) and len(kv) == 2) for kv in head):
                    raise CaptureError("notes() must return a list of (key, value) pairs")
                prov = Provenance(_rt, _v, _t, list(head) + _tail)
                prov.with_recomputed(self.recomputed)
                return TraceWriter(out_path, binding, prov, algorithm, inputs=self._inputs)

            self.writer = _HeldWriter(make)
        else:
            prov = Provenance(runtime, str(runtime_version), int(threads), pnotes)
            prov.with_recomputed(self.recomputed)
            self.writer = TraceWriter(out_path, binding, prov, algorithm, inputs=self._inputs)
        self.steps_done = 0
        #: The ``Mapping(manual=...)`` keys some step recorded (their level captured).
        self._manual_seen = set()
        self.generated: List[int] = []
        self._current: Optional[Step] = None
        self._failed: Optional[BaseException] = None
        self.summary = None
        self._handles = []
        try:
            self._install()
        except BaseException:
            self.close()
            self.writer.abort()
            raise

    # --- matching -------------------------------------------------------------------------

    def _check_layer(self, layer, what):
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise self._fail(CaptureError(f"{what}: layer {layer!r} is not a layer index"))
        n = self.dims.get("L")
        if n is not None and layer >= n:
            raise self._fail(CaptureError(f"{what}: layer {layer}, the model has {n} layers"))
        return layer

    def _match(self, model, mapping):
        names = [(str(n), m) for n, m in model.named_modules()]
        sites: List[_Site] = []
        owner = {}
        n_layers = self.dims.get("L")
        for rule in mapping.rules:
            hits = []
            for name, m in names:
                mt = rule.rx.fullmatch(name)
                if mt is None:
                    continue
                layer = None
                if "layer" in rule.rx.groupindex:
                    text = mt.group("layer")
                    if text is None or not (text.isascii() and text.isdigit()) or (len(text) > 1 and text[0] == "0"):
                        raise CaptureError(f"rule {rule.describe()!r}: module {name!r}: the layer index {text!r} is "
                                           "not a decimal integer (narrow the pattern, or use regex=True)")
                    layer = int(text)
                    if layer >= 2**32 or (n_layers is not None and layer >= n_layers):
                        raise CaptureError(f"rule {rule.describe()!r}: module {name!r}: layer {layer}, the model has "
                                           f"{n_layers} layers")
                hits.append(_Site(rule, name, m, layer))
            if not hits and not rule.optional:
                close = difflib.get_close_matches(rule.module.replace("{layer}", "0"), [n for n, _ in names], 5, 0.5)
                raise CaptureError(f"rule {rule.describe()!r} matches no module of {type(model).__name__} "
                                   f"({len(names)} modules" + (f"; close names: {', '.join(close)}" if close else "")
                                   + "); fix the pattern or pass optional=True")
            for s in hits:
                for (p, layer), other in owner.items():
                    if layer == s.layer and _overlap(p, rule.paths_pattern):
                        raise CaptureError(f"{s.where()} and {other.where()} both record {rule.paths_pattern} of "
                                           f"layer {s.layer}")
                owner[(rule.paths_pattern, s.layer)] = s
            sites += hits
        for p in mapping.manual:
            for r in mapping.rules:
                if _overlap(p, r.paths_pattern):
                    raise CaptureError(f"{p} is both a manual record and mapped by rule {r.describe()!r}")
        return sites

    def _marks(self):
        """(observed paths, recomputed patterns) of the mapping; a path both observed and recomputed
        is refused (the note marks a path for the whole trace)."""
        marks = {}
        for r in self.mapping.rules:
            if not self._wants(r.spec.level):
                continue
            p = r.paths_pattern
            if marks.setdefault(p, r.recomputed) != r.recomputed:
                raise CaptureError(f"{p} is recomputed by one rule and observed by another: the moeconf.recomputed "
                                   "note marks a path for the whole trace")
        for p, rec in self.mapping.manual.items():
            if self._wants(_manual_component(p).level) and marks.setdefault(p, rec) != rec:
                raise CaptureError(f"{p} is both recomputed and observed")
        return [p for p, r in marks.items() if not r], [p for p, r in marks.items() if r]

    def _not_captured(self):
        """{pattern: reason} of the catalogue components of captured levels nothing records.

        The note is in the trace's header, which the writer writes before the first record, so it
        is computed from the mapping and the modules its rules matched, not from the records: a
        rule counts only for the layers of the modules it matched (an optional rule that matched
        none covers nothing), a component the catalogue has on every layer (``layers`` ``all``)
        that the matched modules and declared state give on some layers only is named with the
        layers missing (``moe.combine: layers 1 (reason)``), one of some layer kinds only
        (``cmp``, ``csa``, ``score``: the engine does not know the kinds) is covered by any layer.
        ``state`` paths count for the layers declared, ``manual`` paths for every layer, as
        declared (the engine cannot know before the steps that the loop will give them)."""
        covered = {"token.input", "token.output", "lm.logits", "lm.topk_ids", "lm.topk_logits", "lm.margin"}
        if self.decode is not None:
            covered.add("text.continuation")
        n_layers = self.dims.get("L")
        every = set(range(n_layers)) if n_layers is not None else None
        # pattern -> the layers it is given for (None: every layer, or model-global)
        given = {}
        for p, layers in self.mapping.state.items():
            given.setdefault(p, set())
            if layers is None or given[p] is None:
                given[p] = None
            else:
                given[p] |= set(layers)
        for site in self.sites:
            p = site.rule.paths_pattern
            if site.layer is None:
                given[p] = None
            elif given.get(p, set()) is not None:
                given[p] = given.get(p, set()) | {site.layer}
        for p in self.mapping.manual:
            given[p] = None

        def probe(c):
            return c.path + "0" if c.is_family else c.path

        out, partial, missing = {}, {}, []
        for c in COMPONENTS:
            if not self._wants(c.level) or c.presence not in ("always", "on_emit"):
                continue
            path = c.path + "*" if c.is_family else c.path
            why = [q for q in self.mapping.not_captured if _matches(q, probe(c))]
            if path in covered:
                if why:
                    raise CaptureError(f"Mapping(not_captured=...): {why[0]!r} names {c.path}, which the capture "
                                       "records")
                continue
            have = set()
            for p, layers in given.items():
                if _matches(p, probe(c)) or (c.is_family and p.startswith(c.path)):
                    have = None if layers is None or have is None else have | layers
            if have is not None and not have:
                missing.append((c, path))
                continue
            lacking = [] if (have is None or every is None or c.group == "step" or c.layers != "all") else \
                sorted(every - have)
            if not lacking:
                if why:
                    raise CaptureError(f"Mapping(not_captured=...): {why[0]!r} names {c.path}, which the mapping "
                                       "records")
                continue
            partial[path] = (f"layers {', '.join(map(str, lacking))} ("
                             + (self.mapping.not_captured[why[0]] if why else DEFAULT_NOT_CAPTURED) + ")")
        out.update(partial)  # first: a reader quotes the first item whose pattern matches
        for p, why in self.mapping.not_captured.items():
            if any(_matches(p, probe(c)) for c, _ in missing):
                out[p] = why
        for c, path in missing:
            if not any(_matches(p, probe(c)) for p in self.mapping.not_captured):
                out[path] = "no detokenizer given (decode=)" if path == "text.continuation" else DEFAULT_NOT_CAPTURED
        return out

    # --- hooks ----------------------------------------------------------------------------

    def _wants(self, level):
        return bool(self.mask & LEVEL_BITS[level])

    def _install(self):
        for n, s in enumerate(self.sites):
            if not self._wants(s.rule.spec.level):
                continue
            r = s.rule
            if r.input is not None:
                def pre(module, args, kwargs=None, _s=s, _n=n):
                    self._fire(_s, _n, lambda: self._arg(_s, args, kwargs or {}))

                if isinstance(r.input, str):
                    h = s.module.register_forward_pre_hook(pre, with_kwargs=True)
                else:
                    h = s.module.register_forward_pre_hook(lambda m, a, _p=pre: _p(m, a))
            elif r.select is not None:
                def post_kw(module, args, kwargs, output, _s=s, _n=n):
                    self._fire(_s, _n, lambda: _s.rule.select(module, args, kwargs, output))

                h = s.module.register_forward_hook(post_kw, with_kwargs=True)
            else:
                def post(module, args, output, _s=s, _n=n):
                    self._fire(_s, _n, lambda: self._out(_s, output))

                h = s.module.register_forward_hook(post)
            self._handles.append(h)

    def _arg(self, s, args, kwargs):
        i = s.rule.input
        if isinstance(i, str):
            if i not in kwargs:
                raise CaptureError(f"{s.where()}: the module was called without keyword argument {i!r} "
                                   f"(keywords: {', '.join(sorted(kwargs)) or 'none'})")
            return kwargs[i]
        if i >= len(args):
            raise CaptureError(f"{s.where()}: the module was called with {len(args)} positional arguments, the rule "
                               f"reads argument {i}")
        return args[i]

    def _out(self, s, output):
        o = s.rule.output
        if o is None:
            return output
        if isinstance(o, int):
            if not isinstance(output, (tuple, list)) or not -len(output) <= o < len(output):
                raise CaptureError(f"{s.where()}: output[{o}] of a {type(output).__name__} output"
                                   + (f" of {len(output)}" if isinstance(output, (tuple, list)) else ""))
            return output[o]
        if isinstance(output, dict):
            if o not in output:
                raise CaptureError(f"{s.where()}: the output has no key {o!r}")
            return output[o]
        if not hasattr(output, o):
            raise CaptureError(f"{s.where()}: the output ({type(output).__name__}) has no attribute {o!r}")
        return getattr(output, o)

    def _fail(self, exc):
        """Marks the capture failed (the trace is aborted, the hooks removed); returns ``exc``."""
        if self._failed is None:
            self._failed = exc
            self.close()
            try:
                self.writer.abort()
            except Exception:
                pass
        return exc

    def _fire(self, s, n, get):
        st = self._current
        if self._failed is not None:
            raise CaptureError(f"the capture already failed: {self._failed}")
        if st is None:
            raise self._fail(CaptureError(f"{s.where()}: a forward ran outside a step (with cap.step(tokens): ...); "
                                          "run untraced forwards before the capture or after it finished"))
        c = st.calls.get(n, 0)
        st.calls[n] = c + 1
        r = s.rule
        if r.call is None and c > 0:
            raise self._fail(CaptureError(f"step {st.index}: {s.where()} ran twice in one step: a module called "
                                          "more than once per forward needs call=i (or a chunked prefill, which "
                                          "this capture does not merge)"))
        if r.call is not None and c >= self._calls[s.name]:
            raise self._fail(CaptureError(f"step {st.index}: {s.where()} ran {c + 1} times in one step; the rules on "
                                          f"module {s.name!r} read calls up to {self._calls[s.name] - 1} (a call "
                                          "index past the last one a rule reads would go unrecorded)"))
        if r.call is not None and c != r.call:
            return
        try:
            value = get()
            if r.transform is not None:
                value = r.transform(value)
            if not _is_tensor(value):
                raise CaptureError(f"{s.where()}: the value is a {type(value).__name__}, not a tensor (pick an "
                                   "element with output=i)")
            arr = _numpy(value, s.where())
            self._rows(st, s, arr)
        except CaptureError as e:
            raise self._fail(e)
        except Exception as e:
            raise self._fail(CaptureError(f"step {st.index}: {s.where()}: {type(e).__name__}: {e}")) from e

    def _item_shape(self, c, s):
        out = []
        for sym in SHAPES[c.path]:
            if isinstance(sym, int):
                out.append(sym)
            elif sym in self.dims:
                out.append(self.dims[sym])
            else:
                keys = "/".join(DIM_ALIASES[sym])
                raise CaptureError(f"{s.where()}: {c.path} has shape {list(SHAPES[c.path])} but the config gives no "
                                   f"{sym} ({keys}); pass dims={{{sym!r}: ...}}")
        return tuple(out)

    def _rows(self, st, s, arr):
        r = s.rule
        c = r.spec
        item = self._item_shape(c, s)
        if c.is_family and r.index is None:
            item = (self._item_shape(lookup("router.topk")[0], s)[0],) + item
        want = (st.n,) + item
        if st.batch is not None:
            arr = self._batch_select(st, s, arr)
        shape = tuple(arr.shape)
        if _fits(shape[1:], item) and shape[:1] == (st.n,):  # [n, *item]
            arr = arr.reshape(want)
        elif _fits(shape[2:], item) and shape[:2] == (1, st.n):  # [1, n, *item]: a batch of one
            arr = arr.reshape(want)
        elif st.n == 1 and _fits(shape, item):  # one position, its axis left out: [*item]
            arr = arr.reshape(want)
        else:
            what = c.path if not c.is_family else r.paths_pattern
            msg = (f"step {st.index}: {s.where()}: a tensor of shape {list(arr.shape)}, expected {st.n} position(s) "
                   f"of {what} shape {list(item)} ({list(want)}, or with a batch axis of 1)")
            if sorted(d for d in shape if d != 1) == sorted(d for d in want if d != 1):
                msg += ("; it holds as many values, in another layout: the positions must be the leading axis "
                        "(after a batch axis of 1). Give transform= that puts them first, e.g. transform=lambda t: "
                        "t.transpose(1, 2) for a heads-first [1, H, n, d], with recomputed=False")
            raise CaptureError(msg)
        for k, pos in enumerate(st.positions):
            v = arr[k]
            if c.is_family and r.index is None:
                for j in range(v.shape[0]):
                    path = f"{c.path}{j}"
                    conv = self._convert(v[j], c, f"step {st.index} layer {s.layer} position {pos} {path} ({s.where()})")
                    self._put(st, s.layer, pos, c, j, path, conv, s.where())
            else:
                path = r.paths_pattern
                conv = self._convert(v, c, f"step {st.index} layer {s.layer} position {pos} {path} ({s.where()})")
                self._put(st, s.layer, pos, c, r.index, path, conv, s.where())

    def _batch_select(self, st, s, arr):
        """The traced sequence's rows ``[n, *rest]`` of a batched step's tensor, which holds the whole
        batch as ``[size, width, *rest]`` or ``[size * width, *rest]`` (:class:`BatchRows`)."""
        b = st.batch
        shape = tuple(arr.shape)
        if shape[:2] == (b.size, b.width):
            arr = arr.reshape((b.size * b.width,) + shape[2:])
        elif not shape[:1] == (b.size * b.width,):
            raise CaptureError(f"step {st.index}: {s.where()}: a tensor of shape {list(shape)} in a batched step: "
                               f"expected the whole batch, [{b.size}, {b.width}, ...] or [{b.size * b.width}, ...] "
                               f"({b.size} sequence(s) of {b.width} slot(s))")
        return arr[b.flat]

    def _convert(self, a, c, what):
        """``a`` in the catalogue's dtype for ``c``, checked."""
        a = np.asarray(a)
        if c.kind == "float":
            if not np.issubdtype(a.dtype, np.floating):
                raise CaptureError(f"{what}: {a.dtype} values for a float record")
            a = a.astype(np.float32)
            if not self.allow_nan and np.isnan(a).any():
                raise CaptureError(f"{what}: NaN at index {int(np.flatnonzero(np.isnan(a.reshape(-1)))[0])} "
                                   "(pass allow_nan=True to record NaN)")
            return np.ascontiguousarray(a)
        if not np.issubdtype(a.dtype, np.integer):  # floats (even whole-valued: bf16 rounds ids above 256), bool
            raise CaptureError(f"{what}: {a.dtype} values for an {c.kind} record: give integers (any width; a "
                               "float dtype may hold an id or a count rounded)")
        lo, hi = (-2**31, 2**31) if c.kind == "ids" else (-2**63, 2**63)
        if a.size and (a.min() < lo or a.max() >= hi):
            raise CaptureError(f"{what}: a value outside the range of {'i32' if c.kind == 'ids' else 'i64'}")
        if c.path == "router.topk" and a.size:
            e = self.dims.get("E")
            if a.min() < 0 or (e is not None and a.max() >= e):
                raise CaptureError(f"{what}: expert id {int(a.max() if a.min() >= 0 else a.min())} outside 0.."
                                   f"{'E-1' if e is None else e - 1}")
        return np.ascontiguousarray(a.astype(c.dtype))

    def _put(self, st, layer, pos, c, idx, path, arr, where):
        key = (layer, pos, c.rank, -1 if idx is None else idx) if c.group == "layer" else (pos, c.rank)
        book = st.layer_recs if c.group == "layer" else st.global_recs
        if key in book:
            raise self._fail(CaptureError(f"step {st.index} layer {layer} position {pos}: {path} recorded twice "
                                          f"({where})"))
        book[key] = (path, c.level, arr)

    # --- steps ----------------------------------------------------------------------------

    def _check_open(self, st=None):
        if self._failed is not None:
            raise CaptureError(f"the capture failed: {self._failed}")
        if self.summary is not None:
            raise CaptureError("the capture is finished")
        if st is not None and (st is not self._current or st.done):
            raise CaptureError(f"step {st.index} is over")

    @property
    def current(self):
        """The open :class:`Step` (None between steps): what a wrap outside the rules (a cache method,
        a module-global function) records into with :meth:`Step.record`."""
        return self._current

    def step(self, tokens, batch=None):
        """Starts step ``steps_done``: ``tokens`` are the ids its forward consumes (step 0: the prompt;
        later: the previous step's greedy token), as declared: they are checked and recorded as
        ``token.input``, but what the forward really consumes is not seen. Integers in one
        sequence (a list, ``[n]`` or ``[1, n]``). Use as ``with cap.step(tokens) as s:``.

        ``batch``: a :class:`BatchRows` when the forward runs the traced sequence beside others (its
        tokens at ``batch.slots`` of batch entry ``batch.index``): only those rows are recorded."""
        self._check_open()
        if self._current is not None:
            raise self._fail(CaptureError(f"step {self._current.index} is still open"))
        i = self.steps_done
        if i >= self.max_new_tokens:
            raise self._fail(CaptureError(f"step {i}: max_new_tokens is {self.max_new_tokens}"))
        try:
            ids = _ids(tokens, f"step {i}: tokens")
        except CaptureError as e:
            raise self._fail(e)
        want = self.prompt_ids if i == 0 else [self.generated[-1]]
        if ids != want:
            raise self._fail(CaptureError(f"step {i} feeds {ids[:8]}, the capture expects {want[:8]} (" +
                                          ("the prompt" if i == 0 else "the greedy token of the previous step") + ")"))
        start = 0 if i == 0 else len(self.prompt_ids) + i - 1
        if batch is not None:
            try:
                batch = _batch_rows(batch, len(ids), f"step {i}")
            except CaptureError as e:
                raise self._fail(e)
        self._current = Step(self, i, ids, start, batch)
        return self._current

    def _end_step(self, st):
        try:
            self._check_open(st)
            if st.lm is None:
                raise CaptureError(f"step {st.index}: no logits (call s.logits(row) in the step)")
            for n, s in enumerate(self.sites):
                if not self._wants(s.rule.spec.level):
                    continue
                c = st.calls.get(n, 0)
                need = 1 if s.rule.call is None else self._calls[s.name]
                if c < need:
                    raise CaptureError(f"step {st.index}: {s.where()} " + (
                        "did not run" if c == 0 else f"ran {c} time(s), the rules on module {s.name!r} read calls "
                        f"up to {need - 1}"))
            n_layers = self.dims.get("L")
            for path, layers in self.mapping.state.items():
                c = lookup(path)[0]
                if not self._wants(c.level):
                    continue
                if layers is None and n_layers is None:
                    raise CaptureError("Mapping(state=...) needs the model's layer count (num_hidden_layers in the "
                                       "config, or dims={'L': ...})")
                absent = [layer for layer in (range(n_layers) if layers is None else layers)
                          if (layer, c.rank) not in st.state_recs]
                if absent:
                    raise CaptureError(f"step {st.index}: state {path} of layer {absent[0]} was not given "
                                       "(s.state(layer, path, array) for every layer the mapping declares)")
            self._write(st)
        except BaseException as e:
            raise self._fail(e if isinstance(e, Exception) else CaptureError(str(e)))
        st.done = True
        self._current = None
        self.steps_done += 1
        self.generated.append(st.next_token)

    def _emit(self, st, position, layer, level, path, arr):
        if self._wants(level):
            self.writer.append(Coord.make(st.index, int(position), st.phase, layer, path), level, arr,
                               keep_payload=bool(self.payload_mask & LEVEL_BITS[level]))

    def _write(self, st):
        last = st.start + st.n - 1
        self._emit(st, st.start, None, "L0", "token.input", np.array(st.tokens, dtype=np.int32))
        for key in sorted(st.global_recs):
            path, level, arr = st.global_recs[key]
            self._emit(st, key[0], None, level, path, arr)
        for key in sorted(st.layer_recs):
            path, level, arr = st.layer_recs[key]
            self._emit(st, key[1], key[0], level, path, arr)
        for path, arr in st.lm:
            self._emit(st, last, None, "L1", path, arr)
        self._emit(st, last, None, "L0", "token.output", np.array([st.next_token], dtype=np.int32))
        if self.decode is not None:
            text = self.decode(self.generated + [st.next_token])
            if not isinstance(text, str):
                raise CaptureError(f"decode returned {type(text).__name__}, not str")
            self._emit(st, last, None, "L0", "text.continuation", np.frombuffer(text.encode("utf-8"), np.uint8))
        for key in sorted(st.state_recs):
            path, level, arr = st.state_recs[key]
            self._emit(st, last, key[0], level, path, arr)

    def generate(self, forward):
        """Runs the greedy loop itself: ``forward(ids)`` (the ids the step consumes, a list) runs the
        model and returns the logits of the step's last position; ``state(step)`` is not needed for
        a mapping without state. Returns the generated ids. For loops that manage their own caches
        or state, write the loop with :meth:`step` instead."""
        feed = list(self.prompt_ids)
        for _ in range(self.max_new_tokens - self.steps_done):
            with self.step(feed) as s:
                s.logits(forward(list(feed)))
            feed = [s.next_token]
        return list(self.generated)

    def finish(self):
        """Checks that every step ran, writes the trace (atomically) and removes the hooks; returns
        the writer's :class:`moeconf.WriteSummary`."""
        self._check_open()
        try:
            if self._current is not None:
                raise CaptureError(f"step {self._current.index} is still open")
            if self.steps_done != self.max_new_tokens:
                raise CaptureError(f"{self.steps_done} step(s) captured, max_new_tokens is {self.max_new_tokens}: the "
                                   "trace would claim steps it does not hold")
            unrecorded = [p for p in self.mapping.manual
                          if self._wants(_manual_component(p).level) and p not in self._manual_seen]
            if unrecorded:
                raise CaptureError(f"{', '.join(unrecorded)}: declared in Mapping(manual=...) but no step recorded "
                                   "it (Step.record): the trace would claim a record it does not hold (a declared "
                                   "path is not named in moeconf.not_captured); record it or remove the declaration")
            self.summary = self.writer.finish()
        except BaseException as e:
            raise self._fail(e if isinstance(e, Exception) else CaptureError(str(e)))
        self.close()
        return self.summary

    def close(self):
        """Removes every hook (idempotent)."""
        hs, self._handles = self._handles, []
        for h in hs:
            h.remove()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._fail(exc if isinstance(exc, Exception) else CaptureError("interrupted"))
            return False
        if self._failed is not None:
            raise CaptureError(f"the capture failed: {self._failed}")
        if self.summary is None:
            self.finish()
        return False


def capture(model, mapping, out_path, **kwargs):
    """A :class:`Capture` of ``model`` (a ``torch.nn.Module``, or any object with
    ``named_modules()`` whose modules have ``register_forward_hook`` /
    ``register_forward_pre_hook``) under ``mapping``, writing ``out_path``. Keyword arguments:

    * ``prompt_ids`` (required), ``max_new_tokens`` (required, the steps), ``prompt_text``;
    * ``config`` (default ``model.config``): the dimensions (:data:`DIM_ALIASES`) and, without
      ``model_dir``, the config digest; ``dims={"E": 8}`` overrides or adds dimensions;
    * ``capture`` (``fingerprints``, ``default``, ``replay``, ``all``; default ``default``) or
      ``levels`` / ``payload_levels`` (``"all"``, a mask, level names);
    * ``model_dir`` (bind the checkpoint directory's identity, as ``moeconf run``) or in-memory
      identity (:func:`model_binding`; ``weights=False`` leaves the tensors out), ``model_name``,
      ``tokenizer_json``;
    * ``precision`` (default ``torch-f32`` / ``torch-bf16`` from the parameters), ``contract``
      (default ``torch-native``), ``schedule``;
    * ``decode`` (ids -> text: records ``text.continuation``), ``runtime`` / ``runtime_version`` /
      ``threads`` / ``notes`` (provenance), ``allow_nan``, ``algorithm``, ``inputs`` (files the
      trace may not overwrite);
    * ``notes`` may be a callable returning the pairs, for what only the finished run knows (what
      a runtime reports once its generate call returns): it is called by :meth:`Capture.finish`,
      and the header that holds the notes is written then, so the records are held in memory
      until the end instead of streamed (the file is the same; the output path is still checked
      at the start, a record the writer refuses is reported at the end);
    * for re-expressing an existing capture byte for byte (its provenance exactly as it was):
      ``rules_note=False`` (no ``moeconf.torch.rules`` / ``moeconf.torch.mapping`` note),
      ``not_captured_note=False`` (no ``moeconf.not_captured`` note: the caller writes its own
      in ``notes``, or none), ``recomputed_order`` (the ``moeconf.recomputed`` patterns in this
      order: every recomputed path of the mapping, and possibly paths no rule records at the
      captured levels, never an observed one).
    """
    return Capture(model, mapping, out_path, **kwargs)

