//! The two precision profiles and the activation rounding point `R_BF16`.
//!
//! In the `bf16` profile, every activation that HF transformers 5.23.0 holds in
//! bf16 (see docs/deepseek-v4-architecture.md §3) is rounded with [`r_bf16`]
//! at the operator boundary where HF rounds it; products and sums inside an
//! operator accumulate in FP32. In the `f32` profile the same code runs with
//! every rounding point the identity. docs/operators.md lists each point.

use moeconf_contract::bf16::r_bf16;

/// Numerical profile of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// BF16 weights and activations, FP32 accumulation (the paper's native runtime; default).
    #[default]
    Bf16,
    /// Everything FP32 (weights as stored, promoted exactly); for FP32 backends.
    F32,
}

impl Precision {
    /// The profile's name as used on the command line (`bf16`, `f32`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::F32 => "f32",
        }
    }

    /// Parses `bf16` or `f32`.
    pub fn from_name(s: &str) -> Option<Precision> {
        match s {
            "bf16" => Some(Precision::Bf16),
            "f32" => Some(Precision::F32),
            _ => None,
        }
    }

    /// An activation rounding point: `R_BF16(x)` in the bf16 profile, `x` in f32.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::Bf16 => r_bf16(x),
            Precision::F32 => x,
        }
    }

    /// [`Precision::round`] over a slice, in place.
    #[inline]
    pub fn round_slice(self, xs: &mut [f32]) {
        if self == Precision::Bf16 {
            for x in xs {
                *x = r_bf16(*x);
            }
        }
    }
}
