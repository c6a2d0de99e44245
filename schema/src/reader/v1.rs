//! Version 1: the index is decoded whole on open, the tree rebuilt from it
//! and compared with the trailer's root; full verification re-hashes every
//! payload and checks every padding byte.

use super::{u64_at, Opened, Preambled, Store as AnyStore, Trace};
use crate::binding::Binding;
use crate::error::TraceError;
use crate::layout::{
    check_record, checksum, fingerprint_tree_encoded, Header, IndexEntry, Trailer, END_MAGIC, MIN_ENTRY_LEN,
    PAYLOAD_ALIGN, PREAMBLE_LEN, TRAILER_LEN,
};
use crate::nodes::{GroupAt, GroupContent, GroupNode, LevelNode, StepNode, StepSummary};
use crate::reader::VerifySummary;
use moeconf_fingerprint::wire::Decoder;
use moeconf_fingerprint::{Digest, Interner};
use rayon::prelude::*;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

/// The decoded index of a version 1 trace.
pub(super) struct Store {
    /// Every record in write order.
    pub entries: Vec<IndexEntry>,
    /// Where the index starts (the end of the payload section).
    pub index_offset: u64,
}

/// Payload bytes per verification task of [`Store::verify`] (whole bitset
/// words of records; the last task may hold less).
const VERIFY_CHUNK: u64 = 4 << 20;

/// One task of [`Store::verify`]: the records of bitset words `words`,
/// whose first padding gap starts at `gap_from`.
struct VerifyTask {
    words: std::ops::Range<usize>,
    gap_from: u64,
}

/// Checks the trailer's magic, index offsets and record count bound, and the
/// checksum over preamble + header, index and trailer.
fn check_trailer(path: &Path, b: &[u8], pre: &Preambled) -> Result<Trailer, TraceError> {
    let len = b.len() as u64;
    let fail = |offset: u64, what: String| TraceError::format(path, offset, what);
    let t0 = (len - TRAILER_LEN) as usize;
    if b[t0..t0 + 8] != END_MAGIC || b[t0 + 96..t0 + 104] != END_MAGIC {
        return Err(fail(
            t0 as u64,
            "trailer magic missing: the file is truncated or was not finished by its writer".into(),
        ));
    }
    let index_offset = u64_at(b, t0 + 8);
    let index_len = u64_at(b, t0 + 16);
    let record_count = u64_at(b, t0 + 24);
    let mut root = [0u8; 32];
    root.copy_from_slice(&b[t0 + 32..t0 + 64]);
    let mut stored_sum = [0u8; 32];
    stored_sum.copy_from_slice(&b[t0 + 64..t0 + 96]);
    if index_offset < pre.payload_start.min(len)
        || index_offset.checked_add(index_len) != Some(len - TRAILER_LEN)
    {
        return Err(fail(
            t0 as u64 + 8,
            format!(
                "index at {index_offset} with length {index_len} does not end at the trailer ({})",
                len - TRAILER_LEN
            ),
        ));
    }
    if record_count > index_len / MIN_ENTRY_LEN {
        return Err(fail(
            t0 as u64 + 24,
            format!("record count {record_count} cannot fit in a {index_len}-byte index"),
        ));
    }
    let trailer = Trailer {
        index_offset,
        index_len,
        record_count,
        root: Digest(root),
        checksum: Digest(stored_sum),
    };
    let sum = checksum(
        pre.alg,
        &b[..pre.header_end as usize],
        index_bytes(b, &trailer),
        &trailer.covered_bytes(),
    );
    if sum.0 != stored_sum {
        return Err(fail(
            t0 as u64 + 64,
            "checksum mismatch: the header, index or trailer is corrupted".into(),
        ));
    }
    Ok(trailer)
}

/// The index bytes (in bounds: checked by [`check_trailer`]).
fn index_bytes<'b>(b: &'b [u8], t: &Trailer) -> &'b [u8] {
    &b[t.index_offset as usize..(t.index_offset + t.index_len) as usize]
}

