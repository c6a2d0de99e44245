//! The runtime throughput benchmark (`moeconf bench runtime`): prefill and
//! decode tokens/s of the reference runtime on a model, in both precision
//! profiles, without capture and with the default trace capture, so the
//! cost of tracing is measured against the bare forward in the same run.
//! Each generation is timed around the runtime's public `Model::step`
//! ([`bench_generate`]); the default capture is `moeconf run`'s own:
//! `moeconf-runner`'s public `parse_capture` and `TraceSink` feeding a
//! `TraceWriter`.

use std::path::Path;
use std::time::Instant;

use moeconf_contract::NativeCombine;
use moeconf_fingerprint::Algorithm;
use moeconf_reference_runtime::capture::{CaptureSink, NullSink};
use moeconf_reference_runtime::error::RuntimeError;
use moeconf_reference_runtime::model::{Model, StepOptions};
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::{parse_capture, RunError, TraceSink};
use moeconf_schema::{Header, TraceWriter};

/// Measured throughput of one generation: the prefill step and the
/// decode steps timed separately (wall clock; reported, never asserted).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerateTiming {
    /// Prompt tokens consumed by the prefill step.
    pub prefill_tokens: usize,
    /// Seconds spent in the prefill step.
    pub prefill_seconds: f64,
    /// Decode steps run (one token each).
    pub decode_tokens: usize,
    /// Seconds spent in the decode steps.
    pub decode_seconds: f64,
}

impl GenerateTiming {
    /// Prefill tokens per second.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill_seconds.max(1e-12)
    }
    /// Decode tokens per second.
    pub fn decode_tokens_per_second(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_seconds.max(1e-12)
    }
}

/// Runs a prefill over `prompt_ids` and `decode_tokens` decode steps, capturing
/// into `sink`, and times both phases.
pub fn bench_generate(
    model: &Model,
    prompt_ids: &[u32],
    decode_tokens: usize,
    opts: &StepOptions<'_>,
    sink: &mut dyn CaptureSink,
) -> Result<GenerateTiming, RuntimeError> {
    let mut state = model.new_state();
    let t0 = Instant::now();
    let mut next = model.step(&mut state, prompt_ids, opts, sink)?.next_token;
    let t1 = Instant::now();
    for _ in 0..decode_tokens {
        next = model.step(&mut state, &[next], opts, sink)?.next_token;
    }
    let t2 = Instant::now();
    Ok(GenerateTiming {
        prefill_tokens: prompt_ids.len(),
        prefill_seconds: (t1 - t0).as_secs_f64(),
        decode_tokens,
        decode_seconds: (t2 - t1).as_secs_f64(),
    })
}

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
    /// Precision profile.
    pub precision: Precision,
    /// What was captured.
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
        crate::measure::quartiles(&self.paired_vs_none)
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

/// One timed generation, capturing as `capture` says (also the decode
/// measurement of `crate::real_width`).
pub(crate) fn generate(
    model: &Model,
    prompt: &[u32],
    decode_tokens: usize,
    step: &StepOptions<'_>,
    capture: BenchCapture,
    scratch: &Path,
) -> Result<GenerateTiming, RunError> {
    match capture {
        BenchCapture::None => Ok(bench_generate(model, prompt, decode_tokens, step, &mut NullSink)?),
        BenchCapture::Default => {
            let spec = parse_capture(BenchCapture::Default.name())?;
            // Steps 0..=decode_tokens: the writer refuses steps its binding does not allow.
            let mut header = Header::default();
            header.binding.decoding.max_new_tokens = u32::try_from(decode_tokens + 1).unwrap_or(u32::MAX);
            let w = TraceWriter::create(&scratch.join("bench.bin"), Algorithm::Blake3, header)?;
            let mut sink = TraceSink::new(w, spec).for_model(model);
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
