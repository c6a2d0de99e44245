//! Errors of report rendering.

use std::path::PathBuf;

/// Why a report could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A payload needed for a chart failed verification or could not be read.
    #[error("{path}: cannot read the payload of record {record}")]
    Payload {
        /// The trace.
        path: PathBuf,
        /// The record's index.
        record: usize,
        /// The reader's error.
        #[source]
        source: moeconf_schema::TraceError,
    },
    /// A trace's index could not be read or verified.
    #[error(transparent)]
    Trace(#[from] moeconf_schema::TraceError),
}
