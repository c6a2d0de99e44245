//! Judging a candidate trace against a reference trace (docs/ci.md §3–4).
//!
//! The diff engine pairs the records ([`differing_pairs`]: the hash trees
//! are descended only where digests differ, so equal records cost nothing).
//! Before any record is judged, the reference's margins decide which flips
//! are near-ties: a token flip below `argmax_near_tie_margin` stops the gate
//! after its step (later steps consume another token), a route flip below
//! `route_near_tie_margin` waives the selection-slot records of its
//! coordinate. Then every differing record of a level captured by both sides
//! is judged, in execution order, by its level's mode and, on a tolerance
//! level, by the first matching rule; [`Tally`] sums the outcomes per level
//! and per rule into the [`GateReport`].

use crate::coverage::{self, Coverage, Sides};
use crate::error::GateError;
use crate::judge::{self, Differing, Outcome, PayloadPair};
use crate::policy::{Mode, Profile};
use crate::report::{Failure, FlipKind, GateReport, LevelResult, NearTie, RuleResult, Status};
use crate::tolerance::Minimal;
use moeconf_bisect::{differing_pairs, summarize, FirstDivergence, RecordPair, RecordRef, Side};
use moeconf_fingerprint::catalogue::ExecKey;
use moeconf_fingerprint::{Component, Level, LevelSet};
use moeconf_schema::{IndexEntry, Trace};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};

/// Which rule decided a record: the key of the per-rule results, in the
/// order they are reported (policy rules first, then bitwise levels, then
/// records no rule matched).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Decider {
    /// The policy rule at this index (tolerance levels).
    Rule(usize),
    /// A bitwise level: every difference fails.
    Bitwise(Level),
    /// No rule matched (a profile without a catch-all rule).
    NoRule,
}

impl Decider {
    /// `#2 layer.* at L3 (aggregate)`, `bitwise` or `no rule`.
    fn describe(self, profile: &Profile) -> String {
        match self {
            Decider::Rule(i) => profile
                .rules
                .get(i)
                .map_or_else(|| "no rule".into(), |r| r.describe(i)),
            Decider::Bitwise(_) => "bitwise".into(),
            Decider::NoRule => "no rule".into(),
        }
    }
}

/// Where a route is chosen: one token at one layer of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct RouteSite {
    step: u32,
    position: u32,
    layer: Option<u32>,
}

impl RouteSite {
    fn of(e: &IndexEntry) -> RouteSite {
        RouteSite {
            step: e.coord.step,
            position: e.coord.position,
            layer: e.coord.layer,
        }
    }
}

/// The reference's decision margins (`lm.margin` per step,
/// `router.margin` per route site), read where a decision is judged: a
/// margin payload that does not match its record digest is an error (a
/// corrupted margin must not decide a near-tie). Only the steps and sites
/// the gate judges are read, through the tree, so a version 2 reference
/// reads the margins of its divergent steps only.
struct Margins<'a> {
    reference: &'a Trace,
    lm: RefCell<HashMap<u32, Option<f64>>>,
    router: RefCell<HashMap<RouteSite, Option<f64>>>,
    /// Per (step, layer, component): the matching record ids of the
    /// reference by position, in execution order, built on first use so
    /// that judging many route sites of one long prefill reads each group
    /// once, not once per site.
    sites: RefCell<SiteIndex>,
}

type SiteIndex = HashMap<(u32, Option<u32>, Component), HashMap<u32, Vec<usize>>>;

