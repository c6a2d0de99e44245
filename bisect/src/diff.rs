//! The L0–L4 walk (paper section 4.5): for every level, the first divergent
//! coordinate in execution order, then the localized operator and its
//! contract.

use crate::comparability::{compare_bindings, Comparability};
use crate::ctx::Ctx;
use crate::divergence::{Divergences, Event};
use crate::error::BisectError;
use crate::numeric::{compare_ids, f32_values, i32_values};
use crate::operators::{half_of, is_checkpoint};
use crate::passed::inputs_note;
use crate::report::*;
use crate::textdiff::{compare_texts, TextComparison};
use crate::walk::{Pair, Preceding, Sides};
use moeconf_fingerprint::{Component, DType, Level, LevelSet};
use moeconf_schema::{Trace, TraceError, Verification};
use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::path::Path;

/// Options of [`diff`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiffOptions {
    /// Compare traces whose bindings name a different model, tokenizer,
    /// prompt or decoding configuration (the differences are still reported).
    pub force: bool,
    /// Run contract inference at a localized `moe.combine` (needs L4 payloads).
    pub contract_inference: bool,
}

impl Default for DiffOptions {
    fn default() -> Self {
        DiffOptions {
            force: false,
            contract_inference: true,
        }
    }
}

const EXPLAIN_L0: &str = "Tokens and text: what a user sees. Shows the first generated token that differs and how the continuations differ.";
const EXPLAIN_L1: &str = "Logits: the score of every possible next token before one is chosen. A change here can precede (or never reach) a token change.";
const EXPLAIN_L2: &str = "Persistent state: what each layer carries from one token to the next (KV window, compressor and indexer buffers), compared after every step.";
const EXPLAIN_L3: &str = "Layer state: the residual streams after each half-layer (attention, then FFN) and each token's routed experts. The first mismatch brackets where the difference starts.";
const EXPLAIN_L4: &str = "Operator outputs inside a layer. The first operator whose output differs while its inputs match is where the two executions part.";

fn trace_summary(t: &Trace) -> TraceSummary {
    let b = t.binding();
    TraceSummary {
        path: t.path().display().to_string(),
        root: t.root().to_hex(),
        runtime: t.provenance().runtime.clone(),
        precision: b.precision.clone(),
        contract: b.contract.clone(),
        schedule: b.schedule.clone(),
        steps: t.steps().len() as u64,
    }
}

/// Opens (and validates) the reference and the candidate concurrently, one
/// thread each, and verifies every byte of both ([`Trace::open_verified`]),
/// so that a corrupted byte anywhere in either file is an error, never a
/// verdict (`moeconf diff --verify-all`). The result does not depend on the
/// threads.
pub fn open_pair(reference: &Path, candidate: &Path) -> Result<(Trace, Trace), BisectError> {
    open_pair_with(reference, candidate, Verification::Full)
}

/// [`open_pair`] under `verification`: what `moeconf diff` uses, with
/// [`Verification::OnUse`] by default. A version 2 trace is then verified
/// as the comparison reads it (each node against its parent up to the
/// trailer, each payload against its record digest), so a corrupted byte
/// the comparison uses is an error and bytes it never reads cannot
/// influence the report; a version 1 trace is verified in full.
pub fn open_pair_with(
    reference: &Path,
    candidate: &Path,
    verification: Verification,
) -> Result<(Trace, Trace), BisectError> {
    // Two version 2 traces verified on use open from their root blocks
    // (~0.1 ms each for 10^7 records): a second thread would cost about as
    // much as it saves, so they are opened one after the other. Anything
    // else (version 1, --verify-all) reads whole files: one thread each.
    if Trace::opens_lazily(reference, verification) && Trace::opens_lazily(candidate, verification) {
        let r = Trace::open_for(reference, verification);
        let c = Trace::open_for(candidate, verification);
        return Ok((r?, c?));
    }
    open_both(reference, candidate, |p| Trace::open_for(p, verification))
}

/// Opens both traces concurrently with `open` (one thread each).
pub(crate) fn open_both(
    reference: &Path,
    candidate: &Path,
    open: impl Fn(&Path) -> Result<Trace, TraceError> + Sync,
) -> Result<(Trace, Trace), BisectError> {
    let (r, c) = std::thread::scope(|s| {
        let open = &open;
        let h = s.spawn(move || open(candidate));
        let r = open(reference);
        // A panic in the reader is a bug; re-raise it on this thread.
        let c = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        (r, c)
    });
    Ok((r?, c?))
}

