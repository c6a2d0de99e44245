"""Property: whatever the Python writer accepts, the reader accepts (docs/format.md
section 10). A seeded loop (``random.Random``, no new dependency) builds random
headers and records, valid and invalid, with values at and just past every reader
limit: string, dtype and strategy lengths, extra and note counts, ranks, capture
bits, integers beyond u32/u64, shapes whose byte length overflows a u64, step and
phase combinations around ``max_new_tokens``, invalid paths, duplicate
coordinates. A refused append leaves the writer as it was, so the records it took
are exactly what the reader finds; a refused header leaves no file; every finished
trace reads back, fully verified, with the writer's root, header and records. When
the Rust binary is available, ``moeconf inspect`` must accept every finished trace
too. Both container versions are drawn (version 2 also refuses a record of an
earlier step than one it took)."""

import os
import random
import subprocess

import pytest

from moeconf import Binding, Coord, Provenance, TraceWriter, read_trace
from moeconf.binding import TensorDigest
from moeconf.fingerprint import DTYPES
from moeconf.wire import MAX_STRING

SEED = int(os.environ.get("MOECONF_PROPTEST_SEED", "7"))
CASES = int(os.environ.get("MOECONF_PROPTEST_CASES", "400"))


def _text(rng, n):
    """About ``n`` UTF-8 bytes (exactly n, or n-1/n-2 when a multi-byte character does not fit)."""
    parts, size = [], 0
    while size < n:
        c = rng.choice("az0 é公") if size < 64 else "a"
        parts.append(c)
        size += len(c.encode())
    return "".join(parts).encode()[:n].decode("utf-8", "ignore")


def _field(rng, cap, big_percent):
    if rng.randrange(100) < big_percent:
        return _text(rng, rng.choice([cap - 1, cap, cap + 1, cap + 3]))
    return _text(rng, rng.randrange(12))


def _pairs(rng, sortable):
    n = rng.choice([4095, 4096, 4097]) if rng.randrange(100) < 3 else rng.randrange(4)
    v = [(f"k{i:05}", _field(rng, 16, 0)) for i in range(n)]
    if not sortable and n > 1 and rng.randrange(100) < 15:
        v[0], v[-1] = v[-1], v[0]
    if v and rng.randrange(100) < 2:
        v[0] = (v[0][0], _text(rng, MAX_STRING + 1))
    return v


def _rare(rng, bad, good, percent=4):
    """``bad`` with probability ``percent`` %, else a choice of ``good``."""
    return bad if rng.randrange(100) < percent else rng.choice(good)


def _header(rng):
    tensors = [TensorDigest(f"t{i}", _field(rng, 64, 8),
                            [rng.randrange(5) for _ in range(_rare(rng, 9, [0, 1, 2, 8]))],
                            bytes([rng.randrange(256)]) * 32)
               for i in range(rng.randrange(4))]
    if len(tensors) > 1 and rng.randrange(100) < 10:
        tensors.reverse()
    b = Binding(
        model_name=_field(rng, MAX_STRING, 2), tensors=tensors, tokenizer_name=_field(rng, MAX_STRING, 1),
        prompt_text=_field(rng, MAX_STRING, 2),
        prompt_ids=[2**32 if rng.randrange(100) < 3 else rng.choice([0, 7, 2**32 - 1])
                    for _ in range(rng.randrange(5))],
        decoding_strategy=_field(rng, 64, 10), max_new_tokens=_rare(rng, 2**32, [0, 1, 2, 3, 3, 5, 5, 2**32 - 1]),
        precision=_field(rng, MAX_STRING, 1), contract=_field(rng, 8, 0), schedule=_field(rng, 8, 0),
        capture_levels=_rare(rng, rng.choice([32, 2**32 - 1]), [0, 1, 31, 31]),
        capture_payload_levels=_rare(rng, 64, [0, 10, 31]),
        fold_negative_zero=rng.randrange(2) == 1, extra=_pairs(rng, False))
    p = Provenance(_field(rng, MAX_STRING, 1), _field(rng, 8, 0), _rare(rng, 2**32, [0, 1, 64, 2**32 - 1]),
                   _pairs(rng, True))
    return b, p


