//! Blessed baselines: the accepted fingerprints of a candidate (root and
//! per-step, per-level digests) in a small JSON file committed next to the
//! code, so a deliberate change of execution semantics shows up as a reviewed
//! diff of that file (the `cargo insta review` / rustc `--bless` workflow).
//!
//! A baseline holds no tensor bytes, so it is compared bitwise: every level
//! whose mode is not `info` must have the blessed digest at every step. It
//! also holds the blessed binding, checked against the candidate's like
//! trace against trace (docs/diff.md, "Comparability"), and is subject to
//! the same coverage rules (docs/ci.md §2).

use crate::coverage::{self, Coverage, Sides};
use crate::error::{BaselineError, FileKind, GateError};
use crate::policy::{Mode, Profile};
use crate::report::{Failure, GateReport, LevelResult, Status};
use crate::write::write_atomic;
use moeconf_bisect::{compare_bindings, RecordRef};
use moeconf_fingerprint::{
    hex_decode, hex_encode, root_digest, step_digest, Algorithm, CanonPolicy, Coord, Digest, Level, Phase,
};
use moeconf_schema::{
    Binding, CaptureSpec, Decoding, ModelIdentity, PromptBinding, Provenance, TokenizerIdentity, Trace,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Version of the baseline file. Version 2 added the blessed binding
/// (`binding`), checked against the candidate's like trace against trace;
/// version 3 the binding's own bytes (`binding_wire`), whose digest the root
/// commits to, so that the blessed binding is checked whole on load.
/// Older files are refused with a message to re-bless.
pub const BASELINE_SCHEMA_VERSION: u32 = 3;

/// Largest baseline file read (a baseline of 100 000 steps is ~40 MB).
const MAX_BASELINE_BYTES: u64 = 256 << 20;

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

/// The blessed model identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlessedModel {
    /// Display name (shown, never refused).
    pub name: String,
    /// Digest of the config bytes (hex).
    pub config_digest: String,
    /// Digest of the weights (hex).
    pub weights_digest: String,
}

/// The blessed tokenizer identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlessedTokenizer {
    /// Display name (shown, never refused).
    pub name: String,
    /// Digest of the tokenizer file (hex).
    pub digest: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlessedPrompt {
    pub text: String,
    /// Prompt token ids.
    pub ids: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlessedDecoding {
    /// Decoding strategy (`greedy`).
    pub strategy: String,
    pub max_new_tokens: u32,
}

/// The binding of the blessed trace: the fields that make two traces
/// comparable (model and tokenizer digests, prompt, decoding,
/// canonicalization; a difference refuses the comparison unless forced) and
/// those shown for reviewers (names, precision, contract, schedule, capture).
/// The model's per-tensor list is not kept: its digest is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlessedBinding {
    pub model: BlessedModel,
    pub tokenizer: BlessedTokenizer,
    pub prompt: BlessedPrompt,
    pub decoding: BlessedDecoding,
    pub precision: String,
    pub contract: String,
    pub schedule: String,
    /// Captured levels (`L0,L1+payload,...`, as `moeconf inspect` prints them).
    pub capture: String,
    /// `-0` folded to `+0` before hashing.
    pub fold_negative_zero: bool,
    /// Further binding facts (key, value).
    pub extra: Vec<(String, String)>,
}

impl BlessedBinding {
    /// The blessed fields of a trace's binding.
    fn of(b: &Binding) -> BlessedBinding {
        BlessedBinding {
            model: BlessedModel {
                name: b.model.name.clone(),
                config_digest: b.model.config_digest.to_hex(),
                weights_digest: b.model.weights_digest.to_hex(),
            },
            tokenizer: BlessedTokenizer {
                name: b.tokenizer.name.clone(),
                digest: b.tokenizer.digest.to_hex(),
            },
            prompt: BlessedPrompt {
                text: b.prompt.text.clone(),
                ids: b.prompt.ids.clone(),
            },
            decoding: BlessedDecoding {
                strategy: b.decoding.strategy.clone(),
                max_new_tokens: b.decoding.max_new_tokens,
            },
            precision: b.precision.clone(),
            contract: b.contract.clone(),
            schedule: b.schedule.clone(),
            capture: b.capture.describe(),
            fold_negative_zero: b.canon.fold_negative_zero,
            extra: b.extra.clone(),
        }
    }

