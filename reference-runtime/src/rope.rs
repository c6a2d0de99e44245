//! Partial interleaved RoPE on the trailing `r` channels, with the "main" and
//! the "compress" (YaRN) frequency tables (`modeling_deepseek_v4.py` L91-153,
//! L346-370; `modeling_rope_utils.py` L346-484).
//!
//! Frequencies are computed once at load in FP32 exactly as HF: `base^(2i/r)`
//! with `libm::powf`, then `1 / that`; YaRN ramps use the correction range
//! computed in f64 with `libm::log`, `floor`, `ceil`. Per position t the angle
//! is the FP32 product `(t as f32) · f_i`; `cos`/`sin` come from `libm::cosf` /
//! `libm::sinf` and are rounded to the activation dtype. The rotation of pair
//! `(a, b) = (ρ[2i], ρ[2i+1])` is `(a·c + (−b)·s, b·c + a·s)` in FP32 (the
//! inverse uses `−s`), then rounded. The first `n − r` channels pass unchanged.

use crate::config::{ModelConfig, Yarn};
use crate::precision::Precision;

/// Inverse frequencies `f_i`, `i < r/2`, of one rope kind.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeFreqs {
    inv_freq: Vec<f32>,
}

fn base_inv_freq(base: f32, r: usize) -> Vec<f32> {
    (0..r / 2)
        .map(|i| 1.0 / libm::powf(base, (2 * i) as f32 / r as f32))
        .collect()
}

impl RopeFreqs {
    /// The "main" rope of sliding layers: `f_i = 1 / θ^(2i/r)`.
    pub fn main(cfg: &ModelConfig) -> RopeFreqs {
        RopeFreqs {
            inv_freq: base_inv_freq(cfg.rope_theta, cfg.rope_dim),
        }
    }

    /// The "compress" rope of CSA/HCA layers, their compressors and the indexer
    /// (`compress_rope_theta`, YaRN if configured; attention_factor 1).
    pub fn compress(cfg: &ModelConfig) -> RopeFreqs {
        let r = cfg.rope_dim;
        let base = cfg.compress_rope_theta;
        match cfg.yarn {
            None => RopeFreqs {
                inv_freq: base_inv_freq(base, r),
            },
            Some(y) => RopeFreqs {
                inv_freq: yarn_inv_freq(base, r, y),
            },
        }
    }

    /// cos/sin of position `t`, rounded to the activation dtype.
    pub fn cos_sin(&self, t: u32, p: Precision) -> CosSin {
        let tf = t as f32;
        let mut cos = Vec::with_capacity(self.inv_freq.len());
        let mut sin = Vec::with_capacity(self.inv_freq.len());
        for f in &self.inv_freq {
            let a = tf * f;
            cos.push(p.round(libm::cosf(a)));
            sin.push(p.round(libm::sinf(a)));
        }
        CosSin { cos, sin }
    }
}

/// YaRN (`_compute_yarn_parameters`, truncate = True).
fn yarn_inv_freq(base: f32, r: usize, y: Yarn) -> Vec<f32> {
    let pos_freqs: Vec<f32> = (0..r / 2)
        .map(|i| libm::powf(base, (2 * i) as f32 / r as f32))
        .collect();
    let dim = r as f64;
    let cd = |beta: f64| {
        dim * libm::log(y.original_max_position_embeddings / (beta * 2.0 * std::f64::consts::PI))
            / (2.0 * libm::log(f64::from(base)))
    };
    let lo = libm::floor(cd(y.beta_fast)).max(0.0);
    let mut hi = libm::ceil(cd(y.beta_slow)).min(dim - 1.0);
    if lo == hi {
        hi += 0.001;
    }
    let (lo, hi) = (lo as f32, hi as f32);
    let factor = y.factor as f32;
    pos_freqs
        .iter()
        .enumerate()
        .map(|(i, pf)| {
            let extra = 1.0 / pf;
            let inter = 1.0 / (factor * pf);
            let ramp = ((i as f32 - lo) / (hi - lo)).clamp(0.0, 1.0);
            let e = 1.0 - ramp;
            inter * (1.0 - e) + extra * e
        })
        .collect()
}

