//! Judging one differing record pair under one rule's check (docs/ci.md §3):
//! the common cases first (exact, ignore, no payload, dtype or shape
//! mismatch), then the numerical check of [`tolerance`](crate::tolerance),
//! and for logits the argmax near-tie rule (§4).

use crate::policy::{Check, Profile};
use crate::report::{FlipKind, NearTie};
use crate::tolerance::{self, AggregateLimits, ArgmaxPair, Eval, LogitLimits, Minimal};
use moeconf_bisect::RecordRef;
use moeconf_fingerprint::{Component, DType};
use moeconf_schema::{IndexEntry, Trace, TraceError};

/// Both sides' payloads of one record pair (`None` where a side kept none).
pub(crate) type PayloadPair<'a> = (Option<&'a [u8]>, Option<&'a [u8]>);

/// What a check said about one record.
pub(crate) enum Outcome {
    /// Passes, with what would have passed it.
    Pass(Option<Minimal>),
    /// Fails: why, and what would have passed it.
    Fail(String, Option<Minimal>),
    /// The check cannot run (no payload): fails, with the reason.
    Inconclusive(String),
    /// An argmax flip accepted as a near-tie.
    NearTie(NearTie),
    /// Part of a near-tie accepted before judging (not judged).
    Waived,
}

impl From<Eval> for Outcome {
    fn from(e: Eval) -> Outcome {
        if e.pass {
            Outcome::Pass(e.minimal)
        } else {
            Outcome::Fail(e.detail, e.minimal)
        }
    }
}

/// What every check of one gate run needs besides the record.
pub(crate) struct Context<'a> {
    /// The profile (dtype defaults, `equal_nan`, near-tie thresholds).
    pub profile: &'a Profile,
    pub reference: &'a Trace,
    pub candidate: &'a Trace,
    /// The reference's `lm.margin` at the record's step.
    pub lm_margin: Option<f64>,
}

/// A differing record present on both sides.
pub(crate) struct Differing<'a> {
    pub reference: &'a IndexEntry,
    pub candidate: &'a IndexEntry,
    /// Both payloads, when kept.
    pub payloads: PayloadPair<'a>,
}

/// Judges one differing record pair under `check`; passing and failing
/// records both return the minimal tolerance they need, which the caller
/// merges per rule.
pub(crate) fn record(cx: &Context<'_>, check: &Check, pair: &Differing<'_>) -> Outcome {
    let (re, ce) = (pair.reference, pair.candidate);
    match check {
        Check::Exact => return Outcome::Fail("differs (rule requires exact equality)".into(), None),
        Check::Ignore => return Outcome::Pass(None),
        _ => {}
    }
    let (Some(a), Some(b)) = pair.payloads else {
        return Outcome::Inconclusive(inconclusive(check, re, pair.payloads));
    };
    if re.dtype != ce.dtype || re.shape != ce.shape {
        return Outcome::Fail(
            format!(
                "dtype/shape differ: reference {} {:?}, candidate {} {:?}",
                re.dtype.name(),
                re.shape,
                ce.dtype.name(),
                ce.shape
            ),
            None,
        );
    }
    let equal_nan = cx.profile.equal_nan;
    match *check {
        Check::Elementwise { rtol, atol } => {
            let (dr, da) = cx
                .profile
                .dtype_default(effective_dtype(re.dtype, cx.reference, cx.candidate));
            tolerance::elementwise(re.dtype, a, b, rtol.unwrap_or(dr), atol.unwrap_or(da), equal_nan).into()
        }
        Check::Ulp { max_ulp } => tolerance::ulp(re.dtype, a, b, max_ulp, equal_nan).into(),
        Check::Aggregate {
            cosine_min,
            norm_ratio_tol,
            nmse_max,
        } => {
            let limits = AggregateLimits {
                cosine_min,
                norm_ratio_tol,
                nmse_max,
            };
            tolerance::aggregate(re.dtype, a, b, limits, equal_nan).into()
        }
        Check::Logits {
            topk_overlap_min,
            topk,
            kl_max,
        } => {
            let limits = LogitLimits {
                topk_overlap_min,
                topk: topk as usize,
                kl_max,
            };
            logits(cx, re, (a, b), limits)
        }
        Check::Exact | Check::Ignore => Outcome::Pass(None),
    }
}

/// The message of a tolerance check that cannot run for lack of payloads.
fn inconclusive(check: &Check, re: &IndexEntry, payloads: PayloadPair<'_>) -> String {
    let side = match (payloads.0.is_some(), payloads.1.is_some()) {
        (false, false) => "either trace",
        (false, true) => "the reference",
        _ => "the candidate",
    };
    let level = re.level.name();
    format!(
        "inconclusive: {} differs but {side} has no payload for it, so the {} tolerance cannot be \
         checked; capture payloads for {level} (moeconf run --capture {level}+payload or --capture all)",
        re.coord.path,
        check.name(),
    )
}

/// The dtype whose default tolerances apply: float records are stored as
/// f32, but in a bf16 profile (either side) they carry bf16 precision.
fn effective_dtype(d: DType, r: &Trace, c: &Trace) -> DType {
    if d == DType::F32 && (carries_bf16(r) || carries_bf16(c)) {
        DType::BF16
    } else {
        d
    }
}

