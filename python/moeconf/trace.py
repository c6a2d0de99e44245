"""Streaming writer and validating reader of trace files (docs/format.md sections 1, 5, 7).

Writing::

    w = TraceWriter("out.bin", Binding(...), Provenance(...))
    w.append(Coord.make(0, 3, "prefill", None, "lm.logits"), "L1", logits, "f32", keep_payload=True)
    summary = w.finish()          # atomic: nothing at out.bin until this returns

Reading::

    t = read_trace("out.bin")     # full verification; TraceFormatError names file and offset
    t.root.hex(), len(t.records), t.payload(i)
"""

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from .binding import Binding, Provenance
from .fingerprint import (
    ALGORITHMS, DTYPE_BY_CODE, DTYPES, MAX_PATH_LEN, MAX_RANK, Coord, binding_digest, canonicalize,
    hasher, level_code, record_digest, tree_root, validate_path,
)
from .wire import Decoder, Encoder, WireError

__all__ = [
    "MAGIC", "END_MAGIC", "FORMAT_VERSION", "PREAMBLE_LEN", "TRAILER_LEN", "TraceFormatError",
    "Record", "Trace", "WriteSummary", "TraceWriter", "read_trace", "to_canonical_bytes",
]

#: Preamble magic.
MAGIC = b"MOECONF\x00"
#: Trailer magic (at both ends of the trailer).
END_MAGIC = b"MOECEND\x00"
#: The only container version this module reads and writes.
FORMAT_VERSION = 1
#: Preamble size.
PREAMBLE_LEN = 32
#: Trailer size.
TRAILER_LEN = 104
#: Largest header accepted (256 MiB).
MAX_HEADER_LEN = 256 << 20
#: Payload and section alignment.
ALIGN = 64
#: Smallest encoded index entry (used to bound record_count before decoding).
MIN_ENTRY_LEN = 4 + 4 + 4 + 1 + 8 + 1 + 4 + 4 + 8 + 32 + 1
_ALG_BY_CODE = {v: k for k, v in ALGORITHMS.items()}


def _align(x):
    return (x + ALIGN - 1) // ALIGN * ALIGN


class TraceFormatError(ValueError):
    """A malformed or corrupted trace: ``path``, byte ``offset`` and ``what`` is wrong."""

    def __init__(self, path, offset, what):
        super().__init__(f"{path}: byte {offset}: {what}")
        #: The file.
        self.path = str(path)
        #: Absolute byte offset of the problem.
        self.offset = offset
        #: Description.
        self.what = what


@dataclass
class Record:
    """One index entry: coordinate, level code, dtype name, shape, record digest and
    the payload location ``(offset, length)`` or None for fingerprint-only records."""

    coord: Coord
    level: int
    dtype: str
    shape: List[int]
    digest: bytes
    payload: Optional[Tuple[int, int]]

    def encode(self, e):
        """Appends the wire encoding of the index entry (section 5.4)."""
        self.coord.encode(e)
        e.u32(self.level).u32(DTYPES[self.dtype][0]).length(len(self.shape))
        for d in self.shape:
            e.u64(d)
        e.raw(self.digest)
        if self.payload is None:
            e.u8(0)
        else:
            e.u8(1).u64(self.payload[0]).u64(self.payload[1])

    @staticmethod
    def decode(d):
        """Decodes and validates one index entry."""
        step = d.u32("coordinate step")
        position = d.u32("coordinate position")
        at = d.offset()
        phase = d.u32("coordinate phase")
        if phase > 1:
            raise d.error(f"unknown phase code {phase}", at)
        layer = d.opt_u32("coordinate layer")
        at = d.offset()
        path = d.str("coordinate path", MAX_PATH_LEN)
        try:
            validate_path(path)
        except ValueError as e:
            raise d.error(str(e), at) from None
        at = d.offset()
        level = d.u32("record level")
        if level > 4:
            raise d.error(f"unknown level code {level}", at)
        at = d.offset()
        code = d.u32("record dtype")
        if code not in DTYPE_BY_CODE:
            raise d.error(f"unknown dtype code {code}", at)
        rank = d.length("record shape", 8, MAX_RANK)
        shape = [d.u64("record dimension") for _ in range(rank)]
        digest = d.array32("record digest")
        at = d.offset()
        tag = d.u8("payload option")
        if tag == 0:
            payload = None
        elif tag == 1:
            payload = (d.u64("payload offset"), d.u64("payload length"))
        else:
            raise d.error(f"payload option: invalid option tag {tag}", at)
        return Record(Coord(step, position, phase, layer, path), level, DTYPE_BY_CODE[code], shape,
                      digest, payload)


def _byte_len(dtype, shape):
    n = 1
    for d in shape:
        n *= d
    return n * DTYPES[dtype][1]