/// cos/sin of one position, one entry per rotated pair.
#[derive(Debug, Clone, PartialEq)]
pub struct CosSin {
    /// cos θ_i.
    pub cos: Vec<f32>,
    /// sin θ_i.
    pub sin: Vec<f32>,
}

/// Rotates the trailing `2·cs.cos.len()` channels of `x` in place (inverse
/// rotation when `inverse`), rounding the rotated channels.
pub fn apply_rope(x: &mut [f32], cs: &CosSin, inverse: bool, p: Precision) {
    let r = 2 * cs.cos.len();
    let start = x.len() - r;
    let rho = &mut x[start..];
    for i in 0..cs.cos.len() {
        let (c, s) = (cs.cos[i], if inverse { -cs.sin[i] } else { cs.sin[i] });
        let (a, b) = (rho[2 * i], rho[2 * i + 1]);
        rho[2 * i] = p.round(a * c + (-b) * s);
        rho[2 * i + 1] = p.round(b * c + a * s);
    }
}

/// vLLM-CPU's RoPE on the trailing `2·cs.cos.len()` channels of `x`, in
/// FP32 without rounding (the caller rounds once), GPT-J pairs `(e, o)` in the
/// forms GCC compiled (`store_cache.cpp` @ 6ddedede189232ae7314,
/// `inverse_gptj_rope_o_proj_cpu`; docs/interop-vllm.md §4.2.5 rules 7, 9,
/// 12): forward `(fma(e, c, −(o ⊗ s)), fma(e, s, o ⊗ c))`, inverse
/// `(fma(e, c, o ⊗ s), fma(o, c, e ⊗ −s))`.
pub fn apply_rope_vllm(x: &mut [f32], cs: &CosSin, inverse: bool) {
    let r = 2 * cs.cos.len();
    let start = x.len() - r;
    let rho = &mut x[start..];
    for i in 0..cs.cos.len() {
        let (c, s) = (cs.cos[i], cs.sin[i]);
        let (e, o) = (rho[2 * i], rho[2 * i + 1]);
        if inverse {
            rho[2 * i] = e.mul_add(c, o * s);
            rho[2 * i + 1] = o.mul_add(c, e * -s);
        } else {
            rho[2 * i] = e.mul_add(c, -(o * s));
            rho[2 * i + 1] = e.mul_add(s, o * c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yarn_ramp_matches_notes_example() {
        // Notes §2.1: r = 16, θ_c = 160000, s = 16, L0 = 65536 → lo = 3, hi = 7:
        // entries i ≤ 3 are pure extrapolation, i ≥ 7 fully interpolated.
        let y = Yarn {
            factor: 16.0,
            original_max_position_embeddings: 65536.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let f = yarn_inv_freq(160000.0, 16, y);
        let plain = base_inv_freq(160000.0, 16);
        for i in 0..=3 {
            assert_eq!(f[i], plain[i], "i = {i}");
        }
        assert_eq!(f[7], 1.0 / (16.0 * libm::powf(160000.0, 14.0 / 16.0)));
        assert!(f[5] < plain[5] && f[5] > plain[5] / 16.0);
    }

    #[test]
    fn inverse_undoes_rotation_in_f32() {
        let freqs = RopeFreqs {
            inv_freq: base_inv_freq(10000.0, 8),
        };
        let cs = freqs.cos_sin(5, Precision::F32);
        let orig: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
        let mut x = orig.clone();
        apply_rope(&mut x, &cs, false, Precision::F32);
        assert_eq!(x[..4], orig[..4]);
        assert_ne!(x[4..], orig[4..]);
        apply_rope(&mut x, &cs, true, Precision::F32);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-6);
        }
    }
}
