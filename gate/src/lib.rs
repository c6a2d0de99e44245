//! `moeconf gate`: judges a candidate trace against a reference trace (or a
//! blessed baseline) under a reviewed policy, and reports in text, JSON,
//! JUnit XML or Markdown (docs/ci.md).
//!
//! * [`policy`]: the policy file, profiles, precedence and rules.
//! * [`tolerance`]: element-wise, ULP, aggregate and logit checks.
//! * [`evaluate`]: walks both traces record by record and judges every
//!   difference by its level's mode and the first matching rule.
//! * [`baseline`]: blessed fingerprints (`--bless`) and the comparison with them.
//! * [`report_junit`], [`report_md`]: CI-native renderings of a [`GateReport`].

pub mod baseline;
pub mod policy;
pub mod report_junit;
pub mod report_md;
pub mod tolerance;

use moeconf_bisect::{summarize, FirstDivergence};
use moeconf_fingerprint::{Coord, DType, Level};
use moeconf_schema::{IndexEntry, Trace};
use policy::{Check, Mode, Profile};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use tolerance::{Eval, Minimal};

/// Version of the gate's JSON document.
pub const GATE_SCHEMA_VERSION: u32 = 1;

/// Where a record sits, for messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Loc {
    /// `L0`…`L4`.
    pub level: String,
    /// Forward step.
    pub step: u32,
    /// Absolute position.
    pub position: u32,
    /// `prefill` or `decode`.
    pub phase: String,
    /// Decoder layer.
    pub layer: Option<u32>,
    /// Component path.
    pub path: String,
}

impl Loc {
    fn new(level: Level, c: &Coord) -> Loc {
        Loc {
            level: level.name().into(),
            step: c.step,
            position: c.position,
            phase: c.phase.name().into(),
            layer: c.layer,
            path: c.path.clone(),
        }
    }

    /// `step 1 pos 5 (decode) layer 5 moe.combine`.
    pub fn describe(&self) -> String {
        let mut s = format!("step {} pos {} ({})", self.step, self.position, self.phase);
        if let Some(l) = self.layer {
            s.push_str(&format!(" layer {l}"));
        }
        s.push(' ');
        s.push_str(&self.path);
        s
    }
}

/// One failing record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Failure {
    /// Where.
    pub at: Loc,
    /// Why.
    pub reason: String,
}

/// A flip accepted as a near-tie (reported as a warning).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NearTie {
    /// `route` (router.topk) or `argmax` (token.output, lm.logits, lm.topk_ids).
    pub kind: String,
    /// Where.
    pub at: Loc,
    /// The reference's margin there.
    pub reference_margin: f64,
    /// The policy threshold it is below.
    pub threshold: f64,
    /// What changed, e.g. `[29, 12, 2] -> [29, 12, 19]`.
    pub change: String,
}

/// Status of a level or rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Nothing fails.
    Pass,
    /// Nothing fails, but near-ties were accepted.
    Warn,
    /// At least one record fails or is inconclusive.
    Fail,
    /// Informational level with differences.
    Info,
    /// Not captured by both traces.
    NotCompared,
}

impl Status {
    /// Upper-case label.
    pub fn label(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
            Status::Info => "INFO",
            Status::NotCompared => "NOT COMPARED",
        }
    }
}

/// Result of one level.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LevelResult {
    /// `L0`…`L4`.
    pub level: String,
    /// What the level holds.
    pub describe: String,
    /// Mode from the policy.
    pub mode: Mode,
    /// Verdict.
    pub status: Status,
    /// Reference records looked at.
    pub records: u64,
    /// Records whose digests differ (or that exist on one side only).
    pub differing: u64,
    /// Records that fail.
    pub failed: u64,
    /// Of those, inconclusive (no payloads to judge a tolerance).
    pub inconclusive: u64,
    /// Near-ties accepted (and records waived with them).
    pub near_ties: u64,
    /// Records not gated because an accepted token near-tie changed the inputs of their step.
    pub skipped_after_near_tie: u64,
    /// The first differing record.
    pub first_difference: Option<Loc>,
    /// The first failure in execution order.
    pub first_failure: Option<Failure>,
    /// Smallest element-wise tolerance (rtol 0 / atol 0) under which the
    /// differing float records of a bitwise level would have matched (from payloads).
    pub minimal: Option<Minimal>,
}

