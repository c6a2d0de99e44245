//! The trace generator: small, root-consistent runs of a made-up MoE model,
//! drawn from an [`Unstructured`] byte source, and mutations of them.
//!
//! A [`TraceSpec`] is the content of one trace (header and records in
//! execution order), written with the project's own [`TraceWriter`]; its
//! records follow the catalogue (every path is a [`Component`], levels and
//! value kinds as the catalogue says, steps and phases as docs/format.md
//! §3.1), and derived records agree with what they derive from (top-k and
//! margin from the logits, the token from the argmax, `moe.combine` from the
//! terms and the shared expert), so that the consumers see realistic traces.
//! Sizes stay small (at most 3 steps, 2 layers, 2 prompt positions, hidden
//! size 4) so that one fuzz execution takes well under a millisecond.

use arbitrary::{Result, Unstructured};
use moeconf_fingerprint::{
    Algorithm, CanonPolicy, Component, Coord, DType, Level, LevelSet, Phase, TensorView,
};
use moeconf_schema::{
    Binding, CaptureSpec, Decoding, Header, PromptBinding, Provenance, TraceError, TraceWriter, WriteSummary,
    SMALL_RECORD_BYTES,
};
use std::path::Path;

/// One record of a generated trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub coord: Coord,
    /// Its level (the catalogue's).
    pub level: Level,
    pub dtype: DType,
    /// Logical shape.
    pub shape: Vec<u64>,
    /// Little-endian element bytes.
    pub bytes: Vec<u8>,
}

/// The content of one generated trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSpec {
    pub alg: Algorithm,
    /// Binding and provenance.
    pub header: Header,
    /// Records in execution order.
    pub records: Vec<Record>,
    /// Container format version it is written in (1, 2 or 3, the default).
    pub version: u32,
}

/// What the generator must include.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenOptions {
    /// Levels always captured (with payloads) besides the drawn ones.
    pub levels: LevelSet,
    /// A long prompt: this many prompt positions and one layer instead of
    /// the drawn 1–2 positions and 1–2 layers, so that step 0's per-layer
    /// groups hold thousands of records (format version 4 pages a group
    /// longer than 128 KiB: about 4,100 records; [`crate::paged`]).
    /// `None` draws as before, consuming the same bytes.
    pub prompt: Option<u32>,
}

/// The dimensions of one generated run.
struct Dims {
    steps: u32,
    layers: u32,
    prompt: u32,
    hidden: usize,
    vocab: usize,
    experts: usize,
    k: usize,
}

/// One float from one byte: mostly small multiples of 1/8, sometimes a
/// special value (NaN, ±inf, -0, a subnormal, extremes).
fn float(u: &mut Unstructured<'_>) -> Result<f32> {
    let b: u8 = u.arbitrary()?;
    Ok(match b {
        0..=243 => (f32::from(b) - 122.0) / 8.0,
        244 => f32::NAN,
        245 => f32::INFINITY,
        246 => f32::NEG_INFINITY,
        247 => -0.0,
        248 => f32::from_bits(1),
        249 => f32::MAX,
        250 => 1e-30,
        251 => -1e30,
        252 => 0.1,
        253 => 1.0 + f32::EPSILON,
        254 => 1.0,
        _ => 0.0,
    })
}