/// Whether a trace's precision profile is bf16 (the profile is named after
/// the dtype its float values carry).
fn carries_bf16(t: &Trace) -> bool {
    DType::from_name(&t.binding().precision) == Some(DType::BF16)
}

/// The logits check on `lm.logits` (overlap and KL) or `lm.topk_ids`
/// (overlap of the recorded ids); `lm.topk_logits` and `lm.margin` pass
/// (covered by those two). An argmax change is then a near-tie or a failure.
fn logits(cx: &Context<'_>, re: &IndexEntry, (a, b): (&[u8], &[u8]), limits: LogitLimits) -> Outcome {
    let path = re.coord.path.as_str();
    let (argmax, eval) = if Component::LmLogits.matches(path) {
        tolerance::logits(re.dtype, a, b, limits, cx.profile.equal_nan)
    } else if Component::LmTopkIds.matches(path) {
        match topk_ids(re.dtype, a, b, limits) {
            Some(x) => x,
            None => return Outcome::Fail(format!("malformed {} payload", Component::LmTopkIds.path()), None),
        }
    } else if Component::LmTopkLogits.matches(path) || Component::LmMargin.matches(path) {
        return Outcome::Pass(None);
    } else {
        return Outcome::Fail(
            format!(
                "check \"logits\" applies to {} and {}, not {path}",
                Component::LmLogits.path(),
                Component::LmTopkIds.path()
            ),
            None,
        );
    };
    match argmax {
        Some((p, q)) if p != q => argmax_flip(cx, re, (p, q), eval),
        _ => eval.into(),
    }
}

/// The overlap gate on recorded top-k ids, with both sides' first id as the
/// argmax; `None` when a payload does not decode.
fn topk_ids(dtype: DType, a: &[u8], b: &[u8], limits: LogitLimits) -> Option<(Option<ArgmaxPair>, Eval)> {
    let ids = |bytes: &[u8]| -> Option<Vec<i64>> {
        Some(
            tolerance::decode(dtype, bytes)?
                .iter()
                .map(|&v| v as i64)
                .collect(),
        )
    };
    let (x, y) = (ids(a)?, ids(b)?);
    let k = limits.topk.min(x.len());
    let ov = tolerance::overlap(&x, &y, k);
    let argmax = x.first().zip(y.first()).map(|(&p, &q)| (p as usize, q as usize));
    let min = limits.topk_overlap_min;
    Some((
        argmax,
        Eval {
            pass: ov >= min,
            detail: format!("top-{k} id overlap {ov:.3} (min {min})"),
            minimal: Some(Minimal::Logits {
                topk_overlap_min_needed: ov,
                kl_max_needed: None,
            }),
        },
    ))
}

/// An argmax change seen by a logits rule: a near-tie when the reference
/// margin is below the threshold and the other gates pass, else a failure
/// that shows the margin.
fn argmax_flip(cx: &Context<'_>, re: &IndexEntry, (p, q): ArgmaxPair, eval: Eval) -> Outcome {
    let threshold = cx.profile.argmax_near_tie_margin;
    match cx.lm_margin {
        Some(m) if threshold > 0.0 && m < threshold && eval.pass => Outcome::NearTie(NearTie {
            kind: FlipKind::Argmax,
            at: RecordRef::new(re.level, &re.coord, "both"),
            reference_margin: m,
            threshold,
            change: format!("argmax {p} -> {q}"),
        }),
        _ => {
            let margin = cx
                .lm_margin
                .map(|m| format!("{m:.3e}"))
                .unwrap_or_else(|| "unknown".into());
            Outcome::Fail(
                format!(
                    "argmax flip {p} -> {q} (reference margin {margin}, near-tie threshold {threshold}); {}",
                    eval.detail
                ),
                eval.minimal,
            )
        }
    }
}

/// The first value of record `i`'s payload (margins are one-element f32
/// records); `Ok(None)` without a payload. A payload that does not match its
/// record digest is an error, never a missing value.
pub(crate) fn scalar(t: &Trace, i: usize) -> Result<Option<f64>, TraceError> {
    let Some(e) = t.get_record(i) else {
        return Ok(None);
    };
    Ok(t.payload_verified(i)?
        .and_then(|p| tolerance::decode(e.dtype, p))
        .and_then(|v| v.first().copied()))
}

/// Record `i`'s payload as integer ids (token ids, experts); `Ok(None)` for
/// a float record or without a payload. A payload that does not match its
/// record digest is an error.
pub(crate) fn ids(t: &Trace, i: usize) -> Result<Option<Vec<i64>>, TraceError> {
    let Some(e) = t.get_record(i) else {
        return Ok(None);
    };
    if e.dtype.is_float() {
        return Ok(None);
    }
    let Some(p) = t.payload_verified(i)? else {
        return Ok(None);
    };
    if !p.len().is_multiple_of(e.dtype.size()) {
        return Ok(None);
    }
    Ok((0..p.len() / e.dtype.size())
        .map(|k| e.dtype.value_i64(p, k))
        .collect())
}
