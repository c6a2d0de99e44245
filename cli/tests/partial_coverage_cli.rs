//! `moeconf diff` on a llama.cpp-like candidate (issue 17, item 3): a trace that lacks
//! the records llama.cpp's capture cannot observe (the attention reads happen inside
//! fused kernels; python/moeconf/llamacpp.py `NOT_CAPTURED`), says so in its
//! `moeconf.not_captured` note, and departs from the reference at a decode step's
//! `attn.core`. Localization must end at that record (the finest level both traces
//! captured there), say so, and name the records that would be needed to go further,
//! with the reason the capture gives; with those records present the same difference
//! is localized to the operator itself.

use moeconf_fingerprint::{DType, TensorView};
use moeconf_schema::{Header, Trace, TraceWriter};
use std::path::Path;
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

/// What the llama.cpp capture does not record (python/moeconf/llamacpp.py `NOT_CAPTURED`).
const NOT_CAPTURED: &[(&str, &str)] = &[
    (
        "attn.window_read",
        "the sliding-window cache is read inside the attention graph",
    ),
    (
        "attn.compressed_read",
        "compressed entries are read through a mask",
    ),
    ("attn.indexer_read", "indexer keys are stored Hadamard-rotated"),
    (
        "state.compressor.buffer_gate",
        "the compressor state stores gate + ape",
    ),
    (
        "state.indexer.buffer_gate",
        "the indexer compressor state stores gate + ape",
    ),
    (
        "state.indexer.compressed_kv",
        "indexer entries are stored Hadamard-rotated",
    ),
];

fn moeconf(args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("MOECONF_") {
            c.env_remove(k);
        }
    }
    c.output().unwrap()
}

/// A copy of the reference trace `src` as a llama.cpp-like capture: every f32 value from
/// step 1's first `attn.core` on has its lowest bf16 mantissa bit flipped (bit 16: the
/// reference's bf16 values move by one bf16 ulp) (a difference that
/// starts at that operator and propagates), and, with `partial`, the records of
/// [`NOT_CAPTURED`] are left out and listed in the provenance note.
fn candidate(src: &Path, dst: &Path, partial: bool) {
    let t = Trace::open_verified(src).unwrap();
    let mut header = Header {
        binding: t.binding().clone(),
        provenance: t.provenance().clone(),
    };
    header.provenance.runtime = "llama.cpp-like".into();
    if partial {
        let note = NOT_CAPTURED
            .iter()
            .map(|(p, why)| format!("{p}: {why}"))
            .collect::<Vec<_>>()
            .join("; ");
        header
            .provenance
            .notes
            .push(("moeconf.not_captured".into(), note));
    }
    let records = t.records().unwrap();
    let start = records
        .iter()
        .position(|e| e.coord.step == 1 && e.coord.path == "attn.core")
        .expect("a decode step's attn.core in the reference");
    let mut w = TraceWriter::create(dst, t.algorithm(), header).unwrap();
    for (i, e) in records.iter().enumerate() {
        if partial && NOT_CAPTURED.iter().any(|(p, _)| *p == e.coord.path) {
            continue;
        }
        let bytes = t.payload_verified(i).unwrap().expect("a --capture all trace");
        let owned: Vec<u8>;
        let bytes = if i >= start && e.dtype == DType::F32 {
            owned = bytes
                .chunks_exact(4)
                .flat_map(|c| (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) ^ 0x1_0000).to_le_bytes())
                .collect();
            &owned[..]
        } else {
            bytes
        };
        let view = TensorView {
            dtype: e.dtype,
            shape: &e.shape,
            bytes,
        };
        w.append(e.coord.clone(), e.level, view, true).unwrap();
    }
    w.finish().unwrap();
}

fn diff(reference: &Path, cand: &Path, format: &str) -> String {
    let o = moeconf(&["diff", "--format", format, s(reference), s(cand)]);
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn a_capture_without_the_attention_reads_is_localized_to_attn_core_and_says_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let reference = p("ref.bin");
    let o = moeconf(&run_args(&reference, "3", &["--capture", "all"]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let partial = p("llamacpp-like.bin");
    candidate(&reference, &partial, true);
    let j: serde_json::Value = serde_json::from_str(&diff(&reference, &partial, "json")).unwrap();
    let fd = &j["first_divergence"];
    assert_eq!(fd["operator"], "attn.core", "{fd}");
    assert_eq!(
        (fd["step"].as_u64(), fd["layer"].as_u64()),
        (Some(1), Some(0)),
        "{fd}"
    );
    let cov = &j["levels"]["L4"]["localized"]["coverage"];
    assert_eq!(cov["finest_level"], "L4", "{j}");
    let needed = cov["needed"].as_array().unwrap();
    let window = needed
        .iter()
        .find(|n| n["record"].as_str().unwrap().starts_with("attn.window_read"))
        .unwrap_or_else(|| panic!("attn.window_read not named as needed: {cov}"));
    assert_eq!(window["missing_in"], "candidate");
    assert!(window["held_by_other"].as_u64().unwrap() >= 1, "{window}");
    assert_eq!(
        window["reason"],
        "the sliding-window cache is read inside the attention graph"
    );
    // Only inputs of attn.core are needed; attn.q, held by both, is not among them.
    assert!(
        needed
            .iter()
            .all(|n| n["record"].as_str().unwrap().starts_with("attn.window_read")
                || n["record"].as_str().unwrap().starts_with("attn.compressed_read")),
        "{cov}"
    );
    assert!(
        j["summary"]
            .as_str()
            .unwrap()
            .contains("localization ends here at L4"),
        "{}",
        j["summary"]
    );

    let text = diff(&reference, &partial, "text");
    assert!(text.contains("localization ends here, at L4"), "{text}");
    assert!(
        text.contains("to localize further, the candidate must capture attn.window_read"),
        "{text}"
    );
    assert!(
        text.contains("its capture says: the sliding-window cache is read inside the attention graph"),
        "{text}"
    );
    assert!(
        !text.contains("its output differs while its inputs match"),
        "{text}"
    );

    // The same difference with every record captured: the operator itself is localized.
    let full = p("full.bin");
    candidate(&reference, &full, false);
    let j: serde_json::Value = serde_json::from_str(&diff(&reference, &full, "json")).unwrap();
    assert_eq!(j["first_divergence"]["operator"], "attn.core");
    assert!(
        j["levels"]["L4"]["localized"]["coverage"].is_null(),
        "{}",
        j["levels"]["L4"]["localized"]
    );
    assert!(diff(&reference, &full, "text").contains("its output differs while its inputs match"));
}
