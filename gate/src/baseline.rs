//! Blessed baselines: the accepted fingerprints of a candidate (root and
//! per-step, per-level digests) in a small JSON file committed next to the
//! code, so a deliberate change of execution semantics shows up as a reviewed
//! diff of that file (the `cargo insta review` / rustc `--bless` workflow).
//!
//! A baseline holds no tensor bytes, so it is compared bitwise: every level
//! whose mode is not `info` must have the blessed digest at every step.

use super::policy::{Mode, Profile};
use super::{finish, Failure, GateReport, LevelResult, Loc, Status};
use anyhow::{bail, Context};
use moeconf_fingerprint::{Digest, Level};
use moeconf_schema::Trace;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
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
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let mut tmp = tempfile::NamedTempFile::new_in(dir)
            .with_context(|| format!("baseline {}: cannot create a temporary file", path.display()))?;
        serde_json::to_writer_pretty(&mut tmp, self)?;
        tmp.write_all(b"\n")?;
        tmp.as_file().sync_all()?;
        tmp.persist(path)
            .with_context(|| format!("baseline {}: cannot write", path.display()))?;
        Ok(())
    }

    /// Reads and validates a baseline file.
    pub fn read(path: &Path) -> anyhow::Result<Baseline> {
        let ctx = || format!("baseline {}", path.display());
        let len = std::fs::metadata(path).with_context(ctx)?.len();
        if len > MAX_BASELINE_BYTES {
            bail!(
                "{}: {len} bytes is larger than the {MAX_BASELINE_BYTES}-byte limit",
                ctx()
            );
        }
        let text = std::fs::read_to_string(path).with_context(ctx)?;
        let b: Baseline = serde_json::from_str(&text).with_context(ctx)?;
        if b.kind != "moeconf.baseline" || b.schema_version != BASELINE_SCHEMA_VERSION {
            bail!(
                "{}: not a moeconf baseline of schema version {BASELINE_SCHEMA_VERSION} (kind {:?}, version {})",
                ctx(),
                b.kind,
                b.schema_version
            );
        }
        let hex = |what: String, h: &str| -> anyhow::Result<()> {
            Digest::from_hex(h)
                .with_context(|| format!("{}: {what}: {h:?} is not a 64-digit hex digest", ctx()))?;
            Ok(())
        };
        hex("root".into(), &b.root)?;
        hex("binding_digest".into(), &b.binding_digest)?;
        for s in &b.steps {
            hex(format!("step {}", s.step), &s.digest)?;
            for (l, d) in &s.levels {
                Level::from_name(l)
                    .with_context(|| format!("{}: step {}: unknown level {l:?}", ctx(), s.step))?;
                hex(format!("step {} {l}", s.step), d)?;
            }
        }
        Ok(b)
    }
}

/// Compares a candidate with blessed fingerprints under `profile`: every
/// level that is not `info` must have the blessed level digest at every step.
pub fn compare(baseline: &Baseline, candidate: &Trace, profile: &Profile) -> anyhow::Result<GateReport> {
    if baseline.algorithm != candidate.algorithm().name() {
        bail!(
            "the baseline uses {} digests and the candidate {}: rebless or rerun with --digest {}",
            baseline.algorithm,
            candidate.algorithm().name(),
            baseline.algorithm
        );
    }
    let mut notes = Vec::new();
    if baseline.binding_digest != candidate.binding_digest().to_hex() {
        let b = candidate.binding();
        notes.push(format!(
            "the candidate's binding differs from the blessed one (blessed: model {:?}, precision {}, contract {}, \
             schedule {}; candidate: model {:?}, precision {}, contract {}, schedule {})",
            baseline.model,
            baseline.precision,
            baseline.contract,
            baseline.schedule,
            b.model.name,
            b.precision,
            b.contract,
            b.schedule
        ));
    }
    let cand: BTreeMap<u32, &moeconf_fingerprint::StepNode> =
        candidate.tree().steps.iter().map(|s| (s.step, s)).collect();
    let blessed: BTreeMap<u32, &StepDigests> = baseline.steps.iter().map(|s| (s.step, s)).collect();
    let steps: std::collections::BTreeSet<u32> = cand.keys().chain(blessed.keys()).copied().collect();
    let mut levels = Vec::new();
    for l in Level::ALL {
        let name = l.name();
        let in_baseline = baseline.steps.iter().any(|s| s.levels.contains_key(name));
        let in_candidate = candidate.tree().steps.iter().any(|s| s.level(l).is_some());
        let mut r = LevelResult::empty(l, profile.mode(l), in_baseline && in_candidate);
        if r.status == Status::Pass {
            for &s in &steps {
                r.records += 1;
                let want = blessed.get(&s).and_then(|b| b.levels.get(name));
                let got = cand.get(&s).and_then(|n| n.level(l)).map(|n| n.digest.to_hex());
                if want.map(String::as_str) == got.as_deref() {
                    continue;
                }
                r.differing += 1;
                // Position and phase of the step, from the candidate's first record there.
                let first = candidate
                    .records()
                    .iter()
                    .find(|e| e.coord.step == s && e.level == l);
                let at = Loc {
                    level: name.into(),
                    step: s,
                    position: first.map_or(0, |e| e.coord.position),
                    phase: first
                        .map_or(if s == 0 { "prefill" } else { "decode" }, |e| {
                            e.coord.phase.name()
                        })
                        .into(),
                    layer: None,
                    path: "(level digest)".into(),
                };
                r.first_difference.get_or_insert_with(|| at.clone());
                if profile.mode(l) != Mode::Info {
                    r.failed += 1;
                    let reason = match (want, got) {
                        (Some(_), Some(_)) => "level digest differs from the blessed baseline".to_string(),
                        (Some(_), None) => "blessed step/level missing from the candidate".to_string(),
                        _ => "step/level not in the blessed baseline".to_string(),
                    };
                    r.first_failure.get_or_insert(Failure { at, reason });
                }
            }
        }
        levels.push(r);
    }
    let mut report = finish(profile, levels, BTreeMap::new(), Vec::new(), None);
    report.against = "baseline".into();
    notes.push(format!(
        "compared against blessed fingerprints (root {}); baselines hold digests only, so every non-info \
         level is compared bitwise per step",
        &baseline.root[..16.min(baseline.root.len())]
    ));
    report.notes = notes;
    Ok(report)
}