impl<'a> Margins<'a> {
    fn new(reference: &'a Trace) -> Margins<'a> {
        Margins {
            reference,
            lm: RefCell::new(HashMap::new()),
            router: RefCell::new(HashMap::new()),
            sites: RefCell::new(HashMap::new()),
        }
    }

    /// The value of the last record in write order of `component` at
    /// `step` in `layer` (at `position`, when given) that holds a payload.
    fn find(
        &self,
        step: u32,
        layer: Option<u32>,
        position: Option<u32>,
        component: Component,
    ) -> Result<Option<f64>, GateError> {
        let t = self.reference;
        let key = (step, layer, component);
        if let (Some(p), false) = (position, self.sites.borrow().contains_key(&key)) {
            // One site of a layer whose groups are paged (format version 4):
            // read only the pages holding its position, not the groups.
            if let Some(ids) = self.paged_site(step, layer, p, component)? {
                let mut found = None;
                for i in ids {
                    if let Some(v) = judge::scalar(t, i).map_err(GateError::Reference)? {
                        found = Some(v);
                    }
                }
                return Ok(found);
            }
        }
        if !self.sites.borrow().contains_key(&key) {
            let Some(node) = t.step(step).map_err(GateError::Reference)? else {
                return Ok(None);
            };
            let mut by_position: HashMap<u32, Vec<usize>> = HashMap::new();
            for l in &node.levels {
                if let Some(g) = l.group(layer) {
                    for &i in t.group_records(g).map_err(GateError::Reference)? {
                        let e = t.record(i);
                        if component.matches(&e.coord.path) {
                            by_position.entry(e.coord.position).or_default().push(i);
                        }
                    }
                }
            }
            for ids in by_position.values_mut() {
                ids.sort_by_cached_key(|&i| exec_order(t, i));
            }
            self.sites.borrow_mut().insert(key, by_position);
        }
        let ids: Vec<usize> = {
            let sites = self.sites.borrow();
            let by_position = sites.get(&key);
            match (by_position, position) {
                (None, _) => Vec::new(),
                (Some(m), Some(p)) => m.get(&p).cloned().unwrap_or_default(),
                (Some(m), None) => {
                    let mut all: Vec<usize> = m.values().flatten().copied().collect();
                    all.sort_by_cached_key(|&i| exec_order(t, i));
                    all
                }
            }
        };
        let mut found = None;
        for i in ids {
            if let Some(v) = judge::scalar(t, i).map_err(GateError::Reference)? {
                found = Some(v);
            }
        }
        Ok(found)
    }

    /// The records of `component` at (`step`, `layer`, `position`) in
    /// execution order, when a group of that layer is stored paged
    /// (format version 4): each level's group read only where it holds the
    /// position ([`Trace::group_entries_at`]). `None` when no group of the
    /// layer is paged (the caller indexes the groups whole, once).
    fn paged_site(
        &self,
        step: u32,
        layer: Option<u32>,
        position: u32,
        component: Component,
    ) -> Result<Option<Vec<usize>>, GateError> {
        let t = self.reference;
        let Some(node) = t.step(step).map_err(GateError::Reference)? else {
            return Ok(None);
        };
        let groups: Vec<_> = node.levels.iter().filter_map(|l| l.group(layer)).collect();
        let mut paged = false;
        for g in &groups {
            paged |= t.group_pages(g).map_err(GateError::Reference)?.is_some();
        }
        if !paged {
            return Ok(None);
        }
        let mut ids = Vec::new();
        for g in groups {
            for (i, e) in t.group_entries_at(g, position).map_err(GateError::Reference)? {
                if component.matches(&e.coord.path) {
                    ids.push(i);
                }
            }
        }
        ids.sort_by_cached_key(|&i| exec_order(t, i));
        Ok(Some(ids))
    }

    /// The reference's `lm.margin` at `step`.
    fn lm(&self, step: u32) -> Result<Option<f64>, GateError> {
        if let Some(&v) = self.lm.borrow().get(&step) {
            return Ok(v);
        }
        let v = self.find(step, None, None, Component::LmMargin)?;
        self.lm.borrow_mut().insert(step, v);
        Ok(v)
    }

    /// The reference's `router.margin` at a route site.
    fn router(&self, site: RouteSite) -> Result<Option<f64>, GateError> {
        if let Some(&v) = self.router.borrow().get(&site) {
            return Ok(v);
        }
        let v = self.find(
            site.step,
            site.layer,
            Some(site.position),
            Component::RouterMargin,
        )?;
        self.router.borrow_mut().insert(site, v);
        Ok(v)
    }
}

/// The near-ties accepted before records are judged.
#[derive(Default)]
struct AcceptedFlips {
    /// The step of an accepted token flip: later steps are not gated.
    cutoff: Option<u32>,
    /// Route sites whose flip is accepted.
    routes: HashSet<RouteSite>,
    /// The near-ties, in report order.
    near_ties: Vec<NearTie>,
}

impl AcceptedFlips {
    /// Whether `step` comes after an accepted token flip.
    fn after_cutoff(&self, step: u32) -> bool {
        self.cutoff.is_some_and(|s| step > s)
    }

