//! Value canonicalization: one NaN per dtype and an optional −0 → +0 fold.
//!
//! Two backends that compute the same values may still produce different
//! bytes: NaN payloads and sign bits are not specified by IEEE 754 arithmetic,
//! and some kernels flush `-0.0` to `+0.0`. Before hashing, every float value
//! is therefore rewritten to a canonical form:
//!
//! | dtype | canonical NaN (hex bits) |
//! |-------|--------------------------|
//! | f32   | `0x7fc0_0000`            |
//! | bf16  | `0x7fc0`                 |
//! | f64   | `0x7ff8_0000_0000_0000`  |
//!
//! Signed zero is preserved unless [`CanonPolicy::fold_negative_zero`] is set,
//! because the sign of zero is observable (`1/x`) and the paper's B-class
//! argument explicitly excludes special signed-zero handling. Infinities are
//! never changed. Integer and byte dtypes are already canonical.

use crate::dtype::DType;

/// Canonical quiet NaN of f32, as bits.
pub const CANONICAL_NAN_F32: u32 = 0x7fc0_0000;
/// Canonical quiet NaN of bf16, as bits.
pub const CANONICAL_NAN_BF16: u16 = 0x7fc0;
/// Canonical quiet NaN of f64, as bits.
pub const CANONICAL_NAN_F64: u64 = 0x7ff8_0000_0000_0000;

/// The canonicalization policy of a trace, recorded in its binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CanonPolicy {
    /// Rewrite `-0.0` to `+0.0` before hashing (off by default).
    pub fold_negative_zero: bool,
}

/// Canonical form of one f32 value given as bits.
#[inline]
pub fn canonical_f32_bits(bits: u32, policy: CanonPolicy) -> u32 {
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        CANONICAL_NAN_F32
    } else if policy.fold_negative_zero && bits == 0x8000_0000 {
        0
    } else {
        bits
    }
}

/// Canonical form of one bf16 value given as bits.
#[inline]
pub fn canonical_bf16_bits(bits: u16, policy: CanonPolicy) -> u16 {
    if bits & 0x7fff > 0x7f80 {
        CANONICAL_NAN_BF16
    } else if policy.fold_negative_zero && bits == 0x8000 {
        0
    } else {
        bits
    }
}

/// Canonical form of one f64 value given as bits.
#[inline]
pub fn canonical_f64_bits(bits: u64, policy: CanonPolicy) -> u64 {
    if bits & 0x7fff_ffff_ffff_ffff > 0x7ff0_0000_0000_0000 {
        CANONICAL_NAN_F64
    } else if policy.fold_negative_zero && bits == 0x8000_0000_0000_0000 {
        0
    } else {
        bits
    }
}

/// Whether `bytes` (little-endian values of `dtype`) are already canonical.
///
/// Written without early exit so that the loops vectorize; this scan is what
/// keeps the canonical fingerprint path close to the speed of raw hashing.
pub fn is_canonical(dtype: DType, bytes: &[u8], policy: CanonPolicy) -> bool {
    let fold = policy.fold_negative_zero;
    match dtype {
        DType::F32 => {
            let mut bad = false;
            for c in bytes.chunks_exact(4) {
                let b = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                let nan = (b & 0x7fff_ffff) > 0x7f80_0000 && b != CANONICAL_NAN_F32;
                bad |= nan | (fold & (b == 0x8000_0000));
            }
            !bad
        }
        DType::BF16 => {
            let mut bad = false;
            for c in bytes.chunks_exact(2) {
                let b = u16::from_le_bytes([c[0], c[1]]);
                let nan = (b & 0x7fff) > 0x7f80 && b != CANONICAL_NAN_BF16;
                bad |= nan | (fold & (b == 0x8000));
            }
            !bad
        }
        DType::F64 => {
            let mut bad = false;
            for c in bytes.chunks_exact(8) {
                let b = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
                let nan = (b & 0x7fff_ffff_ffff_ffff) > 0x7ff0_0000_0000_0000 && b != CANONICAL_NAN_F64;
                bad |= nan | (fold & (b == 0x8000_0000_0000_0000));
            }
            !bad
        }
        DType::I32 | DType::I64 | DType::U32 | DType::U8 => true,
    }
}

