//! This crate provides the canonical bytes and digests behind every moeconf
//! fingerprint: tensor identity ([`Coord`], [`Level`], [`DType`]), value
//! canonicalization ([`CanonPolicy`]), domain-separated record digests over
//! BLAKE3-256 or SHA-256 ([`Algorithm`]), and the [`HashTree`] that lets a
//! comparison descend only into differing subtrees.
//!
//! # Brief overview
//!
//! * [`Coord`] names one recorded tensor: step, position, phase, layer, path.
//! * [`record_digest`] hashes a [`TensorView`] in canonical form.
//! * [`HashTree::build`] folds record digests into step, level and layer nodes.
//! * [`wire`] is the bincode-1-compatible encoding used for every preimage.
//!
//! The run → trace → diff flow lives in the other crates: the reference
//! runtime produces tensors, `moeconf-schema` stores them with these digests,
//! and `moeconf-bisect` walks two trees.
//!
//! ```
//! use moeconf_fingerprint::{record_digest, Algorithm, CanonPolicy, Coord, DType, Level, Phase, TensorView};
//! let coord = Coord { step: 1, position: 3, phase: Phase::Decode, layer: Some(5), path: "moe.combine".into() };
//! let bytes: Vec<u8> = [1.0f32, -0.0, f32::NAN].iter().flat_map(|v| v.to_le_bytes()).collect();
//! let t = TensorView { dtype: DType::F32, shape: &[3], bytes: &bytes };
//! let d = record_digest(Algorithm::Blake3, CanonPolicy::default(), &coord, Level::L4, t).unwrap();
//! assert_eq!(d.to_hex().len(), 64);
//! ```
#![deny(unsafe_op_in_unsafe_fn)]

mod algorithm;
pub mod blake3_tree;
mod canonical;
pub mod catalogue;
mod coord;
mod dtype;
pub mod group_pages;
pub mod incremental;
mod lanes;
mod record;
pub mod streaming;
mod tree;
pub mod wire;

pub use algorithm::{hex_decode, hex_encode, Algorithm, Digest, StreamHasher, PARALLEL_HASH_THRESHOLD};
pub use canonical::{
    canonical_bf16_bits, canonical_f32_bits, canonical_f64_bits, canonicalize_in_place, is_canonical,
    surely_canonical, CanonPolicy, CANONICAL_NAN_BF16, CANONICAL_NAN_F32, CANONICAL_NAN_F64,
};
pub use catalogue::{Component, Half};
pub use coord::{Coord, Interner, Level, LevelSet, Phase, RecordPath, MAX_PATH_LEN};
pub use dtype::{bf16_to_f32, f16_to_f32, DType};
pub use record::{
    feed_canonical, record_digest, record_digest_with_sink, record_digests_in_place, record_prefix,
    FingerprintError, RecordRef, TensorView, BATCH_MAX_BYTES, DOMAIN_RECORD, MAX_RANK, PREIMAGE_ALIGN,
};
pub use tree::{
    binding_digest, group_digest, group_prefix, level_digest, root_digest, step_digest, GroupNode, HashTree,
    Leaf, LevelNode, RootHasher, StepNode, DOMAIN_BINDING, DOMAIN_GROUP, DOMAIN_LEVEL, DOMAIN_ROOT,
    DOMAIN_STEP,
};
