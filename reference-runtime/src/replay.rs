//! Replay of one half-layer (or the embedding, or the head) on inputs given
//! from outside: the entry points of `moeconf replay` (docs/replay.md).
//!
//! Layer replay feeds a candidate's captured inputs — the residual streams
//! entering a half-layer and the persistent state of the layer — into the
//! reference's same half-layer and compares what comes out. These entry
//! points run exactly the code a forward step runs ([`Model::step`]: the
//! same private `attention_half` / `ffn_half` functions), with no fault
//! plan, and emit the half's records through a [`CaptureSink`] under the
//! coordinates a forward step would use, so they can be compared record by
//! record with the candidate's.

use moeconf_contract::MoeCombine;
use moeconf_fingerprint::Phase;

use crate::capture::{At, CaptureSink, Recorder};
use crate::context::TokenCtx;
use crate::error::RuntimeError;
use crate::faults::Active;
use crate::head::head_forward_with;
use crate::model::Model;
use crate::precision::Precision;
use crate::state::LayerState;

/// Where a replayed half-layer runs: the forward step, the decoder layer,
/// the absolute position and the token id consumed at that position (hash
/// routing reads it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayAt {
    /// Forward step (0 = prefill).
    pub step: u32,
    /// Decoder layer.
    pub layer: u32,
    /// Absolute token position.
    pub position: u32,
    /// Token id at this position.
    pub token: u32,
    /// Tokens of the forward this position was computed in (the step's, or
    /// its prefill chunk's): the vllm-cpu profile's kernels depend on it
    /// (`crate::vllm::ForwardRows`); the other profiles ignore it.
    pub rows: u32,
}

/// The numerical binding a replay runs under.
#[derive(Clone, Copy)]
pub struct ReplayOptions<'a> {
    pub precision: Precision,
    /// The MoE combine contract.
    pub combine: &'a dyn MoeCombine,
}

fn phase(step: u32) -> Phase {
    if step == 0 {
        Phase::Prefill
    } else {
        Phase::Decode
    }
}

impl Model {
    /// Checks the layer, token and stream length of a replay.
    fn replay_check(&self, at: ReplayAt, x: &[f32]) -> Result<(), RuntimeError> {
        let cfg = self.config();
        if at.layer as usize >= cfg.num_layers() {
            return Err(RuntimeError::Input(format!(
                "replay at layer {}: the model has {} layers",
                at.layer,
                cfg.num_layers()
            )));
        }
        if at.token as usize >= cfg.vocab_size {
            return Err(RuntimeError::Input(format!(
                "replay: token id {} is outside the vocabulary 0..{}",
                at.token, cfg.vocab_size
            )));
        }
        let want = cfg.hc_mult * cfg.hidden_size;
        if x.len() != want {
            return Err(RuntimeError::Input(format!(
                "replay: the residual streams hold {} values, expected hc_mult·D = {want}",
                x.len()
            )));
        }
        Ok(())
    }

    /// Runs the attention half of layer `at.layer` for one token on the
    /// residual streams `x` (replaced by the half's output, the value of
    /// `layer.post_attn_mhc`) and the layer's persistent state `ls`
    /// (advanced by one token), emitting the half's records to `sink`.
    /// Non-finite values are recorded, not refused.
    pub fn replay_attention_half(
        &self,
        at: ReplayAt,
        ls: &mut LayerState,
        x: &mut Vec<f32>,
        opts: &ReplayOptions<'_>,
        sink: &mut dyn CaptureSink,
    ) -> Result<(), RuntimeError> {
        self.replay_check(at, x)?;
        let lw = self
            .layer_weights(at.layer as usize)
            .ok_or_else(|| RuntimeError::Input(format!("no layer {}", at.layer)))?;
        let fx = Active::default();
        let cx = self.replay_ctx(at, opts, &fx);
        let mut rec = Recorder::new(sink, at.step, phase(at.step), false);
        let _forward = crate::vllm::ForwardRows::enter(at.rows.max(1) as usize);
        self.attention_half(lw, ls, x, &cx, &mut rec)
    }

    /// Runs the FFN half of layer `at.layer` for one token on the residual
    /// streams `x` (replaced by the value of `layer.post_ffn_mhc`),
    /// emitting the half's records to `sink`.
    pub fn replay_ffn_half(
        &self,
        at: ReplayAt,
        x: &mut Vec<f32>,
        opts: &ReplayOptions<'_>,
        sink: &mut dyn CaptureSink,
    ) -> Result<(), RuntimeError> {
        self.replay_check(at, x)?;
        let lw = self
            .layer_weights(at.layer as usize)
            .ok_or_else(|| RuntimeError::Input(format!("no layer {}", at.layer)))?;
        let fx = Active::default();
        let cx = self.replay_ctx(at, opts, &fx);
        let mut rec = Recorder::new(sink, at.step, phase(at.step), false);
        let _forward = crate::vllm::ForwardRows::enter(at.rows.max(1) as usize);
        self.ffn_half(lw, x, &cx, &mut rec)
    }

    /// The logits of the head on the last layer's residual streams `x`
    /// (the value of `lm.logits` when `x` is the last position's
    /// `layer.post_ffn_mhc` of the last layer).
    pub fn replay_head(&self, x: &[f32], precision: Precision) -> Result<Vec<f32>, RuntimeError> {
        let cfg = self.config();
        if x.len() != cfg.hc_mult * cfg.hidden_size {
            return Err(RuntimeError::Input(format!(
                "replay: the residual streams hold {} values, expected hc_mult·D = {}",
                x.len(),
                cfg.hc_mult * cfg.hidden_size
            )));
        }
        Ok(head_forward_with(
            self.head_weights(),
            x,
            cfg,
            precision,
            cfg.rms_norm_eps,
        ))
    }

    /// Emits the L2 records of one layer's state `ls` as the decode boundary
    /// of `step` would (at `position`, the step's last position).
    pub fn replay_state_records(
        &self,
        ls: &LayerState,
        step: u32,
        layer: u32,
        position: u32,
        sink: &mut dyn CaptureSink,
    ) -> Result<(), RuntimeError> {
        let mut rec = Recorder::new(sink, step, phase(step), false);
        ls.emit_l2(&mut rec, At::layer(position, layer))
    }

    fn replay_ctx<'a>(&'a self, at: ReplayAt, opts: &ReplayOptions<'a>, fx: &'a Active<'a>) -> TokenCtx<'a> {
        TokenCtx {
            cfg: self.config(),
            p: opts.precision,
            combine: opts.combine,
            step: at.step,
            layer: at.layer,
            position: at.position,
            token: at.token,
            fx,
            plan: None,
        }
    }
}
