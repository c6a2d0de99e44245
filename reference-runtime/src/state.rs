//! Decode-time persistent state, exactly the HF 5.23.0 cache content (notes §4),
//! in a canonical logical layout without allocation padding.
//!
//! Per layer: `cumulative_length`; `window_kv` = the last min(c, w−1) post-norm,
//! post-RoPE kv vectors in position order; for CSA/HCA layers the compressor
//! state and for CSA layers the indexer state ([`CompressorState`]): raw
//! buffers of the open window (c mod rate rows; gate stored without the
//! position bias), the emitted compressed entries (post norm, post RoPE), the
//! entry count, and for CSA the overlap slice (Ca half of the last closed
//! window; gate includes the position bias), `None` before the first window
//! closes. All floats are FP32 holding the profile's values (BF16-representable
//! in the bf16 profile except the overlap gate, which HF keeps in FP32).
//!
//! [`DecodeState`] is `Clone`, and keeps the position, step and pending token
//! explicit, so a run can be snapshot and forked.

use moeconf_fingerprint::{Component, Level, Phase};

use crate::capture::{At, Recorder};
use crate::config::{AttentionKind, ModelConfig};
use crate::continuation::Continuation;
use crate::error::RuntimeError;

/// State of one compressor (main or indexer) of a CSA/HCA layer.
#[derive(Debug, Clone, PartialEq)]
pub struct CompressorState {
    /// Compress rate (window length).
    pub rate: usize,
    /// Width of the raw projections (2·dim with overlap, else dim).
    pub width: usize,
    /// Width of an emitted entry.
    pub dim: usize,
    /// Whether windows overlap (CSA).
    pub overlap: bool,
    /// Raw kv projections of the open window, `[c mod rate, width]` row-major.
    pub buffer_kv: Vec<f32>,
    /// Raw gate projections of the open window (no position bias), `[c mod rate, width]`.
    pub buffer_gate: Vec<f32>,
    /// Emitted entries, `[T, dim]`.
    pub compressed_kv: Vec<f32>,
    /// T, the number of emitted entries.
    pub entry_count: u64,
    /// Ca kv of the last closed window, `[rate, dim]` (CSA), or `None`.
    pub overlap_kv: Option<Vec<f32>>,
    /// Ca gate (+ position bias) of the last closed window, `[rate, dim]`, or `None`.
    pub overlap_gate: Option<Vec<f32>>,
}

impl CompressorState {
    /// Empty state.
    pub fn new(rate: usize, dim: usize, overlap: bool) -> CompressorState {
        CompressorState {
            rate,
            width: if overlap { 2 * dim } else { dim },
            dim,
            overlap,
            buffer_kv: Vec::new(),
            buffer_gate: Vec::new(),
            compressed_kv: Vec::new(),
            entry_count: 0,
            overlap_kv: None,
            overlap_gate: None,
        }
    }

    /// Rows in the open-window buffer.
    pub fn buffered(&self) -> usize {
        self.buffer_kv.len() / self.width
    }

    /// Entry `i` (`dim` values).
    pub fn entry(&self, i: usize) -> &[f32] {
        &self.compressed_kv[i * self.dim..(i + 1) * self.dim]
    }

    fn emit_l2(&self, rec: &mut Recorder<'_>, at: At, role: CompressorRole) -> Result<(), RuntimeError> {
        let c = role.components();
        let (w, d) = (self.width as u64, self.dim as u64);
        let rows = self.buffered() as u64;
        rec.f32(c.buffer_kv, at, &[rows, w], &self.buffer_kv)?;
        rec.f32(c.buffer_gate, at, &[rows, w], &self.buffer_gate)?;
        rec.f32(c.compressed_kv, at, &[self.entry_count, d], &self.compressed_kv)?;
        rec.i64_scalar(c.entry_count, at, self.entry_count as i64)?;
        if self.overlap {
            let empty: Vec<f32> = Vec::new();
            let ok = self.overlap_kv.as_ref().unwrap_or(&empty);
            let og = self.overlap_gate.as_ref().unwrap_or(&empty);
            let m = (ok.len() / self.dim) as u64;
            rec.f32(c.overlap_kv, at, &[m, d], ok)?;
            rec.f32(c.overlap_gate, at, &[m, d], og)?;
        }
        Ok(())
    }
}

/// Which compressor of a layer a [`CompressorState`] belongs to; chooses its
/// L2 records among the catalogue's `state.compressor.*` and
/// `state.indexer.*` components.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompressorRole {
    /// The attention's own KV compressor (CSA and HCA layers).
    Attention,
    /// The lightning indexer's compressor (CSA layers).
    Indexer,
}

/// The six L2 components of one compressor, in serialization order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressorComponents {
    /// Open-window kv buffer.
    pub buffer_kv: Component,
    /// Open-window gate buffer.
    pub buffer_gate: Component,
    /// Closed compressed entries.
    pub compressed_kv: Component,
    /// Number of closed entries.
    pub entry_count: Component,
    /// Overlap kv carried into the next window.
    pub overlap_kv: Component,
    /// Overlap gate carried into the next window.
    pub overlap_gate: Component,
}

