//! The `moeconf bench` measurements. Each measures its subject against a
//! baseline measured in the same run (raw BLAKE3, a byte comparison, a run
//! without capture, the run that wrote the trace) and reports the ratio, as
//! text for people and JSON for machines. The measuring code lives here,
//! one module per benchmark (`fingerprint`, `diff`, `runtime`,
//! `real_width`, `replay`, `scale`; shared tools in `measure`), and reaches
//! what it measures through the measured crates' public API: benchmarks
//! live in bench/, not in the library crates. The functions at the root run
//! each one and build its report, so the binary only parses arguments.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};

pub mod context;
pub mod diff;
pub mod fingerprint;
pub mod invariance;
pub mod measure;
pub mod real_width;
pub mod replay;
pub mod runtime;
pub mod scale;

/// A benchmark's report.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchReport {
    /// For people.
    pub text: String,
    /// For machines (`schema_version`, `kind: moeconf.bench.*`).
    pub json: Value,
}

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A step failed (`what` says which).
    #[error("{what}")]
    Step {
        /// The step.
        what: String,
        /// Its error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A precondition does not hold (message says which).
    #[error("{0}")]
    Invalid(String),
}

/// Wraps an error of step `what`.
fn step<E: std::error::Error + Send + Sync + 'static>(what: &str) -> impl FnOnce(E) -> BenchError + '_ {
    move |e| BenchError::Step {
        what: what.into(),
        source: Box::new(e),
    }
}

/// A benchmark's temporary directory: removed when dropped, and registered
/// as a temporary ([`moeconf_output::register_temporary`]) so that
/// an interrupted benchmark (Ctrl-C) removes it too; a real-width
/// checkpoint in one is gigabytes.
pub(crate) struct Scratch(tempfile::TempDir);

impl Scratch {
    fn new(dir: tempfile::TempDir) -> Scratch {
        moeconf_output::register_temporary(dir.path());
        Scratch(dir)
    }

    /// The directory.
    pub(crate) fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Removed before it is forgotten, so an interruption in between
        // still finds it registered.
        let _ = std::fs::remove_dir_all(self.0.path());
        moeconf_output::deregister_temporary(self.0.path());
    }
}

/// A scratch directory named after the benchmark.
fn scratch(prefix: &str) -> Result<Scratch, BenchError> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map(Scratch::new)
        .map_err(step("creating a scratch directory"))
}

/// `bench fingerprint`: canonical record hashing against raw BLAKE3 over
/// `mib` MiB of f32, best of `repeat`, single- and multi-threaded.
pub fn fingerprint(mib: u64, repeat: u32) -> Result<BenchReport, BenchError> {
    use fingerprint::{bench_fingerprint, f32_buffer, small_records};
    let bytes = (mib as usize) << 20;
    eprintln!("moeconf bench fingerprint: preparing {mib} MiB of f32 values ...");
    let data = f32_buffer(bytes);
    let threads = rayon::current_num_threads();
    eprintln!("measuring (best of {repeat}, measurements interleaved) ...");
    let b = bench_fingerprint(&data, repeat);
    if !b.digests_agree {
        return Err(BenchError::Invalid(
            "canonical digests differ between single- and multi-threaded hashing, or batched and one-by-one"
                .into(),
        ));
    }
    let g = |s: f64| b.gbps(s);
    let json = json!({
        "schema_version": 1,
        "kind": "moeconf.bench.fingerprint",
        "bytes": bytes,
        "threads": threads,
        "raw_blake3_1thread_gbps": g(b.raw_1thread),
        "canonical_1thread_gbps": g(b.canonical_1thread),
        "raw_blake3_rayon_gbps": g(b.raw_rayon),
        "canonical_rayon_gbps": g(b.canonical_rayon),
        "canonical_sha256_1thread_gbps": g(b.canonical_sha256_1thread),
        "ratio_canonical_over_raw_1thread": b.raw_1thread / b.canonical_1thread,
        "ratio_canonical_over_raw_rayon": b.raw_rayon / b.canonical_rayon,
        "canonical_thread_scaling": b.canonical_1thread / b.canonical_rayon,
        "small_records": small_records().len(),
        "small_records_bytes": b.small_bytes,
        "small_one_by_one_gbps": b.small_bytes as f64 / b.small_one_by_one / 1e9,
        "small_batched_gbps": b.small_bytes as f64 / b.small_batched / 1e9,
        "ratio_small_batched_over_one_by_one": b.small_one_by_one / b.small_batched,
    });
    Ok(BenchReport {
        text: b.render_text(threads),
        json,
    })
}

