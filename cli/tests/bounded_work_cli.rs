//! Bounded work on large input (docs/diff.md and docs/contracts.md,
//! "Bounded work"). On the old code two unrelated 100 000-character
//! continuations were diffed with an unbounded Myers diff (minutes in
//! `diff` and `gate`), and `certify` of an event with 8 terms of 200 000
//! values never finished. No test here measures time: they check that the
//! bounded path is taken (the text summary instead of an inline diff, a
//! limit error before any evaluation); docs/performance.md has the timings.

use moeconf_fingerprint::{Algorithm, Component, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{Binding, CaptureSpec, Header, TraceWriter};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

fn moeconf(cwd: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args).current_dir(cwd);
    for (k, _) in std::env::vars() {
        if k.starts_with("MOECONF_") {
            c.env_remove(k);
        }
    }
    c.output().unwrap()
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exit code")
}

fn both(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A trace writer with every level declared captured, one decode step per
/// `steps`.
fn writer(path: &Path, steps: u32) -> TraceWriter {
    let binding = Binding {
        capture: CaptureSpec {
            levels: moeconf_fingerprint::LevelSet::ALL,
            payload_levels: moeconf_fingerprint::LevelSet::ALL,
        },
        decoding: moeconf_schema::Decoding {
            strategy: "greedy".into(),
            max_new_tokens: steps,
        },
        ..Binding::default()
    };
    let header = Header {
        binding,
        ..Header::default()
    };
    TraceWriter::create(path, Algorithm::Blake3, header).unwrap()
}

fn at(layer: Option<u32>, component: &str) -> Coord {
    Coord {
        step: 0,
        position: 0,
        phase: Phase::Prefill,
        layer,
        path: component.into(),
    }
}

/// One step: `token.output` = `token`, `text.continuation` = `text`.
fn text_trace(path: &Path, token: i32, text: &str) -> PathBuf {
    let mut w = writer(path, 1);
    let tok = token.to_le_bytes();
    let view = |dtype, shape: &'static [u64], bytes| TensorView { dtype, shape, bytes };
    w.append(
        at(None, Component::TokenOutput.path()),
        Level::L0,
        view(DType::I32, &[1], &tok),
        true,
    )
    .unwrap();
    let shape = [text.len() as u64];
    let t = TensorView {
        dtype: DType::U8,
        shape: &shape,
        bytes: text.as_bytes(),
    };
    w.append(at(None, Component::TextContinuation.path()), Level::L0, t, true)
        .unwrap();
    w.finish().unwrap();
    path.to_path_buf()
}

/// A deterministic text of `n` CJK characters (a character diff: one token
/// per character, the worst case of the word/character diff).
fn cjk(seed: u32, n: usize) -> String {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            char::from_u32(0x4e00 + (x >> 16) % 200).unwrap()
        })
        .collect()
}

