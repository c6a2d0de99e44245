"""Opt-in: every experts implementation transformers 5.23.0 runs on CPU for DeepSeek-V4
(eager, grouped_mm, batched_mm), in fp32 and bf16, captured with ``moeconf.capture`` on the
built-in tiny fixture, then ``moeconf diff`` of the reference runtime against each capture and
of each implementation against the others, explain and replay of each capture (docs/interop.md
sections 4.5-4.6).

    python3 python/interop_experts.py [--moeconf target/release/moeconf] [--out DIR] [--steps 3]

Prints, per capture, the capture's own diagnostic (which summation of the recomputed terms
reproduces the observed ``moe.routed``), and per diff the exit code, the summary line, what the
walk passed (storage precision, one-sided records) and the headline's inputs; then per capture
``moeconf explain`` (the trace's rule) and ``moeconf replay --precision P --contract X`` under that
rule and under ``c`` (per-layer origins; FFN halves whose output is still reproduced). Needs torch and
transformers; not part of the default CI run (python/run_interop.sh runs it).

Every count this prints depends on torch's CPU kernels (ATen's, oneDNN's bf16 GEMMs, MKL's fp32
GEMMs), so it is a per-CPU measurement (docs/interop.md names the CPU of each). What holds on any
CPU is structural; :func:`diff_structure`, :func:`absorbed_by_own_rules` and the tables below state
it, and python/tests/test_capture.py asserts it.
"""

import argparse
import glob
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

PROMPT = "why the sheep"
IMPLS = ("eager", "grouped_mm", "batched_mm")
PRECS = ("f32", "bf16")

#: The member of the combine grammar each implementation computes, established from transformers'
#: source (modeling L1065, integrations/moe.py L175 and L524; contract/src/backends.rs
#: KNOWN_BACKENDS cites the lines) and checked bitwise in the project's notes. Independent of the CPU.
SOURCE_CONTRACT = {
    ("eager", "bf16"): "b+order=asc-id",              # BF16 index_add_ per expert, ascending id; R(a + s)
    ("grouped_mm", "bf16"): "c+routed=bf16",          # FP32 sum in slot order, R(R(a) + s)
    ("batched_mm", "bf16"): "c+routed=bf16",
    ("eager", "f32"): "p32+output=f32+order=asc-id",  # FP32 in ascending id, a + s unrounded
    ("grouped_mm", "f32"): "p32+output=f32",          # FP32 in slot order, a + s unrounded
    ("batched_mm", "f32"): "p32+output=f32",
}
#: The member the reference runtime computes (`native`: C in router slot order) in both profiles.
REFERENCE_CONTRACT = "c"
#: The summation of the capture's diagnostic (index into moeconf.capture.ROUTED_SUMS) that the
#: source says each implementation performs: eager index_add_s per expert in the model dtype in
#: ascending expert id, grouped_mm and batched_mm sum in FP32 in router slot order.
SOURCE_ROUTED_SUM = {("eager", "f32"): 2, ("eager", "bf16"): 2, ("grouped_mm", "f32"): 0,
                     ("grouped_mm", "bf16"): 0, ("batched_mm", "f32"): 0, ("batched_mm", "bf16"): 0}


