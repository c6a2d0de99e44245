//! What the grammar cannot name: a combine output read as a linear
//! combination of its own routed terms and shared-expert output.
//!
//! Scaling bugs of serving engines (the routed scaling factor applied twice,
//! the shared expert scaled, a term dropped or counted twice, a gate applied
//! before or after a rounding) fall outside the contract grammar, which only
//! varies precisions, shapes and orders: no member reproduces such an output,
//! and "256 of 256 values differ" says nothing about why. [`fit_event`] fits
//! `y ≈ Σ_j a_j·v_j + b·s` by least squares (FP64, per event), snaps each
//! coefficient to a short binary fraction (multiples of 1/64) when it is that
//! close, and then checks the snapped reading bitwise: it evaluates
//! `y' = R_out(Σ_j a_j ∘ v_j + b·s)` in FP32 in slot order, with the scale
//! applied after the term's BF16 rounding, before it, or to the unrounded
//! term, and keeps the reading that reproduces the most values. The result
//! is a reading, not a member: its residual (values not reproduced, largest
//! distance in units in the last place of the output format) says how
//! literally to take it.

use crate::bf16::r_bf16;

/// A coefficient this close to zero (relative to 1) reads as a dropped term.
const ZERO_BELOW: f64 = 1.0 / 128.0;
/// Coefficients are snapped to multiples of 1/SNAP_DENOMINATOR ...
const SNAP_DENOMINATOR: f64 = 64.0;
/// ... when the fitted value is within this relative distance of one.
const SNAP_TOLERANCE: f64 = 0.02;

/// Where a term's coefficient is applied relative to the term's rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalePlacement {
    /// `a · R_BF16(v)`: the term rounded to BF16 first, then scaled (FP32 product).
    AfterRounding,
    /// `R_BF16(a · v)`: the term scaled first, then rounded to BF16.
    BeforeRounding,
    /// `a · v`: the FP32 term, never rounded.
    Unrounded,
}

impl ScalePlacement {
    const ALL: [ScalePlacement; 3] = [
        ScalePlacement::AfterRounding,
        ScalePlacement::BeforeRounding,
        ScalePlacement::Unrounded,
    ];

    /// In words, for reports.
    pub fn words(self) -> &'static str {
        match self {
            ScalePlacement::AfterRounding => "each term rounded to BF16, then scaled",
            ScalePlacement::BeforeRounding => "each term scaled, then rounded to BF16",
            ScalePlacement::Unrounded => "FP32 terms, never rounded",
        }
    }

    #[inline]
    fn apply(self, a: f32, v: f32) -> f32 {
        match self {
            ScalePlacement::AfterRounding => a * r_bf16(v),
            ScalePlacement::BeforeRounding => r_bf16(a * v),
            ScalePlacement::Unrounded => a * v,
        }
    }
}

/// One fitted coefficient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Coefficient {
    /// The least-squares value (`None` when the data cannot determine it:
    /// an all-zero term, or one proportional to another).
    pub fitted: Option<f64>,
    /// The value the bitwise check used: the snapped one, else the fitted one
    /// in FP32 (1 when undetermined).
    pub used: f32,
}

impl Coefficient {
    /// Whether the coefficient reads as 1 (unchanged).
    pub fn is_one(&self) -> bool {
        self.used == 1.0
    }
}

/// The reading of one combine output as scaled terms and shared output.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// One coefficient per routed term, in slot order.
    pub terms: Vec<Coefficient>,
    /// The shared-expert output's coefficient.
    pub shared: Coefficient,
    /// Where the routed coefficients sit relative to the term's rounding.
    pub placement: ScalePlacement,
    /// Whether the check rounded the output to BF16 (the observed output is
    /// BF16-valued) or kept FP32.
    pub output_bf16: bool,
    /// Output values the reading does not reproduce bitwise.
    pub differing: usize,
    /// Output values compared.
    pub elements: usize,
    /// The largest distance between a computed and an observed value, in
    /// units in the last place of the output format (`None` when a NaN is
    /// involved).
    pub max_ulps: Option<u64>,
}

impl Fit {
    /// Whether every routed coefficient is 1 and the shared one too: the
    /// reading changes nothing, so it explains nothing the grammar missed.
    pub fn is_identity(&self) -> bool {
        self.shared.is_one() && self.terms.iter().all(Coefficient::is_one)
    }

    /// The routed terms' common coefficient, when they all share one.
    pub fn common_routed(&self) -> Option<f32> {
        let first = self.terms.first()?.used;
        self.terms.iter().all(|c| c.used == first).then_some(first)
    }

