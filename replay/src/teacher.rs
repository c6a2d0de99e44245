//! Token teacher forcing: the reference runs on the candidate's token
//! sequence (the prompt, then every token the candidate consumed) instead
//! of its own greedy choices, so its logits can be compared with the
//! candidate's at every step, even after the first token that differs —
//! like `llama-perplexity --kl-divergence`.
//!
//! Per step: the KL divergence KL(P_ref ‖ P_cand) = Σ_i p_i (ln p_i − ln q_i)
//! in nats (natural logarithm), with P_ref the reference's softmax and
//! P_cand the candidate's (the direction of llama-perplexity, whose base
//! run is the reference); computed in f64 with `libm`'s `exp`/`log`, the
//! log-sum-exp and the KL sum both in ascending vocabulary order, terms
//! with p_i = 0 skipped. The top-k overlap counts the ids in both top-k
//! sets (ties to the lower id, as `lm.topk_ids`), and argmax agreement
//! compares the two top-1 ids.

use moeconf_fingerprint::{Component, Level};
use moeconf_reference_runtime::capture::{CaptureSink, MemorySink, NullSink, Record};
use moeconf_reference_runtime::head::{argmax, topk_logits};
use moeconf_reference_runtime::model::StepOptions;
use moeconf_runner::LoadedModel;
use moeconf_schema::Trace;
use serde_json::{json, Value};

use crate::candidate::{Candidate, Cmp};
use crate::error::{ReplayError, Result};
use crate::report::REPLAY_SCHEMA_VERSION;
use crate::setup::reference_for;
use crate::units::steps;

#[derive(Debug, Clone)]
pub struct TeacherOptions {
    /// k of the top-k overlap.
    pub top_k: usize,
    /// The reference's precision profile instead of the binding's.
    pub precision: Option<moeconf_reference_runtime::precision::Precision>,
    /// Also compare every layer's `layer.post_ffn_mhc` (L3) per step.
    pub l3: bool,
    /// The reference's aggregation contract instead of the binding's.
    pub contract: Option<String>,
}

impl Default for TeacherOptions {
    fn default() -> Self {
        TeacherOptions {
            top_k: 8,
            precision: None,
            l3: false,
            contract: None,
        }
    }
}

/// The L3 comparison of one layer at one step: the layer's output streams
/// (`layer.post_ffn_mhc`) at every position of the step.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerMetrics {
    pub layer: u32,
    /// Bitwise equal at every position.
    pub identical: bool,
    /// max |reference − candidate| over the positions (f64, NaN-propagating);
    /// `None` when the candidate kept no payload.
    pub max_abs_diff: Option<f64>,
}

/// The comparison of one step's logits.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMetrics {
    /// Forward step.
    pub step: u32,
    /// The position of the logits (the step's last).
    pub position: u32,
    /// KL(P_ref ‖ P_cand) in nats; `None` when either side holds a NaN or
    /// +∞ logit (undefined).
    pub kl: Option<f64>,
    /// Ids in both top-k sets.
    pub topk_overlap: usize,
    /// The reference's argmax.
    pub argmax_reference: u32,
    /// The candidate's argmax.
    pub argmax_candidate: u32,
    /// The two logit vectors are bitwise equal.
    pub identical: bool,
    /// With [`TeacherOptions::l3`]: every layer, ascending.
    pub layers: Vec<LayerMetrics>,
}

/// The teacher-forced comparison of every step.
#[derive(Debug, Clone, PartialEq)]
pub struct TeacherReport {
    /// The candidate trace.
    pub candidate: String,
    pub model: String,
    /// Precision profile of the reference.
    pub precision: String,
    /// Contract of the reference.
    pub contract: String,
    /// Schedule of the reference (without a fork).
    pub schedule: String,
    /// k of the top-k overlap.
    pub top_k: usize,
    /// One row per step, ascending.
    pub steps: Vec<StepMetrics>,
    /// Whether L3 was compared.
    pub l3: bool,
    /// The candidate's completeness when it lacks steps of its run (only
    /// the steps present were compared).
    pub incomplete: Option<moeconf_schema::Completeness>,
}

/// ln p_i of a logit vector in f64, in ascending index order; `None` with
/// a NaN or +∞ logit.
fn log_softmax(logits: &[f32]) -> Option<Vec<f64>> {
    if logits.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
        return None;
    }
    let m = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    if m == f64::NEG_INFINITY {
        return None;
    }
    let mut s = 0f64;
    for &x in logits {
        s += libm::exp(f64::from(x) - m);
    }
    let lse = m + libm::log(s);
    Some(logits.iter().map(|&x| f64::from(x) - lse).collect())
}

