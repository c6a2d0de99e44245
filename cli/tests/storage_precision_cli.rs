//! `moeconf diff` past storage precision, coverage and recomputed inputs
//! (issue 14, items 4 and 6), on reference-runtime traces post-processed
//! with the Rust writer API: a candidate whose `moe.term.*` were rounded to
//! bf16 at storage (as transformers stores them) and that really departs
//! later (a B fork at step 1, layer 3) must be walked past the terms and
//! localized at that combine; a candidate that differs only by storage
//! precision is divergent (exit 1) and says so; a wrongly rounded one is not
//! storage precision; records one side lacks are listed; recomputed inputs
//! are named.

use moeconf_contract::bf16::r_bf16_bits;
use moeconf_fingerprint::{Component, DType, TensorView};
use moeconf_schema::{Header, IndexEntry, Recomputed, Trace, TraceWriter};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

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

fn run_trace(out: &Path, extra: &[&str]) {
    let mut args = run_args(out, "3", &["--capture", "all"]);
    args.extend_from_slice(extra);
    let o = moeconf(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// A copy of `src` with every f32 payload of the records `pick` accepts
/// passed through `round` (bit pattern to bit pattern), records `drop`
/// accepts left out, and the provenance edited by `prov`.
fn rewrite(
    src: &Path,
    dst: &Path,
    pick: impl Fn(&IndexEntry) -> bool,
    round: impl Fn(u32) -> u32,
    drop: impl Fn(&IndexEntry) -> bool,
    prov: impl Fn(&mut moeconf_schema::Provenance),
) -> PathBuf {
    let t = Trace::open_verified(src).unwrap();
    let mut header = Header {
        binding: t.binding().clone(),
        provenance: t.provenance().clone(),
    };
    prov(&mut header.provenance);
    let mut w = TraceWriter::create(dst, t.algorithm(), header).unwrap();
    for (i, e) in t.records().unwrap().iter().enumerate() {
        if drop(e) {
            continue;
        }
        let bytes = t.payload_verified(i).unwrap().expect("a --capture all trace");
        let owned: Vec<u8>;
        let bytes = if pick(e) && e.dtype == DType::F32 {
            owned = bytes
                .chunks_exact(4)
                .flat_map(|c| round(u32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes())
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
    dst.to_path_buf()
}

fn is_term(e: &IndexEntry) -> bool {
    Component::MoeTerm.matches(&e.coord.path)
}

fn diff_json(reference: &Path, candidate: &Path) -> (i32, serde_json::Value) {
    let o = moeconf(&["diff", "--format", "json", s(reference), s(candidate)]);
    let code = o.status.code().unwrap_or(-1);
    assert!(code == 0 || code == 1, "{}", String::from_utf8_lossy(&o.stderr));
    (code, serde_json::from_slice(&o.stdout).unwrap())
}

fn diff_text(reference: &Path, candidate: &Path) -> String {
    let o = moeconf(&["diff", s(reference), s(candidate)]);
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn input<'a>(d: &'a serde_json::Value, prefix: &str) -> &'a serde_json::Value {
    d["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["input"].as_str().unwrap().starts_with(prefix))
        .unwrap_or_else(|| panic!("no input {prefix}: {d}"))
}

fn keep_all(_: &IndexEntry) -> bool {
    false
}

#[test]
fn the_walk_passes_bf16_stored_terms_and_localizes_the_later_combine() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let reference = p("ref.bin");
    run_trace(&reference, &[]);
    let fork = p("fork.bin");
    run_trace(
        &fork,
        &[
            "--fork-layer",
            "3",
            "--fork-contract",
            "b",
            "--fork-order",
            "300",
            "--fork-step",
            "1",
        ],
    );
    // The fork alone: its first divergence, with inputs matching bitwise.
    let (code, plain) = diff_json(&reference, &fork);
    assert_eq!(code, 1);
    let want = &plain["first_divergence"];
    assert_eq!(want["operator"], "moe.combine");
    assert_eq!(
        (want["step"].as_u64(), want["layer"].as_u64()),
        (Some(1), Some(3))
    );
    assert_eq!(plain["storage_precision"], serde_json::json!([]));

    // The same fork with every moe.term.* stored as bf16 values (R_BF16).
    let cand = rewrite(&fork, &p("fork-bf16.bin"), is_term, r_bf16_bits, keep_all, |_| {});
    let (code, j) = diff_json(&reference, &cand);
    assert_eq!(code, 1);
    let fd = &j["first_divergence"];
    for k in ["step", "layer", "position", "operator"] {
        assert_eq!(fd[k], want[k], "{k}: {fd} vs {want}");
    }
    let d0 = &j["divergences"][0];
    assert_eq!(d0["inputs_match"], true, "{d0}");
    assert_eq!(input(d0, "moe.term.")["status"], "storage_precision", "{d0}");
    assert_eq!(input(d0, "moe.shared")["status"], "match", "{d0}");
    assert!(
        d0["inputs_note"]
            .as_str()
            .unwrap()
            .contains("up to storage precision: moe.term."),
        "{d0}"
    );
    let groups = j["storage_precision"].as_array().unwrap();
    assert_eq!(groups.len(), 1, "{groups:?}");
    let g = &groups[0];
    assert_eq!(g["component"], "moe.term.*");
    assert_eq!(g["coarser"], "candidate");
    assert_eq!(g["coarse_storage"], "bf16 values in f32");
    assert!(g["rounding"].as_str().unwrap().starts_with("R_BF16"));
    // Every term of step 0 (all layers, every prompt position) and of step
    // 1 before layer 3 was passed; most of their values change when rounded.
    let terms_before = Trace::open(&reference)
        .unwrap()
        .records()
        .unwrap()
        .iter()
        .filter(|e| {
            is_term(e) && (e.coord.step == 0 || (e.coord.step == 1 && e.coord.layer.unwrap_or(0) < 3))
        })
        .count() as u64;
    assert!(
        g["records"].as_u64().unwrap() >= terms_before,
        "{g} < {terms_before}"
    );
    assert!(
        g["rounded_values"].as_u64().unwrap() * 2 > g["values"].as_u64().unwrap(),
        "{g}"
    );
    assert_eq!(g["first"]["step"], 0);
    assert!(
        j["summary"]
            .as_str()
            .unwrap()
            .contains("passed storage precision: moe.term.*"),
        "{}",
        j["summary"]
    );
    let text = diff_text(&reference, &cand);
    assert!(text.contains("Storage precision"), "{text}");
    assert!(text.contains("inputs match (up to storage precision"), "{text}");
}

#[test]
fn storage_precision_alone_is_divergent_and_said_plainly() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let reference = p("ref.bin");
    run_trace(&reference, &[]);
    let cand = rewrite(&reference, &p("bf16.bin"), is_term, r_bf16_bits, keep_all, |_| {});
    let (code, j) = diff_json(&reference, &cand);
    assert_eq!(code, 1, "never equivalent: the stored values differ");
    assert_eq!(j["verdict"], "divergent");
    assert!(j["first_divergence"].is_null(), "{}", j["first_divergence"]);
    assert_eq!(j["divergences"], serde_json::json!([]));
    assert_eq!(j["storage_precision"][0]["component"], "moe.term.*");
    let summary = j["summary"].as_str().unwrap();
    assert!(summary.contains("differ only by storage precision"), "{summary}");
    let text = diff_text(&reference, &cand);
    assert!(
        text.starts_with("DIVERGENT: the traces differ only by storage precision"),
        "{text}"
    );

    // One record rounded, the rest of the component kept in FP32: rounding is
    // not how the candidate stores moe.term.*, so it is a real divergence.
    let one = |e: &IndexEntry| e.coord.path == "moe.term.2" && e.coord.step == 1 && e.coord.layer == Some(4);
    let once = rewrite(&reference, &p("once.bin"), one, r_bf16_bits, keep_all, |_| {});
    let (code, j) = diff_json(&reference, &once);
    assert_eq!(code, 1);
    assert_eq!(
        j["storage_precision"],
        serde_json::json!([]),
        "{}",
        j["storage_precision"]
    );
    let fd = &j["first_divergence"];
    assert_eq!(
        (fd["operator"].as_str(), fd["step"].as_u64(), fd["layer"].as_u64()),
        (Some("moe.term.2"), Some(1), Some(4)),
        "{fd}"
    );

    // Truncation is not R_BF16: the first term it changes differently is a
    // real divergence (a record whose dropped bits all lie below the half
    // rounds the same both ways and is still storage precision).
    // The truncating capture also marks its terms recomputed.
    let mark = |pv: &mut moeconf_schema::Provenance| {
        pv.set_recomputed(&Recomputed::from_patterns(&["moe.term.*"]).unwrap())
    };
    let trunc = rewrite(
        &reference,
        &p("trunc.bin"),
        is_term,
        |b| b & 0xffff_0000,
        keep_all,
        mark,
    );
    let (code, j) = diff_json(&reference, &trunc);
    assert_eq!(code, 1);
    let fd = &j["first_divergence"];
    assert!(fd["operator"].as_str().unwrap().starts_with("moe.term."), "{fd}");
    assert_eq!(
        (fd["step"].as_u64(), fd["layer"].as_u64(), fd["position"].as_u64()),
        (Some(0), Some(0), Some(0))
    );
    let d0 = &j["divergences"][0];
    assert_eq!(d0["recomputed"], "candidate", "{d0}");
    let b = &d0["beyond_storage_precision"];
    assert_eq!(b["coarser"], "candidate", "{d0}");
    let (n, of) = (
        b["differing_values"].as_u64().unwrap(),
        b["values"].as_u64().unwrap(),
    );
    assert!(
        n > 0 && n < of,
        "truncation and R_BF16 agree where the dropped bits are below half: {b}"
    );
    let summary = j["summary"].as_str().unwrap();
    assert!(
        summary.contains("(recomputed by the capture on candidate)"),
        "{summary}"
    );
}

#[test]
fn one_sided_records_are_listed_and_recomputed_inputs_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let reference = p("ref.bin");
    run_trace(&reference, &[]);
    let fork = p("fork.bin");
    run_trace(
        &fork,
        &[
            "--fork-layer",
            "2",
            "--fork-contract",
            "b",
            "--fork-order",
            "135",
            "--fork-step",
            "1",
        ],
    );
    // No embed.output / attn.window_read, terms marked recomputed.
    let lacks = |e: &IndexEntry| {
        Component::EmbedOutput.matches(&e.coord.path) || Component::AttnWindowRead.matches(&e.coord.path)
    };
    let mark = |pv: &mut moeconf_schema::Provenance| {
        pv.set_recomputed(&Recomputed::from_patterns(&["moe.term.*"]).unwrap())
    };
    let cand = rewrite(&fork, &p("cand.bin"), |_| false, |b| b, lacks, mark);
    let (code, j) = diff_json(&reference, &cand);
    assert_eq!(code, 1);
    let fd = &j["first_divergence"];
    assert_eq!(
        (fd["operator"].as_str(), fd["step"].as_u64(), fd["layer"].as_u64()),
        (Some("moe.combine"), Some(1), Some(2)),
        "{fd}"
    );
    let sides: Vec<(String, String)> = j["one_side_only"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["component"].as_str().unwrap().into(),
                g["present_in"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert!(
        sides.contains(&("embed.output".into(), "reference".into())),
        "{sides:?}"
    );
    assert!(
        sides.contains(&("attn.window_read".into(), "reference".into())),
        "{sides:?}"
    );
    let d0 = &j["divergences"][0];
    let term = input(d0, "moe.term.");
    assert_eq!(
        (term["status"].as_str(), term["recomputed"].as_str()),
        (Some("match"), Some("candidate"))
    );
    assert!(d0["recomputed"].is_null(), "moe.combine itself is observed: {d0}");
    let note = d0["inputs_note"].as_str().unwrap();
    assert!(note.contains("recomputed by the capture: moe.term."), "{note}");
    let summary = j["summary"].as_str().unwrap();
    assert!(
        summary.contains("inputs match (recomputed by the capture"),
        "{summary}"
    );
    assert!(
        summary.contains("held by one side only: embed.output (reference"),
        "{summary}"
    );
    // inspect shows the marker.
    let o = moeconf(&["inspect", s(&cand)]);
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(
        text.contains("recomputed by the capture (not the backend's own): moe.term.*"),
        "{text}"
    );
    let o = moeconf(&["inspect", s(&reference)]);
    assert!(String::from_utf8(o.stdout)
        .unwrap()
        .contains("values     observed"));
}
