//! Command-line grammar (clap derive). Parsing only: validation of values
//! happens in the command modules so it can be tested without a process.

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// Tell whether two sparse-MoE inference backends execute the same model the
/// same way, and if not, where and why they first part.
#[derive(Debug, Parser)]
#[command(
    name = "moeconf",
    version,
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
    /// Print a trace's binding, digest algorithm, root digest and record counts
    /// per level and component; verifies every byte of the file.
    #[command(
        after_help = "Examples:\n  moeconf inspect ref.bin\n  moeconf inspect ref.bin --format json > ref.json"
    )]
    Inspect(InspectArgs),
    /// Compare two traces of the same prompt and model: are they equivalent,
    /// and if not, where (step, layer, operator) does the candidate first
    /// depart from the reference, and which numerical contract explains it.
    #[command(
        after_help = "Exit codes: 0 equivalent, 1 divergent, 2 error (including traces that are not comparable).\n\nExamples:\n  moeconf diff ref.bin cand.bin\n  moeconf diff ref.bin cand.bin --format json > report.json"
    )]
    Diff(crate::cmd::diff::DiffArgs),
    /// Measure throughput (fingerprinting against raw BLAKE3, ...). Prints
    /// ratios against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
}

/// Output format of reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Human-readable text.
    Text,
    /// One JSON document with a `schema_version` field.
    Json,
}

/// `moeconf inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The trace file.
    pub trace: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Skip re-hashing payloads (faster on very large traces; header, index,
    /// checksum and root are still verified).
    #[arg(long)]
    pub no_verify: bool,
    /// Also list every weight tensor digest of the model binding.
    #[arg(long)]
    pub tensors: bool,
}

/// `moeconf bench ...`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Hash the same f32 buffer as raw bytes with BLAKE3 and through the
    /// canonical fingerprint path, single- and multi-threaded; print ratios.
    Fingerprint(BenchFingerprintArgs),
}

/// `moeconf bench fingerprint`.
#[derive(Debug, Args)]
pub struct BenchFingerprintArgs {
    /// Buffer size in MiB.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=8192))]
    pub mib: u64,
    /// Repetitions per measurement (the best is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// Parses the process arguments (exits with code 2 on a usage error, 0 on
/// `--help`/`--version`).
pub fn parse() -> Cli {
    Cli::parse()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn grammar_is_consistent() {
        Cli::command().debug_assert();
    }
}
