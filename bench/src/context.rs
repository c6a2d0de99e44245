//! The long-context benchmark (`moeconf bench runtime --context N`): what
//! the default trace capture costs once the context is long. For each
//! context length N, a prompt of N tokens is prefilled and a fixed number of
//! decode steps run, alternately without capture and with `moeconf run`'s
//! default capture (the writer on its own thread, the growing state digested
//! incrementally, docs/format.md §4.5); each captured run is paired with the
//! uncaptured run just before it. Reported per context: tokens/s of both
//! phases, the paired cost ratio (captured seconds / uncaptured seconds),
//! the bytes each decode step adds to the trace (from the file's own step
//! blocks), the bytes of growing state hashed per decode step, and memory.
//! Nothing here is asserted: it is measured and printed.
//!
//! Each run may be a process of its own ([`ContextBenchOptions::exe`], what
//! `moeconf bench` does): on the 2-vCPU machines we measure on, one process
//! keeps the cost it drew for the whole invocation (two invocations of the
//! same build gave 1.09 and 1.23 at 4,096 tokens; the writer's batches and
//! the forward's buffers land in the caches differently per process), so
//! pairs within one process sample one draw; fresh processes sample them all,
//! as users' runs do.
//!
//! With [`ContextBenchOptions::interleave`] (`moeconf bench`'s default;
//! `--separate-runs` turns it off) each pair is instead one process
//! holding both runs, their decode steps advanced in turn a few at a time
//! ([`interleaved_run`]): the machine's speed drifts within seconds on shared
//! hosts, and segments milliseconds apart see the same machine while runs
//! one after the other do not. The pairs are still processes of their own.

use std::path::{Path, PathBuf};
use std::time::Instant;

use moeconf_contract::NativeCombine;
use moeconf_fingerprint::Algorithm;
use moeconf_reference_runtime::capture::{CaptureSink, NullSink};
use moeconf_reference_runtime::error::RuntimeError;
use moeconf_reference_runtime::model::{Model, StepOptions, StepOutput};
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::state::DecodeState;
use moeconf_runner::{limits, parse_capture, RunError, TraceSink};
use moeconf_schema::{Header, Trace, TraceError, TraceWriter};

use crate::measure;
use crate::runtime::{BenchCapture, GenerateTiming};

/// The cost ratio the issue sets as the target for the default capture:
/// captured seconds at most 1.10 × uncaptured seconds at the median.
pub const TARGET_COST: f64 = 1.10;

/// Sizes of the long-context benchmark.
#[derive(Debug, Clone)]
pub struct ContextBenchOptions {
    /// Context lengths (prompt tokens) to measure, in order.
    pub contexts: Vec<u32>,
    /// Decode steps after each prefill.
    pub decode_tokens: u32,
    /// Alternated (uncaptured, captured) pairs per context.
    pub repeat: u32,
    /// Prefill in chunks of this many tokens (`None`: the whole prompt at once).
    pub prefill_chunk: Option<u32>,
    /// Runs each measured run in a new process of this executable (`moeconf
    /// bench runtime --context-child`, [`one_run`]); `None`: in this process.
    pub exe: Option<PathBuf>,
    /// Each pair is one process holding both runs, their decode steps
    /// interleaved in segments ([`interleaved_run`]; `moeconf bench`'s
    /// default), instead of two runs one after the other (`--separate-runs`).
    pub interleave: bool,
}

/// Decode steps in each segment of an interleaved pair ([`interleaved_run`]).
pub const SEGMENT_STEPS: u32 = 8;

/// What one interleaved pair measured ([`interleaved_run`]): the line a
/// `--context-child N --child-capture interleaved` process prints.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct InterleavedRun {
    /// Prefill seconds, uncaptured and captured: the uncaptured prefill
    /// runs before and after the captured one, and its figure is their mean.
    pub prefill_seconds: [f64; 2],
    /// Seconds of the whole decode phase, every segment (the first, which
    /// finishes the prefill's blocks in the writer, included).
    pub phase_seconds: [f64; 2],
    /// Per counted segment, captured seconds / uncaptured seconds, in run order.
    pub segment_cost: Vec<f64>,
    /// As [`OneRun`]'s, of the captured run.
    pub growing_records: u64,
    pub growing_hashed_bytes: u64,
    /// Peak resident memory of the process (both runs' state).
    pub peak_rss_bytes: Option<u64>,
}

