//! R_BF16 against two independent formulations: an arithmetic one in f64
//! (find the two neighbouring bf16 values, pick the nearest, ties to the even
//! significand) and the `half` crate's `bf16::from_f32` (finite values).
//!
//! The default test covers every f32 exponent/sign/top-7-fraction pattern
//! (all 2^16 high halves) with boundary and pseudo-random low halves. The
//! full 2^32 sweep runs in the default suite (about 40-80 s in --release on
//! two cores; it is the acceptance test, so it is not ignored)
//! (see docs/contracts.md for the measured time).

use moeconf_contract::bf16::{r_bf16, r_bf16_bits, r_bf16_slice, to_bf16_bits};
use moeconf_fingerprint::bf16_to_f32 as from_bf16_bits;
use rayon::prelude::*;

/// R_BF16 computed arithmetically in f64, without bit tricks on the f32
/// (only the f64 exponent is read, to find the binade). Returns f32 bits.
fn reference_r_bf16_bits(x: f32) -> u32 {
    if x.is_nan() {
        // The paper's rule: no rounding bias; sign, exponent and the top 7
        // fraction bits are kept, the low 16 bits cleared (a NaN whose
        // payload lies only in the low 16 bits becomes ±∞).
        let b = x.to_bits();
        return (b & 0x8000_0000) | 0x7f80_0000 | (b & 0x007f_0000);
    }
    if x.is_infinite() {
        return x.to_bits();
    }
    let m = f64::from(x).abs();
    if m == 0.0 {
        return x.to_bits();
    }
    let e = ((m.to_bits() >> 52) & 0x7ff) as i64 - 1023; // floor(log2 m); m is normal in f64
                                                         // bf16 has 8 significant bits; its subnormal quantum is 2^-133.
    let q_exp = e.max(-126) - 7;
    let q = f64::from_bits(((q_exp + 1023) as u64) << 52);
    let n = (m / q).floor(); // exact: q is a power of two
    let lo = n * q;
    let hi = (n + 1.0) * q;
    let r = match (m - lo).partial_cmp(&(hi - m)) {
        Some(std::cmp::Ordering::Less) => lo,
        Some(std::cmp::Ordering::Greater) => hi,
        _ => {
            if n % 2.0 == 0.0 {
                lo
            } else {
                hi
            }
        }
    };
    let magnitude = if r >= 2f64.powi(128) {
        f32::INFINITY
    } else {
        r as f32
    };
    if x < 0.0 {
        (-magnitude).to_bits()
    } else {
        magnitude.to_bits()
    }
}

/// Checks one bit pattern against both formulations; returns a message on failure.
fn check(bits: u32) -> Option<String> {
    let x = f32::from_bits(bits);
    let got = r_bf16_bits(bits);
    let want = reference_r_bf16_bits(x);
    if got != want {
        return Some(format!(
            "r_bf16_bits({bits:#010x}) = {got:#010x}, f64 reference {want:#010x}"
        ));
    }
    if got & 0xffff != 0 || r_bf16(x).to_bits() != got || from_bf16_bits(to_bf16_bits(x)).to_bits() != got {
        return Some(format!("{bits:#010x}: the r_bf16 entry points disagree"));
    }
    if x.is_finite() {
        let h = u32::from(half::bf16::from_f32(x).to_bits()) << 16;
        if h != got {
            return Some(format!("r_bf16_bits({bits:#010x}) = {got:#010x}, half {h:#010x}"));
        }
    }
    None
}

/// Checks every pattern `(high << 16) | low` for the given low halves, in
/// parallel over the high halves; returns the number of failures and the
/// first (lowest) failure message.
fn sweep(lows: &[u32]) -> (u64, Option<String>) {
    let per_high: Vec<(u64, Option<String>)> = (0u32..=0xffff)
        .into_par_iter()
        .map(|high| {
            let mut fails = 0u64;
            let mut first = None;
            for &low in lows {
                if let Some(m) = check((high << 16) | low) {
                    fails += 1;
                    first.get_or_insert(m);
                }
            }
            (fails, first)
        })
        .collect();
    let fails = per_high.iter().map(|p| p.0).sum();
    let first = per_high.into_iter().find_map(|p| p.1);
    (fails, first)
}

