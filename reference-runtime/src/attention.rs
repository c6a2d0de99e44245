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

use moeconf_fingerprint::Component;

use crate::capture::Recorder;
use crate::compressor::{compressor_step_with, CompressorWeights};
use crate::config::{AttentionKind, ModelConfig};
use crate::context::TokenCtx;
use crate::error::RuntimeError;
use crate::faults::{keep_mantissa_bits, truncate_bf16, SumOrder};
use crate::indexer::{indexer_scores_with, topk_desc, IndexerWeights};
use crate::kernels::dot8_f32_many;
use crate::precision::Precision;
use crate::rmsnorm::{rmsnorm_unweighted_in_place, rmsnorm_weighted};
use crate::rope::{apply_rope, CosSin, RopeFreqs};
use crate::state::{CompressorRole, CompressorState, LayerState};
use crate::weights::{Mat, WeightLoader};

/// Weights of one attention block.
#[derive(Debug, Clone)]
pub struct AttnWeights {
    /// Layer kind.
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
    let cs = rope.cos_sin(t, p);

    let shifted;
    let q_cs = if cx.fx.attention.query_rope_off_by_one {
        shifted = rope.cos_sin(t + 1, p);
        &shifted
    } else {
        &cs
    };
    let (q_lat, q) = queries(aw, a, q_cs, cx);
    rec.f32(Component::AttnQ, at, &[h as u64, d as u64], &q)?;
    let kv = new_kv(aw, a, &cs, cx);
    rec.f32(Component::AttnKv, at, &[d as u64], &kv)?;
    store_kv(ls, &kv, cx);

    compress(aw, ls, a, ropes, cx, rec)?;
    let selected = select(aw, ls, a, &q_lat, ropes, cx, rec)?;
    let mut core = {
        let window = window_read(ls, cx);
        rec.f32(
            Component::AttnWindowRead,
            at,
            &[(window.len() / d) as u64, d as u64],
            window,
        )?;
        let compressed = compressed_read(aw.kind, ls, &selected);
        if let Some(c) = &compressed {
            rec.f32(
                Component::AttnCompressedRead,
                at,
                &[(c.len() / d) as u64, d as u64],
                c,
            )?;
        }
        let mut keys: Vec<&[f32]> = window.chunks_exact(d).collect();
        keys.extend(compressed.as_deref().unwrap_or(&[]).chunks_exact(d));
        attend(&q, &keys, &aw.sinks, cx)
    };
    rec.f32(Component::AttnCore, at, &[h as u64, d as u64], &core)?;
    let out = output_projection(aw, &mut core, &cs, cx);
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
/// is read without its oldest row.
fn window_read<'s>(ls: &'s LayerState, cx: &TokenCtx<'_>) -> &'s [f32] {
    let d = cx.cfg.head_dim;
    let rows = ls.window_kv.len() / d;
    if cx.fx.attention.window_read_drops_oldest && rows >= cx.cfg.sliding_window && rows > 0 {
        &ls.window_kv[d..]
    } else {
        &ls.window_kv
    }
}

/// The compressed entries attention reads from the cache (HCA: all; CSA: the
/// indexer's selection in ascending entry order), `None` on sliding layers.
fn compressed_read<'s>(
    kind: AttentionKind,
    ls: &'s LayerState,
    selected: &[usize],
) -> Option<Cow<'s, [f32]>> {
    let cst = ls.compressor.as_ref()?;
    Some(match kind {
        AttentionKind::Csa => {
            let mut sel = selected.to_vec();
            sel.sort_unstable();
            Cow::Owned(sel.iter().flat_map(|&i| cst.entry(i).iter().copied()).collect())
        }
        _ => Cow::Borrowed(&cst.compressed_kv),
    })
}

