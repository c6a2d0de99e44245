//! The calibration suite's error type.

use std::path::PathBuf;

use moeconf_bisect::BisectError;
use moeconf_contract::ContractError;
use moeconf_reference_runtime::error::RuntimeError;
use moeconf_runner::{Field, FieldMessage, RunError};
use moeconf_schema::{InputError, TraceError};

/// Everything that can stop a calibration protocol or the sweep report.
/// Messages name the option, file or record concerned; a variant with a
/// source never repeats the source's text (anyhow's `{:#}` chain prints it).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CalibrateError {
    /// An option or precondition rules the run out (the message names it).
    #[error("{0}")]
    Invalid(String),
    /// A record the protocol needs was not captured (the message names it
    /// and where it was expected).
    #[error("{0}")]
    MissingRecord(String),
    /// Reading or writing a file failed.
    #[error("{context}")]
    Io {
        /// What was being done, naming the file.
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// A trace the protocol wrote could not be read back. The source (a
    /// [`TraceError`]) names the file, so the message does not repeat it.
    #[error("reading back a trace the protocol wrote")]
    Open {
        path: PathBuf,
        /// Why it could not be opened.
        #[source]
        source: TraceError,
    },
    /// A protocol of the suite failed.
    #[error("protocol {name}")]
    Protocol {
        /// The protocol's key (e.g. `fork_sweep`).
        name: &'static str,
        #[source]
        source: Box<CalibrateError>,
    },
    /// A scheme or branch of the sweep, or the protocol selection, is
    /// invalid; the message names it as a [`moeconf_runner::Field`], which
    /// a front end renders by its own option name
    /// ([`CalibrateError::render_fields`]).
    #[error("{0}")]
    Field(FieldMessage),
    /// A scheme or branch of the sweep is invalid.
    #[error("{option}")]
    Option {
        /// The field and the value given (e.g. branch `"b+x"`).
        option: FieldMessage,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The reference runtime failed (loading, tokenizing, a forward step, the sweep).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// Running the runtime into a trace failed.
    #[error(transparent)]
    Run(#[from] RunError),
    /// Reading or writing a trace failed.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// An output file (a table, `calibration.json`, a sweep report) cannot
    /// be written; the error names the file.
    #[error(transparent)]
    Output(#[from] moeconf_output::OutputError),
    /// The model directory could not be identified.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The diff engine refused a pair of traces.
    #[error(transparent)]
    Diff(#[from] BisectError),
    /// A JSON document could not be serialized.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A contract, order or class could not be built or applied.
    #[error(transparent)]
    Contract(#[from] ContractError),
    /// A shard specification, partial result file or merge was refused.
    #[error(transparent)]
    Shard(#[from] moeconf_shard::ShardError),
    /// Verified partial results whose contents this moeconf cannot rebuild
    /// outputs from (a result of the wrong form, a job list that does not
    /// match the arguments).
    #[error("merging partial results: {0}")]
    Merge(String),
}

impl CalibrateError {
    /// The message with every [`Field`] named by `name` (the binary passes
    /// its flags), for the variants that name fields (their own or a run's);
    /// `None` for the others.
    pub fn render_fields(&self, name: impl Fn(Field) -> String) -> Option<String> {
        match self {
            CalibrateError::Field(m) | CalibrateError::Option { option: m, .. } => Some(m.render(name)),
            CalibrateError::Run(r) => r.render_fields(name),
            _ => None,
        }
    }

    /// An I/O error with its context.
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> CalibrateError {
        let context = context.into();
        move |source| CalibrateError::Io { context, source }
    }

    /// An invalid sweep option, keeping what is wrong with it as the source.
    pub(crate) fn option<E>(option: FieldMessage) -> impl FnOnce(E) -> CalibrateError
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        move |e| CalibrateError::Option {
            option,
            source: Box::new(e),
        }
    }
}

pub type Result<T, E = CalibrateError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// The error and its sources joined as anyhow's `{:#}` prints them.
    fn chain(e: &dyn std::error::Error) -> String {
        let mut s = e.to_string();
        let mut src = e.source();
        while let Some(c) = src {
            s.push_str(": ");
            s.push_str(&c.to_string());
            src = c.source();
        }
        s
    }

    #[test]
    fn a_trace_that_cannot_be_read_back_is_named_once() {
        let path = PathBuf::from("/nonexistent-moeconf/replay-x-a.bin");
        let source = moeconf_schema::Trace::open(&path).err().expect("missing file");
        let msg = chain(&CalibrateError::Open { path, source });
        assert_eq!(msg.matches("replay-x-a.bin").count(), 1, "{msg}");
        assert_eq!(msg.matches("(os error 2)").count(), 1, "{msg}");
    }
}