impl InterleavedRun {
    /// The median of the segments' cost ratios: the pair's decode cost.
    pub fn median_segment_cost(&self) -> Option<f64> {
        let mut v = self.segment_cost.clone();
        v.sort_by(f64::total_cmp);
        measure::quartiles(&v).map(|[_, m, _]| m)
    }
}

/// What one measured run (prefill and decode, captured or not) took: the
/// line a `--context-child` process prints.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct OneRun {
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// The median decode step's seconds.
    pub median_step_seconds: f64,
    /// Growing-state records digested incrementally and the bytes the
    /// runtime's thread read again for them (captured runs).
    pub growing_records: u64,
    pub growing_hashed_bytes: u64,
    /// Peak resident memory of the process that ran it.
    pub peak_rss_bytes: Option<u64>,
}

/// What one context length measured.
#[derive(Debug, Clone)]
pub struct ContextRow {
    /// Prompt tokens (the context the decode steps run at).
    pub context: u32,
    /// Best prefill tokens/s, uncaptured and captured.
    pub prefill: [f64; 2],
    /// Best decode tokens/s, uncaptured and captured.
    pub decode: [f64; 2],
    /// Per pair, captured prefill seconds / uncaptured prefill seconds, sorted.
    pub prefill_cost: Vec<f64>,
    /// Per pair, the captured run's median decode-step seconds / the
    /// uncaptured run's, sorted (a step's median: the first decode step
    /// also finishes the prefill step's blocks in the writer, a cost of the
    /// prefill that a phase total would charge to the decode).
    pub decode_cost: Vec<f64>,
    /// Per pair, captured decode-phase seconds / uncaptured, sorted (the
    /// whole phase, the prefill's tail included).
    pub decode_phase_cost: Vec<f64>,
    /// Per pair, the whole run's ratio (prefill and decode phase), sorted.
    pub run_cost: Vec<f64>,
    /// Bytes of the trace's prefill part (step 0, with the file's header).
    pub prefill_bytes: u64,
    /// Bytes each decode step added to the trace: least, median, most.
    pub step_bytes: [u64; 3],
    /// Size of the whole trace.
    pub trace_bytes: u64,
    /// Records of growing state digested incrementally in the captured run.
    pub growing_records: u64,
    /// Bytes of growing state the runtime's thread read again per forward
    /// step (prefill included): for the writer thread's verification sweep.
    pub growing_hashed_per_step: f64,
    /// This process's peak resident memory after the context's runs.
    pub peak_rss: Option<u64>,
}

/// Whether the decode cost per step meets [`TARGET_COST`], from the pairs'
/// 95 % interval of the median ([`measure::median_interval95`]): met when
/// the whole interval is at or below the target, not met when it is all
/// above, undecided when it holds the target (more pairs decide). Below 6
/// pairs there is no interval, and the median alone answers, saying so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetVerdict {
    Met,
    NotMet,
    Undecided,
    MedianMet,
    MedianNotMet,
}

impl TargetVerdict {
    /// The verdict on sorted cost ratios; `None` without any.
    pub fn of(sorted: &[f64]) -> Option<TargetVerdict> {
        let [_, median, _] = measure::quartiles(sorted)?;
        Some(match measure::median_interval95(sorted) {
            Some((_, hi)) if hi <= TARGET_COST => TargetVerdict::Met,
            Some((lo, _)) if lo > TARGET_COST => TargetVerdict::NotMet,
            Some(_) => TargetVerdict::Undecided,
            None if median <= TARGET_COST => TargetVerdict::MedianMet,
            None => TargetVerdict::MedianNotMet,
        })
    }

    /// The JSON value.
    pub fn name(self) -> &'static str {
        match self {
            TargetVerdict::Met => "met",
            TargetVerdict::NotMet => "not_met",
            TargetVerdict::Undecided => "undecided",
            TargetVerdict::MedianMet => "median_met",
            TargetVerdict::MedianNotMet => "median_not_met",
        }
    }

    /// The text report's words.
    fn text(self, pairs: usize) -> String {
        match self {
            TargetVerdict::Met => "target met (the whole 95 % interval of the median)".into(),
            TargetVerdict::NotMet => "target NOT met (the whole 95 % interval of the median)".into(),
            TargetVerdict::Undecided => format!(
                "target undecided: the 95 % interval of the median holds {TARGET_COST:.2}x at {pairs} pairs \
                 (more pairs, --repeat, decide)"
            ),
            TargetVerdict::MedianMet => {
                "target met at the median (fewer than 6 pairs: no 95 % interval)".into()
            }
            TargetVerdict::MedianNotMet => {
                "target NOT met at the median (fewer than 6 pairs: no 95 % interval)".into()
            }
        }
    }
}

