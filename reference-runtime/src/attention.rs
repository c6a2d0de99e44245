//! The attention block of every layer: low-rank queries, the single shared
//! K=V head, sliding window with per-head sinks, CSA/HCA compressed keys, the
//! lightning indexer, de-rotation and the grouped output projection
//! (`modeling_deepseek_v4.py` L728-884; notes §2.4).
//!
//! Numerical contract (round = the profile's rounding point):
//! - `q_lat = rmsnorm_w(round(W_qa·a))`; `q_h = rope(rmsnorm_unweighted(round(W_qb·q_lat)_h))`.
//! - `kv = rope(rmsnorm_w(round(W_kv·a)))`; rope kind "main" on sliding layers, else "compress".
//! - Keys: the window (≤ w kvs, oldest first) then the compressed entries (HCA: all;
//!   CSA: the indexer's selection in ascending entry order), read from the caches
//!   after the position's kv and any emitted entry are stored; the read views are
//!   recorded (`attn.window_read`, `attn.compressed_read`) separately from what is
//!   appended (`attn.kv`, `attn.compressed`).
//! - `l_j = round(round(dot8(q_h, k_j)) · d^(−1/2))`; `M = max(max_j l_j, sink_h)`;
//!   `e_j = expf(l_j − M)`; `Z = (Σ_j e_j) + expf(sink_h − M)` (keys in order, sink last);
//!   `p_j = round(e_j / Z)`; `o_h = round(Σ_j p_j · v_j)` (keys in order, FP32).
//! - De-rotation: inverse rope at t on the trailing r channels of each o_h.
//! - `u_g = round(W_oa[gR..(g+1)R] · o_g)` over contiguous head groups, `out = round(W_ob · u)`.

use std::borrow::Cow;

use moeconf_contract::bf16::r_bf16;
use moeconf_fingerprint::Component;

use crate::capture::Recorder;
use crate::compressor::{compressor_step_with, CompressorWeights, StoreQuant};
use crate::config::{AttentionKind, ModelConfig};
use crate::context::TokenCtx;
use crate::error::RuntimeError;
use crate::faults::{keep_mantissa_bits, truncate_bf16, SumOrder};
use crate::indexer::{indexer_queries, indexer_scores_bf16, indexer_scores_from, topk_desc, IndexerWeights};
use crate::kernels::dot8_f32_many;
use crate::official;
use crate::precision::Precision;
use crate::rmsnorm::{rmsnorm_unweighted_bf16_tensors, rmsnorm_unweighted_in_place, rmsnorm_weighted};
use crate::rope::{apply_rope, CosSin, RopeFreqs};
use crate::state::{CompressorRole, CompressorState, LayerState};
use crate::weights::{Mat, WeightLoader};

/// Weights of one attention block.
#[derive(Debug, Clone)]
pub struct AttnWeights {
    pub kind: AttentionKind,
    /// W_qa `[q_r, D]`.
    pub wq_a: Mat,
    /// q_a_norm weight `[q_r]`.
    pub q_norm: Vec<f32>,
    /// W_qb `[H·d, q_r]`.
    pub wq_b: Mat,
    /// W_kv `[d, D]`.
    pub wkv: Mat,
    /// kv_norm weight `[d]`.
    pub kv_norm: Vec<f32>,
    /// W_oa `[G·R, H·d/G]`.
    pub wo_a: Mat,
    /// W_ob `[D, G·R]`.
    pub wo_b: Mat,
    /// Per-head sink logits `[H]`.
    pub sinks: Vec<f32>,
    /// Main compressor (CSA/HCA).
    pub compressor: Option<CompressorWeights>,
    /// Lightning indexer (CSA).
    pub indexer: Option<IndexerWeights>,
}

impl AttnWeights {
    /// Loads `layers.{i}.attn.*`.
    pub fn load(w: &mut WeightLoader, cfg: &ModelConfig, i: usize) -> Result<AttnWeights, RuntimeError> {
        Self::load_at(w, cfg, &format!("layers.{i}.attn"), cfg.layer_types[i])
    }

