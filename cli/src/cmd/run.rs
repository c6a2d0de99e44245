//! `moeconf run`: trace the reference runtime.

use crate::cli::RunArgs;
use crate::output::human_bytes;
use anyhow::{bail, Context};
use moeconf_fingerprint::{Algorithm, CanonPolicy};
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::{load_model, parse_capture, run_to_trace, CombineChoice, RunSpec};
use std::process::ExitCode;

/// Sets the global rayon pool size (results never depend on it).
pub fn set_threads(threads: Option<usize>) -> anyhow::Result<()> {
    if let Some(n) = threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("configuring the thread pool")?;
    }
    Ok(())
}

pub fn run(a: &RunArgs) -> anyhow::Result<ExitCode> {
    set_threads(a.threads)?;
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), None) => p.clone(),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("--prompt-file {}: reading", f.display()))?
        }
        _ => bail!("give the prompt with --prompt TEXT or --prompt-file FILE"),
    };
    let precision = Precision::from_name(&a.precision)
        .with_context(|| format!("--precision {:?}: expected bf16 or f32", a.precision))?;
    let capture = parse_capture(&a.capture)?;
    let algorithm = Algorithm::from_name(&a.digest).with_context(|| format!("--digest {:?}", a.digest))?;
    let choice = CombineChoice {
        contract: a.contract.clone(),
        schedule: a.schedule.clone(),
        fork_layer: a.fork_layer,
        fork_step: a.fork_step,
        fork_position: a.fork_position,
        fork_contract: a.fork_contract.clone(),
        fork_order: a.fork_order.clone(),
    };
    let m = load_model(&a.model)?;
    let spec = RunSpec {
        prompt: &prompt,
        max_new_tokens: a.max_new_tokens,
        precision,
        combine: &choice,
        capture,
        algorithm,
        canon: CanonPolicy {
            fold_negative_zero: a.fold_negative_zero,
        },
    };
    let t = std::time::Instant::now();
    let out = run_to_trace(&m, &spec, &a.output)?;
    eprintln!(
        "moeconf run: {} prompt tokens + {} generated in {:.2} s: {:?}",
        out.prompt_ids.len(),
        out.tokens.len(),
        t.elapsed().as_secs_f64(),
        out.text
    );
    eprintln!(
        "wrote {} ({}, {} records, {} with payloads), root {}",
        a.output.display(),
        human_bytes(out.summary.bytes),
        out.summary.records,
        out.summary.payloads,
        out.summary.root
    );
    Ok(ExitCode::SUCCESS)
}
