//! The runtime's error type: every failure names the file, tensor or key
//! concerned and what is wrong, so a bad checkpoint is diagnosed without a panic.

use std::path::PathBuf;

/// Every failure of loading a model or running it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// Reading a file failed. The message names the file; the I/O error is
    /// the source (printed after it by an error chain, not repeated here).
    #[error("{}", path.display())]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` is malformed, misses a key or holds an unsupported value.
    #[error("{}: {message}", path.display())]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong, naming the key.
        message: String,
    },
    /// The safetensors file cannot be parsed.
    #[error("{}: malformed safetensors file: {message}", path.display())]
    Safetensors {
        /// The weights file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A tensor is missing, unexpected, mis-shaped or of an unsupported dtype.
    #[error("{}: tensor `{tensor}`: {message}", path.display())]
    Tensor {
        /// The weights file (or directory when the tensor is missing).
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// What is wrong (expected and got).
        message: String,
    },
    /// The tokenizer file cannot be loaded or used.
    #[error("{}: tokenizer: {message}", path.display())]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The `tokenizers` crate's message.
        message: String,
    },
    /// The caller's input is invalid (empty prompt, token id out of range, ...).
    #[error("invalid input: {0}")]
    Input(String),
    /// The capture sink refused a record (its message is the source).
    #[error("capture")]
    Capture(#[from] crate::capture::CaptureError),
}
