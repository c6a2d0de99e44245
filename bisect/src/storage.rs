//! Storage precision: two records that differ only because one side stored
//! its values at a coarser precision than the other. The coarser side's
//! values are exactly the finer side's rounded with R_BF16 (round to
//! nearest, ties to even; `moeconf_contract::r_bf16_bits`), whether it
//! stores them as bf16 or as bf16-valued f32. Such a pair is classified,
//! not treated as a divergence: its consumers count it as a matching input
//! ("inputs match up to storage precision") and the walk goes on to the
//! first difference that storage precision does not explain.
//!
//! It must also be how the coarser side stores that component: every record
//! of the component on the coarser side holds only bf16 values, and at most
//! half of the finer side's do (`Ctx::is_storage_convention`). A single
//! record rounded to bf16 by a computation fault, or a one-ulp change to a
//! value that is a bf16 value by contract, is therefore a divergence.
//!
//! Only R_BF16 is checked; a side that stored f16 or f32-from-f64 values is
//! not recognised (its differences stay divergences).

use moeconf_contract::bf16::r_bf16_bits;
use moeconf_fingerprint::DType;

/// How two payloads relate when storage precision explains their difference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rounding {
    /// Whether the candidate is the coarser side (else the reference).
    pub candidate_coarser: bool,
    /// Whether the coarser side's dtype is bf16 (else bf16 values in f32).
    pub coarse_dtype_bf16: bool,
    /// Elements compared.
    pub values: u64,
    /// Elements the rounding changed (fine ≠ coarse).
    pub rounded: u64,
}

