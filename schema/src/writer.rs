//! Streaming, atomic trace writer that writes only what its reader accepts.
//!
//! Records are appended as the runtime produces them: each tensor is
//! canonicalized and hashed in one pass and, when its payload is kept, the
//! same canonical bytes go to the file. Nothing is visible at the final path
//! until [`TraceWriter::finish`] has written the last blocks and the trailer,
//! flushed and synced: the file is written under a temporary name in the
//! same directory (`.NAME.moeconf-tmp.PID.RAND`, see [`moeconf_output`]) and
//! renamed into place, so a crash never leaves a half-written trace, and
//! every error (including a failed flush, sync or rename in `finish`)
//! removes the temporary file.
//!
//! Format version 2 (the default) streams the tree too: when the first
//! record of a later step arrives, the finished step's group blocks and step
//! block are written, so the writer holds the index entries of one step at a
//! time (plus one 124-byte reference per step) whatever the length of the
//! run. Version 2 therefore takes records step by step: a record of an
//! earlier step than one already appended is refused. Version 1 keeps the
//! whole index in memory until `finish` and takes steps in any order.
//!
//! The writer enforces every check of the reader at write time: the header
//! must decode with the reader's decoder ([`Header::to_checked_bytes`]),
//! every record must pass [`check_record`] (byte length within a u64, step
//! and phase consistent with each other and with `max_new_tokens`), paths
//! and shapes must be valid, and no coordinate may repeat at its level.
//! Whatever `finish` accepts, [`crate::Trace::open_verified`] accepts.

use crate::binding::Binding;
use crate::error::TraceError;
use crate::group_stream::{EndedGroup, Spilled, StepGroups};
use crate::layout::{
    align_up, check_record, checksum, fingerprint_tree, Header, IndexEntry, PayloadRef, Preamble, Trailer,
    PAYLOAD_ALIGN, PREAMBLE_LEN,
};
use crate::steprefs::{self, StepRefLog};
use crate::v2::{
    block_digest, block_hasher, checksum_v2, encode_group_block, encode_page_block, encode_paged_group_block,
    encode_root_block_head, encode_step_block, is_block_format, is_paged_format, step_ref_len, BlockRef,
    GroupRef, LevelRefs, PageRef, StepRef, TrailerV2, FORMAT_V3, FORMAT_V4,
};
use crate::Trace;
use moeconf_fingerprint::group_pages::GroupPages;
use moeconf_fingerprint::wire::Encoder;
use moeconf_fingerprint::{
    binding_digest, group_digest, group_prefix, level_digest, record_digest_with_sink,
    record_digests_in_place, step_digest, Algorithm, Coord, Digest, Interner, Level, Phase, RecordPath,
    RecordRef, RootHasher, TensorView,
};
use moeconf_output::{check_output, AtomicFile, CheckedOutput, Inputs};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One record of [`TraceWriter::append_batch`]: the arguments of
/// [`TraceWriter::append`].
#[derive(Debug, Clone)]
pub struct BatchRecord<'a> {
    /// Tensor identity.
    pub coord: Coord,
    pub level: Level,
    pub tensor: TensorView<'a>,
    /// Whether the trace keeps the record's bytes.
    pub keep_payload: bool,
}

/// Write buffer of a trace file. Small, because a capture's writer runs
/// beside the forward pass and shares its last-level cache: every byte of
/// buffer the writer cycles through is a byte of model weights evicted
/// (docs/performance.md, "Capture overhead"); writes of a payload larger
/// than the buffer go to the file directly.
const BUFFER: usize = 64 << 10;

/// The format version [`TraceWriter::create`] writes.
pub const DEFAULT_FORMAT_VERSION: u32 = FORMAT_V4;

/// What [`TraceWriter::finish`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteSummary {
    /// Root digest of the written trace.
    pub root: Digest,
    pub records: u64,
    /// Records that kept payloads.
    pub payloads: u64,
    /// Final file size in bytes.
    pub bytes: u64,
}

/// What identifies a record inside a step: level, layer, position, phase and
/// path, packed (the path as its [`PathIds`] number) in 101 bits: 16 bytes
/// a record where the tuple with the path took 32, and hashed without
/// reading the path's text. A long prefill holds one per record of the
/// step until the step is written (36 M at 128k tokens).
type Key = u128;

/// Numbers for the paths of the records the writer holds keys of, equal
/// for equal texts.
#[derive(Default)]
struct PathIds {
    /// A `'static` path's literal ([`RecordPath::static_addr`]) to its number.
    by_addr: HashMap<usize, u32>,
    by_text: HashMap<RecordPath, u32>,
}

impl PathIds {
    fn id(&mut self, path: &RecordPath) -> u32 {
        let addr = path.static_addr();
        if let Some(id) = addr.and_then(|a| self.by_addr.get(&a)) {
            return *id;
        }
        let next = self.by_text.len() as u32;
        let id = *self.by_text.entry(path.clone()).or_insert(next);
        if let Some(a) = addr {
            self.by_addr.insert(a, id);
        }
        id
    }

    fn clear(&mut self) {
        self.by_addr.clear();
        self.by_text.clear();
    }
}

/// A record's level and coordinate but its step and path in 69 bits, in
/// comparison order: 3 bits level, 33 layer (0: none), 32 position, 1
/// phase. The duplicate check's [`Key`] and [`tree_order`]'s sort key both
/// start with it.
fn coord_bits(level: Level, coord: &Coord) -> u128 {
    let layer = coord.layer.map_or(0u128, |l| u128::from(l) + 1);
    (u128::from(level.code()) << 66)
        | (layer << 33)
        | (u128::from(coord.position) << 1)
        | (coord.phase as u128)
}

/// The packed [`Key`]: [`coord_bits`], then 32 bits of path number.
fn key_of(ids: &mut PathIds, coord: &Coord, level: Level) -> Key {
    (coord_bits(level, coord) << 32) | u128::from(ids.id(&coord.path))
}

/// What the writer keeps besides the file.
enum Body {
    /// Version 1: every entry, and every (step, key) seen.
    V1 {
        entries: Vec<IndexEntry>,
        keys: HashSet<(u32, Key)>,
        ids: PathIds,
    },
    /// Version 2: the entries of the current step only, and the references
    /// of the steps written (bounded in memory, see [`StepRefLog`]).
    V2 {
        /// 2, or 3 (the root block also lists each step's level digests).
        version: u32,
        step: Option<u32>,
        pending: Vec<IndexEntry>,
        keys: HashSet<Key>,
        /// The numbers of the current step's paths, for its keys.
        ids: PathIds,
        steps: StepRefLog,
    },
}

