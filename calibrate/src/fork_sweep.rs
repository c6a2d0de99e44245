//! Protocol 2, single-layer A/B fork (paper sections 2.4.1, 2.6 and 3.2):
//! freeze "why the sheep" before the first decode forward, then evaluate
//! every A permutation and every B structural class at the fork layer's MoE
//! aggregation with the runtime's trace-freeze-fork sweep.
//!
//! The 720 → 360 collapse is checked from the captured event itself: the
//! native run's routed terms and shared output at the fork are combined
//! under B with all k! raw orders, and every order must give bitwise the
//! output of its class (the first-pair symmetry), with k!/2 classes observed.

use std::collections::{BTreeMap, HashSet};

use moeconf_contract::{all_permutations, b_class_of, AggregationContract, ForkPoint, NativeCombine};
use moeconf_fingerprint::{CanonPolicy, Component};
use moeconf_reference_runtime::fork::{
    assemble_sweep, sweep_job_count, Scheme, SchemeSummary, SweepJobs, SweepOptions,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::jobs::{decode, JobOut, Jobs, Params};
use crate::sweep::BranchRecord;
use crate::{frac, CalibrateError, Claim, Collect, Ctx, Result, Section, Table, ALGORITHM};

const PROMPT: &str = "why the sheep";

/// The routed terms, shared output and native MoE output of one combine event.
pub struct ForkEvent {
    /// Gate-weighted FP32 routed terms, in selection order.
    pub terms: Vec<Vec<f32>>,
    /// Shared-expert output.
    pub shared: Vec<f32>,
    /// The native `moe.combine` output.
    pub native: Vec<f32>,
}

/// Captures the MoE event of (`layer`, `step`) at the step's last position in a native run.
pub fn capture_event(ctx: &Ctx, prompt_ids: &[u32], layer: u32, step: u32) -> Result<ForkEvent> {
    let mut sink = Collect::new(&[Component::MoeTerm, Component::MoeShared, Component::MoeCombine]);
    ctx.generate(prompt_ids, step as usize + 1, &NativeCombine, None, &mut sink)?;
    let l = Some(layer);
    let k = ctx.k();
    let mut terms = Vec::with_capacity(k);
    for j in 0..k as u32 {
        let r = sink.at_member(Component::MoeTerm, j, step, l).ok_or_else(|| {
            CalibrateError::MissingRecord(format!(
                "no {} at layer {layer}, step {step}",
                Component::MoeTerm.indexed_path(j)
            ))
        })?;
        terms.push(r.f32s());
    }
    let at_fork = |c: Component| {
        sink.at(c, step, l)
            .map(|r| r.f32s())
            .ok_or_else(|| CalibrateError::MissingRecord(format!("no {c} at the fork")))
    };
    let shared = at_fork(Component::MoeShared)?;
    let native = at_fork(Component::MoeCombine)?;
    Ok(ForkEvent {
        terms,
        shared,
        native,
    })
}

/// The result of combining one event under every raw order of a contract.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCheck {
    /// Raw orders evaluated (k!).
    pub raw: usize,
    /// Distinct outputs over all raw orders.
    pub distinct_outputs: usize,
    /// B structural classes observed (distinct `b_class_of`), for B.
    pub classes: usize,
    /// Whether both members of every B class gave bitwise the same output.
    pub classes_consistent: bool,
}

/// Combines `ev` under `contract` with all k! orders.
pub fn check_orders(ev: &ForkEvent, contract: &AggregationContract) -> Result<OrderCheck> {
    let k = ev.terms.len();
    let refs: Vec<&[f32]> = ev.terms.iter().map(|v| v.as_slice()).collect();
    let perms = all_permutations(k)?;
    let mut outputs: HashSet<Vec<u32>> = HashSet::new();
    let mut by_class: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut consistent = true;
    let mut y = vec![0.0f32; ev.shared.len()];
    for p in &perms {
        contract.try_combine_with_permutation(p, &refs, &ev.shared, &mut y)?;
        let bits: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
        let class = b_class_of(p)?;
        match by_class.get(&class) {
            Some(prev) => consistent &= *prev == bits,
            None => {
                by_class.insert(class, bits.clone());
            }
        }
        outputs.insert(bits);
    }
    Ok(OrderCheck {
        raw: perms.len(),
        distinct_outputs: outputs.len(),
        classes: by_class.len(),
        classes_consistent: consistent,
    })
}

