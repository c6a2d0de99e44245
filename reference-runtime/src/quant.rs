//! Bit-level decoding of the quantized weight formats of the released
//! DeepSeek-V4 checkpoints (docs/operators.md §8 gives the rules with worked bytes):
//!
//! - **FP8 E4M3** (`float8_e4m3fn`, safetensors `F8_E4M3`): 1 sign, 4 exponent (bias 7),
//!   3 mantissa bits, no infinities; `0x7F`/`0xFF` are NaN. Dense projections.
//! - **FP4 E2M1** (MXFP4 element): 1 sign, 2 exponent (bias 1), 1 mantissa bit; the
//!   magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}; two per byte, the **low nibble is the
//!   even element**. Routed experts.
//! - **UE8M0** (`float8_e8m0fnu`, safetensors `F8_E8M0`): an unsigned power of two
//!   `2^(e−127)`; `0xFF` is NaN. The block scale of both formats.
//!
//! A decoded weight is `decode(code) · 2^(e−127)`, computed exactly in FP32: both factors
//! are binary floating-point numbers with at most 4 significant bits and the product's
//! exponent stays inside FP32's range for every scale the loader accepts
//! ([`max_scale_code`]), so the multiplication never rounds.

/// FP32 bits of an E4M3 code (NaN codes give a quiet NaN with the code's sign).
const fn e4m3_bits(code: u8) -> u32 {
    let sign = ((code >> 7) as u32) << 31;
    let exp = ((code >> 3) & 0xF) as u32;
    let man = (code & 0x7) as u32;
    if exp == 0xF && man == 0x7 {
        return sign | 0x7FC0_0000;
    }
    if exp == 0 {
        if man == 0 {
            return sign;
        }
        // Subnormal: man · 2^-9; normalize the 3-bit mantissa.
        let mut m = man;
        let mut e: i32 = -6; // value = (m/8) · 2^e
        while m & 0x8 == 0 {
            m <<= 1;
            e -= 1;
        }
        let biased = (e + 127) as u32;
        return sign | (biased << 23) | ((m & 0x7) << 20);
    }
    let biased = exp + 127 - 7;
    sign | (biased << 23) | (man << 20)
}

/// FP32 bits of an E2M1 code (low 4 bits of `code`).
const fn e2m1_bits(code: u8) -> u32 {
    let code = code & 0xF;
    let sign = ((code >> 3) as u32) << 31;
    let exp = ((code >> 1) & 0x3) as u32;
    let man = (code & 0x1) as u32;
    if exp == 0 {
        // Subnormal: man · 0.5.
        return if man == 0 { sign } else { sign | (126 << 23) };
    }
    sign | ((exp + 127 - 1) << 23) | (man << 22)
}

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = f32::from_bits(e4m3_bits(i as u8));
        i += 1;
    }
    t
}

const fn e2m1_pair_table() -> [[f32; 2]; 256] {
    let mut t = [[0.0f32; 2]; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = [
            f32::from_bits(e2m1_bits(i as u8 & 0xF)),
            f32::from_bits(e2m1_bits((i as u8) >> 4)),
        ];
        i += 1;
    }
    t
}

/// Every E4M3 code decoded to FP32 (index = code).
pub const E4M3: [f32; 256] = e4m3_table();

/// Every packed MXFP4 byte decoded to its two FP32 values `[even (low nibble), odd (high nibble)]`.
pub const E2M1_PAIRS: [[f32; 2]; 256] = e2m1_pair_table();

/// Largest finite E4M3 magnitude (`0x7E` = 1.75 · 2^8).
#[cfg(test)]
pub const E4M3_MAX: f32 = 448.0;

/// Largest E2M1 magnitude (`0x7` = 1.5 · 2^2).
#[cfg(test)]
pub const E2M1_MAX: f32 = 6.0;

/// Decodes one E4M3 code (`0x7F`/`0xFF` give NaN).
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3[code as usize]
}

/// Whether an E4M3 code is one of the two NaN codes (`0x7F`, `0xFF`).
#[inline]
pub fn e4m3_is_nan(code: u8) -> bool {
    code & 0x7F == 0x7F
}

/// Decodes one E2M1 code (the low 4 bits of `code`).
#[inline]
#[cfg(test)]
pub fn e2m1_to_f32(code: u8) -> f32 {
    f32::from_bits(e2m1_bits(code))
}

/// The UE8M0 scale `2^(e−127)` as FP32, or `None` for the NaN code `0xFF`.
/// `e = 0` gives 2^-127, an FP32 subnormal (exact).
#[inline]
pub fn ue8m0_to_f32(e: u8) -> Option<f32> {
    match e {
        0xFF => None,
        0 => Some(f32::from_bits(0x0040_0000)),
        e => Some(f32::from_bits(u32::from(e) << 23)),
    }
}

/// A quantized weight element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// FP8 E4M3 with one UE8M0 scale per 128×128 block.
    Fp8E4m3Block128,
    /// MXFP4: E2M1 pairs with one UE8M0 scale per 32 consecutive inputs of a row.
    Mxfp4,
}

impl QuantFormat {
    /// The largest scale code whose block values all stay finite in FP32:
    /// `448 · 2^(e−127) < 2^128` needs e ≤ 246; `6 · 2^(e−127)` needs e ≤ 252.
    pub fn max_scale_code(self) -> u8 {
        max_scale_code(self)
    }

    /// Short human name, used in messages and reports.
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Fp8E4m3Block128 => "FP8 E4M3 with UE8M0 128x128 block scales",
            QuantFormat::Mxfp4 => "MXFP4 (E2M1 pairs, UE8M0 scale per 32 inputs)",
        }
    }
}

