//! Every protocol as a list of independent jobs (docs/scale.md): the
//! protocol plans its jobs, runs any of them, and assembles its sections
//! from the results of all of them, without the model. The unsharded suite
//! runs every job and assembles at once; a shard runs its own jobs and
//! writes their results to a partial; `moeconf merge` assembles from the
//! partials. Both go through the same JSON form of each result, so the
//! outputs are the same bytes.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{CalibrateError, Ctx, Result, Section, Sizes};

/// What one job produced: its result, and the files it left in the output
/// directory (relative paths) that are outputs of the command.
pub struct JobOut {
    /// The result, in its JSON form.
    pub result: Value,
    /// Output files it wrote (e.g. `traces/fault-bf16-01.bin`).
    pub files: Vec<String>,
}

impl JobOut {
    /// A result without files.
    pub fn of<T: Serialize>(result: &T) -> Result<JobOut> {
        Ok(JobOut {
            result: serde_json::to_value(result)?,
            files: Vec::new(),
        })
    }
}

/// A protocol's planned jobs.
pub trait Jobs: Sync {
    fn count(&self) -> usize;

    /// Work the jobs `owned` (of `0..count()`) share, done once before they
    /// run in parallel (a frozen snapshot, a reference trace).
    fn prepare(&mut self, _ctx: &Ctx, _owned: &[usize]) -> Result<()> {
        Ok(())
    }

    fn run(&self, ctx: &Ctx, job: usize) -> Result<JobOut>;
}

/// What assembling a protocol needs besides its job results: the run's
/// parameters, recorded in every partial.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub sizes: Sizes,
    /// Layer of the single-layer fork.
    pub fork_layer: u32,
    /// Routed experts per token of the model.
    pub k: usize,
}

/// Decodes job results of one protocol.
pub fn decode<T: DeserializeOwned>(protocol: &str, results: &[Value]) -> Result<Vec<T>> {
    results
        .iter()
        .enumerate()
        .map(|(i, v)| {
            T::deserialize(v).map_err(|e| {
                CalibrateError::Merge(format!(
                    "{protocol}: job {i} of the protocol: result of the wrong form: {e}"
                ))
            })
        })
        .collect()
}

/// A protocol that is one job: its section(s), computed whole.
pub struct Single {
    run: fn(&Ctx) -> Result<Vec<Section>>,
}

impl Single {
    /// The single job `run`.
    pub fn new(run: fn(&Ctx) -> Result<Vec<Section>>) -> Single {
        Single { run }
    }

    /// Assembles the single job's sections.
    pub fn assemble(protocol: &str, results: &[Value]) -> Result<Vec<Section>> {
        let mut v: Vec<Vec<Section>> = decode(protocol, results)?;
        match (v.pop(), v.is_empty()) {
            (Some(sections), true) => Ok(sections),
            _ => Err(CalibrateError::Merge(format!(
                "{protocol}: expected one job result, got {}",
                results.len()
            ))),
        }
    }
}

impl Jobs for Single {
    fn count(&self) -> usize {
        1
    }

    fn run(&self, ctx: &Ctx, _job: usize) -> Result<JobOut> {
        JobOut::of(&(self.run)(ctx)?)
    }
}