impl CompressorRole {
    /// The L2 components of this compressor's open-window buffers (kv, gate).
    pub(crate) fn buffer_components(self) -> (Component, Component) {
        let c = self.components();
        (c.buffer_kv, c.buffer_gate)
    }

    /// This compressor's L2 components (the one table writers and readers
    /// of the persistent state share).
    pub fn components(self) -> CompressorComponents {
        use Component as C;
        match self {
            CompressorRole::Attention => CompressorComponents {
                buffer_kv: C::StateCompressorBufferKv,
                buffer_gate: C::StateCompressorBufferGate,
                compressed_kv: C::StateCompressorCompressedKv,
                entry_count: C::StateCompressorEntryCount,
                overlap_kv: C::StateCompressorOverlapKv,
                overlap_gate: C::StateCompressorOverlapGate,
            },
            CompressorRole::Indexer => CompressorComponents {
                buffer_kv: C::StateIndexerBufferKv,
                buffer_gate: C::StateIndexerBufferGate,
                compressed_kv: C::StateIndexerCompressedKv,
                entry_count: C::StateIndexerEntryCount,
                overlap_kv: C::StateIndexerOverlapKv,
                overlap_gate: C::StateIndexerOverlapGate,
            },
        }
    }
}

/// State of one decoder layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerState {
    pub kind: AttentionKind,
    /// Tokens processed by this layer so far (c).
    pub cumulative_length: u64,
    /// head_dim d.
    pub head_dim: usize,
    /// Last min(c, w−1) kv vectors, `[n, d]`, oldest first.
    pub window_kv: Vec<f32>,
    /// Main compressor (CSA/HCA).
    pub compressor: Option<CompressorState>,
    /// Indexer compressor (CSA).
    pub indexer: Option<CompressorState>,
}

/// The whole persistent state of a generation, plus its explicit counters.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeState {
    /// Per-layer caches.
    pub layers: Vec<LayerState>,
    /// Absolute position of the next token to be consumed (= tokens consumed so far).
    pub position: u32,
    /// Index of the next forward step (0 = prefill).
    pub step: u32,
    /// The predicted token not yet consumed (g_{step}), if any.
    pub pending: Option<u32>,
    /// Prompt ids consumed by the prefill.
    pub prompt: Vec<u32>,
    /// Generated tokens g_1, g_2, … so far.
    pub generated: Vec<u32>,
    /// The decoding of `generated` kept from step to step (the
    /// `text.continuation` record); a cache, not compared.
    pub continuation: Continuation,
}

impl DecodeState {
    /// The phase of the next step: the prefill before any step, decode after it.
    pub fn phase(&self) -> Phase {
        if self.step == 0 {
            Phase::Prefill
        } else {
            Phase::Decode
        }
    }

    /// The empty state of a model.
    pub fn new(cfg: &ModelConfig) -> DecodeState {
        let layers = cfg
            .layer_types
            .iter()
            .map(|&kind| LayerState {
                kind,
                cumulative_length: 0,
                head_dim: cfg.head_dim,
                window_kv: Vec::new(),
                compressor: match kind {
                    AttentionKind::Sliding => None,
                    AttentionKind::Csa => Some(CompressorState::new(cfg.csa_rate, cfg.head_dim, true)),
                    AttentionKind::Hca => Some(CompressorState::new(cfg.hca_rate, cfg.head_dim, false)),
                },
                indexer: match kind {
                    AttentionKind::Csa => Some(CompressorState::new(cfg.csa_rate, cfg.index_head_dim, true)),
                    _ => None,
                },
            })
            .collect();
        DecodeState {
            layers,
            position: 0,
            step: 0,
            pending: None,
            prompt: Vec::new(),
            generated: Vec::new(),
            continuation: Continuation::default(),
        }
    }

    /// Emits the L2 records of every layer in canonical order (capture.md).
    pub(crate) fn emit_l2(&self, rec: &mut Recorder<'_>, pos: u32) -> Result<(), RuntimeError> {
        if !rec.wants(Level::L2) {
            return Ok(());
        }
        for (i, ls) in self.layers.iter().enumerate() {
            ls.emit_l2(rec, At::layer(pos, i as u32))?;
        }
        Ok(())
    }
}

impl LayerState {
    /// Emits this layer's L2 records at `at`, in canonical order.
    pub(crate) fn emit_l2(&self, rec: &mut Recorder<'_>, at: At) -> Result<(), RuntimeError> {
        rec.i64_scalar(
            Component::StateCumulativeLength,
            at,
            self.cumulative_length as i64,
        )?;
        let n = (self.window_kv.len() / self.head_dim) as u64;
        rec.f32(
            Component::StateWindowKv,
            at,
            &[n, self.head_dim as u64],
            &self.window_kv,
        )?;
        if let Some(c) = &self.compressor {
            c.emit_l2(rec, at, CompressorRole::Attention)?;
        }
        if let Some(c) = &self.indexer {
            c.emit_l2(rec, at, CompressorRole::Indexer)?;
        }
        Ok(())
    }
}
