//! The runtime throughput benchmark (`moeconf bench runtime`): prefill and
//! decode tokens/s of the reference runtime on a model, in both precision
//! profiles, without capture and with the default trace capture, so the
//! cost of tracing is measured against the bare forward in the same run.

use std::path::Path;

use moeconf_contract::NativeCombine;
use moeconf_fingerprint::Algorithm;
use moeconf_reference_runtime::bench::{bench_generate, BenchReport};
use moeconf_reference_runtime::capture::NullSink;
use moeconf_reference_runtime::model::{Model, StepOptions};
use moeconf_reference_runtime::precision::Precision;
use moeconf_schema::{Header, TraceWriter};

use crate::{parse_capture, RunError, TraceSink};

/// What a measured run captures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchCapture {
    /// Nothing (the bare forward).
    None,
    /// The default trace capture (`--capture default`) into a trace file.
    Default,
}

impl BenchCapture {
    /// `none` / `default`.
    pub fn name(self) -> &'static str {
        match self {
            BenchCapture::None => "none",
            BenchCapture::Default => "default",
        }
    }
}

/// Sizes of the runtime benchmark.
#[derive(Debug, Clone, Copy)]
pub struct RuntimeBenchOptions {
    /// Prompt length of the prefill.
    pub prompt_tokens: u32,
    /// Decode steps per measurement.
    pub decode_tokens: u32,
    /// Repetitions per measurement (the best is kept).
    pub repeat: u32,
}

/// The best throughput of one (model, precision, capture) combination.
#[derive(Debug, Clone)]
pub struct RuntimeRow {
    /// The model's display name.
    pub model: String,
    pub precision: Precision,
    pub capture: BenchCapture,
    /// Best prefill tokens per second.
    pub prefill: f64,
    /// Best decode tokens per second.
    pub decode: f64,
    /// For a capturing row: in each repetition, its decode speed divided by
    /// the uncaptured run of the same repetition (run just before it),
    /// sorted. Pairs that ran back to back share the machine's state, so
    /// their median says more on a noisy machine than a ratio of two bests.
    pub paired_vs_none: Vec<f64>,
}

impl RuntimeRow {
    /// The median and quartiles of [`RuntimeRow::paired_vs_none`] (none
    /// for an uncaptured row).
    pub fn paired_quartiles(&self) -> Option<[f64; 3]> {
        let v = &self.paired_vs_none;
        let at = |q: usize| v[(q * (v.len() - 1) + 2) / 4];
        (!v.is_empty()).then(|| [at(1), at(2), at(3)])
    }
}

/// Measures the model in `dir` (named `name` in the rows) in both precision
/// profiles, without and with capture; trace files go to `scratch`.
pub fn bench_runtime(
    name: &str,
    dir: &Path,
    opts: &RuntimeBenchOptions,
    scratch: &Path,
) -> Result<Vec<RuntimeRow>, RunError> {
    let model = Model::load(dir)?;
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..opts.prompt_tokens).map(|i| (i * 37 + 5) % vocab).collect();
    let mut rows = Vec::new();
    for precision in [Precision::Bf16, Precision::F32] {
        let step = StepOptions {
            precision,
            combine: &NativeCombine,
            detokenizer: None,
            allow_non_finite: false,
        };
        // Each repetition runs both captures back to back, so every
        // captured run has an uncaptured partner measured under the same
        // conditions.
        let mut best = [(0.0f64, 0.0f64); 2];
        let mut paired = Vec::new();
        for _ in 0..opts.repeat {
            let mut none_seconds = 0.0;
            for (i, capture) in [BenchCapture::None, BenchCapture::Default]
                .into_iter()
                .enumerate()
            {
                let r = generate(
                    &model,
                    &prompt,
                    opts.decode_tokens as usize,
                    &step,
                    capture,
                    scratch,
                )?;
                best[i].0 = best[i].0.max(r.prefill_tokens_per_second());
                best[i].1 = best[i].1.max(r.decode_tokens_per_second());
                match capture {
                    BenchCapture::None => none_seconds = r.decode_seconds,
                    BenchCapture::Default => paired.push(none_seconds / r.decode_seconds.max(1e-12)),
                }
            }
        }
        paired.sort_by(f64::total_cmp);
        for (i, capture) in [BenchCapture::None, BenchCapture::Default]
            .into_iter()
            .enumerate()
        {
            rows.push(RuntimeRow {
                model: name.to_string(),
                precision,
                capture,
                prefill: best[i].0,
                decode: best[i].1,
                paired_vs_none: if capture == BenchCapture::None {
                    Vec::new()
                } else {
                    paired.clone()
                },
            });
        }
    }
    Ok(rows)
}

