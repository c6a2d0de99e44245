//! Counterfactual absorption at the MoE combine (docs/diff.md): when the
//! routed terms (or the shared expert's output) differ at a combine event
//! whose two sides are each explained by the combine grammar, each side's
//! rule is evaluated on the *other* side's terms and shared output. If every
//! side's rule still gives that side's own output, the term differences are
//! absorbed by both contracts (e.g. a one-ulp term difference that R_BF16
//! erases on either side), and what differs at the combine is the contract
//! itself, which contract inference then names for both sides.

use moeconf_contract::{AggregationContract, EventContext};
use moeconf_fingerprint::canonical_f32_bits;

use crate::ctx::Ctx;
use crate::error::BisectError;
use crate::explain::{side_event, ExplainError, SideEvent};

/// At most this many reproducing rules of a side are tried.
const MAX_RULES: usize = 64;

/// Whether one of `rules` gives `out` from `terms` and `shared`, compared
/// bitwise after canonicalization.
fn reproduces(
    rules: &[AggregationContract],
    terms: &[Vec<f32>],
    shared: &[f32],
    out: &[f32],
    side: &SideEvent,
) -> bool {
    let refs: Vec<&[f32]> = terms.iter().map(Vec::as_slice).collect();
    let canon = |v: f32| canonical_f32_bits(v.to_bits(), side.canon);
    // The rule's order is resolved at the side's own event (its expert ids
    // and gates): `asc-id` or `desc-gate` mean that side's routes.
    let ctx = EventContext {
        experts: &side.experts,
        gates: &side.gates,
    };
    rules.iter().take(MAX_RULES).any(|rule| {
        let mut y = vec![0.0f32; out.len()];
        rule.try_combine_in(Some(&ctx), &refs, shared, &mut y).is_ok()
            && y.iter().zip(out).all(|(a, b)| canon(*a) == canon(*b))
    })
}

impl Ctx<'_> {
    /// Whether the term differences at the combine event (`step`, `layer`,
    /// `position`) are absorbed by both sides' contracts (module header).
    /// `false` whenever it cannot be shown: a side without the event or its
    /// payloads, no reproducing rule on a side, other routes, other shapes.
    /// A payload that does not match its digest is an error, as everywhere.
    pub(crate) fn absorbed_by_contracts(
        &self,
        step: u32,
        layer: u32,
        position: u32,
    ) -> Result<bool, BisectError> {
        let key = (step, layer, position);
        if let Some(&v) = self.counterfactuals.borrow().get(&key) {
            return Ok(v);
        }
        let v = self.compute_absorbed(key)?;
        self.counterfactuals.borrow_mut().insert(key, v);
        Ok(v)
    }

    /// The answer [`Ctx::absorbed_by_contracts`] gave for the event, if it
    /// was asked (the walk asks at the combine's inputs, which come first in
    /// execution order); `false` when it was not.
    pub(crate) fn known_absorbed_by_contracts(&self, step: u32, layer: u32, position: u32) -> bool {
        self.counterfactuals.borrow().get(&(step, layer, position)) == Some(&true)
    }

    fn compute_absorbed(&self, key: (u32, u32, u32)) -> Result<bool, BisectError> {
        let side = |t, name| match side_event(t, name, key) {
            Ok(e) => Ok(e),
            Err(ExplainError::Trace(e)) => Err(BisectError::Trace(e)),
            // Missing records or payloads, an inconsistent event: nothing shown.
            Err(_) => Ok(None),
        };
        let (Some(r), Some(c)) = (side(self.s.r, "reference")?, side(self.s.c, "candidate")?) else {
            return Ok(false);
        };
        let same_shapes = r.terms.len() == c.terms.len()
            && r.terms.iter().zip(&c.terms).all(|(a, b)| a.len() == b.len())
            && r.shared.len() == c.shared.len()
            && r.combine.len() == c.combine.len();
        if r.experts != c.experts
            || r.gates.len() != c.gates.len()
            || !same_shapes
            || r.rules.is_empty()
            || c.rules.is_empty()
        {
            return Ok(false);
        }
        Ok(reproduces(&r.rules, &c.terms, &c.shared, &r.combine, &r)
            && reproduces(&c.rules, &r.terms, &r.shared, &c.combine, &c))
    }
}
