"""Tensor identity, canonicalization, record digests and the hash tree
(docs/format.md sections 3 and 4), written from the specification.

Everything here is pure: the same inputs give the same 32-byte digests as
any other conforming implementation (the Rust crate ``moeconf-fingerprint``
included), which ``tests/test_vectors.py`` checks against
``fixtures/test-vectors/fingerprint.json``.
"""

import hashlib
import re
from dataclasses import dataclass
from typing import Optional

import blake3
import numpy as np

from .wire import Encoder

__all__ = [
    "ALGORITHMS", "DTYPES", "DTYPE_BY_CODE", "LEVELS", "PHASES", "MAX_RANK", "MAX_PATH_LEN",
    "Coord", "hasher", "hash_bytes", "validate_path", "canonicalize", "is_canonical",
    "record_prefix", "record_digest", "binding_digest", "tree_root", "level_code", "phase_code",
    "group_digest", "level_digest", "step_digest", "root_digest",
]

#: Digest algorithm codes of the preamble (section 4).
ALGORITHMS = {"blake3": 0, "sha256": 1}
#: Logical dtypes: name -> (code, element bytes, numpy dtype of the raw elements) (section 3.2).
DTYPES = {
    "f32": (0, 4, np.dtype("<u4")),
    "bf16": (1, 2, np.dtype("<u2")),
    "f64": (2, 8, np.dtype("<u8")),
    "i32": (3, 4, np.dtype("<i4")),
    "i64": (4, 8, np.dtype("<i8")),
    "u32": (5, 4, np.dtype("<u4")),
    "u8": (6, 1, np.dtype("u1")),
}
#: dtype code -> name.
DTYPE_BY_CODE = {v[0]: k for k, v in DTYPES.items()}
#: Level names L0..L4 (the code is the digit).
LEVELS = ("L0", "L1", "L2", "L3", "L4")
#: Phase names by code.
PHASES = ("prefill", "decode")
#: Highest tensor rank (section 3.2).
MAX_RANK = 8
#: Longest component path in bytes (section 3.1).
MAX_PATH_LEN = 128

_PATH_RE = re.compile(rb"[A-Za-z0-9_.:\[\]-]+")

# Float bit patterns: (sign-clearing mask, +inf bits, canonical NaN, -0 bits), per float dtype.
_FLOAT_BITS = {
    "f32": (0x7FFFFFFF, 0x7F800000, 0x7FC00000, 0x80000000),
    "bf16": (0x7FFF, 0x7F80, 0x7FC0, 0x8000),
    "f64": (0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000, 0x7FF8000000000000, 0x8000000000000000),
}


def level_code(level):
    """Level code 0..4 from ``"L3"``, ``3`` or similar; raises ValueError otherwise."""
    if isinstance(level, str) and level in LEVELS:
        return LEVELS.index(level)
    if isinstance(level, int) and not isinstance(level, bool) and 0 <= level <= 4:
        return level
    raise ValueError(f"level {level!r} is not one of L0..L4")


def phase_code(phase):
    """Phase code 0 (prefill) or 1 (decode) from a name or code."""
    if isinstance(phase, str) and phase in PHASES:
        return PHASES.index(phase)
    if isinstance(phase, int) and not isinstance(phase, bool) and phase in (0, 1):
        return phase
    raise ValueError(f"phase {phase!r} is not 'prefill' or 'decode'")


def validate_path(path):
    """Checks a component path: 1-128 bytes of ``[A-Za-z0-9_.:[]-]``; raises ValueError."""
    b = path.encode("utf-8")
    if not b:
        raise ValueError("component path is empty")
    if len(b) > MAX_PATH_LEN:
        raise ValueError(f"component path is {len(b)} bytes, longer than {MAX_PATH_LEN}")
    if not _PATH_RE.fullmatch(b):
        bad = next(c for c in path if not _PATH_RE.fullmatch(c.encode("utf-8")))
        raise ValueError(f"component path {path!r} has invalid character {bad!r}")


@dataclass(frozen=True)
class Coord:
    """Where a tensor belongs (section 3.1): step, absolute position, phase
    (0 prefill / 1 decode), decoder layer (None for model-global tensors) and
    component path."""

    step: int
    position: int
    phase: int
    layer: Optional[int]
    path: str

    @staticmethod
    def make(step, position, phase, layer, path):
        """Builds a validated coordinate; ``phase`` may be a name or a code."""
        for name, v in (("step", step), ("position", position)):
            if not (isinstance(v, int) and 0 <= v < 2**32):
                raise ValueError(f"coordinate {name} {v!r} is not a u32")
        if layer is not None and not (isinstance(layer, int) and 0 <= layer < 2**32):
            raise ValueError(f"coordinate layer {layer!r} is not a u32 or None")
        validate_path(path)
        return Coord(step, position, phase_code(phase), layer, path)

    def encode(self, e):
        """Appends the wire encoding (step, position, phase, layer, path)."""
        e.u32(self.step).u32(self.position).u32(self.phase).opt_u32(self.layer).str(self.path)

    def tree_key(self):
        """Sort key of a record inside its group: (position, phase, path bytes)."""
        return (self.position, self.phase, self.path.encode("utf-8"))

    def __str__(self):
        layer = "-" if self.layer is None else str(self.layer)
        return f"step {self.step} pos {self.position} {PHASES[self.phase]} layer {layer} {self.path}"


