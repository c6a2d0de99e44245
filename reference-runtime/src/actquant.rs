//! Activation quantization as DeepSeek's official inference code performs it
//! (docs/operators.md §9.2–§9.4), for the `official` precision profile:
//!
//! - [`fp8_quantize_blocks`]: `act_quant` — per block of B elements, the
//!   power-of-two scale `s = 2^⌈log2(max(amax, 1e-4) · fp32(1/448))⌉` and
//!   `q = E4M3(clamp(x / s, ±448))`, round to nearest even; the values are
//!   replaced by their dequantization `q · s` (exact).
//! - [`fp4_quantize_blocks`]: `fp4_act_quant` — blocks of 32,
//!   `s = 2^⌈log2(max(amax, 6·2^−126) · fp32(1/6))⌉`, `q = E2M1(clamp(x / s, ±6))`.
//! - [`hadamard_rotate`]: the Sylvester-ordered Hadamard rotation `x · H · d^−1/2`
//!   in FP32 with a fixed butterfly order.
//!
//! The encoders round to the grid directly (`e4m3_round`, `e2m1_round`):
//! `|v| / step` is exact for the power-of-two step of `v`'s binade, so
//! `round_ties_even` of it is round-to-nearest-even on the grid, and the grid's
//! even multiples of the step are exactly its even codes. The sign is kept,
//! also on a zero result (CUDA's conversions keep it). The unit tests check
//! both encoders against a brute-force nearest-even search over every code
//! for every BF16 input in range (the official profile's activations are BF16).

/// Largest finite E4M3 (`float8_e4m3fn`) magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;
/// The floor of an FP8 block's absolute maximum (`act_quant`, K L79).
pub const FP8_AMAX_FLOOR: f32 = 1e-4;
/// The floor of an FP4 block's absolute maximum, `6 · 2^−126` (K L163).
pub const FP4_AMAX_FLOOR: f32 = 6.0 * f32::MIN_POSITIVE;
/// Block width of the FP8 quantization of a GEMM input (`block_size`, M L17).
pub const GEMM_INPUT_BLOCK: usize = 128;
/// Block width of the FP8 fake quantization of KV entries (M L372, L506).
pub const KV_BLOCK: usize = 64;
/// Block width of the FP4 fake quantization (`fp4_block_size`, M L18).
pub const FP4_BLOCK: usize = 32;

/// `fp32(1/448)`: the official kernel multiplies by the reciprocal (K L49).
const INV_E4M3_MAX: f32 = 1.0 / E4M3_MAX;
/// `fp32(1/6)` (K L135).
const INV_E2M1_MAX: f32 = 1.0 / E2M1_MAX;
/// Smallest normal E4M3 magnitude, 2^−6.
const E4M3_MIN_NORMAL: f32 = 0.015625;

/// `2^⌈log2 p⌉` for a positive normal FP32 `p`, from its bits (`fast_round_scale`,
/// K L22–37): the biased exponent, plus one if any mantissa bit is set; the
/// exponent is clamped to 254 so the result stays finite.
#[inline]
pub fn ceil_pow2(p: f32) -> f32 {
    let bits = p.to_bits();
    let e = (bits >> 23) & 0xff;
    let e = (e + u32::from(bits & 0x7f_ffff != 0)).min(254);
    f32::from_bits(e << 23)
}

/// The UE8M0 scale of an FP8 block with absolute maximum `amax`.
#[inline]
pub fn fp8_scale(amax: f32) -> f32 {
    ceil_pow2(amax.max(FP8_AMAX_FLOOR) * INV_E4M3_MAX)
}

/// The UE8M0 scale of an FP4 block with absolute maximum `amax`.
#[inline]
pub fn fp4_scale(amax: f32) -> f32 {
    ceil_pow2(amax.max(FP4_AMAX_FLOOR) * INV_E2M1_MAX)
}