    /// What differs from an unscaled combine, in words: `routed terms × 1.5`,
    /// `shared expert × 1.5`, `term 3 dropped (× 0)`, `term 2 counted twice (× 2)`.
    pub fn changes(&self) -> Vec<String> {
        let mut out = Vec::new();
        match self.common_routed() {
            Some(a) if a != 1.0 => out.push(format!("routed terms × {}", coefficient_words(a))),
            Some(_) => {}
            None => {
                for (j, c) in self.terms.iter().enumerate() {
                    match c.used {
                        1.0 => {}
                        0.0 => out.push(format!("term {j} dropped (× 0)")),
                        2.0 => out.push(format!("term {j} counted twice (× 2)")),
                        a => out.push(format!("term {j} × {}", coefficient_words(a))),
                    }
                }
            }
        }
        if !self.shared.is_one() {
            out.push(match self.shared.used {
                0.0 => "shared expert dropped (× 0)".to_string(),
                a => format!("shared expert × {}", coefficient_words(a)),
            });
        }
        out
    }

    /// One line: `routed terms × 1.5 (each term rounded to BF16, then
    /// scaled; FP32 sum, BF16 output): 256 of 256 values reproduced`.
    pub fn summary(&self) -> String {
        let changes = self.changes();
        let what = if changes.is_empty() {
            "no scale differs from 1".to_string()
        } else {
            changes.join(", ")
        };
        let out = if self.output_bf16 { "BF16" } else { "FP32" };
        let residual = match (self.differing, self.max_ulps) {
            (0, _) => format!("{} of {} values reproduced bitwise", self.elements, self.elements),
            (n, Some(u)) => format!(
                "{} of {} values reproduced bitwise, the other {n} within {u} ulp",
                self.elements - n,
                self.elements
            ),
            (n, None) => format!(
                "{} of {} values reproduced bitwise ({n} involve NaN)",
                self.elements - n,
                self.elements
            ),
        };
        let terms = match (self.common_routed(), self.placement) {
            (Some(1.0), ScalePlacement::AfterRounding | ScalePlacement::BeforeRounding) => {
                "each term rounded to BF16"
            }
            (Some(1.0), ScalePlacement::Unrounded) => "FP32 terms",
            _ => self.placement.words(),
        };
        format!("{what} ({terms}; FP32 sum in slot order, shared last, {out} output): {residual}")
    }
}

/// `1.5`, `0.5`, `0.6667`: exact short fractions as they are, others to 4 significant digits.
pub fn coefficient_words(a: f32) -> String {
    let snapped = (f64::from(a) * SNAP_DENOMINATOR).round() / SNAP_DENOMINATOR;
    if snapped == f64::from(a) {
        format!("{a}")
    } else {
        format!("{a:.4}")
    }
}

/// The distance of two values in units in the last place of BF16 (`bf16`)
/// or FP32, on the ordered line of the format (`None` if either is NaN).
pub fn ulp_distance(a: f32, b: f32, bf16: bool) -> Option<u64> {
    if a.is_nan() || b.is_nan() {
        return None;
    }
    let ord = |x: f32| -> i64 {
        let bits = x.to_bits();
        let mag = i64::from(bits & 0x7fff_ffff);
        let v = if bits >> 31 == 1 { -mag } else { mag };
        if bf16 {
            v >> 16
        } else {
            v
        }
    };
    Some((ord(a) - ord(b)).unsigned_abs())
}

/// Solves the (n×n) system `m·x = r` by Gaussian elimination with partial
/// pivoting; an unknown whose pivot vanishes (relative to the matrix's scale)
/// is undetermined (`None`) and held at 0 for the others.
fn solve(mut m: Vec<Vec<f64>>, mut r: Vec<f64>) -> Vec<Option<f64>> {
    let n = r.len();
    let scale = m
        .iter()
        .flatten()
        .fold(0.0f64, |a, &x| a.max(x.abs()))
        .max(f64::MIN_POSITIVE);
    let mut pivot_of = vec![None; n];
    let mut row = 0;
    for col in 0..n {
        let Some(p) = (row..n).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs())) else {
            break;
        };
        if m[p][col].abs() <= scale * 1e-12 {
            continue;
        }
        m.swap(row, p);
        r.swap(row, p);
        let (pivot_row, pivot_r) = (m[row].clone(), r[row]);
        for (i, (mi, ri)) in m.iter_mut().zip(r.iter_mut()).enumerate() {
            let f = mi[col] / pivot_row[col];
            if i != row && f != 0.0 {
                for (x, p) in mi[col..].iter_mut().zip(&pivot_row[col..]) {
                    *x -= f * p;
                }
                *ri -= f * pivot_r;
            }
        }
        pivot_of[col] = Some(row);
        row += 1;
    }
    pivot_of
        .iter()
        .enumerate()
        .map(|(col, p)| p.map(|row| r[row] / m[row][col]).filter(|x| x.is_finite()))
        .collect()
}

