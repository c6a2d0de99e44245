//! Fault injection and state interventions for the calibration suite
//! (`moeconf calibrate`): a [`FaultPlan`] lists deliberate deviations from
//! the runtime's numerical contract, each at one (step, layer, position) or
//! everywhere, so the bisector can be checked against a ground truth it did
//! not see, and so the paper's post-mHC substitution control (section
//! 2.4.2) can add ΔH inside a forward.
//!
//! A plan is passed to [`crate::model::Model::step_with_faults`];
//! [`crate::model::Model::step`] passes none, and with no active fault every
//! operator runs exactly the code it runs without a plan (bit-identical).
//!
//! Each [`FaultKind`] changes one operator (or one piece of persistent
//! state); [`FaultKind::component`] is the record that must be the first to
//! differ, in execution order over every level, while its inputs still
//! match. docs/calibration.md lists every kind, its record and its change;
//! `reference-runtime/tests/faults.rs` checks every kind against the
//! runtime's own records in both profiles.
//!
//! Some kinds are *absorbed* by design: their record differs, but a later
//! rounding point erases the difference before the next checkpoint
//! ([`FaultKind::RoutedTermRounded`] under the native combine,
//! [`FaultKind::CombineElementNudge`] at an element the hc_post absorbs,
//! [`FaultKind::IndexerScoreScaleAfterSum`] when the selection keeps its
//! set). Order faults on sums of BF16-valued operands
//! ([`FaultKind::AttentionSoftmaxReversed`]'s value sum,
//! [`FaultKind::CompressorPoolingReversed`], [`FaultKind::SharedExpertFirst`])
//! are usually silent in the bf16 profile: such FP32 sums are exact, so every
//! order gives the same bits (the reason the C contract is order-invariant).

use std::sync::Mutex;

use moeconf_contract::bf16::r_bf16;
use moeconf_contract::{AggregationContract, CombineEvent, MoeCombine, CANONICAL_NAN_BITS};
use moeconf_fingerprint::{Component, Half};

use crate::config::{AttentionKind, ModelConfig};
use crate::precision::Precision;

