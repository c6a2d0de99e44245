//! The diff's one object: both traces (paired by the walk), the options,
//! the compared levels and what has been computed once (storage
//! classifications, layer kinds, one-sided records), with the record
//! access every analysis uses (references, payloads, values, lookups).
//! The analyses (`coverage`, `storage`, `quantization`, `passed`,
//! `divergence`, `contract_report`) add their methods in their own files
//! and depend on this module, never on `diff.rs`.

use crate::error::BisectError;
use crate::layerkind;
use crate::numeric::{compare_values, summarize, NumericSummary, ValueComparison};
use crate::operators::{inputs_of, InputSpec};
use crate::report::*;
use crate::storage::{bf16_valued_records, classify, component_key, Rounding};
use crate::walk::{Pair, Sides};
use crate::DiffOptions;
use moeconf_fingerprint::catalogue::ValueKind;
use moeconf_fingerprint::{Component, Level, LevelSet};
use moeconf_schema::{Recomputed, Trace};
use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;

/// The component a path belongs to, for grouping (`moe.term.*`), or the path.
pub(crate) fn component_name(path: &str) -> String {
    Component::parse(path).map_or_else(|| path.to_string(), |(c, _)| c.to_string())
}

/// Both sides' payloads of one record pair.
pub(crate) type PayloadPair<'a> = (Option<&'a [u8]>, Option<&'a [u8]>);

/// Both traces, the options and the compared levels: what every part of
/// the walk reads.
pub(crate) struct Ctx<'a> {
    pub(crate) s: Sides<'a>,
    pub(crate) opts: DiffOptions,
    /// The levels both traces capture.
    pub(crate) compared: LevelSet,
    /// Storage-precision classification of the pairs looked at so far
    /// (`crate::storage`).
    pub(crate) storage: RefCell<HashMap<Pair, Option<Rounding>>>,
    /// Whether a side stores a component coarser by convention
    /// ((component, candidate is the coarser side) → answer; `crate::storage`).
    pub(crate) storage_convention: RefCell<HashMap<(String, bool), bool>>,
    /// The records each side's capture recomputed (reference, candidate).
    pub(crate) recomputed: (Recomputed, Recomputed),
    /// The layer kinds inferred so far, by (step, layer) ([`Ctx::layer_kinds`]).
    pub(crate) layer_kinds: RefCell<HashMap<(u32, u32), layerkind::Kinds>>,
    /// The records one trace alone holds ([`Ctx::one_sided`]), once computed.
    pub(crate) one_sided: OnceCell<Vec<Pair>>,
    /// Combine events whose term differences both contracts absorb, by
    /// (step, layer, position) ([`Ctx::absorbed_by_contracts`]).
    pub(crate) counterfactuals: RefCell<HashMap<(u32, u32, u32), bool>>,
}