/// Hand-checked (input, expected) bit pairs at the rounding boundaries.
#[test]
fn table_of_boundary_cases() {
    let table: &[(u32, u32, &str)] = &[
        (0x0000_0000, 0x0000_0000, "+0"),
        (0x8000_0000, 0x8000_0000, "-0"),
        (0x0000_0001, 0x0000_0000, "smallest subnormal rounds to +0"),
        (
            0x8000_0001,
            0x8000_0000,
            "negative smallest subnormal rounds to -0",
        ),
        (0x0000_8000, 0x0000_0000, "tie at 2^-134, even below"),
        (0x0000_8001, 0x0001_0000, "just above the tie"),
        (0x0001_8000, 0x0002_0000, "tie, odd below: up"),
        (
            0x007f_ffff,
            0x0080_0000,
            "largest subnormal rounds to the smallest normal",
        ),
        (0x3f80_0000, 0x3f80_0000, "1.0"),
        (0x3f80_7fff, 0x3f80_0000, "below the tie"),
        (0x3f80_8000, 0x3f80_0000, "tie, even below: down"),
        (0x3f81_8000, 0x3f82_0000, "tie, odd below: up"),
        (0x3fff_8000, 0x4000_0000, "carry into the exponent"),
        (0x7f7f_7fff, 0x7f7f_0000, "largest value below the overflow tie"),
        (0x7f7f_8000, 0x7f80_0000, "overflow tie rounds to +inf"),
        (0x7f7f_ffff, 0x7f80_0000, "f32::MAX rounds to +inf"),
        (0xff7f_ffff, 0xff80_0000, "-f32::MAX rounds to -inf"),
        (0x7f80_0000, 0x7f80_0000, "+inf"),
        (0xff80_0000, 0xff80_0000, "-inf"),
        (0x7fc0_0000, 0x7fc0_0000, "canonical quiet NaN"),
        (0x7fc0_ffff, 0x7fc0_0000, "NaN: low payload cleared, no bias"),
        (
            0x7f80_0001,
            0x7f80_0000,
            "NaN with payload only in the low 16 bits becomes +inf (paper rule)",
        ),
        (
            0xff80_ffff,
            0xff80_0000,
            "negative NaN with low payload becomes -inf",
        ),
        (0x7fff_ffff, 0x7fff_0000, "NaN: no carry into the sign"),
    ];
    for &(input, expected, why) in table {
        let got = r_bf16_bits(input);
        assert_eq!(
            got, expected,
            "{why}: r_bf16_bits({input:#010x}) = {got:#010x}, expected {expected:#010x}"
        );
        assert_eq!(
            reference_r_bf16_bits(f32::from_bits(input)),
            expected,
            "reference disagrees: {why}"
        );
    }
}

/// Every sign/exponent/top-fraction pattern with the low halves at the
/// rounding boundaries (0, ±1 around the tie 0x8000, the extremes) and eight
/// pseudo-random low halves: 2^16 × 16 ≈ 10^6 patterns.
#[test]
fn stratified_sweep_matches_references() {
    let mut lows = vec![0x0000, 0x0001, 0x7ffe, 0x7fff, 0x8000, 0x8001, 0xfffe, 0xffff];
    let mut state = 0x5eed_u64;
    for _ in 0..8 {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        lows.push(((z ^ (z >> 31)) & 0xffff) as u32);
    }
    let (fails, first) = sweep(&lows);
    assert_eq!(fails, 0, "first failure: {first:?}");
}

/// All 2^32 f32 bit patterns (70–84 s in --release on the 2-core machine; see docs/contracts.md).
#[test]
fn exhaustive_sweep_matches_references() {
    let lows: Vec<u32> = (0u32..=0xffff).collect();
    let (fails, first) = sweep(&lows);
    assert_eq!(fails, 0, "first failure: {first:?}");
}

/// The slice helper rounds every element like the scalar function.
#[test]
fn slice_helper_matches_scalar() {
    let inputs = [
        1.0f32,
        f32::from_bits(0x3f80_8000), // 1 + 2^-8: a tie
        -3.1e-40,
        f32::MAX,
        f32::from_bits(0x7f80_0001),
        -0.0,
    ];
    let mut xs = inputs;
    r_bf16_slice(&mut xs);
    for (x, y) in inputs.iter().zip(xs) {
        assert_eq!(y.to_bits(), r_bf16_bits(x.to_bits()), "{:#010x}", x.to_bits());
    }
}
