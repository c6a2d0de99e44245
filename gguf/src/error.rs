//! Every failure of the crate; each names the file (and the tensor or key) it concerns.

use std::path::PathBuf;

/// Errors of GGUF writing, reading, export and verification.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file concerned.
        path: PathBuf,
        source: std::io::Error,
    },
    /// An input is not a regular file: a directory, FIFO, socket, device,
    /// or a symbolic link to one or to nothing (never opened, so never
    /// blocked on). Boxed: large and rare.
    #[error(transparent)]
    Input(Box<moeconf_output::InputFileError>),
    /// A GGUF file is not well-formed.
    #[error("{}: byte {offset}: {message}", path.display())]
    Malformed {
        path: PathBuf,
        /// Byte offset where the problem was found.
        offset: u64,
        /// What is wrong.
        message: String,
    },
    /// A checkpoint tensor is missing, mis-shaped, of an unsupported dtype, or not exactly
    /// representable in the requested GGUF type.
    #[error("{}: tensor {tensor}: {message}", path.display())]
    Tensor {
        /// The checkpoint file or directory.
        path: PathBuf,
        /// The tensor's checkpoint name.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// The checkpoint's config or tokenizer cannot be exported to llama.cpp's `deepseek4`.
    #[error("{0}")]
    Unsupported(String),
    /// A GGUF does not hold what the export of the checkpoint would hold (verification).
    #[error("{0}")]
    Mismatch(String),
    /// Any other inconsistency (with its own context in the message).
    #[error("{0}")]
    Invalid(String),
    /// Loading the checkpoint's config through the reference runtime failed.
    #[error(transparent)]
    Runtime(#[from] moeconf_reference_runtime::error::RuntimeError),
    /// The output file is refused (an input of the command, a directory, a symbolic link, a
    /// missing directory) or could not be committed.
    #[error("{0}")]
    Output(String),
    /// Computing the checkpoint's identity failed.
    #[error("{0}")]
    Identity(String),
}

impl From<moeconf_output::InputFileError> for GgufError {
    /// An I/O failure as [`GgufError::Io`], a file of the wrong kind as it is.
    fn from(e: moeconf_output::InputFileError) -> GgufError {
        let path = e.path().to_path_buf();
        match e.into_io() {
            Ok(source) => GgufError::Io { path, source },
            Err(e) => GgufError::Input(Box::new(e)),
        }
    }
}
