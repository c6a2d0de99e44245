//! This crate provides the moeconf trace: the data model of one captured
//! model execution (binding, coordinates, records), its canonical
//! serialization contract and the container file that holds it.
//!
//! # Brief overview
//!
//! * [`Binding`] says what the trace is of (model, tokenizer, prompt,
//!   decoding, precision, contract, schedule, capture, canonicalization);
//!   [`Provenance`] says who produced it.
//! * [`TraceWriter`] appends records as a runtime produces them and writes the
//!   file atomically, refusing anything its reader would refuse.
//! * [`output`] is the one way any moeconf command writes a file: outputs
//!   checked before work starts, temporary files that never outlive an
//!   error, normal file modes.
//! * [`Trace`] opens a file, validates every field of it and exposes the
//!   records, payloads and fingerprint [`HashTree`](moeconf_fingerprint::HashTree).
//!
//! The run → trace → diff flow: the reference runtime (or a backend's capture
//! hooks) writes a trace with [`TraceWriter`]; `moeconf diff` opens two with
//! [`Trace::open`] and walks their trees.
//!
//! The normative byte layout is docs/format.md.
//!
//! ```
//! use moeconf_schema::{Binding, Header, Trace, TraceWriter};
//! use moeconf_fingerprint::{Algorithm, Coord, DType, Level, Phase, TensorView};
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("t.bin");
//! let mut header = Header::default();
//! header.binding.decoding.max_new_tokens = 1; // steps 0..1
//! let mut w = TraceWriter::create(&path, Algorithm::Blake3, header).unwrap();
//! let ids = 42i32.to_le_bytes();
//! let coord = Coord { step: 0, position: 0, phase: Phase::Prefill, layer: None, path: "token.output".into() };
//! w.append(coord, Level::L0, TensorView { dtype: DType::I32, shape: &[1], bytes: &ids }, true).unwrap();
//! let summary = w.finish().unwrap();
//! let t = Trace::open(&path).unwrap();
//! assert_eq!(t.root(), summary.root);
//! assert_eq!(t.payload_verified(0).unwrap(), Some(&ids[..]));
//! ```
#![deny(missing_docs)]

mod binding;
mod error;
#[cfg(feature = "checkpoint")]
mod identity;
#[cfg(feature = "checkpoint")]
pub mod import;
pub mod inspect;
pub mod layout;
pub mod output;
mod reader;
pub mod recomputed;
mod writer;

pub use binding::{
    weights_digest, Binding, CaptureSpec, Decoding, ModelIdentity, PromptBinding, Provenance, TensorDigest,
    TokenizerIdentity, MAX_STRING,
};
pub use error::{InputError, TraceError};
#[cfg(feature = "checkpoint")]
pub use identity::model_identity;
pub use layout::{Header, IndexEntry, PayloadRef, FORMAT_VERSION};
pub use output::{check_output, check_outputs, CheckedOutput, Inputs, OutputError};
pub use reader::{Trace, VerifySummary};
pub use recomputed::{Recomputed, RECOMPUTED_NOTE};
pub use writer::{TraceWriter, WriteSummary};

/// Records of at most this many bytes keep their payload whatever the
/// capture spec says (token ids, margins, top-k lists, router selections,
/// counters), so that even a fingerprint-only trace can be explained.
pub const SMALL_RECORD_BYTES: usize = 256;

/// Parses and fully verifies arbitrary bytes as a trace, discarding the
/// result: the body of the `cargo fuzz` target and of the mutation test.
/// Undocumented and unstable; exists only for fuzzing.
///
/// Each input is read twice: as given, and with its trailer checksum
/// recomputed over the mutated bytes, so that mutations of the header and
/// index get past the checksum and exercise the decoders behind it.
#[doc(hidden)]
pub fn fuzz_read(bytes: &[u8]) {
    let read = |b: Vec<u8>| {
        if let Ok(t) = Trace::from_bytes(std::path::Path::new("fuzz.bin"), b) {
            let _ = t.verify_payloads();
            for i in 0..t.records().len() {
                let _ = t.payload_verified(i);
            }
        }
    };
    read(bytes.to_vec());
    if let Some(fixed) = layout::with_recomputed_checksum(bytes) {
        read(fixed);
    }
}
