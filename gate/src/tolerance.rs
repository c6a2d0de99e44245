//! Numerical checks of one differing record pair (docs/ci.md, "Tolerance
//! semantics"). Every function reads both payloads in element order and
//! accumulates in f64 in that order, so results are deterministic.
//!
//! Non-finite values are handled first, element by element, by every check:
//! a NaN passes only when both sides are NaN and `equal_nan` is set; an
//! infinity passes only when the other side is the same infinity. Elements
//! that pass this way are left out of the numeric gates; any element that
//! fails it fails the record, whatever the tolerances.

use moeconf_fingerprint::DType;

/// The smallest settings under which the records judged by one rule would
/// have passed (merged over records: the loosest requirement wins).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(tag = "check", rename_all = "snake_case")]
pub enum Minimal {
    /// Element-wise: the `atol` needed at the rule's `rtol`, and the `rtol` needed at its `atol`.
    Elementwise {
        /// The rule's rtol.
        rtol: f64,
        /// Smallest passing atol at that rtol.
        atol_needed: f64,
        /// The rule's atol.
        atol: f64,
        /// Smallest passing rtol at that atol.
        rtol_needed: f64,
    },
    /// Largest ULP distance seen.
    Ulp {
        /// Smallest passing `max_ulp`.
        max_ulp_needed: u64,
    },
    /// Aggregate gates.
    Aggregate {
        /// Largest passing `cosine_min` (the smallest cosine seen).
        cosine_min_needed: f64,
        /// Smallest passing `norm_ratio_tol`.
        norm_ratio_tol_needed: f64,
        /// Smallest passing `nmse_max`.
        nmse_max_needed: f64,
    },
    /// Logit gates.
    Logits {
        /// Largest passing `topk_overlap_min` (the smallest overlap seen).
        topk_overlap_min_needed: f64,
        /// Smallest passing `kl_max` (when full logits were compared).
        kl_max_needed: Option<f64>,
    },
}

impl Minimal {
    /// Merges two requirements of the same kind (the looser one wins).
    pub fn merge(self, o: Minimal) -> Minimal {
        use Minimal::*;
        match (self, o) {
            (
                Elementwise {
                    rtol,
                    atol_needed: a1,
                    atol,
                    rtol_needed: r1,
                },
                Elementwise {
                    atol_needed: a2,
                    rtol_needed: r2,
                    ..
                },
            ) => Elementwise {
                rtol,
                atol_needed: nanmax(a1, a2),
                atol,
                rtol_needed: nanmax(r1, r2),
            },
            (Ulp { max_ulp_needed: a }, Ulp { max_ulp_needed: b }) => Ulp {
                max_ulp_needed: a.max(b),
            },
            (
                Aggregate {
                    cosine_min_needed: c1,
                    norm_ratio_tol_needed: n1,
                    nmse_max_needed: m1,
                },
                Aggregate {
                    cosine_min_needed: c2,
                    norm_ratio_tol_needed: n2,
                    nmse_max_needed: m2,
                },
            ) => Aggregate {
                cosine_min_needed: c1.min(c2),
                norm_ratio_tol_needed: nanmax(n1, n2),
                nmse_max_needed: nanmax(m1, m2),
            },
            (
                Logits {
                    topk_overlap_min_needed: o1,
                    kl_max_needed: k1,
                },
                Logits {
                    topk_overlap_min_needed: o2,
                    kl_max_needed: k2,
                },
            ) => Logits {
                topk_overlap_min_needed: o1.min(o2),
                kl_max_needed: match (k1, k2) {
                    (Some(a), Some(b)) => Some(nanmax(a, b)),
                    (a, b) => a.or(b),
                },
            },
            (a, _) => a,
        }
    }

