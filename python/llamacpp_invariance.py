"""Where llama.cpp's settings change its DeepSeek-V4 computation, recomputed bit for bit from two
captures of the same prompt (docs/invariance.md section 5.1): for each trace, which of llama.cpp's
CPU kernels produced the values it holds at the operators ``moeconf invariance`` finds first.

    python3 python/llamacpp_invariance.py --gguf G.gguf --base BASE.bin --cand CAND.bin [--json]
    python3 python/llamacpp_invariance.py --gguf G.gguf --matrix OUT [--json]   # every configuration

``--matrix`` takes the output directory of ``moeconf invariance python/invariance/llamacpp.toml``
(its ``invariance.json``, ``base.bin`` and ``cNN.bin``). Both traces need payloads (the capture's
default ``--levels all``). The operators, each emulated one IEEE binary32 (or binary16) operation at
a time (``llamacpp_hc_pre.py``'s primitives; paths relative to llama-cpp-python 0.3.36's
``vendor/llama.cpp/``), for the code path llama.cpp was built for (``--cpu-path``; the attention
kernels for AVX-512 with AVX-512-FP16 only). Where the source leaves the compiler a choice (GCC
contracts ``S*ms + vs`` and ``a*b + c*d`` into fused multiply-adds), the emulation takes the choice
that reproduces the captures; the other reproduces fewer values.

* ``mixes``: layer 0's ``attn.hc_pre_weights`` (the mHC mixes ``Phi . rmsnorm(x)``, an F32 x F32
  matmul, then sigmoid) at every token both traces hold with equal inputs. Which matmul kernel
  computes them depends on the number of rows of the ubatch: ``ggml_compute_forward_mul_mat``
  (ggml/src/ggml-cpu/ggml-cpu.c) first offers the product to ``llamafile_sgemm``, which declines a
  single column (ggml/src/ggml-cpu/llamafile/sgemm.cpp: ``n < 2``), so a ubatch of one token takes
  ``ggml_vec_dot_f32`` (4 x 16 lanes, ggml/src/ggml-cpu/vec.cpp) and a ubatch of two or more takes
  ``tinyBLAS<16, __m512>`` (one 16-lane FMA accumulator per output, halving fold).
* ``attention``: the first ``attn.core`` record that differs while its inputs (``attn.q``, the
  keys: the window's ``attn.kv`` rows, the compressed cache, the indexer's selection, all F16 as
  the caches hold them) are equal, recomputed under the three kernels
  ``ggml_compute_forward_flash_attn_ext_f16`` (ggml/src/ggml-cpu/ops.cpp) chooses from: the tiled
  kernel ``ggml_compute_forward_flash_attn_ext_tiled`` when the ubatch has at least
  ``GGML_FA_TILE_Q`` = 64 query rows (ggml/src/ggml-cpu/common.h: Q in F32, scores and V in F32 by
  ``simd_gemm``, ggml/src/ggml-cpu/simd-gemm.h); otherwise
  ``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` (Q rounded to F16, ``ggml_vec_dot_f16``, V
  accumulated in F16), and for a single query over at least 512 cells that kernel on one KV chunk
  per thread, the partial softmaxes combined by ``ggml_flash_attn_ext_reduce_partials`` (the
  split-KV path). Flash attention off runs none of them (``none``).
* ``head``: the output head's mHC pre weights (``build_hc_head``: the same mixes matmul with
  ``output_hc_fn``) at the last prompt position, from layer 8's captured ``layer.post_ffn_mhc``,
  under both matmul kernels: the head runs on the output rows only (``inp_out_ids``), so two
  sequences' last tokens in one ubatch make it a two-row product. Not captured by llama.cpp's
  graph callback (no record), so this says whether the two kernels part there, not which one a
  trace used.

Exit status 1 when a trace's value is reproduced by no emulated kernel where one was expected
(mixes on any emulated path; attention on AVX-512 with flash attention on).
"""

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import llamacpp_hc_pre as H  # noqa: E402