    /// Whether a differing record is part of an accepted near-tie: the other
    /// L0 records of the flipped token's step, or the selection-slot records
    /// (`router.topk`, `router.gates`, `moe.term.*`) of a flipped route.
    fn waives(&self, level: Level, e: &IndexEntry) -> bool {
        let path = e.coord.path.as_str();
        (level == Level::L0 && self.cutoff == Some(e.coord.step))
            || (self.routes.contains(&RouteSite::of(e))
                && (Component::RouterTopk.matches(path)
                    || Component::RouterGates.matches(path)
                    || path.starts_with(Component::MoeTerm.path())))
    }
}

/// Both traces, the profile and the reference's margins.
struct Gate<'a> {
    reference: &'a Trace,
    candidate: &'a Trace,
    profile: &'a Profile,
    margins: Margins<'a>,
}

impl<'a> Gate<'a> {
    /// The entry of a pair on whichever side has it (reference first).
    fn entry(&self, p: RecordPair) -> Option<&'a IndexEntry> {
        let (r, c) = (self.reference, self.candidate);
        p.reference
            .and_then(|i| r.get_record(i))
            .or_else(|| p.candidate.and_then(|j| c.get_record(j)))
    }

    /// Both sides' entries of a pair present on both sides.
    fn entries(&self, p: RecordPair) -> Option<(&'a IndexEntry, &'a IndexEntry)> {
        Some((
            self.reference.get_record(p.reference?)?,
            self.candidate.get_record(p.candidate?)?,
        ))
    }

    /// The ids (tokens, experts) of reference record `i` and candidate
    /// record `j`; empty where a side has no integer payload. A corrupted
    /// payload is an error of its side.
    fn ids(&self, i: usize, j: usize) -> Result<(Vec<i64>, Vec<i64>), GateError> {
        Ok((
            judge::ids(self.reference, i)
                .map_err(GateError::Reference)?
                .unwrap_or_default(),
            judge::ids(self.candidate, j)
                .map_err(GateError::Candidate)?
                .unwrap_or_default(),
        ))
    }

    /// The reference margin below the argmax near-tie threshold at `step`.
    fn argmax_tie(&self, step: u32) -> Result<Option<f64>, GateError> {
        let Some(m) = self.margins.lm(step)? else {
            return Ok(None);
        };
        let threshold = self.profile.argmax_near_tie_margin;
        Ok((threshold > 0.0 && m < threshold).then_some(m))
    }

    /// The token near-tie: the first step (in step order) whose reference
    /// `token.output` differs from the candidate's, when its reference margin
    /// is below the argmax threshold on a tolerance L0.
    fn token_flip(&self, pairs: &[RecordPair], flips: &mut AcceptedFlips) -> Result<(), GateError> {
        let first = pairs
            .iter()
            .filter_map(|p| {
                let i = p.reference?;
                Some((i, p.candidate, self.reference.get_record(i)?))
            })
            .filter(|(.., e)| Component::TokenOutput.matches(&e.coord.path))
            .min_by_key(|&(i, ..)| exec_order(self.reference, i));
        // A token missing from the candidate is no flip.
        let Some((i, Some(j), e)) = first else {
            return Ok(());
        };
        if self.profile.mode(Level::L0) != Mode::Tolerance {
            return Ok(());
        }
        let Some(m) = self.argmax_tie(e.coord.step)? else {
            return Ok(());
        };
        flips.cutoff = Some(e.coord.step);
        let (a, b) = self.ids(i, j)?;
        flips.near_ties.push(NearTie {
            kind: FlipKind::Argmax,
            at: RecordRef::new(e.level, &e.coord, "both"),
            reference_margin: m,
            threshold: self.profile.argmax_near_tie_margin,
            change: format!("token {a:?} -> {b:?}"),
        });
        Ok(())
    }

    /// Route near-ties: `router.topk` records that differ, up to the token
    /// cutoff, whose reference `router.margin` is below the route threshold
    /// on a tolerance L3.
    fn route_flips(&self, pairs: &[RecordPair], flips: &mut AcceptedFlips) -> Result<(), GateError> {
        let threshold = self.profile.route_near_tie_margin;
        if self.profile.mode(Level::L3) != Mode::Tolerance || threshold <= 0.0 {
            return Ok(());
        }
        for &p in pairs {
            let (Some(i), Some(j)) = (p.reference, p.candidate) else {
                continue;
            };
            let Some(re) = self.reference.get_record(i) else {
                continue;
            };
            if !Component::RouterTopk.matches(&re.coord.path) || flips.after_cutoff(re.coord.step) {
                continue;
            }
            let site = RouteSite::of(re);
            let Some(m) = self.margins.router(site)?.filter(|&m| m < threshold) else {
                continue;
            };
            flips.routes.insert(site);
            let (a, b) = self.ids(i, j)?;
            let same_set = {
                let (mut x, mut y) = (a.clone(), b.clone());
                x.sort_unstable();
                y.sort_unstable();
                x == y
            };
            flips.near_ties.push(NearTie {
                kind: FlipKind::Route,
                at: RecordRef::new(re.level, &re.coord, "both"),
                reference_margin: m,
                threshold,
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
        Ok(())
    }

    /// A failing `token.output` or `router.topk` is a decision flip that was
    /// not accepted as a near-tie: its failure message says which flip it
    /// is, the reference margin at that decision and the near-tie threshold
    /// (docs/ci.md §4), so a reviewer sees how far from a tie it was.
    fn with_flip_margin(&self, p: RecordPair, outcome: Outcome) -> Result<Outcome, GateError> {
        let Outcome::Fail(reason, minimal) = outcome else {
            return Ok(outcome);
        };
        let (Some(i), Some(j)) = (p.reference, p.candidate) else {
            return Ok(Outcome::Fail(reason, minimal));
        };
        let Some(re) = self.reference.get_record(i) else {
            return Ok(Outcome::Fail(reason, minimal));
        };
        let path = re.coord.path.as_str();
        let (kind, margin, threshold) = if Component::TokenOutput.matches(path) {
            (
                "argmax flip",
                self.margins.lm(re.coord.step)?,
                self.profile.argmax_near_tie_margin,
            )
        } else if Component::RouterTopk.matches(path) {
            (
                "route flip",
                self.margins.router(RouteSite::of(re))?,
                self.profile.route_near_tie_margin,
            )
        } else {
            return Ok(Outcome::Fail(reason, minimal));
        };
        let (a, b) = self.ids(i, j)?;
        let margin = margin.map_or_else(|| "not recorded".to_string(), |m| format!("{m:.3e}"));
        let tie = if threshold > 0.0 {
            format!("near-tie threshold {threshold:e}")
        } else {
            "near-tie rule off".to_string()
        };
        Ok(Outcome::Fail(
            format!("{kind} {a:?} -> {b:?} (reference margin {margin}, {tie}): {reason}"),
            minimal,
        ))
    }

    /// Both payloads of a pair (verified), `None` on a side without one;
    /// one-sided pairs have none. A payload that does not match its record
    /// digest is an error of its side, never a judged difference.
    fn payloads(&self, p: RecordPair) -> Result<PayloadPair<'a>, GateError> {
        let (Some(i), Some(j)) = (p.reference, p.candidate) else {
            return Ok((None, None));
        };
        Ok((
            self.reference.payload_verified(i).map_err(GateError::Reference)?,
            self.candidate.payload_verified(j).map_err(GateError::Candidate)?,
        ))
    }

    /// The element-wise tolerance (rtol 0 / atol 0) under which a differing
    /// float record would have matched, from its payloads (reported for
    /// bitwise and info levels).
    fn bitwise_minimal(&self, p: RecordPair, payloads: PayloadPair<'_>) -> Option<Minimal> {
        let (re, ce) = self.entries(p)?;
        let (Some(a), Some(b)) = payloads else {
            return None;
        };
        if !re.dtype.is_float() {
            return None;
        }
        let s = summarize(re.dtype, &re.shape, a, ce.dtype, &ce.shape, b)?;
        Some(Minimal::Elementwise {
            rtol: 0.0,
            atol_needed: s.min_atol,
            atol: 0.0,
            rtol_needed: s.min_rtol,
        })
    }

    /// Which rule decides a differing record, and its outcome; `None` on an
    /// info level (reported, never judged).
    fn decide(
        &self,
        p: RecordPair,
        payloads: PayloadPair<'a>,
        flips: &AcceptedFlips,
    ) -> Result<Option<(Decider, Outcome)>, GateError> {
        let missing = match (p.reference, p.candidate) {
            (Some(_), None) => Some("only in the reference (missing from the candidate)"),
            (None, Some(_)) => Some("only in the candidate"),
            _ => None,
        };
        let Some(e) = self.entry(p) else {
            return Ok(None);
        };
        let level = e.level;
        Ok(match self.profile.mode(level) {
            Mode::Info => None,
            Mode::Bitwise => Some((
                Decider::Bitwise(level),
                Outcome::Fail(missing.unwrap_or("differs bitwise").to_string(), None),
            )),
            Mode::Tolerance => {
                let rule = self.profile.rule_for(level, &e.coord.path);
                let decider = rule.map_or(Decider::NoRule, |(i, _)| Decider::Rule(i));
                let outcome = match (missing, rule, payloads, self.entries(p)) {
                    (Some(m), ..) => Outcome::Fail(m.to_string(), None),
                    _ if flips.waives(level, e) => Outcome::Waived,
                    (_, None, ..) => {
                        Outcome::Fail("no rule matches (the policy lacks a catch-all)".into(), None)
                    }
                    (_, Some((_, r)), payloads, Some((reference, candidate))) => judge::record(
                        &judge::Context {
                            profile: self.profile,
                            reference: self.reference,
                            candidate: self.candidate,
                            lm_margin: self.margins.lm(e.coord.step)?,
                        },
                        &r.check,
                        &Differing {
                            reference,
                            candidate,
                            payloads,
                        },
                    ),
                    _ => Outcome::Fail("record missing".into(), None),
                };
                Some((decider, outcome))
            }
        })
    }
}

/// What one rule has judged so far.
#[derive(Default)]
struct RuleTally {
    levels: LevelSet,
    judged: u64,
    failed: u64,
    first_failure: Option<Failure>,
    minimal: Option<Minimal>,
}

/// Merges a requirement into an accumulated one (the looser one wins).
fn merge_minimal(acc: &mut Option<Minimal>, m: Option<Minimal>) {
    if let Some(m) = m {
        *acc = Some(acc.map_or(m, |a| a.merge(m)));
    }
}

/// The per-level and per-rule sums of the outcomes.
struct Tally {
    levels: Vec<LevelResult>,
    rules: BTreeMap<Decider, RuleTally>,
    near_ties: Vec<NearTie>,
}

impl Tally {
    fn level(&mut self, level: Level) -> &mut LevelResult {
        &mut self.levels[level.code() as usize]
    }

    /// Adds one judged record's outcome to its level and rule.
    fn add(&mut self, level: Level, decider: Decider, at: RecordRef, outcome: Outcome) {
        let rule = self.rules.entry(decider).or_default();
        rule.levels.insert(level);
        rule.judged += 1;
        let la = &mut self.levels[level.code() as usize];
        let failure = |reason: String| Failure { at, reason };
        let f = match outcome {
            Outcome::Pass(m) => {
                merge_minimal(&mut rule.minimal, m);
                return;
            }
            Outcome::Waived => {
                la.near_ties += 1;
                return;
            }
            Outcome::NearTie(n) => {
                la.near_ties += 1;
                self.near_ties.push(n);
                return;
            }
            Outcome::Fail(reason, m) => {
                merge_minimal(&mut rule.minimal, m);
                failure(reason)
            }
            Outcome::Inconclusive(reason) => {
                la.inconclusive += 1;
                failure(reason)
            }
        };
        rule.failed += 1;
        la.failed += 1;
        rule.first_failure.get_or_insert_with(|| f.clone());
        la.first_failure.get_or_insert(f);
    }

    /// The report: levels settled, rules described in key order.
    fn into_report(self, profile: &Profile, localization: Option<FirstDivergence>) -> GateReport {
        let rules = self
            .rules
            .into_iter()
            .map(|(decider, t)| RuleResult {
                rule: decider.describe(profile),
                levels: t.levels,
                judged: t.judged,
                failed: t.failed,
                status: if t.failed > 0 { Status::Fail } else { Status::Pass },
                first_failure: t.first_failure,
                minimal: t.minimal,
            })
            .collect();
        GateReport::new(profile, self.levels, rules, self.near_ties, localization)
    }
}

/// The result of a required level the candidate does not hold: each of the
/// reference's records of it fails (counted from the root), located at the
/// first in write order (from the first step holding the level).
fn missing_level(
    reference: &Trace,
    profile: &Profile,
    cov: &Coverage,
    level: Level,
) -> Result<LevelResult, GateError> {
    // Every group of the level is read: the count is of the records
    // themselves (each group block checked against its digest), not of
    // what a root or step block declares.
    let (mut steps, mut records) = (0u64, 0u64);
    let mut first: Option<usize> = None;
    for s in reference.steps() {
        let Some(l) = reference
            .step(s.step)
            .map_err(GateError::Reference)?
            .and_then(|n| n.level(level))
        else {
            continue;
        };
        steps += 1;
        let first_step = first.is_none();
        for g in &l.groups {
            let ids = reference.group_records(g).map_err(GateError::Reference)?;
            records += ids.len() as u64;
            if first_step {
                first = first_in_exec_order(reference, first.into_iter().chain(ids.iter().copied()));
            }
        }
    }
    let at = first.map(|i| reference.record(i)).map_or_else(
        || coverage::level_location(level, 0, 0, moeconf_fingerprint::Phase::Prefill),
        |e| RecordRef::new(level, &e.coord, "reference"),
    );
    Ok(cov.missing_level(profile, level, steps, records, at))
}

/// The first of `ids` (records `t` has loaded) in execution order: the
/// catalogue's order, then the coordinate. Never the write-order numbers,
/// which no digest commits to (docs/format.md §11.5).
pub(crate) fn first_in_exec_order(t: &Trace, ids: impl Iterator<Item = usize>) -> Option<usize> {
    ids.min_by_key(|&i| exec_order(t, i))
}

/// The execution-order key of record `i` of `t` (loaded): the catalogue's
/// order, then the coordinate.
fn exec_order(
    t: &Trace,
    i: usize,
) -> (
    ExecKey,
    u32,
    moeconf_fingerprint::Phase,
    moeconf_fingerprint::RecordPath,
) {
    let c = &t.record(i).coord;
    (ExecKey::of(c), c.position, c.phase, c.path.clone())
}

/// Which side holds a pair's record, in [`RecordRef`]'s words.
fn present_in(p: RecordPair) -> &'static str {
    match (p.reference, p.candidate) {
        (Some(_), Some(_)) => "both",
        (Some(_), None) => "reference",
        _ => "candidate",
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
///
/// Every payload the gate reads (margins, ids, the records it judges) is
/// re-hashed against its record digest first; one that does not match is
/// [`GateError::Reference`] or [`GateError::Candidate`], never a verdict.
pub fn evaluate(
    reference: &Trace,
    candidate: &Trace,
    profile: &Profile,
    localization: Option<FirstDivergence>,
) -> Result<GateReport, GateError> {
    let gate = Gate {
        reference,
        candidate,
        profile,
        margins: Margins::new(reference),
    };
    let pairs = differing_pairs(reference, candidate).map_err(|f| match f.side {
        Side::Reference => GateError::Reference(f.error),
        Side::Candidate => GateError::Candidate(f.error),
    })?;
    let mut flips = AcceptedFlips::default();
    gate.token_flip(&pairs, &mut flips)?;
    gate.route_flips(&pairs, &mut flips)?;

    let (rs, cs, reference_levels) = Sides::of_pair(reference, candidate)?;
    let cov = coverage::plan(profile, rs, cs).map_err(|source| GateError::ReferenceCoverage {
        path: reference.path().to_path_buf(),
        source,
    })?;
    let compared = cov.compared;
    let mut tally = Tally {
        levels: Level::ALL
            .iter()
            .map(|&l| match cov.missing.contains(l) {
                true => missing_level(reference, profile, &cov, l),
                false => Ok(LevelResult::empty(l, profile.mode(l), compared.contains(l))),
            })
            .collect::<Result<_, _>>()?,
        rules: BTreeMap::new(),
        near_ties: std::mem::take(&mut flips.near_ties),
    };
    // Steps per level from the verified step nodes (read for the coverage
    // above): which levels a step holds is committed by its digest, how
    // many records it holds is not (no group is read for it).
    for (s, held) in reference.steps().iter().zip(reference_levels) {
        for level in compared.iter().filter(|&l| held.contains(l)) {
            let la = tally.level(level);
            la.steps += 1;
            if flips.after_cutoff(s.step) {
                la.skipped_after_near_tie += 1;
            }
        }
    }
    for p in pairs {
        let Some(e) = gate.entry(p) else { continue };
        if !compared.contains(e.level) || flips.after_cutoff(e.coord.step) {
            continue;
        }
        let at = RecordRef::new(e.level, &e.coord, present_in(p));
        let payloads = gate.payloads(p)?;
        let la = tally.level(e.level);
        la.differing += 1;
        la.first_difference.get_or_insert_with(|| at.clone());
        merge_minimal(&mut la.minimal, gate.bitwise_minimal(p, payloads));
        if let Some((decider, outcome)) = gate.decide(p, payloads, &flips)? {
            let outcome = gate.with_flip_margin(p, outcome)?;
            tally.add(e.level, decider, at, outcome);
        }
    }
    Ok(tally.into_report(profile, localization))
}
