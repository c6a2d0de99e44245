//! The trace size estimate ([`estimate_trace`]) against real runs of the
//! fixture at several prompt lengths, decode lengths and captures: every
//! trace is within [`TRACE_ESTIMATE_ERROR`] of its estimate, either way.

use moeconf_fingerprint::{Algorithm, CanonPolicy};
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::limits::{estimate_trace, TRACE_ESTIMATE_ERROR};
use moeconf_runner::{load_model, parse_capture, run_to_trace, CombineChoice, RunSpec};

#[test]
fn the_estimate_is_within_its_stated_error_of_real_traces() {
    let m = load_model("builtin:tiny-v4").expect("built-in model");
    let dir = tempfile::tempdir().unwrap();
    let choice = CombineChoice::default();
    let long_prompt = "why the sheep ".repeat(40);
    let cases: &[(&str, u32, &str)] = &[
        ("why the sheep", 8, "default"),
        ("why the sheep", 200, "default"),
        (&long_prompt, 4, "default"),
        ("why the sheep", 200, "all"),
        (&long_prompt, 30, "all"),
        ("why the sheep", 300, "fingerprints"),
        ("why the sheep", 1000, "L0"),
        ("why the sheep", 300, "L0,L1+payload"),
        ("why the sheep", 300, "L0+payload,L2+payload"),
        (&long_prompt, 20, "replay"),
    ];
    let mut worst: f64 = 1.0;
    for (i, &(prompt, new, capture)) in cases.iter().enumerate() {
        let out = dir.path().join(format!("t{i}.bin"));
        let spec = RunSpec {
            prompt,
            max_new_tokens: new,
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
        let r = run_to_trace(&m, &spec, &out).expect("run");
        let actual = std::fs::metadata(&out).unwrap().len() as f64;
        let e = estimate_trace(
            m.model.config(),
            r.prompt_ids.len() as u64,
            u64::from(new),
            spec.capture,
            false,
        );
        let ratio = e.total() as f64 / actual;
        println!(
            "{} prompt tokens, {new} steps, --capture {capture}: estimate {} actual {} ratio {ratio:.3}",
            r.prompt_ids.len(),
            e.total(),
            actual
        );
        worst = worst.max(ratio).max(1.0 / ratio);
        assert!(
            (1.0 / TRACE_ESTIMATE_ERROR..=TRACE_ESTIMATE_ERROR).contains(&ratio),
            "case {i} ({capture}, {new} steps): estimate {} for {actual} bytes",
            e.total()
        );
    }
    println!("worst factor {worst:.3}");
}
