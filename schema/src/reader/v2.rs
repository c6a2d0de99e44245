//! Version 2: the root block is read on open; step and group blocks are
//! read, and checked against their parents, the first time they are used
//! (docs/format.md §11). Full verification reads every block and checks the
//! layout of the whole file.

use super::{u64_at, Opened, Preambled, Store as AnyStore, Trace};
use crate::error::TraceError;
use crate::layout::{
    align_up, check_record, check_step_phase, Header, IndexEntry, END_MAGIC, PAYLOAD_ALIGN, PREAMBLE_LEN,
};
use crate::nodes::{Fault, GroupAt, GroupContent, GroupNode, HeldRecord, LevelNode, StepNode, StepSummary};
use crate::reader::VerifySummary;
use crate::v2::{
    block_digest, checksum_v2, decode_group_block, decode_root_block_split, decode_step_block,
    is_paged_format, step_ref_len, BlockRef, GroupEntry, RootParts, StepRef, TrailerV2, MIN_GROUP_ENTRY_LEN,
    TRAILER_V2_LEN,
};
use moeconf_fingerprint::{
    binding_digest, group_digest, level_digest, root_digest, step_digest, Digest, Interner, Level, LevelSet,
};
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard, OnceLock};

mod paged;

/// Bytes of verified payloads after which [`Store::verify_step`] drops
/// their pages from the resident set.
const VERIFY_RELEASE: u64 = 16 << 20;

/// Where a loaded record sits among the step nodes.
#[derive(Debug, Clone, Copy)]
struct Loc {
    step_index: u32,
    level_index: u8,
    group_index: u32,
    /// The page holding the record ([`WHOLE`]: the group's own content).
    page: u32,
    k: u32,
}

/// [`Loc::page`] of a record held in its group's whole content.
const WHOLE: u32 = u32::MAX;

/// A group's place in the file ([`Store::site`]).
struct Site<'t> {
    /// Index of its step.
    k: usize,
    step: StepRef,
    node: &'t StepNode,
    /// Its group block.
    block: BlockRef,
    /// "step S level L layer Y's group block", for messages.
    name: String,
}

/// The canonical order of a group's records: position, phase, path
/// (bytewise).
fn tree_key(e: &IndexEntry) -> (u32, moeconf_fingerprint::Phase, &str) {
    (e.coord.position, e.coord.phase, e.coord.path.as_str())
}

/// What a version 2 trace holds in memory: the root block's steps and
/// what has been loaded from them.
pub(super) struct Store {
    root_block: BlockRef,
    /// Each step's block (the rest of its reference in the root block is
    /// the trace's [`StepSummary`]).
    blocks: Vec<BlockRef>,
    /// The write-order number of each step's first record.
    bases: Vec<u64>,
    /// Where each step's part of the file starts: the end of the previous
    /// step's block (the header's end for the first step).
    regions: Vec<u64>,
    /// Loaded records: id → where they sit.
    locs: Mutex<HashMap<usize, Loc>>,
    interner: Mutex<Interner>,
    /// Every record in write order, once [`Trace::records`] asked for it.
    flat: OnceLock<Result<Vec<IndexEntry>, Fault>>,
    /// The blocks read so far (offset, length).
    touched: Mutex<Vec<(u64, u64)>>,
    /// Version 3: each step's level digests as the root block lists them
    /// (empty in version 2).
    level_digests: Vec<[Digest; 5]>,
    /// Size of one step reference in the root block.
    ref_len: u64,
    /// Page blocks read so far (version 4).
    pages_read: AtomicU64,
}

