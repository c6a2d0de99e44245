"""What the interop report scripts (``llamacpp_report.py``, ``vllm_report.py``)
say of a trace or a gate result, in one place: the generated tokens of a trace
and a gate result or summary in a few words."""


def tokens_of(path):
    """The generated ids of a trace (``token.output`` in step order)."""
    from moeconf.trace import read_trace

    t = read_trace(path, verify=False)
    toks = {}
    for i, r in enumerate(t.records):
        if r.coord.path == "token.output":
            toks[r.coord.step] = int(t.array(i)[0])
    return [toks[s] for s in sorted(toks)]


def gate_words(j):
    """The gate's summary and its first failing rule, briefly."""
    words = j.get("summary", j.get("verdict", ""))
    for r in j.get("rules", []):
        if r.get("status") == "fail" and r.get("first_failure"):
            f = r["first_failure"]
            at = f["at"]
            words += f"; first failure {r['rule']} at step {at['step']} {at['path']}: {f['reason']}"
            break
    return words


def summary_words(s):
    """The scalar fields of a summary object as ``key value, ...``."""
    return ", ".join(f"{k} {v}" for k, v in s.items() if isinstance(v, (int, float, str)))
