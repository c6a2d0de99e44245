//! The `moeconf` binary: run, inspect, diff and gate MoE execution traces.
//!
//! Exit codes follow diff(1)/cmp(1): 0 equivalent / success, 1 divergence
//! found, 2 error (usage, I/O, malformed input).

mod cli;
mod cmd;
mod output;
mod runner;

use std::process::ExitCode;

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(err) => {
            if is_broken_pipe(&err) {
                return ExitCode::SUCCESS;
            }
            eprintln!("moeconf: {err:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<ExitCode> {
    let args = cli::parse();
    cmd::dispatch(args)
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
