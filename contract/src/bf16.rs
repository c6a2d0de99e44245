//! R_BF16: the paper's software round-to-nearest-even conversion f32 → bf16.
//!
//! For a finite f32 with bits `b`, R_BF16 adds the bias `0x7fff + ((b >> 16) & 1)`
//! (the retained least-significant bit) and clears the low 16 bits. This is
//! round-to-nearest, ties-to-even, and does not depend on the host rounding
//! mode. NaN and ±∞ skip the bias and only have their low 16 bits cleared
//! (so a NaN whose payload lives only in the low 16 bits becomes ±∞: the
//! paper's rule, reproduced exactly; see docs/operators.md).
//!
//! The inverse direction (exact widening of a bf16 pattern to f32) is
//! `moeconf_fingerprint::bf16_to_f32`, the one place values are widened.

/// R_BF16 on raw bits: returns the f32 bit pattern of the rounded value
/// (low 16 bits zero).
#[inline]
pub fn r_bf16_bits(bits: u32) -> u32 {
    if bits & 0x7f80_0000 == 0x7f80_0000 {
        // NaN or infinity: no bias.
        bits & 0xffff_0000
    } else {
        let lsb = (bits >> 16) & 1;
        bits.wrapping_add(0x7fff + lsb) & 0xffff_0000
    }
}

/// R_BF16 of an f32, returned as the f32 that holds the bf16 value exactly.
#[inline]
pub fn r_bf16(x: f32) -> f32 {
    f32::from_bits(r_bf16_bits(x.to_bits()))
}

/// R_BF16 to the 16-bit storage pattern.
#[inline]
pub fn to_bf16_bits(x: f32) -> u16 {
    (r_bf16_bits(x.to_bits()) >> 16) as u16
}

/// Rounds every element in place with R_BF16.
pub fn r_bf16_slice(xs: &mut [f32]) {
    for x in xs {
        *x = r_bf16(*x);
    }
}