F32 = np.float32


def _trace(path):
    """``{(step, position, layer, path): array}`` of the records the checks read, and the trace."""
    from moeconf.trace import read_trace

    want = {"embed.output", "attn.hc_pre_weights", "attn.q", "attn.kv", "attn.core", "layer.post_ffn_mhc",
            "lm.logits", "attn.indexer_topk", "state.compressor.compressed_kv"}
    t = read_trace(path, verify=False)
    out = {}
    for i, r in enumerate(t.records):
        c = r.coord
        if c.path in want:
            a = t.array(i)
            if a is not None:
                out[c.step, c.position, c.layer, c.path] = a
    return out, t


def _gguf(path):
    import gguf

    r = gguf.GGUFReader(path)
    names = ("blk.0.hc_attn_fn.weight", "blk.0.hc_attn_base.weight", "blk.0.hc_attn_scale.weight",
             "output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight")
    t = {x.name: np.asarray(x.data) for x in r.tensors if x.name in names or x.name.endswith(".attn_sinks.weight")}
    kv = {}
    for k, f in r.fields.items():
        if k in ("deepseek4.attention.layer_norm_rms_epsilon", "deepseek4.hyper_connection.epsilon",
                 "deepseek4.attention.key_length", "deepseek4.block_count", "deepseek4.attention.sliding_window"):
            kv[k] = f.parts[f.data[0]][0]
        elif k == "deepseek4.attention.compress_ratios":
            kv[k] = [int(f.parts[i][0]) for i in f.data]
    return t, kv


def mixes_kernels(path):
    """The two matmul kernels of the mixes on this CPU path: ``gemm`` (llamafile tinyBLAS, a ubatch
    of two rows or more) and ``gemv`` (ggml_vec_dot_f32, one row)."""
    return {"gemm (tinyBLAS, >= 2 rows)": H.LLAMACPP[path], "gemv (ggml_vec_dot_f32, 1 row)": H.LLAMACPP_DECODE[path]}


def check_mixes(base, cand, g, path):
    """Layer 0's attn.hc_pre_weights at every token both traces hold with equal embeddings."""
    t, kv = g
    inp_of = lambda emb: (np.tile(emb.astype(F32), H.N_HC), t["blk.0.hc_attn_fn.weight"],  # noqa: E731
                          t["blk.0.hc_attn_base.weight"].astype(F32), t["blk.0.hc_attn_scale.weight"].astype(F32),
                          F32(kv["deepseek4.attention.layer_norm_rms_epsilon"]),
                          F32(kv["deepseek4.hyper_connection.epsilon"]))
    kernels = mixes_kernels(path)
    res = {"tokens": 0, "differing": 0, "base": {}, "cand": {}, "unexplained": [], "first_differing": None}
    for side in ("base", "cand"):
        res[side] = {k: 0 for k in kernels} | {"both kernels agree": 0, "no kernel": 0}
    keys = sorted(k for k in base if k[3] == "embed.output" and k in cand)
    for k in keys:
        step, pos = k[0], k[1]
        pk = (step, pos, 0, "attn.hc_pre_weights")
        if pk not in base or pk not in cand or base[k].tobytes() != cand[k].tobytes():
            continue
        res["tokens"] += 1
        got = {name: H.hc_pre_weights(inp_of(base[k]), cfg)[0] for name, cfg in kernels.items()}
        same = len({v.tobytes() for v in got.values()}) == 1
        for side, tr in (("base", base), ("cand", cand)):
            hits = [name for name, v in got.items() if v.tobytes() == tr[pk].astype(F32).tobytes()]
            if not hits:
                res[side]["no kernel"] += 1
                res["unexplained"].append({"side": side, "step": step, "position": pos})
            elif same:
                res[side]["both kernels agree"] += 1
            else:
                res[side][hits[0]] += 1
        if base[pk].tobytes() != cand[pk].tobytes():
            res["differing"] += 1
            if res["first_differing"] is None:
                res["first_differing"] = {"step": step, "position": pos,
                                          "base": H.bits(base[pk]), "cand": H.bits(cand[pk]),
                                          "ulps": [int(u) for u in H.ulps(base[pk], cand[pk])]}
    return res