    /// Loads the attention block under `p` (`layers.{i}.attn`, `mtp.{j}.attn`) of kind `kind`;
    /// the projections in the config's dense format.
    pub fn load_at(
        w: &mut WeightLoader,
        cfg: &ModelConfig,
        p: &str,
        kind: AttentionKind,
    ) -> Result<AttnWeights, RuntimeError> {
        let (dm, h, d, qr) = (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank);
        let f = cfg.weights.dense;
        let compressor = match kind {
            AttentionKind::Sliding => None,
            AttentionKind::Csa => Some(CompressorWeights::load(
                w,
                &format!("{p}.compressor"),
                dm,
                d,
                cfg.csa_rate,
                true,
            )?),
            AttentionKind::Hca => Some(CompressorWeights::load(
                w,
                &format!("{p}.compressor"),
                dm,
                d,
                cfg.hca_rate,
                false,
            )?),
        };
        let indexer = match kind {
            AttentionKind::Csa => Some(IndexerWeights::load(w, &format!("{p}.indexer"), cfg)?),
            _ => None,
        };
        Ok(AttnWeights {
            kind,
            wq_a: w.linear(&format!("{p}.wq_a.weight"), qr, dm, f)?,
            q_norm: w.vec_f32(&format!("{p}.q_norm.weight"), &[qr])?,
            wq_b: w.linear(&format!("{p}.wq_b.weight"), h * d, qr, f)?,
            wkv: w.linear(&format!("{p}.wkv.weight"), d, dm, f)?,
            kv_norm: w.vec_f32(&format!("{p}.kv_norm.weight"), &[d])?,
            wo_a: w.linear(
                &format!("{p}.wo_a.weight"),
                cfg.o_groups * cfg.o_lora_rank,
                h * d / cfg.o_groups,
                f,
            )?,
            wo_b: w.linear(&format!("{p}.wo_b.weight"), dm, cfg.o_groups * cfg.o_lora_rank, f)?,
            sinks: w.vec_f32(&format!("{p}.attn_sink"), &[h])?,
            compressor,
            indexer,
        })
    }
}

/// Rope tables shared by all layers.
#[derive(Debug, Clone)]
pub struct Ropes {
    /// "main" (sliding layers).
    pub main: RopeFreqs,
    /// "compress" (CSA/HCA layers, compressors, indexer).
    pub compress: RopeFreqs,
}

/// Runs the attention block for one token (at `cx.position`) with
/// normalised input `a`, updating the layer state; returns the block output
/// (length D).
pub(crate) fn attention_forward(
    aw: &AttnWeights,
    ls: &mut LayerState,
    a: &[f32],
    ropes: &Ropes,
    cx: &TokenCtx<'_>,
    rec: &mut Recorder<'_>,
) -> Result<Vec<f32>, RuntimeError> {
    let (cfg, p, t, at) = (cx.cfg, cx.p, cx.position, cx.at());
    let (h, d) = (cfg.num_heads, cfg.head_dim);
    let rope = if aw.kind == AttentionKind::Sliding {
        &ropes.main
    } else {
        &ropes.compress
    };
    let cs = rope.cos_sin(t, p.rope_tables());

    let shifted;
    let q_cs = if cx.fx.attention.query_rope_off_by_one {
        shifted = rope.cos_sin(t + 1, p.rope_tables());
        &shifted
    } else {
        &cs
    };
    // Site Q1 (official profile): the input of the FP8 GEMMs wq_a and wkv.
    let skip = cx.fx.skip_quantization;
    let a_q = (p.quantizes() && official::any_quantized([&aw.wq_a, &aw.wkv]))
        .then(|| official::gemm_input(a, skip.contains(Component::AttnNormFp8)));
    if let Some(v) = &a_q {
        rec.f32(Component::AttnNormFp8, at, &[a.len() as u64], v)?;
    }
    let lat = queries(aw, a, a_q.as_deref(), q_cs, cx);
    if let Some(v) = &lat.quantized {
        rec.f32(Component::AttnQLatFp8, at, &[v.len() as u64], v)?;
    }
    rec.f32(Component::AttnQ, at, &[h as u64, d as u64], &lat.q)?;
    let kv = new_kv(aw, a, a_q.as_deref(), &cs, cx);
    rec.f32(Component::AttnKv, at, &[d as u64], &kv)?;
    // Site Q3: the stored kv has its non-rope channels FP8 fake-quantized.
    let stored = p.quantizes().then(|| {
        let mut v = kv.clone();
        official::kv_fake_quant(&mut v, cfg.rope_dim, skip.contains(Component::AttnKvFp8));
        v
    });
    if let Some(v) = &stored {
        rec.f32(Component::AttnKvFp8, at, &[d as u64], v)?;
    }
    // vllm-cpu: the window cache holds vLLM's FP8 KV (the NoPE channels in
    // 64-wide tiles with flush to zero, read back with EXT; §4.2.5 rule 9),
    // recorded as vLLM's capture records it.
    let vllm_stored = (p == Precision::VllmCpu).then(|| crate::vllm::fp8_kv_round_trip(&kv, cfg.rope_dim));
    if let Some(v) = &vllm_stored {
        rec.f32(Component::AttnKvFp8, at, &[d as u64], v)?;
    }
    store_kv(
        ls,
        vllm_stored.as_deref().or(stored.as_deref()).unwrap_or(&kv),
        cx,
    );

    compress(aw, ls, a, ropes, cx, rec)?;
    let selected = select(aw, ls, a, &lat, ropes, cx, rec)?;
    let mut core = {
        let window = window_read(ls, cx);
        rec.f32(
            Component::AttnWindowRead,
            at,
            &[(window.len() / d) as u64, d as u64],
            &window,
        )?;
        // DeepSeek's kernel reads the selection in the indexer's top-k order
        // (score descending); the other profiles in ascending entry order.
        let compressed = compressed_read(aw.kind, ls, &selected, !p.quantizes());
        if let Some(c) = &compressed {
            rec.f32(
                Component::AttnCompressedRead,
                at,
                &[(c.len() / d) as u64, d as u64],
                c,
            )?;
        }
        let mut keys: Vec<&[f32]> = window.chunks_exact(d).collect();
        let n_window = keys.len();
        keys.extend(compressed.as_deref().unwrap_or(&[]).chunks_exact(d));
        match p {
            Precision::Official => {
                let layout = KeyLayout {
                    n_window,
                    compressed_slot: cfg.sliding_window,
                };
                attend_online_blocks(&lat.q, &keys, layout, &aw.sinks, h, d)
            }
            Precision::VllmCpu => {
                let blocks =
                    crate::vllm::key_blocks(&keys[..n_window], &keys[n_window..], cfg.sliding_window);
                crate::vllm::sparse_attention(&lat.q, &blocks, &aw.sinks, h, d)
            }
            Precision::Bf16 | Precision::F32 => attend(&lat.q, &keys, &aw.sinks, cx),
        }
    };
    rec.f32(Component::AttnCore, at, &[h as u64, d as u64], &core)?;
    let out = output_projection(aw, &mut core, &cs, cx, rec)?;
    rec.f32(Component::AttnOutput, at, &[cfg.hidden_size as u64], &out)?;

    // Keep the last w−1 kvs (HF DynamicSlidingWindowLayer).
    let keep = cfg.sliding_window.saturating_sub(1) * d;
    if ls.window_kv.len() > keep {
        let drop_n = ls.window_kv.len() - keep;
        ls.window_kv.drain(..drop_n);
    }
    ls.cumulative_length += 1;
    Ok(out)
}