/// The least-squares coefficients of `y ≈ Σ_j a_j·v_j + b·s` over the
/// elements where every value is finite (slot order, `b` last).
fn least_squares(terms: &[&[f32]], shared: &[f32], output: &[f32]) -> Vec<Option<f64>> {
    let n = terms.len() + 1;
    let col = |c: usize, e: usize| -> f64 {
        match terms.get(c) {
            Some(t) => f64::from(t[e]),
            None => f64::from(shared[e]),
        }
    };
    let mut m = vec![vec![0.0f64; n]; n];
    let mut r = vec![0.0f64; n];
    for (e, &y) in output.iter().enumerate() {
        let row: Vec<f64> = (0..n).map(|c| col(c, e)).collect();
        if !y.is_finite() || row.iter().any(|x| !x.is_finite()) {
            continue;
        }
        for ((ma, ra), &x) in m.iter_mut().zip(r.iter_mut()).zip(&row) {
            *ra += x * f64::from(y);
            for (mab, &xb) in ma.iter_mut().zip(&row) {
                *mab += x * xb;
            }
        }
    }
    solve(m, r)
}

/// The value a fitted coefficient is checked with: 0 near zero, else the
/// nearest multiple of 1/64 when that is close, else the fitted value.
fn snap(c: Option<f64>) -> f32 {
    let Some(c) = c else { return 1.0 };
    if c.abs() < ZERO_BELOW {
        return 0.0;
    }
    let q = (c * SNAP_DENOMINATOR).round() / SNAP_DENOMINATOR;
    if (q - c).abs() <= SNAP_TOLERANCE * c.abs().max(1.0) {
        q as f32
    } else {
        c as f32
    }
}

/// Evaluates one reading at every element: (values not reproduced, max ulps).
fn check(
    terms: &[&[f32]],
    shared: &[f32],
    output: &[f32],
    coef: &[f32],
    placement: ScalePlacement,
    output_bf16: bool,
    canon: &dyn Fn(u32) -> u32,
) -> (usize, Option<u64>) {
    let k = terms.len();
    let (mut differing, mut max_ulps) = (0usize, Some(0u64));
    for e in 0..output.len() {
        let mut acc = 0.0f32;
        for (j, t) in terms.iter().enumerate() {
            acc += placement.apply(coef[j], t[e]);
        }
        acc += coef[k] * shared[e];
        let y = if output_bf16 { r_bf16(acc) } else { acc };
        if canon(y.to_bits()) != output[e].to_bits() {
            differing += 1;
            max_ulps = match (max_ulps, ulp_distance(y, output[e], output_bf16)) {
                (Some(m), Some(u)) => Some(m.max(u)),
                _ => None,
            };
        }
    }
    (differing, max_ulps)
}

