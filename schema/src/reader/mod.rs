//! Validating trace reader for both container versions.
//!
//! A trace file is untrusted input. [`Trace::open`] checks, in this order:
//! that the path is a regular file (before opening it: [`moeconf_output::input`]),
//! size, magic, version, reserved fields, algorithm, header length, trailer
//! magic and offsets, the checksum, then decodes the header. What follows
//! depends on the version:
//!
//! * **version 1**: the index is decoded whole (every length capped before
//!   allocating), payload placement is checked, the hash tree is rebuilt and
//!   its root compared with the trailer's. Everything but the payload bytes
//!   is then verified.
//! * **version 2**: only the root block is read (its digest pinned by the
//!   trailer, its fingerprint root recomputed). A step's node and a group's
//!   records are read the first time they are asked for ([`Trace::step`],
//!   [`Trace::group_records`]), each block checked against the digests its
//!   parent holds; nothing that is not asked for is read. See
//!   docs/format.md §11.
//!
//! [`Trace::verify_payloads`] verifies every byte of either version: every
//! payload re-hashed, every block read and checked, every padding byte zero.
//! Payload bytes are only ever handed out by [`Trace::payload_verified`],
//! which re-hashes a payload against its record digest before its first use
//! (and remembers that it did); there is no accessor for unverified bytes.
//! Any failure names the file and the byte offset.

mod v1;
mod v2;

use crate::binding::{Binding, Provenance};
use crate::error::TraceError;
use crate::layout::{align_up, Header, IndexEntry, PayloadRef, MAGIC, MAX_HEADER_LEN, PREAMBLE_LEN};
use crate::nodes::{Fault, GroupNode, GroupRecords, HeldRecord, StepNode, StepSummary};
use moeconf_fingerprint::{is_canonical, record_prefix, Algorithm, Digest, LevelSet, TensorView};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

enum Backing {
    /// The file mapped, and the file itself for positioned reads of blocks
    /// read once and dropped (see [`Trace::read_transient`]).
    Map(memmap2::Mmap, std::fs::File),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Map(m, _) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// The largest block [`Trace::read_transient`] copies out of the file; a
/// larger one is read through the map and its pages released.
const TRANSIENT_MAX: u64 = 16 << 20;

/// How much of a trace a command verifies before it answers from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verification {
    /// Every byte ([`Trace::verify_payloads`]).
    Full,
    /// What the answer uses. A version 2 trace is verified node by node and
    /// payload by payload as they are read (each on first use, against its
    /// parent up to the trailer), so bytes that are never read cannot
    /// influence the answer. A version 1 trace has no per-node digests:
    /// it is verified in full, as before version 2 existed.
    OnUse,
}

/// An opened, validated trace.
pub struct Trace {
    path: PathBuf,
    data: Backing,
    alg: Algorithm,
    version: u32,
    header: Header,
    binding_digest: Digest,
    header_end: u64,
    payload_start: u64,
    root: Digest,
    record_count: u64,
    /// The steps, ascending, as the root lists them.
    summaries: Vec<StepSummary>,
    /// One slot per step: version 1 fills them all on open, version 2 on
    /// first use.
    nodes: Slots<Result<StepNode, Fault>>,
    store: Store,
    /// One bit per record: its payload has been re-hashed and matched.
    verified: Bits,
    /// Set once [`Trace::verify_payloads`] has succeeded.
    fully_verified: AtomicBool,
}

enum Store {
    V1(v1::Store),
    V2(Box<v2::Store>),
}

/// What [`Trace::verify_payloads`] checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifySummary {
    /// Payloads re-hashed.
    pub payloads: u64,
    /// Payload bytes re-hashed.
    pub payload_bytes: u64,
}

/// Payloads up to this size are re-hashed with the record prefix in one
/// call (copied after the prefix); larger ones are streamed.
const ONE_SHOT_PAYLOAD: usize = 4096;

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
    version: u32,
    /// End of the header (start of the padding before the payload section).
    header_end: u64,
    /// Start of the payload section.
    payload_start: u64,
}

/// The smallest file of `version` (preamble and trailer).
fn smallest(version: u32) -> u64 {
    PREAMBLE_LEN
        + if crate::v2::is_block_format(version) {
            crate::v2::TRAILER_V2_LEN
        } else {
            crate::layout::TRAILER_LEN
        }
}

