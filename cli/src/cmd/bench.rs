//! `moeconf bench`: throughput measured against a baseline in the same run.
//! The measurements and their reports live in `moeconf-bench`; this module
//! holds the arguments.

use crate::args::Format;
use crate::output::{print_json, print_text};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

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
    /// Replay of a whole trace (every half-layer on the candidate's inputs)
    /// against the reference run that wrote it, on the fixture; prints the
    /// ratio replay / run.
    Replay(BenchReplayArgs),
    /// Diff and gate cost against trace size: two fingerprint-only traces of
    /// 10^4 … 10^6 records (10^7 with --up-to 7) differing in one record,
    /// `moeconf diff` and `moeconf gate` (child processes: time and peak RSS)
    /// against a byte comparison of the files; and `moeconf run`'s peak RSS
    /// against the number of steps.
    Scale(BenchScaleArgs),
    /// A 6-configuration invariance matrix on the fixture (`moeconf
    /// invariance --preset reference-knobs`) against the same configurations
    /// run as separate `moeconf run` processes; prints both and the ratio.
    Invariance(BenchInvarianceArgs),
    /// Writes one synthetic trace of `bench scale` (its child process).
    #[command(hide = true)]
    ScaleWrite(BenchScaleWriteArgs),
}

/// `moeconf bench scale`.
#[derive(Debug, Args)]
pub struct BenchScaleArgs {
    /// Largest size, as a power of ten: 4 to 7 (10^7 records writes two
    /// traces of about 0.9 GiB each; check the free space of --dir first).
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(4..=7))]
    pub up_to: u32,
    /// Repetitions of the byte comparison and the diff (the best is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Token counts of the `moeconf run` memory measurement (comma-separated; `none` skips it).
    #[arg(long, default_value = "50,200,800")]
    pub run_tokens: String,
    /// Directory for the temporary traces (removed after each size; refused if one already exists).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// `moeconf bench invariance`.
