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
}
