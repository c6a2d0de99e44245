"""The trace header (docs/format.md section 5.2): the hashed :class:`Binding`
(what the trace is a trace *of*) and the unhashed :class:`Provenance` (who
produced it), with their wire encodings.
"""

from dataclasses import dataclass, field
from typing import List, Tuple

from .fingerprint import MAX_RANK, hash_bytes
from .wire import Encoder

__all__ = ["ZERO_DIGEST", "TensorDigest", "Binding", "Provenance", "weights_digest"]

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

    @staticmethod
    def decode(d):
        """Decodes a provenance from a :class:`moeconf.wire.Decoder`."""
        return Provenance(d.str("runtime"), d.str("runtime version"), d.u32("threads"),
                          d.pairs("provenance notes"))