def hasher(algorithm):
    """A fresh streaming hasher (``update``/``digest``) for ``"blake3"`` or ``"sha256"``."""
    if algorithm == "blake3":
        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r} (use blake3 or sha256)")


def hash_bytes(algorithm, data):
    """The 32-byte digest of ``data``."""
    h = hasher(algorithm)
    h.update(data)
    return h.digest()


def _bits(dtype, data):
    """``data`` viewed as little-endian unsigned integers of the dtype's width."""
    return np.frombuffer(data, dtype=DTYPES[dtype][2])


def canonicalize(dtype, data, fold_negative_zero=False):
    """Canonical bytes of a tensor's little-endian elements (section 3.3): every
    NaN becomes the dtype's canonical quiet NaN and, if ``fold_negative_zero``,
    -0.0 becomes +0.0. Integer and byte dtypes are returned unchanged."""
    data = bytes(data)
    if dtype not in _FLOAT_BITS:
        return data
    mask, inf, qnan, negz = _FLOAT_BITS[dtype]
    size = DTYPES[dtype][1]
    if len(data) % size:
        raise ValueError(f"{len(data)} bytes is not a whole number of {dtype} elements")
    b = _bits(dtype, data).copy()
    t = b.dtype.type
    nan = (b & t(mask)) > t(inf)
    b[nan] = t(qnan)
    if fold_negative_zero:
        b[b == t(negz)] = t(0)
    return b.astype(DTYPES[dtype][2], copy=False).tobytes()


def is_canonical(dtype, data, fold_negative_zero=False):
    """Whether ``data`` is already canonical under the policy."""
    return canonicalize(dtype, data, fold_negative_zero) == bytes(data)


def record_prefix(coord, level, dtype, shape, byte_len):
    """The record preimage before the data (section 4.1), zero-padded to a multiple of 64."""
    e = Encoder()
    e.str("moeconf.record.v1")
    coord.encode(e)
    e.u32(level_code(level)).u32(DTYPES[dtype][0]).length(len(shape))
    for d in shape:
        e.u64(d)
    e.u64(byte_len)
    e.raw(b"\x00" * ((-len(e.buf)) % 64))
    return e.bytes()


def record_digest(algorithm, coord, level, dtype, shape, canonical_bytes):
    """Record digest of already-canonical bytes (section 4.1)."""
    h = hasher(algorithm)
    h.update(record_prefix(coord, level, dtype, shape, len(canonical_bytes)))
    h.update(canonical_bytes)
    return h.digest()


def binding_digest(algorithm, binding_bytes):
    """Binding digest (section 4.2) of the wire-encoded binding."""
    return hash_bytes(algorithm, Encoder().str("moeconf.binding.v1").str(binding_bytes).bytes())


def group_digest(algorithm, step, level, layer, record_digests):
    """Digest of a layer group (section 4.3): its record digests in canonical order."""
    e = Encoder().str("moeconf.group.v1").u32(step).u32(level).opt_u32(layer).length(len(record_digests))
    for d in record_digests:
        e.raw(d)
    return hash_bytes(algorithm, e.bytes())


def level_digest(algorithm, step, level, group_digests):
    """Digest of a level node: its group digests (layer None first, then ascending)."""
    e = Encoder().str("moeconf.level.v1").u32(step).u32(level).length(len(group_digests))
    for g in group_digests:
        e.raw(g)
    return hash_bytes(algorithm, e.bytes())


def step_digest(algorithm, step, levels):
    """Digest of a step node: ``levels`` is ``[(level code, level digest)]`` ascending."""
    e = Encoder().str("moeconf.step.v1").u32(step).length(len(levels))
    for lv, d in levels:
        e.u32(lv).raw(d)
    return hash_bytes(algorithm, e.bytes())


def root_digest(algorithm, binding_digest_bytes, steps):
    """The root: ``steps`` is ``[(step, step digest)]`` ascending."""
    e = Encoder().str("moeconf.root.v1").u32(ALGORITHMS[algorithm]).raw(binding_digest_bytes)
    e.length(len(steps))
    for s, d in steps:
        e.u32(s).raw(d)
    return hash_bytes(algorithm, e.bytes())


def tree_root(algorithm, binding_digest_bytes, leaves):
    """Root of the hash tree (section 4.3). ``leaves`` is an iterable of
    ``(coord, level_code, digest)`` in any order. Raises ValueError on two
    records with the same (step, level, layer, position, phase, path)."""
    tree = {}
    for coord, level, digest in leaves:
        group = tree.setdefault(coord.step, {}).setdefault(level, {}).setdefault(coord.layer, [])
        group.append((coord.tree_key(), digest, coord))
    steps = []
    for s in sorted(tree):
        level_nodes = []
        for lv in sorted(tree[s]):
            groups = tree[s][lv]
            group_digests = []
            for layer in sorted(groups, key=lambda x: -1 if x is None else x):
                recs = sorted(groups[layer], key=lambda r: r[0])
                for a, b in zip(recs, recs[1:]):
                    if a[0] == b[0]:
                        raise ValueError(f"two records at level L{lv} with the same coordinate ({b[2]})")
                group_digests.append(group_digest(algorithm, s, lv, layer, [r[1] for r in recs]))
            level_nodes.append((lv, level_digest(algorithm, s, lv, group_digests)))
        steps.append((s, step_digest(algorithm, s, level_nodes)))
    return root_digest(algorithm, binding_digest_bytes, steps)
