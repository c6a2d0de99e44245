//! Coverage is part of the verdict (docs/ci.md §2, "Coverage"): which levels
//! are compared, which required levels the candidate lacks (each fails the
//! gate), and which missing data is an error rather than a verdict (an
//! empty reference or baseline, a required level it does not hold, no level
//! in common at all).
//!
//! The same plan serves both entry points: trace against trace, and trace
//! against blessed fingerprints (a baseline "holds" the levels its steps
//! have digests of, and "declares" the capture spec of the blessed binding).

use crate::error::{CoverageError, GateError};
use crate::policy::Profile;
use crate::report::{Failure, LevelResult};
use moeconf_bisect::RecordRef;
use moeconf_fingerprint::{Coord, Level, LevelSet, Phase};
use moeconf_schema::Trace;

/// What one side holds and declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sides {
    /// Levels the side holds at least one record (or step digest) of.
    pub held: LevelSet,
    /// Levels the side's binding declares captured.
    pub declared: LevelSet,
}

impl Sides {
    /// What a trace holds (from its verified step nodes: which levels a
    /// step holds is committed by its digest, the root block's record
    /// counts are not) and declares (its binding).
    pub fn of(t: &Trace) -> Result<Sides, moeconf_schema::TraceError> {
        Ok(Sides {
            held: t.held_levels()?,
            declared: declared(t),
        })
    }

    /// What the reference and the candidate hold and declare. A step with
    /// the same digest on both sides holds the same levels on both, so it
    /// is read on the reference's side only.
    /// Also returns the levels of each of the reference's steps (in step
    /// order).
    pub fn of_pair(reference: &Trace, candidate: &Trace) -> Result<(Sides, Sides, Vec<LevelSet>), GateError> {
        let equal = |s: &moeconf_schema::StepSummary, other: &Trace| {
            other.step_summary(s.step).is_some_and(|o| o.digest == s.digest)
        };
        let (mut shared, mut r_own) = (Vec::new(), Vec::new());
        for (k, s) in reference.steps().iter().enumerate() {
            if equal(s, candidate) {
                shared.push(k);
            } else {
                r_own.push(k);
            }
        }
        let c_own = candidate
            .steps()
            .iter()
            .enumerate()
            .filter(|(_, s)| !equal(s, reference))
            .map(|(k, _)| k);
        let per_step = reference
            .levels_by_step(0..reference.steps().len())
            .map_err(GateError::Reference)?;
        let union = |ks: &[usize]| ks.iter().fold(LevelSet::EMPTY, |a, &k| a.union(per_step[k]));
        let (shared, r_own) = (union(&shared), union(&r_own));
        let c_own = candidate.held_levels_of(c_own).map_err(GateError::Candidate)?;
        Ok((
            Sides {
                held: shared.union(r_own),
                declared: declared(reference),
            },
            Sides {
                held: shared.union(c_own),
                declared: declared(candidate),
            },
            per_step,
        ))
    }
}

/// The levels a trace's binding declares captured.
fn declared(t: &Trace) -> LevelSet {
    Level::ALL
        .into_iter()
        .filter(|&l| t.binding().capture.captures(l))
        .collect()
}

/// The coverage decision of one gate run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Coverage {
    /// Levels whose records (or step digests) are compared.
    pub compared: LevelSet,
    /// Levels the reference holds and the candidate must hold but does not:
    /// each fails the gate.
    pub missing: LevelSet,
    /// Whether the candidate holds no record at all.
    pub candidate_empty: bool,
}

/// A location that stands for a whole level at a step (no single record):
/// the path reads `(level digest)`.
pub(crate) fn level_location(level: Level, step: u32, position: u32, phase: Phase) -> RecordRef {
    let coord = Coord {
        step,
        position,
        phase,
        layer: None,
        path: "(level digest)".into(),
    };
    RecordRef::new(level, &coord, "reference")
}

/// `L1, L2` for messages.
pub(crate) fn names(set: LevelSet) -> String {
    let v: Vec<&str> = set.iter().map(Level::name).collect();
    v.join(", ")
}

/// The levels of `a` not in `b`.
fn minus(a: LevelSet, b: LevelSet) -> LevelSet {
    a.iter().filter(|&l| !b.contains(l)).collect()
}

/// Decides what is compared and what fails for lack of data.
///
/// Errors (no verdict possible): the reference holds nothing; it lacks a
/// level the profile requires; the two sides have no level in common and
/// no required level is missing. A level is compared when either side holds
/// it and both declare it captured, or both hold it: a record on one side
/// only of a compared level then fails on a judged level. Every required
/// level the candidate does not hold is `missing` (all the reference's
/// levels when the candidate is empty: an empty trace never passes).
pub(crate) fn plan(profile: &Profile, reference: Sides, candidate: Sides) -> Result<Coverage, CoverageError> {
    if reference.held.is_empty() {
        return Err(CoverageError::Empty);
    }
    let required = profile.required_levels(reference.held);
    let lacking = minus(required, reference.held);
    if !lacking.is_empty() {
        return Err(CoverageError::MissingRequired {
            levels: names(lacking),
            profile: profile.name.clone(),
            required: profile.describe_required(),
        });
    }
    let candidate_empty = candidate.held.is_empty();
    let missing = if candidate_empty {
        reference.held
    } else {
        minus(required, candidate.held)
    };
    let compared: LevelSet = Level::ALL
        .into_iter()
        .filter(|&l| !missing.contains(l))
        .filter(|&l| {
            let held_by = |s: Sides| s.held.contains(l);
            let both_declare = reference.declared.contains(l) && candidate.declared.contains(l);
            (held_by(reference) || held_by(candidate))
                && (both_declare || (held_by(reference) && held_by(candidate)))
        })
        .collect();
    if compared.is_empty() && missing.is_empty() {
        return Err(CoverageError::NothingInCommon {
            reference: names(reference.held),
            candidate: names(candidate.held),
        });
    }
    Ok(Coverage {
        compared,
        missing,
        candidate_empty,
    })
}

