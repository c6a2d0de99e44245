//! Element-wise numeric comparison of two payloads of the same record.
//!
//! Tolerance semantics (PyTorch's asymmetric rule, reference = the reference
//! trace): an element passes when `|cand − ref| ≤ atol + rtol·|ref|`.
//! [`NumericSummary::min_atol`] is the smallest `atol` that passes every
//! element with `rtol = 0`; [`NumericSummary::min_rtol`] the smallest `rtol`
//! with `atol = 0`. An element whose two sides differ in NaN-ness can pass no
//! tolerance (both minima are then infinite). Equality is bitwise on the
//! canonical bytes, so `-0` vs `+0` counts as differing with `|Δ| = 0`.
//!
//! Values of opposite sign are counted as sign changes
//! ([`NumericSummary::sign_changes`]) and left out of the ULP distance: on
//! the line of representable floats −1 and +1 are about 2·10⁹ apart, a
//! number that says nothing a sign change does not.
//!
//! Identifier records (token, expert and entry ids) are compared as
//! sequences and sets ([`compare_ids`]), never by magnitude.

use moeconf_fingerprint::catalogue::ValueKind;
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
    #[serde(serialize_with = "ser_f64")]
    pub reference: f64,
    #[serde(serialize_with = "ser_f64")]
    pub candidate: f64,
    /// How many steps of the record's dtype lie between the two values
    /// (distance of their ordered bit patterns; `null` when a side is NaN).
    pub ulps: Option<u64>,
}

/// Summary of the element-wise differences of one record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NumericSummary {
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
    /// Differing elements whose two values have opposite signs (both
    /// non-zero): sign changes, left out of `max_ulp`.
    pub sign_changes: u64,
    /// Largest distance in units in the last place of the dtype (integer
    /// distance for integer dtypes) over the differing elements that keep
    /// their sign; NaN elements and sign changes excluded.
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
        sign_changes: 0,
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
        if r != 0.0 && c != 0.0 && r.is_sign_negative() != c.is_sign_negative() {
            s.sign_changes += 1;
        } else if let (Some(a), Some(b)) = (
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
        let (r, c) = (
            element_value(dtype, reference, i)?,
            element_value(dtype, candidate, i)?,
        );
        let ulps = match (
            element_ordinal(dtype, reference, i),
            element_ordinal(dtype, candidate, i),
        ) {
            (Some(a), Some(b)) if !r.is_nan() && !c.is_nan() => {
                Some(u64::try_from((a - b).unsigned_abs()).unwrap_or(u64::MAX))
            }
            _ => None,
        };
        Some(WorstElement {
            flat_index: i as u64,
            index: unravel(i as u64, shape),
            reference: r,
            candidate: c,
            ulps,
        })
    });
    Some(s)
}

/// At most this many ids of a sequence (and of its entering and leaving
/// sets) are listed in an [`IdComparison`]; the counts are always complete.
pub const MAX_LISTED_IDS: usize = 32;

/// Two identifier records compared as sequences and sets (token ids,
/// expert ids, selected entries): which ids enter, which leave, and whether
/// the same ids only changed order. Never by magnitude: expert 15 is not
/// "15 ulp" away from expert 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IdComparison {
    /// The reference's ids in record order (at most [`MAX_LISTED_IDS`]).
    pub reference: Vec<i64>,
    /// The candidate's ids in record order (at most [`MAX_LISTED_IDS`]).
    pub candidate: Vec<i64>,
    /// How many ids the reference holds.
    pub reference_len: u64,
    /// How many ids the candidate holds.
    pub candidate_len: u64,
    /// Ids the candidate holds more often than the reference (a multiset
    /// difference), in candidate order (at most [`MAX_LISTED_IDS`]).
    pub entering: Vec<i64>,
    /// Ids the reference holds more often than the candidate, in reference
    /// order (at most [`MAX_LISTED_IDS`]).
    pub leaving: Vec<i64>,
    /// How many ids enter.
    pub entering_count: u64,
    /// How many ids leave.
    pub leaving_count: u64,
    /// The same ids (as a multiset) in another order.
    pub reordered: bool,
    /// The first index at which the sequences differ.
    pub first_difference: Option<u64>,
}

