//! The DeepSeek-V4 model: loading from a checkpoint directory and one forward
//! step (prefill or decode) over explicit [`DecodeState`], with capture.
//!
//! Execution order of a step over n tokens at positions P..P+n−1: embedding
//! (N identical streams per token), then layer-major — for each layer i, for
//! each position in order: attention half (hc_pre, attn_norm, attention, hc_post)
//! then FFN half (hc_pre, ffn_norm, router, experts, combine, hc_post) — then
//! the head on the last position only. Per-token processing with the cache is
//! exactly HF's masked prefill (same key sets per query, notes §2.8). A
//! chunked prefill ([`Model::step_chunked`]) runs this order chunk by chunk
//! and gives the same records.

use std::path::{Path, PathBuf};

use moeconf_fingerprint::{Component, Half, Level};

use crate::attention::{attention_forward, AttnWeights, Ropes};
use crate::capture::{At, CaptureSink, Progress, Recorder};
use crate::config::{AttentionKind, MlpKind, ModelConfig};
use crate::context::TokenCtx;
use crate::error::RuntimeError;
use crate::faults::{Active, FaultPlan, GlobalActive};
use crate::head::{argmax, head_forward_with, topk_logits, HeadWeights};
use crate::mhc::{hc_post_with, hc_pre_with, HcHead, HcParams, HcPre, HcSite};
use crate::moe::{moe_forward, MoeWeights};
use crate::precision::Precision;
use crate::rmsnorm::rmsnorm_weighted;
use crate::rope::RopeFreqs;
use crate::state::{DecodeState, LayerState};
use crate::tokenizer::Detokenize;
use crate::weights::{Mat, WeightDType, WeightLoader};
use moeconf_contract::MoeCombine;

/// Weights of one decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// attn_norm weight `[D]` (HF input_layernorm).
    pub attn_norm: Vec<f32>,
    /// ffn_norm weight `[D]` (HF post_attention_layernorm).
    pub ffn_norm: Vec<f32>,
    /// mHC site of the attention half.
    pub hc_attn: HcSite,
    /// mHC site of the FFN half.
    pub hc_ffn: HcSite,
    pub attn: AttnWeights,
    pub moe: MoeWeights,
}

impl LayerWeights {
    /// Calls `f` on every matrix of the block.
    pub fn for_each_mat(&self, f: &mut impl FnMut(&Mat)) {
        f(&self.hc_attn.fn_);
        f(&self.hc_ffn.fn_);
        let a = &self.attn;
        for m in [&a.wq_a, &a.wq_b, &a.wkv, &a.wo_a, &a.wo_b] {
            f(m);
        }
        if let Some(c) = &a.compressor {
            f(&c.wkv);
            f(&c.wgate);
        }
        if let Some(ix) = &a.indexer {
            f(&ix.compressor.wkv);
            f(&ix.compressor.wgate);
            f(&ix.wq_b);
            f(&ix.weights_proj);
        }
        f(&self.moe.router.gate);
        for e in self.moe.experts.iter().chain(std::iter::once(&self.moe.shared)) {
            f(&e.w1);
            f(&e.w3);
            f(&e.w2);
        }
    }

    /// Loads the decoder block under `p` (`layers.{i}`, `mtp.{j}`).
    fn load_at(
        w: &mut WeightLoader,
        cfg: &ModelConfig,
        p: &str,
        attention: AttentionKind,
        mlp: MlpKind,
    ) -> Result<LayerWeights, RuntimeError> {
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        Ok(LayerWeights {
            attn_norm: w.vec_f32(&format!("{p}.attn_norm.weight"), &[d])?,
            ffn_norm: w.vec_f32(&format!("{p}.ffn_norm.weight"), &[d])?,
            hc_attn: HcSite::load(w, &format!("{p}.hc_attn"), n, d)?,
            hc_ffn: HcSite::load(w, &format!("{p}.hc_ffn"), n, d)?,
            attn: AttnWeights::load_at(w, cfg, &format!("{p}.attn"), attention)?,
            moe: MoeWeights::load_at(w, cfg, &format!("{p}.ffn"), mlp)?,
        })
    }
}

