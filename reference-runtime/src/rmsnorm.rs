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

/// Weighted RMSNorm: `round((x · r) · g)` per element; in the vllm-cpu
/// profile [`rmsnorm_weighted_torch`].
pub fn rmsnorm_weighted(x: &[f32], g: &[f32], eps: f32, p: Precision) -> Vec<f32> {
    if p == Precision::VllmCpu {
        return rmsnorm_weighted_torch(x, g, eps);
    }
    let r = rms_factor(x, eps);
    x.iter().zip(g).map(|(v, w)| p.round((v * r) * w)).collect()
}

/// vLLM-CPU's RMSNorm (the `native` provider in eager torch on BF16 `x` and
/// weight; `vllm/model_executor/layers/layernorm.py` `RMSNorm.forward_native`
/// L74–94, `vllm/ir/ops/layernorm.py` `rms_norm` L9–21; docs/interop-vllm.md
/// §4.2.5 rule 6): `var = sum(x ⊗ x) ⊘ n` with torch's 8-lane cascade sum
/// ([`crate::vllm::torch_cascade_sum`]), `r = 1 ⊘ sqrt(var ⊕ ε)`, and **two
/// roundings** `R(R(x ⊗ r) ⊗ w)` (`x.to(weight.dtype) * weight`, L20).
pub fn rmsnorm_weighted_torch(x: &[f32], g: &[f32], eps: f32) -> Vec<f32> {
    use moeconf_contract::bf16::r_bf16;
    let sq: Vec<f32> = x.iter().map(|v| v * v).collect();
    let var = crate::vllm::torch_cascade_sum(&sq) / x.len() as f32;
    let r = 1.0 / (var + eps).sqrt();
    x.iter().zip(g).map(|(v, w)| r_bf16(r_bf16(v * r) * w)).collect()
}

/// Unweighted RMSNorm in place: `x · round(r)`, rounded.
pub fn rmsnorm_unweighted_in_place(x: &mut [f32], eps: f32, p: Precision) {
    let r = p.round(rms_factor(x, eps));
    for v in x {
        *v = p.round(*v * r);
    }
}

/// The official profile's per-head query norm, DeepSeek's
/// `q *= torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)` on a BF16
/// tensor (`inference/model.py` L498), with every rounding torch makes
/// there: `s_i = R(q_i²)` (the BF16 square), `m = R((Σ_i s_i) / n)` (the BF16
/// mean: an FP32 sum from +0 in increasing i, then one division), `v = R(m ⊕
/// ε)` (a BF16 tensor plus a scalar), `r = R(1 / sqrt(v))` (the BF16
/// `rsqrt`, correctly rounded in FP32 first), then `q_i ← R(q_i ⊗ r)`. `R`
/// is R_BF16; `q` holds BF16 values. The order of the sum is this runtime's
/// (a GPU reduction's is not in the source).
pub fn rmsnorm_unweighted_bf16_tensors(q: &mut [f32], eps: f32) {
    use moeconf_contract::bf16::r_bf16;
    let sum = q.iter().fold(0.0f32, |acc, v| acc + r_bf16(v * v));
    let mean = r_bf16(sum / q.len() as f32);
    let var = r_bf16(mean + eps);
    let r = r_bf16(1.0 / var.sqrt());
    for v in q {
        *v = r_bf16(*v * r);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn vllm_rmsnorm_rounds_twice() {
        // Every value against the formula written out (torch's statistic, then
        // two BF16 roundings), and at least one value of the grid where the
        // two roundings differ from the bf16 profile's one.
        let mut parted = 0;
        for a in 0..64 {
            let x: Vec<f32> = (0..16).map(|i| r_bf16(1.0 + (i * 7 + a) as f32 / 97.0)).collect();
            let g: Vec<f32> = (0..16)
                .map(|i| r_bf16(0.75 + (i * 5 + a) as f32 / 131.0))
                .collect();
            let got = rmsnorm_weighted_torch(&x, &g, 1e-6);
            let sq: Vec<f32> = x.iter().map(|v| v * v).collect();
            let var = crate::vllm::torch_cascade_sum(&sq) / 16.0;
            let r = 1.0 / (var + 1e-6).sqrt();
            for i in 0..16 {
                let want = r_bf16(r_bf16(x[i] * r) * g[i]);
                assert_eq!(got[i].to_bits(), want.to_bits());
                parted += usize::from(want != r_bf16((x[i] * r) * g[i]));
            }
            assert_eq!(rmsnorm_weighted(&x, &g, 1e-6, Precision::VllmCpu), got);
        }
        assert!(parted > 0, "no value where two roundings differ from one");
    }

    use super::*;
    use moeconf_contract::bf16::r_bf16;

    /// An independent formulation in f64 of the torch expression with its
    /// BF16 tensors: each intermediate tensor is exactly the BF16 value,
    /// so rounding every f64 operation result to FP32 and then to BF16 gives
    /// the same bits wherever the FP32 operations are exact or correctly
    /// rounded (squares of BF16 values are exact in FP32; the sum is checked
    /// on values whose partial sums are exact).
    #[test]
    fn bf16_query_norm_rounds_where_torch_does() {
        let bf = |x: f64| r_bf16(x as f32);
        // Multiples of 2^-4 with few bits: squares and partial sums are exact in FP32.
        let q0: Vec<f32> = (0..64)
            .map(|i| ((i % 13) as f32 - 6.0) * 0.0625 + 0.125)
            .collect();
        let mut q = q0.clone();
        rmsnorm_unweighted_bf16_tensors(&mut q, 1e-6);
        let squares: Vec<f64> = q0.iter().map(|v| bf(*v as f64 * *v as f64) as f64).collect();
        let mean = bf(squares.iter().sum::<f64>() / 64.0);
        let var = bf(mean as f64 + 1e-6f32 as f64);
        let r = bf((1.0f64 / (var as f64).sqrt()) as f32 as f64);
        for (got, x) in q.iter().zip(&q0) {
            assert_eq!(got.to_bits(), bf(*x as f64 * r as f64).to_bits());
        }
    }

    #[test]
    fn bf16_query_norm_rounds_the_squares() {
        // 1 + 2^-7 is a BF16 value whose square 1 + 2^-6 + 2^-14 is not:
        // torch's BF16 square drops the 2^-14.
        let x = 1.0f32 + 2.0f32.powi(-7);
        let mut q = vec![x; 8];
        rmsnorm_unweighted_bf16_tensors(&mut q, 0.0);
        let mean = r_bf16(x * x); // the BF16 square, = 1 + 2^-6
        assert_eq!(mean, 1.0 + 2.0f32.powi(-6));
        let r = r_bf16(1.0 / mean.sqrt());
        assert!(q.iter().all(|v| *v == r_bf16(x * r)));
    }
}
