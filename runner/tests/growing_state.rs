//! The incremental fingerprints of growing state (the compressed caches)
//! give exactly the digests of whole-record hashing: a run whose L2 state is
//! fingerprint-only (digested incrementally) against the same run keeping L2
//! payloads (digested whole, and verified against the bytes when opened).

use moeconf_fingerprint::{Algorithm, CanonPolicy, Level};
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::{load_model, parse_capture, run_to_trace, CombineChoice, RunSpec};
use moeconf_schema::{Trace, Verification};
use std::collections::BTreeMap;

fn run(capture: &str, out: &std::path::Path) -> u64 {
    let m = load_model("builtin:tiny-v4").expect("built-in model");
    let choice = CombineChoice::default();
    let spec = RunSpec {
        prompt: "why the sheep",
        max_new_tokens: 700,
        precision: Precision::Bf16,
        combine: &choice,
        capture: parse_capture(capture).expect("capture"),
        algorithm: Algorithm::Blake3,
        canon: CanonPolicy::default(),
        allow_non_finite: false,
        prefill_chunk: None,
        batch_with: &[],
        progress: false,
    };
    run_to_trace(&m, &spec, out).expect("run").growing_records
}

#[test]
fn incremental_state_digests_equal_whole_record_digests() {
    let dir = tempfile::tempdir().unwrap();
    let (fp, pl) = (dir.path().join("fp.bin"), dir.path().join("pl.bin"));
    let incremental = run("L0,L1,L2", &fp);
    let whole = run("L0,L1,L2+payload", &pl);
    assert!(
        incremental > 100,
        "the compressed caches outgrow the threshold: {incremental} records"
    );
    assert_eq!(whole, 0, "payload records are digested whole");
    let digests = |p: &std::path::Path| -> BTreeMap<String, moeconf_fingerprint::Digest> {
        let t = Trace::open_for(p, Verification::Full).expect("open");
        t.records()
            .expect("records")
            .iter()
            .filter(|e| e.level == Level::L2)
            .map(|e| (e.coord.to_string(), e.digest))
            .collect()
    };
    let (a, b) = (digests(&fp), digests(&pl));
    assert_eq!(a.len(), b.len());
    let grown = a.keys().filter(|k| k.contains("compressed_kv")).count();
    assert!(grown > 100);
    assert_eq!(a, b, "every L2 digest equal");
}