    /// The trace binding these fields describe (without the per-tensor
    /// list), for [`compare_bindings`]; an invalid digest or capture spec
    /// is an error naming the field.
    fn to_binding(&self) -> Result<Binding, BaselineError> {
        let digest = |field: &'static str, text: &str| {
            Digest::from_hex(text).ok_or_else(|| BaselineError::BindingField {
                field,
                text: text.into(),
            })
        };
        let capture = match self.capture.as_str() {
            "" => CaptureSpec {
                levels: moeconf_fingerprint::LevelSet::EMPTY,
                payload_levels: moeconf_fingerprint::LevelSet::EMPTY,
            },
            spec => CaptureSpec::parse(spec).map_err(|_| BaselineError::BindingField {
                field: "capture",
                text: spec.into(),
            })?,
        };
        Ok(Binding {
            model: ModelIdentity {
                name: self.model.name.clone(),
                config_digest: digest("model.config_digest", &self.model.config_digest)?,
                weights_digest: digest("model.weights_digest", &self.model.weights_digest)?,
                tensors: Vec::new(),
            },
            tokenizer: TokenizerIdentity {
                name: self.tokenizer.name.clone(),
                digest: digest("tokenizer.digest", &self.tokenizer.digest)?,
            },
            prompt: PromptBinding {
                text: self.prompt.text.clone(),
                ids: self.prompt.ids.clone(),
            },
            decoding: Decoding {
                strategy: self.decoding.strategy.clone(),
                max_new_tokens: self.decoding.max_new_tokens,
            },
            precision: self.precision.clone(),
            contract: self.contract.clone(),
            schedule: self.schedule.clone(),
            capture,
            canon: CanonPolicy {
                fold_negative_zero: self.fold_negative_zero,
            },
            extra: self.extra.clone(),
        })
    }
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
    /// The blessed binding, checked against the candidate's: the readable
    /// form of `binding_wire`, which it must match field for field.
    pub binding: BlessedBinding,
    /// The binding's wire encoding (docs/format.md §5.2), hex: the bytes
    /// whose digest is `binding_digest`, which the root commits to. The
    /// comparison uses the binding decoded from them, never the readable
    /// fields alone.
    pub binding_wire: String,
    pub records: u64,
    /// Per-step digests, ascending.
    pub steps: Vec<StepDigests>,
}

/// The first field (dotted JSON path) where two blessed bindings differ.
fn first_difference(a: &BlessedBinding, b: &BlessedBinding) -> Option<String> {
    fn walk(prefix: &str, a: &serde_json::Value, b: &serde_json::Value) -> Option<String> {
        match (a, b) {
            (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
                for (k, v) in x {
                    let name = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    match y.get(k) {
                        Some(w) => {
                            if let Some(f) = walk(&name, v, w) {
                                return Some(f);
                            }
                        }
                        None => return Some(name),
                    }
                }
                y.keys()
                    .find(|k| !x.contains_key(*k))
                    .map(|k| format!("{prefix}.{k}"))
            }
            _ => (a != b).then(|| prefix.to_string()),
        }
    }
    let (a, b) = (serde_json::to_value(a).ok()?, serde_json::to_value(b).ok()?);
    walk("", &a, &b).or_else(|| (a != b).then(|| "binding".to_string()))
}

/// The version and kind of a file, read before its full shape.
#[derive(Deserialize)]
struct Probe {
    kind: String,
    schema_version: u32,
}

