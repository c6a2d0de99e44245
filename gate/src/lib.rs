//! moeconf's CI gate (`moeconf gate`, docs/ci.md): judges a candidate trace
//! against a reference trace, or against a blessed baseline, under a
//! reviewed policy, and reports in text, JSON, JUnit XML or Markdown.
//!
//! It exists so that a kernel change is accepted or refused by a written
//! policy instead of by eye: which levels must stay bitwise equal, which may
//! move within stated tolerances, which are only reported. It is built on the
//! diff engine (`moeconf-bisect`): records are paired by the engine's tree
//! descent ([`moeconf_bisect::differing_pairs`]), located with its
//! [`RecordRef`](moeconf_bisect::RecordRef), and every failure report carries
//! its localization of the first divergence.
//!
//! * [`policy`]: the policy file, profiles, precedence and rules.
//! * [`evaluate()`]: walks the differing records of both traces and judges
//!   each by its level's mode and the first matching rule, after the
//!   near-tie rules.
//! * [`tolerance`]: element-wise, ULP, aggregate and logit checks.
//! * [`baseline`]: blessed fingerprints (`--bless`) and the comparison with them.
//! * [`GateReport`]: the result (JSON document and text); [`report_junit`],
//!   [`report_md`]: CI-native renderings.
//! * [`GateError`]: why no verdict could be reached (policy, baseline,
//!   traces, report files).
//!
//! [`against_reference`] and [`against_baseline`] are the two entry points
//! of `moeconf gate`; [`write_atomic`] writes its report files.
#![forbid(unsafe_code)]

pub mod baseline;
mod coverage;
mod error;
mod evaluate;
mod incomplete;
mod judge;
pub mod policy;
mod report;
pub mod report_junit;
pub mod report_md;
pub mod tolerance;
mod write;

pub use error::{BaselineError, CoverageError, FileKind, GateError, PolicyError};
pub use evaluate::evaluate;
pub use report::{
    Failure, FlipKind, GateReport, LevelResult, NearTie, RuleResult, Status, Verdict, GATE_SCHEMA_VERSION,
};
pub use write::{write_atomic, write_checked};

use moeconf_bisect::{diff, BisectError, DiffOptions, DiffReport};
use moeconf_schema::{Trace, Verification};
use policy::Profile;
use std::path::Path;

/// Judges `candidate` against the reference trace at `reference` under
/// `profile`: opens the reference and verifies every byte of both traces (a
/// corrupted byte of either is an error, never a verdict), asks the diff
/// engine for the localization (refusing traces whose bindings are not
/// comparable unless `force`; forced fields are noted in the report), then
/// [`evaluate`]s. The report names both traces.
pub fn against_reference(
    reference: &Path,
    candidate: &Trace,
    profile: &Profile,
    force: bool,
) -> Result<GateReport, GateError> {
    against_reference_with(reference, candidate, profile, force, Verification::Full)
}

/// [`against_reference`] under `verification` (what `moeconf gate` uses,
/// [`Verification::OnUse`] unless `--verify-all`): with `OnUse`, a version 2
/// trace is verified as the gate reads it, node by node and payload by
/// payload, so a corrupted byte the verdict uses is an error of its side
/// and bytes the gate never reads cannot influence the verdict.
pub fn against_reference_with(
    reference: &Path,
    candidate: &Trace,
    profile: &Profile,
    force: bool,
    verification: Verification,
) -> Result<GateReport, GateError> {
    against_reference_run(reference, candidate, profile, force, verification).map(|r| r.report)
}

/// A gate against a reference trace with what it computed on the way, for
/// outputs that draw it (`gate --html`): the reference as opened and
/// verified, and the diff the localization came from (`None` when the
/// traces have no level in common).
pub struct ReferenceRun {
    /// The verdict.
    pub report: GateReport,
    pub reference: Trace,
    /// The diff of the reference and the candidate.
    pub diff: Option<DiffReport>,
}