/// Appends records to a new trace file.
pub struct TraceWriter {
    path: PathBuf,
    /// The temporary file; `None` once finished or after a failed write
    /// (the temporary file is then already removed).
    out: Option<AtomicFile>,
    alg: Algorithm,
    header: Header,
    binding_digest: Digest,
    preamble_and_header: Vec<u8>,
    pos: u64,
    records: u64,
    payloads: u64,
    body: Body,
    /// One shared path and shape per distinct value among the entries.
    interner: Interner,
    parallel: bool,
    /// The current step's groups (version 4 with BLAKE3: their long
    /// groups' page blocks encoded as the records arrive); `None` only
    /// while a step's blocks are being written.
    groups: Option<StepGroups>,
}

impl TraceWriter {
    /// Starts a trace at `path` (written to a temporary sibling until
    /// finished). The path is checked as an output with no known inputs
    /// ([`check_output`]); commands that read files use
    /// [`TraceWriter::create_checked`] with their inputs. A header that a
    /// reader would refuse is an error before any file is created.
    pub fn create(path: &Path, alg: Algorithm, header: Header) -> Result<TraceWriter, TraceError> {
        let out = check_output(path, &Inputs::new())?;
        TraceWriter::create_checked(&out, alg, header)
    }

    /// Starts a trace at an output already checked against the command's
    /// inputs, in the default format version.
    pub fn create_checked(
        out: &CheckedOutput,
        alg: Algorithm,
        header: Header,
    ) -> Result<TraceWriter, TraceError> {
        TraceWriter::create_version(out, alg, header, DEFAULT_FORMAT_VERSION)
    }

    /// Starts a trace of container format `version` (1 or 2) at a checked
    /// output (`moeconf convert --to`, tests of version 1 readers).
    pub fn create_version(
        out: &CheckedOutput,
        alg: Algorithm,
        header: Header,
        version: u32,
    ) -> Result<TraceWriter, TraceError> {
        let path = out.path();
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let groups = StepGroups::new(dir, alg, is_paged_format(version) && alg == Algorithm::Blake3);
        let body = match version {
            1 => Body::V1 {
                entries: Vec::new(),
                keys: HashSet::new(),
                ids: PathIds::default(),
            },
            v if is_block_format(v) => Body::V2 {
                version: v,
                step: None,
                pending: Vec::new(),
                keys: HashSet::new(),
                ids: PathIds::default(),
                steps: StepRefLog::new(dir, steprefs::IN_MEMORY, step_ref_len(v)),
            },
            v => {
                return Err(TraceError::invalid(
                    path,
                    format!("format version {v} cannot be written (1, 2, 3 or 4)"),
                ))
            }
        };
        let header_bytes = header
            .to_checked_bytes()
            .map_err(|m| TraceError::invalid(path, m))?;
        let file = AtomicFile::with_buffer(out, BUFFER)?;
        let mut w = TraceWriter {
            path: path.to_path_buf(),
            out: Some(file),
            alg,
            binding_digest: binding_digest(alg, &header.binding.to_bytes()),
            preamble_and_header: Vec::new(),
            header,
            pos: 0,
            records: 0,
            payloads: 0,
            body,
            interner: Interner::new(),
            parallel: true,
            groups: Some(groups),
        };
        let pre = Preamble {
            algorithm: alg,
            header_len: header_bytes.len() as u64,
        };
        let mut ph = pre.to_bytes_version(version).to_vec();
        ph.extend_from_slice(&header_bytes);
        w.write_all(&ph.clone())?;
        w.preamble_and_header = ph;
        debug_assert_eq!(w.pos, PREAMBLE_LEN + header_bytes.len() as u64);
        w.pad_to_alignment()?;
        Ok(w)
    }

    /// Whether large tensors may be hashed on the rayon pool (default on;
    /// digests are identical either way).
    pub fn set_parallel_hashing(&mut self, on: bool) {
        self.parallel = on;
    }

    /// Whether a long group's page blocks are encoded while its step's
    /// records arrive rather than all at the step's end (default on where
    /// groups are paged: version 4 with BLAKE3). The file's bytes are the
    /// same either way; only the pause at a long step's end differs. Only
    /// before the first record; later calls change nothing.
    pub fn set_group_streaming(&mut self, on: bool) {
        if self.records != 0 {
            return;
        }
        if let Some(g) = &mut self.groups {
            let paged = matches!(&self.body, Body::V2 { version, .. } if is_paged_format(*version));
            g.set_on(on && paged && self.alg == Algorithm::Blake3);
        }
    }

    /// The path the trace is being written to (it appears there when finished).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The binding this trace is being written under.
    pub fn binding(&self) -> &Binding {
        &self.header.binding
    }

    pub fn algorithm(&self) -> Algorithm {
        self.alg
    }

    /// The container format version being written.
    pub fn format_version(&self) -> u32 {
        match self.body {
            Body::V1 { .. } => 1,
            Body::V2 { version, .. } => version,
        }
    }

    /// Records appended so far.
    pub fn record_count(&self) -> usize {
        self.records as usize
    }

    /// The open temporary file, or the error of a writer that finished or failed.
    fn file(&mut self) -> Result<&mut AtomicFile, TraceError> {
        let path = &self.path;
        self.out
            .as_mut()
            .ok_or_else(|| TraceError::invalid(path, "trace writer already finished or failed"))
    }

    /// A failed write leaves the file unusable: drop it (removing the
    /// temporary file) so that nothing more is written.
    fn failed(&mut self, what: &'static str, e: std::io::Error) -> TraceError {
        self.out = None;
        TraceError::io(&self.path, what, e)
    }

    /// The open temporary file, as an I/O error when there is none.
    fn file_io(&mut self) -> std::io::Result<&mut AtomicFile> {
        self.out
            .as_mut()
            .ok_or_else(|| std::io::Error::other("trace writer already finished or failed"))
    }