impl Baseline {
    /// The fingerprints of `t`; a trace without records is refused (its
    /// baseline could gate nothing).
    pub fn of(t: &Trace) -> Result<Baseline, GateError> {
        if t.is_empty() {
            return Err(GateError::BlessEmpty {
                path: t.path().to_path_buf(),
            });
        }
        let mut steps = Vec::with_capacity(t.steps().len());
        for s in t.steps() {
            let node = t
                .step(s.step)
                .map_err(GateError::Candidate)?
                .ok_or_else(|| GateError::Candidate(missing_step(t, s.step)))?;
            steps.push(StepDigests {
                step: s.step,
                digest: s.digest.to_hex(),
                levels: node
                    .levels
                    .iter()
                    .map(|l| (l.level.name().to_string(), l.digest.to_hex()))
                    .collect(),
            });
        }
        Ok(Baseline {
            schema_version: BASELINE_SCHEMA_VERSION,
            kind: "moeconf.baseline".into(),
            algorithm: t.algorithm().name().into(),
            root: t.root().to_hex(),
            binding_digest: t.binding_digest().to_hex(),
            binding: BlessedBinding::of(t.binding()),
            binding_wire: hex_encode(&t.binding().to_bytes()),
            records: t.record_count(),
            steps,
        })
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
            source: Box::new(moeconf_output::OutputError::Io {
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
        let named = |source| GateError::Baseline {
            path: path.to_path_buf(),
            source,
        };
        // A regular file only: a FIFO or device is refused by kind, never opened.
        let file = moeconf_output::input::open_input(path, "baseline").map_err(|e| match e.into_io() {
            Ok(io) => named(BaselineError::Io(io)),
            Err(e) => GateError::Input(Box::new(e)),
        })?;
        Baseline::read_unnamed(file).map_err(named)
    }

    /// The root recorded in the baseline file at `path`, of any schema
    /// version (what `--bless` reports as the previous root); `None` when
    /// there is no readable baseline there.
    pub fn blessed_root(path: &Path) -> Option<String> {
        #[derive(Deserialize)]
        struct Root {
            kind: String,
            root: String,
        }
        let len = moeconf_output::input::check_input(path, "baseline").ok()?.len();
        if len > MAX_BASELINE_BYTES {
            return None;
        }
        let bytes = moeconf_output::input::read_input(path, "baseline").ok()?;
        let r: Root = serde_json::from_slice(&bytes).ok()?;
        (r.kind == "moeconf.baseline").then_some(r.root)
    }

    /// [`Baseline::read`] of the opened `file`, without its name (added by the caller).
    fn read_unnamed(mut file: std::fs::File) -> Result<Baseline, BaselineError> {
        use std::io::Read;
        let len = file.metadata()?.len();
        if len > MAX_BASELINE_BYTES {
            return Err(BaselineError::TooLarge {
                len,
                limit: MAX_BASELINE_BYTES,
            });
        }
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        let probe: Probe = serde_json::from_str(&text)?;
        if probe.kind != "moeconf.baseline" || probe.schema_version > BASELINE_SCHEMA_VERSION {
            return Err(BaselineError::NotABaseline {
                kind: probe.kind,
                version: probe.schema_version,
                expected: BASELINE_SCHEMA_VERSION,
            });
        }
        if probe.schema_version < BASELINE_SCHEMA_VERSION {
            return Err(BaselineError::Outdated {
                version: probe.schema_version,
                expected: BASELINE_SCHEMA_VERSION,
            });
        }
        let b: Baseline = serde_json::from_str(&text)?;
        b.validate()?;
        Ok(b)
    }

    /// The blessed binding decoded from `binding_wire` (checked on load
    /// against the binding digest the root commits to).
    fn committed_binding(&self) -> Result<Binding, BaselineError> {
        let bad = || BaselineError::BindingField {
            field: "binding_wire",
            text: self.binding_wire.chars().take(32).collect(),
        };
        let wire = hex_decode(&self.binding_wire).ok_or_else(bad)?;
        let mut d = moeconf_fingerprint::wire::Decoder::new(&wire, 0);
        let b = Binding::decode(&mut d).map_err(|_| bad())?;
        d.finish("binding").map_err(|_| bad())?;
        Ok(b)
    }

    /// Every digest is 64 hex digits, every level name is known, the
    /// binding's fields are valid, there is at least one step, each listed
    /// once, and the digests belong together: each step digest is the
    /// digest of its level digests and the root that of the binding digest
    /// and the step digests (the trace format's tree, docs/format.md §4.3).
    /// So an edited or corrupted digest is an error, never a verdict: the
    /// comparison takes a step's blessed level digests on trust once the
    /// candidate's step digest matches.
    fn validate(&self) -> Result<(), BaselineError> {
        let hex = |what: String, text: &str| {
            Digest::from_hex(text).ok_or_else(|| BaselineError::Digest {
                what,
                text: text.into(),
            })
        };
        let root = hex("root".into(), &self.root)?;
        let binding_digest = hex("binding_digest".into(), &self.binding_digest)?;
        self.binding.to_binding()?;
        let alg = Algorithm::from_name(&self.algorithm).ok_or_else(|| BaselineError::Algorithm {
            name: self.algorithm.clone(),
        })?;
        // The binding is checked whole: its bytes hash to the binding digest
        // (checked against the root below), and the readable fields are
        // exactly what those bytes say.
        let wire = hex_decode(&self.binding_wire).ok_or_else(|| BaselineError::BindingField {
            field: "binding_wire",
            text: self.binding_wire.chars().take(32).collect(),
        })?;
        if moeconf_fingerprint::binding_digest(alg, &wire) != binding_digest {
            return Err(BaselineError::Inconsistent {
                what: "binding_digest".into(),
                of: "binding bytes (binding_wire)",
            });
        }
        let committed = self.committed_binding()?;
        if let Some(field) = first_difference(&BlessedBinding::of(&committed), &self.binding) {
            return Err(BaselineError::BindingEdited { field });
        }
        if self.steps.is_empty() {
            return Err(BaselineError::NoSteps);
        }
        let mut steps: BTreeMap<u32, Digest> = BTreeMap::new();
        for s in &self.steps {
            if steps.contains_key(&s.step) {
                return Err(BaselineError::DuplicateStep { step: s.step });
            }
            let digest = hex(format!("step {}", s.step), &s.digest)?;
            let mut levels = Vec::with_capacity(s.levels.len());
            for (l, d) in &s.levels {
                let level = Level::from_name(l).ok_or_else(|| BaselineError::UnknownLevel {
                    step: s.step,
                    name: l.clone(),
                })?;
                levels.push((level, hex(format!("step {} {l}", s.step), d)?));
            }
            levels.sort_by_key(|(l, _)| l.code());
            if step_digest(alg, s.step, levels.into_iter()) != digest {
                return Err(BaselineError::Inconsistent {
                    what: format!("step {}'s digest", s.step),
                    of: "level digests",
                });
            }
            steps.insert(s.step, digest);
        }
        if root_digest(alg, binding_digest, steps.into_iter()) != root {
            return Err(BaselineError::Inconsistent {
                what: "the root".into(),
                of: "binding digest and step digests",
            });
        }
        Ok(())
    }

    /// The levels the baseline holds (a digest at some step) and declares
    /// (the blessed capture spec).
    fn sides(&self, binding: &Binding) -> Sides {
        Sides {
            held: Level::ALL
                .into_iter()
                .filter(|l| self.steps.iter().any(|s| s.levels.contains_key(l.name())))
                .collect(),
            declared: Level::ALL
                .into_iter()
                .filter(|&l| binding.capture.captures(l))
                .collect(),
        }
    }

    /// The refusing binding differences between the blessed binding and the
    /// candidate's (an error unless `force`), as notes when forced.
    fn check_binding(
        &self,
        blessed: &Binding,
        candidate: &Trace,
        force: bool,
    ) -> Result<Vec<String>, BaselineError> {
        let none = Provenance::default();
        let (refusing, _) = compare_bindings(blessed, candidate.binding(), &none, &none);
        if refusing.is_empty() {
            return Ok(Vec::new());
        }
        if !force {
            return Err(BaselineError::NotComparable { fields: refusing });
        }
        Ok(refusing
            .iter()
            .map(|d| {
                format!(
                    "forced over {}: blessed {} vs candidate {}",
                    d.field, d.reference, d.candidate
                )
            })
            .collect())
    }

    /// A note for the report when the candidate's binding differs from the blessed one.
    fn binding_note(&self, candidate: &Trace) -> Option<String> {
        if self.binding_digest == candidate.binding_digest().to_hex() {
            return None;
        }
        let b = candidate.binding();
        let blessed = &self.binding;
        Some(format!(
            "the candidate's binding differs from the blessed one (blessed: model {:?}, precision {}, contract {}, \
             schedule {}; candidate: model {:?}, precision {}, contract {}, schedule {})",
            blessed.model.name,
            blessed.precision,
            blessed.contract,
            blessed.schedule,
            b.model.name,
            b.precision,
            b.contract,
            b.schedule
        ))
    }
}

/// A step the root lists but the trace cannot give (not reached: the root
/// and the step slots come from the same list).
fn missing_step(t: &Trace, step: u32) -> moeconf_schema::TraceError {
    moeconf_schema::TraceError::Invalid {
        path: t.path().to_path_buf(),
        what: format!("step {step} is listed but has no node"),
    }
}

/// Both sides of a baseline comparison, step by step.
struct Steps<'a> {
    candidate: &'a Trace,
    blessed: BTreeMap<u32, &'a StepDigests>,
    /// Steps of either side, ascending.
    all: BTreeSet<u32>,
}

impl<'a> Steps<'a> {
    fn new(baseline: &'a Baseline, candidate: &'a Trace) -> Steps<'a> {
        let blessed: BTreeMap<u32, &StepDigests> = baseline.steps.iter().map(|s| (s.step, s)).collect();
        let all = candidate
            .steps()
            .iter()
            .map(|s| s.step)
            .chain(blessed.keys().copied())
            .collect();
        Steps {
            candidate,
            blessed,
            all,
        }
    }

