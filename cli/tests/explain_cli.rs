//! `moeconf explain` as a process: reference-runtime traces run under
//! several grammar notations are each explained as an equivalent of what
//! was run, text and JSON; missing payloads are errors (exit 2) naming
//! what is missing.

use moeconf_contract::{normalized, AggregationContract};
use std::path::Path;
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

fn moeconf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .output()
        .unwrap()
}

fn run_trace(out: &Path, extra: &[&str]) {
    let o = moeconf(&run_args(out, "3", extra));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn explain_json(trace: &Path) -> serde_json::Value {
    let o = moeconf(&["explain", s(trace), "--format", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Whether `member` (notation) is the same grammar member as `run`, up to
/// the structural normalization (other spellings of the same computation).
fn same_member(member: &str, run: &AggregationContract) -> bool {
    AggregationContract::parse(member).is_ok_and(|m| normalized(&m) == normalized(run))
}

#[test]
fn every_notation_run_is_explained_as_an_equivalent_of_itself() {
    let dir = tempfile::tempdir().unwrap();
    for notation in [
        "native",
        "b+order=asc-id",
        "c+routed=bf16",
        "p32+output=f32+order=asc-id",
        "a+order=desc-gate",
        "b+order=class:135",
        "c+order=reversed",
        "c+shared=last+order=asc-id",
        "p32+start=first+output=f32",
        "c+shape=lanes:4",
        "exact-fused",
        "a+shape=tree+order=desc-id",
    ] {
        let trace = dir
            .path()
            .join(format!("{}.bin", notation.replace(['+', '=', ':'], "_")));
        run_trace(&trace, &["--capture", "all", "--contract", notation]);
        let run = AggregationContract::parse(notation).unwrap();
        let j = explain_json(&trace);
        assert_eq!(j["schema_version"], 2);
        let v = &j["verdict"];
        let events = v["events"].as_u64().unwrap();
        assert!(events > 0, "{notation}: {v}");
        assert_eq!(v["explained_events"].as_u64(), Some(events), "{notation}: {v}");
        // The trace-level set: the rule and its equivalents.
        let mut set: Vec<String> = vec![v["rule"]
            .as_str()
            .unwrap_or_else(|| panic!("{notation}: {v}"))
            .to_string()];
        set.extend(
            v["equivalents"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["contract"].as_str().unwrap().to_string()),
        );
        assert!(
            set.iter().any(|m| same_member(m, &run)),
            "{notation} is not among the trace's reproducing rules {set:?}"
        );
        // Each equivalent says why.
        for e in v["equivalents"].as_array().unwrap() {
            assert!(!e["reasons"].as_array().unwrap().is_empty(), "{notation}: {e}");
        }
        // The headline counts every event.
        let headline = v["headline"].as_str().unwrap();
        assert!(
            headline.ends_with(&format!(": {events}/{events} events")),
            "{headline}"
        );
    }
}

#[test]
fn expert_id_rule_is_named_in_the_text_report() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("b.bin");
    run_trace(&trace, &["--capture", "all", "--contract", "b+order=asc-id"]);
    let o = moeconf(&["explain", s(&trace)]);
    assert_eq!(o.status.code(), Some(0));
    let text = String::from_utf8(o.stdout).unwrap();
    let rule = text.lines().find(|l| l.starts_with("rule: ")).unwrap();
    assert!(
        rule.starts_with("rule: b+order=asc-id — ascending expert id: "),
        "{rule}"
    );
    assert!(text.contains("experts ["), "{text}");
}

#[test]
fn missing_payloads_and_missing_events_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    // Default capture: L4 fingerprints without payloads.
    let fp = dir.path().join("fp.bin");
    run_trace(&fp, &[]);
    let o = moeconf(&["explain", s(&fp)]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no payload") && err.contains("moe."), "{err}");
    // No L4 at all.
    let l0 = dir.path().join("l0.bin");
    run_trace(&l0, &["--capture", "L0+payload,L1+payload"]);
    let o = moeconf(&["explain", s(&l0)]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no moe.combine records"), "{err}");
    // Not a trace.
    let junk = dir.path().join("junk.bin");
    std::fs::write(&junk, b"not a trace").unwrap();
    assert_eq!(moeconf(&["explain", s(&junk)]).status.code(), Some(2));
}

#[test]
fn a_single_forked_event_is_named_outside_the_trace_rule() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("fork.bin");
    run_trace(
        &trace,
        &[
            "--capture",
            "all",
            "--fork-layer",
            "5",
            "--fork-contract",
            "b",
            "--fork-order",
            "135",
        ],
    );
    let j = explain_json(&trace);
    let v = &j["verdict"];
    assert!(v["rule"].is_null(), "{v}");
    let events = v["events"].as_u64().unwrap();
    assert_eq!(v["rules"][0]["contract"], "c", "{v}");
    assert_eq!(v["rules"][0]["events"].as_u64(), Some(events - 1), "{v}");
    let out = v["outside_best_rule"].as_array().unwrap();
    assert_eq!(out.len(), 1, "{v}");
    assert_eq!(
        (out[0]["step"].as_u64(), out[0]["layer"].as_u64()),
        (Some(1), Some(5))
    );
    let fork = j["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["step"] == 1 && e["layer"] == 5)
        .unwrap();
    assert_eq!(fork["explanation"]["simplest"], "b+order=class:135", "{fork}");
    let headline = v["headline"].as_str().unwrap();
    assert!(
        headline.starts_with(&format!(
            "no single rule explains every event; best: c — router slot order: {}/{events} events",
            events - 1
        )),
        "{headline}"
    );
}