    /// `atol >= 3.1e-3 (at rtol 1.6e-2) or rtol >= ...`.
    pub fn describe(&self) -> String {
        match *self {
            Minimal::Elementwise {
                rtol,
                atol_needed,
                atol,
                rtol_needed,
            } => format!(
                "atol >= {} (at rtol {}) or rtol >= {} (at atol {})",
                fmt(atol_needed),
                fmt(rtol),
                fmt(rtol_needed),
                fmt(atol)
            ),
            Minimal::Ulp { max_ulp_needed } => format!("max_ulp >= {max_ulp_needed}"),
            Minimal::Aggregate {
                cosine_min_needed,
                norm_ratio_tol_needed,
                nmse_max_needed,
            } => format!(
                "cosine_min <= {}, norm_ratio_tol >= {}, nmse_max >= {}",
                fmt(cosine_min_needed),
                fmt(norm_ratio_tol_needed),
                fmt(nmse_max_needed)
            ),
            Minimal::Logits {
                topk_overlap_min_needed,
                kl_max_needed,
            } => {
                let mut s = format!("topk_overlap_min <= {}", fmt(topk_overlap_min_needed));
                if let Some(k) = kl_max_needed {
                    s.push_str(&format!(", kl_max >= {}", fmt(k)));
                }
                s
            }
        }
    }
}

/// `max` where NaN or +inf (no tolerance passes) dominates.
fn nanmax(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::INFINITY
    } else {
        a.max(b)
    }
}

/// A number for people: `1.234e-3`, `inf` (no finite setting passes).
pub fn fmt(v: f64) -> String {
    if v.is_infinite() || v.is_nan() {
        "inf (no finite setting passes)".into()
    } else if v == 0.0 {
        "0".into()
    } else {
        format!("{v:.3e}")
    }
}

/// The verdict of one check on one record pair.
#[derive(Debug, Clone, PartialEq)]
pub struct Eval {
    /// Whether the record passes.
    pub pass: bool,
    /// Why (measured values against the limits, worst element).
    pub detail: String,
    /// What would have passed.
    pub minimal: Option<Minimal>,
}

impl Eval {
    /// A failure where the two records cannot be compared element by element
    /// (dtype or length mismatch): no tolerance would have passed.
    fn unusable(detail: String) -> Eval {
        Eval {
            pass: false,
            detail,
            minimal: None,
        }
    }
}

/// Element `i` as f64 (the one decoding of trace values, `DType::value_f64`);
/// NaN past the end, which [`element_count`] rules out.
fn value(dtype: DType, bytes: &[u8], i: usize) -> f64 {
    dtype.value_f64(bytes, i).unwrap_or(f64::NAN)
}

/// Element `i`'s position on the line where adjacent representable values
/// are one apart (the diff's definition, so gate and diff agree on ULPs).
fn ordinal(dtype: DType, bytes: &[u8], i: usize) -> i128 {
    moeconf_bisect::element_ordinal(dtype, bytes, i).unwrap_or(0)
}

/// The number of elements of two payloads that can be compared element by
/// element as `dtype` (same length, a whole number of elements).
fn element_count(dtype: DType, r: &[u8], c: &[u8]) -> Result<usize, String> {
    let n = dtype.size();
    if r.len() != c.len() || !r.len().is_multiple_of(n) {
        return Err(format!(
            "payloads of {} and {} bytes cannot be compared element by element as {}",
            r.len(),
            c.len(),
            dtype.name()
        ));
    }
    Ok(r.len() / n)
}

/// The NaN/infinity rule for one element: `Ok(true)` when the element is
/// settled (passes) by it, `Ok(false)` when both values are finite, `Err`
/// with the reason when it fails.
fn nonfinite(r: f64, c: f64, equal_nan: bool) -> Result<bool, String> {
    match (r.is_nan(), c.is_nan()) {
        (true, true) if equal_nan => return Ok(true),
        (true, true) => return Err("both sides NaN and equal_nan is off".into()),
        (true, false) | (false, true) => {
            return Err(format!("NaN on one side (reference {r}, candidate {c})"))
        }
        _ => {}
    }
    if r.is_infinite() || c.is_infinite() {
        return if r == c {
            Ok(true)
        } else {
            Err(format!("infinity mismatch (reference {r}, candidate {c})"))
        };
    }
    Ok(false)
}