/// The order checks of the fork event under B and A: the result of job 0.
#[derive(Serialize, Deserialize)]
struct Checks {
    b: OrderCheck,
    a: OrderCheck,
}

impl Checks {
    /// The check that applies to a scheme, and its structural class count
    /// (B-like: observed classes; otherwise every raw order).
    fn of(&self, scheme: &Scheme) -> (&OrderCheck, usize) {
        if scheme.family.is_b_like() {
            (&self.b, self.b.classes)
        } else {
            (&self.a, self.a.raw)
        }
    }
}

/// The schemes of the sweep: every A order and every B class, truncated to
/// `fork_branches` each.
fn schemes(params: &Params) -> Result<Vec<Scheme>> {
    let mut schemes = vec![
        Scheme::enumerate("a", params.k)?,
        Scheme::enumerate("b", params.k)?,
    ];
    for s in &mut schemes {
        s.truncate(params.sizes.fork_branches);
    }
    Ok(schemes)
}

/// Protocol 2's jobs: the order checks of the captured fork event (job 0),
/// then the sweep's jobs (the native reference, every branch).
struct ForkSweep<'a> {
    ctx: &'a Ctx,
    ids: Vec<u32>,
    point: ForkPoint,
    schemes: Vec<Scheme>,
    sweep: Option<SweepJobs<'a>>,
}

impl Jobs for ForkSweep<'_> {
    fn count(&self) -> usize {
        1 + sweep_job_count(&self.schemes)
    }

    fn prepare(&mut self, _ctx: &Ctx, owned: &[usize]) -> Result<()> {
        if owned.iter().any(|&j| j >= 1) {
            let ctx = self.ctx;
            let opts = SweepOptions {
                point: self.point,
                max_new_tokens: ctx.sizes.fork_tokens,
                precision: ctx.precision,
                base: &NativeCombine,
                detokenizer: Some(&ctx.m.tokenizer),
                algorithm: ALGORITHM,
                canon: CanonPolicy::default(),
            };
            self.sweep = Some(SweepJobs::prepare(&ctx.m.model, &self.ids, &self.schemes, &opts)?);
        }
        Ok(())
    }

    fn run(&self, ctx: &Ctx, job: usize) -> Result<JobOut> {
        if job == 0 {
            let ev = capture_event(ctx, &self.ids, self.point.layer, self.point.step)?;
            return JobOut::of(&Checks {
                b: check_orders(&ev, &AggregationContract::b())?,
                a: check_orders(&ev, &AggregationContract::a())?,
            });
        }
        let sweep = self
            .sweep
            .as_ref()
            .ok_or_else(|| CalibrateError::Invalid("the fork sweep was not prepared".into()))?;
        JobOut::of(&BranchRecord::from(&sweep.run(job - 1)?))
    }
}

/// Plans protocol 2.
pub fn plan(ctx: &Ctx) -> Result<Box<dyn Jobs + '_>> {
    let ids = ctx.encode(PROMPT)?;
    let point = ForkPoint::first_decode(ctx.fork_layer);
    let schemes = schemes(&ctx.params())?;
    let total: usize = schemes.iter().map(|s| s.branches.len()).sum();
    ctx.note(&format!(
        "[2] single-layer A/B fork at layer {}, step {}: {total} branches × {} tokens",
        point.layer, point.step, ctx.sizes.fork_tokens
    ));
    Ok(Box::new(ForkSweep {
        ctx,
        ids,
        point,
        schemes,
        sweep: None,
    }))
}

