//! The errors of a replay: every one ends the replay with exit code 2.

use std::path::PathBuf;

/// Why a replay could not run (or could not finish). Messages name the
/// trace file and what is wrong; a variant's source is not repeated in its
/// text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The model given does not match the trace's binding (or the binding
    /// names a precision, contract or schedule this build cannot run).
    #[error("{path}: {what}")]
    Binding {
        /// The candidate trace.
        path: PathBuf,
        /// What does not match.
        what: String,
    },
    /// The trace lacks records or payloads a replay needs at all.
    #[error("{path}: {what}")]
    Capture {
        /// The candidate trace.
        path: PathBuf,
        /// What is missing.
        what: String,
    },
    /// A record of the trace is malformed for replay (shape, dtype).
    #[error("{path}: record {record}: {what}")]
    Record {
        /// The candidate trace.
        path: PathBuf,
        /// The record's coordinate.
        record: String,
        /// What is wrong.
        what: String,
    },
    /// Reading a payload failed (corrupted bytes).
    #[error("{path}: reading record {record}")]
    Trace {
        /// The candidate trace.
        path: PathBuf,
        /// The record's coordinate.
        record: String,
        #[source]
        source: moeconf_schema::TraceError,
    },
    /// The reference runtime refused a replayed unit.
    #[error("the reference runtime failed replaying {unit}")]
    Runtime {
        /// The unit (step, layer, half).
        unit: String,
        #[source]
        source: moeconf_reference_runtime::error::RuntimeError,
    },
    /// Computing a record digest failed.
    #[error("digesting the reference's record {record}")]
    Digest {
        /// The record's coordinate.
        record: String,
        #[source]
        source: moeconf_fingerprint::FingerprintError,
    },
}

pub type Result<T> = std::result::Result<T, ReplayError>;