impl ContextRow {
    /// The decode cost per step against the target ([`TargetVerdict`]).
    pub fn decode_verdict(&self) -> Option<TargetVerdict> {
        TargetVerdict::of(&self.decode_cost)
    }
    /// Median (quartiles) of the decode cost ratio.
    pub fn decode_quartiles(&self) -> Option<[f64; 3]> {
        measure::quartiles(&self.decode_cost)
    }
    /// Median (quartiles) of the decode-phase cost ratio.
    pub fn decode_phase_quartiles(&self) -> Option<[f64; 3]> {
        measure::quartiles(&self.decode_phase_cost)
    }
    /// Median (quartiles) of the whole run's cost ratio.
    pub fn run_quartiles(&self) -> Option<[f64; 3]> {
        measure::quartiles(&self.run_cost)
    }
    /// Median (quartiles) of the prefill cost ratio.
    pub fn prefill_quartiles(&self) -> Option<[f64; 3]> {
        measure::quartiles(&self.prefill_cost)
    }
}

/// A deterministic prompt of `n` ids below `vocab`.
fn prompt_of(n: u32, vocab: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (i.wrapping_mul(37).wrapping_add(5)) % vocab.max(1))
        .collect()
}

/// One timed generation: the prefill (chunked if asked) and `decode` steps,
/// with the median decode step's seconds.
fn timed(
    model: &Model,
    prompt: &[u32],
    decode: u32,
    opts: &StepOptions<'_>,
    chunk: Option<u32>,
    sink: &mut dyn CaptureSink,
) -> Result<(GenerateTiming, f64), RuntimeError> {
    let mut state = model.new_state();
    let t0 = Instant::now();
    let mut next = prefill(model, &mut state, prompt, opts, chunk, sink)?.next_token;
    let t1 = Instant::now();
    let mut steps = Vec::with_capacity(decode as usize);
    for _ in 0..decode {
        let t = Instant::now();
        next = model.step(&mut state, &[next], opts, sink)?.next_token;
        steps.push(t.elapsed().as_secs_f64());
    }
    let t2 = Instant::now();
    steps.sort_by(f64::total_cmp);
    let median = measure::quartiles(&steps).map_or(0.0, |[_, m, _]| m);
    Ok((
        GenerateTiming {
            prefill_tokens: prompt.len(),
            prefill_seconds: (t1 - t0).as_secs_f64(),
            decode_tokens: decode as usize,
            decode_seconds: (t2 - t1).as_secs_f64(),
        },
        median,
    ))
}

/// The prompt's forward: whole, or in chunks of `chunk` tokens.
fn prefill(
    model: &Model,
    state: &mut DecodeState,
    prompt: &[u32],
    opts: &StepOptions<'_>,
    chunk: Option<u32>,
    sink: &mut dyn CaptureSink,
) -> Result<StepOutput, RuntimeError> {
    match chunk {
        Some(c) => model.step_chunked(state, prompt, opts, c as usize, sink),
        None => model.step(state, prompt, opts, sink),
    }
}

/// What the captured run's trace holds: per-step bytes from its step blocks.
struct TraceBytes {
    prefill: u64,
    steps: Vec<u64>,
    total: u64,
}

fn trace_bytes(path: &Path) -> Result<TraceBytes, RunError> {
    let t = Trace::open(path)?;
    let ends: Vec<u64> = (0..t.steps().len())
        .map(|k| t.step_block_extent(k).map(|(o, l)| o.saturating_add(l)))
        .collect::<Option<_>>()
        .ok_or_else(|| RunError::Invalid(format!("{}: no step blocks (format version 1)", path.display())))?;
    let mut steps: Vec<u64> = ends.windows(2).map(|w| w[1].saturating_sub(w[0])).collect();
    steps.sort_unstable();
    Ok(TraceBytes {
        prefill: ends.first().copied().unwrap_or(0),
        steps,
        total: t.file_len(),
    })
}

