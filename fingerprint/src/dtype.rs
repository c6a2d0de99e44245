//! Logical element types of trace tensors and their stable wire codes.

use std::fmt;

/// The logical element type of a tensor as stored in a trace.
///
/// The numeric code of each variant is part of the wire format (it is the
/// bincode enum variant index) and of every record digest, so the order of the
/// variants must never change; new types are only appended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum DType {
    /// IEEE 754 binary32, little-endian.
    F32 = 0,
    /// bfloat16 (the upper half of a binary32), little-endian.
    BF16 = 1,
    /// IEEE 754 binary64, little-endian.
    F64 = 2,
    /// Two's-complement 32-bit integer, little-endian (token and expert ids).
    I32 = 3,
    /// Two's-complement 64-bit integer, little-endian.
    I64 = 4,
    /// Unsigned 32-bit integer, little-endian.
    U32 = 5,
    /// Raw bytes (UTF-8 text such as decoded continuations).
    U8 = 6,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::BF16,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::U32,
        DType::U8,
    ];

    /// The stable wire code of this dtype.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The dtype with the given wire code, if any.
    pub fn from_code(code: u32) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::BF16 => 2,
            DType::F64 | DType::I64 => 8,
            DType::U8 => 1,
        }
    }

    /// Whether values of this dtype are floating point (and so canonicalized).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F64)
    }

    /// The lowercase name used in reports and JSON (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U32 => "u32",
            DType::U8 => "u8",
        }
    }

    /// Parses a name produced by [`DType::name`].
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| d.name() == name)
    }
}

/// Exact promotion of a bfloat16 bit pattern to f32 (the upper half of a binary32).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Exact promotion of an IEEE binary16 bit pattern to f32 (no platform
/// conversion; subnormals normalized, NaN payloads kept in the high bits).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: m * 2^-24, normalized into the f32 exponent range.
            let shift = m.leading_zeros() - 21; // places to move the top bit to bit 10
            let m = (m << shift) & 0x3ff;
            sign | ((127 - 15 + 1 - shift) << 23) | (m << 13)
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

impl DType {
    /// Element `i` of a little-endian tensor of this dtype as `f64`
    /// (floats widened exactly, integers converted; `None` past the end).
    /// The one place trace values are decoded for comparison and reports.
    pub fn value_f64(self, bytes: &[u8], i: usize) -> Option<f64> {
        let n = self.size();
        let b = bytes.get(i.checked_mul(n)?..i.checked_mul(n)?.checked_add(n)?)?;
        let w4 = |b: &[u8]| [b[0], b[1], b[2], b[3]];
        let w8 = |b: &[u8]| [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]];
        Some(match self {
            DType::F32 => f64::from(f32::from_le_bytes(w4(b))),
            DType::BF16 => f64::from(bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
            DType::F64 => f64::from_le_bytes(w8(b)),
            DType::I32 => f64::from(i32::from_le_bytes(w4(b))),
            DType::I64 => i64::from_le_bytes(w8(b)) as f64,
            DType::U32 => f64::from(u32::from_le_bytes(w4(b))),
            DType::U8 => f64::from(b[0]),
        })
    }

    /// Element `i` of an integer tensor as `i64` (`None` for float dtypes,
    /// past the end, or a u64-range value that does not fit).
    pub fn value_i64(self, bytes: &[u8], i: usize) -> Option<i64> {
        let n = self.size();
        let b = bytes.get(i.checked_mul(n)?..i.checked_mul(n)?.checked_add(n)?)?;
        Some(match self {
            DType::I32 => i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            DType::I64 => i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            DType::U32 => i64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            DType::U8 => i64::from(b[0]),
            DType::F32 | DType::BF16 | DType::F64 => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_dense() {
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(d.code() as usize, i);
            assert_eq!(DType::from_code(d.code()), Some(*d));
            assert_eq!(DType::from_name(d.name()), Some(*d));
        }
        assert_eq!(DType::from_code(7), None);
    }

    #[test]
    fn f16_widening_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let w = f16_to_f32(h);
            let e = (h >> 10) & 0x1f;
            let m = f64::from(h & 0x3ff);
            let sign = if h >> 15 == 1 { -1.0 } else { 1.0 };
            let want = match e {
                0 => sign * m * 2f64.powi(-24),
                0x1f if m == 0.0 => sign * f64::INFINITY,
                0x1f => {
                    assert!(w.is_nan());
                    continue;
                }
                _ => sign * (1.0 + m / 1024.0) * 2f64.powi(i32::from(e) - 15),
            };
            assert_eq!(f64::from(w), want, "h = {h:#06x}");
            assert_eq!(w.is_sign_negative(), sign < 0.0);
        }
    }

    #[test]
    fn values_decode() {
        let b: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(DType::F32.value_f64(&b, 1), Some(-2.0));
        assert_eq!(DType::F32.value_f64(&b, 2), None);
        assert_eq!(DType::F32.value_f64(&b, usize::MAX), None);
        assert_eq!(DType::BF16.value_f64(&[0xc0, 0x3f], 0), Some(1.5));
        assert_eq!(DType::I32.value_i64(&7i32.to_le_bytes(), 0), Some(7));
        assert_eq!(DType::F32.value_i64(&b, 0), None);
    }
}
