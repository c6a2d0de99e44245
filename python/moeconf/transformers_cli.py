"""``python3 -m moeconf transformers MODEL_DIR --prompt TEXT --max-new-tokens N -o OUT``: a trace of
Hugging Face transformers' ``DeepseekV4ForCausalLM`` decoding greedily, captured with
:func:`moeconf.capture.capture` (docs/interop.md section 3), under the settings of transformers
and torch that a serving configuration chooses (docs/invariance.md section 5.2):

* ``--experts-implementation eager|grouped_mm|batched_mm``: transformers' ``experts_implementation``
  (``from_pretrained``; default: transformers' own choice, recorded in the provenance);
* ``--dtype bf16|fp32``: the model's ``dtype`` (binds precision ``hf-bf16`` / ``hf-f32``);
* ``--threads N``: ``torch.set_num_threads(N)``, the thread count the provenance records;
* ``--batch-with PROMPT`` (repeatable) and ``--batch-with-json '["…", …]'`` (one argument: the form a
  ``moeconf invariance`` command knob takes; ``[]`` is the prompt alone): other prompts decoded in
  the same batch after the traced one, every row padded to the longest on ``--padding-side
  left|right`` (the tokenizer's ``padding_side``). Only the traced sequence's rows are recorded;
  the batch composition is in the provenance notes.

Every argument, the model directory (``config.json`` of ``model_type`` ``deepseek_v4``, a
``tokenizer.json``) and the output path are checked before torch is imported; any error exits 2
with a message and leaves no trace (the writer renames a complete file into place, or nothing).
"""

import json
import os
from typing import List, NamedTuple, Optional

from .cli_args import add_run_arguments

#: The experts implementations transformers 5.23.0 runs on CPU (integrations/moe.py).
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
#: ``--dtype`` -> the torch dtype's name.
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
PADDING_SIDES = ("left", "right")
#: The reference runtime's limit (runner/src/limits.rs).
MAX_NEW_TOKENS = 4096
#: Most other prompts in one batch (as ``moeconf invariance``'s ``batch_with``).
MAX_BATCH_WITH = 64
MAX_THREADS = 1024


class TransformersCaptureError(ValueError):
    """A bad argument, model directory or environment; the message names it."""


class Request(NamedTuple):
    """A validated capture request."""

    model_dir: str
    name: Optional[str]
    prompt: str
    max_new_tokens: int
    output: str
    experts_implementation: Optional[str]
    dtype: str
    threads: int
    batch_with: List[str]
    padding_side: str
    levels: object


def add_arguments(a):
    """The options of the ``transformers`` subcommand, on the argparse parser ``a``."""
    a.add_argument("model_dir", help="a DeepSeek-V4 checkpoint directory transformers loads (config.json, "
                   "model.safetensors, tokenizer.json), e.g. the one `moeconf run --model builtin:tiny-v4` "
                   "materializes under ~/.cache/moeconf")
    add_run_arguments(a, "bound model name (default: the directory; e.g. builtin:tiny-v4)")
    a.add_argument("--experts-implementation", default=None, choices=EXPERTS_IMPLEMENTATIONS,
                   help="transformers' experts_implementation (default: transformers' choice)")
    a.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="model dtype (default bf16)")
    a.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    a.add_argument("--batch-with", action="append", default=[], metavar="PROMPT",
                   help="another prompt decoded in the same batch (repeatable)")
    a.add_argument("--batch-with-json", default=None, metavar="JSON",
                   help="other prompts as one JSON list of strings (added after --batch-with; [] = none)")
    a.add_argument("--padding-side", default="left", choices=PADDING_SIDES,
                   help="where a batch pads its shorter rows (default left)")
    a.add_argument("--levels", default="all", help="captured levels: all, or e.g. L0,L1,L3")


def _fail(msg):
    raise TransformersCaptureError(msg)