/// The levels each side holds, as far as the comparison needs to know
/// them: exactly for the levels of `need`, from verified step nodes (which
/// levels a step holds is committed by its step digest; the root block's
/// record counts are not, docs/format.md §11.5). A step whose digest is the
/// same on both sides holds the same levels on both, so it is read on the
/// reference's side only, and only until every needed level has been found;
/// the other steps are the ones the walk reads anyway.
fn held_levels(
    reference: &Trace,
    candidate: &Trace,
    need: LevelSet,
) -> Result<(LevelSet, LevelSet), BisectError> {
    let (mut hr, mut hc) = (LevelSet::EMPTY, LevelSet::EMPTY);
    if need.is_empty() {
        return Ok((hr, hc));
    }
    let sides = Sides::new(reference, candidate);
    let mut equal = Vec::new();
    for (step, a, b) in sides.paired_steps() {
        match (a, b) {
            (Some(a), Some(b)) if a.digest == b.digest => equal.push(step),
            _ => {
                if a.is_some() {
                    hr = hr.union(reference.step_levels(step)?);
                }
                if b.is_some() {
                    hc = hc.union(candidate.step_levels(step)?);
                }
            }
        }
    }
    let mut common = LevelSet::EMPTY;
    for step in equal {
        if need.iter().all(|l| common.contains(l)) {
            break;
        }
        common = common.union(reference.step_levels(step)?);
    }
    Ok((
        hr.union(common).intersection(need),
        hc.union(common).intersection(need),
    ))
}

/// The levels whose presence a diff must know (every level some side does
/// not declare, and L0, whose presence the summary states).
fn presence_needed(reference: &Trace, candidate: &Trace) -> LevelSet {
    let (rc, cc) = (&reference.binding().capture, &candidate.binding().capture);
    Level::ALL
        .into_iter()
        .filter(|&l| l == Level::L0 || !(rc.captures(l) && cc.captures(l)))
        .collect()
}

/// Compares two traces and localizes the first divergence through L0–L4.
///
/// Fails when the traces are not comparable (different model, tokenizer,
/// prompt or decoding; see [`DiffOptions::force`]), use different digest
/// algorithms, or a node or payload read on the divergent path is corrupt.
/// Only the nodes and payloads on the divergent path are read, each
/// verified before use; to refuse a corrupted byte anywhere in either file,
/// open them with [`open_pair`] (as `moeconf diff --verify-all` does).
pub fn diff(reference: &Trace, candidate: &Trace, opts: &DiffOptions) -> Result<DiffReport, BisectError> {
    let comparability = comparability(reference, candidate, opts)?;
    let held = held_levels(reference, candidate, presence_needed(reference, candidate))?;
    let compared = compared_levels(reference, candidate, held);
    let cx = Ctx {
        s: Sides::new(reference, candidate),
        opts: *opts,
        compared,
        storage: RefCell::new(HashMap::new()),
        storage_convention: RefCell::new(HashMap::new()),
        layer_kinds: RefCell::new(HashMap::new()),
        one_sided: OnceCell::new(),
        counterfactuals: RefCell::new(HashMap::new()),
        recomputed: (
            reference.provenance().recomputed(),
            candidate.provenance().recomputed(),
        ),
    };
    if reference.is_empty() && candidate.is_empty() {
        return Err(BisectError::NoRecords);
    }
    if compared.is_empty() {
        return Err(BisectError::NothingToCompare {
            reference: reference.binding().capture.describe(),
            candidate: candidate.binding().capture.describe(),
        });
    }
    let uncompared_levels = uncompared_levels(held, compared);

    let unmatched_steps: Vec<u32> =
        cx.s.paired_steps()
            .filter(|(_, a, b)| a.is_none() || b.is_none())
            .map(|(step, _, _)| step)
            .collect();

    let found = cx.divergences()?;
    let l0 = cx.l0(compared.contains(Level::L0))?;
    let l1 = cx.l1(compared.contains(Level::L1))?;
    let l2 = cx.l2(compared.contains(Level::L2))?;
    let l3 = cx.l3(compared.contains(Level::L3))?;
    let l4 = cx.l4(compared.contains(Level::L4), &found)?;
    let levels = Levels { l0, l1, l2, l3, l4 };

    let statuses = [
        levels.l0.status,
        levels.l1.status,
        levels.l2.status,
        levels.l3.status,
        levels.l4.status,
    ];
    let divergent = statuses.contains(&LevelStatus::Differ)
        || !unmatched_steps.is_empty()
        || !uncompared_levels.is_empty();
    let verdict = if divergent {
        Verdict::Divergent
    } else {
        Verdict::Equivalent
    };
    let mut divergences = Vec::with_capacity(found.events.len());
    for e in found
        .events
        .iter()
        .filter(|e| !cx.consumed_observation(e, &found.events))
    {
        divergences.extend(cx.divergence_report(e)?);
    }
    let first_divergence = cx.first_divergence(&divergences, &levels.l4);
    let storage_precision = cx.storage_groups(&found.storage);
    let one_side_only = cx.one_sided_groups();
    let quantization_one_side = cx.quantized_one_sided_groups();
    let compared_levels: Vec<Level> = compared.iter().collect();
    let summary = summary_line(
        verdict,
        (&first_divergence, &divergences, found.rest),
        (&storage_precision, &one_side_only),
        (&levels.l0, held.0.contains(Level::L0)),
        reference,
        (&unmatched_steps, &uncompared_levels),
        &compared_levels,
    );
    // A node of either trace that failed to read or verify on the way: the
    // report would rest on it.
    if let Some(f) = cx.s.take_failure() {
        return Err(BisectError::Trace(f.error));
    }
    let incomplete = crate::incomplete::sides(reference, candidate);
    let summary = crate::incomplete::annotate(summary, &incomplete);
    Ok(DiffReport {
        schema_version: DIFF_SCHEMA_VERSION,
        kind: "moeconf.diff".into(),
        verdict,
        reference: trace_summary(reference),
        candidate: trace_summary(candidate),
        comparability,
        compared_levels: compared_levels.iter().map(|l| l.name().to_string()).collect(),
        unmatched_steps,
        uncompared_levels,
        incomplete,
        first_divergence,
        divergences,
        rest: found.rest.name().into(),
        storage_precision,
        one_side_only,
        quantization_one_side,
        levels,
        summary,
    })
}

