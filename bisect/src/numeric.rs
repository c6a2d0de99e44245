//! Element-wise numeric comparison of two payloads of the same record.
//!
//! Tolerance semantics (PyTorch's asymmetric rule, reference = the reference
//! trace): an element passes when `|cand − ref| ≤ atol + rtol·|ref|`.
//! [`NumericSummary::min_atol`] is the smallest `atol` that passes every
//! element with `rtol = 0`; [`NumericSummary::min_rtol`] the smallest `rtol`
//! with `atol = 0`. An element whose two sides differ in NaN-ness can pass no
//! tolerance (both minima are then infinite). Equality is bitwise on the
//! canonical bytes, so `-0` vs `+0` counts as differing with `|Δ| = 0`.

use moeconf_fingerprint::DType;
use serde::Serialize;

/// Serializes an `f64` as a JSON number when finite, otherwise as the string
/// `"inf"`, `"-inf"` or `"nan"` (JSON has no non-finite numbers).
pub(crate) fn ser_f64<S: serde::Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    if v.is_finite() {
        s.serialize_f64(*v)
    } else if v.is_nan() {
        s.serialize_str("nan")
    } else if *v > 0.0 {
        s.serialize_str("inf")
    } else {
        s.serialize_str("-inf")
    }
}

/// The worst element of a comparison: where it is and both values.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorstElement {
    /// Flat (row-major) element index.
    pub flat_index: u64,
    /// Multi-dimensional index in the logical shape.
    pub index: Vec<u64>,
    /// The reference's value.
    #[serde(serialize_with = "ser_f64")]
    pub reference: f64,
    /// The candidate's value.
    #[serde(serialize_with = "ser_f64")]
    pub candidate: f64,
}

/// Summary of the element-wise differences of one record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NumericSummary {
    /// The record's dtype.
    pub dtype: String,
    /// The reference's logical shape.
    pub shape: Vec<u64>,
    /// Total elements compared.
    pub elements: u64,
    /// Elements whose canonical bits differ.
    pub differing: u64,
    /// Differing elements where exactly one side is NaN.
    pub nan_mismatches: u64,
    /// Largest `|cand − ref|` over elements where neither side is NaN.
    #[serde(serialize_with = "ser_f64")]
    pub max_abs_delta: f64,
    /// Largest distance in units in the last place of the dtype (integer
    /// distance for integer dtypes); NaN elements excluded.
    pub max_ulp: u64,
    /// Smallest `atol` (with `rtol = 0`) under which every element passes.
    #[serde(serialize_with = "ser_f64")]
    pub min_atol: f64,
    /// Smallest `rtol` (with `atol = 0`) under which every element passes.
    #[serde(serialize_with = "ser_f64")]
    pub min_rtol: f64,
    /// The element with the largest `|Δ|` (the first differing one on ties,
    /// or the first NaN mismatch when no finite difference exists).
    pub worst: Option<WorstElement>,
}

/// Element `i` of a little-endian tensor as `f64` (integers converted):
/// [`DType::value_f64`]. Shared by the diff summaries and the gate's
/// tolerance checks.
pub fn element_value(dtype: DType, bytes: &[u8], i: usize) -> Option<f64> {
    dtype.value_f64(bytes, i)
}

/// Position of element `i` on a line where adjacent floats are one apart
/// (sign-magnitude bits mapped to a monotone integer); integers as themselves.
/// The ULP distance of two floats is the difference of their ordinals.
pub fn element_ordinal(dtype: DType, bytes: &[u8], i: usize) -> Option<i128> {
    let n = dtype.size();
    let b = bytes.get(i * n..i * n + n)?;
    let sm = |bits: u64, sign: u64| -> i128 {
        if bits & sign != 0 {
            -((bits & !sign) as i128)
        } else {
            bits as i128
        }
    };
    Some(match dtype {
        DType::F32 => sm(u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])), 1 << 31),
        DType::BF16 => sm(u64::from(u16::from_le_bytes([b[0], b[1]])), 1 << 15),
        DType::F64 => sm(
            u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            1 << 63,
        ),
        DType::I32 => i128::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::I64 => i128::from(i64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ])),
        DType::U32 => i128::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::U8 => i128::from(b[0]),
    })
}

/// Row-major multi-index of flat index `flat` in `shape`.
pub fn unravel(mut flat: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0u64; shape.len()];
    for (d, &s) in shape.iter().enumerate().rev() {
        if s == 0 {
            return idx;
        }
        idx[d] = flat % s;
        flat /= s;
    }
    idx
}