/// Appends the position's kv to the window cache (with the
/// [`crate::faults::FaultKind::WindowStoreLowPrecision`] fault, stored with
/// fewer mantissa bits).
fn store_kv(ls: &mut LayerState, kv: &[f32], cx: &TokenCtx<'_>) {
    let start = ls.window_kv.len();
    ls.window_kv.extend_from_slice(kv);
    if let Some(bits) = cx.fx.attention.window_store_bits {
        keep_mantissa_bits(&mut ls.window_kv[start..], bits);
    }
}

/// The window rows attention reads: the cache after this position's kv is
/// stored (≤ w rows, oldest first). With the
/// [`crate::faults::FaultKind::WindowReadDropsOldest`] fault a full window
/// is read without its oldest row; with
/// [`crate::faults::FaultKind::WindowRingReadOffByOne`], from position 2w
/// on, the newest row (the position's kv) is read from the next ring slot,
/// which holds the oldest row.
fn window_read<'s>(ls: &'s LayerState, cx: &TokenCtx<'_>) -> Cow<'s, [f32]> {
    let (d, w) = (cx.cfg.head_dim, cx.cfg.sliding_window);
    let rows = ls.window_kv.len() / d.max(1);
    let full = rows >= w && rows > 0;
    let twice_wrapped = cx.position as usize >= 2 * w;
    if cx.fx.attention.window_read_drops_oldest && full {
        Cow::Borrowed(&ls.window_kv[d..])
    } else if cx.fx.attention.window_ring_read_off_by_one && full && twice_wrapped && rows > 1 {
        let mut v = ls.window_kv[..(rows - 1) * d].to_vec();
        v.extend_from_slice(&ls.window_kv[..d]);
        Cow::Owned(v)
    } else {
        Cow::Borrowed(&ls.window_kv)
    }
}

/// The compressed entries attention reads from the cache (HCA: all; CSA: the
/// indexer's selection, in ascending entry order when `ascending`, else in
/// the selection's order), `None` on sliding layers.
fn compressed_read<'s>(
    kind: AttentionKind,
    ls: &'s LayerState,
    selected: &[usize],
    ascending: bool,
) -> Option<Cow<'s, [f32]>> {
    let cst = ls.compressor.as_ref()?;
    Some(match kind {
        AttentionKind::Csa => {
            let mut sel = selected.to_vec();
            if ascending {
                sel.sort_unstable();
            }
            Cow::Owned(sel.iter().flat_map(|&i| cst.entry(i).iter().copied()).collect())
        }
        _ => Cow::Borrowed(&cst.compressed_kv),
    })
}

/// The query latent (and, in the official profile, its quantization, site
/// Q2) and the per-head queries after norm and RoPE.
pub(crate) struct Queries {
    /// `q_lat = rmsnorm_w(W_qa·a)`.
    pub lat: Vec<f32>,
    /// Site Q2: `q_lat` FP8-quantized for the GEMMs that read it (`None`
    /// outside the official profile or when neither `wq_b` is quantized).
    pub quantized: Option<Vec<f32>>,
    /// The queries `[H·d]`.
    pub q: Vec<f32>,
}

