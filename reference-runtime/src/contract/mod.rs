//! MoE aggregation contracts: how the k gate-weighted routed-expert terms and
//! the shared-expert output are combined (operand precision, accumulator
//! precision, order, rounding points).
//!
//! The paper's schemes P32, C, A and B (section 2.5) are presets of one
//! parameterized contract; `native` is the runtime's default and equals C with
//! the identity order.

use crate::bf16::r_bf16;

/// The runtime's default combine (part 2): each gate-weighted routed term
/// v_i is rounded with R_BF16, the rounded terms are accumulated in FP32 from
/// +0 in the given expert order, then the BF16 shared-expert output is added
/// in FP32 and the sum is rounded with R_BF16:
/// `y = R_BF16(((0 + v̂_0) + v̂_1) + … + v̂_{k-1} + s)`.
///
/// `terms[j]` is the j-th selected expert's FP32 term (length D), `shared`
/// the shared-expert output (already BF16-valued), `out` receives y.
pub fn combine_native(terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
    for (d, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for t in terms {
            acc += r_bf16(t[d]);
        }
        *o = r_bf16(acc + shared[d]);
    }
}
