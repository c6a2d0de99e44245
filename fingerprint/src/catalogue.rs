//! The component catalogue: every record a moeconf trace can hold, typed.
//!
//! A record's `path` (`router.topk`, `moe.term.3`, …) names a [`Component`].
//! The catalogue says, for each component, its [`Level`], what kind of values
//! it holds ([`ValueKind`]), the half-layer it belongs to ([`Half`]), its rank
//! in the reference runtime's execution order, which layer kinds have it
//! ([`LayerKinds`]), at which coordinates it is emitted ([`Presence`]) and
//! which records its operator reads ([`Input`]). Every
//! other crate asks the catalogue instead of spelling path strings, so adding
//! a captured record is one new variant and one row of [`SPECS`]
//! (docs/architecture.md spells the steps out).
//!
//! The inputs are complete: every value an operator reads is one of its
//! input records (or a weight), so "its output differs while its inputs
//! match" names the operator itself. Caches are read through their own
//! records (`attn.window_read`, `attn.compressed_read`, `attn.indexer_read`)
//! separate from what is appended (`attn.kv`, `attn.compressed`,
//! `attn.indexer_compressed`), and the mHC mixing through the pre weights,
//! the combination matrix and the post weights. The reference runtime's
//! test `catalogue_inputs_are_captured` checks that every input is a record
//! the runtime captures on that layer kind.
//!
//! docs/format.md §6 is the normative table; a test checks that every row
//! here appears there.

use crate::coord::Level;
use std::fmt;

/// Which half of a decoder layer a record belongs to (each half ends in an
/// mHC `hc_post`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Half {
    /// mHC pre → attention → mHC post (`attn.*`, `layer.post_attn_mhc`).
    Attention,
    /// mHC pre → router, experts, combine → mHC post (`ffn.*`, `router.*`,
    /// `moe.*`, `layer.post_ffn_mhc`).
    Ffn,
}

impl Half {
    /// `attention` / `ffn`.
    pub fn name(self) -> &'static str {
        match self {
            Half::Attention => "attention",
            Half::Ffn => "ffn",
        }
    }
}

/// What the elements of a record mean, which decides how two records are
/// compared and worded in reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueKind {
    /// Real values (f32 in the reference runtime; any float dtype in traces).
    Float,
    /// Identifiers or indices (token ids, expert ids, selected entries):
    /// compared as sets and sequences, never by magnitude. Stored as i32.
    Ids,
    /// Counters (lengths, entry counts), stored as i64.
    Count,
    /// UTF-8 text bytes, stored as u8.
    Text,
}

/// Attention kind of a decoder layer (docs/operators.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Sliding-window attention only.
    Sliding,
    /// Compressed sparse attention: overlapping compressor + lightning indexer.
    Csa,
    /// Heavily compressed attention: non-overlapping compressor, every entry read.
    Hca,
}

/// MLP kind of a decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FfnKind {
    /// Score-routed MoE (top-k of the biased router scores).
    Moe,
    /// Hash-routed MoE (fixed `tid2eid` table per token id).
    HashMoe,
}

/// The set of layer kinds on which a component exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerKinds {
    /// Attention kinds that have it (bit 0 sliding, 1 CSA, 2 HCA).
    attention: u8,
    /// MLP kinds that have it (bit 0 score-routed, 1 hash-routed).
    ffn: u8,
}

impl LayerKinds {
    /// Every layer kind (and model-global records).
    pub const ALL: LayerKinds = LayerKinds {
        attention: 0b111,
        ffn: 0b11,
    };
    /// Layers with a KV compressor (CSA and HCA).
    pub const COMPRESSED: LayerKinds = LayerKinds {
        attention: 0b110,
        ffn: 0b11,
    };
    /// CSA layers only (overlapping compressor, lightning indexer).
    pub const CSA: LayerKinds = LayerKinds {
        attention: 0b010,
        ffn: 0b11,
    };
    /// Score-routed MoE layers only (hash routing has no scores to rank).
    pub const SCORE_ROUTED: LayerKinds = LayerKinds {
        attention: 0b111,
        ffn: 0b01,
    };

    /// Whether some layer kind has both (the component exists on a layer
    /// that also has `other`).
    pub fn intersects(self, other: LayerKinds) -> bool {
        self.attention & other.attention != 0 && self.ffn & other.ffn != 0
    }

    /// Whether a layer of this attention and MLP kind has the component.
    pub fn contains(self, attention: AttentionKind, ffn: FfnKind) -> bool {
        let a = match attention {
            AttentionKind::Sliding => 1,
            AttentionKind::Csa => 2,
            AttentionKind::Hca => 4,
        };
        let f = match ffn {
            FfnKind::Moe => 1,
            FfnKind::HashMoe => 2,
        };
        self.attention & a != 0 && self.ffn & f != 0
    }
}

/// At which coordinates the runtime emits a component's records (on the
/// layer kinds that have it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Presence {
    /// Every coordinate of its group: every position of every step for
    /// layer operators and embeddings, every step for the step's other
    /// model-global records (`text.continuation` when a detokenizer is
    /// given), every decode boundary for persistent state.
    Always,
    /// Only at the positions where the operator emits something: a
    /// compressor's entry exists only at the token that closes its window.
    OnEmit,
    /// Never by the reference runtime: a value some backends materialize
    /// and a capture records where it can observe it (the routed sum of a
    /// MoE block before its shared-expert merge). Where present, it has the
    /// coordinates of an [`Presence::Always`] record.
    CaptureOnly,
    /// Only in precision profiles that quantize activations at this site
    /// (the reference runtime's `official` profile; docs/operators.md §9.6),
    /// then at every coordinate of its group, and for the input of a GEMM
    /// only where that GEMM's weight is quantized (FP8 or FP4). A profile
    /// known to have no quantization sites ([`profile_quantizes`]) never
    /// holds it.
    Quantized,
    /// A quantization site on the output of an operator that emits only at
    /// some positions ([`Presence::OnEmit`]): a compressed entry.
    QuantizedOnEmit,
}

impl Presence {
    /// Whether records of this presence are activation-quantization sites.
    pub fn is_quantized(self) -> bool {
        matches!(self, Presence::Quantized | Presence::QuantizedOnEmit)
    }

    /// Whether the operator emits only at some positions.
    pub fn is_on_emit(self) -> bool {
        matches!(self, Presence::OnEmit | Presence::QuantizedOnEmit)
    }
}

/// Whether the precision profile named in a trace's binding quantizes
/// activations: `Some(false)` for the reference runtime's `bf16` and `f32`
/// profiles (and any backend that names its run so: no quantization sites),
/// `Some(true)` for `official` (DeepSeek's sites, docs/operators.md §9.6),
/// `None` for any other name (a backend's own profile: whether it quantizes
/// is not known, and a missing quantization record is a coverage difference),
/// `vllm-cpu` included: that profile follows vLLM's FP8 KV cache (its
/// `attn.kv_fp8` records) but none of DeepSeek's activation-quantization
/// sites.
pub fn profile_quantizes(precision: &str) -> Option<bool> {
    match precision {
        "bf16" | "f32" => Some(false),
        "official" => Some(true),
        _ => None,
    }
}

/// Where an operator's input record lives, relative to the operator's own
/// coordinate (step, position, layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputSource {
    /// The same step, position and layer.
    SameLayer,
    /// The residual streams entering the layer: the previous layer's
    /// `layer.post_ffn_mhc` at the same position, or for layer 0 the
    /// embedding of the same position (`embed.output`).
    LayerInput,
    /// The ids the step consumes (`token.input`, model-global).
    StepInput,
    /// The persistent state of the same layer at the previous decode
    /// boundary (every `state.*` record of that layer, one step back).
    CarriedState,
}