/// Compares two id sequences ([`IdComparison`]).
pub fn compare_ids(reference: &[i64], candidate: &[i64]) -> IdComparison {
    use std::collections::HashMap;
    let mut counts: HashMap<i64, i64> = HashMap::new();
    for &x in reference {
        *counts.entry(x).or_default() += 1;
    }
    for &x in candidate {
        *counts.entry(x).or_default() -= 1;
    }
    // Walk each side in order, taking an id while the multiset difference
    // says it is in excess on that side.
    let excess = |side: &[i64], sign: i64| -> Vec<i64> {
        let mut left: HashMap<i64, i64> = counts
            .iter()
            .filter(|(_, &n)| n * sign > 0)
            .map(|(&k, &n)| (k, n * sign))
            .collect();
        side.iter()
            .copied()
            .filter(|x| match left.get_mut(x) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    true
                }
                _ => false,
            })
            .collect()
    };
    let entering = excess(candidate, -1);
    let leaving = excess(reference, 1);
    let first_difference = reference
        .iter()
        .zip(candidate)
        .position(|(a, b)| a != b)
        .or_else(|| (reference.len() != candidate.len()).then(|| reference.len().min(candidate.len())))
        .map(|i| i as u64);
    let listed = |v: &[i64]| v.iter().copied().take(MAX_LISTED_IDS).collect::<Vec<_>>();
    IdComparison {
        reference: listed(reference),
        candidate: listed(candidate),
        reference_len: reference.len() as u64,
        candidate_len: candidate.len() as u64,
        entering_count: entering.len() as u64,
        leaving_count: leaving.len() as u64,
        reordered: entering.is_empty() && leaving.is_empty() && first_difference.is_some(),
        entering: listed(&entering),
        leaving: listed(&leaving),
        first_difference,
    }
}

/// The payload decoded as integers (`None` unless it is an integer tensor).
pub fn int_values(dtype: DType, bytes: &[u8]) -> Option<Vec<i64>> {
    if dtype.is_float() || !bytes.len().is_multiple_of(dtype.size()) {
        return None;
    }
    (0..bytes.len() / dtype.size())
        .map(|i| element_ordinal(dtype, bytes, i).and_then(|v| i64::try_from(v).ok()))
        .collect()
}

/// How two payloads of one record compare, worded by what the record's
/// values mean (the catalogue's `ValueKind`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ValueComparison {
    /// Real values: counts, largest difference, ULPs, sign changes and the
    /// tolerances that would pass.
    Float(NumericSummary),
    /// Identifiers and indices: entering, leaving, reordered.
    Ids(IdComparison),
    /// Counters (lengths, entry counts): both values.
    Counts {
        /// The reference's values (at most [`MAX_LISTED_IDS`]).
        reference: Vec<i64>,
        /// The candidate's values (at most [`MAX_LISTED_IDS`]).
        candidate: Vec<i64>,
    },
    /// UTF-8 text: both lengths and the first differing byte.
    Text {
        /// Bytes of the reference's text.
        reference_bytes: u64,
        /// Bytes of the candidate's text.
        candidate_bytes: u64,
        /// The first byte offset at which they differ.
        first_difference: Option<u64>,
    },
}

