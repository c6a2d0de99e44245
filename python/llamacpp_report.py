"""Opt-in: llama.cpp (llama-cpp-python 0.3.36, architecture deepseek4) against the reference
runtime on the quantized fixture ``builtin:tiny-v4-fp8`` (FP8 dense, MXFP4 experts; within
llama.cpp's loader constraints), measured end to end. Prints every number of
docs/interop-llamacpp.md section 4.

    python3 python/llamacpp_report.py [--moeconf target/release/moeconf] [--out DIR] [--steps 8,40]

1. ``moeconf export gguf`` in f32, bf16 and native (MXFP4 experts) types, each verified bit for
   bit against the checkpoint (the reference's values);
2. ``moeconf run`` in the f32, bf16 and official profiles (official skipped, and said so, on a
   build without it; ``--types``/``--profiles`` restrict the run), 8 and
   40 new tokens, ``--capture all``, on fixtures/prompts/llamacpp.txt (124 tokens: an HCA window
   of 128 closes at decode step 4);
3. ``python -m moeconf llamacpp`` (``moeconf.llamacpp.capture``, 1 thread, llama.cpp's default
   KV cache type and flash-attention setting) of each GGUF, the tokenization checked against the
   reference's ids and the logits against a run without the callback;
4. per pair: ``moeconf diff`` (first divergence, partial coverage), token agreement,
   ``moeconf explain`` (the candidate's combine rule), ``moeconf replay`` (per-layer origins under
   the candidate's rule and under ``c``), ``moeconf replay --teacher-force`` (KL per step),
   ``moeconf gate --profile interop`` (policy: docs/interop.md section 5);
5. llama.cpp against itself: 1 vs 2 threads with flash attention auto and off;
6. per pair (first steps value only): layer 0's ``attn.hc_pre_weights`` recomputed bit for bit on
   both sides and its difference attributed to causes (``llamacpp_hc_pre.py``, section 4.6), for
   the CPU path this llama.cpp was compiled for.

The numbers depend on the CPU (its model and llama.cpp's code path are printed first).

Needs llama-cpp-python and gguf (python/run_llamacpp.sh installs them); not part of the default CI.
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from interop_words import gate_words, summary_words, tokens_of  # noqa: E402

MODEL = "builtin:tiny-v4-fp8"
PROMPT_FILE = os.path.join(REPO, "fixtures", "prompts", "llamacpp.txt")
TYPES = ("f32", "bf16", "native")
#: Which reference profile each GGUF type is compared with.
PAIRS = (("f32", "f32"), ("bf16", "bf16"), ("native", "bf16"), ("native", "official"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moeconf", default=os.environ.get("MOECONF_BIN") or
                    os.path.join(REPO, "target", "release", "moeconf"))
    ap.add_argument("--out", default=os.path.join(REPO, "target", "llamacpp"))
    ap.add_argument("--steps", default="8,40")
    ap.add_argument("--types", default=",".join(TYPES),
                    help="GGUF types to export and capture (default all; pairs and section 5 need both sides)")
    ap.add_argument("--profiles", default="f32,bf16,official",
                    help="reference profiles to run (default all this build has; bf16 is always run)")
    args = ap.parse_args()
    types = [t for t in TYPES if t in args.types.split(",")]
    wanted = set(args.profiles.split(",")) | {"bf16"}
    steps_list = [int(s) for s in args.steps.split(",")]
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, MOECONF_CACHE_DIR=os.path.join(out, "cache"), NO_COLOR="1")
    import llama_cpp

    def mc(*a, ok=(0,)):
        p = subprocess.run([args.moeconf, *map(str, a)], capture_output=True, text=True, env=env)
        if p.returncode not in ok:
            sys.exit(f"moeconf {' '.join(map(str, a))} exited {p.returncode}:\n{p.stderr}")
        return p

    def py(*a):
        p = subprocess.run([sys.executable, "-m", "moeconf", *map(str, a)], capture_output=True, text=True,
                           env=dict(env, PYTHONPATH=HERE))
        if p.returncode != 0:
            sys.exit(f"python -m moeconf {' '.join(map(str, a))} exited {p.returncode}:\n{p.stderr}")
        return json.loads(p.stdout)

    from importlib.metadata import version

    print(f"versions: llama-cpp-python {llama_cpp.__version__}, gguf {version('gguf')}; "
          f"model {MODEL}; prompt fixtures/prompts/llamacpp.txt")
    import llamacpp_hc_pre

    system_info = llama_cpp.llama_print_system_info().decode().strip()
    cpu_path = llamacpp_hc_pre.cpu_path(system_info)
    print(f"CPU: {cpu_model()}; llama.cpp CPU backend: {system_info}; matmul path: {cpu_path or 'not emulated'}")
    report = {}

    # 1. Exports.
    G = {}
    for ty in types:
        G[ty] = os.path.join(out, f"tiny-v4-fp8_{ty}.gguf")
        line = mc("export", "gguf", "--model", MODEL, "--type", ty, "-o", G[ty]).stdout.strip()
        print(f"export {ty}: {line}")
        report[f"export {ty}"] = line
    model_dir = os.path.dirname(glob.glob(os.path.join(out, "cache", "tiny-v4-fp8-[0-9]*", "config.json"))[0])

    # 2. References.
    profiles = [p for p in ("f32", "bf16") if p in wanted]
    probe = subprocess.run([args.moeconf, "run", "--model", MODEL, "--prompt", "a", "--max-new-tokens", "1",
                            "--precision", "official", "--capture", "L0", "-o", os.path.join(out, "probe.bin")],
                           capture_output=True, text=True, env=env)
    if probe.returncode == 0 and "official" not in wanted:
        print("reference profile official: available, not requested (--profiles)")
    elif probe.returncode == 0:
        profiles.append("official")
        print("reference profile official: available")
    else:
        print("reference profile official: not in this build (" + probe.stderr.strip().splitlines()[-1] + ")")
    R, ref_tokens = {}, {}
    for n in steps_list:
        for prof in profiles:
            R[prof, n] = os.path.join(out, f"ref_{prof}_{n}.bin")
            t0 = time.time()
            mc("run", "--model", MODEL, "--prompt-file", PROMPT_FILE, "--max-new-tokens", n, "--precision", prof,
               "--capture", "all", "-o", R[prof, n])
            l0 = os.path.join(out, f"ref_{prof}_{n}_l0.bin")
            mc("run", "--model", MODEL, "--prompt-file", PROMPT_FILE, "--max-new-tokens", n, "--precision", prof,
               "--capture", "L0+payload", "-o", l0)
            ref_tokens[prof, n] = tokens_of(l0)
            print(f"reference {prof} {n} tokens: {ref_tokens[prof, n]} ({time.time() - t0:.1f} s)")
    ins = json.loads(mc("inspect", "--format", "json", R["bf16", steps_list[0]]).stdout)
    ids = ins["binding"]["prompt"]["ids"]
    print(f"prompt: {len(ids)} tokens (reference tokenizer)")

    # 3. Captures.
    C, cap = {}, {}
    for n in steps_list:
        for ty in types:
            C[ty, n] = os.path.join(out, f"llamacpp_{ty}_{n}.bin")
            t0 = time.time()
            r = py("llamacpp", G[ty], "--model-dir", model_dir, "--name", MODEL, "--prompt-file", PROMPT_FILE,
                   "--max-new-tokens", n, "-o", C[ty, n], "--reference-ids", ",".join(map(str, ids)))
            cap[ty, n] = r
            print(f"llama.cpp {ty} {n} tokens: {r['generated']} ({r['nodes_read']} nodes read, "
                  f"{time.time() - t0:.1f} s; tokenization checked: {r['tokenization_checked']}; "
                  f"logits equal to an unobserved run: yes)")

    # 4. Pairs.
    policies = {}
    for prof, doc_name in (("interop", "interop.md"), ("llamacpp", "interop-llamacpp.md")):
        doc = open(os.path.join(REPO, "docs", doc_name), encoding="utf-8").read()
        m = re.search(rf"<!-- {prof}-policy:begin -->\s*```toml\n(.*?)```", doc, re.S)
        if not m:
            sys.exit(f"docs/{doc_name}: no {prof}-policy block")
        policies[prof] = os.path.join(out, f"{prof}.toml")
        with open(policies[prof], "w", encoding="utf-8") as f:
            f.write(m.group(1))
    for ty, prof in PAIRS:
        if ty not in types or (prof != "official" and prof not in profiles):
            continue
        if prof not in profiles:
            print(f"\n== llama.cpp {ty} vs reference {prof}: n/a (no {prof} profile in this build)")
            continue
        for n in steps_list:
            name = f"llama.cpp {ty} vs reference {prof}, {n} tokens"
            print(f"\n== {name}")
            d = mc("diff", "--format", "json", R[prof, n], C[ty, n], ok=(0, 1))
            j = json.loads(d.stdout)
            fd = j["first_divergence"]
            print(f"  diff: exit {d.returncode}; first divergence {fd['level']} step {fd['step']} pos {fd['position']} "
                  f"layer {fd['layer']} {fd['operator']} ({fd['kind']})")
            print(f"  summary: {j['summary']}")
            if j["divergences"]:
                dv = j["divergences"][0]
                c = dv.get("comparison") or {}
                if c.get("kind") == "float":
                    print(f"  headline values: {c['differing']}/{c['elements']} differ, max |d| {c['max_abs_delta']:.3e}")
                if dv.get("coverage"):
                    print("  coverage: " + "; ".join(f"{x['record']} missing in {x['missing_in']}"
                                                     for x in dv["coverage"]["needed"]))
            route = j["levels"]["L3"].get("route")
            if route:
                at = route["at"]
                print(f"  first route difference: step {at['step']} pos {at['position']} layer {at['layer']}: "
                      f"{route.get('reference_experts')} -> {route.get('candidate_experts')} "
                      f"(reference margin {route.get('reference_margin')})")
            rt, ct = ref_tokens[prof, n], cap[ty, n]["generated"]
            agree = sum(1 for a, b in zip(rt, ct) if a == b)
            first = next((i for i, (a, b) in enumerate(zip(rt, ct)) if a != b), None)
            print(f"  tokens: {agree}/{n} equal; first different generated token: "
                  f"{'none' if first is None else first + 1} (reference {rt}, llama.cpp {ct})")
            report[name] = {"diff": j["summary"], "first": fd, "tokens_equal": agree}
            for gp, gpath in policies.items():
                g = mc("gate", "--policy", gpath, "--profile", gp, "--format", "json", R[prof, n], C[ty, n],
                       ok=(0, 1))
                gj = json.loads(g.stdout)
                levels = ", ".join(f"{lv['level']} {lv['status']} ({lv['failed']} failed)" for lv in gj["levels"])
                print(f"  gate --profile {gp}: exit {g.returncode} ({gate_words(gj)}); levels: {levels}")
                report[name][f"gate {gp}"] = g.returncode
            if n != steps_list[0]:
                continue
            print_hc_pre(G[ty], R[prof, n], C[ty, n], cpu_path)
            e = json.loads(mc("explain", "--format", "json", C[ty, n]).stdout)["verdict"]
            print(f"  explain (candidate): {e['headline']}")
            member = e["rule"] or "c"
            # The official profile's own combine is DeepSeek's (docs/operators.md section 10.5).
            contracts = (member, "c") + (("c+shared=last+order=asc-id",) if prof == "official" else ())
            for contract in dict.fromkeys(contracts):
                rp = mc("replay", C[ty, n], "--precision", prof, "--contract",
                        contract, "--model", model_dir, "--allow-incomplete", "--format", "json", ok=(0, 1))
                rj = json.loads(rp.stdout)
                firsts = {}
                for u in rj["origins"]:
                    k = f"{u['part']}:{u['first_difference']['record']}"
                    firsts[k] = firsts.get(k, 0) + 1
                absorbed = sum(1 for u in rj["origins"] if u["part"] == "ffn" and u["absorbed"])
                ffn = sum(1 for u in rj["origins"] if u["part"] == "ffn")
                print(f"  replay --contract {contract}: {summary_words(rj['summary'])}; first differing records "
                      f"{firsts}; FFN outputs reproduced (origin absorbed) {absorbed}/{ffn}")
            # Under the candidate's combine rule; the official profile also under its own (DeepSeek's).
            for contract in dict.fromkeys((member,) + (("c+shared=last+order=asc-id",) if prof == "official" else ())):
                tf = json.loads(mc("replay", "--teacher-force", C[ty, n], "--precision",
                                   prof, "--contract", contract, "--model", model_dir,
                                   "--format", "json", ok=(0, 1)).stdout)
                kl = " ".join(f"{s['kl']:.2e}" for s in tf["steps"])
                s = tf["summary"]
                print(f"  teacher-forced KL per step (--contract {contract}): {kl}; argmax agree "
                      f"{s['argmax_agree']}/{s['steps']}, max KL {s['max_kl']:.3e} at step {s['max_kl_step']}")

    # 5. llama.cpp against itself.
    n = steps_list[0]
    for a, b in (("f32", "bf16"), ("bf16", "native")):
        if a not in types or b not in types:
            continue
        d = mc("diff", C[a, n], C[b, n], ok=(0, 1))
        last = [x for x in d.stdout.splitlines() if x.startswith(("first divergence", "equivalent"))]
        loc = [x.strip() for x in d.stdout.splitlines() if x.strip().startswith(("localized operator", "inputs:"))]
        print(f"\n== llama.cpp {a} GGUF vs llama.cpp {b} GGUF, {n} tokens: exit {d.returncode}; {last[-1] if last else ''}")
        for x in loc[:2]:
            print(f"  {x}")
    T = {}
    for fa in ("auto", "off") if "native" in types else ():
        if fa == "auto":
            print("\n== llama.cpp against itself (native GGUF, 3 tokens)")
        for th in (1, 2):
            T[fa, th] = os.path.join(out, f"self_{fa}_{th}.bin")
            py("llamacpp", G["native"], "--model-dir", model_dir, "--name", MODEL, "--prompt-file", PROMPT_FILE,
               "--max-new-tokens", 3, "-o", T[fa, th], "--threads", th, "--flash-attn", fa, "--levels", "L0,L1,L3,L4")
        d = mc("diff", T[fa, 1], T[fa, 2], ok=(0, 1))
        last = [x for x in d.stdout.splitlines() if x.startswith(("first divergence", "equivalent"))]
        print(f"  flash attention {fa}: 1 vs 2 threads: exit {d.returncode}; {last[-1] if last else ''}")
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)


def cpu_model():
    """The CPU's model name (/proc/cpuinfo) and the x86 features that pick llama.cpp's kernels."""
    try:
        info = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return "unknown"
    name = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    fms = [re.search(rf"^{k}\s*:\s*(\S+)$", info, re.M) for k in ("cpu family", "model", "stepping")]
    fms = "family {} model {} stepping {}".format(*(m.group(1) if m else "?" for m in fms))
    flags = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    have = set(flags.group(1).split()) if flags else set()
    feats = [f for f in ("avx2", "fma", "avx512f") if f in have]
    return (f"{name.group(1).strip() if name else 'unknown'} ({fms}; {os.cpu_count()} cores; "
            f"{' '.join(feats) or 'no AVX2'})")


def print_hc_pre(gguf_path, ref, cand, cpu_path):
    """Section 4.6: layer 0's attn.hc_pre_weights recomputed on both sides, causes attributed."""
    import llamacpp_hc_pre as h

    if cpu_path is None:
        print("  mHC pre weights recomputation: n/a (llama.cpp's matmul path is not emulated)")
        return
    r = h.analyse(gguf_path, ref, cand, cpu_path)
    rec = r["recomputed"]
    ref_ok = next(v for k, v in rec.items() if k.startswith("reference"))["matches_trace"]
    lc_ok = rec[f"llama.cpp prefill {cpu_path}"]["matches_trace"]
    tk = r["tokens"]
    words = lambda ok: "bit for bit" if ok else "NOT reproduced"
    print(f"  layer 0 attn.hc_pre_weights, step 0 pos 0, recomputed ({cpu_path} path): reference {words(ref_ok)}, "
          f"llama.cpp {words(lc_ok)}; llama.cpp - reference = {r['traces_ulps']} ulps; every shared token: "
          + ", ".join(f"{k} {tk[k][1]}/{tk[k][0]}" for k in ("reference", "llama.cpp prefill", "llama.cpp decode")
                      if tk[k][0]))
    per = "; ".join(f"pre[{v['value']}] {v['ulps']:+d}: " + (" or ".join("{" + ", ".join(m) + "}"
                                                                       for m in v["minimal_causes"]) or "equal")
                    for v in r["reference_to_llamacpp"]["per_value"])
    print(f"    smallest cause sets giving llama.cpp's value: {per}")
    ct = r["causes_over_tokens"]
    print(f"    over the {ct['tokens']} prompt tokens: {ct['differing']}/{ct['values']} values differ; per cause "
          f"alone/needed: " + ", ".join(f"{g} {ct['alone'][g]}/{ct['needed'][g]}" for g in ct["alone"]))


if __name__ == "__main__":
    main()