def r_bf16(x):
    """R_BF16: round to nearest, ties to even, of f32 values to bf16 (kept as f32; finite values)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


#: The BF16-output members above, as the grammar defines them (docs/contracts.md "The combine
#: grammar"): BF16 operands, zero start, sequential, shared expert merged separately.
#: (accumulator, order, routed sum rounded to BF16 before the merge)
_BF16_MEMBERS = {"c": ("f32", "slot", False), "b+order=asc-id": ("bf16", "asc-id", False),
                 "c+routed=bf16": ("f32", "slot", True)}


def combine(member, terms, experts, shared):
    """One combine event under ``member`` (one of the BF16-output members above), in numpy: an
    oracle independent of the Rust grammar, for the counterfactual of :func:`absorbed_by_own_rules`."""
    acc_dtype, order, routed_bf16 = _BF16_MEMBERS[member]
    slots = range(len(terms)) if order == "slot" else sorted(range(len(terms)), key=lambda j: experts[j])
    a = np.zeros_like(np.asarray(terms[0], np.float32))
    for j in slots:
        a = (a + r_bf16(terms[j])).astype(np.float32)
        if acc_dtype == "bf16":
            a = r_bf16(a)
    if routed_bf16:
        a = r_bf16(a)
    return r_bf16((a + np.asarray(shared, np.float32)).astype(np.float32))


def moe_event(trace, step, position, layer):
    """The combine event of ``trace`` (a moeconf.read_trace result) at (step, position, layer):
    ``{"terms": [...], "experts": [...], "shared": ..., "combine": ...}``, or None."""
    got = {}
    for i, r in enumerate(trace.records):
        c = r.coord
        if (c.step, c.position, c.layer) == (step, position, layer) and c.path.startswith(("moe.", "router.topk")):
            got[c.path] = trace.array(i)
    if "moe.combine" not in got or "router.topk" not in got:
        return None
    k = len(got["router.topk"])
    return {"terms": [got[f"moe.term.{j}"] for j in range(k)], "experts": got["router.topk"].tolist(),
            "shared": got["moe.shared"], "combine": got["moe.combine"]}


def absorbed_by_own_rules(ref_event, cand_event, ref_member, cand_member):
    """Whether the term differences of one combine event are absorbed by each side's own rule
    (docs/diff.md "Counterfactual absorption"): each side's member on the *other* side's terms and
    shared output gives that side's own combine, bit for bit. Returns (reference side, candidate
    side, each member on its own side's terms)."""
    same_route = ref_event["experts"] == cand_event["experts"]
    ok = lambda m, e, out: same_route and np.array_equal(combine(m, e["terms"], e["experts"], e["shared"]), out)
    return (ok(ref_member, cand_event, ref_event["combine"]), ok(cand_member, ref_event, cand_event["combine"]),
            ok(ref_member, ref_event, ref_event["combine"]) and ok(cand_member, cand_event, cand_event["combine"]))


def _where(x):
    return (x["step"], x["position"], x["layer"])


def acausal_claims(j):
    """Divergences of one diff JSON classified as propagating to a checkpoint at an earlier step,
    or at an earlier position of the same step: a position never reaches an earlier one
    (docs/diff.md "Causality"). Should be empty."""
    bad = []
    for d in j["divergences"]:
        at, cp = d["at"], d["checkpoint"]
        if d["kind"] != "propagating" or not cp:
            continue
        if cp["step"] < at["step"] or (cp["step"] == at["step"] and cp["position"] is not None
                                       and at["position"] is not None and cp["position"] < at["position"]):
            bad.append(f"{at['path']} {_where(at)} -> {cp['path']} {_where(cp)}")
    return bad


def diff_structure(j):
    """What one ``moeconf diff --format json`` says, reduced to what can hold on any CPU: the first
    divergence (step, position, layer, operator, kind), whether the walk reaches ``moe.combine``
    at that event and which contract it names on each side there, and any acausal claim."""
    fd = j["first_divergence"]
    if fd is None:
        return {"first": None, "combine_reached": False, "contracts": None, "acausal": acausal_claims(j)}
    first = (fd["step"], fd["position"], fd["layer"], fd["operator"], fd["kind"])
    reached = any(d["at"]["path"] == "moe.combine" and _where(d["at"]) == first[:3] for d in j["divergences"])
    c = j["levels"]["L4"].get("contract")
    contracts = None
    if c and c["at"]["path"] == "moe.combine" and _where(c["at"]) == first[:3]:
        re_, ce = c["reference_explanation"] or {}, c["candidate_explanation"] or {}
        contracts = (re_.get("simplest") if re_.get("status") == "explained" else None,
                     ce.get("simplest") if ce.get("status") == "explained" else None)
    return {"first": first, "combine_reached": reached, "contracts": contracts, "acausal": acausal_claims(j)}


def members(expl):
    """Every member an explanation (diff) or verdict (explain) names: the simplest and its equivalents."""
    return {expl.get("simplest") or expl.get("rule"), *(e["contract"] for e in expl["equivalents"])}