/// Measures `builtin:tiny-v4` (in `dir`) at each context of `opts` in the
/// bf16 profile; traces go to `scratch` (one file, replaced per run).
/// `progress` receives one line per run.
pub fn bench_context(
    dir: &Path,
    opts: &ContextBenchOptions,
    scratch: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<ContextRow>, RunError> {
    if opts.interleave {
        segments_of(opts.decode_tokens)?;
    }
    let model = Model::load(dir)?;
    let path = scratch.join("bench-context.bin");
    // Every context must fit before any runs.
    for &n in &opts.contexts {
        check_fits(&model, n, opts.decode_tokens, opts.prefill_chunk, opts.interleave)?;
    }
    drop(model);
    let mut rows = Vec::new();
    for &n in &opts.contexts {
        let mut best = [[0.0f64; 2]; 2];
        let (mut prefill_cost, mut decode_cost, mut decode_phase_cost) = (Vec::new(), Vec::new(), Vec::new());
        let mut run_cost = Vec::new();
        let (mut last, mut peak_rss) = (None, None);
        for r in 0..opts.repeat {
            let pair = if opts.interleave {
                progress(&format!(
                    "context {n}: pair {}/{}: both runs in one process, decode steps interleaved ...",
                    r + 1,
                    opts.repeat
                ));
                let run = match &opts.exe {
                    Some(exe) => child_run(exe, n, opts, "interleaved", &path)?,
                    None => interleaved_run(dir, n, opts.decode_tokens, opts.prefill_chunk, &path)?,
                };
                Pair::interleaved(n, opts.decode_tokens, &run)?
            } else {
                let mut runs = [None; 2];
                for (i, capture) in [BenchCapture::None, BenchCapture::Default]
                    .into_iter()
                    .enumerate()
                {
                    progress(&format!(
                        "context {n}: pair {}/{}: {} ...",
                        r + 1,
                        opts.repeat,
                        match capture {
                            BenchCapture::None => "without capture",
                            BenchCapture::Default => "with the default capture",
                        }
                    ));
                    runs[i] = Some(match &opts.exe {
                        Some(exe) => child_run(exe, n, opts, capture.name(), &path)?,
                        None => one_run(dir, n, opts.decode_tokens, opts.prefill_chunk, capture, &path)?,
                    });
                }
                let [Some(none), Some(with)] = runs else {
                    continue;
                };
                Pair::of_processes(n, opts.decode_tokens, &none, &with)
            };
            peak_rss = peak_rss.max(pair.peak_rss);
            for (b, now) in best.iter_mut().zip([pair.prefill, pair.decode]) {
                b[0] = b[0].max(now[0]);
                b[1] = b[1].max(now[1]);
            }
            prefill_cost.push(pair.prefill_cost);
            decode_cost.push(pair.decode_cost);
            decode_phase_cost.push(pair.decode_phase_cost);
            run_cost.push(pair.run_cost);
            last = Some(pair.growing);
        }
        let bytes = trace_bytes(&path)?;
        let _ = std::fs::remove_file(&path);
        prefill_cost.sort_by(f64::total_cmp);
        decode_cost.sort_by(f64::total_cmp);
        decode_phase_cost.sort_by(f64::total_cmp);
        run_cost.sort_by(f64::total_cmp);
        let (growing_records, hashed) = last.unwrap_or((0, 0));
        let s = &bytes.steps;
        rows.push(ContextRow {
            context: n,
            prefill: best[0],
            decode: best[1],
            prefill_cost,
            decode_cost,
            decode_phase_cost,
            run_cost,
            prefill_bytes: bytes.prefill,
            step_bytes: match s.len() {
                0 => [0; 3],
                k => [s[0], s[k / 2], s[k - 1]],
            },
            trace_bytes: bytes.total,
            growing_records,
            growing_hashed_per_step: hashed as f64 / f64::from(opts.decode_tokens.saturating_add(1)),
            peak_rss,
        });
    }
    Ok(rows)
}

/// `count` per second in `seconds`.
fn per_second(count: f64, seconds: f64) -> f64 {
    count / seconds.max(1e-12)
}

/// The captured side's seconds over the uncaptured side's, `[uncaptured, captured]`.
fn ratio([uncaptured, captured]: [f64; 2]) -> f64 {
    captured / uncaptured.max(1e-12)
}

/// What one pair of runs measured, either way ([`ContextBenchOptions::interleave`]).
struct Pair {
    /// Tokens/s, uncaptured and captured.
    prefill: [f64; 2],
    decode: [f64; 2],
    prefill_cost: f64,
    decode_cost: f64,
    decode_phase_cost: f64,
    run_cost: f64,
    growing: (u64, u64),
    peak_rss: Option<u64>,
}

impl Pair {
    /// Two processes: the decode cost is the ratio of their median steps.
    fn of_processes(n: u32, decode: u32, none: &OneRun, with: &OneRun) -> Pair {
        let of = |a: f64, b: f64| ratio([a, b]);
        Pair {
            prefill: [none, with].map(|o| per_second(f64::from(n), o.prefill_seconds)),
            decode: [none, with].map(|o| per_second(f64::from(decode), o.decode_seconds)),
            prefill_cost: of(none.prefill_seconds, with.prefill_seconds),
            decode_cost: of(none.median_step_seconds, with.median_step_seconds),
            decode_phase_cost: of(none.decode_seconds, with.decode_seconds),
            run_cost: of(
                none.prefill_seconds + none.decode_seconds,
                with.prefill_seconds + with.decode_seconds,
            ),
            growing: (with.growing_records, with.growing_hashed_bytes),
            peak_rss: none.peak_rss_bytes.max(with.peak_rss_bytes),
        }
    }

    /// One process: the decode cost is the median of its segments' ratios.
    /// Refuses a run without counted segments or with a time that is not a
    /// positive number (a child process's line is read back).
    fn interleaved(n: u32, decode: u32, run: &InterleavedRun) -> Result<Pair, RunError> {
        let times = run
            .prefill_seconds
            .iter()
            .chain(&run.phase_seconds)
            .chain(&run.segment_cost);
        if run.segment_cost.is_empty() || !times.into_iter().all(|t| t.is_finite() && *t > 0.0) {
            return Err(RunError::Invalid(format!(
                "the interleaved pair at context {n} measured no counted segment or a time that is not a \
                 positive number: {run:?}"
            )));
        }
        Ok(Pair {
            prefill: run.prefill_seconds.map(|s| per_second(f64::from(n), s)),
            decode: run.phase_seconds.map(|s| per_second(f64::from(decode), s)),
            prefill_cost: ratio(run.prefill_seconds),
            decode_cost: run.median_segment_cost().unwrap_or(f64::NAN),
            decode_phase_cost: ratio(run.phase_seconds),
            run_cost: ratio([0, 1].map(|i| run.prefill_seconds[i] + run.phase_seconds[i])),
            growing: (run.growing_records, run.growing_hashed_bytes),
            peak_rss: run.peak_rss_bytes,
        })
    }
}

/// Both runs at context `n` in this one process: the prompt prefilled
/// without capture, then with the default capture into `trace`, then
/// without capture again (the baseline the mean of the two), then their
/// decode steps advanced in turn, [`SEGMENT_STEPS`] at a time, the order
/// swapped every segment (uncaptured first, then captured first, ...). The
/// first segment (with the remainder of `decode` over whole segments) is
/// not counted: it finishes the prefill's blocks in the writer.
///
/// Why: on a shared machine the speed of the whole machine drifts within
/// seconds (docs/performance.md: one process's uncaptured segments went
/// from 46 to 66 ms in the middle of a run), so two runs measured one
/// after the other compare the drift as much as the capture; segments
/// milliseconds apart see the same machine. Every pair is still a process
/// of its own, so the pairs sample what each process draws.
pub fn interleaved_run(
    dir: &Path,
    n: u32,
    decode: u32,
    prefill_chunk: Option<u32>,
    trace: &Path,
) -> Result<InterleavedRun, RunError> {
    let segments = segments_of(decode)?;
    let model = Model::load(dir)?;
    check_fits(&model, n, decode, prefill_chunk, true)?;
    let prompt = prompt_of(n, model.config().vocab_size as u32);
    let opts = bf16_step();
    let mut sink = default_sink(&model, dir, decode, trace)?;
    let mut none = NullSink;
    let timed_prefill =
        |state: &mut DecodeState, sink: &mut dyn CaptureSink| -> Result<(u32, f64), RunError> {
            let t = Instant::now();
            let next = prefill(&model, state, &prompt, &opts, prefill_chunk, sink)?.next_token;
            Ok((next, t.elapsed().as_secs_f64()))
        };
    // Uncaptured, captured, uncaptured again (a new state, the first one
    // dropped): the two uncaptured prefills' mean is the baseline, so a
    // drift of the machine's speed that is linear over the three cancels.
    let mut states = [model.new_state(), model.new_state()];
    let (_, plain_before) = timed_prefill(&mut states[0], &mut none)?;
    let (captured_next, captured) = timed_prefill(&mut states[1], &mut sink)?;
    states[0] = model.new_state();
    let (plain_next, plain_after) = timed_prefill(&mut states[0], &mut none)?;
    let mut next = [plain_next, captured_next];
    let prefill_seconds = [(plain_before + plain_after) / 2.0, captured];
    let first = SEGMENT_STEPS + decode % SEGMENT_STEPS;
    let mut phase_seconds = [0.0; 2];
    let mut segment_cost = Vec::with_capacity(segments as usize);
    for k in 0..segments {
        let steps = if k == 0 { first } else { SEGMENT_STEPS };
        let mut seconds = [0.0; 2];
        let order = if k % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let sink: &mut dyn CaptureSink = if i == 0 { &mut none } else { &mut sink };
            let t = Instant::now();
            for _ in 0..steps {
                next[i] = model.step(&mut states[i], &[next[i]], &opts, sink)?.next_token;
            }
            seconds[i] = t.elapsed().as_secs_f64();
        }
        phase_seconds[0] += seconds[0];
        phase_seconds[1] += seconds[1];
        if k > 0 {
            segment_cost.push(seconds[1] / seconds[0].max(1e-12));
        }
    }
    let growing = (sink.growing_records(), sink.growing_hashed_bytes());
    sink.finish()?;
    Ok(InterleavedRun {
        prefill_seconds,
        phase_seconds,
        segment_cost,
        growing_records: growing.0,
        growing_hashed_bytes: growing.1,
        peak_rss_bytes: measure::peak_rss_bytes(),
    })
}

