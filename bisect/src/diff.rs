//! The L0–L4 walk (paper section 4.5): for every level, the first divergent
//! coordinate in execution order, then the localized operator and its
//! contract.

use crate::comparability::{compare_bindings, Comparability};
use crate::error::BisectError;
use crate::inference::infer;
use crate::numeric::{f32_values, i32_values, summarize, NumericSummary};
use crate::operators::{describe_input, half_of, inputs_of, is_checkpoint};
use crate::report::*;
use crate::textdiff::{compare_texts, TextComparison};
use crate::walk::{Pair, Sides};
use moeconf_fingerprint::{Component, DType, Level, LevelSet};
use moeconf_schema::{Trace, TraceError};
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

/// Both sides' payloads of one record pair.
type PayloadPair<'a> = (Option<&'a [u8]>, Option<&'a [u8]>);

/// Routed terms, shared-expert output and combine output of one event.
type CombineEvent = (Vec<Vec<f32>>, Vec<f32>, Vec<f32>);

const EXPLAIN_L0: &str = "Tokens and text: what a user sees. Shows the first generated token that differs and how the continuations differ.";
const EXPLAIN_L1: &str = "Logits: the score of every possible next token before one is chosen. A change here can precede (or never reach) a token change.";
const EXPLAIN_L2: &str = "Persistent state: what each layer carries from one token to the next (KV window, compressor and indexer buffers), compared after every step.";
const EXPLAIN_L3: &str = "Layer state: the residual streams after each half-layer (attention, then FFN) and each token's routed experts. The first mismatch brackets where the difference starts.";
const EXPLAIN_L4: &str = "Operator outputs inside a layer. The first operator whose output differs while its inputs match is where the two executions part.";

struct Ctx<'a> {
    s: Sides<'a>,
    opts: DiffOptions,
}

fn trace_summary(t: &Trace) -> TraceSummary {
    let b = t.binding();
    TraceSummary {
        path: t.path().display().to_string(),
        root: t.root().to_hex(),
        runtime: t.provenance().runtime.clone(),
        precision: b.precision.clone(),
        contract: b.contract.clone(),
        schedule: b.schedule.clone(),
        records: t.records().len() as u64,
        steps: t.tree().steps.len() as u64,
    }
}

/// Opens (and validates) the reference and the candidate concurrently, one
/// thread each, and re-hashes every payload of both
/// ([`Trace::open_verified`]): what `moeconf diff` compares, so that a
/// corrupted byte anywhere in either file is an error, never a verdict.
/// Opening parses and checks both indexes and rebuilds both hash trees;
/// verification hashes every payload byte. The result does not depend on
/// the threads.
pub fn open_pair(reference: &Path, candidate: &Path) -> Result<(Trace, Trace), BisectError> {
    open_both(reference, candidate, Trace::open_verified)
}

/// Opens both traces concurrently with `open` (one thread each).
pub(crate) fn open_both(
    reference: &Path,
    candidate: &Path,
    open: fn(&Path) -> Result<Trace, TraceError>,
) -> Result<(Trace, Trace), BisectError> {
    let (r, c) = std::thread::scope(|s| {
        let h = s.spawn(|| open(candidate));
        let r = open(reference);
        // A panic in the reader is a bug; re-raise it on this thread.
        let c = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        (r, c)
    });
    Ok((r?, c?))
}

fn has_level(t: &Trace, level: Level) -> bool {
    t.tree().steps.iter().any(|s| s.level(level).is_some())
}

