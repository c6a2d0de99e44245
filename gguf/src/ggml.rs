//! The ggml tensor types a moeconf GGUF holds, their block layouts and their exact
//! dequantization, transcribed from ggml (llama-cpp-python 0.3.36's vendored
//! `ggml/include/ggml.h` `enum ggml_type`, `ggml/src/ggml-common.h` block structs,
//! `ggml/src/ggml-quants.c` `dequantize_row_*`, `ggml/src/ggml-impl.h`
//! `ggml_e8m0_to_fp32_half`).
//!
//! - `F32`, `F16`, `BF16`, `I32`: one element per "block".
//! - `Q8_0` (id 8): blocks of 32 elements, `{ f16 d; int8 qs[32]; }` (34 bytes); value `d · q`.
//!   Written by llama.cpp's converter for FP8 dense weights; moeconf only reads it.
//! - `MXFP4` (id 39): blocks of 32 elements, `{ uint8 e; uint8 qs[16]; }` (17 bytes); byte `j`
//!   of `qs` holds element `j` in its low nibble and element `j + 16` in its high nibble; a
//!   nibble indexes `kvalues_mxfp4 = {0, 1, 2, 3, 4, 6, 8, 12, 0, −1, −2, −3, −4, −6, −8, −12}`
//!   (twice the E2M1 value) and the value is `kvalues[nibble] · 2^(e − 128)` (the halved
//!   UE8M0 scale: `e < 2` gives the FP32 subnormals 2^−128 and 2^−127). Every product is exact
//!   in FP32, so this equals E2M1(nibble) · 2^(e − 127), the checkpoint's own MXFP4 value.
//!
//! F8_E4M3_B128 (the block-scaled FP8 type of newer llama.cpp) does not exist in this ggml:
//! its type list ends at `GGML_TYPE_Q2_0 = 42` (docs/interop-llamacpp.md §2).

use moeconf_fingerprint::f16_to_f32;

/// Elements per MXFP4 / Q8_0 block (`QK_MXFP4`, `QK8_0`).
pub const QK: usize = 32;

/// ggml's `kvalues_mxfp4`: twice the E2M1 value of each 4-bit code.
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// A ggml tensor type (the subset moeconf writes or reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    /// `GGML_TYPE_F32` (0).
    F32,
    /// `GGML_TYPE_F16` (1).
    F16,
    /// `GGML_TYPE_Q8_0` (8).
    Q8_0,
    /// `GGML_TYPE_I32` (26).
    I32,
    /// `GGML_TYPE_BF16` (30).
    Bf16,
    /// `GGML_TYPE_MXFP4` (39).
    Mxfp4,
}

impl GgmlType {
    /// Every type, for tests and messages.
    pub const ALL: [GgmlType; 6] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q8_0,
        GgmlType::I32,
        GgmlType::Bf16,
        GgmlType::Mxfp4,
    ];

    /// The `enum ggml_type` value stored in a GGUF tensor info.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q8_0 => 8,
            GgmlType::I32 => 26,
            GgmlType::Bf16 => 30,
            GgmlType::Mxfp4 => 39,
        }
    }

    /// The type of an `enum ggml_type` value, if moeconf knows it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    /// ggml's `ggml_type_name`.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::I32 => "i32",
            GgmlType::Bf16 => "bf16",
            GgmlType::Mxfp4 => "mxfp4",
        }
    }

    /// Elements per block (`ggml_blck_size`).
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::Q8_0 | GgmlType::Mxfp4 => QK,
            _ => 1,
        }
    }

    /// Bytes per block (`ggml_type_size`).
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::I32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q8_0 => 2 + QK,
            GgmlType::Mxfp4 => 1 + QK / 2,
        }
    }

    /// Bytes of `n` elements, or `None` if `n` is not a whole number of blocks (or overflows).
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let b = self.block_size() as u64;
        if !n.is_multiple_of(b) {
            return None;
        }
        (n / b).checked_mul(self.block_bytes() as u64)
    }

    /// Whether the type holds real values (everything but `I32`).
    pub fn is_float(self) -> bool {
        self != GgmlType::I32
    }
}

