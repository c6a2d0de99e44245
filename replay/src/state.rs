//! The persistent state a layer carries into a step, rebuilt from the
//! candidate's `state.*` records of the previous decode boundary (every L2
//! component of the layer's kind, docs/format.md §6), checked for the
//! shapes the reference's attention relies on.

use moeconf_fingerprint::Component;
use moeconf_reference_runtime::state::{CompressorComponents, CompressorRole, CompressorState, LayerState};

use crate::candidate::{Candidate, Found};
use crate::error::{ReplayError, Result};
use crate::report::Missing;

/// Where the state records of one layer at one decode boundary live.
#[derive(Clone, Copy)]
pub(crate) struct Boundary {
    /// The step that ended at the boundary.
    pub step: u32,
    /// Its last position (the coordinate of L2 records).
    pub position: u32,
    pub layer: u32,
}

/// Reads records of one boundary, collecting what is missing.
struct Reader<'a, 'c> {
    cand: &'a Candidate<'c>,
    at: Boundary,
    missing: &'a mut Vec<Missing>,
}

impl<'c> Reader<'_, 'c> {
    fn index(&mut self, c: Component) -> Result<Option<Found<'c>>> {
        let at = self.at;
        let f = self.cand.find(at.step, at.position, Some(at.layer), c.path())?;
        if f.is_none() {
            self.miss(c, false);
        }
        Ok(f)
    }

    fn miss(&mut self, c: Component, payload_only: bool) {
        self.missing.push(Missing {
            record: c.path().to_string(),
            step: self.at.step,
            position: self.at.position,
            layer: Some(self.at.layer),
            payload_only,
        });
    }

    fn floats(&mut self, c: Component) -> Result<Option<Vec<f32>>> {
        let Some(f) = self.index(c)? else {
            return Ok(None);
        };
        let v = self.cand.floats(&f)?;
        if v.is_none() {
            self.miss(c, true);
        }
        Ok(v)
    }

    fn count(&mut self, c: Component) -> Result<Option<u64>> {
        let Some(f) = self.index(c)? else {
            return Ok(None);
        };
        match self.cand.ints(&f)? {
            None => {
                self.miss(c, true);
                Ok(None)
            }
            Some(v) => match v.as_slice() {
                [x] if *x >= 0 => Ok(Some(*x as u64)),
                _ => Err(self.bad(c, "expected one non-negative count")),
            },
        }
    }

    fn bad(&self, c: Component, what: &str) -> ReplayError {
        ReplayError::Record {
            path: self.cand.trace.path().to_path_buf(),
            record: format!(
                "step {} pos {} layer {} {}",
                self.at.step,
                self.at.position,
                self.at.layer,
                c.path()
            ),
            what: what.to_string(),
        }
    }
}

/// Fills `cs` from the records of `roles`; `Ok(false)` when something is missing.
fn compressor(
    r: &mut Reader<'_, '_>,
    roles: &CompressorComponents,
    cs: &mut CompressorState,
) -> Result<bool> {
    let kv = r.floats(roles.buffer_kv)?;
    let gate = r.floats(roles.buffer_gate)?;
    let comp = r.floats(roles.compressed_kv)?;
    let count = r.count(roles.entry_count)?;
    let (ok, og) = if cs.overlap {
        (r.floats(roles.overlap_kv)?, r.floats(roles.overlap_gate)?)
    } else {
        (Some(Vec::new()), Some(Vec::new()))
    };
    let (Some(kv), Some(gate), Some(comp), Some(count), Some(ok), Some(og)) = (kv, gate, comp, count, ok, og)
    else {
        return Ok(false);
    };
    if kv.len() != gate.len() || kv.len() % cs.width != 0 || kv.len() / cs.width >= cs.rate {
        return Err(r.bad(
            roles.buffer_kv,
            "the open-window buffers do not hold fewer than rate rows of the compressor's width",
        ));
    }
    if Some(comp.len() as u64) != count.checked_mul(cs.dim as u64) {
        return Err(r.bad(roles.compressed_kv, "the entries do not match the entry count"));
    }
    if ok.len() != og.len() || !(ok.is_empty() || ok.len() == cs.rate * cs.dim) {
        return Err(r.bad(roles.overlap_kv, "the overlap is neither empty nor rate × dim"));
    }
    cs.buffer_kv = kv;
    cs.buffer_gate = gate;
    cs.compressed_kv = comp;
    cs.entry_count = count;
    (cs.overlap_kv, cs.overlap_gate) = if ok.is_empty() {
        (None, None)
    } else {
        (Some(ok), Some(og))
    };
    Ok(true)
}

/// The state `template` (the layer's empty state) filled from the
/// candidate's records at `at`; `None` when some record or payload is
/// missing (recorded in `missing`).
pub(crate) fn carried(
    cand: &Candidate<'_>,
    template: &LayerState,
    at: Boundary,
    missing: &mut Vec<Missing>,
) -> Result<Option<LayerState>> {
    let mut r = Reader { cand, at, missing };
    let mut ls = template.clone();
    let len = r.count(Component::StateCumulativeLength)?;
    let win = r.floats(Component::StateWindowKv)?;
    let mut complete = len.is_some() && win.is_some();
    if let Some(c) = ls.compressor.as_mut() {
        complete &= compressor(&mut r, &CompressorRole::Attention.components(), c)?;
    }
    if let Some(c) = ls.indexer.as_mut() {
        complete &= compressor(&mut r, &CompressorRole::Indexer.components(), c)?;
    }
    let (Some(len), Some(win), true) = (len, win, complete) else {
        return Ok(None);
    };
    if win.len() % ls.head_dim != 0 || (win.len() / ls.head_dim) as u64 > len {
        return Err(r.bad(
            Component::StateWindowKv,
            "the window is not whole rows of head_dim, or holds more rows than tokens processed",
        ));
    }
    ls.cumulative_length = len;
    ls.window_kv = win;
    Ok(Some(ls))
}