/// Compares two payloads of the same dtype and shape element by element.
/// Returns `None` when the dtypes or shapes differ or a payload is shorter
/// than its shape says (nothing element-wise can be said then).
pub fn summarize(
    dtype: DType,
    shape: &[u64],
    reference: &[u8],
    cand_dtype: DType,
    cand_shape: &[u64],
    candidate: &[u8],
) -> Option<NumericSummary> {
    if dtype != cand_dtype || shape != cand_shape || reference.len() != candidate.len() {
        return None;
    }
    let size = dtype.size();
    if reference.len().checked_rem(size) != Some(0) {
        return None;
    }
    let n = reference.len() / size;
    let mut s = NumericSummary {
        dtype: dtype.name().to_string(),
        shape: shape.to_vec(),
        elements: n as u64,
        differing: 0,
        nan_mismatches: 0,
        max_abs_delta: 0.0,
        max_ulp: 0,
        min_atol: 0.0,
        min_rtol: 0.0,
        worst: None,
    };
    let mut worst: Option<(usize, f64)> = None;
    let mut first_nan: Option<usize> = None;
    for i in 0..n {
        let (rb, cb) = (
            &reference[i * size..(i + 1) * size],
            &candidate[i * size..(i + 1) * size],
        );
        if rb == cb {
            continue;
        }
        s.differing += 1;
        let (Some(r), Some(c)) = (
            element_value(dtype, reference, i),
            element_value(dtype, candidate, i),
        ) else {
            continue;
        };
        if r.is_nan() || c.is_nan() {
            // Canonical NaNs are bitwise equal, so exactly one side is NaN here.
            s.nan_mismatches += 1;
            first_nan.get_or_insert(i);
            continue;
        }
        let delta = (c - r).abs();
        if let (Some(a), Some(b)) = (
            element_ordinal(dtype, reference, i),
            element_ordinal(dtype, candidate, i),
        ) {
            let u = (a - b).unsigned_abs();
            s.max_ulp = s.max_ulp.max(u64::try_from(u).unwrap_or(u64::MAX));
        }
        let rtol = if delta == 0.0 {
            0.0
        } else if r == 0.0 {
            f64::INFINITY
        } else {
            delta / r.abs()
        };
        // NaN deltas (inf − inf of equal sign cannot occur: equal bits) are excluded above.
        if delta > s.max_abs_delta || (delta.is_infinite() && !s.max_abs_delta.is_infinite()) {
            s.max_abs_delta = delta;
        }
        if worst.is_none_or(|(_, d)| delta > d) {
            worst = Some((i, delta));
        }
        s.min_rtol = s.min_rtol.max(rtol);
    }
    s.min_atol = s.max_abs_delta;
    if s.nan_mismatches > 0 {
        s.min_atol = f64::INFINITY;
        s.min_rtol = f64::INFINITY;
    }
    let worst_index = worst.map(|(i, _)| i).or(first_nan);
    s.worst = worst_index.and_then(|i| {
        Some(WorstElement {
            flat_index: i as u64,
            index: unravel(i as u64, shape),
            reference: element_value(dtype, reference, i)?,
            candidate: element_value(dtype, candidate, i)?,
        })
    });
    Some(s)
}

/// The payload decoded as `f32` values (`None` unless it is an f32 tensor).
pub fn f32_values(dtype: DType, bytes: &[u8]) -> Option<Vec<f32>> {
    words(DType::F32, dtype, bytes, f32::from_le_bytes)
}

/// The payload decoded as `i32` values (`None` unless it is an i32 tensor).
pub fn i32_values(dtype: DType, bytes: &[u8]) -> Option<Vec<i32>> {
    words(DType::I32, dtype, bytes, i32::from_le_bytes)
}

/// A payload of 4-byte little-endian elements decoded with `decode`, when
/// its dtype is `want` and its length a whole number of elements.
fn words<T>(want: DType, dtype: DType, bytes: &[u8], decode: fn([u8; 4]) -> T) -> Option<Vec<T>> {
    if dtype != want || !bytes.chunks_exact(4).remainder().is_empty() {
        return None;
    }
    Some(
        bytes
            .chunks_exact(4)
            .map(|c| decode([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn tolerances_ulps_and_worst_element() {
        // Element 1: one ulp above 1.0 (2^-23); element 2: 2.0 vs 2.5 (|Δ| 0.5, rtol 0.25).
        let r = f32_bytes(&[0.5, 1.0, 2.0, -0.0]);
        let c = f32_bytes(&[0.5, f32::from_bits(1.0f32.to_bits() + 1), 2.5, 0.0]);
        let s = summarize(DType::F32, &[2, 2], &r, DType::F32, &[2, 2], &c).unwrap();
        assert_eq!(s.elements, 4);
        assert_eq!(s.differing, 3, "signed zero differs bitwise");
        assert_eq!(s.max_abs_delta, 0.5);
        assert_eq!(s.min_atol, 0.5);
        assert_eq!(s.min_rtol, 0.25);
        // 2.0 -> 2.5: ulp(2) = 2^-22, so 0.5 is 2^21 ulps; -0 -> +0 is 0 on the ordinal line.
        assert_eq!(s.max_ulp, 1 << 21);
        let w = s.worst.unwrap();
        assert_eq!((w.flat_index, w.index.clone()), (2, vec![1, 0]));
        assert_eq!((w.reference, w.candidate), (2.0, 2.5));
    }

    #[test]
    fn nan_mismatch_passes_no_tolerance_and_zero_reference_needs_infinite_rtol() {
        let r = f32_bytes(&[0.0, 1.0]);
        let c = f32_bytes(&[1e-30, f32::from_bits(0x7fc0_0000)]);
        let s = summarize(DType::F32, &[2], &r, DType::F32, &[2], &c).unwrap();
        assert_eq!(s.nan_mismatches, 1);
        assert!(s.min_atol.is_infinite() && s.min_rtol.is_infinite());
        assert_eq!(s.worst.unwrap().flat_index, 0);
        assert!(summarize(DType::F32, &[2], &r, DType::F32, &[1, 2], &c).is_none());
    }
}