/// Levels one trace holds and the other does not (and that are therefore
/// not compared): a coverage difference, which makes the traces divergent.
fn uncompared_levels((hr, hc): (LevelSet, LevelSet), compared: LevelSet) -> Vec<UncomparedLevel> {
    Level::ALL
        .into_iter()
        .filter(|&l| !compared.contains(l))
        .filter_map(|l| {
            let present_in = match (hr.contains(l), hc.contains(l)) {
                (true, false) => "reference",
                (false, true) => "candidate",
                _ => return None,
            };
            Some(UncomparedLevel {
                level: l.name().into(),
                present_in: present_in.into(),
            })
        })
        .collect()
}

/// Whether the traces may be compared: the same digest algorithm, and no
/// refusing binding difference unless forced. Returns the binding
/// differences the report shows.
fn comparability(
    reference: &Trace,
    candidate: &Trace,
    opts: &DiffOptions,
) -> Result<Comparability, BisectError> {
    if reference.algorithm() != candidate.algorithm() {
        return Err(BisectError::AlgorithmMismatch {
            reference: reference.algorithm().name().to_string(),
            candidate: candidate.algorithm().name().to_string(),
        });
    }
    let (refusing, shown) = compare_bindings(
        reference.binding(),
        candidate.binding(),
        reference.provenance(),
        candidate.provenance(),
    );
    if !refusing.is_empty() && !opts.force {
        return Err(BisectError::NotComparable { fields: refusing });
    }
    Ok(Comparability {
        forced_over: refusing,
        expected_differences: shown,
    })
}

/// The levels both traces declare (or, undeclared, both hold records of;
/// `held` from [`held_levels`]).
fn compared_levels(reference: &Trace, candidate: &Trace, (hr, hc): (LevelSet, LevelSet)) -> LevelSet {
    let (rc, cc) = (&reference.binding().capture, &candidate.binding().capture);
    Level::ALL
        .into_iter()
        .filter(|&l| (rc.captures(l) && cc.captures(l)) || (hr.contains(l) && hc.contains(l)))
        .collect()
}

/// `L4 step 1 position 5 layer 5 operator moe.combine`: where a record
/// sits, with the level first (noun `operator` for L3/L4 records, `record`
/// otherwise).
fn place(level: &str, step: u32, position: u32, layer: Option<u32>, path: &str) -> String {
    let mut s = format!("{level} step {step} position {position}");
    if let Some(l) = layer {
        s.push_str(&format!(" layer {l}"));
    }
    let noun = if level == "L3" || level == "L4" {
        "operator"
    } else {
        "record"
    };
    s.push_str(&format!(" {noun} {path}"));
    s
}