#[test]
fn long_divergent_continuations_are_summarized_not_diffed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let a = text_trace(&d.join("a.bin"), 5, &cjk(1, 100_000));
    let b = text_trace(&d.join("b.bin"), 6, &cjk(2, 100_000));
    let o = moeconf(d, &["diff", s(&a), s(&b), "--format", "json"]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let l0 = &j["levels"]["L0"];
    assert_eq!(l0["text_diff"], serde_json::json!([]));
    let summary = &l0["text_summary"];
    assert_eq!(summary["reference_chars"], 100_000);
    assert_eq!(summary["first_difference"]["char_offset"], 0);
    assert!(
        summary["reason"].as_str().unwrap().contains("more than the 2048"),
        "{summary}"
    );
    let o = moeconf(d, &["diff", s(&a), s(&b)]);
    assert!(
        both(&o).contains("text: no inline diff: first difference at character 0 (byte 0, line 1, column 1)"),
        "{}",
        both(&o)
    );
    // The gate localizes through the same diff.
    let o = moeconf(d, &["gate", "--required", "L0", s(&a), s(&b)]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    // Short texts keep their inline diff.
    let a = text_trace(&d.join("c.bin"), 5, "the sheep ate grass");
    let b = text_trace(&d.join("e.bin"), 6, "the sheep slept here");
    let o = moeconf(d, &["diff", s(&a), s(&b), "--format", "json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["levels"]["L0"]["text_summary"], serde_json::Value::Null);
    assert_eq!(j["levels"]["L0"]["text_diff"].as_array().unwrap().len(), 6);
}

/// One MoE event at layer 0: `k` routed terms and the shared output, `d`
/// values each, all small integers (every order sums them exactly).
fn moe_trace(path: &Path, k: u32, d: usize) -> PathBuf {
    moe_events(path, k, d, &[true])
}

/// MoE events at layers 0, 1, …, one per entry of `payloads` (whether that
/// event keeps its payloads).
fn moe_events(path: &Path, k: u32, d: usize, payloads: &[bool]) -> PathBuf {
    let mut w = writer(path, 1);
    let values: Vec<u8> = (0..d).flat_map(|i| ((i % 7) as f32).to_le_bytes()).collect();
    let shape = [d as u64];
    let view = TensorView {
        dtype: DType::F32,
        shape: &shape,
        bytes: &values,
    };
    for (layer, &keep) in payloads.iter().enumerate() {
        let layer = Some(layer as u32);
        for j in 0..k {
            let path = Component::MoeTerm.indexed_path(j);
            w.append(at(layer, &path), Level::L4, view, keep).unwrap();
        }
        w.append(at(layer, Component::MoeShared.path()), Level::L4, view, keep)
            .unwrap();
    }
    w.finish().unwrap();
    path.to_path_buf()
}

#[test]
fn certify_refuses_work_beyond_its_limits_before_evaluating() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 8 terms x 200 000 values: 8! x 2e5 = 8.06e9 order-values.
    let big = moe_trace(&d.join("big.bin"), 8, 200_000);
    let o = moeconf(d, &["certify", s(&big)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    let e = both(&o);
    assert!(
        e.contains("big.bin")
            && e.contains("step 0 position 0 layer 0")
            && e.contains("8064000000 order-values")
            && e.contains("--max-event-work"),
        "{e}"
    );
    // A family the recorded terms cannot evaluate: refused before any event.
    let o = moeconf(d, &["certify", s(&big), "--contract", "p32+operand=fma"]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(
        both(&o).contains("operand=fma") && !both(&o).contains("step 0"),
        "{}",
        both(&o)
    );
    // k beyond the enumerated range: refused up front, naming the event.
    let nine = moe_trace(&d.join("nine.bin"), 9, 4);
    let o = moeconf(d, &["certify", s(&nine)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(
        both(&o).contains("k = 9 routed terms") && both(&o).contains("k <= 8"),
        "{}",
        both(&o)
    );
    // Just above the default per-event limit (8! x 900 = 36 288 000 > 2^25):
    // refused, then certified when the limit is raised.
    let edge = moe_trace(&d.join("edge.bin"), 8, 900);
    assert_eq!(code(&moeconf(d, &["certify", s(&edge)])), 2);
    let o = moeconf(d, &["certify", s(&edge), "--max-event-work", "40000000"]);
    assert_eq!(code(&o), 0, "{}", both(&o));
    assert!(both(&o).contains("order-invariant on 1/1 events"), "{}", both(&o));
    // The total over events and families.
    let o = moeconf(
        d,
        &[
            "certify",
            s(&edge),
            "--contract",
            "c,a",
            "--max-event-work",
            "40000000",
            "--max-work",
            "50000000",
        ],
    );
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(
        both(&o).contains("1 MoE events under 2 contract families takes 72576000 order-values")
            && both(&o).contains("--max-work"),
        "{}",
        both(&o)
    );
}

#[test]
fn certify_of_the_fixture_stays_within_the_default_limits() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full.bin");
    let r = Command::new(BIN)
        .args(run_args(&full, "2", &["--capture", "all"]))
        .output()
        .unwrap();
    assert!(r.status.success());
    let o = moeconf(dir.path(), &["certify", s(&full), "--contract", "c,a,b,p32"]);
    assert_eq!(code(&o), 0, "{}", both(&o));
    // A limit below the fixture's total (54 events x 6! x 256 x 4 families) is an error, not a partial report.
    let o = moeconf(dir.path(), &["certify", s(&full), "--max-work", "1000000"]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(String::from_utf8_lossy(&o.stdout).is_empty(), "no partial report");
}

#[test]
fn certify_of_part_of_the_events_is_not_a_success() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let part = moe_events(&d.join("part.bin"), 3, 16, &[true, false]);
    let o = moeconf(d, &["certify", s(&part)]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    let out = both(&o);
    assert!(
        out.contains("1 more without payloads skipped")
            && out.contains("incomplete: 1 of 2 MoE events keep no payloads"),
        "{out}"
    );
    let all = moe_events(&d.join("all.bin"), 3, 16, &[true, true]);
    assert_eq!(code(&moeconf(d, &["certify", s(&all)])), 0);
}
