//! End-to-end: `moeconf sweep` on the built-in model (a few branches, short
//! continuations) in text and JSON, thread-independent JSON, and `moeconf
//! certify` on a `--capture all` trace (and its clear error without L4 payloads).

use std::path::Path;
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

fn moeconf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .output()
        .expect("spawn moeconf")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

const SWEEP: [&str; 14] = [
    "sweep",
    "--model",
    "builtin:tiny-v4",
    "--prompt",
    "why the sheep",
    "--fork-layer",
    "5",
    "--scheme",
    "a,b",
    "--limit",
    "12",
    "--max-new-tokens",
    "3",
    "-q",
];

#[test]
fn sweep_text_table_and_json_report() {
    let text = ok(&moeconf(&SWEEP));
    assert!(text.contains("Raw permutations"), "{text}");
    assert!(text.contains("Distinct post-mHC states"), "{text}");
    // A: 720 raw, 720 classes; B: 720 raw, 360 classes; 12 evaluated each.
    let a_row = text.lines().find(|l| l.starts_with("A ")).expect("row A");
    let b_row = text.lines().find(|l| l.starts_with("B ")).expect("row B");
    let a: Vec<&str> = a_row.split_whitespace().collect();
    let b: Vec<&str> = b_row.split_whitespace().collect();
    assert_eq!(&a[1..4], &["720", "720", "12"], "{a_row}");
    assert_eq!(&b[1..4], &["720", "360", "12"], "{b_row}");
    assert!(text.contains("basins of B"), "{text}");

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep.json");
    let mut args = SWEEP.to_vec();
    args.extend(["--format", "json", "-o", out.to_str().unwrap(), "--threads", "1"]);
    let stdout = ok(&moeconf(&args));
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["schema_version"], 1);
    assert_eq!(v["fork"]["layer"], 5);
    assert_eq!(v["fork"]["step"], 1);
    let schemes = v["schemes"].as_array().unwrap();
    assert_eq!(schemes.len(), 2);
    assert_eq!(schemes[1]["structural_classes"], 360);
    let branches = schemes[1]["branches"].as_array().unwrap();
    assert_eq!(branches.len(), 12);
    assert_eq!(branches[0]["label"], "class:0");
    assert_eq!(branches[0]["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(branches[0]["steps"].as_array().unwrap().len(), 2);
    assert_eq!(branches[0]["fork_moe_digest"].as_str().unwrap().len(), 64);
    let sum: u64 = schemes[1]["basin_rank_frequency"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["branches"].as_u64().unwrap())
        .sum();
    assert_eq!(sum, 12);
    // The file holds the same document; two threads give the same bytes.
    let file = std::fs::read_to_string(&out).unwrap();
    assert_eq!(file, stdout);
    let mut args2 = SWEEP.to_vec();
    args2.extend(["--format", "json", "--threads", "2"]);
    assert_eq!(ok(&moeconf(&args2)), stdout);
}

#[test]
fn sweep_rejects_bad_input_with_exit_2() {
    let o = moeconf(&["sweep", "--prompt", "x", "--fork-layer", "99", "--limit", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--fork-layer 99"));
    let o = moeconf(&["sweep", "--prompt", "x", "--scheme", "zz", "--limit", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--scheme"));
    let o = moeconf(&["sweep", "--prompt", "x", "--max-new-tokens", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--fork-step"));
}

fn trace(dir: &Path, name: &str, capture: &str) -> String {
    let p = dir.join(name);
    ok(&moeconf(&run_args(&p, "2", &["--capture", capture])));
    s(&p).to_string()
}

#[test]
fn certify_reports_every_captured_event() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(dir.path(), "full.bin", "all");
    let o = moeconf(&["certify", &t, "--contract", "c,a,b", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_str(&ok(&o)).unwrap();
    assert_eq!(v["schema_version"], 1);
    let events = v["events"].as_array().unwrap();
    // Prompt positions + 1 decode position, 9 layers each.
    assert!(
        !events.is_empty() && events.len().is_multiple_of(9),
        "{}",
        events.len()
    );
    for e in events {
        assert_eq!(e["k"], 6);
        for c in e["certificates"].as_array().unwrap() {
            assert_eq!(c["orders"], 720);
            let d = c["distinct_outputs"].as_u64().unwrap();
            assert!((1..=720).contains(&d));
            if !c["proof"].is_null() {
                assert_eq!(d, 1, "a proof implies one distinct output");
            }
        }
    }
    let summary = v["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 3);
    assert_eq!(summary[0]["contract"], "c");
    for s in summary {
        assert_eq!(s["events"].as_u64().unwrap() as usize, events.len());
    }
    // A rounds after every addition: some event must be order-sensitive under A.
    assert!(summary[1]["order_invariant"].as_u64().unwrap() < events.len() as u64);

    let text = ok(&moeconf(&["certify", &t]));
    assert!(text.contains("summary:"), "{text}");
    assert!(text.contains("c: "), "{text}");
}

#[test]
fn certify_without_l4_payloads_says_capture_all() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(dir.path(), "default.bin", "default");
    let o = moeconf(&["certify", &t]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--capture all"), "{err}");
    let o = moeconf(&["certify", dir.path().join("missing.bin").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
}
