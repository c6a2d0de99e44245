//! Blessed baselines: the accepted fingerprints of a candidate (root and
//! per-step, per-level digests) in a small JSON file committed next to the
//! code, so a deliberate change of execution semantics shows up as a reviewed
//! diff of that file (the `cargo insta review` / rustc `--bless` workflow).
//!
//! A baseline holds no tensor bytes, so it is compared bitwise: every level
//! whose mode is not `info` must have the blessed digest at every step.

use crate::error::{BaselineError, FileKind, GateError};
use crate::policy::{Mode, Profile};
use crate::report::{Failure, GateReport, LevelResult, Status};
use crate::write::write_atomic;
use moeconf_bisect::RecordRef;
use moeconf_fingerprint::{Coord, Digest, Level, Phase, StepNode};
use moeconf_schema::Trace;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Version of the baseline file.
pub const BASELINE_SCHEMA_VERSION: u32 = 1;

/// Largest baseline file read (a baseline of 100 000 steps is ~40 MB).
const MAX_BASELINE_BYTES: u64 = 256 << 20;

/// One step's digests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepDigests {
    /// Forward step.
    pub step: u32,
    /// Step digest (hex).
    pub digest: String,
    /// Level digest (hex) by level name `L0`…`L4`.
    pub levels: BTreeMap<String, String>,
}

/// The blessed fingerprints of one trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Baseline {
    /// [`BASELINE_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// `moeconf.baseline`.
    pub kind: String,
    /// Digest algorithm (`blake3` or `sha256`).
    pub algorithm: String,
    /// Root digest (hex).
    pub root: String,
    /// Binding digest (hex).
    pub binding_digest: String,
    /// Model name (for reviewers).
    pub model: String,
    /// Prompt text (for reviewers).
    pub prompt: String,
    /// Precision profile.
    pub precision: String,
    /// Aggregation contract.
    pub contract: String,
    /// Schedule.
    pub schedule: String,
    /// Records in the trace.
    pub records: u64,
    /// Per-step digests, ascending.
    pub steps: Vec<StepDigests>,
}

impl Baseline {
    /// The fingerprints of `t`.
    pub fn of(t: &Trace) -> Baseline {
        let b = t.binding();
        Baseline {
            schema_version: BASELINE_SCHEMA_VERSION,
            kind: "moeconf.baseline".into(),
            algorithm: t.algorithm().name().into(),
            root: t.root().to_hex(),
            binding_digest: t.binding_digest().to_hex(),
            model: b.model.name.clone(),
            prompt: b.prompt.text.clone(),
            precision: b.precision.clone(),
            contract: b.contract.clone(),
            schedule: b.schedule.clone(),
            records: t.records().len() as u64,
            steps: t
                .tree()
                .steps
                .iter()
                .map(|s| StepDigests {
                    step: s.step,
                    digest: s.digest.to_hex(),
                    levels: s
                        .levels
                        .iter()
                        .map(|l| (l.level.name().to_string(), l.digest.to_hex()))
                        .collect(),
                })
                .collect(),
        }
    }

    /// Writes the file atomically (temporary file in the same directory, then rename).
    pub fn write(&self, path: &Path) -> Result<(), GateError> {
        write_atomic(path, self.text(path)?.as_bytes(), FileKind::Baseline)
    }

    /// The file's text (pretty JSON and a final newline); `path` names the
    /// file in an error.
    pub fn text(&self, path: &Path) -> Result<String, GateError> {
        let mut text = serde_json::to_string_pretty(self).map_err(|e| GateError::Output {
            file: FileKind::Baseline,
            source: Box::new(moeconf_schema::OutputError::Io {
                path: path.to_path_buf(),
                what: "encoding the baseline",
                source: e.into(),
            }),
        })?;
        text.push('\n');
        Ok(text)
    }

    /// Reads and validates a baseline file.
    pub fn read(path: &Path) -> Result<Baseline, GateError> {
        Baseline::read_unnamed(path).map_err(|source| GateError::Baseline {
            path: path.to_path_buf(),
            source,
        })
    }

    /// [`Baseline::read`] without the file name (added by the caller).
    fn read_unnamed(path: &Path) -> Result<Baseline, BaselineError> {
        let len = std::fs::metadata(path)?.len();
        if len > MAX_BASELINE_BYTES {
            return Err(BaselineError::TooLarge {
                len,
                limit: MAX_BASELINE_BYTES,
            });
        }
        let b: Baseline = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        if b.kind != "moeconf.baseline" || b.schema_version != BASELINE_SCHEMA_VERSION {
            return Err(BaselineError::NotABaseline {
                kind: b.kind,
                version: b.schema_version,
                expected: BASELINE_SCHEMA_VERSION,
            });
        }
        let hex = |what: String, text: &str| match Digest::from_hex(text) {
            Some(_) => Ok(()),
            None => Err(BaselineError::Digest {
                what,
                text: text.into(),
            }),
        };
        hex("root".into(), &b.root)?;
        hex("binding_digest".into(), &b.binding_digest)?;
        for s in &b.steps {
            hex(format!("step {}", s.step), &s.digest)?;
            for (l, d) in &s.levels {
                if Level::from_name(l).is_none() {
                    return Err(BaselineError::UnknownLevel {
                        step: s.step,
                        name: l.clone(),
                    });
                }
                hex(format!("step {} {l}", s.step), d)?;
            }
        }
        Ok(b)
    }