/// [`against_reference_with`], keeping the reference and the diff.
pub fn against_reference_run(
    reference: &Path,
    candidate: &Trace,
    profile: &Profile,
    force: bool,
    verification: Verification,
) -> Result<ReferenceRun, GateError> {
    let rt = Trace::open_for(reference, verification).map_err(GateError::Reference)?;
    candidate.ensure(verification).map_err(GateError::Candidate)?;
    let opts = DiffOptions {
        force,
        ..DiffOptions::default()
    };
    let (localization, forced, diffed) = match diff(&rt, candidate, &opts) {
        Ok(d) => (
            d.first_divergence.clone(),
            d.comparability.forced_over.clone(),
            Some(d),
        ),
        // Coverage decides what a gate without a common level says.
        Err(BisectError::NothingToCompare { .. }) => (None, Vec::new(), None),
        // A node or payload of one trace that failed verification on the
        // diff's path: an error of that trace (the candidate's makes the
        // commit untestable under `git bisect run`, like an unreadable file).
        Err(BisectError::Trace(e)) => {
            return Err(if e.path() == Some(candidate.path()) {
                GateError::Candidate(e)
            } else {
                GateError::Reference(e)
            })
        }
        Err(source) => {
            return Err(GateError::Diff {
                reference: reference.to_path_buf(),
                candidate: candidate.path().to_path_buf(),
                source,
            })
        }
    };
    let mut report = evaluate(&rt, candidate, profile, localization)?;
    report.notes.extend(forced.iter().map(|d| {
        format!(
            "forced over {}: reference {} vs candidate {}",
            d.field, d.reference, d.candidate
        )
    }));
    report.mark_incomplete([
        incomplete::of_trace("reference", &rt),
        incomplete::of_trace("candidate", candidate),
    ]);
    report.reference = reference.display().to_string();
    report.candidate = candidate.path().display().to_string();
    report.candidate_root = candidate.root().to_hex();
    Ok(ReferenceRun {
        report,
        reference: rt,
        diff: diffed,
    })
}

/// Judges `candidate` against the blessed baseline `file` under `profile`
/// (every level that is not `info` bitwise, per step). Every byte of the
/// candidate is verified first: a baseline holds digests only, but a
/// candidate with a corrupted byte is an error, never a verdict. A
/// candidate whose binding differs from the blessed one in a refusing field
/// (model, tokenizer, prompt, decoding) is an error unless `force`. The
/// report names the baseline and the candidate.
pub fn against_baseline(
    file: &Path,
    candidate: &Trace,
    profile: &Profile,
    force: bool,
) -> Result<GateReport, GateError> {
    against_baseline_with(file, candidate, profile, force, Verification::Full)
}

