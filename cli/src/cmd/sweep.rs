//! `moeconf sweep`: trace-freeze-fork sweep (paper section 2.4.1 and 3.2).
//!
//! Runs the request natively up to the fork step, freezes the decode state,
//! and runs every structural class of each scheme from the snapshot (all k!
//! permutation indices for A-like contracts, the k!/2 B classes for B-like
//! ones) with only the fork layer's MoE aggregation changed. Prints the
//! paper's table per scheme (raw permutations, structural classes, distinct
//! MoE outputs, distinct post-mHC states, basins) and the basin
//! rank-frequency; `--format json` / `-o FILE` give every branch's digests,
//! routes and tokens. With `--shard I/N` only that shard's jobs run and `-o`
//! names the partial result that `moeconf merge` combines (docs/scale.md).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use moeconf_calibrate::sweep::{SchemeRequest, SweepOutcome, SweepRequest};
use moeconf_contract::ForkPoint;
use moeconf_shard::ProgressMode;

use crate::args::{Format, ModelPromptArgs};
use crate::output::print_text;
use moeconf_runner::limits::MAX_PROTOCOL_TOKENS;
use moeconf_runner::{load_model, CombineChoice};

const SWEEP_EXAMPLES: &str = "Examples:
  moeconf sweep --model builtin:tiny-v4 --prompt \"why the sheep\" --fork-layer 5 --scheme a,b --max-new-tokens 2
  moeconf sweep --prompt \"why the sheep\" --scheme b --limit 20 --max-new-tokens 2 --format json
  moeconf sweep --prompt \"why the sheep\" --scheme a,b --max-new-tokens 2 -o sweep.json --html sweep.html
  moeconf sweep --prompt \"why the sheep\" --max-new-tokens 2 --branch b+order=class:135 --branch a+order=index:17
  moeconf sweep --prompt \"why the sheep\" --scheme b --limit 20 --max-new-tokens 2 --shard 0/2 -o part-0.part
  moeconf sweep --prompt \"why the sheep\" --scheme b --limit 20 --max-new-tokens 2 --shard 1/2 -o part-1.part
  moeconf merge part-*.part -o sweep.json          # after every shard (docs/scale.md)

A scheme is a contract family (native, p32, c, a, b, exact, tree, f64, exact-fused, or
operand=..+accumulator=..); it is swept over its structural classes: the k!/2 B classes for
B-like families (BF16 operands and accumulator, first-pair symmetry), all k! permutation
indices otherwise. --branch adds single explicit contracts (with +order=...) as one more
scheme named `explicit`. Basins are distinct continuation texts.";

/// Arguments of `moeconf sweep`.
#[derive(Debug, clap::Args)]
#[command(after_help = SWEEP_EXAMPLES)]
pub struct SweepArgs {
    /// Model and prompt.
    #[command(flatten)]
    pub input: ModelPromptArgs,
    /// Layer whose MoE aggregation is forked.
    #[arg(long, default_value_t = 5)]
    pub fork_layer: u32,
    /// Forward step of the fork (default 1: the forward that consumes the first emitted token).
    #[arg(long, default_value_t = 1)]
    pub fork_step: u32,
    /// Restrict the fork to one absolute position (for prefill forks, --fork-step 0).
    #[arg(long)]
    pub fork_position: Option<u32>,
    /// Schemes to sweep, comma-separated (e.g. a,b); repeatable.
    #[arg(long, value_delimiter = ',', default_value = "a,b")]
    pub scheme: Vec<String>,
    /// An explicit branch contract such as b+order=class:135 (repeatable; not comma-split).
    #[arg(long)]
    pub branch: Vec<String>,
    /// Evaluate only the first N branches of each scheme (quick runs).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Tokens generated per branch (steps 0..N-1); must exceed --fork-step.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=MAX_PROTOCOL_TOKENS as i64))]
    pub max_new_tokens: u32,
    /// Precision profile: bf16, f32, official or vllm-cpu (docs/operators.md §1, §9–§11).
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// Contract of every other MoE event (the base; default native).
    #[arg(long, default_value = "native")]
    pub contract: moeconf_runner::ContractChoice,
    /// Order schedule of the base contract: identity, layer-static:SEED or token-dynamic:SEED.
    #[arg(long, default_value = "identity")]
    pub schedule: moeconf_contract::Schedule,
    /// Digest algorithm of the branch fingerprints.
    #[arg(long, default_value = "blake3", value_parser = ["blake3", "sha256"])]
    pub digest: String,
    /// Report format on stdout.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Also write the JSON report (every branch) to FILE, atomically; FILE is checked before the
    /// sweep (its directory exists; not a directory, FIFO, device, socket, symbolic link or input).
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Also write a self-contained HTML report: the basin rank-frequency and
    /// where each distinct continuation parts from the native one.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Basins listed per scheme in the text report.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Shards (the sweep's jobs: the native reference, then every branch), threads, progress.
    #[command(flatten)]
    pub jobs: crate::args::JobArgs,
}