/// One multi-token-prediction block `mtp.{j}` (DeepSeek's `MTPBlock`): a decoder
/// block plus the projections that fuse the next token's embedding with the
/// main model's last hidden streams, and its own head collapse. Loaded and
/// shape-checked so a released checkpoint is verified whole; the reference
/// runtime does not run speculative decoding, so these weights are never used
/// in a step (docs/operators.md §8.6).
#[derive(Debug, Clone)]
pub struct MtpWeights {
    /// `e_proj` `[D, D]` (dense format): projects the normalised embedding.
    pub e_proj: Mat,
    /// `h_proj` `[D, D]` (dense format): projects the normalised hidden state.
    pub h_proj: Mat,
    /// `enorm` weight `[D]`.
    pub enorm: Vec<f32>,
    /// `hnorm` weight `[D]`.
    pub hnorm: Vec<f32>,
    /// Final `norm` weight `[D]`.
    pub norm: Vec<f32>,
    /// The block's own mHC head collapse (`hc_head_fn/base/scale`).
    pub hc_head: HcHead,
    /// The decoder block.
    pub block: LayerWeights,
}

impl MtpWeights {
    fn load(w: &mut WeightLoader, cfg: &ModelConfig, j: usize) -> Result<MtpWeights, RuntimeError> {
        let p = format!("mtp.{j}");
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        let attention = cfg.mtp_layer_types[j];
        Ok(MtpWeights {
            e_proj: w.linear(&format!("{p}.e_proj.weight"), d, d, cfg.weights.dense)?,
            h_proj: w.linear(&format!("{p}.h_proj.weight"), d, d, cfg.weights.dense)?,
            enorm: w.vec_f32(&format!("{p}.enorm.weight"), &[d])?,
            hnorm: w.vec_f32(&format!("{p}.hnorm.weight"), &[d])?,
            norm: w.vec_f32(&format!("{p}.norm.weight"), &[d])?,
            hc_head: HcHead {
                fn_: w.mat(&format!("{p}.hc_head_fn"), n, n * d)?,
                base: w.vec_f32(&format!("{p}.hc_head_base"), &[n])?,
                scale: w.vec_f32(&format!("{p}.hc_head_scale"), &[1])?,
            },
            // An MTP block sits after the last layer, past the hash-routed ones.
            block: LayerWeights::load_at(w, cfg, &p, attention, MlpKind::Moe)?,
        })
    }
}

/// A loaded model (weights memory-mapped).
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    dir: PathBuf,
    ropes: Ropes,
    embed: Mat,
    layers: Vec<LayerWeights>,
    head: HeadWeights,
    mtp: Vec<MtpWeights>,
}

/// Options of one forward step.
#[derive(Clone, Copy)]
pub struct StepOptions<'a> {
    pub precision: Precision,
    /// The MoE combine contract.
    pub combine: &'a dyn MoeCombine,
    /// Decoder for the `text.continuation` record (omitted when `None`).
    pub detokenizer: Option<&'a dyn Detokenize>,
    /// Record NaN and infinite values instead of failing. By default (`false`)
    /// every operator output (whether captured or not), the persistent state
    /// it produces and the logits are checked, and the first non-finite value
    /// in execution order ends the step with [`RuntimeError::NonFinite`].
    pub allow_non_finite: bool,
}

/// One sequence of a batched step ([`Model::step_batch`]): its state, the
/// tokens it consumes in this step, and the sink its records go to.
pub struct BatchEntry<'a> {
    pub state: &'a mut DecodeState,
    pub ids: &'a [u32],
    pub sink: &'a mut dyn CaptureSink,
    /// Process this sequence's tokens in chunks of this many (a chunked
    /// prefill inside the batch: chunk r of every sequence goes through every
    /// layer before chunk r + 1 starts); `None`: all at once. 0 is refused.
    pub chunk: Option<usize>,
}

/// Result of one forward step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// Logits at the last position.
    pub logits: Vec<f32>,
    /// The greedy prediction.
    pub next_token: u32,
}

