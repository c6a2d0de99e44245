"""Streaming writer and validating reader of trace files (docs/format.md sections 1, 5, 7).

Writing::

    w = TraceWriter("out.bin", Binding(...), Provenance(...))
    w.append(Coord.make(0, 3, "prefill", None, "lm.logits"), "L1", logits, "f32", keep_payload=True)
    summary = w.finish()          # atomic: nothing at out.bin until this returns

Reading::

    t = read_trace("out.bin")     # full verification; TraceFormatError names file and offset
    t.root.hex(), len(t.records), t.payload(i)

Writer guarantees (docs/format.md section 10), the same as the Rust writer's:

* the writer refuses anything its reader would refuse: the encoded header is
  decoded with the reader's own decoder before any file is created (every
  string, count and rank cap), and every record passes :func:`check_record`
  (byte length within a u64; step 0 is the prefill forward and only step 0;
  step < ``max_new_tokens``), besides path, shape and duplicate checks;
* the output path is checked first (:func:`check_output`): its directory
  exists, nothing but a regular file is replaced, a symbolic link is
  refused (never written through or replaced), and it is no file of
  ``inputs``; the file is written to ``.NAME.moeconf-tmp.PID.RAND`` (mode
  0666 & ~umask) and renamed into place; every error removes it; stale
  temporary files of dead processes next to the output raise a
  :class:`StaleTemporaryWarning`.
"""

import math
import mmap
import os
import re
import secrets
import stat
import struct
import warnings
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
    "MAGIC", "END_MAGIC", "FORMAT_VERSION", "PREAMBLE_LEN", "TRAILER_LEN", "TEMP_MARKER", "TraceFormatError",
    "OutputError", "StaleTemporaryWarning", "Record", "Trace", "WriteSummary", "TraceWriter", "read_trace",
    "to_canonical_bytes", "check_record", "check_step", "check_header", "check_output", "stale_temporaries",
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


#: Marker between the output's name and the process id in a temporary file's
#: name: ``.NAME.moeconf-tmp.PID.RAND`` (RAND: 16 hex digits).
TEMP_MARKER = ".moeconf-tmp."
_TEMP_NAME_MAX = 200


def _align(x):
    return (x + ALIGN - 1) // ALIGN * ALIGN


class OutputError(ValueError):
    """An output path that cannot be written (see :func:`check_output`); the message names it."""


class StaleTemporaryWarning(UserWarning):
    """A temporary file left next to an output by a process that no longer runs."""


def _dir_of(path):
    return os.path.dirname(path) or "."


def _kind(mode):
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def _check_existing(path, inputs):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(f"{path}: is a symbolic link (to {os.readlink(path)}): moeconf neither writes through "
                          "nor replaces a symbolic link; give the target's path, or remove the link")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{path}: is {_kind(st.st_mode)}, not a regular file: moeconf writes outputs only as "
                          "regular files and never replaces anything else")
    for inp in inputs:
        try:
            i = os.stat(inp)
        except OSError:
            continue
        if (i.st_dev, i.st_ino) == (st.st_dev, st.st_ino):
            raise OutputError(f"{path}: is the same file as the input {os.fspath(inp)} (same device and inode): "
                              "refusing to overwrite an input")


def check_output(path, inputs=()):
    """Checks that ``path`` can be written as an output of a producer that reads
    ``inputs`` (paths): its directory exists and is a directory; nothing but a
    regular file exists there; it is not a symbolic link; it is not the same
    file (device and inode) as any input. Raises :class:`OutputError`."""
    path = os.fspath(path)
    if not os.path.basename(path):
        raise OutputError(f"{path}: is a directory name, not a file path")
    d = _dir_of(path)
    try:
        st = os.stat(d)
    except FileNotFoundError:
        raise OutputError(f"{path}: the directory {d} does not exist") from None
    except NotADirectoryError:
        raise OutputError(f"{path}: {d} is not a directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path}: {d} is not a directory")
    _check_existing(path, [os.fspath(i) for i in inputs])


def _temp_stem(path):
    name = os.path.basename(path)
    b = name.encode("utf-8", "surrogateescape")
    if len(b) <= _TEMP_NAME_MAX:
        return name
    return b[:_TEMP_NAME_MAX].decode("utf-8", "ignore")


def stale_temporaries(path):
    """Temporary files of ``path``'s name in its directory (both the
    ``.NAME.moeconf-tmp.PID.RAND`` pattern and the older ``.NAME.tmp-PID-N``)
    whose writing process no longer runs (Linux: no ``/proc/PID``; elsewhere
    none are reported). Returns ``[(path, pid)]`` sorted by path."""
    path = os.fspath(path)
    stem = re.escape(_temp_stem(path))
    pattern = re.compile(r"\." + stem + r"(?:\.moeconf-tmp\.(\d+)\.[0-9a-fA-F]{16}|\.tmp-(\d+)-\d+)")
    if not os.path.exists("/proc/self"):
        return []
    out = []
    d = _dir_of(path)
    try:
        names = os.listdir(d)
    except OSError:
        return []
    for n in names:
        m = pattern.fullmatch(n)
        if not m:
            continue
        pid = int(m.group(1) or m.group(2))
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            out.append((os.path.join(d, n), pid))
    return sorted(out)


