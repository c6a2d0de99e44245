//! `moeconf bench`: throughput measured against a baseline in the same run.
//! The measurements live with what they measure
//! (`moeconf_fingerprint::bench`, `moeconf_bisect::bench_diff`,
//! `moeconf_runner::bench`); this module prints them.

use crate::cli::Format;
use crate::output::{print_json, print_text};
use clap::{Args, Subcommand};
use moeconf_fingerprint::bench::{bench_fingerprint, f32_buffer};
use moeconf_runner::bench::{bench_runtime, render_runtime_text, RuntimeBenchOptions};
use serde_json::json;
use std::path::{Path, PathBuf};
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
    }
}

fn replay(a: &BenchReplayArgs) -> anyhow::Result<ExitCode> {
    let m = moeconf_runner::load_model(&a.model)?;
    let tmp = tempfile::Builder::new()
        .prefix("moeconf-bench-replay")
        .tempdir()?;
    eprintln!(
        "moeconf bench replay: {} tokens on {} (best of {}) ...",
        a.tokens, a.model, a.repeat
    );
    let b = moeconf_replay::bench::bench_replay(&m, "why the sheep", a.tokens, a.repeat, tmp.path())?;
    match a.format {
        Format::Json => print_json(&json!({
            "schema_version": 1,
            "kind": "moeconf.bench.replay",
            "model": a.model,
            "tokens": b.tokens,
            "prompt_tokens": b.prompt_tokens,
            "units": b.units,
            "threads": b.threads,
            "run_seconds": b.run,
            "bare_forward_seconds": b.bare,
            "replay_1thread_seconds": b.replay_1thread,
            "replay_pool_seconds": b.replay_pool,
            "teacher_force_seconds": b.teacher,
            "replay_measured_propagation_1thread_seconds": b.replay_measured_1thread,
            "ratio_replay_1thread_over_run": b.replay_1thread / b.run,
            "ratio_replay_pool_over_run": b.replay_pool / b.run,
        }))?,
        Format::Text => {
            println!(
                "replay of a whole trace vs the run that wrote it: {} ({} prompt + {} generated tokens, {} units)",
                a.model, b.prompt_tokens, b.tokens, b.units
            );
            println!(
                "  (a) reference run, --capture replay, to a trace  {:>8.3} s",
                b.run
            );
            println!(
                "  (b) bare forward, no capture                   {:>8.3} s",
                b.bare
            );
            println!(
                "  (c) layer replay, 1 thread                     {:>8.3} s   ratio c/a = {:.2}",
                b.replay_1thread,
                b.replay_1thread / b.run
            );
            println!(
                "  (d) layer replay, {} threads                    {:>8.3} s   ratio d/a = {:.2}",
                b.threads,
                b.replay_pool,
                b.replay_pool / b.run
            );
            println!(
                "  (e) teacher forcing                            {:>8.3} s",
                b.teacher
            );
            println!(
                "  (f) layer replay + measured propagation, 1 t.  {:>8.3} s   ratio f/a = {:.2}",
                b.replay_measured_1thread,
                b.replay_measured_1thread / b.run
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn fingerprint(a: &BenchFingerprintArgs) -> anyhow::Result<ExitCode> {
    let bytes = (a.mib as usize) << 20;
    eprintln!(
        "moeconf bench fingerprint: preparing {} MiB of f32 values ...",
        a.mib
    );
    let data = f32_buffer(bytes);
    let threads = rayon::current_num_threads();
    eprintln!("measuring (best of {}, measurements interleaved) ...", a.repeat);
    let b = bench_fingerprint(&data, a.repeat);
    if !b.digests_agree {
        anyhow::bail!("canonical digests differ between single- and multi-threaded hashing");
    }
    let gbps = |s: f64| b.gbps(s);
    let ratio_1 = b.raw_1thread / b.canonical_1thread;
    let ratio_n = b.raw_rayon / b.canonical_rayon;
    let scaling = b.canonical_1thread / b.canonical_rayon;
    match a.format {
        Format::Json => print_json(&json!({
            "schema_version": 1,
            "kind": "moeconf.bench.fingerprint",
            "bytes": bytes,
            "threads": threads,
            "raw_blake3_1thread_gbps": gbps(b.raw_1thread),
            "canonical_1thread_gbps": gbps(b.canonical_1thread),
            "raw_blake3_rayon_gbps": gbps(b.raw_rayon),
            "canonical_rayon_gbps": gbps(b.canonical_rayon),
            "canonical_sha256_1thread_gbps": gbps(b.canonical_sha256_1thread),
            "ratio_canonical_over_raw_1thread": ratio_1,
            "ratio_canonical_over_raw_rayon": ratio_n,
            "canonical_thread_scaling": scaling,
        }))?,
        Format::Text => print_text(&b.render_text(threads))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `bench diff --dir D`: D must be a directory, and the two traces the
/// benchmark writes there and removes afterwards must not exist yet (the
/// benchmark never takes over, and then deletes, a file it did not create).
fn check_bench_dir(dir: &Path) -> anyhow::Result<()> {
    if !std::fs::metadata(dir).is_ok_and(|m| m.is_dir()) {
        anyhow::bail!("--dir {}: not a directory", dir.display());
    }
    for name in moeconf_bisect::BENCH_TRACE_NAMES {
        let p = dir.join(name);
        if std::fs::symlink_metadata(&p).is_ok() {
            anyhow::bail!(
                "--dir {}: {} already exists; bench diff writes and then removes its own traces there, \
                 so it refuses to take over an existing file",
                dir.display(),
                p.display()
            );
        }
    }
    Ok(())
}

fn diff(a: &BenchDiffArgs) -> anyhow::Result<ExitCode> {
    let tmp;
    let dir = match &a.dir {
        Some(d) => {
            check_bench_dir(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new().prefix("moeconf-bench-diff").tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    eprintln!(
        "moeconf bench diff: writing two {} MiB traces into {} ...",
        a.mib,
        dir.display()
    );
    let b = moeconf_bisect::bench_diff(&dir, a.mib << 20, a.record_bytes, a.repeat)?;
    match a.format {
        Format::Json => print_json(&json!({
            "schema_version": 1,
            "kind": "moeconf.bench.diff",
            "file_bytes": b.file_bytes,
            "records": b.records,
            "record_bytes": b.record_bytes,
            "byte_compare_seconds": b.byte_compare_seconds,
            "diff_seconds": b.diff_seconds,
            "open_seconds": b.open_seconds,
            "walk_seconds": b.walk_seconds,
            "verify_seconds": b.verify_seconds,
            "ratio": b.ratio,
            "localized": b.localized.as_ref().map(|f| json!({"step": f.step, "layer": f.layer, "operator": f.operator})),
        }))?,
        Format::Text => print_text(&b.render_text())?,
    }
    Ok(ExitCode::SUCCESS)
}

fn runtime(a: &BenchRuntimeArgs) -> anyhow::Result<ExitCode> {
    let opts = RuntimeBenchOptions {
        prompt_tokens: a.prompt_tokens,
        decode_tokens: a.decode_tokens,
        repeat: a.repeat,
    };
    let scratch = tempfile::Builder::new().prefix("moeconf-bench-rt").tempdir()?;
    eprintln!("moeconf bench runtime: builtin:tiny-v4 ...");
    let tiny = moeconf_fixtures::ensure_builtin("builtin:tiny-v4")?;
    let mut rows = bench_runtime("tiny-v4", &tiny, &opts, scratch.path())?;
    let rss_tiny = moeconf_reference_runtime::bench::anon_rss_bytes();
    let mut rss_large = None;
    if a.large {
        let dir = tempfile::Builder::new().prefix("moeconf-bench-large").tempdir()?;
        eprintln!(
            "generating the large configuration in {} ...",
            dir.path().display()
        );
        moeconf_fixtures::checkpoint::write_v4(
            dir.path(),
            &moeconf_fixtures::checkpoint::V4Spec::bench_large(),
        )?;
        rows.extend(bench_runtime(
            "large (hidden 1024, 64 experts)",
            dir.path(),
            &opts,
            scratch.path(),
        )?);
        rss_large = moeconf_reference_runtime::bench::anon_rss_bytes();
    }
    let threads = rayon::current_num_threads();
    match a.format {
        Format::Json => print_json(&json!({
            "schema_version": 1,
            "kind": "moeconf.bench.runtime",
            "threads": threads,
            "prompt_tokens": a.prompt_tokens,
            "decode_tokens": a.decode_tokens,
            "rows": rows.iter().map(|r| json!({
                "model": r.model, "precision": r.precision.name(), "capture": r.capture.name(),
                "prefill_tokens_per_second": r.prefill, "decode_tokens_per_second": r.decode,
            })).collect::<Vec<_>>(),
            "anon_rss_bytes_after_tiny": rss_tiny,
            "anon_rss_bytes_after_large": rss_large,
        }))?,
        Format::Text => print_text(&render_runtime_text(&opts, &rows, [rss_tiny, rss_large]))?,
    }
    Ok(ExitCode::SUCCESS)
}