/// The path prefix of every persistent-state component: the records an
/// [`InputSource::CarriedState`] input stands for.
pub const STATE_PREFIX: &str = "state.";

/// One input of an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Input {
    pub source: InputSource,
    /// The input component (ignored for [`InputSource::LayerInput`] and
    /// [`InputSource::CarriedState`], which name their records themselves).
    pub component: Component,
}

/// Everything the catalogue knows about one component.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ComponentSpec {
    pub component: Component,
    /// Its path, or for a family (`moe.term.J`) the prefix `moe.term.`.
    pub path: &'static str,
    pub level: Level,
    /// What its values mean.
    pub kind: ValueKind,
    /// Half-layer of a per-layer operator record (`None`: model-global or
    /// persistent state).
    pub half: Option<Half>,
    /// Rank in the reference runtime's execution order within its group
    /// (model-global records of a step, one layer's operators, one layer's
    /// persistent state). Unique within a group.
    pub rank: u16,
    /// Layer kinds that have it.
    pub layers: LayerKinds,
    /// At which coordinates it is emitted.
    pub presence: Presence,
    /// Its values only grow between records of one layer: every later
    /// record of the layer starts with the bytes of the earlier one (the
    /// compressed caches, which entries are appended to and never
    /// rewritten). Writers may digest such records incrementally
    /// ([`crate::incremental`]); the digest is the same.
    pub append_only: bool,
    /// The records its operator reads (empty for inputs of the whole step
    /// and for persistent state).
    pub inputs: &'static [Input],
    /// One line for reports and docs.
    pub meaning: &'static str,
}

