//! An exact fixed-point superaccumulator for sums of f32 values, with one
//! final round-to-nearest-even to f32.
//!
//! Every finite f32 is an integer multiple of 2^−149 (the subnormal quantum)
//! below 2^128, so it is an integer `M · 2^−149` with `M < 2^277`. The
//! accumulator holds `Σ M_i` exactly in [`LIMBS`] signed 64-bit limbs of
//! 32-bit digits (carry-save: a limb absorbs up to 2^31 additions before it
//! could overflow, and [`ExactSum::add`] normalizes long before that). The
//! sum is therefore exact for any number of terms and independent of their
//! order, and [`ExactSum::to_f32`] ([`ExactSum::to_bf16`]) rounds the exact
//! real value **once** to the nearest f32 (bf16), ties to even, including
//! gradual underflow and overflow to ±∞ (a magnitude that rounds to 2^128 or
//! above).
//!
//! Non-finite operands are tracked separately: the result is NaN if any
//! operand is NaN or if both +∞ and −∞ occur, otherwise ±∞ if an infinity
//! occurs, otherwise the rounded exact sum. An exact zero sum is +0 (as an
//! FP32 accumulation from +0 would give); a nonzero sum too small for the
//! target's smallest quantum (possible for bf16 only) rounds to a zero of its
//! own sign, as R_BF16 does.

/// Number of 32-bit digits: 277 value bits plus sign and carry headroom.
pub const LIMBS: usize = 10;

/// Additions between carry normalizations (well below the 2^31 headroom).
const NORMALIZE_EVERY: u32 = 1 << 20;

/// An exact sum of f32 values (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct ExactSum {
    limbs: [i64; LIMBS],
    pending: u32,
    nan: bool,
    pos_inf: bool,
    neg_inf: bool,
}

impl ExactSum {
    /// An empty sum (value +0).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `x` exactly.
    pub fn add(&mut self, x: f32) {
        let bits = x.to_bits();
        let exp_field = (bits >> 23) & 0xff;
        let frac = bits & 0x007f_ffff;
        let negative = bits >> 31 == 1;
        if exp_field == 0xff {
            if frac != 0 {
                self.nan = true;
            } else if negative {
                self.neg_inf = true;
            } else {
                self.pos_inf = true;
            }
            return;
        }
        // x = sig · 2^(shift − 149) with shift = max(exp_field, 1) − 1.
        let (sig, shift) = if exp_field == 0 {
            (frac, 0)
        } else {
            (frac | 0x0080_0000, exp_field - 1)
        };
        if sig == 0 {
            return;
        }
        let digit = (shift / 32) as usize;
        let wide = u64::from(sig) << (shift % 32); // < 2^55
        let lo = (wide & 0xffff_ffff) as i64;
        let hi = (wide >> 32) as i64;
        if negative {
            self.limbs[digit] -= lo;
            self.limbs[digit + 1] -= hi;
        } else {
            self.limbs[digit] += lo;
            self.limbs[digit + 1] += hi;
        }
        self.pending += 1;
        if self.pending >= NORMALIZE_EVERY {
            self.normalize();
        }
    }

    /// Propagates carries so that every limb but the last is in `[0, 2^32)`.
    fn normalize(&mut self) {
        for i in 0..LIMBS - 1 {
            let carry = self.limbs[i] >> 32; // arithmetic shift: floor division
            self.limbs[i] -= carry << 32;
            self.limbs[i + 1] += carry;
        }
        self.pending = 0;
    }

    /// The exact sum rounded once to f32, round to nearest, ties to even.
    pub fn to_f32(&self) -> f32 {
        self.round(24, 0)
    }

    /// The exact sum rounded once to bf16 (8 significant bits, subnormal
    /// quantum 2^−133, overflow to ±∞ from the tie above the largest bf16),
    /// round to nearest, ties to even; returned as the f32 holding the bf16
    /// value. For an exact sum that is an f32 value this equals R_BF16 of it.
    pub fn to_bf16(&self) -> f32 {
        self.round(8, 16)
    }

    /// Rounds once to `precision` significant bits with the smallest quantum
    /// 2^(−149 + min_shift) and the f32 exponent range.
    fn round(&self, precision: u32, min_shift: u32) -> f32 {
        if self.nan || (self.pos_inf && self.neg_inf) {
            return f32::NAN;
        }
        if self.pos_inf {
            return f32::INFINITY;
        }
        if self.neg_inf {
            return f32::NEG_INFINITY;
        }
        let mut s = self.clone();
        s.normalize();
        let negative = s.limbs[LIMBS - 1] < 0;
        if negative {
            for l in s.limbs.iter_mut() {
                *l = -*l;
            }
            s.normalize();
        }
        // Now every limb is a digit in [0, 2^32) and the value is Σ d_i 2^(32 i) · 2^−149.
        let magnitude = round_digits(&s.limbs, precision, min_shift);
        f32::from_bits(magnitude | if negative { 0x8000_0000 } else { 0 })
    }
}