    /// The candidate's digest of `level` at `step` (hex). A step whose
    /// digest is the blessed one has the blessed level digests, so its node
    /// is not read; a version 2 candidate reads the nodes of the steps that
    /// differ only.
    fn candidate_level(&self, level: Level, step: u32) -> Result<Option<String>, GateError> {
        let Some(summary) = self.candidate.step_summary(step) else {
            return Ok(None);
        };
        if let Some(b) = self.blessed.get(&step) {
            if b.digest == summary.digest.to_hex() {
                return Ok(b.levels.get(level.name()).cloned());
            }
        }
        Ok(self
            .candidate
            .step(step)
            .map_err(GateError::Candidate)?
            .and_then(|n| n.level(level))
            .map(|n| n.digest.to_hex()))
    }

    /// Where a differing level digest sits: the step, with the position and
    /// phase of the candidate's first record of the level there.
    fn location(&self, level: Level, step: u32) -> Result<RecordRef, GateError> {
        let t = self.candidate;
        let mut first: Option<usize> = None;
        if let Some(l) = t
            .step(step)
            .map_err(GateError::Candidate)?
            .and_then(|n| n.level(level))
        {
            for g in &l.groups {
                let ids = t.group_records(g).map_err(GateError::Candidate)?;
                first = crate::evaluate::first_in_exec_order(t, first.into_iter().chain(ids.iter().copied()));
            }
        }
        let first = first.map(|i| t.record(i));
        let coord = Coord {
            step,
            position: first.map_or(0, |e| e.coord.position),
            phase: first.map_or(if step == 0 { Phase::Prefill } else { Phase::Decode }, |e| {
                e.coord.phase
            }),
            layer: None,
            path: "(level digest)".into(),
        };
        Ok(RecordRef::new(level, &coord, "both"))
    }