macro_rules! components {
    ($($(#[$doc:meta])* $variant:ident,)*) => {
        /// A catalogue component (docs/format.md §6). `MoeTerm` is the family
        /// `moe.term.J` of the k gate-weighted routed terms; the others name
        /// exactly one path.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Component {
            $($(#[$doc])* $variant,)*
        }

        impl Component {
            /// Every component, in catalogue order.
            pub const ALL: &'static [Component] = &[$(Component::$variant,)*];
        }
    };
}

components! {
    /// L0 ids consumed by the step (prefill: the prompt).
    TokenInput,
    /// L4 embedding of one position's id (the value of every residual stream entering layer 0).
    EmbedOutput,
    /// L0 greedy prediction.
    TokenOutput,
    /// L0 UTF-8 decoding of every generated id so far.
    TextContinuation,
    /// L1 logits at the step's last position.
    LmLogits,
    /// L1 top-8 ids by logit.
    LmTopkIds,
    /// L1 top-8 logits.
    LmTopkLogits,
    /// L1 rank-1 minus rank-2 logit.
    LmMargin,
    /// L2 tokens processed by the layer.
    StateCumulativeLength,
    /// L2 sliding-window KV.
    StateWindowKv,
    /// L2 attention compressor: raw kv rows of the open window.
    StateCompressorBufferKv,
    /// L2 attention compressor: raw gate rows of the open window.
    StateCompressorBufferGate,
    /// L2 attention compressor: emitted entries.
    StateCompressorCompressedKv,
    /// L2 attention compressor: number of emitted entries.
    StateCompressorEntryCount,
    /// L2 attention compressor: overlap kv carried to the next window (CSA).
    StateCompressorOverlapKv,
    /// L2 attention compressor: overlap gate carried to the next window (CSA).
    StateCompressorOverlapGate,
    /// L2 indexer compressor: raw kv rows of the open window.
    StateIndexerBufferKv,
    /// L2 indexer compressor: raw gate rows of the open window.
    StateIndexerBufferGate,
    /// L2 indexer compressor: emitted entries.
    StateIndexerCompressedKv,
    /// L2 indexer compressor: number of emitted entries.
    StateIndexerEntryCount,
    /// L2 indexer compressor: overlap kv.
    StateIndexerOverlapKv,
    /// L2 indexer compressor: overlap gate.
    StateIndexerOverlapGate,
    /// L4 attention-half mHC pre weights (FP32).
    AttnHcPreWeights,
    /// L4 attention-half mHC post weights (FP32, before the post's rounding).
    AttnHcPostWeights,
    /// L4 attention-half Sinkhorn-normalised combination matrix (FP32).
    AttnHcComb,
    /// L4 attention-half mHC collapse.
    AttnHcPre,
    /// L4 attention RMSNorm output.
    AttnNorm,
    /// L4 quantization site Q1: the attention input as the FP8 GEMMs `wq_a`, `wkv` read it.
    AttnNormFp8,
    /// L4 quantization site Q2: the query latent as the FP8 GEMMs `wq_b` read it.
    AttnQLatFp8,
    /// L4 queries after norm and RoPE.
    AttnQ,
    /// L4 the new KV vector of this position, as computed (before it is stored).
    AttnKv,
    /// L4 quantization site Q3: the new KV vector after FP8 fake quantization of its non-rope channels.
    AttnKvFp8,
    /// L4 an entry the attention compressor emitted at this position (before it is stored).
    AttnCompressed,
    /// L4 quantization site Q4: the emitted entry after FP8 fake quantization of its non-rope channels.
    AttnCompressedFp8,
    /// L4 an entry the indexer compressor emitted at this position (before it is stored).
    AttnIndexerCompressed,
    /// L4 quantization site Q5: the emitted indexer entry after the Hadamard rotation and FP4 fake quantization.
    AttnIndexerCompressedFp4,
    /// L4 the indexer keys as the indexer reads them from its cache (every entry).
    AttnIndexerRead,
    /// L4 quantization site Q6: the indexer queries after RoPE, the Hadamard rotation and FP4 fake quantization.
    AttnIndexerQFp4,
    /// L4 lightning-indexer score of every compressed entry.
    AttnIndexerScores,
    /// L4 compressed entries the lightning indexer selected.
    AttnIndexerTopk,
    /// L4 the window keys/values attention reads from the cache (oldest first, this position's last).
    AttnWindowRead,
    /// L4 the compressed entries attention reads from the cache (HCA: all; CSA: the selected ones, ascending).
    AttnCompressedRead,
    /// L4 attention output per head, before de-rotation.
    AttnCore,
    /// L4 quantization site Q7: the grouped output latent as the FP8 GEMM `wo_b` reads it.
    AttnOLatFp8,
    /// L4 attention output projection.
    AttnOutput,
    /// L3 residual streams after the attention-half mHC post.
    LayerPostAttnMhc,
    /// L4 FFN-half mHC pre weights (FP32).
    FfnHcPreWeights,
    /// L4 FFN-half mHC post weights (FP32, before the post's rounding).
    FfnHcPostWeights,
    /// L4 FFN-half Sinkhorn-normalised combination matrix (FP32).
    FfnHcComb,
    /// L4 FFN-half mHC collapse.
    FfnHcPre,
    /// L4 FFN RMSNorm output.
    FfnNorm,
    /// L4 quantization site Q8: the FFN input as the experts' `w1`, `w3` GEMMs read it.
    FfnNormFp8,
    /// L3 router scores before the correction bias.
    RouterScores,
    /// L3 selected experts, in combine order.
    RouterTopk,
    /// L3 gate weights of the selected experts.
    RouterGates,
    /// L3 rank-k minus rank-(k+1) selection score.
    RouterMargin,
    /// L4 quantization site Q9: routed expert J's hidden activation as its `w2` GEMM reads it (`moe.term_h_fp8.J`).
    MoeTermHFp8,
    /// L4 gate-weighted routed term J (`moe.term.J`).
    MoeTerm,
    /// L4 routed sum before the shared-expert merge, as the backend stores it
    /// (captures only; the reference runtime keeps it inside the combine).
    MoeRouted,
    /// L4 quantization site Q10: the shared expert's hidden activation as its `w2` GEMM reads it.
    MoeSharedHFp8,
    /// L4 shared-expert output.
    MoeShared,
    /// L4 MoE output (the aggregation contract's result).
    MoeCombine,
    /// L3 residual streams after the FFN-half mHC post.
    LayerPostFfnMhc,
}

use Component as C;
use InputSource::{CarriedState, LayerInput, SameLayer, StepInput};

const fn same(component: Component) -> Input {
    Input {
        source: SameLayer,
        component,
    }
}
const LAYER_INPUT: Input = Input {
    source: LayerInput,
    component: C::LayerPostFfnMhc,
};
const CARRIED_STATE: Input = Input {
    source: CarriedState,
    component: C::StateCumulativeLength,
};
const STEP_INPUT: Input = Input {
    source: StepInput,
    component: C::TokenInput,
};

#[allow(clippy::too_many_arguments)] // a table row constructor: one argument per column
const fn spec(
    component: Component,
    path: &'static str,
    level: Level,
    kind: ValueKind,
    half: Option<Half>,
    rank: u16,
    layers: LayerKinds,
    inputs: &'static [Input],
    meaning: &'static str,
) -> ComponentSpec {
    ComponentSpec {
        component,
        path,
        level,
        kind,
        half,
        rank,
        layers,
        presence: Presence::Always,
        append_only: false,
        inputs,
        meaning,
    }
}

/// A row whose values only grow ([`ComponentSpec::append_only`]).
const fn append_only(mut row: ComponentSpec) -> ComponentSpec {
    row.append_only = true;
    row
}

/// A row the reference runtime never emits ([`Presence::CaptureOnly`]).
const fn capture_only(mut row: ComponentSpec) -> ComponentSpec {
    row.presence = Presence::CaptureOnly;
    row
}

/// A quantization site ([`Presence::Quantized`]).
const fn quantized(mut row: ComponentSpec) -> ComponentSpec {
    row.presence = Presence::Quantized;
    row
}

/// A quantization site on an operator that emits only at some positions
/// ([`Presence::QuantizedOnEmit`]).
const fn quantized_on_emit(mut row: ComponentSpec) -> ComponentSpec {
    row.presence = Presence::QuantizedOnEmit;
    row
}

/// A row whose records exist only where the operator emits ([`Presence::OnEmit`]).
const fn on_emit(mut row: ComponentSpec) -> ComponentSpec {
    row.presence = Presence::OnEmit;
    row
}

use Half::{Attention as ATT, Ffn as FFN};
use Level::{L0, L1, L2, L3, L4};
use ValueKind::{Count, Float, Ids, Text};
const ALL: LayerKinds = LayerKinds::ALL;
const CMP: LayerKinds = LayerKinds::COMPRESSED;
const CSA: LayerKinds = LayerKinds::CSA;

/// The catalogue, one row per [`Component`] in [`Component::ALL`] order.
/// Ranks: model-global records in step order (the step's input first, its
/// outputs after the layers), per-layer operators in execution order,
/// persistent state in serialization order.
pub const SPECS: &[ComponentSpec] = &[
    spec(
        C::TokenInput,
        "token.input",
        L0,
        Ids,
        None,
        0,
        ALL,
        &[],
        "ids consumed by the step (prefill: the prompt)",
    ),
    spec(
        C::EmbedOutput,
        "embed.output",
        L4,
        Float,
        None,
        1,
        ALL,
        &[STEP_INPUT],
        "embedding of the position's id: every residual stream entering layer 0",
    ),
    spec(
        C::TokenOutput,
        "token.output",
        L0,
        Ids,
        None,
        6,
        ALL,
        &[],
        "greedy prediction (ties to the lowest id)",
    ),
    spec(
        C::TextContinuation,
        "text.continuation",
        L0,
        Text,
        None,
        7,
        ALL,
        &[],
        "UTF-8 decoding of all generated ids so far",
    ),
    spec(
        C::LmLogits,
        "lm.logits",
        L1,
        Float,
        None,
        2,
        ALL,
        &[],
        "logits at the step's last position",
    ),
    spec(
        C::LmTopkIds,
        "lm.topk_ids",
        L1,
        Ids,
        None,
        3,
        ALL,
        &[],
        "top-8 ids by logit, ties to the lower id",
    ),
    spec(
        C::LmTopkLogits,
        "lm.topk_logits",
        L1,
        Float,
        None,
        4,
        ALL,
        &[],
        "top-8 logits",
    ),
    spec(
        C::LmMargin,
        "lm.margin",
        L1,
        Float,
        None,
        5,
        ALL,
        &[],
        "rank-1 minus rank-2 logit",
    ),
    spec(
        C::StateCumulativeLength,
        "state.cumulative_length",
        L2,
        Count,
        None,
        0,
        ALL,
        &[],
        "tokens processed by the layer",
    ),
    spec(
        C::StateWindowKv,
        "state.window_kv",
        L2,
        Float,
        None,
        1,
        ALL,
        &[],
        "sliding-window KV, oldest first",
    ),
    spec(
        C::StateCompressorBufferKv,
        "state.compressor.buffer_kv",
        L2,
        Float,
        None,
        2,
        CMP,
        &[],
        "attention compressor: raw kv rows of the open window",
    ),
    spec(
        C::StateCompressorBufferGate,
        "state.compressor.buffer_gate",
        L2,
        Float,
        None,
        3,
        CMP,
        &[],
        "attention compressor: raw gate rows of the open window",
    ),
    append_only(spec(
        C::StateCompressorCompressedKv,
        "state.compressor.compressed_kv",
        L2,
        Float,
        None,
        4,
        CMP,
        &[],
        "attention compressor: emitted entries",
        )),
    spec(
        C::StateCompressorEntryCount,
        "state.compressor.entry_count",
        L2,
        Count,
        None,
        5,
        CMP,
        &[],
        "attention compressor: emitted entry count",
    ),
    spec(
        C::StateCompressorOverlapKv,
        "state.compressor.overlap_kv",
        L2,
        Float,
        None,
        6,
        CSA,
        &[],
        "attention compressor: overlap kv for the next window",
    ),
    spec(
        C::StateCompressorOverlapGate,
        "state.compressor.overlap_gate",
        L2,
        Float,
        None,
        7,
        CSA,
        &[],
        "attention compressor: overlap gate for the next window",
    ),
    spec(
        C::StateIndexerBufferKv,
        "state.indexer.buffer_kv",
        L2,
        Float,
        None,
        8,
        CSA,
        &[],
        "indexer compressor: raw kv rows of the open window",
    ),
    spec(
        C::StateIndexerBufferGate,
        "state.indexer.buffer_gate",
        L2,
        Float,
        None,
        9,
        CSA,
        &[],
        "indexer compressor: raw gate rows of the open window",
    ),
    append_only(spec(
        C::StateIndexerCompressedKv,
        "state.indexer.compressed_kv",
        L2,
        Float,
        None,
        10,
        CSA,
        &[],
        "indexer compressor: emitted entries",
        )),
    spec(
        C::StateIndexerEntryCount,
        "state.indexer.entry_count",
        L2,
        Count,
        None,
        11,
        CSA,
        &[],
        "indexer compressor: emitted entry count",
    ),
    spec(
        C::StateIndexerOverlapKv,
        "state.indexer.overlap_kv",
        L2,
        Float,
        None,
        12,
        CSA,
        &[],
        "indexer compressor: overlap kv for the next window",
    ),
    spec(
        C::StateIndexerOverlapGate,
        "state.indexer.overlap_gate",
        L2,
        Float,
        None,
        13,
        CSA,
        &[],
        "indexer compressor: overlap gate for the next window",
    ),
    spec(
        C::AttnHcPreWeights,
        "attn.hc_pre_weights",
        L4,
        Float,
        Some(ATT),
        0,
        ALL,
        &[LAYER_INPUT],
        "attention-half mHC pre weights pre_j (FP32)",
    ),
    spec(
        C::AttnHcPostWeights,
        "attn.hc_post_weights",
        L4,
        Float,
        Some(ATT),
        1,
        ALL,
        &[LAYER_INPUT],
        "attention-half mHC post weights post_j (FP32)",
    ),
    spec(
        C::AttnHcComb,
        "attn.hc_comb",
        L4,
        Float,
        Some(ATT),
        2,
        ALL,
        &[LAYER_INPUT],
        "attention-half Sinkhorn-normalised combination matrix C (FP32)",
    ),
    spec(
        C::AttnHcPre,
        "attn.hc_pre",
        L4,
        Float,
        Some(ATT),
        3,
        ALL,
        &[LAYER_INPUT, same(C::AttnHcPreWeights)],
        "attention-half mHC collapse of the residual streams",
    ),
    spec(
        C::AttnNorm,
        "attn.norm",
        L4,
        Float,
        Some(ATT),
        4,
        ALL,
        &[same(C::AttnHcPre)],
        "attention RMSNorm output",
    ),
    quantized(spec(
        C::AttnNormFp8,
        "attn.norm_fp8",
        L4,
        Float,
        Some(ATT),
        5,
        ALL,
        &[same(C::AttnNorm)],
        "quantization site Q1: the attention input FP8-quantized in 1x128 blocks (UE8M0 scales), as wq_a and wkv read it",
    )),
    quantized(spec(
        C::AttnQLatFp8,
        "attn.q_lat_fp8",
        L4,
        Float,
        Some(ATT),
        6,
        ALL,
        &[same(C::AttnNorm), same(C::AttnNormFp8)],
        "quantization site Q2: the query latent q_norm(wq_a a) FP8-quantized in 1x128 blocks, as wq_b reads it",
    )),
    spec(
        C::AttnQ,
        "attn.q",
        L4,
        Float,
        Some(ATT),
        7,
        ALL,
        &[same(C::AttnNorm), same(C::AttnNormFp8), same(C::AttnQLatFp8)],
        "queries after norm and RoPE",
    ),
    spec(
        C::AttnKv,
        "attn.kv",
        L4,
        Float,
        Some(ATT),
        8,
        ALL,
        &[same(C::AttnNorm), same(C::AttnNormFp8)],
        "the position's new KV vector, before it is stored",
    ),
    quantized(spec(
        C::AttnKvFp8,
        "attn.kv_fp8",
        L4,
        Float,
        Some(ATT),
        9,
        ALL,
        &[same(C::AttnKv)],
        "quantization site Q3: the new KV vector with its non-rope channels FP8 fake-quantized in 1x64 blocks, as stored",
    )),
    on_emit(spec(
        C::AttnCompressed,
        "attn.compressed",
        L4,
        Float,
        Some(ATT),
        10,
        CMP,
        &[same(C::AttnNorm), CARRIED_STATE],
        "entry emitted by the attention compressor, before it is stored",
    )),
    quantized_on_emit(spec(
        C::AttnCompressedFp8,
        "attn.compressed_fp8",
        L4,
        Float,
        Some(ATT),
        11,
        CMP,
        &[same(C::AttnCompressed)],
        "quantization site Q4: the emitted entry with its non-rope channels FP8 fake-quantized in 1x64 blocks, as stored",
    )),
    on_emit(spec(
        C::AttnIndexerCompressed,
        "attn.indexer_compressed",
        L4,
        Float,
        Some(ATT),
        12,
        CSA,
        &[same(C::AttnNorm), CARRIED_STATE],
        "entry emitted by the indexer compressor, before it is stored",
    )),
    quantized_on_emit(spec(
        C::AttnIndexerCompressedFp4,
        "attn.indexer_compressed_fp4",
        L4,
        Float,
        Some(ATT),
        13,
        CSA,
        &[same(C::AttnIndexerCompressed)],
        "quantization site Q5: the emitted indexer entry Hadamard-rotated and FP4 fake-quantized in 1x32 blocks, as stored",
    )),
    append_only(spec(
        C::AttnIndexerRead,
        "attn.indexer_read",
        L4,
        Float,
        Some(ATT),
        14,
        CSA,
        &[same(C::AttnIndexerCompressed), same(C::AttnIndexerCompressedFp4), CARRIED_STATE],
        "indexer keys as read from the indexer cache (every entry)",
        )),
    quantized(spec(
        C::AttnIndexerQFp4,
        "attn.indexer_q_fp4",
        L4,
        Float,
        Some(ATT),
        15,
        CSA,
        &[same(C::AttnNorm), same(C::AttnNormFp8), same(C::AttnQLatFp8)],
        "quantization site Q6: the indexer queries after RoPE, Hadamard-rotated and FP4 fake-quantized in 1x32 blocks",
    )),
    spec(
        C::AttnIndexerScores,
        "attn.indexer_scores",
        L4,
        Float,
        Some(ATT),
        16,
        CSA,
        &[same(C::AttnNorm), same(C::AttnIndexerRead), same(C::AttnIndexerQFp4)],
        "lightning-indexer score of every compressed entry",
    ),
    spec(
        C::AttnIndexerTopk,
        "attn.indexer_topk",
        L4,
        Ids,
        Some(ATT),
        17,
        CSA,
        &[same(C::AttnIndexerScores)],
        "compressed entries selected by the lightning indexer",
    ),
    spec(
        C::AttnWindowRead,
        "attn.window_read",
        L4,
        Float,
        Some(ATT),
        18,
        ALL,
        &[same(C::AttnKv), same(C::AttnKvFp8), CARRIED_STATE],
        "window KV as attention reads it from the cache",
    ),
    spec(
        C::AttnCompressedRead,
        "attn.compressed_read",
        L4,
        Float,
        Some(ATT),
        19,
        CMP,
        &[
            same(C::AttnCompressed),
            same(C::AttnCompressedFp8),
            same(C::AttnIndexerTopk),
            CARRIED_STATE,
        ],
        "compressed entries as attention reads them from the cache",
    ),
    spec(
        C::AttnCore,
        "attn.core",
        L4,
        Float,
        Some(ATT),
        20,
        ALL,
        &[
            same(C::AttnQ),
            same(C::AttnWindowRead),
            same(C::AttnCompressedRead),
        ],
        "attention output per head, before de-rotation",
    ),
    quantized(spec(
        C::AttnOLatFp8,
        "attn.o_lat_fp8",
        L4,
        Float,
        Some(ATT),
        21,
        ALL,
        &[same(C::AttnCore)],
        "quantization site Q7: the de-rotated grouped output latent FP8-quantized in 1x128 blocks, as wo_b reads it",
    )),
    spec(
        C::AttnOutput,
        "attn.output",
        L4,
        Float,
        Some(ATT),
        22,
        ALL,
        &[same(C::AttnCore), same(C::AttnOLatFp8)],
        "de-rotated grouped output projection",
    ),
    spec(
        C::LayerPostAttnMhc,
        "layer.post_attn_mhc",
        L3,
        Float,
        Some(ATT),
        23,
        ALL,
        &[
            LAYER_INPUT,
            same(C::AttnOutput),
            same(C::AttnHcPostWeights),
            same(C::AttnHcComb),
        ],
        "residual streams after the attention-half mHC post",
    ),
    spec(
        C::FfnHcPreWeights,
        "ffn.hc_pre_weights",
        L4,
        Float,
        Some(FFN),
        24,
        ALL,
        &[same(C::LayerPostAttnMhc)],
        "FFN-half mHC pre weights pre_j (FP32)",
    ),
    spec(
        C::FfnHcPostWeights,
        "ffn.hc_post_weights",
        L4,
        Float,
        Some(FFN),
        25,
        ALL,
        &[same(C::LayerPostAttnMhc)],
        "FFN-half mHC post weights post_j (FP32)",
    ),
    spec(
        C::FfnHcComb,
        "ffn.hc_comb",
        L4,
        Float,
        Some(FFN),
        26,
        ALL,
        &[same(C::LayerPostAttnMhc)],
        "FFN-half Sinkhorn-normalised combination matrix C (FP32)",
    ),
    spec(
        C::FfnHcPre,
        "ffn.hc_pre",
        L4,
        Float,
        Some(FFN),
        27,
        ALL,
        &[same(C::LayerPostAttnMhc), same(C::FfnHcPreWeights)],
        "FFN-half mHC collapse of the residual streams",
    ),
    spec(
        C::FfnNorm,
        "ffn.norm",
        L4,
        Float,
        Some(FFN),
        28,
        ALL,
        &[same(C::FfnHcPre)],
        "FFN RMSNorm output",
    ),
    quantized(spec(
        C::FfnNormFp8,
        "ffn.norm_fp8",
        L4,
        Float,
        Some(FFN),
        29,
        ALL,
        &[same(C::FfnNorm)],
        "quantization site Q8: the FFN input FP8-quantized in 1x128 blocks, as the experts' w1 and w3 read it",
    )),
    spec(
        C::RouterScores,
        "router.scores",
        L3,
        Float,
        Some(FFN),
        30,
        ALL,
        &[same(C::FfnNorm)],
        "router scores before the correction bias",
    ),
    spec(
        C::RouterTopk,
        "router.topk",
        L3,
        Ids,
        Some(FFN),
        31,
        ALL,
        &[same(C::RouterScores)],
        "selected experts, in combine order",
    ),
    spec(
        C::RouterGates,
        "router.gates",
        L3,
        Float,
        Some(FFN),
        32,
        ALL,
        &[same(C::RouterScores), same(C::RouterTopk)],
        "gate weights of the selected experts",
    ),
    spec(
        C::RouterMargin,
        "router.margin",
        L3,
        Float,
        Some(FFN),
        33,
        LayerKinds::SCORE_ROUTED,
        &[same(C::RouterScores)],
        "rank-k minus rank-(k+1) selection score",
    ),
    quantized(spec(
        C::MoeTermHFp8,
        "moe.term_h_fp8.",
        L4,
        Float,
        Some(FFN),
        34,
        ALL,
        &[same(C::FfnNorm), same(C::FfnNormFp8), same(C::RouterTopk), same(C::RouterGates)],
        "quantization site Q9: routed expert J's gate-weighted hidden activation FP8-quantized in 1x128 blocks, as its w2 reads it",
    )),
    spec(
        C::MoeTerm,
        "moe.term.",
        L4,
        Float,
        Some(FFN),
        35,
        ALL,
        &[
            same(C::FfnNorm),
            same(C::FfnNormFp8),
            same(C::RouterTopk),
            same(C::RouterGates),
            same(C::MoeTermHFp8),
        ],
        "gate-weighted routed term J, v_J = g_J · E_J(x)",
    ),
    capture_only(spec(
        C::MoeRouted,
        "moe.routed",
        L4,
        Float,
        Some(FFN),
        36,
        ALL,
        &[same(C::MoeTerm)],
        "routed sum before the shared-expert merge, as the backend stores it (captures only)",
    )),
    quantized(spec(
        C::MoeSharedHFp8,
        "moe.shared_h_fp8",
        L4,
        Float,
        Some(FFN),
        37,
        ALL,
        &[same(C::FfnNorm), same(C::FfnNormFp8)],
        "quantization site Q10: the shared expert's hidden activation FP8-quantized in 1x128 blocks, as its w2 reads it",
    )),
    spec(
        C::MoeShared,
        "moe.shared",
        L4,
        Float,
        Some(FFN),
        38,
        ALL,
        &[same(C::FfnNorm), same(C::FfnNormFp8), same(C::MoeSharedHFp8)],
        "shared-expert output",
    ),
    spec(
        C::MoeCombine,
        "moe.combine",
        L4,
        Float,
        Some(FFN),
        39,
        ALL,
        &[same(C::MoeTerm), same(C::MoeRouted), same(C::MoeShared)],
        "MoE output: the aggregation contract's result",
    ),
    spec(
        C::LayerPostFfnMhc,
        "layer.post_ffn_mhc",
        L3,
        Float,
        Some(FFN),
        40,
        ALL,
        &[
            same(C::LayerPostAttnMhc),
            same(C::MoeCombine),
            same(C::FfnHcPostWeights),
            same(C::FfnHcComb),
        ],
        "residual streams after the FFN-half mHC post",
    ),
];

/// Where a record sits in a step's execution order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExecGroup {
    /// The step's input ids and their embeddings (before every layer).
    StepInput = 0,
    /// A layer's operators and layer-state records.
    Layer = 1,
    /// The step's outputs (logits, token, text), after the layers.
    StepOutput = 2,
    /// The persistent state at the decode boundary, after the step.
    State = 3,
}

impl Component {
    /// The steps of this operator that no record captures (docs/operators.md
    /// §4, the operator table): where a difference localized at this record
    /// can have arisen besides the record's own last rounding. `None` for a
    /// record whose operator is one step, or whose steps are records too.
    pub fn uncaptured_steps(self) -> Option<&'static str> {
        use Component as C;
        Some(match self {
            C::AttnQ => "the q_a projection, q_norm, the q_b projection, the per-head norm and RoPE",
            C::AttnKv => "the KV projection (W_kv), kv_norm and RoPE",
            C::AttnCompressed | C::AttnIndexerCompressed => {
                "the compressor's projections (W^C_kv, W^C_g), the slot gates (+ ape), the softmax over slots, the pooling, its norm and compress-RoPE, and the buffer and overlap it carries"
            }
            C::AttnIndexerScores => "the indexer's query projection, its compress-RoPE, the head weights and the weighted sum over heads",
            C::AttnCore => "the scores, their scaling, the softmax with sink and the weighted sum over the window and compressed entries",
            C::AttnOutput => "the inverse RoPE, the grouped projections W_oa (one per head group) and W_ob",
            C::AttnOLatFp8 => "the inverse RoPE, the grouped projections W_oa (one per head group) and the FP8 quantization of their output",
            C::AttnHcPre | C::FfnHcPre => "the collapse of the streams with the pre weights",
            C::AttnHcPreWeights | C::FfnHcPreWeights | C::AttnHcPostWeights | C::FfnHcPostWeights | C::AttnHcComb | C::FfnHcComb => {
                "the stream norm, the Φ projection and the sigmoid/softmax (and Sinkhorn for the mixing matrix)"
            }
            C::LayerPostAttnMhc | C::LayerPostFfnMhc => "the post weights times the half's output and the mixing of the streams",
            C::RouterScores => "the gate projection (W_gate), softplus and square root",
            C::RouterGates => "the normalization of the selected scores and the routed scaling factor",
            C::MoeTerm => "the expert's W1 and W3 projections, the clamp, SiLU, their product, W2, and the gate multiply",
            C::MoeShared => "the shared expert's W1 and W3 projections, the clamp, SiLU, their product and W2",
            C::LmLogits => "the head's stream collapse, the final norm and the LM head projection",
            _ => return None,
        })
    }

    /// The catalogue row.
    pub fn spec(self) -> &'static ComponentSpec {
        &SPECS[self as usize]
    }

    /// The path (for the family [`Component::MoeTerm`]: its prefix `moe.term.`;
    /// use [`Component::indexed_path`] for one member).
    pub fn path(self) -> &'static str {
        self.spec().path
    }

    pub fn level(self) -> Level {
        self.spec().level
    }

    /// What its values mean.
    pub fn kind(self) -> ValueKind {
        self.spec().kind
    }

    /// The half-layer of a per-layer operator record.
    pub fn half(self) -> Option<Half> {
        self.spec().half
    }

    /// Whether the component is a family of indexed paths (`moe.term.J`,
    /// `moe.term_h_fp8.J`): its catalogue path is the prefix, ending in `.`.
    pub fn is_family(self) -> bool {
        self.spec().path.ends_with('.')
    }

    /// The path of family member `index` (`moe.term.3`); for a single-path
    /// component the index is ignored.
    pub fn indexed_path(self, index: u32) -> String {
        if self.is_family() {
            format!("{}{index}", self.path())
        } else {
            self.path().to_string()
        }
    }

    /// Whether `path` is this component (any member of a family).
    pub fn matches(self, path: &str) -> bool {
        if self.is_family() {
            path.strip_prefix(self.path()).is_some_and(is_index)
        } else {
            path == self.path()
        }
    }

    /// The component a path names, with the family index for a family
    /// member (`moe.term.J`, `moe.term_h_fp8.J`).
    pub fn parse(path: &str) -> Option<(Component, Option<u32>)> {
        let index = path_index();
        for f in &index.families {
            if let Some(j) = path.strip_prefix(f.path) {
                return is_index(j).then(|| (f.component, j.parse().ok()));
            }
        }
        let exact = &index.exact;
        let k = exact.partition_point(|&(p, _)| p < path);
        exact.get(k).filter(|&&(p, _)| p == path).map(|&(_, c)| (c, None))
    }

    /// The execution group of the component's records.
    pub fn exec_group(self) -> ExecGroup {
        match (self, self.level()) {
            (Component::TokenInput | Component::EmbedOutput, _) => ExecGroup::StepInput,
            (_, Level::L2) => ExecGroup::State,
            _ if self.half().is_some() => ExecGroup::Layer,
            _ => ExecGroup::StepOutput,
        }
    }

    /// Whether a record of this component is one of the two post-mHC
    /// layer-state checkpoints that end a half-layer.
    pub fn is_checkpoint(self) -> bool {
        matches!(self, Component::LayerPostAttnMhc | Component::LayerPostFfnMhc)
    }

    /// Components of `level`, in catalogue order.
    pub fn of_level(level: Level) -> impl Iterator<Item = Component> {
        Component::ALL.iter().copied().filter(move |c| c.level() == level)
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_family() {
            write!(f, "{}*", self.path())
        } else {
            f.write_str(self.path())
        }
    }
}

