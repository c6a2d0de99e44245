//! The DeepSeek-V4 model: loading from a checkpoint directory and one forward
//! step (prefill or decode) over explicit [`DecodeState`], with capture.
//!
//! Execution order of a step over n tokens at positions P..P+n−1: embedding
//! (N identical streams per token), then layer-major — for each layer i, for
//! each position in order: attention half (hc_pre, attn_norm, attention, hc_post)
//! then FFN half (hc_pre, ffn_norm, router, experts, combine, hc_post) — then
//! the head on the last position only. Per-token processing with the cache is
//! exactly HF's masked prefill (same key sets per query, notes §2.8).

use std::path::{Path, PathBuf};

use moeconf_fingerprint::{Level, Phase};

use crate::attention::{attention_forward, AttnWeights, Ropes};
use crate::capture::{CaptureSink, Recorder};
use crate::config::ModelConfig;
use crate::error::RuntimeError;
use crate::faults::{Active, FaultPlan, RoundedRoutedCombine, SharedFirstCombine};
use crate::head::{argmax, head_forward, topk_logits, HeadWeights};
use crate::mhc::{hc_post, hc_pre, HcSite};
use crate::moe::{moe_forward, MoeSite, MoeWeights};
use crate::precision::Precision;
use crate::rmsnorm::rmsnorm_weighted;
use crate::rope::RopeFreqs;
use crate::state::DecodeState;
use crate::tokenizer::Detokenize;
use crate::weights::{Mat, WeightLoader};
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
    /// Attention block.
    pub attn: AttnWeights,
    /// MoE block.
    pub moe: MoeWeights,
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
}

/// Options of one forward step.
#[derive(Clone, Copy)]
pub struct StepOptions<'a> {
    /// Precision profile.
    pub precision: Precision,
    /// The MoE combine contract.
    pub combine: &'a dyn MoeCombine,
    /// Decoder for the `text.continuation` record (omitted when `None`).
    pub detokenizer: Option<&'a dyn Detokenize>,
}

/// Result of one forward step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// Logits at the last position.
    pub logits: Vec<f32>,
    /// The greedy prediction.
    pub next_token: u32,
}

fn l0_text(
    rec: &mut Recorder<'_>,
    det: Option<&dyn Detokenize>,
    ids: &[u32],
    pos: u32,
) -> Result<(), RuntimeError> {
    if let Some(d) = det {
        if rec.wants(Level::L0) {
            let text = d.decode(ids)?;
            rec.bytes(Level::L0, pos, None, "text.continuation", text.as_bytes())?;
        }
    }
    Ok(())
}

impl Model {
    /// Loads `dir/config.json` and the `*.safetensors` files of `dir`.
    pub fn load(dir: &Path) -> Result<Model, RuntimeError> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let mut w = WeightLoader::open_dir(dir)?;
        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        let embed = w.mat("embed.weight", cfg.vocab_size, d)?;
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for i in 0..cfg.num_layers() {
            layers.push(LayerWeights {
                attn_norm: w.vec_f32(&format!("layers.{i}.attn_norm.weight"), &[d])?,
                ffn_norm: w.vec_f32(&format!("layers.{i}.ffn_norm.weight"), &[d])?,
                hc_attn: HcSite::load(&mut w, &format!("layers.{i}.hc_attn"), n, d)?,
                hc_ffn: HcSite::load(&mut w, &format!("layers.{i}.hc_ffn"), n, d)?,
                attn: AttnWeights::load(&mut w, &cfg, i)?,
                moe: MoeWeights::load(&mut w, &cfg, i)?,
            });
        }
        let head = HeadWeights::load(&mut w, &cfg)?;
        w.finish()?;
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
        let cfg = &self.cfg;
        if ids.is_empty() {
            return Err(RuntimeError::Input(
                "a forward step needs at least one token".into(),
            ));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(RuntimeError::Input(format!(
                "token id {bad} is outside the vocabulary 0..{}",
                cfg.vocab_size
            )));
        }
        let p = opts.precision;
        let phase = if state.step == 0 {
            Phase::Prefill
        } else {
            Phase::Decode
        };
        let mut rec = Recorder::new(sink, state.step, phase);
        let pos0 = state.position;
        let last = pos0 + ids.len() as u32 - 1;
        let id32: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        rec.i32(Level::L0, pos0, None, "token.input", &id32)?;