/// Runs `moeconf sweep`.
pub fn run(a: &SweepArgs) -> anyhow::Result<ExitCode> {
    crate::args::set_threads(a.jobs.threads)?;
    a.check()?;
    let mut inputs = a.input.inputs();
    let outs: Vec<&std::path::Path> = a.output.iter().chain(&a.html).map(|p| p.as_path()).collect();
    crate::output::check_outputs(&outs, &inputs)?;
    let prompt = a.input.prompt()?;
    let precision = crate::args::precision(&a.precision)?;
    let algorithm = crate::args::algorithm(&a.digest)?;
    a.check_steps()?;
    let m = load_model(&a.input.model)?;
    inputs.dir_files(&m.dir, "model file");
    let check = |o: &PathBuf| moeconf_output::check_output(o, &inputs);
    let output = a.output.as_ref().map(check).transpose()?;
    let html = a.html.as_ref().map(check).transpose()?;
    let choice = a.combine();
    let req = SweepRequest {
        model: &m,
        prompt: &prompt,
        point: ForkPoint {
            layer: a.fork_layer,
            step: a.fork_step,
            position: a.fork_position,
        },
        max_new_tokens: a.max_new_tokens,
        schemes: SchemeRequest {
            schemes: &a.scheme,
            branches: &a.branch,
            limit: a.limit,
        },
        combine: &choice,
        precision,
        algorithm,
        format: a.format.name(),
        top: a.top,
        shard: a.jobs.shard,
        html: html.is_some(),
        progress: ProgressMode::detect(a.jobs.quiet),
    };
    let done = moeconf_calibrate::sweep::run(&req)?;
    if !a.jobs.quiet {
        eprintln!("{}", done.finished);
    }
    match done.outcome {
        SweepOutcome::Partial {
            identity,
            shard,
            results,
        } => {
            let out = output.as_ref().context("--shard needs -o FILE")?;
            moeconf_shard::write_partial(out, &identity, shard, results, &[])?;
        }
        SweepOutcome::Whole(o) => {
            crate::results::write_sweep(output.as_ref(), html.as_ref(), &o)?;
            print_text(&o.stdout)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

impl SweepArgs {
    /// The contract and schedule of every combine but the fork's.
    fn combine(&self) -> CombineChoice {
        CombineChoice {
            contract: self.contract.clone(),
            schedule: self.schedule.clone(),
            ..CombineChoice::default()
        }
    }

    /// Refuses options that contradict each other, before anything is read.
    fn check(&self) -> anyhow::Result<()> {
        if self.jobs.shard.is_some() {
            if self.html.is_some() {
                bail!(
                    "--html with --shard: the HTML report is written by `moeconf merge PARTIAL... --html FILE`"
                );
            }
            if self.output.is_none() {
                bail!("--shard needs -o FILE: the partial result file that `moeconf merge` reads");
            }
        }
        Ok(())
    }

    /// Refuses a fork step the run never reaches (checked after the prompt
    /// and the profile, as before).
    fn check_steps(&self) -> anyhow::Result<()> {
        if self.max_new_tokens <= self.fork_step {
            bail!(
                "--max-new-tokens {} must exceed --fork-step {} (the fork step must run)",
                self.max_new_tokens,
                self.fork_step
            );
        }
        Ok(())
    }
}