fn floats(u: &mut Unstructured<'_>, n: usize) -> Result<Vec<f32>> {
    (0..n).map(|_| float(u)).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Ids sorted by value, descending, ties (and NaN) to the lower id.
fn ranked(logits: &[f32]) -> Vec<usize> {
    let key = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    ids.sort_by(|&a, &b| key(logits[b]).total_cmp(&key(logits[a])).then(a.cmp(&b)));
    ids
}

/// Appends records to a spec under construction.
struct Builder {
    records: Vec<Record>,
    levels: LevelSet,
}

impl Builder {
    fn push(
        &mut self,
        c: Component,
        at: (u32, u32, Option<u32>),
        dtype: DType,
        shape: &[u64],
        bytes: Vec<u8>,
    ) {
        self.push_path(c.level(), c.path().to_string(), at, dtype, shape, bytes);
    }

    fn push_path(
        &mut self,
        level: Level,
        path: String,
        (step, position, layer): (u32, u32, Option<u32>),
        dtype: DType,
        shape: &[u64],
        bytes: Vec<u8>,
    ) {
        if !self.levels.contains(level) {
            return;
        }
        let phase = if step == 0 { Phase::Prefill } else { Phase::Decode };
        self.records.push(Record {
            coord: Coord {
                step,
                position,
                phase,
                layer,
                path: path.as_str().into(),
            },
            level,
            dtype,
            shape: shape.to_vec(),
            bytes,
        });
    }

    fn floats(
        &mut self,
        u: &mut Unstructured<'_>,
        c: Component,
        at: (u32, u32, Option<u32>),
        shape: &[u64],
    ) -> Result<()> {
        let n = shape.iter().product::<u64>() as usize;
        let v = floats(u, n)?;
        self.push(c, at, DType::F32, shape, f32_bytes(&v));
        Ok(())
    }

    /// One layer at one position: attention output, layer states, routing,
    /// routed terms, shared expert and their combine.
    fn layer(&mut self, u: &mut Unstructured<'_>, d: &Dims, at: (u32, u32, Option<u32>)) -> Result<()> {
        let h = d.hidden as u64;
        self.floats(u, Component::AttnOutput, at, &[h])?;
        self.floats(u, Component::LayerPostAttnMhc, at, &[2, h])?;
        let scores = floats(u, d.experts)?;
        let order = ranked(&scores);
        self.push(
            Component::RouterScores,
            at,
            DType::F32,
            &[d.experts as u64],
            f32_bytes(&scores),
        );
        let topk: Vec<i32> = order[..d.k].iter().map(|&e| e as i32).collect();
        self.push(
            Component::RouterTopk,
            at,
            DType::I32,
            &[d.k as u64],
            i32_bytes(&topk),
        );
        self.floats(u, Component::RouterGates, at, &[d.k as u64])?;
        let margin = match order.get(d.k) {
            Some(&next) => scores[order[d.k - 1]] - scores[next],
            None => f32::INFINITY,
        };
        self.push(
            Component::RouterMargin,
            at,
            DType::F32,
            &[1],
            f32_bytes(&[margin]),
        );
        let mut combine = vec![0f32; d.hidden];
        for j in 0..d.k {
            let t = floats(u, d.hidden)?;
            combine.iter_mut().zip(&t).for_each(|(c, x)| *c += x);
            let path = Component::MoeTerm.indexed_path(j as u32);
            self.push_path(Level::L4, path, at, DType::F32, &[h], f32_bytes(&t));
        }
        let shared = floats(u, d.hidden)?;
        combine.iter_mut().zip(&shared).for_each(|(c, x)| *c += x);
        self.push(Component::MoeShared, at, DType::F32, &[h], f32_bytes(&shared));
        self.push(Component::MoeCombine, at, DType::F32, &[h], f32_bytes(&combine));
        self.floats(u, Component::LayerPostFfnMhc, at, &[2, h])
    }

    /// The step's outputs at its last position: logits, top-k, margin, token, text.
    fn outputs(
        &mut self,
        u: &mut Unstructured<'_>,
        d: &Dims,
        step: u32,
        last: u32,
        text: &mut Vec<u8>,
    ) -> Result<()> {
        let at = (step, last, None);
        let logits = floats(u, d.vocab)?;
        let order = ranked(&logits);
        let t = order.len().min(8);
        self.push(
            Component::LmLogits,
            at,
            DType::F32,
            &[d.vocab as u64],
            f32_bytes(&logits),
        );
        let ids: Vec<i32> = order[..t].iter().map(|&i| i as i32).collect();
        let top: Vec<f32> = order[..t].iter().map(|&i| logits[i]).collect();
        self.push(Component::LmTopkIds, at, DType::I32, &[t as u64], i32_bytes(&ids));
        self.push(
            Component::LmTopkLogits,
            at,
            DType::F32,
            &[t as u64],
            f32_bytes(&top),
        );
        let margin = if t > 1 { top[0] - top[1] } else { f32::INFINITY };
        self.push(Component::LmMargin, at, DType::F32, &[1], f32_bytes(&[margin]));
        self.push(Component::TokenOutput, at, DType::I32, &[1], i32_bytes(&ids[..1]));
        // Mostly ASCII, sometimes any byte (text need not be valid UTF-8 in a trace).
        let n = u.int_in_range(0..=3)?;
        for _ in 0..n {
            let b: u8 = u.arbitrary()?;
            text.push(if b < 200 { b'a' + b % 26 } else { b });
        }
        self.push(
            Component::TextContinuation,
            at,
            DType::U8,
            &[text.len() as u64],
            text.clone(),
        );
        Ok(())
    }

    /// Persistent state of every layer at the decode boundary after `last`.
    fn state(&mut self, u: &mut Unstructured<'_>, d: &Dims, step: u32, last: u32) -> Result<()> {
        for layer in 0..d.layers {
            let at = (step, last, Some(layer));
            let len = i64::from(last) + 1;
            self.push(
                Component::StateCumulativeLength,
                at,
                DType::I64,
                &[1],
                len.to_le_bytes().to_vec(),
            );
            let w = (last + 1).min(2) as u64;
            self.floats(u, Component::StateWindowKv, at, &[w, d.hidden as u64])?;
        }
        Ok(())
    }
}

impl TraceSpec {
    /// Draws a trace: dimensions, binding, captured levels and payload
    /// levels, then every record of every step in execution order.
    pub fn generate(u: &mut Unstructured<'_>, opts: GenOptions) -> Result<TraceSpec> {
        let d = Dims {
            steps: u.int_in_range(1..=3)?,
            layers: match opts.prompt {
                Some(_) => 1,
                None => u.int_in_range(1..=2)?,
            },
            prompt: match opts.prompt {
                Some(p) => p.max(1),
                None => u.int_in_range(1..=2)?,
            },
            hidden: u.int_in_range(1..=4)?,
            vocab: u.int_in_range(2..=10)?,
            experts: u.int_in_range(1..=4)?,
            k: 1,
        };
        let d = Dims {
            k: u.int_in_range(1..=d.experts)?,
            ..d
        };
        let levels = LevelSet::of_mask(u.int_in_range(1..=31u8)?).union(opts.levels);
        let payload_levels = LevelSet::of_mask(u.int_in_range(0..=31u8)?).union(opts.levels);
        let alg = if u.ratio(1, 8)? {
            Algorithm::Sha256
        } else {
            Algorithm::Blake3
        };
        let prompt: Vec<u32> = (0..d.prompt)
            .map(|_| u.int_in_range(0..=9))
            .collect::<Result<_>>()?;
        let binding = Binding {
            prompt: PromptBinding {
                text: "fuzz".into(),
                ids: prompt.clone(),
            },
            decoding: Decoding {
                strategy: "greedy".into(),
                max_new_tokens: d.steps + u.int_in_range(0..=1)?,
            },
            precision: (*u.choose(&["bf16", "f32"])?).into(),
            contract: "native".into(),
            schedule: "identity".into(),
            capture: CaptureSpec {
                levels,
                payload_levels,
            },
            canon: CanonPolicy {
                fold_negative_zero: u.ratio(1, 8)?,
            },
            ..Binding::default()
        };
        let header = Header {
            binding,
            provenance: Provenance {
                runtime: "moeconf-testkit".into(),
                ..Provenance::default()
            },
        };
        let mut b = Builder {
            records: Vec::new(),
            levels,
        };
        let mut text = Vec::new();
        for step in 0..d.steps {
            let positions: Vec<u32> = match step {
                0 => (0..d.prompt).collect(),
                s => vec![d.prompt + s - 1],
            };
            let ids: Vec<i32> = match step {
                0 => prompt.iter().map(|&x| x as i32).collect(),
                _ => vec![u.int_in_range(0..=9)?],
            };
            let n = ids.len() as u64;
            b.push(
                Component::TokenInput,
                (step, positions[0], None),
                DType::I32,
                &[n],
                i32_bytes(&ids),
            );
            for layer in 0..d.layers {
                for &p in &positions {
                    b.layer(u, &d, (step, p, Some(layer)))?;
                }
            }
            let last = *positions.last().unwrap_or(&0);
            b.outputs(u, &d, step, last, &mut text)?;
            b.state(u, &d, step, last)?;
        }
        // Drawn last, so that the drawn content is the same in both versions.
        let version = if u.ratio(1, 4)? {
            1
        } else if u.arbitrary()? {
            3
        } else {
            2
        };
        Ok(TraceSpec {
            alg,
            header,
            records: b.records,
            version,
        })
    }

    /// Whether record `r` keeps its payload: its level's payload bit, or a
    /// small record (as every moeconf writer does).
    pub fn keeps_payload(&self, r: &Record) -> bool {
        self.header.binding.capture.keeps_payload(r.level) || r.bytes.len() <= SMALL_RECORD_BYTES
    }

    /// Writes the trace with the project's writer ([`TraceWriter`]) in its
    /// container format version.
    pub fn write(&self, path: &Path) -> std::result::Result<WriteSummary, TraceError> {
        let out = moeconf_output::check_output(path, &moeconf_output::Inputs::new())?;
        let mut w = TraceWriter::create_version(&out, self.alg, self.header.clone(), self.version)?;
        w.set_parallel_hashing(false);
        for r in &self.records {
            let view = TensorView {
                dtype: r.dtype,
                shape: &r.shape,
                bytes: &r.bytes,
            };
            w.append(r.coord.clone(), r.level, view, self.keeps_payload(r))?;
        }
        w.finish()
    }

    /// The levels this spec holds records of.
    pub fn held_levels(&self) -> LevelSet {
        self.records.iter().map(|r| r.level).collect()
    }
}
