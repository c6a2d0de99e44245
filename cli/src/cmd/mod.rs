//! One module per subcommand.

mod bench;
pub mod calibrate;
pub mod certify;
mod demo;
pub mod diff;
pub mod gate;
pub mod import;
mod inspect;
mod run;
pub mod sweep;

use crate::cli::{BenchCommand, Cli, Command};
use std::process::ExitCode;

/// Runs the parsed command.
pub fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Inspect(a) => inspect::run(&a),
        Command::Run(a) => run::run(&a),
        Command::Demo(a) => demo::run(&a),
        Command::Diff(a) => diff::run(&a),
        Command::Sweep(a) => sweep::run(&a),
        Command::Certify(a) => certify::run(&a),
        Command::Import(a) => import::run(&a),
        Command::Gate(a) => gate::run(&a),
        Command::Calibrate(a) => calibrate::run(&a),
        Command::Bench(BenchCommand::Fingerprint(a)) => bench::fingerprint(&a),
        Command::Bench(BenchCommand::Diff(a)) => bench::diff(&a),
        Command::Bench(BenchCommand::Runtime(a)) => bench::runtime(&a),
    }
}