#[derive(Debug, Args)]
pub struct BenchInvarianceArgs {
    /// Tokens generated per configuration.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub tokens: u32,
    /// Repetitions (the best is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// `moeconf bench scale-write` (hidden).
#[derive(Debug, Args)]
pub struct BenchScaleWriteArgs {
    /// About this many records (whole steps).
    #[arg(long)]
    pub records: u64,
    /// Change the middle step's `moe.combine` of layer 21.
    #[arg(long)]
    pub changed: bool,
    /// Container format version (the writers' default, 4, unless given).
    #[arg(long, default_value_t = moeconf_schema::DEFAULT_FORMAT_VERSION, value_parser = clap::value_parser!(u32).range(1..=4))]
    pub version: u32,
    /// Output trace.
    #[arg(long)]
    pub out: PathBuf,
}

/// `moeconf bench replay`.
#[derive(Debug, Args)]
pub struct BenchReplayArgs {
    /// Model: `builtin:tiny-v4` or a checkpoint directory.
    #[arg(long, default_value = "builtin:tiny-v4")]
    pub model: String,
    /// Tokens generated (forward steps) by the measured run.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub tokens: u32,
    /// Repetitions per measurement (the best is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// `moeconf bench runtime`.
#[derive(Debug, Args)]
pub struct BenchRuntimeArgs {
    /// Also measure the larger generated configuration (hidden 1024, 64
    /// experts; about 500 MB of weights written to a temporary directory).
    #[arg(long)]
    pub large: bool,
    /// Also measure the quantized fixture `builtin:tiny-v4-fp8` (FP8 dense, MXFP4 experts)
    /// against its exact BF16 dequantization `builtin:tiny-v4-fp8-bf16`, with their ratio.
    #[arg(long)]
    pub quantized: bool,
    /// Instead of the fixture: generate (in a temporary directory, removed
    /// afterwards) a checkpoint of DeepSeek-V4-Flash's per-layer dimensions
    /// with FP8 dense projections and MXFP4 routed experts, and report decode
    /// tokens/s, the weight bytes of one decode step, the measured memory
    /// read bandwidth and the achieved fraction of the bandwidth bound. About
    /// 2.3 GB of disk per layer plus 2.1 GB for embedding and head.
    #[arg(long)]
    pub real_width: bool,
    /// Decoder layers of the --real-width checkpoint (2: CSA, HCA; 3: sliding, CSA, HCA;
    /// 4: sliding, CSA, HCA, CSA).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=4))]
    pub layers: u32,
    /// --real-width with fewer routed experts per layer than V4-Flash's 256 (quicker to
    /// generate; a decode step still reads 6 experts of the real size per layer).
    #[arg(long, value_parser = clap::value_parser!(u32).range(6..=256))]
    pub experts: Option<u32>,
    /// --real-width with a smaller vocabulary than V4-Flash's 129280 (a smaller head).
    #[arg(long, value_parser = clap::value_parser!(u32).range(16..=129280))]
    pub vocab: Option<u32>,
    /// Directory for the --real-width checkpoint (default: the system temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Decode steps per measurement (default: 200 on the fixture, 32 with --real-width, 64 with --context).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100000))]
    pub decode_tokens: Option<u32>,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub prompt_tokens: u32,
    /// Instead of the throughput table: at each of these context lengths (comma-separated
    /// prompt lengths in tokens, e.g. 264,4096,32768), prefill the fixture and decode
    /// --decode-tokens steps (default 64, at least 16), without capture and with the default
    /// capture, and report the paired cost ratio of each phase, tokens/s, the bytes each
    /// decode step adds to the trace, peak memory, and whether the median decode cost meets the
    /// 1.10 target. Each pair is a process of its own (one process keeps the cost it drew)
    /// holding both runs: the uncaptured prefill runs before and after the captured one (the
    /// baseline their mean), then their decode steps interleaved 8 at a time, the order swapped every
    /// segment, the first segment not counted; the pair's cost is the median of its segments'
    /// ratios. On a machine whose speed drifts within seconds (shared hosts), runs one after
    /// the other compare the drift as much as the capture; segments milliseconds apart see the
    /// same machine. A 32,768-token context writes a trace of about 3.5 GiB to the system's
    /// temporary directory per pair (replaced, then removed) and takes minutes per pair.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["real_width", "large", "quantized"],
          value_parser = clap::value_parser!(u32).range(1..=1048576))]
    pub context: Vec<u32>,
    /// With --context: each run a process of its own, the captured one after the uncaptured
    /// one, and the pair's decode cost the ratio of their median steps (half the memory of an
    /// interleaved pair, but the machine's drift between the two runs counts as cost).
    #[arg(long, requires = "context")]
    pub separate_runs: bool,
    /// With --context: prefill in chunks of this many tokens (bounded memory; the records are
    /// those of the unchunked prefill).
    #[arg(long, requires = "context", value_parser = clap::value_parser!(u32).range(1..))]
    pub prefill_chunk: Option<u32>,
    /// Repetitions per measurement (the best is reported); with --context, the pairs.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Internal: one measured run of --context at this length in this process, printed as one
    /// JSON line (each run of `--context` is a process of its own).
    #[arg(long, hide = true, conflicts_with_all = ["context", "real_width", "large", "quantized"],
          requires_all = ["child_capture", "child_trace"],
          value_parser = clap::value_parser!(u32).range(1..=1048576))]
    pub context_child: Option<u32>,
    /// Internal, with --context-child: `none`, `default` or `interleaved` (both runs).
    #[arg(long, hide = true, requires = "context_child", value_parser = ["none", "default", "interleaved"])]
    pub child_capture: Option<String>,
    /// Internal, with --context-child: the trace of a captured run.
    #[arg(long, hide = true, requires = "context_child")]
    pub child_trace: Option<PathBuf>,
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
    /// Directory for the two temporary traces `bench-ref.bin` and `bench-cand.bin` (removed
    /// afterwards; refused if either already exists).
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