def check_model_dir(model_dir):
    """Checks that ``model_dir`` is a directory with a DeepSeek-V4 ``config.json`` and a
    ``tokenizer.json``; returns the parsed config."""
    if not os.path.exists(model_dir):
        _fail(f"{model_dir}: no such model directory")
    if not os.path.isdir(model_dir):
        _fail(f"{model_dir}: not a directory (pass the checkpoint directory)")
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        _fail(f"{model_dir}: no config.json (not a transformers checkpoint directory)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        _fail(f"{cfg_path}: not a readable JSON config: {e}")
    if not isinstance(cfg, dict):
        _fail(f"{cfg_path}: not a JSON object")
    if cfg.get("model_type") != "deepseek_v4":
        _fail(f"{cfg_path}: model_type {cfg.get('model_type')!r}, not 'deepseek_v4': this capture runs "
              "transformers' DeepseekV4ForCausalLM only")
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        _fail(f"{model_dir}: no tokenizer.json (the prompts are encoded with it)")
    return cfg


def request_from_args(args):
    """Validates parsed arguments without importing torch; returns a :class:`Request`."""
    from .capture import parse_levels
    from .trace import OutputError, check_output

    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        _fail(f"--max-new-tokens {args.max_new_tokens}: expected 1..{MAX_NEW_TOKENS}")
    if not 1 <= args.threads <= MAX_THREADS:
        _fail(f"--threads {args.threads}: expected 1..{MAX_THREADS}")
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            _fail(f"--prompt-file {args.prompt_file}: {e}")
    else:
        prompt = args.prompt
    if not prompt:
        _fail("the prompt is empty")
    batch_with = list(args.batch_with)
    if args.batch_with_json is not None:
        try:
            extra = json.loads(args.batch_with_json)
        except json.JSONDecodeError as e:
            _fail(f"--batch-with-json {args.batch_with_json!r}: not JSON: {e}")
        if not isinstance(extra, list) or not all(isinstance(p, str) for p in extra):
            _fail(f"--batch-with-json {args.batch_with_json!r}: expected a JSON list of strings")
        batch_with += extra
    for n, p in enumerate(batch_with):
        if not p:
            _fail(f"other prompt #{n + 1} of the batch is empty")
    if len(batch_with) > MAX_BATCH_WITH:
        _fail(f"{len(batch_with)} other prompts in the batch, more than {MAX_BATCH_WITH}")
    try:
        levels = "all" if args.levels == "all" else parse_levels([x.strip() for x in args.levels.split(",")])
    except ValueError as e:
        _fail(f"--levels {args.levels!r}: {e}")
    model_dir = os.path.abspath(args.model_dir)
    check_model_dir(model_dir)
    try:
        check_output(args.output, [os.path.join(model_dir, f) for f in os.listdir(model_dir)])
    except OutputError as e:
        _fail(str(e))
    return Request(model_dir, args.name, prompt, args.max_new_tokens, args.output, args.experts_implementation,
                   args.dtype, args.threads, batch_with, args.padding_side, levels)


def run(req):
    """Loads the model under ``req``'s settings, captures, and returns the JSON summary."""
    try:
        import torch
        import transformers
        from tokenizers import Tokenizer
        from transformers import DeepseekV4ForCausalLM
    except ImportError as e:
        _fail(f"the transformers capture needs torch, transformers (with DeepSeek-V4) and tokenizers: {e}")
    from .capture import capture

    torch.set_num_threads(req.threads)
    if torch.get_num_threads() != req.threads:
        _fail(f"torch runs {torch.get_num_threads()} threads after set_num_threads({req.threads})")
    kw = {"dtype": getattr(torch, DTYPES[req.dtype]), "output_loading_info": True}
    if req.experts_implementation is not None:
        kw["experts_implementation"] = req.experts_implementation
    try:
        model, info = DeepseekV4ForCausalLM.from_pretrained(req.model_dir, **kw)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        _fail(f"{req.model_dir}: transformers cannot load it: {e}")
    missing = sorted(info.get("missing_keys") or [])
    mismatched = info.get("mismatched_keys") or []
    if missing or mismatched:
        _fail(f"{req.model_dir}: the checkpoint does not hold every weight of the model ({len(missing)} missing, "
              f"{len(mismatched)} of another shape; first: {(missing or mismatched)[0]}): transformers would "
              "initialize them at random")
    model.eval()
    impl = getattr(model.config, "_experts_implementation", None)
    if req.experts_implementation is not None and impl != req.experts_implementation:
        _fail(f"transformers runs experts implementation {impl!r}, not the {req.experts_implementation!r} asked")
    try:
        tok = Tokenizer.from_file(os.path.join(req.model_dir, "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises its own exception type
        _fail(f"{req.model_dir}/tokenizer.json: {e}")
    res = capture(model, tok, req.prompt, req.max_new_tokens, req.output, model_dir=req.model_dir,
                  model_name=req.name, levels=req.levels, batch_with=req.batch_with,
                  padding_side=req.padding_side)
    return {"file": req.output, "root": res.summary.root.hex(), "records": res.summary.records,
            "generated": res.generated, "transformers": transformers.__version__, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "experts_implementation": impl, "dtype": req.dtype,
            "batch_sequences": 1 + len(req.batch_with), "padding_side": req.padding_side,
            "moe_events": res.moe_events, "moe_routed_reproduced_by_terms": res.moe_routed_reproduced}
