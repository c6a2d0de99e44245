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
/// current rayon pool; the report is the same on any number of threads.
pub fn replay_layers(trace: &Trace, m: &LoadedModel, opts: &LayerOptions) -> Result<LayerReport> {
    let reference = reference_for(trace, m, opts.precision, opts.contract.as_deref())?;
    let cand = candidate::Candidate::new(trace)?;
    let steps = units::steps(&cand)?;
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
    let mut results = list
        .par_iter()
        .map(|&u| engine.run(u))
        .collect::<Result<Vec<_>>>()?;
    propagate::mark(&mut results, layers);
    if opts.measure_propagation {
        measure::mark(&cand, &m.model, &reference, &steps, &mut results)?;
    }
    Ok(LayerReport {
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
    })
}