impl Model {
    /// Loads `dir/config.json` and the `*.safetensors` files of `dir`.
    pub fn load(dir: &Path) -> Result<Model, RuntimeError> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let mut w = WeightLoader::open_dir(dir)?;
        let d = cfg.hidden_size;
        let embed = w.mat("embed.weight", cfg.vocab_size, d)?;
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for i in 0..cfg.num_layers() {
            let p = format!("layers.{i}");
            layers.push(LayerWeights::load_at(
                &mut w,
                &cfg,
                &p,
                cfg.layer_types[i],
                cfg.mlp_layer_types[i],
            )?);
        }
        let head = HeadWeights::load(&mut w, &cfg)?;
        let mtp = (0..cfg.mtp_layer_types.len())
            .map(|j| MtpWeights::load(&mut w, &cfg, j))
            .collect::<Result<Vec<_>, _>>()?;
        w.finish(mtp.len())?;
        let ropes = Ropes {
            main: RopeFreqs::main(&cfg),
            compress: RopeFreqs::compress(&cfg),
        };
        Ok(Model {
            cfg,
            dir: dir.to_path_buf(),
            ropes,
            embed,
            layers,
            head,
            mtp,
        })
    }

    /// The validated configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The multi-token-prediction blocks (loaded and shape-checked, never run).
    pub fn mtp(&self) -> &[MtpWeights] {
        &self.mtp
    }

    /// Every matrix of the model with its name-free role, for weight accounting:
    /// `(dtype, body bytes, scale bytes)` summed per dtype, in a fixed order.
    pub fn weight_bytes(&self) -> Vec<(WeightDType, usize, usize)> {
        let mut acc: Vec<(WeightDType, usize, usize)> = Vec::new();
        let mut add = |m: &Mat| match acc.iter_mut().find(|(d, _, _)| *d == m.dtype()) {
            Some(e) => {
                e.1 += m.body_bytes();
                e.2 += m.scale_bytes();
            }
            None => acc.push((m.dtype(), m.body_bytes(), m.scale_bytes())),
        };
        add(&self.embed);
        for l in self.layers.iter().chain(self.mtp.iter().map(|m| &m.block)) {
            l.for_each_mat(&mut add);
        }
        for m in &self.mtp {
            add(&m.e_proj);
            add(&m.h_proj);
            add(&m.hc_head.fn_);
        }
        add(&self.head.hc.fn_);
        add(&self.head.lm_head);
        acc.sort_by_key(|(d, _, _)| d.name());
        acc
    }

    /// Whether the routed experts hold BF16 weights (the vllm-cpu profile then
    /// follows vLLM's BF16-expert kernel `cpu_fused_moe`, whose weighted sum
    /// is `operand=fma`; docs/operators.md §11). False for a model without
    /// routed experts.
    pub fn routed_experts_bf16(&self) -> bool {
        self.layers
            .iter()
            .flat_map(|l| l.moe.experts.first())
            .next()
            .is_some_and(|e| e.w1.dtype() == crate::weights::WeightDType::Bf16)
    }

    /// Whether this model can run in `precision`: the official profile needs
    /// the dimensions DeepSeek's quantization kernels assert (non-rope KV
    /// channels a multiple of 64, the indexer head width a power of two and
    /// a multiple of 32, the input width of every quantized GEMM a multiple
    /// of 128; docs/operators.md §10.4). The bf16 and f32 profiles run any
    /// model that loaded.
    pub fn check_precision(&self, precision: Precision) -> Result<(), RuntimeError> {
        if !precision.quantizes() {
            return Ok(());
        }
        let cfg = &self.cfg;
        let mut sites: Vec<(Component, usize)> = Vec::new();
        let mut add = |site: Component, width: usize, quantized: bool| {
            if quantized && !sites.iter().any(|(s, _)| *s == site) {
                sites.push((site, width));
            }
        };
        for lw in &self.layers {
            let a = &lw.attn;
            add(
                Component::AttnNormFp8,
                cfg.hidden_size,
                a.wq_a.quantizes_input() || a.wkv.quantizes_input(),
            );
            let idx_q = a.indexer.as_ref().is_some_and(|ix| ix.wq_b.quantizes_input());
            add(
                Component::AttnQLatFp8,
                cfg.q_lora_rank,
                a.wq_b.quantizes_input() || idx_q,
            );
            add(
                Component::AttnOLatFp8,
                cfg.o_groups * cfg.o_lora_rank,
                a.wo_b.quantizes_input(),
            );
            let experts = || lw.moe.experts.iter().chain(std::iter::once(&lw.moe.shared));
            let up = experts().any(|e| e.w1.quantizes_input() || e.w3.quantizes_input());
            add(Component::FfnNormFp8, cfg.hidden_size, up);
            let down = lw.moe.experts.iter().any(|e| e.w2.quantizes_input());
            add(Component::MoeTermHFp8, cfg.moe_intermediate_size, down);
            add(
                Component::MoeSharedHFp8,
                cfg.moe_intermediate_size,
                lw.moe.shared.w2.quantizes_input(),
            );
        }
        crate::official::check_dimensions(cfg, &self.dir.join("config.json"), &sites)
    }

    /// A fresh, empty decode state for this model.
    pub fn new_state(&self) -> DecodeState {
        DecodeState::new(&self.cfg)
    }

    /// One forward step consuming `ids` at positions `state.position..`:
    /// step 0 (phase Prefill) consumes the prompt; later steps (Decode) consume
    /// one token each. Emits the capture records of the step (capture.md) and
    /// advances `state` (position, step, pending token, generated tokens).
    pub fn step(
        &self,
        state: &mut DecodeState,
        ids: &[u32],
        opts: &StepOptions<'_>,
        sink: &mut dyn CaptureSink,
    ) -> Result<StepOutput, RuntimeError> {
        self.step_with_faults(state, ids, opts, None, sink)
    }

    /// [`Model::step`] with the faults and interventions of `faults` applied
    /// where they match (calibration only, see [`crate::faults`]); `None`
    /// is exactly [`Model::step`].
    pub fn step_with_faults(
        &self,
        state: &mut DecodeState,
        ids: &[u32],
        opts: &StepOptions<'_>,
        faults: Option<&FaultPlan>,
        sink: &mut dyn CaptureSink,
    ) -> Result<StepOutput, RuntimeError> {
        self.step_inner(state, ids, opts, faults, sink)
    }

    /// [`Model::step`] with its tokens processed in chunks of `chunk` (a
    /// chunked prefill, as serving engines schedule long prompts): each chunk
    /// goes through every layer before the next chunk starts. Invariant by
    /// construction: a position's operators read only its own row and the
    /// cache rows of earlier positions, which are complete either way, and
    /// every reduction keeps its fixed order; so every record, and the
    /// trace's root, equals the unchunked step's (only the order in which the
    /// records are emitted differs). `chunk` 0 is refused.
    pub fn step_chunked(
        &self,
        state: &mut DecodeState,
        ids: &[u32],
        opts: &StepOptions<'_>,
        chunk: usize,
        sink: &mut dyn CaptureSink,
    ) -> Result<StepOutput, RuntimeError> {
        let mut one = [BatchEntry {
            state,
            ids,
            sink,
            chunk: Some(chunk),
        }];
        let mut out = self.step_batch(&mut one, opts)?;
        out.pop()
            .ok_or_else(|| RuntimeError::Input("a batch of one gave no output".into()))
    }

    fn step_inner(
        &self,
        state: &mut DecodeState,
        ids: &[u32],
        opts: &StepOptions<'_>,
        faults: Option<&FaultPlan>,
        sink: &mut dyn CaptureSink,
    ) -> Result<StepOutput, RuntimeError> {
        let cfg = &self.cfg;
        self.check_step_input(ids, opts)?;
        let mut rec = Recorder::new(sink, state.step, state.phase(), !opts.allow_non_finite);
        let pos0 = state.position;
        let last = pos0 + ids.len() as u32 - 1;
        let id32: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        rec.i32(Component::TokenInput, At::global(pos0), &id32)?;

        let global = |t: u32| faults.map_or_else(GlobalActive::default, |f| f.global(state.step, t));
        let mut streams = Vec::with_capacity(ids.len());
        for (j, &id) in ids.iter().enumerate() {
            let t = pos0 + j as u32;
            let e = self.embedding(id, global(t).embedding_next_row);
            rec.f32(Component::EmbedOutput, At::global(t), &[e.len() as u64], &e)?;
            streams.push(e.repeat(cfg.hc_mult));
        }
        // The vllm-cpu profile's kernels follow vLLM's forward of the whole
        // step: M = the step's tokens (crate::vllm::ForwardRows).
        let forward = crate::vllm::ForwardRows::enter(ids.len());
        let layers = self.layers.len() as u32;
        for (li, lw) in self.layers.iter().enumerate() {
            for (j, x) in streams.iter_mut().enumerate() {
                rec.progress(Progress {
                    step: state.step,
                    layer: li as u32,
                    layers,
                    done: j as u64,
                    positions: ids.len() as u64,
                    chunk: ids.len() as u64,
                });
                let t = pos0 + j as u32;
                let fx = faults.map_or_else(Active::default, |f| f.active(state.step, li as u32, t));
                let cx = TokenCtx {
                    cfg,
                    p: opts.precision,
                    combine: opts.combine,
                    step: state.step,
                    layer: li as u32,
                    position: t,
                    token: ids[j],
                    fx: &fx,
                    plan: faults,
                };
                self.layer_forward(lw, &mut state.layers[li], x, &cx, &mut rec)?;
            }
        }
        drop(forward);
        let last_stream = streams.pop().unwrap_or_default();
        let head_eps = global(last).head_norm_eps.unwrap_or(cfg.rms_norm_eps);
        self.finish_step(state, ids, opts, &mut rec, &last_stream, head_eps)
    }

    /// Refuses a step's input before anything runs: no tokens, a token
    /// outside the vocabulary, a precision profile the model cannot run.
    fn check_step_input(&self, ids: &[u32], opts: &StepOptions<'_>) -> Result<(), RuntimeError> {
        if ids.is_empty() {
            return Err(RuntimeError::Input(
                "a forward step needs at least one token".into(),
            ));
        }
        self.check_precision(opts.precision)?;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(RuntimeError::Input(format!(
                "token id {bad} is outside the vocabulary 0..{}",
                self.cfg.vocab_size
            )));
        }
        Ok(())
    }

    /// The end of a step: the head on the last position's streams, the
    /// logits, token and text records, the state advanced past `ids`, and
    /// the persistent state at the decode boundary.
    fn finish_step(
        &self,
        state: &mut DecodeState,
        ids: &[u32],
        opts: &StepOptions<'_>,
        rec: &mut Recorder<'_>,
        last_stream: &[f32],
        head_eps: f32,
    ) -> Result<StepOutput, RuntimeError> {
        let last = state.position + ids.len() as u32 - 1;
        let logits = head_forward_with(&self.head, last_stream, &self.cfg, opts.precision, head_eps);
        let next = argmax(&logits);
        logit_records(rec, &logits, last)?;
        rec.i32(Component::TokenOutput, At::global(last), &[next as i32])?;

        if state.step == 0 {
            state.prompt = ids.to_vec();
        }
        state.generated.push(next);
        state.position = last + 1;
        state.step += 1;
        state.pending = Some(next);
        text_record(rec, opts.detokenizer, state, last)?;
        state.emit_l2(rec, last)?;
        Ok(StepOutput {
            logits,
            next_token: next,
        })
    }

    /// One forward step of several independent sequences together (batched
    /// decoding; a prefilling and a decoding sequence may share a step, as in
    /// continuous batching): layer by layer, each sequence's positions in
    /// turn, each sequence with its own state, tokens and capture sink.
    /// Invariant by construction: a sequence's operators read only its own
    /// rows and cache, and every reduction keeps its fixed order, so each
    /// sink receives exactly the records [`Model::step`] gives that sequence
    /// alone. Every input is checked before anything runs; on an error no
    /// state has advanced.
    pub fn step_batch(
        &self,
        batch: &mut [BatchEntry<'_>],
        opts: &StepOptions<'_>,
    ) -> Result<Vec<StepOutput>, RuntimeError> {
        for e in batch.iter() {
            self.check_step_input(e.ids, opts)?;
            if e.chunk == Some(0) {
                return Err(RuntimeError::Input(
                    "a prefill chunk needs at least one token".into(),
                ));
            }
        }
        let cfg = &self.cfg;
        struct Seq<'b> {
            state: &'b mut DecodeState,
            ids: &'b [u32],
            rec: Recorder<'b>,
            streams: Vec<Vec<f32>>,
            chunk: usize,
        }
        let mut seqs = Vec::with_capacity(batch.len());
        for e in batch.iter_mut() {
            let (step, phase) = (e.state.step, e.state.phase());
            let mut rec = Recorder::new(&mut *e.sink, step, phase, !opts.allow_non_finite);
            let pos0 = e.state.position;
            let id32: Vec<i32> = e.ids.iter().map(|&t| t as i32).collect();
            rec.i32(Component::TokenInput, At::global(pos0), &id32)?;
            // A position's streams exist only while its chunk runs (filled
            // when the chunk starts, freed when it has left the last layer;
            // the last position's are kept for the head), so a chunked
            // prefill holds one chunk of residual streams, not the prompt's.
            let streams = vec![Vec::new(); e.ids.len()];
            seqs.push(Seq {
                state: &mut *e.state,
                ids: e.ids,
                rec,
                streams,
                chunk: e.chunk.unwrap_or(e.ids.len()).max(1),
            });
        }
        let none = Active::default();
        let rounds = seqs
            .iter()
            .map(|s| s.ids.len().div_ceil(s.chunk))
            .max()
            .unwrap_or(0);
        for round in 0..rounds {
            // vLLM's forward of this round: every sequence's tokens in it.
            let m: usize = seqs
                .iter()
                .map(|s| {
                    let start = (round * s.chunk).min(s.streams.len());
                    (start + s.chunk).min(s.streams.len()) - start
                })
                .sum();
            let _forward = crate::vllm::ForwardRows::enter(m);
            for s in seqs.iter_mut() {
                let pos0 = s.state.position;
                let start = (round * s.chunk).min(s.streams.len());
                let end = (start + s.chunk).min(s.streams.len());
                for j in start..end {
                    let emb = self.embedding(s.ids[j], false);
                    s.rec.f32(
                        Component::EmbedOutput,
                        At::global(pos0 + j as u32),
                        &[emb.len() as u64],
                        &emb,
                    )?;
                    s.streams[j] = emb.repeat(cfg.hc_mult);
                }
            }
            for (li, lw) in self.layers.iter().enumerate() {
                for s in seqs.iter_mut() {
                    let pos0 = s.state.position;
                    let start = (round * s.chunk).min(s.streams.len());
                    let end = (start + s.chunk).min(s.streams.len());
                    let positions = s.streams.len() as u64;
                    for (j, x) in s.streams[start..end].iter_mut().enumerate() {
                        let j = start + j;
                        s.rec.progress(Progress {
                            step: s.state.step,
                            layer: li as u32,
                            layers: self.layers.len() as u32,
                            done: j as u64,
                            positions,
                            chunk: s.chunk as u64,
                        });
                        let cx = TokenCtx {
                            cfg,
                            p: opts.precision,
                            combine: opts.combine,
                            step: s.state.step,
                            layer: li as u32,
                            position: pos0 + j as u32,
                            token: s.ids[j],
                            fx: &none,
                            plan: None,
                        };
                        self.layer_forward(lw, &mut s.state.layers[li], x, &cx, &mut s.rec)?;
                    }
                }
            }
            for s in seqs.iter_mut() {
                let n = s.streams.len();
                let start = (round * s.chunk).min(n);
                let end = (start + s.chunk).min(n);
                // The last position's streams stay for the head; a sequence
                // with fewer rounds than the batch has nothing left here.
                let stop = end.min(n.saturating_sub(1));
                for x in s.streams.iter_mut().take(stop).skip(start) {
                    *x = Vec::new();
                }
            }
        }
        seqs.into_iter()
            .map(|mut s| {
                let last = s.streams.pop().unwrap_or_default();
                self.finish_step(s.state, s.ids, opts, &mut s.rec, &last, cfg.rms_norm_eps)
            })
            .collect()
    }

    /// The embedding row of `id` (of the next id with the
    /// [`crate::faults::FaultKind::EmbeddingWrongRow`] fault).
    fn embedding(&self, id: u32, next_row: bool) -> Vec<f32> {
        let row = if next_row {
            (id as usize + 1) % self.cfg.vocab_size
        } else {
            id as usize
        };
        (0..self.cfg.hidden_size)
            .map(|c| self.embed.get(row, c))
            .collect()
    }

    /// One token through one decoder layer: the attention half (hc_pre,
    /// attn_norm, attention, hc_post), then the FFN half (hc_pre, ffn_norm,
    /// router, experts, combine, hc_post), updating the residual streams `x`.
    fn layer_forward(
        &self,
        lw: &LayerWeights,
        ls: &mut LayerState,
        x: &mut Vec<f32>,
        cx: &TokenCtx<'_>,
        rec: &mut Recorder<'_>,
    ) -> Result<(), RuntimeError> {
        self.attention_half(lw, ls, x, cx, rec)?;
        self.ffn_half(lw, x, cx, rec)
    }

    /// The mHC parameters of the configuration.
    fn hc_params(&self) -> HcParams {
        let cfg = &self.cfg;
        HcParams {
            n: cfg.hc_mult,
            rms_eps: cfg.rms_norm_eps,
            hc_eps: cfg.hc_eps,
            iters: cfg.hc_sinkhorn_iters,
        }
    }

    /// The attention half of one token through one layer: hc_pre,
    /// attn_norm, attention (reading and updating `ls`), hc_post.
    pub(crate) fn attention_half(
        &self,
        lw: &LayerWeights,
        ls: &mut LayerState,
        x: &mut Vec<f32>,
        cx: &TokenCtx<'_>,
        rec: &mut Recorder<'_>,
    ) -> Result<(), RuntimeError> {
        let (cfg, p, at, fx) = (cx.cfg, cx.p, cx.at(), cx.fx);
        let (n, d, eps) = (cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps);
        let pre = hc_pre_with(&lw.hc_attn, x, self.hc_params(), p, fx.hc_attn);
        record_hc_pre(rec, at, Half::Attention, &pre)?;
        let a = rmsnorm_weighted(&pre.x, &lw.attn_norm, fx.attn_norm_eps.unwrap_or(eps), p);
        rec.f32(Component::AttnNorm, at, &[d as u64], &a)?;
        let y = attention_forward(&lw.attn, ls, &a, &self.ropes, cx, rec)?;
        *x = hc_post_with(x, &y, &pre.post, &pre.comb, n, p, fx.hc_attn.post_mix_bf16);
        rec.f32(Component::LayerPostAttnMhc, at, &[n as u64, d as u64], x)?;
        Ok(())
    }

    /// The FFN half of one token through one layer: hc_pre, ffn_norm,
    /// router, experts, combine, hc_post (no persistent state).
    pub(crate) fn ffn_half(
        &self,
        lw: &LayerWeights,
        x: &mut Vec<f32>,
        cx: &TokenCtx<'_>,
        rec: &mut Recorder<'_>,
    ) -> Result<(), RuntimeError> {
        let (cfg, p, at, fx) = (cx.cfg, cx.p, cx.at(), cx.fx);
        let (n, d, eps) = (cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps);
        let pre = hc_pre_with(&lw.hc_ffn, x, self.hc_params(), p, fx.hc_ffn);
        record_hc_pre(rec, at, Half::Ffn, &pre)?;
        let f = rmsnorm_weighted(&pre.x, &lw.ffn_norm, fx.ffn_norm_eps.unwrap_or(eps), p);
        rec.f32(Component::FfnNorm, at, &[d as u64], &f)?;
        let y = moe_forward(&lw.moe, &f, cx, rec)?;
        *x = hc_post_with(x, &y, &pre.post, &pre.comb, n, p, fx.hc_ffn.post_mix_bf16);
        if let (Some(dh), Some(plan)) = (fx.add_post_ffn_mhc, cx.plan) {
            plan.observe_pre_add(x);
            for (v, d) in x.iter_mut().zip(dh) {
                *v += d;
            }
        }
        rec.f32(Component::LayerPostFfnMhc, at, &[n as u64, d as u64], x)?;
        Ok(())
    }

    /// The weights of layer `i`, if the model has it.
    pub fn layer_weights(&self, i: usize) -> Option<&LayerWeights> {
        self.layers.get(i)
    }

    /// The head weights (mHC head collapse, final norm, LM head), which
    /// every step reads after the last layer. Public beside
    /// [`Model::layer_weights`] so that a caller can size what a step reads
    /// (`moeconf bench runtime --real-width` counts its weight bytes).
    pub fn head_weights(&self) -> &HeadWeights {
        &self.head
    }

    /// The embedding matrix `[V, D]`, of which a step reads one row per
    /// token. Public for the same reason as [`Model::head_weights`].
    pub fn embedding_matrix(&self) -> &Mat {
        &self.embed
    }

    /// The embedding row of `id` (the reference's `embed.output`), `None`
    /// for an id outside the vocabulary.
    pub fn embed(&self, id: u32) -> Option<Vec<f32>> {
        ((id as usize) < self.cfg.vocab_size).then(|| self.embedding(id, false))
    }
}

