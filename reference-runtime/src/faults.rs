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
//! Each [`FaultKind`] changes one operator, whose record (capture.md) is
//! the first to differ while its inputs still match
//! ([`FaultKind::operator`]):
//!
//! | kind | operator record | change |
//! |---|---|---|
//! | [`FaultKind::AttentionSoftmaxReversed`] | `attn.core` | softmax normalizer Σ e_j and the weighted value sum in reverse key order |
//! | [`FaultKind::AttentionSoftmaxBf16Accumulator`] | `attn.core` | softmax normalizer accumulated in BF16 |
//! | [`FaultKind::AttentionOutputTruncate`] | `attn.output` | BF16 truncation (clear the low 16 bits) instead of R_BF16 at the output projection's rounding point |
//! | [`FaultKind::FfnNormEpsilon`] | `ffn.norm` | a different RMSNorm ε |
//! | [`FaultKind::RouterNearTieFlip`] | `router.topk` | ranks k and k+1 of the selection swapped (one expert enters, one leaves) |
//! | [`FaultKind::SharedExpertFirst`] | `moe.combine` | the shared-expert output enters the FP32 accumulator first instead of last |
//! | [`FaultKind::CompressorPoolingReversed`] | `attn.compressed` | compressor softmax pooling sums in reverse slot order |
//! | [`FaultKind::CompressorPoolingBf16Accumulator`] | `attn.compressed` | compressor pooled sum accumulated in BF16 |
//! | [`FaultKind::RoundedRoutedMerge`] | `moe.combine` | routed sum rounded to BF16 before the shared merge |
//! | [`FaultKind::KvLowPrecision`] | `attn.kv` | the token's kv entry truncated to fewer mantissa bits before it is used and stored |
//! | [`FaultKind::CombineContract`] | `moe.combine` | another MoE aggregation contract |
//! | [`FaultKind::AddPostFfnMhc`] | `layer.post_ffn_mhc` | an intervention: ΔH added once in FP32 after the FFN-half hc_post |
//!
//! In the bf16 profile the order faults on sums of BF16-valued operands
//! (`AttentionSoftmaxReversed`'s value sum, `CompressorPoolingReversed`,
//! `SharedExpertFirst`) are usually silent: such FP32 sums are exact, so
//! every order gives the same bits (the reason the C contract is
//! order-invariant). The calibration matrix reports them separately.

use std::sync::Mutex;

use moeconf_contract::bf16::r_bf16;
use moeconf_contract::{AggregationContract, CombineEvent, MoeCombine, CANONICAL_NAN_BITS};
use moeconf_fingerprint::Component;

/// One deliberate deviation from the runtime's numerical contract.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultKind {
    /// Attention: the softmax normalizer `Z = Σ_j e_j` and the weighted value
    /// sum `Σ_j p_j v_j` are accumulated in reverse key order (the sink term
    /// is still added last to Z).
    AttentionSoftmaxReversed,
    /// Attention: the softmax normalizer `Z` is accumulated in a BF16
    /// container (R_BF16 after every addition) instead of FP32.
    AttentionSoftmaxBf16Accumulator,
    /// Attention output projection: the FP32 result is truncated to BF16
    /// (low 16 bits cleared) instead of rounded to nearest even.
    AttentionOutputTruncate,
    /// FFN-half RMSNorm (`ffn_norm`) with this ε instead of the config's.
    FfnNormEpsilon(f32),
    /// Router (non-hash layers): the experts at selection ranks k and k+1
    /// are swapped, as if a near-tie had been resolved the other way.
    RouterNearTieFlip,
    /// MoE combine: native operands and FP32 accumulator, but the shared
    /// expert output is added first: `y = R_BF16(((s + v̂_0) + v̂_1) + …)`.
    SharedExpertFirst,
    /// Main KV compressor (CSA/HCA): the pooling softmax normalizer and the
    /// pooled sum run over the slots in reverse order.
    CompressorPoolingReversed,
    /// Main KV compressor: the pooled sum accumulated in BF16 (R_BF16 after
    /// every addition) instead of FP32.
    CompressorPoolingBf16Accumulator,
    /// MoE combine: the routed FP32 sum is rounded to BF16 before the shared
    /// output is merged: `y = R_BF16(R_BF16(a_k) + s)` (a double rounding).
    RoundedRoutedMerge,
    /// The token's kv vector (after kv_norm and RoPE) keeps only this many
    /// explicit mantissa bits (truncation), as if stored at lower precision.
    KvLowPrecision {
        /// Explicit mantissa bits kept (0..=23; BF16 keeps 7, FP8 E4M3 keeps 3).
        mantissa_bits: u32,
    },
    /// MoE combine with this contract (with its order) instead of the run's combine.
    CombineContract(AggregationContract),
    /// Intervention (not a fault): `H += ΔH` elementwise in FP32, once, on
    /// the residual streams after the FFN-half hc_post (length hc_mult·D).
    AddPostFfnMhc(Vec<f32>),
}

