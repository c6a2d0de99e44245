//! Whether a trace holds its whole run (docs/format.md §3.1).
//!
//! A run of `max_new_tokens` = N is **complete** when it holds every step
//! 0..N. Both facts are committed: the step numbers are in the root (the
//! root digest commits to them) and N is in the binding (the binding digest
//! commits to it). Every writer runs all N steps (none stops early, e.g. at
//! an end-of-sequence token); a writer that stops early must write the
//! number of steps it ran as `max_new_tokens`. Per-level record counts are
//! deliberately not used: they are not committed.
//!
//! `moeconf diff`, `gate` and `replay` never give exit 0 on an incomplete
//! side unless `--allow-incomplete` is given, and then say
//! [`Completeness::note`] in their reports.

use crate::Trace;
use std::fmt;

/// How many of its run's steps a trace holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completeness {
    /// Steps held below `expected` (steps at or beyond it are refused by
    /// the reader, so this is every step held).
    pub present: u64,
    /// The run's steps: the binding's `max_new_tokens`.
    pub expected: u32,
    /// The steps of 0..`expected` not held, as inclusive ranges, ascending
    /// (at most one more range than steps held, however large `expected`).
    pub missing: Vec<(u32, u32)>,
}

/// At most this many missing ranges are spelled out by [`Completeness::note`].
const SHOWN_RANGES: usize = 8;

impl Completeness {
    /// The completeness of a run of `max_new_tokens` steps holding `steps`
    /// (ascending; steps at or beyond `max_new_tokens` and repeats are
    /// ignored).
    pub fn of(steps: impl IntoIterator<Item = u32>, max_new_tokens: u32) -> Completeness {
        let mut present = 0u64;
        let mut missing = Vec::new();
        let mut next = 0u32; // the first step not yet accounted for
        for s in steps {
            if s >= max_new_tokens || s < next {
                continue;
            }
            if s > next {
                missing.push((next, s - 1));
            }
            present += 1;
            next = s + 1;
        }
        if next < max_new_tokens {
            missing.push((next, max_new_tokens - 1));
        }
        Completeness {
            present,
            expected: max_new_tokens,
            missing,
        }
    }

    /// Whether the run holds every step 0..`expected`. A run of no step
    /// (`max_new_tokens` = 0, or no step held) is not complete: it shows
    /// nothing to compare.
    pub fn is_complete(&self) -> bool {
        self.expected > 0 && self.missing.is_empty()
    }

    /// The missing steps, e.g. `1, 3-7` (the first few ranges, then `…`).
    pub fn missing_steps(&self) -> String {
        let mut parts: Vec<String> = self
            .missing
            .iter()
            .take(SHOWN_RANGES)
            .map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
            .collect();
        if self.missing.len() > SHOWN_RANGES {
            parts.push("…".into());
        }
        parts.join(", ")
    }

    /// `incomplete: 1 of 2 steps (missing step 1)`, or `complete: 2 of 2
    /// steps`.
    pub fn note(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Completeness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let word = if self.is_complete() {
            "complete"
        } else {
            "incomplete"
        };
        write!(f, "{word}: {} of {} steps", self.present, self.expected)?;
        if self.expected == 0 {
            write!(f, " (the binding's max_new_tokens is 0)")?;
        } else if !self.missing.is_empty() {
            let one = self.missing.len() == 1 && self.missing[0].0 == self.missing[0].1;
            write!(
                f,
                " (missing step{} {})",
                if one { "" } else { "s" },
                self.missing_steps()
            )?;
        }
        Ok(())
    }
}

impl Trace {
    /// Whether the trace holds every step of its run, from committed data
    /// only: the root's step list and the binding's `max_new_tokens`.
    pub fn completeness(&self) -> Completeness {
        Completeness::of(
            self.steps().iter().map(|s| s.step),
            self.binding().decoding.max_new_tokens,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_step_below_max_new_tokens_is_complete() {
        let c = Completeness::of([0, 1, 2], 3);
        assert!(c.is_complete());
        assert_eq!(c.note(), "complete: 3 of 3 steps");
    }

    #[test]
    fn missing_steps_are_ranges() {
        let c = Completeness::of([0], 2);
        assert!(!c.is_complete());
        assert_eq!(c.note(), "incomplete: 1 of 2 steps (missing step 1)");
        let c = Completeness::of([1, 4, 5], 10);
        assert_eq!(c.missing, vec![(0, 0), (2, 3), (6, 9)]);
        assert_eq!(c.note(), "incomplete: 3 of 10 steps (missing steps 0, 2-3, 6-9)");
    }

    #[test]
    fn no_step_is_incomplete() {
        let c = Completeness::of([], 2);
        assert_eq!(c.note(), "incomplete: 0 of 2 steps (missing steps 0-1)");
        let c = Completeness::of([], 0);
        assert!(!c.is_complete());
        assert_eq!(
            c.note(),
            "incomplete: 0 of 0 steps (the binding's max_new_tokens is 0)"
        );
    }

    #[test]
    fn a_huge_run_lists_few_ranges() {
        let c = Completeness::of((0..40).map(|s| s * 2), u32::MAX);
        assert_eq!(c.present, 40);
        assert_eq!(c.missing.len(), 40);
        assert!(c.note().ends_with(", …)"), "{}", c.note());
        assert_eq!(c.missing.last(), Some(&(79, u32::MAX - 1)));
    }
}