    /// The result of a required level the candidate does not hold: every
    /// blessed step of the level fails, located at the first.
    fn missing_level(&self, cov: &Coverage, profile: &Profile, level: Level) -> LevelResult {
        let holding: Vec<u32> = self
            .blessed
            .iter()
            .filter(|(_, b)| b.levels.contains_key(level.name()))
            .map(|(&s, _)| s)
            .collect();
        let first = holding.first().copied().unwrap_or(0);
        let phase = if first == 0 { Phase::Prefill } else { Phase::Decode };
        let at = coverage::level_location(level, first, 0, phase);
        cov.missing_level(profile, level, holding.len() as u64, holding.len() as u64, at)
    }

    /// The level's result: every step's level digest against the blessed one.
    fn compare_level(&self, level: Level, mode: Mode, captured: bool) -> Result<LevelResult, GateError> {
        let mut r = LevelResult::empty(level, mode, captured);
        if r.status != Status::Pass {
            return Ok(r);
        }
        for &s in &self.all {
            r.steps += 1;
            let want = self.blessed.get(&s).and_then(|b| b.levels.get(level.name()));
            let got = self.candidate_level(level, s)?;
            if want.map(String::as_str) == got.as_deref() {
                continue;
            }
            r.differing += 1;
            let at = self.location(level, s)?;
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
        Ok(r)
    }
}

/// Compares a candidate with blessed fingerprints under `profile`: the
/// blessed binding first (a refusing difference is an error unless
/// `force`), then coverage (a required level the baseline lacks is an
/// error, one the candidate lacks fails), then every compared level that is
/// not `info` must have the blessed level digest at every step. `file`
/// names the baseline in errors.
pub fn compare(
    baseline: &Baseline,
    file: &Path,
    candidate: &Trace,
    profile: &Profile,
    force: bool,
) -> Result<GateReport, GateError> {
    if baseline.algorithm != candidate.algorithm().name() {
        return Err(GateError::AlgorithmMismatch {
            baseline: baseline.algorithm.clone(),
            candidate: candidate.algorithm().name().into(),
        });
    }
    let named = |source| GateError::Baseline {
        path: file.to_path_buf(),
        source,
    };
    let blessed = baseline.committed_binding().map_err(named)?;
    let forced = baseline
        .check_binding(&blessed, candidate, force)
        .map_err(named)?;
    let cov = coverage::plan(
        profile,
        baseline.sides(&blessed),
        Sides::of(candidate).map_err(GateError::Candidate)?,
    )
    .map_err(|e| named(BaselineError::Coverage(e)))?;
    let mut notes: Vec<String> = baseline.binding_note(candidate).into_iter().collect();
    notes.extend(forced);
    let steps = Steps::new(baseline, candidate);
    let levels = Level::ALL
        .into_iter()
        .map(|l| match cov.missing.contains(l) {
            true => Ok(steps.missing_level(&cov, profile, l)),
            false => steps.compare_level(l, profile.mode(l), cov.compared.contains(l)),
        })
        .collect::<Result<_, _>>()?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use moeconf_fingerprint::{Algorithm, Component, DType, TensorView};
    use moeconf_schema::{Header, TraceWriter};

    /// A one-step trace holding `token.output` and `lm.margin` (L0 and L1).
    fn trace(dir: &Path) -> Trace {
        let path = dir.join("t.bin");
        let binding = Binding {
            capture: CaptureSpec {
                levels: moeconf_fingerprint::LevelSet::ALL,
                payload_levels: moeconf_fingerprint::LevelSet::ALL,
            },
            decoding: Decoding {
                strategy: "greedy".into(),
                max_new_tokens: 1,
            },
            ..Binding::default()
        };
        let header = Header {
            binding,
            ..Header::default()
        };
        let mut w = TraceWriter::create(&path, Algorithm::Blake3, header).unwrap();
        for (c, level) in [
            (Component::TokenOutput, Level::L0),
            (Component::LmMargin, Level::L1),
        ] {
            let coord = Coord {
                step: 0,
                position: 0,
                phase: Phase::Prefill,
                layer: None,
                path: c.path().into(),
            };
            let bytes = 7i32.to_le_bytes();
            let dtype = if level == Level::L0 {
                DType::I32
            } else {
                DType::F32
            };
            let view = TensorView {
                dtype,
                shape: &[1],
                bytes: &bytes,
            };
            w.append(coord, level, view, true).unwrap();
        }
        w.finish().unwrap();
        Trace::open(&path).unwrap()
    }

    #[test]
    fn the_blessed_binding_refuses_like_trace_against_trace() {
        let dir = tempfile::tempdir().unwrap();
        let t = trace(dir.path());
        let profile = Profile::builtin("default");
        let file = dir.path().join("b.json");
        let b = Baseline::of(&t).unwrap();
        assert_eq!(
            compare(&b, &file, &t, &profile, false).unwrap().verdict,
            crate::Verdict::Pass
        );
        // A baseline blessed from a run of another model and tokenizer.
        let b = blessed_with(&b, |x| {
            x.model.config_digest = Digest([0x11; 32]);
            x.tokenizer.digest = Digest([0x22; 32]);
        });
        assert!(b.validate().is_ok());
        let err = compare(&b, &file, &t, &profile, false).unwrap_err();
        let GateError::Baseline {
            source: BaselineError::NotComparable { fields },
            ..
        } = &err
        else {
            panic!("{err}");
        };
        let names: Vec<&str> = fields.iter().map(|f| f.field.as_str()).collect();
        assert_eq!(names, ["model.config_digest", "tokenizer.digest"]);
        let report = compare(&b, &file, &t, &profile, true).unwrap();
        assert!(
            report
                .notes
                .iter()
                .any(|n| n.starts_with("forced over model.config_digest")),
            "{:?}",
            report.notes
        );
        // Shown fields differ without refusing.
        let b = blessed_with(&Baseline::of(&t).unwrap(), |x| {
            x.precision = "f32".into();
            x.model.name = "other".into();
        });
        assert!(compare(&b, &file, &t, &profile, false).is_ok());
    }

    /// `b` as if blessed from a run whose binding `edit` changed: binding
    /// bytes, readable fields, binding digest and root all recomputed.
    fn blessed_with(b: &Baseline, edit: impl FnOnce(&mut Binding)) -> Baseline {
        let mut binding = b.committed_binding().unwrap();
        edit(&mut binding);
        let alg = Algorithm::from_name(&b.algorithm).unwrap();
        let wire = binding.to_bytes();
        let bd = moeconf_fingerprint::binding_digest(alg, &wire);
        let steps: Vec<(u32, Digest)> = b
            .steps
            .iter()
            .map(|s| (s.step, Digest::from_hex(&s.digest).unwrap()))
            .collect();
        let mut out = b.clone();
        out.binding = BlessedBinding::of(&binding);
        out.binding_wire = hex_encode(&wire);
        out.binding_digest = bd.to_hex();
        out.root = root_digest(alg, bd, steps.into_iter()).to_hex();
        out
    }

    #[test]
    fn an_edited_blessed_binding_is_refused_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let t = trace(dir.path());
        let good = Baseline::of(&t).unwrap();
        assert!(good.validate().is_ok());
        // The readable form edited to the values of another run's binding:
        // before schema version 3 this passed a candidate of that run.
        let mut b = good.clone();
        b.binding.model.config_digest = "11".repeat(32);
        match b.validate() {
            Err(BaselineError::BindingEdited { field }) => assert_eq!(field, "model.config_digest"),
            other => panic!("{other:?}"),
        }
        let mut b = good.clone();
        b.binding.prompt.ids.push(7);
        assert!(matches!(b.validate(), Err(BaselineError::BindingEdited { .. })));
        // The bytes edited too: their digest is no longer the binding digest.
        let mut b = good.clone();
        let mut other = b.committed_binding().unwrap();
        other.model.config_digest = Digest([0x11; 32]);
        b.binding = BlessedBinding::of(&other);
        b.binding_wire = hex_encode(&other.to_bytes());
        assert!(matches!(b.validate(), Err(BaselineError::Inconsistent { .. })));
        // And the binding digest with them: the root no longer fits.
        b.binding_digest = moeconf_fingerprint::binding_digest(t.algorithm(), &other.to_bytes()).to_hex();
        assert!(matches!(b.validate(), Err(BaselineError::Inconsistent { .. })));
        // Not hex, or not a binding.
        let mut b = good.clone();
        b.binding_wire.push('z');
        assert!(b.validate().is_err());
        let mut b = good;
        b.binding_wire.truncate(b.binding_wire.len() - 2);
        assert!(b.validate().is_err());
    }

    #[test]
    fn invalid_baselines_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let t = trace(dir.path());
        let good = Baseline::of(&t).unwrap();
        assert!(good.validate().is_ok());
        let mut b = good.clone();
        b.binding.model.weights_digest = "xyz".into();
        assert!(matches!(
            b.validate(),
            Err(BaselineError::BindingField {
                field: "model.weights_digest",
                ..
            })
        ));
        let mut b = good.clone();
        b.steps.push(b.steps[0].clone());
        assert!(matches!(
            b.validate(),
            Err(BaselineError::DuplicateStep { step: 0 })
        ));
        let mut b = good.clone();
        b.steps.clear();
        assert!(matches!(b.validate(), Err(BaselineError::NoSteps)));
        let mut b = good;
        b.binding.capture = "L9".into();
        assert!(b.validate().is_err());
    }
}
