//! GGUF, the model file of llama.cpp and ggml, for moeconf: a writer ([`write`]), a
//! bounds-checked reader ([`read`]), the ggml tensor types with their exact dequantization
//! ([`ggml`]), and the export of a DeepSeek-V4 checkpoint to llama.cpp's `deepseek4`
//! architecture ([`deepseek4`], [`tokenizer`], [`export`]) — from the same weights the
//! reference runtime runs, verified bit for bit by reading the file back.
//!
//! Why it exists: to compare llama.cpp with the reference runtime, both must run exactly the
//! same weights. `moeconf export gguf` writes the GGUF llama.cpp loads from the checkpoint
//! the reference loads, and [`export::verify`] proves that every dequantized GGUF value equals
//! the reference's value (docs/interop-llamacpp.md §2).

pub mod deepseek4;
pub mod error;
pub mod export;
pub mod ggml;
pub mod read;
pub mod source;
pub mod tokenizer;
pub mod value;
pub mod write;

pub use deepseek4::ExportType;
pub use error::GgufError;
pub use export::{export, verify, ExportSummary};
pub use ggml::GgmlType;
pub use read::GgufFile;
pub use value::Value;
