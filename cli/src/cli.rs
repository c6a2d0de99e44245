//! Command-line grammar (clap derive). Parsing only: each command's `Args`
//! lives beside its `run` in `cmd/`, and values are validated there so it can
//! be tested without a process.

use clap::{Args, FromArgMatches, Parser, Subcommand};

use crate::cmd;

/// Tell whether two sparse-MoE inference backends execute the same model the
/// same way, and if not, where and why they first part.
#[derive(Debug, Parser)]
#[command(
    name = "moeconf",
    version = crate::version::SHORT,
    long_version = crate::version::LONG,
    about,
    long_about = "Tell whether two sparse Mixture-of-Experts inference backends execute the same model the same \
way, and if not, exactly where and why they first part.\n\nA trace is one captured execution: canonical \
fingerprints (and optionally tensor bytes) of tokens (L0), logits (L1), full persistent state (L2), layer \
state and routes (L3) and operator intermediates (L4), bound to the model, tokenizer, prompt and decoding \
configuration.\n\nExit codes: 0 success / equivalent, 1 divergent, 2 error.",
    after_help = "Examples:\n  moeconf inspect ref.bin\n  moeconf inspect ref.bin --format json\n  moeconf bench fingerprint --mib 256"
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The guided tour: trace the built-in model twice, once natively and once
    /// with one changed MoE reduction (scheme B at layer 5, the paper's fork),
    /// and show where and why the two executions part.
    Demo(cmd::demo::DemoArgs),
    /// Run the reference runtime greedily on a prompt and write a trace of
    /// every level (tokens, logits, persistent state, layer state, operators).
    Run(cmd::run::RunArgs),
    /// Print a trace's binding, digest algorithm, root digest and record counts
    /// per level and component; verifies every byte of the file.
    Inspect(cmd::inspect::InspectArgs),
    /// Compare two traces of the same prompt and model: are they equivalent,
    /// and if not, where (step, layer, operator) does the candidate first
    /// depart from the reference, and which numerical contract explains it.
    #[command(about = DIFF_ABOUT, long_about = None)]
    Diff(cmd::diff::DiffArgs),
    /// Which MoE combine contract does one trace's backend implement? Explains
    /// every moe.combine event against the whole combine grammar (no reference
    /// needed): the simplest reproducing member, the indistinguishable others
    /// and why, and the rule that explains every event (docs/contracts.md).
    Explain(cmd::explain::ExplainArgs),
    /// Trace-freeze-fork sweep: snapshot the run at a fork point and evaluate
    /// every order of a contract there (e.g. all 720 A orders, all 360 B classes).
    Sweep(cmd::sweep::SweepArgs),
    /// Exactness certificate: for the MoE events captured in a trace (L4
    /// payloads of moe.term.* and moe.shared), how many distinct outputs a
    /// contract gives over all k! orders.
    Certify(cmd::certify::CertifyArgs),
    /// Build a canonical trace from a backend's safetensors tensor dumps
    /// (naming convention and manifest in docs/import.md).
    Import(cmd::import::ImportArgs),
    /// Rewrite a trace in another container format version (4: layer groups
    /// longer than a page stored as pages, the default; 3 and 2: tree nodes
    /// read on use; 1: a flat index). The root does not change.
    Convert(cmd::convert::ConvertArgs),
    /// CI gate: diff a candidate against a reference under a reviewed policy
    /// (moeconf.toml), with text/JSON/JUnit/Markdown reports and blessed baselines.
    #[command(about = GATE_ABOUT, long_about = None, after_help = GATE_AFTER_HELP)]
    Gate(cmd::gate::GateArgs),
    /// Replay a candidate trace on the reference runtime: every half-layer
    /// fed the candidate's own captured inputs, to find every origin of
    /// divergence (not only the first); or, with --teacher-force, the
    /// reference on the candidate's tokens with per-step KL divergence.
    Replay(cmd::replay::ReplayArgs),
    /// Which serving knob changes the state, and where: one backend under a
    /// matrix of configurations (threads, batch, chunked prefill, or any knob
    /// of a capture command), each bisected against the base (docs/invariance.md).
    Invariance(cmd::invariance::InvarianceArgs),
    /// Calibration suite: the paper's experiments and the fault-injection
    /// localization matrix on the reference runtime (docs/calibration.md).
    Calibrate(cmd::calibrate::CalibrateArgs),
    /// Combine the partial results of every shard of a `sweep --shard I/N` or
    /// `calibrate --shard I/N` run into exactly the unsharded outputs
    /// (docs/scale.md: Slurm, Kubernetes and GitHub Actions recipes).
    Merge(cmd::merge::MergeArgs),
    /// Export a model for another backend: `moeconf export gguf` writes the GGUF llama.cpp's
    /// deepseek4 loads, with the same weights the reference runs (verified bit for bit).
    #[command(subcommand)]
    Export(cmd::export::ExportCommand),
    /// Measure throughput (fingerprinting against raw BLAKE3, ...). Prints
    /// ratios against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell)
    /// generated from this binary's own options.
    Completions(cmd::completions::CompletionsArgs),
    /// Write man pages (moeconf.1 and one per subcommand) generated from this
    /// binary's own options and help.
    Man(cmd::completions::ManArgs),
}

/// `moeconf diff`'s description (one constant for the full grammar and
/// [`parse`]'s fast path).
const DIFF_ABOUT: &str = "Compare two traces of the same prompt and model: are they equivalent, and if not, where \
(step, layer, operator) does the candidate first depart from the reference, and which numerical contract explains it";