/// Decodes the index and checks that payloads lie inside the payload
/// section in order, aligned and non-overlapping.
fn decode_index(
    path: &Path,
    b: &[u8],
    pre: &Preambled,
    t: &Trailer,
    binding: &Binding,
) -> Result<Vec<IndexEntry>, TraceError> {
    let fail = |offset: u64, what: String| TraceError::format(path, offset, what);
    let (index_offset, record_count) = (t.index_offset, t.record_count);
    let mut d = Decoder::new(index_bytes(b, t), index_offset);
    let n = d
        .len("index record count", MIN_ENTRY_LEN as usize, record_count)
        .map_err(|e| fail(e.offset, e.what))?;
    if n as u64 != record_count {
        return Err(fail(
            index_offset,
            format!("index holds {n} records, trailer says {record_count}"),
        ));
    }
    let mut entries = Vec::with_capacity(n);
    let mut next_payload = pre.payload_start;
    let mut interner = Interner::new();
    for i in 0..n {
        let at = d.offset();
        let e = IndexEntry::decode_interned(&mut d, &mut interner)
            .map_err(|e| fail(e.offset, format!("record {i}: {}", e.what)))?;
        check_record(binding, &e.coord, e.dtype, &e.shape)
            .map_err(|m| fail(at, format!("record {i} ({}): {m}", e.coord)))?;
        if let Some(p) = e.payload {
            let end = p.offset.checked_add(p.len);
            if !p.offset.is_multiple_of(PAYLOAD_ALIGN)
                || p.offset < next_payload
                || end.is_none_or(|end| end > index_offset)
            {
                return Err(fail(
                    at,
                    format!(
                        "record {i} ({}): payload at {} (+{}) is outside the payload section, misaligned \
                         or overlapping",
                        e.coord, p.offset, p.len
                    ),
                ));
            }
            next_payload = end.unwrap_or(index_offset);
        }
        entries.push(e);
    }
    d.finish("index").map_err(|e| fail(e.offset, e.what))?;
    Ok(entries)
}

/// Opens a version 1 trace: decodes header and index, rebuilds the tree and
/// checks its root.
pub(super) fn open(path: &Path, b: &[u8], pre: &Preambled) -> Result<Opened, TraceError> {
    let trailer = check_trailer(path, b, pre)?;
    let fail = |offset: u64, what: String| TraceError::format(path, offset, what);
    let header_bytes = &b[PREAMBLE_LEN as usize..pre.header_end as usize];
    let (header, binding_len) = Header::decode_split(header_bytes, PREAMBLE_LEN)
        .map_err(|e| fail(e.offset, format!("header: {}", e.what)))?;
    let entries = decode_index(path, b, pre, &trailer, &header.binding)?;
    let (bd, tree) = fingerprint_tree_encoded(pre.alg, &header_bytes[..binding_len], &entries)
        .map_err(|e| fail(trailer.index_offset, e.to_string()))?;
    if tree.root != trailer.root {
        return Err(fail(
            b.len() as u64 - TRAILER_LEN + 32,
            "root digest does not match the records: the index or trailer is corrupted".into(),
        ));
    }
    let mut summaries = Vec::with_capacity(tree.steps.len());
    let mut nodes = Vec::with_capacity(tree.steps.len());
    for (k, s) in tree.steps.into_iter().enumerate() {
        let mut level_records = [0u64; 5];
        let mut levels = Vec::with_capacity(s.levels.len());
        for (li, l) in s.levels.into_iter().enumerate() {
            let mut groups = Vec::with_capacity(l.groups.len());
            for (gi, g) in l.groups.into_iter().enumerate() {
                level_records[l.level.code() as usize] += g.records.len() as u64;
                groups.push(GroupNode {
                    layer: g.layer,
                    digest: g.digest,
                    records: g.records.len() as u64,
                    at: GroupAt {
                        step_index: k as u32,
                        level: l.level,
                        level_index: li as u8,
                        group_index: gi as u32,
                        block: u32::MAX,
                    },
                    content: OnceLock::from(Ok(GroupContent {
                        ids: g.records.into_boxed_slice(),
                        entries: Box::default(),
                    })),
                    paged: OnceLock::new(),
                });
            }
            levels.push(LevelNode {
                level: l.level,
                digest: l.digest,
                groups,
            });
        }
        summaries.push(StepSummary {
            step: s.step,
            digest: s.digest,
            level_records,
        });
        nodes.push(StepNode {
            step: s.step,
            digest: s.digest,
            levels,
            payload_end: trailer.index_offset,
            blocks: Box::default(),
        });
    }
    Ok(Opened {
        header,
        binding_digest: bd,
        root: tree.root,
        record_count: entries.len() as u64,
        summaries,
        nodes: Some(nodes),
        store: AnyStore::V1(Store {
            entries,
            index_offset: trailer.index_offset,
        }),
    })
}

