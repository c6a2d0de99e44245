//! The MoE router: sqrt-softplus scores, top-k selection with the correction
//! bias (selection only), hash routing through `tid2eid`, and the normalised
//! gate weights (`modeling_deepseek_v4.py` L1079-1128; notes §2.6).
//!
//! `logit = round(dot8(W_gate_e, f))`; `s_e = round(sqrt(round(softplus(logit))))`
//! with softplus(x) = x for x > 20, else `libm::log1pf(libm::expf(x))`.
//! moe layers: selection score `σ_e = s_e + b_e` (FP32); experts sorted by σ
//! descending, ties to the lower id (IEEE total order); the first k are the
//! selection, in that order. hash_moe layers: the k ids of `tid2eid[token]` in
//! row order. Gates: `S = round(Σ_j s_{idx_j} + 1e−20)` (selection order, FP32),
//! `g_j = round(round(s_{idx_j} / S) · routed_scaling_factor)`. The official
//! profile has no rounding point here (DeepSeek's gate is FP32 throughout);
//! its `+ 1e−20` (HF's) is kept, and changes no FP32 sum of positive scores.

use crate::config::{MlpKind, ModelConfig};
use crate::error::RuntimeError;
use crate::faults::RouterFaults;
use crate::precision::Precision;
use crate::weights::{Mat, WeightLoader};
use moeconf_contract::bf16::r_bf16;

/// Router weights of one layer.
#[derive(Debug, Clone)]
pub struct RouterWeights {
    /// W_gate `[E, D]`.
    pub gate: Mat,
    /// Correction bias `[E]` (moe layers).
    pub bias: Option<Vec<f32>>,
    /// `tid2eid` `[V, k]` row-major (hash_moe layers).
    pub tid2eid: Option<Vec<u32>>,
}

impl RouterWeights {
    /// Loads `layers.{i}.ffn.gate.*`.
    pub fn load(w: &mut WeightLoader, cfg: &ModelConfig, i: usize) -> Result<RouterWeights, RuntimeError> {
        Self::load_at(w, cfg, &format!("layers.{i}.ffn.gate"), cfg.mlp_layer_types[i])
    }

    /// Loads the router under `p` (`layers.{i}.ffn.gate`, `mtp.{j}.ffn.gate`) of routing `kind`.
    pub fn load_at(
        w: &mut WeightLoader,
        cfg: &ModelConfig,
        p: &str,
        kind: MlpKind,
    ) -> Result<RouterWeights, RuntimeError> {
        let e = cfg.n_routed_experts;
        let gate = w.mat(&format!("{p}.weight"), e, cfg.hidden_size)?;
        Ok(match kind {
            MlpKind::Moe => RouterWeights {
                gate,
                bias: Some(w.vec_f32(&format!("{p}.bias"), &[e])?),
                tid2eid: None,
            },
            MlpKind::HashMoe => RouterWeights {
                gate,
                bias: None,
                tid2eid: Some(w.ids(&format!("{p}.tid2eid"), &[cfg.vocab_size, cfg.experts_per_tok], e)?),
            },
        })
    }
}

/// The routing decision for one token.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// s_e for every expert (before the correction bias).
    pub scores: Vec<f32>,
    /// Selected experts, in selection order.
    pub topk: Vec<u32>,
    /// Gate weights g_j, same order.
    pub gates: Vec<f32>,
    /// σ of rank k minus σ of rank k+1 (moe layers with E > k).
    pub margin: Option<f32>,
}

/// softplus with β = 1 and threshold 20 (torch semantics), libm transcendentals.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        libm::log1pf(libm::expf(x))
    }
}

/// Routes one token (`token` is needed by hash layers), with calibration
/// faults: selection ranks k and k+1 swapped on
/// moe layers (`near_tie_flip`, [`crate::faults::FaultKind::RouterNearTieFlip`])
/// and the other router faults of `fx`.
pub(crate) fn route_with(
    rw: &RouterWeights,
    f: &[f32],
    token: u32,
    cfg: &ModelConfig,
    p: Precision,
    near_tie_flip: bool,
    fx: RouterFaults,
) -> Routing {
    // The official profile's router is FP32 throughout (no rounding point).
    let p = p.router();
    let logits = rw.gate.linear(f, p);
    let sp = |x: f32| match fx.softplus_bf16_exp {
        true if x <= 20.0 => libm::log1pf(r_bf16(libm::expf(x))),
        _ => softplus(x),
    };
    // vllm-cpu: vLLM's FP32 scores (topk.cpp `sqrtsoftplus`, §4.1).
    let scores: Vec<f32> = match p {
        Precision::VllmCpu => logits.iter().map(|&l| crate::vllm::sqrt_softplus(l)).collect(),
        _ => logits.iter().map(|&l| p.round(p.round(sp(l)).sqrt())).collect(),
    };
    let k = cfg.experts_per_tok;
    let (topk, margin) = match (&rw.tid2eid, &rw.bias) {
        (Some(t), _) => {
            let id = match fx.hash_next_row {
                true => (token as usize + 1) % cfg.vocab_size,
                false => token as usize,
            };
            let row = id * k;
            (t[row..row + k].to_vec(), None)
        }
        (None, bias) => {
            let sel: Vec<f32> = scores
                .iter()
                .enumerate()
                .map(|(e, s)| s + bias.as_ref().map_or(0.0, |b| b[e]))
                .collect();
            let mut idx: Vec<usize> = (0..sel.len()).collect();
            idx.sort_by(|&a, &b| sel[b].total_cmp(&sel[a]).then(a.cmp(&b)));
            if near_tie_flip && idx.len() > k && k > 0 {
                idx.swap(k - 1, k);
            }
            let margin = idx.get(k).map(|&next| sel[idx[k - 1]] - sel[next]);
            (idx[..k].iter().map(|&e| e as u32).collect(), margin)
        }
    };
    if p == Precision::VllmCpu {
        let picked: Vec<f32> = topk.iter().map(|&e| scores[e as usize]).collect();
        let gates = crate::vllm::route_weights(&picked, cfg.routed_scaling_factor);
        return Routing {
            scores,
            topk,
            gates,
            margin,
        };
    }
    let mut sum = 0.0f32;
    for &e in &topk {
        sum += scores[e as usize];
    }
    let den = p.round(sum + 1e-20);
    let gates = topk
        .iter()
        .map(|&e| {
            let s = scores[e as usize];
            match fx.gate_scale_first {
                false => p.round(p.round(s / den) * cfg.routed_scaling_factor),
                true => p.round(p.round(s * cfg.routed_scaling_factor) / den),
            }
        })
        .collect();
    Routing {
        scores,
        topk,
        gates,
        margin,
    }
}
