//! The reference a candidate is replayed against: the model (which must be
//! the one the candidate's binding names), and the binding's precision
//! profile, aggregation contract and schedule.
//!
//! A single-layer fork recorded in the binding's schedule (`identity +
//! ... fork(...)`) is a deliberate departure from the declared contract:
//! the reference runs the declared contract and schedule *without* the
//! fork, so the fork shows as an origin.

use moeconf_contract::MoeCombine;
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::{build_combine, model_identity, CombineChoice, LoadedModel};
use moeconf_schema::Trace;

use crate::error::{ReplayError, Result};

/// The numerical binding of the reference side of a replay.
pub struct Reference {
    /// Precision profile (the binding's).
    pub precision: Precision,
    /// The combine (the binding's contract and schedule, without a fork).
    pub combine: Box<dyn MoeCombine>,
    /// The contract string the reference runs (the binding's, or the
    /// override given).
    pub contract: String,
    /// The schedule the reference runs (the binding's, without a fork).
    pub schedule: String,
    /// The fork the binding recorded and the reference leaves out, if any.
    pub fork_ignored: Option<String>,
}

/// Checks that `m` is the model `trace`'s binding names (config and weight
/// digests under the trace's digest algorithm), and builds the reference's
/// precision and combine from the binding. A mismatch is an error naming
/// the trace and the differing part. `precision` overrides the binding's
/// profile (traces of other runtimes name their own, e.g. `hf-bf16`);
/// `contract` overrides the binding's aggregation contract the same way
/// (the Python capture binds `hf-native`, which names no grammar member).
pub fn reference_for(
    trace: &Trace,
    m: &LoadedModel,
    precision: Option<Precision>,
    contract: Option<&str>,
) -> Result<Reference> {
    let b = trace.binding();
    let err = |what: String| ReplayError::Binding {
        path: trace.path().to_path_buf(),
        what,
    };
    let id = model_identity(&m.name, &m.dir, trace.algorithm())
        .map_err(|e| err(format!("cannot fingerprint the model {}: {e}", m.name)))?;
    if id.config_digest != b.model.config_digest {
        return Err(err(format!(
            "the model {} has another config.json than the one the trace is bound to ({}); replay needs the candidate's model",
            m.name, b.model.name
        )));
    }
    if id.weights_digest != b.model.weights_digest {
        return Err(err(format!(
            "the model {} has other weights than the ones the trace is bound to ({}); replay needs the candidate's model",
            m.name, b.model.name
        )));
    }
    let precision = match precision {
        Some(p) => p,
        None => Precision::from_name(&b.precision).ok_or_else(|| {
            err(format!(
                "the binding's precision profile {:?} is not one the reference runtime has (bf16, f32, official); \
                 name the reference's profile with --precision",
                b.precision
            ))
        })?,
    };
    let (base, fork) = match b.schedule.split_once(" + ") {
        Some((base, fork)) => (base.trim().to_string(), Some(fork.trim().to_string())),
        None => (b.schedule.trim().to_string(), None),
    };
    let contract = contract.map_or_else(|| b.contract.clone(), str::to_string);
    // The trace's own strings: what cannot be parsed cannot be run.
    let choice = CombineChoice {
        contract: contract.parse().map_err(|e| {
            err(format!(
                "the contract/schedule cannot be run: contract {contract:?}: {e}"
            ))
        })?,
        schedule: base.parse().map_err(|e| {
            err(format!(
                "the contract/schedule cannot be run: schedule {base:?}: {e}"
            ))
        })?,
        ..CombineChoice::default()
    };
    let cfg = m.model.config();
    let built = build_combine(
        &choice,
        cfg.experts_per_tok,
        &b.prompt.text,
        cfg.num_layers(),
        precision,
    )
    .map_err(|e| err(format!("the contract/schedule cannot be run: {e}")))?;
    Ok(Reference {
        precision,
        combine: built.combine,
        contract,
        schedule: base,
        fork_ignored: fork,
    })
}