/// Checks size, magic, version, flags, algorithm, reserved field and header length.
fn check_preamble(path: &Path, b: &[u8]) -> Result<Preambled, TraceError> {
    let len = b.len() as u64;
    let fail = |offset: u64, what: String| TraceError::format(path, offset, what);
    if len < smallest(1) {
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
    if version != 1 && !crate::v2::is_block_format(version) {
        return Err(TraceError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version,
            supported: crate::v2::FORMAT_V4,
        });
    }
    if len < smallest(version) {
        return Err(fail(
            0,
            format!("file is {len} bytes, shorter than the smallest version {version} trace"),
        ));
    }
    let flags = u32_at(b, 12);
    if flags != 0 {
        return Err(fail(
            12,
            format!("unknown flags {flags:#x} (must be 0 in version {version})"),
        ));
    }
    let alg_code = u32_at(b, 16);
    let alg = Algorithm::from_code(alg_code)
        .ok_or_else(|| fail(16, format!("unknown digest algorithm code {alg_code}")))?;
    if u32_at(b, 20) != 0 {
        return Err(fail(20, "reserved field is not zero".into()));
    }
    let header_len = u64_at(b, 24);
    let trailer = smallest(version) - PREAMBLE_LEN;
    let header_end = PREAMBLE_LEN
        .checked_add(header_len)
        .filter(|&e| header_len <= MAX_HEADER_LEN && e <= len - trailer)
        .ok_or_else(|| {
            fail(
                24,
                format!("header length {header_len} does not fit in a {len}-byte file"),
            )
        })?;
    let payload_start = align_up(header_end).ok_or_else(|| fail(24, "header length overflows".into()))?;
    Ok(Preambled {
        alg,
        version,
        header_end,
        payload_start,
    })
}

/// A bitset whose 32 KiB chunks are allocated when first written, so that
/// opening a trace of 10^7 records touches no memory for it (a diff marks
/// a handful of bits).
struct Bits {
    chunks: Box<[OnceLock<Box<[AtomicU64]>>]>,
    words: usize,
}

/// Words (of 64 bits) per chunk of [`Bits`].
const CHUNK_WORDS: usize = 4096;

impl Bits {
    /// `n` zero bits.
    fn new(n: u64) -> Bits {
        let words = n.div_ceil(64) as usize;
        Bits {
            chunks: (0..words.div_ceil(CHUNK_WORDS))
                .map(|_| OnceLock::new())
                .collect(),
            words,
        }
    }

    /// The number of 64-bit words.
    fn len(&self) -> usize {
        self.words
    }

    /// Word `w` (allocating its chunk), `None` past the end.
    fn word(&self, w: usize) -> Option<&AtomicU64> {
        if w >= self.words {
            return None;
        }
        let chunk = self.chunks.get(w / CHUNK_WORDS)?.get_or_init(|| {
            let n = CHUNK_WORDS.min(self.words - w / CHUNK_WORDS * CHUNK_WORDS);
            (0..n).map(|_| AtomicU64::new(0)).collect()
        });
        chunk.get(w % CHUNK_WORDS)
    }

    /// Word `w`'s bits, without allocating (0 when its chunk is absent).
    fn peek(&self, w: usize) -> u64 {
        self.chunks
            .get(w / CHUNK_WORDS)
            .and_then(|c| c.get())
            .and_then(|c| c.get(w % CHUNK_WORDS))
            .map_or(0, |x| x.load(Ordering::Relaxed))
    }
}

/// Lazily initialized slots whose storage is allocated a chunk at a time
/// when first written, like [`Bits`]: a version 2 trace of 1,002 steps
/// whose diff reads one step's node allocates (and touches) one chunk of
/// step slots, not a slot per step.
struct Slots<T> {
    chunks: Box<[OnceLock<SlotChunk<T>>]>,
    len: usize,
}

/// One chunk of [`Slots`].
type SlotChunk<T> = Box<[OnceLock<T>]>;

/// Slots per chunk of [`Slots`].
const SLOT_CHUNK: usize = 64;

impl<T> Slots<T> {
    /// `n` empty slots.
    fn new(n: usize) -> Slots<T> {
        Slots {
            chunks: (0..n.div_ceil(SLOT_CHUNK)).map(|_| OnceLock::new()).collect(),
            len: n,
        }
    }

    /// Slots holding `values`.
    fn filled(values: Vec<T>) -> Slots<T> {
        let s = Slots::new(values.len());
        for (k, v) in values.into_iter().enumerate() {
            if let Some(slot) = s.slot(k) {
                let _ = slot.set(v);
            }
        }
        s
    }

    /// Slot `k` (allocating its chunk), `None` past the end.
    fn slot(&self, k: usize) -> Option<&OnceLock<T>> {
        if k >= self.len {
            return None;
        }
        let c = k / SLOT_CHUNK;
        let chunk = self.chunks.get(c)?.get_or_init(|| {
            let n = SLOT_CHUNK.min(self.len - c * SLOT_CHUNK);
            (0..n).map(|_| OnceLock::new()).collect()
        });
        chunk.get(k % SLOT_CHUNK)
    }

    /// The value of slot `k`, if set (allocates nothing).
    fn get(&self, k: usize) -> Option<&T> {
        self.chunks.get(k / SLOT_CHUNK)?.get()?.get(k % SLOT_CHUNK)?.get()
    }
}

