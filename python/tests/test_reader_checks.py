"""The Python reader refuses records no writer may write (docs/format.md sections
3.1, 3.2, 7), in files whose checksum and root are consistent: a decode record at
step 0, a prefill record at a later step, a step at or beyond ``max_new_tokens``,
and a fingerprint-only record whose byte length does not fit in a u64. The files
are assembled by hand, bypassing the writer's checks, in both container
versions; the Rust reader (schema/tests/reader_checks.rs) refuses the same ones."""

import struct

import blake3

import pytest

from moeconf import Binding, Coord, Provenance, TraceFormatError, read_trace, v2
from moeconf.fingerprint import binding_digest, group_digest, level_digest, root_digest, step_digest, tree_root
from moeconf.trace import END_MAGIC, FORMAT_V1, MAGIC, Record, _align
from moeconf.wire import Encoder


def _raw_v2(path, max_new_tokens, step, phase, shape):
    """One record in a one-step version 2 trace with correct digests, checksum and root."""
    b = Binding(max_new_tokens=max_new_tokens)
    e = Encoder()
    b.encode(e)
    Provenance().encode(e)
    header = e.bytes()
    pre = MAGIC + struct.pack("<IIIIQ", v2.FORMAT_V2, 0, 0, 0, len(header))
    body = bytearray(pre + header)

    def block(data):
        body.extend(b"\x00" * (_align(len(body)) - len(body)))
        ref = v2.BlockRef(len(body), len(data), v2.block_digest("blake3", data))
        body.extend(data)
        return ref

    r = Record(Coord(step, step, phase, None, "token.output"), 0, "i32", shape, b"\x07" * 32, None)
    g = block(v2.encode_group_block(step, 0, None, [(0, r)]))
    gd = group_digest("blake3", step, 0, None, [r.digest])
    s = block(v2.encode_step_block(step, [(0, [v2.GroupRef(None, gd, 1, g)])]))
    sd = step_digest("blake3", step, [(0, level_digest("blake3", step, 0, [gd]))])
    root_ref = block(v2.encode_root_block([v2.StepRef(step, sd, [1, 0, 0, 0, 0], s)]))
    root = root_digest("blake3", binding_digest("blake3", b.to_bytes()), [(step, sd)])
    covered = v2.trailer_v2(root_ref, 1, root)
    path.write_bytes(bytes(body) + covered + v2.checksum_v2("blake3", pre + header, covered) + END_MAGIC)
    return path


def _raw(path, max_new_tokens, step, phase, shape, version=1):
    if version == 2:
        return _raw_v2(path, max_new_tokens, step, phase, shape)
    b = Binding(max_new_tokens=max_new_tokens)
    e = Encoder()
    b.encode(e)
    Provenance().encode(e)
    header = e.bytes()
    pre = MAGIC + struct.pack("<IIIIQ", FORMAT_V1, 0, 0, 0, len(header))
    body = pre + header
    body += b"\x00" * (_align(len(body)) - len(body))
    r = Record(Coord(step, step, phase, None, "token.output"), 0, "i32", shape, b"\x07" * 32, None)
    e = Encoder().length(1)
    r.encode(e)
    index = e.bytes()
    root = tree_root("blake3", binding_digest("blake3", b.to_bytes()), [(r.coord, r.level, r.digest)])
    covered = END_MAGIC + struct.pack("<QQQ", len(body), len(index), 1) + root

    h = blake3.blake3()
    h.update(Encoder().str("moeconf.checksum.v1").bytes())
    h.update(pre + header)
    h.update(index)
    h.update(covered)
    path.write_bytes(body + index + covered + h.digest() + END_MAGIC)
    return path


@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("max_new,step,phase,shape", [(2, 0, 0, [1]), (2, 1, 1, [1]), (1, 0, 0, [2**63, 4, 0]),
                                                      (1, 0, 0, [0, 2**63, 4])])
def test_consistent_records_are_read(tmp_path, max_new, step, phase, shape, version):
    read_trace(_raw(tmp_path / "t.bin", max_new, step, phase, shape, version))


@pytest.mark.parametrize("max_new,step,phase,shape,match", [
    (2, 0, 1, [1], "step 0 is the prefill forward"),
    (3, 2, 0, [1], "step 2 is a decode forward"),
    (2, 2, 1, [1], "max_new_tokens = 2 allows steps 0..1"),
    (0, 0, 0, [1], "max_new_tokens = 0 allows no step"),
    (1, 0, 0, [2**32, 2**32], "more than 2\\^64 - 1 bytes"),
    (1, 0, 0, [2**62, 2], "more than 2\\^64 - 1 bytes"),
])
@pytest.mark.parametrize("version", [1, 2, 3])
def test_inconsistent_records_are_refused(tmp_path, max_new, step, phase, shape, match, version):
    with pytest.raises(TraceFormatError, match=match):
        read_trace(_raw(tmp_path / "t.bin", max_new, step, phase, shape, version))
