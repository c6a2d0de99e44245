//! `moeconf calibrate`: run the paper's experiments and the fault-injection
//! localization matrix on the reference runtime (see `moeconf_calibrate` and
//! docs/calibration.md), print every table in the paper's layout, write
//! `calibration.json` and one TSV per table into `--out`, and exit 1 when a
//! structural claim fails. With `--shard I/N` only that shard's jobs run and
//! `--out` names the partial result that `moeconf merge` combines
//! (docs/scale.md).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use crate::output::{add_model_inputs, check_output, output_dir};
use anyhow::bail;
use moeconf_calibrate::suite::{self, RunInfo};
use moeconf_calibrate::{Ctx, CtxOptions, Sizes};
use moeconf_output::{AtomicDir, Inputs};
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::limits::MAX_PROTOCOL_TOKENS;
use moeconf_runner::{load_model, LoadedModel};
use moeconf_shard::{ProgressMode, Shard};

const EXAMPLES: &str = "Examples:
  moeconf calibrate --quick --out cal-quick
  moeconf calibrate --quick --only 2,10 --out cal                   # the fork sweep and the fault matrix
  moeconf calibrate --quick --only 1 --shard 0/2 --out part-0.part  # one of 2 shards (docs/scale.md)
  moeconf calibrate --quick --only 1 --shard 1/2 --out part-1.part
  moeconf merge part-*.part -o cal-sharded                          # the unsharded outputs
  moeconf calibrate --only 11 --context 2048 --fork-tokens 33 --out cal-2k   # the fork at 2,048 tokens

Without --quick (moeconf calibrate --out cal-full): the paper's sizes (720 A, 360 B, 64 seeds,
50 prompts; minutes instead of seconds). --out DIR appears only once complete (docs/format.md §10).

Protocols: 1 native replay, 2 single-layer A/B fork, 3 persistent layer-static ablation,
4 same-mode canonical reference, 5 C intermediate check, 6 post-mHC substitution control,
7 persistent-state substitution control, 8 representative propagation trace, 9 breadth,
10 fault-injection localization matrix; opt-in (only with --only): 11 the fork protocol by
context (the B fork at the fork layer vs native, per decode step, at \"why the sheep\" and with
--context N at N tokens; docs/calibration.md's 32k result: --context 32768 --fork-tokens 129,
about 2-4 minutes). Exit codes: 0 all structural claims hold, 1 a claim
failed, 2 error.";

/// Arguments of `moeconf calibrate`.
#[derive(Debug, clap::Args)]
#[command(after_help = EXAMPLES)]
pub struct CalibrateArgs {
    /// Model: `builtin:tiny-v4` or a directory with config.json, *.safetensors and tokenizer.json.
    #[arg(long, default_value = "builtin:tiny-v4")]
    pub model: String,
    /// Output directory for calibration.json, the TSV tables and the traces (default
    /// moeconf-calibration). Written as a temporary sibling directory renamed into place when
    /// complete, so an interrupted run leaves no result; an existing directory is replaced only
    /// when empty or holding nothing but a previous calibration's result (checked before any
    /// work). With --shard: the partial result file to write (required).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Reduced version of every protocol (fewer seeds, classes, prompts, shorter continuations).
    #[arg(long)]
    pub quick: bool,
    /// Run only these protocols (comma-separated numbers 1..11; 3, 4 and 5 run together; 11 runs
    /// only when named here).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<u32>,
    /// Layer of the single-layer fork (paper: 5).
    #[arg(long, default_value_t = 5)]
    pub fork_layer: u32,
    /// Precision profile: bf16, f32, official or vllm-cpu (docs/operators.md §1, §9–§11).
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// Request seeds per prompt and scheme in protocols 3-5 (default: 64, quick: 6).
    #[arg(long)]
    pub seeds: Option<u64>,
    /// Tokens generated per fork branch in protocols 2 and 11 (default: 8, quick: 4; at least 2).
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..=MAX_PROTOCOL_TOKENS as i64))]
    pub fork_tokens: Option<u32>,
    /// Protocol 11 (the fork protocol by context) also at a prompt of exactly N tokens (words
    /// drawn deterministically from a built-in passage), beside the short context "why the
    /// sheep"; needs --only with 11. Its horizon is --fork-tokens (e.g. 128). On tiny-v4, 32768 tokens with 128 decode steps
    /// took 72 s of CPU (2-4 min wall on 2 shared cores) and 190 MB; no trace is kept.
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=moeconf_runner::limits::MAX_PROMPT_TOKENS as i64))]
    pub context: Option<u32>,
    /// Tokens generated in protocols 1, 3-5, 8 and 10 (default: 8, quick: 6; at least 4).
    #[arg(long, value_parser = clap::value_parser!(u32).range(4..=MAX_PROTOCOL_TOKENS as i64))]
    pub tokens: Option<u32>,
    /// Shards (the suite's jobs: every protocol's runs, in order), threads, progress.
    #[command(flatten)]
    pub jobs: crate::args::JobArgs,
}