/// The query latent and the per-head queries after norm and RoPE; `a_q` is
/// site Q1 (the quantized `a`) in the official profile.
fn queries(aw: &AttnWeights, a: &[f32], a_q: Option<&[f32]>, cs: &CosSin, cx: &TokenCtx<'_>) -> Queries {
    let (p, eps) = (cx.p, cx.cfg.rms_norm_eps);
    let lat = rmsnorm_weighted(&official::linear(&aw.wq_a, a, a_q, p), &aw.q_norm, eps, p);
    let readers = std::iter::once(&aw.wq_b).chain(aw.indexer.as_ref().map(|ix| &ix.wq_b));
    let quantized = (p.quantizes() && official::any_quantized(readers)).then(|| {
        let skip = cx.fx.skip_quantization.contains(Component::AttnQLatFp8);
        official::gemm_input(&lat, skip)
    });
    let mut q = official::linear(&aw.wq_b, &lat, quantized.as_deref(), p);
    for hq in q.chunks_exact_mut(cx.cfg.head_dim) {
        match p {
            // DeepSeek's norm on the BF16 tensor (M L498).
            Precision::Official => rmsnorm_unweighted_bf16_tensors(hq, eps),
            Precision::VllmCpu => {
                crate::vllm::query_norm_rope(hq, cs, eps);
                continue;
            }
            Precision::Bf16 | Precision::F32 => rmsnorm_unweighted_in_place(hq, eps, p),
        }
        apply_rope(hq, cs, false, p);
    }
    Queries { lat, quantized, q }
}

/// The position's new kv vector (norm, RoPE, and the kv precision fault).
fn new_kv(aw: &AttnWeights, a: &[f32], a_q: Option<&[f32]>, cs: &CosSin, cx: &TokenCtx<'_>) -> Vec<f32> {
    let p = cx.p;
    let projected = match cx.fx.kv_projection_truncate {
        true => truncated_linear(&aw.wkv, a_q.unwrap_or(a), p),
        false => official::linear(&aw.wkv, a, a_q, p),
    };
    let mut kv = rmsnorm_weighted(&projected, &aw.kv_norm, cx.cfg.rms_norm_eps, p);
    match p {
        // vLLM: RoPE in FP32 with the fused forms, then R of every value
        // (§4.2.5 rule 9, `fused_qnorm_rope_kv_insert_cpu`).
        Precision::VllmCpu => {
            crate::rope::apply_rope_vllm(&mut kv, cs, false);
            p.round_slice(&mut kv);
        }
        _ => apply_rope(&mut kv, cs, false, p),
    }
    if let Some(bits) = cx.fx.kv_mantissa_bits {
        keep_mantissa_bits(&mut kv, bits);
    }
    kv
}

/// The main compressor's step (CSA/HCA), recording an emitted entry.
fn compress(
    aw: &AttnWeights,
    ls: &mut LayerState,
    a: &[f32],
    ropes: &Ropes,
    cx: &TokenCtx<'_>,
    rec: &mut Recorder<'_>,
) -> Result<(), RuntimeError> {
    let (Some(cw), Some(cst)) = (&aw.compressor, ls.compressor.as_mut()) else {
        return Ok(());
    };
    let eps = cx.fx.compressor_norm_eps.unwrap_or(cx.cfg.rms_norm_eps);
    let rows = cst.buffered();
    // Site Q4 (official profile): the stored entry's non-rope channels FP8-quantized.
    let store = match cx.p.quantizes() {
        true => StoreQuant::KvFp8 {
            rope: cx.cfg.rope_dim,
            skip: cx.fx.skip_quantization.contains(Component::AttnCompressedFp8),
        },
        false => StoreQuant::None,
    };
    match compressor_step_with(cw, cst, a, &ropes.compress, eps, cx.p, cx.fx.compressor, store) {
        Some(emitted) => {
            let d = cx.cfg.head_dim as u64;
            rec.f32(Component::AttnCompressed, cx.at(), &[1, d], &emitted.entry)?;
            if let Some(v) = &emitted.stored {
                rec.f32(Component::AttnCompressedFp8, cx.at(), &[1, d], v)?;
            }
        }
        None => check_buffered(rec, cst, rows, cx, CompressorRole::Attention)?,
    }
    Ok(())
}

/// Checks the projections a compressor step buffered (rows `from..`) for
/// non-finite values: they are persistent state that no operator record
/// shows until the window closes.
fn check_buffered(
    rec: &Recorder<'_>,
    st: &CompressorState,
    from: usize,
    cx: &TokenCtx<'_>,
    role: CompressorRole,
) -> Result<(), RuntimeError> {
    let (kv, gate) = role.buffer_components();
    let start = from * st.width;
    rec.check(kv, cx.at(), st.buffer_kv.get(start..).unwrap_or(&[]))?;
    rec.check(gate, cx.at(), st.buffer_gate.get(start..).unwrap_or(&[]))
}