/// One deliberate deviation from the runtime's numerical contract.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultKind {
    /// Embedding: the row of the next id, `(token + 1) mod V`, instead of the
    /// token's own row (a model-global fault; the layer of its [`Fault`] is
    /// ignored).
    EmbeddingWrongRow,
    /// mHC pre of one half: `pre_j = σ(α₀μ_j + b_j)` without the `+ ε_hc`.
    MhcPreWeightsWithoutEpsilon(Half),
    /// mHC pre of one half: the Sinkhorn row and column steps divide by the
    /// line sum without the `+ ε_hc`.
    MhcSinkhornWithoutEpsilon(Half),
    /// mHC pre of one half: the FP32 post weights truncated to BF16 (low 16
    /// bits cleared) where they are computed.
    MhcPostWeightsTruncated(Half),
    /// mHC pre of one half: the collapse `Σ_j pre_j X_j` with the pre weights
    /// rounded to BF16 first (HF keeps them FP32; the `hc_pre_weights`
    /// record is unchanged).
    MhcCollapseBf16Weights(Half),
    /// mHC post of one half: the mixing `Σ_j C_jk X_j` accumulated in BF16
    /// (R_BF16 after every addition) instead of FP32.
    MhcPostMixBf16Accumulator(Half),
    /// Attention-half RMSNorm (`attn_norm`) with this ε instead of the config's.
    AttnNormEpsilon(f32),
    /// Queries rotated at position t + 1 instead of t (an off-by-one position
    /// in the query RoPE; keys unchanged).
    QueryRopePositionOffByOne,
    /// Attention: the softmax normalizer `Z = Σ_j e_j` and the weighted value
    /// sum `Σ_j p_j v_j` are accumulated in reverse key order (the sink term
    /// is still added last to Z).
    AttentionSoftmaxReversed,
    /// Attention: the softmax normalizer `Z` is accumulated in a BF16
    /// container (R_BF16 after every addition) instead of FP32.
    AttentionSoftmaxBf16Accumulator,
    /// Attention in decode steps only (step ≥ 1; prefill unchanged): the
    /// softmax normalizer is split in two halves over the keys, each summed
    /// in FP32 and then added (a split-K decode kernel).
    AttentionSplitKDecode,
    /// Attention output: the inverse RoPE on each head's output is skipped.
    DerotationSkipped,
    /// Attention output projection: the FP32 result is truncated to BF16
    /// (low 16 bits cleared) instead of rounded to nearest even.
    AttentionOutputTruncate,
    /// The token's kv vector (after kv_norm and RoPE) keeps only this many
    /// explicit mantissa bits (truncation), as if computed at lower precision;
    /// used and stored so.
    KvLowPrecision {
        /// Explicit mantissa bits kept (0..=23; BF16 keeps 7, FP8 E4M3 keeps 3).
        mantissa_bits: u32,
    },
    /// Window cache storage: the kv appended to the window keeps only this
    /// many mantissa bits (the computed kv is unchanged), so every read of
    /// that row, from this token on, sees the stored value.
    WindowStoreLowPrecision {
        /// Explicit mantissa bits kept.
        mantissa_bits: u32,
    },
    /// Window cache read: when the window holds w rows, attention reads only
    /// the newest w − 1 (the oldest is skipped; the cache is unchanged).
    WindowReadDropsOldest,
    /// Main KV compressor (CSA/HCA): the pooling softmax normalizer and the
    /// pooled sum run over the slots in reverse order.
    CompressorPoolingReversed,
    /// Main KV compressor: the pooled sum accumulated in BF16 (R_BF16 after
    /// every addition) instead of FP32.
    CompressorPoolingBf16Accumulator,
    /// Main CSA compressor: a closing window ignores the overlap carried from
    /// the previous window (pools as if it were the first window).
    CompressorIgnoresOverlap,
    /// Main CSA compressor state: the overlap gate saved for the next window
    /// lacks the position bias (only the next window's entry reads it).
    CompressorOverlapGateWithoutBias,
    /// Compressed cache storage: the emitted entry is stored with this many
    /// mantissa bits (the emitted `attn.compressed` is unchanged).
    CompressedStoreLowPrecision {
        /// Explicit mantissa bits kept.
        mantissa_bits: u32,
    },
    /// Indexer compressor: the pooled sum accumulated in BF16 (R_BF16 after
    /// every addition) instead of FP32.
    IndexerCompressorPoolingBf16Accumulator,
    /// Indexer compressor state: the raw kv rows buffered for the open window
    /// keep this many mantissa bits (inject at a token that does not close
    /// the window; the buffer is read when it closes).
    IndexerBufferLowPrecision {
        /// Explicit mantissa bits kept.
        mantissa_bits: u32,
    },
    /// Indexer key cache storage: the emitted indexer entry is stored with
    /// this many mantissa bits (FP8-like indexer keys).
    IndexerStoreLowPrecision {
        /// Explicit mantissa bits kept.
        mantissa_bits: u32,
    },
    /// Main compressor (CSA/HCA): the RMSNorm of the pooled entry with this ε
    /// instead of the config's (an uncaptured step inside `attn.compressed`).
    CompressorNormEpsilon(f32),
    /// KV projection: the FP32 result of `W_kv · a` truncated to BF16 (low 16
    /// bits cleared) instead of rounded, before kv_norm (an uncaptured step
    /// inside `attn.kv`).
    KvProjectionTruncate,
    /// Output projection: one head group's `W_oa` result truncated to BF16
    /// (low 16 bits cleared) instead of rounded (an uncaptured step inside
    /// `attn.output`).
    OutputGroupTruncate {
        /// The head group (0..o_groups; clamped to the last).
        group: usize,
    },
    /// Lightning indexer: the d_I^(−1/2) scale applied once to the head sum
    /// instead of to each head's ReLU(q·k) (a reassociation).
    IndexerScoreScaleAfterSum,
    /// Lightning indexer: the selection keeps one entry fewer than
    /// min(K_I, T) (the lowest-scored selected entry is dropped).
    IndexerTopkDropsLast,
    /// Lightning indexer, a long-context fault: the last selected slot takes
    /// its neighbour in the ranking, the (K_I+1)-th best entry instead of the
    /// K_I-th (an off-by-one in the top-k cut). Only possible once there are
    /// more compressed entries than K_I (T > K_I, from position
    /// rate·(K_I+1) − 1 on); before that the selection is every entry and
    /// the fault changes no bit.
    IndexerTopkTakesNextEntry,
    /// Window cache read, a long-context fault: once the ring of w slots
    /// (slot of position t = t mod w) has wrapped twice (t ≥ 2w), the read
    /// of the newest row takes the next slot, (t + 1) mod w, which holds the
    /// oldest row: the read view has the oldest row twice and lacks the
    /// position's own kv (the cache is unchanged). Before the second wrap it
    /// changes no bit.
    WindowRingReadOffByOne,
    /// Main KV compressor (CSA/HCA), a long-context fault: the entry of
    /// window i is rotated at position i·rate − 1 instead of i·rate (an
    /// off-by-one at the window boundary, as `(i·rate).saturating_sub(1)`),
    /// so the first window's entry (i = 0, position 0) is right and every
    /// entry from the second window on (closing at position 2·rate − 1) is
    /// wrong.
    CompressedPositionOffByOne,
    /// FFN-half RMSNorm (`ffn_norm`) with this ε instead of the config's.
    FfnNormEpsilon(f32),
    /// Router scores: softplus computed as `log1pf(R_BF16(expf(x)))`, the
    /// exponential held in BF16.
    RouterSoftplusBf16Exp,
    /// Router (non-hash layers): the experts at selection ranks k and k+1
    /// are swapped, as if a near-tie had been resolved the other way.
    RouterNearTieFlip,
    /// Hash routing (hash layers): the `tid2eid` row of the next id,
    /// `(token + 1) mod V`.
    HashRouteNextRow,
    /// Router gates: the routed scaling factor applied before the division,
    /// `g_j = round(round(s_{idx_j} · factor) / den)` (a reassociation).
    RouterGateScaleBeforeDivide,
    /// Routed experts: the SwiGLU clamp limit is this value instead of the config's.
    RoutedExpertSwigluLimit(f32),
    /// Shared expert: the SwiGLU clamp limit is this value instead of the config's.
    SharedExpertSwigluLimit(f32),
    /// Routed terms rounded with R_BF16 (`v_j = R_BF16(g_j · y)`) in both
    /// profiles; the native combine rounds every term the same way, so the
    /// combine output is unchanged (absorbed).
    RoutedTermRounded,
    /// MoE combine: native operands and FP32 accumulator, but the shared
    /// expert output is added first: `y = R_BF16(((s + v̂_0) + v̂_1) + …)`.
    SharedExpertFirst,
    /// MoE combine: the routed FP32 sum is rounded to BF16 before the shared
    /// output is merged: `y = R_BF16(R_BF16(a_k) + s)` (a double rounding).
    RoundedRoutedMerge,
    /// MoE combine: the shared-expert output multiplied by this factor (FP32
    /// product) before the run's combine merges it (the `moe.shared` record
    /// is unchanged): a scaling bug the contract grammar cannot name.
    SharedExpertScaled(f32),
    /// MoE combine: every routed term multiplied by the config's routed
    /// scaling factor (FP32 product) before the run's combine, although the
    /// gates already hold it (the `moe.term.J` records are unchanged).
    RoutedScalingAppliedTwice,
    /// Routed terms: the gate applied to the down projection's unrounded FP32
    /// output, `v_j = g_j · (W2·h)`, instead of to its rounded output
    /// `g_j · R(W2·h)` (silent in f32, which does not round there).
    GateOnUnroundedProduct,
    /// MoE combine with this contract (with its order) instead of the run's combine.
    CombineContract(AggregationContract),
    /// MoE combine: exactly one output element moved one unit in the last
    /// place of the profile's activation format away from zero (BF16 ulp in
    /// the bf16 profile, FP32 ulp in f32).
    CombineElementNudge {
        /// The element (0..D).
        element: usize,
    },
    /// Head: the final RMSNorm with this ε (a model-global fault at the
    /// step's last position; the layer of its [`Fault`] is ignored).
    HeadNormEpsilon(f32),
    /// Intervention (not a fault): `H += ΔH` elementwise in FP32, once, on
    /// the residual streams after the FFN-half hc_post (length hc_mult·D).
    AddPostFfnMhc(Vec<f32>),
    /// Official profile only: this activation-quantization site (a catalogue
    /// component of presence `Quantized`/`QuantizedOnEmit`,
    /// [`crate::official::SITES`]) skips its quantize-dequantize, as a
    /// backend that does not quantize there; the Hadamard rotation of the
    /// indexer sites stays. The site's record holds the unquantized values and
    /// its consumers read them. In the bf16 and f32 profiles, which have no
    /// sites, it changes nothing.
    QuantizationSiteSkipped(Component),
}

