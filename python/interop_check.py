"""Cross-backend check (docs/interop.md): the Rust reference runtime against Hugging Face
transformers on the built-in tiny DeepSeek-V4 fixture, in both precision profiles.

    python3 python/interop_check.py [--moeconf target/release/moeconf] [--out interop-out]

Materializes the fixture (a DeepSeek original-names checkpoint), runs the reference
(`moeconf run --precision f32|bf16 --capture all`) and transformers with
`moeconf.capture` (fp32 and bf16, 1 thread), saves the transformers model back in
original names (`moeconf.capture.save_original`) and runs the reference on that too,
then prints `moeconf diff` / `moeconf gate` (policy from docs/interop.md) and a per-layer
summary: tokens, routes (same set / same order / set flips with the reference margin),
gate weights, post-FFN state error, logits and LM margins. Needs torch and transformers.
"""

import argparse
import glob
import os
import re
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from moeconf import read_trace  # noqa: E402

PROMPT = "why the sheep"
STEPS = 8


def key(r):
    """Pairing key of a record (as `moeconf diff` pairs them)."""
    return (r.coord.step, r.level, r.coord.layer, r.coord.position, r.coord.phase, r.coord.path)


def r_bf16(x):
    """R_BF16: round-to-nearest-even of f32 values to bf16 (kept as f32)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def summarize(ref_path, cand_path, k):
    """Prints the measured agreement of two traces (reference first)."""
    a, b = read_trace(ref_path), read_trace(cand_path)
    ia = {key(r): i for i, r in enumerate(a.records)}
    ib = {key(r): i for i, r in enumerate(b.records)}
    keys = [x for x in ia if x in ib]
    first = next((r for r in a.records if key(r) in ib and b.records[ib[key(r)]].digest != r.digest), None)
    print(f"  records {len(ia)} / {len(ib)}, paired {len(keys)}; first bitwise difference (reference order): "
          f"{first.coord} L{first.level}" if first else "  identical")
    per = {}
    for x in keys:
        n, d = per.get(x[1], (0, 0))
        per[x[1]] = (n + 1, d + (a.records[ia[x]].digest != b.records[ib[x]].digest))
    print("  bitwise-differing records:", ", ".join(f"L{lv} {d}/{n}" for lv, (n, d) in sorted(per.items())))

    def toks(t, m):
        return [int(t.array(m[x])[0]) for x in sorted(x for x in m if x[5] == "token.output")]

    ta, tb = toks(a, ia), toks(b, ib)
    comp = 0
    while comp < len(ta) and (comp == 0 or ta[comp - 1] == tb[comp - 1]):
        comp += 1
    print(f"  tokens reference {ta}\n  tokens candidate {tb}: {sum(x == y for x, y in zip(ta, tb))}/{len(ta)} "
          f"equal; steps with identical inputs: 0..{comp - 1}")
    keys = [x for x in keys if x[0] < comp]
    for s in range(comp):
        lk = next(x for x in keys if x[0] == s and x[5] == "lm.logits")
        mk = lk[:5] + ("lm.margin",)
        dl = float(np.abs(a.array(ia[lk]) - b.array(ib[lk])).max())
        print(f"  step {s}: max |d logit| {dl:.3e}, LM margin reference {float(a.array(ia[mk])[0]):.4g} "
              f"candidate {float(b.array(ib[mk])[0]):.4g}")
    layers = sorted({x[2] for x in keys if x[2] is not None})
    print("  layer | routed events | same set | same order | set flips (step, pos, ref margin) | "
          "min ref margin | max |d gate| (same set) | max rel err post_ffn_mhc")
    for lay in layers:
        ev = same = order = 0
        flips, margins, gd, rel = [], [], 0.0, 0.0
        for x in keys:
            if x[2] != lay:
                continue
            if x[5] == "router.topk":
                ev += 1
                ra, rb = a.array(ia[x]).tolist(), b.array(ib[x]).tolist()
                mk = x[:5] + ("router.margin",)
                m = float(a.array(ia[mk])[0]) if mk in ia else None
                if m is not None:
                    margins.append(m)
                if set(ra) == set(rb):
                    same += 1
                    order += ra == rb
                    gk = x[:5] + ("router.gates",)
                    ga = dict(zip(ra, a.array(ia[gk]).tolist()))
                    gb = dict(zip(rb, b.array(ib[gk]).tolist()))
                    gd = max(gd, max(abs(ga[e] - gb[e]) for e in ga))
                else:
                    flips.append((x[0], x[3], None if m is None else float(f"{m:.3g}")))
            elif x[5] == "layer.post_ffn_mhc":
                xa, xb = a.array(ia[x]).astype(np.float64), b.array(ib[x]).astype(np.float64)
                rel = max(rel, float(np.linalg.norm(xa - xb) / np.linalg.norm(xa)))
        mm = f"{min(margins):.3g}" if margins else "- (hash)"
        print(f"  {lay} | {ev} | {same} | {order} | {flips or '-'} | {mm} | {gd:.2e} | {rel:.2e}")
    # the MoE combine at the first event: reference contract C applied to the candidate's own terms
    ev0 = sorted({x[:5] for x in keys if x[5] == "moe.combine"}, key=lambda x: (x[0], x[2], x[3]))[0]
    terms = [b.array(ib[ev0 + (f"moe.term.{j}",)]) for j in range(k)]
    acc = np.zeros_like(terms[0])
    for t in terms:
        acc = (acc + r_bf16(t)).astype(np.float32)
    c = r_bf16((acc + b.array(ib[ev0 + ("moe.shared",)])).astype(np.float32))
    ref_c, cand_c = a.array(ia[ev0 + ("moe.combine",)]), b.array(ib[ev0 + ("moe.combine",)])
    print(f"  first MoE event (step {ev0[0]} layer {ev0[2]} pos {ev0[3]}): max |d combine| "
          f"{float(np.abs(ref_c - cand_c).max()):.3e}; contract C (BF16 terms, FP32 sum, BF16 output) on the "
          f"candidate's terms reproduces the reference bit for bit in {int(np.sum(c == ref_c))}/{c.size} values")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moeconf", default=os.environ.get("MOECONF_BIN") or
                    os.path.join(REPO, "target", "release", "moeconf"))
    ap.add_argument("--out", default="interop-out")
    ap.add_argument("--steps", type=int, default=STEPS, help="new tokens (forward steps); 8 in docs/interop.md "
                    "sections 2-4, 40 in section 4.4 (HCA entries, sparse indexer selection)")
    args = ap.parse_args()
    steps = args.steps

    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    from moeconf.capture import capture, save_original

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, MOECONF_CACHE_DIR=os.path.join(out, "cache"), NO_COLOR="1")

    def mc(*a, check=True):
        p = subprocess.run([args.moeconf, *map(str, a)], capture_output=True, text=True, env=env)
        if check and p.returncode != 0:
            sys.exit(f"moeconf {' '.join(map(str, a))} exited {p.returncode}:\n{p.stderr}")
        return p

    print(f"versions: torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    T = {}
    for prec in ("f32", "bf16"):
        T["ref", prec] = os.path.join(out, f"ref_{prec}.bin")
        mc("run", "--model", "builtin:tiny-v4", "--prompt", PROMPT, "--max-new-tokens", steps,
           "--precision", prec, "--capture", "all", "-o", T["ref", prec])
    model_dir = os.path.dirname(glob.glob(os.path.join(out, "cache", "*", "config.json"))[0])
    print("fixture checkpoint:", model_dir)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    torch.set_num_threads(1)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    for prec in ("f32", "bf16"):
        model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=dtypes[prec]).eval()
        T["hf", prec] = os.path.join(out, f"hf_{prec}.bin")
        res = capture(model, tok, PROMPT, steps, T["hf", prec], model_name="builtin:tiny-v4")
        print(f"transformers {prec}: generated {res.generated}; experts implementation "
              f"{getattr(model.config, '_experts_implementation', None)}; recomputed moe.term.* reproduce the "
              f"observed moe.routed: " + "; ".join(f"{n}: {c}" for n, c in res.moe_routed_reproduced.items())
              + f"; by no checked summation: {res.moe_terms_unexplained} of {res.moe_events} events")

    # transformers -> original names -> reference runtime
    saved = os.path.join(out, "hf_saved_b")
    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    renamed = save_original(model, saved, tokenizer_json=os.path.join(model_dir, "tokenizer.json"))
    print(f"save_original: {len(renamed)} tensors renamed from save_pretrained's names")
    for prec in ("f32", "bf16"):
        p = os.path.join(out, f"ref_saved_{prec}.bin")
        mc("run", "--model", saved, "--prompt", PROMPT, "--max-new-tokens", steps, "--precision", prec,
           "--capture", "all", "-o", p)
        d = mc("diff", "--force", T["ref", prec], p, check=False)
        print(f"reference on the transformers-saved checkpoint vs on the fixture ({prec}), diff --force: "
              f"exit {d.returncode}: {d.stdout.splitlines()[0]}")

    policy = os.path.join(out, "interop.toml")
    doc = open(os.path.join(REPO, "docs", "interop.md"), encoding="utf-8").read()
    m = re.search(r"<!-- interop-policy:begin -->\s*```toml\n(.*?)```", doc, re.S)
    if not m:
        sys.exit("docs/interop.md: no interop-policy block")
    with open(policy, "w", encoding="utf-8") as f:
        f.write(m.group(1))
    k = model.config.num_experts_per_tok
    hf = read_trace(T["hf", "f32"])
    comp = {p: sum(1 for r in hf.records if r.coord.path == p) for p in ("attn.compressed", "attn.indexer_compressed")}
    sparse = sum(1 for i, r in enumerate(hf.records) if r.coord.path == "attn.indexer_topk"
                 and r.shape[0] == model.config.index_topk)
    print(f"features in the transformers fp32 capture: {comp['attn.compressed']} compressed entries, "
          f"{comp['attn.indexer_compressed']} indexer entries, {sparse} indexer selections of the full "
          f"index_topk={model.config.index_topk}")
    for ref, cand in ((("ref", "f32"), ("hf", "f32")), (("ref", "bf16"), ("hf", "bf16")),
                      (("ref", "f32"), ("ref", "bf16")), (("hf", "f32"), ("hf", "bf16"))):
        print(f"\n== {ref[0]}-{ref[1]} (reference) vs {cand[0]}-{cand[1]} (candidate)")
        d = mc("diff", T[ref], T[cand], check=False)
        line = [x for x in d.stdout.splitlines() if x.startswith("first divergence") or x.startswith("EQUIV")]
        print(f"  moeconf diff: exit {d.returncode}; {line[-1] if line else d.stdout.splitlines()[0]}")
        g = mc("gate", "--policy", policy, "--profile", "interop", T[ref], T[cand], check=False)
        print(f"  moeconf gate --profile interop: exit {g.returncode}")
        for x in g.stdout.splitlines():
            if re.match(r"^(L\d |  (FAIL|PASS)|        (first failure|smallest)|FAIL|PASS)", x):
                print("   ", x.strip())
        summarize(T[ref], T[cand], k)


if __name__ == "__main__":
    main()