/// The bench's forward: the bf16 profile, the native combine.
fn bf16_step() -> StepOptions<'static> {
    StepOptions {
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    }
}

/// The default capture into a new trace at `trace`, for a prefill and
/// `decode` decode steps; `trace` must not be one of the model's files in
/// `dir` (the hidden `--context-child` takes the path from its command line).
fn default_sink(model: &Model, dir: &Path, decode: u32, trace: &Path) -> Result<TraceSink, RunError> {
    let mut inputs = moeconf_output::Inputs::new();
    inputs.dir_files(dir, "model file");
    let out = moeconf_output::check_output(trace, &inputs).map_err(TraceError::from)?;
    let mut header = Header::default();
    header.binding.decoding.max_new_tokens = decode.saturating_add(1);
    let w = TraceWriter::create_checked(&out, Algorithm::Blake3, header)?;
    Ok(TraceSink::new(w, parse_capture(BenchCapture::Default.name())?).for_model(model))
}

/// The segments of `decode` interleaved steps, the first one included;
/// refused below two.
fn segments_of(decode: u32) -> Result<u32, RunError> {
    if decode < 2 * SEGMENT_STEPS {
        return Err(RunError::Invalid(format!(
            "interleaved pairs need at least {} decode steps (--decode-tokens): a first segment of \
             {SEGMENT_STEPS} that is not counted and at least one that is; {decode} given (--separate-runs \
             measures fewer)",
            2 * SEGMENT_STEPS
        )));
    }
    Ok(decode / SEGMENT_STEPS)
}