/// The unit in which mapped pages are dropped from the resident set.
const RELEASE_BLOCK: u64 = 64 << 10;

impl Trace {
    /// Opens and validates the trace at `path` (memory-mapped). A version 2
    /// trace is read lazily: see the module documentation.
    pub fn open(path: &Path) -> Result<Trace, TraceError> {
        // A regular file only: never a FIFO or device (docs/format.md §7).
        let file = moeconf_output::input::open_input(path, "trace")
            .map_err(|e| TraceError::input("opening trace", e))?;
        let len = file
            .metadata()
            .map_err(|e| TraceError::io(path, "reading trace metadata", e))?
            .len();
        if len < smallest(1) {
            return Err(TraceError::format(
                path,
                0,
                format!(
                    "file is {len} bytes, shorter than the smallest trace ({} bytes): truncated or not a trace",
                    smallest(1)
                ),
            ));
        }
        // SAFETY: the map is read-only and private to this process; like every
        // memory-mapped reader it assumes no other process truncates the file
        // while it is open. All reads below are bounds-checked slices.
        let map =
            unsafe { memmap2::Mmap::map(&file) }.map_err(|e| TraceError::io(path, "mapping trace", e))?;
        Trace::parse(path, Backing::Map(map, file))
    }

    /// Opens the trace at `path` and verifies every byte of it
    /// ([`Trace::verify_payloads`]), so that no byte it did not check can
    /// stand behind an answer: what `inspect`, `certify`, `explain`,
    /// `replay`, `calibrate` and `convert` use.
    pub fn open_verified(path: &Path) -> Result<Trace, TraceError> {
        Trace::open_for(path, Verification::Full)
    }

    /// Opens the trace at `path` and verifies it as `verification` says:
    /// what `diff` and `gate` use ([`Verification::OnUse`] unless asked for
    /// every byte).
    pub fn open_for(path: &Path, verification: Verification) -> Result<Trace, TraceError> {
        let t = Trace::open(path)?;
        t.ensure(verification)?;
        Ok(t)
    }

    /// Whether opening the trace at `path` under `verification` reads only
    /// its root block: a version 2 or 3 trace verified on use. Read from the
    /// preamble's magic and version alone, nothing validated: a hint for
    /// scheduling (opening such a trace on a thread of its own costs more
    /// than the thread saves), never a check; `false` when the file cannot
    /// be read or is no trace.
    pub fn opens_lazily(path: &Path, verification: Verification) -> bool {
        use std::io::Read;
        if verification != Verification::OnUse {
            return false;
        }
        let mut pre = [0u8; 12];
        let Ok(mut f) = moeconf_output::input::open_input(path, "trace") else {
            return false;
        };
        f.read_exact(&mut pre)
            .is_ok_and(|()| pre[..8] == MAGIC && crate::v2::is_block_format(u32_at(&pre, 8)))
    }

    /// Verifies an open trace as `verification` says (see [`Verification`]).
    pub fn ensure(&self, verification: Verification) -> Result<(), TraceError> {
        match (verification, &self.store) {
            (Verification::OnUse, Store::V2(_)) => Ok(()),
            _ => self.verify_payloads().map(|_| ()),
        }
    }

    /// Validates a trace held in memory (`name` is used in messages).
    pub fn from_bytes(name: &Path, bytes: Vec<u8>) -> Result<Trace, TraceError> {
        Trace::parse(name, Backing::Owned(bytes))
    }

    fn parse(path: &Path, data: Backing) -> Result<Trace, TraceError> {
        let b = data.bytes();
        let pre = check_preamble(path, b)?;
        let opened = if pre.version == 1 {
            v1::open(path, b, &pre)?
        } else {
            v2::open(path, b, &pre)?
        };
        let n = opened.summaries.len();
        let nodes = match opened.nodes {
            Some(nodes) => Slots::filled(nodes.into_iter().map(Ok).collect()),
            None => Slots::new(n),
        };
        Ok(Trace {
            path: path.to_path_buf(),
            alg: pre.alg,
            version: pre.version,
            header: opened.header,
            binding_digest: opened.binding_digest,
            header_end: pre.header_end,
            payload_start: pre.payload_start,
            root: opened.root,
            record_count: opened.record_count,
            summaries: opened.summaries,
            nodes,
            verified: Bits::new(opened.record_count),
            fully_verified: AtomicBool::new(false),
            store: opened.store,
            data,
        })
    }

    /// The file this trace was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The container format version of the file (1 or 2).
    pub fn format_version(&self) -> u32 {
        self.version
    }

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

    pub fn root(&self) -> Digest {
        self.root
    }

    /// Number of records (from the verified root: version 2 sums the
    /// record counts of the root block's steps, which it checks against the
    /// trailer).
    pub fn record_count(&self) -> u64 {
        self.record_count
    }