/// Compares two traces and localizes the first divergence through L0–L4.
///
/// Fails when the traces are not comparable (different model, tokenizer,
/// prompt or decoding; see [`DiffOptions::force`]), use different digest
/// algorithms, or a payload read on the divergent path is corrupt. Only the
/// payloads of the records on the divergent path are read, each re-hashed
/// against its record digest before use; to refuse a corrupted byte
/// anywhere in either file, open them with [`open_pair`] (as `moeconf diff`
/// does).
pub fn diff(reference: &Trace, candidate: &Trace, opts: &DiffOptions) -> Result<DiffReport, BisectError> {
    let comparability = comparability(reference, candidate, opts)?;
    let cx = Ctx {
        s: Sides {
            r: reference,
            c: candidate,
        },
        opts: *opts,
    };
    let compared = compared_levels(reference, candidate);
    if reference.records().is_empty() && candidate.records().is_empty() {
        return Err(BisectError::NoRecords);
    }
    if compared.is_empty() {
        return Err(BisectError::NothingToCompare {
            reference: reference.binding().capture.describe(),
            candidate: candidate.binding().capture.describe(),
        });
    }
    let uncompared_levels = uncompared_levels(reference, candidate, compared);

    let rsteps: Vec<u32> = reference.tree().steps.iter().map(|s| s.step).collect();
    let csteps: Vec<u32> = candidate.tree().steps.iter().map(|s| s.step).collect();
    let unmatched_steps: Vec<u32> =
        cx.s.steps()
            .into_iter()
            .filter(|s| rsteps.binary_search(s).is_err() || csteps.binary_search(s).is_err())
            .collect();

    let l0 = cx.l0(compared.contains(Level::L0))?;
    let l1 = cx.l1(compared.contains(Level::L1))?;
    let l2 = cx.l2(compared.contains(Level::L2))?;
    let (l3, l3_first) = cx.l3(compared.contains(Level::L3))?;
    let (l4, l4_local) = cx.l4(compared.contains(Level::L4), &l3, l3_first)?;
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
    let first_divergence = cx.first_divergence(&levels, compared, l3_first, l4_local);
    let compared_levels: Vec<Level> = compared.iter().collect();
    let summary = summary_line(
        verdict,
        &first_divergence,
        &levels.l0,
        reference,
        (&unmatched_steps, &uncompared_levels),
        &compared_levels,
    );
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
        first_divergence,
        levels,
        summary,
    })
}