/// One measured run at context `n` in this process: the fixture in `dir`
/// loaded, a prompt of `n` tokens prefilled and `decode` steps decoded,
/// without capture or with the default capture into `trace` (finished, so
/// that its step blocks can be read).
pub fn one_run(
    dir: &Path,
    n: u32,
    decode: u32,
    prefill_chunk: Option<u32>,
    capture: BenchCapture,
    trace: &Path,
) -> Result<OneRun, RunError> {
    let model = Model::load(dir)?;
    // Refused before it runs, as the parent refuses the whole benchmark.
    check_fits(&model, n, decode, prefill_chunk, false)?;
    let prompt = prompt_of(n, model.config().vocab_size as u32);
    let step = bf16_step();
    let (t, median, growing) = match capture {
        BenchCapture::None => {
            let (t, m) = timed(&model, &prompt, decode, &step, prefill_chunk, &mut NullSink)?;
            (t, m, (0, 0))
        }
        BenchCapture::Default => {
            let mut sink = default_sink(&model, dir, decode, trace)?;
            let (t, m) = timed(&model, &prompt, decode, &step, prefill_chunk, &mut sink)?;
            let growing = (sink.growing_records(), sink.growing_hashed_bytes());
            sink.finish()?;
            (t, m, growing)
        }
    };
    Ok(OneRun {
        prefill_seconds: t.prefill_seconds,
        decode_seconds: t.decode_seconds,
        median_step_seconds: median,
        growing_records: growing.0,
        growing_hashed_bytes: growing.1,
        peak_rss_bytes: measure::peak_rss_bytes(),
    })
}

