//! Errors of a trace comparison.

use moeconf_schema::TraceError;

/// One binding field whose value differs between the two traces.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FieldDifference {
    /// Dotted field name, e.g. `prompt.ids` or `model.weights_digest`.
    pub field: String,
    /// The reference's value, rendered for humans.
    pub reference: String,
    /// The candidate's value, rendered for humans.
    pub candidate: String,
}

impl std::fmt::Display for FieldDifference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: reference {} vs candidate {}",
            self.field, self.reference, self.candidate
        )
    }
}

/// Why a comparison could not produce a report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BisectError {
    /// The bindings name a different model, tokenizer, prompt or decoding
    /// configuration (override with `DiffOptions::force`).
    #[error("traces are not comparable ({} differing field{}; use --force to compare anyway):\n{}",
        .fields.len(), if .fields.len() == 1 { "" } else { "s" },
        .fields.iter().map(|d| format!("  {d}")).collect::<Vec<_>>().join("\n"))]
    NotComparable {
        /// Every refusing field that differs.
        fields: Vec<FieldDifference>,
    },
    /// The traces use different digest algorithms, so no digest can be
    /// compared (re-capture one of them with the other's algorithm).
    #[error("traces use different digest algorithms (reference {reference}, candidate {candidate}); re-capture one with the other's algorithm")]
    AlgorithmMismatch {
        /// The reference's algorithm name.
        reference: String,
        /// The candidate's algorithm name.
        candidate: String,
    },
    /// No level is captured by both traces, so nothing can be compared.
    #[error("no level is captured by both traces (reference captures {reference}, candidate {candidate}); re-capture with common levels")]
    NothingToCompare {
        /// The reference's capture spec, e.g. `L0,L1`.
        reference: String,
        /// The candidate's capture spec.
        candidate: String,
    },
    /// Neither trace holds a record: nothing was compared, so nothing can
    /// be called equivalent.
    #[error("neither trace holds any record: nothing to compare")]
    NoRecords,
    /// A file could not be read or written (the benchmark's byte
    /// comparison). The I/O error is the source, not repeated in the text.
    #[error("{}: {what}", .path.display())]
    Io {
        path: std::path::PathBuf,
        /// What was being done.
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A payload on the divergent path failed verification or could not be
    /// read.
    #[error(transparent)]
    Trace(#[from] TraceError),
}
