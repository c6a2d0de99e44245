//! Validating trace reader.
//!
//! A trace file is untrusted input. [`Trace::open`] checks, in this order:
//! size, magic, version, reserved fields, algorithm, header length, trailer
//! magic and offsets, the checksum of preamble + header + index + trailer,
//! then decodes header and index (every length capped before allocating),
//! checks that payloads lie inside the payload section in order, aligned and
//! non-overlapping, rebuilds the hash tree and compares its root with the
//! trailer. [`Trace::verify_payloads`] additionally re-hashes every payload
//! and checks that every padding byte is zero, so that every byte of the file
//! is accounted for. Any failure names the file and the byte offset.
//!
//! Payload bytes are only ever handed out by [`Trace::payload_verified`],
//! which re-hashes a payload against its record digest before its first use
//! (and remembers that it did); there is no accessor for unverified bytes.

use crate::binding::{Binding, Provenance};
use crate::error::TraceError;
use crate::layout::{
    align_up, check_record, checksum, fingerprint_tree_encoded, Header, IndexEntry, PayloadRef, Trailer,
    END_MAGIC, FORMAT_VERSION, MAGIC, MAX_HEADER_LEN, MIN_ENTRY_LEN, PAYLOAD_ALIGN, PREAMBLE_LEN,
    TRAILER_LEN,
};
use moeconf_fingerprint::wire::Decoder;
use moeconf_fingerprint::{is_canonical, record_prefix, Algorithm, Digest, HashTree, Interner, TensorView};
use rayon::prelude::*;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