/// Compares two payloads of a record whose values are of `kind`: ids as
/// sequences and sets, counters and text by value, anything else (and ids
/// or counters stored in a float dtype) element-wise ([`summarize`]).
/// `None` when nothing can be said (float payloads of different dtype or
/// shape).
pub fn compare_values(
    kind: ValueKind,
    (dtype, shape, reference): (DType, &[u64], &[u8]),
    (cand_dtype, cand_shape, candidate): (DType, &[u64], &[u8]),
) -> Option<ValueComparison> {
    let ints = || Some((int_values(dtype, reference)?, int_values(cand_dtype, candidate)?));
    match kind {
        ValueKind::Ids => {
            if let Some((r, c)) = ints() {
                return Some(ValueComparison::Ids(compare_ids(&r, &c)));
            }
        }
        ValueKind::Count => {
            if let Some((r, c)) = ints() {
                let listed = |v: Vec<i64>| v.into_iter().take(MAX_LISTED_IDS).collect();
                return Some(ValueComparison::Counts {
                    reference: listed(r),
                    candidate: listed(c),
                });
            }
        }
        ValueKind::Text => {
            return Some(ValueComparison::Text {
                reference_bytes: reference.len() as u64,
                candidate_bytes: candidate.len() as u64,
                first_difference: reference
                    .iter()
                    .zip(candidate)
                    .position(|(a, b)| a != b)
                    .or_else(|| {
                        (reference.len() != candidate.len()).then(|| reference.len().min(candidate.len()))
                    })
                    .map(|i| i as u64),
            });
        }
        ValueKind::Float => {}
    }
    summarize(dtype, shape, reference, cand_dtype, cand_shape, candidate).map(ValueComparison::Float)
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
        assert_eq!(w.ulps, Some(1 << 21));
    }

    #[test]
    fn a_worst_element_of_close_values_reads_as_two_values_and_its_ulps() {
        // 64 ulp apart: 7 significant digits print both as -4.017118e0.
        let a = -4.017_118_f32;
        let b = f32::from_bits(a.to_bits() + 64);
        let s = summarize(
            DType::F32,
            &[1],
            &f32_bytes(&[a]),
            DType::F32,
            &[1],
            &f32_bytes(&[b]),
        )
        .unwrap();
        let w = s.worst.as_ref().unwrap();
        assert_eq!(w.ulps, Some(64));
        let mut text = String::new();
        crate::render::numeric_lines_for_test(&mut text, &s);
        let line = text.lines().find(|l| l.contains("worst element")).unwrap();
        assert!(line.contains("(64 ulp apart)"), "{line}");
        let (ra, rb) = (format!("{a:e}"), format!("{b:e}"));
        assert_ne!(ra, rb);
        assert!(
            line.contains(&format!("reference {ra} vs candidate {rb}")),
            "{line}"
        );
        // Each printed value reads back as the same f32.
        assert_eq!(ra.parse::<f32>().unwrap().to_bits(), a.to_bits());
        assert_eq!(rb.parse::<f32>().unwrap().to_bits(), b.to_bits());
    }

    #[test]
    fn sign_changes_are_counted_and_left_out_of_the_ulp_distance() {
        // Element 0 changes sign (-1 -> +1: about 2.1e9 ulp on the float line);
        // element 1 moves 3 ulp; element 2 goes from +0 to a tiny negative (no sign change).
        let tiny = f32::from_bits(0x8000_0001);
        let r = f32_bytes(&[-1.0, 1.0, 0.0]);
        let c = f32_bytes(&[1.0, f32::from_bits(1.0f32.to_bits() + 3), tiny]);
        let s = summarize(DType::F32, &[3], &r, DType::F32, &[3], &c).unwrap();
        assert_eq!((s.differing, s.sign_changes), (3, 1));
        assert_eq!(s.max_ulp, 3);
        assert_eq!(s.max_abs_delta, 2.0);
    }

    #[test]
    fn ids_are_compared_as_sets_and_sequences() {
        let c = compare_ids(&[30, 15, 10, 3, 4, 28], &[30, 15, 10, 3, 4, 19]);
        assert_eq!((c.entering, c.leaving, c.reordered), (vec![19], vec![28], false));
        assert_eq!(c.first_difference, Some(5));
        let c = compare_ids(&[1, 2, 3], &[2, 1, 3]);
        assert!(c.reordered && c.entering.is_empty() && c.leaving.is_empty());
        assert_eq!(c.first_difference, Some(0));
        // A dropped entry: nothing enters, the last leaves.
        let c = compare_ids(&[7, 5, 9], &[7, 5]);
        assert_eq!((c.entering_count, c.leaving, c.reordered), (0, vec![9], false));
        // Duplicates count as a multiset.
        let c = compare_ids(&[4, 4, 2], &[4, 2, 2]);
        assert_eq!((c.entering, c.leaving), (vec![2], vec![4]));
        let i = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let v = compare_values(
            ValueKind::Ids,
            (DType::I32, &[2], &i(&[0, 15])),
            (DType::I32, &[2], &i(&[15, 0])),
        );
        assert!(matches!(
            v,
            Some(ValueComparison::Ids(IdComparison { reordered: true, .. }))
        ));
        let v = compare_values(
            ValueKind::Count,
            (DType::I64, &[1], &3i64.to_le_bytes()),
            (DType::I64, &[1], &4i64.to_le_bytes()),
        );
        assert_eq!(
            v,
            Some(ValueComparison::Counts {
                reference: vec![3],
                candidate: vec![4]
            })
        );
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