impl CalibrateArgs {
    /// The run sizes: `--quick` or the paper's, with the explicit overrides.
    fn sizes(&self) -> anyhow::Result<Sizes> {
        let mut sizes = if self.quick { Sizes::QUICK } else { Sizes::FULL };
        if let Some(s) = self.seeds {
            if s == 0 || s > 100_000 {
                bail!("--seeds {s}: expected 1..100000");
            }
            sizes.seeds = s;
        }
        if let Some(n) = self.fork_tokens {
            sizes.fork_tokens = n as usize;
        }
        if let Some(n) = self.tokens {
            sizes.tokens = n as usize;
        }
        if let Some(c) = self.context {
            if !self.only.contains(&11) {
                bail!("--context {c}: only protocol 11 runs at a context; add --only 11");
            }
            sizes.context = Some(c);
        }
        Ok(sizes)
    }
}

/// The default output directory.
const DEFAULT_OUT: &str = "moeconf-calibration";

/// What every calibration has settled before it runs: the model, the
/// options and where the result goes.
struct Setup<'a> {
    args: &'a CalibrateArgs,
    model: LoadedModel,
    precision: Precision,
    sizes: Sizes,
    progress: ProgressMode,
    out: PathBuf,
    inputs: Inputs,
    start: Instant,
}

impl Setup<'_> {
    /// The suite's context, writing its traces under `dir`.
    fn ctx(self, dir: PathBuf) -> anyhow::Result<(Ctx, RunInfo)> {
        let a = self.args;
        let opts = CtxOptions {
            precision: self.precision,
            fork_layer: a.fork_layer,
            sizes: self.sizes,
            out: dir,
            progress: self.progress,
        };
        let ctx = Ctx::new(self.model, opts)?;
        let info = RunInfo {
            model: a.model.clone(),
            precision: self.precision.name().into(),
            quick: a.quick,
            fork_layer: a.fork_layer,
            sizes: self.sizes,
            only: suite::normalize_selection(&a.only),
            experts_per_tok: ctx.k(),
        };
        Ok((ctx, info))
    }
}

/// Runs `moeconf calibrate`.
pub fn run(a: &CalibrateArgs) -> anyhow::Result<ExitCode> {
    let start = Instant::now();
    crate::args::set_threads(a.jobs.threads)?;
    let precision = crate::args::precision(&a.precision)?;
    suite::check_selection(&a.only)?;
    let sizes = a.sizes()?;
    let mut inputs = Inputs::new();
    add_model_inputs(&a.model, &mut inputs);
    let out = match (&a.out, a.jobs.shard) {
        (Some(o), _) => o.clone(),
        (None, None) => PathBuf::from(DEFAULT_OUT),
        (None, Some(_)) => {
            bail!("--shard needs --out FILE: the partial result file that `moeconf merge` reads")
        }
    };
    if a.jobs.shard.is_some() {
        check_output(&out, &inputs)?;
    } else {
        crate::results::check_calibration_dir("--out", &out, &inputs)?;
    }
    let model = load_model(&a.model)?;
    inputs.dir_files(&model.dir, "model file");
    // Every fork of the suite is at step 1 with at least 2 generated tokens,
    // so only the layer can miss; refuse it before creating --out.
    moeconf_runner::check_fork_layer(a.fork_layer, model.model.config().num_layers())?;
    let setup = Setup {
        args: a,
        model,
        precision,
        sizes,
        progress: ProgressMode::detect(a.jobs.quiet),
        out,
        inputs,
        start,
    };
    match a.jobs.shard {
        Some(shard) => run_shard(setup, shard),
        None => run_whole(setup),
    }
}

/// One shard of the suite, into the partial result file `--out`.
fn run_shard(setup: Setup<'_>, shard: Shard) -> anyhow::Result<ExitCode> {
    let (out, start, progress) = (setup.out.clone(), setup.start, setup.progress);
    let partial = check_output(&out, &setup.inputs)?;
    // The traces of this shard's jobs go to a scratch directory next to
    // the partial, attached to it, and removed.
    let scratch = suite::scratch_dir(&out)?;
    output_dir("--out", &scratch.path().join("traces"))?;
    let (ctx, info) = setup.ctx(scratch.path().to_path_buf())?;
    let run = suite::run_shard(&ctx, &info.only, shard)?;
    let jobs = run.results.len();
    let total: usize = run.groups.iter().map(|g| g.jobs).sum();
    suite::write_partial(&ctx, &info, shard, run, &partial)?;
    if progress.enabled() {
        eprintln!(
            "moeconf calibrate: shard {shard}: {jobs} of {total} jobs in {:.1} s; partial result in {}",
            start.elapsed().as_secs_f64(),
            out.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The whole suite, into the directory `--out`.
fn run_whole(setup: Setup<'_>) -> anyhow::Result<ExitCode> {
    let (out, start, progress) = (setup.out.clone(), setup.start, setup.progress);
    let inputs = setup.inputs.clone();
    // Everything is written into a temporary sibling directory, renamed
    // into place once complete: an interrupted run leaves no result.
    // Checked again with the model's files as inputs (a built-in model's
    // cache directory is known only once loaded).
    let checked = moeconf_output::check_output_dir(&out, &inputs, suite::is_result_entry)?;
    let result = AtomicDir::create(&checked)?;
    output_dir("--out", &result.temp_path().join("traces"))?;
    let (ctx, info) = setup.ctx(result.temp_path().to_path_buf())?;
    let results = suite::run(&ctx, &info.only)?;
    let o = suite::outputs(&results, &info, &out)?;
    crate::results::write_calibration(result, &o, &inputs)?;
    if progress.enabled() {
        eprintln!(
            "moeconf calibrate: wall time {:.1} s",
            start.elapsed().as_secs_f64()
        );
    }
    Ok(crate::results::calibration_exit(&o))
}
