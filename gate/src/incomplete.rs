//! Sides of a gate that lack steps of their run (the rule:
//! `moeconf_schema::Completeness`). The gate records them in
//! [`GateReport::incomplete`]; `moeconf gate` refuses such a report (exit 2,
//! not a verdict) unless `--allow-incomplete`, and with it every rendering
//! says `incomplete` next to the verdict.

use crate::baseline::Baseline;
use crate::report::GateReport;
use moeconf_bisect::Incomplete;
use moeconf_schema::{Completeness, Trace};

/// The trace's side, when it is incomplete.
pub(crate) fn of_trace(side: &str, t: &Trace) -> Option<Incomplete> {
    Incomplete::of(side, &t.completeness())
}

/// The baseline's side, when its blessed steps do not cover the blessed
/// `max_new_tokens`.
pub(crate) fn of_baseline(b: &Baseline) -> Option<Incomplete> {
    let c = Completeness::of(b.steps.iter().map(|s| s.step), b.binding.decoding.max_new_tokens);
    Incomplete::of("baseline", &c)
}

impl GateReport {
    /// Records the incomplete sides and says so in the summary line.
    pub(crate) fn mark_incomplete(&mut self, sides: impl IntoIterator<Item = Option<Incomplete>>) {
        self.incomplete.extend(sides.into_iter().flatten());
        for i in &self.incomplete {
            self.summary.push_str(&format!("; INCOMPLETE {}", i.describe()));
        }
    }

    /// ` (incomplete)` after the verdict when a side lacks steps, else empty.
    pub fn incomplete_label(&self) -> &'static str {
        if self.incomplete.is_empty() {
            ""
        } else {
            " (incomplete)"
        }
    }

    /// `FILE: incomplete: …` of an incomplete side (the reference or
    /// baseline file is [`GateReport::reference`]).
    pub fn incomplete_file(&self, i: &Incomplete) -> String {
        let path = if i.side == "candidate" {
            &self.candidate
        } else {
            &self.reference
        };
        format!("{path}: {}", i.note)
    }

    /// Whether the candidate is among the incomplete sides.
    pub fn candidate_incomplete(&self) -> bool {
        self.incomplete.iter().any(|i| i.side == "candidate")
    }
}