impl FaultKind {
    /// The catalogue component of the record this kind changes first: the
    /// record the bisector must name as the first divergence (for the
    /// persistent-state kinds, the L2 record at the decode boundary of the
    /// injected step).
    pub fn component(&self) -> Component {
        use Component as C;
        use FaultKind as K;
        let half = |h: &Half, attn: Component, ffn: Component| match h {
            Half::Attention => attn,
            Half::Ffn => ffn,
        };
        match self {
            K::EmbeddingWrongRow => C::EmbedOutput,
            K::MhcPreWeightsWithoutEpsilon(h) => half(h, C::AttnHcPreWeights, C::FfnHcPreWeights),
            K::MhcSinkhornWithoutEpsilon(h) => half(h, C::AttnHcComb, C::FfnHcComb),
            K::MhcPostWeightsTruncated(h) => half(h, C::AttnHcPostWeights, C::FfnHcPostWeights),
            K::MhcCollapseBf16Weights(h) => half(h, C::AttnHcPre, C::FfnHcPre),
            K::MhcPostMixBf16Accumulator(h) => half(h, C::LayerPostAttnMhc, C::LayerPostFfnMhc),
            K::AttnNormEpsilon(_) => C::AttnNorm,
            K::QueryRopePositionOffByOne => C::AttnQ,
            K::AttentionSoftmaxReversed | K::AttentionSoftmaxBf16Accumulator | K::AttentionSplitKDecode => {
                C::AttnCore
            }
            K::DerotationSkipped | K::AttentionOutputTruncate => C::AttnOutput,
            K::KvLowPrecision { .. } => C::AttnKv,
            K::WindowStoreLowPrecision { .. } | K::WindowReadDropsOldest => C::AttnWindowRead,
            K::CompressorPoolingReversed
            | K::CompressorPoolingBf16Accumulator
            | K::CompressorIgnoresOverlap => C::AttnCompressed,
            K::CompressorOverlapGateWithoutBias => C::StateCompressorOverlapGate,
            K::CompressedStoreLowPrecision { .. } => C::AttnCompressedRead,
            K::IndexerCompressorPoolingBf16Accumulator => C::AttnIndexerCompressed,
            K::IndexerBufferLowPrecision { .. } => C::StateIndexerBufferKv,
            K::IndexerStoreLowPrecision { .. } => C::AttnIndexerRead,
            K::CompressorNormEpsilon(_) => C::AttnCompressed,
            K::KvProjectionTruncate => C::AttnKv,
            K::OutputGroupTruncate { .. } => C::AttnOutput,
            K::IndexerScoreScaleAfterSum => C::AttnIndexerScores,
            K::IndexerTopkDropsLast | K::IndexerTopkTakesNextEntry => C::AttnIndexerTopk,
            K::WindowRingReadOffByOne => C::AttnWindowRead,
            K::CompressedPositionOffByOne => C::AttnCompressed,
            K::FfnNormEpsilon(_) => C::FfnNorm,
            K::RouterSoftplusBf16Exp => C::RouterScores,
            K::RouterNearTieFlip | K::HashRouteNextRow => C::RouterTopk,
            K::RouterGateScaleBeforeDivide => C::RouterGates,
            K::RoutedExpertSwigluLimit(_) | K::RoutedTermRounded | K::GateOnUnroundedProduct => C::MoeTerm,
            K::SharedExpertSwigluLimit(_) => C::MoeShared,
            K::SharedExpertFirst
            | K::RoundedRoutedMerge
            | K::SharedExpertScaled(_)
            | K::RoutedScalingAppliedTwice
            | K::CombineContract(_)
            | K::CombineElementNudge { .. } => C::MoeCombine,
            K::HeadNormEpsilon(_) => C::LmLogits,
            K::AddPostFfnMhc(_) => C::LayerPostFfnMhc,
            K::QuantizationSiteSkipped(site) => *site,
        }
    }

