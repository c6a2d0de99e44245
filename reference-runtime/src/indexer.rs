//! The lightning indexer of CSA layers: its own compressor at width d_I
//! (crate::compressor), queries from the query latent, and top-k selection of
//! compressed entries (`modeling_deepseek_v4.py` L457-597; notes §2.4).
//!
//! `q^I = round(W^I_qb · q_lat)` viewed as H_I × d_I, each head rotated with the
//! "compress" rope at t. `ω_h = round(W^I_w · a)_h · H_I^(−1/2)` (FP32 product).
//! `score_i = Σ_h (ReLU(dot8(q_h, k_i)) · d_I^(−1/2)) · ω_h`, h ascending, FP32.
//! Selection: the min(K_I, T) entries of highest score, descending, ties to the
//! lower index (all T emitted entries are causal for the token that sees them).
//!
//! The official profile scores in BF16 as DeepSeek's `Indexer.forward` does
//! (`inference/model.py` L417–421; [`indexer_scores_bf16`]): `w_h =
//! R(R(W^I_w·a)_h ⊗ fp32(d_I^(−1/2)·H_I^(−1/2)))`, `s_hi = R(dot8(q_h, k_i))`
//! (the BF16 einsum), `score_i = R(Σ_h R(max(s_hi, 0) ⊗ w_h))` (FP32 sum from
//! +0 in h order, one rounding), R = R_BF16.

use crate::config::ModelConfig;
use crate::error::RuntimeError;
use crate::kernels::dot8_f32_many;
use crate::linear::dot8;
use crate::precision::Precision;
use crate::rope::{apply_rope, CosSin};
use crate::state::CompressorState;
use crate::weights::{Mat, WeightLoader};
use moeconf_contract::bf16::r_bf16;

use crate::compressor::CompressorWeights;

/// Weights of the lightning indexer.
#[derive(Debug, Clone)]
pub struct IndexerWeights {
    /// The indexer's compressor (overlapping, width d_I).
    pub compressor: CompressorWeights,
    /// W^I_qb, `[H_I·d_I, q_lora_rank]`.
    pub wq_b: Mat,
    /// W^I_w (`weights_proj`), `[H_I, D]`.
    pub weights_proj: Mat,
}

impl IndexerWeights {
    /// Loads `{prefix}.compressor.*`, `{prefix}.wq_b.weight`,
    /// `{prefix}.weights_proj.weight` with the sizes of `cfg` (H_I heads of
    /// width d_I, the CSA compress rate).
    pub fn load(
        w: &mut WeightLoader,
        prefix: &str,
        cfg: &ModelConfig,
    ) -> Result<IndexerWeights, RuntimeError> {
        let (d_model, heads, dim) = (cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim);
        Ok(IndexerWeights {
            compressor: CompressorWeights::load(
                w,
                &format!("{prefix}.compressor"),
                d_model,
                dim,
                cfg.csa_rate,
                true,
            )?,
            wq_b: w.linear(
                &format!("{prefix}.wq_b.weight"),
                heads * dim,
                cfg.q_lora_rank,
                cfg.weights.dense,
            )?,
            weights_proj: w.mat(&format!("{prefix}.weights_proj.weight"), heads, d_model)?,
        })
    }
}

/// The indexer queries `q^I = rope(round(W^I_qb · q_lat))`, per head (`[H_I·d_I]`);
/// in the official profile `q_lat_q` is site Q2 (the quantized `q_lat`), read
/// by a quantized `W^I_qb`.
pub(crate) fn indexer_queries(
    iw: &IndexerWeights,
    q_lat: &[f32],
    q_lat_q: Option<&[f32]>,
    cs: &CosSin,
    heads: usize,
    dim: usize,
    p: Precision,
) -> Vec<f32> {
    let mut q = crate::official::linear(&iw.wq_b, q_lat, q_lat_q, p);
    for h in 0..heads {
        apply_rope(&mut q[h * dim..(h + 1) * dim], cs, false, p);
    }
    q
}

