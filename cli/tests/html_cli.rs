//! `--html` of `diff`, `gate` and `sweep` (and the demo's picture): one
//! self-contained, well-formed, deterministic file that shows the first
//! divergence at its layer and step.

use std::path::Path;
use std::process::{Command, Output};

mod common;
use common::s;

fn moeconf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap()
}

/// Every opened element is closed in order (void elements excepted), and
/// nothing points outside the file.
fn assert_self_contained_and_well_formed(html: &str) {
    for bad in [
        "http://", "https://", "<script", "src=", "url(", "<link", "@import",
    ] {
        assert!(!html.contains(bad), "found {bad:?}");
    }
    assert!(html.starts_with("<!DOCTYPE html>"));
    let mut stack: Vec<String> = Vec::new();
    let mut rest = html;
    while let Some(i) = rest.find('<') {
        rest = &rest[i + 1..];
        let end = rest.find('>').expect("unterminated tag");
        let tag = &rest[..end];
        rest = &rest[end + 1..];
        if tag.starts_with('!') {
            continue;
        }
        let self_closing = tag.ends_with('/');
        let name: String = tag
            .trim_start_matches('/')
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        if tag.starts_with('/') {
            assert_eq!(
                stack.pop().as_deref(),
                Some(name.as_str()),
                "mismatched </{name}>"
            );
        } else if !self_closing && name != "meta" {
            stack.push(name);
        }
    }
    assert!(stack.is_empty(), "unclosed: {stack:?}");
}

#[test]
fn the_demo_writes_a_picture_of_where_the_fork_happened() {
    let dir = tempfile::tempdir().unwrap();
    let o = moeconf(&["demo", "--out-dir", s(dir.path())]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let html = read(&dir.path().join("report.html"));
    assert_self_contained_and_well_formed(&html);
    // The fork (B class 135 at layer 5, step 1) is the outlined cell, marked
    // propagating, in both L3 heatmaps.
    let first = html
        .matches(r##"stroke="#d62728" stroke-width="2.5"><title>layer 5, 1: "##)
        .count();
    assert_eq!(first, 2, "first-divergence cell in both heatmaps");
    assert!(
        html.contains("Spread: the layer state first differs at step 1"),
        "spread sentence"
    );
    assert!(html.contains("b+order=class:135"));
    assert!(html.contains("Localized operator: step 1 pos 5 layer 5 moe.combine"));
    // No earlier cell differs: step 0 is identical in every layer.
    assert!(!html.contains("layer 0, 0: 1") && html.contains("layer 0, 0: identical"));

    // Deterministic: the same traces give the same bytes.
    let (r, c) = (dir.path().join("ref.bin"), dir.path().join("cand.bin"));
    let again = dir.path().join("again.html");
    let o = moeconf(&["diff", s(&r), s(&c), "--html", s(&again)]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(read(&again), html);
}

#[test]
fn html_never_replaces_an_input_and_equivalent_traces_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("t.bin");
    let o = moeconf(&common::run_args(&t, "3", &["--capture", "all"]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let before = std::fs::read(&t).unwrap();
    let o = moeconf(&["diff", s(&t), s(&t), "--html", s(&t)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains(s(&t)));
    assert_eq!(std::fs::read(&t).unwrap(), before);

    let out = dir.path().join("same.html");
    let o = moeconf(&["diff", s(&t), s(&t), "--html", s(&out)]);
    assert_eq!(o.status.code(), Some(0));
    let html = read(&out);
    assert_self_contained_and_well_formed(&html);
    assert!(html.contains("EQUIVALENT"));
    assert!(!html.contains(r##"stroke="#d62728""##), "no first divergence");
}

#[test]
fn gate_and_sweep_pages() {
    let dir = tempfile::tempdir().unwrap();
    let (r, c) = (dir.path().join("r.bin"), dir.path().join("c.bin"));
    for (p, extra) in [
        (&r, vec![]),
        (
            &c,
            vec![
                "--fork-layer",
                "2",
                "--fork-contract",
                "b",
                "--fork-order",
                "class:7",
            ],
        ),
    ] {
        let mut args = common::run_args(p, "4", &["--capture", "all"]);
        args.extend(extra);
        let o = moeconf(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let page = dir.path().join("gate.html");
    let o = moeconf(&["gate", s(&r), s(&c), "--html", s(&page)]);
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stdout));
    let html = read(&page);
    assert_self_contained_and_well_formed(&html);
    assert!(html.contains("FAIL") && html.contains("gate verdict"));
    assert!(html.contains("L3 layer state"));

    let base = dir.path().join("base.json");
    assert!(moeconf(&["gate", "--bless", "--baseline", s(&base), s(&r)])
        .status
        .success());
    let o = moeconf(&["gate", "--baseline", s(&base), s(&r), "--html", s(&page)]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stdout));
    let html = read(&page);
    assert_self_contained_and_well_formed(&html);
    assert!(html.contains("PASS") && html.contains("holds digests only"));

    let sweep = dir.path().join("sweep.html");
    let o = moeconf(&[
        "sweep",
        "--prompt",
        "why the sheep",
        "--scheme",
        "b",
        "--limit",
        "12",
        "--max-new-tokens",
        "4",
        "-q",
        "--html",
        s(&sweep),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let html = read(&sweep);
    assert_self_contained_and_well_formed(&html);
    assert!(html.contains("Basin rank-frequency") && html.contains("12 branches"));
}