    /// The path of [`FaultKind::component`] (for the family `moe.term.J` its
    /// prefix `moe.term.`; match a record path with `component().matches`).
    pub fn operator(&self) -> &'static str {
        self.component().path()
    }

    /// Whether the kind is model-global (embedding, head): it applies at its
    /// step and position whatever layer its [`Fault`] names.
    pub fn is_global(&self) -> bool {
        matches!(self, FaultKind::EmbeddingWrongRow | FaultKind::HeadNormEpsilon(_))
    }

    /// For the long-context kinds, the first absolute position at which the
    /// kind changes a bit on a layer of attention kind `layer` of `cfg`
    /// (active there, it is a no-op at every earlier position); `None` for
    /// the other kinds, and for a layer where the kind never acts (the
    /// indexer's only on CSA layers, the compressor's only on CSA and HCA
    /// layers).
    pub fn long_context_onset(&self, cfg: &ModelConfig, layer: AttentionKind) -> Option<u32> {
        let pos = |x: usize| u32::try_from(x).ok();
        let rate = (layer != AttentionKind::Sliding).then(|| cfg.compress_rate(layer));
        match self {
            // A ring of one slot has no other slot to read.
            FaultKind::WindowRingReadOffByOne if cfg.sliding_window >= 2 => {
                pos(cfg.sliding_window.checked_mul(2)?)
            }
            FaultKind::IndexerTopkTakesNextEntry if layer == AttentionKind::Csa && cfg.index_topk > 0 => {
                let entries = cfg.index_topk.checked_add(1)?;
                pos(cfg.csa_rate.checked_mul(entries)?.checked_sub(1)?)
            }
            FaultKind::CompressedPositionOffByOne => pos(rate?.checked_mul(2)?.checked_sub(1)?),
            _ => None,
        }
    }

    /// A short name for reports (`attention-softmax-reversed`, `combine:b+order=class:135`, …).
    pub fn name(&self) -> String {
        use FaultKind as K;
        let h = |h: &Half| h.name();
        match self {
            K::EmbeddingWrongRow => "embedding-wrong-row".into(),
            K::MhcPreWeightsWithoutEpsilon(x) => format!("mhc-{}-pre-weights-without-eps", h(x)),
            K::MhcSinkhornWithoutEpsilon(x) => format!("mhc-{}-sinkhorn-without-eps", h(x)),
            K::MhcPostWeightsTruncated(x) => format!("mhc-{}-post-weights-bf16-truncated", h(x)),
            K::MhcCollapseBf16Weights(x) => format!("mhc-{}-collapse-bf16-weights", h(x)),
            K::MhcPostMixBf16Accumulator(x) => format!("mhc-{}-post-mix-bf16-accumulator", h(x)),
            K::AttnNormEpsilon(e) => format!("attn-norm-eps={e:e}"),
            K::QueryRopePositionOffByOne => "query-rope-position-off-by-one".into(),
            K::AttentionSoftmaxReversed => "attention-softmax-reversed".into(),
            K::AttentionSoftmaxBf16Accumulator => "attention-softmax-bf16-accumulator".into(),
            K::AttentionSplitKDecode => "attention-split-k-decode-only".into(),
            K::DerotationSkipped => "attention-derotation-skipped".into(),
            K::AttentionOutputTruncate => "attn-output-bf16-truncate".into(),
            K::KvLowPrecision { mantissa_bits } => format!("kv-mantissa-{mantissa_bits}-bits"),
            K::WindowStoreLowPrecision { mantissa_bits } => {
                format!("window-store-mantissa-{mantissa_bits}-bits")
            }
            K::WindowReadDropsOldest => "window-read-drops-oldest".into(),
            K::CompressorPoolingReversed => "compressor-pooling-reversed".into(),
            K::CompressorPoolingBf16Accumulator => "compressor-pooling-bf16-accumulator".into(),
            K::CompressorIgnoresOverlap => "compressor-ignores-carried-overlap".into(),
            K::CompressorOverlapGateWithoutBias => "compressor-overlap-gate-without-bias".into(),
            K::CompressedStoreLowPrecision { mantissa_bits } => {
                format!("compressed-store-mantissa-{mantissa_bits}-bits")
            }
            K::IndexerCompressorPoolingBf16Accumulator => {
                "indexer-compressor-pooling-bf16-accumulator".into()
            }
            K::IndexerBufferLowPrecision { mantissa_bits } => {
                format!("indexer-buffer-mantissa-{mantissa_bits}-bits")
            }
            K::IndexerStoreLowPrecision { mantissa_bits } => {
                format!("indexer-store-mantissa-{mantissa_bits}-bits")
            }
            K::CompressorNormEpsilon(e) => format!("compressor-norm-eps={e:e}"),
            K::KvProjectionTruncate => "kv-projection-bf16-truncate".into(),
            K::OutputGroupTruncate { group } => format!("attn-output-group-{group}-bf16-truncate"),
            K::IndexerScoreScaleAfterSum => "indexer-score-scale-after-head-sum".into(),
            K::IndexerTopkDropsLast => "indexer-topk-drops-last".into(),
            K::IndexerTopkTakesNextEntry => "indexer-topk-takes-next-entry".into(),
            K::WindowRingReadOffByOne => "window-ring-read-off-by-one-after-second-wrap".into(),
            K::CompressedPositionOffByOne => "compressed-position-off-by-one-from-second-window".into(),
            K::FfnNormEpsilon(e) => format!("ffn-norm-eps={e:e}"),
            K::RouterSoftplusBf16Exp => "router-softplus-bf16-exp".into(),
            K::RouterNearTieFlip => "router-near-tie-flip".into(),
            K::HashRouteNextRow => "hash-route-next-row".into(),
            K::RouterGateScaleBeforeDivide => "router-gate-scale-before-divide".into(),
            K::RoutedExpertSwigluLimit(l) => format!("routed-expert-swiglu-limit={l}"),
            K::SharedExpertSwigluLimit(l) => format!("shared-expert-swiglu-limit={l}"),
            K::RoutedTermRounded => "routed-term-rounded".into(),
            K::SharedExpertFirst => "shared-expert-first".into(),
            K::RoundedRoutedMerge => "routed-sum-rounded-before-shared-merge".into(),
            K::SharedExpertScaled(f) => format!("shared-expert-scaled-x{f}"),
            K::RoutedScalingAppliedTwice => "routed-scaling-applied-twice".into(),
            K::GateOnUnroundedProduct => "gate-on-unrounded-down-projection".into(),
            K::CombineContract(c) => format!("combine:{}", c.describe()),
            K::CombineElementNudge { element } => format!("combine-element-{element}-nudged-one-ulp"),
            K::HeadNormEpsilon(e) => format!("head-norm-eps={e:e}"),
            K::AddPostFfnMhc(_) => "add-post-ffn-mhc".into(),
            K::QuantizationSiteSkipped(site) => format!("quantization-site-skipped:{site}"),
        }
    }
}

/// A fault and where it applies; `None` coordinates match everything.
#[derive(Debug, Clone, PartialEq)]
pub struct Fault {
    /// Forward step (0 = prefill), or every step.
    pub step: Option<u32>,
    /// Decoder layer, or every layer.
    pub layer: Option<u32>,
    /// Absolute token position, or every position of the step.
    pub position: Option<u32>,
    pub kind: FaultKind,
}

impl Fault {
    /// A fault at one step and layer (every position of that step).
    pub fn at(step: u32, layer: u32, kind: FaultKind) -> Fault {
        Fault {
            step: Some(step),
            layer: Some(layer),
            position: None,
            kind,
        }
    }

    fn matches(&self, step: u32, layer: u32, position: u32) -> bool {
        self.step.is_none_or(|s| s == step)
            && self.layer.is_none_or(|l| l == layer)
            && self.position.is_none_or(|p| p == position)
    }
}

