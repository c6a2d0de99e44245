"""Decode speed of the reference runtime against Hugging Face transformers on the built-in
fixture, both measured in this one run (docs/performance.md, "Against transformers").

    python3 python/bench_transformers.py [--moeconf target/release/moeconf] [--tokens 200]

transformers: ``DeepseekV4ForCausalLM`` in fp32 with the ``grouped_mm`` experts
implementation, ``torch.set_num_threads(1)``, greedy ``generate`` of N new tokens after a
warm-up; the decode time is taken from the first to the last decode forward (a logits
processor stamps the time after every forward), so the prefill is excluded.
moeconf: ``moeconf bench runtime`` with ``RAYON_NUM_THREADS=1`` (the same fixture checkpoint,
materialized into this run's cache directory, the same prompt ids, N decode steps; bf16
profile; without capture and with the default trace capture, whose writer runs on its own
thread). The two sides alternate, best of ``--repeat`` each, so that machine load affects
both alike. Prints the tokens/s of each and the ratios. Needs torch and transformers (the
pinned versions: python/run_bench_transformers.sh installs them).
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def moeconf_bench(args, env):
    """One `moeconf bench runtime` run (1 rayon thread); its JSON report."""
    cmd = [args.moeconf, "bench", "runtime", "--format", "json", "--repeat", "1",
           "--decode-tokens", str(args.tokens), "--prompt-tokens", str(args.prompt_tokens)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, RAYON_NUM_THREADS="1"))
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr}")
    return json.loads(p.stdout)


def row(report, precision, capture):
    """The decode tokens/s of one (precision, capture) row of a bench report."""
    for r in report["rows"]:
        if r["precision"] == precision and r["capture"] == capture:
            return r["decode_tokens_per_second"]
    sys.exit(f"no {precision}/{capture} row in the moeconf report")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moeconf", default=os.environ.get("MOECONF_BIN") or
                    os.path.join(REPO, "target", "release", "moeconf"))
    ap.add_argument("--out", default=os.path.join(REPO, "target", "bench-transformers"))
    ap.add_argument("--tokens", type=int, default=200, help="decode steps per measurement")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="alternating measurements per side (best kept)")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import DeepseekV4ForCausalLM, LogitsProcessor, LogitsProcessorList

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, MOECONF_CACHE_DIR=os.path.join(out, "cache"), NO_COLOR="1")
    # The first bench run materializes the fixture into the cache; transformers loads that directory.
    first = moeconf_bench(args, env)
    model_dir = os.path.dirname(glob.glob(os.path.join(out, "cache", "*", "config.json"))[0])

    torch.set_num_threads(1)
    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                  experts_implementation="grouped_mm").eval()
    impl = getattr(model.config, "_experts_implementation", None)
    if impl != "grouped_mm":
        sys.exit(f"transformers chose the experts implementation {impl!r}, not grouped_mm")
    vocab = model.config.vocab_size
    # The prompt of `moeconf bench runtime`: id i = (37 i + 5) mod V.
    prompt = torch.tensor([[(i * 37 + 5) % vocab for i in range(args.prompt_tokens)]])

    class Stamp(LogitsProcessor):
        """Records the time after every forward (generate calls it once per step)."""

        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    def hf_decode(n):
        stamp = Stamp()
        with torch.inference_mode():
            g = model.generate(prompt, max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False,
                               logits_processor=LogitsProcessorList([stamp]), pad_token_id=0)
        assert g.shape[1] == prompt.shape[1] + n + 1, g.shape
        # stamp.t[0] follows the prefill forward, stamp.t[n] the n-th decode forward.
        return n / (stamp.t[n] - stamp.t[0])

    hf_decode(8)  # warm-up
    hf, ref_none, ref_default = [], [row(first, "bf16", "none")], [row(first, "bf16", "default")]
    for _ in range(args.repeat):
        hf.append(hf_decode(args.tokens))
        r = moeconf_bench(args, env)
        ref_none.append(row(r, "bf16", "none"))
        ref_default.append(row(r, "bf16", "default"))
    hf_best, none_best, default_best = max(hf), max(ref_none), max(ref_default)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"versions: torch {torch.__version__}, transformers {transformers.__version__}; "
          f"fixture {model_dir}; load average {load:.1f}")
    print(f"decode of {args.tokens} tokens after a {args.prompt_tokens}-token prompt, best of {args.repeat} "
          f"(alternating), 1 thread:")
    print(f"  transformers fp32, grouped_mm      {hf_best:9.1f} tok/s   (all: {', '.join(f'{x:.1f}' for x in hf)})")
    print(f"  moeconf bf16, no capture           {none_best:9.1f} tok/s   "
          f"(all: {', '.join(f'{x:.1f}' for x in ref_none)})")
    print(f"  moeconf bf16, default capture      {default_best:9.1f} tok/s   "
          f"(all: {', '.join(f'{x:.1f}' for x in ref_default)})")
    print(f"  ratio moeconf (default capture) / transformers: {default_best / hf_best:.1f}x")
    print(f"  ratio moeconf (no capture) / transformers:      {none_best / hf_best:.1f}x")
    print(f"  capture: default / no capture = {default_best / none_best:.2f}")


if __name__ == "__main__":
    main()
