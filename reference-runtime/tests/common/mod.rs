//! Shared helpers of the runtime's integration tests: the fixture checkpoint
//! generated once per test binary, prompts given as token ids (the tests do not
//! depend on the tokenizer), and an FP32 combine for the f32 profile.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use moeconf_contract::{CombineEvent, MoeCombine};
use moeconf_fingerprint::{record_digest, Algorithm, CanonPolicy};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::model::Model;

/// The tiny-v4 fixture, materialized once under cargo's per-target temporary
/// directory (`CARGO_TARGET_TMPDIR`) and reused by every test binary and run
/// (the folder name carries the generator version, so a generator change
/// makes a new one).
pub fn fixture_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("moeconf-fixtures");
        moeconf_fixtures::ensure_tiny_v4_in(&root).expect("materialize the tiny-v4 fixture")
    })
    .clone()
}

/// The loaded fixture model.
pub fn fixture_model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::load(&fixture_dir()).expect("load fixture"))
}

/// Deterministic prompt ids: `len` ids derived from `seed` (within the vocabulary).
pub fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| (i * 37 + seed * 101 + 5) % 1024).collect()
}

/// FP32 combine for the f32 profile: `y = ((0 + v_0) + … + v_{k−1}) + s`, no rounding.
pub struct F32Combine;

impl MoeCombine for F32Combine {
    fn combine(&self, _e: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for t in terms {
                acc += t[i];
            }
            *o = acc + shared[i];
        }
    }
    fn describe(&self) -> String {
        "test-f32".into()
    }
}

/// Hex record digests of every captured record, in order.
pub fn digests(sink: &MemorySink) -> Vec<String> {
    sink.records
        .iter()
        .map(|r| {
            record_digest(
                Algorithm::Blake3,
                CanonPolicy::default(),
                &r.coord,
                r.level,
                r.view(),
            )
            .unwrap()
            .to_hex()
        })
        .collect()
}

/// A BLAKE3 digest of the raw trace content, independent of the fingerprint
/// crate's record format (so it can be pinned): for each record in order,
/// `path ‖ 0x00 ‖ step ‖ position ‖ layer (u32::MAX for none) ‖ level code ‖
/// dtype code ‖ rank ‖ dims (u64) ‖ byte length (u64) ‖ bytes`, integers little-endian.
pub fn trace_digest(sink: &MemorySink) -> String {
    let mut h = blake3::Hasher::new();
    for r in &sink.records {
        h.update(r.coord.path.as_bytes());
        h.update(&[0]);
        h.update(&r.coord.step.to_le_bytes());
        h.update(&r.coord.position.to_le_bytes());
        h.update(&r.coord.layer.unwrap_or(u32::MAX).to_le_bytes());
        h.update(&r.level.code().to_le_bytes());
        h.update(&(r.dtype as u32).to_le_bytes());
        h.update(&(r.shape.len() as u32).to_le_bytes());
        for d in &r.shape {
            h.update(&d.to_le_bytes());
        }
        h.update(&(r.bytes.len() as u64).to_le_bytes());
        h.update(&r.bytes);
    }
    h.finalize().to_hex().to_string()
}