/// A list of faults (and interventions) for one run. Later faults of the
/// same kind at the same coordinate override earlier ones.
#[derive(Debug, Default)]
pub struct FaultPlan {
    /// The faults, in the order given.
    pub faults: Vec<Fault>,
    observed: Mutex<Vec<Vec<f32>>>,
}

impl FaultPlan {
    pub fn new(faults: Vec<Fault>) -> FaultPlan {
        FaultPlan {
            faults,
            observed: Mutex::new(Vec::new()),
        }
    }

    /// The faults active at one (step, layer, position) of a decoder layer
    /// (model-global kinds are resolved by [`FaultPlan::global`]).
    pub fn active(&self, step: u32, layer: u32, position: u32) -> Active<'_> {
        use FaultKind as K;
        let mut a = Active::default();
        for f in self.faults.iter().filter(|f| f.matches(step, layer, position)) {
            match &f.kind {
                K::MhcPreWeightsWithoutEpsilon(h) => a.hc_mut(*h).pre_without_eps = true,
                K::MhcSinkhornWithoutEpsilon(h) => a.hc_mut(*h).sinkhorn_without_eps = true,
                K::MhcPostWeightsTruncated(h) => a.hc_mut(*h).post_truncated = true,
                K::MhcCollapseBf16Weights(h) => a.hc_mut(*h).collapse_bf16_weights = true,
                K::MhcPostMixBf16Accumulator(h) => a.hc_mut(*h).post_mix_bf16 = true,
                K::AttnNormEpsilon(e) => a.attn_norm_eps = Some(*e),
                K::QueryRopePositionOffByOne => a.attention.query_rope_off_by_one = true,
                K::AttentionSoftmaxReversed => a.softmax.order = SumOrder::Reversed,
                K::AttentionSoftmaxBf16Accumulator => a.softmax.accumulator = SumAccumulator::Bf16,
                K::AttentionSplitKDecode => a.attention.split_k = step > 0,
                K::DerotationSkipped => a.attention.derotation_skipped = true,
                K::AttentionOutputTruncate => a.attn_output_truncate = true,
                K::KvLowPrecision { mantissa_bits } => a.kv_mantissa_bits = Some(*mantissa_bits),
                K::WindowStoreLowPrecision { mantissa_bits } => {
                    a.attention.window_store_bits = Some(*mantissa_bits)
                }
                K::WindowReadDropsOldest => a.attention.window_read_drops_oldest = true,
                K::CompressorPoolingReversed => a.compressor.pooling.order = SumOrder::Reversed,
                K::CompressorPoolingBf16Accumulator => {
                    a.compressor.pooling.accumulator = SumAccumulator::Bf16
                }
                K::CompressorIgnoresOverlap => a.compressor.ignore_overlap = true,
                K::CompressorOverlapGateWithoutBias => a.compressor.overlap_gate_without_bias = true,
                K::CompressedStoreLowPrecision { mantissa_bits } => {
                    a.compressor.store_bits = Some(*mantissa_bits)
                }
                K::IndexerCompressorPoolingBf16Accumulator => {
                    a.indexer.compressor.pooling.accumulator = SumAccumulator::Bf16
                }
                K::IndexerBufferLowPrecision { mantissa_bits } => {
                    a.indexer.compressor.buffer_bits = Some(*mantissa_bits)
                }
                K::IndexerStoreLowPrecision { mantissa_bits } => {
                    a.indexer.compressor.store_bits = Some(*mantissa_bits)
                }
                K::CompressorNormEpsilon(e) => a.compressor_norm_eps = Some(*e),
                K::KvProjectionTruncate => a.kv_projection_truncate = true,
                K::OutputGroupTruncate { group } => a.output_group_truncate = Some(*group),
                K::IndexerScoreScaleAfterSum => a.indexer.scale_after_sum = true,
                K::IndexerTopkDropsLast => a.indexer.topk_drops_last = true,
                K::IndexerTopkTakesNextEntry => a.indexer.topk_takes_next = true,
                K::WindowRingReadOffByOne => a.attention.window_ring_read_off_by_one = true,
                K::CompressedPositionOffByOne => a.compressor.position_off_by_one = true,
                K::FfnNormEpsilon(e) => a.ffn_norm_eps = Some(*e),
                K::RouterSoftplusBf16Exp => a.router.softplus_bf16_exp = true,
                K::RouterNearTieFlip => a.router_flip = true,
                K::HashRouteNextRow => a.router.hash_next_row = true,
                K::RouterGateScaleBeforeDivide => a.router.gate_scale_first = true,
                K::RoutedExpertSwigluLimit(l) => a.experts.routed_limit = Some(*l),
                K::SharedExpertSwigluLimit(l) => a.experts.shared_limit = Some(*l),
                K::RoutedTermRounded => a.experts.term_rounded = true,
                K::SharedExpertFirst => a.shared_first = true,
                K::RoundedRoutedMerge => a.rounded_routed_merge = true,
                K::SharedExpertScaled(f) => a.shared_scale = Some(*f),
                K::RoutedScalingAppliedTwice => a.routed_scaling_twice = true,
                K::GateOnUnroundedProduct => a.experts.gate_on_unrounded = true,
                K::CombineContract(c) => a.combine = Some(c),
                K::CombineElementNudge { element } => a.combine_nudge = Some(*element),
                K::AddPostFfnMhc(d) => a.add_post_ffn_mhc = Some(d),
                K::QuantizationSiteSkipped(site) => {
                    a.skip_quantization.insert(*site);
                }
                K::EmbeddingWrongRow | K::HeadNormEpsilon(_) => {}
            }
        }
        a
    }

    /// The model-global faults (embedding, head) active at one step and
    /// position, whatever layer their [`Fault`] names.
    pub fn global(&self, step: u32, position: u32) -> GlobalActive {
        let mut g = GlobalActive::default();
        let at = |f: &&Fault| f.step.is_none_or(|s| s == step) && f.position.is_none_or(|p| p == position);
        for f in self.faults.iter().filter(at) {
            match &f.kind {
                FaultKind::EmbeddingWrongRow => g.embedding_next_row = true,
                FaultKind::HeadNormEpsilon(e) => g.head_norm_eps = Some(*e),
                _ => {}
            }
        }
        g
    }

    /// Records the residual streams seen just before an [`FaultKind::AddPostFfnMhc`]
    /// addition (so a control can check the pre-add state bitwise).
    pub(crate) fn observe_pre_add(&self, x: &[f32]) {
        if let Ok(mut o) = self.observed.lock() {
            o.push(x.to_vec());
        }
    }

    /// The states observed just before each ΔH addition, in execution order.
    pub fn pre_add_states(&self) -> Vec<Vec<f32>> {
        self.observed.lock().map(|o| o.clone()).unwrap_or_default()
    }
}

