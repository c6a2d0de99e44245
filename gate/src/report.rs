//! The gate's result, [`GateReport`]: one serializable document
//! (`--format json`, docs/ci.md §5) and its text rendering. The JUnit and
//! Markdown renderings live in [`report_junit`](crate::report_junit) and
//! [`report_md`](crate::report_md).
//!
//! Records are located with the diff engine's [`RecordRef`], so a failure
//! reads the same in `moeconf diff` and `moeconf gate`. The gate's JSON
//! document predates that sharing and writes a location without the
//! `present_in` field (the failure reason says which side lacks a record).

use crate::policy::{Mode, Profile};
use crate::tolerance::Minimal;
use moeconf_bisect::{FirstDivergence, RecordRef};
use moeconf_fingerprint::{Level, LevelSet};
use moeconf_output::escape::text;
use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

/// Version of the gate's JSON document.
pub const GATE_SCHEMA_VERSION: u32 = 2;

/// A record location as the gate's JSON document writes it: level, step,
/// position, phase, layer and path.
struct Location<'a>(&'a RecordRef);

impl Serialize for Location<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let r = self.0;
        let mut st = s.serialize_struct("Location", 6)?;
        st.serialize_field("level", &r.level)?;
        st.serialize_field("step", &r.step)?;
        st.serialize_field("position", &r.position)?;
        st.serialize_field("phase", &r.phase)?;
        st.serialize_field("layer", &r.layer)?;
        st.serialize_field("path", &r.path)?;
        st.end()
    }
}

fn ser_location<S: Serializer>(r: &RecordRef, s: S) -> Result<S::Ok, S::Error> {
    Location(r).serialize(s)
}

fn ser_opt_location<S: Serializer>(r: &Option<RecordRef>, s: S) -> Result<S::Ok, S::Error> {
    r.as_ref().map(Location).serialize(s)
}

/// One failing record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Failure {
    #[serde(serialize_with = "ser_location")]
    pub at: RecordRef,
    pub reason: String,
}

/// What flipped in a near-tie.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FlipKind {
    /// A route flip: `router.topk` selects other experts (or another order).
    Route,
    /// An argmax flip: `token.output`, or the top-1 of `lm.logits` / `lm.topk_ids`.
    Argmax,
}

impl FlipKind {
    /// `route` or `argmax`.
    pub fn name(self) -> &'static str {
        match self {
            FlipKind::Route => "route",
            FlipKind::Argmax => "argmax",
        }
    }
}

/// A flip accepted as a near-tie (reported as a warning).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NearTie {
    /// Route or argmax.
    pub kind: FlipKind,
    #[serde(serialize_with = "ser_location")]
    pub at: RecordRef,
    /// The reference's margin there.
    pub reference_margin: f64,
    /// The policy threshold it is below.
    pub threshold: f64,
    /// What changed, e.g. `experts [29, 12, 2] -> [29, 12, 19]`.
    pub change: String,
}

impl NearTie {
    /// `route flip at step 1 pos 5 (decode) layer 2 router.topk: experts [..] -> [..] (reference margin 1.000e-2 < 0.25)`.
    pub fn describe(&self) -> String {
        format!(
            "{} flip at {}: {} (reference margin {:.3e} < {})",
            self.kind.name(),
            self.at.describe_location(),
            self.change,
            self.reference_margin,
            self.threshold
        )
    }
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

/// The gate's overall verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// No level fails and no near-tie was accepted.
    Pass,
    /// No level fails, but near-ties were accepted (reported as warnings).
    /// The gate passes: exit code 0.
    Warn,
    /// A level fails: a record fails or is inconclusive.
    Fail,
}

