//! Protocol 10, the fault-injection localization matrix: the bisector's own
//! calibration. A native reference trace of "why the sheep" is written once;
//! each fault of the matrix (a different operator or contract, at a step and
//! layer computed from the model's configuration and the prompt length) gives
//! a candidate trace from the same runtime with one
//! [`FaultPlan`](moeconf_reference_runtime::faults::FaultPlan); the diff
//! engine compares each pair, and the localization must name exactly the
//! injected step, layer and operator. Reported as N/N over the effective
//! faults: a fault whose candidate trace is bitwise identical to the
//! reference (same root digest) changed no bit anywhere and cannot be
//! localized by any tool; such silent faults are listed separately and the
//! diff must call them equivalent (no false positive). Reordering sums of
//! BF16-valued operands in an FP32 accumulator is typically silent: those
//! sums are exact, which is also why the C contract is order-invariant.

use std::path::Path;

use moeconf_bisect::{diff, DiffOptions, Verdict};
use moeconf_contract::{b_class_count, AggregationContract, NativeCombine, Order};
use moeconf_reference_runtime::config::{AttentionKind, MlpKind};
use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
use moeconf_schema::Trace;
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::{frac, Claim, Ctx, Result, Section, Table, TraceRequest};

const PROMPT: &str = "why the sheep";

/// The matrix for a model, prompt length and run length. Coordinates are
/// derived from the configuration: attention faults on the first layer with
/// compressed keys (most keys), router and combine faults on routed (non-hash)
/// layers, compressor faults at a decode step whose token closes a CSA window.
pub fn matrix(ctx: &Ctx, prompt_len: usize, tokens: usize) -> Result<Vec<Fault>> {
    let cfg = ctx.m.model.config();
    let layers = cfg.num_layers() as u32;
    let last = tokens.saturating_sub(1) as u32;
    let s = |x: u32| x.min(last);
    let csa: Vec<u32> = (0..layers)
        .filter(|&i| cfg.layer_types[i as usize] == AttentionKind::Csa)
        .collect();
    let compressed: Vec<u32> = (0..layers)
        .filter(|&i| cfg.layer_types[i as usize] != AttentionKind::Sliding)
        .collect();
    let routed: Vec<u32> = (0..layers)
        .filter(|&i| cfg.mlp_layer_types[i as usize] == MlpKind::Moe)
        .collect();
    let pick = |v: &[u32], i: usize, fallback: u32| {
        v.get(i.min(v.len().saturating_sub(1)))
            .copied()
            .unwrap_or(fallback)
    };
    let mid = layers / 2;
    let attn_layer = pick(&compressed, 0, 0);
    let merge_layer = pick(&routed, routed.len().saturating_sub(2), mid);
    let mut faults = vec![
        Fault::at(s(3), attn_layer, FaultKind::AttentionSoftmaxReversed),
        Fault::at(s(3), attn_layer, FaultKind::AttentionSoftmaxBf16Accumulator),
        Fault::at(s(2), 1.min(layers - 1), FaultKind::AttentionOutputTruncate),
        Fault::at(s(1), mid, FaultKind::FfnNormEpsilon(1e-2)),
        Fault::at(
            s(2),
            pick(&routed, routed.len() / 2, mid),
            FaultKind::RouterNearTieFlip,
        ),
        Fault::at(s(1), merge_layer, FaultKind::SharedExpertFirst),
        Fault::at(s(1), merge_layer, FaultKind::RoundedRoutedMerge),
        Fault::at(s(3), layers - 1, FaultKind::KvLowPrecision { mantissa_bits: 3 }),
    ];
    // Compressor pooling: a step whose token closes a CSA (else any compressed) window.
    let (cl, rate) = match csa.get(1).or(csa.first()) {
        Some(&l) => (l, cfg.csa_rate),
        None => (pick(&compressed, 0, 0), cfg.hca_rate),
    };
    let closing = (1..=last)
        .find(|&st| (prompt_len + st as usize).is_multiple_of(rate.max(1)))
        .unwrap_or(0);
    faults.push(Fault::at(closing, cl, FaultKind::CompressorPoolingReversed));
    faults.push(Fault::at(
        closing,
        cl,
        FaultKind::CompressorPoolingBf16Accumulator,
    ));
    let classes = b_class_count(ctx.k())?;
    faults.push(Fault::at(
        s(2),
        ctx.fork_layer,
        FaultKind::CombineContract(AggregationContract::b().with_order(Order::BClass(135.min(classes - 1)))),
    ));
    faults.push(Fault::at(
        0,
        pick(&routed, 0, 0),
        FaultKind::CombineContract(AggregationContract::p32()),
    ));
    Ok(faults)
}

/// Where the diff localized the first divergence.
struct Found {
    step: u32,
    layer: Option<u32>,
    operator: String,
    position: u32,
}

/// What the diff made of one fault.
struct Outcome {
    fault: Fault,
    /// The candidate trace differs from the reference (root digests differ).
    effective: bool,
    /// The diff called the pair equivalent.
    equivalent: bool,
    found: Option<Found>,
    contract: Option<String>,
    /// The localization is exactly the injected step, layer and operator.
    localized: bool,
    summary: String,
}