fn summary_line(
    verdict: Verdict,
    (fd, divergences, rest): (&Option<FirstDivergence>, &[Divergence], crate::divergence::Rest),
    (storage, one_sided): (&[StoragePrecision], &[OneSided]),
    (l0, held_l0): (&L0Report, bool),
    reference: &Trace,
    (unmatched, uncompared): (&[u32], &[UncomparedLevel]),
    compared: &[Level],
) -> String {
    let levels = match (compared.first(), compared.last()) {
        (Some(a), Some(b)) if a != b => format!("{a}-{b}"),
        (Some(a), _) => a.to_string(),
        _ => "no levels".into(),
    };
    match (verdict, fd) {
        (Verdict::Equivalent, _) => format!(
            "equivalent: {} steps match bitwise at {levels}",
            reference.steps().len()
        ),
        (Verdict::Divergent, Some(f)) => {
            let mut s = format!(
                "first divergence: {}",
                place(&f.level, f.step, f.position, f.layer, &f.operator)
            );
            if f.present_in != "both" && crate::quantization::is_site(&f.operator) {
                s.push_str(&format!(" (quantized by the {} only)", f.present_in));
            } else if f.present_in != "both" {
                s.push_str(&format!(" (only in the {})", f.present_in));
            }
            if let Some(side) = divergences.first().and_then(|d| d.recomputed.as_deref()) {
                let by = if side == "both" { "both sides" } else { side };
                s.push_str(&format!(" (recomputed by the capture on {by})"));
            }
            if let Some(d) = divergences.first() {
                if let Some(c) = &d.coverage {
                    // Partial coverage: the operator cannot be separated
                    // from inputs one trace did not capture.
                    s.push_str(&format!(
                        ", localization ends here at {} ({})",
                        c.finest_level,
                        crate::coverage::needed_words(c)
                    ));
                } else if let (Some(n), true) = (&d.inputs_note, d.inputs_match) {
                    // Said only when the match rests on more than bitwise
                    // equality of observed values.
                    s.push_str(&format!(", inputs match ({n})"));
                }
            }
            match divergences.first().and_then(|d| d.absorbed_at) {
                Some(Absorption::Contracts) => {
                    s.push_str(", absorbed by both sides' contracts at the combine")
                }
                Some(Absorption::Consumer) => s.push_str(", absorbed by the combine, which matches"),
                Some(Absorption::Checkpoint) => s.push_str(", absorbed before the next checkpoint"),
                None => {}
            }
            if let Some(c) = &f.contract {
                s.push_str(&format!("; candidate contract: {c}"));
            }
            if f.kind == Some(DivergenceKind::Absorbed) {
                s.push_str(&later_divergences(divergences, rest));
            } else if divergences.len() > 1 {
                // After a propagating divergence the list holds only
                // divergences it cannot reach (crate::divergence).
                let n = divergences.len() - 1;
                s.push_str(&format!(
                    "; and {n} more divergence{} independent of it (listed above)",
                    if n == 1 { "" } else { "s" }
                ));
            }
            match l0.ordinal {
                Some(n) => s.push_str(&format!("; visible at generated token {n}")),
                None if l0.status == LevelStatus::Match && held_l0 => {
                    s.push_str("; tokens and text identical")
                }
                None => {}
            }
            s.push_str(&passed_words(storage, one_sided));
            s
        }
        (Verdict::Divergent, None) => {
            let mut s = coverage_summary(unmatched, uncompared, storage, one_sided);
            if !storage.is_empty() || !one_sided.is_empty() {
                s.push_str("; no other difference");
            }
            s
        }
    }
}

/// `; passed: storage precision in 4992 values of moe.term.* (…); held by
/// one side only: …`: what the walk passed on its way to the headline.
fn passed_words(storage: &[StoragePrecision], one_sided: &[OneSided]) -> String {
    let mut s = String::new();
    if !storage.is_empty() {
        s.push_str(&format!("; passed storage precision: {}", storage_words(storage)));
    }
    if !one_sided.is_empty() {
        s.push_str(&format!(
            "; held by one side only: {}",
            one_sided_words(one_sided)
        ));
    }
    s
}