impl LevelResult {
    /// A level with nothing judged yet: `Pass` when both sides captured it,
    /// `NotCompared` otherwise.
    pub fn empty(level: Level, mode: Mode, captured: bool) -> LevelResult {
        LevelResult {
            level: level.name().into(),
            describe: level.describe().into(),
            mode,
            status: if captured {
                Status::Pass
            } else {
                Status::NotCompared
            },
            records: 0,
            differing: 0,
            failed: 0,
            inconclusive: 0,
            near_ties: 0,
            skipped_after_near_tie: 0,
            first_difference: None,
            first_failure: None,
            minimal: None,
        }
    }
}

/// Result of one rule (only rules that judged a differing record are listed).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleResult {
    /// `#2 layer.* at L3 (aggregate)`, or `bitwise` for a bitwise level.
    pub rule: String,
    /// Levels whose records it judged.
    pub levels: Vec<String>,
    /// Differing records judged.
    pub judged: u64,
    /// Records it failed (inconclusive included).
    pub failed: u64,
    /// Verdict.
    pub status: Status,
    /// The first failure.
    pub first_failure: Option<Failure>,
    /// What would have passed every record it judged.
    pub minimal: Option<Minimal>,
}

/// The gate's result: one serializable document (`--format json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateReport {
    /// [`GATE_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// `moeconf.gate`.
    pub kind: String,
    /// `pass` or `fail`.
    pub verdict: Status,
    /// The resolved profile.
    pub profile: Profile,
    /// Where the policy came from.
    pub policy_source: String,
    /// `reference` (a reference trace) or `baseline` (blessed fingerprints).
    pub against: String,
    /// Reference trace or baseline file.
    pub reference: String,
    /// Candidate trace.
    pub candidate: String,
    /// Candidate root digest.
    pub candidate_root: String,
    /// The diff engine's localization of the first divergence.
    pub localization: Option<FirstDivergence>,
    /// One entry per level.
    pub levels: Vec<LevelResult>,
    /// Rules that judged differing records.
    pub rules: Vec<RuleResult>,
    /// Accepted near-ties.
    pub near_ties: Vec<NearTie>,
    /// Notes (binding differences, baseline facts).
    pub notes: Vec<String>,
    /// One-line summary.
    pub summary: String,
}

impl GateReport {
    /// Process exit code: 0 pass, 1 fail.
    pub fn exit_code(&self) -> u8 {
        if self.verdict == Status::Fail {
            1
        } else {
            0
        }
    }

