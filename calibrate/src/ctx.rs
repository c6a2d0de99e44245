//! What every protocol shares: the loaded model, the run sizes and the
//! runs themselves (greedy generation with a combine, optional faults, into
//! a capture sink or a full trace).

use std::path::{Path, PathBuf};

use moeconf_contract::MoeCombine;
use moeconf_fingerprint::{Algorithm, CanonPolicy, Digest};
use moeconf_reference_runtime::capture::CaptureSink;
use moeconf_reference_runtime::faults::FaultPlan;
use moeconf_reference_runtime::model::StepOptions;
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::state::DecodeState;
use moeconf_reference_runtime::tokenizer::Detokenize;
use moeconf_runner::{model_identity, parse_capture, LoadedModel, TraceSink};
use moeconf_schema::{
    Binding, Decoding, Header, ModelIdentity, PromptBinding, TokenizerIdentity, TraceWriter,
};

use crate::error::{CalibrateError, Result};
use crate::jobs::Params;
use moeconf_shard::ProgressMode;

/// The `inputs` of a partial result (docs/scale.md): the model's name,
/// configuration and weights digests, and the tokenizer's digest.
pub fn inputs_json(model: &ModelIdentity, tokenizer: &Digest) -> serde_json::Value {
    serde_json::json!({
        "model": {
            "name": model.name,
            "config_digest": model.config_digest.to_hex(),
            "weights_digest": model.weights_digest.to_hex(),
        },
        "tokenizer_digest": tokenizer.to_hex(),
    })
}

/// Digest algorithm of every trace and digest the suite writes.
pub const ALGORITHM: Algorithm = Algorithm::Blake3;

/// Sizes of one calibration run (full or `--quick`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Sizes {
    /// Replay prompts used (protocol 1); `usize::MAX` = all.
    pub replay_prompts: usize,
    /// Generated tokens of replay, persistent, canonical, C-check and fault runs.
    pub tokens: usize,
    /// Generated tokens per fork branch (protocol 2; paper: 8).
    pub fork_tokens: usize,
    /// Branches per scheme in the fork sweep; `usize::MAX` = all.
    pub fork_branches: usize,
    /// Request seeds per prompt and scheme (protocols 3–5; paper: 64).
    pub seeds: u64,
    /// Driver tokens of the substitution controls (paper: 9).
    pub control_tokens: usize,
    /// Breadth prompts used (protocol 9); `usize::MAX` = all 50.
    pub breadth_prompts: usize,
    /// Breadth horizons (paper: 8, 16, 32).
    pub horizons: [usize; 3],
    /// Prompt tokens of protocol 11's long context (`--context N`; `None`:
    /// the short context only). Absent from the JSON when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<u32>,
}

impl Sizes {
    /// The paper's sizes.
    pub const FULL: Sizes = Sizes {
        replay_prompts: usize::MAX,
        tokens: 8,
        fork_tokens: 8,
        fork_branches: usize::MAX,
        seeds: 64,
        control_tokens: 9,
        breadth_prompts: usize::MAX,
        horizons: [8, 16, 32],
        context: None,
    };

    /// Reduced sizes for `--quick` (every protocol, fewer runs and tokens).
    pub const QUICK: Sizes = Sizes {
        replay_prompts: 3,
        tokens: 6,
        fork_tokens: 4,
        fork_branches: 48,
        seeds: 6,
        control_tokens: 6,
        breadth_prompts: 8,
        horizons: [4, 8, 12],
        context: None,
    };
}

/// How a calibration run is configured, apart from the model.
#[derive(Debug, Clone)]
pub struct CtxOptions {
    /// Precision profile of every run.
    pub precision: Precision,
    /// Layer of the single-layer fork (paper: 5).
    pub fork_layer: u32,
    pub sizes: Sizes,
    /// Output directory (traces go to its `traces/` folder); for a shard, a
    /// scratch directory whose output files are attached to the partial.
    pub out: PathBuf,
    /// How progress is shown on stderr.
    pub progress: ProgressMode,
}