/// One timed generation, capturing as `capture` says.
fn generate(
    model: &Model,
    prompt: &[u32],
    decode_tokens: usize,
    step: &StepOptions<'_>,
    capture: BenchCapture,
    scratch: &Path,
) -> Result<BenchReport, RunError> {
    match capture {
        BenchCapture::None => Ok(bench_generate(model, prompt, decode_tokens, step, &mut NullSink)?),
        BenchCapture::Default => {
            let spec = parse_capture(BenchCapture::Default.name())?;
            // Steps 0..=decode_tokens: the writer refuses steps its binding does not allow.
            let mut header = Header::default();
            header.binding.decoding.max_new_tokens = u32::try_from(decode_tokens + 1).unwrap_or(u32::MAX);
            let w = TraceWriter::create(&scratch.join("bench.bin"), Algorithm::Blake3, header)?;
            let mut sink = TraceSink::new(w, spec);
            let r = bench_generate(model, prompt, decode_tokens, step, &mut sink)?;
            sink.finish()?;
            Ok(r)
        }
    }
}

/// The text report of `moeconf bench runtime`: one row per (model,
/// precision, capture) with decode speed relative to the same model and
/// precision without capture; `rss` is the anonymous RSS after the tiny and
/// after the large model.
pub fn render_runtime_text(opts: &RuntimeBenchOptions, rows: &[RuntimeRow], rss: [Option<u64>; 2]) -> String {
    let mut t = format!(
        "reference runtime throughput ({} threads, prompt {} tokens, {} decode steps, best of {}; \
         paired: each repetition's captured run against the uncaptured run just before it, median (quartiles))\n  \
         {:<34} {:<5} {:<8} {:>12} {:>12} {:>16} {:>22}\n",
        rayon::current_num_threads(),
        opts.prompt_tokens,
        opts.decode_tokens,
        opts.repeat,
        "model",
        "prec",
        "capture",
        "prefill t/s",
        "decode t/s",
        "decode vs none",
        "paired vs none"
    );
    for r in rows {
        let base = rows
            .iter()
            .find(|b| b.model == r.model && b.precision == r.precision && b.capture == BenchCapture::None)
            .map_or(r.decode, |b| b.decode);
        let paired = r
            .paired_quartiles()
            .map_or(String::new(), |[q1, m, q3]| format!("{m:.2}x ({q1:.2}-{q3:.2})"));
        t.push_str(&format!(
            "  {:<34} {:<5} {:<8} {:>12.1} {:>12.1} {:>15.2}x {:>22}\n",
            r.model,
            r.precision.name(),
            r.capture.name(),
            r.prefill,
            r.decode,
            r.decode / base,
            paired
        ));
    }
    let mib = |b: Option<u64>| b.map_or("n/a".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0));
    t.push_str(&format!(
        "  anonymous RSS: {} after tiny, {} after large (weights are memory-mapped, not copied)\n",
        mib(rss[0]),
        mib(rss[1])
    ));
    t
}

/// Optional reductions of the real-width checkpoint for quicker runs: fewer
/// routed experts per layer (a decode step still reads k of them, each of
/// the real size) and a smaller vocabulary (a smaller head). `None` keeps
/// V4-Flash's 256 experts and 129280 tokens.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealWidthShrink {
    /// Routed experts per layer.
    pub experts: Option<usize>,
    /// Vocabulary size.
    pub vocab: Option<usize>,
}