    pub fn is_empty(&self) -> bool {
        self.record_count == 0
    }

    /// The steps, ascending, with their digests and record counts per
    /// level: known on open, without reading any step's node.
    pub fn steps(&self) -> &[StepSummary] {
        &self.summaries
    }

    /// The summary of `step`, if present.
    pub fn step_summary(&self, step: u32) -> Option<&StepSummary> {
        self.step_index(step).map(|k| &self.summaries[k])
    }

    fn step_index(&self, step: u32) -> Option<usize> {
        self.summaries.binary_search_by_key(&step, |s| s.step).ok()
    }

    /// The levels any step holds records of, from every step's verified
    /// node: which levels a step holds is committed by its step digest, so
    /// this is the trace's answer whatever its root block's record counts
    /// claim (they are not under the root digest, docs/format.md §11.5).
    /// A version 2 trace reads every step block for it (not the groups).
    pub fn held_levels(&self) -> Result<LevelSet, TraceError> {
        self.held_levels_of(0..self.summaries.len())
    }

    /// [`Trace::held_levels`] of the steps with these indices (into
    /// [`Trace::steps`]). A step node not loaded yet is read, verified and
    /// dropped: a scan of every step keeps no node in memory.
    pub fn held_levels_of(&self, steps: impl Iterator<Item = usize>) -> Result<LevelSet, TraceError> {
        Ok(self
            .levels_by_step(steps)?
            .into_iter()
            .fold(LevelSet::EMPTY, LevelSet::union))
    }

    /// The levels each of the steps with these indices (into
    /// [`Trace::steps`]) holds, in the order given, from verified step
    /// nodes (read, verified and dropped when not loaded yet).
    pub fn levels_by_step(&self, steps: impl Iterator<Item = usize>) -> Result<Vec<LevelSet>, TraceError> {
        use rayon::prelude::*;
        let steps: Vec<usize> = steps.collect();
        // Steps are read in parallel; the first error in the order given is
        // the answer, whatever the threads.
        let held: Vec<Result<LevelSet, TraceError>> =
            steps.into_par_iter().map(|k| self.levels_at(k)).collect();
        held.into_iter().collect()
    }

    /// The levels the `k`-th step holds, from its node (loaded, or read,
    /// verified and dropped).
    fn levels_at(&self, k: usize) -> Result<LevelSet, TraceError> {
        if let Some(r) = self.nodes.get(k) {
            return r.as_ref().map(StepNode::held).map_err(|f| self.fault(f));
        }
        match &self.store {
            Store::V2(s) => {
                // Version 3: from the root block's level digests, checked
                // against the step digest; no step block is read.
                if let Some(committed) = s.committed_levels(self, k) {
                    return committed.map_err(|f| self.fault(&f));
                }
                let held = s
                    .load_step(self, k, true)
                    .map(|n| n.held())
                    .map_err(|f| self.fault(&f));
                if let Some((offset, len)) = s.step_block(k) {
                    if self.read_transient(offset, len).is_none() {
                        self.release_around(offset, offset.saturating_add(len));
                    }
                }
                held
            }
            Store::V1(_) => self.step_at(k).map(StepNode::held),
        }
    }

    /// The levels `step` holds, from its verified node (empty when the trace
    /// has no such step).
    pub fn step_levels(&self, step: u32) -> Result<LevelSet, TraceError> {
        match self.step_index(step) {
            Some(k) => self.levels_at(k),
            None => Ok(LevelSet::EMPTY),
        }
    }

    /// The node of `step` (its levels and layer groups with their digests),
    /// `None` when the trace holds no such step. Version 2 reads and
    /// verifies the step's block on first use; an error names the file and
    /// offset (and is returned again on every later call).
    pub fn step(&self, step: u32) -> Result<Option<&StepNode>, TraceError> {
        let Some(k) = self.step_index(step) else {
            return Ok(None);
        };
        self.step_at(k).map(Some)
    }

    /// The node of the `k`-th step of [`Trace::steps`].
    fn step_at(&self, k: usize) -> Result<&StepNode, TraceError> {
        let slot = self
            .nodes
            .slot(k)
            .ok_or_else(|| TraceError::format(&self.path, 0, format!("no step number {k}")))?;
        let r = slot.get_or_init(|| match &self.store {
            Store::V2(s) => s.load_step(self, k, false),
            // Version 1 fills every slot on open.
            Store::V1(_) => Err(Fault::new(0, "step node missing")),
        });
        r.as_ref().map_err(|f| self.fault(f))
    }

    /// The record ids of `group` (a group of one of this trace's step
    /// nodes), in canonical tree order (position, phase, path). Version 2
    /// reads and verifies the group's block on first use.
    pub fn group_records<'a>(&'a self, group: &'a GroupNode) -> Result<&'a [usize], TraceError> {
        let r = group.content.get_or_init(|| match &self.store {
            Store::V2(s) => s.load_group(self, group, true),
            Store::V1(_) => Err(Fault::new(0, "group records missing")),
        });
        r.as_ref().map(|c| &c.ids[..]).map_err(|f| self.fault(f))
    }