/// KL(P ‖ Q) in nats of two logit vectors (module docs).
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> Option<f64> {
    if p_logits.len() != q_logits.len() {
        return None;
    }
    let (lp, lq) = (log_softmax(p_logits)?, log_softmax(q_logits)?);
    let mut kl = 0f64;
    for (a, b) in lp.iter().zip(&lq) {
        let p = libm::exp(*a);
        if p > 0.0 {
            kl += p * (a - b);
        }
    }
    Some(kl.max(0.0))
}

fn metrics(step: u32, position: u32, r: &[f32], c: &[f32], k: usize) -> StepMetrics {
    let k = k.min(r.len());
    let (tr, tc) = (topk_logits(r, k), topk_logits(c, k));
    StepMetrics {
        step,
        position,
        kl: kl_divergence(r, c),
        topk_overlap: tr.iter().filter(|i| tc.contains(i)).count(),
        argmax_reference: argmax(r),
        argmax_candidate: argmax(c),
        identical: r.len() == c.len() && r.iter().zip(c).all(|(a, b)| a.to_bits() == b.to_bits()),
        layers: Vec::new(),
    }
}

/// The L3 comparison of one step: the reference's `layer.post_ffn_mhc`
/// records against the candidate's, per layer.
fn layer_metrics(cand: &Candidate<'_>, records: &[Record], layers: u32) -> Result<Vec<LayerMetrics>> {
    let mut out: Vec<LayerMetrics> = (0..layers)
        .map(|layer| LayerMetrics {
            layer,
            identical: true,
            max_abs_diff: Some(0.0),
        })
        .collect();
    for r in records
        .iter()
        .filter(|r| Component::LayerPostFfnMhc.matches(&r.coord.path))
    {
        let Some(lm) = r.coord.layer.and_then(|l| out.get_mut(l as usize)) else {
            continue;
        };
        lm.identical &= cand.compare(r)? == Cmp::Same;
        let c = &r.coord;
        let values = match cand.find(c.step, c.position, c.layer, &c.path)? {
            Some(f) => cand.floats(&f)?,
            None => None,
        };
        lm.max_abs_diff = match (lm.max_abs_diff, values) {
            (Some(m), Some(v)) if v.len() == r.shape.iter().product::<u64>() as usize => {
                let d = r
                    .f32s()
                    .iter()
                    .zip(&v)
                    .map(|(a, b)| (f64::from(*a) - f64::from(*b)).abs())
                    .fold(m, |m, d| if d > m || d.is_nan() { d } else { m });
                Some(d)
            }
            _ => None,
        };
    }
    Ok(out)
}

/// Runs the reference on the candidate's tokens and compares the logits at
/// every step. The trace needs `token.input` and `lm.logits` with payloads
/// at every step; what is missing is an error naming records and steps.
pub fn teacher_force(trace: &Trace, m: &LoadedModel, opts: TeacherOptions) -> Result<TeacherReport> {
    let reference = reference_for(trace, m, opts.precision, opts.contract.as_deref())?;
    let cand = Candidate::new(trace);
    let steps = steps(&cand)?;
    let mut missing = Vec::new();
    let mut plan = Vec::new();
    // The candidate's groups are held while their step is read, then dropped.
    cand.retain(|_, _, _| false);
    for (i, st) in steps.iter().enumerate() {
        cand.retain(|s, _, _| s >= st.step);
        if st.step as usize != i {
            missing.push(format!("every record of step {i}"));
            break;
        }
        let logits = match cand.find(st.step, st.last(), None, Component::LmLogits.path())? {
            Some(f) => cand.floats(&f)?,
            None => None,
        };
        match (&st.ids, logits) {
            (Some(ids), Some(l)) => plan.push((st, ids.clone(), l)),
            (ids, l) => {
                if ids.is_none() {
                    missing.push(format!("{} at step {}", Component::TokenInput.path(), st.step));
                }
                if l.is_none() {
                    missing.push(format!(
                        "{} payload at step {}",
                        Component::LmLogits.path(),
                        st.step
                    ));
                }
            }
        }
    }
    if !missing.is_empty() || plan.is_empty() {
        return Err(ReplayError::Capture {
            path: trace.path().to_path_buf(),
            what: format!(
                "teacher forcing needs token.input and lm.logits payloads at every step (capture L0,L1+payload or --capture replay); missing: {}",
                if missing.is_empty() { "every step".to_string() } else { missing.join(", ") }
            ),
        });
    }
    let sopts = StepOptions {
        precision: reference.precision,
        combine: reference.combine.as_ref(),
        detokenizer: None,
        allow_non_finite: true,
    };
    let mut state = m.model.new_state();
    let mut rows = Vec::with_capacity(plan.len());
    let layers = m.model.config().num_layers() as u32;
    cand.retain(|_, _, _| false);
    for (st, ids, cand_logits) in plan {
        cand.retain(|s, _, _| s >= st.step);
        let mut l3 = MemorySink::with_levels(&[Level::L3]);
        let sink: &mut dyn CaptureSink = if opts.l3 { &mut l3 } else { &mut NullSink };
        let out = m
            .model
            .step(&mut state, &ids, &sopts, sink)
            .map_err(|source| ReplayError::Runtime {
                unit: format!("step {} (teacher forcing)", st.step),
                source,
            })?;
        let mut row = metrics(st.step, st.last(), &out.logits, &cand_logits, opts.top_k);
        if opts.l3 {
            row.layers = layer_metrics(&cand, &l3.records, layers)?;
        }
        rows.push(row);
    }
    Ok(TeacherReport {
        candidate: trace.path().display().to_string(),
        model: m.name.clone(),
        precision: reference.precision.name().to_string(),
        contract: reference.contract,
        schedule: reference.schedule,
        top_k: opts.top_k,
        steps: rows,
        l3: opts.l3,
        incomplete: crate::incomplete::of(trace),
    })
}

