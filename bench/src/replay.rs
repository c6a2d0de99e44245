//! The replay benchmark (`moeconf bench replay`): the cost of replaying a
//! whole trace against the cost of the reference run that wrote it.
//!
//! On the same model, prompt and length: (a) the reference run with the
//! replay capture into a trace file (`run`), (b) the bare greedy forward
//! without capture, (c) layer replay of that trace on one thread and (d)
//! on the current pool, (e) teacher forcing, (f) layer replay with measured
//! propagation on one thread. Each is the best of `repeat`
//! wall-clock measurements; the headline is c / a.

use std::path::Path;
use std::time::Instant;

use moeconf_contract::NativeCombine;
use moeconf_fingerprint::{Algorithm, CanonPolicy};
use moeconf_reference_runtime::capture::NullSink;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::{run_to_trace, CombineChoice, LoadedModel, RunError, RunSpec};
use moeconf_schema::{CaptureSpec, Trace};

use moeconf_replay::{replay_layers, teacher_force, ReplayError, TeacherOptions};

/// Why the benchmark failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The reference run failed.
    #[error("the reference run failed")]
    Run(#[source] RunError),
    /// Reading the trace back failed.
    #[error("opening the benchmark trace")]
    Open(#[source] moeconf_schema::TraceError),
    /// The replay failed.
    #[error("the replay failed")]
    Replay(#[source] ReplayError),
    /// A pool of one thread could not be built.
    #[error("building a one-thread pool")]
    Pool(#[source] rayon::ThreadPoolBuildError),
    /// The replay of the reference's own trace was not all reproduced.
    #[error("the replay of the reference's own trace found {0} units not reproduced")]
    NotReproduced(usize),
}

/// The measured seconds (best of the repetitions).
#[derive(Debug, Clone, Copy)]
pub struct ReplayBench {
    /// Forward steps (tokens generated).
    pub tokens: u32,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Units replayed.
    pub units: usize,
    /// (a) reference run with the replay capture into a trace.
    pub run: f64,
    /// (b) bare forward, no capture.
    pub bare: f64,
    /// (c) layer replay, one thread.
    pub replay_1thread: f64,
    /// (d) layer replay, the current pool.
    pub replay_pool: f64,
    /// (e) teacher forcing, the current pool.
    pub teacher: f64,
    /// (f) layer replay with measured propagation, one thread.
    pub replay_measured_1thread: f64,
    /// Threads of the current pool.
    pub threads: usize,
}

fn best<T>(repeat: u32, mut f: impl FnMut() -> Result<T, BenchError>) -> Result<(f64, T), BenchError> {
    let mut out = None;
    let mut best = f64::INFINITY;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        let v = f()?;
        best = best.min(t.elapsed().as_secs_f64());
        out = Some(v);
    }
    match out {
        Some(v) => Ok((best, v)),
        None => Err(BenchError::NotReproduced(0)),
    }
}

/// Measures replay against the run on `m` with `prompt`, generating
/// `tokens` tokens, writing the trace into `dir`.
pub fn bench_replay(
    m: &LoadedModel,
    prompt: &str,
    tokens: u32,
    repeat: u32,
    dir: &Path,
) -> Result<ReplayBench, BenchError> {
    let choice = CombineChoice::default();
    let spec = RunSpec {
        prompt,
        max_new_tokens: tokens,
        precision: Precision::Bf16,
        combine: &choice,
        capture: CaptureSpec::REPLAY,
        algorithm: Algorithm::Blake3,
        canon: CanonPolicy::default(),
        allow_non_finite: false,
        prefill_chunk: None,
        batch_with: &[],
        progress: false,
    };
    let path = dir.join("bench-replay.bin");
    let (run, outcome) = best(repeat, || run_to_trace(m, &spec, &path).map_err(BenchError::Run))?;
    let opts = GenerateOptions {
        max_new_tokens: tokens as usize,
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let ids = outcome.prompt_ids.clone();
    let (bare, _) = best(repeat, || {
        m.model
            .generate(&ids, &opts, &mut NullSink)
            .map_err(|e| BenchError::Run(RunError::Runtime(e)))
    })?;
    let replay = || {
        let t = Trace::open(&path).map_err(BenchError::Open)?;
        replay_layers(&t, m, &moeconf_replay::LayerOptions::default()).map_err(BenchError::Replay)
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(BenchError::Pool)?;
    let (replay_1thread, report) = pool.install(|| best(repeat, replay))?;
    let bad = report.units.len() - report.count(moeconf_replay::Status::Reproduced);
    if bad > 0 {
        return Err(BenchError::NotReproduced(bad));
    }
    let (replay_pool, _) = best(repeat, replay)?;
    let measured = || {
        let t = Trace::open(&path).map_err(BenchError::Open)?;
        let opts = moeconf_replay::LayerOptions {
            measure_propagation: true,
            ..moeconf_replay::LayerOptions::default()
        };
        replay_layers(&t, m, &opts).map_err(BenchError::Replay)
    };
    let (replay_measured_1thread, _) = pool.install(|| best(repeat, measured))?;
    let (teacher, _) = best(repeat, || {
        let t = Trace::open(&path).map_err(BenchError::Open)?;
        teacher_force(&t, m, TeacherOptions::default()).map_err(BenchError::Replay)
    })?;
    Ok(ReplayBench {
        tokens,
        prompt_tokens: ids.len(),
        units: report.units.len(),
        run,
        bare,
        replay_1thread,
        replay_pool,
        teacher,
        replay_measured_1thread,
        threads: rayon::current_num_threads(),
    })
}