    /// The records of `group` with their entries, in canonical tree order
    /// ([`GroupRecords`]; the same ids as [`Trace::group_records`], read
    /// and verified the same way): what a comparison walks, without a
    /// lookup by id per record.
    pub fn group_entries<'a>(&'a self, group: &'a GroupNode) -> Result<GroupRecords<'a>, TraceError> {
        let ids = self.group_records(group)?;
        Ok(match &self.store {
            Store::V1(s) => GroupRecords::of_flat(ids, &s.entries),
            Store::V2(_) => match group.content.get() {
                Some(Ok(c)) => GroupRecords::of_group(&c.ids, &c.entries),
                // Not reached: `group_records` loaded the content.
                _ => GroupRecords::empty(),
            },
        })
    }

    /// The chaining values of `group`'s pages (docs/format.md §11.9), in
    /// page order, when the file stores it paged (format version 4, BLAKE3,
    /// a group longer than a page): read with the group's page table on
    /// first use and checked to merge to the group digest. `None` for any
    /// other group. Two groups of the same (step, level, layer) with the
    /// same record count have the same layout: their records differ only
    /// inside pages whose values differ.
    pub fn group_pages<'a>(&'a self, group: &'a GroupNode) -> Result<Option<&'a [Digest]>, TraceError> {
        match &self.store {
            Store::V2(s) => s
                .paged(self, group)
                .map(|p| p.map(|p| &p.cvs[..]))
                .map_err(|f| self.fault(&f)),
            Store::V1(_) => Ok(None),
        }
    }

