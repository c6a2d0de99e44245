//! One module per subcommand, each with its `Args` beside its `run`, and
//! the option parsing they share.

pub mod bench;
pub mod calibrate;
pub mod certify;
pub mod complete;
pub mod convert;
pub mod demo;
pub mod diff;
pub mod explain;
pub mod export;
pub mod gate;
pub mod import;
pub mod inspect;
pub mod merge;
pub mod replay;
pub mod run;
pub mod sweep;

use crate::cli::{Cli, Command};
use anyhow::Context;
use moeconf_fingerprint::Algorithm;
use moeconf_reference_runtime::precision::Precision;
use std::process::ExitCode;

/// Runs the parsed command.
pub fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Inspect(a) => inspect::run(&a),
        Command::Run(a) => run::run(&a),
        Command::Demo(a) => demo::run(&a),
        Command::Diff(a) => diff::run(&a),
        Command::Explain(a) => explain::run(&a),
        Command::Sweep(a) => sweep::run(&a),
        Command::Certify(a) => certify::run(&a),
        Command::Convert(a) => convert::run(&a),
        Command::Import(a) => import::run(&a),
        Command::Gate(a) => gate::run(&a),
        Command::Calibrate(a) => calibrate::run(&a),
        Command::Merge(a) => merge::run(&a),
        Command::Replay(a) => replay::run(&a),
        Command::Bench(b) => bench::run(&b),
        Command::Export(e) => export::run(&e),
    }
}

/// Sets the global rayon pool size (results never depend on it), within
/// [`moeconf_runner::limits::max_threads`].
pub fn set_threads(threads: Option<usize>) -> anyhow::Result<()> {
    if let Some(n) = threads {
        moeconf_runner::limits::check_threads(n)?;
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("configuring the thread pool")?;
    }
    Ok(())
}

/// Parses `--precision`.
pub fn precision(name: &str) -> anyhow::Result<Precision> {
    Precision::from_name(name)
        .with_context(|| format!("--precision {name:?}: expected bf16, f32 or official"))
}

/// Parses `--digest`.
pub fn algorithm(name: &str) -> anyhow::Result<Algorithm> {
    Algorithm::from_name(name).with_context(|| format!("--digest {name:?}"))
}
