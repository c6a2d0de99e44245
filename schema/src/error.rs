//! Errors of trace reading and writing.

use std::path::{Path, PathBuf};
use thiserror::Error;

/// Everything that can go wrong reading or writing a trace. Every variant
/// names the file; format errors also name the byte offset.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The operating system refused a read, write or rename. The message
    /// names the file and what was being done; the I/O error is the source
    /// (printed after it by an error chain such as anyhow's `{:#}`, never
    /// repeated in this variant's own text).
    #[error("{}: {what}", path.display())]
    Io {
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not a valid trace: truncated, corrupted or malformed.
    #[error("{}: byte {offset}: {what}", path.display())]
    Format {
        path: PathBuf,
        /// Absolute offset of the offending byte.
        offset: u64,
        /// What is wrong there.
        what: String,
    },
    /// The file is a trace of a format version this build cannot read.
    #[error(
        "{}: trace format version {found} is not supported (this build reads versions 1 to {supported}); \
         upgrade moeconf or re-capture the trace",
        path.display()
    )]
    UnsupportedVersion {
        path: PathBuf,
        /// The version in the file.
        found: u32,
        /// The newest version this build reads and writes.
        supported: u32,
    },
    /// The writer was given something it cannot store (bad shape, duplicate
    /// coordinate, invalid path, a header or record its reader would refuse).
    #[error("{}: {what}", path.display())]
    Invalid {
        /// The trace being written.
        path: PathBuf,
        /// What was rejected.
        what: String,
    },
    /// The output path cannot be written (see [`moeconf_output`]): not a
    /// regular file, a symbolic link, an input of the command, or the write,
    /// flush, sync or rename failed (the temporary file is removed).
    /// (Boxed: it is large and rare, and keeps every `Result<_, TraceError>` small.)
    #[error(transparent)]
    Output(Box<moeconf_output::OutputError>),
    /// The input is not a regular file (a directory, FIFO, socket, device,
    /// or a symbolic link to one or to nothing; see [`moeconf_output::input`]).
    #[error(transparent)]
    Input(Box<moeconf_output::input::InputFileError>),
}

impl From<moeconf_output::OutputError> for TraceError {
    fn from(e: moeconf_output::OutputError) -> TraceError {
        TraceError::Output(Box::new(e))
    }
}

impl TraceError {
    /// The error of opening the input trace `path`: an I/O failure keeps
    /// the reader's wording (`what`), a file of the wrong kind says what it is.
    pub(crate) fn input(what: &'static str, e: moeconf_output::input::InputFileError) -> TraceError {
        let path = e.path().to_path_buf();
        match e.into_io() {
            Ok(source) => TraceError::Io { path, what, source },
            Err(e) => TraceError::Input(Box::new(e)),
        }
    }

    pub(crate) fn format(path: &Path, offset: u64, what: impl Into<String>) -> TraceError {
        TraceError::Format {
            path: path.to_path_buf(),
            offset,
            what: what.into(),
        }
    }

    pub(crate) fn io(path: &Path, what: &'static str, source: std::io::Error) -> TraceError {
        TraceError::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    }

    pub(crate) fn invalid(path: &Path, what: impl Into<String>) -> TraceError {
        TraceError::Invalid {
            path: path.to_path_buf(),
            what: what.into(),
        }
    }

    /// The file the error is about (every variant but an output error
    /// names one here; an output error names its path in its text).
    pub fn path(&self) -> Option<&Path> {
        match self {
            TraceError::Io { path, .. }
            | TraceError::Format { path, .. }
            | TraceError::UnsupportedVersion { path, .. }
            | TraceError::Invalid { path, .. } => Some(path),
            TraceError::Input(e) => Some(e.path()),
            TraceError::Output(_) => None,
        }
    }

    /// The byte offset of a format error, if this is one.
    pub fn offset(&self) -> Option<u64> {
        match self {
            TraceError::Format { offset, .. } => Some(*offset),
            _ => None,
        }
    }
}

/// Errors reading the inputs a trace is built from: a dump directory and its
/// manifest (`moeconf import`), or a checkpoint directory whose identity a
/// binding records. Every variant names the file.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum InputError {
    /// The operating system refused a read or listing. The message says
    /// what and where; the I/O error is the source.
    #[error("{context}")]
    Io {
        /// What was being done, naming the file.
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The input is malformed or inconsistent (the message names the file
    /// and what is wrong).
    #[error("{0}")]
    Invalid(String),
    /// Writing the trace failed.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// An input (the manifest, a dump file, a model file, the tokenizer
    /// file) is not a regular file, or cannot be opened or read.
    #[error(transparent)]
    File(#[from] moeconf_output::input::InputFileError),
}

#[cfg(feature = "checkpoint")]
impl InputError {
    /// An I/O error with its context.
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> InputError {
        let context = context.into();
        move |source| InputError::Io { context, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    /// The texts of `e` and of each of its sources, outermost first.
    fn chain(e: &dyn Error) -> Vec<String> {
        let mut out = vec![e.to_string()];
        let mut src = e.source();
        while let Some(s) = src {
            out.push(s.to_string());
            src = s.source();
        }
        out
    }

    /// No error of the chain repeats the text of one of its sources, so a
    /// chain printed as `a: b: c` (anyhow's `{:#}`) says everything once.
    fn assert_no_repetition(e: &dyn Error) {
        let parts = chain(e);
        for (i, p) in parts.iter().enumerate() {
            for q in &parts[i + 1..] {
                assert!(
                    !p.contains(q.as_str()),
                    "{p:?} repeats its source {q:?} (chain {parts:?})"
                );
            }
        }
    }

    #[test]
    fn io_errors_name_file_and_action_once_and_keep_the_os_error_as_source() {
        let missing = Path::new("/nonexistent-moeconf-dir/x.bin");
        let e = crate::Trace::open(missing).err().expect("missing file");
        assert_no_repetition(&e);
        let parts = chain(&e);
        assert_eq!(parts.len(), 2, "{parts:?}");
        assert_eq!(parts[0], "/nonexistent-moeconf-dir/x.bin: opening trace");
        assert!(e.source().is_some_and(|s| s.is::<std::io::Error>()));
        let input = InputError::from(e);
        assert_no_repetition(&input);
        let io = InputError::Io {
            context: "reading dumps/manifest.json".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert_no_repetition(&io);
    }
}