/// Bit `i` of the non-negative integer held in `digits` (32-bit digits).
fn bit(digits: &[i64; LIMBS], i: u32) -> bool {
    (digits[(i / 32) as usize] >> (i % 32)) & 1 == 1
}

/// Rounds the non-negative integer `M` (in 32-bit digits) times 2^−149 to
/// `precision` (≤ 24) significant bits, never below the quantum
/// 2^(−149 + min_shift), ties to even, and returns the f32 bits of the result
/// (+∞ on overflow).
fn round_digits(digits: &[i64; LIMBS], precision: u32, min_shift: u32) -> u32 {
    let Some(top) = (0..LIMBS).rev().find(|&i| digits[i] != 0) else {
        return 0; // exact zero: +0
    };
    // Index of the highest set bit of M.
    let t = top as u32 * 32 + (63 - digits[top].leading_zeros());
    // M is kept in multiples of 2^shift: `precision` bits from the top, or the smallest quantum.
    let mut shift = (t + 1).saturating_sub(precision).max(min_shift);
    let mut sig: u32 = 0;
    for i in (shift..=t).rev() {
        sig = (sig << 1) | u32::from(bit(digits, i));
    }
    if shift > 0 {
        let round_bit = bit(digits, shift - 1);
        let sticky = (0..shift - 1).any(|i| bit(digits, i));
        if round_bit && (sticky || sig & 1 == 1) {
            sig += 1;
            if sig == 1 << precision {
                sig = 1 << (precision - 1);
                shift += 1;
            }
        }
    }
    if sig == 0 {
        return 0; // rounded to zero below the smallest quantum
    }
    // value = sig · 2^(shift − 149); as an f32 its biased exponent is b + shift − 23.
    let b = 32 - sig.leading_zeros();
    let biased = b + shift;
    if biased <= 23 {
        // Below 2^−126: an f32 subnormal whose bit pattern is the value / 2^−149.
        return sig << shift;
    }
    let exp_field = biased - 23;
    if exp_field >= 0xff {
        return 0x7f80_0000; // overflow to infinity
    }
    (exp_field << 23) | ((sig << (24 - b)) & 0x007f_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(xs: &[f32]) -> f32 {
        let mut s = ExactSum::new();
        for &x in xs {
            s.add(x);
        }
        s.to_f32()
    }

    #[test]
    fn single_values_round_trip() {
        // Boundary values: zero, smallest subnormal, largest subnormal, smallest
        // normal, one, largest finite.
        for bits in [0u32, 1, 0x007f_ffff, 0x0080_0000, 0x3f80_0000, 0x7f7f_ffff] {
            for sign in [0, 0x8000_0000u32] {
                let x = f32::from_bits(bits | sign);
                let got = sum(&[x]);
                let want = if bits == 0 { 0.0f32 } else { x };
                assert_eq!(got.to_bits(), want.to_bits(), "{:#010x}", bits | sign);
            }
        }
    }

    #[test]
    fn cancellation_is_exact() {
        // 1e30 + 1 − 1e30 = 1 exactly, whatever the order.
        assert_eq!(sum(&[1e30, 1.0, -1e30]), 1.0);
        assert_eq!(sum(&[1e30, -1e30, 1.0]), 1.0);
        // Exact zero is +0.
        assert_eq!(sum(&[-0.0, -0.0]).to_bits(), 0);
        assert_eq!(sum(&[2.5, -2.5]).to_bits(), 0);
    }

    #[test]
    fn ties_to_even_and_overflow() {
        // 1 + 2^-24 is halfway between 1 and 1 + 2^-23: ties to even → 1.
        assert_eq!(sum(&[1.0, f32::from_bits(0x3380_0000)]), 1.0);
        // 1 + 2^-24 + 2^-60 is just above halfway → 1 + 2^-23.
        assert_eq!(
            sum(&[1.0, f32::from_bits(0x3380_0000), f32::from_bits(0x2180_0000)]),
            1.0 + f32::EPSILON
        );
        // MAX + MAX overflows; MAX + half-ulp(MAX) rounds to even (up) → ∞.
        assert_eq!(sum(&[f32::MAX, f32::MAX]), f32::INFINITY);
        assert_eq!(sum(&[f32::MAX, f32::from_bits(0x7300_0000)]), f32::INFINITY);
        assert_eq!(sum(&[-f32::MAX, -f32::MAX]), f32::NEG_INFINITY);
        // MAX + MAX − MAX = MAX exactly (no intermediate overflow).
        assert_eq!(sum(&[f32::MAX, f32::MAX, -f32::MAX]), f32::MAX);
    }

    #[test]
    fn non_finite_policy() {
        assert!(sum(&[1.0, f32::NAN]).is_nan());
        assert!(sum(&[f32::INFINITY, f32::NEG_INFINITY]).is_nan());
        assert_eq!(sum(&[f32::INFINITY, -f32::MAX, -f32::MAX]), f32::INFINITY);
        assert_eq!(sum(&[f32::NEG_INFINITY, 1.0]), f32::NEG_INFINITY);
    }
}