/// What `moeconf bench runtime --real-width` measured.
#[derive(Debug, Clone)]
pub struct RealWidthReport {
    /// Decoder layers of the generated checkpoint.
    pub layers: usize,
    /// Their attention kinds (`sliding_attention`, ...).
    pub layer_kinds: Vec<String>,
    /// Bytes of the checkpoint's safetensors files.
    pub checkpoint_bytes: u64,
    /// Seconds spent generating the checkpoint.
    pub generate_seconds: f64,
    /// Weight bytes one decode step reads.
    pub step: moeconf_reference_runtime::bench::StepBytes,
    /// Routed experts per token (k).
    pub experts_per_tok: usize,
    /// Routed experts per layer.
    pub n_routed_experts: usize,
    pub vocab_size: usize,
    /// Read bandwidth, 1 thread (bytes/s).
    pub bandwidth_1thread: f64,
    /// Read bandwidth with the decode's thread count (bytes/s).
    pub bandwidth_threads: f64,
    /// Threads of the decode (rayon).
    pub threads: usize,
    /// Decode tokens/s without capture.
    pub decode_none: f64,
    /// Decode tokens/s with the default capture.
    pub decode_default: f64,
    /// Decode steps per measurement.
    pub decode_tokens: usize,
    /// Anonymous RSS after loading the model, and after the measured runs.
    pub anon_rss: [Option<u64>; 2],
}

impl RealWidthReport {
    /// Bytes per second the default-capture decode moved through the weights.
    pub fn achieved_bytes_per_second(&self) -> f64 {
        self.step.total() as f64 * self.decode_default
    }

    /// Achieved over measured bandwidth (same thread count): the fraction of
    /// the bandwidth bound.
    pub fn fraction_of_bound(&self) -> f64 {
        self.achieved_bytes_per_second() / self.bandwidth_threads.max(1.0)
    }

    /// The bound itself: decode tokens/s if every step only streamed its weights at the
    /// measured bandwidth.
    pub fn bound_tokens_per_second(&self) -> f64 {
        self.bandwidth_threads / (self.step.total().max(1) as f64)
    }
}

/// Bytes of the buffer the bandwidth is measured on: far above the caches
/// (the machine reports a 480 MiB last-level cache).
pub const BANDWIDTH_BUFFER_BYTES: usize = 2 << 30;

