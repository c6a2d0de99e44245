//! Traces that do not hold every step of their run (the rule and its
//! computation: `moeconf_schema::Completeness`). `moeconf diff` refuses
//! them (exit 2) unless `--allow-incomplete`, and then its report lists
//! them and its verdict and summary say so; `moeconf gate` reuses the type.

use moeconf_schema::{Completeness, Trace};
use serde::Serialize;

/// One side of a comparison that lacks some steps of its run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Incomplete {
    /// `reference`, `candidate` or `baseline` (the report names its file).
    pub side: String,
    /// Steps held.
    pub present_steps: u64,
    /// Steps of the run (the binding's `max_new_tokens`).
    pub expected_steps: u32,
    /// The missing steps, e.g. `1, 3-7` (the first few ranges).
    pub missing_steps: String,
    /// `incomplete: 1 of 2 steps (missing step 1)`.
    pub note: String,
}

impl Incomplete {
    /// `Some` when `c` is not complete.
    pub fn of(side: &str, c: &Completeness) -> Option<Incomplete> {
        (!c.is_complete()).then(|| Incomplete {
            side: side.into(),
            present_steps: c.present,
            expected_steps: c.expected,
            missing_steps: c.missing_steps(),
            note: c.note(),
        })
    }

    /// `candidate: incomplete: 1 of 2 steps (missing step 1)`.
    pub fn describe(&self) -> String {
        format!("{}: {}", self.side, self.note)
    }
}

/// The incomplete sides of a diff, reference first.
pub(crate) fn sides(reference: &Trace, candidate: &Trace) -> Vec<Incomplete> {
    [("reference", reference), ("candidate", candidate)]
        .into_iter()
        .filter_map(|(side, t)| Incomplete::of(side, &t.completeness()))
        .collect()
}

/// The summary line with the incomplete sides in front: an equivalent
/// verdict never reads as a plain one when a side lacks steps.
pub(crate) fn annotate(summary: String, incomplete: &[Incomplete]) -> String {
    match incomplete {
        [] => summary,
        _ => {
            let notes: Vec<String> = incomplete.iter().map(Incomplete::describe).collect();
            format!("{} — {summary}", notes.join("; "))
        }
    }
}