/// `bench diff --dir D`: D must be a directory, and the two traces the
/// benchmark writes there and removes afterwards must not exist yet (the
/// benchmark never takes over, and then deletes, a file it did not create).
fn check_bench_dir(dir: &Path) -> Result<(), BenchError> {
    if !std::fs::metadata(dir).is_ok_and(|m| m.is_dir()) {
        return Err(BenchError::Invalid(format!(
            "--dir {}: not a directory",
            dir.display()
        )));
    }
    for name in diff::BENCH_TRACE_NAMES {
        let p = dir.join(name);
        if std::fs::symlink_metadata(&p).is_ok() {
            return Err(BenchError::Invalid(format!(
                "--dir {}: {} already exists; bench diff writes and then removes its own traces there, \
                 so it refuses to take over an existing file",
                dir.display(),
                p.display()
            )));
        }
    }
    Ok(())
}

/// `bench diff`: two traces of `mib` MiB differing in one record, the
/// localization against a byte comparison of the files.
pub fn diff(
    mib: u64,
    record_bytes: u64,
    repeat: u32,
    dir: Option<&PathBuf>,
) -> Result<BenchReport, BenchError> {
    let tmp;
    let dir = match dir {
        Some(d) => {
            check_bench_dir(d)?;
            d.clone()
        }
        None => {
            tmp = scratch("moeconf-bench-diff")?;
            tmp.path().to_path_buf()
        }
    };
    eprintln!(
        "moeconf bench diff: writing two {mib} MiB traces into {} ...",
        dir.display()
    );
    let b = diff::bench_diff(&dir, mib << 20, record_bytes, repeat).map_err(step("bench diff"))?;
    let json = json!({
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
    });
    Ok(BenchReport {
        text: b.render_text(),
        json,
    })
}

/// `bench runtime`: decode and prefill tokens/s with and without capture on
/// the fixture (and, with `large`, a generated hidden-1024 / 64-expert
/// model), and the anonymous RSS.
pub fn runtime(
    opts: &runtime::RuntimeBenchOptions,
    large: bool,
    quantized: bool,
) -> Result<BenchReport, BenchError> {
    use runtime::{bench_runtime, render_runtime_text};
    let work = scratch("moeconf-bench-rt")?;
    eprintln!("moeconf bench runtime: builtin:tiny-v4 ...");
    let tiny = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").map_err(step("the built-in fixture"))?;
    let mut rows = bench_runtime("tiny-v4", &tiny, opts, work.path()).map_err(step("bench runtime"))?;
    let rss_tiny = measure::anon_rss_bytes();
    let mut rss_large = None;
    if large {
        let dir = scratch("moeconf-bench-large")?;
        eprintln!(
            "generating the large configuration in {} ...",
            dir.path().display()
        );
        moeconf_fixtures::checkpoint::write_v4(
            dir.path(),
            &moeconf_fixtures::checkpoint::V4Spec::bench_large(),
        )
        .map_err(step("generating the large configuration"))?;
        let name = "large (hidden 1024, 64 experts)";
        rows.extend(bench_runtime(name, dir.path(), opts, work.path()).map_err(step("bench runtime"))?);
        rss_large = measure::anon_rss_bytes();
    }
    let mut rss_quantized = None;
    let mut quantized_text = String::new();
    if quantized {
        let mut pair = Vec::new();
        for (label, name) in [
            ("tiny-v4-fp8 (FP8 + MXFP4)", moeconf_fixtures::BUILTIN_TINY_V4_FP8),
            (
                "tiny-v4-fp8-bf16 (dequantized)",
                moeconf_fixtures::BUILTIN_TINY_V4_FP8_BF16,
            ),
        ] {
            eprintln!("moeconf bench runtime: {name} ...");
            let dir = moeconf_fixtures::ensure_builtin(name).map_err(step("the quantized fixture"))?;
            let r = bench_runtime(label, &dir, opts, work.path()).map_err(step("bench runtime"))?;
            pair.push(r.clone());
            rows.extend(r);
        }
        rss_quantized = measure::anon_rss_bytes();
        quantized_text.push_str("  quantized fixture, decode tokens/s FP8+MXFP4 / its BF16 dequantization (same weights, same bits):\n");
        for (q, b) in pair[0].iter().zip(&pair[1]) {
            quantized_text.push_str(&format!(
                "    {:<5} {:<8} {:>8.1} / {:>8.1} = {:.2}x\n",
                q.precision.name(),
                q.capture.name(),
                q.decode,
                b.decode,
                q.decode / b.decode
            ));
        }
        quantized_text.push_str(&format!(
            "  anonymous RSS after the quantized fixtures: {}\n",
            rss_quantized.map_or("n/a".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0))
        ));
    }
    let json = json!({
        "schema_version": 1,
        "kind": "moeconf.bench.runtime",
        "threads": rayon::current_num_threads(),
        "prompt_tokens": opts.prompt_tokens,
        "decode_tokens": opts.decode_tokens,
        "rows": rows.iter().map(|r| json!({
            "model": r.model, "precision": r.precision.name(), "capture": r.capture.name(),
            "prefill_tokens_per_second": r.prefill, "decode_tokens_per_second": r.decode,
            "decode_vs_none_paired": r.paired_quartiles().map(|[q1, median, q3]| json!({
                "rounds": r.paired_vs_none.len(), "q1": q1, "median": median, "q3": q3,
            })),
        })).collect::<Vec<_>>(),
        "anon_rss_bytes_after_tiny": rss_tiny,
        "anon_rss_bytes_after_large": rss_large,
        "anon_rss_bytes_after_quantized": rss_quantized,
    });
    Ok(BenchReport {
        text: render_runtime_text(opts, &rows, [rss_tiny, rss_large]) + &quantized_text,
        json,
    })
}