def _record(rng, max_new_tokens, previous):
    if previous and rng.randrange(100) < 5:
        return rng.choice(previous)
    step = rng.choice([0, 1, 2, max(max_new_tokens - 1, 0), max_new_tokens, max_new_tokens + 1])
    step = min(step, 2**32 - 1)
    phase = "prefill" if (rng.randrange(100) < 90) == (step == 0) else "decode"
    path = {0: "", 1: "x" * 129, 2: "x" * 128, 3: "lm logits"}.get(
        rng.randrange(30),
        rng.choice(["token.output", "lm.logits", "lm.margin", "router.topk", "moe.combine", "state.window_kv"]))
    dtype = rng.choice(list(DTYPES))
    shape = [rng.randrange(4) for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3, 8, 9]))]
    if shape and rng.randrange(100) < 15:
        shape[rng.randrange(len(shape))] = rng.choice([2**32, 2**62, 2**63, 2**64 - 1, 2**64])
    want = DTYPES[dtype][1]
    for d in shape:
        want *= d
    n = want if want <= 4096 and rng.randrange(100) < 92 else rng.randrange(9)
    data = bytes(rng.randrange(256) for _ in range(n))
    layer = rng.randrange(3) if rng.randrange(2) else None
    return ((step, rng.randrange(8), phase, layer, path), rng.choice(["L0", "L1", "L2", "L3", "L4", 0, 3] * 3 + [5]),
            data, dtype, shape, rng.randrange(100) < 60)


def _leftovers(d):
    return [n for n in os.listdir(d) if n.startswith(".")]


def _case(rng, d, n):
    path = os.path.join(d, f"c{n}.bin")
    b, p = _header(rng)
    version = rng.choice([1, 2, 2])
    try:
        w = TraceWriter(path, b, p, rng.choice(["blake3", "sha256"]), format_version=version)
    except ValueError:
        assert not os.path.exists(path) and not _leftovers(d), f"case {n}: a refused header left a file"
        return None
    taken, tried = [], []
    for _ in range(rng.randrange(10)):
        r = _record(rng, b.max_new_tokens, tried)
        tried.append(r)
        coord, level, data, dtype, shape, keep = r
        try:
            w.append(Coord.make(*coord), level, data, dtype, shape, keep)
        except ValueError:
            continue
        taken.append(r)
    s = w.finish()
    t = read_trace(path)
    assert t.root == s.root, n
    assert t.format_version == version, n
    assert t.binding == b and t.provenance == p, n
    assert len(t.records) == len(taken), n
    for rec, (coord, _, data, dtype, shape, keep) in zip(t.records, taken):
        assert (rec.coord.step, rec.coord.position, rec.coord.layer, rec.coord.path) == \
            (coord[0], coord[1], coord[3], coord[4])
        assert (rec.dtype, rec.shape) == (dtype, shape)
        assert (rec.payload is not None) == keep
    return path, len(taken)


def test_whatever_the_writer_accepts_the_reader_accepts(tmp_path, request):
    rng = random.Random(SEED)
    finished, records, refused = [], 0, 0
    for n in range(CASES):
        r = _case(rng, str(tmp_path), n)
        if r is None:
            refused += 1
            continue
        finished.append(r[0])
        records += r[1]
    print(f"{CASES} cases: {CASES - refused} headers accepted, {records} records accepted")
    assert CASES // 10 < len(finished) < CASES - CASES // 10, (len(finished), refused)
    assert records > CASES // 3
    # The Rust reader agrees on every finished trace (when the binary is built).
    bin_path = os.environ.get("MOECONF_BIN") or os.path.join(request.config.rootdir, "..", "target", "release",
                                                             "moeconf")
    if not (os.path.isfile(bin_path) and os.access(bin_path, os.X_OK)):
        pytest.skip("the Rust half needs the moeconf binary (MOECONF_BIN)")
    for f in finished[:60]:
        p = subprocess.run([bin_path, "inspect", f], capture_output=True, text=True)
        assert p.returncode == 0, (f, p.stderr)
