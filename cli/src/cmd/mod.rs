//! One module per subcommand.

mod bench;
mod demo;
pub mod diff;
mod inspect;
mod run;

use crate::cli::{BenchCommand, Cli, Command};
use std::process::ExitCode;

/// Runs the parsed command.
pub fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Inspect(a) => inspect::run(&a),
        Command::Run(a) => run::run(&a),
        Command::Demo(a) => demo::run(&a),
        Command::Diff(a) => diff::run(&a),
        Command::Bench(BenchCommand::Fingerprint(a)) => bench::fingerprint(&a),
    }
}