/// The catalogue's paths arranged for [`Component::parse`], which every
/// reader of a trace calls once per record it classifies: the families in
/// catalogue order, and the single paths sorted (for a binary search
/// instead of a scan of the whole table, most of all for paths outside the
/// catalogue).
struct PathIndex {
    families: Vec<&'static ComponentSpec>,
    /// (path, component), sorted by path; among equal paths (there are
    /// none) catalogue order, so the first match is the table's first.
    exact: Vec<(&'static str, Component)>,
}

/// The [`PathIndex`] of [`SPECS`], built on first use.
fn path_index() -> &'static PathIndex {
    static INDEX: std::sync::OnceLock<PathIndex> = std::sync::OnceLock::new();
    INDEX.get_or_init(|| {
        let families = SPECS.iter().filter(|s| s.component.is_family()).collect();
        let mut exact: Vec<(&'static str, Component)> = SPECS
            .iter()
            .filter(|s| !s.component.is_family())
            .map(|s| (s.path, s.component))
            .collect();
        exact.sort_by_key(|&(p, _)| p);
        PathIndex { families, exact }
    })
}

/// A decimal index without sign or leading zeros.
fn is_index(s: &str) -> bool {
    !s.is_empty()
        && s.bytes().all(|b| b.is_ascii_digit())
        && (s.len() == 1 || !s.starts_with('0'))
        && s.len() <= 10
}

/// The level of a record path: the catalogue's level for a catalogue
/// component, else by the catalogue's namespace prefixes (`token.`/`text.`
/// L0, `lm.` L1, `state.` L2, `layer.`/`router.` L3, `embed.`/`attn.`/`ffn.`/`moe.`
/// L4), so that backends can record further components in a known namespace.
pub fn level_of_path(path: &str) -> Option<Level> {
    if let Some((c, _)) = Component::parse(path) {
        return Some(c.level());
    }
    NAMESPACES
        .iter()
        .find(|(p, _)| path.starts_with(p))
        .map(|(_, l)| *l)
}

/// Catalogue namespaces and their levels.
pub const NAMESPACES: &[(&str, Level)] = &[
    ("token.", Level::L0),
    ("text.", Level::L0),
    ("embed.", Level::L4),
    ("lm.", Level::L1),
    ("state.", Level::L2),
    ("layer.", Level::L3),
    ("router.", Level::L3),
    ("attn.", Level::L4),
    ("ffn.", Level::L4),
    ("moe.", Level::L4),
];

/// The half-layer of a record path (by catalogue component, else by
/// namespace: `attn.` attention; `ffn.`, `router.`, `moe.` FFN).
pub fn half_of_path(path: &str) -> Option<Half> {
    if let Some((c, _)) = Component::parse(path) {
        return c.half();
    }
    if path.starts_with("attn.") {
        Some(Half::Attention)
    } else if ["ffn.", "router.", "moe."].iter().any(|p| path.starts_with(p)) {
        Some(Half::Ffn)
    } else {
        None
    }
}

/// Sort key of a record path in the reference runtime's execution order
/// within its group: (rank, family index); unknown paths sort after every
/// catalogue component.
pub fn exec_rank(path: &str) -> (u16, u64) {
    match Component::parse(path) {
        Some((c, idx)) => (c.spec().rank, idx.map_or(0, u64::from)),
        None => (u16::MAX, 0),
    }
}

/// A record's place in the catalogue's execution order of a whole run
/// (docs/operators.md §3 and §5): by step; within a step the step's input
/// and embeddings, then the layers in order (layer-major, position-minor,
/// the operators of one layer and position by rank, attention half before
/// FFN half), then the step's outputs, then the persistent state at the
/// decode boundary (layer by layer). Records of the same key (which a valid
/// trace does not hold) are ordered by the caller.
///
/// A path outside the catalogue is placed by its namespace: a layer record
/// of a known half (`attn.`, `ffn.`, `router.`, `moe.`) just before the
/// checkpoint that closes that half, any other layer record after the
/// layer's last checkpoint, `state.` records after the catalogue's state,
/// `embed.` records with the step's input and other model-global records
/// after the step's outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExecKey {
    /// Forward step.
    pub step: u32,
    /// The group within the step.
    pub group: ExecGroup,
    /// Decoder layer (0 for model-global records).
    pub layer: u32,
    /// Absolute position (0 for persistent state, which is per layer).
    pub position: u32,
    /// Twice the catalogue rank plus one for catalogue components (so that
    /// a backend's own record of a half sorts just before the half's
    /// closing checkpoint), `u32::MAX` for unplaced records.
    pub slot: u32,
    /// Family index (`moe.term.J`: J).
    pub index: u64,
}

