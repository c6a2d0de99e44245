"""moeconf for Python: write and read canonical moeconf traces (docs/format.md).

A backend written in Python (transformers, vLLM, SGLang hooks, ...) records its
tensors with :class:`TraceWriter`; ``moeconf inspect`` / ``moeconf diff`` (the
Rust CLI) read the result like any reference-runtime trace, and
:func:`read_trace` reads traces from either side with full validation.
Depends only on numpy and blake3; written from the specification.
"""

from .binding import ZERO_DIGEST, Binding, Provenance, TensorDigest, weights_digest
from .fingerprint import (
    Coord, binding_digest, canonicalize, record_digest, record_prefix, tree_root,
)
from .identity import model_identity, read_safetensors_header, tokenizer_digest
from . import v2
from .trace import (
    OutputError, Record, StaleTemporaryWarning, Trace, TraceFormatError, TraceWriter, WriteSummary, read_trace,
)

__version__ = "0.1.0"

__all__ = [
    "ZERO_DIGEST", "Binding", "Provenance", "TensorDigest", "weights_digest", "Coord", "binding_digest",
    "canonicalize", "record_digest", "record_prefix", "tree_root", "model_identity",
    "read_safetensors_header", "tokenizer_digest", "Record", "Trace", "TraceFormatError", "TraceWriter",
    "WriteSummary", "read_trace", "binding_from_model", "OutputError", "StaleTemporaryWarning",
]


def binding_from_model(model_dir, name, **fields):
    """A :class:`Binding` whose model and tokenizer identity are those of
    ``model_dir`` (as ``moeconf run`` computes them), with further binding
    fields from ``fields``; ``algorithm`` (default blake3) is taken from
    ``fields`` too and must match the writer's."""
    import os

    algorithm = fields.pop("algorithm", "blake3")
    ident = model_identity(name, model_dir, algorithm)
    b = Binding(model_name=ident.name, config_digest=ident.config_digest,
                weights_digest=ident.weights_digest, tensors=ident.tensors)
    tok = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(tok):
        b.tokenizer_name = "tokenizer.json"
        b.tokenizer_digest = tokenizer_digest(tok, algorithm)
    for k, v in fields.items():
        if not hasattr(b, k):
            raise TypeError(f"Binding has no field {k!r}")
        setattr(b, k, v)
    return b


# ``moeconf.capture(model, ...)``: the transformers capture (a callable module; torch and
# transformers are imported only when it runs).
from . import capture  # noqa: E402