/// Runs `moeconf bench ...`.
pub fn run(cmd: &BenchCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCommand::Fingerprint(a) => fingerprint(a),
        BenchCommand::Diff(a) => diff(a),
        BenchCommand::Runtime(a) => runtime(a),
        BenchCommand::Replay(a) => replay(a),
        BenchCommand::Scale(a) => scale(a),
        BenchCommand::Invariance(a) => {
            let exe = std::env::current_exe()?;
            let opts = moeconf_bench::invariance::InvarianceBenchOptions {
                exe: &exe,
                tokens: a.tokens,
                repeat: a.repeat,
            };
            print(moeconf_bench::invariance::invariance(&opts)?, a.format)
        }
        BenchCommand::ScaleWrite(a) => {
            moeconf_bench::scale::write_synthetic(&a.out, a.records, a.changed, a.version)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn scale(a: &BenchScaleArgs) -> anyhow::Result<ExitCode> {
    let run_tokens = if a.run_tokens == "none" {
        Vec::new()
    } else {
        a.run_tokens
            .split(',')
            .map(|t| {
                t.trim()
                    .parse::<u32>()
                    .ok()
                    .filter(|&n| (1..=100_000).contains(&n))
                    .ok_or_else(|| {
                        anyhow::anyhow!("--run-tokens {t:?}: expected token counts 1..=100000 or none")
                    })
            })
            .collect::<anyhow::Result<_>>()?
    };
    let opts = moeconf_bench::scale::ScaleOptions {
        exponents: (4..=a.up_to).collect(),
        repeat: a.repeat,
        dir: a.dir.clone(),
        run_tokens,
        exe: std::env::current_exe()?,
    };
    print(moeconf_bench::scale::scale(&opts)?, a.format)
}

/// Prints a benchmark's report in `format`.
fn print(r: moeconf_bench::BenchReport, format: Format) -> anyhow::Result<ExitCode> {
    match format {
        Format::Json => print_json(&r.json)?,
        Format::Text => print_text(&r.text)?,
    }
    Ok(ExitCode::SUCCESS)
}

fn replay(a: &BenchReplayArgs) -> anyhow::Result<ExitCode> {
    print(moeconf_bench::replay(&a.model, a.tokens, a.repeat)?, a.format)
}

fn fingerprint(a: &BenchFingerprintArgs) -> anyhow::Result<ExitCode> {
    print(moeconf_bench::fingerprint(a.mib, a.repeat)?, a.format)
}

fn diff(a: &BenchDiffArgs) -> anyhow::Result<ExitCode> {
    let r = moeconf_bench::diff(a.mib, a.record_bytes, a.repeat, a.dir.as_ref())?;
    print(r, a.format)
}

fn runtime(a: &BenchRuntimeArgs) -> anyhow::Result<ExitCode> {
    if a.real_width {
        let tokens = a.decode_tokens.unwrap_or(32);
        let shrink = moeconf_bench::real_width::RealWidthShrink {
            experts: a.experts.map(|e| e as usize),
            vocab: a.vocab.map(|v| v as usize),
        };
        let r = moeconf_bench::real_width(a.layers as usize, shrink, tokens, a.repeat, a.dir.as_ref())?;
        return print(r, a.format);
    }
    if let (Some(n), Some(capture), Some(trace)) = (a.context_child, &a.child_capture, &a.child_trace) {
        let decode = a.decode_tokens.unwrap_or(64);
        let line = match capture.as_str() {
            "interleaved" => serde_json::to_string(&moeconf_bench::context_child_interleaved(
                n,
                decode,
                a.prefill_chunk,
                trace,
            )?)?,
            c => {
                let capture = match c {
                    "default" => moeconf_bench::runtime::BenchCapture::Default,
                    _ => moeconf_bench::runtime::BenchCapture::None,
                };
                serde_json::to_string(&moeconf_bench::context_child(
                    n,
                    decode,
                    a.prefill_chunk,
                    capture,
                    trace,
                )?)?
            }
        };
        println!("{line}");
        return Ok(ExitCode::SUCCESS);
    }
    if !a.context.is_empty() {
        let opts = moeconf_bench::context::ContextBenchOptions {
            contexts: a.context.clone(),
            decode_tokens: a.decode_tokens.unwrap_or(64),
            repeat: a.repeat,
            prefill_chunk: a.prefill_chunk,
            exe: Some(std::env::current_exe()?),
            interleave: !a.separate_runs,
        };
        return print(moeconf_bench::runtime_context(&opts)?, a.format);
    }
    let opts = moeconf_bench::runtime::RuntimeBenchOptions {
        prompt_tokens: a.prompt_tokens,
        decode_tokens: a.decode_tokens.unwrap_or(200),
        repeat: a.repeat,
    };
    print(moeconf_bench::runtime(&opts, a.large, a.quantized)?, a.format)
}
