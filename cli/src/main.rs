//! The `moeconf` binary: run, inspect, diff and gate MoE execution traces.
//!
//! Exit codes follow diff(1)/cmp(1): 0 equivalent / success, 1 divergence
//! found, 2 error (usage, I/O, malformed input).

mod cli;
mod cmd;
mod output;

use std::process::ExitCode;

fn main() -> ExitCode {
    reset_sigpipe();
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

/// Rust ignores SIGPIPE, which turns a closed stdout (`moeconf diff a b | head`)
/// into a panic inside `println!`. Restore the default action, as Unix
/// command-line tools expect: the process ends quietly when the reader goes.
fn reset_sigpipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal disposition to SIG_DFL at startup, before any
    // thread is spawned, has no memory-safety preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