/// The root block's reference to a step, from its two halves.
fn step_ref(s: &StepSummary, block: &BlockRef, level_digests: Option<&[Digest; 5]>) -> StepRef {
    StepRef {
        step: s.step,
        digest: s.digest,
        level_records: s.level_records,
        block: *block,
        level_digests: level_digests.copied(),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves consistent data (each
    // critical section is one insert or push).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Reads the trailer, checks the checksum and the root block, and
/// recomputes the root.
pub(super) fn open(path: &Path, b: &[u8], pre: &Preambled) -> Result<Opened, TraceError> {
    let len = b.len() as u64;
    let fail = |offset: u64, what: String| TraceError::format(path, offset, what);
    let t0 = len - TRAILER_V2_LEN;
    let tu = t0 as usize;
    if b[tu..tu + 8] != END_MAGIC || b[tu + 128..tu + 136] != END_MAGIC {
        return Err(fail(
            t0,
            "trailer magic missing: the file is truncated or was not finished by its writer".into(),
        ));
    }
    let mut word = [0u8; 32];
    let root_offset = u64_at(b, tu + 8);
    let root_len = u64_at(b, tu + 16);
    let record_count = u64_at(b, tu + 24);
    word.copy_from_slice(&b[tu + 32..tu + 64]);
    let root = Digest(word);
    word.copy_from_slice(&b[tu + 64..tu + 96]);
    let root_block_digest = Digest(word);
    word.copy_from_slice(&b[tu + 96..tu + 128]);
    let stored_sum = Digest(word);
    if root_offset < pre.payload_start
        || !root_offset.is_multiple_of(PAYLOAD_ALIGN)
        || root_offset.checked_add(root_len) != Some(t0)
    {
        return Err(fail(
            t0 + 8,
            format!(
                "root block at {root_offset} with length {root_len} is misaligned, before the payload \
                 section ({}) or does not end at the trailer ({t0})",
                pre.payload_start
            ),
        ));
    }
    if record_count > root_offset / MIN_GROUP_ENTRY_LEN {
        return Err(fail(
            t0 + 24,
            format!("record count {record_count} cannot fit before the root block at {root_offset}"),
        ));
    }
    let trailer = TrailerV2 {
        root_block: BlockRef {
            offset: root_offset,
            len: root_len,
            digest: root_block_digest,
        },
        record_count,
        root,
        checksum: stored_sum,
    };
    if checksum_v2(pre.alg, &b[..pre.header_end as usize], &trailer.covered_bytes()) != stored_sum {
        return Err(fail(
            t0 + 96,
            "checksum mismatch: the header or trailer is corrupted".into(),
        ));
    }
    let header_bytes = &b[PREAMBLE_LEN as usize..pre.header_end as usize];
    let (header, binding_len) = Header::decode_split(header_bytes, PREAMBLE_LEN)
        .map_err(|e| fail(e.offset, format!("header: {}", e.what)))?;
    let root_bytes = &b[root_offset as usize..t0 as usize];
    if block_digest(pre.alg, root_bytes) != root_block_digest {
        return Err(fail(
            root_offset,
            "root block does not match its digest in the trailer (corrupted root block)".into(),
        ));
    }
    let RootParts {
        summaries,
        blocks,
        level_digests,
    } = decode_root_block_split(root_bytes, root_offset, pre.version)
        .map_err(|e| fail(e.offset, format!("root block: {}", e.what)))?;
    let ref_len = step_ref_len(pre.version);
    let max_new_tokens = header.binding.decoding.max_new_tokens;
    let (mut bases, mut regions) = (
        Vec::with_capacity(summaries.len()),
        Vec::with_capacity(summaries.len()),
    );
    // A step's part of the file starts where the previous step's block ends
    // (the first step's after the header); its first chunk is at the next
    // multiple of 64.
    let (mut total, mut region) = (0u64, pre.header_end);
    let mut previous: Option<u32> = None;
    for (k, s) in summaries
        .iter()
        .zip(&blocks)
        .map(|(s, b)| step_ref(s, b, None))
        .enumerate()
    {
        let at = root_offset + 12 + k as u64 * ref_len;
        let what = |m: String| fail(at, format!("root block: step {}: {m}", s.step));
        // Version 3: a level digest is listed exactly for the levels the
        // step declares records at (which levels these are is checked
        // against the step digest when it is used: `committed_levels`).
        if let Some(l) = level_digests.get(k) {
            for (code, (d, n)) in l.iter().zip(&s.level_records).enumerate() {
                if (*d == Digest::ZERO) != (*n == 0) {
                    return Err(what(format!(
                        "level L{code}: {n} records declared with {} level digest",
                        if *d == Digest::ZERO { "a zero" } else { "a" }
                    )));
                }
            }
        }
        if previous.is_some_and(|p| p >= s.step) {
            return Err(what("steps are not in strictly ascending order".into()));
        }
        previous = Some(s.step);
        let phase = if s.step == 0 {
            moeconf_fingerprint::Phase::Prefill
        } else {
            moeconf_fingerprint::Phase::Decode
        };
        check_step_phase(max_new_tokens, s.step, phase).map_err(what)?;
        let n = s
            .total()
            .filter(|&n| n > 0)
            .ok_or_else(|| what("its record counts are zero or overflow".into()))?;
        let end = s.block.end().filter(|&e| e <= root_offset);
        if !s.block.offset.is_multiple_of(PAYLOAD_ALIGN) || s.block.offset < region || end.is_none() {
            return Err(what(format!(
                "step block at {} (+{}) is misaligned, overlaps the step before or does not lie before the \
                 root block",
                s.block.offset, s.block.len
            )));
        }
        bases.push(total);
        regions.push(region);
        total = total
            .checked_add(n)
            .ok_or_else(|| what("record count overflows".into()))?;
        region = end.unwrap_or(u64::MAX);
    }
    if total != record_count {
        return Err(fail(
            t0 + 24,
            format!("the root block's steps hold {total} records, the trailer says {record_count}"),
        ));
    }
    let bd = binding_digest(pre.alg, &header_bytes[..binding_len]);
    if root_digest(pre.alg, bd, summaries.iter().map(|s| (s.step, s.digest))) != root {
        return Err(fail(
            t0 + 32,
            "root digest does not match the root block's steps: the root block or trailer is corrupted"
                .into(),
        ));
    }
    Ok(Opened {
        header,
        binding_digest: bd,
        root,
        record_count,
        summaries,
        nodes: None,
        store: AnyStore::V2(Box::new(Store {
            root_block: trailer.root_block,
            blocks,
            bases,
            regions,
            locs: Mutex::new(HashMap::new()),
            interner: Mutex::new(Interner::new()),
            flat: OnceLock::new(),
            touched: Mutex::new(vec![(root_offset, root_len)]),
            level_digests,
            ref_len,
            pages_read: AtomicU64::new(0),
        })),
    })
}

impl Store {
    /// The root block's reference to the `k`-th step.
    fn step(&self, t: &Trace, k: usize) -> Option<StepRef> {
        Some(step_ref(
            t.summaries.get(k)?,
            self.blocks.get(k)?,
            self.level_digests.get(k),
        ))
    }

    /// Version 3: the levels the `k`-th step holds, from the root block's
    /// level digests once they hash to the step digest (which the root
    /// digest commits to); `None` in version 2 (read the step block).
    pub fn committed_levels(&self, t: &Trace, k: usize) -> Option<Result<LevelSet, Fault>> {
        let l = self.level_digests.get(k)?;
        let s = t.summaries.get(k)?;
        let held: Vec<(Level, Digest)> = Level::ALL
            .into_iter()
            .zip(l.iter().copied())
            .filter(|(_, d)| *d != Digest::ZERO)
            .collect();
        Some(if step_digest(t.alg, s.step, held.iter().copied()) == s.digest {
            Ok(held
                .iter()
                .fold(LevelSet::EMPTY, |set, (level, _)| set.with(*level)))
        } else {
            Err(Fault::new(
                self.root_block.offset + 12 + k as u64 * self.ref_len,
                format!(
                    "root block: step {}: its level digests do not hash to its step digest",
                    s.step
                ),
            ))
        })
    }

    /// The bytes of a block whose location has been checked against the
    /// file, after checking them against their digest.
    fn block<'t>(&self, t: &'t Trace, b: BlockRef, what: &str) -> Result<&'t [u8], Fault> {
        let bytes = b
            .end()
            .and_then(|end| t.data.bytes().get(b.offset as usize..end as usize))
            .ok_or_else(|| Fault::new(b.offset, format!("{what} lies outside the file")))?;
        self.checked(t, b, bytes, what)
    }

    /// `bytes` (the block `b`, read through the map or copied out of the
    /// file), after checking them against their digest.
    fn checked<'b>(&self, t: &Trace, b: BlockRef, bytes: &'b [u8], what: &str) -> Result<&'b [u8], Fault> {
        lock(&self.touched).push((b.offset, b.len));
        if block_digest(t.alg, bytes) != b.digest {
            return Err(Fault::new(
                b.offset,
                format!("{what} does not match its digest in its parent (corrupted block)"),
            ));
        }
        Ok(bytes)
    }

    /// Reads and checks the step block of the `k`-th step: its digest, its
    /// levels and groups in canonical order with the record counts the root
    /// lists, its group blocks inside the step's part of the file, and its
    /// fingerprint digest against the root's.
    /// With `transient`, the block is read with a positioned read when the
    /// trace is mapped (a node read for its levels and dropped: see
    /// `Trace::read_transient`).
    pub fn load_step(&self, t: &Trace, k: usize, transient: bool) -> Result<StepNode, Fault> {
        let s = self
            .step(t, k)
            .ok_or_else(|| Fault::new(0, format!("no step number {k}")))?;
        let name = format!("step {}'s block", s.step);
        let copied = if transient {
            t.read_transient(s.block.offset, s.block.len)
        } else {
            None
        };
        let bytes = match &copied {
            Some(c) => self.checked(t, s.block, c, &name)?,
            None => self.block(t, s.block, &name)?,
        };
        let at = s.block.offset;
        let fail = |m: String| Fault::new(at, format!("{name}: {m}"));
        let (step, levels) =
            decode_step_block(bytes, at).map_err(|e| Fault::new(e.offset, format!("{name}: {}", e.what)))?;
        if step != s.step {
            return Err(fail(format!("names step {step}")));
        }
        let mut cursor = self.regions[k];
        let mut payload_end = None;
        let mut counts = [0u64; 5];
        let mut nodes = Vec::with_capacity(levels.len());
        let mut blocks = Vec::new();
        let mut previous_level = None;
        for (li, l) in levels.into_iter().enumerate() {
            if previous_level.is_some_and(|p| p >= l.level) {
                return Err(fail("levels are not in strictly ascending order".into()));
            }
            previous_level = Some(l.level);
            if l.groups.is_empty() {
                return Err(fail(format!("level {} holds no group", l.level)));
            }
            let mut groups = Vec::with_capacity(l.groups.len());
            let mut previous_layer: Option<Option<u32>> = None;
            let mut n = 0u64;
            for (gi, g) in l.groups.iter().enumerate() {
                if previous_layer.is_some_and(|p| p >= g.layer) {
                    return Err(fail(format!(
                        "the groups of level {} are not in strictly ascending layer order",
                        l.level
                    )));
                }
                previous_layer = Some(g.layer);
                let end = g.block.end();
                if g.records == 0
                    || !g.block.offset.is_multiple_of(PAYLOAD_ALIGN)
                    || g.block.offset < cursor
                    || end.is_none_or(|e| e > s.block.offset)
                {
                    return Err(fail(format!(
                        "group block of level {} layer {:?} at {} (+{}) holds no record, is misaligned, out of \
                         order or outside the step's part of the file",
                        l.level, g.layer, g.block.offset, g.block.len
                    )));
                }
                payload_end.get_or_insert(g.block.offset);
                cursor = end.unwrap_or(u64::MAX);
                n = n
                    .checked_add(g.records)
                    .ok_or_else(|| fail("record count overflows".into()))?;
                groups.push(GroupNode {
                    layer: g.layer,
                    digest: g.digest,
                    records: g.records,
                    at: GroupAt {
                        step_index: k as u32,
                        level: l.level,
                        level_index: li as u8,
                        group_index: gi as u32,
                        block: blocks.len() as u32,
                    },
                    content: OnceLock::new(),
                    paged: OnceLock::new(),
                });
                blocks.push(g.block);
            }
            counts[l.level.code() as usize] = n;
            let digest = level_digest(t.alg, step, l.level, l.groups.iter().map(|g| g.digest));
            nodes.push(LevelNode {
                level: l.level,
                digest,
                groups,
            });
        }
        if counts != s.level_records {
            return Err(fail(format!(
                "holds {counts:?} records per level, the root block says {:?}",
                s.level_records
            )));
        }
        if step_digest(t.alg, step, nodes.iter().map(|l| (l.level, l.digest))) != s.digest {
            return Err(fail(
                "its levels do not hash to the step digest in the root block (corrupted block)".into(),
            ));
        }
        if let Some(listed) = &s.level_digests {
            let mut own = [Digest::ZERO; 5];
            for l in &nodes {
                own[l.level.code() as usize] = l.digest;
            }
            if own != *listed {
                return Err(fail(
                    "its level digests differ from those the root block lists".into(),
                ));
            }
        }
        Ok(StepNode {
            step,
            digest: s.digest,
            levels: nodes,
            payload_end: payload_end.unwrap_or(s.block.offset),
            blocks: blocks.into_boxed_slice(),
        })
    }

    /// Reads and checks a group block: its digest, that it is the group its
    /// step names, every record as the reader of docs/format.md §7 checks
    /// it, the records' canonical order, their write-order numbers within
    /// the step's range, their payloads inside the step's payloads, and the
    /// group's fingerprint digest. With `register`, the records become
    /// reachable by id ([`Trace::get_record`]).
    pub fn load_group(&self, t: &Trace, g: &GroupNode, register: bool) -> Result<GroupContent, Fault> {
        let entries = self.read_group(t, g, &mut lock(&self.interner))?;
        let mut ids = Vec::with_capacity(entries.len());
        let mut out = Vec::with_capacity(entries.len());
        for ge in entries {
            ids.push(ge.ordinal as usize);
            out.push(ge.entry);
        }
        if register {
            self.register(t, g, WHOLE, &ids, &out)?;
        }
        Ok(GroupContent {
            ids: ids.into_boxed_slice(),
            entries: out.into_boxed_slice(),
        })
    }

    /// The checked records of group `g` with their ids, kept by nobody but
    /// the caller ([`Trace::read_group`]); two records claiming one
    /// write-order number are refused.
    pub fn read_held(&self, t: &Trace, g: &GroupNode) -> Result<Vec<HeldRecord>, Fault> {
        let entries = self.read_group(t, g, &mut lock(&self.interner))?;
        let mut seen = std::collections::HashSet::with_capacity(entries.len());
        let mut out = Vec::with_capacity(entries.len());
        for ge in entries {
            if !seen.insert(ge.ordinal) {
                return Err(Fault::new(
                    ge.at,
                    format!(
                        "step {} level {} layer {:?}'s group block: record {}: write-order number {} is \
                         already another record's (the numbers of a step must be a permutation)",
                        t.summaries[g.at.step_index as usize].step,
                        g.at.level,
                        g.layer,
                        ge.entry.coord,
                        ge.ordinal
                    ),
                ));
            }
            out.push(HeldRecord {
                id: ge.ordinal as usize,
                entry: ge.entry,
            });
        }
        Ok(out)
    }

    /// [`Store::load_group`] without keeping anything: the checked entries
    /// (a paged group's from every page, `paged.rs`).
    fn read_group(
        &self,
        t: &Trace,
        g: &GroupNode,
        interner: &mut Interner,
    ) -> Result<Vec<GroupEntry>, Fault> {
        let site = self.site(t, g)?;
        let (block, name) = (site.block, &site.name);
        let bytes = self.block(t, block, name)?;
        let decoded = decode_group_block(bytes, block.offset, interner, is_paged_format(t.version))
            .map_err(|e| Fault::new(e.offset, format!("{name}: {}", e.what)))?;
        let fail = |at: u64, m: String| Fault::new(at, format!("{name}: {m}"));
        if (decoded.step, decoded.level, decoded.layer) != (site.step.step, g.at.level, g.layer) {
            return Err(fail(
                block.offset,
                format!(
                    "says it holds step {} level {} layer {:?}",
                    decoded.step, decoded.level, decoded.layer
                ),
            ));
        }
        if let Some(layout) = self.paged_layout(t, g) {
            if decoded.pages.is_empty() {
                return Err(fail(
                    block.offset,
                    format!(
                        "holds its records unpaged, though a group of {} records is stored in {} pages in \
                         format version 4",
                        g.records,
                        layout.count()
                    ),
                ));
            }
            let paged = self.table(g, &site, layout, decoded.pages)?;
            return self.read_all_pages(t, g, &site, &paged, interner);
        }
        if decoded.entries.len() as u64 != g.records {
            return Err(fail(
                block.offset,
                format!(
                    "holds {} records, its step says {}",
                    decoded.entries.len(),
                    g.records
                ),
            ));
        }
        self.check_entries(t, &site, &decoded.entries)?;
        let digest = group_digest(
            t.alg,
            site.step.step,
            g.at.level,
            g.layer,
            decoded.entries.iter().map(|x| x.entry.digest),
        );
        if digest != g.digest {
            return Err(fail(
                block.offset,
                "its records do not hash to the group digest in its step block (corrupted block)".into(),
            ));
        }
        Ok(decoded.entries)
    }

    /// Where group `g` sits: its step's reference and node, its group
    /// block, and its name in messages. The step must have been read.
    fn site<'t>(&self, t: &'t Trace, g: &GroupNode) -> Result<Site<'t>, Fault> {
        let k = g.at.step_index as usize;
        let step = self
            .step(t, k)
            .ok_or_else(|| Fault::new(0, format!("no step number {k}")))?;
        let node = match t.nodes.get(k) {
            Some(Ok(n)) => n,
            _ => return Err(Fault::new(step.block.offset, "group read before its step")),
        };
        let block = *node
            .blocks
            .get(g.at.block as usize)
            .ok_or_else(|| Fault::new(step.block.offset, "group without a block"))?;
        let name = format!(
            "step {} level {} layer {:?}'s group block",
            step.step, g.at.level, g.layer
        );
        Ok(Site {
            k,
            step,
            node,
            block,
            name,
        })
    }

    /// Checks the entries of a group or page block of `site`'s group, in
    /// block order: every record as docs/format.md §7 checks it, strictly
    /// ascending canonical order, write-order numbers in the step's range,
    /// payloads inside the step's payloads.
    fn check_entries(&self, t: &Trace, site: &Site<'_>, entries: &[GroupEntry]) -> Result<(), Fault> {
        let k = site.k;
        let fail = |at: u64, m: String| Fault::new(at, format!("{}: {m}", site.name));
        let (base, n) = (self.bases[k], site.step.total().unwrap_or(0));
        let binding = t.binding();
        let mut previous: Option<&GroupEntry> = None;
        for ge in entries {
            let e = &ge.entry;
            let at = ge.at;
            check_record(binding, &e.coord, e.dtype, &e.shape)
                .map_err(|m| fail(at, format!("record {}: {m}", e.coord)))?;
            if ge.ordinal < base || ge.ordinal - base >= n {
                return Err(fail(
                    at,
                    format!(
                        "record {}: write-order number {} is outside its step's {base}..{}",
                        e.coord,
                        ge.ordinal,
                        base + n
                    ),
                ));
            }
            if let Some(p) = previous {
                if tree_key(&p.entry) >= tree_key(e) {
                    return Err(fail(
                        at,
                        format!(
                            "record {}: not in canonical order (or a duplicate) after {}",
                            e.coord, p.entry.coord
                        ),
                    ));
                }
            }
            if let Some(p) = e.payload {
                if !p.offset.is_multiple_of(PAYLOAD_ALIGN)
                    || p.offset < self.regions[k]
                    || p.offset
                        .checked_add(p.len)
                        .is_none_or(|end| end > site.node.payload_end)
                {
                    return Err(fail(
                        at,
                        format!(
                            "record {}: payload at {} (+{}) is misaligned or outside its step's payloads",
                            e.coord, p.offset, p.len
                        ),
                    ));
                }
            }
            previous = Some(ge);
        }
        Ok(())
    }

    /// A loaded record by id.
    pub fn record<'t>(&'t self, t: &'t Trace, i: usize) -> Option<&'t IndexEntry> {
        if let Some(Ok(flat)) = self.flat.get() {
            return flat.get(i);
        }
        let loc = *lock(&self.locs).get(&i)?;
        Self::at(t, loc)
    }

    /// The loaded record at `loc`.
    fn at(t: &Trace, loc: Loc) -> Option<&IndexEntry> {
        let node = t.nodes.get(loc.step_index as usize)?.as_ref().ok()?;
        let g = node
            .levels
            .get(loc.level_index as usize)?
            .groups
            .get(loc.group_index as usize)?;
        let content = if loc.page == WHOLE {
            g.content.get()?.as_ref().ok()?
        } else {
            g.paged
                .get()?
                .as_ref()
                .as_ref()
                .ok()?
                .pages
                .get(loc.page as usize)?
                .get()?
                .as_ref()
                .ok()?
        };
        content.entries.get(loc.k as usize)
    }

    /// Makes the records `ids` (with `entries`, the content of group `g`'s
    /// page `page` or, with [`WHOLE`], of the whole group) reachable by id.
    /// A record is found by its write-order number, and its payload's
    /// verified state is kept under that number: two records claiming one
    /// number would make a lookup return the wrong record (the numbers are
    /// not under the root, docs/format.md §11.5). So every number is checked
    /// free before any is taken: free, or taken by the same record of the
    /// same group (read through another of its pages, or whole).
    fn register(
        &self,
        t: &Trace,
        g: &GroupNode,
        page: u32,
        ids: &[usize],
        entries: &[IndexEntry],
    ) -> Result<(), Fault> {
        let mut locs = lock(&self.locs);
        let here = |l: &Loc| {
            (l.step_index, l.level_index, l.group_index)
                == (g.at.step_index, g.at.level_index, g.at.group_index)
        };
        // One map operation per number: taken here when free; when taken,
        // it must be this record: the same place of this page or content
        // (a page read again), or an equal entry of the same group read
        // through another page or whole. A number twice in this page fails
        // the first test (another place of the same page).
        for (k, &i) in ids.iter().enumerate() {
            let ok = match locs.entry(i) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Loc {
                        step_index: g.at.step_index,
                        level_index: g.at.level_index,
                        group_index: g.at.group_index,
                        page,
                        k: k as u32,
                    });
                    true
                }
                std::collections::hash_map::Entry::Occupied(o) => {
                    let l = o.get();
                    here(l)
                        && if l.page == page {
                            l.k == k as u32
                        } else {
                            Self::at(t, *l) == entries.get(k)
                        }
                }
            };
            if ok {
                continue;
            }
            // Refused: the numbers this call took are given back (a page
            // registered before never fails again: its numbers all hold
            // this page's places), so nothing is taken.
            for (j, &taken) in ids[..k].iter().enumerate() {
                if locs
                    .get(&taken)
                    .is_some_and(|l| here(l) && l.page == page && l.k == j as u32)
                {
                    locs.remove(&taken);
                }
            }
            let block = t
                .nodes
                .get(g.at.step_index as usize)
                .and_then(|n| n.as_ref().ok());
            let at = block
                .and_then(|n| n.blocks.get(g.at.block as usize))
                .map_or(0, |b| b.offset);
            return Err(Fault::new(
                at,
                format!(
                    "step {} level {} layer {:?}'s group block: record {}: write-order number {i} is \
                     already another record's (the numbers of a step must be a permutation)",
                    t.summaries[g.at.step_index as usize].step,
                    g.at.level,
                    g.layer,
                    entries.get(k).map_or_else(String::new, |e| e.coord.to_string())
                ),
            ));
        }
        Ok(())
    }

    /// Reads the groups of the step holding record `i` until it is in memory.
    pub fn resolve<'t>(&'t self, t: &'t Trace, i: usize) -> Result<Option<&'t IndexEntry>, TraceError> {
        if i as u64 >= t.record_count {
            return Ok(None);
        }
        let k = self.bases.partition_point(|&b| b <= i as u64).saturating_sub(1);
        let node = t.step_at(k)?;
        for g in node.levels.iter().flat_map(|l| &l.groups) {
            if t.group_records(g)?.contains(&i) {
                return Ok(self.record(t, i));
            }
        }
        Err(TraceError::format(
            &t.path,
            self.blocks[k].offset,
            format!(
                "step {}: no record has write-order number {i} (the numbers are not a permutation)",
                t.summaries[k].step
            ),
        ))
    }

    /// The checked entries of every group of step `k`, from memory where
    /// loaded, else read without keeping them.
    fn step_entries(
        &self,
        t: &Trace,
        k: usize,
        interner: &mut Interner,
    ) -> Result<Vec<(u64, IndexEntry)>, TraceError> {
        let node = t.step_at(k)?;
        // Sized once from the step node's group record counts, so that a
        // step of millions of records is not copied on growth; bounded by
        // what its group blocks can hold (each record there carries a
        // 32-byte digest), whatever the counts claim.
        let declared: u64 = node
            .levels
            .iter()
            .flat_map(|l| &l.groups)
            .fold(0u64, |n, g| n.saturating_add(g.records));
        let room: u64 = node.blocks.iter().fold(0u64, |n, b| n.saturating_add(b.len)) / 32;
        let mut out = Vec::with_capacity(declared.min(room) as usize);
        for l in &node.levels {
            for g in &l.groups {
                match g.content.get() {
                    Some(Ok(c)) => out.extend(c.ids.iter().map(|&i| i as u64).zip(c.entries.iter().cloned())),
                    Some(Err(f)) => return Err(t.fault(f)),
                    None => out.extend(
                        self.read_group(t, g, interner)
                            .map_err(|f| t.fault(&f))?
                            .into_iter()
                            .map(|x| (x.ordinal, x.entry)),
                    ),
                }
            }
        }
        Ok(out)
    }

    /// Every record, step by step, without keeping the groups (paths and
    /// shapes shared with the trace's loaded records).
    pub fn for_each(&self, t: &Trace, f: &mut dyn FnMut(usize, &IndexEntry)) -> Result<(), TraceError> {
        for k in 0..self.blocks.len() {
            let entries = self.step_entries(t, k, &mut lock(&self.interner))?;
            for (i, e) in entries {
                f(i as usize, &e);
            }
        }
        Ok(())
    }

    /// Every record in write order (built once, then kept).
    pub fn flat<'t>(&'t self, t: &'t Trace) -> Result<&'t [IndexEntry], Fault> {
        let r = self.flat.get_or_init(|| {
            let mut slots: Vec<Option<IndexEntry>> = vec![None; t.record_count as usize];
            let mut fault = None;
            let res = self.for_each(t, &mut |i, e| {
                match slots.get_mut(i) {
                    Some(s @ None) => *s = Some(e.clone()),
                    _ => {
                        fault.get_or_insert(Fault::new(0, format!("record number {i} appears twice")));
                    }
                };
            });
            if let Err(e) = res {
                return Err(match e {
                    TraceError::Format { offset, what, .. } => Fault::new(offset, what),
                    other => Fault::new(0, other.to_string()),
                });
            }
            if let Some(f) = fault {
                return Err(f);
            }
            let all: Vec<IndexEntry> = slots.into_iter().flatten().collect();
            if all.len() as u64 != t.record_count {
                return Err(Fault::new(
                    0,
                    "the records' write-order numbers are not a permutation",
                ));
            }
            Ok(all)
        });
        match r {
            Ok(v) => Ok(v),
            Err(f) => Err(f.clone()),
        }
    }

    /// The `k`-th step's part of the file: from the end of the previous
    /// step's block to the end of its own.
    pub fn step_region(&self, k: usize) -> Option<(u64, u64)> {
        let from = *self.regions.get(k)?;
        let b = self.blocks.get(k)?;
        Some((from, b.offset.saturating_add(b.len)))
    }

    /// Where the `k`-th step's block lies (offset, length).
    pub fn step_block(&self, k: usize) -> Option<(u64, u64)> {
        self.blocks.get(k).map(|b| (b.offset, b.len))
    }

    /// Page blocks read so far.
    pub fn pages_read(&self) -> u64 {
        self.pages_read.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The blocks read so far.
    pub fn blocks_read(&self) -> Vec<(u64, u64)> {
        lock(&self.touched).clone()
    }

    /// Checks that a chunk (payload or block) starts where the layout puts
    /// it, right after `cursor` rounded up to 64, with zero bytes between.
    fn chunk(
        &self,
        t: &Trace,
        cursor: u64,
        offset: u64,
        what: &dyn Fn() -> String,
    ) -> Result<(), TraceError> {
        let want = align_up(cursor).unwrap_or(u64::MAX);
        if offset != want {
            return Err(TraceError::format(
                &t.path,
                offset.min(t.file_len()),
                format!(
                    "{} is at byte {offset}, where the layout puts it at {want}",
                    what()
                ),
            ));
        }
        if let Some(at) = t.first_nonzero(cursor, offset) {
            return Err(t.padding_error(at));
        }
        Ok(())
    }

    /// Verifies step `k` in full: its records' write-order numbers are the
    /// step's range, its payloads (in write order), group blocks (in tree
    /// order) and step block follow each other as the layout says, and
    /// every payload matches its record digest. Returns the payloads and
    /// payload bytes checked.
    fn verify_step(&self, t: &Trace, k: usize) -> Result<(u64, u64), TraceError> {
        let node = t.step_at(k)?;
        let s = &self
            .step(t, k)
            .ok_or_else(|| TraceError::format(&t.path, 0, format!("no step number {k}")))?;
        let mut entries = self.step_entries(t, k, &mut Interner::new())?;
        let base = self.bases[k];
        entries.sort_unstable_by_key(|(i, _)| *i);
        for (j, (i, e)) in entries.iter().enumerate() {
            if *i != base + j as u64 {
                return Err(TraceError::format(
                    &t.path,
                    s.block.offset,
                    format!(
                        "step {}: record {} ({}) repeats a write-order number or leaves one out",
                        s.step, i, e.coord
                    ),
                ));
            }
        }
        let mut cursor = self.regions[k];
        // Verified payload pages leave the resident set as verification
        // goes, not only when the step is done: a long prefill's step holds
        // most of the file.
        let mut released = cursor;
        let (mut payloads, mut bytes) = (0u64, 0u64);
        for (i, e) in &entries {
            if cursor.saturating_sub(released) >= VERIFY_RELEASE {
                t.release(released, cursor);
                released = cursor;
            }
            let Some(p) = e.payload else { continue };
            self.chunk(t, cursor, p.offset, &|| {
                format!("the payload of record {i} ({})", e.coord)
            })?;
            let i = *i as usize;
            if !t.is_verified(i) {
                t.check_payload(i, e, p)?;
                t.mark_verified(i);
            }
            payloads += 1;
            bytes += p.len;
            cursor = p.offset + p.len;
        }
        for l in &node.levels {
            for g in &l.groups {
                // A paged group's page blocks come first, in page order.
                if let Some(paged) = self.paged(t, g).map_err(|f| t.fault(&f))? {
                    for (j, p) in paged.blocks.iter().enumerate() {
                        self.chunk(t, cursor, p.offset, &|| {
                            format!("step {} level {} layer {:?}'s page {j}", s.step, l.level, g.layer)
                        })?;
                        cursor = p.offset + p.len;
                    }
                }
                if let Some(&b) = node.blocks.get(g.at.block as usize) {
                    self.chunk(t, cursor, b.offset, &|| {
                        format!(
                            "step {} level {} layer {:?}'s group block",
                            s.step, l.level, g.layer
                        )
                    })?;
                    cursor = b.offset + b.len;
                }
            }
        }
        self.chunk(t, cursor, s.block.offset, &|| format!("step {}'s block", s.step))?;
        t.release(self.regions[k], s.block.offset + s.block.len);
        Ok((payloads, bytes))
    }

    /// Verifies every byte: the header's padding, every step (in parallel),
    /// and the root block's place right after the last step.
    pub fn verify(&self, t: &Trace) -> Result<VerifySummary, TraceError> {
        if let Some(at) = t.first_nonzero(t.header_end, t.payload_start) {
            return Err(t.padding_error(at));
        }
        let results: Vec<Result<(u64, u64), TraceError>> = (0..self.blocks.len())
            .into_par_iter()
            .map(|k| self.verify_step(t, k))
            .collect();
        let mut summary = VerifySummary {
            payloads: 0,
            payload_bytes: 0,
        };
        for r in results {
            let (p, b) = r?;
            summary.payloads += p;
            summary.payload_bytes += b;
        }
        let cursor = self.blocks.last().map_or(t.header_end, |b| b.offset + b.len);
        self.chunk(t, cursor, self.root_block.offset, &|| {
            "the root block".to_string()
        })?;
        Ok(summary)
    }
}