# ---------------------------------------------------------------------------------------------
# flash attention (ggml/src/ggml-cpu/ops.cpp), every operation as the AVX-512 build performs it.
# The compiler contracts the scalar ``S = S*ms + vs`` and the reduce's ``a*b + c*d`` into fused
# multiply-adds (-ffp-contract=fast, GCC's default): the variants without reproduce fewer values.

NEG = F32(-np.inf)


def _hex(s):
    return F32(float.fromhex(s))


def v_expf(x):
    """``ggml_v_expf`` (ggml/src/ggml-cpu/vec.h, AVX-512: FMA polynomial and ``_mm512_scalef_ps``),
    the exponential of ``ggml_vec_soft_max_f32``, elementwise on float32."""
    x = np.asarray(x, F32)
    full = lambda v: np.full_like(x, v)  # noqa: E731
    r = _hex("0x1.8p23")
    with np.errstate(invalid="ignore", over="ignore"):
        z = H.fma32(x, full(_hex("0x1.715476p+0")), full(r))
        n = (z - r).astype(F32)
        b = H.fma32(-n, full(_hex("0x1.62e4p-1")), x)
        b = H.fma32(-n, full(_hex("0x1.7f7d1cp-20")), b)
        d = np.abs(n) > 192
        u = (b * b).astype(F32)
        j = H.fma32(H.fma32(H.fma32(full(_hex("0x1.0e4020p-7")), b, full(_hex("0x1.573e2ep-5"))), u,
                            H.fma32(full(_hex("0x1.555e66p-3")), b, full(_hex("0x1.fffdb6p-2")))),
                    u, H.fma32(full(_hex("0x1.ffffecp-1")), b, full(F32(1.0))))
        res = np.ldexp(j.astype(F32), np.where(d, 0, n).astype(np.int32)).astype(F32)
        alt = np.where(n <= 0, F32(0), F32(np.inf)).astype(F32)
    return np.where(d, alt, res).astype(F32)


def _scale_f16(y, v):
    """``ggml_vec_scale_f16`` with AVX-512-FP16: the first n & ~127 elements times ``(_Float16) v``
    (one F16 rounding), the rest ``fp16(fp32(y) * v)``."""
    n = len(y)
    k = n & ~127
    out = np.empty(n, np.float16)
    out[:k] = (y[:k].astype(np.float64) * float(np.float16(F32(v)))).astype(np.float16)
    out[k:] = (y[k:].astype(F32) * F32(v)).astype(F32).astype(np.float16)
    return out


def _mad_f16(y, x, v):
    """``ggml_vec_mad_f16`` with AVX-512-FP16: ``_mm512_fmadd_ph`` with ``(_Float16) v`` on the first
    n & ~127 elements, the rest ``fp16(fma(fp32(x), v, fp32(y)))`` (the scalar loop, contracted)."""
    n = len(y)
    k = n & ~127
    out = np.empty(n, np.float16)
    out[:k] = (x[:k].astype(np.float64) * float(np.float16(F32(v))) + y[:k].astype(np.float64)).astype(np.float16)
    xs = x[k:].astype(F32)
    out[k:] = np.asarray(H.fma32(xs, np.full_like(xs, F32(v)), y[k:].astype(F32)), F32).astype(np.float16)
    return out


def _sink(M, S, vkq, sink):
    """The head's sink as one more score without a value: returns (M, S, VKQ)."""
    ms, vs = F32(1), F32(1)
    if sink > M:
        ms, M = H.expf_c(F32(M - sink)), sink
        vkq = (vkq * ms).astype(F32)
    else:
        vs = H.expf_c(F32(sink - M))
    return M, F32(H.fma32(S, ms, vs)[0]), vkq


