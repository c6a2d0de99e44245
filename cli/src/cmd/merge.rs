//! `moeconf merge`: combine the partial results of every shard of a sharded
//! `moeconf sweep` or `moeconf calibrate` run into exactly the outputs of
//! the unsharded run (docs/scale.md). The partials are verified (digests,
//! one run, every shard once) before any output is checked or written.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::bail;
use moeconf_calibrate::{suite, sweep};
use moeconf_output::Inputs;
use moeconf_output::{AtomicDir, AtomicFile};
use moeconf_shard::Merged;

use crate::output::{check_output, check_outputs, output_dir, print_text};

const EXAMPLES: &str = "Examples:
  moeconf sweep --prompt \"why the sheep\" --scheme b --limit 20 --max-new-tokens 2 --shard 0/2 -o sweep-0.part
  moeconf sweep --prompt \"why the sheep\" --scheme b --limit 20 --max-new-tokens 2 --shard 1/2 -o sweep-1.part
  moeconf merge sweep-*.part -o sweep.json
  moeconf merge sweep-*.part -o sweep.json --html sweep.html
  moeconf calibrate --quick --only 1 --shard 0/2 --out cal-0.part
  moeconf calibrate --quick --only 1 --shard 1/2 --out cal-1.part
  moeconf merge cal-*.part -o cal

The partials may be given in any order; every shard 0..N-1 of one run is needed, each once.
What is printed and written is byte for byte what the unsharded command prints and writes
with -o (sweep) or --out (calibrate) set to OUT. Exit codes: those of the merged command
(calibrate: 1 when a structural claim fails), 2 on any refusal.";

/// Arguments of `moeconf merge`.
#[derive(Debug, clap::Args)]
#[command(after_help = EXAMPLES)]
pub struct MergeArgs {
    /// Partial result files (`moeconf sweep|calibrate --shard I/N`), one per shard, any order.
    #[arg(required = true, value_name = "PARTIAL")]
    pub partials: Vec<PathBuf>,
    /// Where the unsharded command's outputs go: a sweep's JSON report (its -o FILE), a
    /// calibration's output directory (its --out DIR; required). Checked before writing like the
    /// command's own outputs; no partial may be among them.
    #[arg(short = 'o', long, value_name = "OUT")]
    pub output: Option<PathBuf>,
    /// A sweep's self-contained HTML report (its --html FILE).
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

/// Runs `moeconf merge`.
pub fn run(a: &MergeArgs) -> anyhow::Result<ExitCode> {
    let mut inputs = Inputs::new();
    for p in &a.partials {
        inputs.file(p, "partial result file");
    }
    let paths: Vec<&Path> = a.partials.iter().map(|p| p.as_path()).collect();
    let merged = Merged::open(&paths)?;
    match merged.run().command.as_str() {
        sweep::COMMAND => merge_sweep(a, &merged, &inputs),
        suite::COMMAND => merge_calibration(a, &merged, &inputs),
        other => bail!("the partials are of `moeconf {other}`, which this moeconf cannot merge"),
    }
}

fn merge_sweep(a: &MergeArgs, m: &Merged, inputs: &Inputs) -> anyhow::Result<ExitCode> {
    let args = sweep::merged(m)?;
    let outs: Vec<&Path> = a.output.iter().chain(&a.html).map(|p| p.as_path()).collect();
    let mut checked = check_outputs(&outs, inputs)?.into_iter();
    let output = a.output.as_ref().and_then(|_| checked.next());
    let html = a.html.as_ref().and_then(|_| checked.next());
    let o = sweep::outputs(&args, m.results(), html.is_some())?;
    crate::results::write_sweep(output.as_ref(), html.as_ref(), &o)?;
    print_text(&o.stdout)?;
    Ok(ExitCode::SUCCESS)
}

fn merge_calibration(a: &MergeArgs, m: &Merged, inputs: &Inputs) -> anyhow::Result<ExitCode> {
    if a.html.is_some() {
        bail!("--html: a calibration has no HTML report");
    }
    let Some(out) = &a.output else {
        bail!("merging a calibration needs -o DIR: the output directory the unsharded run's --out names");
    };
    let checked = crate::results::check_calibration_dir("-o", out, inputs)?;
    let (info, suite) = suite::merged(m)?;
    let o = suite::outputs(&suite, &info, out)?;
    // Written into a temporary sibling directory, renamed into place once
    // complete (as `calibrate --out`).
    let result = AtomicDir::create(&checked)?;
    let tmp = result.temp_path().to_path_buf();
    output_dir("-o", &tmp.join("traces"))?;
    // Every output (tables, calibration.json, each trace) is checked before any is written.
    let files = m.files();
    let mut all: Vec<PathBuf> = o.files.iter().map(|(n, _)| tmp.join(n)).collect();
    all.extend(files.iter().map(|f| tmp.join(f.name)));
    let refs: Vec<&Path> = all.iter().map(|p| p.as_path()).collect();
    check_outputs(&refs, inputs)?;
    for f in &files {
        let target = check_output(&tmp.join(f.name), inputs)?;
        let mut w = AtomicFile::create(&target)?;
        m.copy_file(f, &mut w)?;
        w.commit()?;
    }
    crate::results::write_calibration(result, &o, inputs)?;
    Ok(crate::results::calibration_exit(&o))
}