impl Outcome {
    fn result(&self) -> &'static str {
        match (self.effective, self.localized, self.equivalent) {
            (true, true, _) => "exact",
            (true, false, _) => "WRONG",
            (false, _, true) => "silent (bitwise identical run; diff: equivalent)",
            (false, _, false) => "FALSE POSITIVE",
        }
    }

    fn json(&self) -> Value {
        let f = self.found.as_ref();
        json!({
            "fault": self.fault.kind.name(), "step": self.fault.step, "layer": self.fault.layer,
            "operator": self.fault.kind.operator(),
            "found_step": f.map(|f| f.step), "found_layer": f.and_then(|f| f.layer),
            "found_operator": f.map(|f| f.operator.clone()), "found_position": f.map(|f| f.position),
            "inferred_contract": self.contract, "effective": self.effective, "localized": self.localized,
            "diff_equivalent": self.equivalent, "diff_summary": self.summary,
        })
    }
}

/// Writes the candidate trace of fault `i` and diffs it against the reference.
fn run_fault(ctx: &Ctx, ids: &[u32], ref_path: &Path, i: usize, f: &Fault) -> Result<Outcome> {
    let path = ref_path.with_file_name(format!("fault-{:02}.bin", i + 1));
    let plan = FaultPlan::new(vec![f.clone()]);
    ctx.write_trace(TraceRequest {
        prompt: PROMPT,
        prompt_ids: ids,
        tokens: ctx.sizes.tokens,
        combine: &NativeCombine,
        faults: Some(&plan),
        notes: vec![("fault".to_string(), f.kind.name())],
        path: &path,
    })?;
    let (r, c) = (Trace::open_verified(ref_path)?, Trace::open_verified(&path)?);
    let report = diff(&r, &c, &DiffOptions::default())?;
    let first = report.first_divergence.as_ref();
    let found = first.map(|d| Found {
        step: d.step,
        layer: d.layer,
        operator: d.operator.clone(),
        position: d.position,
    });
    let localized = found
        .as_ref()
        .is_some_and(|d| Some(d.step) == f.step && d.layer == f.layer && d.operator == f.kind.operator());
    Ok(Outcome {
        fault: f.clone(),
        effective: r.root() != c.root(),
        equivalent: report.verdict == Verdict::Equivalent,
        contract: first.and_then(|d| d.contract.clone()),
        found,
        localized,
        summary: report.summary.clone(),
    })
}

/// Runs protocol 10.
pub fn run(ctx: &Ctx) -> Result<Section> {
    let ids = ctx.encode(PROMPT)?;
    let n = ctx.sizes.tokens;
    let faults = matrix(ctx, ids.len(), n)?;
    ctx.note(&format!(
        "[10] fault-injection localization matrix: {} faults, {n} tokens",
        faults.len()
    ));
    let ref_path = ctx.out.join("traces").join("fault-reference.bin");
    ctx.write_trace(TraceRequest {
        prompt: PROMPT,
        prompt_ids: &ids,
        tokens: n,
        combine: &NativeCombine,
        faults: None,
        notes: vec![],
        path: &ref_path,
    })?;
    let outcomes: Vec<Outcome> = faults
        .par_iter()
        .enumerate()
        .map(|(i, f)| run_fault(ctx, &ids, &ref_path, i, f))
        .collect::<Result<_>>()?;
    let effective = outcomes.iter().filter(|o| o.effective).count();
    let ok = outcomes.iter().filter(|o| o.effective && o.localized).count();
    let silent = outcomes.len() - effective;
    let silent_ok = outcomes.iter().filter(|o| !o.effective && o.equivalent).count();
    let json = json!({
        "prompt": PROMPT, "tokens": n, "faults": outcomes.len(), "effective": effective, "localized": ok,
        "silent": silent, "silent_reported_equivalent": silent_ok,
        "rows": outcomes.iter().map(Outcome::json).collect::<Vec<_>>(),
    });
    Ok(Section {
        key: "fault_matrix".into(),
        tables: vec![table(n, &outcomes)],
        json,
        claims: vec![
            Claim::new(
                "localization_exact",
                ok == effective && effective >= 8,
                format!(
                    "{} effective injected faults localized to exactly their step, layer and operator (at least 8 needed)",
                    frac(ok, effective)
                ),
            ),
            Claim::new(
                "silent_faults_equivalent",
                silent_ok == silent,
                format!("{} silent faults (no bit changed) reported equivalent", frac(silent_ok, silent)),
            ),
        ],
    })
}

fn table(n: usize, outcomes: &[Outcome]) -> Table {
    let mut t = Table::new(
        "fault_localization",
        &format!(
            "Fault-injection localization matrix: \"{PROMPT}\", {n} tokens, diff against the native trace"
        ),
        &[
            "#",
            "Fault",
            "Injected step",
            "Injected layer",
            "Operator",
            "Localized step",
            "Localized layer",
            "Localized operator",
            "Result",
        ],
    );
    let opt = |x: Option<u32>| x.map_or("all".to_string(), |v| v.to_string());
    for (i, o) in outcomes.iter().enumerate() {
        let (fs, fl, fo) = match &o.found {
            Some(f) => (f.step.to_string(), opt(f.layer), f.operator.clone()),
            None => ("-".into(), "-".into(), "(equivalent)".into()),
        };
        t.row(vec![
            (i + 1).to_string(),
            o.fault.kind.name(),
            opt(o.fault.step),
            opt(o.fault.layer),
            o.fault.kind.operator().into(),
            fs,
            fl,
            fo,
            o.result().into(),
        ]);
    }
    t
}
