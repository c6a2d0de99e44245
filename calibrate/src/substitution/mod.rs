//! Protocols 6 and 7, the two endpoint-substitution controls (paper
//! sections 2.4.2, 2.4.3, 3.2.2, 3.2.3) on one single-layer B branch of
//! "why the sheep" at the fork layer, first decode forward (step 1).
//!
//! Branch selection (computed, not chosen by hand): the first B class in
//! cyclic order from 135 (the paper's class; class 0 when k!/2 ≤ 135) whose
//! MoE output at the fork differs from the native output; protocol 7
//! additionally requires that the branch and production independently
//! predict the same next token at the decode boundary (no token is forced).
//!
//! 6. Post-mHC substitution ([`post_mhc`]): ΔH = H_B − H_P in FP32 at
//!    (step 1, fork layer); a native run with the runtime's `AddPostFfnMhc`
//!    intervention adds ΔH once after the FFN-half hc_post. The pre-add state
//!    must equal H_P and the result H_B bitwise; every later post-mHC state,
//!    route, prediction and the text must equal the branch's; the pre-fork
//!    layers must match.
//! 7. Persistent-state substitution ([`persistent_state`]): at the decode
//!    boundary after step 1, ΔS = S_B − S_P over every float of the
//!    persistent state; count layers an FP32 ΔS and an FP64 ΔS reconstruct
//!    bitwise; then continue production from the FP64-reconstructed state and
//!    compare every later post-mHC state, persistent-state checkpoint, route,
//!    prediction and text.

mod persistent_state;
mod post_mhc;

pub use persistent_state::persistent_state;
pub use post_mhc::post_mhc;

use moeconf_contract::{b_class_count, AggregationContract, ForkCombine, ForkPoint, Order};

use crate::fork_sweep::capture_event;
use crate::{bitwise_eq, Ctx, Result};

/// The prompt of both controls.
const PROMPT: &str = "why the sheep";

/// Candidate B classes in the selection order: cyclic from 135, MoE output differing from native.
fn candidate_classes(ctx: &Ctx, ids: &[u32], point: ForkPoint) -> Result<Vec<u64>> {
    let n = b_class_count(ctx.k())?;
    let start = if n > 135 { 135 } else { 0 };
    let ev = capture_event(ctx, ids, point.layer, point.step)?;
    let refs: Vec<&[f32]> = ev.terms.iter().map(|v| v.as_slice()).collect();
    let mut y = vec![0.0f32; ev.shared.len()];
    let mut out = Vec::new();
    for i in 0..n {
        let c = (start + i) % n;
        AggregationContract::b()
            .with_order(Order::BClass(c))
            .try_combine(&refs, &ev.shared, &mut y)?;
        if !bitwise_eq(&y, &ev.native) {
            out.push(c);
        }
    }
    Ok(out)
}

/// The single-layer B branch of `class` at `point`.
fn fork(point: ForkPoint, class: u64) -> ForkCombine {
    ForkCombine::new(point, AggregationContract::b().with_order(Order::BClass(class)))
}

/// `yes` or `NO`.
fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}
