"""The trace header (docs/format.md section 5.2): the hashed :class:`Binding`
(what the trace is a trace *of*) and the unhashed :class:`Provenance` (who
produced it), with their wire encodings.
"""

from dataclasses import dataclass, field
from typing import List, Tuple

from .fingerprint import MAX_RANK, hash_bytes, validate_path
from .wire import Encoder

__all__ = ["ZERO_DIGEST", "TensorDigest", "Binding", "Provenance", "weights_digest", "RECOMPUTED_NOTE",
           "parse_recomputed"]

#: Provenance note key listing the records a capture recomputed (docs/format.md section 5.2.1).
RECOMPUTED_NOTE = "moeconf.recomputed"
#: At most this many patterns in the note.
MAX_RECOMPUTED_PATTERNS = 256


def parse_recomputed(value):
    """The patterns of a ``moeconf.recomputed`` note value (comma-separated record paths, each
    optionally ending in ``*`` for a prefix; no spaces, no duplicates); raises ValueError."""
    patterns = []
    for p in value.split(","):
        stem = p[:-1] if p.endswith("*") else p
        try:
            validate_path(stem)
        except ValueError as e:
            raise ValueError(f"{RECOMPUTED_NOTE}: pattern {p!r} is not a record path (optionally ending in *): {e}")
        if p in patterns:
            raise ValueError(f"{RECOMPUTED_NOTE}: pattern {p!r} is listed twice")
        if len(patterns) == MAX_RECOMPUTED_PATTERNS:
            raise ValueError(f"{RECOMPUTED_NOTE}: more than {MAX_RECOMPUTED_PATTERNS} patterns")
        patterns.append(p)
    return patterns

#: 32 zero bytes: the digest a producer writes when it knows no model/tokenizer digest.
ZERO_DIGEST = b"\x00" * 32
_MAX_TENSORS = 1 << 20
_MAX_PROMPT_IDS = 1 << 24


def _digest(v, what):
    if not (isinstance(v, (bytes, bytearray)) and len(v) == 32):
        raise ValueError(f"{what} must be 32 bytes")
    return bytes(v)


@dataclass
class TensorDigest:
    """One weight tensor of the model: name, stored dtype (``bf16``, ``f32``, ...),
    shape, and the digest of its raw bytes."""

    name: str
    dtype: str
    shape: List[int]
    digest: bytes

    def encode(self, e):
        """Appends the wire encoding (name, dtype, shape, digest)."""
        e.str(self.name).str(self.dtype).length(len(self.shape))
        for d in self.shape:
            e.u64(d)
        e.raw(_digest(self.digest, f"tensor {self.name} digest"))


def weights_digest(algorithm, tensors):
    """``H("moeconf.weights.v1": String, tensors: Vec<TensorDigest>)``; ``tensors``
    must already be sorted by name (section 5.2)."""
    e = Encoder().str("moeconf.weights.v1").length(len(tensors))
    for t in tensors:
        t.encode(e)
    return hash_bytes(algorithm, e.bytes())