/// The lightning indexer (CSA): its compressor's step, then the selection
/// of compressed entries (descending score). Empty on other layers.
fn select(
    aw: &AttnWeights,
    ls: &mut LayerState,
    a: &[f32],
    lat: &Queries,
    ropes: &Ropes,
    cx: &TokenCtx<'_>,
    rec: &mut Recorder<'_>,
) -> Result<Vec<usize>, RuntimeError> {
    let (Some(iw), Some(ist)) = (&aw.indexer, ls.indexer.as_mut()) else {
        return Ok(Vec::new());
    };
    let (cfg, p, at) = (cx.cfg, cx.p, cx.at());
    let fx = cx.fx.indexer;
    let skip = cx.fx.skip_quantization;
    let rows = ist.buffered();
    // Site Q5 (official profile): the stored key Hadamard-rotated and FP4-quantized.
    let store = match p.quantizes() {
        true => StoreQuant::RotatedFp4 {
            skip: skip.contains(Component::AttnIndexerCompressedFp4),
        },
        false => StoreQuant::None,
    };
    match compressor_step_with(
        &iw.compressor,
        ist,
        a,
        &ropes.compress,
        cfg.rms_norm_eps,
        p,
        fx.compressor,
        store,
    ) {
        Some(emitted) => {
            let d_i = ist.dim as u64;
            rec.f32(Component::AttnIndexerCompressed, at, &[1, d_i], &emitted.entry)?;
            if let Some(v) = &emitted.stored {
                rec.f32(Component::AttnIndexerCompressedFp4, at, &[1, d_i], v)?;
            }
        }
        None => check_buffered(rec, ist, rows, cx, CompressorRole::Indexer)?,
    }
    let (t, d_i) = (ist.entry_count, ist.dim as u64);
    rec.f32(Component::AttnIndexerRead, at, &[t, d_i], &ist.compressed_kv)?;
    let ccs = ropes.compress.cos_sin(cx.position, p.rope_tables());
    let heads = cfg.index_n_heads;
    let mut q = indexer_queries(iw, &lat.lat, lat.quantized.as_deref(), &ccs, heads, ist.dim, p);
    if p.quantizes() {
        // Site Q6: the queries Hadamard-rotated and FP4-quantized per head.
        official::rotate_fake_quant_fp4(&mut q, ist.dim, skip.contains(Component::AttnIndexerQFp4));
        rec.f32(Component::AttnIndexerQFp4, at, &[heads as u64, d_i], &q)?;
    }
    let scores = match p {
        // BF16 scores as DeepSeek's indexer computes them (M L417–421).
        Precision::Official => indexer_scores_bf16(iw, ist, &q, a, heads),
        // vllm-cpu: vLLM's learned indexer never runs below 2,048 tokens
        // (docs/interop-vllm.md §4.2.6); the bf16 profile's scores.
        Precision::Bf16 | Precision::F32 | Precision::VllmCpu => {
            indexer_scores_from(iw, ist, &q, a, heads, p, fx.scale_after_sum)
        }
    };
    rec.f32(Component::AttnIndexerScores, at, &[scores.len() as u64], &scores)?;
    let full = cfg.index_topk.min(scores.len());
    let mut k = full;
    if fx.topk_drops_last {
        k = k.saturating_sub(1);
    }
    let selected = match fx.topk_takes_next && scores.len() > full && k > 0 {
        // The last slot takes the next entry of the ranking (T > K_I only).
        true => {
            let mut s = topk_desc(&scores, k + 1);
            s.remove(k - 1);
            s
        }
        false => topk_desc(&scores, k),
    };
    let ids: Vec<i32> = selected.iter().map(|&i| i as i32).collect();
    rec.i32(Component::AttnIndexerTopk, at, &ids)?;
    Ok(selected)
}

/// Per-head sink softmax over `keys` and the weighted value sum (K = V):
/// the attention output per head, before de-rotation, `[H·d]`.
fn attend(q: &[f32], keys: &[&[f32]], sinks: &[f32], cx: &TokenCtx<'_>) -> Vec<f32> {
    let (p, h, d) = (cx.p, cx.cfg.num_heads, cx.cfg.head_dim);
    let softmax = cx.fx.softmax;
    let reversed = softmax.order == SumOrder::Reversed;
    let scale = 1.0 / (d as f32).sqrt();
    let mut core = vec![0.0f32; h * d];
    let mut e = vec![0.0f32; keys.len()];
    for hh in 0..h {
        let qh = &q[hh * d..(hh + 1) * d];
        let sink = sinks[hh];
        let mut m = sink;
        // dot8(q_h, k_j) for every key (several keys at a time, same bits).
        dot8_f32_many(keys, qh, &mut e);
        for lj in e.iter_mut() {
            *lj = p.round(p.round(*lj) * scale);
            m = m.max(*lj);
        }
        let add = |z: f32, ej: &f32| softmax.accumulator.add(z, *ej);
        let mut z = if cx.fx.attention.split_k {
            split_k_exponentials(&mut e, m)
        } else {
            for ej in e.iter_mut() {
                *ej = libm::expf(*ej - m);
            }
            if reversed {
                e.iter().rev().fold(0.0f32, add)
            } else {
                e.iter().fold(0.0f32, add)
            }
        };
        z += libm::expf(sink - m);
        let oh = &mut core[hh * d..(hh + 1) * d];
        let mut weighted = |ej: &f32, v: &&[f32]| {
            let pj = p.round(ej / z);
            for (o, vv) in oh.iter_mut().zip(v.iter()) {
                *o += pj * vv;
            }
        };
        if reversed {
            e.iter().zip(keys).rev().for_each(|(ej, v)| weighted(ej, v));
        } else {
            e.iter().zip(keys).for_each(|(ej, v)| weighted(ej, v));
        }
        p.round_slice(oh);
    }
    core
}

