//! The runtime's error type: every failure names the file, tensor or key
//! concerned and what is wrong, so a bad checkpoint is diagnosed without a panic.
//! A variant's message never repeats its `#[source]` (printers such as
//! anyhow's `{:#}` append the source chain themselves).

use std::path::PathBuf;

/// Every failure of loading a model or running it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// An I/O operation on a file failed.
    #[error("cannot {what} {}", path.display())]
    Io {
        path: PathBuf,
        /// The operation, as a verb phrase (`read`, `open`, `memory-map`, ...).
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A model file is not what it must be: not a regular file (a directory,
    /// FIFO, device, socket), over its size limit, or missing.
    #[error("{}: {message}", path.display())]
    File {
        path: PathBuf,
        /// What is wrong, e.g. `is a directory, expected a safetensors file`.
        message: String,
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
    /// An operator produced a NaN or an infinity: the run is invalid (the
    /// first such value in execution order; see [`crate::model::StepOptions`]).
    #[error(
        "non-finite value {value} at step {step}, {}, position {position}, operator `{path}` (element {index})",
        layer.map_or_else(|| "model-global".to_string(), |l| format!("layer {l}"))
    )]
    NonFinite {
        /// Forward step.
        step: u32,
        /// Decoder layer (`None` for model-global records such as `lm.logits`).
        layer: Option<u32>,
        /// Absolute token position.
        position: u32,
        /// The record path of the operator output (catalogue path).
        path: String,
        /// Index of the first non-finite element in the output.
        index: usize,
        /// That element (NaN, inf or -inf).
        value: f32,
    },
    /// The capture sink refused a record.
    #[error("capture sink failed")]
    Capture(#[from] crate::capture::CaptureError),
}
