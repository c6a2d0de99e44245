"""Model and tokenizer identity, computed exactly as the Rust CLI does
(``cli/src/runner.rs`` ``model_identity``; docs/format.md section 5.2):

* ``config_digest`` = H(raw bytes of ``config.json``);
* one :class:`~moeconf.binding.TensorDigest` per tensor of every
  ``*.safetensors`` file in the directory: name, lower-case safetensors dtype
  (``bf16``, ``f32``, ...), shape, H(raw tensor bytes); the list sorted by name;
* ``weights_digest`` = H("moeconf.weights.v1", tensors);
* ``tokenizer_digest`` = H(raw bytes of ``tokenizer.json``).

Safetensors headers are parsed by hand (8-byte little-endian length, then
JSON), with the same validation a careful reader needs for untrusted files.
"""

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import List

from .binding import TensorDigest, weights_digest
from .fingerprint import hash_bytes, hasher

__all__ = ["SAFETENSORS_DTYPE_SIZES", "SafetensorsEntry", "SafetensorsError", "read_safetensors_header",
           "tensor_digests", "ModelIdentity", "model_identity", "tokenizer_digest"]

#: Element size of the whole-byte dtypes the Rust safetensors crate accepts (0.7: with F8_E8M0,
#: the UE8M0 block scales of the released DeepSeek-V4 checkpoints).
SAFETENSORS_DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                           "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
#: Largest safetensors JSON header accepted (the Rust crate's limit is 100 MB).
MAX_SAFETENSORS_HEADER = 100_000_000
_CHUNK = 16 << 20


class SafetensorsError(ValueError):
    """A malformed safetensors file; the message names the file and the problem."""


@dataclass
class SafetensorsEntry:
    """One tensor of a safetensors file: name, dtype (as written, e.g. ``BF16``),
    shape, and the absolute file offset and length of its bytes."""

    name: str
    dtype: str
    shape: List[int]
    offset: int
    length: int


def read_safetensors_header(path):
    """Parses and validates the header of a safetensors file; returns
    ``(entries sorted by data offset, metadata dict)``."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit in a {size}-byte file")
        raw = f.read(n)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    data_start = 8 + n
    data_len = size - data_start
    entries = []
    for name, info in doc.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise SafetensorsError(f"{where}: entry is not an object")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPE_SIZES:
            raise SafetensorsError(f"{where}: unsupported dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise SafetensorsError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1] <= data_len):
            raise SafetensorsError(f"{where}: data_offsets {offs!r} lie outside the {data_len} data bytes")
        want = math.prod(shape) * SAFETENSORS_DTYPE_SIZES[dtype]
        if offs[1] - offs[0] != want:
            raise SafetensorsError(f"{where}: {offs[1] - offs[0]} data bytes, shape {shape} of {dtype} "
                                   f"needs {want}")
        entries.append(SafetensorsEntry(name, dtype, shape, data_start + offs[0], offs[1] - offs[0]))
    entries.sort(key=lambda e: e.offset)
    return entries, meta


def tensor_digests(path, algorithm="blake3"):
    """A :class:`TensorDigest` for every tensor of one safetensors file (file order)."""
    entries, _ = read_safetensors_header(path)
    out = []
    with open(path, "rb") as f:
        for e in entries:
            h = hasher(algorithm)
            f.seek(e.offset)
            left = e.length
            while left:
                chunk = f.read(min(left, _CHUNK))
                if not chunk:
                    raise SafetensorsError(f"{path}: tensor {e.name!r}: file ends inside its data")
                h.update(chunk)
                left -= len(chunk)
            out.append(TensorDigest(e.name, e.dtype.lower(), list(e.shape), h.digest()))
    return out


@dataclass
class ModelIdentity:
    """The model part of a binding: name, config digest, weights digest, tensor list."""

    name: str
    config_digest: bytes
    weights_digest: bytes
    tensors: List[TensorDigest]


def model_identity(name, directory, algorithm="blake3"):
    """The identity of the model in ``directory`` (``config.json`` and every
    ``*.safetensors`` file), exactly as ``moeconf run`` computes it; ``name`` is
    the display name bound into the trace (``moeconf run`` uses the ``--model``
    argument, e.g. ``builtin:tiny-v4``)."""
    directory = os.fspath(directory)
    with open(os.path.join(directory, "config.json"), "rb") as f:
        config_digest = hash_bytes(algorithm, f.read())
    files = sorted(os.path.join(directory, p) for p in os.listdir(directory)
                   if p.endswith(".safetensors") and p != ".safetensors")
    tensors = []
    for p in files:
        if os.path.isfile(p):
            tensors.extend(tensor_digests(p, algorithm))
    tensors.sort(key=lambda t: t.name.encode("utf-8"))
    return ModelIdentity(name, config_digest, weights_digest(algorithm, tensors), tensors)


def tokenizer_digest(path, algorithm="blake3"):
    """H(raw bytes of the tokenizer file), as bound by ``moeconf run``."""
    with open(path, "rb") as f:
        return hash_bytes(algorithm, f.read())
