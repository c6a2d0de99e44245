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
    group_digest, hasher, level_code, level_digest, record_digest, root_digest, step_digest, tree_root,
    validate_path,
)
from . import v2
from .wire import Decoder, Encoder, WireError

__all__ = [
    "MAGIC", "END_MAGIC", "FORMAT_VERSION", "FORMAT_V1", "PREAMBLE_LEN", "TRAILER_LEN", "TEMP_MARKER",
    "TraceFormatError",
    "OutputError", "StaleTemporaryWarning", "Record", "Trace", "WriteSummary", "TraceWriter", "read_trace",
    "to_canonical_bytes", "check_record", "check_step", "check_header", "check_output", "stale_temporaries",
]

#: Preamble magic.
MAGIC = b"MOECONF\x00"
#: Trailer magic (at both ends of the trailer).
END_MAGIC = b"MOECEND\x00"
#: The newest container version this module reads and writes, and the one
#: :class:`TraceWriter` writes by default (version 1 stays readable and writable).
FORMAT_VERSION = 3
#: The first container version (a flat index).
FORMAT_V1 = 1
#: The newest container version this module reads: version 4 (large groups
#: paged, docs/format.md section 11.9) is read, not written.
READ_VERSION = 4
#: Preamble size.
PREAMBLE_LEN = 32
#: Trailer size of version 1 (version 2: :data:`moeconf.v2.TRAILER_V2_LEN`).
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
    ``format_version`` 2 (the default) streams the hash tree too: the blocks of a
    step are written when the first record of a later step arrives, so the
    writer holds one step's records at a time and refuses a record of an
    earlier step than one already appended; version 1 keeps the whole index
    until :meth:`finish` and takes steps in any order.
    Usable as a context manager: leaving the block without ``finish`` (e.g. on an
    exception) removes the temporary file.
    """

    def __init__(self, path, binding, provenance=None, algorithm="blake3", inputs=(), format_version=FORMAT_VERSION):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown digest algorithm {algorithm!r} (use blake3 or sha256)")
        if format_version != FORMAT_V1 and not v2.is_block_format(format_version) or format_version == v2.FORMAT_V4:
            # Version 4 (paged groups) is read here but written by the Rust writers only.
            raise ValueError(f"format version {format_version!r} cannot be written (1, 2 or 3)")
        self.format_version = format_version
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
        pre = (MAGIC + struct.pack("<IIII", format_version, 0, ALGORITHMS[algorithm], 0)
               + struct.pack("<Q", len(header)))
        self._preamble_header = pre + header
        self._binding_digest = binding_digest(algorithm, binding.to_bytes())
        #: Version 1: every record; version 2: the current step's records.
        self.records = []
        self._count = 0
        self._payloads = 0
        self._step = None
        self._steps = []
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
        if v2.is_block_format(self.format_version) and self._step is not None and coord.step < self._step:
            raise ValueError(f"{self.path}: record {coord}: step {coord.step} after step {self._step}: format "
                             "version 2 takes records step by step (in execution order)")
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
        try:
            if v2.is_block_format(self.format_version) and self._step is not None and coord.step != self._step:
                self._flush_step()
            self._step = coord.step
            if keep_payload:
                self._pad()
                payload = (self._pos, len(canon))
                self._write(canon)
                self._pad()
        except BaseException:
            # A failed write leaves the file unusable: discard it.
            self.abort()
            raise
        self._keys.add(key)
        self.records.append(Record(coord, lv, dtype, shape, digest, payload))
        self._count += 1
        self._payloads += payload is not None
        return digest

    def _block(self, data):
        """Writes a block at the next multiple of 64; returns its :class:`moeconf.v2.BlockRef`."""
        self._pad()
        ref = v2.BlockRef(self._pos, len(data), v2.block_digest(self.algorithm, data))
        self._write(data)
        return ref

    def _flush_step(self):
        """Version 2: writes the current step's group blocks (tree order) and step
        block, and forgets its records."""
        recs, self.records = self.records, []
        self._keys = set()
        if not recs:
            return
        step = self._step
        base = self._count - len(recs)

        def key(i):
            r = recs[i]
            return (r.level, -1 if r.coord.layer is None else r.coord.layer) + r.coord.tree_key()

        order = sorted(range(len(recs)), key=key)
        levels = []
        counts = [0] * 5
        i = 0
        while i < len(order):
            lv, layer = recs[order[i]].level, recs[order[i]].coord.layer
            j = i
            while j < len(order) and (recs[order[j]].level, recs[order[j]].coord.layer) == (lv, layer):
                j += 1
            members = order[i:j]
            ref = self._block(v2.encode_group_block(step, lv, layer, [(base + m, recs[m]) for m in members]))
            g = v2.GroupRef(layer, group_digest(self.algorithm, step, lv, layer, [recs[m].digest for m in members]),
                            len(members), ref)
            counts[lv] += len(members)
            if levels and levels[-1][0] == lv:
                levels[-1][1].append(g)
            else:
                levels.append((lv, [g]))
            i = j
        ref = self._block(v2.encode_step_block(step, levels))
        pairs = [(lv, level_digest(self.algorithm, step, lv, [g.digest for g in groups])) for lv, groups in levels]
        digest = step_digest(self.algorithm, step, pairs)
        listed = None
        if self.format_version == v2.FORMAT_V3:
            listed = [v2.ZERO] * 5
            for lv, d in pairs:
                listed[lv] = d
        self._steps.append(v2.StepRef(step, digest, counts, ref, listed))

    def finish(self):
        """Writes index and trailer, fsyncs, renames into place; returns a :class:`WriteSummary`."""
        if self._f is None:
            raise ValueError(f"{self.path}: trace writer already finished")
        try:
            if v2.is_block_format(self.format_version):
                self._flush_step()
                ref = self._block(v2.encode_root_block(self._steps))
                root = root_digest(self.algorithm, self._binding_digest, [(s.step, s.digest) for s in self._steps])
                covered = v2.trailer_v2(ref, self._count, root)
                self._write(covered + v2.checksum_v2(self.algorithm, self._preamble_header, covered) + END_MAGIC)
            else:
                e = Encoder().length(len(self.records))
                for r in self.records:
                    r.encode(e)
                index = e.bytes()
                root = tree_root(self.algorithm, self._binding_digest,
                                 [(r.coord, r.level, r.digest) for r in self.records])
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
        return WriteSummary(root, self._count, self._payloads, self._pos)

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
    """A validated trace: ``format_version``, ``algorithm``, ``binding``, ``provenance``,
    ``binding_digest``, ``root``, ``records`` (write order) and the file bytes for payload access."""

    def __init__(self, path, data, algorithm, binding, provenance, bdigest, root, records, format_version=1):
        #: The file read.
        self.path = path
        #: Container format version (1 or 2).
        self.format_version = format_version
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

    Both container versions are read. A version 2 file (section 11) is read
    whole: every step and group block is checked against the digests its
    parent holds, every record as in version 1, the records' write-order
    numbers must be a permutation, and with ``verify`` the layout of the whole
    body (payloads, group blocks and step block of each step, then the root
    block, each at the next multiple of 64 with zero bytes between).
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
    if version != FORMAT_V1 and not v2.is_block_format(version):
        raise fail(8, f"unsupported format version {version} (this reader supports versions 1 to {READ_VERSION})")
    if v2.is_block_format(version) and n < PREAMBLE_LEN + v2.TRAILER_V2_LEN:
        raise fail(0, f"file is {n} bytes, shorter than the smallest version {version} trace")
    if flags != 0:
        raise fail(12, f"unknown flags {flags:#x} (must be 0 in version {version})")
    if alg_code not in _ALG_BY_CODE:
        raise fail(16, f"unknown digest algorithm code {alg_code}")
    alg = _ALG_BY_CODE[alg_code]
    if reserved != 0:
        raise fail(20, "reserved field is not zero")
    header_end = PREAMBLE_LEN + header_len
    trailer_len = v2.TRAILER_V2_LEN if v2.is_block_format(version) else TRAILER_LEN
    if header_len > MAX_HEADER_LEN or header_end > n - trailer_len:
        raise fail(24, f"header length {header_len} does not fit in a {n}-byte file")
    payload_start = _align(header_end)
    if v2.is_block_format(version):
        return _read_v2(path, b, alg, header_end, payload_start, verify, fail, version)

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
    return Trace(path, b, alg, binding, provenance, bd, root, records, FORMAT_V1)


def _check_zero(b, lo, hi, fail):
    seg = b[lo:hi]
    if seg.count(0) != len(seg):
        k = next(j for j, x in enumerate(seg) if x != 0)
        raise fail(lo + k, "padding byte is not zero (corrupted file)")


def _read_pages(b, block, fail, gname, step, lv, g, pages, prefix_len, floor):
    """Every record of a paged group (format version 4, section 11.9): the page
    table's size and placement, then every page block (its digest, that it names
    the group and the page and holds the records the layout puts in it), a record
    two pages share identical in both. The caller checks the records and the
    group digest as a group block's (no chaining value is needed for that)."""
    count = -(-(prefix_len + 32 * g.records) // v2.PAGE_BYTES)
    if len(pages) != count:
        raise fail(g.block.offset, f"{gname}: has {len(pages)} pages, a group of {g.records} records has {count}")
    out = []
    cursor = floor
    for j, (_cv, ref) in enumerate(pages):
        if ref.offset % ALIGN or ref.offset < cursor or ref.offset + ref.length > g.block.offset:
            raise fail(g.block.offset, f"{gname}: page {j}'s block at {ref.offset} (+{ref.length}) is misaligned, out "
                                       "of order or not between the previous group's block and this one")
        cursor = ref.offset + ref.length
        pname = f"{gname} page {j}"
        data = block(ref, pname)
        try:
            pstep, plevel, player, page, entries = v2.decode_page_block(data, ref.offset, Record)
        except WireError as e:
            raise fail(e.offset, f"{pname}: {e.what}") from None
        if (pstep, plevel, player, page) != (step, lv, g.layer, j):
            raise fail(ref.offset, f"{pname}: says it holds step {pstep} level L{plevel} layer {player} page {page}")
        want = v2.page_entries(prefix_len, g.records, j)
        if len(entries) != len(want):
            raise fail(ref.offset, f"{pname}: holds {len(entries)} records, the group's layout puts {len(want)} in it")
        skip = max(len(out) - want.start, 0)
        for (o1, r1, _), (o2, r2, _) in zip(out[want.start:], entries[:skip]):
            if o1 != o2 or r1 != r2:
                raise fail(ref.offset, f"{pname}: record {r2.coord}, which pages {j - 1} and {j} share, differs "
                                       "between them")
        out.extend(entries[skip:])
    return out


def _read_v2(path, b, alg, header_end, payload_start, verify, fail, version=v2.FORMAT_V2):
    """Reads a version 2, 3 or 4 trace whole (see :func:`read_trace`)."""
    n = len(b)
    t0 = n - v2.TRAILER_V2_LEN
    if b[t0:t0 + 8] != END_MAGIC or b[t0 + 128:t0 + 136] != END_MAGIC:
        raise fail(t0, "trailer magic missing: the file is truncated or was not finished by its writer")
    root_off, root_len, record_count = struct.unpack_from("<QQQ", b, t0 + 8)
    root = bytes(b[t0 + 32:t0 + 64])
    root_block_digest = bytes(b[t0 + 64:t0 + 96])
    if root_off < payload_start or root_off % ALIGN or root_off + root_len != t0:
        raise fail(t0 + 8, f"root block at {root_off} with length {root_len} is misaligned, before the payload "
                           f"section ({payload_start}) or does not end at the trailer ({t0})")
    if record_count > root_off // v2.MIN_GROUP_ENTRY_LEN:
        raise fail(t0 + 24, f"record count {record_count} cannot fit before the root block at {root_off}")
    if v2.checksum_v2(alg, b[:header_end], b[t0:t0 + 96]) != bytes(b[t0 + 96:t0 + 128]):
        raise fail(t0 + 96, "checksum mismatch: the header or trailer is corrupted")
    try:
        d = Decoder(b[PREAMBLE_LEN:header_end], PREAMBLE_LEN)
        binding = Binding.decode(d)
        provenance = Provenance.decode(d)
        d.finish("header")
    except WireError as e:
        raise fail(e.offset, f"header: {e.what}") from None

    def block(ref, what):
        if ref.offset + ref.length > n:
            raise fail(ref.offset, f"{what} lies outside the file")
        data = bytes(b[ref.offset:ref.offset + ref.length])
        if v2.block_digest(alg, data) != ref.digest:
            raise fail(ref.offset, f"{what} does not match its digest in its parent (corrupted block)")
        return data

    root_bytes = block(v2.BlockRef(root_off, root_len, root_block_digest), "root block")
    try:
        steps = v2.decode_root_block(root_bytes, root_off, version)
    except WireError as e:
        raise fail(e.offset, f"root block: {e.what}") from None
    bases, regions = [], []
    total, region, previous = 0, header_end, None
    for k, s in enumerate(steps):
        at = root_off + 12 + k * v2.step_ref_len(version)
        if previous is not None and previous >= s.step:
            raise fail(at, f"root block: step {s.step}: steps are not in strictly ascending order")
        previous = s.step
        wrong = check_step(binding.max_new_tokens, Coord(s.step, 0, 0 if s.step == 0 else 1, None, "x"))
        if wrong:
            raise fail(at, f"root block: step {s.step}: {wrong}")
        if s.level_digests is not None:
            for lv, (d, c) in enumerate(zip(s.level_digests, s.level_records)):
                if (d == v2.ZERO) != (c == 0):
                    raise fail(at, f"root block: step {s.step}: level L{lv}: {c} records declared with "
                                   f"{'a zero' if d == v2.ZERO else 'a'} level digest")
        count = sum(s.level_records)
        if count == 0 or count >= 2**64:
            raise fail(at, f"root block: step {s.step}: its record counts are zero or overflow")
        end = s.block.offset + s.block.length
        if s.block.offset % ALIGN or s.block.offset < region or end > root_off:
            raise fail(at, f"root block: step {s.step}: step block at {s.block.offset} (+{s.block.length}) is "
                           "misaligned, overlaps the step before or does not lie before the root block")
        bases.append(total)
        regions.append(region)
        total += count
        region = end
    if total != record_count:
        raise fail(t0 + 24, f"the root block's steps hold {total} records, the trailer says {record_count}")
    bd = binding_digest(alg, binding.to_bytes())
    if root_digest(alg, bd, [(s.step, s.digest) for s in steps]) != root:
        raise fail(t0 + 32, "root digest does not match the root block's steps: the root block or trailer is "
                            "corrupted")

    records = [None] * record_count
    fold = binding.fold_negative_zero
    for k, s in enumerate(steps):
        name = f"step {s.step}'s block"
        data = block(s.block, name)
        try:
            step, levels = v2.decode_step_block(data, s.block.offset)
        except WireError as e:
            raise fail(e.offset, f"{name}: {e.what}") from None
        sfail = lambda m: fail(s.block.offset, f"{name}: {m}")  # noqa: E731
        if step != s.step:
            raise sfail(f"names step {step}")
        cursor, payload_end, counts, prev_lv = regions[k], None, [0] * 5, None
        blocks = []
        level_nodes = []
        for lv, groups in levels:
            if prev_lv is not None and prev_lv >= lv:
                raise sfail("levels are not in strictly ascending order")
            prev_lv = lv
            if not groups:
                raise sfail(f"level L{lv} holds no group")
            prev_layer = "none"
            for g in groups:
                layer_key = -1 if g.layer is None else g.layer
                if prev_layer != "none" and prev_layer >= layer_key:
                    raise sfail(f"the groups of level L{lv} are not in strictly ascending layer order")
                prev_layer = layer_key
                if (g.records == 0 or g.block.offset % ALIGN or g.block.offset < cursor
                        or g.block.offset + g.block.length > s.block.offset):
                    raise sfail(f"group block of level L{lv} layer {g.layer} at {g.block.offset} (+{g.block.length}) "
                                "holds no record, is misaligned, out of order or outside the step's part of the file")
                if payload_end is None:
                    payload_end = g.block.offset
                cursor = g.block.offset + g.block.length
                counts[lv] += g.records
                blocks.append((lv, g))
            level_nodes.append((lv, level_digest(alg, step, lv, [g.digest for g in groups])))
        if counts != s.level_records:
            raise sfail(f"holds {counts} records per level, the root block says {s.level_records}")
        if step_digest(alg, step, level_nodes) != s.digest:
            raise sfail("its levels do not hash to the step digest in the root block (corrupted block)")
        if s.level_digests is not None:
            own = [v2.ZERO] * 5
            for lv, d in level_nodes:
                own[lv] = d
            if own != s.level_digests:
                raise sfail("its level digests differ from those the root block lists")
        base, count = bases[k], sum(s.level_records)
        mine = []
        # Version 4: each paged group's page blocks, and where the previous
        # group's block ends (a paged group's pages lie after it).
        page_blocks, page_floor = {}, []
        for lv, g in blocks:
            gname = f"step {step} level L{lv} layer {g.layer}'s group block"
            gdata = block(g.block, gname)
            try:
                gstep, glevel, glayer, entries, pages = v2.decode_group_block_paged(
                    gdata, g.block.offset, Record, version >= v2.FORMAT_V4)
            except WireError as e:
                raise fail(e.offset, f"{gname}: {e.what}") from None
            if (gstep, glevel, glayer) != (step, lv, g.layer):
                raise fail(g.block.offset, f"{gname}: says it holds step {gstep} level L{glevel} layer {glayer}")
            prefix_len = v2.group_prefix_len(g.layer)
            should_page = (version >= v2.FORMAT_V4 and alg == "blake3"
                           and prefix_len + 32 * g.records > v2.PAGE_BYTES)
            if should_page != bool(pages):
                raise fail(g.block.offset, f"{gname}: a group of {g.records} records is "
                                           f"{'' if should_page else 'not '}stored paged in format version "
                                           f"{version}")
            if pages:
                entries = _read_pages(b, block, fail, gname, step, lv, g, pages, prefix_len,
                                      page_floor[-1] if page_floor else regions[k])
                page_blocks[(lv, g.layer)] = [ref for _, ref in pages]
            page_floor.append(g.block.offset + g.block.length)
            if len(entries) != g.records:
                raise fail(g.block.offset, f"{gname}: holds {len(entries)} records, its step says {g.records}")
            prev = None
            for ordinal, r, at in entries:
                wrong = check_record(binding, r.coord, r.dtype, r.shape)
                if wrong:
                    raise fail(at, f"{gname}: record {r.coord}: {wrong}")
                if not base <= ordinal < base + count:
                    raise fail(at, f"{gname}: record {r.coord}: write-order number {ordinal} is outside its step's "
                                   f"{base}..{base + count}")
                if prev is not None and prev.coord.tree_key() >= r.coord.tree_key():
                    raise fail(at, f"{gname}: record {r.coord}: not in canonical order (or a duplicate) after "
                                   f"{prev.coord}")
                if r.payload is not None:
                    off, ln = r.payload
                    if off % ALIGN or off < regions[k] or off + ln > payload_end:
                        raise fail(at, f"{gname}: record {r.coord}: payload at {off} (+{ln}) is misaligned or outside "
                                       "its step's payloads")
                prev = r
                mine.append((ordinal, r))
            if group_digest(alg, step, lv, g.layer, [r.digest for _, r, _ in entries]) != g.digest:
                raise fail(g.block.offset, f"{gname}: its records do not hash to the group digest in its step block "
                                           "(corrupted block)")
        mine.sort(key=lambda x: x[0])
        for j, (ordinal, r) in enumerate(mine):
            if ordinal != base + j:
                raise fail(s.block.offset, f"step {step}: record {ordinal} ({r.coord}) repeats a write-order number "
                                           "or leaves one out")
            records[ordinal] = r
        if verify:
            def chunk(cur, off, what):
                want = _align(cur)
                if off != want:
                    raise fail(min(off, n), f"{what} is at byte {off}, where the layout puts it at {want}")
                _check_zero(b, cur, off, fail)

            cur = regions[k]
            for ordinal, r in mine:
                if r.payload is None:
                    continue
                off, ln = r.payload
                chunk(cur, off, f"the payload of record {ordinal} ({r.coord})")
                data = b[off:off + ln]
                if canonicalize(r.dtype, data, fold) != data:
                    raise fail(off, f"record {ordinal} ({r.coord}): payload is not canonical")
                if record_digest(alg, r.coord, r.level, r.dtype, r.shape, data) != r.digest:
                    raise fail(off, f"record {ordinal} ({r.coord}): payload bytes do not match the record digest "
                                    "(corrupted payload)")
                cur = off + ln
            for lv, g in blocks:
                for j, ref in enumerate(page_blocks.get((lv, g.layer), [])):
                    chunk(cur, ref.offset, f"step {step} level L{lv} layer {g.layer}'s page {j}")
                    cur = ref.offset + ref.length
                chunk(cur, g.block.offset, f"step {step} level L{lv} layer {g.layer}'s group block")
                cur = g.block.offset + g.block.length
            chunk(cur, s.block.offset, f"step {step}'s block")
    if verify:
        cur = steps[-1].block.offset + steps[-1].block.length if steps else header_end
        want = _align(cur)
        if root_off != want:
            raise fail(root_off, f"the root block is at byte {root_off}, where the layout puts it at {want}")
        _check_zero(b, cur, root_off, fail)
    return Trace(path, b, alg, binding, provenance, bd, root, records, version)