/// ggml's `ggml_e8m0_to_fp32_half`: `2^(e − 128)` as FP32 (`e < 2` are FP32 subnormals).
/// `e = 0xFF` gives +∞ (ggml does not handle the UE8M0 NaN code; the exporter refuses it).
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// Dequantizes `n` elements of type `ty` from `bytes` to FP32, as ggml's `dequantize_row_*`
/// (`I32` elements are converted with `as f32`). Fails if `bytes` does not hold exactly `n`
/// elements.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let want = ty.bytes_for(n as u64).ok_or_else(|| {
        format!(
            "{n} elements are not a whole number of {} blocks of {}",
            ty.name(),
            ty.block_size()
        )
    })?;
    if bytes.len() as u64 != want {
        return Err(format!(
            "{n} {} elements need {want} bytes, got {}",
            ty.name(),
            bytes.len()
        ));
    }
    let mut out = Vec::with_capacity(n);
    match ty {
        GgmlType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        GgmlType::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]]))),
        ),
        GgmlType::Bf16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)),
        ),
        GgmlType::I32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32),
        ),
        GgmlType::Q8_0 => {
            for b in bytes.chunks_exact(ty.block_bytes()) {
                let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                out.extend(b[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
        }
        GgmlType::Mxfp4 => {
            for b in bytes.chunks_exact(ty.block_bytes()) {
                let d = e8m0_to_f32_half(b[0]);
                let qs = &b[1..];
                let mut block = [0.0f32; QK];
                for (j, &q) in qs.iter().enumerate() {
                    block[j] = f32::from(KVALUES_MXFP4[usize::from(q & 0x0F)]) * d;
                    block[j + QK / 2] = f32::from(KVALUES_MXFP4[usize::from(q >> 4)]) * d;
                }
                out.extend_from_slice(&block);
            }
        }
    }
    Ok(out)
}

/// Repacks one row of a DeepSeek MXFP4 tensor into ggml `block_mxfp4`s, moving bits only.
///
/// Source (the released checkpoints' routed experts): `packed` holds `cols / 2` bytes, element
/// `2i` in the low nibble of byte `i` and element `2i + 1` in its high nibble; `scales` holds
/// one UE8M0 exponent per 32 elements. Destination, per block of 32: the scale byte, then 16
/// bytes whose byte `j` holds element `j` (low nibble) and element `j + 16` (high nibble). The
/// 4-bit codes are not remapped: the E2M1 code order is `kvalues_mxfp4`'s order.
pub fn repack_mxfp4_row(packed: &[u8], scales: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
    let cols = packed.len() * 2;
    if !cols.is_multiple_of(QK) {
        return Err(format!("an MXFP4 row of {cols} values is not a multiple of {QK}"));
    }
    if scales.len() != cols / QK {
        return Err(format!(
            "an MXFP4 row of {cols} values needs {} scales, got {}",
            cols / QK,
            scales.len()
        ));
    }
    for (blk, &e) in packed.chunks_exact(QK / 2).zip(scales) {
        if e == 0xFF {
            return Err("UE8M0 scale 0xFF is NaN".to_string());
        }
        let mut codes = [0u8; QK];
        for (i, &byte) in blk.iter().enumerate() {
            codes[2 * i] = byte & 0x0F;
            codes[2 * i + 1] = byte >> 4;
        }
        out.push(e);
        for j in 0..QK / 2 {
            out.push(codes[j] | (codes[j + QK / 2] << 4));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// E2M1 value of a code from its fields (1 sign, 2 exponent bits of bias 1, 1 mantissa bit).
    fn e2m1_fields(code: u8) -> f64 {
        let sign = if code & 0x8 != 0 { -1.0 } else { 1.0 };
        let exp = i32::from((code >> 1) & 0x3);
        let man = f64::from(code & 0x1);
        let mag = if exp == 0 {
            man * 0.5
        } else {
            (1.0 + man / 2.0) * 2f64.powi(exp - 1)
        };
        sign * mag
    }

    #[test]
    fn kvalues_are_twice_the_e2m1_values() {
        for code in 0..16u8 {
            assert_eq!(
                f64::from(KVALUES_MXFP4[code as usize]),
                2.0 * e2m1_fields(code),
                "code {code}"
            );
        }
    }

    #[test]
    fn halved_e8m0_is_two_to_the_e_minus_128_for_every_finite_code() {
        for e in 0..=254u8 {
            let want = 2f64.powi(i32::from(e) - 128);
            assert_eq!(f64::from(e8m0_to_f32_half(e)), want, "e = {e}");
        }
    }

    #[test]
    fn mxfp4_dequantization_is_e2m1_times_the_scale_for_every_code_and_exponent() {
        // One block per exponent, every code in every position across the blocks. Up to
        // e = 252 every product is finite (6 · 2^125 < FP32 max); from 253 on the largest codes
        // overflow to infinity, in ggml as in any FP32 decoder (the loaders refuse such scales).
        for e in 0..=252u8 {
            let mut packed = [0u8; 16];
            for (i, p) in packed.iter_mut().enumerate() {
                *p = ((2 * i) as u8 & 0xF) | ((((2 * i + 1) as u8 + e) & 0xF) << 4);
            }
            let mut block = Vec::new();
            repack_mxfp4_row(&packed, &[e], &mut block).expect("repack");
            let got = dequantize(GgmlType::Mxfp4, &block, QK).expect("dequantize");
            for (k, v) in got.iter().enumerate() {
                let byte = packed[k / 2];
                let code = if k % 2 == 0 { byte & 0xF } else { byte >> 4 };
                let want = e2m1_fields(code) * 2f64.powi(i32::from(e) - 127);
                assert_eq!(f64::from(*v), want, "e {e} element {k}");
            }
        }
    }

    #[test]
    fn repack_refuses_nan_scales_and_ragged_rows() {
        let mut out = Vec::new();
        assert!(repack_mxfp4_row(&[0; 16], &[0xFF], &mut out)
            .unwrap_err()
            .contains("NaN"));
        assert!(repack_mxfp4_row(&[0; 8], &[1], &mut out).is_err());
        assert!(repack_mxfp4_row(&[0; 16], &[1, 2], &mut out).is_err());
    }

    #[test]
    fn q8_0_and_bf16_dequantize_as_ggml() {
        // d = 0.5 (f16 0x3800), q = -128..=-97.
        let mut b = vec![0x00, 0x38];
        b.extend((0..32).map(|i| (-128i32 + i) as i8 as u8));
        let v = dequantize(GgmlType::Q8_0, &b, 32).expect("q8_0");
        assert_eq!(v[0], -64.0);
        assert_eq!(v[31], -48.5);
        let v = dequantize(GgmlType::Bf16, &0x3F80u16.to_le_bytes(), 1).expect("bf16");
        assert_eq!(v, vec![1.0]);
        assert!(dequantize(GgmlType::Q8_0, &b, 31).is_err());
        assert!(dequantize(GgmlType::F32, &[0; 3], 1).is_err());
    }

    #[test]
    fn ids_round_trip() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        assert_eq!(GgmlType::from_id(2), None); // Q4_0: not a moeconf type
        assert_eq!(GgmlType::Mxfp4.bytes_for(64), Some(34));
        assert_eq!(GgmlType::Mxfp4.bytes_for(33), None);
    }
}