/// `bench runtime --context N,...`: the default capture's cost, the trace
/// bytes per decode step and memory at each context length
/// ([`context::bench_context`]), on the built-in fixture.
pub fn runtime_context(opts: &context::ContextBenchOptions) -> Result<BenchReport, BenchError> {
    use context::{bench_context, render_context_text, TARGET_COST};
    let work = scratch("moeconf-bench-ctx")?;
    let tiny = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").map_err(step("the built-in fixture"))?;
    let mut progress = |line: &str| eprintln!("moeconf bench runtime: {line}");
    let rows =
        bench_context(&tiny, opts, work.path(), &mut progress).map_err(step("bench runtime --context"))?;
    let q = |v: Option<[f64; 3]>, n: usize| {
        v.map(|[q1, median, q3]| json!({"rounds": n, "q1": q1, "median": median, "q3": q3}))
    };
    let json = json!({
        "schema_version": 1,
        "kind": "moeconf.bench.runtime.context",
        "model": "builtin:tiny-v4",
        "precision": "bf16",
        "threads": rayon::current_num_threads(),
        "decode_tokens": opts.decode_tokens,
        "prefill_chunk": opts.prefill_chunk,
        "measure": if opts.interleave { "interleaved" } else { "process_pairs" },
        "segment_steps": opts.interleave.then_some(context::SEGMENT_STEPS),
        "target_cost": TARGET_COST,
        "rows": rows.iter().map(|r| json!({
            "context": r.context,
            "prefill_tokens_per_second": {"none": r.prefill[0], "default": r.prefill[1]},
            "decode_tokens_per_second": {"none": r.decode[0], "default": r.decode[1]},
            "prefill_cost": q(r.prefill_quartiles(), r.prefill_cost.len()),
            "decode_cost": q(r.decode_quartiles(), r.decode_cost.len()),
            "decode_phase_cost": q(r.decode_phase_quartiles(), r.decode_phase_cost.len()),
            "run_cost": q(r.run_quartiles(), r.run_cost.len()),
            "decode_target_met": r.decode_quartiles().map(|[_, m, _]| m <= TARGET_COST),
            "decode_cost_median_interval95": crate::measure::median_interval95(&r.decode_cost).map(|(lo, hi)| [lo, hi]),
            "decode_target": r.decode_verdict().map(|v| v.name()),
            "bytes_per_decode_step": {"min": r.step_bytes[0], "median": r.step_bytes[1], "max": r.step_bytes[2]},
            "prefill_bytes": r.prefill_bytes,
            "trace_bytes": r.trace_bytes,
            "growing_records": r.growing_records,
            "growing_hashed_bytes_per_step": r.growing_hashed_per_step,
            "peak_rss_bytes": r.peak_rss,
        })).collect::<Vec<_>>(),
    });
    Ok(BenchReport {
        text: render_context_text(opts, &rows),
        json,
    })
}

/// One run of `bench runtime --context` in this process
/// ([`context::one_run`], the child process of each measured run).
pub fn context_child(
    n: u32,
    decode_tokens: u32,
    prefill_chunk: Option<u32>,
    capture: runtime::BenchCapture,
    trace: &std::path::Path,
) -> Result<context::OneRun, BenchError> {
    let tiny = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").map_err(step("the built-in fixture"))?;
    context::one_run(&tiny, n, decode_tokens, prefill_chunk, capture, trace)
        .map_err(step("bench runtime --context-child"))
}

/// One interleaved pair of `bench runtime --context` in this
/// process ([`context::interleaved_run`], the child process of each pair).
pub fn context_child_interleaved(
    n: u32,
    decode_tokens: u32,
    prefill_chunk: Option<u32>,
    trace: &std::path::Path,
) -> Result<context::InterleavedRun, BenchError> {
    let tiny = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").map_err(step("the built-in fixture"))?;
    context::interleaved_run(&tiny, n, decode_tokens, prefill_chunk, trace)
        .map_err(step("bench runtime --context-child"))
}