#: Environment variables that select torch's CPU code paths (docs/interop.md "Per CPU"):
#: ATen's kernels, oneDNN's (bf16 GEMMs) and MKL's (fp32 GEMMs).
CPU_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cpu_model():
    """The CPU's model name (/proc/cpuinfo on Linux) and its AVX-512 / AMX flags."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or "unknown"
    name = next((x.split(":", 1)[1].strip() for x in info.splitlines() if x.startswith("model name")), "unknown")
    flags = next((x.split(":", 1)[1].split() for x in info.splitlines() if x.startswith("flags")), [])
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(simd) or 'no AVX2'})"


def describe(j):
    """The lines of one diff's JSON this report keeps."""
    out = [f"    summary: {j['summary']}"]
    for g in j["storage_precision"]:
        out.append(f"    storage precision: {g['component']}: {g['coarser']} stores {g['coarse_storage']}, "
                   f"{g['rounding']}: {g['values']} values in {g['records']} records "
                   f"({g['rounded_values']} changed by the rounding)")
    if j["one_side_only"]:
        out.append("    one side only: " + ", ".join(f"{g['component']} ({g['present_in']}, {g['records']})"
                                                     for g in j["one_side_only"]))
    if j["divergences"]:
        d = j["divergences"][0]
        ins = ", ".join(f"{i['input']}={i['status']}" + (f" [recomputed: {i['recomputed']}]" if i["recomputed"]
                                                         else "") for i in d["inputs"])
        out.append(f"    headline inputs: {ins}")
        b = d.get("beyond_storage_precision")
        if b:
            out.append(f"    beyond storage precision: {b['coarser']} holds bf16 values; after R_BF16 of the other "
                       f"side {b['differing_values']}/{b['values']} values still differ")
        c = d.get("comparison") or {}
        if c.get("kind") == "float":
            out.append(f"    headline values: {c['differing']}/{c['elements']} differ, max |d| {c['max_abs_delta']}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moeconf", default=os.environ.get("MOECONF_BIN") or
                    os.path.join(REPO, "target", "release", "moeconf"))
    ap.add_argument("--out", default=os.path.join(REPO, "target", "interop", "experts"))
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    from moeconf import read_trace
    from moeconf.capture import capture

    def prec_of(side):
        return side[1]

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, MOECONF_CACHE_DIR=os.path.join(out, "cache"), NO_COLOR="1")

    def mc(*a, check=True):
        p = subprocess.run([args.moeconf, *map(str, a)], capture_output=True, text=True, env=env)
        if check and p.returncode != 0:
            sys.exit(f"moeconf {' '.join(map(str, a))} exited {p.returncode}:\n{p.stderr}")
        return p

    print(f"versions: torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{args.steps} new tokens, prompt {PROMPT!r}, 1 thread")
    print(f"CPU: {cpu_model()}; torch capability {torch.backends.cpu.get_cpu_capability()}; "
          + ", ".join(f"{v}={os.environ[v]}" for v in CPU_ENV if v in os.environ))
    T = {}
    for prec in PRECS:
        T["ref", prec] = os.path.join(out, f"ref_{prec}.bin")
        mc("run", "--model", "builtin:tiny-v4", "--prompt", PROMPT, "--max-new-tokens", args.steps,
           "--precision", prec, "--capture", "all", "-o", T["ref", prec])
    model_dir = os.path.dirname(glob.glob(os.path.join(out, "cache", "*", "config.json"))[0])
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    torch.set_num_threads(1)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    for prec in PRECS:
        for impl in IMPLS:
            model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=dtypes[prec],
                                                          experts_implementation=impl).eval()
            assert model.config._experts_implementation == impl, model.get_experts_implementation()
            T[impl, prec] = os.path.join(out, f"hf_{impl}_{prec}.bin")
            res = capture(model, tok, PROMPT, args.steps, T[impl, prec], model_name="builtin:tiny-v4")
            print(f"capture {impl} {prec}: tokens {res.generated}; {res.moe_events} MoE events; recomputed terms "
                  f"reproduce the observed moe.routed: "
                  + "; ".join(f"{n}: {c}" for n, c in res.moe_routed_reproduced.items())
                  + f"; none: {res.moe_terms_unexplained}")
    pairs = [(("ref", p), (i, p)) for p in PRECS for i in IMPLS]
    pairs += [((a, p), (b, p)) for p in PRECS for n, a in enumerate(IMPLS) for b in IMPLS[n + 1:]]
    report = {}
    for ra, ca in pairs:
        d = mc("diff", "--format", "json", T[ra], T[ca], check=False)
        if d.returncode not in (0, 1):
            sys.exit(f"diff {ra} {ca}: exit {d.returncode}: {d.stderr}")
        j = json.loads(d.stdout)
        name = f"{ra[0]} vs {ca[0]} ({ra[1]})"
        report[name] = j
        print(f"{name}: exit {d.returncode}")
        for line in describe(j):
            print(line)
        st = diff_structure(j)
        print(f"    structure: first divergence {st['first']}; moe.combine reached at that event: "
              f"{'yes' if st['combine_reached'] else 'no'}; contracts named there (reference / candidate): "
              f"{st['contracts'] or 'none'}; acausal propagating claims: {st['acausal'] or 'none'}")
        if ra[0] == "ref" and st["first"] and st["first"][3].startswith("moe.") and prec_of(ra) == "bf16":
            fd = st["first"]
            rev = moe_event(read_trace(T[ra]), *fd[:3])
            cev = moe_event(read_trace(T[ca]), *fd[:3])
            r_ok, c_ok, own = absorbed_by_own_rules(rev, cev, REFERENCE_CONTRACT, SOURCE_CONTRACT[ca])
            print(f"    oracle at {fd[:3]} (numpy): {REFERENCE_CONTRACT} on the candidate's terms gives the reference's "
                  f"combine: {r_ok}; {SOURCE_CONTRACT[ca]} on the reference's terms gives the candidate's: {c_ok} "
                  f"(each on its own terms: {own}) -> the term differences are "
                  f"{'absorbed by both own rules: the diff should reach moe.combine' if r_ok and c_ok else 'not absorbed'}")
    with open(os.path.join(out, "diffs.json"), "w") as f:
        json.dump(report, f, indent=1)
    for prec in PRECS:
        for impl in IMPLS:
            e = json.loads(mc("explain", "--format", "json", T[impl, prec]).stdout)["verdict"]
            src = SOURCE_CONTRACT[impl, prec]
            print(f"explain {impl} {prec}: {e['headline']}; {len(e['equivalents'])} equivalents on this trace; "
                  f"the source's member {src}: " + ("the rule" if e["rule"] == src else
                                                    "an equivalent" if src in members(e) else "NOT NAMED"))
            report[f"explain {impl} {prec}"] = e
            member = e["rule"] or "c"
            for contract in dict.fromkeys((member, "c")):
                r = mc("replay", T[impl, prec], "--precision", prec, "--contract", contract, "--model", model_dir,
                       "--allow-incomplete", "--format", "json", check=False)
                if r.returncode not in (0, 1):
                    sys.exit(f"replay {impl} {prec}: exit {r.returncode}: {r.stderr}")
                j = json.loads(r.stdout)
                ffn = [u for u in j["origins"] if u["part"] == "ffn"]
                firsts = {}
                for u in j["origins"]:
                    k = f"{u['part']}:{u['first_difference']['record']}"
                    firsts[k] = firsts.get(k, 0) + 1
                per_layer = {}
                for u in ffn:
                    a, b = per_layer.get(u["layer"], (0, 0))
                    per_layer[u["layer"]] = (a + u["absorbed"], b + 1)
                print(f"replay {impl} {prec} --contract {contract}: exit {r.returncode}; {j['summary']}; "
                      f"FFN outputs reproduced (origin absorbed) {sum(u['absorbed'] for u in ffn)}/{len(ffn)}; "
                      f"first differing records {firsts}; per layer absorbed/FFN origins "
                      + " ".join(f"L{k}:{a}/{b}" for k, (a, b) in sorted(per_layer.items())))
                report[f"replay {impl} {prec} {contract}"] = j["summary"]
    with open(os.path.join(out, "explain_replay.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
