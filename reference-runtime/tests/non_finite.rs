//! A run is valid or it is an error: a NaN or infinity in an operator output,
//! in the persistent state or in the logits fails the step with
//! `RuntimeError::NonFinite` naming the first such value in execution order
//! — whatever the sink captures — unless the step allows non-finite values.

mod common;

use std::path::{Path, PathBuf};

use common::{fixture_dir, prompt};
use moeconf_contract::NativeCombine;
use moeconf_reference_runtime::capture::{MemorySink, NullSink};
use moeconf_reference_runtime::error::RuntimeError;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::Model;
use moeconf_reference_runtime::precision::Precision;

/// A copy of the fixture in `dir` whose tensor `name` holds only `bits`
/// (a BF16 bit pattern).
fn poisoned(dir: &Path, name: &str, bits: u16) -> PathBuf {
    let src = fixture_dir();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let (start, len) = {
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::BF16);
        (
            t.data().as_ptr() as usize - bytes.as_ptr() as usize,
            t.data().len(),
        )
    };
    for c in bytes[start..start + len].chunks_exact_mut(2) {
        c.copy_from_slice(&bits.to_le_bytes());
    }
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    dir.to_path_buf()
}

fn opts(allow: bool) -> GenerateOptions<'static> {
    GenerateOptions {
        max_new_tokens: 3,
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: allow,
    }
}

/// (step, layer, position, path) of a NonFinite error.
fn where_(e: RuntimeError) -> (u32, Option<u32>, u32, String) {
    match e {
        RuntimeError::NonFinite {
            step,
            layer,
            position,
            path,
            value,
            ..
        } => {
            assert!(!value.is_finite());
            (step, layer, position, path)
        }
        other => panic!("expected NonFinite, got {other}"),
    }
}

#[test]
fn first_non_finite_operator_output_is_named_whatever_is_captured() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::load(&poisoned(dir.path(), "layers.3.ffn_norm.weight", 0x7fc0)).unwrap();
    let ids = prompt(1, 4);
    let expected = (0, Some(3), 0, "ffn.norm".to_string());
    let e = m.generate(&ids, &opts(false), &mut NullSink).unwrap_err();
    assert_eq!(where_(e), expected);
    let mut sink = MemorySink::all();
    let e = m.generate(&ids, &opts(false), &mut sink).unwrap_err();
    assert_eq!(where_(e), expected);
    // Nothing at or after the bad output was recorded.
    assert!(sink
        .records
        .iter()
        .all(|r| !(r.coord.layer == Some(3) && r.coord.path == "ffn.norm")));

    // Allowed: the run completes and records the NaN values.
    let mut sink = MemorySink::all();
    let g = m.generate(&ids, &opts(true), &mut sink).unwrap();
    assert_eq!(g.tokens.len(), 3);
    let norm = sink
        .by_path("ffn.norm")
        .find(|r| r.coord.layer == Some(3))
        .unwrap();
    assert!(norm.f32s().iter().all(|v| v.is_nan()));
}

#[test]
fn non_finite_state_is_named_where_it_is_buffered() {
    // An infinite compressor gate projection: the open-window buffer (state)
    // is the first non-finite value, before any entry is emitted.
    let dir = tempfile::tempdir().unwrap();
    let m = Model::load(&poisoned(
        dir.path(),
        "layers.2.attn.compressor.wgate.weight",
        0x7f80,
    ))
    .unwrap();
    let e = m
        .generate(&prompt(2, 3), &opts(false), &mut NullSink)
        .unwrap_err();
    assert_eq!(
        where_(e),
        (0, Some(2), 0, "state.compressor.buffer_gate".to_string())
    );
}

#[test]
fn valid_runs_are_unchanged_by_the_check() {
    // The fixture itself is finite everywhere: checking and not checking give
    // the same records.
    let m = common::fixture_model();
    let ids = prompt(3, 6);
    let (mut a, mut b) = (MemorySink::all(), MemorySink::all());
    m.generate(&ids, &opts(false), &mut a).unwrap();
    m.generate(&ids, &opts(true), &mut b).unwrap();
    assert_eq!(a.records, b.records);
}