        let (n, d) = (cfg.hc_mult, cfg.hidden_size);
        let mut streams: Vec<Vec<f32>> = ids
            .iter()
            .map(|&t| {
                let e: Vec<f32> = (0..d).map(|c| self.embed.get(t as usize, c)).collect();
                let mut x = Vec::with_capacity(n * d);
                for _ in 0..n {
                    x.extend_from_slice(&e);
                }
                x
            })
            .collect();
        let eps = cfg.rms_norm_eps;
        for (li, lw) in self.layers.iter().enumerate() {
            let l = Some(li as u32);
            for (j, x) in streams.iter_mut().enumerate() {
                let t = pos0 + j as u32;
                let ls = &mut state.layers[li];
                let fx = faults.map_or_else(Active::default, |f| f.active(state.step, li as u32, t));
                let pre = hc_pre(&lw.hc_attn, x, n, eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, p);
                rec.f32(Level::L4, t, l, "attn.hc_pre", &[d as u64], &pre.x)?;
                let a = rmsnorm_weighted(&pre.x, &lw.attn_norm, eps, p);
                rec.f32(Level::L4, t, l, "attn.norm", &[d as u64], &a)?;
                let y =
                    attention_forward(&lw.attn, cfg, ls, &a, t, &self.ropes, p, &mut rec, li as u32, &fx)?;
                *x = hc_post(x, &y, &pre.post, &pre.comb, n, p);
                rec.f32(Level::L3, t, l, "layer.post_attn_mhc", &[n as u64, d as u64], x)?;

                let pre = hc_pre(&lw.hc_ffn, x, n, eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, p);
                rec.f32(Level::L4, t, l, "ffn.hc_pre", &[d as u64], &pre.x)?;
                let f = rmsnorm_weighted(&pre.x, &lw.ffn_norm, fx.ffn_norm_eps.unwrap_or(eps), p);
                rec.f32(Level::L4, t, l, "ffn.norm", &[d as u64], &f)?;
                let site = MoeSite {
                    layer: li as u32,
                    step: state.step,
                    position: t,
                    token: ids[j],
                };
                let combine: &dyn MoeCombine = match (fx.combine, fx.shared_first, fx.rounded_routed_merge) {
                    (Some(c), _, _) => c,
                    (None, true, _) => &SharedFirstCombine,
                    (None, false, true) => &RoundedRoutedCombine,
                    (None, false, false) => opts.combine,
                };
                let y = moe_forward(&lw.moe, &f, cfg, site, p, combine, &mut rec, &fx)?;
                *x = hc_post(x, &y, &pre.post, &pre.comb, n, p);
                if let (Some(dh), Some(plan)) = (fx.add_post_ffn_mhc, faults) {
                    plan.observe_pre_add(x);
                    for (v, d) in x.iter_mut().zip(dh) {
                        *v += d;
                    }
                }
                rec.f32(Level::L3, t, l, "layer.post_ffn_mhc", &[n as u64, d as u64], x)?;
            }
        }
        let last_streams = streams.last().map(|v| v.as_slice()).unwrap_or(&[]);
        let logits = head_forward(&self.head, last_streams, cfg, p);
        let next = argmax(&logits);
        if rec.wants(Level::L1) {
            rec.f32(
                Level::L1,
                last,
                None,
                "lm.logits",
                &[logits.len() as u64],
                &logits,
            )?;
            let top = topk_logits(&logits, 8.min(logits.len()));
            let top_ids: Vec<i32> = top.iter().map(|&i| i as i32).collect();
            let top_l: Vec<f32> = top.iter().map(|&i| logits[i as usize]).collect();
            rec.i32(Level::L1, last, None, "lm.topk_ids", &top_ids)?;
            rec.f32(
                Level::L1,
                last,
                None,
                "lm.topk_logits",
                &[top_l.len() as u64],
                &top_l,
            )?;
            let margin = if top_l.len() > 1 { top_l[0] - top_l[1] } else { 0.0 };
            rec.f32(Level::L1, last, None, "lm.margin", &[1], &[margin])?;
        }
        rec.i32(Level::L0, last, None, "token.output", &[next as i32])?;

        if state.step == 0 {
            state.prompt = ids.to_vec();
        }
        state.generated.push(next);
        state.position = last + 1;
        state.step += 1;
        state.pending = Some(next);
        l0_text(&mut rec, opts.detokenizer, &state.generated, last)?;
        state.emit_l2(&mut rec, last)?;
        Ok(StepOutput {
            logits,
            next_token: next,
        })
    }
}