/// The scores of every emitted entry for the queries `q` (`[H_I·d_I]`), with
/// the d_I^(−1/2) scale applied to each score's head sum instead of to every
/// head's term when `scale_after_sum` (the
/// [`crate::faults::FaultKind::IndexerScoreScaleAfterSum`] fault).
pub(crate) fn indexer_scores_from(
    iw: &IndexerWeights,
    st: &CompressorState,
    q: &[f32],
    a: &[f32],
    heads: usize,
    p: Precision,
    scale_after_sum: bool,
) -> Vec<f32> {
    let dim = st.dim;
    let w_scale = 1.0 / (heads as f32).sqrt();
    let omega: Vec<f32> = iw.weights_proj.linear(a, p).iter().map(|v| v * w_scale).collect();
    let s_scale = 1.0 / (dim as f32).sqrt();
    let q_heads: Vec<&[f32]> = q.chunks_exact(dim.max(1)).take(heads).collect();
    let mut dots = vec![0.0f32; q_heads.len()];
    (0..st.entry_count as usize)
        .map(|i| {
            let k = st.entry(i);
            // dot8(q_h, k_i) for every head at once (same bits: the product is commutative).
            dot8_f32_many(&q_heads, k, &mut dots);
            let mut acc = 0.0f32;
            for h in 0..heads {
                let dot = dots
                    .get(h)
                    .copied()
                    .unwrap_or_else(|| dot8(&q[h * dim..(h + 1) * dim], k));
                acc += match scale_after_sum {
                    false => (dot.max(0.0) * s_scale) * omega[h],
                    true => dot.max(0.0) * omega[h],
                };
            }
            if scale_after_sum {
                acc * s_scale
            } else {
                acc
            }
        })
        .collect()
}

/// The FP32 factor of DeepSeek's indexer weights, `softmax_scale ·
/// n_heads ** -0.5` evaluated in Python floats (f64) and converted to FP32
/// by the BF16 multiply (M L404, L417).
pub fn index_weight_scale(dim: usize, heads: usize) -> f32 {
    (libm::pow(dim as f64, -0.5) * libm::pow(heads as f64, -0.5)) as f32
}

/// One entry's BF16 score from its per-head FP32 dot products `dots[h] =
/// dot8(q_h, k_i)` and the BF16 weights `w`: `R(Σ_h R(max(R(dots[h]), 0) ⊗
/// w_h))`, the sum in FP32 from +0 in increasing h (M L418–419: the BF16
/// einsum, `relu_`, the BF16 product, `sum(dim=2)` of a BF16 tensor).
pub fn index_score_bf16(dots: &[f32], w: &[f32]) -> f32 {
    let acc = dots
        .iter()
        .zip(w)
        .fold(0.0f32, |acc, (d, wh)| acc + r_bf16(r_bf16(*d).max(0.0) * wh));
    r_bf16(acc)
}

/// The official profile's indexer scores (see the module docs): every
/// emitted entry scored in BF16 for the queries `q` (`[H_I·d_I]`, site Q6).
pub(crate) fn indexer_scores_bf16(
    iw: &IndexerWeights,
    st: &CompressorState,
    q: &[f32],
    a: &[f32],
    heads: usize,
) -> Vec<f32> {
    let dim = st.dim;
    let scale = index_weight_scale(dim, heads);
    // weights_proj is a BF16 GEMM with a BF16 result (M L394), times the scale in BF16.
    let w: Vec<f32> = iw
        .weights_proj
        .linear(a, Precision::Bf16)
        .iter()
        .map(|v| r_bf16(v * scale))
        .collect();
    let q_heads: Vec<&[f32]> = q.chunks_exact(dim.max(1)).take(heads).collect();
    let mut dots = vec![0.0f32; q_heads.len()];
    (0..st.entry_count as usize)
        .map(|i| {
            dot8_f32_many(&q_heads, st.entry(i), &mut dots);
            index_score_bf16(&dots, &w)
        })
        .collect()
}

/// Indices of the `k` highest scores, descending, ties to the lower index.
pub fn topk_desc(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The torch expression of M L417–419 evaluated step by step on BF16
    /// tensors: the einsum's BF16 result, `relu_`, the BF16 product with the
    /// weights, and the head sum of a BF16 tensor (FP32 accumulation, one
    /// BF16 result), bit for bit.
    #[test]
    fn bf16_scores_round_where_torch_does() {
        let heads = 8;
        let dots: Vec<f32> = (0..heads).map(|h| ((h as f32) * 1.37).sin() * 3.3).collect();
        let raw_w: Vec<f32> = (0..heads).map(|h| r_bf16(((h as f32) * 0.61).cos())).collect();
        let scale = index_weight_scale(128, heads);
        assert_eq!(scale, (1.0f64 / (128.0f64.sqrt() * (heads as f64).sqrt())) as f32);
        let w: Vec<f32> = raw_w.iter().map(|v| r_bf16(v * scale)).collect();
        let einsum: Vec<f32> = dots.iter().map(|d| r_bf16(*d)).collect();
        let relu: Vec<f32> = einsum.iter().map(|v| if *v > 0.0 { *v } else { 0.0 }).collect();
        let prod: Vec<f32> = relu.iter().zip(&w).map(|(r, w)| r_bf16(r * w)).collect();
        let mut sum = 0.0f32;
        for v in &prod {
            sum += v;
        }
        assert_eq!(index_score_bf16(&dots, &w).to_bits(), r_bf16(sum).to_bits());
        // Negative dot products contribute nothing.
        assert_eq!(index_score_bf16(&[-1.0, -2.0], &[0.5, 0.5]), 0.0);
    }
}