impl Verdict {
    /// `PASS`, `WARN` or `FAIL` (the text report's header).
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
        }
    }

    /// Whether the gate passes (`Pass` or `Warn`).
    pub fn passes(self) -> bool {
        self != Verdict::Fail
    }

    /// `PASS` or `FAIL`: the outcome the exit code reports, as the summary
    /// line and the Markdown heading state it (a warning passes).
    pub fn outcome_label(self) -> &'static str {
        if self.passes() {
            "PASS"
        } else {
            "FAIL"
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LevelResult {
    pub level: Level,
    /// What the level holds.
    pub describe: String,
    /// Mode from the policy.
    pub mode: Mode,
    pub status: Status,
    /// Steps of the reference that hold the level (against a baseline: the
    /// steps compared). Steps, not records: which levels a step holds is
    /// committed by its step digest, while a count of records is not (a
    /// gate reads only the groups that differ; docs/format.md §11.5).
    pub steps: u64,
    /// Records whose digests differ (or that exist on one side only).
    pub differing: u64,
    /// Records that fail.
    pub failed: u64,
    /// Of those, inconclusive (no payloads to judge a tolerance).
    pub inconclusive: u64,
    /// Near-ties accepted (and records waived with them).
    pub near_ties: u64,
    /// Steps (holding the level) not gated because an accepted token
    /// near-tie changed their inputs.
    pub skipped_after_near_tie: u64,
    /// The first differing record.
    #[serde(serialize_with = "ser_opt_location")]
    pub first_difference: Option<RecordRef>,
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
            level,
            describe: level.describe().into(),
            mode,
            status: if captured {
                Status::Pass
            } else {
                Status::NotCompared
            },
            steps: 0,
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

    /// The final status from the counts (a level not compared stays so).
    fn settle(&mut self) {
        if self.status == Status::NotCompared {
            return;
        }
        self.status = if self.failed > 0 {
            Status::Fail
        } else if self.mode == Mode::Info && self.differing > 0 {
            Status::Info
        } else if self.near_ties > 0 {
            Status::Warn
        } else {
            Status::Pass
        };
    }

    /// The level's lines of the text report.
    fn render_text(&self, s: &mut String) {
        s.push_str(&format!(
            "{} {:<9} {:<12} {} steps, {} records differ, {} fail  ({})\n",
            self.level.name(),
            self.mode.name(),
            self.status.label(),
            self.steps,
            self.differing,
            self.failed,
            self.describe
        ));
        if let Some(f) = &self.first_failure {
            s.push_str(&format!("   first failure: {}\n", f.describe()));
        } else if let Some(d) = &self.first_difference {
            s.push_str(&format!("   first difference: {}\n", d.describe_location()));
        }
        if self.inconclusive > 0 {
            s.push_str(&format!("   {} inconclusive (no payloads)\n", self.inconclusive));
        }
        if self.skipped_after_near_tie > 0 {
            s.push_str(&format!(
                "   {} steps not gated: they consume a different token after an accepted near-tie\n",
                self.skipped_after_near_tie
            ));
        }
        if let (Some(m), Status::Fail | Status::Info) = (&self.minimal, self.status) {
            s.push_str(&format!(
                "   would have matched element-wise with {}\n",
                m.describe()
            ));
        }
    }
}

impl Failure {
    /// `step 1 pos 5 (decode) layer 5 moe.combine: differs bitwise`.
    pub fn describe(&self) -> String {
        format!("{}: {}", self.at.describe_location(), self.reason)
    }
}

/// Result of one rule (only rules that judged a differing record are listed).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleResult {
    /// `#2 layer.* at L3 (aggregate)`, or `bitwise` for a bitwise level.
    pub rule: String,
    /// Levels whose records it judged (listed in order).
    pub levels: LevelSet,
    /// Differing records judged.
    pub judged: u64,
    /// Records it failed (inconclusive included).
    pub failed: u64,
    pub status: Status,
    pub first_failure: Option<Failure>,
    /// What would have passed every record it judged.
    pub minimal: Option<Minimal>,
}

impl RuleResult {
    /// `L3,L4`.
    pub fn level_names(&self, separator: &str) -> String {
        let names: Vec<&str> = self.levels.iter().map(Level::name).collect();
        names.join(separator)
    }

    /// The rule's lines of the text report.
    fn render_text(&self, s: &mut String) {
        s.push_str(&format!(
            "  {:<5} {} [{}]: {} judged, {} fail\n",
            self.status.label(),
            text(&self.rule),
            self.level_names(","),
            self.judged,
            self.failed
        ));
        if let Some(f) = &self.first_failure {
            s.push_str(&format!("        first failure: {}\n", f.describe()));
        }
        if let Some(m) = &self.minimal {
            s.push_str(&format!("        smallest passing tolerance: {}\n", m.describe()));
        }
    }
}

