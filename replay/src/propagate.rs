//! Which reproduced units only propagate an earlier origin's difference.
//!
//! Data flows between units through the residual streams (a layer's input
//! is the previous half's output), the persistent state (a layer's
//! attention at step s reads what its attention wrote at step s − 1) and
//! the tokens (step s consumes what the head of step s − 1 chose). A unit's
//! outputs are *downstream* of an origin when the origin's outputs reach
//! its inputs along these edges. A reproduced unit downstream of an origin
//! computes exactly what the reference computes on its inputs; whatever
//! differs there was carried in. The relation is conservative: it says the
//! origin's difference may have reached the unit, not that it did.

use std::collections::HashMap;

use crate::report::{Status, UnitResult};
use crate::units::{Part, UnitId};

/// The units whose outputs a unit reads.
fn upstream(u: UnitId, layers: u32) -> Vec<UnitId> {
    let at = |step: u32, layer: Option<u32>, part: Part| UnitId { step, layer, part };
    let prev_head = u.step.checked_sub(1).map(|s| at(s, None, Part::Head));
    let mut out = Vec::new();
    match (u.part, u.layer) {
        (Part::Embed, _) => out.extend(prev_head),
        (Part::Attention, Some(l)) => {
            if l == 0 {
                out.push(at(u.step, None, Part::Embed));
                out.extend(prev_head);
            } else {
                out.push(at(u.step, Some(l - 1), Part::Ffn));
            }
            if let Some(s) = u.step.checked_sub(1) {
                out.push(at(s, Some(l), Part::Attention));
            }
        }
        (Part::Ffn, Some(l)) => out.push(at(u.step, Some(l), Part::Attention)),
        (Part::Head, _) => out.push(at(u.step, Some(layers.saturating_sub(1)), Part::Ffn)),
        _ => {}
    }
    out
}

/// An absorbed origin (its outputs match) is no source; it passes on what
/// reaches its inputs like a reproduced unit.
///
/// Sets [`UnitResult::downstream_of`] of every reproduced unit (`units` in
/// execution order) to the latest origin, in execution order, that reaches
/// its inputs.
pub(crate) fn mark(units: &mut [UnitResult], layers: u32) {
    let mut source: HashMap<UnitId, UnitId> = HashMap::new();
    for r in units.iter_mut() {
        let from = upstream(r.unit, layers)
            .into_iter()
            .filter_map(|i| source.get(&i).copied())
            .max_by_key(|o| o.exec_key());
        match r.status {
            Status::Origin if !r.absorbed => {
                source.insert(r.unit, r.unit);
            }
            _ => {
                if let Some(o) = from {
                    source.insert(r.unit, o);
                    if r.status == Status::Reproduced {
                        r.downstream_of = Some(o);
                    }
                }
            }
        }
    }
}