def check_step(max_new_tokens, coord):
    """Step and phase consistency (section 3.1): step 0 is the prefill forward and
    every later step a decode forward; ``max_new_tokens`` = N allows steps
    0..N-1. Returns None or what is wrong."""
    if coord.step == 0 and coord.phase == 1:
        return "step 0 is the prefill forward, but the record's phase is decode"
    if coord.step > 0 and coord.phase == 0:
        return f"step {coord.step} is a decode forward, but the record's phase is prefill (only step 0 is)"
    if coord.step >= max_new_tokens:
        if max_new_tokens == 0:
            return f"step {coord.step} is beyond the run: the binding's max_new_tokens = 0 allows no step"
        return (f"step {coord.step} is beyond the run: the binding's max_new_tokens = {max_new_tokens} "
                f"allows steps 0..{max_new_tokens - 1}")
    return None


def check_record(binding, coord, dtype, shape):
    """What a reader checks of one record beyond its encoding: the byte length
    (product of the shape times the element size) fits in a u64, with or without
    a payload, and :func:`check_step`. Returns None or what is wrong."""
    if _byte_len(dtype, shape) >= 2**64:
        return f"shape {list(shape)} of {dtype} is more than 2^64 - 1 bytes"
    return check_step(binding.max_new_tokens, coord)


def check_header(binding, provenance):
    """The wire-encoded header after checking that a reader accepts it: it
    encodes (every integer in range, every string valid UTF-8), the binding's
    tensors and extras are sorted, it fits in 256 MiB and it decodes with the
    reader's own decoder (every cap of section 7). Raises ValueError naming the
    field and the limit."""
    binding.validate()
    e = Encoder()
    try:
        binding.encode(e)
        provenance.encode(e)
    except (struct.error, OverflowError, TypeError, UnicodeEncodeError, AttributeError) as err:
        raise ValueError(f"header cannot be encoded: {err}") from None
    header = e.bytes()
    if len(header) > MAX_HEADER_LEN:
        raise ValueError(f"the header is {len(header)} bytes, more than the {MAX_HEADER_LEN} a reader accepts")
    try:
        d = Decoder(header, PREAMBLE_LEN)
        Binding.decode(d)
        Provenance.decode(d)
        d.finish("header")
    except WireError as err:
        raise ValueError(f"header field refused by the reader: {err.what}") from None
    return header


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

    def __init__(self, path, binding, provenance=None, algorithm="blake3", inputs=()):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown digest algorithm {algorithm!r} (use blake3 or sha256)")
        self.path = os.fspath(path)
        self._f = None
        self.algorithm = algorithm
        self.binding = binding
        self.provenance = provenance if provenance is not None else Provenance()
        try:
            header = check_header(binding, self.provenance)
        except ValueError as err:
            raise ValueError(f"{self.path}: {err}") from None
        self._inputs = [os.fspath(i) for i in inputs]
        check_output(self.path, self._inputs)
        for tmp, pid in stale_temporaries(self.path):
            warnings.warn(f"stale temporary file {tmp} next to {self.path}: left by process {pid}, which no "
                          "longer runs (a write that was killed); delete it", StaleTemporaryWarning, stacklevel=2)
        pre = (MAGIC + struct.pack("<IIII", FORMAT_VERSION, 0, ALGORITHMS[algorithm], 0)
               + struct.pack("<Q", len(header)))
        self._preamble_header = pre + header
        self.records = []
        d = _dir_of(self.path)
        for _ in range(16):
            self._tmp = os.path.join(d, f".{_temp_stem(self.path)}{TEMP_MARKER}{os.getpid()}.{secrets.token_hex(8)}")
            try:
                fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
                break
            except FileExistsError:
                continue
        else:
            raise OutputError(f"{self.path}: cannot create a temporary file (16 names taken)")
        self._f = os.fdopen(fd, "wb")
        self._pos = 0
        self._keys = set()
        try:
            self._write(self._preamble_header)
            self._pad()
        except BaseException:
            self.abort()
            raise

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
        step_error = check_step(self.binding.max_new_tokens, coord)
        if step_error:
            raise ValueError(f"{self.path}: record {coord}: {step_error}")
        canon, dtype, shape = to_canonical_bytes(data, dtype, shape, self.binding.fold_negative_zero)
        wrong = check_record(self.binding, coord, dtype, shape)
        if wrong:
            raise ValueError(f"{self.path}: record {coord}: {wrong}")
        digest = record_digest(self.algorithm, coord, lv, dtype, shape, canon)
        payload = None
        if keep_payload:
            payload = (self._pos, len(canon))
            try:
                self._write(canon)
                self._pad()
            except BaseException:
                # A failed write leaves the file unusable: discard it.
                self.abort()
                raise
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
            _check_existing(self.path, self._inputs)
            os.replace(self._tmp, self.path)
            self._tmp = None
            try:
                dfd = os.open(_dir_of(self.path), os.O_RDONLY)
            except OSError:
                dfd = None
            if dfd is not None:
                try:
                    os.fsync(dfd)
                except OSError:
                    pass
                finally:
                    os.close(dfd)
        except BaseException:
            self.abort()
            raise
        payloads = sum(1 for r in self.records if r.payload is not None)
        return WriteSummary(root, len(self.records), payloads, self._pos)

    def abort(self):
        """Discards the temporary file (no trace is written)."""
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None
        tmp, self._tmp = getattr(self, "_tmp", None), None
        if tmp is not None:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._f is not None:
            self.abort()
        return False

    def __del__(self):
        # A writer dropped unfinished (no ``with``, no ``finish``) leaves nothing behind.
        if getattr(self, "_f", None) is not None:
            self.abort()


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
            wrong = check_record(binding, r.coord, r.dtype, r.shape)
            if wrong:
                raise WireError(at, f"record {i} ({r.coord}): {wrong}")
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