/// The gate's result: one serializable document (`--format json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateReport {
    /// [`GATE_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// `moeconf.gate`.
    pub kind: String,
    /// `pass`, `warn` (passes with near-tie warnings) or `fail`.
    pub verdict: Verdict,
    /// The resolved profile.
    pub profile: Profile,
    /// Where the policy came from.
    pub policy_source: String,
    /// `reference` (a reference trace) or `baseline` (blessed fingerprints).
    pub against: String,
    /// Reference trace or baseline file.
    pub reference: String,
    pub candidate: String,
    pub candidate_root: String,
    /// The diff engine's localization of the first divergence.
    pub localization: Option<FirstDivergence>,
    /// One entry per level.
    pub levels: Vec<LevelResult>,
    /// Rules that judged differing records.
    pub rules: Vec<RuleResult>,
    /// Accepted near-ties.
    pub near_ties: Vec<NearTie>,
    /// Sides that lack steps of their run (empty when both are complete;
    /// `moeconf gate` judges them only with `--allow-incomplete`): the
    /// verdict covers only the steps present.
    pub incomplete: Vec<moeconf_bisect::Incomplete>,
    /// Notes (binding differences, baseline facts).
    pub notes: Vec<String>,
    /// One-line summary.
    pub summary: String,
}

impl GateReport {
    /// The report of judged levels and rules: settles each level's status,
    /// then the verdict (fail when a level fails, warn when near-ties were
    /// accepted) and the summary line. Paths, policy source and notes are
    /// left for the caller to fill in.
    pub fn new(
        profile: &Profile,
        mut levels: Vec<LevelResult>,
        rules: Vec<RuleResult>,
        near_ties: Vec<NearTie>,
        localization: Option<FirstDivergence>,
    ) -> GateReport {
        levels.iter_mut().for_each(LevelResult::settle);
        let verdict = if levels.iter().any(|l| l.status == Status::Fail) {
            Verdict::Fail
        } else if !near_ties.is_empty() {
            Verdict::Warn
        } else {
            Verdict::Pass
        };
        let count = |s: Status| levels.iter().filter(|l| l.status == s).count();
        let summary = format!(
            "{}: {} passed, {} failed, {} warned, {} info, {} not compared (levels); {} near-ties",
            verdict.outcome_label(),
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
            incomplete: Vec::new(),
            notes: Vec::new(),
            summary,
        }
    }

    /// Process exit code: 0 pass (warnings included), 1 fail.
    pub fn exit_code(&self) -> u8 {
        if self.verdict.passes() {
            0
        } else {
            1
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        // Plain structs with string keys; non-finite floats become null.
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// `step 1 pos 5 layer 5 operator moe.combine (L4)`, from the diff engine.
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

    /// The human-readable report (summary line last). User strings (profile,
    /// policy, trace names, rules, notes) are written in the visible form of
    /// [`moeconf_output::escape::text`]: a newline or bidi control in a name
    /// cannot forge or reorder a line.
    pub fn render_text(&self) -> String {
        let mut s = format!(
            "moeconf gate: {}{} (profile {}, policy {})\n  reference  {}\n  candidate  {}\n",
            self.verdict.label(),
            self.incomplete_label(),
            text(&self.profile.name),
            text(&self.policy_source),
            text(&self.reference),
            text(&self.candidate)
        );
        if let Some(l) = self.localization_line() {
            s.push_str(&format!("  first divergence: {l}\n"));
        }
        for i in &self.incomplete {
            s.push_str(&format!(
                "  INCOMPLETE: {} {}; only the steps present were judged\n",
                i.side,
                self.incomplete_file(i)
            ));
        }
        for n in &self.notes {
            s.push_str(&format!("  note: {}\n", text(n)));
        }
        s.push('\n');
        for l in &self.levels {
            l.render_text(&mut s);
        }
        if !self.rules.is_empty() {
            s.push_str("\nrules\n");
            for r in &self.rules {
                r.render_text(&mut s);
            }
        }
        if !self.near_ties.is_empty() {
            s.push_str("\nnear-ties (warnings)\n");
            for n in &self.near_ties {
                s.push_str(&format!("  {}\n", text(&n.describe())));
            }
        }
        s.push('\n');
        s.push_str(&self.summary);
        s.push('\n');
        s
    }
}