/// Where the keys of one query sit in DeepSeek's index list (`topk_idxs` of
/// `Attention.forward`, M L508–515, decode layout): the window takes `win`
/// slots (its rows oldest first, then unused slots marked −1 until the
/// window fills), the compressed keys follow from slot `win`. Only the
/// partition into [`ATTN_BLOCK`]-key blocks depends on it: a −1 slot adds
/// `exp(−∞) = 0` to every sum and nothing to the maximum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyLayout {
    /// Window keys at the front of `keys` (slots 0..n_window).
    pub n_window: usize,
    /// Slot of the first compressed key (`sliding_window`).
    pub compressed_slot: usize,
}

impl KeyLayout {
    /// The slot of key `j` in the index list.
    fn slot(self, j: usize) -> usize {
        match j < self.n_window {
            true => j,
            false => self.compressed_slot.max(self.n_window) + (j - self.n_window),
        }
    }
}

/// Keys per block of DeepSeek's sparse-attention kernel (`block = 64`, K L288).
pub(crate) const ATTN_BLOCK: usize = 64;

/// The official profile's attention, DeepSeek's `sparse_attn_kernel`
/// (`inference/kernel.py` L276–368) for one query position: per head,
/// `s_j = dot8(q_h, k_j) ⊗ fp32(d^(−1/2))` (FP32 scores from BF16 q and k),
/// then an online softmax over the blocks of [`ATTN_BLOCK`] slots of
/// `layout` in increasing order, from `m = −∞`, `l = 0`, `acc = 0`: `m' =
/// max(m, max_{j∈b} s_j)`, `α = exp(m − m')`, `e_j = exp(s_j − m')`, `l ←
/// l ⊗ α ⊕ Σ_{j∈b} e_j`, `acc_c ← acc_c ⊗ α ⊕ Σ_{j∈b} R(e_j) ⊗ v_jc` (each
/// block sum in FP32 from +0 in key order: the MMA's order is not in the
/// source); after the last block `l ← l ⊕ exp(sink_h − m)` (the sink only in
/// the denominator, not in the maximum) and `o_hc = R(acc_c / l)`. V = K;
/// R = R_BF16; exp is libm's expf.
pub(crate) fn attend_online_blocks(
    q: &[f32],
    keys: &[&[f32]],
    layout: KeyLayout,
    sinks: &[f32],
    h: usize,
    d: usize,
) -> Vec<f32> {
    let scale = libm::pow(d as f64, -0.5) as f32;
    let mut core = vec![0.0f32; h * d];
    let mut s = vec![0.0f32; keys.len()];
    let mut partial = vec![0.0f32; d];
    for hh in 0..h {
        let qh = &q[hh * d..(hh + 1) * d];
        dot8_f32_many(keys, qh, &mut s);
        s.iter_mut().for_each(|v| *v *= scale);
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
        let acc = &mut core[hh * d..(hh + 1) * d];
        let mut j0 = 0;
        while j0 < keys.len() {
            let block = layout.slot(j0) / ATTN_BLOCK;
            let j1 = (j0..keys.len())
                .find(|&j| layout.slot(j) / ATTN_BLOCK != block)
                .unwrap_or(keys.len());
            let m_new = s[j0..j1].iter().copied().fold(m, f32::max);
            let alpha = libm::expf(m - m_new);
            let mut block_sum = 0.0f32;
            partial.iter_mut().for_each(|v| *v = 0.0);
            for j in j0..j1 {
                let e = libm::expf(s[j] - m_new);
                block_sum += e;
                let pj = r_bf16(e);
                for (o, v) in partial.iter_mut().zip(keys[j]) {
                    *o += pj * v;
                }
            }
            l = l * alpha + block_sum;
            for (a, pb) in acc.iter_mut().zip(&partial) {
                *a = *a * alpha + pb;
            }
            m = m_new;
            j0 = j1;
        }
        l += libm::expf(sinks[hh] - m);
        for a in acc.iter_mut() {
            *a = r_bf16(*a / l);
        }
    }
    core
}