/// Element-wise `|c − r| ≤ atol + rtol·|r|` (PyTorch's asymmetric rule, `r` = reference).
pub fn elementwise(dtype: DType, r: &[u8], c: &[u8], rtol: f64, atol: f64, equal_nan: bool) -> Eval {
    let n = match element_count(dtype, r, c) {
        Ok(n) => n,
        Err(e) => return Eval::unusable(e),
    };
    let (mut failing, mut total) = (0u64, 0u64);
    let (mut atol_needed, mut rtol_needed) = (0.0f64, 0.0f64);
    let mut worst: Option<(usize, f64, f64, f64)> = None; // (index, ref, cand, excess over the bound)
    let mut special: Option<String> = None;
    for i in 0..n {
        total += 1;
        let (rv, cv) = (value(dtype, r, i), value(dtype, c, i));
        match nonfinite(rv, cv, equal_nan) {
            Ok(true) => continue,
            Err(e) => {
                failing += 1;
                atol_needed = f64::INFINITY;
                rtol_needed = f64::INFINITY;
                special.get_or_insert(format!("element [{i}]: {e}"));
                continue;
            }
            Ok(false) => {}
        }
        let d = (cv - rv).abs();
        let bound = atol + rtol * rv.abs();
        atol_needed = atol_needed.max(d - rtol * rv.abs());
        let need_r = if d <= atol {
            0.0
        } else if rv == 0.0 {
            f64::INFINITY
        } else {
            (d - atol) / rv.abs()
        };
        rtol_needed = rtol_needed.max(need_r);
        if d > bound {
            failing += 1;
            if worst.is_none_or(|w| d - bound > w.3) {
                worst = Some((i, rv, cv, d - bound));
            }
        }
    }
    let mut detail =
        format!("{failing} of {total} elements outside |cand - ref| <= {atol:e} + {rtol:e}*|ref|");
    if let Some(s) = &special {
        detail.push_str(&format!("; {s}"));
    }
    if let Some((i, rv, cv, _)) = worst {
        detail.push_str(&format!(
            "; worst element [{i}]: reference {rv:e} vs candidate {cv:e}"
        ));
    }
    Eval {
        pass: failing == 0,
        detail,
        minimal: Some(Minimal::Elementwise {
            rtol,
            atol_needed: atol_needed.max(0.0),
            atol,
            rtol_needed,
        }),
    }
}

/// At most `max_ulp` units in the last place per element.
pub fn ulp(dtype: DType, r: &[u8], c: &[u8], max_ulp: u64, equal_nan: bool) -> Eval {
    let n = match element_count(dtype, r, c) {
        Ok(n) => n,
        Err(e) => return Eval::unusable(e),
    };
    let mut worst: (u64, usize) = (0, 0);
    let mut special: Option<String> = None;
    for i in 0..n {
        match nonfinite(value(dtype, r, i), value(dtype, c, i), equal_nan) {
            Ok(true) => continue,
            Err(e) => {
                special.get_or_insert(format!("element [{i}]: {e}"));
                continue;
            }
            Ok(false) => {}
        }
        let u =
            u64::try_from((ordinal(dtype, r, i) - ordinal(dtype, c, i)).unsigned_abs()).unwrap_or(u64::MAX);
        if u > worst.0 {
            worst = (u, i);
        }
    }
    if let Some(s) = special {
        return Eval {
            pass: false,
            detail: s,
            minimal: Some(Minimal::Ulp {
                max_ulp_needed: u64::MAX,
            }),
        };
    }
    Eval {
        pass: worst.0 <= max_ulp,
        detail: format!(
            "max distance {} ulp at element [{}] (limit {max_ulp})",
            worst.0, worst.1
        ),
        minimal: Some(Minimal::Ulp {
            max_ulp_needed: worst.0,
        }),
    }
}

/// The limits of an aggregate check (docs/ci.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AggregateLimits {
    /// Smallest accepted cosine similarity.
    pub cosine_min: f64,
    /// Largest accepted `|‖cand‖/‖ref‖ − 1|`.
    pub norm_ratio_tol: f64,
    /// Largest accepted `‖cand − ref‖² / ‖ref‖²`.
    pub nmse_max: f64,
}

