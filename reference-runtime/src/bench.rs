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

/// Weight bytes one decode step reads, by where they are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepBytes {
    /// Every matrix of every decoder layer except the routed experts
    /// (attention, compressors, indexer, mHC, router, shared expert).
    pub layers_dense: u64,
    /// The `k` routed experts a token selects per layer (codes and scales).
    pub routed_experts: u64,
    /// The head (mHC head collapse and LM head) and one embedding row.
    pub head_and_embedding: u64,
    /// Bytes of all routed experts of the checkpoint (what stays in the memory map).
    pub all_routed_experts: u64,
}

impl StepBytes {
    /// Total weight bytes one decode step reads.
    pub fn total(&self) -> u64 {
        self.layers_dense + self.routed_experts + self.head_and_embedding
    }
}

/// The weight bytes a decode step of `model` must read: every matrix it
/// multiplies by (codes plus scales for quantized ones), with `k` routed
/// experts per layer (all experts of a layer have the same size) and one
/// embedding row. MTP blocks are not run and not counted; state (caches)
/// is not weights and not counted.
pub fn decode_step_bytes(model: &Model) -> StepBytes {
    let cfg = model.config();
    let bytes = |m: &crate::weights::Mat| (m.body_bytes() + m.scale_bytes()) as u64;
    let mut s = StepBytes::default();
    for i in 0..cfg.num_layers() {
        let Some(l) = model.layer_weights(i) else {
            continue;
        };
        let mut all = 0u64;
        l.for_each_mat(&mut |m| all += bytes(m));
        let experts: Vec<u64> = l
            .moe
            .experts
            .iter()
            .map(|e| bytes(&e.w1) + bytes(&e.w3) + bytes(&e.w2))
            .collect();
        let routed: u64 = experts.iter().sum();
        let per_expert = experts.iter().copied().max().unwrap_or(0);
        s.layers_dense += all - routed;
        s.routed_experts += cfg.experts_per_tok as u64 * per_expert;
        s.all_routed_experts += routed;
    }
    let h = model.head_weights();
    let embed = model.embedding_matrix();
    s.head_and_embedding = bytes(&h.hc.fn_) + bytes(&h.lm_head) + embed.dtype().row_len(embed.cols()) as u64;
    s
}

/// Memory read bandwidth in bytes per second: the best of `repeat`
/// streaming reads of a `bytes`-byte buffer (touched once before), summed
/// in 64-bit words by `threads` threads over contiguous parts. The buffer
/// is freed before returning.
pub fn read_bandwidth(bytes: usize, threads: usize, repeat: u32) -> f64 {
    let words = (bytes / 8).max(1);
    let buf: Vec<u64> = (0..words as u64).collect();
    let threads = threads.max(1);
    let part = words.div_ceil(threads);
    let mut best = 0.0f64;
    let mut sink = 0u64;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = buf.chunks(part).map(|c| s.spawn(move || sum_words(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        let secs = t.elapsed().as_secs_f64();
        sink ^= sums.iter().fold(0, |a, b| a ^ b);
        best = best.max((words * 8) as f64 / secs.max(1e-12));
    }
    std::hint::black_box(sink);
    best
}

/// Wrapping sum of `w` in 8 independent lanes (vectorizes; bound by memory).
fn sum_words(w: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut it = w.chunks_exact(8);
    for c in &mut it {
        for j in 0..8 {
            acc[j] = acc[j].wrapping_add(c[j]);
        }
    }
    let tail = it.remainder().iter().fold(0u64, |a, b| a.wrapping_add(*b));
    acc.iter().fold(tail, |a, b| a.wrapping_add(*b))
}