impl FaultKind {
    /// The catalogue component of the operator this kind changes: the
    /// record the bisector must name as the first divergence.
    pub fn component(&self) -> Component {
        use Component as C;
        match self {
            FaultKind::AttentionSoftmaxReversed | FaultKind::AttentionSoftmaxBf16Accumulator => C::AttnCore,
            FaultKind::AttentionOutputTruncate => C::AttnOutput,
            FaultKind::FfnNormEpsilon(_) => C::FfnNorm,
            FaultKind::RouterNearTieFlip => C::RouterTopk,
            FaultKind::SharedExpertFirst | FaultKind::RoundedRoutedMerge | FaultKind::CombineContract(_) => {
                C::MoeCombine
            }
            FaultKind::CompressorPoolingReversed | FaultKind::CompressorPoolingBf16Accumulator => {
                C::AttnCompressed
            }
            FaultKind::KvLowPrecision { .. } => C::AttnKv,
            FaultKind::AddPostFfnMhc(_) => C::LayerPostFfnMhc,
        }
    }

    /// The path of [`FaultKind::component`] (the record the bisector must
    /// name as the first divergence).
    pub fn operator(&self) -> &'static str {
        self.component().path()
    }

    /// A short name for reports (`softmax-reversed`, `combine:b+order=class:135`, …).
    pub fn name(&self) -> String {
        match self {
            FaultKind::AttentionSoftmaxReversed => "attention-softmax-reversed".into(),
            FaultKind::AttentionSoftmaxBf16Accumulator => "attention-softmax-bf16-accumulator".into(),
            FaultKind::CompressorPoolingBf16Accumulator => "compressor-pooling-bf16-accumulator".into(),
            FaultKind::RoundedRoutedMerge => "routed-sum-rounded-before-shared-merge".into(),
            FaultKind::AttentionOutputTruncate => "attn-output-bf16-truncate".into(),
            FaultKind::FfnNormEpsilon(e) => format!("ffn-norm-eps={e:e}"),
            FaultKind::RouterNearTieFlip => "router-near-tie-flip".into(),
            FaultKind::SharedExpertFirst => "shared-expert-first".into(),
            FaultKind::CompressorPoolingReversed => "compressor-pooling-reversed".into(),
            FaultKind::KvLowPrecision { mantissa_bits } => format!("kv-mantissa-{mantissa_bits}-bits"),
            FaultKind::CombineContract(c) => format!("combine:{}", c.describe()),
            FaultKind::AddPostFfnMhc(_) => "add-post-ffn-mhc".into(),
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
    /// What changes.
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
    /// A plan of these faults.
    pub fn new(faults: Vec<Fault>) -> FaultPlan {
        FaultPlan {
            faults,
            observed: Mutex::new(Vec::new()),
        }
    }

    /// The faults active at one (step, layer, position).
    pub fn active(&self, step: u32, layer: u32, position: u32) -> Active<'_> {
        let mut a = Active::default();
        for f in self.faults.iter().filter(|f| f.matches(step, layer, position)) {
            match &f.kind {
                FaultKind::AttentionSoftmaxReversed => a.softmax.order = SumOrder::Reversed,
                FaultKind::AttentionSoftmaxBf16Accumulator => a.softmax.accumulator = SumAccumulator::Bf16,
                FaultKind::CompressorPoolingBf16Accumulator => {
                    a.compressor_pooling.accumulator = SumAccumulator::Bf16
                }
                FaultKind::RoundedRoutedMerge => a.rounded_routed_merge = true,
                FaultKind::AttentionOutputTruncate => a.attn_output_truncate = true,
                FaultKind::FfnNormEpsilon(e) => a.ffn_norm_eps = Some(*e),
                FaultKind::RouterNearTieFlip => a.router_flip = true,
                FaultKind::SharedExpertFirst => a.shared_first = true,
                FaultKind::CompressorPoolingReversed => a.compressor_pooling.order = SumOrder::Reversed,
                FaultKind::KvLowPrecision { mantissa_bits } => a.kv_mantissa_bits = Some(*mantissa_bits),
                FaultKind::CombineContract(c) => a.combine = Some(c),
                FaultKind::AddPostFfnMhc(d) => a.add_post_ffn_mhc = Some(d),
            }
        }
        a
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

/// The faults active at one coordinate, as the operators consume them.
/// `Active::default()` is the unmodified runtime.
#[derive(Debug, Clone, Copy, Default)]
pub struct Active<'a> {
    /// The attention softmax normalizer (and, for the order, the weighted
    /// value sum): see [`FaultKind::AttentionSoftmaxReversed`] and
    /// [`FaultKind::AttentionSoftmaxBf16Accumulator`].
    pub softmax: Summation,
    /// The main compressor's pooling: see
    /// [`FaultKind::CompressorPoolingReversed`] and
    /// [`FaultKind::CompressorPoolingBf16Accumulator`].
    pub compressor_pooling: Summation,
    /// See [`FaultKind::RoundedRoutedMerge`].
    pub rounded_routed_merge: bool,
    /// See [`FaultKind::AttentionOutputTruncate`].
    pub attn_output_truncate: bool,
    /// See [`FaultKind::FfnNormEpsilon`].
    pub ffn_norm_eps: Option<f32>,
    /// See [`FaultKind::RouterNearTieFlip`].
    pub router_flip: bool,
    /// See [`FaultKind::SharedExpertFirst`].
    pub shared_first: bool,
    /// See [`FaultKind::KvLowPrecision`].
    pub kv_mantissa_bits: Option<u32>,
    /// See [`FaultKind::CombineContract`].
    pub combine: Option<&'a AggregationContract>,
    /// See [`FaultKind::AddPostFfnMhc`].
    pub add_post_ffn_mhc: Option<&'a [f32]>,
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
