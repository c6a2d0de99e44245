//! `moeconf bench invariance`: the cost of a 6-configuration invariance
//! matrix on the fixture (`moeconf invariance --preset reference-knobs`, one
//! model load, every trace verified, bisected and drawn) against the same
//! configurations run as separate `moeconf run` processes (one model load
//! each, no comparison), both measured in this run as child processes.

use crate::scale::measure;
use crate::{BenchError, BenchReport};
use moeconf_invariance::matrix::{KnobValue, ReferenceRun};
use serde_json::json;
use std::path::Path;
use std::process::Command;

/// What the benchmark runs.
pub struct InvarianceBenchOptions<'a> {
    /// The `moeconf` binary (child processes).
    pub exe: &'a Path,
    /// Tokens generated per configuration.
    pub tokens: u32,
    /// Repetitions (the best is reported).
    pub repeat: u32,
}

/// `moeconf run` arguments of one configuration of the preset.
fn run_args(r: &ReferenceRun, knobs: &moeconf_invariance::matrix::Knobs, out: &Path) -> Vec<String> {
    let mut a: Vec<String> = [
        "run",
        "--model",
        &r.model,
        "--prompt",
        &r.prompt,
        "--max-new-tokens",
        &r.max_new_tokens.to_string(),
        "--capture",
        &r.capture,
        "-o",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push(out.display().to_string());
    for (k, v) in knobs {
        match (k.as_str(), v) {
            ("threads", KnobValue::Int(n)) => a.extend(["--threads".into(), n.to_string()]),
            ("prefill_chunk", KnobValue::Int(n)) => a.extend(["--prefill-chunk".into(), n.to_string()]),
            ("batch_with", KnobValue::List(p)) => {
                for prompt in p {
                    a.extend(["--batch-with".into(), prompt.clone()]);
                }
            }
            _ => {}
        }
    }
    a
}

/// Runs the benchmark.
pub fn invariance(o: &InvarianceBenchOptions<'_>) -> Result<BenchReport, BenchError> {
    let dir = tempfile::tempdir().map_err(crate::step("a temporary directory"))?;
    let req = ReferenceRun {
        model: "builtin:tiny-v4".into(),
        prompt: "why the sheep".into(),
        max_new_tokens: o.tokens,
        precision: "bf16".into(),
        capture: "all".into(),
    };
    let m = moeconf_invariance::preset::preset("reference-knobs", req.clone())
        .map_err(|e| BenchError::Invalid(e.to_string()))?;
    // Materialize the built-in model once, outside the measurements.
    let warm = measure(
        Command::new(o.exe).args(run_args(&req, &m.base.knobs, &dir.path().join("warm.bin"))),
        "moeconf run (warm-up)",
    )?;
    if warm.code != 0 {
        return Err(BenchError::Invalid("the warm-up run failed".into()));
    }
    let mut matrix_best = f64::INFINITY;
    let mut runs_best = f64::INFINITY;
    for rep in 0..o.repeat {
        let out = dir.path().join(format!("inv{rep}"));
        let c = measure(
            Command::new(o.exe).args([
                "invariance",
                "--preset",
                "reference-knobs",
                "--max-new-tokens",
                &o.tokens.to_string(),
                "--out",
                &out.display().to_string(),
                "--format",
                "json",
                "-q",
            ]),
            "moeconf invariance",
        )?;
        let report: serde_json::Value = serde_json::from_slice(&c.stdout)
            .map_err(|e| BenchError::Invalid(format!("moeconf invariance printed no JSON report: {e}")))?;
        if c.code != 0 || report["verdict"] != "pass" {
            return Err(BenchError::Invalid(format!(
                "moeconf invariance did not pass on the fixture (exit {}, verdict {})",
                c.code, report["verdict"]
            )));
        }
        matrix_best = matrix_best.min(c.seconds);
        let mut total = 0.0;
        for (i, cfg) in std::iter::once(&m.base).chain(&m.configs).enumerate() {
            let t = dir.path().join(format!("run{rep}-{i}.bin"));
            let c = measure(
                Command::new(o.exe).args(run_args(&req, &cfg.knobs, &t)),
                "moeconf run",
            )?;
            if c.code != 0 {
                return Err(BenchError::Invalid(format!(
                    "moeconf run of {:?} failed",
                    cfg.name
                )));
            }
            total += c.seconds;
        }
        runs_best = runs_best.min(total);
    }
    let n = m.configs.len();
    let ratio = matrix_best / runs_best;
    let matrix_label = format!(
        "moeconf invariance --preset reference-knobs ({n} configurations + base, traced, verified, bisected, drawn)"
    );
    let runs_label = format!(
        "the same {} runs as separate moeconf run processes (no comparison)",
        n + 1
    );
    let text = format!(
        "moeconf bench invariance: builtin:tiny-v4, \"why the sheep\", {} tokens, best of {}\n  {matrix_label:<100} {matrix_best:>7.2} s\n  {runs_label:<100} {runs_best:>7.2} s\n  ratio matrix / separate runs: {ratio:.2}\n",
        o.tokens, o.repeat
    );
    let json = json!({
        "schema_version": 1,
        "kind": "moeconf.bench.invariance",
        "model": "builtin:tiny-v4",
        "tokens": o.tokens,
        "repeat": o.repeat,
        "configurations": n,
        "matrix_seconds": matrix_best,
        "separate_runs_seconds": runs_best,
        "ratio": ratio,
    });
    Ok(BenchReport { text, json })
}