/// The order in which a sum visits its terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SumOrder {
    /// Increasing index (the numerical contract).
    #[default]
    Forward,
    /// Decreasing index (an order fault).
    Reversed,
}

/// The container a running sum is held in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SumAccumulator {
    /// FP32 (the numerical contract).
    #[default]
    F32,
    /// BF16: R_BF16 after every addition (an accumulator fault).
    Bf16,
}

impl SumAccumulator {
    /// `acc + x` in this container.
    #[inline]
    pub fn add(self, acc: f32, x: f32) -> f32 {
        match self {
            SumAccumulator::F32 => acc + x,
            SumAccumulator::Bf16 => r_bf16(acc + x),
        }
    }
}

/// How a softmax-weighted sum accumulates: the contract's (forward, FP32)
/// by default, or as a calibration fault changes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summation {
    /// Order of the terms.
    pub order: SumOrder,
    /// Container of the running sum.
    pub accumulator: SumAccumulator,
}

impl Summation {
    /// Whether this is the numerical contract's summation.
    pub fn is_contract(self) -> bool {
        self == Summation::default()
    }
}

/// The model-global faults of one step and position ([`FaultPlan::global`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GlobalActive {
    /// See [`FaultKind::EmbeddingWrongRow`].
    pub embedding_next_row: bool,
    /// See [`FaultKind::HeadNormEpsilon`].
    pub head_norm_eps: Option<f32>,
}

/// Faults of one mHC site (one half-layer's pre and post).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MhcFaults {
    /// See [`FaultKind::MhcPreWeightsWithoutEpsilon`].
    pub pre_without_eps: bool,
    /// See [`FaultKind::MhcSinkhornWithoutEpsilon`].
    pub sinkhorn_without_eps: bool,
    /// See [`FaultKind::MhcPostWeightsTruncated`].
    pub post_truncated: bool,
    /// See [`FaultKind::MhcCollapseBf16Weights`].
    pub collapse_bf16_weights: bool,
    /// See [`FaultKind::MhcPostMixBf16Accumulator`].
    pub post_mix_bf16: bool,
}

/// Faults of the attention operator and its window cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttentionFaults {
    /// See [`FaultKind::QueryRopePositionOffByOne`].
    pub query_rope_off_by_one: bool,
    /// See [`FaultKind::AttentionSplitKDecode`] (set only in decode steps).
    pub split_k: bool,
    /// See [`FaultKind::DerotationSkipped`].
    pub derotation_skipped: bool,
    /// See [`FaultKind::WindowStoreLowPrecision`].
    pub window_store_bits: Option<u32>,
    /// See [`FaultKind::WindowReadDropsOldest`].
    pub window_read_drops_oldest: bool,
    /// See [`FaultKind::WindowRingReadOffByOne`].
    pub window_ring_read_off_by_one: bool,
}

/// Faults of one compressor (the attention's or the indexer's) and its cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompressorFaults {
    /// Pooling sums: [`FaultKind::CompressorPoolingReversed`],
    /// [`FaultKind::CompressorPoolingBf16Accumulator`].
    pub pooling: Summation,
    /// See [`FaultKind::CompressorIgnoresOverlap`].
    pub ignore_overlap: bool,
    /// See [`FaultKind::CompressorOverlapGateWithoutBias`].
    pub overlap_gate_without_bias: bool,
    /// See [`FaultKind::CompressedPositionOffByOne`].
    pub position_off_by_one: bool,
    /// Mantissa bits kept in the buffered raw kv rows
    /// ([`FaultKind::IndexerBufferLowPrecision`]).
    pub buffer_bits: Option<u32>,
    /// Mantissa bits kept when an emitted entry is stored
    /// ([`FaultKind::CompressedStoreLowPrecision`],
    /// [`FaultKind::IndexerStoreLowPrecision`]).
    pub store_bits: Option<u32>,
}

/// Faults of the lightning indexer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexerFaults {
    /// Its compressor and key cache.
    pub compressor: CompressorFaults,
    /// See [`FaultKind::IndexerScoreScaleAfterSum`].
    pub scale_after_sum: bool,
    /// See [`FaultKind::IndexerTopkDropsLast`].
    pub topk_drops_last: bool,
    /// See [`FaultKind::IndexerTopkTakesNextEntry`].
    pub topk_takes_next: bool,
}

/// Faults of the router (besides [`FaultKind::RouterNearTieFlip`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouterFaults {
    /// See [`FaultKind::RouterSoftplusBf16Exp`].
    pub softplus_bf16_exp: bool,
    /// See [`FaultKind::HashRouteNextRow`].
    pub hash_next_row: bool,
    /// See [`FaultKind::RouterGateScaleBeforeDivide`].
    pub gate_scale_first: bool,
}

/// Faults of the experts and the routed terms.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExpertFaults {
    /// See [`FaultKind::RoutedExpertSwigluLimit`].
    pub routed_limit: Option<f32>,
    /// See [`FaultKind::SharedExpertSwigluLimit`].
    pub shared_limit: Option<f32>,
    /// See [`FaultKind::RoutedTermRounded`].
    pub term_rounded: bool,
    /// See [`FaultKind::GateOnUnroundedProduct`].
    pub gate_on_unrounded: bool,
}