impl TeacherReport {
    /// Mean KL over the steps where it is defined (summed in step order).
    pub fn mean_kl(&self) -> Option<f64> {
        let v: Vec<f64> = self.steps.iter().filter_map(|s| s.kl).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }

    /// The largest KL and its step (the first on ties).
    pub fn max_kl(&self) -> Option<(f64, u32)> {
        self.steps
            .iter()
            .filter_map(|s| s.kl.map(|k| (k, s.step)))
            .fold(None, |m, (k, s)| match m {
                Some((mk, _)) if mk >= k => m,
                _ => Some((k, s)),
            })
    }

    /// Steps whose argmax agrees.
    pub fn argmax_agree(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| s.argmax_reference == s.argmax_candidate)
            .count()
    }

    /// Steps with undefined KL (non-finite logits).
    pub fn undefined(&self) -> usize {
        self.steps.iter().filter(|s| s.kl.is_none()).count()
    }

    /// 0 when the logits are bitwise equal at every step, 1 otherwise;
    /// 2 instead of 0 when the candidate lacks steps of its run, unless
    /// `allow_incomplete`.
    pub fn exit_code(&self, allow_incomplete: bool) -> u8 {
        if !self.steps.iter().all(|s| s.identical) {
            1
        } else if self.incomplete.is_some() && !allow_incomplete {
            2
        } else {
            0
        }
    }

    /// The JSON document (docs/replay.md §4).
    pub fn to_json(&self, allow_incomplete: bool) -> Value {
        let n = self.steps.len();
        json!({
            "kind": "moeconf.replay",
            "mode": "teacher_force",
            "schema_version": REPLAY_SCHEMA_VERSION,
            "candidate": self.candidate,
            "model": self.model,
            "reference": {"precision": self.precision, "contract": self.contract, "schedule": self.schedule},
            "kl": {"direction": "KL(P_reference || P_candidate)", "log_base": "e (nats)"},
            "top_k": self.top_k,
            "l3": self.l3,
            "summary": {
                "steps": n,
                "identical_steps": self.steps.iter().filter(|s| s.identical).count(),
                "mean_kl": self.mean_kl(),
                "max_kl": self.max_kl().map(|(k, _)| k),
                "max_kl_step": self.max_kl().map(|(_, s)| s),
                "argmax_agree": self.argmax_agree(),
                "argmax_agreement_pct": if n == 0 { 0.0 } else { 100.0 * self.argmax_agree() as f64 / n as f64 },
                "undefined_kl_steps": self.undefined(),
            },
            "exit_code": self.exit_code(allow_incomplete),
            "incomplete": crate::incomplete::json(&self.incomplete),
            "steps": self.steps.iter().map(|s| json!({
                "step": s.step, "position": s.position, "kl": s.kl,
                "topk_overlap": s.topk_overlap, "argmax_reference": s.argmax_reference,
                "argmax_candidate": s.argmax_candidate, "identical": s.identical,
                "layers": s.layers.iter().map(|l| json!({
                    "layer": l.layer, "identical": l.identical, "max_abs_diff": l.max_abs_diff,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_on_equal_logits_and_matches_a_hand_value() {
        assert_eq!(kl_divergence(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]), Some(0.0));
        // P = (1/2, 1/2), Q = softmax(0, ln 3) = (1/4, 3/4):
        // KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3).
        let q = [0.0, 3f64.ln() as f32];
        let kl = kl_divergence(&[0.0, 0.0], &q).unwrap();
        assert!((kl - 0.5 * (4f64 / 3.0).ln()).abs() < 1e-7, "{kl}");
        assert_eq!(kl_divergence(&[0.0, f32::NAN], &[0.0, 0.0]), None);
        // A candidate that gives an id of the reference's support zero
        // probability diverges infinitely.
        assert_eq!(
            kl_divergence(&[0.0, 0.0], &[0.0, f32::NEG_INFINITY]),
            Some(f64::INFINITY)
        );
    }
}
