//! `moeconf demo`: the README's main job. Two traces of the built-in model,
//! identical except for one MoE reduction, and the diff that localizes it.

use crate::args::Format;
use crate::compare::{run_diff, DiffJob};
use crate::output::{check_outputs, output_dir};
use clap::Args;
use moeconf_fingerprint::{Algorithm, CanonPolicy};
use moeconf_output::Inputs;
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::{load_model, parse_capture, prepare_run, run_prepared, CombineChoice, RunSpec};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `moeconf demo`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  moeconf demo\n  moeconf demo --fork-contract a --fork-order 17\n  moeconf demo --format json --out-dir demo"
)]
pub struct DemoArgs {
    /// Where to write the two traces (`ref.bin`, `cand.bin`; created if missing). Both are checked
    /// before the runs: no directory, FIFO, device, socket or symbolic link is replaced.
    #[arg(long, default_value = "moeconf-demo")]
    pub out_dir: PathBuf,
    /// Prompt of both runs.
    #[arg(long, default_value = "why the sheep")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub max_new_tokens: u32,
    /// Layer of the candidate's single changed MoE aggregation.
    #[arg(long, default_value_t = 5)]
    pub fork_layer: u32,
    /// Contract of the candidate's changed aggregation.
    #[arg(long, default_value = "b")]
    pub fork_contract: moeconf_runner::ContractChoice,
    /// Order of the changed aggregation (a B class for b).
    #[arg(long, default_value = "135")]
    pub fork_order: String,
    /// Report format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// Runs `moeconf demo`.
pub fn run(a: &DemoArgs) -> anyhow::Result<ExitCode> {
    let text = a.format == Format::Text;
    output_dir("--out-dir", &a.out_dir)?;
    let reference = a.out_dir.join("ref.bin");
    let candidate = a.out_dir.join("cand.bin");
    let html = a.out_dir.join("report.html");
    check_outputs(&[&reference, &candidate, &html], &Inputs::new())?;
    if text {
        eprintln!("moeconf demo: loading the built-in tiny DeepSeek-V4 fixture (generated on first use) ...");
    }
    let m = load_model("builtin:tiny-v4")?;
    let mut inputs = Inputs::new();
    inputs.dir_files(&m.dir, "model file");
    moeconf_output::check_outputs(&[&reference, &candidate, &html], &inputs)?;
    let capture = parse_capture("all")?;
    let native = CombineChoice::default();
    let fork = CombineChoice {
        fork_layer: Some(a.fork_layer),
        fork_contract: Some(a.fork_contract.clone()),
        fork_order: Some(a.fork_order.clone()),
        ..CombineChoice::default()
    };
    let spec = |c| RunSpec {
        prompt: &a.prompt,
        max_new_tokens: a.max_new_tokens,
        precision: Precision::Bf16,
        combine: c,
        capture,
        algorithm: Algorithm::Blake3,
        canon: CanonPolicy::default(),
        allow_non_finite: false,
        prefill_chunk: None,
        batch_with: &[],
        progress: false,
    };
    // Both runs are validated (the fork must take effect) before either runs.
    let (native_spec, fork_spec) = (spec(&native), spec(&fork));
    let native_run = prepare_run(&m, &native_spec)?;
    let fork_run = prepare_run(&m, &fork_spec)?;
    let r = run_prepared(&m, &native_spec, native_run, &reference)?;
    let c = run_prepared(&m, &fork_spec, fork_run, &candidate)?;
    if text {
        print_runs(a, &reference, &candidate, &html, &r.text, &c.text);
    }
    let job = DiffJob {
        html: Some(html.clone()),
        ..DiffJob::new(reference, candidate, a.format)
    };
    run_diff(&job)?;
    if text {
        println!();
        println!(
            "The demo worked: the diff found the one changed reduction; the picture is {} (open it in a browser: \
             layers x steps, where the fork happened and how it spread). (`moeconf diff` itself exits 1 on a \
             divergence, 0 when equivalent, 2 on error; the demo exits 0 once the report is printed.)",
            html.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The two runs, what differs between them, and the diff command that follows.
fn print_runs(a: &DemoArgs, reference: &Path, candidate: &Path, html: &Path, r: &str, c: &str) {
    println!();
    println!(
        "reference  {}  native MoE combine everywhere",
        reference.display()
    );
    println!("           generated {r:?}");
    println!(
        "candidate  {}  identical, except the MoE aggregation of layer {} in the first decode step\n           uses contract {} order {} (BF16 rounding after every addition)",
        candidate.display(),
        a.fork_layer,
        a.fork_contract,
        a.fork_order
    );
    println!("           generated {c:?}");
    println!();
    println!(
        "$ moeconf diff {} {} --html {}",
        reference.display(),
        candidate.display(),
        html.display()
    );
    println!();
}
