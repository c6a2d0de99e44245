"""Trace format version 2 (docs/format.md section 11): the hash tree's interior
nodes persisted as blocks, written from the specification.

A group block holds the index entries of one (step, level, layer), a step block
the level nodes of one step with a reference to each group block, the root block
one reference per step; every reference carries the child's fingerprint digest
(section 4.3) and the digest of the child block's bytes. This module encodes and
decodes the blocks; :mod:`moeconf.trace` reads and writes files with them.
"""

import struct
from dataclasses import dataclass
from typing import List, Optional

from .fingerprint import DTYPE_BY_CODE, DTYPES, MAX_PATH_LEN, MAX_RANK, Coord, hasher, validate_path
from .wire import Decoder, Encoder

__all__ = [
    "FORMAT_V2", "TRAILER_V2_LEN", "KIND_GROUP", "KIND_STEP", "KIND_ROOT", "MIN_GROUP_ENTRY_LEN",
    "MIN_GROUP_REF_LEN", "MIN_LEVEL_LEN", "STEP_REF_LEN", "STEP_REF_LEN_V3", "FORMAT_V3", "is_block_format",
    "step_ref_len", "BlockRef", "GroupRef", "StepRef", "block_digest",
    "checksum_v2", "encode_group_block", "decode_group_block", "encode_step_block", "decode_step_block",
    "encode_root_block", "decode_root_block", "FORMAT_V4", "KIND_PAGE", "PAGE_BYTES", "PAGE_REF_LEN",
    "decode_group_block_paged", "decode_page_block", "page_entries",
]

#: The container version with persisted tree nodes.
FORMAT_V2 = 2
#: Size of the version 2 trailer.
TRAILER_V2_LEN = 136
#: Block kind codes.
KIND_GROUP, KIND_STEP, KIND_ROOT = 0, 1, 2
#: Smallest encoded group entry (ordinal, position, phase, 1-byte path, dtype, empty shape, digest, no payload).
MIN_GROUP_ENTRY_LEN = 8 + 4 + 4 + 8 + 1 + 4 + 8 + 32 + 1
#: Smallest encoded group reference (layer None).
MIN_GROUP_REF_LEN = 1 + 32 + 8 + 8 + 8 + 32
#: Smallest encoded level of a step block.
MIN_LEVEL_LEN = 4 + 8
#: Size of an encoded step reference.
STEP_REF_LEN = 4 + 32 + 8 * 5 + 8 + 8 + 32
#: Version 3: version 2 whose step references also list the five level
#: digests (zero where the step holds no record), docs/format.md §11.8.
FORMAT_V3 = 3
STEP_REF_LEN_V3 = STEP_REF_LEN + 5 * 32
ZERO = bytes(32)
#: Version 4: version 3 whose layer groups longer than one page (BLAKE3
#: traces) are stored as page blocks under a page table, docs/format.md
#: section 11.9. Read here; written by the Rust writers only.
FORMAT_V4 = 4
#: Block kind code of a page block (version 4).
KIND_PAGE = 3
#: Bytes of a group's digest preimage per page (128 BLAKE3 chunks).
PAGE_BYTES = 128 * 1024
#: Size of an encoded page reference (chaining value, block reference).
PAGE_REF_LEN = 32 + 8 + 8 + 32


def is_block_format(version):
    """Whether ``version`` is one of the block formats (2, 3 or 4)."""
    return version in (FORMAT_V2, FORMAT_V3, FORMAT_V4)


def step_ref_len(version):
    """Size of one step reference of ``version`` (2, 3 or 4)."""
    return STEP_REF_LEN_V3 if version >= FORMAT_V3 else STEP_REF_LEN


def group_prefix_len(layer):
    """Bytes of a group's digest preimage before its record digests (section 4.3): the
    domain tag, step, level, layer and record count."""
    return 8 + len("moeconf.group.v1") + 4 + 4 + (1 if layer is None else 5) + 8


