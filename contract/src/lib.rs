//! MoE aggregation contracts: how the k gate-weighted routed-expert terms and
//! the shared-expert output are combined (operand precision, accumulator
//! precision, order, rounding points).
//!
//! The paper's schemes P32, C, A and B (section 2.5) are presets of one
//! parameterized [`AggregationContract`]; `native` is the runtime's default
//! and equals C with the identity order ([`combine_native`], [`NativeCombine`]).
//! Orders and B structural classes live in the `order` functions
//! ([`permutation_from_index`], [`b_class_of`], …), per-event schedules in
//! [`Schedule`], [`ScheduledCombine`] and [`ForkCombine`], and the
//! order-invariance certificate in [`order_sensitivity`]. docs/contracts.md
//! states every equation, enumeration order and the non-finite behaviour.
//!
//! ```
//! use moeconf_contract::{b_class_of, AggregationContract, Order};
//! // A rounds only the first operand when it enters the accumulator: the
//! // first pair's order matters. B rounds every operand first: it does not.
//! let terms: [&[f32]; 2] = [&[1.00390625], &[0.00390625]]; // 1 + 2^-8, 2^-8
//! let mut y = [0.0f32];
//! let a = AggregationContract::parse("a").unwrap();
//! a.try_combine(&terms, &[0.0], &mut y).unwrap();
//! assert_eq!(y[0], 1.0);
//! a.with_order(Order::Permutation(vec![1, 0])).try_combine(&terms, &[0.0], &mut y).unwrap();
//! assert_eq!(y[0], 1.0078125);
//! assert_eq!(b_class_of(&[1, 0]).unwrap(), b_class_of(&[0, 1]).unwrap());
//! ```

#![forbid(unsafe_code)]

mod backends;
pub mod bf16;
mod certificate;
mod error;
mod exact;
mod infer;
mod kernel;
mod named;
mod order;
mod schedule;
mod spec;

pub use backends::{backends_for_capture, CaptureSelector, KnownBackend, KNOWN_BACKENDS};
pub use certificate::{order_sensitivity, prove_invariance, Certificate, InvarianceProof, MAX_CERTIFIED_K};
pub use error::ContractError;
pub use exact::ExactSum;
pub use infer::*;
pub use named::{
    order_groups, orders_for, EventContext, OrderGroup, ResolvedOrder, NAMED_ORDERS, NAMED_SHAPES,
};
pub use order::{
    all_permutations, b_canonical, b_class_count, b_class_of, b_class_representative,
    b_class_representatives, factorial, identity_permutation, index_of_permutation, permutation_from_index,
    validate_permutation, MAX_ENUMERATED_K, MAX_INDEXED_K,
};
pub use schedule::{
    derive_seed, draw_index, fnv1a64, parse_fork_order, prompt_hash, splitmix64, ForkCombine, ForkPoint,
    Schedule, ScheduledCombine, DEFAULT_EXPERIMENT_SEED, DOMAIN_LAYER_STATIC, DOMAIN_TOKEN_DYNAMIC,
    GOLDEN_GAMMA,
};
pub use spec::{
    Accumulator, AggregationContract, LaneFold, OperandPrecision, Order, OutputRounding, RoutedRounding,
    Shape, SharedMerge, Start, CANONICAL_NAN_BITS, PRESET_NAMES,
};

use crate::bf16::r_bf16;

/// Identifies one MoE combine event, so a contract or schedule can choose
/// per layer and per position (layer-static and token-dynamic schedules,
/// single-layer forks).
#[derive(Debug, Clone, Copy)]
pub struct CombineEvent<'a> {
    /// Decoder layer index.
    pub layer: u32,
    /// Forward step (0 = prefill, s ≥ 1 = the decode forward consuming generated token s).
    pub step: u32,
    /// Absolute token position being processed.
    pub position: u32,
    /// Selected routed experts, in the order their terms are passed (router slot order).
    pub experts: &'a [u32],
    /// Gate weights of the selected experts, in slot order (empty when
    /// unknown: the gate orders then cannot be resolved).
    pub gates: &'a [f32],
    /// The routed experts' unweighted FP32 outputs `u_j = E_j(x)` in slot
    /// order (each of length D), where the runtime forms them; empty
    /// otherwise. Only `operand=fma` needs them: its chain multiplies each
    /// `u_j` by its gate inside a fused multiply-add, so no term `g_j · u_j`
    /// is ever rounded on its own and the terms cannot stand in for them.
    pub units: &'a [&'a [f32]],
}

impl<'a> CombineEvent<'a> {
    /// The router choice the named orders are determined by.
    pub fn context(&self) -> EventContext<'a> {
        EventContext {
            experts: self.experts,
            gates: self.gates,
        }
    }
}

/// A pluggable MoE combine: turns k FP32 gate-weighted routed terms
/// `v_j = g_j · E_j(x)` (each of length D, in selection order) and the
/// shared-expert output `s` (already BF16-valued in the bf16 profile) into
/// the MoE output `y` written to `out`. A combine that fuses the gate
/// multiply into its accumulation (`operand=fma`) reads the unweighted
/// outputs and the gates from the event instead of the terms.
pub trait MoeCombine: Send + Sync {
    /// Combines the terms of one event.
    fn combine(&self, event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]);

    /// A short description for trace bindings and reports (e.g. `native`).
    fn describe(&self) -> String;
}

/// The runtime's default combine (part 2): each gate-weighted routed term
/// v_j is rounded with R_BF16, the rounded terms are accumulated in FP32 from
/// +0 in selection order, then the shared-expert output is added in FP32 and
/// the sum is rounded with R_BF16:
/// `y = R_BF16(((0 + v̂_0) + v̂_1) + … + v̂_{k-1} + s)`. A NaN result is
/// written as the canonical quiet NaN [`CANONICAL_NAN_BITS`] (NaN sign and
/// payload after arithmetic differ between machines). Bitwise equal to
/// [`AggregationContract::native`] (tested).
///
/// # Panics
///
/// If a term or `shared` is shorter than `out`.
pub fn combine_native(terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
    for (d, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for t in terms {
            acc += r_bf16(t[d]);
        }
        let y = r_bf16(acc + shared[d]);
        *o = if y.is_nan() {
            f32::from_bits(CANONICAL_NAN_BITS)
        } else {
            y
        };
    }
}

/// The native contract as a [`MoeCombine`].
#[derive(Debug, Clone, Copy, Default)]
pub struct NativeCombine;

impl MoeCombine for NativeCombine {
    fn combine(&self, _event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        combine_native(terms, shared, out)
    }

    fn describe(&self) -> String {
        "native".to_string()
    }
}

impl<T: MoeCombine + ?Sized> MoeCombine for Box<T> {
    fn combine(&self, event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        (**self).combine(event, terms, shared, out)
    }

    fn describe(&self) -> String {
        (**self).describe()
    }
}

impl<T: MoeCombine + ?Sized> MoeCombine for std::sync::Arc<T> {
    fn combine(&self, event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        (**self).combine(event, terms, shared, out)
    }

    fn describe(&self) -> String {
        (**self).describe()
    }
}
