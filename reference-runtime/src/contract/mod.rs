//! MoE aggregation contracts: how the k gate-weighted routed-expert terms and
//! the shared-expert output are combined (operand precision, accumulator
//! precision, order, rounding points).
//!
//! The paper's schemes P32, C, A and B (section 2.5) are presets of one
//! parameterized contract; `native` is the runtime's default and equals C with
//! the identity order.

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
    /// Selected routed experts, in the order their terms are passed.
    pub experts: &'a [u32],
}

/// A pluggable MoE combine: turns k FP32 gate-weighted routed terms
/// `v_j = g_j · E_j(x)` (each of length D, in selection order) and the
/// shared-expert output `s` (already BF16-valued in the bf16 profile) into
/// the MoE output `y` written to `out`.
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
/// `y = R_BF16(((0 + v̂_0) + v̂_1) + … + v̂_{k-1} + s)`.
pub fn combine_native(terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
    for (d, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for t in terms {
            acc += r_bf16(t[d]);
        }
        *o = r_bf16(acc + shared[d]);
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
