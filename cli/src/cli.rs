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
    /// The guided tour: trace the built-in model twice, once natively and once
    /// with one changed MoE reduction (scheme B at layer 5, the paper's fork),
    /// and show where and why the two executions part.
    #[command(
        after_help = "Examples:\n  moeconf demo\n  moeconf demo --fork-contract a --fork-order 17\n  moeconf demo --format json --out-dir /tmp/demo"
    )]
    Demo(DemoArgs),
    /// Run the reference runtime greedily on a prompt and write a trace of
    /// every level (tokens, logits, persistent state, layer state, operators).
    #[command(after_help = RUN_EXAMPLES)]
    Run(RunArgs),
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
    /// Trace-freeze-fork sweep: snapshot the run at a fork point and evaluate
    /// every order of a contract there (e.g. all 720 A orders, all 360 B classes).
    Sweep(crate::cmd::sweep::SweepArgs),
    /// Exactness certificate: for the MoE events captured in a trace (L4
    /// payloads of moe.term.* and moe.shared), how many distinct outputs a
    /// contract gives over all k! orders.
    Certify(crate::cmd::certify::CertifyArgs),
    /// Build a canonical trace from a backend's safetensors tensor dumps
    /// (naming convention and manifest in docs/import.md).
    #[command(
        after_help = "Examples:\n  moeconf import dumps/ -o cand.bin\n  moeconf import dumps/ --manifest dumps/manifest.json --payloads L1,L3 -o cand.bin\n\nNaming convention and manifest: docs/import.md"
    )]
    Import(crate::cmd::import::ImportArgs),
    /// CI gate: diff a candidate against a reference under a reviewed policy
    /// (moeconf.toml), with text/JSON/JUnit/Markdown reports and blessed baselines.
    #[command(
        after_help = "Exit codes: 0 pass, 1 fail, 2 error (--bisect-exit-codes: 0 good, 1 bad, 125 skip, 128 error).\n\nExamples:\n  moeconf gate ref.bin cand.bin\n  moeconf gate ref.bin cand.bin --profile strict --format md >> \"$GITHUB_STEP_SUMMARY\"\n  moeconf gate ref.bin cand.bin --junit moeconf-junit.xml\n  moeconf gate --bless --baseline baselines/sheep.json cand.bin\n  moeconf gate --baseline baselines/sheep.json cand.bin\n\nPolicies, tolerance semantics and a GitHub Actions workflow: docs/ci.md"
    )]
    Gate(crate::cmd::gate::GateArgs),
    /// Calibration suite: the paper's experiments and the fault-injection
    /// localization matrix on the reference runtime (docs/calibration.md).
    Calibrate(crate::cmd::calibrate::CalibrateArgs),
    /// Measure throughput (fingerprinting against raw BLAKE3, ...). Prints
    /// ratios against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
}

const RUN_EXAMPLES: &str = "Examples:
  moeconf run --model builtin:tiny-v4 --prompt \"why the sheep\" --max-new-tokens 8 -o ref.bin
  moeconf run --model builtin:tiny-v4 --prompt \"why the sheep\" --contract b --schedule layer-static:7 -o cand.bin
  moeconf run --model builtin:tiny-v4 --prompt \"why the sheep\" --fork-layer 5 --fork-contract b --fork-order 135 -o fork.bin
  moeconf run --model ./my-checkpoint --prompt-file prompt.txt --precision f32 --capture all -o full.bin

Contracts (--contract, --fork-contract): native (= c with identity order), p32, c, a, b (the paper's
schemes), exact (correctly rounded sum), tree (fixed pairwise tree), f64 (FP64 accumulation).
Schedules (--schedule): identity, layer-static:SEED (one permutation per MoE layer for the whole
request), token-dynamic:SEED (a fresh permutation per layer and position).
Fork (--fork-layer L): only the MoE aggregation of layer L at one event uses --fork-contract
(default b) with --fork-order (a B class 0..359 for b, a permutation index 0..719 otherwise, or
p:5,4,3,2,1,0 for an explicit permutation); by default the event is the first decode forward
(step 1, the forward that consumes the first emitted token), as FORK_TOKEN=-1 in the paper.";