/// Everything the protocols share.
pub struct Ctx {
    /// The model under calibration.
    pub m: LoadedModel,
    /// Model identity for trace bindings (computed once).
    pub identity: ModelIdentity,
    /// Digest of tokenizer.json.
    pub tokenizer_digest: Digest,
    pub precision: Precision,
    /// Layer of the single-layer fork (paper: 5).
    pub fork_layer: u32,
    pub sizes: Sizes,
    /// Output directory.
    pub out: PathBuf,
    /// How progress is shown on stderr.
    pub progress: ProgressMode,
}

/// One greedy run written to a full trace by [`Ctx::write_trace`].
pub struct TraceRequest<'a> {
    /// Prompt text (bound in the trace).
    pub prompt: &'a str,
    pub prompt_ids: &'a [u32],
    /// Tokens to generate.
    pub tokens: usize,
    /// MoE combine of every event.
    pub combine: &'a dyn MoeCombine,
    /// Faults to inject, if any.
    pub faults: Option<&'a FaultPlan>,
    /// Provenance notes (e.g. the injected fault's name).
    pub notes: Vec<(String, String)>,
    /// The trace file to write.
    pub path: &'a Path,
}

impl Ctx {
    /// Builds the context (hashes the model once for trace bindings); fails
    /// when the fork layer is not a layer of the model.
    pub fn new(m: LoadedModel, opts: CtxOptions) -> Result<Ctx> {
        let layers = m.model.config().num_layers();
        moeconf_runner::check_fork_layer(opts.fork_layer, layers)?;
        let identity = model_identity(&m.name, &m.dir, ALGORITHM)?;
        let tok_path = m.dir.join("tokenizer.json");
        let tok = moeconf_output::input::read_input(&tok_path, "tokenizer file")
            .map_err(moeconf_schema::InputError::from)?;
        let tokenizer_digest = ALGORITHM.hash(&tok);
        Ok(Ctx {
            m,
            identity,
            tokenizer_digest,
            precision: opts.precision,
            fork_layer: opts.fork_layer,
            sizes: opts.sizes,
            out: opts.out,
            progress: opts.progress,
        })
    }

    /// Routed experts per token (k).
    pub fn k(&self) -> usize {
        self.m.model.config().experts_per_tok
    }

    /// What assembling the protocols' sections needs besides job results.
    pub fn params(&self) -> Params {
        Params {
            sizes: self.sizes,
            fork_layer: self.fork_layer,
            k: self.k(),
        }
    }

    /// The digests of what a run reads, recorded in partial results
    /// (docs/scale.md): the model's configuration and weights, the tokenizer.
    pub fn inputs_json(&self) -> serde_json::Value {
        inputs_json(&self.identity, &self.tokenizer_digest)
    }

