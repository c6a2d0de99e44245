//! Errors of sharding, partial result files and merging. Every variant
//! about a file names it.

use std::path::PathBuf;

use thiserror::Error;

/// Why a shard specification, a partial result file or a merge is refused.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ShardError {
    /// A malformed `--shard I/N`.
    #[error("--shard {0}")]
    Spec(String),
    /// The operating system refused a read or write.
    #[error("{}: {what}", path.display())]
    Io {
        path: PathBuf,
        /// What was being done.
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// An input is not a regular file: a directory, FIFO, socket, device,
    /// or a symbolic link to one or to nothing (never opened, so never
    /// blocked on). Boxed: large and rare.
    #[error(transparent)]
    Input(Box<moeconf_output::InputFileError>),
    /// The file does not start like a partial result file.
    #[error(
        "{}: not a moeconf partial result file (written by `moeconf sweep|calibrate --shard I/N`): {detail}",
        path.display()
    )]
    NotPartial {
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The contents do not match their digest (a flipped byte, a truncated copy).
    #[error("{}: corrupted partial result: {detail}", path.display())]
    Corrupt {
        path: PathBuf,
        /// Which digest or length disagrees.
        detail: String,
    },
    /// Intact bytes, but a manifest that breaks the format's rules.
    #[error("{}: invalid partial result: {detail}", path.display())]
    Invalid {
        path: PathBuf,
        /// The broken rule.
        detail: String,
    },
    /// Partial results of different runs (arguments, inputs, versions, shard counts).
    #[error(
        "{} and {} are partial results of different runs: {what}; only the shards of one run \
         (same command, arguments, inputs, moeconf version and shard count) can be merged",
        a.display(),
        b.display()
    )]
    DifferentRuns {
        /// The first partial.
        a: PathBuf,
        /// The partial that differs from it.
        b: PathBuf,
        /// The first field that differs, with both values.
        what: String,
    },
    /// The same shard given twice.
    #[error("shard {shard} is given twice: {} and {}", a.display(), b.display())]
    DuplicateShard {
        /// The shard, `i/n`.
        shard: String,
        /// One file.
        a: PathBuf,
        /// The other.
        b: PathBuf,
    },
    /// Some shards of the run are not given.
    #[error("missing shard{} {missing} of {count}: every shard 0..{} of the run is needed", if *several { "s" } else { "" }, count - 1)]
    MissingShards {
        /// The missing shards, `i/n, ...`.
        missing: String,
        /// Whether more than one is missing.
        several: bool,
        /// The run's shard count.
        count: u32,
    },
    #[error("nothing to merge: give the partial result files of every shard")]
    NoPartials,
    /// One output file attached by two partials.
    #[error("{name} is attached by both {} and {}", a.display(), b.display())]
    DuplicateFile {
        /// The file's name in the output.
        name: String,
        /// One partial.
        a: PathBuf,
        /// The other.
        b: PathBuf,
    },
    /// Writing an output was refused (`moeconf_output`).
    #[error(transparent)]
    Output(#[from] moeconf_output::OutputError),
}

impl ShardError {
    /// An I/O error on `path` while doing `what`.
    pub fn io(path: &std::path::Path, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ShardError {
        let (path, what) = (path.to_path_buf(), what.into());
        move |source| ShardError::Io { path, what, source }
    }

    /// The error of opening the input `path` (schema's checked open): an
    /// I/O failure in the caller's words (`what`), a file of the wrong kind
    /// (a directory, FIFO, device, or a link to one) as it is.
    pub fn input(what: impl Into<String>) -> impl FnOnce(moeconf_output::InputFileError) -> ShardError {
        let what = what.into();
        move |e| {
            let path = e.path().to_path_buf();
            match e.into_io() {
                Ok(source) => ShardError::Io { path, what, source },
                Err(e) => ShardError::Input(Box::new(e)),
            }
        }
    }
}

pub type Result<T> = std::result::Result<T, ShardError>;