/// Levels one trace holds and the other does not (and that are therefore
/// not compared): a coverage difference, which makes the traces divergent.
fn uncompared_levels(reference: &Trace, candidate: &Trace, compared: LevelSet) -> Vec<UncomparedLevel> {
    Level::ALL
        .into_iter()
        .filter(|&l| !compared.contains(l))
        .filter_map(|l| {
            let present_in = match (has_level(reference, l), has_level(candidate, l)) {
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

/// The levels both traces declare (or, undeclared, both hold records of).
fn compared_levels(reference: &Trace, candidate: &Trace) -> LevelSet {
    let (rc, cc) = (&reference.binding().capture, &candidate.binding().capture);
    Level::ALL
        .into_iter()
        .filter(|&l| {
            (rc.captures(l) && cc.captures(l)) || (has_level(reference, l) && has_level(candidate, l))
        })
        .collect()
}

fn summary_line(
    verdict: Verdict,
    fd: &Option<FirstDivergence>,
    l0: &L0Report,
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
            "equivalent: {} records in {} steps match bitwise at {levels}",
            reference.records().len(),
            reference.tree().steps.len()
        ),
        (Verdict::Divergent, Some(f)) => {
            let mut s = format!(
                "first divergence: {} step {} position {}",
                f.level, f.step, f.position
            );
            if let Some(l) = f.layer {
                s.push_str(&format!(" layer {l}"));
            }
            let noun = if f.level == "L3" || f.level == "L4" {
                "operator"
            } else {
                "record"
            };
            s.push_str(&format!(" {noun} {}", f.operator));
            if let Some(c) = &f.contract {
                s.push_str(&format!("; candidate contract: {c}"));
            }
            match l0.ordinal {
                Some(n) => s.push_str(&format!("; visible at generated token {n}")),
                None if l0.status == LevelStatus::Match && has_level(reference, Level::L0) => {
                    s.push_str("; tokens and text identical")
                }
                None => {}
            }
            s
        }
        (Verdict::Divergent, None) => coverage_summary(unmatched, uncompared),
    }
}

/// The summary of traces that differ only in what they cover: the levels
/// one trace holds alone, then the steps one trace holds alone.
fn coverage_summary(unmatched: &[u32], uncompared: &[UncomparedLevel]) -> String {
    let mut parts = Vec::new();
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
    /// The localization: the earliest divergent record in execution order;
    /// on the same record the finer level wins (lists are finest first).
    fn first_divergence(
        &self,
        levels: &Levels,
        compared: LevelSet,
        l3_first: Option<Pair>,
        l4_local: Option<Pair>,
    ) -> Option<FirstDivergence> {
        let l4 = &levels.l4;
        let contract = l4.contract.as_ref().and_then(|c| c.candidate.clone());
        let mut cands: Vec<(Pair, &RecordRef, Option<String>)> = Vec::new();
        if let (Some(p), Some(loc)) = (l4_local, l4.localized.as_ref()) {
            let c = if Component::MoeCombine.matches(&loc.at.path) {
                contract.clone()
            } else {
                None
            };
            cands.push((p, &loc.at, c));
        }
        if let (Some(p), Some(r)) = (l3_first, levels.l3.first.as_ref()) {
            cands.push((p, r, None));
        }
        for (level, r) in [
            (Level::L2, levels.l2.first.as_ref()),
            (Level::L1, levels.l1.first.as_ref()),
            (Level::L0, levels.l0.first.as_ref()),
        ] {
            if let (Some(p), Some(r)) = (self.first_pair(level, compared.contains(level)), r) {
                cands.push((p, r, None));
            }
        }
        // No operator was localized and no checkpoint differs (e.g. a
        // differing L4 record without a layer): the first differing record
        // of L4, then L3, is the divergence.
        if cands.is_empty() {
            for (level, r) in [
                (Level::L4, levels.l4.first.as_ref()),
                (Level::L3, levels.l3.first_record.as_ref()),
            ] {
                if let (Some(p), Some(r)) = (self.first_pair(level, compared.contains(level)), r) {
                    cands.push((p, r, None));
                }
            }
        }
        cands
            .iter()
            .enumerate()
            .min_by_key(|(i, (p, _, _))| (p.order_key(), *i))
            .map(|(_, (_, r, c))| FirstDivergence {
                level: r.level.clone(),
                step: r.step,
                position: r.position,
                layer: r.layer,
                operator: r.path.clone(),
                contract: c.clone(),
            })
    }

    fn rec_ref(&self, level: Level, p: Pair) -> Option<RecordRef> {
        let e = self.s.entry(p)?;
        let present = match (p.r, p.c) {
            (Some(_), Some(_)) => "both",
            (Some(_), None) => "reference",
            _ => "candidate",
        };
        Some(RecordRef::new(level, &e.coord, present))
    }

    fn first_pair(&self, level: Level, compared: bool) -> Option<Pair> {
        if !compared {
            return None;
        }
        let s = *self.s.differing_steps(level).first()?;
        self.s.differing_records(s, level).first().copied()
    }

    /// Verified payloads of both sides (`None` on a side without one).
    fn payloads(&self, p: Pair) -> Result<PayloadPair<'_>, BisectError> {
        let r = match p.r {
            Some(i) => self.s.r.payload_verified(i)?,
            None => None,
        };
        let c = match p.c {
            Some(i) => self.s.c.payload_verified(i)?,
            None => None,
        };
        Ok((r, c))
    }

    fn numeric(&self, p: Pair) -> Result<Option<NumericSummary>, BisectError> {
        let (Some(ri), Some(ci)) = (p.r, p.c) else {
            return Ok(None);
        };
        let (Some(rb), Some(cb)) = self.payloads(p)? else {
            return Ok(None);
        };
        let (re, ce) = (&self.s.r.records()[ri], &self.s.c.records()[ci]);
        Ok(summarize(re.dtype, &re.shape, rb, ce.dtype, &ce.shape, cb))
    }

    /// The single record of a model-global component at `step`.
    fn global(&self, step: u32, component: Component) -> Option<Pair> {
        self.s
            .lookup_component(step, None, None, component)
            .first()
            .copied()
    }

    fn text_of(&self, t: &Trace, idx: Option<usize>) -> Result<Option<String>, BisectError> {
        let Some(i) = idx else { return Ok(None) };
        Ok(t.payload_verified(i)?
            .map(|b| String::from_utf8_lossy(b).into_owned()))
    }

    fn continuation(&self, step: u32) -> Result<(Option<String>, Option<String>), BisectError> {
        let p = self.global(step, Component::TextContinuation);
        let (r, c) = p.map(|p| (p.r, p.c)).unwrap_or((None, None));
        Ok((self.text_of(self.s.r, r)?, self.text_of(self.s.c, c)?))
    }

    fn last_text(&self, t: &Trace) -> Result<Option<String>, BisectError> {
        for step in t.tree().steps.iter().rev() {
            let Some(g) = step.level(Level::L0).and_then(|l| l.group(None)) else {
                continue;
            };
            if let Some(&i) = g
                .records
                .iter()
                .find(|&&i| Component::TextContinuation.matches(&t.records()[i].coord.path))
            {
                return self.text_of(t, Some(i));
            }
        }
        Ok(None)
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
                let e = &t.records()[e?];
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
                    .and_then(|(i, b)| decode_i32_first2(self.s.r.records()[i].dtype, b));
            rep.candidate_top2 =
                p.c.zip(cb)
                    .and_then(|(i, b)| decode_i32_first2(self.s.c.records()[i].dtype, b));
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
                let e = &t.records()[i?];
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
        let (rl, cl) = (
            self.s.r.tree().step(s).and_then(|n| n.level(Level::L2)),
            self.s.c.tree().step(s).and_then(|n| n.level(Level::L2)),
        );
        if let (Some(rl), Some(cl)) = (rl, cl) {
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

    fn l3(&self, compared: bool) -> Result<(L3Report, Option<Pair>), BisectError> {
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
            earlier_checkpoints_matched: 0,
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
                    // Earlier checkpoints of this step (reference execution order).
                    let bound = p.r.unwrap_or(usize::MAX);
                    let mut last: Option<usize> = None;
                    if let Some(level) = self.s.r.tree().step(s).and_then(|n| n.level(Level::L3)) {
                        for g in &level.groups {
                            for &i in &g.records {
                                if i < bound && is_checkpoint(&self.s.r.records()[i].coord.path) {
                                    rep.earlier_checkpoints_matched += 1;
                                    last = last.max(Some(i));
                                }
                            }
                        }
                    }
                    rep.last_matched_checkpoint =
                        last.map(|i| RecordRef::new(Level::L3, &self.s.r.records()[i].coord, "both"));
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
        Ok((rep, first_pair))
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
                .and_then(|(i, b)| i32_values(t.records()[i].dtype, b))
                .map(|v| v.into_iter().map(i64::from).collect())
                .unwrap_or_default()
        };
        let re = ids(p.r, self.s.r, rb);
        let ce = ids(p.c, self.s.c, cb);
        let entering = ce.iter().copied().filter(|x| !re.contains(x)).collect();
        let leaving = re.iter().copied().filter(|x| !ce.contains(x)).collect();
        let (mut rm, mut cm) = (None, None);
        let c = &e.coord;
        if let Some(&mp) = self
            .s
            .lookup_component(c.step, c.layer, Some(c.position), Component::RouterMargin)
            .first()
        {
            let (rb, cb) = self.payloads(mp)?;
            let first = |i: Option<usize>, t: &Trace, b: Option<&[u8]>| -> Option<f64> {
                let e = &t.records()[i?];
                f32_values(e.dtype, b?)?.first().map(|&v| f64::from(v))
            };
            rm = first(mp.r, self.s.r, rb);
            cm = first(mp.c, self.s.c, cb);
        }
        Ok(Some(RouteDivergence {
            at,
            reference_experts: re,
            candidate_experts: ce,
            entering,
            leaving,
            reference_margin: rm,
            candidate_margin: cm,
        }))
    }

    fn l4(
        &self,
        compared: bool,
        l3: &L3Report,
        l3_first: Option<Pair>,
    ) -> Result<(L4Report, Option<Pair>), BisectError> {
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
        // The interval: the half closed by the first differing L3 checkpoint,
        // else the half of the first differing L4 record.
        let anchor = match (l3_first, &l3.first) {
            (Some(p), Some(_)) => Some(p),
            _ => first_l4,
        };
        let Some(anchor) = anchor else {
            return Ok((rep, None));
        };
        let Some(ae) = self.s.entry(anchor) else {
            return Ok((rep, None));
        };
        let (step, layer, position) = (ae.coord.step, ae.coord.layer, ae.coord.position);
        let half = half_of(&ae.coord.path);
        let Some(layer_idx) = layer else {
            return Ok((rep, None));
        };
        let mut inside: Vec<(Level, Pair)> = Vec::new();
        for level in [Level::L3, Level::L4] {
            if level == Level::L4 && !compared {
                continue;
            }
            for p in self.s.differing_records(step, level) {
                if let Some(e) = self.s.entry(p) {
                    if e.coord.layer == layer
                        && e.coord.position == position
                        && half_of(&e.coord.path) == half
                    {
                        inside.push((level, p));
                    }
                }
            }
        }
        inside.sort_by_key(|(_, p)| p.order_key());
        let mut chosen: Option<(Level, Pair, Vec<InputCheck>, bool)> = None;
        for &(level, p) in &inside {
            let Some(e) = self.s.entry(p) else { continue };
            let checks = self.check_inputs(step, layer_idx, position, &e.coord.path);
            let ok = !checks.iter().any(|c| c.status == "differ");
            if ok {
                chosen = Some((level, p, checks, true));
                break;
            }
            if chosen.is_none() {
                chosen = Some((level, p, checks, false));
            }
        }
        let Some((level, p, inputs, inputs_match)) = chosen else {
            return Ok((rep, None));
        };
        let Some(at) = self.rec_ref(level, p) else {
            return Ok((rep, None));
        };
        let numeric = self.numeric(p)?;
        if Component::MoeCombine.matches(&at.path) && self.opts.contract_inference {
            rep.contract = Some(self.contract(step, layer_idx, position, at.clone())?);
        }
        rep.localized = Some(Localized {
            at,
            half,
            inputs,
            inputs_match,
            numeric,
        });
        Ok((rep, Some(p)))
    }

    fn check_inputs(&self, step: u32, layer: u32, position: u32, path: &str) -> Vec<InputCheck> {
        let mut out = Vec::new();
        for spec in inputs_of(path, layer) {
            let Some(s) = step.checked_sub(spec.steps_back) else {
                continue;
            };
            let pos = spec.same_position.then_some(position);
            let pairs = self
                .s
                .lookup(s, spec.level, spec.layer, pos, &spec.path, spec.prefix);
            let status = if pairs.is_empty() {
                "not_captured"
            } else if pairs.iter().all(|&p| self.s.pair_equal(p)) {
                "match"
            } else {
                "differ"
            };
            out.push(InputCheck {
                input: describe_input(&spec),
                status: status.into(),
                records: pairs.len() as u64,
            });
        }
        out
    }

    /// The routed terms, shared output and combine output of one side, if
    /// all have f32 payloads.
    fn combine_event(
        &self,
        t: &Trace,
        pick: impl Fn(Pair) -> Option<usize>,
        step: u32,
        layer: u32,
        position: u32,
    ) -> Result<Option<CombineEvent>, BisectError> {
        let get = |i: usize| -> Result<Option<Vec<f32>>, BisectError> {
            let e = &t.records()[i];
            Ok(t.payload_verified(i)?.and_then(|b| f32_values(e.dtype, b)))
        };
        let mut terms: Vec<(usize, usize)> = Vec::new();
        for p in self
            .s
            .lookup_component(step, Some(layer), Some(position), Component::MoeTerm)
        {
            let Some(i) = pick(p) else { continue };
            let path = &t.records()[i].coord.path;
            let Some(j) = path
                .strip_prefix(Component::MoeTerm.path())
                .and_then(|j| j.parse::<usize>().ok())
            else {
                continue;
            };
            terms.push((j, i));
        }
        terms.sort_unstable();
        if terms.is_empty() || terms.iter().enumerate().any(|(n, &(j, _))| n != j) {
            return Ok(None);
        }
        let one = |component: Component| -> Result<Option<Vec<f32>>, BisectError> {
            match self
                .s
                .lookup_component(step, Some(layer), Some(position), component)
                .first()
                .and_then(|&p| pick(p))
            {
                Some(i) => get(i),
                None => Ok(None),
            }
        };
        let (Some(shared), Some(combine)) = (one(Component::MoeShared)?, one(Component::MoeCombine)?) else {
            return Ok(None);
        };
        let mut tv = Vec::with_capacity(terms.len());
        for (_, i) in terms {
            match get(i)? {
                Some(v) => tv.push(v),
                None => return Ok(None),
            }
        }
        Ok(Some((tv, shared, combine)))
    }

    fn contract(
        &self,
        step: u32,
        layer: u32,
        position: u32,
        at: RecordRef,
    ) -> Result<ContractReport, BisectError> {
        let cand = self.combine_event(self.s.c, |p| p.c, step, layer, position)?;
        let refe = self.combine_event(self.s.r, |p| p.r, step, layer, position)?;
        let ci = cand
            .as_ref()
            .and_then(|(t, s, y)| infer(t, s, y, self.s.c.binding().canon));
        let ri = refe
            .as_ref()
            .and_then(|(t, s, y)| infer(t, s, y, self.s.r.binding().canon));
        let note = if cand.is_none() {
            Some("no f32 payloads of moe.term.*, moe.shared and moe.combine in the candidate at this event (capture L4 with payloads)".to_string())
        } else if ci.as_ref().is_none_or(|i| i.matches.is_empty()) {
            Some("no known contract (P32/C/A/B under any order, tree, exact, f64) reproduces the candidate's output bitwise".to_string())
        } else {
            None
        };
        Ok(ContractReport {
            at,
            candidate: ci.as_ref().and_then(|i| i.explain()),
            reference: ri.as_ref().and_then(|i| i.explain()),
            reference_is_native: ri.as_ref().map(|i| i.native),
            candidate_inference: ci,
            reference_inference: ri,
            note,
        })
    }
}