    /// The records (ids and entries) of pages `pages` of a paged `group`
    /// ([`Trace::group_pages`]), in canonical tree order, a record two
    /// pages share once; each page read and verified against its chaining
    /// value on first use, with the neighbouring page when a record
    /// straddles into it (so that every byte of every digest returned is
    /// checked). The records become reachable by id ([`Trace::record`]).
    /// An error for a group not stored paged.
    pub fn group_page_entries<'a>(
        &'a self,
        group: &'a GroupNode,
        pages: &[u64],
    ) -> Result<Vec<(usize, &'a IndexEntry)>, TraceError> {
        match &self.store {
            Store::V2(s) => s.page_entries(self, group, pages).map_err(|f| self.fault(&f)),
            Store::V1(_) => Err(TraceError::format(
                &self.path,
                0,
                "version 1 stores no paged group",
            )),
        }
    }

    /// The records of `group` at `position` (ids and entries), in canonical
    /// tree order. A paged group ([`Trace::group_pages`]) reads only the
    /// pages that hold the position, found by bisection over its pages (a
    /// group's records are in position order), each page read and verified
    /// as [`Trace::group_page_entries`] reads it; any other group is read
    /// whole ([`Trace::group_entries`]).
    pub fn group_entries_at<'a>(
        &'a self,
        group: &'a GroupNode,
        position: u32,
    ) -> Result<Vec<(usize, &'a IndexEntry)>, TraceError> {
        let Some(cvs) = self.group_pages(group)? else {
            return Ok(self
                .group_entries(group)?
                .iter()
                .filter(|(_, e)| e.coord.position == position)
                .collect());
        };
        let n = cvs.len() as u64;
        // The first page whose last record is at or after the position:
        // narrowed first by the pages already read (a comparison looks up
        // positions inside the pages it read, or next to them), then
        // searched. A page read whose first record lies before the
        // position bounds the answer from below too: every page before it
        // ends at or before that record.
        let (mut lo, mut hi) = (0u64, n);
        if let Store::V2(s) = &self.store {
            for (j, first, last) in s.loaded_positions(group) {
                if last < position {
                    lo = lo.max(j + 1);
                } else {
                    hi = hi.min(j);
                    if first < position {
                        lo = lo.max(j);
                    }
                }
            }
        }
        // Bounded by a page read: probe the pages just before it first
        // (1, 2, 4, … back), so that a position next to the pages read
        // costs a page or two whatever the group's length.
        if hi < n {
            let mut step = 1u64;
            while lo < hi {
                let probe = hi.saturating_sub(step).max(lo);
                let page = self.group_page_entries(group, &[probe])?;
                match page.last() {
                    Some((_, e)) if e.coord.position < position => {
                        lo = probe + 1;
                        break;
                    }
                    _ => hi = probe,
                }
                step *= 2;
            }
        }
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let page = self.group_page_entries(group, &[mid])?;
            match page.last() {
                Some((_, e)) if e.coord.position < position => lo = mid + 1,
                _ => hi = mid,
            }
        }
        let mut out: Vec<(usize, &IndexEntry)> = Vec::new();
        for j in lo..n {
            let page = self.group_page_entries(group, &[j])?;
            for &(id, e) in &page {
                // A record two pages share is taken once.
                if e.coord.position == position && !out.iter().any(|&(i, _)| i == id) {
                    out.push((id, e));
                }
            }
            if page.last().is_none_or(|(_, e)| e.coord.position > position) {
                break;
            }
        }
        Ok(out)
    }

    /// Page blocks (format version 4) read so far: for tests of what a
    /// command reads.
    #[doc(hidden)]
    pub fn pages_read(&self) -> u64 {
        match &self.store {
            Store::V2(s) => s.pages_read(),
            Store::V1(_) => 0,
        }
    }

    /// The records of `group` (a group of one of this trace's step nodes)
    /// with their ids, in canonical tree order, read and verified as
    /// [`Trace::group_records`] reads them (version 2: the group block
    /// against its digest in the step node, every record checked, the ids
    /// distinct) but **not kept** by the trace: the caller holds them for
    /// as long as it needs them and memory follows what it holds (what
    /// `replay` streams a long trace with). A group already loaded is
    /// copied from memory; version 1 copies from its index.
    pub fn read_group(&self, group: &GroupNode) -> Result<Vec<HeldRecord>, TraceError> {
        let held = |ids: &[usize], entries: &dyn Fn(usize, usize) -> Option<IndexEntry>| {
            ids.iter()
                .enumerate()
                .filter_map(|(k, &id)| entries(k, id).map(|entry| HeldRecord { id, entry }))
                .collect::<Vec<_>>()
        };
        match &self.store {
            Store::V1(s) => {
                let ids = self.group_records(group)?;
                Ok(held(ids, &|_, id| s.entries.get(id).cloned()))
            }
            Store::V2(s) => match group.content.get() {
                Some(Ok(c)) => Ok(held(&c.ids, &|k, _| c.entries.get(k).cloned())),
                Some(Err(f)) => Err(self.fault(f)),
                None => s.read_held(self, group).map_err(|f| self.fault(&f)),
            },
        }
    }

    /// The payload of `r`, a record [`Trace::read_group`] of this trace
    /// handed out, re-hashed against its record digest like
    /// [`Trace::payload_verified`]. A payload already matched is returned
    /// without re-hashing only when its id is known to be the record's
    /// alone (version 1, or a trace [`Trace::verify_payloads`] checked,
    /// which proves every step's write-order numbers a permutation);
    /// otherwise it is re-hashed on every call and nothing is remembered.
    pub fn held_payload(&self, r: &HeldRecord) -> Result<Option<&[u8]>, TraceError> {
        let Some(p) = r.entry.payload else {
            return Ok(None);
        };
        let ids_unique = matches!(self.store, Store::V1(_)) || self.is_fully_verified();
        if ids_unique && self.is_verified(r.id) {
            if let Some(bytes) = self.raw_payload(p) {
                return Ok(Some(bytes));
            }
        }
        let bytes = self.check_payload(r.id, &r.entry, p)?;
        if ids_unique {
            self.mark_verified(r.id);
        }
        Ok(Some(bytes))
    }

    /// The record with id `i` (its position in write order), when this
    /// trace has it in memory: every record of a version 1 trace, the
    /// records of the groups [`Trace::group_records`] has loaded of a
    /// version 2 trace (and every record after [`Trace::records`]).
    pub fn get_record(&self, i: usize) -> Option<&IndexEntry> {
        match &self.store {
            Store::V1(s) => s.entries.get(i),
            Store::V2(s) => s.record(self, i),
        }
    }

    /// The record with id `i` (its position in write order), read from the
    /// file if it is not in memory yet (version 2: the groups of its step,
    /// verified as [`Trace::group_records`] verifies them); `Ok(None)` when
    /// the trace holds fewer records.
    pub fn load_record(&self, i: usize) -> Result<Option<&IndexEntry>, TraceError> {
        if let Some(e) = self.get_record(i) {
            return Ok(Some(e));
        }
        match &self.store {
            Store::V1(_) => Ok(None),
            Store::V2(s) => s.resolve(self, i),
        }
    }

    /// The record with id `i`, which must be an id this trace handed out
    /// ([`Trace::group_records`], [`Trace::records`], [`Trace::load_record`]).
    ///
    /// # Panics
    ///
    /// When `i` is no such id (like indexing a slice out of bounds).
    pub fn record(&self, i: usize) -> &IndexEntry {
        match self.get_record(i) {
            Some(e) => e,
            None => panic!("record id {i} was not handed out by this trace"),
        }
    }

    /// Every record in write (execution) order. A version 2 trace reads and
    /// verifies every group block for it and keeps the whole index in memory
    /// (for commands that analyse a whole trace: `certify`, `explain`,
    /// `replay`); comparisons use [`Trace::step`] and
    /// [`Trace::group_records`] instead.
    pub fn records(&self) -> Result<&[IndexEntry], TraceError> {
        match &self.store {
            Store::V1(s) => Ok(&s.entries),
            Store::V2(s) => s.flat(self).map_err(|f| self.fault(&f)),
        }
    }

    /// Calls `f` with every record (id and entry), step by step, without
    /// keeping a version 2 trace's index in memory: what `inspect` counts
    /// with. The order within a step is unspecified.
    pub fn for_each_record(&self, mut f: impl FnMut(usize, &IndexEntry)) -> Result<(), TraceError> {
        match &self.store {
            Store::V1(s) => {
                for (i, e) in s.entries.iter().enumerate() {
                    f(i, e);
                }
                Ok(())
            }
            Store::V2(s) => s.for_each(self, &mut f),
        }
    }

    /// Where the `k`-th step's block lies in the file (offset, length), from
    /// the root block (versions 2 and 3; `None` for version 1, which has no
    /// step blocks, and for a step the trace does not hold). A step's part
    /// of the file (its payloads, group blocks and step block, docs/format.md
    /// §11.1) ends where its step block ends, so consecutive ends measure the
    /// bytes each step added.
    pub fn step_block_extent(&self, k: usize) -> Option<(u64, u64)> {
        match &self.store {
            Store::V2(s) => s.step_block(k),
            Store::V1(_) => None,
        }
    }

    /// Drops the mapped pages of `step`'s part of the file (its payloads,
    /// group blocks and step block, docs/format.md §11.1) from this
    /// process's resident set: for a reader that is done with the step
    /// (`replay` moving past it), so that reading every payload of a long
    /// trace once does not keep the file resident. Nothing else changes: a
    /// later read maps the same bytes again from the page cache, and what
    /// was verified stays verified. Version 1 (no step parts) and a step the
    /// trace does not hold: nothing is dropped.
    pub fn release_step(&self, step: u32) {
        if let (Store::V2(s), Some(k)) = (&self.store, self.step_index(step)) {
            if let Some((from, to)) = s.step_region(k) {
                self.release(from, to);
            }
        }
    }

    /// Drops the mapped pages lying wholly inside the span of `records`'
    /// payloads (records [`Trace::read_group`] handed out) from this
    /// process's resident set, like [`Trace::release_step`]: for a reader
    /// dropping a group it is done with. Pages of other records inside the
    /// span are dropped too; they stay readable (mapped again on their next
    /// read), so this costs at most page faults.
    pub fn release_held(&self, records: &[HeldRecord]) {
        let span = records
            .iter()
            .filter_map(|r| r.entry.payload)
            .filter_map(|p| Some((p.offset, p.offset.checked_add(p.len)?)))
            .reduce(|(a, b), (c, d)| (a.min(c), b.max(d)));
        if let Some((from, to)) = span {
            self.release(from, to.min(self.file_len()));
        }
    }

    /// Total file size.
    pub fn file_len(&self) -> u64 {
        self.data.bytes().len() as u64
    }

    fn fault(&self, f: &Fault) -> TraceError {
        TraceError::format(&self.path, f.offset, f.what.clone())
    }

    /// The bytes of payload `p` (in bounds: checked on open or on loading
    /// the record's group). Private: every caller outside
    /// [`Trace::check_payload`] goes through [`Trace::payload_verified`].
    fn raw_payload(&self, p: PayloadRef) -> Option<&[u8]> {
        self.data
            .bytes()
            .get(p.offset as usize..(p.offset.checked_add(p.len)?) as usize)
    }

    /// Whether record `i`'s payload has already been re-hashed and matched.
    fn is_verified(&self, i: usize) -> bool {
        self.verified.peek(i / 64) & (1 << (i % 64)) != 0
    }

    /// Remembers that record `i`'s payload matched its digest. The bytes are
    /// immutable (a read-only map or an owned buffer), so a matched payload
    /// stays matched; `Relaxed` suffices because the bit only saves work.
    fn mark_verified(&self, i: usize) {
        if let Some(w) = self.verified.word(i / 64) {
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
    /// payload (or the trace holds fewer records); a payload
    /// that does not match its digest, is not canonical or does not fit the
    /// record's shape is an error naming the file, the record and the
    /// payload's byte offset. A payload is hashed once: later reads of the
    /// same record (and every read after [`Trace::verify_payloads`]) return
    /// it without re-hashing.
    ///
    /// There is no accessor for unverified payload bytes:
    ///
    /// ```compile_fail
    /// # fn f(t: &moeconf_schema::Trace) {
    /// let _unchecked: Option<&[u8]> = t.payload(0);
    /// # }
    /// ```
    pub fn payload_verified(&self, i: usize) -> Result<Option<&[u8]>, TraceError> {
        let Some(e) = self.load_record(i)? else {
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
        self.data
            .bytes()
            .get(from as usize..to as usize)?
            .iter()
            .position(|&x| x != 0)
            .map(|k| from + k as u64)
    }

    fn padding_error(&self, at: u64) -> TraceError {
        TraceError::format(&self.path, at, "padding byte is not zero (corrupted file)")
    }

    /// Drops the mapped pages wholly inside `from..to` from this process's
    /// resident set once they have been verified, so that verifying a large
    /// trace does not keep all of it resident (a later read maps them again
    /// from the page cache). Only 64 KiB-aligned blocks are released.
    fn release(&self, from: u64, to: u64) {
        self.dont_need(
            from.div_ceil(RELEASE_BLOCK) * RELEASE_BLOCK,
            to / RELEASE_BLOCK * RELEASE_BLOCK,
        );
    }

    /// Drops the mapped pages of the 64 KiB blocks that `from..to` touches
    /// from this process's resident set: after a small read (a step block
    /// read for its levels alone) whose page faults mapped the cached pages
    /// around it too (the kernel's fault-around), so that reading one small
    /// block of every step does not keep the file resident.
    fn release_around(&self, from: u64, to: u64) {
        let b = to
            .div_ceil(RELEASE_BLOCK)
            .saturating_mul(RELEASE_BLOCK)
            .min(self.file_len());
        self.dont_need(from / RELEASE_BLOCK * RELEASE_BLOCK, b);
    }

    /// Whether the `len` bytes at `offset` of a memory-mapped trace are read
    /// with a positioned read instead of through the map, and that read:
    /// a block read once and dropped (a step block read for its levels)
    /// then never enters the page tables, so nothing is released after it
    /// and no other thread's TLB is flushed (at 10^7 records, releasing
    /// 1002 step blocks through `MADV_DONTNEED` was half of the gate's
    /// time). `None`: not mapped, out of the file, larger than 16 MiB, or
    /// the read failed (the caller reads through the map).
    fn read_transient(&self, offset: u64, len: u64) -> Option<Vec<u8>> {
        #[cfg(unix)]
        if let Backing::Map(_, file) = &self.data {
            use std::os::unix::fs::FileExt;
            let end = offset.checked_add(len)?;
            if end > self.file_len() || len > TRANSIENT_MAX {
                return None;
            }
            let mut buf = vec![0u8; len as usize];
            return file.read_exact_at(&mut buf, offset).ok().map(|()| buf);
        }
        let _ = (offset, len);
        None
    }

    /// `MADV_DONTNEED` on `a..b` of a memory-mapped trace (`a` a multiple of
    /// 64 KiB, `b` at most the file's length).
    fn dont_need(&self, a: u64, b: u64) {
        #[cfg(unix)]
        if let (Backing::Map(m, _), true) = (&self.data, b > a) {
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

    /// Verifies every byte of the trace: every payload re-hashed (in
    /// parallel), every padding byte zero and, for version 2, every step and
    /// group block read and checked against its parent, the records'
    /// write-order numbers a permutation, and the blocks and payloads laid
    /// out exactly as docs/format.md §11 says. The error is the first
    /// problem in file order. Afterwards every [`Trace::payload_verified`]
    /// returns without re-hashing. Verified pages of a memory-mapped trace
    /// are released as verification proceeds, so its resident memory stays
    /// bounded.
    pub fn verify_payloads(&self) -> Result<VerifySummary, TraceError> {
        let summary = match &self.store {
            Store::V1(s) => s.verify(self)?,
            Store::V2(s) => s.verify(self)?,
        };
        self.fully_verified.store(true, Ordering::Relaxed);
        Ok(summary)
    }

    /// Whether [`Trace::verify_payloads`] has succeeded on this trace.
    pub fn is_fully_verified(&self) -> bool {
        self.fully_verified.load(Ordering::Relaxed)
    }

    /// The ids of the records whose payloads have been verified so far
    /// (for tests of what a command reads).
    #[doc(hidden)]
    pub fn payloads_read(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for w in 0..self.verified.len() {
            let mut bits = self.verified.peek(w);
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                out.push(w * 64 + b);
                bits &= bits - 1;
            }
        }
        out
    }

    /// The blocks (offset, length) a version 2 trace has read so far,
    /// root block first (for tests of what a command reads; empty for
    /// version 1).
    #[doc(hidden)]
    pub fn blocks_read(&self) -> Vec<(u64, u64)> {
        match &self.store {
            Store::V1(_) => Vec::new(),
            Store::V2(s) => s.blocks_read(),
        }
    }
}

/// What a version's opening produced.
struct Opened {
    header: Header,
    binding_digest: Digest,
    root: Digest,
    record_count: u64,
    summaries: Vec<StepSummary>,
    /// Every step node (version 1), or `None` (version 2: loaded on use).
    nodes: Option<Vec<StepNode>>,
    store: Store,
}
