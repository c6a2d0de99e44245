//! The output head: mHC head collapse, final RMSNorm, LM head, and the greedy
//! choice (`modeling_deepseek_v4.py` L1001-1017, L1381, L1527; notes §2.7).
//!
//! `y = hc_head(X)` (crate::mhc), `h = rmsnorm_w(y, norm)`, `logits = round(W_lm·h)`
//! (not rounded in the official profile: FP32 logits, as DeepSeek's head).
//! Greedy: the highest logit, ties to the lowest id (NaN never wins: IEEE
//! total order with NaN treated as below everything).

use crate::config::ModelConfig;
use crate::error::RuntimeError;
use crate::mhc::{hc_head, HcHead};
use crate::precision::Precision;
use crate::rmsnorm::rmsnorm_weighted;
use crate::weights::{Mat, WeightLoader};

#[derive(Debug, Clone)]
pub struct HeadWeights {
    /// mHC head collapse.
    pub hc: HcHead,
    /// Final norm weight `[D]`.
    pub norm: Vec<f32>,
    /// LM head `[V, D]`.
    pub lm_head: Mat,
}

impl HeadWeights {
    /// Loads `hc_head_*`, `norm.weight`, `head.weight`.
    pub fn load(w: &mut WeightLoader, cfg: &ModelConfig) -> Result<HeadWeights, RuntimeError> {
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        Ok(HeadWeights {
            hc: HcHead {
                fn_: w.mat("hc_head_fn", n, n * d)?,
                base: w.vec_f32("hc_head_base", &[n])?,
                scale: w.vec_f32("hc_head_scale", &[1])?,
            },
            norm: w.vec_f32("norm.weight", &[d])?,
            lm_head: w.mat("head.weight", cfg.vocab_size, d)?,
        })
    }
}

/// Logits of the final residual streams.
pub fn head_forward(hw: &HeadWeights, streams: &[f32], cfg: &ModelConfig, p: Precision) -> Vec<f32> {
    head_forward_with(hw, streams, cfg, p, cfg.rms_norm_eps)
}

/// [`head_forward`] with the final RMSNorm's ε given (the config's, or a
/// [`crate::faults::FaultKind::HeadNormEpsilon`] fault's).
pub(crate) fn head_forward_with(
    hw: &HeadWeights,
    streams: &[f32],
    cfg: &ModelConfig,
    p: Precision,
    norm_eps: f32,
) -> Vec<f32> {
    let y = hc_head(&hw.hc, streams, cfg.hc_mult, cfg.rms_norm_eps, cfg.hc_eps, p);
    let h = rmsnorm_weighted(&y, &hw.norm, norm_eps, p);
    match p {
        // vLLM computes the logits of the last token only: an M = 1 BF16 GEMM
        // (a VDPBF16PS chain), BF16 logits (§4.2.5 rule 13, `compute_logits`).
        Precision::VllmCpu => hw.lm_head.linear_vllm(&h, 1),
        _ => hw.lm_head.linear(&h, p.logits()),
    }
}

fn key(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else {
        v
    }
}

/// Largest `k` [`topk_logits`] answers in one pass over the logits.
const SMALL_K: usize = 64;

/// [`topk_logits`] for small `k` in one pass: the best `k` so far, kept in
/// order. Ids arrive in increasing order, so a later id enters only with a
/// strictly larger key than the one it displaces and goes after every equal
/// key already held (ties to the lower id; −0 and +0 are equal keys, as in
/// the sort). Same ids in the same order as the sort, without touching the
/// vocabulary twice (this runs on every captured step's logits).
fn topk_small(logits: &[f32], k: usize) -> Vec<u32> {
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for (i, &v) in logits.iter().enumerate() {
        let kv = key(v);
        if best.len() == k && best.last().is_some_and(|&(w, _)| kv <= w) {
            continue;
        }
        let at = best.partition_point(|&(w, _)| w >= kv);
        best.insert(at, (kv, i as u32));
        best.truncate(k);
    }
    best.into_iter().map(|(_, i)| i).collect()
}

/// The `k` best ids by logit, descending, ties to the lower id.
pub fn topk_logits(logits: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    // (key, id) is a strict total order (keys are never NaN), so the k first
    // ids are unique: partition around the k-th, then sort only those
    // (not the whole vocabulary).
    let order = |a: &u32, b: &u32| {
        key(logits[*b as usize])
            .partial_cmp(&key(logits[*a as usize]))
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    };
    if k == 0 {
        return Vec::new();
    }
    if k <= SMALL_K {
        return topk_small(logits, k);
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_by(order);
    idx
}

/// Greedy argmax (ties to the lowest id).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if key(v) > key(logits[best]) {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_to_the_lowest_id_and_nan_never_wins() {
        let l = [1.0, 3.0, f32::NAN, 3.0, -0.0, 0.0, 2.0];
        assert_eq!(argmax(&l), 1);
        assert_eq!(topk_logits(&l, 7), vec![1, 3, 6, 0, 4, 5, 2]);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[f32::NAN, -1.0]), 1);
        for k in 0..=8 {
            assert_eq!(
                topk_logits(&l, k),
                [1, 3, 6, 0, 4, 5, 2][..k.min(7)].to_vec(),
                "k = {k}"
            );
        }
    }

    #[test]
    fn top_k_equals_the_first_k_of_a_full_sort() {
        // Many ties (values on a coarse grid), signed zeros and NaNs.
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let l: Vec<f32> = (0..5000)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                match s % 50 {
                    0 => f32::NAN,
                    1 => -0.0,
                    2 => 0.0,
                    v => (v % 17) as f32 - 8.0,
                }
            })
            .collect();
        let mut full: Vec<u32> = (0..l.len() as u32).collect();
        full.sort_by(|&a, &b| {
            key(l[b as usize])
                .partial_cmp(&key(l[a as usize]))
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        for k in [1usize, 2, 7, 8, 9, 63, 64, 65, 100, 4999, 5000, 6000] {
            assert_eq!(topk_logits(&l, k), full[..k.min(l.len())].to_vec(), "k = {k}");
        }
    }
}