/// Fast pre-check used on the hashing hot path: `true` means `bytes` are
/// certainly canonical (no NaN/∞ exponent pattern at all, and no −0 folding
/// requested); `false` means "look closer" with [`is_canonical`].
///
/// The answer is a pure function of the bytes, so the CPU-feature dispatch
/// inside cannot change any digest: it only decides how fast the scan runs.
pub fn surely_canonical(dtype: DType, bytes: &[u8], policy: CanonPolicy) -> bool {
    if policy.fold_negative_zero {
        return false;
    }
    match dtype {
        DType::F32 => match bytemuck::try_cast_slice::<u8, u32>(bytes) {
            Ok(words) => !any_f32_special(words),
            Err(_) => false,
        },
        DType::I32 | DType::I64 | DType::U32 | DType::U8 => true,
        DType::BF16 | DType::F64 => false,
    }
}

/// Whether any word has an all-ones f32 exponent (∞ or NaN), as little-endian words.
fn any_f32_special(words: &[u32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            return unsafe { any_f32_special_avx512(words) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { any_f32_special_avx2(words) };
        }
    }
    any_f32_special_portable(words)
}

/// # Safety
/// The CPU must support AVX-512F (the caller checks).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn any_f32_special_avx512(words: &[u32]) -> bool {
    any_f32_special_portable(words)
}

/// # Safety
/// The CPU must support AVX2 (the caller checks).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn any_f32_special_avx2(words: &[u32]) -> bool {
    any_f32_special_portable(words)
}

#[inline(always)]
fn any_f32_special_portable(words: &[u32]) -> bool {
    // max of the exponent fields: reaches 0x7f80_0000 iff some exponent is
    // all ones. Two vector ops per lane (and, max), no compare in the loop.
    let mut acc = 0u32;
    for &w in words {
        acc = acc.max(u32::from_le(w) & 0x7f80_0000);
    }
    acc == 0x7f80_0000
}