/// `v` rounded to the nearest E4M3 value, ties to even, saturating at ±448
/// (a finite `v`; the sign is kept, also on zero).
#[inline]
pub fn e4m3_round(v: f32) -> f32 {
    let a = v.abs();
    let step = if a < E4M3_MIN_NORMAL {
        // Subnormals: multiples of 2^−9.
        0.001953125
    } else {
        // 2^(E−3) for a in [2^E, 2^(E+1)): three mantissa bits.
        f32::from_bits((a.to_bits() & 0x7f80_0000) - (3 << 23))
    };
    let q = ((a / step).round_ties_even() * step).min(E4M3_MAX);
    q.copysign(v)
}

/// `v` rounded to the nearest E2M1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to
/// even, saturating at ±6 (a finite `v`; the sign is kept, also on zero).
#[inline]
pub fn e2m1_round(v: f32) -> f32 {
    let a = v.abs();
    let step = if a < 2.0 {
        0.5
    } else if a < 4.0 {
        1.0
    } else {
        2.0
    };
    let q = ((a / step).round_ties_even() * step).min(E2M1_MAX);
    q.copysign(v)
}

/// Absolute maximum of a block, `None` if it holds a NaN or an infinity.
#[inline]
fn finite_amax(block: &[f32]) -> Option<f32> {
    let mut amax = 0.0f32;
    for v in block {
        if !v.is_finite() {
            return None;
        }
        amax = amax.max(v.abs());
    }
    Some(amax)
}

/// FP8 quantize-dequantize of `x` in consecutive blocks of `block` elements
/// (`act_quant`): every value becomes `E4M3(clamp(x/s, ±448)) · s` with its
/// block's power-of-two scale `s` (returned, one per block). A block holding a
/// non-finite value becomes all NaN (scale NaN); the runtime stops on
/// non-finite values before they reach a quantization site unless non-finite
/// values are allowed. `x.len()` must be a multiple of `block` (checked when
/// the model is loaded for the profile; a ragged tail is quantized as a
/// shorter block).
pub fn fp8_quantize_blocks(x: &mut [f32], block: usize) -> Vec<f32> {
    quantize_blocks(x, block, fp8_scale, E4M3_MAX, e4m3_round)
}

/// FP4 quantize-dequantize of `x` in consecutive blocks of `block` elements
/// (`fp4_act_quant`, block 32): `E2M1(clamp(x/s, ±6)) · s`; scales returned.
pub fn fp4_quantize_blocks(x: &mut [f32], block: usize) -> Vec<f32> {
    quantize_blocks(x, block, fp4_scale, E2M1_MAX, e2m1_round)
}

#[inline]
fn quantize_blocks(
    x: &mut [f32],
    block: usize,
    scale_of: impl Fn(f32) -> f32,
    max: f32,
    round: impl Fn(f32) -> f32,
) -> Vec<f32> {
    let block = block.max(1);
    let mut scales = Vec::with_capacity(x.len().div_ceil(block));
    for b in x.chunks_mut(block) {
        let Some(amax) = finite_amax(b) else {
            b.fill(f32::NAN);
            scales.push(f32::NAN);
            continue;
        };
        let s = scale_of(amax);
        for v in b.iter_mut() {
            // v / s is exact (s is a power of two); so is q · s.
            *v = round((*v / s).clamp(-max, max)) * s;
        }
        scales.push(s);
    }
    scales
}