/// `moeconf demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Where to write the two traces.
    #[arg(long, default_value = "moeconf-demo")]
    pub out_dir: PathBuf,
    /// Prompt of both runs.
    #[arg(long, default_value = "why the sheep")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub max_new_tokens: u32,
    /// Layer of the candidate's single changed MoE aggregation.
    #[arg(long, default_value_t = 5)]
    pub fork_layer: u32,
    /// Contract of the candidate's changed aggregation.
    #[arg(long, default_value = "b")]
    pub fork_contract: String,
    /// Order of the changed aggregation (a B class for b).
    #[arg(long, default_value = "135")]
    pub fork_order: String,
    /// Report format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// `moeconf run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Model: `builtin:tiny-v4` or a directory with config.json, *.safetensors and tokenizer.json.
    #[arg(long, default_value = "builtin:tiny-v4")]
    pub model: String,
    /// Prompt text (raw UTF-8, no chat template).
    #[arg(long, conflicts_with = "prompt_file")]
    pub prompt: Option<String>,
    /// Read the prompt text from a file.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Number of tokens to generate (= number of forward steps).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_new_tokens: u32,
    /// Output trace file (written atomically).
    #[arg(short = 'o', long)]
    pub output: PathBuf,
    /// Precision profile: bf16 (BF16 weights and activations at HF's rounding points, FP32
    /// accumulation) or f32.
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// What to capture: default (fingerprints for all levels, payloads for L1 and L3), all
    /// (every level with payloads), fingerprints, or a list such as L0,L1+payload,L3+payload.
    #[arg(long, default_value = "default")]
    pub capture: String,
    /// Digest algorithm of the trace.
    #[arg(long, default_value = "blake3", value_parser = ["blake3", "sha256"])]
    pub digest: String,
    /// Fold -0.0 to +0.0 before hashing (recorded in the binding).
    #[arg(long)]
    pub fold_negative_zero: bool,
    /// MoE aggregation contract applied at every MoE layer.
    #[arg(long, default_value = "native")]
    pub contract: String,
    /// Order schedule of the contract: identity, layer-static:SEED or token-dynamic:SEED.
    #[arg(long, default_value = "identity")]
    pub schedule: String,
    /// Single-layer fork: the MoE layer whose aggregation changes at one event.
    #[arg(long)]
    pub fork_layer: Option<u32>,
    /// Contract at the fork (default b).
    #[arg(long)]
    pub fork_contract: Option<String>,
    /// Order at the fork: B class (b), permutation index (others), or p:i,j,...
    #[arg(long, alias = "fork-class")]
    pub fork_order: Option<String>,
    /// Forward step of the fork (default 1: the first decode forward).
    #[arg(long)]
    pub fork_step: Option<u32>,
    /// Restrict the fork to one absolute position (for prefill forks).
    #[arg(long)]
    pub fork_position: Option<u32>,
    /// Worker threads (results never depend on it).
    #[arg(long)]
    pub threads: Option<usize>,
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
    /// Write two large traces (with payloads) differing in one record and
    /// time `diff` against a plain byte comparison of the two files.
    Diff(BenchDiffArgs),
    /// Decode and prefill tokens/s of the reference runtime on the fixture
    /// (and, with --large, a generated hidden-1024 / 64-expert model), with
    /// and without the default trace capture, and anonymous RSS.
    Runtime(BenchRuntimeArgs),
}

/// `moeconf bench runtime`.
#[derive(Debug, Args)]
pub struct BenchRuntimeArgs {
    /// Also measure the larger generated configuration (hidden 1024, 64
    /// experts; about 500 MB of weights written to a temporary directory).
    #[arg(long)]
    pub large: bool,
    /// Decode steps per measurement.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=100000))]
    pub decode_tokens: u32,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub prompt_tokens: u32,
    /// Repetitions per measurement (the best is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// `moeconf bench diff`.
#[derive(Debug, Args)]
pub struct BenchDiffArgs {
    /// Size of each trace in MiB.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub mib: u64,
    /// Payload bytes per record.
    #[arg(long, default_value_t = 256 * 1024)]
    pub record_bytes: u64,
    /// Repetitions per measurement (the best is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Directory for the two temporary traces (removed afterwards).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
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