impl Coverage {
    /// The failure reason of a missing level.
    pub fn reason(&self, profile: &Profile, level: Level) -> String {
        if self.candidate_empty
            && !profile
                .required_levels(LevelSet::EMPTY.with(level))
                .contains(level)
        {
            "missing from the candidate: it holds no records (an empty trace never passes)".into()
        } else {
            format!(
                "required level missing from the candidate: it holds no {} records (profile {:?}: required = [{}])",
                level.name(),
                profile.name,
                profile.describe_required()
            )
        }
    }

    /// The result of a missing level held by `steps` steps: every one of its
    /// `records` (reference records, or blessed steps) fails, the first
    /// located at `at`.
    pub fn missing_level(
        &self,
        profile: &Profile,
        level: Level,
        steps: u64,
        records: u64,
        at: RecordRef,
    ) -> LevelResult {
        let mut r = LevelResult::empty(level, profile.mode(level), true);
        r.steps = steps;
        r.differing = records;
        r.failed = records.max(1);
        r.first_difference = Some(at.clone());
        r.first_failure = Some(Failure {
            at,
            reason: self.reason(profile, level),
        });
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Mode, Requirement};

    fn set(levels: &[Level]) -> LevelSet {
        levels.iter().copied().collect()
    }

    fn sides(held: &[Level], declared: &[Level]) -> Sides {
        Sides {
            held: set(held),
            declared: set(declared),
        }
    }

    use Level::*;
    const FULL: [Level; 5] = [L0, L1, L2, L3, L4];

    #[test]
    fn required_levels_follow_the_profile_and_the_reference() {
        let mut p = Profile::builtin("default");
        p.set_mode(L4, Mode::Info);
        assert_eq!(p.required_levels(set(&FULL)), set(&[L0, L1, L2, L3]));
        assert_eq!(p.required_levels(set(&[L3])), set(&[L0, L1, L3]));
        let strict = Profile::builtin("strict");
        assert_eq!(strict.required_levels(set(&[L2, L4])), set(&[L2, L4]));
        assert_eq!(strict.describe_required(), "reference");
        p.required.clear();
        assert_eq!(p.required_levels(set(&FULL)), LevelSet::EMPTY);
        assert_eq!(p.describe_required(), "none");
    }

    #[test]
    fn the_plan_fails_or_refuses_missing_data() {
        let strict = Profile::builtin("strict");
        let full = sides(&FULL, &FULL);
        // A candidate that captured L0 only: the other levels are missing.
        let c = plan(&strict, full, sides(&[L0], &[L0])).unwrap();
        assert_eq!((c.compared, c.missing), (set(&[L0]), set(&[L1, L2, L3, L4])));
        // An empty reference, or one without a required level, is an error.
        assert!(matches!(
            plan(&strict, sides(&[], &FULL), full),
            Err(CoverageError::Empty)
        ));
        let default = Profile::builtin("default");
        let e = plan(&default, sides(&[L0, L3], &FULL), full).unwrap_err();
        assert!(e.to_string().contains("holds no L1 records"), "{e}");
        // An empty candidate misses every level, even when nothing is required.
        let mut none = Profile::builtin("default");
        none.required = Vec::new();
        let c = plan(&none, full, sides(&[], &[])).unwrap();
        assert_eq!(c.missing, set(&FULL));
        assert!(c.reason(&none, L2).contains("holds no records"));
        // Declared by both, held by one: compared (its records fail one-sided).
        let c = plan(&none, sides(&[L0], &FULL), sides(&[L0, L4], &FULL)).unwrap();
        assert_eq!(c.compared, set(&[L0, L4]));
        // Held by one, declared by the other only: not compared.
        let c = plan(&none, sides(&[L0], &[L0]), sides(&[L0, L4], &FULL)).unwrap();
        assert_eq!(c.compared, set(&[L0]));
        // Nothing in common and nothing required: an error, not a pass.
        let e = plan(&none, sides(&[L0], &[L0]), sides(&[L3], &[L3])).unwrap_err();
        assert!(matches!(e, CoverageError::NothingInCommon { .. }), "{e}");
        // Undeclared producers: held by both is enough.
        let c = plan(&none, sides(&[L0, L1], &[]), sides(&[L0, L1], &[])).unwrap();
        assert_eq!(c.compared, set(&[L0, L1]));
        assert_eq!(
            Requirement::parse_list("L0, judged,reference").unwrap(),
            vec![
                Requirement::Level(L0),
                Requirement::Judged,
                Requirement::Reference
            ]
        );
        assert_eq!(Requirement::parse_list("none").unwrap(), Vec::new());
        assert!(Requirement::parse_list("L0,everything").is_err());
    }
}
