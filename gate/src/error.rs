//! The gate's errors, typed so that callers can tell a broken policy from an
//! unreadable candidate (which `git bisect run` skips) and so that every
//! message names the file, profile, rule or key at fault.
//!
//! Printed as a chain (`{:#}`: each error, then `: ` and its source), a
//! variant's own text never repeats its source's: the file is named once, by
//! the outermost error, and the detail comes from the source.

use crate::policy::Source;
use moeconf_bisect::BisectError;
use moeconf_schema::TraceError;
use std::num::ParseFloatError;
use std::path::PathBuf;

/// Why the gate could not produce a verdict.
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    /// The policy file cannot be read.
    #[error("policy {}", path.display())]
    PolicyRead {
        path: PathBuf,
        /// The operating system's refusal.
        source: std::io::Error,
    },
    /// An input (the policy file, a baseline) is not a regular file: a
    /// directory, FIFO, socket, device, or a symbolic link to one or to
    /// nothing. Never opened, so never blocked on. Boxed: large and rare.
    #[error(transparent)]
    Input(Box<moeconf_output::InputFileError>),
    /// The policy file is not TOML of the policy's shape (syntax error,
    /// unknown key, wrong type).
    #[error("policy {}", path.display())]
    PolicySyntax {
        path: PathBuf,
        /// The parser's message (line, column and the offending text).
        source: Box<toml::de::Error>,
    },
    /// A profile of the policy sets something invalid.
    #[error("policy {policy}: profile {profile:?}")]
    Profile {
        /// Where the policy came from.
        policy: Source,
        /// The profile being resolved.
        profile: String,
        /// The invalid setting.
        source: PolicyError,
    },
    /// The selected profile is defined neither in the file nor built in.
    #[error(
        "policy {policy}: profile {profile:?}: no such profile (defined: {defined:?}; built in: default, strict)"
    )]
    NoSuchProfile {
        /// Where the policy came from.
        policy: Source,
        /// The profile asked for.
        profile: String,
        /// The profiles the file defines.
        defined: Vec<String>,
    },
    /// The resolved profile (file and overrides together) breaks an
    /// invariant: no catch-all rule, or a threshold out of range.
    #[error("policy {policy}")]
    InvalidProfile {
        /// Where the policy came from.
        policy: Source,
        /// The broken invariant.
        source: PolicyError,
    },
    /// A baseline file cannot be read or is not a valid baseline.
    #[error("baseline {}", path.display())]
    Baseline {
        /// The baseline file.
        path: PathBuf,
        source: BaselineError,
    },
    /// The baseline and the candidate use different digest algorithms, so no
    /// digest can be compared.
    #[error(
        "the baseline uses {baseline} digests and the candidate {candidate}: rebless or rerun with --digest {baseline}"
    )]
    AlgorithmMismatch {
        /// The baseline's algorithm name.
        baseline: String,
        /// The candidate's algorithm name.
        candidate: String,
    },
    /// The reference trace cannot gate anything: it holds no records, lacks
    /// a level the profile requires, or has no level in common with the
    /// candidate.
    #[error("reference {}", path.display())]
    ReferenceCoverage {
        /// The reference trace.
        path: PathBuf,
        /// What is missing.
        source: CoverageError,
    },
    /// `--bless` of a trace that holds no records (the baseline could gate nothing).
    #[error("cannot bless {}: it holds no records", path.display())]
    BlessEmpty {
        /// The trace given to `--bless`.
        path: PathBuf,
    },
    /// The reference trace cannot be opened (missing, unreadable or invalid).
    #[error(transparent)]
    Reference(TraceError),
    /// The candidate trace cannot be opened. Under `git bisect run` this
    /// commit cannot be tested, so it is skipped rather than marked bad.
    #[error(transparent)]
    Candidate(TraceError),
    /// The diff engine refused the pair (bindings not comparable, different
    /// digest algorithms, no common level) or could not read a payload.
    #[error("gate {} {}", reference.display(), candidate.display())]
    Diff {
        reference: PathBuf,
        candidate: PathBuf,
        /// The diff engine's reason.
        source: BisectError,
    },
    /// A report or baseline cannot be written: its path is refused before
    /// any work (not a regular file, a symbolic link, an input of the
    /// command, a missing directory) or a step of the atomic write failed
    /// (the temporary file is then removed). The source names the file.
    #[error("writing the {}", if matches!(file, FileKind::Baseline) { "baseline" } else { "report" })]
    Output {
        /// What is being written.
        file: FileKind,
        /// What went wrong, naming the file (boxed: it is large and rare).
        source: Box<moeconf_output::OutputError>,
    },
}

impl GateError {
    /// Whether the error means that the candidate cannot be tested (its
    /// trace is missing or unreadable), as opposed to a broken setup.
    pub fn is_candidate_unreadable(&self) -> bool {
        matches!(self, GateError::Candidate(_))
    }
}

/// What an atomic write produces, for the messages of [`GateError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// A report (`--output`, `--junit`): messages name only the file.
    Report,
    /// A baseline (`--bless`): messages say `baseline FILE`.
    Baseline,
}