impl Store {
    /// Splits the records into verification tasks in file order: runs of
    /// whole bitset words (so no two tasks mark the same word) holding at
    /// least [`VERIFY_CHUNK`] payload bytes, each with the end of the
    /// payload before it (where its first padding gap starts).
    fn verify_tasks(&self, t: &Trace) -> Vec<VerifyTask> {
        let mut tasks = Vec::new();
        let (mut start, mut gap_from, mut bytes) = (0, t.header_end, 0u64);
        let mut cursor = t.header_end;
        for w in 0..t.verified.len() {
            let records = w * 64..((w + 1) * 64).min(self.entries.len());
            for p in self.entries[records].iter().filter_map(|e| e.payload) {
                bytes += p.len;
                cursor = p.offset + p.len;
            }
            if bytes >= VERIFY_CHUNK || w + 1 == t.verified.len() {
                tasks.push(VerifyTask {
                    words: start..w + 1,
                    gap_from,
                });
                (start, gap_from, bytes) = (w + 1, cursor, 0);
            }
        }
        tasks
    }

    /// Verifies one task's records in file order: the zero padding before
    /// each payload, then the payload (unless already verified). Returns the
    /// first problem, and the end of the task's last payload.
    fn verify_task(&self, t: &Trace, task: &VerifyTask) -> (Option<TraceError>, u64) {
        let mut cursor = task.gap_from;
        for w in task.words.clone() {
            let Some(word) = t.verified.word(w) else { break };
            let mut done = word.load(Ordering::Relaxed);
            let records = w * 64..((w + 1) * 64).min(self.entries.len());
            for (i, e) in self.entries[records.clone()]
                .iter()
                .enumerate()
                .map(|(k, e)| (records.start + k, e))
            {
                let Some(p) = e.payload else { continue };
                if let Some(at) = t.first_nonzero(cursor, p.offset) {
                    word.fetch_or(done, Ordering::Relaxed);
                    return (Some(t.padding_error(at)), cursor);
                }
                if done & (1 << (i % 64)) == 0 {
                    if let Err(err) = t.check_payload(i, e, p) {
                        word.fetch_or(done, Ordering::Relaxed);
                        return (Some(err), cursor);
                    }
                    done |= 1 << (i % 64);
                }
                cursor = p.offset + p.len;
            }
            word.fetch_or(done, Ordering::Relaxed);
        }
        (None, cursor)
    }

    /// Re-hashes every payload (in parallel) and checks that all padding
    /// bytes are zero.
    pub fn verify(&self, t: &Trace) -> Result<VerifySummary, TraceError> {
        let tasks = self.verify_tasks(t);
        let first_error = tasks.par_iter().find_map_first(|task| {
            let (err, end) = self.verify_task(t, task);
            if err.is_none() {
                t.release(task.gap_from, end);
            }
            err
        });
        if let Some(err) = first_error {
            return Err(err);
        }
        let last_end = self
            .entries
            .iter()
            .rev()
            .find_map(|e| e.payload)
            .map_or(t.header_end, |p| p.offset + p.len);
        if let Some(at) = t.first_nonzero(last_end, self.index_offset) {
            return Err(t.padding_error(at));
        }
        let mut summary = VerifySummary {
            payloads: 0,
            payload_bytes: 0,
        };
        for p in self.entries.iter().filter_map(|e| e.payload) {
            summary.payloads += 1;
            summary.payload_bytes += p.len;
        }
        Ok(summary)
    }
}