/// `moeconf gate`'s description.
const GATE_ABOUT: &str =
    "CI gate: diff a candidate against a reference under a reviewed policy (moeconf.toml), \
with text/JSON/JUnit/Markdown reports and blessed baselines";

/// What `moeconf gate --help` prints after the options.
const GATE_AFTER_HELP: &str = "Exit codes: 0 pass, 1 fail, 2 error (--bisect-exit-codes: 0 good, 1 bad, 125 skip, 128 error).\n\nExamples:\n  moeconf gate ref.bin cand.bin\n  moeconf gate ref.bin cand.bin --profile strict --format md >> \"$GITHUB_STEP_SUMMARY\"\n  moeconf gate ref.bin cand.bin --junit moeconf-junit.xml\n  moeconf gate --bless --baseline baselines/sheep.json cand.bin\n  moeconf gate --baseline baselines/sheep.json cand.bin\n\nPolicies, tolerance semantics and a GitHub Actions workflow: docs/ci.md";

/// Parses the process arguments (exits with code 2 on a usage error, 0 on
/// `--help`/`--version`).
///
/// `moeconf diff` and `moeconf gate` are what CI runs many times: for them
/// only their own subcommand is built (the whole grammar, every
/// subcommand's options and help, costs ~0.3 ms of a ~2 ms `diff`).
/// Parsing, help and errors are the same (tests below compare them).
pub fn parse() -> Cli {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match args.get(1).and_then(|a| a.to_str()).and_then(one_subcommand) {
        Some(mut cmd) => {
            let matches = cmd.try_get_matches_from_mut(&args).unwrap_or_else(|e| e.exit());
            Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut cmd).exit())
        }
        None => Cli::parse_from(args),
    }
}

/// The grammar with only the subcommand `name`, for the subcommands
/// [`parse`] takes a fast path for.
fn one_subcommand(name: &str) -> Option<clap::Command> {
    let sub = match name {
        "diff" => cmd::diff::DiffArgs::augment_args(clap::Command::new("diff"))
            .about(DIFF_ABOUT)
            .long_about(None),
        "gate" => cmd::gate::GateArgs::augment_args(clap::Command::new("gate"))
            .about(GATE_ABOUT)
            .long_about(None)
            .after_help(GATE_AFTER_HELP),
        _ => return None,
    };
    // What the derived top level sets that shows below it: the binary's
    // name in usage lines, and a subcommand being required.
    Some(
        clap::Command::new("moeconf")
            .version(crate::version::SHORT)
            .long_version(crate::version::LONG)
            .subcommand_required(true)
            .arg_required_else_help(true)
            .subcommand(sub),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn grammar_is_consistent() {
        Cli::command().debug_assert();
        for name in ["diff", "gate"] {
            one_subcommand(name).unwrap().debug_assert();
        }
    }

    /// The fast path of [`parse`] builds the same subcommand as the full
    /// grammar: the same help, usage, parses and errors.
    #[test]
    fn the_fast_path_parses_and_explains_like_the_full_grammar() {
        let cases: &[&[&str]] = &[
            &["diff", "a.bin", "b.bin"],
            &["diff", "a.bin", "b.bin", "--format", "json"],
            &["diff", "a.bin", "b.bin", "--format", "yaml"],
            &["diff", "a.bin"],
            &["diff", "--no-such-flag", "a.bin", "b.bin"],
            &["diff", "--help"],
            &["diff", "-h"],
            &["diff", "--version"],
            &["gate", "ref.bin", "cand.bin"],
            &[
                "gate",
                "ref.bin",
                "cand.bin",
                "--profile",
                "strict",
                "--format",
                "md",
            ],
            &["gate", "--bless", "--baseline", "b.json", "cand.bin"],
            &["gate", "--help"],
            &["gate", "--format"],
            &["gate", "ref.bin", "cand.bin", "--junit"],
        ];
        for name in ["diff", "gate"] {
            let mut fast = one_subcommand(name).unwrap();
            let mut full = Cli::command();
            let (a, b) = (
                fast.find_subcommand_mut(name).unwrap(),
                full.find_subcommand_mut(name).unwrap(),
            );
            assert_eq!(a.render_help().to_string(), b.render_help().to_string(), "{name}");
            assert_eq!(
                a.render_long_help().to_string(),
                b.render_long_help().to_string(),
                "{name}"
            );
            assert_eq!(
                a.render_usage().to_string(),
                b.render_usage().to_string(),
                "{name}"
            );
        }
        for case in cases {
            let argv: Vec<&str> = std::iter::once("moeconf").chain(case.iter().copied()).collect();
            let fast = one_subcommand(case[0])
                .unwrap()
                .try_get_matches_from(&argv)
                .and_then(|m| Cli::from_arg_matches(&m));
            let full = Cli::try_parse_from(&argv);
            match (fast, full) {
                (Ok(a), Ok(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}"), "{argv:?}"),
                (Err(a), Err(b)) => {
                    assert_eq!(a.kind(), b.kind(), "{argv:?}");
                    assert_eq!(a.exit_code(), b.exit_code(), "{argv:?}");
                    assert_eq!(a.render().to_string(), b.render().to_string(), "{argv:?}");
                }
                (a, b) => panic!("{argv:?}: fast {a:?}, full {b:?}"),
            }
        }
    }
}