/// `bench runtime --real-width`: decode of a generated checkpoint of
/// V4-Flash's per-layer dimensions (`layers` layers) against the memory
/// bandwidth bound, all measured in one run; the checkpoint is generated
/// in a temporary directory under `dir` (or the system's) and removed.
pub fn real_width(
    layers: usize,
    shrink: real_width::RealWidthShrink,
    decode_tokens: u32,
    repeat: u32,
    dir: Option<&PathBuf>,
) -> Result<BenchReport, BenchError> {
    use real_width::{bench_real_width, render_real_width_text};
    let ckpt = match dir {
        Some(d) => tempfile::Builder::new()
            .prefix("moeconf-bench-real-width")
            .tempdir_in(d)
            .map(Scratch::new)
            .map_err(step("creating a scratch directory"))?,
        None => scratch("moeconf-bench-real-width")?,
    };
    let work = scratch("moeconf-bench-rt")?;
    let r = bench_real_width(layers, shrink, decode_tokens, repeat, ckpt.path(), work.path())
        .map_err(step("bench runtime --real-width"))?;
    let s = &r.step;
    let json = json!({
        "schema_version": 1,
        "kind": "moeconf.bench.runtime.real_width",
        "layers": r.layers,
        "n_routed_experts": r.n_routed_experts,
        "vocab_size": r.vocab_size,
        "layer_types": r.layer_kinds,
        "threads": r.threads,
        "checkpoint_bytes": r.checkpoint_bytes,
        "generate_seconds": r.generate_seconds,
        "step_weight_bytes": s.total(),
        "step_weight_bytes_layers_dense": s.layers_dense,
        "step_weight_bytes_routed_experts": s.routed_experts,
        "step_weight_bytes_head_and_embedding": s.head_and_embedding,
        "all_routed_expert_bytes": s.all_routed_experts,
        "read_bandwidth_1thread_bytes_per_second": r.bandwidth_1thread,
        "read_bandwidth_bytes_per_second": r.bandwidth_threads,
        "decode_tokens": r.decode_tokens,
        "decode_tokens_per_second_no_capture": r.decode_none,
        "decode_tokens_per_second_default_capture": r.decode_default,
        "bound_tokens_per_second": r.bound_tokens_per_second(),
        "achieved_bytes_per_second": r.achieved_bytes_per_second(),
        "fraction_of_bandwidth_bound": r.fraction_of_bound(),
        "anon_rss_bytes_after_load": r.anon_rss[0],
        "anon_rss_bytes_after_decode": r.anon_rss[1],
    });
    Ok(BenchReport {
        text: render_real_width_text(&r),
        json,
    })
}

/// `bench replay`: replay of a whole trace of `tokens` tokens against the
/// reference run that wrote it (best of `repeat`).
pub fn replay(model: &str, tokens: u32, repeat: u32) -> Result<BenchReport, BenchError> {
    let m = moeconf_runner::load_model(model).map_err(step("loading the model"))?;
    let tmp = scratch("moeconf-bench-replay")?;
    eprintln!("moeconf bench replay: {tokens} tokens on {model} (best of {repeat}) ...");
    let b = replay::bench_replay(&m, "why the sheep", tokens, repeat, tmp.path())
        .map_err(step("bench replay"))?;
    let json = json!({
        "schema_version": 1,
        "kind": "moeconf.bench.replay",
        "model": model,
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
    });
    let text = format!(
        "replay of a whole trace vs the run that wrote it: {model} ({} prompt + {} generated tokens, {} units)\n\
         \x20 (a) reference run, --capture replay, to a trace  {:>8.3} s\n\
         \x20 (b) bare forward, no capture                   {:>8.3} s\n\
         \x20 (c) layer replay, 1 thread                     {:>8.3} s   ratio c/a = {:.2}\n\
         \x20 (d) layer replay, {} threads                    {:>8.3} s   ratio d/a = {:.2}\n\
         \x20 (e) teacher forcing                            {:>8.3} s\n\
         \x20 (f) layer replay + measured propagation, 1 t.  {:>8.3} s   ratio f/a = {:.2}\n",
        b.prompt_tokens,
        b.tokens,
        b.units,
        b.run,
        b.bare,
        b.replay_1thread,
        b.replay_1thread / b.run,
        b.threads,
        b.replay_pool,
        b.replay_pool / b.run,
        b.teacher,
        b.replay_measured_1thread,
        b.replay_measured_1thread / b.run
    );
    Ok(BenchReport { text, json })
}