/// Refuses a run at context `n` with `decode` steps that the default
/// capture's memory estimate says would not fit (`both`: an interleaved
/// pair, two runs' state in one process).
fn check_fits(
    model: &Model,
    n: u32,
    decode: u32,
    prefill_chunk: Option<u32>,
    both: bool,
) -> Result<(), RunError> {
    let (n, new) = (u64::from(n), u64::from(decode) + 1);
    let spec = parse_capture(BenchCapture::Default.name())?;
    let mut estimate = limits::estimate_memory(model.config(), n, new, spec, prefill_chunk.map(u64::from));
    if both {
        estimate.state = estimate.state.saturating_mul(2);
    }
    limits::check_memory_for(
        limits::Sizing::BenchContext,
        &estimate,
        limits::available_memory(),
        n,
        new,
    )
}

/// [`one_run`] in a new process: `exe bench runtime --context-child N
/// --child-capture C --child-trace PATH ...`, which prints the run as one
/// JSON line.
fn child_run<T: serde::de::DeserializeOwned>(
    exe: &Path,
    n: u32,
    opts: &ContextBenchOptions,
    capture: &str,
    trace: &Path,
) -> Result<T, RunError> {
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["bench", "runtime", "--context-child"])
        .arg(n.to_string())
        .args(["--child-capture", capture, "--decode-tokens"])
        .arg(opts.decode_tokens.to_string())
        .arg("--child-trace")
        .arg(trace);
    if let Some(c) = opts.prefill_chunk {
        cmd.arg("--prefill-chunk").arg(c.to_string());
    }
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| RunError::Invalid(format!("starting {}: {e}", exe.display())))?;
    if !out.status.success() {
        return Err(RunError::Invalid(format!(
            "the run at context {n} ({} capture) in a child process of {} failed ({})",
            capture,
            exe.display(),
            out.status
        )));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).map_err(|e| {
        RunError::Invalid(format!(
            "the run at context {n} in a child process of {} printed no run ({e}): {:?}",
            exe.display(),
            line.chars().take(200).collect::<String>()
        ))
    })
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / 1048576.0)
}

fn median_text(q: Option<[f64; 3]>) -> String {
    q.map_or("n/a".into(), |[a, m, b]| format!("{m:.3}x ({a:.3}-{b:.3})"))
}