/// The faults active at one coordinate, as the operators consume them.
/// `Active::default()` is the unmodified runtime.
#[derive(Debug, Clone, Copy, Default)]
pub struct Active<'a> {
    /// mHC site of the attention half.
    pub hc_attn: MhcFaults,
    /// mHC site of the FFN half.
    pub hc_ffn: MhcFaults,
    /// See [`FaultKind::AttnNormEpsilon`].
    pub attn_norm_eps: Option<f32>,
    /// The attention softmax normalizer (and, for the order, the weighted
    /// value sum): see [`FaultKind::AttentionSoftmaxReversed`] and
    /// [`FaultKind::AttentionSoftmaxBf16Accumulator`].
    pub softmax: Summation,
    /// The attention operator's other faults and its window cache.
    pub attention: AttentionFaults,
    /// The main compressor and its cache.
    pub compressor: CompressorFaults,
    /// The lightning indexer.
    pub indexer: IndexerFaults,
    /// See [`FaultKind::RoundedRoutedMerge`].
    pub rounded_routed_merge: bool,
    /// See [`FaultKind::SharedExpertScaled`].
    pub shared_scale: Option<f32>,
    /// See [`FaultKind::RoutedScalingAppliedTwice`].
    pub routed_scaling_twice: bool,
    /// See [`FaultKind::CompressorNormEpsilon`].
    pub compressor_norm_eps: Option<f32>,
    /// See [`FaultKind::KvProjectionTruncate`].
    pub kv_projection_truncate: bool,
    /// See [`FaultKind::OutputGroupTruncate`].
    pub output_group_truncate: Option<usize>,
    /// See [`FaultKind::AttentionOutputTruncate`].
    pub attn_output_truncate: bool,
    /// See [`FaultKind::FfnNormEpsilon`].
    pub ffn_norm_eps: Option<f32>,
    /// See [`FaultKind::RouterNearTieFlip`].
    pub router_flip: bool,
    /// The router's other faults.
    pub router: RouterFaults,
    /// The experts and routed terms.
    pub experts: ExpertFaults,
    /// See [`FaultKind::SharedExpertFirst`].
    pub shared_first: bool,
    /// See [`FaultKind::KvLowPrecision`].
    pub kv_mantissa_bits: Option<u32>,
    /// See [`FaultKind::CombineContract`].
    pub combine: Option<&'a AggregationContract>,
    /// See [`FaultKind::CombineElementNudge`].
    pub combine_nudge: Option<usize>,
    /// See [`FaultKind::AddPostFfnMhc`].
    pub add_post_ffn_mhc: Option<&'a [f32]>,
    /// See [`FaultKind::QuantizationSiteSkipped`].
    pub skip_quantization: crate::official::SiteSet,
}

impl<'a> Active<'a> {
    /// The MoE combine of this coordinate: a fault's, else `base` (the run's).
    pub fn combine_or(&self, base: &'a dyn MoeCombine) -> &'a dyn MoeCombine {
        match (self.combine, self.shared_first, self.rounded_routed_merge) {
            (Some(c), _, _) => c,
            (None, true, _) => &SharedFirstCombine,
            (None, false, true) => &RoundedRoutedCombine,
            (None, false, false) => base,
        }
    }

    /// The faults of the mHC site of `half`.
    pub fn hc(&self, half: Half) -> MhcFaults {
        match half {
            Half::Attention => self.hc_attn,
            Half::Ffn => self.hc_ffn,
        }
    }

    fn hc_mut(&mut self, half: Half) -> &mut MhcFaults {
        match half {
            Half::Attention => &mut self.hc_attn,
            Half::Ffn => &mut self.hc_ffn,
        }
    }
}

/// Moves `x` one unit in the last place of the profile's activation format
/// away from zero: the BF16 ulp (bit 16) in the bf16 and official profiles, the FP32 ulp
/// in f32. ±0 becomes the smallest positive subnormal of the format.
pub fn nudge_one_ulp(x: f32, p: Precision) -> f32 {
    let unit = match p {
        Precision::Bf16 | Precision::Official | Precision::VllmCpu => 1u32 << 16,
        Precision::F32 => 1,
    };
    let bits = if x == 0.0 { 0 } else { x.to_bits() };
    f32::from_bits(bits + unit)
}

/// BF16 truncation: the low 16 bits cleared (round toward zero).
#[inline]
pub fn truncate_bf16(x: f32) -> f32 {
    f32::from_bits(x.to_bits() & 0xffff_0000)
}

/// Keeps `bits` explicit mantissa bits of every element (truncation toward zero).
pub fn keep_mantissa_bits(xs: &mut [f32], bits: u32) {
    let drop = 23u32.saturating_sub(bits.min(23));
    let mask = !((1u32 << drop) - 1);
    for x in xs {
        *x = f32::from_bits(x.to_bits() & mask);
    }
}

/// The [`FaultKind::SharedExpertFirst`] combine: routed terms rounded with
/// R_BF16, accumulated in FP32 in selection order *after* the shared output,
/// then R_BF16: `y = R_BF16(((s + v̂_0) + v̂_1) + … + v̂_{k−1})`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SharedFirstCombine;

impl MoeCombine for SharedFirstCombine {
    fn combine(&self, _event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        for (d, o) in out.iter_mut().enumerate() {
            let mut acc = shared[d];
            for t in terms {
                acc += r_bf16(t[d]);
            }
            let y = r_bf16(acc);
            *o = if y.is_nan() {
                f32::from_bits(CANONICAL_NAN_BITS)
            } else {
                y
            };
        }
    }

    fn describe(&self) -> String {
        "shared-expert-first".into()
    }
}

/// The [`FaultKind::RoundedRoutedMerge`] combine: native operands and FP32
/// routed accumulator, but `y = R_BF16(R_BF16(a_k) + s)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundedRoutedCombine;

impl MoeCombine for RoundedRoutedCombine {
    fn combine(&self, _event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        for (d, o) in out.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for t in terms {
                acc += r_bf16(t[d]);
            }
            let y = r_bf16(r_bf16(acc) + shared[d]);
            *o = if y.is_nan() {
                f32::from_bits(CANONICAL_NAN_BITS)
            } else {
                y
            };
        }
    }