impl ExecKey {
    /// The key of the record at `c`.
    pub fn of(c: &crate::Coord) -> ExecKey {
        let parsed = Component::parse(&c.path);
        let group = match parsed {
            Some((comp, _)) => comp.exec_group(),
            None => match (level_of_path(&c.path), c.layer) {
                (Some(Level::L2), _) => ExecGroup::State,
                (_, Some(_)) => ExecGroup::Layer,
                _ if c.path.starts_with("embed.") => ExecGroup::StepInput,
                _ => ExecGroup::StepOutput,
            },
        };
        let slot = match parsed {
            Some((comp, _)) => 2 * u32::from(comp.spec().rank) + 1,
            None => match (group, half_of_path(&c.path)) {
                (ExecGroup::Layer, Some(Half::Attention)) => {
                    2 * u32::from(Component::LayerPostAttnMhc.spec().rank)
                }
                (ExecGroup::Layer, Some(Half::Ffn)) => 2 * u32::from(Component::LayerPostFfnMhc.spec().rank),
                _ => u32::MAX,
            },
        };
        ExecKey {
            step: c.step,
            group,
            layer: c.layer.unwrap_or(0),
            position: if group == ExecGroup::State { 0 } else { c.position },
            slot,
            index: parsed.and_then(|(_, i)| i).map_or(0, u64::from),
        }
    }
}

