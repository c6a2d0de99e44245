"""Python writer -> Python reader: round trips, the streaming/atomic contract,
input validation, and rejection of every corruption the format can detect."""

import os
import struct

import numpy as np
import pytest

from moeconf import Binding, Coord, Provenance, TraceFormatError, TraceWriter, read_trace
from moeconf.fingerprint import canonicalize


def _binding(**kw):
    base = dict(model_name="py-test", prompt_text="why the sheep", prompt_ids=[11, 12, 13],
                max_new_tokens=2, precision="f32", capture_levels=0b11111, capture_payload_levels=0b00010)
    base.update(kw)
    return Binding(**base)


def _write_sample(path, algorithm="blake3", fold=False, keep=True):
    """A small two-step trace: returns the list of (coord, level, array) appended."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal(16).astype(np.float32)
    logits[3] = np.float32("nan")
    logits[5] = np.float32(-0.0)
    items = [
        (Coord.make(0, 0, "prefill", None, "token.input"), "L0", np.array([11, 12, 13], dtype=np.int32)),
        (Coord.make(0, 2, "prefill", None, "token.output"), "L0", np.array([7], dtype=np.int32)),
        (Coord.make(0, 2, "prefill", None, "lm.logits"), "L1", logits),
        (Coord.make(0, 2, "prefill", 1, "layer.post_ffn_mhc"), "L3", rng.standard_normal((2, 8)).astype(np.float32)),
        (Coord.make(0, 2, "prefill", 0, "layer.post_ffn_mhc"), "L3", rng.standard_normal((2, 8)).astype(np.float32)),
        (Coord.make(0, 2, "prefill", 0, "state.cumulative_length"), "L2", np.array([3], dtype=np.int64)),
        (Coord.make(1, 3, "decode", None, "token.input"), "L0", np.array([7], dtype=np.int32)),
        (Coord.make(1, 3, "decode", 0, "moe.combine"), "L4", rng.standard_normal(8).astype(np.float64)),
        (Coord.make(1, 3, "decode", None, "text.continuation"), "L0", np.frombuffer("é!".encode(), np.uint8)),
        (Coord.make(1, 3, "decode", 0, "router.scores"), "L3", np.array([0x3f80, 0xffc1, 0x8000], np.uint16)),
    ]
    w = TraceWriter(path, _binding(fold_negative_zero=fold), Provenance("pytest", "1", 1, [("k", "v")]),
                    algorithm)
    for c, lv, a in items:
        w.append(c, lv, a, keep_payload=keep)
    return items, w.finish()


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("fold", [False, True])
def test_round_trip(tmp_path, algorithm, fold):
    p = tmp_path / "t.bin"
    items, s = _write_sample(p, algorithm, fold)
    t = read_trace(p)
    assert t.algorithm == algorithm
    assert t.root == s.root and len(t.records) == s.records == len(items)
    assert os.path.getsize(p) == s.bytes
    assert t.binding.prompt_ids == [11, 12, 13] and t.binding.fold_negative_zero == fold
    assert t.provenance.runtime == "pytest" and t.provenance.notes == [("k", "v")]
    for i, (c, lv, a) in enumerate(items):
        r = t.records[i]
        assert r.coord == c and r.level == int(lv[1])
        assert list(r.shape) == list(a.shape)
        assert r.payload[0] % 64 == 0
        dtype = r.dtype
        assert t.payload(i) == canonicalize(dtype, a.astype(a.dtype.newbyteorder("<")).tobytes(), fold)
    logits = t.array(2)
    assert np.isnan(logits[3]) and logits.view(np.uint32)[3] == 0x7FC00000
    assert logits.view(np.uint32)[5] == (0 if fold else 0x80000000)


def test_root_independent_of_append_order_and_provenance(tmp_path):
    items, s = _write_sample(tmp_path / "a.bin")
    # Version 1 takes records in any order.
    w = TraceWriter(tmp_path / "b.bin", _binding(), Provenance("other", "9", 64), "blake3", format_version=1)
    for c, lv, a in reversed(items):
        w.append(c, lv, a, keep_payload=False)
    s2 = w.finish()
    assert s2.root == s.root
    # Version 2 takes them step by step, in any order within a step, and
    # refuses an earlier step than one it took.
    w = TraceWriter(tmp_path / "b2.bin", _binding(), Provenance("other", "9", 64), "blake3")
    for step in (0, 1):
        for c, lv, a in reversed([x for x in items if x[0].step == step]):
            w.append(c, lv, a, keep_payload=False)
    with pytest.raises(ValueError, match="step 0 after step 1: format version 2 takes records step by step"):
        w.append(Coord.make(0, 9, "prefill", None, "token.output"), "L0", np.array([1], np.int32))
    assert w.finish().root == s.root
    assert read_trace(tmp_path / "b2.bin").root == s.root
    # The root binds the binding: another prompt gives another root.
    w = TraceWriter(tmp_path / "c.bin", _binding(prompt_text="why the goat"))
    for c, lv, a in items:
        w.append(c, lv, a)
    assert w.finish().root != s.root


def test_root_depends_on_every_value_and_policy(tmp_path):
    _, s = _write_sample(tmp_path / "a.bin", fold=False)
    _, s_fold = _write_sample(tmp_path / "b.bin", fold=True)
    assert s.root != s_fold.root   # -0 present and the policy is bound


def test_fingerprint_only_trace(tmp_path):
    _, s = _write_sample(tmp_path / "t.bin", keep=False)
    t = read_trace(tmp_path / "t.bin")
    assert t.payload_count() == 0 and t.root == s.root
    assert t.payload(0) is None


def test_atomic_write(tmp_path):
    p = tmp_path / "t.bin"
    w = TraceWriter(p, _binding())
    w.append(Coord.make(0, 0, "prefill", None, "token.output"), "L0", np.array([1], np.int32))
    assert not p.exists()   # nothing at the destination before finish
    w.finish()
    assert p.exists() and [f.name for f in tmp_path.iterdir()] == ["t.bin"]
    with pytest.raises(ValueError, match="already finished"):
        w.append(Coord.make(0, 1, "prefill", None, "token.output"), "L0", np.array([1], np.int32))
    # An aborted writer (context manager left by an exception) leaves no file at all.
    q = tmp_path / "u.bin"
    with pytest.raises(RuntimeError):
        with TraceWriter(q, _binding()) as w2:
            w2.append(Coord.make(0, 0, "prefill", None, "token.output"), "L0", np.array([1], np.int32))
            raise RuntimeError("backend crashed")
    assert not q.exists() and [f.name for f in tmp_path.iterdir()] == ["t.bin"]


@pytest.mark.parametrize("args,match", [
    (((0, 0, "prefill", None, "bad path!"), "L0", np.array([1], np.int32)), "invalid character"),
    (((0, 0, "prefill", None, "x" * 129), "L0", np.array([1], np.int32)), "longer than 128"),
    (((0, 0, "sideways", None, "x"), "L0", np.array([1], np.int32)), "phase"),
    (((0, 0, "prefill", None, "x"), "L5", np.array([1], np.int32)), "L0..L4"),
    (((0, 0, "prefill", None, "x"), "L0", np.array([1.0], np.float32), "f64"), "cannot be recorded as f64"),
    (((0, 0, "prefill", None, "x"), "L0", b"\x00" * 7, "f32", [2]), "needs 8"),
    (((0, 0, "prefill", None, "x"), "L0", b"\x00" * 4, "f16", [2]), "unknown dtype"),
    (((0, 0, "prefill", None, "x"), "L0", np.zeros([1] * 9, np.float32)), "rank 9"),
])
def test_append_rejects_bad_input(tmp_path, args, match):
    with TraceWriter(tmp_path / "t.bin", _binding()) as w:
        with pytest.raises(ValueError, match=match):
            w.append(*args)


def test_duplicate_coordinate_rejected(tmp_path):
    with TraceWriter(tmp_path / "t.bin", _binding()) as w:
        c = Coord.make(0, 0, "prefill", None, "token.output")
        w.append(c, "L0", np.array([1], np.int32))
        with pytest.raises(ValueError, match="already appended"):
            w.append(c, "L0", np.array([2], np.int32))
        w.append(c, "L1", np.array([2], np.int32))   # another level is another record


def _small_trace(tmp_path, version=2):
    p = tmp_path / "small.bin"
    w = TraceWriter(p, _binding(prompt_ids=[1]), Provenance("pytest", "1", 1), format_version=version)
    w.append(Coord.make(0, 0, "prefill", None, "token.output"), "L0", np.array([5], np.int32), keep_payload=True)
    w.append(Coord.make(0, 0, "prefill", None, "lm.logits"), "L1", np.array([1.5, -2.0, 0.25], np.float32),
             keep_payload=True)
    w.append(Coord.make(0, 0, "prefill", 0, "layer.post_ffn_mhc"), "L3", np.ones((2, 2), np.float32))
    w.finish()
    return p, p.read_bytes()


@pytest.mark.parametrize("version", [1, 2, 3])
def test_every_single_byte_flip_is_rejected(tmp_path, version):
    p, good = _small_trace(tmp_path, version)
    bad = tmp_path / "bad.bin"
    for i in range(len(good)):
        for mask in (0x01, 0x80):
            b = bytearray(good)
            b[i] ^= mask
            bad.write_bytes(bytes(b))
            with pytest.raises(TraceFormatError) as e:
                read_trace(bad)
            assert str(bad) in str(e.value) and 0 <= e.value.offset <= len(good), (i, mask)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_every_truncation_is_rejected(tmp_path, version):
    p, good = _small_trace(tmp_path, version)
    bad = tmp_path / "bad.bin"
    for n in range(len(good)):
        bad.write_bytes(good[:n])
        with pytest.raises(TraceFormatError):
            read_trace(bad)
    bad.write_bytes(good + b"\x00")
    with pytest.raises(TraceFormatError, match="trailer magic"):
        read_trace(bad)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_error_messages_name_file_and_offset(tmp_path, version):
    p, good = _small_trace(tmp_path, version)
    bad = tmp_path / "bad.bin"
    n = len(good)
    # The trailer: 104 bytes in version 1 (checksum at 64), 136 in versions 2 and 3 (at 96).
    t0, sum_at = (n - 104, 64) if version == 1 else (n - 136, 96)
    cases = [
        (0, "bad magic", 0),
        (8, f"unsupported format version {version ^ 4}", 8),
        (12, "unknown flags", 12),
        (16, "unknown digest algorithm code", 16),
        (20, "reserved field", 20),
        (t0 + sum_at + 6, "checksum mismatch", t0 + sum_at),
    ]
    for at, match, offset in cases:
        b = bytearray(good)
        b[at] ^= 0x04
        bad.write_bytes(bytes(b))
        with pytest.raises(TraceFormatError, match=match) as e:
            read_trace(bad)
        assert e.value.offset == offset
        assert str(e.value).startswith(f"{bad}: byte {offset}: ")
    # A payload byte: the structure is intact, re-hashing catches it at the payload's offset.
    t = read_trace(p)
    off = t.records[1].payload[0]
    b = bytearray(good)
    b[off] ^= 0x01
    bad.write_bytes(bytes(b))
    with pytest.raises(TraceFormatError, match="do not match the record digest") as e:
        read_trace(bad)
    assert e.value.offset == off
    read_trace(bad, verify=False)   # without payload verification the structure still reads
    # A padding byte after the first payload.
    b = bytearray(good)
    b[t.records[0].payload[0] + 4] = 1
    bad.write_bytes(bytes(b))
    with pytest.raises(TraceFormatError, match="padding byte is not zero") as e:
        read_trace(bad)
    assert e.value.offset == t.records[0].payload[0] + 4
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(tmp_path / "missing.bin")


def test_non_canonical_payload_rejected(tmp_path):
    """A payload holding a non-canonical NaN is refused even though the index is intact."""
    p = tmp_path / "t.bin"
    w = TraceWriter(p, _binding())
    w.append(Coord.make(0, 0, "prefill", None, "lm.logits"), "L1", np.array([1.0, 2.0], np.float32),
             keep_payload=True)
    w.finish()
    t = read_trace(p)
    off = t.records[0].payload[0]
    b = bytearray(p.read_bytes())
    b[off:off + 4] = struct.pack("<I", 0x7FC00001)
    p.write_bytes(bytes(b))
    with pytest.raises(TraceFormatError, match="not canonical"):
        read_trace(p)