impl Ctx<'_> {
    /// The inputs of the operator that wrote `path` at (`step`, `layer`,
    /// `position`), from the catalogue, each with the step it was read at
    /// and its coordinate-matched records on both sides; inputs from before
    /// step 0 are left out.
    pub(crate) fn input_pairs(
        &self,
        step: u32,
        layer: Option<u32>,
        position: u32,
        path: &str,
    ) -> Vec<(InputSpec, u32, Vec<Pair>)> {
        inputs_of(path, layer.unwrap_or(0))
            .into_iter()
            .filter_map(|spec| {
                let s = step.checked_sub(spec.steps_back)?;
                let pos = spec.same_position.then_some(position);
                let pairs = self
                    .s
                    .lookup(s, spec.level, spec.layer, pos, &spec.path, spec.prefix);
                Some((spec, s, pairs))
            })
            .collect()
    }

    /// The kind of the layer a record sits in (`None` for model-global records).
    pub(crate) fn layer_kind_of(&self, p: Pair) -> Option<LayerKind> {
        let e = self.s.entry(p)?;
        let layer = e.coord.layer?;
        self.layer_kinds(e.coord.step, layer).report()
    }

    /// The kinds of `layer` at `step` ([`layerkind::infer`], inferred once
    /// per diff: the answer depends only on the two traces).
    pub(crate) fn layer_kinds(&self, step: u32, layer: u32) -> layerkind::Kinds {
        if let Some(k) = self.layer_kinds.borrow().get(&(step, layer)) {
            return k.clone();
        }
        let k = layerkind::infer(&self.s, step, layer, self.compared);
        self.layer_kinds.borrow_mut().insert((step, layer), k.clone());
        k
    }

    /// The record reference of a pair at its own level.
    pub(crate) fn rec_ref_any(&self, p: Pair) -> Option<RecordRef> {
        let e = self.s.entry(p)?;
        self.rec_ref(e.level, p)
    }

    pub(crate) fn rec_ref(&self, level: Level, p: Pair) -> Option<RecordRef> {
        let e = self.s.entry(p)?;
        let present = match (p.r, p.c) {
            (Some(_), Some(_)) => "both",
            (Some(_), None) => "reference",
            _ => "candidate",
        };
        Some(RecordRef::new(level, &e.coord, present))
    }

    /// Verified payloads of both sides (`None` on a side without one).
    pub(crate) fn payloads(&self, p: Pair) -> Result<PayloadPair<'_>, BisectError> {
        let r = match p.r {
            Some(i) => self.s.r.payload_verified(i)?,
            None => None,
        };
        let c = match p.c {
            Some(i) => self.s.c.payload_verified(i)?,
            None => None,
        };
        Ok((r, c))
    }

    pub(crate) fn numeric(&self, p: Pair) -> Result<Option<NumericSummary>, BisectError> {
        let (Some(ri), Some(ci)) = (p.r, p.c) else {
            return Ok(None);
        };
        let (Some(rb), Some(cb)) = self.payloads(p)? else {
            return Ok(None);
        };
        let (re, ce) = (self.s.r.record(ri), self.s.c.record(ci));
        Ok(summarize(re.dtype, &re.shape, rb, ce.dtype, &ce.shape, cb))
    }

    /// The single record of a model-global component at `step`.
    pub(crate) fn global(&self, step: u32, component: Component) -> Option<Pair> {
        self.s
            .lookup_component(step, None, None, component)
            .first()
            .copied()
    }

    pub(crate) fn text_of(&self, t: &Trace, idx: Option<usize>) -> Result<Option<String>, BisectError> {
        let Some(i) = idx else { return Ok(None) };
        Ok(t.payload_verified(i)?
            .map(|b| String::from_utf8_lossy(b).into_owned()))
    }

    /// How the two payloads of `p` compare, by the record's value kind
    /// (catalogue `ValueKind`; paths outside the catalogue by dtype).
    pub(crate) fn comparison(&self, p: Pair) -> Result<Option<ValueComparison>, BisectError> {
        let (Some(ri), Some(ci)) = (p.r, p.c) else {
            return Ok(None);
        };
        let (Some(rb), Some(cb)) = self.payloads(p)? else {
            return Ok(None);
        };
        let (re, ce) = (self.s.r.record(ri), self.s.c.record(ci));
        let kind = match Component::parse(&re.coord.path) {
            Some((c, _)) => c.kind(),
            None if re.dtype.is_float() => ValueKind::Float,
            None => ValueKind::Count,
        };
        Ok(compare_values(
            kind,
            (re.dtype, &re.shape, rb),
            (ce.dtype, &ce.shape, cb),
        ))
    }

    /// Every record held by one trace only at a step both traces hold, at
    /// the compared levels, in execution order (steps one trace holds alone
    /// are reported as `unmatched_steps`).
    pub(crate) fn one_sided(&self) -> Vec<Pair> {
        self.one_sided.get_or_init(|| self.find_one_sided()).clone()
    }

    /// [`Ctx::one_sided`], computed.
    pub(crate) fn find_one_sided(&self) -> Vec<Pair> {
        let mut out = Vec::new();
        for (step, a, b) in self.s.paired_steps() {
            // Only steps both traces hold, with different digests.
            let Some((a, b)) = a.zip(b) else { continue };
            if a.digest == b.digest {
                continue;
            }
            for level in self.compared.iter() {
                if self.s.level_differs(step, level) {
                    out.extend(
                        self.s
                            .differing_records(step, level)
                            .into_iter()
                            .filter(|p| p.r.is_none() || p.c.is_none()),
                    );
                }
            }
        }
        out
    }

    /// The one-sided records `keep` selects, grouped by (component, side)
    /// in execution order of first appearance.
    pub(crate) fn group_one_sided(&self, keep: impl Fn(Pair) -> bool) -> Vec<OneSided> {
        let mut out: Vec<OneSided> = Vec::new();
        for p in self.one_sided().into_iter().filter(|&p| keep(p)) {
            let Some(e) = self.s.entry(p) else { continue };
            let component = component_name(&e.coord.path);
            let side = if p.r.is_some() { "reference" } else { "candidate" };
            match out
                .iter_mut()
                .find(|g| g.component == component && g.present_in == side)
            {
                Some(g) => g.records += 1,
                None => out.push(OneSided {
                    component,
                    present_in: side.into(),
                    records: 1,
                    first: RecordRef::new(e.level, &e.coord, side),
                }),
            }
        }
        out
    }
    /// The storage-precision classification of a differing pair held by
    /// both sides (`None`: equal, one-sided, or a real difference),
    /// remembered per pair. Reads both payloads (verified before use).
    pub(crate) fn storage_checked(
        &self,
        p: crate::walk::Pair,
    ) -> Result<Option<Rounding>, crate::BisectError> {
        if let Some(&known) = self.storage.borrow().get(&p) {
            return Ok(known);
        }
        let found = match (p.r, p.c) {
            (Some(ri), Some(ci)) if !self.s.pair_equal(p) => {
                let (re, ce) = (self.s.r.record(ri), self.s.c.record(ci));
                let rounding = match (self.s.r.payload_verified(ri)?, self.s.c.payload_verified(ci)?) {
                    (Some(rb), Some(cb)) => classify(
                        (re.dtype, &re.shape, rb),
                        (ce.dtype, &ce.shape, cb),
                        self.s.r.binding().canon.fold_negative_zero,
                    ),
                    _ => None,
                };
                match rounding {
                    Some(r) if self.is_storage_convention(&re.coord.path, r.candidate_coarser)? => Some(r),
                    _ => None,
                }
            }
            _ => None,
        };
        self.storage.borrow_mut().insert(p, found);
        Ok(found)
    }

    /// Whether storing the component of `path` coarser is a convention of
    /// the side that is coarser here (`candidate_coarser`), not an accident
    /// of one record: every record of the component on the coarser side
    /// holds only bf16 values, and at most half of them do on the finer
    /// side. Without this, a computation fault that rounds one event's
    /// values to bf16, or a one-ulp change to an f32 value that is a bf16
    /// value by contract, would pass as storage precision. Remembered per
    /// (component, side); reads every payload of the component once.
    pub(crate) fn is_storage_convention(
        &self,
        path: &str,
        candidate_coarser: bool,
    ) -> Result<bool, crate::BisectError> {
        let component = component_key(path);
        let key = (component.clone(), candidate_coarser);
        if let Some(&known) = self.storage_convention.borrow().get(&key) {
            return Ok(known);
        }
        let (coarse, fine) = if candidate_coarser {
            (self.s.c, self.s.r)
        } else {
            (self.s.r, self.s.c)
        };
        let (coarse_bf16, coarse_total) = bf16_valued_records(coarse, &component)?;
        let (fine_bf16, fine_total) = bf16_valued_records(fine, &component)?;
        let ok = coarse_total > 0 && coarse_bf16 == coarse_total && fine_bf16 * 2 <= fine_total;
        self.storage_convention.borrow_mut().insert(key, ok);
        Ok(ok)
    }

    /// [`Self::storage_checked`] for input checks, which cannot fail: a
    /// payload that fails verification is never storage precision (the
    /// input then differs; the walk itself reports the error).
    pub(crate) fn storage_of(&self, p: crate::walk::Pair) -> Option<Rounding> {
        self.storage_checked(p).ok().flatten()
    }
}
