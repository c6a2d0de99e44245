//! The result of a layer replay: one [`UnitResult`] per unit, the summary,
//! the exit code, and its JSON form (`kind: "moeconf.replay"`,
//! docs/replay.md §4).

use serde_json::{json, Value};

use crate::units::UnitId;

/// JSON schema version of the replay report.
pub const REPLAY_SCHEMA_VERSION: u32 = 1;

/// What replaying one unit showed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The reference, fed the candidate's inputs, produced every record of
    /// the unit the candidate captured (outputs and intermediates) bitwise.
    Reproduced,
    /// The reference, fed the candidate's inputs, produced other outputs:
    /// the candidate computes this unit differently.
    Origin,
    /// An input (or the output to compare) is not in the trace.
    NotReplayable,
}

impl Status {
    /// `reproduced`, `origin`, `not_replayable`.
    pub fn name(self) -> &'static str {
        match self {
            Status::Reproduced => "reproduced",
            Status::Origin => "origin",
            Status::NotReplayable => "not_replayable",
        }
    }
}

/// The first record (in execution order) where reference and candidate part
/// inside a unit.
#[derive(Debug, Clone, PartialEq)]
pub struct Difference {
    /// Absolute position of the record.
    pub position: u32,
    /// Its path (the operator).
    pub record: String,
    /// Whether it is one of the unit's outputs (checkpoint, state, embedding,
    /// logits) rather than an intermediate.
    pub output: bool,
}

/// A record (or its payload) a unit needs and the trace lacks.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Missing {
    /// The record's path.
    pub record: String,
    pub step: u32,
    pub position: u32,
    /// Its layer, or `None` for model-global records.
    pub layer: Option<u32>,
    /// `true`: the record is there but kept no payload; `false`: no record.
    pub payload_only: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct UnitResult {
    pub unit: UnitId,
    pub status: Status,
    /// For an origin, where the two part: the first differing record in
    /// execution order.
    pub first_difference: Option<Difference>,
    /// An origin whose outputs all match the reference's: the difference
    /// did not leave the unit (nothing downstream inherits it).
    pub absorbed: bool,
    /// Largest |reference − candidate| over the first differing output,
    /// when the candidate kept its payload.
    pub max_abs_diff: Option<f64>,
    /// What the unit lacked (not replayable units).
    pub missing: Vec<Missing>,
    /// Records compared.
    pub compared: u64,
    /// For a reproduced unit whose inputs derive from an earlier origin
    /// (data flow through residual streams, persistent state and tokens),
    /// the nearest such origin: the unit only propagates its difference.
    pub downstream_of: Option<UnitId>,
    /// Measured propagation (`--measure-propagation`): whether the unit's
    /// input records differ from a clean reference teacher-forced on the
    /// candidate's tokens (`None`: not measured, or an input not comparable).
    pub inputs_differ: Option<bool>,
    /// Hook for contract inference (Part 4): the contract under which the
    /// candidate's output of an origin is reproduced. Filled for an FFN
    /// origin that parts at `moe.combine` by trying the preset contracts
    /// and B classes on the matching terms (`explain.rs`); other explainers
    /// plug in through [`crate::LayerReport::explain_origins`].
    pub reproduced_under: Option<String>,
}

impl UnitResult {
    /// A reproduced unit that propagates an earlier difference: its inputs
    /// differ from the clean reference where measured, else it is
    /// downstream of an origin.
    pub fn propagates(&self) -> bool {
        self.status == Status::Reproduced && self.inputs_differ.unwrap_or(self.downstream_of.is_some())
    }
}

/// The whole layer replay.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerReport {
    /// The candidate trace.
    pub candidate: String,
    /// The model replayed against.
    pub model: String,
    pub precision: String,
    /// Contract of the reference.
    pub contract: String,
    /// Schedule of the reference.
    pub schedule: String,
    /// A fork in the binding that the reference leaves out.
    pub fork_ignored: Option<String>,
    /// Layers of the model.
    pub layers: u32,
    /// Every unit, in execution order.
    pub units: Vec<UnitResult>,
    /// Whether propagation was measured against a clean reference.
    pub measured_propagation: bool,
    /// The candidate's completeness when it lacks steps of its run (only
    /// the steps present were replayed).
    pub incomplete: Option<moeconf_schema::Completeness>,
}

impl LayerReport {
    /// Units with this status.
    pub fn count(&self, s: Status) -> usize {
        self.units.iter().filter(|u| u.status == s).count()
    }

