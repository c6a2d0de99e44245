//! Mutations of a generated trace (a candidate that differs from its
//! reference in drawn ways) and of written trace bytes (one flipped payload
//! bit behind valid checksums).

use crate::gen::{Record, TraceSpec};
use arbitrary::{Result, Unstructured};
use moeconf_fingerprint::{Coord, DType, Level, LevelSet};
use moeconf_schema::{IndexEntry, Trace};

/// Every record of a trace the project's writer wrote (its whole index): a
/// trace that opened must give it, so a failure is an oracle failure.
pub fn all_records(t: &Trace) -> &[IndexEntry] {
    match t.records() {
        Ok(r) => r,
        Err(e) => panic!("the index of an opened trace is unreadable: {e}"),
    }
}

/// Applies 0–3 drawn mutations to a copy of `spec`: change a byte of a
/// record, drop a record, a step or a level, drop every record, shorten a
/// float record, duplicate a record at a new layer, change the precision
/// (a non-refusing binding field) or the prompt (a refusing one). With no
/// mutation the candidate is the same content as the reference.
pub fn mutate(u: &mut Unstructured<'_>, spec: &TraceSpec) -> Result<TraceSpec> {
    let mut c = spec.clone();
    for _ in 0..u.int_in_range(0..=3)? {
        let n = c.records.len();
        match u.int_in_range(0..=9u8)? {
            0..=2 if n > 0 => {
                let r = &mut c.records[u.choose_index(n)?];
                if !r.bytes.is_empty() {
                    let i = u.choose_index(r.bytes.len())?;
                    r.bytes[i] = u.arbitrary()?;
                }
            }
            3 if n > 0 => {
                c.records.remove(u.choose_index(n)?);
            }
            4 => {
                let last = c.records.iter().map(|r| r.coord.step).max().unwrap_or(0);
                c.records.retain(|r| r.coord.step != last);
            }
            5 => {
                let l = Level::ALL[u.choose_index(5)?];
                c.records.retain(|r| r.level != l);
            }
            6 if u.ratio(1, 4)? => c.records.clear(),
            7 if n > 0 => shorten(&mut c.records[u.choose_index(n)?]),
            8 if n > 0 => {
                // Right after its source, in the same step (format version 2
                // takes records step by step).
                let at = u.choose_index(n)?;
                let mut r = c.records[at].clone();
                if let Some(l) = r.coord.layer {
                    r.coord = Coord {
                        layer: Some(l + 2),
                        ..r.coord
                    };
                    c.records.insert(at + 1, r);
                }
            }
            9 => {
                let b = &mut c.header.binding;
                if u.arbitrary()? {
                    b.precision = format!("{}-x", b.precision);
                } else {
                    b.prompt.text.push('!');
                }
            }
            _ => {}
        }
    }
    Ok(c)
}

/// Drops the last element of a float vector record.
fn shorten(r: &mut Record) {
    if r.dtype == DType::F32 && r.shape.len() == 1 && r.shape[0] > 1 {
        r.shape[0] -= 1;
        r.bytes.truncate(r.bytes.len() - 4);
    }
}

/// Flips one drawn bit of one drawn payload byte of `bytes` (the file of
/// `trace`). Returns the index of the record whose payload was changed, or
/// `None` when the trace keeps no payload byte. Checksums and the root stay
/// valid: payloads are covered only by their record digests.
pub fn flip_payload_bit(u: &mut Unstructured<'_>, trace: &Trace, bytes: &mut [u8]) -> Result<Option<usize>> {
    let with: Vec<usize> = (0..all_records(trace).len())
        .filter(|&i| all_records(trace)[i].payload.is_some_and(|p| p.len > 0))
        .collect();
    if with.is_empty() {
        return Ok(None);
    }
    let i = with[u.choose_index(with.len())?];
    let Some(p) = all_records(trace)[i].payload else {
        return Ok(None);
    };
    let at = p.offset as usize + u.choose_index(p.len as usize)?;
    bytes[at] ^= 1 << u.int_in_range(0..=7u8)?;
    Ok(Some(i))
}

/// A trace's records as a sorted list of (coordinate, level, digest) keys:
/// two traces hold the same records exactly when these are equal.
pub fn record_keys(t: &Trace) -> Vec<String> {
    record_keys_at(t, LevelSet::ALL)
}

/// The levels a trace holds records of.
pub fn held_levels(t: &Trace) -> LevelSet {
    all_records(t).iter().map(|e| e.level).collect()
}

/// The records of `t` at the levels `levels`, as [`record_keys`].
pub fn record_keys_at(t: &Trace, levels: LevelSet) -> Vec<String> {
    let mut v: Vec<String> = all_records(t)
        .iter()
        .filter(|e| levels.contains(e.level))
        .map(|e| format!("{} {} {}", e.coord, e.level.name(), e.digest.to_hex()))
        .collect();
    v.sort();
    v
}

/// Byte ranges of a file: `(offset, length)`.
pub type Ranges = Vec<(u64, u64)>;

/// What a trace opened on use has read so far, as byte ranges: its blocks
/// (root, step and group blocks; none for version 1) and the payloads it
/// verified.
pub fn read_ranges(t: &Trace) -> (Ranges, Ranges) {
    let payloads = t
        .payloads_read()
        .into_iter()
        .filter_map(|i| t.get_record(i).and_then(|e| e.payload))
        .map(|p| (p.offset, p.len))
        .collect();
    (t.blocks_read(), payloads)
}

/// The payload ranges of `all` (every record of the trace) that are not
/// among `read`.
pub fn unread_payloads(all: &[IndexEntry], read: &[(u64, u64)]) -> Ranges {
    all.iter()
        .filter_map(|e| e.payload)
        .map(|p| (p.offset, p.len))
        .filter(|r| !read.contains(r))
        .collect()
}

/// Flips one drawn bit of one drawn byte inside one drawn non-empty range
/// of `ranges`; returns its offset, `None` when every range is empty.
pub fn flip_bit_in(u: &mut Unstructured<'_>, bytes: &mut [u8], ranges: &[(u64, u64)]) -> Result<Option<u64>> {
    let ranges: Vec<(u64, u64)> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
    if ranges.is_empty() {
        return Ok(None);
    }
    let (offset, len) = ranges[u.choose_index(ranges.len())?];
    let at = offset + u.choose_index(len as usize)? as u64;
    let Some(b) = bytes.get_mut(at as usize) else {
        return Ok(None);
    };
    *b ^= 1 << u.int_in_range(0..=7u8)?;
    Ok(Some(at))
}