/// Rewrites `bytes` (little-endian values of `dtype`) to canonical form.
pub fn canonicalize_in_place(dtype: DType, bytes: &mut [u8], policy: CanonPolicy) {
    match dtype {
        DType::F32 => {
            for c in bytes.chunks_exact_mut(4) {
                let b = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                c.copy_from_slice(&canonical_f32_bits(b, policy).to_le_bytes());
            }
        }
        DType::BF16 => {
            for c in bytes.chunks_exact_mut(2) {
                let b = u16::from_le_bytes([c[0], c[1]]);
                c.copy_from_slice(&canonical_bf16_bits(b, policy).to_le_bytes());
            }
        }
        DType::F64 => {
            for c in bytes.chunks_exact_mut(8) {
                let b = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
                c.copy_from_slice(&canonical_f64_bits(b, policy).to_le_bytes());
            }
        }
        DType::I32 | DType::I64 | DType::U32 | DType::U8 => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEEP: CanonPolicy = CanonPolicy {
        fold_negative_zero: false,
    };
    const FOLD: CanonPolicy = CanonPolicy {
        fold_negative_zero: true,
    };

    #[test]
    fn f32_table() {
        // (input bits, keep-zero result, fold-zero result)
        let table: [(u32, u32, u32); 9] = [
            (0x7fc0_0000, 0x7fc0_0000, 0x7fc0_0000), // canonical NaN
            (0xffc0_0000, 0x7fc0_0000, 0x7fc0_0000), // negative quiet NaN
            (0x7f80_0001, 0x7fc0_0000, 0x7fc0_0000), // signalling NaN
            (0x7fff_ffff, 0x7fc0_0000, 0x7fc0_0000), // max payload
            (0x7f80_0000, 0x7f80_0000, 0x7f80_0000), // +inf unchanged
            (0xff80_0000, 0xff80_0000, 0xff80_0000), // -inf unchanged
            (0x8000_0000, 0x8000_0000, 0x0000_0000), // -0
            (0x0000_0001, 0x0000_0001, 0x0000_0001), // smallest subnormal
            (0x8000_0001, 0x8000_0001, 0x8000_0001), // negative subnormal
        ];
        for (x, keep, fold) in table {
            assert_eq!(canonical_f32_bits(x, KEEP), keep, "{x:#010x}");
            assert_eq!(canonical_f32_bits(x, FOLD), fold, "{x:#010x}");
        }
    }

    #[test]
    fn bf16_all_patterns_agree_with_definition() {
        for b in 0..=u16::MAX {
            let is_nan = (b & 0x7fff) > 0x7f80;
            let want = if is_nan { 0x7fc0 } else { b };
            assert_eq!(canonical_bf16_bits(b, KEEP), want, "{b:#06x}");
            let mut bytes = b.to_le_bytes();
            assert_eq!(is_canonical(DType::BF16, &bytes, KEEP), want == b);
            canonicalize_in_place(DType::BF16, &mut bytes, KEEP);
            assert_eq!(u16::from_le_bytes(bytes), want);
        }
    }

    #[test]
    fn f64_nan_and_zero() {
        assert_eq!(canonical_f64_bits(0xfff8_0000_0000_0001, KEEP), CANONICAL_NAN_F64);
        assert_eq!(canonical_f64_bits(0x8000_0000_0000_0000, FOLD), 0);
        assert_eq!(
            canonical_f64_bits(0x8000_0000_0000_0000, KEEP),
            0x8000_0000_0000_0000
        );
        assert_eq!(
            canonical_f64_bits(0x7ff0_0000_0000_0000, KEEP),
            0x7ff0_0000_0000_0000
        );
    }

    #[test]
    fn scan_matches_rewrite_for_f32_sample() {
        // A spread of bit patterns including every special class.
        let mut x: u32 = 0x1234_5678;
        for i in 0..200_000u32 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let bits = match i % 7 {
                0 => 0x7f80_0000 | (x & 0x007f_ffff) | (x & 0x8000_0000),
                1 => 0x8000_0000,
                _ => x,
            };
            for p in [KEEP, FOLD] {
                let mut bytes = bits.to_le_bytes();
                let canon = is_canonical(DType::F32, &bytes, p);
                canonicalize_in_place(DType::F32, &mut bytes, p);
                assert_eq!(canon, u32::from_le_bytes(bytes) == bits, "{bits:#010x}");
            }
        }
    }

    #[test]
    fn surely_canonical_never_contradicts_is_canonical() {
        let vals: Vec<u32> = vec![
            0,
            1,
            0x8000_0000,
            0x7f80_0000,
            0x7fc0_0000,
            0xffc0_0000,
            0x3f80_0000,
            0x7f7f_ffff,
        ];
        for v in &vals {
            for w in &vals {
                let bytes: Vec<u8> = [*v, *w, 5, 6].iter().flat_map(|x| x.to_le_bytes()).collect();
                for p in [KEEP, FOLD] {
                    if surely_canonical(DType::F32, &bytes, p) {
                        assert!(is_canonical(DType::F32, &bytes, p), "{v:#x} {w:#x}");
                    }
                }
            }
        }
        let clean: Vec<u8> = (0..1000u32).flat_map(|x| (x * 12345).to_le_bytes()).collect();
        assert!(surely_canonical(DType::F32, &clean, KEEP));
    }

    #[test]
    fn integers_untouched() {
        let mut b = [0xffu8; 16];
        for d in [DType::I32, DType::I64, DType::U32, DType::U8] {
            assert!(is_canonical(d, &b, FOLD));
            canonicalize_in_place(d, &mut b, FOLD);
            assert_eq!(b, [0xff; 16]);
        }
    }
}
