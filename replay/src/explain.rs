//! The first use of the contract hook ([`crate::UnitResult::reproduced_under`]):
//! an FFN origin whose first differing record is `moe.combine`, with every
//! routed term and the shared output at those positions matching, is
//! recomputed from the (matching) terms under each preset aggregation
//! contract of `moeconf_contract` (in `PRESET_NAMES` order, identity
//! order) and then under every B class; the first contract that gives the
//! candidate's `moe.combine` bitwise at every differing position is
//! reported. Contract inference proper (Part 4) can replace this.

use moeconf_contract::{b_class_count, AggregationContract, Order, PRESET_NAMES};
use moeconf_fingerprint::{Component, DType};
use moeconf_reference_runtime::capture::Record;

use crate::candidate::{Candidate, Cmp};
use crate::error::Result;

/// Most B classes tried (k = 8 has 20160; the fixture's k = 6 has 360).
const MAX_CLASSES: u64 = 5040;

/// The combine inputs of one position, if every one matches the candidate.
struct Event<'r> {
    terms: Vec<Vec<f32>>,
    shared: Vec<f32>,
    combine: &'r Record,
}

fn event<'r>(cand: &Candidate<'_>, records: &'r [Record], position: u32) -> Result<Option<Event<'r>>> {
    let at = |r: &&Record| r.coord.position == position;
    let mut terms: Vec<(u32, Vec<f32>)> = Vec::new();
    let (mut shared, mut combine) = (None, None);
    for r in records.iter().filter(at) {
        let Some((c, idx)) = Component::parse(&r.coord.path) else {
            continue;
        };
        let needed = matches!(c, Component::MoeTerm | Component::MoeShared);
        if needed && (r.dtype != DType::F32 || cand.compare(r)? != Cmp::Same) {
            return Ok(None);
        }
        match c {
            Component::MoeTerm => terms.push((idx.unwrap_or(0), r.f32s())),
            Component::MoeShared => shared = Some(r.f32s()),
            Component::MoeCombine => combine = Some(r),
            _ => {}
        }
    }
    terms.sort_by_key(|(j, _)| *j);
    Ok(match (shared, combine, terms.is_empty()) {
        (Some(shared), Some(combine), false) => Some(Event {
            terms: terms.into_iter().map(|(_, v)| v).collect(),
            shared,
            combine,
        }),
        _ => None,
    })
}

/// Whether `contract` gives the candidate's `moe.combine` at every event.
fn explains(cand: &Candidate<'_>, contract: &AggregationContract, events: &[Event<'_>]) -> Result<bool> {
    for e in events {
        let refs: Vec<&[f32]> = e.terms.iter().map(Vec::as_slice).collect();
        let mut out = vec![0f32; e.shared.len()];
        if contract.try_combine(&refs, &e.shared, &mut out).is_err() {
            return Ok(false);
        }
        let r = Record {
            bytes: out.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ..e.combine.clone()
        };
        if cand.compare(&r)? != Cmp::Same {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The contract under which the candidate's `moe.combine` at `positions` is
/// reproduced from the unit's matching terms, if one is found.
pub(crate) fn combine_contract(
    cand: &Candidate<'_>,
    records: &[Record],
    positions: &[u32],
) -> Result<Option<String>> {
    let mut events = Vec::with_capacity(positions.len());
    for &p in positions {
        match event(cand, records, p)? {
            Some(e) => events.push(e),
            None => return Ok(None),
        }
    }
    let Some(k) = events.first().map(|e| e.terms.len()) else {
        return Ok(None);
    };
    for name in PRESET_NAMES {
        if let Some(c) = AggregationContract::from_preset_name(name) {
            if explains(cand, &c, &events)? {
                return Ok(Some(name.to_string()));
            }
        }
    }
    let classes = b_class_count(k).unwrap_or(0).min(MAX_CLASSES);
    for class in 1..classes {
        let c = AggregationContract::b().with_order(Order::BClass(class));
        if explains(cand, &c, &events)? {
            return Ok(Some(c.describe()));
        }
    }
    Ok(None)
}