/// The [`crate::faults::FaultKind::AttentionSplitKDecode`] fault: the
/// logits `e` (in place) become exponentials as a two-split decode kernel
/// computes them: each half of the keys against its own maximum m_i, then
/// rescaled to the global maximum `m` (`expf(l_j − m_i) · expf(m_i − m)`);
/// returns the normalizer without the sink, the halves' FP32 sums added.
fn split_k_exponentials(e: &mut [f32], m: f32) -> f32 {
    let half = e.len() / 2;
    let (lo, hi) = e.split_at_mut(half);
    let mut z = 0.0f32;
    for part in [lo, hi] {
        let mi = part.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let rescale = libm::expf(mi - m);
        let mut zi = 0.0f32;
        for ej in part.iter_mut() {
            *ej = libm::expf(*ej - mi) * rescale;
            zi += *ej;
        }
        z += zi;
    }
    z
}

/// De-rotation of each head's output, then the grouped output projection.
fn output_projection(
    aw: &AttnWeights,
    core: &mut [f32],
    cs: &CosSin,
    cx: &TokenCtx<'_>,
    rec: &mut Recorder<'_>,
) -> Result<Vec<f32>, RuntimeError> {
    let (cfg, p) = (cx.cfg, cx.p);
    let (h, d) = (cfg.num_heads, cfg.head_dim);
    if !cx.fx.attention.derotation_skipped {
        for oh in core.chunks_exact_mut(d) {
            match p {
                // vLLM: FP32 inverse RoPE with the fused forms, then R (rule 12).
                Precision::VllmCpu => {
                    let start = d - 2 * cs.cos.len();
                    crate::rope::apply_rope_vllm(oh, cs, true);
                    p.round_slice(&mut oh[start..]);
                }
                _ => apply_rope(oh, cs, true, p),
            }
        }
    }
    let (g, r) = (cfg.o_groups, cfg.o_lora_rank);
    let per_group = h * d / g;
    let mut u = vec![0.0f32; g * r];
    // wo_a is a BF16 GEMM in every profile (DeepSeek dequantizes it, M L536–541).
    // vllm-cpu: `bmm_cpu` on a BF16 copy of wo_a dequantized exactly (not
    // EXT), the forward's M deciding VDPBF16PS or AMX (§4.2.5 rules 2, 12).
    let rows = crate::vllm::forward_rows();
    for gi in 0..g {
        let x = &core[gi * per_group..(gi + 1) * per_group];
        let o = &mut u[gi * r..(gi + 1) * r];
        match p {
            Precision::VllmCpu => aw.wo_a.matvec_rows_vllm(gi * r, x, o, rows, false),
            _ => aw.wo_a.matvec_rows(gi * r, x, o),
        }
    }
    if let Some(gi) = cx.fx.output_group_truncate.map(|x| x.min(g.saturating_sub(1))) {
        u[gi * r..(gi + 1) * r]
            .iter_mut()
            .for_each(|v| *v = truncate_bf16(*v));
    }
    p.round_slice(&mut u);
    // Site Q7 (official profile): the input of the FP8 GEMM wo_b.
    let u_q = (p.quantizes() && aw.wo_b.quantizes_input()).then(|| {
        let skip = cx.fx.skip_quantization.contains(Component::AttnOLatFp8);
        official::gemm_input(&u, skip)
    });
    if let Some(v) = &u_q {
        rec.f32(Component::AttnOLatFp8, cx.at(), &[v.len() as u64], v)?;
    }
    Ok(if cx.fx.attn_output_truncate {
        truncated_linear(&aw.wo_b, u_q.as_deref().unwrap_or(&u), p)
    } else {
        official::linear(&aw.wo_b, &u, u_q.as_deref(), p)
    })
}

