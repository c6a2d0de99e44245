//! Documented bounds on the work and memory a run may ask for
//! (docs/operators.md §7): worker threads, prompt files, prompt tokens and
//! generated tokens. Each check fails with a message naming the option, the
//! value and the limit.

use std::io::Read;
use std::path::Path;

use moeconf_fingerprint::Level;
use moeconf_reference_runtime::config::{AttentionKind, ModelConfig};
use moeconf_reference_runtime::files::limit_text;
use moeconf_schema::CaptureSpec;

use crate::{Field, FieldMessage, RunError};

/// Largest prompt file read ([`Field::PromptFile`]) (16 MiB).
pub const MAX_PROMPT_FILE_BYTES: u64 = 16 << 20;

/// DeepSeek-V4's context length (2^20 tokens): the prompt and the
/// generated tokens of one run together hold at most this many.
pub const MAX_CONTEXT_TOKENS: u64 = 1 << 20;

/// Largest `--max-new-tokens` (forward steps of one run): the context
/// length. Within it, what a run may ask for is bounded by memory, estimated
/// before the run ([`estimate_memory`], [`check_memory`]).
pub const MAX_NEW_TOKENS: u32 = 1 << 20;

/// Largest token count of the multi-run commands (`sweep`, `invariance`,
/// `calibrate`), which run many generations of the same length: a bound on
/// their total time, not on memory.
pub const MAX_PROTOCOL_TOKENS: u32 = 4096;

/// Largest prompt in tokens (2^20, DeepSeek-V4's context length).
pub const MAX_PROMPT_TOKENS: usize = 1 << 20;

/// Absolute upper bound on the thread count ([`Field::Threads`]).
pub const MAX_THREADS_CEILING: usize = 1024;

/// Thread counts always allowed, however few cores the machine reports.
pub const MIN_THREADS_CEILING: usize = 64;

/// The largest thread count accepted on this machine: 4 × the available
/// parallelism, at least [`MIN_THREADS_CEILING`] and at most
/// [`MAX_THREADS_CEILING`]. Results never depend on the thread count, so
/// oversubscription beyond this only costs time.
pub fn max_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores
        .saturating_mul(4)
        .clamp(MIN_THREADS_CEILING, MAX_THREADS_CEILING)
}

/// Checks a thread count: 1..=[`max_threads`].
pub fn check_threads(n: usize) -> Result<usize, RunError> {
    let max = max_threads();
    if n == 0 {
        return Err(RunError::Field(
            FieldMessage::of(Field::Threads).text(" must be at least 1"),
        ));
    }
    if n > max {
        return Err(RunError::Field(FieldMessage::of(Field::Threads).text(format!(
            " {n}: at most {max} worker threads (4 × the available cores, at least {MIN_THREADS_CEILING}, at most {MAX_THREADS_CEILING}); results never depend on it"
        ))));
    }
    Ok(n)
}