/// Whether the record at `to` can depend on the record at `from` in a
/// causal decoder: a change of `from` can reach `to` only forward in
/// execution and never to an earlier position of the same forward.
///
/// - A later step depends on everything before it (persistent state and the
///   fed token carry it; its positions follow every earlier one); an
///   earlier step on nothing of a later one.
/// - In one step, a record reaches its own position's later records (later
///   layers, or later in its own layer) and the later positions' records of
///   later layers; within its own layer only the attention half reaches
///   later positions (through the keys and values attention reads), the
///   FFN half only its own position.
/// - The step's input (`embed.*`) reaches everything of its position and
///   later ones; the step's outputs reach only the step's later outputs;
///   the persistent state recorded after the step reaches the same step's
///   state of its own and later layers only.
///
/// Where the catalogue cannot tell a record's half (a backend's record
/// outside it) the answer errs towards "reaches": a divergence is never
/// called independent of one that could have caused it.
pub fn reaches(from: &crate::Coord, to: &crate::Coord) -> bool {
    if to.step != from.step {
        return to.step > from.step;
    }
    let (a, b) = (ExecKey::of(from), ExecKey::of(to));
    let later_here = (b.layer, b.slot, b.index) >= (a.layer, a.slot, a.index);
    match (a.group, b.group) {
        (ExecGroup::StepInput, ExecGroup::StepInput) => to.position == from.position && later_here,
        (ExecGroup::StepInput, ExecGroup::State) => true,
        (ExecGroup::StepInput, _) => to.position >= from.position,
        (ExecGroup::Layer, ExecGroup::Layer) => {
            if to.position == from.position {
                later_here
            } else if to.position > from.position {
                b.layer > a.layer || (b.layer == a.layer && half_of_path(&from.path) != Some(Half::Ffn))
            } else {
                false
            }
        }
        (ExecGroup::Layer, ExecGroup::StepOutput) => to.position >= from.position,
        (ExecGroup::Layer, ExecGroup::State) => b.layer >= a.layer,
        (ExecGroup::StepOutput, ExecGroup::StepOutput) => (b.slot, b.index) >= (a.slot, a.index),
        (ExecGroup::State, ExecGroup::State) => b.layer >= a.layer,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(step: u32, position: u32, layer: Option<u32>, path: &str) -> crate::Coord {
        crate::Coord {
            step,
            position,
            phase: if step == 0 {
                crate::Phase::Prefill
            } else {
                crate::Phase::Decode
            },
            layer,
            path: path.into(),
        }
    }

    #[test]
    fn reaching_follows_causality() {
        let term = at(0, 1, Some(5), "moe.term.0");
        // A later layer at an earlier position of the same forward: never.
        assert!(!reaches(&term, &at(0, 0, Some(7), "layer.post_ffn_mhc")));
        // Its own position, later: the half's checkpoint and later layers.
        assert!(reaches(&term, &at(0, 1, Some(5), "layer.post_ffn_mhc")));
        assert!(reaches(&term, &at(0, 1, Some(7), "layer.post_attn_mhc")));
        assert!(!reaches(&term, &at(0, 1, Some(4), "layer.post_ffn_mhc")));
        // Later positions: from the next layer on (the FFN half mixes no positions) ...
        assert!(!reaches(&term, &at(0, 2, Some(5), "layer.post_ffn_mhc")));
        assert!(reaches(&term, &at(0, 2, Some(6), "layer.post_attn_mhc")));
        // ... and in its own layer from the attention half, which writes the keys and values.
        let kv = at(0, 1, Some(5), "attn.kv");
        assert!(reaches(&kv, &at(0, 2, Some(5), "layer.post_attn_mhc")));
        assert!(!reaches(&kv, &at(0, 0, Some(5), "layer.post_attn_mhc")));
        // Later steps: everything; earlier steps: nothing.
        assert!(reaches(&term, &at(1, 3, Some(0), "layer.post_attn_mhc")));
        assert!(!reaches(
            &at(1, 3, Some(5), "moe.term.0"),
            &at(0, 2, Some(8), "layer.post_ffn_mhc")
        ));
        // The step's outputs and state.
        assert!(reaches(&term, &at(0, 2, None, "lm.logits")));
        assert!(!reaches(
            &at(0, 2, Some(3), "moe.combine"),
            &at(0, 1, None, "lm.logits")
        ));
        assert!(reaches(&term, &at(0, 2, Some(6), "state.window_kv")));
        assert!(!reaches(
            &at(0, 2, None, "lm.logits"),
            &at(0, 2, Some(6), "state.window_kv")
        ));
        assert!(reaches(
            &at(0, 0, None, "embed.output"),
            &at(0, 0, Some(0), "attn.q")
        ));
        assert!(!reaches(
            &at(0, 1, None, "embed.output"),
            &at(0, 0, Some(3), "attn.q")
        ));
    }

    #[test]
    fn table_is_in_enum_order_and_paths_parse_back() {
        assert_eq!(SPECS.len(), Component::ALL.len());
        for (i, s) in SPECS.iter().enumerate() {
            assert_eq!(s.component as usize, i, "{}", s.path);
            crate::Coord::validate_path(s.path).unwrap();
            if s.component.is_family() {
                let member = format!("{}3", s.path);
                assert_eq!(Component::parse(&member), Some((s.component, Some(3))));
                assert_eq!(Component::parse(&format!("{}03", s.path)), None);
                assert_eq!(Component::parse(s.path), None);
            } else {
                assert_eq!(Component::parse(s.path), Some((s.component, None)));
            }
            assert_eq!(level_of_path(s.path.trim_end_matches('.')), Some(s.level));
        }
    }

    /// The indexed lookup gives what a scan of the table in catalogue
    /// order gives, for catalogue paths, family members, near misses and
    /// paths outside the catalogue.
    #[test]
    fn parse_agrees_with_a_scan_of_the_table() {
        fn scan(path: &str) -> Option<(Component, Option<u32>)> {
            for f in SPECS.iter().filter(|s| s.component.is_family()) {
                if let Some(j) = path.strip_prefix(f.path) {
                    return is_index(j).then(|| (f.component, j.parse().ok()));
                }
            }
            SPECS
                .iter()
                .find(|s| s.path == path && !s.component.is_family())
                .map(|s| (s.component, None))
        }
        let mut paths: Vec<String> = vec!["".into(), "op.000".into(), "zzz".into(), "a".into(), "moe".into()];
        for s in SPECS {
            for p in [
                s.path.to_string(),
                format!("{}0", s.path),
                format!("{}12", s.path),
                format!("{}x", s.path),
                s.path.trim_end_matches('.').to_string(),
                s.path[..s.path.len() - 1].to_string(),
            ] {
                paths.push(p);
            }
        }
        for p in &paths {
            assert_eq!(Component::parse(p), scan(p), "{p:?}");
        }
        assert!(paths.iter().filter(|p| Component::parse(p).is_some()).count() > SPECS.len());
    }

    #[test]
    fn ranks_are_unique_within_each_group() {
        let mut seen = std::collections::HashSet::new();
        for c in Component::ALL {
            assert!(seen.insert((c.exec_group(), c.spec().rank)), "{c}");
        }
    }

    #[test]
    fn inputs_come_earlier_in_execution_order() {
        for c in Component::ALL {
            for i in c.spec().inputs {
                if i.source == InputSource::SameLayer {
                    assert_eq!(i.component.exec_group(), ExecGroup::Layer, "{c}");
                    assert!(
                        i.component.spec().rank < c.spec().rank,
                        "{c} reads {}",
                        i.component
                    );
                }
            }
        }
    }

    #[test]
    fn layer_operators_have_inputs_on_their_layer_kinds() {
        for c in Component::ALL
            .iter()
            .filter(|c| c.exec_group() == ExecGroup::Layer)
        {
            let s = c.spec();
            assert!(!s.inputs.is_empty(), "{c} lists no inputs");
            for i in s.inputs.iter().filter(|i| i.source == InputSource::SameLayer) {
                assert!(
                    s.layers.intersects(i.component.spec().layers),
                    "{c} reads {} on no common layer kind",
                    i.component
                );
            }
        }
        // The attention half runs before the FFN half.
        let ranks = |h: Half| {
            Component::ALL
                .iter()
                .filter(move |c| c.exec_group() == ExecGroup::Layer && c.half() == Some(h))
                .map(|c| c.spec().rank)
        };
        assert!(ranks(Half::Attention).max() < ranks(Half::Ffn).min());
        assert_eq!(Component::EmbedOutput.exec_group(), ExecGroup::StepInput);
        assert!(Component::EmbedOutput.spec().rank > Component::TokenInput.spec().rank);
    }

    #[test]
    fn format_md_lists_every_component() {
        let doc = include_str!("../../docs/format.md");
        let start = doc.find("## 6.").expect("docs/format.md has §6");
        let end = doc[start..].find("\n## 7.").map_or(doc.len(), |e| start + e);
        let section = &doc[start..end];
        for s in SPECS {
            let path = if s.component.is_family() {
                format!("`{}J`", s.path)
            } else {
                format!("`{}`", s.path)
            };
            assert!(section.contains(&path), "docs/format.md §6 does not list {path}");
        }
    }

    #[test]
    fn exec_key_follows_the_runtime_order_of_a_step() {
        let at = |step: u32, position: u32, layer: Option<u32>, path: &str| {
            ExecKey::of(&crate::Coord {
                step,
                position,
                phase: crate::Phase::Decode,
                layer,
                path: path.into(),
            })
        };
        // One step of two positions and two layers, in the runtime's order.
        let order = [
            at(1, 4, None, "token.input"),
            at(1, 4, None, "embed.output"),
            at(1, 5, None, "embed.output"),
            at(1, 4, Some(0), "attn.hc_pre_weights"),
            at(1, 4, Some(0), "attn.custom"),
            at(1, 4, Some(0), "layer.post_attn_mhc"),
            at(1, 4, Some(0), "moe.term.0"),
            at(1, 4, Some(0), "moe.term.5"),
            at(1, 4, Some(0), "moe.extra"),
            at(1, 4, Some(0), "layer.post_ffn_mhc"),
            at(1, 4, Some(0), "layer.custom"),
            at(1, 5, Some(0), "attn.hc_pre_weights"),
            at(1, 4, Some(1), "attn.hc_pre_weights"),
            at(1, 5, None, "lm.logits"),
            at(1, 5, None, "lm.topk_ids"),
            at(1, 5, None, "token.output"),
            at(1, 5, None, "text.continuation"),
            at(1, 5, None, "custom.global"),
            at(1, 5, Some(0), "state.cumulative_length"),
            at(1, 5, Some(0), "state.window_kv"),
            at(1, 5, Some(0), "state.custom"),
            at(1, 5, Some(1), "state.cumulative_length"),
            at(2, 6, None, "token.input"),
        ];
        for w in order.windows(2) {
            assert!(w[0] < w[1], "{:?} must precede {:?}", w[0], w[1]);
        }
    }

    #[test]
    fn quantization_sites_are_read_by_a_later_operator() {
        let sites: Vec<Component> = Component::ALL
            .iter()
            .copied()
            .filter(|c| c.spec().presence.is_quantized())
            .collect();
        assert_eq!(sites.len(), 10, "Q1..Q10 of docs/operators.md §9.6");
        for q in &sites {
            let spec = q.spec();
            assert_eq!((spec.level, spec.kind), (Level::L4, ValueKind::Float), "{q}");
            assert!(spec.path.contains("_fp8") || spec.path.contains("_fp4"), "{q}");
            // Some operator of the same layer kinds reads it, so a site a backend
            // skips is the first differing record, not its consumer.
            let readers: Vec<Component> = Component::ALL
                .iter()
                .copied()
                .filter(|c| {
                    c.spec()
                        .inputs
                        .iter()
                        .any(|i| i.source == InputSource::SameLayer && i.component == *q)
                })
                .collect();
            assert!(!readers.is_empty(), "nothing reads {q}");
            for r in readers {
                assert!(
                    !r.spec().presence.is_quantized() || r.spec().inputs.len() > 1,
                    "{r} reads only {q}"
                );
                assert!(r.spec().layers.intersects(spec.layers), "{r} / {q}");
            }
        }
        assert_eq!(
            Component::AttnCompressedFp8.spec().presence,
            Presence::QuantizedOnEmit
        );
        assert!(Component::AttnCompressedFp8.spec().presence.is_on_emit());
        assert!(Component::MoeTermHFp8.is_family());
        assert_eq!(
            Component::parse("moe.term_h_fp8.5"),
            Some((Component::MoeTermHFp8, Some(5)))
        );
        assert_eq!(
            Component::parse("moe.term.5"),
            Some((Component::MoeTerm, Some(5)))
        );
        assert_eq!(profile_quantizes("bf16"), Some(false));
        assert_eq!(profile_quantizes("f32"), Some(false));
        assert_eq!(profile_quantizes("official"), Some(true));
        assert_eq!(profile_quantizes("vllm-cpu"), None);
        assert_eq!(profile_quantizes("vllm-fp8"), None);
    }

    #[test]
    fn layer_kinds() {
        use AttentionKind::*;
        use FfnKind::*;
        assert!(Component::AttnIndexerTopk.spec().layers.contains(Csa, Moe));
        assert!(!Component::AttnIndexerTopk.spec().layers.contains(Hca, Moe));
        assert!(!Component::AttnCompressed.spec().layers.contains(Sliding, Moe));
        assert!(!Component::RouterMargin.spec().layers.contains(Csa, HashMoe));
        assert!(Component::MoeCombine.spec().layers.contains(Sliding, HashMoe));
    }
}