def to_canonical_bytes(data, dtype, shape, fold_negative_zero=False):
    """Validates a tensor and returns ``(canonical bytes, dtype, shape)``.

    ``data`` is ``bytes`` (little-endian elements) or a numpy array. For arrays,
    ``dtype`` and ``shape`` default to the array's own (float32 -> f32, float64 ->
    f64, int32 -> i32, int64 -> i64, uint32 -> u32, uint8 -> u8); ``bf16`` takes a
    uint16 array of raw bf16 bit patterns (numpy has no bfloat16). Arrays are
    converted to the exact little-endian row-major layout, never to another
    element type: a float32 array recorded as ``f64`` is an error, not a cast.
    """
    if isinstance(data, np.ndarray):
        natural = {("f", 4): "f32", ("f", 8): "f64", ("i", 4): "i32", ("i", 8): "i64", ("u", 4): "u32",
                   ("u", 1): "u8", ("u", 2): "bf16"}
        kind = natural.get((data.dtype.kind, data.dtype.itemsize))
        if dtype is None:
            dtype = kind
        if kind is None or kind != dtype:
            raise ValueError(f"a numpy {data.dtype} array cannot be recorded as {dtype} "
                             "(convert it exactly first; bf16 takes uint16 bit patterns)")
        if shape is None:
            shape = list(data.shape)
        elif math.prod(shape) != data.size:
            raise ValueError(f"shape {list(shape)} does not match the array's {data.size} elements")
        target = {"f32": "<f4", "f64": "<f8", "i32": "<i4", "i64": "<i8", "u32": "<u4", "u8": "u1",
                  "bf16": "<u2"}[dtype]
        raw = np.ascontiguousarray(data).astype(target, copy=False).tobytes()
    else:
        if dtype is None or shape is None:
            raise ValueError("raw bytes need an explicit dtype and shape")
        raw = bytes(data)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    shape = [int(d) for d in shape]
    if len(shape) > MAX_RANK:
        raise ValueError(f"rank {len(shape)} exceeds {MAX_RANK}")
    if any(d < 0 or d >= 2**64 for d in shape):
        raise ValueError(f"shape {shape} has a dimension outside u64")
    want = _byte_len(dtype, shape)
    if len(raw) != want:
        raise ValueError(f"{len(raw)} bytes given, shape {shape} of {dtype} needs {want}")
    return canonicalize(dtype, raw, fold_negative_zero), dtype, shape


@dataclass
class WriteSummary:
    """What :meth:`TraceWriter.finish` reports: root digest, record and payload counts, file size."""

    root: bytes
    records: int
    payloads: int
    bytes: int