    fn write_all(&mut self, bytes: &[u8]) -> Result<(), TraceError> {
        if let Err(e) = self.file()?.write_all(bytes) {
            return Err(self.failed("writing trace", e));
        }
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn pad_to_alignment(&mut self) -> Result<(), TraceError> {
        let target = align_up(self.pos).ok_or_else(|| TraceError::invalid(&self.path, "trace too large"))?;
        let zeros = [0u8; PAYLOAD_ALIGN as usize];
        let n = (target - self.pos) as usize;
        self.write_all(&zeros[..n])
    }

    /// Writes a block at the next 64-byte boundary; returns where it lies.
    fn write_block(&mut self, bytes: &[u8]) -> Result<BlockRef, TraceError> {
        self.pad_to_alignment()?;
        let offset = self.pos;
        self.write_all(bytes)?;
        Ok(BlockRef {
            offset,
            len: bytes.len() as u64,
            digest: block_digest(self.alg, bytes),
        })
    }

    /// Checks that a record's step may be appended (version 2: no earlier
    /// step than the current one). Changes nothing.
    fn check_order(&self, coord: &Coord) -> Result<(), TraceError> {
        match &self.body {
            Body::V2 { step: Some(s), .. } if coord.step < *s => Err(TraceError::invalid(
                &self.path,
                format!(
                    "record {coord}: step {} after step {s}: format version 2 takes records step by step \
                     (in execution order)",
                    coord.step
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Takes the record's coordinate at its level, refusing one already
    /// taken (a duplicate coordinate), changing nothing then. One lookup
    /// per record: the set is the writer's largest per-record cost on a long
    /// prefill (docs/performance.md, "Long context"). Version 2 calls it
    /// after [`Self::enter_step`], so the set holds the current step's.
    fn claim(&mut self, coord: &Coord, level: Level) -> Result<(), TraceError> {
        let fresh = match &mut self.body {
            Body::V1 { keys, ids, .. } => keys.insert((coord.step, key_of(ids, coord, level))),
            Body::V2 { keys, ids, .. } => keys.insert(key_of(ids, coord, level)),
        };
        if fresh {
            Ok(())
        } else {
            Err(TraceError::invalid(
                &self.path,
                format!("record {coord} at {level} was already appended (duplicate coordinate)"),
            ))
        }
    }

    /// Gives back a coordinate [`Self::claim`] took for a record that was
    /// then refused, so the writer is as it was.
    fn release(&mut self, coord: &Coord, level: Level) {
        match &mut self.body {
            Body::V1 { keys, ids, .. } => keys.remove(&(coord.step, key_of(ids, coord, level))),
            Body::V2 { keys, ids, .. } => keys.remove(&key_of(ids, coord, level)),
        };
    }

    /// Version 2: before the first record of a later step, writes the
    /// finished step's blocks.
    fn enter_step(&mut self, step: u32) -> Result<(), TraceError> {
        if let Body::V2 { step: Some(s), .. } = self.body {
            if s != step {
                self.flush_step()?;
            }
        }
        if let Body::V2 { step: current, .. } = &mut self.body {
            *current = Some(step);
        }
        Ok(())
    }

    /// Appends one record; keeps its canonical bytes when `keep_payload`.
    /// Returns the record digest. A record its reader would refuse (invalid
    /// path, shape that does not fit the bytes or a u64, step and phase
    /// inconsistent with each other or with the binding's `max_new_tokens`,
    /// a coordinate already appended at its level) is an error and leaves
    /// the writer as it was; so is, in version 2, a record of an earlier
    /// step than the last one appended.
    pub fn append(
        &mut self,
        coord: Coord,
        level: Level,
        tensor: TensorView<'_>,
        keep_payload: bool,
    ) -> Result<Digest, TraceError> {
        self.append_hashed(coord, level, tensor, keep_payload, None)
    }

    /// Appends `records` in order, exactly as calling [`TraceWriter::append`]
    /// on each would (the same file bytes; the same error at the same record,
    /// the records before it appended, none after it), but digests the short
    /// ones together ([`record_digests_in_place`]: BLAKE3 in SIMD lanes,
    /// several times faster than one record at a time). What the capture's
    /// writer thread calls for each batch.
    pub fn append_batch(&mut self, records: Vec<BatchRecord<'_>>) -> Result<(), TraceError> {
        let refs: Vec<RecordRef<'_>> = records
            .iter()
            .map(|r| RecordRef {
                coord: &r.coord,
                level: r.level,
                tensor: r.tensor,
            })
            .collect();
        let digests = record_digests_in_place(self.alg, self.header.binding.canon, &refs);
        for (r, d) in records.into_iter().zip(digests) {
            self.append_hashed(r.coord, r.level, r.tensor, r.keep_payload, d)?;
        }
        Ok(())
    }

    /// [`TraceWriter::append`], with the record's digest already computed
    /// when `hashed` is set — by [`record_digests_in_place`], which gives one
    /// only for bytes that are canonical as they are, so they are stored
    /// unchanged.
    fn append_hashed(
        &mut self,
        coord: Coord,
        level: Level,
        tensor: TensorView<'_>,
        keep_payload: bool,
        hashed: Option<Digest>,
    ) -> Result<Digest, TraceError> {
        Coord::validate_path(&coord.path).map_err(|m| TraceError::invalid(&self.path, m))?;
        check_record(&self.header.binding, &coord, tensor.dtype, tensor.shape)
            .map_err(|m| TraceError::invalid(&self.path, format!("record {coord}: {m}")))?;
        tensor
            .validate(&coord.path)
            .map_err(|e| TraceError::invalid(&self.path, e.to_string()))?;
        self.check_order(&coord)?;
        self.enter_step(coord.step)?;
        self.claim(&coord, level)?;
        if keep_payload {
            // After a step's blocks (version 2) the next payload starts at
            // the next 64-byte boundary, like every payload and block.
            self.pad_to_alignment()?;
        }
        let canon = self.header.binding.canon;
        let (alg, parallel) = (self.alg, self.parallel);
        let payload = if keep_payload {
            Some(PayloadRef {
                offset: self.pos,
                len: tensor.bytes.len() as u64,
            })
        } else {
            None
        };
        let digest = if let Some(d) = hashed {
            if keep_payload {
                if let Err(e) = self.file()?.write_all(tensor.bytes) {
                    return Err(self.failed("writing trace payload", e));
                }
                self.pos += tensor.bytes.len() as u64;
                self.pad_to_alignment()?;
            }
            d
        } else if keep_payload {
            let out = self.file()?;
            let d =
                record_digest_with_sink(alg, canon, &coord, level, tensor, parallel, |b| out.write_all(b));
            let d = match d {
                Ok(d) => d,
                Err(moeconf_fingerprint::FingerprintError::Sink(io)) => {
                    return Err(self.failed("writing trace payload", io))
                }
                Err(other) => return Err(self.failed("writing trace payload", std::io::Error::other(other))),
            };
            self.pos += tensor.bytes.len() as u64;
            self.pad_to_alignment()?;
            d
        } else {
            match record_digest_with_sink(alg, canon, &coord, level, tensor, parallel, |_| Ok(())) {
                Ok(d) => d,
                Err(e) => {
                    self.release(&coord, level);
                    return Err(TraceError::invalid(&self.path, e.to_string()));
                }
            }
        };
        self.push(coord, level, tensor.dtype, tensor.shape, digest, payload);
        Ok(digest)
    }

    /// Appends a fingerprint-only record whose digest the caller computed
    /// from its canonical bytes (an incremental digest of persistent state
    /// that only grows, `moeconf_fingerprint::incremental`): the same checks
    /// as [`TraceWriter::append`] on the coordinate, dtype and shape, then
    /// the digest as given. The caller answers for the digest: the trace
    /// holds no bytes to check it against.
    pub fn append_fingerprint(
        &mut self,
        coord: Coord,
        level: Level,
        dtype: moeconf_fingerprint::DType,
        shape: &[u64],
        digest: Digest,
    ) -> Result<Digest, TraceError> {
        Coord::validate_path(&coord.path).map_err(|m| TraceError::invalid(&self.path, m))?;
        check_record(&self.header.binding, &coord, dtype, shape)
            .map_err(|m| TraceError::invalid(&self.path, format!("record {coord}: {m}")))?;
        if TensorView::byte_len(dtype, shape).is_none() {
            return Err(TraceError::invalid(
                &self.path,
                format!("record {coord}: shape {shape:?} overflows"),
            ));
        }
        self.check_order(&coord)?;
        self.enter_step(coord.step)?;
        self.claim(&coord, level)?;
        self.push(coord, level, dtype, shape, digest, None);
        Ok(digest)
    }

    /// Appends record `i` of `source` (a trace opened and verified by the
    /// caller) with its digest, copying its verified payload when it has
    /// one: what `moeconf convert` does. A payload is hashed again on the
    /// way, and must give the source's digest.
    pub fn append_from(&mut self, source: &Trace, i: usize) -> Result<Digest, TraceError> {
        let e = source
            .get_record(i)
            .ok_or_else(|| {
                TraceError::invalid(&self.path, format!("record {i} of the source is not loaded"))
            })?
            .clone();
        let payload = source.payload_verified(i)?;
        let Some(bytes) = payload else {
            // A fingerprint-only record: its digest is covered by the
            // source's root, which the output's root must reproduce.
            check_record(&self.header.binding, &e.coord, e.dtype, &e.shape)
                .map_err(|m| TraceError::invalid(&self.path, format!("record {}: {m}", e.coord)))?;
            self.check_order(&e.coord)?;
            self.enter_step(e.coord.step)?;
            self.claim(&e.coord, e.level)?;
            self.push(e.coord, e.level, e.dtype, &e.shape, e.digest, None);
            return Ok(e.digest);
        };
        let view = TensorView {
            dtype: e.dtype,
            shape: &e.shape,
            bytes,
        };
        let d = self.append(e.coord.clone(), e.level, view, true)?;
        if d != e.digest {
            self.out = None;
            return Err(TraceError::invalid(
                &self.path,
                format!(
                    "record {}: its payload does not give the source's digest",
                    e.coord
                ),
            ));
        }
        Ok(d)
    }

    /// Records an appended entry.
    fn push(
        &mut self,
        coord: Coord,
        level: Level,
        dtype: moeconf_fingerprint::DType,
        shape: &[u64],
        digest: Digest,
        payload: Option<PayloadRef>,
    ) {
        let coord = Coord {
            path: self.interner.share(coord.path),
            ..coord
        };
        let entry = IndexEntry {
            level,
            dtype,
            shape: self.interner.shape(shape),
            digest,
            payload,
            coord,
        };
        match &mut self.body {
            Body::V1 { entries, .. } => entries.push(entry),
            Body::V2 { pending, .. } => {
                pending.push(entry);
                if let Some(g) = &mut self.groups {
                    let i = pending.len() - 1;
                    g.add(pending, i, self.records - i as u64);
                }
            }
        }
        self.records += 1;
        self.payloads += u64::from(payload.is_some());
    }

    /// Writes the blocks of one group (`members`: indices into `entries`,
    /// in tree order) and returns its group block's reference. Version 4
    /// writes a group whose digest preimage is longer than one page (BLAKE3
    /// only) as its page blocks, in page order, then a group block holding
    /// their page table (docs/format.md §11.9); every other group is one
    /// group block, as in version 2. `spilled` are the group's first page
    /// blocks, encoded while the step ran ([`StepGroups`]): copied as they
    /// are, the rest encoded here. Gives also the group digest of a paged
    /// group, merged from its pages' chaining values.
    #[allow(clippy::too_many_arguments)]
    fn write_group(
        &mut self,
        step: u32,
        level: Level,
        layer: Option<u32>,
        base: u64,
        entries: &[IndexEntry],
        members: &[usize],
        spilled: (&[Spilled], &StepGroups),
    ) -> Result<(BlockRef, Option<Digest>), TraceError> {
        let paged_format = matches!(&self.body, Body::V2 { version, .. } if is_paged_format(*version));
        let prefix = group_prefix(step, level, layer, members.len() as u64);
        let layout = GroupPages::new(prefix.len() as u64, members.len() as u64);
        let Some(layout) = layout.filter(|l| paged_format && self.alg == Algorithm::Blake3 && l.is_paged())
        else {
            let bytes = encode_group_block(
                step,
                level,
                layer,
                members.iter().map(|&m| (base + m as u64, &entries[m])),
            );
            return Ok((self.write_block(&bytes)?, None));
        };
        let (spilled, groups) = spilled;
        if spilled.len() as u64 > layout.count() {
            return Err(TraceError::invalid(
                &self.path,
                format!("step {step}: more page blocks encoded than the group has pages"),
            ));
        }
        let mut pages = Vec::with_capacity(layout.count() as usize);
        for j in 0..layout.count() {
            let r = layout.entries(j);
            let part = &members[r.start as usize..r.end as usize];
            let early = spilled.get(j as usize);
            let cv = match early {
                // Every page but the first is independent of the group's
                // length; the first holds the prefix, which counts it.
                Some(s) if j > 0 => Some(s.cv),
                _ => {
                    let digests: Vec<Digest> = part.iter().map(|&m| entries[m].digest).collect();
                    layout.cv(j, &prefix, &digests)
                }
            };
            let cv = cv.ok_or_else(|| {
                TraceError::invalid(
                    &self.path,
                    format!("step {step}: group page {j} does not fit its layout"),
                )
            })?;
            let block = match early {
                Some(s) => {
                    self.pad_to_alignment()?;
                    let offset = self.pos;
                    let copied = groups
                        .source(s)
                        .and_then(|(src, at)| self.file_io()?.copy_range(src, at, s.len));
                    if let Err(e) = copied {
                        return Err(
                            self.failed("copying a page block from a temporary file beside the trace", e)
                        );
                    }
                    self.pos += s.len;
                    BlockRef {
                        offset,
                        len: s.len,
                        digest: s.digest,
                    }
                }
                None => {
                    let bytes = encode_page_block(
                        step,
                        level,
                        layer,
                        j as u32,
                        part.iter().map(|&m| (base + m as u64, &entries[m])),
                    );
                    self.write_block(&bytes)?
                }
            };
            pages.push(PageRef { cv, block });
        }
        let cvs: Vec<Digest> = pages.iter().map(|p| p.cv).collect();
        let digest = layout.digest(&cvs);
        let block = self.write_block(&encode_paged_group_block(step, level, layer, &pages))?;
        Ok((block, digest))
    }

    /// Version 2: writes the current step's group blocks (tree order) and
    /// step block, and forgets its entries.
    fn flush_step(&mut self) -> Result<(), TraceError> {
        let Body::V2 {
            step: Some(step),
            pending,
            keys,
            ids,
            ..
        } = &mut self.body
        else {
            return Ok(());
        };
        let step = *step;
        let entries = std::mem::take(pending);
        // Clearing costs the table's capacity, not its length: after a step
        // far larger than the next ones (a long prefill) the table shrinks
        // to the next step's size, so a decode step never pays for the prompt.
        let held = keys.len();
        keys.clear();
        keys.shrink_to(held);
        ids.clear();
        // Only this step's entries share the interned paths and shapes; a
        // shape that grows with the position (a cache's length) would
        // otherwise keep one allocation per step for the whole run.
        self.interner = Interner::new();
        let Some(mut groups) = self.groups.take() else {
            return Err(TraceError::invalid(&self.path, "trace writer already failed"));
        };
        let written = if entries.is_empty() {
            Ok(())
        } else {
            self.write_step(step, &entries, &mut groups)
        };
        groups.clear();
        self.groups = Some(groups);
        written
    }

    /// Writes the group blocks and step block of `step`, whose entries are
    /// `entries`.
    fn write_step(
        &mut self,
        step: u32,
        entries: &[IndexEntry],
        groups: &mut StepGroups,
    ) -> Result<(), TraceError> {
        let base = self.records - entries.len() as u64;
        let ended = match groups.end_step(entries) {
            Some(ended) => ended,
            None => whole_step_groups(entries),
        };
        let mut levels: Vec<LevelRefs> = Vec::new();
        let mut level_records = [0u64; 5];
        for g in &ended {
            let (level, layer, members) = (g.level, g.layer, &g.members[..]);
            let (block, merged) =
                self.write_group(step, level, layer, base, entries, members, (&g.spilled, groups))?;
            let digest = merged.unwrap_or_else(|| {
                group_digest(
                    self.alg,
                    step,
                    level,
                    layer,
                    members.iter().map(|&m| entries[m].digest),
                )
            });
            let g = GroupRef {
                layer,
                digest,
                records: members.len() as u64,
                block,
            };
            level_records[level.code() as usize] += g.records;
            match levels.last_mut() {
                Some(l) if l.level == level => l.groups.push(g),
                _ => levels.push(LevelRefs {
                    level,
                    groups: vec![g],
                }),
            }
        }
        let block = self.write_block(&encode_step_block(step, &levels))?;
        let digest = step_digest(
            self.alg,
            step,
            levels.iter().map(|l| {
                (
                    l.level,
                    level_digest(self.alg, step, l.level, l.groups.iter().map(|g| g.digest)),
                )
            }),
        );
        let mut level_digests = [Digest::ZERO; 5];
        for l in &levels {
            level_digests[l.level.code() as usize] =
                level_digest(self.alg, step, l.level, l.groups.iter().map(|g| g.digest));
        }
        if let Body::V2 { steps, version, .. } = &mut self.body {
            let r = StepRef {
                step,
                digest,
                level_records,
                block,
                level_digests: (*version >= FORMAT_V3).then_some(level_digests),
            };
            if let Err(e) = steps.push(&r) {
                return Err(self.failed(
                    "keeping the step references (a temporary file beside the trace)",
                    e,
                ));
            }
        }
        Ok(())
    }

    /// Writes the index (version 1) or the last step's blocks and the root
    /// block (version 2), then the trailer; syncs, and renames the file into
    /// place.
    pub fn finish(mut self) -> Result<WriteSummary, TraceError> {
        let root = match self.body {
            Body::V1 { .. } => self.finish_v1()?,
            Body::V2 { .. } => self.finish_v2()?,
        };
        // On any failure of the flush, sync, re-check or rename the
        // temporary file is removed (AtomicFile::commit).
        let file = self
            .out
            .take()
            .ok_or_else(|| TraceError::invalid(&self.path, "trace writer already finished or failed"))?;
        file.commit()?;
        Ok(WriteSummary {
            root,
            records: self.records,
            payloads: self.payloads,
            bytes: self.pos,
        })
    }

    fn finish_v1(&mut self) -> Result<Digest, TraceError> {
        let Body::V1 { entries, .. } = &self.body else {
            return Err(TraceError::invalid(&self.path, "not a version 1 writer"));
        };
        let (_, tree) = fingerprint_tree(self.alg, &self.header.binding, entries)
            .map_err(|e| TraceError::invalid(&self.path, e.to_string()))?;
        let mut e = Encoder::new();
        e.len(entries.len());
        for entry in entries {
            entry.encode(&mut e);
        }
        let index = e.into_bytes();
        let mut trailer = Trailer {
            index_offset: self.pos,
            index_len: index.len() as u64,
            record_count: entries.len() as u64,
            root: tree.root,
            checksum: Digest::ZERO,
        };
        trailer.checksum = checksum(
            self.alg,
            &self.preamble_and_header,
            &index,
            &trailer.covered_bytes(),
        );
        self.write_all(&index)?;
        self.write_all(&trailer.to_bytes())?;
        Ok(tree.root)
    }

    fn finish_v2(&mut self) -> Result<Digest, TraceError> {
        self.flush_step()?;
        let Body::V2 { steps, version, .. } = &mut self.body else {
            return Err(TraceError::invalid(&self.path, "not a version 2 writer"));
        };
        let ref_len = step_ref_len(*version) as usize;
        // The root block is streamed from the log: its head, then every
        // step reference, hashed for the block digest and the root as they
        // are written.
        let mut steps = std::mem::replace(steps, StepRefLog::new(Path::new("."), 0, ref_len as u64));
        let mut head = Encoder::new();
        encode_root_block_head(&mut head, steps.len());
        self.pad_to_alignment()?;
        let offset = self.pos;
        let mut block = block_hasher(self.alg);
        let mut root = RootHasher::new(self.alg, self.binding_digest, steps.len());
        self.write_all(head.as_bytes())?;
        block.update(head.as_bytes());
        let path = self.path.clone();
        steps.for_each_piece(
            |piece| {
                // Pieces hold whole references (the log's own encoding); a
                // piece that does not would give a wrong root, so it is an
                // error, never skipped.
                if piece.len() % ref_len != 0 {
                    return Err(TraceError::invalid(&path, "a step reference of the wrong length"));
                }
                for r in piece.chunks_exact(ref_len) {
                    let (step, digest) = StepRef::step_and_digest(r)
                        .ok_or_else(|| TraceError::invalid(&path, "a step reference of the wrong length"))?;
                    root.push(step, digest);
                }
                block.update(piece);
                self.write_all(piece)
            },
            |e| TraceError::Io {
                path: path.clone(),
                what: "reading back the step references (a temporary file beside the trace)",
                source: e,
            },
        )?;
        let root_block = BlockRef {
            offset,
            len: self.pos - offset,
            digest: block.finalize(),
        };
        let root = root.finish();
        let mut trailer = TrailerV2 {
            root_block,
            record_count: self.records,
            root,
            checksum: Digest::ZERO,
        };
        trailer.checksum = checksum_v2(self.alg, &self.preamble_and_header, &trailer.covered_bytes());
        self.write_all(&trailer.to_bytes())?;
        Ok(root)
    }
}

/// A step's groups in tree order, each with its members in tree order, from
/// one sort of the whole step.
fn whole_step_groups(entries: &[IndexEntry]) -> Vec<EndedGroup> {
    let order = tree_order(entries);
    let mut out = Vec::new();
    let mut i = 0;
    while i < order.len() {
        let (level, layer) = (entries[order[i]].level, entries[order[i]].coord.layer);
        let start = i;
        while i < order.len() && (entries[order[i]].level, entries[order[i]].coord.layer) == (level, layer) {
            i += 1;
        }
        out.push(EndedGroup {
            level,
            layer,
            members: order[start..i].to_vec(),
            spilled: Vec::new(),
        });
    }
    out
}

/// An entry's place in the tree: level, layer (none first), position,
/// phase, path (the duplicate check's key, so unique within a step).
pub(crate) fn tree_key(e: &IndexEntry) -> (Level, Option<u32>, u32, Phase, &RecordPath) {
    (
        e.level,
        e.coord.layer,
        e.coord.position,
        e.coord.phase,
        &e.coord.path,
    )
}

/// The entries' order in the tree: by level, layer (none first), position,
/// phase and path, the key of [`TraceWriter::push`]'s duplicate check, so no
/// two entries compare equal and the order is the same whatever sort finds
/// it. Sorted as packed integers (level, layer, position, phase, the path's
/// rank among the step's distinct paths, then the entry's index) rather
/// than by comparing entries through their indices: a long prefill holds
/// millions of entries, and the comparisons' scattered reads and string
/// compares made its step the writer's longest pause (issue 35).
fn tree_order(entries: &[IndexEntry]) -> Vec<usize> {
    // Ranks of the distinct paths; the interner shares one text per path, so
    // the text's address and length find most repeats without hashing it.
    let mut by_text: HashMap<&str, u32> = HashMap::new();
    let mut last: Option<(*const u8, usize, u32)> = None;
    let mut path_ids: Vec<u32> = Vec::with_capacity(entries.len());
    for e in entries {
        let text = e.coord.path.as_str();
        let id = match last {
            Some((ptr, len, id)) if ptr == text.as_ptr() && len == text.len() => id,
            _ => {
                let next = by_text.len() as u32;
                let id = *by_text.entry(text).or_insert(next);
                last = Some((text.as_ptr(), text.len(), id));
                id
            }
        };
        path_ids.push(id);
    }
    let mut texts: Vec<(&str, u32)> = by_text.into_iter().collect();
    texts.sort_unstable();
    let mut rank = vec![0u32; texts.len()];
    for (r, (_, id)) in texts.iter().enumerate() {
        rank[*id as usize] = r as u32;
    }
    const RANK_BITS: u32 = 27;
    let fits = entries.len() <= u32::MAX as usize && texts.len() < (1 << RANK_BITS);
    if !fits {
        let mut order: Vec<usize> = (0..entries.len()).collect();
        order.sort_unstable_by_key(|&i| tree_key(&entries[i]));
        return order;
    }
    // 69 bits of coordinate ([`coord_bits`]), 27 path rank, 32 index: 128.
    let mut keys: Vec<u128> = entries
        .iter()
        .zip(&path_ids)
        .enumerate()
        .map(|(i, (e, &id))| {
            (coord_bits(e.level, &e.coord) << 59) | (u128::from(rank[id as usize]) << 32) | i as u128
        })
        .collect();
    keys.sort_unstable();
    keys.into_iter().map(|k| (k as u32) as usize).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeconf_fingerprint::DType;

    /// A version 2 trace of `steps` steps whose writer keeps `in_memory`
    /// step references in memory and spills the rest.
    fn trace(path: &Path, steps: u32, in_memory: usize) -> (WriteSummary, Vec<u8>) {
        let mut header = Header::default();
        header.binding.decoding.max_new_tokens = steps;
        let mut w = TraceWriter::create(path, Algorithm::Blake3, header).unwrap();
        let dir = path.parent().unwrap();
        if let Body::V2 { steps, .. } = &mut w.body {
            *steps = StepRefLog::new(dir, in_memory, crate::v2::step_ref_len(DEFAULT_FORMAT_VERSION));
        }
        for step in 0..steps {
            for (k, path) in ["token.output", "lm.margin"].into_iter().enumerate() {
                let bytes = (step * 2 + k as u32).to_le_bytes();
                let coord = Coord {
                    step,
                    position: step,
                    phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
                    layer: None,
                    path: path.into(),
                };
                let view = TensorView {
                    dtype: DType::I32,
                    shape: &[1],
                    bytes: &bytes,
                };
                w.append(coord, Level::L0, view, k == 0).unwrap();
            }
        }
        let summary = w.finish().unwrap();
        (summary, std::fs::read(path).unwrap())
    }

    #[test]
    fn step_references_spilled_to_a_temporary_file_give_the_same_trace() {
        let tmp = tempfile::tempdir().unwrap();
        for steps in [1u32, 5, 4097] {
            let (a, x) = trace(&tmp.path().join("memory.bin"), steps, usize::MAX);
            for in_memory in [0, 1, 3, steps as usize - 1] {
                let (b, y) = trace(&tmp.path().join("spilled.bin"), steps, in_memory);
                assert_eq!(a.root, b.root, "{steps} steps, {in_memory} in memory");
                assert!(x == y, "{steps} steps, {in_memory} in memory: the files differ");
            }
            // The file verifies, and the temporary file left nothing behind.
            let t = Trace::open_verified(&tmp.path().join("spilled.bin")).unwrap();
            assert_eq!(t.steps().len(), steps as usize);
            let mut names: Vec<_> = std::fs::read_dir(tmp.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            assert_eq!(names, ["memory.bin", "spilled.bin"]);
            // The root digest is the one of the steps' digests, as a reader
            // recomputes it.
            assert_eq!(t.root(), a.root);
        }
    }

    /// A coordinate is refused twice whatever holds its path's text: a
    /// `'static` literal, another literal of the same text, or a shared
    /// string; equal coordinates with another level, layer, position or
    /// path are taken. In both container versions.
    #[test]
    fn a_duplicate_is_refused_whichever_literal_or_string_holds_its_path() {
        static A: &str = "moe.combine";
        static B: &str = "moe.combine";
        let tmp = tempfile::tempdir().unwrap();
        for version in [1, DEFAULT_FORMAT_VERSION] {
            let out = check_output(&tmp.path().join(format!("v{version}.bin")), &Inputs::new()).unwrap();
            let mut header = Header::default();
            header.binding.decoding.max_new_tokens = 2;
            let mut w = TraceWriter::create_version(&out, Algorithm::Blake3, header, version).unwrap();
            let bytes = [0u8; 4];
            let view = TensorView {
                dtype: DType::F32,
                shape: &[1],
                bytes: &bytes,
            };
            let coord = |path: RecordPath, layer: Option<u32>, position: u32| Coord {
                step: 1,
                position,
                phase: Phase::Decode,
                layer,
                path,
            };
            let a = RecordPath::from_static(&A);
            let b = RecordPath::from_static(&B);
            assert_ne!(a.static_addr(), b.static_addr());
            w.append(coord(a.clone(), Some(3), 7), Level::L4, view, false)
                .unwrap();
            for same in [a.clone(), b.clone(), RecordPath::from("moe.combine")] {
                let e = w
                    .append(coord(same, Some(3), 7), Level::L4, view, false)
                    .unwrap_err();
                assert!(e.to_string().contains("duplicate coordinate"), "{e}");
            }
            w.append(coord(b.clone(), Some(3), 7), Level::L3, view, false)
                .unwrap();
            w.append(coord(b.clone(), None, 7), Level::L4, view, false)
                .unwrap();
            w.append(coord(b.clone(), Some(4), 7), Level::L4, view, false)
                .unwrap();
            w.append(
                coord(RecordPath::from("moe.combine"), Some(3), 8),
                Level::L4,
                view,
                false,
            )
            .unwrap();
            w.append(
                coord(RecordPath::from("moe.shared"), Some(3), 7),
                Level::L4,
                view,
                false,
            )
            .unwrap();
            let e = w
                .append(
                    coord(RecordPath::from("moe.shared"), Some(3), 7),
                    Level::L4,
                    view,
                    false,
                )
                .unwrap_err();
            assert!(e.to_string().contains("duplicate coordinate"), "{e}");
            assert_eq!(w.finish().unwrap().records, 6, "version {version}");
        }
    }

    /// The packed-key order is the comparison order of (level, layer,
    /// position, phase, path), with layers absent and present, both phases,
    /// paths shared and static with equal texts, extreme values, and entries
    /// in scrambled order.
    #[test]
    fn tree_order_is_the_key_comparison_order() {
        let paths = [
            "moe.term.10",
            "moe.term.2",
            "attn.q",
            "token.output",
            "a",
            "moe.term.1",
        ];
        let mut entries = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let long: &'static str = Box::leak("moe.term.10".to_string().into_boxed_str());
        let prefixes: [&'static &'static str; 2] =
            [Box::leak(Box::new(long)), Box::leak(Box::new(&long[..10]))];
        let mut seen = HashSet::new();
        while entries.len() < 5000 {
            let layer = match next(4) {
                0 => None,
                1 => Some(u32::MAX),
                _ => Some(next(40) as u32),
            };
            let position = match next(5) {
                0 => u32::MAX,
                _ => next(300) as u32,
            };
            let phase = if next(2) == 0 {
                Phase::Prefill
            } else {
                Phase::Decode
            };
            let text = paths[next(paths.len() as u64) as usize];
            let path = match next(3) {
                0 => RecordPath::from(text),
                // A text at the same address as a longer one ("moe.term.1"
                // inside "moe.term.10"): equal addresses are not equal paths.
                1 => RecordPath::from_static(prefixes[next(2) as usize]),
                _ => RecordPath::from(text.to_string()),
            };
            let level = Level::from_code(next(5) as u32).unwrap();
            if !seen.insert((level, layer, position, phase, path.as_str().to_string())) {
                continue;
            }
            entries.push(IndexEntry {
                coord: Coord {
                    step: 0,
                    position,
                    phase,
                    layer,
                    path,
                },
                level,
                dtype: DType::F32,
                shape: std::sync::Arc::from(&[1u64][..]),
                digest: Digest::ZERO,
                payload: None,
            });
        }
        let mut want: Vec<usize> = (0..entries.len()).collect();
        want.sort_by_key(|&i| tree_key(&entries[i]));
        assert_eq!(tree_order(&entries), want);
    }
}

#[cfg(test)]
mod batch_tests {
    use super::*;
    use moeconf_fingerprint::{CanonPolicy, DType, BATCH_MAX_BYTES};

    /// Coordinate, level, dtype, shape, bytes, keep.
    type Owned = (Coord, Level, DType, Vec<u64>, Vec<u8>, bool);

    /// Records of every kind a batch can hold: batched (short, canonical),
    /// not canonical as they are (a NaN payload; -0 when folding), longer
    /// than the batch limit, kept and not, and with `bad`, one the writer
    /// refuses (a duplicate coordinate) in the middle.
    fn records(bad: bool) -> Vec<Owned> {
        let mut out = Vec::new();
        for step in 0..3u32 {
            for k in 0..40u32 {
                let n: usize = match k % 5 {
                    0 => 256,
                    1 => 1024,
                    2 => 3,
                    3 => BATCH_MAX_BYTES / 4 + 17,
                    _ => 600,
                };
                let mut bytes: Vec<u8> = (0..n as u32)
                    .flat_map(|i| ((i ^ k ^ step) as f32 * 0.25).to_le_bytes())
                    .collect();
                if k % 7 == 3 {
                    bytes[4..8].copy_from_slice(&0x7fc0_1234u32.to_le_bytes()); // a non-canonical NaN
                }
                if k % 11 == 5 {
                    bytes[0..4].copy_from_slice(&(-0.0f32).to_le_bytes());
                }
                let coord = Coord {
                    step,
                    position: step + 4,
                    phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
                    layer: Some(k % 3),
                    path: format!("op.{k}").into(),
                };
                out.push((coord, Level::L4, DType::F32, vec![n as u64], bytes, k % 4 == 0));
            }
        }
        if bad {
            let again = out[50].clone();
            out.insert(70, again);
        }
        out
    }

    fn write(
        path: &Path,
        alg: Algorithm,
        fold: bool,
        bad: bool,
        batched: bool,
    ) -> (Result<(), String>, WriteSummary, Vec<u8>) {
        let mut header = Header::default();
        header.binding.decoding.max_new_tokens = 3;
        header.binding.canon = CanonPolicy {
            fold_negative_zero: fold,
        };
        let mut w = TraceWriter::create(path, alg, header).unwrap();
        let all = records(bad);
        let r = if batched {
            // In batches of 37 (across steps, like the capture's batches).
            all.chunks(37).try_for_each(|c| {
                let batch = c
                    .iter()
                    .map(|(coord, level, dtype, shape, bytes, keep)| BatchRecord {
                        coord: coord.clone(),
                        level: *level,
                        tensor: TensorView {
                            dtype: *dtype,
                            shape,
                            bytes,
                        },
                        keep_payload: *keep,
                    })
                    .collect();
                w.append_batch(batch).map_err(|e| e.to_string())
            })
        } else {
            all.iter()
                .try_for_each(|(coord, level, dtype, shape, bytes, keep)| {
                    let t = TensorView {
                        dtype: *dtype,
                        shape,
                        bytes,
                    };
                    w.append(coord.clone(), *level, t, *keep)
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                })
        };
        let summary = w.finish().unwrap();
        (r, summary, std::fs::read(path).unwrap())
    }

    #[test]
    fn a_batch_writes_what_its_records_one_by_one_write_and_fails_at_the_same_record() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("one.bin"), tmp.path().join("batch.bin"));
        for alg in [Algorithm::Blake3, Algorithm::Sha256] {
            for fold in [false, true] {
                for bad in [false, true] {
                    let (r1, s1, x) = write(&a, alg, fold, bad, false);
                    let (r2, s2, y) = write(&b, alg, fold, bad, true);
                    let case = format!("{alg:?} fold {fold} bad {bad}");
                    let r2 = r2.map_err(|e| e.replace("batch.bin", "one.bin"));
                    assert_eq!(r1, r2, "{case}");
                    assert_eq!(r1.is_err(), bad, "{case}: {r1:?}");
                    assert_eq!((s1.root, s1.records), (s2.root, s2.records), "{case}");
                    assert!(x == y, "{case}: the files differ");
                    assert_eq!(s1.records, if bad { 70 } else { 120 }, "{case}");
                    assert!(Trace::open_verified(&b).is_ok(), "{case}");
                }
            }
        }
    }
}

#[cfg(test)]
mod group_streaming_tests {
    use super::*;
    use moeconf_fingerprint::group_pages::PAGE_BYTES;
    use moeconf_fingerprint::DType;

    /// Records of the first record count that fills page 0 of a group.
    fn page0_end(layer: Option<u32>) -> u32 {
        let p = group_prefix(0, Level::L4, layer, 0).len() as u64;
        (PAGE_BYTES - p).div_ceil(32) as u32
    }

    /// One record to append: level, layer, position, path, kept or not.
    type Rec = (Level, Option<u32>, u32, String, bool);

    /// A long prefill step's records in the orders a runtime emits them,
    /// then two decode steps. Groups of several pages whose records come
    /// layer by layer, positions ascending and a position's paths shuffled;
    /// a chunked pass that returns to each layer; a group that ends just
    /// after its first page; one that turns out of order after pages were
    /// encoded; small groups.
    fn prefill(seed: u64) -> Vec<Vec<Rec>> {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as usize
        };
        let mut step0: Vec<Rec> = Vec::new();
        let paths: Vec<String> = (0..13).map(|k| format!("op.{}", (k * 7) % 13)).collect();
        let position_of =
            |step0: &mut Vec<Rec>, level: Level, layer: u32, t: u32, next: &mut dyn FnMut() -> usize| {
                let mut p = paths.clone();
                for i in (1..p.len()).rev() {
                    p.swap(i, next() % (i + 1));
                }
                for (k, path) in p.into_iter().enumerate() {
                    let keep = k % 5 == 0;
                    step0.push((level, Some(layer), t, path.clone(), keep));
                    if k % 4 == 0 {
                        step0.push((Level::L3, Some(layer), t, format!("{path}.half"), false));
                    }
                }
            };
        // Chunks of 211 positions, every layer per chunk (layers revisited).
        for chunk in 0..4u32 {
            for layer in 0..3 {
                for t in chunk * 211..(chunk + 1) * 211 {
                    position_of(&mut step0, Level::L4, layer, t, &mut next);
                }
            }
        }
        // A group of exactly page 0's records plus one.
        for t in 0..=page0_end(Some(7)) {
            step0.push((Level::L4, Some(7), t, "x".into(), false));
        }
        // A group that goes out of order after two pages.
        for t in 0..2 * page0_end(Some(8)) + 5 {
            step0.push((Level::L4, Some(8), t, "y".into(), t % 100 == 0));
        }
        step0.push((Level::L4, Some(8), 3, "z".into(), false));
        for t in 2 * page0_end(Some(8)) + 5..2 * page0_end(Some(8)) + 400 {
            step0.push((Level::L4, Some(8), t, "y".into(), false));
        }
        // Globals between and after.
        step0.push((Level::L0, None, 843, "token.output".into(), true));
        step0.push((Level::L2, Some(1), 843, "state".into(), false));
        let decode: Vec<Vec<Rec>> = (1..3u32)
            .map(|step| {
                let t = 843 + step;
                let mut v: Vec<Rec> = paths
                    .iter()
                    .map(|p| (Level::L4, Some(0), t, p.clone(), true))
                    .collect();
                v.push((Level::L0, None, t, "token.output".into(), true));
                v
            })
            .collect();
        let mut all = vec![step0];
        all.extend(decode);
        all
    }

    fn write(path: &Path, steps: &[Vec<Rec>], streaming: bool, version: u32) -> (WriteSummary, Vec<u8>) {
        let mut header = Header::default();
        header.binding.decoding.max_new_tokens = 3;
        let out = check_output(path, &Inputs::new()).unwrap();
        let mut w = TraceWriter::create_version(&out, Algorithm::Blake3, header, version).unwrap();
        w.set_group_streaming(streaming);
        let mut early = 0;
        for (step, recs) in steps.iter().enumerate() {
            if step == 1 {
                early = w.groups.as_ref().map_or(0, |g| g.spilled_pages());
            }
            for (i, (level, layer, t, p, keep)) in recs.iter().enumerate() {
                let bytes = (i as u32 ^ *t).to_le_bytes();
                let coord = Coord {
                    step: step as u32,
                    position: *t,
                    phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
                    layer: *layer,
                    path: p.as_str().into(),
                };
                let view = TensorView {
                    dtype: DType::I32,
                    shape: &[1],
                    bytes: &bytes,
                };
                w.append(coord, *level, view, *keep).unwrap();
            }
        }
        // Layers 0-2 of L4: 10,972 records, 3 pages, of which 2 are full;
        // layer 7: 1 of 2; layer 8: 2 before it turned out of order.
        let want = if streaming && version == FORMAT_V4 {
            3 * 2 + 1 + 2
        } else {
            0
        };
        assert_eq!(early, want, "streaming {streaming}, version {version}");
        let summary = w.finish().unwrap();
        (summary, std::fs::read(path).unwrap())
    }

    /// Page blocks encoded while the step runs give the file that ordering
    /// the whole step at its end gives, byte for byte, and it verifies.
    #[test]
    fn groups_encoded_as_their_records_arrive_give_the_same_file() {
        let tmp = tempfile::tempdir().unwrap();
        for seed in [1u64, 2, 3] {
            let steps = prefill(seed);
            let (a, x) = write(&tmp.path().join("end.bin"), &steps, false, FORMAT_V4);
            let (b, y) = write(&tmp.path().join("early.bin"), &steps, true, FORMAT_V4);
            assert_eq!(a, b, "seed {seed}");
            assert!(x == y, "seed {seed}: the files differ");
            let t = Trace::open_verified(&tmp.path().join("early.bin")).unwrap();
            assert_eq!(t.root(), a.root);
        }
        let mut names: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["early.bin", "end.bin"]);
    }

    /// The streaming switch changes nothing where groups are not paged.
    #[test]
    fn versions_without_pages_write_the_same_file_either_way() {
        let tmp = tempfile::tempdir().unwrap();
        let steps = prefill(4);
        for v in [2, FORMAT_V3] {
            let (_, x) = write(&tmp.path().join("a.bin"), &steps, false, v);
            let (_, y) = write(&tmp.path().join("b.bin"), &steps, true, v);
            assert!(x == y, "version {v}");
        }
    }
}
