//! Running the reference runtime into a trace: model resolution, binding
//! construction (model, tokenizer, prompt digests), the MoE combine a run
//! selects, and the capture sink that feeds a [`TraceWriter`]. Shared by the
//! `run`, `demo`, `sweep` and `calibrate` commands.
#![deny(missing_docs)]

pub mod bench;

use moeconf_contract::prompt_hash;
use moeconf_contract::{
    parse_fork_order, AggregationContract, ForkCombine, ForkPoint, MoeCombine, Schedule, ScheduledCombine,
};
use moeconf_fingerprint::{Algorithm, CanonPolicy, Coord, Level, TensorView};
use moeconf_reference_runtime::capture::{CaptureError, CaptureSink};
use moeconf_reference_runtime::error::RuntimeError;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::Model;
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::tokenizer::Tokenizer;
pub use moeconf_schema::model_identity;
use moeconf_schema::{
    Binding, CaptureSpec, Decoding, Header, InputError, PromptBinding, Provenance, TokenizerIdentity,
    TraceError, TraceWriter, WriteSummary, SMALL_RECORD_BYTES,
};
use std::path::{Path, PathBuf};

/// Everything that can stop a traced run. Messages name the option or file
/// concerned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// An option or input is invalid (the message names it).
    #[error("{0}")]
    Invalid(String),
    /// Something failed while doing what the context says.
    #[error("{context}")]
    Context {
        /// What was being done.
        context: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The runtime failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// Reading the model directory or tokenizer failed.
    #[error(transparent)]
    Input(#[from] InputError),
    /// Writing the trace failed.
    #[error(transparent)]
    Trace(#[from] TraceError),
}

fn context<E: std::error::Error + Send + Sync + 'static>(c: impl Into<String>) -> impl FnOnce(E) -> RunError {
    let context = c.into();
    move |e| RunError::Context {
        context,
        source: Box::new(e),
    }
}

macro_rules! bail {
    ($($t:tt)*) => { return Err(RunError::Invalid(format!($($t)*))) };
}

/// A loaded model with its tokenizer and identity.
pub struct LoadedModel {
    /// Display name (`builtin:tiny-v4` or the directory).
    pub name: String,
    /// The model directory.
    pub dir: PathBuf,
    /// The runtime model.
    pub model: Model,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
}

/// Resolves `spec` (`builtin:NAME` or a directory) and loads model and tokenizer.
pub fn load_model(spec: &str) -> Result<LoadedModel, RunError> {
    let dir = if spec.starts_with("builtin:") {
        moeconf_fixtures::ensure_builtin(spec).map_err(context(format!("materializing {spec}")))?
    } else {
        let d = PathBuf::from(spec);
        if !d.is_dir() {
            bail!("--model {spec}: not a directory (expected config.json, *.safetensors and tokenizer.json, or builtin:tiny-v4)");
        }
        d
    };
    let model = Model::load(&dir).map_err(context(format!("loading model from {}", dir.display())))?;
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = Tokenizer::from_file(&tok_path)?;
    Ok(LoadedModel {
        name: spec.to_string(),
        dir,
        model,
        tokenizer,
    })
}

fn read(path: &Path) -> Result<Vec<u8>, RunError> {
    std::fs::read(path).map_err(context(format!("reading {}", path.display())))
}

/// Parses a `--capture` spec ([`CaptureSpec::parse`]).
pub fn parse_capture(s: &str) -> Result<CaptureSpec, RunError> {
    CaptureSpec::parse(s).map_err(|m| RunError::Invalid(format!("--capture: {m}")))
}

/// A capture sink that appends to a trace.
pub struct TraceSink {
    writer: TraceWriter,
    spec: CaptureSpec,
}

impl TraceSink {
    /// Wraps a writer.
    pub fn new(writer: TraceWriter, spec: CaptureSpec) -> Self {
        TraceSink { writer, spec }
    }

    /// Finishes the trace file.
    pub fn finish(self) -> Result<WriteSummary, RunError> {
        Ok(self.writer.finish()?)
    }
}

impl CaptureSink for TraceSink {
    fn wants(&self, level: Level) -> bool {
        self.spec.captures(level)
    }

    fn record(&mut self, coord: Coord, level: Level, tensor: TensorView<'_>) -> Result<(), CaptureError> {
        let keep = self.spec.keeps_payload(level) || tensor.bytes.len() <= SMALL_RECORD_BYTES;
        self.writer
            .append(coord, level, tensor, keep)
            .map(|_| ())
            .map_err(|e| CaptureError::new(error_chain(&e)))
    }
}

/// An error and its sources joined by ": " (the capture error carries text
/// only, and a trace error's I/O reason is its source, not its text).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// How the MoE combine is chosen for a run.
#[derive(Debug, Clone)]
pub struct CombineChoice {
    /// Contract applied everywhere (`native`, `b`, ...).
    pub contract: String,
    /// Schedule (`identity`, `layer-static:SEED`, `token-dynamic:SEED`).
    pub schedule: String,
    /// Single-layer fork: layer.
    pub fork_layer: Option<u32>,
    /// Fork step (default 1: the forward that consumes the first emitted token).
    pub fork_step: Option<u32>,
    /// Fork position restriction.
    pub fork_position: Option<u32>,
    /// Contract at the fork.
    pub fork_contract: Option<String>,
    /// Order at the fork: a B class for B-like contracts, else a permutation index, or `p:2,0,1,...`.
    pub fork_order: Option<String>,
}

impl Default for CombineChoice {
    fn default() -> Self {
        CombineChoice {
            contract: "native".into(),
            schedule: "identity".into(),
            fork_layer: None,
            fork_step: None,
            fork_position: None,
            fork_contract: None,
            fork_order: None,
        }
    }
}

/// The combine built from a [`CombineChoice`], plus its binding strings.
pub struct BuiltCombine {
    /// The combine to pass to the runtime.
    pub combine: Box<dyn MoeCombine>,
    /// Binding `contract` string.
    pub contract: String,
    /// Binding `schedule` string.
    pub schedule: String,
}

/// The binding label of a contract: `native` stays `native` (it equals
/// `c` with the identity order, but users asked for the runtime default);
/// everything else is the contract's own description.
fn contract_label(given: &str, parsed: &AggregationContract) -> String {
    if given.eq_ignore_ascii_case("native") {
        "native".into()
    } else {
        parsed.describe()
    }
}

/// Validates a [`CombineChoice`] against the model's k and builds it.
pub fn build_combine(
    c: &CombineChoice,
    k: usize,
    prompt: &str,
    layers: usize,
) -> Result<BuiltCombine, RunError> {
    let opt = |name: &str| {
        let name = name.to_string();
        move |e: moeconf_contract::ContractError| RunError::Invalid(format!("{name}: {e}"))
    };
    let base = AggregationContract::parse(&c.contract).map_err(opt("--contract"))?;
    let schedule = Schedule::parse(&c.schedule).map_err(opt("--schedule"))?;
    let scheduled = ScheduledCombine::new(base.clone(), schedule.clone(), prompt_hash(prompt));
    scheduled
        .validate_for_k(k)
        .map_err(opt("--contract/--schedule"))?;
    let fork_given = c.fork_contract.is_some() || c.fork_order.is_some() || c.fork_step.is_some();
    match c.fork_layer {
        None if fork_given => bail!("--fork-contract/--fork-order/--fork-step need --fork-layer"),
        None => Ok(BuiltCombine {
            contract: contract_label(&c.contract, &base),
            schedule: schedule.to_string(),
            combine: Box::new(scheduled),
        }),
        Some(layer) => {
            if layer as usize >= layers {
                bail!(
                    "--fork-layer {layer}: the model has {layers} layers (0..{})",
                    layers - 1
                );
            }
            let fc = c.fork_contract.as_deref().unwrap_or("b");
            let mut contract = AggregationContract::parse(fc).map_err(opt("--fork-contract"))?;
            if let Some(o) = &c.fork_order {
                let order = parse_fork_order(o, &contract).map_err(opt("--fork-order"))?;
                contract = contract.with_order(order);
            }
            contract.validate_for_k(k).map_err(opt("--fork-order"))?;
            let mut point = ForkPoint::first_decode(layer);
            if let Some(s) = c.fork_step {
                point.step = s;
            }
            point.position = c.fork_position;
            let fork = ForkCombine::with_base(scheduled, point, contract);
            Ok(BuiltCombine {
                contract: contract_label(&c.contract, &base),
                schedule: format!("{} + {}", schedule, fork.describe()),
                combine: Box::new(fork),
            })
        }
    }
}

/// The provenance block of traces written by this build's reference runtime.
pub fn reference_provenance(threads: u32, notes: Vec<(String, String)>) -> Provenance {
    Provenance {
        runtime: "moeconf-reference-runtime".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        threads,
        notes,
    }
}

/// Everything a traced run needs.
pub struct RunSpec<'a> {
    /// Prompt text (tokenized with the model's tokenizer).
    pub prompt: &'a str,
    /// Tokens to generate.
    pub max_new_tokens: u32,
    /// Precision profile.
    pub precision: Precision,
    /// Combine selection.
    pub combine: &'a CombineChoice,
    /// Capture spec.
    pub capture: CaptureSpec,
    /// Digest algorithm.
    pub algorithm: Algorithm,
    /// Canonicalization policy.
    pub canon: CanonPolicy,
}