class TraceWriter:
    """Appends records to a new trace file, streaming payloads to a temporary
    sibling file that :meth:`finish` syncs and renames into place
    (``os.replace``), so the destination is either a complete trace or absent.

    ``algorithm`` is ``"blake3"`` (default) or ``"sha256"``; the binding's
    ``fold_negative_zero`` selects the canonicalization policy of every record.
    Usable as a context manager: leaving the block without ``finish`` (e.g. on an
    exception) removes the temporary file.
    """

    def __init__(self, path, binding, provenance=None, algorithm="blake3"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown digest algorithm {algorithm!r} (use blake3 or sha256)")
        binding.validate()
        self.path = os.fspath(path)
        self.algorithm = algorithm
        self.binding = binding
        self.provenance = provenance if provenance is not None else Provenance()
        e = Encoder()
        binding.encode(e)
        self.provenance.encode(e)
        header = e.bytes()
        if len(header) > MAX_HEADER_LEN:
            raise ValueError(f"header is {len(header)} bytes, more than {MAX_HEADER_LEN}")
        pre = (MAGIC + struct.pack("<IIII", FORMAT_VERSION, 0, ALGORITHMS[algorithm], 0)
               + struct.pack("<Q", len(header)))
        self._preamble_header = pre + header
        self.records = []
        d, base = os.path.split(os.path.abspath(self.path))
        self._tmp = os.path.join(d, f".{base}.tmp-{os.getpid()}-{id(self)}")
        self._f = open(self._tmp, "wb")
        self._pos = 0
        self._keys = set()
        self._write(self._preamble_header)
        self._pad()

    def _write(self, b):
        self._f.write(b)
        self._pos += len(b)

    def _pad(self):
        self._write(b"\x00" * (_align(self._pos) - self._pos))

    def append(self, coord, level, data, dtype=None, shape=None, keep_payload=False):
        """Appends one record and returns its digest.

        ``coord`` is a :class:`Coord` (or a tuple ``(step, position, phase, layer,
        path)``), ``level`` ``"L0"``..``"L4"`` or 0..4, ``data`` bytes or a numpy
        array (see :func:`to_canonical_bytes`). With ``keep_payload`` the
        canonical bytes are stored in the file too.
        """
        if self._f is None:
            raise ValueError(f"{self.path}: trace writer already finished")
        if not isinstance(coord, Coord):
            coord = Coord.make(*coord)
        else:
            coord = Coord.make(coord.step, coord.position, coord.phase, coord.layer, coord.path)
        lv = level_code(level)
        key = (coord.step, lv, coord.layer, coord.position, coord.phase, coord.path)
        if key in self._keys:
            raise ValueError(f"{self.path}: a record at L{lv} {coord} was already appended")
        canon, dtype, shape = to_canonical_bytes(data, dtype, shape, self.binding.fold_negative_zero)
        digest = record_digest(self.algorithm, coord, lv, dtype, shape, canon)
        payload = None
        if keep_payload:
            payload = (self._pos, len(canon))
            self._write(canon)
            self._pad()
        self._keys.add(key)
        self.records.append(Record(coord, lv, dtype, shape, digest, payload))
        return digest

    def finish(self):
        """Writes index and trailer, fsyncs, renames into place; returns a :class:`WriteSummary`."""
        if self._f is None:
            raise ValueError(f"{self.path}: trace writer already finished")
        try:
            e = Encoder().length(len(self.records))
            for r in self.records:
                r.encode(e)
            index = e.bytes()
            bd = binding_digest(self.algorithm, self.binding.to_bytes())
            root = tree_root(self.algorithm, bd, [(r.coord, r.level, r.digest) for r in self.records])
            index_offset = self._pos
            self._write(index)
            covered = END_MAGIC + struct.pack("<QQQ", index_offset, len(index), len(self.records)) + root
            h = hasher(self.algorithm)
            h.update(Encoder().str("moeconf.checksum.v1").bytes())
            h.update(self._preamble_header)
            h.update(index)
            h.update(covered)
            self._write(covered + h.digest() + END_MAGIC)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        payloads = sum(1 for r in self.records if r.payload is not None)
        return WriteSummary(root, len(self.records), payloads, self._pos)

    def abort(self):
        """Discards the temporary file (no trace is written)."""
        if self._f is not None:
            self._f.close()
            self._f = None
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._f is not None:
            self.abort()
        return False


class Trace:
    """A validated trace: ``algorithm``, ``binding``, ``provenance``, ``binding_digest``,
    ``root``, ``records`` (index order) and the file bytes for payload access."""

    def __init__(self, path, data, algorithm, binding, provenance, bdigest, root, records):
        #: The file read.
        self.path = path
        self.data = data
        #: ``"blake3"`` or ``"sha256"``.
        self.algorithm = algorithm
        #: The decoded :class:`Binding`.
        self.binding = binding
        #: The decoded :class:`Provenance`.
        self.provenance = provenance
        #: Binding digest (section 4.2).
        self.binding_digest = bdigest
        #: Root digest (section 4.3).
        self.root = root
        #: The :class:`Record` list in index (execution) order.
        self.records = records

    def payload(self, i):
        """Canonical bytes of record ``i`` or None (verified when read with ``verify=True``)."""
        p = self.records[i].payload
        return None if p is None else self.data[p[0]:p[0] + p[1]]

    def array(self, i):
        """Payload of record ``i`` as a numpy array of its shape (bf16 as uint16 bits), or None."""
        r = self.records[i]
        b = self.payload(i)
        if b is None:
            return None
        np_dtype = {"f32": "<f4", "f64": "<f8", "i32": "<i4", "i64": "<i8", "u32": "<u4", "u8": "u1",
                    "bf16": "<u2"}[r.dtype]
        return np.frombuffer(b, dtype=np_dtype).reshape(r.shape)

    def payload_count(self):
        """Records that carry payloads."""
        return sum(1 for r in self.records if r.payload is not None)


def read_trace(path, verify=True):
    """Reads and validates the trace at ``path`` (docs/format.md section 7).

    Checks sizes, magics, version, flags, algorithm, reserved field, header
    length, trailer layout, checksum, header and index decoding (caps, codes,
    UTF-8, tags, no trailing bytes), payload placement (inside the payload
    section, 64-aligned, in order, exact length), and the root. With ``verify``
    (the default) it also re-hashes every payload, checks that it is canonical
    and that every padding byte is zero. Raises :class:`TraceFormatError`
    naming the file and byte offset.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # Memory-mapped when non-empty, so a multi-GB trace is not copied into memory.
            b = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as e:
        raise TraceFormatError(path, 0, f"cannot read: {e.strerror}") from None
    n = len(b)

    def fail(offset, what):
        return TraceFormatError(path, offset, what)

    if n < PREAMBLE_LEN + TRAILER_LEN:
        raise fail(0, f"file is {n} bytes, shorter than the smallest trace")
    if b[0:8] != MAGIC:
        raise fail(0, 'not a moeconf trace (bad magic; expected "MOECONF\\0")')
    version, flags, alg_code, reserved, header_len = struct.unpack_from("<IIIIQ", b, 8)
    if version != FORMAT_VERSION:
        raise fail(8, f"unsupported format version {version} (this reader supports version {FORMAT_VERSION})")
    if flags != 0:
        raise fail(12, f"unknown flags {flags:#x} (must be 0 in version 1)")
    if alg_code not in _ALG_BY_CODE:
        raise fail(16, f"unknown digest algorithm code {alg_code}")
    alg = _ALG_BY_CODE[alg_code]
    if reserved != 0:
        raise fail(20, "reserved field is not zero")
    header_end = PREAMBLE_LEN + header_len
    if header_len > MAX_HEADER_LEN or header_end > n - TRAILER_LEN:
        raise fail(24, f"header length {header_len} does not fit in a {n}-byte file")
    payload_start = _align(header_end)

    t0 = n - TRAILER_LEN
    if b[t0:t0 + 8] != END_MAGIC or b[t0 + 96:t0 + 104] != END_MAGIC:
        raise fail(t0, "trailer magic missing: the file is truncated or was not finished by its writer")
    index_offset, index_len, record_count = struct.unpack_from("<QQQ", b, t0 + 8)
    root = b[t0 + 32:t0 + 64]
    stored_sum = b[t0 + 64:t0 + 96]
    if index_offset < min(payload_start, n) or index_offset + index_len != t0:
        raise fail(t0 + 8, f"index at {index_offset} with length {index_len} does not end at the trailer ({t0})")
    if record_count > index_len // MIN_ENTRY_LEN:
        raise fail(t0 + 24, f"record count {record_count} cannot fit in a {index_len}-byte index")
    index = b[index_offset:index_offset + index_len]
    h = hasher(alg)
    h.update(Encoder().str("moeconf.checksum.v1").bytes())
    h.update(b[:header_end])
    h.update(index)
    h.update(b[t0:t0 + 64])
    if h.digest() != stored_sum:
        raise fail(t0 + 64, "checksum mismatch: the header, index or trailer is corrupted")

    try:
        d = Decoder(b[PREAMBLE_LEN:header_end], PREAMBLE_LEN)
        binding = Binding.decode(d)
        provenance = Provenance.decode(d)
        d.finish("header")
        d = Decoder(index, index_offset)
        count = d.length("index record count", MIN_ENTRY_LEN, record_count)
        if count != record_count:
            raise d.error(f"index holds {count} records, trailer says {record_count}", index_offset)
        records = []
        next_payload = payload_start
        for i in range(count):
            at = d.offset()
            try:
                r = Record.decode(d)
            except WireError as e:
                raise WireError(e.offset, f"record {i}: {e.what}") from None
            want = _byte_len(r.dtype, r.shape)
            if want >= 2**64:
                raise WireError(at, f"record {i} ({r.coord}): shape {r.shape} overflows a u64 byte length")
            if r.payload is not None:
                off, ln = r.payload
                if off % ALIGN or off < next_payload or off + ln > index_offset:
                    raise WireError(at, f"record {i} ({r.coord}): payload at {off} (+{ln}) is outside the "
                                        "payload section, misaligned or overlapping")
                if ln != want:
                    raise WireError(at, f"record {i} ({r.coord}): payload length {ln} is not "
                                        f"product(shape) x element size = {want}")
                next_payload = off + ln
            records.append(r)
        d.finish("index")
    except WireError as e:
        raise fail(e.offset, e.what) from None

    bd = binding_digest(alg, binding.to_bytes())
    try:
        computed = tree_root(alg, bd, [(r.coord, r.level, r.digest) for r in records])
    except ValueError as e:
        raise fail(index_offset, str(e)) from None
    if computed != root:
        raise fail(t0 + 32, "root digest does not match the records: the index or trailer is corrupted")

    if verify:
        def check_zero(lo, hi):
            seg = b[lo:hi]
            if seg.count(0) != len(seg):
                k = next(j for j, x in enumerate(seg) if x != 0)
                raise fail(lo + k, "padding byte is not zero (corrupted file)")

        check_zero(header_end, payload_start)
        cursor = payload_start
        fold = binding.fold_negative_zero
        for i, r in enumerate(records):
            if r.payload is None:
                continue
            off, ln = r.payload
            check_zero(cursor, off)
            data = b[off:off + ln]
            if canonicalize(r.dtype, data, fold) != data:
                raise fail(off, f"record {i} ({r.coord}): payload is not canonical")
            if record_digest(alg, r.coord, r.level, r.dtype, r.shape, data) != r.digest:
                raise fail(off, f"record {i} ({r.coord}): payload bytes do not match the record digest "
                                "(corrupted payload)")
            cursor = off + ln
        check_zero(cursor, index_offset)
    return Trace(path, b, alg, binding, provenance, bd, root, records)