def page_entries(prefix_len, records, j):
    """The records (indices in canonical order) whose digest bytes overlap page ``j``
    of a group's preimage: ``range(first, last)``; a record straddling a page
    boundary is in both pages (section 11.9)."""
    total = prefix_len + 32 * records
    a = min(j * PAGE_BYTES, total)
    b = min(a + PAGE_BYTES, total)
    first = max(a - prefix_len, 0) // 32
    last = min(-(-max(b - prefix_len, 0) // 32), records)
    return range(min(first, last), last)


def block_digest(algorithm, data):
    """``H(wire("moeconf.block.v2") || data)``: what a parent records of a child block."""
    h = hasher(algorithm)
    h.update(Encoder().str("moeconf.block.v2").bytes())
    h.update(data)
    return h.digest()


def checksum_v2(algorithm, preamble_and_header, covered):
    """``H(wire("moeconf.checksum.v2") || preamble and header || trailer[0:96])``."""
    h = hasher(algorithm)
    h.update(Encoder().str("moeconf.checksum.v2").bytes())
    h.update(preamble_and_header)
    h.update(covered)
    return h.digest()


@dataclass
class BlockRef:
    """Where a block lies (absolute ``offset``, ``length``) and its :func:`block_digest`."""

    offset: int
    length: int
    digest: bytes

    def encode(self, e):
        """Appends offset u64, length u64, digest."""
        e.u64(self.offset).u64(self.length).raw(self.digest)

    @staticmethod
    def decode(d, what):
        """Reads offset, length and digest."""
        return BlockRef(d.u64(what), d.u64(what), d.array32(what))


@dataclass
class GroupRef:
    """A step block's reference to a group block."""

    layer: Optional[int]
    digest: bytes
    records: int
    block: BlockRef


@dataclass
class StepRef:
    """The root block's reference to a step block; ``level_records`` counts the
    step's records at L0..L4."""

    step: int
    digest: bytes
    level_records: List[int]
    block: BlockRef
    #: Version 3: the digest of each level L0..L4 (32 zero bytes where the
    #: step holds none); ``None`` in version 2.
    level_digests: Optional[List[bytes]] = None


def encode_group_block(step, level, layer, entries):
    """A group block. ``entries`` are ``(ordinal, Record)`` in canonical order;
    each is encoded as (ordinal u64, position u32, phase u32, path String, dtype
    u32, shape Vec<u64>, digest, payload Option<(offset u64, length u64)>)."""
    e = Encoder().u32(KIND_GROUP).u32(step).u32(level).opt_u32(layer).length(len(entries))
    for ordinal, r in entries:
        e.u64(ordinal).u32(r.coord.position).u32(r.coord.phase).str(r.coord.path)
        e.u32(DTYPES[r.dtype][0]).length(len(r.shape))
        for d in r.shape:
            e.u64(d)
        e.raw(r.digest)
        if r.payload is None:
            e.u8(0)
        else:
            e.u8(1).u64(r.payload[0]).u64(r.payload[1])
    return e.bytes()


def _kind(d, want, name):
    at = d.offset()
    k = d.u32("block kind")
    if k != want:
        raise d.error(f"block kind {k} where a {name} block (kind {want}) belongs", at)


def _level(d, what):
    at = d.offset()
    lv = d.u32(what)
    if lv > 4:
        raise d.error(f"unknown level code {lv}", at)
    return lv


def decode_group_block(data, base, make_record):
    """Decodes a group block at file offset ``base``. Returns ``(step, level, layer,
    [(ordinal, Record, offset)])``; ``make_record(coord, level, dtype, shape,
    digest, payload)`` builds the records. Order, counts and locations are the
    reader's to check."""
    step, level, layer, out, _ = decode_group_block_paged(data, base, make_record, False)
    return step, level, layer, out


def decode_group_block_paged(data, base, make_record, paged=True):
    """:func:`decode_group_block` of version 4 (with ``paged``): a block without
    entries carries a page table. Returns ``(step, level, layer, entries, pages)``,
    ``pages`` a list of ``(chaining value, BlockRef)`` (empty unless paged)."""
    d = Decoder(data, base)
    _kind(d, KIND_GROUP, "group")
    step = d.u32("group step")
    level = _level(d, "group level")
    layer = d.opt_u32("group layer")
    out = _entries(d, step, level, layer, make_record)
    pages = []
    if paged and not out:
        n = d.length("page count", PAGE_REF_LEN, 2**64)
        for _ in range(n):
            cv = d.array32("page chaining value")
            pages.append((cv, BlockRef.decode(d, "page block reference")))
    d.finish("group block")
    return step, level, layer, out, pages


def decode_page_block(data, base, make_record):
    """Decodes a page block (version 4): ``(step, level, layer, page, entries)``,
    with the checks of :func:`decode_group_block`."""
    d = Decoder(data, base)
    _kind(d, KIND_PAGE, "page")
    step = d.u32("page step")
    level = _level(d, "page level")
    layer = d.opt_u32("page layer")
    page = d.u32("page number")
    out = _entries(d, step, level, layer, make_record)
    d.finish("page block")
    return step, level, layer, page, out


def _entries(d, step, level, layer, make_record):
    """The entry list of a group or page block."""
    n = d.length("group entry count", MIN_GROUP_ENTRY_LEN, 2**64)
    out = []
    for _ in range(n):
        at = d.offset()
        ordinal = d.u64("record ordinal")
        position = d.u32("coordinate position")
        pat = d.offset()
        phase = d.u32("coordinate phase")
        if phase > 1:
            raise d.error(f"unknown phase code {phase}", pat)
        pat = d.offset()
        path = d.str("coordinate path", MAX_PATH_LEN)
        try:
            validate_path(path)
        except ValueError as e:
            raise d.error(str(e), pat) from None
        dat = d.offset()
        code = d.u32("record dtype")
        if code not in DTYPE_BY_CODE:
            raise d.error(f"unknown dtype code {code}", dat)
        rank = d.length("record shape", 8, MAX_RANK)
        shape = [d.u64("record dimension") for _ in range(rank)]
        digest = d.array32("record digest")
        oat = d.offset()
        tag = d.u8("record payload")
        if tag == 0:
            payload = None
        elif tag == 1:
            payload = (d.u64("payload offset"), d.u64("payload length"))
        else:
            raise d.error(f"record payload: invalid option tag {tag}", oat)
        dtype = DTYPE_BY_CODE[code]
        coord = Coord(step, position, phase, layer, path)
        if payload is not None:
            want = DTYPES[dtype][1]
            for x in shape:
                want *= x
            if payload[1] != want:
                raise d.error(f"record {coord}: payload length {payload[1]} does not match shape {shape} of {dtype}",
                              oat)
        out.append((ordinal, make_record(coord, level, dtype, shape, digest, payload), at))
    return out


def encode_step_block(step, levels):
    """A step block: ``levels`` is ``[(level code, [GroupRef])]`` ascending."""
    e = Encoder().u32(KIND_STEP).u32(step).length(len(levels))
    for lv, groups in levels:
        e.u32(lv).length(len(groups))
        for g in groups:
            e.opt_u32(g.layer).raw(g.digest).u64(g.records)
            g.block.encode(e)
    return e.bytes()


def decode_step_block(data, base):
    """Decodes a step block: ``(step, [(level code, [GroupRef])])``."""
    d = Decoder(data, base)
    _kind(d, KIND_STEP, "step")
    step = d.u32("step block step")
    n = d.length("step block level count", MIN_LEVEL_LEN, 5)
    levels = []
    for _ in range(n):
        lv = _level(d, "step block level")
        g = d.length("level group count", MIN_GROUP_REF_LEN, 2**64)
        groups = []
        for _ in range(g):
            layer = d.opt_u32("group layer")
            digest = d.array32("group digest")
            records = d.u64("group record count")
            groups.append(GroupRef(layer, digest, records, BlockRef.decode(d, "group block reference")))
        levels.append((lv, groups))
    d.finish("step block")
    return step, levels


def encode_root_block(steps):
    """The root block: one :class:`StepRef` per step, ascending."""
    e = Encoder().u32(KIND_ROOT).length(len(steps))
    for s in steps:
        e.u32(s.step).raw(s.digest)
        for n in s.level_records:
            e.u64(n)
        s.block.encode(e)
        if s.level_digests is not None:
            for x in s.level_digests:
                e.raw(x)
    return e.bytes()


def decode_root_block(data, base, version=FORMAT_V2):
    """Decodes the root block of ``version`` (2, 3 or 4): ``[StepRef]``."""
    d = Decoder(data, base)
    _kind(d, KIND_ROOT, "root")
    n = d.length("root block step count", step_ref_len(version), 2**64)
    steps = []
    for _ in range(n):
        step = d.u32("step reference step")
        digest = d.array32("step digest")
        counts = [d.u64("step level record count") for _ in range(5)]
        block = BlockRef.decode(d, "step block reference")
        levels = [d.array32("step level digest") for _ in range(5)] if version >= FORMAT_V3 else None
        steps.append(StepRef(step, digest, counts, block, levels))
    d.finish("root block")
    return steps


def trailer_v2(root_block, record_count, root):
    """The first 96 trailer bytes (what the checksum covers)."""
    return (b"MOECEND\x00" + struct.pack("<QQQ", root_block.offset, root_block.length, record_count) + root
            + root_block.digest)