def fa_one_chunk(q, k16, vis, sink, scale, ic0, ic1, with_sink):
    """``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` for one query row over cells
    [ic0, ic1): Q rounded to F16, scores by ``ggml_vec_dot_f16`` (4 x 16 F32 lanes), online softmax
    with the V accumulator in F16. Returns (M, S, VKQ in F32)."""
    q16 = q.astype(np.float16).astype(F32)
    vkq = np.zeros(k16.shape[1], np.float16)
    S, M = F32(0), NEG
    for ic in range(ic0, ic1):
        if not vis[ic]:
            continue
        s = F32(F32(H.vec_dot(k16[ic].astype(F32)[None, :], q16, 16, True)[0]) * scale)
        ms, vs = F32(1), F32(1)
        if s > M:
            ms, M = H.expf_c(F32(M - s)), s
            vkq = _scale_f16(vkq, ms)
        else:
            vs = H.expf_c(F32(s - M))
        vkq = _mad_f16(vkq, k16[ic], vs)
        S = F32(H.fma32(S, ms, vs)[0])
    v32 = vkq.astype(F32)
    if with_sink:
        M, S, v32 = _sink(M, S, v32, sink)
    return M, S, v32


def fa_chunks(q, k16, vis, sink, scale, nth):
    """The one-chunk kernel over ``nth`` KV chunks of ceil(nek1 / nth) cells, one per thread, then
    ``ggml_flash_attn_ext_reduce_partials`` (the split-KV path of a single query over >= 512 keys;
    with nth = 1 the same bits as the kernel without the split)."""
    nek1 = len(vis)
    cs = (nek1 + nth - 1) // nth
    mf, sf, vf = NEG, F32(0), np.zeros(k16.shape[1], F32)
    for t in range(nth):
        a = t * cs
        if a >= nek1:
            continue
        mc, sc, vc = fa_one_chunk(q, k16, vis, sink, scale, a, min(a + cs, nek1), a == 0)
        if sc == 0:
            continue
        mn = F32(max(mf, mc))
        so, sn = H.expf_c(F32(mf - mn)), H.expf_c(F32(mc - mn))
        vf = np.asarray(H.fma32(vf, np.full_like(vf, so), (vc * sn).astype(F32)), F32)
        sf = F32(H.fma32(sf, so, F32(sc * sn))[0])
        mf = mn
    return (vf * F32(F32(1) / sf)).astype(F32) if sf != 0 else vf


def fa_tiled(q, k16, vis, sink, scale):
    """``ggml_compute_forward_flash_attn_ext_tiled`` for one query row: Q in F32, KV tiles of 64
    cells, scores by ``simd_gemm`` (one FMA per head-dimension element, in order), softmax with
    ``ggml_v_expf`` summed per 16 lanes into a double, V accumulated in F32 by ``simd_gemm``."""
    nek1, dv = k16.shape
    kf = k16.astype(F32)
    q = q.astype(F32)
    M, S, vkq = NEG, F32(0), np.zeros(dv, F32)
    for ic in range(0, nek1, 64):
        idx = np.arange(ic, min(ic + 64, nek1))
        if not vis[idx].any():
            continue
        acc = np.zeros(len(idx), F32)
        for d in range(len(q)):
            acc = np.asarray(H.fma32(kf[idx, d], np.full(len(idx), q[d], F32), acc), F32)
        kq = np.full(64, NEG, F32)
        kq[:len(idx)] = ((acc * scale).astype(F32) + np.where(vis[idx], F32(0), NEG)).astype(F32)
        mn = F32(max(M, kq.max()))
        if mn > M:
            ms = H.expf_c(F32(M - mn))
            vkq, S = (vkq * ms).astype(F32), F32(S * ms)
        M = mn
        with np.errstate(invalid="ignore"):
            e = v_expf((kq - M).astype(F32))
        S = F32(float(S) + sum(float(H.fold(e[None, 16 * b:16 * b + 16], "halves")[0]) for b in range(4)))
        v32 = np.zeros((64, dv), F32)
        v32[:len(idx)] = kf[idx]
        for kk in range(64):
            vkq = np.asarray(H.fma32(v32[kk], np.full(dv, e[kk], F32), vkq), F32)
    M, S, vkq = _sink(M, S, vkq, sink)
    return (vkq * F32(F32(1) / S)).astype(F32) if S != 0 else vkq


