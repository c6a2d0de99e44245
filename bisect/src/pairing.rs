//! Record pairing for tools built on the diff engine (the CI gate): the
//! records of two traces paired by (step, level, layer, position, phase,
//! path) through the same hash-tree descent [`diff`](crate::diff) uses, so
//! only subtrees whose digests differ are entered and equal records cost
//! nothing.

use crate::walk::{Pair, SideError, Sides};
use moeconf_fingerprint::Level;
use moeconf_schema::Trace;

/// One differing record position of two traces: the id of the record in
/// each trace ([`Trace::record`]), `None` on the side that lacks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordPair {
    /// Index into the reference's records.
    pub reference: Option<usize>,
    /// Index into the candidate's records.
    pub candidate: Option<usize>,
}

/// Every record pair of every step and level whose digests differ, and
/// every record present on one side only, in execution order: records the
/// reference holds in the catalogue's execution order (then phase and
/// path), then records only the candidate holds, in the same order. The records named are in memory
/// afterwards ([`Trace::record`]). A node on the descent that fails to read
/// or verify (version 2 reads them on use) is an error of its side.
pub fn differing_pairs(reference: &Trace, candidate: &Trace) -> Result<Vec<RecordPair>, SideError> {
    let sides = Sides::new(reference, candidate);
    let mut pairs: Vec<Pair> = Vec::new();
    for step in sides.steps() {
        for level in Level::ALL {
            if sides.level_differs(step, level) {
                pairs.extend(sides.differing_records(step, level));
            }
        }
    }
    if let Some(f) = sides.take_failure() {
        return Err(f);
    }
    // Execution order from the coordinates (the catalogue's order, then
    // phase and path), never from the write-order numbers, which no digest
    // commits to (docs/format.md §11.5).
    pairs.sort_by_cached_key(|&p| (p.r.is_none(), sides.exec_key(p)));
    Ok(pairs
        .into_iter()
        .map(|p| RecordPair {
            reference: p.r,
            candidate: p.c,
        })
        .collect())
}