@dataclass
class Binding:
    """Every hashed fact that decides comparability and execution semantics
    (section 5.2). Field names follow the specification; ``capture_levels`` and
    ``capture_payload_levels`` are bit masks (bit i = level Li)."""

    model_name: str = ""
    config_digest: bytes = ZERO_DIGEST
    weights_digest: bytes = ZERO_DIGEST
    tensors: List[TensorDigest] = field(default_factory=list)
    tokenizer_name: str = ""
    tokenizer_digest: bytes = ZERO_DIGEST
    prompt_text: str = ""
    prompt_ids: List[int] = field(default_factory=list)
    decoding_strategy: str = "greedy"
    max_new_tokens: int = 0
    precision: str = ""
    contract: str = "native"
    schedule: str = "identity"
    capture_levels: int = 0b11111
    capture_payload_levels: int = 0
    fold_negative_zero: bool = False
    extra: List[Tuple[str, str]] = field(default_factory=list)

    def validate(self):
        """Raises ValueError on values the format cannot carry."""
        for mask, what in ((self.capture_levels, "capture_levels"),
                           (self.capture_payload_levels, "capture_payload_levels")):
            if not (isinstance(mask, int) and 0 <= mask <= 0b11111):
                raise ValueError(f"{what} {mask!r} is not a bit mask of levels L0..L4")
        for i in self.prompt_ids:
            if not (isinstance(i, int) and 0 <= i < 2**32):
                raise ValueError(f"prompt id {i!r} is not a u32")
        if not (isinstance(self.max_new_tokens, int) and 0 <= self.max_new_tokens < 2**32):
            raise ValueError(f"max_new_tokens {self.max_new_tokens!r} is not a u32")
        names = [t.name for t in self.tensors]
        if names != sorted(names, key=lambda n: n.encode("utf-8")):
            raise ValueError("binding tensors must be sorted by name")
        for t in self.tensors:
            if len(t.shape) > MAX_RANK:
                raise ValueError(f"tensor {t.name} has rank {len(t.shape)} > {MAX_RANK}")
        keys = [k for k, _ in self.extra]
        if keys != sorted(keys, key=lambda k: k.encode("utf-8")):
            raise ValueError("binding extra must be sorted by key")

    def encode(self, e):
        """Appends the wire encoding in the field order of section 5.2."""
        e.str(self.model_name).raw(_digest(self.config_digest, "config_digest"))
        e.raw(_digest(self.weights_digest, "weights_digest")).length(len(self.tensors))
        for t in self.tensors:
            t.encode(e)
        e.str(self.tokenizer_name).raw(_digest(self.tokenizer_digest, "tokenizer_digest"))
        e.str(self.prompt_text).length(len(self.prompt_ids))
        for i in self.prompt_ids:
            e.u32(i)
        e.str(self.decoding_strategy).u32(self.max_new_tokens)
        e.str(self.precision).str(self.contract).str(self.schedule)
        e.u32(self.capture_levels).u32(self.capture_payload_levels).bool(self.fold_negative_zero)
        e.pairs(self.extra)

    def to_bytes(self):
        """The wire encoding (the preimage input of the binding digest)."""
        e = Encoder()
        self.encode(e)
        return e.bytes()

    @staticmethod
    def decode(d):
        """Decodes a binding from a :class:`moeconf.wire.Decoder`, applying the caps of section 7."""
        b = Binding()
        b.model_name = d.str("model name")
        b.config_digest = d.array32("model config digest")
        b.weights_digest = d.array32("model weights digest")
        n = d.length("model tensor list", 8 + 8 + 8 + 32, _MAX_TENSORS)
        for _ in range(n):
            name = d.str("tensor name")
            dtype = d.str("tensor dtype", 64)
            rank = d.length("tensor shape", 8, MAX_RANK)
            shape = [d.u64("tensor dimension") for _ in range(rank)]
            b.tensors.append(TensorDigest(name, dtype, shape, d.array32("tensor digest")))
        b.tokenizer_name = d.str("tokenizer name")
        b.tokenizer_digest = d.array32("tokenizer digest")
        b.prompt_text = d.str("prompt text")
        n = d.length("prompt ids", 4, _MAX_PROMPT_IDS)
        b.prompt_ids = [d.u32("prompt id") for _ in range(n)]
        b.decoding_strategy = d.str("decoding strategy", 64)
        b.max_new_tokens = d.u32("max new tokens")
        b.precision = d.str("precision")
        b.contract = d.str("contract")
        b.schedule = d.str("schedule")
        at = d.offset()
        b.capture_levels = d.u32("capture levels")
        b.capture_payload_levels = d.u32("capture payload levels")
        if b.capture_levels > 0b11111 or b.capture_payload_levels > 0b11111:
            raise d.error("capture spec names a level above L4", at)
        b.fold_negative_zero = d.bool("fold negative zero flag")
        b.extra = d.pairs("binding extras")
        return b


@dataclass
class Provenance:
    """Facts about the producer, stored in the header but not hashed into the root."""

    runtime: str = "moeconf-python"
    version: str = ""
    threads: int = 1
    notes: List[Tuple[str, str]] = field(default_factory=list)

    def encode(self, e):
        """Appends the wire encoding (runtime, version, threads, notes)."""
        e.str(self.runtime).str(self.version).u32(self.threads).pairs(self.notes)

    def with_recomputed(self, patterns):
        """Marks the records ``patterns`` match (record paths, ``prefix*``) as recomputed by the
        capture rather than observed from the backend (docs/format.md section 5.2.1), replacing
        any earlier mark; an empty list removes it. Returns self."""
        patterns = list(patterns)
        self.notes = [(k, v) for k, v in self.notes if k != RECOMPUTED_NOTE]
        if patterns:
            self.notes.append((RECOMPUTED_NOTE, ",".join(parse_recomputed(",".join(patterns)))))
        return self

    def recomputed(self):
        """The patterns of the records the capture recomputed (``[]``: every record observed)."""
        for k, v in self.notes:
            if k == RECOMPUTED_NOTE:
                return parse_recomputed(v)
        return []

    def is_recomputed(self, path):
        """Whether the record ``path`` was recomputed by the capture."""
        return any(path.startswith(p[:-1]) if p.endswith("*") else path == p for p in self.recomputed())

    @staticmethod
    def decode(d):
        """Decodes a provenance from a :class:`moeconf.wire.Decoder`, refusing a malformed or
        repeated ``moeconf.recomputed`` note."""
        runtime, version, threads = d.str("runtime"), d.str("runtime version"), d.u32("threads")
        at = d.offset()
        notes = d.pairs("provenance notes")
        marks = [v for k, v in notes if k == RECOMPUTED_NOTE]
        if len(marks) > 1:
            raise d.error(f"provenance notes: {RECOMPUTED_NOTE} is given more than once", at)
        for v in marks:
            try:
                parse_recomputed(v)
            except ValueError as e:
                raise d.error(str(e), at)
        return Provenance(runtime, version, threads, notes)