/// Reads one combine output as scaled terms and shared output (see the
/// module docs). `canon` maps a computed value's bits to the bits the trace
/// would hold (its NaN canonicalization). `None` when there is nothing to
/// fit (no elements, or lengths that disagree).
pub fn fit_event(
    terms: &[&[f32]],
    shared: &[f32],
    output: &[f32],
    canon: &dyn Fn(u32) -> u32,
) -> Option<Fit> {
    let d = output.len();
    if d == 0 || shared.len() != d || terms.iter().any(|t| t.len() != d) {
        return None;
    }
    let output_bf16 = output.iter().all(|&y| r_bf16(y).to_bits() == y.to_bits());
    let fitted = least_squares(terms, shared, output);
    let k = terms.len();
    let used: Vec<f32> = fitted.iter().map(|&c| snap(c)).collect();
    let mut best: Option<(usize, Option<u64>, ScalePlacement)> = None;
    for placement in ScalePlacement::ALL {
        let (n, u) = check(terms, shared, output, &used, placement, output_bf16, canon);
        let better = match best {
            None => true,
            Some((bn, bu, _)) => n < bn || (n == bn && u.unwrap_or(u64::MAX) < bu.unwrap_or(u64::MAX)),
        };
        if better {
            best = Some((n, u, placement));
        }
    }
    let (differing, max_ulps, placement) = best?;
    let coefficient = |c: usize| Coefficient {
        fitted: fitted[c],
        used: used[c],
    };
    Some(Fit {
        terms: (0..k).map(coefficient).collect(),
        shared: coefficient(k),
        placement,
        output_bf16,
        differing,
        elements: d,
        max_ulps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random terms (BF16-valued) and shared output.
    fn data(k: usize, d: usize) -> (Vec<Vec<f32>>, Vec<f32>) {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            r_bf16(((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.37)
        };
        let terms = (0..k).map(|_| (0..d).map(|_| next()).collect()).collect();
        let shared = (0..d).map(|_| next()).collect();
        (terms, shared)
    }

    fn combine(terms: &[Vec<f32>], shared: &[f32], a: &[f32], b: f32) -> Vec<f32> {
        (0..shared.len())
            .map(|e| {
                let mut acc = 0.0f32;
                for (j, t) in terms.iter().enumerate() {
                    acc += a[j] * r_bf16(t[e]);
                }
                r_bf16(acc + b * shared[e])
            })
            .collect()
    }

    fn fit(terms: &[Vec<f32>], shared: &[f32], y: &[f32]) -> Fit {
        let refs: Vec<&[f32]> = terms.iter().map(|t| t.as_slice()).collect();
        fit_event(&refs, shared, y, &|b| b).unwrap()
    }

    #[test]
    fn a_scaled_shared_expert_is_read_exactly() {
        let (terms, shared) = data(6, 256);
        let y = combine(&terms, &shared, &[1.0; 6], 1.5);
        let f = fit(&terms, &shared, &y);
        assert_eq!(f.shared.used, 1.5);
        assert_eq!(f.common_routed(), Some(1.0));
        assert_eq!(f.differing, 0, "{}", f.summary());
        assert_eq!(f.changes(), vec!["shared expert × 1.5".to_string()]);
    }

    #[test]
    fn a_dropped_and_a_doubled_term_are_named() {
        let (terms, shared) = data(6, 256);
        let y = combine(&terms, &shared, &[1.0, 1.0, 0.0, 1.0, 2.0, 1.0], 1.0);
        let f = fit(&terms, &shared, &y);
        assert_eq!(f.differing, 0, "{}", f.summary());
        assert_eq!(
            f.changes(),
            vec![
                "term 2 dropped (× 0)".to_string(),
                "term 4 counted twice (× 2)".to_string()
            ]
        );
    }

    #[test]
    fn scaling_before_the_terms_rounding_is_told_from_after() {
        let (terms, shared) = data(6, 256);
        let y: Vec<f32> = (0..256)
            .map(|e| {
                let mut acc = 0.0f32;
                for t in &terms {
                    acc += r_bf16(1.5 * t[e]);
                }
                r_bf16(acc + shared[e])
            })
            .collect();
        let f = fit(&terms, &shared, &y);
        assert_eq!(f.common_routed(), Some(1.5));
        assert_eq!(f.placement, ScalePlacement::BeforeRounding, "{}", f.summary());
        assert_eq!(f.differing, 0);
    }

    #[test]
    fn an_unscaled_combine_reads_as_the_identity() {
        let (terms, shared) = data(6, 64);
        let y = combine(&terms, &shared, &[1.0; 6], 1.0);
        let f = fit(&terms, &shared, &y);
        assert!(f.is_identity());
        assert!(f.changes().is_empty());
    }

    #[test]
    fn an_all_zero_term_is_undetermined_not_a_crash() {
        let (mut terms, shared) = data(3, 32);
        terms[1] = vec![0.0; 32];
        let y = combine(&terms, &shared, &[1.0; 3], 1.0);
        let f = fit(&terms, &shared, &y);
        assert_eq!(f.terms[1].fitted, None);
        assert_eq!(f.differing, 0);
        assert!(fit_event(&[], &[], &[], &|b| b).is_none());
    }

    #[test]
    fn ulps_are_counted_in_the_output_format() {
        assert_eq!(
            ulp_distance(1.0, f32::from_bits(1.0f32.to_bits() + (3 << 16)), true),
            Some(3)
        );
        assert_eq!(ulp_distance(-0.0, 0.0, false), Some(0));
        assert_eq!(ulp_distance(f32::NAN, 0.0, false), None);
    }
}
