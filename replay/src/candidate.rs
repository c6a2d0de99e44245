//! The candidate trace as replay reads it: records by coordinate, payloads
//! decoded to the reference's FP32, and the comparison of a reference
//! record with the candidate's record at the same coordinate.
//!
//! Comparison is bitwise through the record digest: the reference's values
//! are converted *exactly* into the candidate's dtype (FP32 to BF16 only
//! when every value is BF16-representable, FP32 to FP64 always, integers
//! when they fit) and digested under the candidate's coordinate, level,
//! digest algorithm and canonicalization policy; equal digests mean equal
//! canonical bytes. So a comparison needs no candidate payload: L4
//! fingerprints are enough to name the operator where a half-layer parts.
//!
//! **Streaming.** The candidate's index is not read whole: a record is
//! looked up in its (step, level, layer) group, which is read from the
//! trace the first time a lookup needs it (verified against its digest in
//! the step node, [`Trace::read_group`]), held here, and dropped when the
//! replay has moved past it ([`Candidate::retain`]). So memory follows the
//! groups the units in flight read, not the whole trace. A record is
//! looked for at its path's catalogue level first
//! ([`moeconf_fingerprint::level_of_path`]), then at the step's other
//! levels. [`Candidate::whole`] keeps the former whole-index lookup (every
//! record of the trace in one map), against which the streamed one is
//! tested.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use moeconf_fingerprint::catalogue::level_of_path;
use moeconf_fingerprint::{record_digest, Coord, DType, Level, Phase, RecordPath, TensorView};
use moeconf_reference_runtime::capture::Record;
use moeconf_schema::{HeldRecord, IndexEntry, Trace, TraceError};

use crate::error::{ReplayError, Result};

/// Records of a trace by (step, position, layer, path).
type Key = (u32, u32, Option<u32>, RecordPath);

/// A group of the trace: (step, level code, layer).
type GroupKey = (u32, u32, Option<u32>);

/// The records of one group, sorted by (position, path), one per key.
pub(crate) struct Held {
    records: Vec<HeldRecord>,
}

/// The lookup key of a held record.
fn held_key(r: &HeldRecord) -> (u32, &str) {
    let c = &r.entry().coord;
    (c.position, c.path.as_str())
}

impl Held {
    /// `records` (a group, in canonical tree order) ready for lookup. A
    /// group's records are strictly ascending by (position, path) (the
    /// reader checks the canonical order; a step has one phase); should two
    /// share a key anyway, the later in write order is kept, as the whole
    /// index's map keeps it.
    fn new(mut records: Vec<HeldRecord>) -> Held {
        let sorted = records.windows(2).all(|w| held_key(&w[0]) < held_key(&w[1]));
        if !sorted {
            records.sort_by(|a, b| held_key(a).cmp(&held_key(b)).then_with(|| b.id().cmp(&a.id())));
            records.dedup_by(|b, a| held_key(a) == held_key(b));
        }
        records.shrink_to_fit();
        Held { records }
    }

    fn find(&self, position: u32, path: &str) -> Option<usize> {
        self.records
            .binary_search_by(|r| held_key(r).cmp(&(position, path)))
            .ok()
    }
}

/// How the candidate's records are looked up.
enum Index {
    /// Every record of the trace in one map (the former path).
    Whole(HashMap<Key, usize>),
    /// The groups read so far and not dropped yet.
    Streamed(Mutex<HashMap<GroupKey, Arc<Held>>>),
}

/// The candidate trace with its index.
pub(crate) struct Candidate<'t> {
    pub trace: &'t Trace,
    index: Index,
    /// The most records held at once.
    peak: AtomicUsize,
}

/// A record of the candidate found by [`Candidate::find`] (it keeps its
/// group in memory while it lives).
#[derive(Clone)]
pub(crate) enum Found<'t> {
    /// A record of the whole index: its id and entry.
    Whole(usize, &'t IndexEntry),
    /// The `k`-th record of a held group.
    Held(Arc<Held>, usize),
}

impl Found<'_> {
    /// The record's entry.
    pub fn entry(&self) -> Option<&IndexEntry> {
        match self {
            Found::Whole(_, e) => Some(e),
            Found::Held(g, k) => g.records.get(*k).map(HeldRecord::entry),
        }
    }
}