/// The records of one mHC pre, in execution order: the pre weights, the
/// post weights, the Sinkhorn-normalised combination matrix (all FP32, as
/// computed) and the collapse.
fn record_hc_pre(rec: &mut Recorder<'_>, at: At, half: Half, pre: &HcPre) -> Result<(), RuntimeError> {
    use Component as C;
    let (pre_w, post_w, comb, collapse) = match half {
        Half::Attention => (
            C::AttnHcPreWeights,
            C::AttnHcPostWeights,
            C::AttnHcComb,
            C::AttnHcPre,
        ),
        Half::Ffn => (C::FfnHcPreWeights, C::FfnHcPostWeights, C::FfnHcComb, C::FfnHcPre),
    };
    let n = pre.pre.len() as u64;
    rec.f32(pre_w, at, &[n], &pre.pre)?;
    rec.f32(post_w, at, &[n], &pre.post)?;
    rec.f32(comb, at, &[n, n], &pre.comb)?;
    rec.f32(collapse, at, &[pre.x.len() as u64], &pre.x)
}

/// The L1 records of a step: logits at its last position, the top-8 ids and
/// logits, and the rank-1 minus rank-2 margin.
/// The logits are checked for non-finite values even when L1 is not captured.
fn logit_records(rec: &mut Recorder<'_>, logits: &[f32], last: u32) -> Result<(), RuntimeError> {
    let at = At::global(last);
    rec.check(Component::LmLogits, at, logits)?;
    if !rec.wants(Level::L1) {
        return Ok(());
    }
    rec.f32(Component::LmLogits, at, &[logits.len() as u64], logits)?;
    let top = topk_logits(logits, 8.min(logits.len()));
    let top_ids: Vec<i32> = top.iter().map(|&i| i as i32).collect();
    let top_l: Vec<f32> = top.iter().map(|&i| logits[i as usize]).collect();
    rec.i32(Component::LmTopkIds, at, &top_ids)?;
    rec.f32(Component::LmTopkLogits, at, &[top_l.len() as u64], &top_l)?;
    let margin = if top_l.len() > 1 { top_l[0] - top_l[1] } else { 0.0 };
    rec.f32(Component::LmMargin, at, &[1], &[margin])?;
    Ok(())
}

/// The `text.continuation` record: the decoding of every generated id so
/// far, decoded incrementally ([`crate::continuation`]) and passed with how
/// many leading bytes it shares with the previous step's.
fn text_record(
    rec: &mut Recorder<'_>,
    det: Option<&dyn Detokenize>,
    state: &mut DecodeState,
    pos: u32,
) -> Result<(), RuntimeError> {
    if let Some(d) = det {
        if rec.wants(Component::TextContinuation.level()) {
            let (text, kept) = state.continuation.update(d, &state.generated)?;
            rec.grown_bytes(
                Component::TextContinuation,
                At::global(pos),
                text.as_bytes(),
                kept,
            )?;
        }
    }
    Ok(())
}