    /// A note for the report when the candidate's binding differs from the blessed one.
    fn binding_note(&self, candidate: &Trace) -> Option<String> {
        if self.binding_digest == candidate.binding_digest().to_hex() {
            return None;
        }
        let b = candidate.binding();
        Some(format!(
            "the candidate's binding differs from the blessed one (blessed: model {:?}, precision {}, contract {}, \
             schedule {}; candidate: model {:?}, precision {}, contract {}, schedule {})",
            self.model,
            self.precision,
            self.contract,
            self.schedule,
            b.model.name,
            b.precision,
            b.contract,
            b.schedule
        ))
    }
}

/// Both sides of a baseline comparison, step by step.
struct Steps<'a> {
    candidate: &'a Trace,
    by_step: BTreeMap<u32, &'a StepNode>,
    blessed: BTreeMap<u32, &'a StepDigests>,
    /// Steps of either side, ascending.
    all: BTreeSet<u32>,
}

impl<'a> Steps<'a> {
    fn new(baseline: &'a Baseline, candidate: &'a Trace) -> Steps<'a> {
        let by_step: BTreeMap<u32, &StepNode> = candidate.tree().steps.iter().map(|s| (s.step, s)).collect();
        let blessed: BTreeMap<u32, &StepDigests> = baseline.steps.iter().map(|s| (s.step, s)).collect();
        let all = by_step.keys().chain(blessed.keys()).copied().collect();
        Steps {
            candidate,
            by_step,
            blessed,
            all,
        }
    }

    /// Where a differing level digest sits: the step, with the position and
    /// phase of the candidate's first record of the level there.
    fn location(&self, level: Level, step: u32) -> RecordRef {
        let first = self
            .candidate
            .records()
            .iter()
            .find(|e| e.coord.step == step && e.level == level);
        let coord = Coord {
            step,
            position: first.map_or(0, |e| e.coord.position),
            phase: first.map_or(if step == 0 { Phase::Prefill } else { Phase::Decode }, |e| {
                e.coord.phase
            }),
            layer: None,
            path: "(level digest)".into(),
        };
        RecordRef::new(level, &coord, "both")
    }

    /// The level's result: every step's level digest against the blessed one.
    fn compare_level(&self, level: Level, mode: Mode, captured: bool) -> LevelResult {
        let mut r = LevelResult::empty(level, mode, captured);
        if r.status != Status::Pass {
            return r;
        }
        for &s in &self.all {
            r.records += 1;
            let want = self.blessed.get(&s).and_then(|b| b.levels.get(level.name()));
            let got = self
                .by_step
                .get(&s)
                .and_then(|n| n.level(level))
                .map(|n| n.digest.to_hex());
            if want.map(String::as_str) == got.as_deref() {
                continue;
            }
            r.differing += 1;
            let at = self.location(level, s);
            r.first_difference.get_or_insert_with(|| at.clone());
            if mode != Mode::Info {
                r.failed += 1;
                let reason = match (want, got) {
                    (Some(_), Some(_)) => "level digest differs from the blessed baseline",
                    (Some(_), None) => "blessed step/level missing from the candidate",
                    _ => "step/level not in the blessed baseline",
                };
                r.first_failure.get_or_insert(Failure {
                    at,
                    reason: reason.into(),
                });
            }
        }
        r
    }
}

/// Compares a candidate with blessed fingerprints under `profile`: every
/// level that is not `info` must have the blessed level digest at every step.
pub fn compare(baseline: &Baseline, candidate: &Trace, profile: &Profile) -> Result<GateReport, GateError> {
    if baseline.algorithm != candidate.algorithm().name() {
        return Err(GateError::AlgorithmMismatch {
            baseline: baseline.algorithm.clone(),
            candidate: candidate.algorithm().name().into(),
        });
    }
    let mut notes: Vec<String> = baseline.binding_note(candidate).into_iter().collect();
    let steps = Steps::new(baseline, candidate);
    let levels = Level::ALL
        .into_iter()
        .map(|l| {
            let in_baseline = baseline.steps.iter().any(|s| s.levels.contains_key(l.name()));
            let in_candidate = candidate.tree().steps.iter().any(|s| s.level(l).is_some());
            steps.compare_level(l, profile.mode(l), in_baseline && in_candidate)
        })
        .collect();
    let mut report = GateReport::new(profile, levels, Vec::new(), Vec::new(), None);
    report.against = "baseline".into();
    notes.push(format!(
        "compared against blessed fingerprints (root {}); baselines hold digests only, so every non-info \
         level is compared bitwise per step",
        baseline.root.get(..16).unwrap_or(&baseline.root)
    ));
    report.notes = notes;
    Ok(report)
}
