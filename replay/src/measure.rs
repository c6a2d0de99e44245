//! Measured propagation (`--measure-propagation`): which units' inputs
//! actually differ from a clean reference.
//!
//! The clean reference is the reference runtime teacher-forced on the
//! candidate's token sequence (docs/replay.md §2), capturing its L2 and L3
//! records. Each of the candidate's checkpoints and state records is
//! compared with the clean run's at the same coordinate; a unit's inputs
//! differ when one of its input records does (layer 0's input differs when
//! the embedding unit is a non-absorbed origin, since the tokens are the
//! candidate's own). A reproduced unit with differing inputs computes the
//! reference's function of inputs that already carry an earlier
//! difference: measured propagation, where `downstream_of` only says the
//! difference may have reached it.

use std::collections::HashMap;

use moeconf_fingerprint::catalogue::STATE_PREFIX;
use moeconf_fingerprint::{Component, Level};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::model::{Model, StepOptions};

use crate::candidate::{Candidate, Cmp};
use crate::error::{ReplayError, Result};
use crate::report::{Status, UnitResult};
use crate::setup::Reference;
use crate::units::{Part, StepInfo};

/// (step, position, layer) of a record, and whether its path is state.
type Key = (u32, u32, Option<u32>, String);

/// How the candidate's records compare with the clean run's, by coordinate.
struct Clean {
    /// Every L2/L3 record of the clean run.
    records: HashMap<Key, Cmp>,
    /// Every layer's state at every boundary (step, position, layer), merged.
    states: HashMap<(u32, u32, u32), Cmp>,
}

impl Clean {
    fn get(&self, step: u32, position: u32, layer: Option<u32>, path: &str) -> Cmp {
        self.records
            .get(&(step, position, layer, path.to_string()))
            .copied()
            .unwrap_or(Cmp::Absent)
    }

    /// How the state of `layer` at the boundary (step, position) compares.
    fn state(&self, step: u32, position: u32, layer: u32) -> Cmp {
        self.states
            .get(&(step, position, layer))
            .copied()
            .unwrap_or(Cmp::Absent)
    }
}

/// Differs wins, then Absent, then Same.
fn merge(a: Cmp, b: Cmp) -> Cmp {
    match (a, b) {
        (Cmp::Differs, _) | (_, Cmp::Differs) => Cmp::Differs,
        (Cmp::Absent, _) | (_, Cmp::Absent) => Cmp::Absent,
        _ => Cmp::Same,
    }
}

/// Runs the clean reference on the candidate's tokens (every step must
/// have its `token.input`) and compares its L2/L3 records with the
/// candidate's.
fn clean(cand: &Candidate<'_>, model: &Model, reference: &Reference, steps: &[StepInfo]) -> Result<Clean> {
    let opts = StepOptions {
        precision: reference.precision,
        combine: reference.combine.as_ref(),
        detokenizer: None,
        allow_non_finite: true,
    };
    let mut state = model.new_state();
    let mut records = HashMap::new();
    let mut states: HashMap<(u32, u32, u32), Cmp> = HashMap::new();
    for (i, st) in steps.iter().enumerate() {
        // The candidate's groups of earlier steps are not read again.
        cand.retain(|s, _, _| s >= st.step);
        if let Some(prev) = st.step.checked_sub(1) {
            cand.trace.release_step(prev);
        }
        let Some(ids) = st.ids.as_ref().filter(|_| st.step as usize == i) else {
            break;
        };
        let mut sink = MemorySink::with_levels(&[Level::L2, Level::L3]);
        model
            .step(&mut state, ids, &opts, &mut sink)
            .map_err(|source| ReplayError::Runtime {
                unit: format!("step {} (clean teacher-forced reference)", st.step),
                source,
            })?;
        for r in &sink.records {
            let c = &r.coord;
            let cmp = cand.compare(r)?;
            if let (true, Some(l)) = (c.path.starts_with(STATE_PREFIX), c.layer) {
                let e = states.entry((c.step, c.position, l)).or_insert(Cmp::Same);
                *e = merge(*e, cmp);
            }
            records.insert((c.step, c.position, c.layer, c.path.to_string()), cmp);
        }
    }
    Ok(Clean { records, states })
}

fn flag(c: Cmp) -> Option<bool> {
    match c {
        Cmp::Same => Some(false),
        Cmp::Differs => Some(true),
        Cmp::Absent => None,
    }
}

/// Sets [`UnitResult::inputs_differ`] of every unit.
pub(crate) fn mark(
    cand: &Candidate<'_>,
    model: &Model,
    reference: &Reference,
    steps: &[StepInfo],
    units: &mut [UnitResult],
) -> Result<()> {
    let clean = clean(cand, model, reference, steps)?;
    let layers = model.config().num_layers() as u32;
    let embed_differs: HashMap<u32, bool> = units
        .iter()
        .filter(|u| u.unit.part == Part::Embed)
        .map(|u| (u.unit.step, u.status == Status::Origin && !u.absorbed))
        .collect();
    for u in units.iter_mut() {
        let Some(st) = steps.iter().find(|s| s.step == u.unit.step) else {
            continue;
        };
        let s = st.step;
        let mut c = Cmp::Same;
        match (u.unit.part, u.unit.layer) {
            (Part::Embed, _) => {}
            (Part::Attention, Some(l)) => {
                for p in st.positions() {
                    c = merge(c, input_of_layer(&clean, &embed_differs, s, p, l));
                }
                if let Some(prev) = s
                    .checked_sub(1)
                    .and_then(|ps| steps.iter().find(|x| x.step == ps))
                {
                    c = merge(c, clean.state(prev.step, prev.last(), l));
                }
            }
            (Part::Ffn, Some(l)) => {
                for p in st.positions() {
                    let cmp = clean.get(s, p, Some(l), Component::LayerPostAttnMhc.path());
                    c = merge(c, cmp);
                }
            }
            (Part::Head, _) => {
                let last = Some(layers.saturating_sub(1));
                c = clean.get(s, st.last(), last, Component::LayerPostFfnMhc.path());
            }
            _ => c = Cmp::Absent,
        }
        u.inputs_differ = flag(c);
    }
    Ok(())
}

/// How the residual streams entering layer `l` at `p` compare with the clean run's.
fn input_of_layer(clean: &Clean, embed_differs: &HashMap<u32, bool>, s: u32, p: u32, l: u32) -> Cmp {
    if l > 0 {
        return clean.get(s, p, Some(l - 1), Component::LayerPostFfnMhc.path());
    }
    match embed_differs.get(&s) {
        Some(true) => Cmp::Differs,
        Some(false) => Cmp::Same,
        None => Cmp::Absent,
    }
}
