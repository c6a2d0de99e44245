//! The `moeconf` binary: run, inspect, diff and gate MoE execution traces.
//!
//! Exit codes follow diff(1)/cmp(1): 0 equivalent / success, 1 divergence
//! found, 2 error (usage, I/O, malformed input).

mod args;
mod cli;
mod cmd;
mod compare;
mod complete;
mod output;
mod results;
mod version;

use std::process::ExitCode;

fn main() -> ExitCode {
    reset_sigpipe();
    remove_temporaries_on_interrupt();
    match run() {
        Ok(code) => code,
        Err(err) => {
            if is_broken_pipe(&err) {
                return ExitCode::SUCCESS;
            }
            // File names in the chain are user strings: no terminal escape or
            // bidi control from them reaches the terminal.
            let msg = args::render_error(&err);
            eprintln!("moeconf: {}", moeconf_output::escape::multiline(&msg));
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<ExitCode> {
    dispatch(cli::parse())
}

/// Runs the parsed command.
fn dispatch(cli: cli::Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        cli::Command::Inspect(a) => cmd::inspect::run(&a),
        cli::Command::Run(a) => cmd::run::run(&a),
        cli::Command::Demo(a) => cmd::demo::run(&a),
        cli::Command::Diff(a) => cmd::diff::run(&a),
        cli::Command::Explain(a) => cmd::explain::run(&a),
        cli::Command::Sweep(a) => cmd::sweep::run(&a),
        cli::Command::Certify(a) => cmd::certify::run(&a),
        cli::Command::Convert(a) => cmd::convert::run(&a),
        cli::Command::Import(a) => cmd::import::run(&a),
        cli::Command::Gate(a) => cmd::gate::run(&a),
        cli::Command::Invariance(a) => cmd::invariance::run(&a),
        cli::Command::Calibrate(a) => cmd::calibrate::run(&a),
        cli::Command::Merge(a) => cmd::merge::run(&a),
        cli::Command::Replay(a) => cmd::replay::run(&a),
        cli::Command::Bench(b) => cmd::bench::run(&b),
        cli::Command::Export(e) => cmd::export::run(&e),
        cli::Command::Completions(a) => cmd::completions::run_completions(&a),
        cli::Command::Man(a) => cmd::completions::run_man(&a),
    }
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

/// Ctrl-C (SIGINT), SIGTERM and SIGHUP end a process without running any
/// destructor, which would leave a half-written `.NAME.moeconf-tmp.*` file
/// (or a benchmark's generated checkpoint) behind. So those signals are
/// blocked in every thread and taken by one thread of their own
/// ([`watch_signals`]). A signal the process was started with ignored
/// (`nohup`, background jobs) stays ignored. If the thread cannot be
/// started, the signals keep their default action.
fn remove_temporaries_on_interrupt() {
    #[cfg(unix)]
    // SAFETY: sigset and sigaction calls on local, initialized values, made
    // at startup before any other thread exists (so the mask every later
    // thread inherits is the one set here).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction != libc::SIG_IGN {
                libc::sigaddset(&mut set, sig);
            }
        }
        let mut previous: libc::sigset_t = std::mem::zeroed();
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut previous) != 0 {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("moeconf-signals".into())
            .spawn(move || watch_signals(set));
        if spawned.is_err() {
            libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut());
        }
    }
}

/// Waits for a signal of `set` (blocked in every thread), removes the
/// registered temporaries ([`moeconf_output::remove_temporaries_and`])
/// and ends the process by the same signal with its default action, so the
/// exit status a shell sees is unchanged (130 for Ctrl-C).
#[cfg(unix)]
fn watch_signals(set: libc::sigset_t) {
    loop {
        let mut sig: libc::c_int = 0;
        // SAFETY: `set` is an initialized signal set, `sig` a valid out-pointer.
        if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
            continue;
        }
        moeconf_output::remove_temporaries_and(|| {
            // SAFETY: restores the default action of `sig` and raises it in
            // this thread, the only one that then leaves it unblocked.
            unsafe {
                libc::signal(sig, libc::SIG_DFL);
                let mut only: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut only);
                libc::sigaddset(&mut only, sig);
                libc::pthread_sigmask(libc::SIG_UNBLOCK, &only, std::ptr::null_mut());
                libc::raise(sig);
            }
            std::process::exit(128 + sig);
        });
    }
}