    /// The JSON document.
    pub fn to_json(&self) -> serde_json::Value {
        // Plain structs with string keys; non-finite floats become null.
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// `step 1 pos 5 (decode) layer 5 moe.combine (L4)`, from the diff engine.
    pub fn localization_line(&self) -> Option<String> {
        self.localization.as_ref().map(|f| {
            let mut s = format!("step {} pos {}", f.step, f.position);
            if let Some(l) = f.layer {
                s.push_str(&format!(" layer {l}"));
            }
            s.push_str(&format!(" operator {} ({})", f.operator, f.level));
            if let Some(c) = &f.contract {
                s.push_str(&format!(", candidate contract {c}"));
            }
            s
        })
    }

    /// The human-readable report (summary line last).
    pub fn render_text(&self) -> String {
        let mut s = format!(
            "moeconf gate: {} (profile {}, policy {})\n  reference  {}\n  candidate  {}\n",
            self.verdict.label(),
            self.profile.name,
            self.policy_source,
            self.reference,
            self.candidate
        );
        if let Some(l) = self.localization_line() {
            s.push_str(&format!("  first divergence: {l}\n"));
        }
        for n in &self.notes {
            s.push_str(&format!("  note: {n}\n"));
        }
        s.push('\n');
        for l in &self.levels {
            s.push_str(&format!(
                "{} {:<9} {:<12} {} records, {} differ, {} fail  ({})\n",
                l.level,
                l.mode.name(),
                l.status.label(),
                l.records,
                l.differing,
                l.failed,
                l.describe
            ));
            if let Some(f) = &l.first_failure {
                s.push_str(&format!("   first failure: {}: {}\n", f.at.describe(), f.reason));
            } else if let Some(d) = &l.first_difference {
                s.push_str(&format!("   first difference: {}\n", d.describe()));
            }
            if l.inconclusive > 0 {
                s.push_str(&format!("   {} inconclusive (no payloads)\n", l.inconclusive));
            }
            if l.skipped_after_near_tie > 0 {
                s.push_str(&format!(
                    "   {} records not gated: later steps consume a different token after an accepted near-tie\n",
                    l.skipped_after_near_tie
                ));
            }
            if let (Some(m), Status::Fail | Status::Info) = (&l.minimal, l.status) {
                s.push_str(&format!(
                    "   would have matched element-wise with {}\n",
                    m.describe()
                ));
            }
        }
        if !self.rules.is_empty() {
            s.push_str("\nrules\n");
            for r in &self.rules {
                s.push_str(&format!(
                    "  {:<5} {} [{}]: {} judged, {} fail\n",
                    r.status.label(),
                    r.rule,
                    r.levels.join(","),
                    r.judged,
                    r.failed
                ));
                if let Some(f) = &r.first_failure {
                    s.push_str(&format!(
                        "        first failure: {}: {}\n",
                        f.at.describe(),
                        f.reason
                    ));
                }
                if let Some(m) = &r.minimal {
                    s.push_str(&format!("        smallest passing tolerance: {}\n", m.describe()));
                }
            }
        }
        if !self.near_ties.is_empty() {
            s.push_str("\nnear-ties (warnings)\n");
            for n in &self.near_ties {
                s.push_str(&format!(
                    "  {} flip at {}: {} (reference margin {:.3e} < {})\n",
                    n.kind,
                    n.at.describe(),
                    n.change,
                    n.reference_margin,
                    n.threshold
                ));
            }
        }
        s.push('\n');
        s.push_str(&self.summary);
        s.push('\n');
        s
    }
}

type Key<'a> = (u32, u32, Option<u32>, u32, &'static str, &'a str);

fn key(e: &IndexEntry) -> Key<'_> {
    (
        e.coord.step,
        e.level.code(),
        e.coord.layer,
        e.coord.position,
        e.coord.phase.name(),
        e.coord.path.as_str(),
    )
}

/// The one-element f32 payload of record `i` (margins).
fn scalar(t: &Trace, i: usize) -> Option<f64> {
    let e = t.records().get(i)?;
    let p = t.payload(i)?;
    tolerance::decode(e.dtype, p)?.first().copied()
}

fn ints(t: &Trace, i: usize) -> Option<Vec<i64>> {
    let e = t.records().get(i)?;
    if e.dtype.is_float() {
        return None;
    }
    Some(
        tolerance::decode(e.dtype, t.payload(i)?)?
            .iter()
            .map(|&v| v as i64)
            .collect(),
    )
}

/// What a tolerance check said about one record.
enum Outcome {
    Pass(Option<Minimal>),
    Fail(String, Option<Minimal>),
    Inconclusive(String),
    NearTie(NearTie),
    Waived,
}

#[derive(Default)]
struct RuleAcc {
    levels: Vec<String>,
    judged: u64,
    failed: u64,
    first_failure: Option<Failure>,
    minimal: Option<Minimal>,
}

impl RuleAcc {
    fn minimal(&mut self, m: Option<Minimal>) {
        if let Some(m) = m {
            self.minimal = Some(match self.minimal {
                Some(a) => a.merge(m),
                None => m,
            });
        }
    }
}

struct LevelAcc {
    r: LevelResult,
}

/// The dtype whose default tolerances apply: float records are stored as
/// f32, but in a bf16 profile (either side) they carry bf16 precision.
fn effective_dtype(d: DType, r: &Trace, c: &Trace) -> DType {
    if d == DType::F32 && (r.binding().precision == "bf16" || c.binding().precision == "bf16") {
        DType::BF16
    } else {
        d
    }
}