    /// The origins, in execution order.
    pub fn origins(&self) -> impl Iterator<Item = &UnitResult> {
        self.units.iter().filter(|u| u.status == Status::Origin)
    }

    /// Reproduced units that propagate an earlier difference
    /// ([`UnitResult::propagates`]).
    pub fn propagated(&self) -> usize {
        self.units.iter().filter(|u| u.propagates()).count()
    }

    /// Every missing record, grouped by (record, payload_only): the steps
    /// that lack it, ascending.
    pub fn missing_summary(&self) -> Vec<(String, bool, Vec<u32>)> {
        let mut all: Vec<&Missing> = self.units.iter().flat_map(|u| u.missing.iter()).collect();
        all.sort();
        let mut out: Vec<(String, bool, Vec<u32>)> = Vec::new();
        for m in all {
            match out
                .iter_mut()
                .find(|(r, p, _)| *r == m.record && *p == m.payload_only)
            {
                Some((_, _, steps)) => {
                    if !steps.contains(&m.step) {
                        steps.push(m.step);
                    }
                }
                None => out.push((m.record.clone(), m.payload_only, vec![m.step])),
            }
        }
        for (_, _, s) in &mut out {
            s.sort_unstable();
        }
        out
    }

    /// Exit code: 1 when any origin exists; else 2 when some unit was not
    /// replayable or the candidate lacks steps of its run (unless
    /// `allow_incomplete`); else 0.
    pub fn exit_code(&self, allow_incomplete: bool) -> u8 {
        if self.count(Status::Origin) > 0 {
            1
        } else if (self.count(Status::NotReplayable) > 0 || self.incomplete.is_some()) && !allow_incomplete {
            2
        } else {
            0
        }
    }

    /// Fills [`UnitResult::reproduced_under`] of every origin with what
    /// `explain` says (the hook for contract inference: given an origin,
    /// the name of a contract under which the candidate's output is
    /// reproduced, or `None`).
    pub fn explain_origins(&mut self, explain: &dyn Fn(&UnitResult) -> Option<String>) {
        for u in self.units.iter_mut().filter(|u| u.status == Status::Origin) {
            u.reproduced_under = explain(u);
        }
    }

    /// The JSON document (docs/replay.md §4).
    pub fn to_json(&self, allow_incomplete: bool) -> Value {
        let missing: Vec<Value> = self
            .missing_summary()
            .into_iter()
            .map(|(r, p, steps)| json!({"record": r, "payload_only": p, "steps": steps}))
            .collect();
        json!({
            "kind": "moeconf.replay",
            "mode": "layers",
            "schema_version": REPLAY_SCHEMA_VERSION,
            "candidate": self.candidate,
            "model": self.model,
            "reference": {
                "precision": self.precision,
                "contract": self.contract,
                "schedule": self.schedule,
                "fork_ignored": self.fork_ignored,
            },
            "layers": self.layers,
            "measured_propagation": self.measured_propagation,
            "summary": {
                "units": self.units.len(),
                "reproduced": self.count(Status::Reproduced),
                "propagated": self.propagated(),
                "origins": self.count(Status::Origin),
                "not_replayable": self.count(Status::NotReplayable),
            },
            "exit_code": self.exit_code(allow_incomplete),
            "incomplete": crate::incomplete::json(&self.incomplete),
            "origins": self.origins().map(unit_json).collect::<Vec<_>>(),
            "missing": missing,
            "units": self.units.iter().map(unit_json).collect::<Vec<_>>(),
        })
    }
}

fn unit_id_json(u: &UnitId) -> Value {
    json!({"step": u.step, "layer": u.layer, "part": u.part.name()})
}

fn unit_json(u: &UnitResult) -> Value {
    json!({
        "step": u.unit.step,
        "layer": u.unit.layer,
        "part": u.unit.part.name(),
        "status": u.status.name(),
        "first_difference": u.first_difference.as_ref().map(|d| json!({
            "position": d.position, "record": d.record, "output": d.output,
        })),
        "absorbed": u.absorbed,
        "max_abs_diff": u.max_abs_diff,
        "compared": u.compared,
        "downstream_of": u.downstream_of.as_ref().map(unit_id_json),
        "inputs_differ": u.inputs_differ,
        "reproduced_under": u.reproduced_under,
        "missing": u.missing.iter().map(|m| json!({
            "record": m.record, "step": m.step, "position": m.position,
            "layer": m.layer, "payload_only": m.payload_only,
        })).collect::<Vec<_>>(),
    })
}