/// Cosine similarity, norm ratio and NMSE of the whole tensor.
pub fn aggregate(dtype: DType, r: &[u8], c: &[u8], limits: AggregateLimits, equal_nan: bool) -> Eval {
    let AggregateLimits {
        cosine_min,
        norm_ratio_tol,
        nmse_max,
    } = limits;
    let n = match element_count(dtype, r, c) {
        Ok(n) => n,
        Err(e) => return Eval::unusable(e),
    };
    let (mut rr, mut cc, mut rc, mut dd) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for i in 0..n {
        let (rv, cv) = (value(dtype, r, i), value(dtype, c, i));
        match nonfinite(rv, cv, equal_nan) {
            Ok(true) => continue,
            Err(e) => {
                return Eval {
                    pass: false,
                    detail: format!("element [{i}]: {e}"),
                    minimal: Some(Minimal::Aggregate {
                        cosine_min_needed: f64::NEG_INFINITY,
                        norm_ratio_tol_needed: f64::INFINITY,
                        nmse_max_needed: f64::INFINITY,
                    }),
                }
            }
            Ok(false) => {}
        }
        rr += rv * rv;
        cc += cv * cv;
        rc += rv * cv;
        dd += (cv - rv) * (cv - rv);
    }
    let (nr, nc) = (rr.sqrt(), cc.sqrt());
    let cosine = if nr == 0.0 && nc == 0.0 {
        1.0
    } else if nr == 0.0 || nc == 0.0 {
        0.0
    } else {
        rc / (nr * nc)
    };
    let ratio_dev = relative(nc, nr, |n, d| (n / d - 1.0).abs());
    let nmse = relative(dd, rr, |n, d| n / d);
    let pass = cosine >= cosine_min && ratio_dev <= norm_ratio_tol && nmse <= nmse_max;
    Eval {
        pass,
        detail: format!(
            "cosine {cosine:.9} (min {cosine_min}), |norm ratio - 1| {ratio_dev:.3e} (max {norm_ratio_tol:e}), \
             NMSE {nmse:.3e} (max {nmse_max:e})"
        ),
        minimal: Some(Minimal::Aggregate {
            cosine_min_needed: cosine,
            norm_ratio_tol_needed: ratio_dev,
            nmse_max_needed: nmse,
        }),
    }
}

/// `f(num, den)` for a non-zero `den`; for a zero `den`, 0 when `num` is
/// zero too (nothing to compare) and infinity otherwise.
fn relative(num: f64, den: f64, f: impl Fn(f64, f64) -> f64) -> f64 {
    match (den == 0.0, num == 0.0) {
        (false, _) => f(num, den),
        (true, true) => 0.0,
        (true, false) => f64::INFINITY,
    }
}

/// Ids of the `k` largest values, descending, ties to the lower id.
pub fn topk(v: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// `|a ∩ b| / k`.
pub fn overlap(a: &[i64], b: &[i64], k: usize) -> f64 {
    if k == 0 {
        return 1.0;
    }
    let common = a
        .iter()
        .take(k)
        .filter(|x| b.iter().take(k).any(|y| y == *x))
        .count();
    common as f64 / k as f64
}

/// KL(softmax(r) ‖ softmax(c)) in nats: log-softmax with the max subtracted,
/// sums in index order in f64, `libm::exp`/`libm::log` (no platform libm).
pub fn kl(r: &[f64], c: &[f64]) -> f64 {
    let lse = |v: &[f64]| {
        let m = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut s = 0.0f64;
        for &x in v {
            s += libm::exp(x - m);
        }
        m + libm::log(s)
    };
    let (lr, lc) = (lse(r), lse(c));
    let mut k = 0.0f64;
    for (&a, &b) in r.iter().zip(c) {
        let (pa, qa) = (a - lr, b - lc);
        k += libm::exp(pa) * (pa - qa);
    }
    k.max(0.0)
}

/// The payload as f64 values (`None` when its length does not fit the dtype).
pub fn decode(dtype: DType, bytes: &[u8]) -> Option<Vec<f64>> {
    if !bytes.len().is_multiple_of(dtype.size()) {
        return None;
    }
    Some(
        (0..bytes.len() / dtype.size())
            .map(|i| value(dtype, bytes, i))
            .collect(),
    )
}

/// The limits of a logits check (docs/ci.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitLimits {
    /// Smallest accepted `|topk(ref) ∩ topk(cand)| / k`.
    pub topk_overlap_min: f64,
    /// k of the overlap (capped at the length of the logits).
    pub topk: usize,
    /// Largest accepted KL(softmax(ref) ‖ softmax(cand)) in nats.
    pub kl_max: f64,
}