/// The Hadamard rotation `x · H_n · n^−1/2` of a power-of-two-long `x`
/// (`rotate_activation`, M L247–251), in FP32: the butterflies
/// `(u, v) → (u + v, u − v)` over pairs at distance h = 1, 2, 4, …, n/2 (the
/// Sylvester order, lowest index bit first), each stage over the pairs in
/// increasing index, then every element multiplied by `fp32(n^−1/2)`
/// (`libm::pow(n, −0.5)` in f64, rounded once). Callers round the result to
/// the activation format. `n` not a power of two is refused when the model is
/// loaded for the profile; here such an `x` is left unchanged.
pub fn hadamard_rotate(x: &mut [f32]) {
    let n = x.len();
    if n == 0 || !n.is_power_of_two() {
        return;
    }
    let mut h = 1;
    while h < n {
        for base in (0..n).step_by(2 * h) {
            for j in base..base + h {
                let (u, v) = (x[j], x[j + h]);
                x[j] = u + v;
                x[j + h] = u - v;
            }
        }
        h *= 2;
    }
    let scale = libm::pow(n as f64, -0.5) as f32;
    for v in x.iter_mut() {
        *v *= scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeconf_contract::bf16::r_bf16;

    /// Every E4M3 value by code (the field formula: sign, 4 exponent bits with
    /// bias 7, 3 mantissa bits; 0x7F/0xFF are NaN), independent of `e4m3_round`.
    fn e4m3_value(code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0f64 } else { 1.0 };
        let e = i32::from((code >> 3) & 0xf);
        let m = f64::from(code & 7);
        let mag = if e == 0 {
            m / 8.0 * 2f64.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f64.powi(e - 7)
        };
        (sign * mag) as f32
    }

    /// Every E2M1 value by code (1 sign, 2 exponent bits with bias 1, 1 mantissa bit).
    fn e2m1_value(code: u8) -> f32 {
        let sign = if code & 8 != 0 { -1.0f64 } else { 1.0 };
        let e = i32::from((code >> 1) & 3);
        let m = f64::from(code & 1);
        let mag = if e == 0 {
            m * 0.5
        } else {
            (1.0 + m / 2.0) * 2f64.powi(e - 1)
        };
        (sign * mag) as f32
    }

    /// Nearest grid value by exhaustive search in f64, ties to the even code,
    /// saturating at the largest magnitude; the sign of `v` kept.
    fn brute_nearest(v: f32, codes: &[u8], value: impl Fn(u8) -> f32) -> f32 {
        let a = f64::from(v.abs());
        let mut best: Option<(f64, u8)> = None;
        for &c in codes {
            let g = f64::from(value(c));
            let d = (g - a).abs();
            best = match best {
                None => Some((d, c)),
                Some((bd, bc)) if d < bd || (d == bd && c % 2 == 0 && bc % 2 == 1) => Some((d, c)),
                keep => keep,
            };
        }
        let (_, c) = best.unwrap();
        value(c).copysign(v)
    }

    #[test]
    fn reciprocals_are_the_fp32_values_of_the_official_constants() {
        // fp32(1/448) = 0x1.24924Ap−9 and fp32(1/6) = 0x1.555556p−3, the values the
        // TileLang kernel embeds (Python doubles rounded once to fp32).
        assert_eq!(INV_E4M3_MAX.to_bits(), 0x3b12_4925);
        assert_eq!(INV_E4M3_MAX, ((1.0f64 / 448.0) as f32));
        assert_eq!(INV_E2M1_MAX, ((1.0f64 / 6.0) as f32));
        assert_eq!(FP4_AMAX_FLOOR, (6.0f64 * 2f64.powi(-126)) as f32);
    }

    #[test]
    fn e4m3_round_is_nearest_even_for_every_bf16_in_range() {
        // The non-negative non-NaN codes 0x00..=0x7E.
        let codes: Vec<u8> = (0u8..=0x7e).collect();
        let mut checked = 0;
        for bits in 0u16..=u16::MAX {
            let v = f32::from_bits(u32::from(bits) << 16);
            if !v.is_finite() || v.abs() > E4M3_MAX {
                continue;
            }
            let want = brute_nearest(v, &codes, e4m3_value);
            let got = e4m3_round(v);
            assert_eq!(got.to_bits(), want.to_bits(), "bf16 {bits:#06x} = {v:e}");
            checked += 1;
        }
        assert!(checked > 30_000, "{checked}");
    }

    #[test]
    fn e4m3_round_at_every_midpoint_and_its_neighbours() {
        let codes: Vec<u8> = (0u8..=0x7e).collect();
        let grid: Vec<f32> = codes.iter().map(|&c| e4m3_value(c)).collect();
        for w in grid.windows(2) {
            let mid = (w[0] + w[1]) / 2.0; // exact: few significant bits
            for v in [
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                let want = brute_nearest(v, &codes, e4m3_value);
                assert_eq!(e4m3_round(v).to_bits(), want.to_bits(), "{v:e}");
                assert_eq!(e4m3_round(-v).to_bits(), (-want).to_bits(), "{:e}", -v);
            }
        }
        // Saturation at the top, and the smallest subnormal's tie.
        assert_eq!(e4m3_round(448.0), 448.0);
        assert_eq!(e4m3_round(2f32.powi(-10)), 0.0);
        assert_eq!(e4m3_round(1.5 * 2f32.powi(-10)), 2f32.powi(-9));
        assert_eq!(e4m3_round(-1e-9).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn e2m1_round_is_nearest_even_for_every_bf16_in_range() {
        let codes: Vec<u8> = (0u8..8).collect();
        for bits in 0u16..=u16::MAX {
            let v = f32::from_bits(u32::from(bits) << 16);
            if !v.is_finite() || v.abs() > E2M1_MAX {
                continue;
            }
            let want = brute_nearest(v, &codes, e2m1_value);
            assert_eq!(
                e2m1_round(v).to_bits(),
                want.to_bits(),
                "bf16 {bits:#06x} = {v:e}"
            );
        }
        // The ties of docs/operators.md §9.3 (DeepGEMM's encoder rounds 0.75, 1.75, 3.5 down).
        let ties = [
            (0.25, 0.0),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
        ];
        for (v, q) in ties {
            assert_eq!(e2m1_round(v), q, "{v}");
            assert_eq!(e2m1_round(-v), -q, "{v}");
        }
    }

    #[test]
    fn ceil_pow2_matches_the_exact_ceiling() {
        for e in -126..=126 {
            let p = 2f32.powi(e);
            assert_eq!(ceil_pow2(p), p, "2^{e}");
            assert_eq!(
                ceil_pow2(f32::from_bits(p.to_bits() + 1)),
                p * 2.0,
                "just above 2^{e}"
            );
            if e > -126 {
                assert_eq!(ceil_pow2(f32::from_bits(p.to_bits() - 1)), p, "just below 2^{e}");
            }
        }
        assert_eq!(ceil_pow2(f32::MAX), 2f32.powi(127));
    }

    /// The product form `amax · fp32(1/m)` of the official kernel and the
    /// quotient `amax / m` of DeepGEMM and SGLang give the same rounded-up
    /// scale (docs/operators.md §9.8 item 5), for every FP32 amax of the binades
    /// `lo..hi` (all 2^23 mantissas each).
    fn product_equals_quotient(lo: i32, hi: i32) {
        for (m, inv) in [(E4M3_MAX, INV_E4M3_MAX), (E2M1_MAX, INV_E2M1_MAX)] {
            for e in lo..hi {
                let base = 2f32.powi(e).to_bits();
                for k in 0..(1u32 << 23) {
                    let amax = f32::from_bits(base + k);
                    let a = ceil_pow2(amax * inv);
                    let b = ceil_pow2(amax / m);
                    assert_eq!(a, b, "amax {amax:e}, m {m}");
                }
            }
        }
    }

    #[test]
    fn scale_product_equals_quotient_near_one() {
        product_equals_quotient(-2, 10);
    }

    /// Every binade an activation block's amax can have (BF16 range, amax ≥ 2^−126);
    /// ~15 s: `cargo test --release -p moeconf-reference-runtime --lib --
    /// --ignored scale_product_equals_quotient_everywhere`.
    #[test]
    #[ignore]
    fn scale_product_equals_quotient_everywhere() {
        product_equals_quotient(-126, 127);
    }

    #[test]
    fn fp8_blocks_follow_act_quant() {
        // Block 0: amax 3.0 → p = 3 · fp32(1/448) ≈ 0.0067 → s = 2^−7; 3.0 / 2^−7 = 384 exact.
        // Block 1: all zeros → amax floor 1e-4 → s = 2^−22; zeros stay (+0 and −0 kept).
        let mut x = vec![3.0, -1.0, 0.1, 0.0, 0.0, -0.0, 0.0, 0.0];
        let s = fp8_quantize_blocks(&mut x, 4);
        assert_eq!(s, vec![2f32.powi(-7), 2f32.powi(-22)]);
        assert_eq!(x[0], 3.0);
        assert_eq!(x[1], -1.0);
        // 0.1 / 2^−7 = 12.8 → E4M3 step 1 in [8, 16) → 13 → 13 · 2^−7.
        assert_eq!(x[2], 13.0 * 2f32.powi(-7));
        assert_eq!(x[5].to_bits(), (-0.0f32).to_bits());
        // Idempotent: quantizing the quantized values changes nothing.
        let before = x.clone();
        fp8_quantize_blocks(&mut x, 4);
        assert_eq!(x, before);
        // A non-finite value poisons its block only.
        let mut y = vec![1.0, f32::INFINITY, 2.0, 3.0];
        fp8_quantize_blocks(&mut y, 2);
        assert!(y[0].is_nan() && y[1].is_nan());
        assert_eq!(&y[2..], &[2.0, 3.0]);
    }

    #[test]
    fn fp4_blocks_follow_fp4_act_quant() {
        // amax 6 → s = 1: the grid itself; 0.75 → 1 (tie to even), 5 → 4.
        let mut x = vec![6.0, 0.75, 5.0, -2.9, 0.0, -0.2, 1.75, 3.5];
        let s = fp4_quantize_blocks(&mut x, 8);
        assert_eq!(s, vec![1.0]);
        assert_eq!(x, vec![6.0, 1.0, 4.0, -3.0, 0.0, -0.0, 2.0, 4.0]);
        assert_eq!(x[5].to_bits(), (-0.0f32).to_bits());
        // amax 7 → 7 · fp32(1/6) > 1 → s = 2: 7/2 = 3.5 → 4 → 8.
        let mut y = vec![7.0, 1.0];
        assert_eq!(fp4_quantize_blocks(&mut y, 2), vec![2.0]);
        assert_eq!(y, vec![8.0, 1.0]);
        // An all-zero block gets the floor's scale 2^−126.
        let mut z = vec![0.0; 4];
        assert_eq!(fp4_quantize_blocks(&mut z, 4), vec![f32::MIN_POSITIVE]);
    }

    #[test]
    fn quantized_bf16_values_stay_bf16_values() {
        // The official profile's activations are BF16; the dequantized values
        // are exactly representable in BF16, so the cast back never rounds.
        let mut state = 0x9e37_79b9u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            r_bf16((state as f32 / u32::MAX as f32 - 0.5) * 2f32.powi((state % 40) as i32 - 20))
        };
        for _ in 0..200 {
            let mut x: Vec<f32> = (0..128).map(|_| next()).collect();
            let mut y = x.clone();
            fp8_quantize_blocks(&mut x, 64);
            fp4_quantize_blocks(&mut y, 32);
            for v in x.iter().chain(&y) {
                assert_eq!(r_bf16(*v).to_bits(), v.to_bits());
            }
        }
    }

    #[test]
    fn hadamard_is_the_scaled_sylvester_matrix() {
        // Against the explicit H_n (entry (i, j) = (−1)^popcount(i & j)) in f64.
        for n in [1usize, 2, 4, 8, 32, 128] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25).collect();
            let mut y = x.clone();
            hadamard_rotate(&mut y);
            let s = (n as f64).powf(-0.5);
            for (i, yi) in y.iter().enumerate() {
                let want: f64 = (0..n)
                    .map(|j| {
                        let sign = if (i & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 };
                        sign * f64::from(x[j])
                    })
                    .sum::<f64>()
                    * s;
                assert!(
                    (f64::from(*yi) - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "n {n} i {i}"
                );
            }
            // Orthogonal: rotating twice gives x back (up to rounding).
            let mut z = y.clone();
            hadamard_rotate(&mut z);
            for (a, b) in z.iter().zip(&x) {
                assert!((a - b).abs() <= 1e-5, "n {n}");
            }
        }
        // The fixed butterfly order is part of the contract: pinned bits.
        let a: Vec<f32> = (0..8).map(|i| 1.0 + (i as f32) * 1e-7).collect();
        let mut x = a.clone();
        hadamard_rotate(&mut x);
        let scale = libm::pow(8.0, -0.5) as f32;
        let first = (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))) * scale;
        assert_eq!(x[0].to_bits(), first.to_bits());
        let last = (((a[0] - a[1]) - (a[2] - a[3])) - ((a[4] - a[5]) - (a[6] - a[7]))) * scale;
        assert_eq!(x[7].to_bits(), last.to_bits());
    }
}
