//! Activation-quantization sites held by one trace only (docs/diff.md
//! "Quantization sites").
//!
//! A quantization site (catalogue presence `Quantized`/`QuantizedOnEmit`,
//! docs/operators.md §9.6) exists only in a precision profile that quantizes
//! activations there. When one trace holds a site's record and the other
//! trace's precision profile is known to have no quantization sites
//! ([`profile_quantizes`] `Some(false)`: the reference runtime's `bf16` and
//! `f32`), the other side computes the identity there: the site is a real
//! difference of execution, localized to the site itself ("quantized by the
//! reference only"), not a coverage difference. An operator that reads such
//! a site has the input status `quantized_one_side`, which counts as
//! differing. When neither trace holds a site and both profiles are known,
//! the site is simply not part of either execution and is left out of the
//! operators' input lists. With a profile of unknown quantization (a
//! backend's own name), a missing site stays a coverage difference.

use crate::ctx::Ctx;
use crate::report::OneSided;
use crate::walk::Pair;
use moeconf_fingerprint::catalogue::{profile_quantizes, InputSource};
use moeconf_fingerprint::Component;

/// The input status of a quantization site held by one side only whose
/// other side does not quantize (counts as differing).
pub(crate) const QUANTIZED_ONE_SIDE: &str = "quantized_one_side";

/// Whether an input status means the input differs (the operator reading it
/// is not where the executions part).
pub(crate) fn status_differs(status: &str) -> bool {
    status == "differ" || status == QUANTIZED_ONE_SIDE
}

/// Whether `path` names an activation-quantization site.
pub(crate) fn is_site(path: &str) -> bool {
    // A family's prefix (`moe.term_h_fp8.`, an input spec's path) names its site too.
    crate::operators::producer(path).is_some_and(|c| c.spec().presence.is_quantized())
}

impl Ctx<'_> {
    /// Whether each side's precision profile quantizes activations
    /// (reference, candidate; `None`: not known).
    pub(crate) fn quantizes(&self) -> (Option<bool>, Option<bool>) {
        (
            profile_quantizes(&self.s.r.binding().precision),
            profile_quantizes(&self.s.c.binding().precision),
        )
    }

    /// The side that holds `p` when `p` is a quantization site held by one
    /// side only and the other side's profile has no quantization sites
    /// (`"reference"` or `"candidate"`), else `None`.
    pub(crate) fn quantized_by(&self, p: Pair) -> Option<&'static str> {
        let e = self.s.entry(p)?;
        if !is_site(&e.coord.path) {
            return None;
        }
        let (rq, cq) = self.quantizes();
        match (p.r, p.c) {
            (Some(_), None) if cq == Some(false) => Some("reference"),
            (None, Some(_)) if rq == Some(false) => Some("candidate"),
            _ => None,
        }
    }

    /// Whether either trace holds a record of any quantization site at
    /// `step` and `layer` (an execution that quantizes captures its sites
    /// where it captures the operators around them).
    pub(crate) fn holds_sites(&self, step: u32, layer: Option<u32>) -> bool {
        self.s
            .lookup(step, moeconf_fingerprint::Level::L4, layer, None, "", true)
            .iter()
            .filter_map(|&p| self.s.entry(p))
            .any(|e| is_site(&e.coord.path))
    }

    /// Whether both profiles are known, so that a site neither trace holds
    /// is part of neither execution (and is not listed as an input).
    pub(crate) fn both_profiles_known(&self) -> bool {
        let (rq, cq) = self.quantizes();
        rq.is_some() && cq.is_some()
    }

    /// For a site held by one side only ([`Ctx::quantized_by`]): the site's
    /// record paired with the record the other side reads instead — the
    /// site's first input, when it has the site's shape (Q1, Q3, Q4, Q5, Q8:
    /// the tensor the site quantizes). `None` when there is no such record.
    pub(crate) fn identity_pair(&self, p: Pair) -> Option<Pair> {
        let side = self.quantized_by(p)?;
        let e = self.s.entry(p)?;
        let (component, _) = Component::parse(&e.coord.path)?;
        let input = component
            .spec()
            .inputs
            .iter()
            .find(|i| i.source == InputSource::SameLayer)?;
        let other = self
            .s
            .lookup_component(
                e.coord.step,
                e.coord.layer,
                Some(e.coord.position),
                input.component,
            )
            .into_iter()
            .find(|q| q.r.is_some() && q.c.is_some())?;
        let pair = match side {
            "reference" => Pair { r: p.r, c: other.c },
            _ => Pair { r: other.r, c: p.c },
        };
        let (ri, ci) = (pair.r?, pair.c?);
        // Ids handed out by the lookup above, so both entries are in memory.
        let (re, ce) = (self.s.r.get_record(ri)?, self.s.c.get_record(ci)?);
        (re.shape == ce.shape).then_some(pair)
    }

    /// The quantization sites held by one side only whose other side does
    /// not quantize, grouped by (component, side) in execution order of
    /// first appearance (reported apart from the coverage differences).
    pub(crate) fn quantized_one_sided_groups(&self) -> Vec<OneSided> {
        self.group_one_sided(|p| self.quantized_by(p).is_some())
    }
}