/// See [`QuantFormat::max_scale_code`].
pub const fn max_scale_code(f: QuantFormat) -> u8 {
    match f {
        QuantFormat::Fp8E4m3Block128 => 246,
        QuantFormat::Mxfp4 => 252,
    }
}

/// Side of an FP8 scale block (rows and columns), as released (`weight_block_size: [128, 128]`).
pub const FP8_BLOCK: usize = 128;

/// Inputs per MXFP4 scale, as released.
pub const MXFP4_GROUP: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    /// E4M3 from its fields with f64 arithmetic (the OCP FP8 definition), independent of the
    /// bit construction above.
    fn e4m3_reference(code: u8) -> f64 {
        let s = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((code >> 3) & 0xF);
        let m = f64::from(code & 0x7);
        if e == 15 && m == 7.0 {
            return f64::NAN;
        }
        if e == 0 {
            s * (m / 8.0) * 2f64.powi(-6)
        } else {
            s * (1.0 + m / 8.0) * 2f64.powi(e - 7)
        }
    }

    #[test]
    fn every_e4m3_code_matches_the_field_formula() {
        let mut nans = 0;
        for code in 0..=255u8 {
            let got = e4m3_to_f32(code);
            let want = e4m3_reference(code);
            if want.is_nan() {
                assert!(got.is_nan(), "{code:#04x}");
                assert!(e4m3_is_nan(code));
                nans += 1;
                continue;
            }
            assert!(!e4m3_is_nan(code));
            assert_eq!(f64::from(got), want, "{code:#04x}");
            assert_eq!(got.is_sign_negative(), code & 0x80 != 0, "{code:#04x} sign");
            // Every finite E4M3 value is exact in bf16 and f16 too (`half` as a second oracle).
            assert_eq!(
                half::bf16::from_f32(got).to_f32().to_bits(),
                got.to_bits(),
                "{code:#04x} bf16"
            );
            assert_eq!(
                half::f16::from_f32(got).to_f32().to_bits(),
                got.to_bits(),
                "{code:#04x} f16"
            );
        }
        assert_eq!(nans, 2);
        assert_eq!(e4m3_to_f32(0x7E), E4M3_MAX);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn every_e2m1_code_matches_the_value_table() {
        let magnitudes = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for code in 0..16u8 {
            let want = if code & 8 != 0 {
                -magnitudes[usize::from(code & 7)]
            } else {
                magnitudes[usize::from(code & 7)]
            };
            let got = e2m1_to_f32(code);
            assert_eq!(got.to_bits(), want.to_bits(), "{code:#x}");
            // The field formula: s · 2^(e−1) · (1 + m/2), subnormal s · m/2.
            let (s, e, m) = (code >> 3, i32::from((code >> 1) & 3), f64::from(code & 1));
            let f = if e == 0 {
                m / 2.0
            } else {
                2f64.powi(e - 1) * (1.0 + m / 2.0)
            };
            assert_eq!(f64::from(got), if s == 1 { -f } else { f }, "{code:#x}");
        }
        // Pair table: low nibble is the even element.
        for byte in 0..=255u8 {
            assert_eq!(
                E2M1_PAIRS[usize::from(byte)][0].to_bits(),
                e2m1_to_f32(byte & 0xF).to_bits()
            );
            assert_eq!(
                E2M1_PAIRS[usize::from(byte)][1].to_bits(),
                e2m1_to_f32(byte >> 4).to_bits()
            );
        }
        assert_eq!(E2M1_PAIRS[0x2F], [-6.0, 1.0]);
    }

    #[test]
    fn every_ue8m0_exponent_is_a_power_of_two() {
        for e in 0..=254u8 {
            let got = ue8m0_to_f32(e).expect("finite");
            assert_eq!(f64::from(got), 2f64.powi(i32::from(e) - 127), "{e}");
            assert_eq!(got, 2f32.powi(i32::from(e) - 127), "{e}");
        }
        assert_eq!(ue8m0_to_f32(0xFF), None);
        assert_eq!(ue8m0_to_f32(127), Some(1.0));
    }

    #[test]
    fn scaled_values_are_exact_and_finite_up_to_the_limit() {
        for f in [QuantFormat::Fp8E4m3Block128, QuantFormat::Mxfp4] {
            let (max, limit) = match f {
                QuantFormat::Fp8E4m3Block128 => (E4M3_MAX, f.max_scale_code()),
                QuantFormat::Mxfp4 => (E2M1_MAX, f.max_scale_code()),
            };
            let s = ue8m0_to_f32(limit).expect("finite");
            assert!((max * s).is_finite(), "{f:?}");
            let over = ue8m0_to_f32(limit + 1).expect("finite");
            assert!(!(max * over).is_finite(), "{f:?}");
        }
        // Every product code · scale is exact: compare with f64 for every E4M3 code and every
        // accepted exponent.
        for e in 0..=max_scale_code(QuantFormat::Fp8E4m3Block128) {
            let s = ue8m0_to_f32(e).expect("finite");
            for code in 0..=255u8 {
                if e4m3_is_nan(code) {
                    continue;
                }
                let v = e4m3_to_f32(code) * s;
                assert_eq!(f64::from(v), e4m3_reference(code) * 2f64.powi(i32::from(e) - 127));
            }
        }
        for e in 0..=max_scale_code(QuantFormat::Mxfp4) {
            let s = ue8m0_to_f32(e).expect("finite");
            for code in 0..16u8 {
                let v = e2m1_to_f32(code) * s;
                assert_eq!(
                    f64::from(v),
                    f64::from(e2m1_to_f32(code)) * 2f64.powi(i32::from(e) - 127)
                );
            }
        }
    }
}