/// The argmax of each side, reference first.
pub type ArgmaxPair = (usize, usize);

/// Logit gates on full logits: returns both argmaxes (when the logits could
/// be compared) and the verdict of the overlap and KL gates; the argmax
/// agreement itself is judged by the caller (it may be a near-tie).
pub fn logits(
    dtype: DType,
    r: &[u8],
    c: &[u8],
    limits: LogitLimits,
    equal_nan: bool,
) -> (Option<ArgmaxPair>, Eval) {
    let LogitLimits {
        topk_overlap_min,
        topk: k,
        kl_max,
    } = limits;
    let (Some(rv), Some(cv)) = (decode(dtype, r), decode(dtype, c)) else {
        return (None, Eval::unusable("malformed logits payload".into()));
    };
    if rv.len() != cv.len() || rv.is_empty() {
        return (None, Eval::unusable("logits of different lengths".into()));
    }
    for (i, (&a, &b)) in rv.iter().zip(&cv).enumerate() {
        if let Err(e) = nonfinite(a, b, equal_nan) {
            return (None, Eval::unusable(format!("logit [{i}]: {e}")));
        }
        if a.is_nan() || a.is_infinite() {
            return (None, Eval::unusable(format!("logit [{i}] is {a}: KL undefined")));
        }
    }
    let k = k.min(rv.len());
    let (tr, tc) = (topk(&rv, k), topk(&cv, k));
    let to_i64 = |v: &[usize]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
    let ov = overlap(&to_i64(&tr), &to_i64(&tc), k);
    let d = kl(&rv, &cv);
    (
        Some((tr[0], tc[0])),
        Eval {
            pass: ov >= topk_overlap_min && d <= kl_max,
            detail: format!(
                "top-{k} overlap {ov:.3} (min {topk_overlap_min}), KL {d:.3e} nats (max {kl_max:e}); \
                 argmax reference {} candidate {}",
                tr[0], tc[0]
            ),
            minimal: Some(Minimal::Logits {
                topk_overlap_min_needed: ov,
                kl_max_needed: Some(d),
            }),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn limits(cosine_min: f64, norm_ratio_tol: f64, nmse_max: f64) -> AggregateLimits {
        AggregateLimits {
            cosine_min,
            norm_ratio_tol,
            nmse_max,
        }
    }

    fn logit_limits(topk_overlap_min: f64, topk: usize, kl_max: f64) -> LogitLimits {
        LogitLimits {
            topk_overlap_min,
            topk,
            kl_max,
        }
    }

    #[test]
    fn elementwise_is_asymmetric_and_reports_the_minimal_tolerances() {
        // |Δ| = 0.5 at ref 10 (needs rtol 0.025 at atol 0.25), |Δ| = 0.25 at ref 0 (needs atol 0.25);
        // values exactly representable so the bounds are exact.
        let (r, c) = (b(&[10.0, 0.0, 1.0]), b(&[10.5, 0.25, 1.0]));
        let e = elementwise(DType::F32, &r, &c, 0.0, 0.25, false);
        assert!(!e.pass, "{}", e.detail);
        let Some(Minimal::Elementwise {
            atol_needed,
            rtol_needed,
            ..
        }) = e.minimal
        else {
            panic!()
        };
        assert_eq!(atol_needed, 0.5);
        assert_eq!(rtol_needed, 0.025);
        assert!(elementwise(DType::F32, &r, &c, 0.0, 0.5, false).pass);
        assert!(elementwise(DType::F32, &r, &c, 0.03, 0.25, false).pass);
        // Reference is the base of rtol: swapping sides changes the verdict at the boundary.
        let (r2, c2) = (b(&[1.0]), b(&[2.0]));
        assert!(elementwise(DType::F32, &r2, &c2, 1.0, 0.0, false).pass);
        assert!(!elementwise(DType::F32, &c2, &r2, 0.4, 0.0, false).pass);
    }

    #[test]
    fn nan_and_infinity_rules() {
        let nan = f32::NAN;
        let both = (b(&[nan, 1.0]), b(&[nan, 1.0]));
        assert!(!elementwise(DType::F32, &both.0, &both.1, 1.0, 1.0, false).pass);
        assert!(elementwise(DType::F32, &both.0, &both.1, 1.0, 1.0, true).pass);
        let one = (b(&[nan]), b(&[1.0]));
        assert!(!elementwise(DType::F32, &one.0, &one.1, 1e9, 1e9, true).pass);
        let inf = (b(&[f32::INFINITY]), b(&[f32::NEG_INFINITY]));
        let e = elementwise(DType::F32, &inf.0, &inf.1, 1e9, 1e9, true);
        assert!(!e.pass && e.detail.contains("infinity"), "{}", e.detail);
        let same = (b(&[f32::INFINITY]), b(&[f32::INFINITY]));
        assert!(ulp(DType::F32, &same.0, &same.1, 0, false).pass);
        assert!(!aggregate(DType::F32, &one.0, &one.1, limits(0.0, 1e9, 1e9), true).pass);
        assert!(aggregate(DType::F32, &both.0, &both.1, limits(1.0, 0.0, 0.0), true).pass);
    }

    #[test]
    fn ulp_counts_representable_steps_across_zero() {
        let one_up = f32::from_bits(1.0f32.to_bits() + 3);
        let e = ulp(DType::F32, &b(&[1.0]), &b(&[one_up]), 3, false);
        assert!(e.pass);
        assert!(!ulp(DType::F32, &b(&[1.0]), &b(&[one_up]), 2, false).pass);
        // -0 and +0 are 0 ulp apart; the smallest subnormals either side of zero are 2 apart.
        assert!(ulp(DType::F32, &b(&[-0.0]), &b(&[0.0]), 0, false).pass);
        let (lo, hi) = (f32::from_bits(0x8000_0001), f32::from_bits(1));
        assert_eq!(
            ulp(DType::F32, &b(&[lo]), &b(&[hi]), 0, false).minimal,
            Some(Minimal::Ulp { max_ulp_needed: 2 })
        );
    }

    #[test]
    fn aggregate_gates_catch_scale_and_direction() {
        let r = b(&[1.0, 2.0, 3.0]);
        // 1% larger everywhere: cosine 1, norm ratio deviation 0.01, NMSE 1e-4.
        let c = b(&[1.01, 2.02, 3.03]);
        let e = aggregate(DType::F32, &r, &c, limits(0.999_999, 0.02, 2e-4), false);
        assert!(e.pass, "{}", e.detail);
        assert!(
            !aggregate(DType::F32, &r, &c, limits(0.999_999, 0.005, 2e-4), false).pass,
            "norm ratio catches scale"
        );
        assert!(
            !aggregate(DType::F32, &r, &c, limits(0.999_999, 0.02, 5e-5), false).pass,
            "nmse catches it too"
        );
        // Same norm, other direction: cosine catches it.
        let d = b(&[3.0, 2.0, 1.0]);
        assert!(!aggregate(DType::F32, &r, &d, limits(0.9, 1.0, 10.0), false).pass);
    }

    #[test]
    fn logits_overlap_kl_and_argmax() {
        let r = b(&[1.0, 3.0, 2.0, 0.0]);
        let c = b(&[1.0, 2.0, 3.0, 0.0]);
        let (am, e) = logits(DType::F32, &r, &c, logit_limits(1.0, 2, 10.0), false);
        assert_eq!(am, Some((1, 2)));
        assert!(e.pass, "same top-2 set");
        let (_, e) = logits(DType::F32, &r, &c, logit_limits(1.0, 2, 0.1), false);
        assert!(!e.pass, "KL of the swap is ~0.35 nats: {}", e.detail);
        assert_eq!(kl(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
        // KL of [0, ln 3] vs [0, 0]: p = (1/4, 3/4), q = (1/2, 1/2) -> 1/4 ln(1/2) + 3/4 ln(3/2).
        let want = 0.25 * libm::log(0.5) + 0.75 * libm::log(1.5);
        assert!((kl(&[0.0, libm::log(3.0)], &[0.0, 0.0]) - want).abs() < 1e-12);
        assert_eq!(
            topk(&[1.0, 5.0, 5.0, 2.0], 3),
            vec![1, 2, 3],
            "ties to the lower id"
        );
    }
}
