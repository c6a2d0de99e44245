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

PROMPT = "why the sheep"
IMPLS = ("eager", "grouped_mm", "batched_mm")
PRECS = ("f32", "bf16")


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

    from moeconf.capture import capture

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
    with open(os.path.join(out, "diffs.json"), "w") as f:
        json.dump(report, f, indent=1)
    for prec in PRECS:
        for impl in IMPLS:
            e = json.loads(mc("explain", "--format", "json", T[impl, prec]).stdout)["verdict"]
            print(f"explain {impl} {prec}: {e['headline']}; {len(e['equivalents'])} equivalents on this trace")
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