/// Judges `candidate` against `reference` under `profile`.
///
/// Every reference record is matched with the candidate record of the same
/// (step, level, layer, position, phase, path); equal digests pass. A
/// differing record fails on a bitwise level, is reported on an info level,
/// and on a tolerance level is judged by the first matching rule (with the
/// near-tie rules of docs/ci.md applied first). `localization` is the diff
/// engine's first divergence, shown in every failure report.
pub fn evaluate(
    reference: &Trace,
    candidate: &Trace,
    profile: &Profile,
    localization: Option<FirstDivergence>,
) -> GateReport {
    let (rr, cr) = (reference.records(), candidate.records());
    let cmap: HashMap<Key<'_>, usize> = cr.iter().enumerate().map(|(i, e)| (key(e), i)).collect();
    let mut present = [false; 5];
    for e in rr {
        present[e.level.code() as usize] = true;
    }
    let captured = |l: Level| {
        reference.binding().capture.captures(l)
            && candidate.binding().capture.captures(l)
            && present[l.code() as usize]
    };
    let tol = |l: Level| profile.mode(l) == Mode::Tolerance;

    // Reference margins: lm.margin per step, router.margin per (step, position, layer).
    let mut lm_margin: BTreeMap<u32, f64> = BTreeMap::new();
    let mut router_margin: HashMap<(u32, u32, Option<u32>), f64> = HashMap::new();
    for (i, e) in rr.iter().enumerate() {
        match e.coord.path.as_str() {
            "lm.margin" => {
                if let Some(v) = scalar(reference, i) {
                    lm_margin.insert(e.coord.step, v);
                }
            }
            "router.margin" => {
                if let Some(v) = scalar(reference, i) {
                    router_margin.insert((e.coord.step, e.coord.position, e.coord.layer), v);
                }
            }
            _ => {}
        }
    }
    let argmax_tie = |step: u32| -> Option<f64> {
        let m = *lm_margin.get(&step)?;
        (profile.argmax_near_tie_margin > 0.0 && m < profile.argmax_near_tie_margin).then_some(m)
    };

    let mut near_ties: Vec<NearTie> = Vec::new();
    // Token near-tie: the first step whose token.output differs.
    let mut cutoff: Option<u32> = None;
    let mut outputs: Vec<(usize, &IndexEntry)> = rr
        .iter()
        .enumerate()
        .filter(|(_, e)| e.coord.path == "token.output")
        .collect();
    outputs.sort_by_key(|(_, e)| e.coord.step);
    for (i, e) in outputs {
        let Some(&j) = cmap.get(&key(e)) else { break };
        if cr[j].digest == e.digest {
            continue;
        }
        if tol(Level::L0) {
            if let Some(m) = argmax_tie(e.coord.step) {
                cutoff = Some(e.coord.step);
                near_ties.push(NearTie {
                    kind: "argmax".into(),
                    at: Loc::new(e.level, &e.coord),
                    reference_margin: m,
                    threshold: profile.argmax_near_tie_margin,
                    change: format!(
                        "token {:?} -> {:?}",
                        ints(reference, i).unwrap_or_default(),
                        ints(candidate, j).unwrap_or_default()
                    ),
                });
            }
        }
        break;
    }
    // Route near-ties.
    let mut route_ties: HashSet<(u32, u32, Option<u32>)> = HashSet::new();
    if tol(Level::L3) && profile.route_near_tie_margin > 0.0 {
        for (i, e) in rr.iter().enumerate() {
            if e.coord.path != "router.topk" || cutoff.is_some_and(|s| e.coord.step > s) {
                continue;
            }
            let Some(&j) = cmap.get(&key(e)) else { continue };
            if cr[j].digest == e.digest {
                continue;
            }
            let at = (e.coord.step, e.coord.position, e.coord.layer);
            if let Some(&m) = router_margin.get(&at) {
                if m < profile.route_near_tie_margin {
                    route_ties.insert(at);
                    let (a, b) = (
                        ints(reference, i).unwrap_or_default(),
                        ints(candidate, j).unwrap_or_default(),
                    );
                    let same_set = {
                        let (mut x, mut y) = (a.clone(), b.clone());
                        x.sort_unstable();
                        y.sort_unstable();
                        x == y
                    };
                    near_ties.push(NearTie {
                        kind: "route".into(),
                        at: Loc::new(e.level, &e.coord),
                        reference_margin: m,
                        threshold: profile.route_near_tie_margin,
                        change: format!(
                            "experts {a:?} -> {b:?}{}",
                            if same_set {
                                " (same set, selection order changed)"
                            } else {
                                ""
                            }
                        ),
                    });
                }
            }
        }
    }

    let mut levels: Vec<LevelAcc> = Level::ALL
        .iter()
        .map(|&l| LevelAcc {
            r: LevelResult::empty(l, profile.mode(l), captured(l)),
        })
        .collect();
    // Rule accumulators keyed by rule index; bitwise failures of level l under usize::MAX - 5 + l.
    let mut rules: BTreeMap<usize, RuleAcc> = BTreeMap::new();

    let mut judge =
        |lvl: Level, at: Loc, ri: Option<usize>, ci: Option<usize>, levels: &mut Vec<LevelAcc>| {
            let la = &mut levels[lvl.code() as usize].r;
            la.differing += 1;
            la.first_difference.get_or_insert_with(|| at.clone());
            let mode = profile.mode(lvl);
            // Bitwise-style minimal tolerance from payloads, for information.
            let (re, ce) = (ri.map(|i| &rr[i]), ci.map(|j| &cr[j]));
            let payloads = match (ri, ci) {
                (Some(i), Some(j)) => match (reference.payload_verified(i), candidate.payload_verified(j)) {
                    (Ok(a), Ok(b)) => Ok((a, b)),
                    (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
                },
                _ => Ok((None, None)),
            };
            if let (Some(re), Some(ce), Ok((Some(a), Some(b)))) = (re, ce, &payloads) {
                if re.dtype.is_float() {
                    if let Some(s) = summarize(re.dtype, &re.shape, a, ce.dtype, &ce.shape, b) {
                        let m = Minimal::Elementwise {
                            rtol: 0.0,
                            atol_needed: s.min_atol,
                            atol: 0.0,
                            rtol_needed: s.min_rtol,
                        };
                        la.minimal = Some(la.minimal.map_or(m, |x| x.merge(m)));
                    }
                }
            }
            let missing = match (re, ce) {
                (Some(_), None) => Some("only in the reference (missing from the candidate)"),
                (None, Some(_)) => Some("only in the candidate"),
                _ => None,
            };
            let (rule_key, outcome) = match mode {
                Mode::Info => return,
                Mode::Bitwise => (
                    usize::MAX - 5 + lvl.code() as usize,
                    Outcome::Fail(missing.unwrap_or("differs bitwise").to_string(), None),
                ),
                Mode::Tolerance => {
                    let rule = profile.rule_for(lvl, &at.path);
                    let idx = rule.map(|(i, _)| i).unwrap_or(usize::MAX);
                    let outcome = if let Some(m) = missing {
                        Outcome::Fail(m.to_string(), None)
                    } else if (lvl == Level::L0 && cutoff == Some(at.step))
                        || (route_ties.contains(&(at.step, at.position, at.layer))
                            && (at.path == "router.topk"
                                || at.path == "router.gates"
                                || at.path.starts_with("moe.term.")))
                    {
                        // Part of an accepted near-tie (token or route flip).
                        Outcome::Waived
                    } else {
                        match (rule, payloads, re, ce) {
                            (None, ..) => {
                                Outcome::Fail("no rule matches (the policy lacks a catch-all)".into(), None)
                            }
                            (_, Err(e), ..) => Outcome::Fail(format!("corrupt payload: {e}"), None),
                            (Some((_, r)), Ok((a, b)), Some(re), Some(ce)) => judge_record(
                                profile,
                                &r.check,
                                reference,
                                candidate,
                                re,
                                ce,
                                (a, b),
                                lm_margin.get(&at.step).copied(),
                            ),
                            _ => Outcome::Fail("record missing".into(), None),
                        }
                    };
                    (idx, outcome)
                }
            };
            let acc = rules.entry(rule_key).or_default();
            if !acc.levels.contains(&at.level) {
                acc.levels.push(at.level.clone());
            }
            acc.judged += 1;
            let fail = |acc: &mut RuleAcc, la: &mut LevelResult, reason: String| {
                acc.failed += 1;
                la.failed += 1;
                let f = Failure {
                    at: at.clone(),
                    reason,
                };
                acc.first_failure.get_or_insert_with(|| f.clone());
                la.first_failure.get_or_insert(f);
            };
            match outcome {
                Outcome::Pass(m) => acc.minimal(m),
                Outcome::Waived => la.near_ties += 1,
                Outcome::NearTie(n) => {
                    la.near_ties += 1;
                    near_ties.push(n);
                }
                Outcome::Fail(reason, m) => {
                    acc.minimal(m);
                    fail(acc, la, reason);
                }
                Outcome::Inconclusive(reason) => {
                    la.inconclusive += 1;
                    fail(acc, la, reason);
                }
            }
        };

    for (i, e) in rr.iter().enumerate() {
        let lvl = e.level;
        if !captured(lvl) {
            continue;
        }
        levels[lvl.code() as usize].r.records += 1;
        if cutoff.is_some_and(|s| e.coord.step > s) {
            levels[lvl.code() as usize].r.skipped_after_near_tie += 1;
            continue;
        }
        let j = cmap.get(&key(e)).copied();
        if j.is_some_and(|j| cr[j].digest == e.digest) {
            continue;
        }
        judge(lvl, Loc::new(lvl, &e.coord), Some(i), j, &mut levels);
    }
    let rkeys: HashSet<Key<'_>> = rr.iter().map(key).collect();
    for (j, e) in cr.iter().enumerate() {
        if !captured(e.level) || rkeys.contains(&key(e)) || cutoff.is_some_and(|s| e.coord.step > s) {
            continue;
        }
        judge(e.level, Loc::new(e.level, &e.coord), None, Some(j), &mut levels);
    }
    finish(
        profile,
        levels.into_iter().map(|l| l.r).collect(),
        rules,
        near_ties,
        localization,
    )
}

/// Judges one differing record pair under a rule's check; passing and
/// failing records both return the minimal tolerance they need, which
/// `evaluate` merges per rule.
#[allow(clippy::too_many_arguments)]
fn judge_record(
    profile: &Profile,
    check: &Check,
    reference: &Trace,
    candidate: &Trace,
    re: &IndexEntry,
    ce: &IndexEntry,
    (a, b): (Option<&[u8]>, Option<&[u8]>),
    lm_margin: Option<f64>,
) -> Outcome {
    let at = Loc::new(re.level, &re.coord);
    if matches!(check, Check::Exact) {
        return Outcome::Fail("differs (rule requires exact equality)".into(), None);
    }
    if matches!(check, Check::Ignore) {
        return Outcome::Pass(None);
    }
    let (Some(a), Some(b)) = (a, b) else {
        let side = match (a.is_some(), b.is_some()) {
            (false, false) => "either trace",
            (false, true) => "the reference",
            _ => "the candidate",
        };
        return Outcome::Inconclusive(format!(
            "inconclusive: {} differs but {side} has no payload for it, so the {} tolerance cannot be \
             checked; capture payloads for {} (moeconf run --capture {}+payload or --capture all)",
            at.path,
            check.name(),
            at.level,
            at.level
        ));
    };
    if re.dtype != ce.dtype || re.shape != ce.shape {
        return Outcome::Fail(
            format!(
                "dtype/shape differ: reference {} {:?}, candidate {} {:?}",
                re.dtype.name(),
                re.shape,
                ce.dtype.name(),
                ce.shape
            ),
            None,
        );
    }
    let eval_to = |e: Eval| {
        if e.pass {
            Outcome::Pass(e.minimal)
        } else {
            Outcome::Fail(e.detail, e.minimal)
        }
    };
    match check {
        Check::Elementwise { rtol, atol } => {
            let (dr, da) = profile.dtype_default(effective_dtype(re.dtype, reference, candidate));
            eval_to(tolerance::elementwise(
                re.dtype,
                a,
                b,
                rtol.unwrap_or(dr),
                atol.unwrap_or(da),
                profile.equal_nan,
            ))
        }
        Check::Ulp { max_ulp } => eval_to(tolerance::ulp(re.dtype, a, b, *max_ulp, profile.equal_nan)),
        Check::Aggregate {
            cosine_min,
            norm_ratio_tol,
            nmse_max,
        } => eval_to(tolerance::aggregate(
            re.dtype,
            a,
            b,
            (*cosine_min, *norm_ratio_tol, *nmse_max),
            profile.equal_nan,
        )),
        Check::Logits {
            topk_overlap_min,
            topk,
            kl_max,
        } => {
            let k = *topk as usize;
            let (argmax, eval) = match re.coord.path.as_str() {
                "lm.logits" => {
                    tolerance::logits(re.dtype, a, b, (*topk_overlap_min, k, *kl_max), profile.equal_nan)
                }
                "lm.topk_ids" => {
                    let (Some(x), Some(y)) = (tolerance::decode(re.dtype, a), tolerance::decode(re.dtype, b))
                    else {
                        return Outcome::Fail("malformed lm.topk_ids payload".into(), None);
                    };
                    let (x, y): (Vec<i64>, Vec<i64>) = (
                        x.iter().map(|&v| v as i64).collect(),
                        y.iter().map(|&v| v as i64).collect(),
                    );
                    let k = k.min(x.len());
                    let ov = tolerance::overlap(&x, &y, k);
                    let am = x.first().zip(y.first()).map(|(&p, &q)| (p as usize, q as usize));
                    (
                        am,
                        Eval {
                            pass: ov >= *topk_overlap_min,
                            detail: format!("top-{k} id overlap {ov:.3} (min {topk_overlap_min})"),
                            minimal: Some(Minimal::Logits {
                                topk_overlap_min_needed: ov,
                                kl_max_needed: None,
                            }),
                        },
                    )
                }
                "lm.topk_logits" | "lm.margin" => return Outcome::Pass(None),
                other => {
                    return Outcome::Fail(
                        format!("check \"logits\" applies to lm.logits and lm.topk_ids, not {other}"),
                        None,
                    )
                }
            };
            if let Some((p, q)) = argmax {
                if p != q {
                    let thr = profile.argmax_near_tie_margin;
                    match lm_margin {
                        Some(m) if thr > 0.0 && m < thr && eval.pass => {
                            return Outcome::NearTie(NearTie {
                                kind: "argmax".into(),
                                at,
                                reference_margin: m,
                                threshold: thr,
                                change: format!("argmax {p} -> {q}"),
                            })
                        }
                        _ => {
                            let margin = lm_margin
                                .map(|m| format!("{m:.3e}"))
                                .unwrap_or_else(|| "unknown".into());
                            return Outcome::Fail(
                                format!(
                                    "argmax flip {p} -> {q} (reference margin {margin}, near-tie threshold {thr}); {}",
                                    eval.detail
                                ),
                                eval.minimal,
                            );
                        }
                    }
                }
            }
            eval_to(eval)
        }
        Check::Exact | Check::Ignore => Outcome::Pass(None),
    }
}

fn finish(
    profile: &Profile,
    mut levels: Vec<LevelResult>,
    rules: BTreeMap<usize, RuleAcc>,
    near_ties: Vec<NearTie>,
    localization: Option<FirstDivergence>,
) -> GateReport {
    for l in &mut levels {
        if l.status == Status::NotCompared {
            continue;
        }
        l.status = if l.failed > 0 {
            Status::Fail
        } else if l.mode == Mode::Info && l.differing > 0 {
            Status::Info
        } else if l.near_ties > 0 {
            Status::Warn
        } else {
            Status::Pass
        };
    }
    let rules: Vec<RuleResult> = rules
        .into_iter()
        .map(|(k, a)| RuleResult {
            rule: match profile.rules.get(k) {
                Some(r) => r.describe(k),
                None if k == usize::MAX => "no rule".into(),
                None => "bitwise".into(),
            },
            levels: a.levels,
            judged: a.judged,
            failed: a.failed,
            status: if a.failed > 0 { Status::Fail } else { Status::Pass },
            first_failure: a.first_failure,
            minimal: a.minimal,
        })
        .collect();
    let verdict = if levels.iter().any(|l| l.status == Status::Fail) {
        Status::Fail
    } else if !near_ties.is_empty() {
        Status::Warn
    } else {
        Status::Pass
    };
    let count = |s: Status| levels.iter().filter(|l| l.status == s).count();
    let summary = format!(
        "{}: {} passed, {} failed, {} warned, {} info, {} not compared (levels); {} near-ties",
        if verdict == Status::Fail { "FAIL" } else { "PASS" },
        count(Status::Pass),
        count(Status::Fail),
        count(Status::Warn),
        count(Status::Info),
        count(Status::NotCompared),
        near_ties.len()
    );
    GateReport {
        schema_version: GATE_SCHEMA_VERSION,
        kind: "moeconf.gate".into(),
        verdict,
        profile: profile.clone(),
        policy_source: String::new(),
        against: "reference".into(),
        reference: String::new(),
        candidate: String::new(),
        candidate_root: String::new(),
        localization,
        levels,
        rules,
        near_ties,
        notes: Vec::new(),
        summary,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeconf_fingerprint::{Algorithm, Phase, TensorView};
    use moeconf_schema::{Binding, CaptureSpec, Header, TraceWriter};

    /// One L3 record `layer.post_ffn_mhc` holding `v`, in a trace of the given precision.
    fn trace(dir: &std::path::Path, name: &str, precision: &str, v: &[f32]) -> Trace {
        let path = dir.join(name);
        let binding = Binding {
            precision: precision.into(),
            capture: CaptureSpec {
                levels: 0b11111,
                payload_levels: 0b11111,
            },
            ..Binding::default()
        };
        let mut w = TraceWriter::create(
            &path,
            Algorithm::Blake3,
            Header {
                binding,
                ..Header::default()
            },
        )
        .unwrap();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let coord = Coord {
            step: 0,
            position: 0,
            phase: Phase::Prefill,
            layer: Some(0),
            path: "layer.post_ffn_mhc".into(),
        };
        let view = TensorView {
            dtype: DType::F32,
            shape: &[v.len() as u64],
            bytes: &bytes,
        };
        w.append(coord, Level::L3, view, true).unwrap();
        w.finish().unwrap();
        Trace::open(&path).unwrap()
    }

    fn tolerant() -> Profile {
        let mut p = Profile::builtin("t");
        p.levels[3] = Mode::Tolerance;
        p
    }

    #[test]
    fn bf16_traces_use_the_bf16_row_of_the_dtype_table() {
        let dir = tempfile::tempdir().unwrap();
        // Relative difference 2^-10 ≈ 9.8e-4: inside bf16's rtol 1.6e-2, far outside f32's 1.3e-6.
        let v = [1.0f32, 2.0, -4.0];
        let w = [1.0f32 + 1.0 / 1024.0, 2.0, -4.0];
        let (r, c) = (
            trace(dir.path(), "r.bin", "bf16", &v),
            trace(dir.path(), "c.bin", "bf16", &w),
        );
        let rep = evaluate(&r, &c, &tolerant(), None);
        assert_eq!(rep.levels[3].status, Status::Pass, "{}", rep.render_text());
        assert_eq!(rep.levels[3].differing, 1);
        let (r, c) = (
            trace(dir.path(), "r32.bin", "f32", &v),
            trace(dir.path(), "c32.bin", "f32", &w),
        );
        let rep = evaluate(&r, &c, &tolerant(), None);
        assert_eq!(rep.levels[3].status, Status::Fail);
        assert!(
            rep.rules[0].minimal.unwrap().describe().contains("rtol >= 9.6"),
            "{}",
            rep.render_text()
        );
        // Bitwise fails either way; info reports without failing.
        let mut p = tolerant();
        p.levels[3] = Mode::Bitwise;
        assert_eq!(evaluate(&r, &c, &p, None).verdict, Status::Fail);
        p.levels[3] = Mode::Info;
        let rep = evaluate(&r, &c, &p, None);
        assert_eq!((rep.verdict, rep.levels[3].status), (Status::Pass, Status::Info));
    }

    #[test]
    fn nan_policy_and_per_dtype_override_reach_the_evaluation() {
        let dir = tempfile::tempdir().unwrap();
        let nan = f32::NAN;
        let (r, c) = (
            trace(dir.path(), "r.bin", "f32", &[nan, 1.0]),
            trace(dir.path(), "c.bin", "f32", &[nan, 1.5]),
        );
        let mut p = tolerant();
        p.dtype_tolerance.insert("f32".into(), (0.0, 0.5));
        assert_eq!(
            evaluate(&r, &c, &p, None).verdict,
            Status::Fail,
            "both NaN without equal_nan"
        );
        p.equal_nan = true;
        assert_eq!(evaluate(&r, &c, &p, None).verdict, Status::Pass);
        p.dtype_tolerance.insert("f32".into(), (0.0, 0.25));
        assert_eq!(evaluate(&r, &c, &p, None).verdict, Status::Fail);
        // A ulp rule first in line replaces the catch-all for this path.
        p.rules.insert(
            0,
            policy::Rule {
                path: "layer.*".into(),
                level: None,
                check: Check::Ulp { max_ulp: 1 << 22 },
            },
        );
        assert_eq!(
            evaluate(&r, &c, &p, None).verdict,
            Status::Pass,
            "1.0 -> 1.5 is 2^22 ulp"
        );
    }
}