    /// Tokenizes a prompt (must give at least one token).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let ids = self
            .m
            .tokenizer
            .encode_for(text, self.m.model.config().vocab_size)?;
        if ids.is_empty() {
            return Err(CalibrateError::Invalid(format!(
                "the prompt {text:?} tokenizes to no tokens"
            )));
        }
        Ok(ids)
    }

    /// Decodes generated ids.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(self.m.tokenizer.decode(ids)?)
    }

    /// A progress line on stderr (when enabled).
    pub fn note(&self, msg: &str) {
        if self.progress.enabled() {
            eprintln!("calibrate: {msg}");
        }
    }

    /// Step options with `combine`.
    pub fn step_opts<'a>(&'a self, combine: &'a dyn MoeCombine) -> StepOptions<'a> {
        self.step_opts_in(combine, self.precision)
    }

    /// Step options with `combine` in `precision` (the fault matrix runs both
    /// profiles whatever `--precision` says).
    pub fn step_opts_in<'a>(&'a self, combine: &'a dyn MoeCombine, precision: Precision) -> StepOptions<'a> {
        StepOptions {
            precision,
            combine,
            detokenizer: Some(&self.m.tokenizer),
            allow_non_finite: false,
        }
    }

    /// Runs forward steps from `state` until `n` tokens are generated, with
    /// `combine` and the optional fault plan; records go to `sink`.
    pub fn advance(
        &self,
        state: &mut DecodeState,
        prompt: &[u32],
        n: usize,
        combine: &dyn MoeCombine,
        faults: Option<&FaultPlan>,
        sink: &mut dyn CaptureSink,
    ) -> Result<()> {
        self.advance_in(state, prompt, n, combine, faults, sink, self.precision)
    }

    /// [`Ctx::advance`] in `precision`.
    #[allow(clippy::too_many_arguments)] // advance's arguments plus the profile
    pub fn advance_in(
        &self,
        state: &mut DecodeState,
        prompt: &[u32],
        n: usize,
        combine: &dyn MoeCombine,
        faults: Option<&FaultPlan>,
        sink: &mut dyn CaptureSink,
        precision: Precision,
    ) -> Result<()> {
        let opts = self.step_opts_in(combine, precision);
        while (state.step as usize) < n {
            let ids: Vec<u32> = if state.step == 0 {
                prompt.to_vec()
            } else {
                vec![state
                    .pending
                    .ok_or_else(|| CalibrateError::Invalid("the decode state has no pending token".into()))?]
            };
            self.m.model.step_with_faults(state, &ids, &opts, faults, sink)?;
        }
        Ok(())
    }

    /// A greedy run of `n` tokens from scratch; returns the final state.
    pub fn generate(
        &self,
        prompt: &[u32],
        n: usize,
        combine: &dyn MoeCombine,
        faults: Option<&FaultPlan>,
        sink: &mut dyn CaptureSink,
    ) -> Result<DecodeState> {
        let mut state = self.m.model.new_state();
        self.advance(&mut state, prompt, n, combine, faults, sink)?;
        Ok(state)
    }

    /// Runs greedily into a trace file with every level and payload
    /// (`capture all`); returns the final state.
    pub fn write_trace(&self, req: TraceRequest<'_>) -> Result<DecodeState> {
        self.write_trace_in(req, self.precision)
    }

    /// [`Ctx::write_trace`] in `precision` (bound in the trace).
    pub fn write_trace_in(&self, req: TraceRequest<'_>, precision: Precision) -> Result<DecodeState> {
        self.write_trace_captured(req, precision, "all")
    }

    /// [`Ctx::write_trace_in`] with another capture (`moeconf run --capture`'s
    /// notation, e.g. `fingerprints` for long prompts whose payloads would not fit).
    pub fn write_trace_captured(
        &self,
        req: TraceRequest<'_>,
        precision: Precision,
        capture: &str,
    ) -> Result<DecodeState> {
        let capture = parse_capture(capture)?;
        let binding = Binding {
            model: self.identity.clone(),
            tokenizer: TokenizerIdentity {
                name: "tokenizer.json".into(),
                digest: self.tokenizer_digest,
            },
            prompt: PromptBinding {
                text: req.prompt.to_string(),
                ids: req.prompt_ids.to_vec(),
            },
            decoding: Decoding {
                strategy: "greedy".into(),
                max_new_tokens: req.tokens as u32,
            },
            precision: precision.name().to_string(),
            contract: "native".into(),
            schedule: "identity".into(),
            capture,
            canon: CanonPolicy::default(),
            extra: vec![],
        };
        let header = Header {
            binding,
            provenance: moeconf_runner::reference_provenance(1, req.notes),
        };
        let writer = TraceWriter::create(req.path, ALGORITHM, header)?;
        let mut sink = TraceSink::new(writer, capture).for_model(&self.m.model);
        let mut state = self.m.model.new_state();
        let (ids, n) = (req.prompt_ids, req.tokens);
        self.advance_in(&mut state, ids, n, req.combine, req.faults, &mut sink, precision)?;
        sink.finish()?;
        Ok(state)
    }
}