/// `W · x` with every FP32 result truncated to BF16 (low 16 bits cleared)
/// instead of rounded: the truncation faults. `x` is the GEMM's input as the
/// profile feeds it (the quantized input in the official profile).
fn truncated_linear(w: &crate::weights::Mat, x: &[f32], p: crate::precision::Precision) -> Vec<f32> {
    (0..w.rows())
        .map(|row| {
            let v = match p.quantizes() {
                true => w.dot_row_official(row, x),
                false => w.dot_row(row, x),
            };
            truncate_bf16(v)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::dot8;

    /// DeepSeek's `sparse_attn_kernel` written out literally for one head:
    /// the index list padded with −1 slots (window `win` slots, then the
    /// compressed keys), blocks of 64 slots with masked scores −∞ and masked
    /// values 0, every masked term included, the kernel's statements in
    /// order.
    fn kernel_literal(
        q: &[f32],
        window: &[Vec<f32>],
        compressed: &[Vec<f32>],
        win: usize,
        sink: f32,
    ) -> Vec<f32> {
        let d = q.len();
        let mut slots: Vec<Option<&Vec<f32>>> = window.iter().map(Some).collect();
        slots.resize(win.max(window.len()), None);
        slots.extend(compressed.iter().map(Some));
        let scale = (1.0f64 / d as f64).sqrt() as f32;
        let (mut scores_max, mut sum_exp) = (f32::NEG_INFINITY, 0.0f32);
        let mut acc_o = vec![0.0f32; d];
        let zero = vec![0.0f32; d];
        for block in slots.chunks(ATTN_BLOCK) {
            let kv: Vec<&Vec<f32>> = block.iter().map(|k| k.unwrap_or(&zero)).collect();
            let mut acc_s: Vec<f32> = block
                .iter()
                .zip(&kv)
                .map(|(k, v)| match k {
                    Some(_) => dot8(q, v),
                    None => f32::NEG_INFINITY,
                })
                .collect();
            acc_s.iter_mut().for_each(|v| *v *= scale);
            let prev = scores_max;
            scores_max = acc_s.iter().copied().fold(prev, f32::max);
            let scores_scale = libm::expf(prev - scores_max);
            acc_s.iter_mut().for_each(|v| *v = libm::expf(*v - scores_max));
            let scores_sum = acc_s.iter().fold(0.0f32, |a, b| a + b);
            sum_exp = sum_exp * scores_scale + scores_sum;
            let cast: Vec<f32> = acc_s.iter().map(|v| r_bf16(*v)).collect();
            let mut gemm = vec![0.0f32; d];
            for (p, v) in cast.iter().zip(&kv) {
                for c in 0..d {
                    gemm[c] += p * v[c];
                }
            }
            for c in 0..d {
                acc_o[c] = acc_o[c] * scores_scale + gemm[c];
            }
        }
        sum_exp += libm::expf(sink - scores_max);
        acc_o.iter().map(|v| r_bf16(v / sum_exp)).collect()
    }

    fn bf16_vec(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| r_bf16(((i as f32 + seed) * 0.731 * seed).sin() * 1.7))
            .collect()
    }

    /// The block-by-block online softmax equals the kernel's literal
    /// statements, masked slots included, bit for bit: a window not yet full
    /// (padding between window and compressed keys), a full window, key sets
    /// spanning several 64-slot blocks, and a sink larger than every score.
    #[test]
    fn online_blocks_equal_the_kernel_literally() {
        let (h, d) = (2usize, 16usize);
        let q: Vec<f32> = bf16_vec(h * d, 1.3);
        for &(n_window, win, n_comp, sink) in &[
            (1usize, 8usize, 0usize, 0.5f32),
            (5, 8, 3, -1.0),
            (8, 8, 70, 2.0),
            (40, 128, 30, 0.0),
            (128, 128, 150, 30.0),
        ] {
            let window: Vec<Vec<f32>> = (0..n_window).map(|j| bf16_vec(d, 2.0 + j as f32)).collect();
            let compressed: Vec<Vec<f32>> = (0..n_comp).map(|j| bf16_vec(d, 0.3 + j as f32 * 0.1)).collect();
            let keys: Vec<&[f32]> = window.iter().chain(&compressed).map(|v| v.as_slice()).collect();
            let layout = KeyLayout {
                n_window,
                compressed_slot: win,
            };
            let sinks = vec![sink, -sink];
            let got = attend_online_blocks(&q, &keys, layout, &sinks, h, d);
            for hh in 0..h {
                let want = kernel_literal(&q[hh * d..(hh + 1) * d], &window, &compressed, win, sinks[hh]);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got[hh * d..(hh + 1) * d]),
                    bits(&want),
                    "{n_window} {win} {n_comp} head {hh}"
                );
            }
        }
    }

    /// The result is the sink softmax of the scores (sink in the
    /// denominator only) within BF16 rounding.
    #[test]
    fn online_blocks_compute_the_sink_softmax() {
        let d = 8usize;
        let q = bf16_vec(d, 0.7);
        let keys_v: Vec<Vec<f32>> = (0..100).map(|j| bf16_vec(d, 1.0 + j as f32 * 0.01)).collect();
        let keys: Vec<&[f32]> = keys_v.iter().map(|v| v.as_slice()).collect();
        let layout = KeyLayout {
            n_window: 100,
            compressed_slot: 100,
        };
        let got = attend_online_blocks(&q, &keys, layout, &[0.25], 1, d);
        let scale = 1.0 / (d as f64).sqrt();
        let s: Vec<f64> = keys_v
            .iter()
            .map(|k| k.iter().zip(&q).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale)
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|v| (v - m).exp()).sum::<f64>() + (0.25 - m).exp();
        for c in 0..d {
            let o: f64 = s
                .iter()
                .zip(&keys_v)
                .map(|(v, k)| (v - m).exp() * k[c] as f64)
                .sum::<f64>()
                / z;
            assert!(
                (got[c] as f64 - o).abs() <= 1e-2 * o.abs().max(0.1),
                "{c}: {} vs {o}",
                got[c]
            );
        }
    }
}