/// An invalid policy setting, from the file, the environment or the command
/// line. [`GateError`] adds the file and profile it was found in.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// A level name other than `L0`…`L4`.
    #[error("unknown level {name:?} (expected L0, L1, L2, L3 or L4)")]
    UnknownLevel {
        /// The name given.
        name: String,
    },
    /// A mode other than `bitwise`, `tolerance` or `info`.
    #[error("unknown mode {name:?} (expected bitwise, tolerance or info)")]
    UnknownMode {
        /// The name given.
        name: String,
    },
    /// A rule's `check` names no known check.
    #[error(
        "rule {rule:?}: unknown check {check:?} (expected exact, elementwise, ulp, aggregate, logits or ignore)"
    )]
    UnknownCheck {
        /// The rule's path pattern.
        rule: String,
        check: String,
    },
    /// A rule sets a key its check does not read.
    #[error("rule {rule:?}: key {key} does not apply to check {check:?}")]
    KeyNotApplicable {
        /// The rule's path pattern.
        rule: String,
        key: &'static str,
        /// The rule's check.
        check: String,
    },
    /// A rule lacks a key its check requires.
    #[error("rule {rule:?}: check {check:?} needs {key}")]
    MissingKey {
        /// The rule's path pattern.
        rule: String,
        /// The rule's check.
        check: String,
        key: &'static str,
    },
    /// A rule with an empty path pattern.
    #[error("rule with an empty path pattern")]
    EmptyPattern,
    /// `dtype_tolerance` names an unknown dtype.
    #[error("dtype_tolerance: unknown dtype {name:?}")]
    UnknownDtype {
        /// The name given.
        name: String,
    },
    /// `dtype_tolerance` names an integer dtype (integers compare exactly).
    #[error("dtype_tolerance: {name} is not a floating-point dtype (integers compare exactly)")]
    IntegerDtype {
        /// The dtype's name.
        name: String,
    },
    /// The profile has no catch-all rule, so some record would have no rule.
    #[error(
        "profile {profile:?}: no catch-all rule: add a last rule with path = \"*\" (and no level) so every \
         record has a rule"
    )]
    NoCatchAll {
        /// The profile.
        profile: String,
    },
    /// Rules follow the catch-all rule, so they can never match.
    #[error("profile {profile:?}: rules after the catch-all rule {catch_all} can never match")]
    UnreachableRules {
        profile: String,
        /// The catch-all rule, described (`#3 * (exact)`).
        catch_all: String,
    },
    /// A profile-wide threshold that is negative or not finite.
    #[error("profile {profile:?}: {key} must be a finite number >= 0, got {value}")]
    Threshold {
        profile: String,
        /// The key (`route_near_tie_margin`, `argmax_near_tie_margin`).
        key: &'static str,
        value: f64,
    },
    /// A `dtype_tolerance` bound that is negative or not finite (a NaN
    /// bound would fail every differing element without saying why; an
    /// infinite one would pass anything, which is what `info` is for).
    #[error("profile {profile:?}: {key} must be a finite number >= 0, got {value}")]
    DtypeThreshold {
        profile: String,
        /// The key, `dtype_tolerance.DTYPE.rtol` or `.atol`.
        key: String,
        value: f64,
    },
    /// A rule threshold that is negative or not finite.
    #[error("profile {profile:?}: rule {rule}: {key} must be a finite number >= 0, got {value}")]
    RuleThreshold {
        profile: String,
        /// The rule, described (`#2 layer.* (aggregate)`).
        rule: String,
        key: &'static str,
        value: f64,
    },
    /// A logits rule with `topk = 0`.
    #[error("profile {profile:?}: rule {rule}: topk must be >= 1")]
    ZeroTopk {
        profile: String,
        /// The rule, described.
        rule: String,
    },
    /// A level override that is not `LEVEL=MODE`.
    #[error("{text:?}: expected LEVEL=MODE, e.g. L3=tolerance")]
    LevelModeSyntax {
        /// The text given.
        text: String,
    },
    /// An environment variable that should hold a number.
    #[error("{variable}={value:?}: not a number")]
    NotANumber {
        variable: &'static str,
        value: String,
        source: ParseFloatError,
    },
    /// An invalid entry of `MOECONF_LEVELS`.
    #[error("MOECONF_LEVELS={value:?}")]
    EnvLevels {
        /// The variable's whole value.
        value: String,
        /// The invalid entry's reason.
        source: Box<PolicyError>,
    },
    /// An invalid entry of `MOECONF_REQUIRED`.
    #[error("MOECONF_REQUIRED={value:?}")]
    EnvRequired {
        /// The variable's whole value.
        value: String,
        /// The invalid entry's reason.
        source: Box<PolicyError>,
    },
    /// A `required` entry that is neither a level nor `judged` / `reference`.
    #[error("required: unknown entry {name:?} (expected L0, L1, L2, L3, L4, judged or reference)")]
    UnknownRequirement {
        /// The entry given.
        name: String,
    },
    /// `MOECONF_EQUAL_NAN` other than `1`, `true`, `0` or `false`.
    #[error("MOECONF_EQUAL_NAN={value:?}: expected 1, true, 0 or false")]
    EqualNan {
        /// The value given.
        value: String,
    },
}