/// What a traced run produced.
pub struct RunOutcome {
    /// Generated ids.
    pub tokens: Vec<u32>,
    /// Decoded continuation.
    pub text: String,
    /// Trace summary.
    pub summary: WriteSummary,
    /// Prompt ids.
    pub prompt_ids: Vec<u32>,
}

/// Runs the model greedily and writes the trace to `out` atomically.
pub fn run_to_trace(m: &LoadedModel, spec: &RunSpec<'_>, out: &Path) -> Result<RunOutcome, RunError> {
    use moeconf_reference_runtime::tokenizer::Detokenize;
    if spec.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    let prompt_ids = m.tokenizer.encode(spec.prompt)?;
    if prompt_ids.is_empty() {
        bail!("the prompt {:?} tokenizes to no tokens", spec.prompt);
    }
    let cfg = m.model.config();
    let built = build_combine(
        spec.combine,
        cfg.experts_per_tok,
        spec.prompt,
        cfg.layer_types.len(),
    )?;
    let tok_bytes = read(&m.dir.join("tokenizer.json"))?;
    let binding = Binding {
        model: model_identity(&m.name, &m.dir, spec.algorithm)?,
        tokenizer: TokenizerIdentity {
            name: "tokenizer.json".into(),
            digest: spec.algorithm.hash(&tok_bytes),
        },
        prompt: PromptBinding {
            text: spec.prompt.to_string(),
            ids: prompt_ids.clone(),
        },
        decoding: Decoding {
            strategy: "greedy".into(),
            max_new_tokens: spec.max_new_tokens,
        },
        precision: spec.precision.name().to_string(),
        contract: built.contract.clone(),
        schedule: built.schedule.clone(),
        capture: spec.capture,
        canon: spec.canon,
        extra: vec![],
    };
    let header = Header {
        binding,
        provenance: reference_provenance(rayon::current_num_threads() as u32, vec![]),
    };
    let writer = TraceWriter::create(out, spec.algorithm, header)?;
    let mut sink = TraceSink::new(writer, spec.capture);
    let opts = GenerateOptions {
        max_new_tokens: spec.max_new_tokens as usize,
        precision: spec.precision,
        combine: built.combine.as_ref(),
        detokenizer: Some(&m.tokenizer),
    };
    let generation = m.model.generate(&prompt_ids, &opts, &mut sink)?;
    let summary = sink.finish()?;
    let text = m.tokenizer.decode(&generation.tokens)?;
    Ok(RunOutcome {
        tokens: generation.tokens,
        text,
        summary,
        prompt_ids,
    })
}