#: The kernels ``ggml_compute_forward_flash_attn_ext_f16`` chooses from, by the ubatch's query rows
#: and the thread count.
FA_KERNELS = {
    "tiled (>= 64 query rows)": lambda q, k, v, s, c: fa_tiled(q, k, v, s, c),
    "one chunk (< 64 query rows, or 1 thread)": lambda q, k, v, s, c: fa_chunks(q, k, v, s, c, 1),
    "split KV over 2 threads": lambda q, k, v, s, c: fa_chunks(q, k, v, s, c, 2),
}


def _pad256(n):
    return max(256, -(-n // 256) * 256)


def attention_inputs(tr, g, n_prompt, step, pos, layer):
    """The keys (= values, F16 as the caches store them) and the visibility of one query row of
    layer ``layer``, laid out as llama.cpp's attention sees them: the window cache's cells (a cell
    per position; ``n_kv`` padded to 256, llama-kv-cache.cpp ``get_n_kv``) and, for CSA / HCA
    layers, the compressed cache's cells after them (ggml_concat in deepseek4.cpp
    ``build_csa_lid_attention`` / ``build_hca_attention``; visible: the indexer's selection, or
    every closed window). None when the trace lacks a record."""
    _, kv = g
    window = int(kv["deepseek4.attention.sliding_window"])
    ratio = kv["deepseek4.attention.compress_ratios"][layer]
    n_raw = _pad256(pos + 1)
    rows = {}
    for p in range(max(0, pos - window + 1), pos + 1):
        k = (0 if p < n_prompt else p - n_prompt + 1, p, layer, "attn.kv")
        if k not in tr:
            return None
        rows[p] = tr[k].reshape(-1)
    dim = len(rows[pos])
    n_comp = 0
    if ratio:
        n_comp = _pad256((pos + 1) // ratio)
        ck = (step, max(k[1] for k in tr if k[0] == step and k[3] == "embed.output"), layer,
              "state.compressor.compressed_kv")
        if ck not in tr:
            return None
        comp = tr[ck].reshape(-1, dim)
    k16 = np.zeros((n_raw + n_comp, dim), np.float16)
    vis = np.zeros(n_raw + n_comp, bool)
    for p, r in rows.items():
        k16[p] = r.astype(np.float16)
        vis[p] = True
    if ratio:
        t = (pos + 1) // ratio
        k16[n_raw:n_raw + t] = comp[:t].astype(np.float16)
        if ratio == 4:
            sel = tr.get((step, pos, layer, "attn.indexer_topk"))
            if sel is None:
                return None
            for e in np.asarray(sel).reshape(-1):
                vis[n_raw + int(e)] = True
        else:
            vis[n_raw:n_raw + t] = True
    return k16, vis


def check_attention(base, cand, g):
    """The first ``attn.core`` record (by step, layer, position) whose value differs between the
    traces while its inputs (attn.q, the keys) are equal, recomputed under every flash-attention
    kernel: which one each trace's value is."""
    t, kv = g
    n_prompt = 1 + max(k[1] for k in base if k[0] == 0 and k[3] == "embed.output")
    cores = sorted((k for k in base if k[3] == "attn.core" and k in cand), key=lambda k: (k[0], k[2], k[1]))
    first = next((k for k in cores if base[k].tobytes() != cand[k].tobytes()), None)
    if first is None:
        return {"skipped": "no attn.core differs"}
    step, pos, layer, _ = first
    kq = (step, pos, layer, "attn.q")
    if base.get(kq) is None or cand.get(kq) is None or base[kq].tobytes() != cand[kq].tobytes():
        return {"skipped": f"attn.q differs where attn.core first does (step {step} position {pos} layer {layer})"}
    ins = [attention_inputs(tr, g, n_prompt, step, pos, layer) for tr in (base, cand)]
    if ins[0] is None or ins[1] is None:
        return {"skipped": f"the trace lacks the keys of step {step} position {pos} layer {layer}"}
    if any(not np.array_equal(a, b) for a, b in zip(ins[0], ins[1])):
        return {"skipped": f"the keys differ at step {step} position {pos} layer {layer} (an earlier divergence)"}
    k16, vis = ins[0]
    scale = F32(F32(1.0) / np.sqrt(F32(int(kv["deepseek4.attention.key_length"]))))
    sinks = t[f"blk.{layer}.attn_sinks.weight"].astype(F32)
    q = base[kq]
    # The split-KV path exists for a single query over >= 512 cells only.
    kernels = {n: f for n, f in FA_KERNELS.items() if len(vis) >= 512 or not n.startswith("split")}
    got = {name: np.stack([f(q[h], k16, vis, sinks[h], scale) for h in range(q.shape[0])])
           for name, f in kernels.items()}
    res = {"step": step, "position": pos, "layer": layer, "keys": int(vis.sum()), "cells": len(vis)}
    for side, tr in (("base", base), ("cand", cand)):
        want = tr[first].astype(F32).tobytes()
        hits = [name for name, v in got.items() if v.tobytes() == want]
        res[side] = " = ".join(hits) if hits else "none of the emulated kernels (flash attention off?)"
    return res


def check_head(base, cand, g, path, n_layer):
    """The head's mHC pre weights at the last prompt position under both matmul kernels, when both
    traces hold equal inputs there (layer n_layer-1's layer.post_ffn_mhc) and different logits."""
    t, kv = g
    pos = max(k[1] for k in base if k[0] == 0 and k[3] == "embed.output")
    ki, kl = (0, pos, n_layer - 1, "layer.post_ffn_mhc"), (0, pos, None, "lm.logits")
    if not all(x in base and x in cand for x in (ki, kl)):
        return {"skipped": "no layer.post_ffn_mhc / lm.logits payloads"}
    if base[ki].tobytes() != cand[ki].tobytes():
        return {"skipped": "the head's inputs differ (an earlier divergence)"}
    inp = (base[ki].astype(F32).reshape(-1), t["output_hc_fn.weight"], t["output_hc_base.weight"].astype(F32),
           t["output_hc_scale.weight"].astype(F32), F32(kv["deepseek4.attention.layer_norm_rms_epsilon"]),
           F32(kv["deepseek4.hyper_connection.epsilon"]))
    got = {name: H.hc_pre_weights(inp, cfg)[0] for name, cfg in mixes_kernels(path).items()}
    a, b = got.values()
    return {"position": pos, "logits_differ": base[kl].tobytes() != cand[kl].tobytes(),
            "head_pre_weights": {name: H.bits(v) for name, v in got.items()},
            "kernels_differ_in_values": int((a != b).sum())}


def analyse(gguf_path, base_path, cand_path, path="AVX-512"):
    """Every check for one pair; ``ok``: every mixes value of both traces is one kernel's, and
    the attention output of a trace run with flash attention on is one of its two kernels'."""
    g = _gguf(gguf_path)
    (base, tb), (cand, tc) = _trace(base_path), _trace(cand_path)
    n_layer = int(g[1]["deepseek4.block_count"])
    res = {"cpu_path": path, "mixes": check_mixes(base, cand, g, path), "attention": check_attention(base, cand, g),
           "head": check_head(base, cand, g, path, n_layer)}
    fa = {side: dict(t.provenance.notes).get("flash_attn.resolved", "") for side, t in (("base", tb), ("cand", tc))}
    res["flash_attn"] = fa
    # The attention kernels are emulated for the AVX-512 build (F16 arithmetic of AVX-512-FP16).
    res["ok"] = not res["mixes"]["unexplained"] and not (path == "AVX-512" and any(
        "enabled" in fa[side] and res["attention"].get(side, "").startswith("none") for side in fa))
    return res


def text(name, res):
    """The checks whose operator differs between the two traces, one paragraph per configuration."""
    m, a, h = res["mixes"], res["attention"], res["head"]
    lines = [f"{name}:"]

    def kernels(side):
        return ", ".join(f"{k} {v}" for k, v in m[side].items() if v)

    if m["differing"] or m["unexplained"]:
        lines.append(f"  layer 0 attn.hc_pre_weights: {m['differing']} of {m['tokens']} tokens with equal inputs differ; "
                     f"reproduced by base: {kernels('base')}; cand: {kernels('cand')}")
        f = m["first_differing"]
        if f:
            lines.append(f"    first: step {f['step']} position {f['position']}: base {' '.join(f['base'])}, cand "
                         f"{' '.join(f['cand'])} (ulps {f['ulps']})")
    if "skipped" not in a:
        lines.append(f"  attn.core at step {a['step']} position {a['position']} layer {a['layer']} (the first that "
                     f"differs; equal attn.q and keys, {a['keys']} visible of {a['cells']} cells): base = {a['base']}; "
                     f"cand = {a['cand']}")
    if "skipped" not in h and h["logits_differ"]:
        lines.append(f"  step 0 lm.logits differ with equal inputs to the head (layer.post_ffn_mhc, position "
                     f"{h['position']}); its mHC pre weights under the two matmul kernels differ in "
                     f"{h['kernels_differ_in_values']} of 4 values: "
                     + "; ".join(f"{k} {' '.join(v)}" for k, v in h["head_pre_weights"].items()))
    if len(lines) == 1:
        lines.append("  none of the recomputed operators differs with equal inputs (layer 0's attn.hc_pre_weights, "
                     "the first differing attn.core, the head's pre weights)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--base")
    ap.add_argument("--cand")
    ap.add_argument("--matrix", help="a moeconf invariance output directory (every configuration against its base)")
    ap.add_argument("--cpu-path", default=None, choices=sorted(H.LLAMACPP),
                    help="the matmul path llama.cpp was built for (default: the one llama_cpp reports, else AVX-512)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    pairs = []
    if args.matrix:
        doc = json.load(open(os.path.join(args.matrix, "invariance.json"), encoding="utf-8"))
        base = os.path.join(args.matrix, doc["base"]["trace"])
        for c in doc["configurations"]:
            fd = (c.get("compared") or {}).get("first_divergence")
            if c.get("root") and c["root"] != doc["base"]["root"] and fd:
                pairs.append((c["name"], base, os.path.join(args.matrix, c["trace"])))
    elif args.base and args.cand:
        pairs.append((os.path.basename(args.cand), args.base, args.cand))
    else:
        ap.error("give --base and --cand, or --matrix")
    path = args.cpu_path
    if path is None:
        try:
            import llama_cpp

            path = H.cpu_path(llama_cpp.llama_print_system_info().decode())
        except ImportError:
            path = "AVX-512"
        if path is None:
            print("llama.cpp's CPU backend takes a path this script does not emulate; the checks assume AVX-512")
            path = "AVX-512"
    out, ok = {}, True
    for name, b, c in pairs:
        res = analyse(args.gguf, b, c, path)
        ok &= res["ok"]
        out[name] = res
        if not args.json:
            print(text(name, res))
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