/// Why the reference side (trace or baseline) cannot gate the candidate;
/// [`GateError`] names the file.
#[derive(Debug, thiserror::Error)]
pub enum CoverageError {
    /// No records (or no steps) at all.
    #[error("it holds no records, so nothing can be gated")]
    Empty,
    /// A level the profile requires is not held.
    #[error(
        "it holds no {levels} records, which profile {profile:?} requires (required = [{required}]): capture \
         them, or relax `required` (docs/ci.md §2)"
    )]
    MissingRequired {
        /// The levels, e.g. `L1, L2`.
        levels: String,
        profile: String,
        /// The profile's `required` list as written.
        required: String,
    },
    /// The two sides have no level in common, and no required level is
    /// missing from the candidate: nothing can be compared.
    #[error(
        "no level in common with the candidate (reference side holds {reference}, candidate {candidate})"
    )]
    NothingInCommon {
        /// Levels the reference side holds.
        reference: String,
        /// Levels the candidate holds.
        candidate: String,
    },
}

/// What is wrong with a baseline file; [`GateError::Baseline`] names the file.
#[derive(Debug, thiserror::Error)]
pub enum BaselineError {
    /// The file cannot be read.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The file is larger than any plausible baseline.
    #[error("{len} bytes is larger than the {limit}-byte limit")]
    TooLarge {
        /// The file's size.
        len: u64,
        limit: u64,
    },
    /// The file is not JSON of the baseline's shape.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// The JSON is not a baseline of the supported schema version.
    #[error("not a moeconf baseline of schema version {expected} (kind {kind:?}, version {version})")]
    NotABaseline {
        kind: String,
        /// The `schema_version` found.
        version: u32,
        /// The version this build reads.
        expected: u32,
    },
    /// A digest that is not 64 hex digits.
    #[error("{what}: {text:?} is not a 64-digit hex digest")]
    Digest {
        /// Which digest (`root`, `step 3 L4`, …).
        what: String,
        text: String,
    },
    /// A baseline of schema version 1 (before the binding fields): it cannot
    /// be checked against the candidate's binding.
    #[error(
        "schema version {version} baselines do not hold the blessed binding in a form its digest commits to, \
         so it cannot be checked against the candidate's: re-bless it with `moeconf gate --bless --baseline \
         FILE TRACE` (version {expected})"
    )]
    Outdated {
        /// The version found.
        version: u32,
        /// The version this build reads.
        expected: u32,
    },
    /// A readable field of the blessed binding does not say what the
    /// binding's committed bytes (`binding_wire`) say: the file was edited.
    #[error(
        "binding.{field} is not what the blessed binding's own bytes say (binding_wire, whose digest the root \
         commits to) (edited or corrupted baseline; bless again)"
    )]
    BindingEdited {
        /// The first differing field (`model.config_digest`, ...).
        field: String,
    },
    /// The baseline holds no step (`steps: []`): it could gate nothing.
    #[error("it holds no steps, so nothing can be gated (bless a trace that holds records)")]
    NoSteps,
    /// A step listed twice.
    #[error("step {step} is listed twice")]
    DuplicateStep {
        /// The step.
        step: u32,
    },
    /// A digest of the blessed binding that is not 64 hex digits, or another
    /// binding field out of range.
    #[error("binding.{field}: {text:?} is not valid")]
    BindingField {
        /// The field (`model.config_digest`, ...).
        field: &'static str,
        text: String,
    },
    /// The baseline cannot gate the candidate (a required level it does not hold).
    #[error(transparent)]
    Coverage(CoverageError),
    /// The candidate's binding differs from the blessed one in a field that
    /// makes the comparison meaningless (as `moeconf diff` refuses traces).
    #[error("the candidate is not comparable with the blessed baseline ({} differing field{}; use --force to compare anyway):\n{}",
        .fields.len(), if .fields.len() == 1 { "" } else { "s" },
        .fields.iter().map(|d| format!("  {}: blessed {} vs candidate {}", d.field, d.reference, d.candidate)).collect::<Vec<_>>().join("\n"))]
    NotComparable {
        /// Every refusing field that differs (reference = the blessed value).
        fields: Vec<moeconf_bisect::FieldDifference>,
    },
    /// The digest algorithm is neither `blake3` nor `sha256`.
    #[error("algorithm {name:?} is not a digest algorithm (blake3 or sha256)")]
    Algorithm {
        /// The name found.
        name: String,
    },
    /// A digest that is not the hash of the digests the file lists under it
    /// (an edited or corrupted baseline: a step digest and its level
    /// digests, or the root and its step digests, no longer belong together).
    #[error(
        "{what} is not the digest of the {of} the file lists (edited or corrupted baseline; bless again)"
    )]
    Inconsistent {
        /// Which digest (`step 3's digest`, `the root`).
        what: String,
        /// What it should be the digest of.
        of: &'static str,
    },
    /// A level name other than `L0`…`L4`.
    #[error("step {step}: unknown level {name:?}")]
    UnknownLevel {
        step: u32,
        /// The name found.
        name: String,
    },
}
