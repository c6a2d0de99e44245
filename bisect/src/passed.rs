//! What the divergence walk passes on its way to the first real
//! difference, and what an "inputs match" rests on: records that differ
//! only by storage precision ([`crate::storage`]), records one trace alone
//! holds, and inputs a capture recomputed rather than observed (the trace's
//! `moeconf.recomputed` provenance note, docs/format.md §5.2.1).

use crate::ctx::{component_name, Ctx};
use crate::report::{BeyondStorage, InputCheck, OneSided, RecordRef, StoragePrecision};
use crate::storage::Rounding;
use crate::walk::Pair;

/// The rounding the storage check recognises, in words.
const R_BF16_WORDS: &str = "R_BF16 (round to nearest, ties to even)";

/// What an "inputs match" rests on besides bitwise equality, in words
/// (`None`: every input that matches matches bitwise and was observed).
pub(crate) fn inputs_note(inputs: &[InputCheck]) -> Option<String> {
    let names = |keep: &dyn Fn(&InputCheck) -> bool| -> Vec<String> {
        inputs
            .iter()
            .filter(|i| keep(i))
            .map(|i| i.input.clone())
            .collect()
    };
    let mut parts = Vec::new();
    let storage = names(&|i| i.status == "storage_precision");
    if !storage.is_empty() {
        parts.push(format!("up to storage precision: {}", storage.join(", ")));
    }
    let recomputed: Vec<String> = inputs
        .iter()
        .filter(|i| !crate::quantization::status_differs(&i.status))
        .filter_map(|i| {
            let side = i.recomputed.as_deref()?;
            let by = if side == "both" {
                "both sides".to_string()
            } else {
                format!("the {side}")
            };
            Some(format!("{} on {by}", i.input))
        })
        .collect();
    if !recomputed.is_empty() {
        parts.push(format!("recomputed by the capture: {}", recomputed.join(", ")));
    }
    let absorbed = names(&|i| i.status == crate::divergence::ABSORBED_BY_CONTRACTS);
    if !absorbed.is_empty() {
        parts.push(format!("absorbed by both contracts: {}", absorbed.join(", ")));
    }
    let observed = names(&|i| i.status == crate::divergence::OBSERVED_DIFFERS);
    if !observed.is_empty() {
        parts.push(format!(
            "observed inside the operator, differs: {}",
            observed.join(", ")
        ));
    }
    let one_side = names(&|i| i.status == "one_side");
    if !one_side.is_empty() {
        parts.push(format!(
            "held by one side only, not compared: {}",
            one_side.join(", ")
        ));
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

impl Ctx<'_> {
    /// How far a real difference goes beyond storage precision
    /// ([`crate::storage::residual`]; `None` unless exactly one side holds
    /// only bf16 values).
    pub(crate) fn beyond_storage(&self, p: Pair) -> Result<Option<BeyondStorage>, crate::BisectError> {
        let (Some(ri), Some(ci)) = (p.r, p.c) else {
            return Ok(None);
        };
        let (re, ce) = (self.s.r.record(ri), self.s.c.record(ci));
        let (Some(rb), Some(cb)) = (self.s.r.payload_verified(ri)?, self.s.c.payload_verified(ci)?) else {
            return Ok(None);
        };
        let fold = self.s.r.binding().canon.fold_negative_zero;
        Ok(
            crate::storage::residual((re.dtype, &re.shape, rb), (ce.dtype, &ce.shape, cb), fold).map(
                |(candidate_coarser, differing_values, values)| BeyondStorage {
                    coarser: if candidate_coarser {
                        "candidate"
                    } else {
                        "reference"
                    }
                    .into(),
                    differing_values,
                    values,
                },
            ),
        )
    }

    /// The status of one input's records: `differ` if any differs beyond
    /// storage precision, else `one_side` if one trace alone holds any,
    /// else `storage_precision` if any differs only by storage precision,
    /// else `match`.
    pub(crate) fn pairs_status(&self, pairs: &[Pair]) -> &'static str {
        let (mut one_side, mut storage) = (false, false);
        for &p in pairs {
            if self.s.pair_equal(p) {
                continue;
            }
            if p.r.is_none() || p.c.is_none() {
                if self.quantized_by(p).is_some() {
                    return crate::quantization::QUANTIZED_ONE_SIDE;
                }
                one_side = true;
            } else if self.storage_of(p).is_some() {
                storage = true;
            } else {
                return "differ";
            }
        }
        match (one_side, storage) {
            (true, _) => "one_side",
            (false, true) => "storage_precision",
            (false, false) => "match",
        }
    }

    /// Which side's capture recomputed any of these records
    /// (`reference`, `candidate`, `both`), per the traces' markers.
    pub(crate) fn recomputed_side(&self, pairs: &[Pair]) -> Option<String> {
        let (rm, cm) = &self.recomputed;
        let r = pairs
            .iter()
            .filter_map(|p| p.r)
            .any(|i| rm.covers(&self.s.r.record(i).coord.path));
        let c = pairs
            .iter()
            .filter_map(|p| p.c)
            .any(|i| cm.covers(&self.s.c.record(i).coord.path));
        match (r, c) {
            (true, true) => Some("both".into()),
            (true, false) => Some("reference".into()),
            (false, true) => Some("candidate".into()),
            (false, false) => None,
        }
    }

    /// The storage-precision records the walk passed, grouped by
    /// (component, coarser side, coarse storage) in order of first appearance.
    pub(crate) fn storage_groups(&self, found: &[(Pair, Rounding)]) -> Vec<StoragePrecision> {
        let mut out: Vec<StoragePrecision> = Vec::new();
        for &(p, r) in found {
            let Some(e) = self.s.entry(p) else { continue };
            let component = component_name(&e.coord.path);
            let coarser = if r.candidate_coarser {
                "candidate"
            } else {
                "reference"
            };
            let storage = if r.coarse_dtype_bf16 {
                "bf16"
            } else {
                "bf16 values in f32"
            };
            match out
                .iter_mut()
                .find(|g| g.component == component && g.coarser == coarser && g.coarse_storage == storage)
            {
                Some(g) => {
                    g.records += 1;
                    g.values += r.values;
                    g.rounded_values += r.rounded;
                }
                None => out.push(StoragePrecision {
                    component,
                    coarser: coarser.into(),
                    coarse_storage: storage.into(),
                    rounding: R_BF16_WORDS.into(),
                    records: 1,
                    values: r.values,
                    rounded_values: r.rounded,
                    first: RecordRef::new(e.level, &e.coord, "both"),
                }),
            }
        }
        out
    }

    /// Every record one trace alone holds (at steps both hold), grouped by
    /// (component, side) in execution order of first appearance.
    pub(crate) fn one_sided_groups(&self) -> Vec<OneSided> {
        // A quantization site the other side does not have is a difference
        // of execution, reported apart (`quantized_one_sided_groups`).
        self.group_one_sided(|p| self.quantized_by(p).is_none())
    }
}
