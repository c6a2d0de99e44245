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
            Sizing::BenchContext => "a smaller --context or fewer --decode-tokens (the benchmark measures the default capture)",
            Sizing::CalibrateContext => "a smaller --context",
        },
    )))
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
