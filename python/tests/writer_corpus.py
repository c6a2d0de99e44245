"""The shared writer corpus (``tests/writer_corpus.json``) through the Python writer.

Each case of the corpus is a binding, a provenance and records, and whether a
writer must accept or reject it. :func:`run_all` writes every case with
:class:`moeconf.TraceWriter` and reports, per case, whether the writer accepted
it, the root of the written trace and the error. The Rust side
(``tests/writer_corpus.rs``) runs this file as a script
(``python3 python/tests/writer_corpus.py CORPUS OUTDIR [VERSION]`` prints the
JSON list) and checks that both writers accept and reject the same cases and
write byte-identical files, in both container versions (a case's
``expect_v1``, where given, is its answer for version 1).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moeconf.binding import Binding, Provenance, TensorDigest  # noqa: E402
from moeconf.fingerprint import Coord  # noqa: E402
from moeconf.trace import TraceWriter  # noqa: E402


def expand_str(v):
    """A corpus string: plain, ``{"repeat": S, "count": N}`` or ``{"utf8_hex": H}``."""
    if isinstance(v, dict) and "repeat" in v:
        return v["repeat"] * v["count"]
    if isinstance(v, dict) and "utf8_hex" in v:
        # Bytes that need not be UTF-8: kept as surrogate escapes, which no writer may encode.
        return bytes.fromhex(v["utf8_hex"]).decode("utf-8", "surrogateescape")
    return v


def expand_pairs(v):
    """A corpus pair list: ``[[k, v], ...]`` or ``{"generate": N}``."""
    if isinstance(v, dict):
        return [(f"k{i:05}", "v") for i in range(v["generate"])]
    return [(expand_str(a), expand_str(b)) for a, b in v]


def build(case):
    """The :class:`Binding`, :class:`Provenance` and record list of a case."""
    b = Binding()
    for k, v in case.get("binding", {}).items():
        if k in ("config_digest", "weights_digest", "tokenizer_digest"):
            v = bytes.fromhex(v)
        elif k == "tensors":
            v = [TensorDigest(expand_str(t["name"]), expand_str(t["dtype"]), list(t["shape"]),
                              bytes.fromhex(t["digest"])) for t in v]
        elif k == "extra":
            v = expand_pairs(v)
        else:
            v = expand_str(v)
        if not hasattr(b, k):
            raise KeyError(f"unknown binding field {k}")
        setattr(b, k, v)
    p = case.get("provenance")
    prov = Provenance() if p is None else Provenance(
        expand_str(p["runtime"]), expand_str(p["version"]), p["threads"], expand_pairs(p["notes"]))
    return b, prov, case.get("records", [])


def expected(case, version=2):
    """Whether a writer of container ``version`` must accept ``case``."""
    e = case.get("expect_v1", case["expect"]) if version == 1 else case["expect"]
    return e == "accept"


def run_case(case, out, version=2):
    """Writes one case to ``out``; returns ``{"name", "accepted", "root", "error"}``.
    Only ValueError counts as a refusal; any other exception is a writer bug."""
    b, prov, records = build(case)
    try:
        with TraceWriter(out, b, prov, format_version=version) as w:
            for r in records:
                c = Coord.make(r["step"], r["position"], r["phase"], r["layer"], r["path"])
                w.append(c, r["level"], bytes.fromhex(r["data_hex"]), r["dtype"], r["shape"],
                         r["keep_payload"])
            s = w.finish()
    except ValueError as e:
        return {"name": case["name"], "accepted": False, "root": None, "error": str(e)[:300]}
    return {"name": case["name"], "accepted": True, "root": s.root.hex(), "error": None}


def load(corpus):
    """The corpus document."""
    with open(corpus, encoding="utf-8") as f:
        return json.load(f)


def run_all(corpus, outdir, version=2):
    """Runs every case of ``corpus`` into ``outdir/caseNNN.bin`` in container ``version``."""
    cases = load(corpus)["cases"]
    return [run_case(c, os.path.join(outdir, f"case{i:03}.bin"), version) for i, c in enumerate(cases)]


if __name__ == "__main__":
    json.dump(run_all(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2), sys.stdout)