enum Backing {
    Map(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// An opened, validated trace.
pub struct Trace {
    path: PathBuf,
    data: Backing,
    alg: Algorithm,
    header: Header,
    entries: Vec<IndexEntry>,
    tree: HashTree,
    binding_digest: Digest,
    header_end: u64,
    index_offset: u64,
    /// One bit per record: its payload has been re-hashed and matched.
    verified: Box<[AtomicU64]>,
}

/// Payloads up to this size are re-hashed with the record prefix in one
/// call (copied after the prefix); larger ones are streamed.
const ONE_SHOT_PAYLOAD: usize = 4096;

/// Payload bytes per verification task of [`Trace::verify_payloads`]
/// (whole bitset words of records; the last task may hold less).
const VERIFY_CHUNK: u64 = 4 << 20;

/// One task of [`Trace::verify_payloads`]: the records of bitset words
/// `words`, whose first padding gap starts at `gap_from`.
struct VerifyTask {
    words: std::ops::Range<usize>,
    gap_from: u64,
}

/// What [`Trace::verify_payloads`] checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifySummary {
    /// Payloads re-hashed.
    pub payloads: u64,
    /// Payload bytes re-hashed.
    pub payload_bytes: u64,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// What the preamble says about the file's layout.
struct Preambled {
    alg: Algorithm,
    /// End of the header (start of the padding before the payload section).
    header_end: u64,
    /// Start of the payload section.
    payload_start: u64,
}

/// Checks size, magic, version, flags, algorithm, reserved field and header length.
fn check_preamble(path: &Path, b: &[u8]) -> Result<Preambled, TraceError> {
    let len = b.len() as u64;
    let fail = |offset: u64, what: String| TraceError::format(path, offset, what);
    if len < PREAMBLE_LEN + TRAILER_LEN {
        return Err(fail(
            0,
            format!("file is {len} bytes, shorter than the smallest trace"),
        ));
    }
    if b[0..8] != MAGIC {
        return Err(fail(
            0,
            "not a moeconf trace (bad magic; expected \"MOECONF\\0\")".into(),
        ));
    }
    let version = u32_at(b, 8);
    if version != FORMAT_VERSION {
        return Err(TraceError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let flags = u32_at(b, 12);
    if flags != 0 {
        return Err(fail(
            12,
            format!("unknown flags {flags:#x} (must be 0 in version 1)"),
        ));
    }
    let alg_code = u32_at(b, 16);
    let alg = Algorithm::from_code(alg_code)
        .ok_or_else(|| fail(16, format!("unknown digest algorithm code {alg_code}")))?;
    if u32_at(b, 20) != 0 {
        return Err(fail(20, "reserved field is not zero".into()));
    }
    let header_len = u64_at(b, 24);
    let header_end = PREAMBLE_LEN
        .checked_add(header_len)
        .filter(|&e| header_len <= MAX_HEADER_LEN && e <= len - TRAILER_LEN)
        .ok_or_else(|| {
            fail(
                24,
                format!("header length {header_len} does not fit in a {len}-byte file"),
            )
        })?;
    let payload_start = align_up(header_end).ok_or_else(|| fail(24, "header length overflows".into()))?;
    Ok(Preambled {
        alg,
        header_end,
        payload_start,
    })
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
            if p.offset % PAYLOAD_ALIGN != 0
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

impl Trace {
    /// Opens and validates the trace at `path` (memory-mapped).
    pub fn open(path: &Path) -> Result<Trace, TraceError> {
        let file = File::open(path).map_err(|e| TraceError::io(path, "opening trace", e))?;
        let len = file
            .metadata()
            .map_err(|e| TraceError::io(path, "reading trace metadata", e))?
            .len();
        if len < PREAMBLE_LEN + TRAILER_LEN {
            return Err(TraceError::format(
                path,
                0,
                format!(
                    "file is {len} bytes, shorter than the smallest trace ({} bytes): truncated or not a trace",
                    PREAMBLE_LEN + TRAILER_LEN
                ),
            ));
        }
        // SAFETY: the map is read-only and private to this process; like every
        // memory-mapped reader it assumes no other process truncates the file
        // while it is open. All reads below are bounds-checked slices.
        let map =
            unsafe { memmap2::Mmap::map(&file) }.map_err(|e| TraceError::io(path, "mapping trace", e))?;
        Trace::parse(path, Backing::Map(map))
    }

    /// Opens the trace at `path` and re-hashes every payload
    /// ([`Trace::verify_payloads`]): what every command that gives a verdict
    /// uses, so that no byte of an input it did not check can stand behind
    /// its answer.
    pub fn open_verified(path: &Path) -> Result<Trace, TraceError> {
        let t = Trace::open(path)?;
        t.verify_payloads()?;
        Ok(t)
    }

    /// Validates a trace held in memory (`name` is used in messages).
    pub fn from_bytes(name: &Path, bytes: Vec<u8>) -> Result<Trace, TraceError> {
        Trace::parse(name, Backing::Owned(bytes))
    }

    fn parse(path: &Path, data: Backing) -> Result<Trace, TraceError> {
        let b = data.bytes();
        let pre = check_preamble(path, b)?;
        let trailer = check_trailer(path, b, &pre)?;
        let fail = |offset: u64, what: String| TraceError::format(path, offset, what);
        let header_bytes = &b[PREAMBLE_LEN as usize..pre.header_end as usize];
        let (header, binding_len) = Header::decode_split(header_bytes, PREAMBLE_LEN)
            .map_err(|e| fail(e.offset, format!("header: {}", e.what)))?;
        let entries = decode_index(path, b, &pre, &trailer, &header.binding)?;
        let (bd, tree) = fingerprint_tree_encoded(pre.alg, &header_bytes[..binding_len], &entries)
            .map_err(|e| fail(trailer.index_offset, e.to_string()))?;
        if tree.root != trailer.root {
            return Err(fail(
                b.len() as u64 - TRAILER_LEN + 32,
                "root digest does not match the records: the index or trailer is corrupted".into(),
            ));
        }
        let verified = (0..entries.len().div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        Ok(Trace {
            path: path.to_path_buf(),
            verified,
            data,
            alg: pre.alg,
            header,
            entries,
            tree,
            binding_digest: bd,
            header_end: pre.header_end,
            index_offset: trailer.index_offset,
        })
    }

    /// The file this trace was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The digest algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.alg
    }

    /// The hashed binding.
    pub fn binding(&self) -> &Binding {
        &self.header.binding
    }

    /// Digest of the binding (a child of the root).
    pub fn binding_digest(&self) -> Digest {
        self.binding_digest
    }

    /// The unhashed provenance.
    pub fn provenance(&self) -> &Provenance {
        &self.header.provenance
    }

    /// Root digest.
    pub fn root(&self) -> Digest {
        self.tree.root
    }

    /// Records in execution (write) order.
    pub fn records(&self) -> &[IndexEntry] {
        &self.entries
    }

    /// The hash tree; its leaves index into [`Trace::records`].
    pub fn tree(&self) -> &HashTree {
        &self.tree
    }

    /// Total file size.
    pub fn file_len(&self) -> u64 {
        self.data.bytes().len() as u64
    }

    /// The bytes of payload `p` (in bounds: checked in parse against the
    /// index offset). Private: every caller outside [`Trace::check_payload`]
    /// goes through [`Trace::payload_verified`].
    fn raw_payload(&self, p: PayloadRef) -> Option<&[u8]> {
        self.data
            .bytes()
            .get(p.offset as usize..(p.offset + p.len) as usize)
    }

    /// Whether record `i`'s payload has already been re-hashed and matched.
    fn is_verified(&self, i: usize) -> bool {
        self.verified
            .get(i / 64)
            .is_some_and(|w| w.load(Ordering::Relaxed) & (1 << (i % 64)) != 0)
    }

    /// Remembers that record `i`'s payload matched its digest. The bytes are
    /// immutable (a read-only map or an owned buffer), so a matched payload
    /// stays matched; `Relaxed` suffices because the bit only saves work.
    fn mark_verified(&self, i: usize) {
        if let Some(w) = self.verified.get(i / 64) {
            w.fetch_or(1 << (i % 64), Ordering::Relaxed);
        }
    }

    /// Re-hashes the payload of record `i` against its record digest and
    /// checks that it is canonical and matches the record's shape.
    fn check_payload(&self, i: usize, e: &IndexEntry, p: PayloadRef) -> Result<&[u8], TraceError> {
        let bytes = self.raw_payload(p).ok_or_else(|| {
            TraceError::format(&self.path, p.offset, format!("record {i}: payload out of bounds"))
        })?;
        let fail = |what: &str| {
            TraceError::format(&self.path, p.offset, format!("record {i} ({}): {what}", e.coord))
        };
        if !is_canonical(e.dtype, bytes, self.header.binding.canon) {
            return Err(fail("payload is not in canonical form"));
        }
        let t = TensorView {
            dtype: e.dtype,
            shape: &e.shape,
            bytes,
        };
        t.validate(&e.coord.path).map_err(|err| fail(&err.to_string()))?;
        let mut preimage = record_prefix(&e.coord, e.level, e.dtype, &e.shape, p.len);
        // Small payloads (most records of a large trace: ids, margins, top-k
        // lists) are hashed in one call after the prefix, without a boxed
        // streaming state; the digest of prefix ‖ payload is the same.
        let digest = if bytes.len() <= ONE_SHOT_PAYLOAD {
            preimage.extend_from_slice(bytes);
            self.alg.hash(&preimage)
        } else {
            let mut h = self.alg.hasher();
            h.update(&preimage);
            h.update_with(bytes, true);
            h.finalize()
        };
        if digest != e.digest {
            return Err(fail(
                "payload bytes do not match the record digest (corrupted payload)",
            ));
        }
        Ok(bytes)
    }

    /// The payload of record `i`, re-hashed against its record digest: the
    /// one way to read payload bytes. `Ok(None)` when the record kept no
    /// payload (or `i` is out of range); a payload that does not match its
    /// digest, is not canonical or does not fit the record's shape is an
    /// error naming the file, the record and the payload's byte offset. A
    /// payload is hashed once: later reads of the same record (and every
    /// read after [`Trace::verify_payloads`]) return it without re-hashing.
    ///
    /// There is no accessor for unverified payload bytes:
    ///
    /// ```compile_fail
    /// # fn f(t: &moeconf_schema::Trace) {
    /// let _unchecked: Option<&[u8]> = t.payload(0);
    /// # }
    /// ```
    pub fn payload_verified(&self, i: usize) -> Result<Option<&[u8]>, TraceError> {
        let Some(e) = self.entries.get(i) else {
            return Ok(None);
        };
        let Some(p) = e.payload else {
            return Ok(None);
        };
        if self.is_verified(i) {
            if let Some(bytes) = self.raw_payload(p) {
                return Ok(Some(bytes));
            }
        }
        let bytes = self.check_payload(i, e, p)?;
        self.mark_verified(i);
        Ok(Some(bytes))
    }

    /// The first non-zero byte in `from..to`, if any.
    fn first_nonzero(&self, from: u64, to: u64) -> Option<u64> {
        self.data.bytes()[from as usize..to as usize]
            .iter()
            .position(|&x| x != 0)
            .map(|k| from + k as u64)
    }

    /// Splits the records into verification tasks in file order: runs of
    /// whole bitset words (so no two tasks mark the same word) holding at
    /// least [`VERIFY_CHUNK`] payload bytes, each with the end of the
    /// payload before it (where its first padding gap starts).
    fn verify_tasks(&self) -> Vec<VerifyTask> {
        let mut tasks = Vec::new();
        let (mut start, mut gap_from, mut bytes) = (0, self.header_end, 0u64);
        let mut cursor = self.header_end;
        for w in 0..self.verified.len() {
            let records = w * 64..((w + 1) * 64).min(self.entries.len());
            for p in self.entries[records].iter().filter_map(|e| e.payload) {
                bytes += p.len;
                cursor = p.offset + p.len;
            }
            if bytes >= VERIFY_CHUNK || w + 1 == self.verified.len() {
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
    fn verify_task(&self, task: &VerifyTask) -> (Option<TraceError>, u64) {
        let mut cursor = task.gap_from;
        for w in task.words.clone() {
            let mut done = self.verified[w].load(Ordering::Relaxed);
            let records = w * 64..((w + 1) * 64).min(self.entries.len());
            for (i, e) in self.entries[records.clone()]
                .iter()
                .enumerate()
                .map(|(k, e)| (records.start + k, e))
            {
                let Some(p) = e.payload else { continue };
                if let Some(at) = self.first_nonzero(cursor, p.offset) {
                    self.verified[w].fetch_or(done, Ordering::Relaxed);
                    return (Some(self.padding_error(at)), cursor);
                }
                if done & (1 << (i % 64)) == 0 {
                    if let Err(err) = self.check_payload(i, e, p) {
                        self.verified[w].fetch_or(done, Ordering::Relaxed);
                        return (Some(err), cursor);
                    }
                    done |= 1 << (i % 64);
                }
                cursor = p.offset + p.len;
            }
            self.verified[w].fetch_or(done, Ordering::Relaxed);
        }
        (None, cursor)
    }

    fn padding_error(&self, at: u64) -> TraceError {
        TraceError::format(&self.path, at, "padding byte is not zero (corrupted file)")
    }

    /// Drops the mapped pages wholly inside `from..to` from this process's
    /// resident set once they have been verified, so that verifying a large
    /// trace does not keep all of it resident (a later read maps them again
    /// from the page cache). Only 64 KiB-aligned blocks are released.
    fn release(&self, from: u64, to: u64) {
        const BLOCK: u64 = 64 << 10;
        let (a, b) = (from.div_ceil(BLOCK) * BLOCK, to / BLOCK * BLOCK);
        #[cfg(unix)]
        if let (Backing::Map(m), true) = (&self.data, b > a) {
            // SAFETY: the map is a read-only shared mapping of the file
            // (memmap2 maps read-only with MAP_SHARED). MADV_DONTNEED only
            // drops page-table entries; the next access maps the same page
            // of the file again, so every slice handed out stays valid and
            // keeps its contents (under the reader's standing assumption
            // that nobody modifies the file while it is open). Failure only
            // means the pages stay resident.
            let _ = unsafe {
                m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a as usize, (b - a) as usize)
            };
        }
        #[cfg(not(unix))]
        let _ = (a, b);
    }

    /// Re-hashes every payload (in parallel) and checks that all padding
    /// bytes are zero, so that every byte of the file has been validated.
    /// The error is the first problem in file order. Afterwards every
    /// [`Trace::payload_verified`] returns without re-hashing. Verified
    /// pages of a memory-mapped trace are released as verification
    /// proceeds, so its resident memory stays bounded.
    pub fn verify_payloads(&self) -> Result<VerifySummary, TraceError> {
        let tasks = self.verify_tasks();
        let first_error = tasks.par_iter().find_map_first(|task| {
            let (err, end) = self.verify_task(task);
            if err.is_none() {
                self.release(task.gap_from, end);
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
            .map_or(self.header_end, |p| p.offset + p.len);
        if let Some(at) = self.first_nonzero(last_end, self.index_offset) {
            return Err(self.padding_error(at));
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
