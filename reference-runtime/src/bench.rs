//! Throughput measurement of the runtime (for `moeconf bench runtime`): times
//! the prefill step and the decode steps of one greedy generation separately.
//! Wall-clock numbers are reported, never asserted in tests.

use std::time::Instant;

use crate::capture::CaptureSink;
use crate::error::RuntimeError;
use crate::model::{Model, StepOptions};

/// Measured throughput of one generation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BenchReport {
    /// Prompt tokens consumed by the prefill step.
    pub prefill_tokens: usize,
    /// Seconds spent in the prefill step.
    pub prefill_seconds: f64,
    /// Decode steps run (one token each).
    pub decode_tokens: usize,
    /// Seconds spent in the decode steps.
    pub decode_seconds: f64,
}

impl BenchReport {
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
) -> Result<BenchReport, RuntimeError> {
    let mut state = model.new_state();
    let t0 = Instant::now();
    let mut next = model.step(&mut state, prompt_ids, opts, sink)?.next_token;
    let t1 = Instant::now();
    for _ in 0..decode_tokens {
        next = model.step(&mut state, &[next], opts, sink)?.next_token;
    }
    let t2 = Instant::now();
    Ok(BenchReport {
        prefill_tokens: prompt_ids.len(),
        prefill_seconds: (t1 - t0).as_secs_f64(),
        decode_tokens,
        decode_seconds: (t2 - t1).as_secs_f64(),
    })
}

/// Current anonymous resident memory of this process in bytes (`RssAnon` of
/// `/proc/self/status`; Linux only, `None` elsewhere or if unreadable). Weights
/// are memory-mapped files, so they count as file-backed, not anonymous, memory:
/// this figure must not grow with the number of experts.
pub fn anon_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}