/// The query latent and the per-head queries after norm and RoPE.
fn queries(aw: &AttnWeights, a: &[f32], cs: &CosSin, cx: &TokenCtx<'_>) -> (Vec<f32>, Vec<f32>) {
    let (p, eps) = (cx.p, cx.cfg.rms_norm_eps);
    let q_lat = rmsnorm_weighted(&aw.wq_a.linear(a, p), &aw.q_norm, eps, p);
    let mut q = aw.wq_b.linear(&q_lat, p);
    for hq in q.chunks_exact_mut(cx.cfg.head_dim) {
        rmsnorm_unweighted_in_place(hq, eps, p);
        apply_rope(hq, cs, false, p);
    }
    (q_lat, q)
}

/// The position's new kv vector (norm, RoPE, and the kv precision fault).
fn new_kv(aw: &AttnWeights, a: &[f32], cs: &CosSin, cx: &TokenCtx<'_>) -> Vec<f32> {
    let p = cx.p;
    let mut kv = rmsnorm_weighted(&aw.wkv.linear(a, p), &aw.kv_norm, cx.cfg.rms_norm_eps, p);
    apply_rope(&mut kv, cs, false, p);
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
    let eps = cx.cfg.rms_norm_eps;
    let rows = cst.buffered();
    match compressor_step_with(cw, cst, a, &ropes.compress, eps, cx.p, cx.fx.compressor) {
        Some(entry) => {
            let d = cx.cfg.head_dim as u64;
            rec.f32(Component::AttnCompressed, cx.at(), &[1, d], &entry)?;
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
    q_lat: &[f32],
    ropes: &Ropes,
    cx: &TokenCtx<'_>,
    rec: &mut Recorder<'_>,
) -> Result<Vec<usize>, RuntimeError> {
    let (Some(iw), Some(ist)) = (&aw.indexer, ls.indexer.as_mut()) else {
        return Ok(Vec::new());
    };
    let (cfg, p, at) = (cx.cfg, cx.p, cx.at());
    let fx = cx.fx.indexer;
    let rows = ist.buffered();
    match compressor_step_with(
        &iw.compressor,
        ist,
        a,
        &ropes.compress,
        cfg.rms_norm_eps,
        p,
        fx.compressor,
    ) {
        Some(entry) => rec.f32(Component::AttnIndexerCompressed, at, &[1, ist.dim as u64], &entry)?,
        None => check_buffered(rec, ist, rows, cx, CompressorRole::Indexer)?,
    }
    let (t, d_i) = (ist.entry_count, ist.dim as u64);
    rec.f32(Component::AttnIndexerRead, at, &[t, d_i], &ist.compressed_kv)?;
    let ccs = ropes.compress.cos_sin(cx.position, p);
    let scores = indexer_scores_with(iw, ist, q_lat, a, &ccs, cfg.index_n_heads, p, fx.scale_after_sum);
    rec.f32(Component::AttnIndexerScores, at, &[scores.len() as u64], &scores)?;
    let mut k = cfg.index_topk.min(scores.len());
    if fx.topk_drops_last {
        k = k.saturating_sub(1);
    }
    let selected = topk_desc(&scores, k);
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
fn output_projection(aw: &AttnWeights, core: &mut [f32], cs: &CosSin, cx: &TokenCtx<'_>) -> Vec<f32> {
    let (cfg, p) = (cx.cfg, cx.p);
    let (h, d) = (cfg.num_heads, cfg.head_dim);
    if !cx.fx.attention.derotation_skipped {
        for oh in core.chunks_exact_mut(d) {
            apply_rope(oh, cs, true, p);
        }
    }
    let (g, r) = (cfg.o_groups, cfg.o_lora_rank);
    let per_group = h * d / g;
    let mut u = vec![0.0f32; g * r];
    for gi in 0..g {
        aw.wo_a.matvec_rows(
            gi * r,
            &core[gi * per_group..(gi + 1) * per_group],
            &mut u[gi * r..(gi + 1) * r],
        );
    }
    p.round_slice(&mut u);
    if cx.fx.attn_output_truncate {
        let mut o = aw.wo_b.linear(&u, Precision::F32);
        o.iter_mut().for_each(|v| *v = truncate_bf16(*v));
        o
    } else {
        aw.wo_b.linear(&u, p)
    }
}