/// Reads every file of `dir` once (so the measured decode reads weights
/// from memory, not from disk); returns the bytes read.
fn warm_page_cache(dir: &Path) -> Result<u64, RunError> {
    use std::io::Read;
    let mut total = 0u64;
    let mut buf = vec![0u8; 16 << 20];
    let entries = std::fs::read_dir(dir).map_err(crate::context(format!("listing {}", dir.display())))?;
    for e in entries.flatten() {
        let path = e.path();
        if path.extension().and_then(|x| x.to_str()) != Some("safetensors") {
            continue;
        }
        let mut f = moeconf_output::input::open_input(&path, "model file")
            .map_err(moeconf_schema::InputError::from)?;
        loop {
            let n = f
                .read(&mut buf)
                .map_err(crate::context(format!("reading {}", path.display())))?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    Ok(total)
}

/// `moeconf bench runtime --real-width`: generates a checkpoint of
/// DeepSeek-V4-Flash's per-layer dimensions with `layers` decoder layers
/// (FP8 dense projections, MXFP4 routed experts, [`V4Spec::flash_width`])
/// in `dir`, then measures in one run: the weight bytes of one decode step,
/// the memory read bandwidth (1 thread and the decode's thread count), and
/// decode tokens/s without and with the default capture (best of `repeat`).
///
/// [`V4Spec::flash_width`]: moeconf_fixtures::checkpoint::V4Spec::flash_width
pub fn bench_real_width(
    layers: usize,
    shrink: RealWidthShrink,
    decode_tokens: u32,
    repeat: u32,
    dir: &Path,
    scratch: &Path,
) -> Result<RealWidthReport, RunError> {
    use moeconf_fixtures::checkpoint::{write_v4, V4Spec};
    use moeconf_reference_runtime::bench::{anon_rss_bytes, decode_step_bytes, read_bandwidth};
    let mut spec = V4Spec::flash_width(layers);
    if let Some(e) = shrink.experts {
        spec.n_routed_experts = e.max(spec.experts_per_tok);
    }
    if let Some(v) = shrink.vocab {
        spec.vocab_size = v.max(16);
    }
    let layer_kinds = spec
        .layer_types
        .iter()
        .map(|k| k.config_name().to_string())
        .collect();
    eprintln!(
        "generating {} layers at V4-Flash width in {} ...",
        spec.layer_types.len(),
        dir.display()
    );
    let t = std::time::Instant::now();
    write_v4(dir, &spec).map_err(crate::context("generating the real-width checkpoint"))?;
    let generate_seconds = t.elapsed().as_secs_f64();
    let checkpoint_bytes = warm_page_cache(dir)?;
    let model = Model::load(dir)?;
    let rss_loaded = anon_rss_bytes();
    let step = decode_step_bytes(&model);
    let threads = rayon::current_num_threads();
    eprintln!("measuring the memory read bandwidth ...");
    let bandwidth_1thread = read_bandwidth(BANDWIDTH_BUFFER_BYTES, 1, 3);
    let bandwidth_threads = if threads > 1 {
        read_bandwidth(BANDWIDTH_BUFFER_BYTES, threads, 3)
    } else {
        bandwidth_1thread
    };
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..4u32).map(|i| (i * 7919 + 11) % vocab).collect();
    let opts = StepOptions {
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let (mut decode_none, mut decode_default) = (0.0f64, 0.0f64);
    for _ in 0..repeat.max(1) {
        for capture in [BenchCapture::None, BenchCapture::Default] {
            eprintln!("decoding {decode_tokens} tokens, capture {} ...", capture.name());
            let r = generate(&model, &prompt, decode_tokens as usize, &opts, capture, scratch)?;
            let v = r.decode_tokens_per_second();
            match capture {
                BenchCapture::None => decode_none = decode_none.max(v),
                BenchCapture::Default => decode_default = decode_default.max(v),
            }
        }
    }
    Ok(RealWidthReport {
        layers: spec.layer_types.len(),
        layer_kinds,
        checkpoint_bytes,
        generate_seconds,
        step,
        experts_per_tok: model.config().experts_per_tok,
        n_routed_experts: model.config().n_routed_experts,
        vocab_size: model.config().vocab_size,
        bandwidth_1thread,
        bandwidth_threads,
        threads,
        decode_none,
        decode_default,
        decode_tokens: decode_tokens as usize,
        anon_rss: [rss_loaded, anon_rss_bytes()],
    })
}

/// The text report of `moeconf bench runtime --real-width`.
pub fn render_real_width_text(r: &RealWidthReport) -> String {
    let gb = |b: f64| b / 1e9;
    let mib = |b: Option<u64>| b.map_or("n/a".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0));
    let s = &r.step;
    format!(
        "real-width decode (V4-Flash per-layer dimensions, {} layers: {}; FP8 dense, {} MXFP4 experts per layer; vocabulary {}; {} threads)\n\
         \x20 checkpoint: {:.2} GB, generated in {:.1} s\n\
         \x20 weights read per decode step: {:.3} GB (layers without routed experts {:.3}, {} routed experts per layer {:.3}, head + embedding row {:.3})\n\
         \x20 memory read bandwidth: {:.2} GB/s (1 thread), {:.2} GB/s ({} threads)\n\
         \x20 decode: {:.3} tok/s without capture, {:.3} tok/s with the default capture ({} steps, best of runs)\n\
         \x20 bandwidth bound: {:.3} tok/s; achieved {:.2} GB/s = {:.1}% of the bound (default capture)\n\
         \x20 anonymous RSS: {} after loading, {} after decoding ({:.2} GB of routed experts stay in the memory map)\n",
        r.layers,
        r.layer_kinds.join(", "),
        r.n_routed_experts,
        r.vocab_size,
        r.threads,
        gb(r.checkpoint_bytes as f64),
        r.generate_seconds,
        gb(s.total() as f64),
        gb(s.layers_dense as f64),
        r.experts_per_tok,
        gb(s.routed_experts as f64),
        gb(s.head_and_embedding as f64),
        gb(r.bandwidth_1thread),
        gb(r.bandwidth_threads),
        r.threads,
        r.decode_none,
        r.decode_default,
        r.decode_tokens,
        r.bound_tokens_per_second(),
        gb(r.achieved_bytes_per_second()),
        100.0 * r.fraction_of_bound(),
        mib(r.anon_rss[0]),
        mib(r.anon_rss[1]),
        gb(s.all_routed_experts as f64),
    )
}