/// Reads a prompt file: at most [`MAX_PROMPT_FILE_BYTES`] of UTF-8. A
/// regular file over the limit is refused before reading; anything else
/// (a pipe, a device) is read up to the limit and refused beyond it.
pub fn read_prompt_file(path: &Path) -> Result<String, RunError> {
    let name = path.display();
    let too_big = || {
        prompt_file(format!(
            " {name}: more than the {} limit for prompts",
            limit_text(MAX_PROMPT_FILE_BYTES)
        ))
    };
    let io = |what: &str, e: std::io::Error| prompt_file(format!(" {name}: {what}: {e}"));
    let meta = std::fs::metadata(path).map_err(|e| io("cannot access", e))?;
    if meta.is_dir() {
        return Err(prompt_file(format!(" {name}: is a directory")));
    }
    if meta.is_file() && meta.len() > MAX_PROMPT_FILE_BYTES {
        return Err(too_big());
    }
    let file = std::fs::File::open(path).map_err(|e| io("cannot open", e))?;
    let mut bytes = Vec::new();
    file.take(MAX_PROMPT_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io("cannot read", e))?;
    if bytes.len() as u64 > MAX_PROMPT_FILE_BYTES {
        return Err(too_big());
    }
    String::from_utf8(bytes).map_err(|e| {
        prompt_file(format!(
            " {name}: not UTF-8 (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// An error about the prompt file: `detail` follows its field.
fn prompt_file(detail: String) -> RunError {
    RunError::Field(FieldMessage::of(Field::PromptFile).text(detail))
}

/// Checks the prompt's token count against [`MAX_PROMPT_TOKENS`].
pub fn check_prompt_tokens(n: usize) -> Result<(), RunError> {
    if n > MAX_PROMPT_TOKENS {
        return Err(RunError::Invalid(format!(
            "the prompt has {n} tokens, more than the limit of {MAX_PROMPT_TOKENS}"
        )));
    }
    Ok(())
}

/// The memory a run is estimated to need, by part (bytes). Measured on the
/// fixture (docs/performance.md, "Long context"): the estimate is above the
/// measured peak at every context measured, and within a small factor of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// The process and the runtime's fixed buffers.
    pub base: u64,
    /// Persistent state at the run's final context (window rings, compressed
    /// caches, indexer caches).
    pub state: u64,
    /// Prefill activations: the residual streams of every prompt position.
    pub prefill: u64,
    /// The trace writer's index entries of its largest step (the prefill's
    /// per-position records at L3 and L4), held until the step ends.
    pub capture: u64,
}

impl MemoryEstimate {
    /// The sum of the parts.
    pub fn total(&self) -> u64 {
        self.base
            .saturating_add(self.state)
            .saturating_add(self.prefill)
            .saturating_add(self.capture)
    }
}

/// Bytes of the process and the runtime's fixed buffers (measured: 58 MB
/// for a 2,000-token prompt on the fixture).
const BASE_BYTES: u64 = 256 << 20;
/// Bytes the writer holds per record of an open step (entry, key, order;
/// measured: about 200).
const ENTRY_BYTES: u64 = 256;
/// Records per prompt position and layer the writer holds at L3 and at L4
/// (measured on the fixture: 5.7 and 25; the official profile's
/// quantization sites add some).
const L3_PER_LAYER: u64 = 8;
const L4_PER_LAYER: u64 = 48;

/// Estimates the memory of a run of `prompt` prompt tokens and
/// `max_new_tokens` forward steps of a model with config `cfg` capturing
/// `capture`, its prefill in chunks of `prefill_chunk` tokens if given
/// (docs/operators.md §7).
pub fn estimate_memory(
    cfg: &ModelConfig,
    prompt: u64,
    max_new_tokens: u64,
    capture: CaptureSpec,
    prefill_chunk: Option<u64>,
) -> MemoryEstimate {
    let context = prompt.saturating_add(max_new_tokens);
    let f32b = 4u64;
    let mut per_token = 0u64;
    let mut fixed = 0u64;
    for kind in &cfg.layer_types {
        // Window ring: `sliding_window` keys of head_dim.
        fixed += (cfg.sliding_window * cfg.head_dim) as u64 * f32b;
        match kind {
            AttentionKind::Sliding => {}
            AttentionKind::Csa => {
                // Compressed entries (one per csa_rate tokens) and the indexer's.
                per_token +=
                    ((cfg.head_dim + cfg.index_head_dim) as u64 * f32b).div_ceil(cfg.csa_rate.max(1) as u64);
            }
            AttentionKind::Hca => {
                per_token += (cfg.head_dim as u64 * f32b).div_ceil(cfg.hca_rate.max(1) as u64);
            }
        }
    }
    let layers = cfg.layer_types.len() as u64;
    let residual = (cfg.hc_mult * cfg.hidden_size) as u64 * f32b;
    let mut per_position = 0u64;
    if capture.levels.contains(Level::L3) {
        per_position += L3_PER_LAYER * layers;
    }
    if capture.levels.contains(Level::L4) {
        per_position += L4_PER_LAYER * layers;
    }
    MemoryEstimate {
        base: BASE_BYTES,
        state: fixed.saturating_add(per_token.saturating_mul(context)),
        // Twice the residual streams: the streams and one working copy.
        // A chunked prefill holds one chunk's streams at a time.
        prefill: prompt
            .min(prefill_chunk.unwrap_or(u64::MAX))
            .saturating_mul(2 * residual),
        capture: prompt.saturating_mul(per_position).saturating_mul(ENTRY_BYTES),
    }
}

/// This machine's available memory (`MemAvailable` of `/proc/meminfo`), or
/// `None` where it cannot be read.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// The command a memory or context refusal is worded for: each names its own
/// options (what sets the tokens, what lowers the estimate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sizing {
    /// `moeconf run`: `--prompt*` and `--max-new-tokens`, and its `--capture`.
    Run,
    /// `moeconf bench runtime --context N`: N prompt tokens and
    /// `--decode-tokens` + 1 new ones, at the default capture.
    BenchContext,
    /// `moeconf calibrate --only 11 --context N`: N prompt tokens and the
    /// fork protocol's own decode steps, tokens only.
    CalibrateContext,
}

/// Refuses a run whose estimate exceeds `available` bytes (no check when
/// the available memory is unknown), naming each part and what lowers it.
pub fn check_memory(
    estimate: &MemoryEstimate,
    available: Option<u64>,
    prompt: u64,
    max_new_tokens: u64,
) -> Result<(), RunError> {
    check_memory_for(Sizing::Run, estimate, available, prompt, max_new_tokens)
}

/// [`check_memory`] worded for `command`'s options.
pub fn check_memory_for(
    command: Sizing,
    estimate: &MemoryEstimate,
    available: Option<u64>,
    prompt: u64,
    max_new_tokens: u64,
) -> Result<(), RunError> {
    let context = prompt.saturating_add(max_new_tokens);
    if context > MAX_CONTEXT_TOKENS {
        let over = format!(
            "the prompt's {prompt} tokens and {max_new_tokens} new ones exceed DeepSeek-V4's context of {MAX_CONTEXT_TOKENS} tokens"
        );
        return Err(match command {
            Sizing::Run => RunError::Field(
                FieldMessage::of(Field::MaxNewTokens).text(format!(" {max_new_tokens}: {over}")),
            ),
            Sizing::BenchContext => RunError::Invalid(format!(
                "--context {prompt} with --decode-tokens {}: {over} (the prefill's token is new too)",
                max_new_tokens.saturating_sub(1)
            )),
            Sizing::CalibrateContext => RunError::Invalid(format!(
                "--context {prompt}: {over} (the fork protocol decodes {max_new_tokens} tokens)"
            )),
        });
    }
    let Some(available) = available else {
        return Ok(());
    };
    if estimate.total() <= available {
        return Ok(());
    }
    let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
    Err(RunError::Invalid(format!(
        "a run of {prompt} prompt tokens and {max_new_tokens} new ones needs an estimated {} (persistent state at {context} tokens {}, \
         prefill activations {}, the trace writer's prefill step {}, the rest {}), more than the {} this machine has available; \
         {} lower it",
        gib(estimate.total()),
        gib(estimate.state),
        gib(estimate.prefill),
        gib(estimate.capture),
        gib(estimate.base),
        gib(available),
        match command {
            Sizing::Run => "fewer tokens, or a capture without L3/L4 (e.g. --capture L0,L1+payload,L2),",
            Sizing::BenchContext => {
                "a smaller --context, fewer --decode-tokens, or --separate-runs (one run's state per process instead \
                 of an interleaved pair's two; the benchmark measures the default capture)"
            }
            Sizing::CalibrateContext => "a smaller --context",
        },
    )))
}

/// The trace a run is estimated to write, by part (bytes; docs/performance.md
/// "Trace size" states its accuracy against real runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEstimate {
    /// The prefill step (step 0): every prompt position's records.
    pub prefill: u64,
    /// The decode steps (1 .. max_new_tokens).
    pub decode: u64,
}

impl TraceEstimate {
    /// The sum of the parts.
    pub fn total(&self) -> u64 {
        self.prefill.saturating_add(self.decode)
    }
}

/// Bytes of one record's index entry (format version 3, docs/format.md
/// §11.2: ordinal, position, phase, path, dtype, shape, digest, payload
/// flag), and the payload reference it adds when the payload is kept.
const TRACE_ENTRY_BYTES: f64 = 100.0;
const TRACE_PAYLOAD_REF_BYTES: f64 = 16.0;
/// Bytes of one group (a step's level and layer): its block's header and
/// alignment, and its reference in the step block.
const TRACE_GROUP_BYTES: f64 = 150.0;
/// Bytes of one step: its reference in the root block (284, §11.8) and its
/// block's header and alignment.
const TRACE_STEP_BYTES: f64 = 344.0;
/// UTF-8 bytes per generated token in `text.continuation` (byte-level BPE;
/// the fixture's continuations measure about 3).
const TEXT_BYTES_PER_TOKEN: f64 = 4.0;
/// Points at which the per-step cost is evaluated; between them it is
/// interpolated linearly (the growing records grow linearly with the
/// context, or stop growing at the window).
const TRACE_SAMPLES: u64 = 64;

/// Accumulates the estimated bytes of records of a capture.
struct TraceBytes {
    capture: CaptureSpec,
    bytes: f64,
}

impl TraceBytes {
    /// `count` records of `level` of `payload` bytes each (fractional for a
    /// record that exists at one position in `rate`).
    fn add(&mut self, level: Level, payload: f64, count: f64) {
        if !self.capture.levels.contains(level) {
            return;
        }
        let kept = self.capture.keeps_payload(level) || payload <= moeconf_schema::SMALL_RECORD_BYTES as f64;
        let stored = if kept {
            TRACE_PAYLOAD_REF_BYTES + (payload / 64.0).ceil() * 64.0
        } else {
            0.0
        };
        self.bytes += count * (TRACE_ENTRY_BYTES + stored);
    }
}

/// The records of one position of layer `layer` at `ctx` tokens of context
/// (docs/format.md §6: L3 and L4, with the official profile's quantization
/// sites when `quantized`).
fn position_records(t: &mut TraceBytes, cfg: &ModelConfig, layer: usize, ctx: f64, quantized: bool) {
    let f = 4.0;
    let (n, d_model, d) = (cfg.hc_mult as f64, cfg.hidden_size as f64, cfg.head_dim as f64);
    let (h, k) = (cfg.num_heads as f64, cfg.experts_per_tok as f64);
    let (d_i, h_i) = (cfg.index_head_dim as f64, cfg.index_n_heads as f64);
    let q = |t: &mut TraceBytes, bytes: f64, count: f64| {
        if quantized {
            t.add(Level::L4, bytes, count);
        }
    };
    // The attention half.
    t.add(Level::L4, n * f, 2.0); // hc pre / post weights
    t.add(Level::L4, n * n * f, 1.0); // hc_comb
    t.add(Level::L4, d_model * f, 2.0); // hc_pre, norm
    q(t, d_model * f, 1.0); // norm_fp8
    q(t, cfg.q_lora_rank as f64 * f, 1.0); // q_lat_fp8
    t.add(Level::L4, h * d * f, 2.0); // q, core
    t.add(Level::L4, d * f, 1.0); // kv
    q(t, d * f, 1.0); // kv_fp8
    t.add(Level::L4, ctx.min(cfg.sliding_window as f64) * d * f, 1.0); // window_read
    q(t, (cfg.o_groups * cfg.o_lora_rank) as f64 * f, 1.0); // o_lat_fp8
    t.add(Level::L4, d_model * f, 1.0); // output
    let kind = cfg
        .layer_types
        .get(layer)
        .copied()
        .unwrap_or(AttentionKind::Sliding);
    let rate = match kind {
        AttentionKind::Sliding => None,
        AttentionKind::Csa => Some(cfg.csa_rate.max(1) as f64),
        AttentionKind::Hca => Some(cfg.hca_rate.max(1) as f64),
    };
    if let Some(rate) = rate {
        let entries = (ctx / rate).floor();
        // An entry emitted at one position in `rate`.
        t.add(Level::L4, d * f, 1.0 / rate);
        q(t, d * f, 1.0 / rate);
        let read = if kind == AttentionKind::Csa {
            entries.min(cfg.index_topk as f64)
        } else {
            entries
        };
        t.add(Level::L4, read * d * f, 1.0); // compressed_read
        if kind == AttentionKind::Csa {
            t.add(Level::L4, d_i * f, 1.0 / rate); // indexer_compressed
            q(t, d_i * f, 1.0 / rate);
            t.add(Level::L4, entries * d_i * f, 1.0); // indexer_read
            q(t, h_i * d_i * f, 1.0); // indexer_q_fp4
            t.add(Level::L4, entries * f, 1.0); // indexer_scores
            t.add(Level::L4, entries.min(cfg.index_topk as f64) * f, 1.0); // indexer_topk
        }
    }
    t.add(Level::L3, n * d_model * f, 2.0); // post_attn_mhc, post_ffn_mhc
                                            // The FFN half.
    t.add(Level::L4, n * f, 2.0);
    t.add(Level::L4, n * n * f, 1.0);
    t.add(Level::L4, d_model * f, 2.0);
    q(t, d_model * f, 1.0); // ffn.norm_fp8
    t.add(Level::L3, cfg.n_routed_experts as f64 * f, 1.0); // router.scores
    t.add(Level::L3, k * f, 2.0); // router.topk, router.gates
    if cfg.mlp_layer_types.get(layer) == Some(&moeconf_reference_runtime::config::MlpKind::Moe) {
        t.add(Level::L3, f, 1.0); // router.margin
    }
    t.add(Level::L4, d_model * f, k + 3.0); // moe.term.J, routed, shared, combine
    q(t, cfg.moe_intermediate_size as f64 * f, k + 1.0); // term_h_fp8.J, shared_h_fp8
}

/// The persistent state records of layer `layer` at `ctx` tokens (L2).
fn state_records(t: &mut TraceBytes, cfg: &ModelConfig, layer: usize, ctx: f64) {
    let (f, d, d_i) = (4.0, cfg.head_dim as f64, cfg.index_head_dim as f64);
    t.add(Level::L2, 8.0, 1.0); // cumulative_length
    t.add(Level::L2, ctx.min(cfg.sliding_window as f64) * d * f, 1.0);
    let mut compressor = |rate: f64, width: f64, overlap: bool| {
        let entries = (ctx / rate).floor();
        // The buffer holds half a window on average, kv and gate.
        t.add(Level::L2, rate / 2.0 * width * f, 2.0);
        t.add(
            Level::L2,
            entries * width / if overlap { 2.0 } else { 1.0 } * f,
            1.0,
        );
        t.add(Level::L2, 8.0, 1.0); // entry_count
        if overlap {
            t.add(Level::L2, rate * width / 2.0 * f, 2.0);
        }
    };
    match cfg.layer_types.get(layer) {
        Some(AttentionKind::Csa) => {
            let rate = cfg.csa_rate.max(1) as f64;
            compressor(rate, 2.0 * d, true);
            compressor(rate, 2.0 * d_i, true);
        }
        Some(AttentionKind::Hca) => compressor(cfg.hca_rate.max(1) as f64, d, false),
        _ => {}
    }
}

/// Groups (level, layer) of a step: the model-global ones and one per layer
/// of each layered level captured.
fn step_groups(capture: CaptureSpec, layers: f64) -> f64 {
    let global = [Level::L0, Level::L1, Level::L4]
        .into_iter()
        .filter(|&l| capture.levels.contains(l))
        .count() as f64;
    let layered = [Level::L2, Level::L3, Level::L4]
        .into_iter()
        .filter(|&l| capture.levels.contains(l))
        .count() as f64;
    global + layered * layers
}

/// Estimates the trace of a run of `prompt` prompt tokens and
/// `max_new_tokens` forward steps of a model with config `cfg` capturing
/// `capture` (`quantized`: a profile with the official quantization sites),
/// from the catalogue's records and their shapes (docs/format.md §6) and
/// the format's per-record, per-group and per-step bytes. Records whose
/// size depends on the context (persistent state, the attention's reads,
/// the continuation) are evaluated at `TRACE_SAMPLES` points and
/// interpolated.
pub fn estimate_trace(
    cfg: &ModelConfig,
    prompt: u64,
    max_new_tokens: u64,
    capture: CaptureSpec,
    quantized: bool,
) -> TraceEstimate {
    let layers = cfg.layer_types.len();
    let f = 4.0;
    let new_tokens = |t: &mut TraceBytes, generated: f64| {
        t.add(Level::L0, f, 1.0); // token.output
        t.add(Level::L0, generated * TEXT_BYTES_PER_TOKEN, 1.0); // text.continuation
        t.add(Level::L1, cfg.vocab_size as f64 * f, 1.0); // lm.logits
        t.add(Level::L1, 8.0 * f, 2.0); // top-k ids and logits
        t.add(Level::L1, f, 1.0); // margin
    };
    // One position at context `ctx` through every layer.
    let position = |t: &mut TraceBytes, ctx: f64| {
        t.add(Level::L4, cfg.hidden_size as f64 * f, 1.0); // embed.output
        for l in 0..layers {
            position_records(t, cfg, l, ctx, quantized);
        }
    };
    let state = |t: &mut TraceBytes, ctx: f64| {
        for l in 0..layers {
            state_records(t, cfg, l, ctx);
        }
    };
    // Mean of `cost` over 1..=n, from samples (exact for a linear cost).
    let mean = |n: u64, cost: &dyn Fn(f64) -> f64| -> f64 {
        if n == 0 {
            return 0.0;
        }
        let samples = TRACE_SAMPLES.min(n);
        (0..samples)
            .map(|i| cost(1.0 + (n - 1) as f64 * (i as f64 + 0.5) / samples as f64))
            .sum::<f64>()
            / samples as f64
    };
    let empty = || TraceBytes { capture, bytes: 0.0 };
    let p = prompt as f64;
    let prefill = {
        let mut t = empty();
        t.add(Level::L0, p * f, 1.0); // token.input
        new_tokens(&mut t, 1.0);
        state(&mut t, p);
        let per_position = mean(prompt, &|ctx| {
            let mut t = empty();
            position(&mut t, ctx);
            t.bytes
        });
        t.bytes
            + per_position * p
            + TRACE_STEP_BYTES
            + TRACE_GROUP_BYTES * step_groups(capture, layers as f64)
    };
    let steps = max_new_tokens.saturating_sub(1);
    let per_step = mean(steps, &|s| {
        let ctx = p + s;
        let mut t = empty();
        t.add(Level::L0, f, 1.0); // token.input
        new_tokens(&mut t, s + 1.0);
        state(&mut t, ctx);
        position(&mut t, ctx);
        t.bytes
    });
    let decode = if steps == 0 {
        0.0
    } else {
        (per_step + TRACE_STEP_BYTES + TRACE_GROUP_BYTES * step_groups(capture, layers as f64)) * steps as f64
    };
    // Preamble, header (the binding's weight digests), trailer, root block.
    let fixed = 64.0 * 1024.0;
    TraceEstimate {
        prefill: (prefill + fixed) as u64,
        decode: decode as u64,
    }
}

/// Refuses a run whose estimated trace exceeds the `free` bytes of the
/// output's filesystem by more than the estimate's error (no check when the
/// free space is unknown), naming the estimate, the free space, the output
/// and what lowers it.
pub fn check_disk(estimate: &TraceEstimate, free: Option<u64>, output: &Path) -> Result<(), RunError> {
    let Some(free) = free else {
        return Ok(());
    };
    // The estimate is within a factor TRACE_ESTIMATE_ERROR of the trace
    // (measured, docs/performance.md "Trace size"): refuse only when even
    // the smallest trace it allows would not fit.
    if (estimate.total() as f64 / TRACE_ESTIMATE_ERROR) <= free as f64 {
        return Ok(());
    }
    Err(RunError::Invalid(format!(
        "the trace {} would need an estimated {} (prefill step {}, decode steps {}), more than the {} free on its \
         filesystem; write it elsewhere, or lower it with fewer levels or payloads (--capture, e.g. --capture \
         L0,L1+payload,L2), a shorter prompt or fewer --max-new-tokens",
        output.display(),
        human(estimate.total()),
        human(estimate.prefill),
        human(estimate.decode),
        human(free),
    )))
}

/// Largest ratio between the estimate and a real trace's size, either way
/// (docs/performance.md "Trace size").
pub const TRACE_ESTIMATE_ERROR: f64 = 1.25;

/// `bytes` in the largest binary unit that keeps a number at least 1.
pub fn human(bytes: u64) -> String {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if bytes == 1 {
        "1 byte".to_string()
    } else if u == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_ceiling_is_bounded_and_checked() {
        let max = max_threads();
        assert!((MIN_THREADS_CEILING..=MAX_THREADS_CEILING).contains(&max));
        assert_eq!(check_threads(1).unwrap(), 1);
        assert_eq!(check_threads(max).unwrap(), max);
        assert!(check_threads(0).is_err());
        let e = check_threads(max + 1).unwrap_err().to_string();
        assert!(e.contains(&format!("at most {max}")), "{e}");
    }

    #[test]
    fn prompt_files_are_capped_and_utf8() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.txt");
        std::fs::write(&p, "why the sheep").unwrap();
        assert_eq!(read_prompt_file(&p).unwrap(), "why the sheep");
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        assert!(read_prompt_file(&p)
            .unwrap_err()
            .to_string()
            .contains("not UTF-8"));
        std::fs::File::create(&p)
            .unwrap()
            .set_len(MAX_PROMPT_FILE_BYTES + 1)
            .unwrap();
        let e = read_prompt_file(&p).unwrap_err().to_string();
        assert!(e.contains("16 MiB"), "{e}");
        assert!(check_prompt_tokens(MAX_PROMPT_TOKENS).is_ok());
        assert!(check_prompt_tokens(MAX_PROMPT_TOKENS + 1).is_err());
    }

    fn tiny() -> ModelConfig {
        let dir = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").unwrap();
        moeconf_reference_runtime::model::Model::load(&dir)
            .unwrap()
            .config()
            .clone()
    }

    #[test]
    fn memory_grows_with_the_context_and_the_captured_levels() {
        let cfg = tiny();
        let all = CaptureSpec::FINGERPRINTS_ONLY;
        let l0 = CaptureSpec {
            levels: moeconf_fingerprint::LevelSet::EMPTY.with(Level::L0),
            payload_levels: moeconf_fingerprint::LevelSet::EMPTY,
        };
        let short = estimate_memory(&cfg, 264, 8, all, None);
        let long = estimate_memory(&cfg, 131072, 8, all, None);
        assert!(long.state > short.state && long.prefill > short.prefill && long.capture > short.capture);
        // Decode steps add state, never writer entries.
        let decode = estimate_memory(&cfg, 264, 100_000, all, None);
        assert!(decode.state > short.state);
        assert_eq!(decode.capture, short.capture);
        // Without L3/L4 the writer holds no per-position entries.
        assert_eq!(estimate_memory(&cfg, 131072, 8, l0, None).capture, 0);
    }

    #[test]
    fn each_command_is_told_its_own_options() {
        let cfg = tiny();
        let e = estimate_memory(&cfg, 1 << 19, 65, CaptureSpec::FINGERPRINTS_ONLY, None);
        let bench = check_memory_for(Sizing::BenchContext, &e, Some(1 << 30), 1 << 19, 65)
            .unwrap_err()
            .to_string();
        assert!(
            bench.contains("--context") && bench.contains("--decode-tokens"),
            "{bench}"
        );
        assert!(
            !bench.contains("--capture") && !bench.contains("--max-new-tokens"),
            "{bench}"
        );
        let over = check_memory_for(Sizing::BenchContext, &e, None, MAX_CONTEXT_TOKENS, 65)
            .unwrap_err()
            .to_string();
        assert!(
            over.contains("--context 1048576 with --decode-tokens 64"),
            "{over}"
        );
        let cal = check_memory_for(Sizing::CalibrateContext, &e, None, MAX_CONTEXT_TOKENS, 8)
            .unwrap_err()
            .to_string();
        assert!(
            cal.starts_with("--context 1048576") && !cal.contains("--max-new-tokens"),
            "{cal}"
        );
    }

    #[test]
    fn the_trace_estimate_grows_with_what_is_captured_and_refuses_what_clearly_does_not_fit() {
        let cfg = tiny();
        let parse = |c: &str| CaptureSpec::parse(c).unwrap();
        let d = |c: &str, p: u64, n: u64| estimate_trace(&cfg, p, n, parse(c), false);
        // More prompt, more steps, more levels and payloads: more bytes.
        assert!(d("default", 1000, 8).prefill > d("default", 100, 8).prefill);
        assert!(d("default", 5, 1000).decode > d("default", 5, 100).decode);
        assert!(d("all", 5, 100).total() > d("default", 5, 100).total());
        assert!(d("default", 5, 100).total() > d("L0", 5, 100).total());
        // A decode step does not grow with the context at the default
        // capture (fingerprints of the growing records)...
        let step = |p: u64| (d("default", p, 101).decode - d("default", p, 1).decode) / 100;
        assert!(
            step(10_000).abs_diff(step(100)) < step(100) / 50,
            "{} {}",
            step(100),
            step(10_000)
        );
        // ... and does with L2 payloads (the caches' bytes).
        let l2 = |p: u64| d("L2+payload", p, 101).decode;
        assert!(l2(10_000) > 2 * l2(100));
        // The quantization sites add L4 records.
        assert!(
            estimate_trace(&cfg, 5, 10, parse("all"), true).total()
                > estimate_trace(&cfg, 5, 10, parse("all"), false).total()
        );
        let e = d("default", 5, 200);
        let out = Path::new("/some/dir/t.bin");
        let free = (e.total() as f64 / TRACE_ESTIMATE_ERROR) as u64;
        assert!(check_disk(&e, Some(free + 1), out).is_ok(), "within the error");
        assert!(check_disk(&e, None, out).is_ok(), "unknown free space");
        let m = check_disk(&e, Some(free / 2), out).unwrap_err().to_string();
        for part in [
            "/some/dir/t.bin",
            "estimated",
            "free",
            "--capture",
            "--max-new-tokens",
            "prefill step",
        ] {
            assert!(m.contains(part), "{part}: {m}");
        }
        assert_eq!(human(512), "512 bytes");
        assert_eq!(human(3 << 20), "3.0 MiB");
    }

    #[test]
    fn a_run_beyond_the_memory_or_the_context_is_refused_with_its_parts() {
        let cfg = tiny();
        let all = CaptureSpec::FINGERPRINTS_ONLY;
        let e = estimate_memory(&cfg, 1 << 19, 8, all, None);
        let m = check_memory(&e, Some(1 << 30), 1 << 19, 8)
            .unwrap_err()
            .to_string();
        for part in [
            "needs an estimated",
            "persistent state",
            "prefill activations",
            "trace writer",
            "1.0 GiB",
            "--capture",
        ] {
            assert!(m.contains(part), "{part}: {m}");
        }
        assert!(check_memory(&e, Some(e.total()), 1 << 19, 8).is_ok());
        assert!(check_memory(&e, None, 1 << 19, 8).is_ok());
        let m = check_memory(&e, None, MAX_CONTEXT_TOKENS, 1)
            .unwrap_err()
            .to_string();
        assert!(m.contains("context of 1048576 tokens"), "{m}");
    }
}
