//! RMSNorm, weighted and unweighted (`modeling_deepseek_v4.py` L44-72).
//!
//! Statistic: `ss = dot8(x, x)` (FP32, crate::linear order), `r = 1 / sqrt(ss / n + ε)`
//! (IEEE-correct sqrt and division). Weighted: `y_i = round((x_i · r) · g_i)`.
//! Unweighted (HF casts the factor to the input dtype first):
//! `y_i = round(x_i · round(r))`. `round` is the profile's rounding point.

use crate::linear::dot8;
use crate::precision::Precision;

/// The FP32 reciprocal RMS `1 / sqrt(mean(x²) + eps)`.
#[inline]
pub fn rms_factor(x: &[f32], eps: f32) -> f32 {
    let ss = dot8(x, x);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// Weighted RMSNorm: `round((x · r) · g)` per element.
pub fn rmsnorm_weighted(x: &[f32], g: &[f32], eps: f32, p: Precision) -> Vec<f32> {
    let r = rms_factor(x, eps);
    x.iter().zip(g).map(|(v, w)| p.round((v * r) * w)).collect()
}

/// Unweighted RMSNorm in place: `x · round(r)`, rounded.
pub fn rmsnorm_unweighted_in_place(x: &mut [f32], eps: f32, p: Precision) {
    let r = p.round(rms_factor(x, eps));
    for v in x {
        *v = p.round(*v * r);
    }
}
