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

use std::path::{Path, PathBuf};
use std::time::Instant;

use moeconf_contract::NativeCombine;
use moeconf_fingerprint::Algorithm;
use moeconf_reference_runtime::capture::{CaptureSink, NullSink};
use moeconf_reference_runtime::error::RuntimeError;
use moeconf_reference_runtime::model::{Model, StepOptions};
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::{limits, parse_capture, RunError, TraceSink};
use moeconf_schema::{Header, Trace, TraceWriter};

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
    let out = match chunk {
        Some(c) => model.step_chunked(&mut state, prompt, opts, c as usize, sink)?,
        None => model.step(&mut state, prompt, opts, sink)?,
    };
    let mut next = out.next_token;
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
    let model = Model::load(dir)?;
    let path = scratch.join("bench-context.bin");
    // Every context must fit before any runs.
    for &n in &opts.contexts {
        check_fits(&model, n, opts.decode_tokens, opts.prefill_chunk)?;
    }
    drop(model);
    let mut rows = Vec::new();
    for &n in &opts.contexts {
        let mut best = [[0.0f64; 2]; 2];
        let (mut prefill_cost, mut decode_cost, mut decode_phase_cost) = (Vec::new(), Vec::new(), Vec::new());
        let (mut last, mut peak_rss) = (None, None);
        for r in 0..opts.repeat {
            let mut pair = [None; 2];
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
                let run = match &opts.exe {
                    Some(exe) => child_run(exe, n, opts, capture, &path)?,
                    None => one_run(dir, n, opts.decode_tokens, opts.prefill_chunk, capture, &path)?,
                };
                peak_rss = peak_rss.max(run.peak_rss_bytes);
                pair[i] = Some(run);
            }
            let [Some(none), Some(with)] = pair else {
                continue;
            };
            let phases = |o: &OneRun| {
                [
                    n as f64 / o.prefill_seconds.max(1e-12),
                    f64::from(opts.decode_tokens) / o.decode_seconds.max(1e-12),
                ]
            };
            for (i, t) in [none, with].iter().enumerate() {
                let [p, d] = phases(t);
                best[0][i] = best[0][i].max(p);
                best[1][i] = best[1][i].max(d);
            }
            prefill_cost.push(with.prefill_seconds / none.prefill_seconds.max(1e-12));
            decode_cost.push(with.median_step_seconds / none.median_step_seconds.max(1e-12));
            decode_phase_cost.push(with.decode_seconds / none.decode_seconds.max(1e-12));
            last = Some((with.growing_records, with.growing_hashed_bytes));
        }
        let bytes = trace_bytes(&path)?;
        let _ = std::fs::remove_file(&path);
        prefill_cost.sort_by(f64::total_cmp);
        decode_cost.sort_by(f64::total_cmp);
        decode_phase_cost.sort_by(f64::total_cmp);
        let (growing_records, hashed) = last.unwrap_or((0, 0));
        let s = &bytes.steps;
        rows.push(ContextRow {
            context: n,
            prefill: best[0],
            decode: best[1],
            prefill_cost,
            decode_cost,
            decode_phase_cost,
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
    check_fits(&model, n, decode, prefill_chunk)?;
    let prompt = prompt_of(n, model.config().vocab_size as u32);
    let step = StepOptions {
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let (t, median, growing) = match capture {
        BenchCapture::None => {
            let (t, m) = timed(&model, &prompt, decode, &step, prefill_chunk, &mut NullSink)?;
            (t, m, (0, 0))
        }
        BenchCapture::Default => {
            let mut header = Header::default();
            header.binding.decoding.max_new_tokens = decode.saturating_add(1);
            let w = TraceWriter::create(trace, Algorithm::Blake3, header)?;
            let spec = parse_capture(BenchCapture::Default.name())?;
            let mut sink = TraceSink::new(w, spec).for_model(&model);
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
/// capture's memory estimate says would not fit.
fn check_fits(model: &Model, n: u32, decode: u32, prefill_chunk: Option<u32>) -> Result<(), RunError> {
    let (n, new) = (u64::from(n), u64::from(decode) + 1);
    let spec = parse_capture(BenchCapture::Default.name())?;
    let estimate = limits::estimate_memory(model.config(), n, new, spec, prefill_chunk.map(u64::from));
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
fn child_run(
    exe: &Path,
    n: u32,
    opts: &ContextBenchOptions,
    capture: BenchCapture,
    trace: &Path,
) -> Result<OneRun, RunError> {
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["bench", "runtime", "--context-child"])
        .arg(n.to_string())
        .args(["--child-capture", capture.name(), "--decode-tokens"])
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
            capture.name(),
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
         per pair, median (quartiles), for decode of the median step; target <= {TARGET_COST:.2}x)\n",
        rayon::current_num_threads(),
        opts.decode_tokens,
        opts.repeat,
        if opts.exe.is_some() { ", each run a process of its own" } else { "" },
        opts.prefill_chunk
            .map_or(String::new(), |c| format!(", prefill in chunks of {c}")),
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
             prefill  {:>9.1} t/s without, {:>9.1} t/s with capture; cost {}\n    \
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
}