/// `moe.term.* (candidate bf16 values in f32, R_BF16 …: 4992 of 4992 values rounded, 24 records)`.
fn storage_words(storage: &[StoragePrecision]) -> String {
    storage
        .iter()
        .map(|g| {
            format!(
                "{} ({} stores {}: {} of {} values are {} of the {}'s, {})",
                g.component,
                g.coarser,
                g.coarse_storage,
                g.values,
                g.values,
                g.rounding,
                if g.coarser == "candidate" {
                    "reference"
                } else {
                    "candidate"
                },
                records_words(g.records)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `1 record`, `7 records`.
fn records_words(n: u64) -> String {
    format!("{n} record{}", if n == 1 { "" } else { "s" })
}

/// `embed.output (reference, 30 records), moe.routed (candidate, 144 records)`.
fn one_sided_words(one_sided: &[OneSided]) -> String {
    one_sided
        .iter()
        .map(|g| format!("{} ({}, {})", g.component, g.present_in, records_words(g.records)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// After an absorbed first divergence: the next one that propagates, or
/// that every divergence is absorbed.
fn later_divergences(divergences: &[Divergence], rest: crate::divergence::Rest) -> String {
    use crate::divergence::Rest;
    let later = divergences.get(1..).unwrap_or_default();
    if let Some(d) = later.iter().find(|d| d.kind != Some(DivergenceKind::Absorbed)) {
        let a = &d.at;
        let how = d.kind.map_or("not classified", |k| k.name());
        // The line names two divergences; it says how many more the list holds.
        let more = match (later.len() - 1, rest) {
            (0, Rest::Limit) => "; more divergences follow than the report lists".to_string(),
            (0, _) => String::new(),
            (n, Rest::Limit) => format!(
                "; and {n} more listed divergence{}, and more than the report lists",
                if n == 1 { "" } else { "s" }
            ),
            (n, _) => format!(
                "; and {n} more divergence{} (listed above)",
                if n == 1 { "" } else { "s" }
            ),
        };
        return format!(
            "; then {}, {how}{more}",
            place(&a.level, a.step, a.position, a.layer, &a.path)
        );
    }
    match (later.len(), rest) {
        (0, Rest::None) => "; no other divergence".into(),
        (n, Rest::None) => format!(
            "; {n} more divergence{}, all absorbed",
            if n == 1 { "" } else { "s" }
        ),
        (_, Rest::Propagates) => {
            "; its consequences reach a later checkpoint through the persistent state".into()
        }
        (_, Rest::Limit) => "; more divergences follow than the report lists".into(),
        (_, Rest::Unclassified) => String::new(),
    }
}

/// The summary of traces that differ only in what they cover: the levels
/// one trace holds alone, then the steps one trace holds alone.
fn coverage_summary(
    unmatched: &[u32],
    uncompared: &[UncomparedLevel],
    storage: &[StoragePrecision],
    one_sided: &[OneSided],
) -> String {
    let mut parts = Vec::new();
    if !storage.is_empty() {
        parts.push(format!(
            "the records differ only by storage precision: {}",
            storage_words(storage)
        ));
    }
    if !one_sided.is_empty() {
        parts.push(format!(
            "records held by one side only: {}",
            one_sided_words(one_sided)
        ));
    }
    for side in ["reference", "candidate"] {
        let names: Vec<&str> = uncompared
            .iter()
            .filter(|u| u.present_in == side)
            .map(|u| u.level.as_str())
            .collect();
        if !names.is_empty() {
            parts.push(format!(
                "level{} {} captured only by the {side} (not compared)",
                if names.len() == 1 { "" } else { "s" },
                names.join(", ")
            ));
        }
    }
    if !unmatched.is_empty() {
        parts.push(format!("steps {unmatched:?} are present in only one trace"));
    }
    if parts.is_empty() {
        // Not reached: a differing compared record is a first divergence.
        parts.push("records differ".into());
    }
    format!("divergent: {}", parts.join("; "))
}

fn status(compared: bool, differing: &[u32]) -> LevelStatus {
    if !compared {
        LevelStatus::NotCompared
    } else if differing.is_empty() {
        LevelStatus::Match
    } else {
        LevelStatus::Differ
    }
}

fn decode_i32_first2(dtype: DType, bytes: &[u8]) -> Option<[i64; 2]> {
    let v = i32_values(dtype, bytes)?;
    Some([i64::from(*v.first()?), i64::from(*v.get(1)?)])
}

impl Ctx<'_> {
    /// The headline: the first divergence's record, with its kind and, at
    /// `moe.combine`, the candidate's inferred contract.
    fn first_divergence(&self, reports: &[Divergence], l4: &L4Report) -> Option<FirstDivergence> {
        let d = reports.first()?;
        let contract = match (&l4.contract, Component::MoeCombine.matches(&d.at.path)) {
            (Some(c), true) if c.at == d.at => c.candidate.clone(),
            _ => None,
        };
        Some(FirstDivergence {
            level: d.at.level.clone(),
            step: d.at.step,
            position: d.at.position,
            layer: d.at.layer,
            operator: d.at.path.clone(),
            contract,
            kind: d.kind,
            present_in: d.at.present_in.clone(),
        })
    }

    /// Whether `e` is a capture-only observation (`moe.routed`) whose
    /// consumer at the same step, layer and position is itself a divergence:
    /// it is reported there, as that operator's `observed_differs` input, not
    /// as a divergence of its own before the operator.
    fn consumed_observation(&self, e: &Event, events: &[Event]) -> bool {
        let Some(at) = self.s.entry(e.pair) else {
            return false;
        };
        if !crate::divergence::observational(&at.coord.path) {
            return false;
        }
        events.iter().any(|f| {
            self.s.entry(f.pair).is_some_and(|g| {
                Component::MoeCombine.matches(&g.coord.path)
                    && (g.coord.step, g.coord.layer, g.coord.position)
                        == (at.coord.step, at.coord.layer, at.coord.position)
            })
        })
    }

    /// The report form of one divergence.
    fn divergence_report(&self, e: &Event) -> Result<Option<Divergence>, BisectError> {
        let Some(at) = self.rec_ref_any(e.pair) else {
            return Ok(None);
        };
        Ok(Some(Divergence {
            kind: e.kind,
            checkpoint: e.checkpoint.and_then(|p| self.rec_ref_any(p)),
            absorbed_at: e.absorbed_at,
            inputs: e.inputs.clone(),
            inputs_match: e.inputs_match,
            inputs_note: inputs_note(&e.inputs),
            layer_kind: self.layer_kind_of(e.pair),
            comparison: match self.identity_pair(e.pair) {
                // A site one side alone quantizes: against what the other
                // side reads instead.
                Some(q) => self.comparison(q)?,
                None => self.comparison(e.pair)?,
            },
            beyond_storage_precision: self.beyond_storage(e.pair)?,
            recomputed: self.recomputed_side(&[e.pair]),
            coverage: self.s.entry(e.pair).and_then(|en| {
                self.coverage_limit(
                    en.coord.step,
                    en.coord.layer,
                    en.coord.position,
                    &en.coord.path,
                    en.level,
                )
            }),
            at,
        }))
    }

    fn continuation(&self, step: u32) -> Result<(Option<String>, Option<String>), BisectError> {
        let p = self.global(step, Component::TextContinuation);
        let (r, c) = p.map(|p| (p.r, p.c)).unwrap_or((None, None));
        Ok((self.text_of(self.s.r, r)?, self.text_of(self.s.c, c)?))
    }

    /// The generated text: the `text.continuation` of the last step that
    /// holds L0 records (which holds every generated token so far). Only
    /// that step's L0 group is read, so a trace without text costs one
    /// group, not one per step.
    fn last_text(&self, t: &Trace) -> Result<Option<String>, BisectError> {
        // The last step whose verified node holds L0 (the node is kept:
        // its L0 group is read next).
        let Some(g) = t
            .steps()
            .iter()
            .rev()
            .find_map(|s| self.s.group(t, s.step, Level::L0, None))
        else {
            return Ok(None);
        };
        let found = self
            .s
            .group_ids(t, g)
            .iter()
            .find(|&&i| Component::TextContinuation.matches(&t.record(i).coord.path))
            .copied();
        self.text_of(t, found)
    }

    fn l0(&self, compared: bool) -> Result<L0Report, BisectError> {
        let steps = if compared {
            self.s.differing_steps(Level::L0)
        } else {
            Vec::new()
        };
        let mut rep = L0Report {
            status: status(compared, &steps),
            explains: EXPLAIN_L0.into(),
            differing_steps: steps.len() as u64,
            first: None,
            ordinal: None,
            reference_token: None,
            candidate_token: None,
            reference_token_text: None,
            candidate_token_text: None,
            reference_text: None,
            candidate_text: None,
            text_diff: Vec::new(),
            text_summary: None,
        };
        let Some(&s0) = steps.first() else {
            return Ok(rep);
        };
        rep.first = self
            .s
            .differing_records(s0, Level::L0)
            .first()
            .and_then(|&p| self.rec_ref(Level::L0, p));
        // The first step whose predicted token differs.
        for &s in &steps {
            let Some(p) = self.global(s, Component::TokenOutput) else {
                continue;
            };
            if self.s.pair_equal(p) {
                continue;
            }
            rep.ordinal = s.checked_add(1);
            let (rb, cb) = self.payloads(p)?;
            let tok = |e: Option<usize>, t: &Trace, b: Option<&[u8]>| -> Option<i64> {
                let e = t.record(e?);
                i32_values(e.dtype, b?)?.first().map(|&v| i64::from(v))
            };
            rep.reference_token = tok(p.r, self.s.r, rb);
            rep.candidate_token = tok(p.c, self.s.c, cb);
            let (rt, ct) = self.continuation(s)?;
            let (rprev, cprev) = match s.checked_sub(1) {
                Some(prev) => self.continuation(prev)?,
                None => (Some(String::new()), Some(String::new())),
            };
            let grow = |now: Option<String>, before: Option<String>| -> Option<String> {
                let now = now?;
                match before {
                    Some(b) if now.starts_with(&b) => Some(now[b.len()..].to_string()),
                    _ => None,
                }
            };
            rep.reference_token_text = grow(rt, rprev);
            rep.candidate_token_text = grow(ct, cprev);
            break;
        }
        rep.reference_text = self.last_text(self.s.r)?;
        rep.candidate_text = self.last_text(self.s.c)?;
        if let (Some(a), Some(b)) = (&rep.reference_text, &rep.candidate_text) {
            if a != b {
                match compare_texts(a, b) {
                    TextComparison::Inline(ops) => rep.text_diff = ops,
                    TextComparison::Summary(s) => rep.text_summary = Some(s),
                }
            }
        }
        Ok(rep)
    }

    fn l1(&self, compared: bool) -> Result<L1Report, BisectError> {
        let steps = if compared {
            self.s.differing_steps(Level::L1)
        } else {
            Vec::new()
        };
        let mut rep = L1Report {
            status: status(compared, &steps),
            explains: EXPLAIN_L1.into(),
            differing_steps: steps.len() as u64,
            first: None,
            differing_paths: Vec::new(),
            argmax_changed: None,
            reference_top2: None,
            candidate_top2: None,
            reference_margin: None,
            candidate_margin: None,
            logits: None,
        };
        let Some(&s) = steps.first() else {
            return Ok(rep);
        };
        let diffs = self.s.differing_records(s, Level::L1);
        rep.first = diffs.first().and_then(|&p| self.rec_ref(Level::L1, p));
        for &p in &diffs {
            if let Some(e) = self.s.entry(p) {
                if !rep.differing_paths.iter().any(|p| e.coord.path == *p) {
                    rep.differing_paths.push(e.coord.path.to_string());
                }
            }
        }
        if let Some(p) = self.global(s, Component::LmTopkIds) {
            let (rb, cb) = self.payloads(p)?;
            rep.reference_top2 =
                p.r.zip(rb)
                    .and_then(|(i, b)| decode_i32_first2(self.s.r.record(i).dtype, b));
            rep.candidate_top2 =
                p.c.zip(cb)
                    .and_then(|(i, b)| decode_i32_first2(self.s.c.record(i).dtype, b));
        }
        rep.argmax_changed = match (rep.reference_top2, rep.candidate_top2) {
            (Some(a), Some(b)) => Some(a[0] != b[0]),
            _ => self
                .global(s, Component::TokenOutput)
                .map(|p| !self.s.pair_equal(p)),
        };
        if let Some(p) = self.global(s, Component::LmMargin) {
            let (rb, cb) = self.payloads(p)?;
            let first = |i: Option<usize>, t: &Trace, b: Option<&[u8]>| -> Option<f64> {
                let e = t.record(i?);
                f32_values(e.dtype, b?)?.first().map(|&v| f64::from(v))
            };
            rep.reference_margin = first(p.r, self.s.r, rb);
            rep.candidate_margin = first(p.c, self.s.c, cb);
        }
        if let Some(p) = self.global(s, Component::LmLogits) {
            rep.logits = self.numeric(p)?;
        }
        Ok(rep)
    }

    fn l2(&self, compared: bool) -> Result<L2Report, BisectError> {
        let steps = if compared {
            self.s.differing_steps(Level::L2)
        } else {
            Vec::new()
        };
        let mut rep = L2Report {
            status: status(compared, &steps),
            explains: EXPLAIN_L2.into(),
            differing_steps: steps.len() as u64,
            first: None,
            step: None,
            layers: Vec::new(),
            identical_layers: Vec::new(),
        };
        let Some(&s) = steps.first() else {
            return Ok(rep);
        };
        rep.step = Some(s);
        let diffs = self.s.differing_records(s, Level::L2);
        rep.first = diffs.first().and_then(|&p| self.rec_ref(Level::L2, p));
        for &p in &diffs {
            let Some(e) = self.s.entry(p) else { continue };
            let num = self.numeric(p)?;
            let comp = StateComponent {
                path: e.coord.path.to_string(),
                differing_values: num.as_ref().map(|n| n.differing),
                values: num.as_ref().map(|n| n.elements),
                present_in: self
                    .rec_ref(Level::L2, p)
                    .map(|r| r.present_in)
                    .unwrap_or_default(),
            };
            match rep.layers.iter_mut().find(|l| l.layer == e.coord.layer) {
                Some(l) => l.components.push(comp),
                None => rep.layers.push(StateLayer {
                    layer: e.coord.layer,
                    components: vec![comp],
                }),
            }
        }
        if let (Some(rl), Some(cl)) = self.s.level_nodes(s, Level::L2) {
            for g in &rl.groups {
                if let (Some(layer), Some(cg)) = (g.layer, cl.group(g.layer)) {
                    if cg.digest == g.digest {
                        rep.identical_layers.push(layer);
                    }
                }
            }
        }
        Ok(rep)
    }

    fn l3(&self, compared: bool) -> Result<L3Report, BisectError> {
        let steps = if compared {
            self.s.differing_steps(Level::L3)
        } else {
            Vec::new()
        };
        let mut rep = L3Report {
            status: status(compared, &steps),
            explains: EXPLAIN_L3.into(),
            differing_steps: steps.len() as u64,
            first: None,
            half: None,
            earlier_checkpoints: None,
            last_matched_checkpoint: None,
            numeric: None,
            first_record: None,
            route: None,
        };
        let mut first_pair = None;
        for &s in &steps {
            let diffs = self.s.differing_records(s, Level::L3);
            if rep.first_record.is_none() {
                rep.first_record = diffs.first().and_then(|&p| self.rec_ref(Level::L3, p));
            }
            if first_pair.is_none() {
                if let Some(&p) = diffs
                    .iter()
                    .find(|&&p| self.s.entry(p).is_some_and(|e| is_checkpoint(&e.coord.path)))
                {
                    first_pair = Some(p);
                    rep.first = self.rec_ref(Level::L3, p);
                    rep.half = self.s.entry(p).and_then(|e| half_of(&e.coord.path));
                    rep.numeric = self.numeric(p)?;
                    // Every earlier checkpoint of the step matches (the walk
                    // lists every differing record, and this is the first
                    // checkpoint among them in execution order): only the
                    // last one is looked up, at its coordinates.
                    let (earlier, last) = self.last_matched_checkpoint(p);
                    rep.earlier_checkpoints = Some(earlier);
                    rep.last_matched_checkpoint = last;
                }
            }
            if rep.route.is_none() {
                if let Some(&p) = diffs.iter().find(|&&p| {
                    self.s
                        .entry(p)
                        .is_some_and(|e| Component::RouterTopk.matches(&e.coord.path))
                }) {
                    rep.route = self.route(p)?;
                }
            }
            if first_pair.is_some() && rep.route.is_some() {
                break;
            }
        }
        Ok(rep)
    }

    /// The checkpoint before the first differing one, `p`, in execution
    /// order ([`Sides::checkpoint_before`] in the reference, which reads
    /// the pages of one or two positions), named only when the candidate
    /// holds the same record with the same digest (it lies before the
    /// first difference, so it must; a trace where it does not gets no
    /// name, never another record).
    fn last_matched_checkpoint(&self, p: Pair) -> (EarlierCheckpoints, Option<RecordRef>) {
        let Some(bound) = self.s.entry(p).map(|e| e.coord.clone()) else {
            return (EarlierCheckpoints::Unlocated, None);
        };
        match self.s.checkpoint_before(self.s.r, &bound) {
            Preceding::None => (EarlierCheckpoints::None, None),
            Preceding::Unlocated => (EarlierCheckpoints::Unlocated, None),
            Preceding::At(id) => {
                let c = &self.s.r.record(id).coord;
                let same = self
                    .s
                    .lookup(c.step, Level::L3, c.layer, Some(c.position), &c.path, false)
                    .into_iter()
                    .find(|q| q.r == Some(id))
                    .is_some_and(|q| self.s.pair_equal(q));
                if same {
                    (
                        EarlierCheckpoints::Match,
                        Some(RecordRef::new(Level::L3, c, "both")),
                    )
                } else {
                    (EarlierCheckpoints::Unlocated, None)
                }
            }
        }
    }

    fn route(&self, p: Pair) -> Result<Option<RouteDivergence>, BisectError> {
        let Some(at) = self.rec_ref(Level::L3, p) else {
            return Ok(None);
        };
        let Some(e) = self.s.entry(p) else {
            return Ok(None);
        };
        let (rb, cb) = self.payloads(p)?;
        let ids = |i: Option<usize>, t: &Trace, b: Option<&[u8]>| -> Vec<i64> {
            i.zip(b)
                .and_then(|(i, b)| i32_values(t.record(i).dtype, b))
                .map(|v| v.into_iter().map(i64::from).collect())
                .unwrap_or_default()
        };
        let re = ids(p.r, self.s.r, rb);
        let ce = ids(p.c, self.s.c, cb);
        let cmp = compare_ids(&re, &ce);
        let (mut rm, mut cm) = (None, None);
        let c = &e.coord;
        let hash_routed = c.layer.and_then(|l| self.layer_kinds(c.step, l).hash_routed());
        if let Some(&mp) = self
            .s
            .lookup_component(c.step, c.layer, Some(c.position), Component::RouterMargin)
            .first()
        {
            let (rb, cb) = self.payloads(mp)?;
            let first = |i: Option<usize>, t: &Trace, b: Option<&[u8]>| -> Option<f64> {
                let e = t.record(i?);
                f32_values(e.dtype, b?)?.first().map(|&v| f64::from(v))
            };
            rm = first(mp.r, self.s.r, rb);
            cm = first(mp.c, self.s.c, cb);
        }
        Ok(Some(RouteDivergence {
            at,
            reference_experts: re,
            candidate_experts: ce,
            entering: cmp.entering,
            leaving: cmp.leaving,
            reordered: cmp.reordered,
            hash_routed,
            reference_margin: rm,
            candidate_margin: cm,
        }))
    }

    fn l4(&self, compared: bool, found: &Divergences) -> Result<L4Report, BisectError> {
        let steps = if compared {
            self.s.differing_steps(Level::L4)
        } else {
            Vec::new()
        };
        let mut rep = L4Report {
            status: status(compared, &steps),
            explains: EXPLAIN_L4.into(),
            differing_steps: steps.len() as u64,
            first: None,
            localized: None,
            contract: None,
        };
        let first_l4 = steps
            .first()
            .and_then(|&s| self.s.differing_records(s, Level::L4).first().copied());
        rep.first = first_l4.and_then(|p| self.rec_ref(Level::L4, p));
        // The localized operator: a layer operator or the embedding.
        let Some((p, inputs, inputs_match)) = found.localized.clone() else {
            return Ok(rep);
        };
        let Some(e) = self.s.entry(p) else {
            return Ok(rep);
        };
        let operator = Component::parse(&e.coord.path)
            .map_or(e.coord.layer.is_some() && e.level != Level::L2, |(c, _)| {
                !c.spec().inputs.is_empty()
            });
        if !operator || !matches!(e.level, Level::L3 | Level::L4) {
            return Ok(rep);
        }
        let Some(at) = self.rec_ref(e.level, p) else {
            return Ok(rep);
        };
        let (step, layer, position) = (e.coord.step, e.coord.layer, e.coord.position);
        if let (Some(layer), true) = (
            layer,
            Component::MoeCombine.matches(&at.path) && self.opts.contract_inference,
        ) {
            rep.contract = Some(self.contract(step, layer, position, at.clone())?);
        }
        rep.localized = Some(Localized {
            half: half_of(&at.path),
            inputs_note: inputs_note(&inputs),
            inputs,
            inputs_match,
            layer_kind: self.layer_kind_of(p),
            comparison: match self.identity_pair(p) {
                Some(q) => self.comparison(q)?,
                None => self.comparison(p)?,
            },
            coverage: self.coverage_limit(step, layer, position, &at.path, e.level),
            uncaptured_steps: Component::parse(&at.path)
                .and_then(|(c, _)| c.uncaptured_steps())
                .map(String::from),
            at,
        });
        Ok(rep)
    }
}