/// [`against_baseline`] under `verification` (see
/// [`against_reference_with`]): with `OnUse`, a version 2 candidate is
/// verified as its step nodes are read, and only the steps whose digests
/// differ from the blessed ones are read.
pub fn against_baseline_with(
    file: &Path,
    candidate: &Trace,
    profile: &Profile,
    force: bool,
    verification: Verification,
) -> Result<GateReport, GateError> {
    candidate.ensure(verification).map_err(GateError::Candidate)?;
    let b = baseline::Baseline::read(file)?;
    let mut report = baseline::compare(&b, file, candidate, profile, force)?;
    report.mark_incomplete([
        incomplete::of_baseline(&b),
        incomplete::of_trace("candidate", candidate),
    ]);
    report.reference = file.display().to_string();
    report.candidate = candidate.path().display().to_string();
    report.candidate_root = candidate.root().to_hex();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeconf_fingerprint::{Algorithm, Coord, DType, Level, Phase, TensorView};
    use moeconf_schema::{Binding, CaptureSpec, Header, TraceWriter};
    use policy::{Check, Mode};

    /// One L3 record `layer.post_ffn_mhc` holding `v`, in a trace of the given precision.
    fn trace(dir: &std::path::Path, name: &str, precision: &str, v: &[f32]) -> Trace {
        traces_of(dir, name, precision, &[(0, v)])
    }

    /// L3 records `layer.post_ffn_mhc` at step 0, one per `(layer, values)`.
    fn traces_of(dir: &std::path::Path, name: &str, precision: &str, records: &[(u32, &[f32])]) -> Trace {
        let path = dir.join(name);
        let binding = Binding {
            precision: precision.into(),
            decoding: moeconf_schema::Decoding {
                strategy: "greedy".into(),
                max_new_tokens: 1,
            },
            capture: CaptureSpec {
                levels: moeconf_fingerprint::LevelSet::ALL,
                payload_levels: moeconf_fingerprint::LevelSet::ALL,
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
        for &(layer, v) in records {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            let coord = Coord {
                step: 0,
                position: 0,
                phase: Phase::Prefill,
                layer: Some(layer),
                path: moeconf_fingerprint::Component::LayerPostFfnMhc.path().into(),
            };
            let view = TensorView {
                dtype: DType::F32,
                shape: &[v.len() as u64],
                bytes: &bytes,
            };
            w.append(coord, Level::L3, view, true).unwrap();
        }
        w.finish().unwrap();
        Trace::open(&path).unwrap()
    }

    /// L3 in tolerance mode; the traces here hold only L3, so only judged
    /// levels are required (the built-in default also requires L0 and L1).
    fn tolerant() -> Profile {
        let mut p = Profile::builtin("t");
        p.levels[3] = Mode::Tolerance;
        p.required = vec![policy::Requirement::Judged];
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
        let rep = evaluate(&r, &c, &tolerant(), None).unwrap();
        assert_eq!(rep.levels[3].status, Status::Pass, "{}", rep.render_text());
        assert_eq!(rep.levels[3].differing, 1);
        let (r, c) = (
            trace(dir.path(), "r32.bin", "f32", &v),
            trace(dir.path(), "c32.bin", "f32", &w),
        );
        let rep = evaluate(&r, &c, &tolerant(), None).unwrap();
        assert_eq!(rep.levels[3].status, Status::Fail);
        assert!(
            rep.rules[0].minimal.unwrap().describe().contains("rtol >= 9.6"),
            "{}",
            rep.render_text()
        );
        // Bitwise fails either way; info reports without failing.
        let mut p = tolerant();
        assert!(
            matches!(
                evaluate(&r, &c, &Profile::builtin("default"), None),
                Err(GateError::ReferenceCoverage { .. })
            ),
            "the built-in default requires L0 and L1, which these traces lack"
        );
        p.levels[3] = Mode::Bitwise;
        assert_eq!(evaluate(&r, &c, &p, None).unwrap().verdict, Verdict::Fail);
        p.levels[3] = Mode::Info;
        let rep = evaluate(&r, &c, &p, None).unwrap();
        assert_eq!((rep.verdict, rep.levels[3].status), (Verdict::Pass, Status::Info));
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
            evaluate(&r, &c, &p, None).unwrap().verdict,
            Verdict::Fail,
            "both NaN without equal_nan"
        );
        p.equal_nan = true;
        assert_eq!(evaluate(&r, &c, &p, None).unwrap().verdict, Verdict::Pass);
        p.dtype_tolerance.insert("f32".into(), (0.0, 0.25));
        assert_eq!(evaluate(&r, &c, &p, None).unwrap().verdict, Verdict::Fail);
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
            evaluate(&r, &c, &p, None).unwrap().verdict,
            Verdict::Pass,
            "1.0 -> 1.5 is 2^22 ulp"
        );
    }

    #[test]
    fn records_on_one_side_fail_in_execution_order() {
        let dir = tempfile::tempdir().unwrap();
        let v: &[f32] = &[1.0, 2.0];
        // The candidate lacks layer 1 and adds layer 2; layer 0 is equal.
        let r = traces_of(dir.path(), "r.bin", "f32", &[(0, v), (1, v)]);
        let c = traces_of(dir.path(), "c.bin", "f32", &[(0, v), (2, v)]);
        let rep = evaluate(&r, &c, &tolerant(), None).unwrap();
        let l3 = &rep.levels[3];
        assert_eq!((l3.steps, l3.differing, l3.failed), (1, 2, 2));
        assert_eq!(l3.first_difference.as_ref().map(|d| d.layer), Some(Some(1)));
        let f = l3.first_failure.as_ref().unwrap();
        assert_eq!(f.reason, "only in the reference (missing from the candidate)");
        let rule = &rep.rules[0];
        assert_eq!((rule.judged, rule.failed), (2, 2));
        assert_eq!(rep.verdict, Verdict::Fail);
        // The gate's JSON locates records without the diff's `present_in`.
        let at = &rep.to_json()["levels"][3]["first_failure"]["at"];
        assert_eq!(at["layer"], 1);
        assert!(at.get("present_in").is_none(), "{at}");
        // A bitwise level judges its records as the rule `bitwise`.
        let mut p = tolerant();
        p.levels[3] = Mode::Bitwise;
        let rep = evaluate(&r, &c, &p, None).unwrap();
        assert_eq!(rep.rules[0].rule, "bitwise");
        assert_eq!(rep.rules[0].judged, 2);
    }
}
