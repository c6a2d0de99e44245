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

use std::borrow::Cow;
use std::collections::HashMap;

use moeconf_fingerprint::{record_digest, Coord, DType, Phase, RecordPath, TensorView};
use moeconf_reference_runtime::capture::Record;
use moeconf_schema::{IndexEntry, Trace};

use crate::error::{ReplayError, Result};

/// Records of a trace by (step, position, layer, path).
type Key = (u32, u32, Option<u32>, RecordPath);

/// The candidate trace with its index.
pub(crate) struct Candidate<'t> {
    pub trace: &'t Trace,
    index: HashMap<Key, usize>,
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

impl<'t> Candidate<'t> {
    /// Indexes every record of `trace` (a version 2 trace reads its whole
    /// index for it).
    pub fn new(trace: &'t Trace) -> Result<Candidate<'t>> {
        let records = trace.records().map_err(|source| ReplayError::Trace {
            path: trace.path().to_path_buf(),
            record: "the index".into(),
            source,
        })?;
        let index = records
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let c = &r.coord;
                ((c.step, c.position, c.layer, c.path.clone()), i)
            })
            .collect();
        Ok(Candidate { trace, index })
    }

    /// The index of the record at (step, position, layer, path).
    pub fn find(&self, step: u32, position: u32, layer: Option<u32>, path: &str) -> Option<usize> {
        self.index
            .get(&(step, position, layer, RecordPath::from(path)))
            .copied()
    }

    /// The index entry of record `i`.
    pub fn entry(&self, i: usize) -> Option<&IndexEntry> {
        self.trace.get_record(i)
    }

    fn record_err(&self, i: usize, what: String) -> ReplayError {
        ReplayError::Record {
            path: self.trace.path().to_path_buf(),
            record: self
                .entry(i)
                .map_or_else(|| format!("#{i}"), |e| e.coord.to_string()),
            what,
        }
    }

    /// The verified payload of record `i` (`None` without a payload).
    fn payload(&self, i: usize) -> Result<Option<&'t [u8]>> {
        self.trace
            .payload_verified(i)
            .map_err(|source| ReplayError::Trace {
                path: self.trace.path().to_path_buf(),
                record: self
                    .entry(i)
                    .map_or_else(|| format!("#{i}"), |e| e.coord.to_string()),
                source,
            })
    }

    /// The values of float record `i` as FP32 (exact: FP32 and BF16
    /// payloads always, FP64 only when every value is an FP32 value);
    /// `None` when the record kept no payload.
    pub fn floats(&self, i: usize) -> Result<Option<Vec<f32>>> {
        let Some(bytes) = self.payload(i)? else {
            return Ok(None);
        };
        let dtype = self.entry(i).map_or(DType::U8, |e| e.dtype);
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
                            i,
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
                    i,
                    format!("expected a float record, found dtype {}", other.name()),
                ))
            }
        };
        Ok(Some(out))
    }

    /// The integer values of record `i` (ids, counters); `None` without a payload.
    pub fn ints(&self, i: usize) -> Result<Option<Vec<i64>>> {
        let Some(bytes) = self.payload(i)? else {
            return Ok(None);
        };
        let dtype = self.entry(i).map_or(DType::U8, |e| e.dtype);
        if dtype.is_float() {
            return Err(self.record_err(
                i,
                format!("expected an integer record, found dtype {}", dtype.name()),
            ));
        }
        let n = bytes.len() / dtype.size();
        let mut v = Vec::with_capacity(n);
        for k in 0..n {
            match dtype.value_i64(bytes, k) {
                Some(x) => v.push(x),
                None => return Err(self.record_err(i, format!("element {k} does not decode"))),
            }
        }
        Ok(Some(v))
    }

    /// Compares the reference's record `r` with the candidate's record at
    /// the same coordinate (module docs).
    pub fn compare(&self, r: &Record) -> Result<Cmp> {
        let c = &r.coord;
        let Some(i) = self.find(c.step, c.position, c.layer, &c.path) else {
            return Ok(Cmp::Absent);
        };
        let Some(e) = self.entry(i) else {
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
