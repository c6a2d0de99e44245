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
//! * [`moeconf_output`] is the one way any moeconf command writes a file: outputs
//!   checked before work starts, temporary files that never outlive an
//!   error, normal file modes.
//! * [`Trace`] opens a file of either container version, validates it and
//!   exposes the fingerprint tree ([`Trace::steps`], [`Trace::step`],
//!   [`Trace::group_records`]), the records and their payloads; a version 2
//!   file is read node by node, each verified against its parent, as the
//!   tree is descended ([`nodes`], [`v2`]); a version 4 file's large groups
//!   page by page ([`Trace::group_pages`], [`Trace::group_page_entries`]).
//!
//! The run → trace → diff flow: the reference runtime (or a backend's capture
//! hooks) writes a trace with [`TraceWriter`] (format version 4 by default,
//! streaming the tree to disk step by step); `moeconf diff` opens two with
//! [`Trace::open_for`] and walks their trees.
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
//! // Descend the tree: step 0, level L0, the model-global group.
//! let group = t.step(0).unwrap().unwrap().level(Level::L0).unwrap().group(None).unwrap();
//! let records = t.group_records(group).unwrap();
//! assert_eq!(t.record(records[0]).coord.path, "token.output");
//! assert_eq!(t.payload_verified(records[0]).unwrap(), Some(&ids[..]));
//! ```

mod binding;
mod completeness;
pub mod convert;
mod error;
mod group_stream;
#[cfg(feature = "checkpoint")]
mod identity;
#[cfg(feature = "checkpoint")]
pub mod import;
pub mod inspect;
pub mod layout;
pub mod nodes;
mod reader;
pub mod recomputed;
mod steprefs;
pub mod v2;
mod writer;

pub use binding::{
    weights_digest, Binding, CaptureSpec, Decoding, ModelIdentity, PromptBinding, Provenance, TensorDigest,
    TokenizerIdentity, MAX_STRING,
};
pub use completeness::Completeness;
pub use error::{InputError, TraceError};
#[cfg(feature = "checkpoint")]
pub use identity::model_identity;
pub use layout::{Header, IndexEntry, PayloadRef, FORMAT_V1, FORMAT_VERSION};
pub use nodes::{GroupNode, GroupRecords, HeldRecord, LevelNode, StepNode, StepSummary};
pub use reader::{Trace, Verification, VerifySummary};
pub use recomputed::{Recomputed, RECOMPUTED_NOTE};
pub use writer::{BatchRecord, TraceWriter, WriteSummary, DEFAULT_FORMAT_VERSION};

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
            // The lazy paths first (version 2 reads nodes on use; version 3
            // takes level sets from the root block), then every byte.
            let _ = t.held_levels();
            let _ = t.levels_by_step(0..t.steps().len());
            for s in t.steps().to_vec() {
                if let Ok(Some(node)) = t.step(s.step) {
                    for g in node.levels.iter().flat_map(|l| &l.groups) {
                        // Version 4: a paged group's pages one at a time first.
                        if let Ok(Some(cvs)) = t.group_pages(g) {
                            for j in 0..cvs.len() as u64 {
                                let _ = t.group_page_entries(g, &[j]);
                            }
                        }
                        if let Ok(ids) = t.group_records(g) {
                            for &i in ids {
                                let _ = t.payload_verified(i);
                            }
                        }
                    }
                }
            }
            let _ = t.verify_payloads();
            if let Ok(records) = t.records() {
                for i in 0..records.len() {
                    let _ = t.payload_verified(i);
                }
            }
        }
    };
    read(bytes.to_vec());
    if let Some(fixed) = layout::with_recomputed_checksum(bytes) {
        read(fixed);
    }
}