    fn describe(&self) -> String {
        "routed-sum-rounded-before-shared-merge".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_matches_coordinates_and_defaults_to_nothing() {
        let plan = FaultPlan::new(vec![
            Fault::at(2, 5, FaultKind::RouterNearTieFlip),
            Fault {
                step: None,
                layer: Some(3),
                position: Some(7),
                kind: FaultKind::KvLowPrecision { mantissa_bits: 3 },
            },
        ]);
        assert!(plan.active(2, 5, 9).router_flip);
        assert!(!plan.active(1, 5, 9).router_flip);
        assert_eq!(plan.active(9, 3, 7).kv_mantissa_bits, Some(3));
        assert_eq!(plan.active(9, 3, 8).kv_mantissa_bits, None);
        let none = plan.active(0, 0, 0);
        assert!(none.softmax.is_contract() && none.combine.is_none() && none.add_post_ffn_mhc.is_none());
    }

    #[test]
    fn global_faults_ignore_the_layer_and_layer_faults_ignore_globals() {
        let plan = FaultPlan::new(vec![
            Fault::at(1, 7, FaultKind::EmbeddingWrongRow),
            Fault {
                step: Some(2),
                layer: None,
                position: Some(9),
                kind: FaultKind::HeadNormEpsilon(0.5),
            },
            Fault {
                step: None,
                layer: Some(4),
                position: None,
                kind: FaultKind::AttentionSplitKDecode,
            },
        ]);
        assert!(plan.global(1, 3).embedding_next_row);
        assert!(!plan.global(0, 3).embedding_next_row);
        assert_eq!(plan.global(2, 9).head_norm_eps, Some(0.5));
        assert_eq!(plan.global(2, 8).head_norm_eps, None);
        assert_eq!(plan.active(1, 7, 3).attention, AttentionFaults::default());
        // Split-K is a decode kernel: never in the prefill.
        assert!(!plan.active(0, 4, 0).attention.split_k);
        assert!(plan.active(3, 4, 0).attention.split_k);
    }

    #[test]
    fn nudge_moves_one_unit_of_the_profile_format_away_from_zero() {
        // 1.0 = 0x3f80_0000: next BF16 is 0x3f81_0000, next FP32 0x3f80_0001.
        assert_eq!(nudge_one_ulp(1.0, Precision::Bf16).to_bits(), 0x3f81_0000);
        assert_eq!(nudge_one_ulp(1.0, Precision::F32).to_bits(), 0x3f80_0001);
        assert_eq!(nudge_one_ulp(-1.0, Precision::F32).to_bits(), 0xbf80_0001);
        assert_eq!(nudge_one_ulp(-0.0, Precision::F32).to_bits(), 0x0000_0001);
        assert_eq!(nudge_one_ulp(0.0, Precision::Bf16).to_bits(), 0x0001_0000);
    }

    #[test]
    fn every_kind_has_a_distinct_name_and_a_catalogue_record() {
        let kinds = [
            FaultKind::EmbeddingWrongRow,
            FaultKind::MhcPreWeightsWithoutEpsilon(Half::Attention),
            FaultKind::MhcPreWeightsWithoutEpsilon(Half::Ffn),
            FaultKind::MhcSinkhornWithoutEpsilon(Half::Ffn),
            FaultKind::MhcPostWeightsTruncated(Half::Attention),
            FaultKind::MhcCollapseBf16Weights(Half::Attention),
            FaultKind::MhcPostMixBf16Accumulator(Half::Ffn),
            FaultKind::KvLowPrecision { mantissa_bits: 3 },
            FaultKind::WindowStoreLowPrecision { mantissa_bits: 3 },
            FaultKind::CompressedStoreLowPrecision { mantissa_bits: 3 },
            FaultKind::IndexerStoreLowPrecision { mantissa_bits: 3 },
            FaultKind::IndexerBufferLowPrecision { mantissa_bits: 3 },
            FaultKind::CombineElementNudge { element: 7 },
            FaultKind::IndexerTopkDropsLast,
            FaultKind::IndexerTopkTakesNextEntry,
            FaultKind::WindowReadDropsOldest,
            FaultKind::WindowRingReadOffByOne,
            FaultKind::CompressedPositionOffByOne,
        ];
        let names: std::collections::HashSet<String> = kinds.iter().map(FaultKind::name).collect();
        assert_eq!(names.len(), kinds.len());
        assert_eq!(
            FaultKind::MhcPostMixBf16Accumulator(Half::Ffn).component(),
            Component::LayerPostFfnMhc
        );
        assert_eq!(
            FaultKind::MhcSinkhornWithoutEpsilon(Half::Ffn).operator(),
            "ffn.hc_comb"
        );
        assert_eq!(FaultKind::HeadNormEpsilon(0.1).component(), Component::LmLogits);
        assert!(FaultKind::EmbeddingWrongRow.is_global() && !FaultKind::RoutedTermRounded.is_global());
    }

    #[test]
    fn truncation_differs_from_rounding_only_when_low_bits_round_up() {
        let x = f32::from_bits(0x3f80_8000 + 1); // just above a tie: RNE rounds up
        assert_eq!(truncate_bf16(x).to_bits(), 0x3f80_0000);
        assert_eq!(r_bf16(x).to_bits(), 0x3f81_0000);
        let mut v = [f32::from_bits(0x3fff_ffff)];
        keep_mantissa_bits(&mut v, 3);
        assert_eq!(v[0].to_bits(), 0x3ff0_0000);
    }

    #[test]
    fn shared_first_changes_association() {
        // Native: ((0 + 1) + 2^-24) - 1 = 0; shared first: ((-1 + 1) + 2^-24) = 2^-24.
        let t0 = [1.0f32];
        let t1 = [f32::from_bits(0x3380_0000)];
        let s = [-1.0f32];
        let ev = CombineEvent {
            layer: 0,
            step: 0,
            position: 0,
            experts: &[0, 1],
            gates: &[],
            units: &[],
        };
        let mut y = [0.0f32];
        SharedFirstCombine.combine(&ev, &[&t0, &t1], &s, &mut y);
        assert_eq!(y[0].to_bits(), 0x3380_0000);
        let mut n = [0.0f32];
        moeconf_contract::combine_native(&[&t0, &t1], &s, &mut n);
        assert_eq!(n[0], 0.0);
        assert_eq!(FaultKind::SharedExpertFirst.operator(), "moe.combine");
    }
}
