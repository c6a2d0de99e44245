//! The lightning indexer of CSA layers: its own compressor at width d_I
//! (crate::compressor), queries from the query latent, and top-k selection of
//! compressed entries (`modeling_deepseek_v4.py` L457-597; notes §2.4).
//!
//! `q^I = round(W^I_qb · q_lat)` viewed as H_I × d_I, each head rotated with the
//! "compress" rope at t. `ω_h = round(W^I_w · a)_h · H_I^(−1/2)` (FP32 product).
//! `score_i = Σ_h (ReLU(dot8(q_h, k_i)) · d_I^(−1/2)) · ω_h`, h ascending, FP32.
//! Selection: the min(K_I, T) entries of highest score, descending, ties to the
//! lower index (all T emitted entries are causal for the token that sees them).

use crate::config::ModelConfig;
use crate::error::RuntimeError;
use crate::kernels::dot8_f32_many;
use crate::linear::dot8;
use crate::precision::Precision;
use crate::rope::{apply_rope, CosSin};
use crate::state::CompressorState;
use crate::weights::{Mat, WeightLoader};

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

/// Scores every emitted indexer entry for the current token.
pub fn indexer_scores(
    iw: &IndexerWeights,
    st: &CompressorState,
    q_lat: &[f32],
    a: &[f32],
    cs: &CosSin,
    heads: usize,
    p: Precision,
) -> Vec<f32> {
    indexer_scores_with(iw, st, q_lat, a, cs, heads, p, false)
}

/// [`indexer_scores`], with the d_I^(−1/2) scale applied to each score's
/// head sum instead of to every head's term when `scale_after_sum` (the
/// [`crate::faults::FaultKind::IndexerScoreScaleAfterSum`] fault).
#[allow(clippy::too_many_arguments)] // the operator's inputs plus one fault switch
pub(crate) fn indexer_scores_with(
    iw: &IndexerWeights,
    st: &CompressorState,
    q_lat: &[f32],
    a: &[f32],
    cs: &CosSin,
    heads: usize,
    p: Precision,
    scale_after_sum: bool,
) -> Vec<f32> {
    let dim = st.dim;
    let mut q = iw.wq_b.linear(q_lat, p);
    for h in 0..heads {
        apply_rope(&mut q[h * dim..(h + 1) * dim], cs, false, p);
    }
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

/// Indices of the `k` highest scores, descending, ties to the lower index.
pub fn topk_desc(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}