/// Assembles protocol 2 from its job results.
pub fn assemble(params: &Params, results: &[Value]) -> Result<Vec<Section>> {
    let (first, rest) = results
        .split_first()
        .ok_or_else(|| CalibrateError::Merge("fork_sweep: no job results".into()))?;
    let checks: Checks = decode("fork_sweep", std::slice::from_ref(first))?
        .pop()
        .ok_or_else(|| CalibrateError::Merge("fork_sweep: no order checks".into()))?;
    let branches = decode::<BranchRecord>("fork_sweep", rest)?
        .into_iter()
        .map(BranchRecord::into_result)
        .collect::<Result<Vec<_>>>()?;
    let point = ForkPoint::first_decode(params.fork_layer);
    let schemes = schemes(params)?;
    let report = assemble_sweep(point, params.sizes.fork_tokens, &schemes, branches)?;
    let k = params.k;
    let mut tables = Tables::new(params, point);
    let schemes_json: Vec<Value> = report
        .summaries
        .iter()
        .zip(&schemes)
        .map(|(s, scheme)| tables.add(s, scheme, &checks))
        .collect();
    let b = &checks.b;
    let expected_classes = if k >= 2 { b.raw / 2 } else { b.raw };
    let collapse = b.classes == expected_classes && b.classes_consistent;
    let json = json!({
        "prompt": PROMPT,
        "fork_layer": point.layer,
        "fork_step": point.step,
        "tokens": params.sizes.fork_tokens,
        "native_text": report.reference.text,
        "b_raw_orders": b.raw,
        "b_classes_observed": b.classes,
        "b_classes_bitwise_consistent": b.classes_consistent,
        "b_distinct_outputs_over_raw_orders": b.distinct_outputs,
        "a_distinct_outputs_over_raw_orders": checks.a.distinct_outputs,
        "schemes": schemes_json,
    });
    Ok(vec![Section {
        key: "fork_sweep".into(),
        tables: vec![tables.counts, tables.rank_frequency],
        json,
        claims: vec![Claim::new(
            "b_720_to_360",
            collapse,
            format!(
                "B: {} raw orders collapse to {} structural classes (expected {expected_classes}); both orders of every class bitwise equal: {}",
                b.raw, b.classes, b.classes_consistent
            ),
        )],
    }])
}

/// The two tables of protocol 2, filled one scheme at a time.
struct Tables {
    counts: Table,
    rank_frequency: Table,
}

impl Tables {
    fn new(params: &Params, point: ForkPoint) -> Tables {
        let counts = Table::new(
            "basin_counts",
            &format!(
                "Single-layer fork (section 3.2): \"{PROMPT}\", layer {}, step {} (first decode), {} tokens",
                point.layer, point.step, params.sizes.fork_tokens
            ),
            &[
                "Scheme",
                "Raw permutations",
                "Exact structural classes",
                "Evaluated",
                "Distinct MoE outputs",
                "Distinct post-mHC states",
                "Post-mHC differs from native",
                "Distinct texts",
            ],
        );
        let rank_frequency = Table::new(
            "basin_rank_frequency",
            "Basin rank-frequency (branches / raw permutations per continuation text)",
            &[
                "Scheme",
                "Rank",
                "Branches",
                "Raw permutations",
                "First branch",
                "Continuation",
            ],
        );
        Tables {
            counts,
            rank_frequency,
        }
    }

    /// Adds one scheme's rows; returns its JSON object.
    fn add(&mut self, s: &SchemeSummary, scheme: &Scheme, checks: &Checks) -> Value {
        let (check, classes) = checks.of(scheme);
        self.counts.row(vec![
            s.scheme.to_uppercase(),
            check.raw.to_string(),
            classes.to_string(),
            s.evaluated.to_string(),
            s.distinct_moe_outputs.to_string(),
            s.distinct_post_mhc.to_string(),
            frac(s.post_mhc_differs_from_reference, s.evaluated),
            s.basins.to_string(),
        ]);
        let first_label = |i: usize| scheme.branches.get(i).map(|x| x.label.clone());
        for (i, b) in s.basin_rank_frequency.iter().enumerate() {
            self.rank_frequency.row(vec![
                s.scheme.to_uppercase(),
                (i + 1).to_string(),
                b.branches.to_string(),
                b.raw_permutations.to_string(),
                first_label(b.first_branch).unwrap_or_default(),
                format!("{:?}", b.text),
            ]);
        }
        json!({
            "scheme": s.scheme,
            "family": s.family,
            "raw_permutations": check.raw,
            "structural_classes": classes,
            "evaluated": s.evaluated,
            "distinct_moe_outputs": s.distinct_moe_outputs,
            "distinct_moe_outputs_all_raw_orders": check.distinct_outputs,
            "distinct_post_mhc": s.distinct_post_mhc,
            "post_mhc_differs_from_native": s.post_mhc_differs_from_reference,
            "distinct_continuations": s.distinct_continuations,
            "basins": s.basins,
            "basin_rank_frequency": s.basin_rank_frequency.iter().map(|b| json!({
                "branches": b.branches, "raw_permutations": b.raw_permutations,
                "first_branch": first_label(b.first_branch),
                "text": b.text, "tokens": b.tokens,
            })).collect::<Vec<_>>(),
        })
    }
}
