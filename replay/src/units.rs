//! The units of a layer replay and the steps they belong to.
//!
//! A unit is everything one (step, layer, half) computes over all the
//! positions of the step — the attention half reads and updates the layer's
//! persistent state position by position, so its positions replay in
//! order, from the state of the previous decode boundary — plus, per step,
//! the embedding (when `embed.output` is captured) and the head (when
//! `lm.logits` is captured). Units are independent of each other: each
//! reads only the candidate's captured values.

use moeconf_fingerprint::{Component, Half, Level, LevelSet};
use moeconf_schema::Trace;

use crate::candidate::Candidate;
use crate::error::{ReplayError, Result};

/// What a unit computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Part {
    /// The embedding of the step's ids (`embed.output`).
    Embed,
    /// The attention half of a layer (ends in `layer.post_attn_mhc`; also
    /// writes the layer's persistent state).
    Attention,
    /// The FFN half of a layer (ends in `layer.post_ffn_mhc`).
    Ffn,
    /// The head at the step's last position (`lm.logits`).
    Head,
}

impl Part {
    /// `embed`, `attention`, `ffn`, `head`.
    pub fn name(self) -> &'static str {
        match self {
            Part::Embed => "embed",
            Part::Attention => Half::Attention.name(),
            Part::Ffn => Half::Ffn.name(),
            Part::Head => "head",
        }
    }
}

/// One replay unit: a step, a layer (`None` for embed and head) and a part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UnitId {
    /// Forward step.
    pub step: u32,
    /// Decoder layer (attention and FFN units).
    pub layer: Option<u32>,
    pub part: Part,
}

impl UnitId {
    /// The key of the unit in execution order: by step; within a step the
    /// embedding, then layer by layer the attention then the FFN half, then
    /// the head (the diff's order, docs/operators.md §3).
    pub fn exec_key(&self) -> (u32, u64) {
        let slot = match (self.part, self.layer) {
            (Part::Embed, _) => 0,
            (Part::Attention, Some(l)) => 1 + 2 * u64::from(l),
            (Part::Ffn, Some(l)) => 2 + 2 * u64::from(l),
            _ => u64::MAX,
        };
        (self.step, slot)
    }
}

impl std::fmt::Display for UnitId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layer {
            Some(l) => write!(f, "step {} layer {l} {}", self.step, self.part.name()),
            None => write!(f, "step {} {}", self.step, self.part.name()),
        }
    }
}

/// One forward step of the candidate: its positions and the ids it consumed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StepInfo {
    /// Forward step.
    pub step: u32,
    /// First absolute position.
    pub first: u32,
    /// Number of positions (the prompt length for step 0, else 1).
    pub count: u32,
    /// The ids consumed (`token.input`), `None` if not captured.
    pub ids: Option<Vec<u32>>,
}

impl StepInfo {
    pub fn positions(&self) -> std::ops::Range<u32> {
        self.first..self.first + self.count
    }

    /// The last position (where the head runs and the state is recorded).
    pub fn last(&self) -> u32 {
        self.first + self.count - 1
    }

    /// The id consumed at `position`, if known.
    pub fn token(&self, position: u32) -> Option<u32> {
        let i = position.checked_sub(self.first)? as usize;
        self.ids.as_ref()?.get(i).copied()
    }
}

/// The steps of the candidate: every step some record belongs to, with
/// positions from the binding's prompt (step 0 consumes the prompt, step
/// s ≥ 1 position P + s − 1) and ids from `token.input`.
pub(crate) fn steps(cand: &Candidate<'_>) -> Result<Vec<StepInfo>> {
    let trace: &Trace = cand.trace;
    let p = trace.binding().prompt.ids.len() as u32;
    if p == 0 {
        return Err(ReplayError::Capture {
            path: trace.path().to_path_buf(),
            what: "the binding holds no prompt ids".into(),
        });
    }
    let ids: Vec<u32> = trace.steps().iter().map(|s| s.step).collect();
    let mut out = Vec::with_capacity(ids.len());
    for step in ids {
        let (first, count) = if step == 0 { (0, p) } else { (p + step - 1, 1) };
        let tokens = match cand.find(step, first, None, Component::TokenInput.path())? {
            Some(f) => cand.ints(&f)?.map(|v| {
                v.into_iter()
                    .map(|x| u32::try_from(x).unwrap_or(u32::MAX))
                    .collect::<Vec<u32>>()
            }),
            None => None,
        };
        let tokens = tokens.filter(|t| t.len() == count as usize);
        out.push(StepInfo {
            step,
            first,
            count,
            ids: tokens,
        });
    }
    Ok(out)
}

/// Every unit of the candidate in execution order: per step the embedding
/// (if L4 is captured), each layer's two halves, the head (if L1 is
/// captured).
pub(crate) fn units(steps: &[StepInfo], layers: u32, levels: LevelSet) -> Vec<UnitId> {
    let mut out = Vec::new();
    for st in steps {
        let s = st.step;
        if levels.contains(Level::L4) {
            out.push(UnitId {
                step: s,
                layer: None,
                part: Part::Embed,
            });
        }
        for l in 0..layers {
            for part in [Part::Attention, Part::Ffn] {
                out.push(UnitId {
                    step: s,
                    layer: Some(l),
                    part,
                });
            }
        }
        if levels.contains(Level::L1) {
            out.push(UnitId {
                step: s,
                layer: None,
                part: Part::Head,
            });
        }
    }
    out
}
