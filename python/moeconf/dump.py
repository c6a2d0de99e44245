"""Writing tensor dumps for ``moeconf import`` (docs/import.md) without the
safetensors package: :func:`dump_name` spells the naming convention and
:func:`write_safetensors` writes a safetensors file by hand (8-byte
little-endian header length, JSON header, 8-byte-aligned data).
"""

import json
import os
import struct

import numpy as np

__all__ = ["dump_name", "write_safetensors"]

_ST_DTYPES = {("f", 2): "F16", ("f", 4): "F32", ("f", 8): "F64", ("i", 1): "I8", ("i", 2): "I16",
              ("i", 4): "I32", ("i", 8): "I64", ("u", 1): "U8", ("u", 2): "U16", ("u", 4): "U32",
              ("u", 8): "U64", ("b", 1): "BOOL"}


def dump_name(step, position, layer, component):
    """``step.{t}.pos.{p}.{component}`` or ``step.{t}.pos.{p}.layer.{i}.{component}``."""
    if layer is None:
        return f"step.{step}.pos.{position}.{component}"
    return f"step.{step}.pos.{position}.layer.{layer}.{component}"


def write_safetensors(path, tensors, metadata=None):
    """Writes ``tensors`` (name -> numpy array, or name -> ``(dtype, shape, bytes)``
    with a safetensors dtype string such as ``"BF16"``) to ``path`` atomically.
    numpy has no bfloat16: pass bf16 as ``("BF16", shape, raw bytes)``."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        if isinstance(t, np.ndarray):
            dtype = _ST_DTYPES.get((t.dtype.kind, t.dtype.itemsize))
            if dtype is None:
                raise ValueError(f"tensor {name}: numpy dtype {t.dtype} has no safetensors equivalent")
            shape = list(t.shape)
            data = np.ascontiguousarray(t).astype(t.dtype.newbyteorder("<"), copy=False).tobytes()
        else:
            dtype, shape, data = t
            data = bytes(data)
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = dict(metadata)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((-len(h)) % 8)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