/// The text report.
pub fn render_context_text(opts: &ContextBenchOptions, rows: &[ContextRow]) -> String {
    let mut t = format!(
        "long-context capture cost (builtin:tiny-v4, bf16, runtime threads: {}, {} decode steps after a prefill of \
         the context, {} alternated pairs{}{}; cost = seconds with the default capture / seconds without, \
         per pair, median (quartiles), for decode {}; target <= {TARGET_COST:.2}x)\n",
        rayon::current_num_threads(),
        opts.decode_tokens,
        opts.repeat,
        match (opts.interleave, opts.exe.is_some()) {
            (true, true) => ", each pair a process of its own holding both runs",
            (true, false) => ", each pair both runs in this process",
            (false, true) => ", each run a process of its own",
            (false, false) => "",
        },
        opts.prefill_chunk
            .map_or(String::new(), |c| format!(", prefill in chunks of {c}")),
        if opts.interleave {
            format!(
                "of the median of each pair's segment ratios (decode steps interleaved {SEGMENT_STEPS} at a time, \
                 the first segment not counted)"
            )
        } else {
            "of the median step".into()
        },
    );
    for r in rows {
        let interval = measure::median_interval95(&r.decode_cost).map_or(String::new(), |(lo, hi)| {
            format!(", 95 % interval of the median {lo:.3}-{hi:.3}")
        });
        let verdict = r
            .decode_verdict()
            .map_or("target n/a".into(), |v| v.text(r.decode_cost.len()));
        t.push_str(&format!(
            "  context {:>7}\n    decode   {:>9.1} t/s without, {:>9.1} t/s with capture; cost per step {}{} — {}; \
             whole phase {}\n    \
             prefill  {:>9.1} t/s without, {:>9.1} t/s with capture; cost {}; whole run (prefill and decode) {}\n    \
             trace    {} per decode step (least {}, most {}); prefill part {}; whole trace {}\n    \
             growing  {} records digested incrementally, {} re-read per step for the sweep; peak RSS {}\n",
            r.context,
            r.decode[0],
            r.decode[1],
            median_text(r.decode_quartiles()),
            interval,
            verdict,
            median_text(r.decode_phase_quartiles()),
            r.prefill[0],
            r.prefill[1],
            median_text(r.prefill_quartiles()),
            median_text(r.run_quartiles()),
            r.step_bytes[1],
            r.step_bytes[0],
            r.step_bytes[2],
            mib(r.prefill_bytes),
            mib(r.trace_bytes),
            r.growing_records,
            mib(r.growing_hashed_per_step as u64),
            r.peak_rss.map_or("n/a".into(), mib),
        ));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The verdict follows the 95 % interval of the median: wholly below or
    /// at the target, wholly above, or holding it; below 6 pairs the median
    /// alone, said so.
    #[test]
    fn the_target_verdict_follows_the_interval_of_the_median() {
        let around = |centre: f64, n: usize| -> Vec<f64> {
            (0..n)
                .map(|i| centre + (i as f64 - (n - 1) as f64 / 2.0) * 0.01)
                .collect()
        };
        assert_eq!(TargetVerdict::of(&around(1.00, 15)), Some(TargetVerdict::Met));
        assert_eq!(TargetVerdict::of(&around(1.20, 15)), Some(TargetVerdict::NotMet));
        assert_eq!(
            TargetVerdict::of(&around(1.10, 15)),
            Some(TargetVerdict::Undecided)
        );
        // 15 pairs: the interval is x(4)..x(12); a median below the target
        // with x(12) above it (the four largest above) is undecided, not met.
        let mut v = around(1.00, 15);
        v[11..].fill(1.2);
        assert_eq!(TargetVerdict::of(&v), Some(TargetVerdict::Undecided));
        assert_eq!(
            TargetVerdict::of(&around(1.00, 5)),
            Some(TargetVerdict::MedianMet)
        );
        assert_eq!(
            TargetVerdict::of(&around(1.20, 5)),
            Some(TargetVerdict::MedianNotMet)
        );
        assert_eq!(TargetVerdict::of(&[]), None);
    }

    /// An interleaved pair's captured run is the run a process of its own
    /// makes: the same trace bytes, though its steps alternate with an
    /// uncaptured run's in one process. It counts every segment but the
    /// first, and refuses fewer than two.
    #[test]
    fn an_interleaved_pair_captures_the_same_trace_as_a_run_of_its_own() {
        let dir = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").unwrap();
        let scratch = tempfile::tempdir().unwrap();
        let (alone, paired) = (
            scratch.path().join("alone.bin"),
            scratch.path().join("paired.bin"),
        );
        // 2 whole segments and 3 steps: a first segment of 11, one counted.
        let decode = 2 * SEGMENT_STEPS + 3;
        let lone = one_run(&dir, 40, decode, None, BenchCapture::Default, &alone).unwrap();
        let run = interleaved_run(&dir, 40, decode, None, &paired).unwrap();
        assert_eq!(std::fs::read(&alone).unwrap(), std::fs::read(&paired).unwrap());
        assert_eq!(run.segment_cost.len(), 1);
        assert!(run.segment_cost[0] > 0.0);
        assert!(run.phase_seconds.iter().all(|s| *s > 0.0));
        assert_eq!(
            (run.growing_records, run.growing_hashed_bytes),
            (lone.growing_records, lone.growing_hashed_bytes)
        );
        // Chunked prefill too.
        one_run(&dir, 40, decode, Some(16), BenchCapture::Default, &alone).unwrap();
        interleaved_run(&dir, 40, decode, Some(16), &paired).unwrap();
        assert_eq!(std::fs::read(&alone).unwrap(), std::fs::read(&paired).unwrap());
        assert!(Pair::interleaved(40, decode, &run).is_ok());
        for broken in [
            InterleavedRun {
                segment_cost: Vec::new(),
                ..run.clone()
            },
            InterleavedRun {
                segment_cost: vec![f64::NAN],
                ..run.clone()
            },
            InterleavedRun {
                phase_seconds: [0.0, 1.0],
                ..run.clone()
            },
        ] {
            assert!(Pair::interleaved(40, decode, &broken).is_err(), "{broken:?}");
        }
        // The model's own file as the trace: refused, the file unchanged.
        let model_file = dir.join("model.safetensors");
        let before = std::fs::read(&model_file).unwrap();
        for e in [
            interleaved_run(&dir, 40, decode, None, &model_file).unwrap_err(),
            one_run(&dir, 40, decode, None, BenchCapture::Default, &model_file).unwrap_err(),
        ] {
            assert!(e.to_string().contains("model.safetensors"), "{e}");
        }
        assert_eq!(std::fs::read(&model_file).unwrap(), before);
        let e = interleaved_run(&dir, 40, 2 * SEGMENT_STEPS - 1, None, &paired).unwrap_err();
        assert!(e.to_string().contains("at least 16 decode steps"), "{e}");
    }
}
