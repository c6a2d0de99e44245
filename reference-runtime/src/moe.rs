//! Clamped-SwiGLU routed experts and the shared expert; the combine goes only
//! through the pluggable [`MoeCombine`] (`modeling_deepseek_v4.py` L1020-1076;
//! notes §2.6).
//!
//! Expert: `γ = min(round(W1·f), L)`, `υ = clamp(round(W3·f), −L, L)`,
//! `h = round(round(silu(γ)) · υ)` with silu(x) = x / (1 + libm::expf(−x)),
//! `y = round(W2·h)`. Routed term `v_j = g_j · y_{idx_j}` (FP32 product, not
//! rounded: the combine decides). The shared expert's `y` is passed as is.
//! Experts run in parallel (rayon) over independent outputs only.

use moeconf_fingerprint::Level;
use rayon::prelude::*;

use crate::capture::{CaptureError, Recorder};
use crate::config::ModelConfig;
use crate::error::RuntimeError;
use crate::linear::PAR_MIN_EXPERT_WORK;
use crate::precision::Precision;
use crate::router::{route_with, RouterWeights};
use crate::weights::{Mat, WeightLoader};
use moeconf_contract::{CombineEvent, MoeCombine};

/// One SwiGLU expert (`w1` gate, `w3` up, `w2` down).
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    /// W1 `[I, D]`.
    pub w1: Mat,
    /// W3 `[I, D]`.
    pub w3: Mat,
    /// W2 `[D, I]`.
    pub w2: Mat,
}

impl ExpertWeights {
    /// Loads `{prefix}.w1.weight`, `.w3.weight`, `.w2.weight`.
    pub fn load(
        w: &mut WeightLoader,
        prefix: &str,
        d: usize,
        i: usize,
    ) -> Result<ExpertWeights, RuntimeError> {
        Ok(ExpertWeights {
            w1: w.mat(&format!("{prefix}.w1.weight"), i, d)?,
            w3: w.mat(&format!("{prefix}.w3.weight"), i, d)?,
            w2: w.mat(&format!("{prefix}.w2.weight"), d, i)?,
        })
    }
}

/// silu(x) = x / (1 + exp(−x)).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + libm::expf(-x))
}

/// The clamped SwiGLU expert output `y` (length D).
pub fn expert_forward(ew: &ExpertWeights, f: &[f32], limit: f32, p: Precision) -> Vec<f32> {
    let gamma = ew.w1.linear(f, p);
    let up = ew.w3.linear(f, p);
    let h: Vec<f32> = gamma
        .iter()
        .zip(&up)
        .map(|(&g, &u)| {
            let g = g.min(limit);
            let u = u.clamp(-limit, limit);
            p.round(p.round(silu(g)) * u)
        })
        .collect();
    ew.w2.linear(&h, p)
}

/// MoE weights of one layer.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// Router.
    pub router: RouterWeights,
    /// Routed experts, by id.
    pub experts: Vec<ExpertWeights>,
    /// The shared expert.
    pub shared: ExpertWeights,
}

impl MoeWeights {
    /// Loads `layers.{i}.ffn.*`.
    pub fn load(w: &mut WeightLoader, cfg: &ModelConfig, i: usize) -> Result<MoeWeights, RuntimeError> {
        let (d, iw) = (cfg.hidden_size, cfg.moe_intermediate_size);
        let router = RouterWeights::load(w, cfg, i)?;
        let experts = (0..cfg.n_routed_experts)
            .map(|e| ExpertWeights::load(w, &format!("layers.{i}.ffn.experts.{e}"), d, iw))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = ExpertWeights::load(w, &format!("layers.{i}.ffn.shared_experts"), d, iw)?;
        Ok(MoeWeights {
            router,
            experts,
            shared,
        })
    }
}

/// Identifies where an MoE forward runs (for the combine event and capture).
#[derive(Debug, Clone, Copy)]
pub struct MoeSite {
    /// Decoder layer.
    pub layer: u32,
    /// Forward step.
    pub step: u32,
    /// Absolute token position.
    pub position: u32,
    /// Token id at this position (hash routing).
    pub token: u32,
}

/// Router + experts + shared expert + combine for one token.
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_forward(
    mw: &MoeWeights,
    f: &[f32],
    cfg: &ModelConfig,
    site: MoeSite,
    p: Precision,
    combine: &dyn MoeCombine,
    rec: &mut Recorder<'_>,
    fx: &crate::faults::Active<'_>,
) -> Result<Vec<f32>, CaptureError> {
    let (t, l) = (site.position, Some(site.layer));
    let r = route_with(&mw.router, f, site.token, cfg, p, fx.router_flip);
    let k = r.topk.len() as u64;
    rec.f32(
        Level::L3,
        t,
        l,
        "router.scores",
        &[r.scores.len() as u64],
        &r.scores,
    )?;
    let ids: Vec<i32> = r.topk.iter().map(|&e| e as i32).collect();
    rec.i32(Level::L3, t, l, "router.topk", &ids)?;
    rec.f32(Level::L3, t, l, "router.gates", &[k], &r.gates)?;
    if let Some(m) = r.margin {
        rec.f32(Level::L3, t, l, "router.margin", &[1], &[m])?;
    }
    // Experts 0..k-1 in selection order, then the shared expert (index k).
    // Each expert output is independent; run them on rayon only when an expert
    // is big enough to pay for the scheduling (results are identical either way).
    let one = |j: usize| match r.topk.get(j) {
        Some(&e) => expert_forward(&mw.experts[e as usize], f, cfg.swiglu_limit, p),
        None => expert_forward(&mw.shared, f, cfg.swiglu_limit, p),
    };
    let outs: Vec<Vec<f32>> = if 3 * cfg.moe_intermediate_size * cfg.hidden_size >= PAR_MIN_EXPERT_WORK {
        (0..=r.topk.len()).into_par_iter().map(one).collect()
    } else {
        (0..=r.topk.len()).map(one).collect()
    };
    let mut terms: Vec<Vec<f32>> = Vec::with_capacity(r.topk.len());
    for (j, g) in r.gates.iter().enumerate() {
        terms.push(outs[j].iter().map(|y| g * y).collect());
    }
    let shared = &outs[r.topk.len()];
    let dm = cfg.hidden_size as u64;
    if rec.wants(Level::L4) {
        for (j, v) in terms.iter().enumerate() {
            rec.f32(Level::L4, t, l, &format!("moe.term.{j}"), &[dm], v)?;
        }
        rec.f32(Level::L4, t, l, "moe.shared", &[dm], shared)?;
    }
    let term_refs: Vec<&[f32]> = terms.iter().map(|v| v.as_slice()).collect();
    let event = CombineEvent {
        layer: site.layer,
        step: site.step,
        position: site.position,
        experts: &r.topk,
    };
    let mut y = vec![0.0f32; cfg.hidden_size];
    combine.combine(&event, &term_refs, shared, &mut y);
    rec.f32(Level::L4, t, l, "moe.combine", &[dm], &y)?;
    Ok(y)
}