/// The f32 bit patterns of a float payload (`None` for other dtypes or a
/// length that is not whole elements).
fn f32_bits(dtype: DType, bytes: &[u8]) -> Option<Vec<u32>> {
    match dtype {
        DType::F32 if bytes.len().is_multiple_of(4) => Some(
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        DType::BF16 if bytes.len().is_multiple_of(2) => Some(
            bytes
                .chunks_exact(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)
                .collect(),
        ),
        _ => None,
    }
}

/// Whether every `coarse` value is R_BF16 of the `fine` value at the same
/// index (with `-0` folded to `+0` when the traces' policy folds it), and
/// how many the rounding changed.
fn rounds_to(fine: &[u32], coarse: &[u32], fold_zero: bool) -> Option<u64> {
    let fold = |b: u32| if fold_zero && b == 0x8000_0000 { 0 } else { b };
    let mut changed = 0u64;
    for (&f, &c) in fine.iter().zip(coarse) {
        if fold(r_bf16_bits(f)) != c {
            return None;
        }
        changed += u64::from(f != c);
    }
    Some(changed)
}

/// Classifies the difference of two float payloads of the same shape:
/// `Some` when one side's values are the other's rounded to bf16 (or, with
/// equal values, when only the storage dtype differs). `fold_zero`: the
/// traces fold `-0` to `+0`.
pub(crate) fn classify(
    (rd, rshape, rb): (DType, &[u64], &[u8]),
    (cd, cshape, cb): (DType, &[u64], &[u8]),
    fold_zero: bool,
) -> Option<Rounding> {
    if rshape != cshape {
        return None;
    }
    let (r, c) = (f32_bits(rd, rb)?, f32_bits(cd, cb)?);
    if r.len() != c.len() || r.is_empty() {
        return None;
    }
    let values = r.len() as u64;
    if r == c {
        // Equal values: only the storage dtype differs.
        return match (rd, cd) {
            (DType::BF16, DType::F32) | (DType::F32, DType::BF16) => Some(Rounding {
                candidate_coarser: cd == DType::BF16,
                coarse_dtype_bf16: true,
                values,
                rounded: 0,
            }),
            _ => None,
        };
    }
    if let Some(rounded) = rounds_to(&r, &c, fold_zero) {
        return Some(Rounding {
            candidate_coarser: true,
            coarse_dtype_bf16: cd == DType::BF16,
            values,
            rounded,
        });
    }
    rounds_to(&c, &r, fold_zero).map(|rounded| Rounding {
        candidate_coarser: false,
        coarse_dtype_bf16: rd == DType::BF16,
        values,
        rounded,
    })
}

/// For a real difference where one side holds only bf16 values and the
/// other does not: how many values still differ after R_BF16 of the finer
/// side (`(candidate_coarser, differing, values)`), so the report can say
/// how far beyond storage precision the difference goes.
pub(crate) fn residual(
    (rd, rshape, rb): (DType, &[u64], &[u8]),
    (cd, cshape, cb): (DType, &[u64], &[u8]),
    fold_zero: bool,
) -> Option<(bool, u64, u64)> {
    if rshape != cshape {
        return None;
    }
    let (r, c) = (f32_bits(rd, rb)?, f32_bits(cd, cb)?);
    if r.len() != c.len() {
        return None;
    }
    // A side "holds bf16 values" when its dtype is bf16, or when every value
    // is a bf16 value and at least two are not zero: a lone value, or zeros,
    // are bf16 values by chance (an f32 score that became exactly 0.0).
    let coarse = |d: DType, v: &[u32]| {
        v.iter().all(|&b| r_bf16_bits(b) == b)
            && (d == DType::BF16 || v.iter().filter(|&&b| b & 0x7fff_ffff != 0).count() >= 2)
    };
    let (fine, coarse_side, candidate_coarser) = match (coarse(rd, &r), coarse(cd, &c)) {
        (false, true) => (&r, &c, true),
        (true, false) => (&c, &r, false),
        _ => return None,
    };
    let fold = |b: u32| if fold_zero && b == 0x8000_0000 { 0 } else { b };
    let differing = fine
        .iter()
        .zip(coarse_side.iter())
        .filter(|&(&f, &k)| fold(r_bf16_bits(f)) != k)
        .count() as u64;
    Some((candidate_coarser, differing, r.len() as u64))
}

/// The component a record belongs to (a family member's prefix, `moe.term.`), or its path.
pub(crate) fn component_key(path: &str) -> String {
    match moeconf_fingerprint::Component::parse(path) {
        Some((c, _)) => c.path().to_string(),
        None => path.to_string(),
    }
}

/// How many records of `component` in `t` (with a float payload) hold only
/// bf16 values, and how many have a float payload at all.
pub(crate) fn bf16_valued_records(
    t: &moeconf_schema::Trace,
    component: &str,
) -> Result<(u64, u64), crate::BisectError> {
    let (mut bf16, mut total) = (0u64, 0u64);
    // Every record of the component: the whole index (a version 2 trace
    // reads every group block once for it).
    for (i, e) in t.records()?.iter().enumerate() {
        if component_key(&e.coord.path) != component {
            continue;
        }
        let Some(bits) = t.payload_verified(i)?.and_then(|b| f32_bits(e.dtype, b)) else {
            continue;
        };
        total += 1;
        bf16 += u64::from(bits.iter().all(|&b| r_bf16_bits(b) == b));
    }
    Ok((bf16, total))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32b(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn bf16_rounded_side_is_the_coarser_one() {
        let fine = [1.0f32 + f32::EPSILON, 3.0, -2.0 - 4.0 * f32::EPSILON, 1e-3];
        let coarse: Vec<f32> = fine
            .iter()
            .map(|&x| f32::from_bits(r_bf16_bits(x.to_bits())))
            .collect();
        let (fb, cb) = (f32b(&fine), f32b(&coarse));
        let r = classify((DType::F32, &[4], &fb), (DType::F32, &[4], &cb), false).unwrap();
        assert!(r.candidate_coarser && !r.coarse_dtype_bf16);
        assert_eq!((r.values, r.rounded), (4, 3), "3.0 is bf16-exact");
        let r = classify((DType::F32, &[4], &cb), (DType::F32, &[4], &fb), false).unwrap();
        assert!(!r.candidate_coarser);
        // A bf16 payload of the same values.
        let b16: Vec<u8> = coarse
            .iter()
            .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        let r = classify((DType::F32, &[4], &fb), (DType::BF16, &[4], &b16), false).unwrap();
        assert!(r.candidate_coarser && r.coarse_dtype_bf16);
        let r = classify((DType::F32, &[4], &cb), (DType::BF16, &[4], &b16), false).unwrap();
        assert_eq!(r.rounded, 0, "same values, only the dtype differs");
    }

    #[test]
    fn other_differences_are_not_storage_precision() {
        // Rounded the wrong way (toward zero instead of nearest even).
        let fine = [1.0f32 + 3.0 * f32::EPSILON * 32768.0];
        let trunc = [f32::from_bits(fine[0].to_bits() & 0xffff_0000)];
        assert_ne!(r_bf16_bits(fine[0].to_bits()), trunc[0].to_bits());
        let (fb, tb) = (f32b(&fine), f32b(&trunc));
        assert!(classify((DType::F32, &[1], &fb), (DType::F32, &[1], &tb), false).is_none());
        // Two different bf16-valued payloads.
        let (a, b) = (f32b(&[1.0, 2.0]), f32b(&[1.0, 2.015625]));
        assert!(classify((DType::F32, &[2], &a), (DType::F32, &[2], &b), false).is_none());
        // Shapes differ.
        assert!(classify((DType::F32, &[2], &a), (DType::F32, &[1, 2], &a), false).is_none());
        // Integers are never storage precision.
        assert!(classify((DType::I32, &[2], &a), (DType::I32, &[2], &b), false).is_none());
        // How far beyond: one of two values still differs after rounding.
        let fine = f32b(&[1.0 + f32::EPSILON, 3.0 + 4.0 * f32::EPSILON]);
        let coarse = f32b(&[1.0, 3.015625]);
        assert_eq!(
            residual((DType::F32, &[2], &fine), (DType::F32, &[2], &coarse), false),
            Some((true, 1, 2))
        );
        assert_eq!(
            residual((DType::F32, &[2], &a), (DType::F32, &[2], &b), false),
            None
        );
        // An f32 value that became exactly 0.0 (or any lone value) is no
        // evidence that a side holds bf16 values.
        let (score, zero) = (f32b(&[0.123_456_78]), f32b(&[0.0]));
        assert_eq!(
            residual((DType::F32, &[1], &score), (DType::F32, &[1], &zero), false),
            None
        );
        let (two, zeros) = (f32b(&[0.123_456_78, 1.0 + f32::EPSILON]), f32b(&[0.0, 1.0]));
        assert_eq!(
            residual((DType::F32, &[2], &two), (DType::F32, &[2], &zeros), false),
            None
        );
    }
}