/// How a reference record compares with the candidate's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cmp {
    /// Bitwise equal (equal record digests).
    Same,
    /// Different values, shape or a value the candidate's dtype cannot hold.
    Differs,
    /// The candidate has no record at this coordinate.
    Absent,
}

/// The phase of forward step `step`.
pub(crate) fn phase(step: u32) -> Phase {
    if step == 0 {
        Phase::Prefill
    } else {
        Phase::Decode
    }
}

/// A coordinate of a replayed record.
pub(crate) fn coord(step: u32, position: u32, layer: Option<u32>, path: &str) -> Coord {
    Coord {
        step,
        position,
        phase: phase(step),
        layer,
        path: path.into(),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<'t> Candidate<'t> {
    /// The candidate, its records read group by group as lookups need them
    /// (module docs): nothing is read yet.
    pub fn new(trace: &'t Trace) -> Candidate<'t> {
        Candidate {
            trace,
            index: Index::Streamed(Mutex::new(HashMap::new())),
            peak: AtomicUsize::new(0),
        }
    }

    /// The candidate with every record of `trace` indexed at once (a
    /// version 2 trace reads its whole index for it): memory grows with
    /// the whole trace. Kept to test the streamed lookup against.
    pub fn whole(trace: &'t Trace) -> Result<Candidate<'t>> {
        let records = trace.records().map_err(|source| ReplayError::Trace {
            path: trace.path().to_path_buf(),
            record: "the index".into(),
            source,
        })?;
        let index: HashMap<Key, usize> = records
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let c = &r.coord;
                ((c.step, c.position, c.layer, c.path.clone()), i)
            })
            .collect();
        Ok(Candidate {
            trace,
            peak: AtomicUsize::new(index.len()),
            index: Index::Whole(index),
        })
    }

    fn trace_err(&self, record: String, source: TraceError) -> ReplayError {
        ReplayError::Trace {
            path: self.trace.path().to_path_buf(),
            record,
            source,
        }
    }

    /// The group (step, level, layer) `g`, from memory or read now.
    fn held(&self, key: GroupKey, g: &moeconf_schema::GroupNode) -> Result<Option<Arc<Held>>> {
        let Index::Streamed(groups) = &self.index else {
            return Ok(None);
        };
        if let Some(h) = lock(groups).get(&key) {
            return Ok(Some(Arc::clone(h)));
        }
        // Read outside the lock: another unit's lookups go on meanwhile (two
        // units asking for the same group at once both read it; one is kept).
        let records = self.trace.read_group(g).map_err(|source| {
            self.trace_err(
                format!("the records of step {} level {} layer {:?}", key.0, key.1, key.2),
                source,
            )
        })?;
        let held = Arc::new(Held::new(records));
        let mut groups = lock(groups);
        let held = Arc::clone(groups.entry(key).or_insert(held));
        let now = groups.values().map(|h| h.records.len()).sum();
        self.peak.fetch_max(now, Ordering::Relaxed);
        Ok(Some(held))
    }

    /// The record at (step, position, layer, path).
    pub fn find(
        &self,
        step: u32,
        position: u32,
        layer: Option<u32>,
        path: &str,
    ) -> Result<Option<Found<'t>>> {
        if let Index::Whole(index) = &self.index {
            let found = index
                .get(&(step, position, layer, RecordPath::from(path)))
                .and_then(|&i| Some(Found::Whole(i, self.trace.get_record(i)?)));
            return Ok(found);
        }
        let node = self
            .trace
            .step(step)
            .map_err(|source| self.trace_err(format!("step {step}'s node"), source))?;
        let Some(node) = node else {
            return Ok(None);
        };
        let first = level_of_path(path);
        let levels = first
            .into_iter()
            .chain(node.levels.iter().map(|l| l.level).filter(|l| Some(*l) != first));
        for level in levels {
            let Some(g) = node.level(level).and_then(|n| n.group(layer)) else {
                continue;
            };
            let Some(held) = self.held((step, level.code(), layer), g)? else {
                continue;
            };
            if let Some(k) = held.find(position, path) {
                return Ok(Some(Found::Held(held, k)));
            }
        }
        Ok(None)
    }

    /// Drops every held group whose (step, layer) `keep` refuses (a later
    /// lookup reads it again).
    /// The pages of a dropped group's payloads leave the resident set of a
    /// mapped trace ([`Trace::release_held`]).
    pub fn retain(&self, keep: impl Fn(u32, Option<u32>, Level) -> bool) {
        if let Index::Streamed(groups) = &self.index {
            let mut dropped = Vec::new();
            lock(groups).retain(|&(step, level, layer), h| {
                let k = Level::from_code(level).is_none_or(|level| keep(step, layer, level));
                if !k {
                    dropped.push(Arc::clone(h));
                }
                k
            });
            for h in dropped {
                self.trace.release_held(&h.records);
            }
        }
    }

    /// The most records held in memory at once so far (the streamed
    /// lookup's groups; the whole index's every record).
    pub fn peak_records(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    fn record_err(&self, f: &Found<'_>, what: String) -> ReplayError {
        ReplayError::Record {
            path: self.trace.path().to_path_buf(),
            record: f.entry().map_or_else(|| "?".to_string(), |e| e.coord.to_string()),
            what,
        }
    }

    /// The verified payload of `f` (`None` without a payload).
    fn payload(&self, f: &Found<'_>) -> Result<Option<&'t [u8]>> {
        let trace: &'t Trace = self.trace;
        let r = match f {
            Found::Whole(i, _) => trace.payload_verified(*i),
            Found::Held(g, k) => match g.records.get(*k) {
                Some(r) => trace.held_payload(r),
                None => Ok(None),
            },
        };
        r.map_err(|source| {
            self.trace_err(
                f.entry().map_or_else(|| "?".to_string(), |e| e.coord.to_string()),
                source,
            )
        })
    }

    /// The values of float record `f` as FP32 (exact: FP32 and BF16
    /// payloads always, FP64 only when every value is an FP32 value);
    /// `None` when the record kept no payload.
    pub fn floats(&self, f: &Found<'_>) -> Result<Option<Vec<f32>>> {
        let Some(bytes) = self.payload(f)? else {
            return Ok(None);
        };
        let dtype = f.entry().map_or(DType::U8, |e| e.dtype);
        let out: Vec<f32> = match dtype {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|c| moeconf_fingerprint::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            DType::F64 => {
                let mut v = Vec::with_capacity(bytes.len() / 8);
                for c in bytes.chunks_exact(8) {
                    let x = f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
                    let y = x as f32;
                    if f64::from(y).to_bits() != x.to_bits() && !x.is_nan() {
                        return Err(self.record_err(
                            f,
                            "an f64 value is not an f32 value, so the reference cannot be fed it exactly"
                                .into(),
                        ));
                    }
                    v.push(y);
                }
                v
            }
            other => {
                return Err(self.record_err(
                    f,
                    format!("expected a float record, found dtype {}", other.name()),
                ))
            }
        };
        Ok(Some(out))
    }

    /// The integer values of record `f` (ids, counters); `None` without a payload.
    pub fn ints(&self, f: &Found<'_>) -> Result<Option<Vec<i64>>> {
        let Some(bytes) = self.payload(f)? else {
            return Ok(None);
        };
        let dtype = f.entry().map_or(DType::U8, |e| e.dtype);
        if dtype.is_float() {
            return Err(self.record_err(
                f,
                format!("expected an integer record, found dtype {}", dtype.name()),
            ));
        }
        let n = bytes.len() / dtype.size();
        let mut v = Vec::with_capacity(n);
        for k in 0..n {
            match dtype.value_i64(bytes, k) {
                Some(x) => v.push(x),
                None => return Err(self.record_err(f, format!("element {k} does not decode"))),
            }
        }
        Ok(Some(v))
    }

    /// Compares the reference's record `r` with the candidate's record at
    /// the same coordinate (module docs).
    pub fn compare(&self, r: &Record) -> Result<Cmp> {
        let c = &r.coord;
        let Some(found) = self.find(c.step, c.position, c.layer, &c.path)? else {
            return Ok(Cmp::Absent);
        };
        let Some(e) = found.entry() else {
            return Ok(Cmp::Absent);
        };
        if *e.shape != *r.shape {
            return Ok(Cmp::Differs);
        }
        let Some(bytes) = convert(r.dtype, &r.bytes, e.dtype) else {
            return Ok(Cmp::Differs);
        };
        let view = TensorView {
            dtype: e.dtype,
            shape: &e.shape,
            bytes: &bytes,
        };
        let d = record_digest(
            self.trace.algorithm(),
            self.trace.binding().canon,
            &e.coord,
            e.level,
            view,
        )
        .map_err(|source| ReplayError::Digest {
            record: e.coord.to_string(),
            source,
        })?;
        Ok(if d == e.digest { Cmp::Same } else { Cmp::Differs })
    }
}

/// Which groups a unit reads: (step, layer, level), level `None` for
/// every level of the (step, layer).
pub(crate) type Reads = (u32, Option<u32>, Option<Level>);

/// The groups a unit reads: its own (step, layer), its input's and, for an
/// attention half after the prefill, its layer's state (level L2) at the
/// previous step; `layer = None` for the model-global records.
pub(crate) fn reads(u: &crate::units::UnitId, last_layer: u32) -> Vec<Reads> {
    use crate::units::Part;
    let s = u.step;
    match (u.part, u.layer) {
        (Part::Attention, Some(l)) => {
            let mut v = vec![(s, Some(l), None), (s, l.checked_sub(1), None)];
            if let Some(p) = s.checked_sub(1) {
                v.push((p, Some(l), Some(Level::L2)));
            }
            v
        }
        (Part::Ffn, Some(l)) => vec![(s, Some(l), None)],
        (Part::Head, _) => vec![(s, Some(last_layer), None), (s, None, None)],
        _ => vec![(s, None, None)],
    }
}

/// `bytes` of dtype `from` converted exactly into `to`, or `None` when
/// some value has no exact representation in `to` (or the pair is not a
/// conversion replay knows).
pub(crate) fn convert(from: DType, bytes: &[u8], to: DType) -> Option<Cow<'_, [u8]>> {
    if from == to {
        return Some(Cow::Borrowed(bytes));
    }
    convert_owned(from, bytes, to).map(Cow::Owned)
}

/// [`convert`] between two different dtypes.
fn convert_owned(from: DType, bytes: &[u8], to: DType) -> Option<Vec<u8>> {
    let f32s = || {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
    };
    match (from, to) {
        (DType::F32, DType::BF16) => {
            let mut out = Vec::with_capacity(bytes.len() / 2);
            for x in f32s() {
                let b = x.to_bits();
                if b & 0xffff != 0 && !x.is_nan() {
                    return None;
                }
                out.extend_from_slice(&((b >> 16) as u16).to_le_bytes());
            }
            Some(out)
        }
        (DType::F32, DType::F64) => Some(f32s().flat_map(|x| f64::from(x).to_le_bytes()).collect()),
        (DType::I32, DType::I64) => Some(
            bytes
                .chunks_exact(4)
                .flat_map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes())
                .collect(),
        ),
        (DType::I64, DType::I32) => {
            let mut out = Vec::with_capacity(bytes.len() / 2);
            for c in bytes.chunks_exact(8) {
                let v = i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
                out.extend_from_slice(&i32::try_from(v).ok()?.to_le_bytes());
            }
            Some(out)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_are_exact_or_refused() {
        let b = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        // 1.5 is a BF16 value; 1.0 + 2^-20 is not.
        assert_eq!(
            convert(DType::F32, &b(&[1.5]), DType::BF16),
            Some(Cow::Owned(0x3fc0u16.to_le_bytes().to_vec()))
        );
        assert_eq!(
            convert(DType::F32, &b(&[1.0 + 2f32.powi(-20)]), DType::BF16),
            None
        );
        assert_eq!(
            convert(DType::F32, &b(&[0.1]), DType::F64),
            Some(Cow::Owned(f64::from(0.1f32).to_le_bytes().to_vec()))
        );
        let big = (i64::from(i32::MAX) + 1).to_le_bytes();
        assert_eq!(convert(DType::I64, &big, DType::I32), None);
        assert_eq!(convert(DType::F32, &b(&[1.0]), DType::I32), None);
    }
}
