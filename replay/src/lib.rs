//! Teacher-forced replay of a candidate trace on the reference runtime
//! (`moeconf replay`, docs/replay.md).
//!
//! `moeconf diff` names where two executions *first* part; after that every
//! later layer inherits different inputs. Replay instead feeds every
//! half-layer of the candidate its *own* captured inputs — the residual
//! streams entering it and the persistent state of the layer at the
//! previous decode boundary — runs the reference's same half-layer under
//! the candidate's binding (precision profile, contract, schedule) and
//! compares the outputs bitwise. A half-layer the reference reproduces
//! computes what the reference computes; one it does not is an *origin*:
//! the candidate computes differently on identical inputs. Every origin of
//! the run is found, not only the first ([`replay_layers`]).
//!
//! Token teacher forcing ([`teacher_force`]) runs the reference on the
//! candidate's token sequence and compares the logits at every step (KL
//! divergence, top-k overlap, argmax agreement).
//!
//! Results never depend on the number of threads: units are independent
//! and collected in execution order, and every reduction has a fixed order.
#![forbid(unsafe_code)]

mod candidate;
mod engine;
pub mod error;
mod explain;
mod html;
mod incomplete;
mod measure;
mod propagate;
pub mod report;
mod state;
pub mod teacher;
pub mod text;
pub mod units;

use moeconf_runner::LoadedModel;
use moeconf_schema::Trace;
use rayon::prelude::*;
use std::collections::HashMap;

pub use error::{ReplayError, Result};
pub use html::html_view;
pub use report::{Difference, LayerReport, Missing, Status, UnitResult, REPLAY_SCHEMA_VERSION};
pub use setup::{reference_for, Reference};
pub use teacher::{teacher_force, TeacherOptions, TeacherReport};
pub use units::{Part, UnitId};

mod setup;

/// Options of a layer replay.
#[derive(Debug, Clone, Default)]
pub struct LayerOptions {
    /// The reference's precision profile instead of the binding's (for
    /// traces of runtimes whose profile names differ, e.g. `hf-bf16`).
    pub precision: Option<moeconf_reference_runtime::precision::Precision>,
    /// The reference's aggregation contract (docs/contracts.md notation)
    /// instead of the binding's (for traces of runtimes whose contract names
    /// no grammar member, e.g. the Python capture's `hf-native`, or to
    /// replay under the member `moeconf explain` found).
    pub contract: Option<String>,
    /// Measure propagation against a clean reference teacher-forced on the
    /// candidate's tokens (one more reference run; fills
    /// [`UnitResult::inputs_differ`]).
    pub measure_propagation: bool,
}

/// Replays every unit of `trace` (embedding, each layer's attention and
/// FFN half, head, at every step) on the reference model `m`, which must be
/// the model the trace's binding names. Units run in parallel on the
/// current rayon pool, a few at a time in execution order; the candidate's
/// records are read group by group as the units need them and dropped
/// once no later unit reads them, so memory follows the units in flight,
/// not the whole trace (docs/replay.md §5). The report is the same on any
/// number of threads.
pub fn replay_layers(trace: &Trace, m: &LoadedModel, opts: &LayerOptions) -> Result<LayerReport> {
    replay_with(trace, m, opts, |t| Ok(candidate::Candidate::new(t))).map(|(r, _)| r)
}

/// [`replay_layers`], and the most candidate records it held in memory at
/// once (for tests of its memory).
#[doc(hidden)]
pub fn replay_layers_held(
    trace: &Trace,
    m: &LoadedModel,
    opts: &LayerOptions,
) -> Result<(LayerReport, usize)> {
    replay_with(trace, m, opts, |t| Ok(candidate::Candidate::new(t)))
}

/// [`replay_layers`] through the former whole-index lookup: every record of
/// the trace indexed before any unit runs (memory grows with the whole
/// trace). Kept to test that streaming changes no report.
#[doc(hidden)]
pub fn replay_layers_whole_index(trace: &Trace, m: &LoadedModel, opts: &LayerOptions) -> Result<LayerReport> {
    replay_with(trace, m, opts, candidate::Candidate::whole).map(|(r, _)| r)
}

fn replay_with<'t>(
    trace: &'t Trace,
    m: &LoadedModel,
    opts: &LayerOptions,
    candidate: impl FnOnce(&'t Trace) -> Result<candidate::Candidate<'t>>,
) -> Result<(LayerReport, usize)> {
    let reference = reference_for(trace, m, opts.precision, opts.contract.as_deref())?;
    let cand = candidate(trace)?;
    let steps = units::steps(&cand)?;
    cand.retain(|_, _, _| false);
    let levels = trace.binding().capture.levels;
    let layers = m.model.config().num_layers() as u32;
    let list = units::units(&steps, layers, levels);
    let engine = engine::Engine {
        cand: &cand,
        model: &m.model,
        reference: &reference,
        levels,
        steps: &steps,
        templates: m.model.new_state().layers,
    };
    // The last unit reading each (step, layer): its groups are dropped
    // once that unit is done.
    let last_layer = layers.saturating_sub(1);
    let mut last_use: HashMap<candidate::Reads, usize> = HashMap::new();
    for (j, u) in list.iter().enumerate() {
        for k in candidate::reads(u, last_layer) {
            last_use.insert(k, j);
        }
    }
    // The last unit reading each step: the step's part of a mapped file
    // leaves the resident set once it is done.
    let mut step_last: HashMap<u32, usize> = HashMap::new();
    for (&(s, _, _), &j) in &last_use {
        let e = step_last.entry(s).or_insert(j);
        *e = (*e).max(j);
    }
    let batch = (2 * rayon::current_num_threads()).max(2);
    let mut results = Vec::with_capacity(list.len());
    for (b, units) in list.chunks(batch).enumerate() {
        let done = units
            .par_iter()
            .map(|&u| engine.run(u))
            .collect::<Result<Vec<_>>>()?;
        results.extend(done);
        let next = (b + 1) * batch;
        let needed = |k| last_use.get(&k).is_some_and(|&j| j >= next);
        cand.retain(|s, l, level| needed((s, l, None)) || needed((s, l, Some(level))));
        step_last.retain(|&s, &mut j| {
            let done = j < next;
            if done {
                trace.release_step(s);
            }
            !done
        });
    }
    propagate::mark(&mut results, layers);
    if opts.measure_propagation {
        measure::mark(&cand, &m.model, &reference, &steps, &mut results)?;
        cand.retain(|_, _, _| false);
    }
    let report = LayerReport {
        candidate: trace.path().display().to_string(),
        model: m.name.clone(),
        precision: reference.precision.name().to_string(),
        contract: reference.contract.clone(),
        schedule: reference.schedule.clone(),
        fork_ignored: reference.fork_ignored.clone(),
        layers,
        units: results,
        measured_propagation: opts.measure_propagation,
        incomplete: incomplete::of(trace),
    };
    Ok((report, cand.peak_records()))
}
