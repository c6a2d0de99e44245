//! Byte layout of trace format version 2: the hash tree's interior nodes
//! persisted as blocks (group, step and root blocks) and the 136-byte
//! trailer that pins the root block (docs/format.md §11 is the normative
//! description).
//!
//! Version 2 stores the same records and the same fingerprint tree as
//! version 1 (the root digest of the same records is identical); only the
//! storage changes. A group block holds the index entries of one layer
//! group, a step block the level nodes of one step with a reference to
//! each group block, the root block one reference per step. Every
//! reference carries the child's fingerprint digest (the tree of
//! docs/format.md §4.3) and the digest of the child block's bytes, so a
//! reader that descends one path reads and verifies only the blocks on it,
//! each against its parent up to the trailer.
//!
//! This module encodes and decodes the blocks; what a reader checks of
//! their contents (order, counts, locations, digests) is in the reader.

use crate::layout::{IndexEntry, PayloadRef, END_MAGIC};
use moeconf_fingerprint::wire::{Decoder, Encoder, WireError};
use moeconf_fingerprint::{
    Algorithm, Coord, DType, Digest, Interner, Level, Phase, StreamHasher, TensorView, MAX_RANK,
};

/// The container format version with persisted tree nodes.
pub const FORMAT_V2: u32 = 2;
/// Version 2 whose root block also commits each step's levels: every step
/// reference carries the step's level digests, which hash to the step
/// digest, so which levels a step holds is checked without reading its
/// step block (docs/format.md §11.8).
pub const FORMAT_V3: u32 = 3;
/// Version 3 in which a layer group whose digest preimage is longer than
/// one page (BLAKE3 traces) is stored as page blocks under a page table
/// (docs/format.md §11.9, [`moeconf_fingerprint::group_pages`]).
pub const FORMAT_V4: u32 = 4;
/// Size of the version 2 trailer.
pub const TRAILER_V2_LEN: u64 = 136;
/// Domain tag of a block digest.
pub const DOMAIN_BLOCK: &str = "moeconf.block.v2";
/// Domain tag of the version 2 checksum (preamble, header, trailer).
pub const DOMAIN_CHECKSUM_V2: &str = "moeconf.checksum.v2";
/// Block kind code of a group block.
pub const KIND_GROUP: u32 = 0;
/// Block kind code of a step block.
pub const KIND_STEP: u32 = 1;
/// Block kind code of the root block.
pub const KIND_ROOT: u32 = 2;
/// Block kind code of a page block (version 4).
pub const KIND_PAGE: u32 = 3;
/// Size of an encoded page reference (chaining value, block reference).
pub const PAGE_REF_LEN: u64 = 32 + 8 + 8 + 32;
/// Smallest encoded group entry (ordinal, position, phase, a 1-byte path,
/// dtype, empty shape, digest, no payload): bounds record counts.
pub const MIN_GROUP_ENTRY_LEN: u64 = 8 + 4 + 4 + 8 + 1 + 4 + 8 + 32 + 1;
/// Smallest encoded group reference (layer `None`).
pub const MIN_GROUP_REF_LEN: u64 = 1 + 32 + 8 + 8 + 8 + 32;
/// Smallest encoded level of a step block (no group).
pub const MIN_LEVEL_LEN: u64 = 4 + 8;
/// Size of an encoded step reference (version 2).
pub const STEP_REF_LEN: u64 = 4 + 32 + 8 * 5 + 8 + 8 + 32;
/// Size of an encoded step reference of version 3: version 2's, then the
/// five level digests.
pub const STEP_REF_LEN_V3: u64 = STEP_REF_LEN + 5 * 32;

/// Size of an encoded step reference of `version` (2 or 3).
pub fn step_ref_len(version: u32) -> u64 {
    if version >= FORMAT_V3 {
        STEP_REF_LEN_V3
    } else {
        STEP_REF_LEN
    }
}

/// Whether `version` is one of the block formats (2, 3 or 4) this module
/// encodes.
pub fn is_block_format(version: u32) -> bool {
    (FORMAT_V2..=FORMAT_V4).contains(&version)
}

/// Whether `version` stores large groups paged (version 4).
pub fn is_paged_format(version: u32) -> bool {
    version >= FORMAT_V4
}

/// Digest of a block's bytes: `H(wire("moeconf.block.v2") ‖ bytes)`.
pub fn block_digest(alg: Algorithm, bytes: &[u8]) -> Digest {
    let mut h = block_hasher(alg);
    h.update(bytes);
    h.finalize()
}

/// A hasher of [`block_digest`]'s preimage with the domain tag already fed:
/// feed it the block's bytes (in any number of pieces), then finalize.
pub fn block_hasher(alg: Algorithm) -> StreamHasher {
    let mut h = alg.hasher();
    let mut e = Encoder::new();
    e.str(DOMAIN_BLOCK);
    h.update(e.as_bytes());
    h
}

/// Where a block lies in the file and the digest of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    /// Absolute offset (a multiple of 64).
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// [`block_digest`] of the block's bytes.
    pub digest: Digest,
}

impl BlockRef {
    /// The end offset, `None` on overflow.
    pub fn end(&self) -> Option<u64> {
        self.offset.checked_add(self.len)
    }

    fn encode(&self, e: &mut Encoder) {
        e.u64(self.offset).u64(self.len).raw(&self.digest.0);
    }

    fn decode(d: &mut Decoder<'_>, what: &str) -> Result<BlockRef, WireError> {
        Ok(BlockRef {
            offset: d.u64(what)?,
            len: d.u64(what)?,
            digest: Digest(d.array32(what)?),
        })
    }
}

/// A step block's reference to one group block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupRef {
    /// The group's layer (`None`: model-global records).
    pub layer: Option<u32>,
    /// The group's fingerprint digest (docs/format.md §4.3).
    pub digest: Digest,
    /// Records in the group.
    pub records: u64,
    pub block: BlockRef,
}

/// A paged group block's reference to one of its pages (version 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRef {
    /// The page's BLAKE3 chaining value in the group's digest preimage.
    pub cv: Digest,
    pub block: BlockRef,
}

/// One level of a step block: its groups in canonical order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LevelRefs {
    pub level: Level,
    /// Its groups, layer `None` first, then ascending.
    pub groups: Vec<GroupRef>,
}

/// The root block's reference to one step block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepRef {
    pub step: u32,
    pub digest: Digest,
    /// Records of the step at each level L0..L4.
    pub level_records: [u64; 5],
    pub block: BlockRef,
    /// Version 3: the digest of each level L0..L4 the step holds
    /// ([`Digest::ZERO`] where it holds none); `None` in version 2.
    pub level_digests: Option<[Digest; 5]>,
}

impl StepRef {
    /// Appends the reference as the root block holds it: step, digest,
    /// records per level, block offset, length and digest
    /// ([`STEP_REF_LEN`] bytes), then in version 3 the five level digests.
    pub fn encode(&self, e: &mut Encoder) {
        e.u32(self.step).raw(&self.digest.0);
        for &n in &self.level_records {
            e.u64(n);
        }
        self.block.encode(e);
        if let Some(levels) = &self.level_digests {
            for d in levels {
                e.raw(&d.0);
            }
        }
    }

    /// The step and its digest from an encoded reference (the first
    /// [`STEP_REF_LEN`] bytes of `bytes`, as [`StepRef::encode`] wrote them).
    pub fn step_and_digest(bytes: &[u8]) -> Option<(u32, Digest)> {
        let step = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?);
        let digest = Digest(bytes.get(4..36)?.try_into().ok()?);
        Some((step, digest))
    }

    /// Records of the step at every level, `None` on overflow.
    pub fn total(&self) -> Option<u64> {
        self.level_records
            .iter()
            .try_fold(0u64, |acc, &n| acc.checked_add(n))
    }
}

/// One decoded entry of a group block, with its write-order number and
/// the offset where its encoding starts (for messages).
#[derive(Debug, Clone)]
pub struct GroupEntry {
    /// Position of the record in write (execution) order.
    pub ordinal: u64,
    /// The record, its step, level and layer taken from the block.
    pub entry: IndexEntry,
    /// Absolute offset of the entry's encoding.
    pub at: u64,
}

/// A decoded group block.
#[derive(Debug, Clone)]
pub struct GroupBlock {
    /// The step the block says it belongs to.
    pub step: u32,
    pub level: Level,
    /// The layer, or `None` for model-global records.
    pub layer: Option<u32>,
    /// Entries in block order (none in a paged group block).
    pub entries: Vec<GroupEntry>,
    /// Version 4: a paged group's page table (empty otherwise).
    pub pages: Vec<PageRef>,
}

/// A decoded page block (version 4): a range of a paged group's entries.
#[derive(Debug, Clone)]
pub struct PageBlock {
    pub step: u32,
    pub level: Level,
    pub layer: Option<u32>,
    /// The page's number in its group (0-based).
    pub page: u32,
    pub entries: Vec<GroupEntry>,
}

/// Encodes a group block: kind, step, level, layer, then the entries
/// (ordinal, position, phase, path, dtype, shape, digest, payload).
pub fn encode_group_block<'e>(
    step: u32,
    level: Level,
    layer: Option<u32>,
    entries: impl ExactSizeIterator<Item = (u64, &'e IndexEntry)>,
) -> Vec<u8> {
    let mut e = Encoder::with_capacity(32 + 110 * entries.len());
    e.u32(KIND_GROUP).u32(step).u32(level.code()).opt_u32(layer);
    encode_entries(&mut e, entries);
    e.into_bytes()
}

/// Encodes a paged group block (version 4): kind 0, step, level, layer, an
/// empty entry list, then the page table (each page's chaining value and
/// block reference, in page order).
pub fn encode_paged_group_block(step: u32, level: Level, layer: Option<u32>, pages: &[PageRef]) -> Vec<u8> {
    let mut e = Encoder::with_capacity(40 + PAGE_REF_LEN as usize * pages.len());
    e.u32(KIND_GROUP).u32(step).u32(level.code()).opt_u32(layer);
    e.len(0).len(pages.len());
    for p in pages {
        e.raw(&p.cv.0);
        p.block.encode(&mut e);
    }
    e.into_bytes()
}

/// Encodes a page block (version 4): kind 3, step, level, layer, the page's
/// number, then its entries as a group block holds them.
pub fn encode_page_block<'e>(
    step: u32,
    level: Level,
    layer: Option<u32>,
    page: u32,
    entries: impl ExactSizeIterator<Item = (u64, &'e IndexEntry)>,
) -> Vec<u8> {
    let mut e = Encoder::with_capacity(36 + 110 * entries.len());
    e.u32(KIND_PAGE)
        .u32(step)
        .u32(level.code())
        .opt_u32(layer)
        .u32(page);
    encode_entries(&mut e, entries);
    e.into_bytes()
}

/// The entry list of a group or page block.
fn encode_entries<'e>(e: &mut Encoder, entries: impl ExactSizeIterator<Item = (u64, &'e IndexEntry)>) {
    e.len(entries.len());
    for (ordinal, x) in entries {
        e.u64(ordinal)
            .u32(x.coord.position)
            .u32(x.coord.phase as u32)
            .str(&x.coord.path);
        x.encode_value_fields(e);
    }
}

fn kind(d: &mut Decoder<'_>, want: u32, name: &str) -> Result<(), WireError> {
    let at = d.offset();
    let k = d.u32("block kind")?;
    if k != want {
        return Err(d.error_at(
            at,
            format!("block kind {k} where a {name} block (kind {want}) belongs"),
        ));
    }
    Ok(())
}

fn level_code(d: &mut Decoder<'_>, what: &str) -> Result<Level, WireError> {
    let at = d.offset();
    let c = d.u32(what)?;
    Level::from_code(c).ok_or_else(|| d.error_at(at, format!("unknown level code {c}")))
}

/// Decodes a group block (`base`: its absolute offset), rejecting unknown
/// codes, invalid paths and tags, ranks above 8, payload lengths that do not
/// match the shape, and trailing bytes. With `paged` (version 4), a block
/// with no entry carries a page table. Order, counts and locations are the
/// reader's to check.
pub fn decode_group_block(
    bytes: &[u8],
    base: u64,
    interner: &mut Interner,
    paged: bool,
) -> Result<GroupBlock, WireError> {
    let mut d = Decoder::new(bytes, base);
    kind(&mut d, KIND_GROUP, "group")?;
    let step = d.u32("group step")?;
    let level = level_code(&mut d, "group level")?;
    let layer = d.opt_u32("group layer")?;
    let entries = decode_entries(&mut d, step, level, layer, interner)?;
    let mut pages = Vec::new();
    if paged && entries.is_empty() {
        let n = d.len("page count", PAGE_REF_LEN as usize, u64::MAX)?;
        pages.reserve_exact(n);
        for _ in 0..n {
            let cv = Digest(d.array32("page chaining value")?);
            let block = BlockRef::decode(&mut d, "page block reference")?;
            pages.push(PageRef { cv, block });
        }
    }
    d.finish("group block")?;
    Ok(GroupBlock {
        step,
        level,
        layer,
        entries,
        pages,
    })
}

/// Decodes a page block (version 4) with the checks of
/// [`decode_group_block`].
pub fn decode_page_block(bytes: &[u8], base: u64, interner: &mut Interner) -> Result<PageBlock, WireError> {
    let mut d = Decoder::new(bytes, base);
    kind(&mut d, KIND_PAGE, "page")?;
    let step = d.u32("page step")?;
    let level = level_code(&mut d, "page level")?;
    let layer = d.opt_u32("page layer")?;
    let page = d.u32("page number")?;
    let entries = decode_entries(&mut d, step, level, layer, interner)?;
    d.finish("page block")?;
    Ok(PageBlock {
        step,
        level,
        layer,
        page,
        entries,
    })
}

/// The entry list of a group or page block of (`step`, `level`, `layer`).
fn decode_entries(
    d: &mut Decoder<'_>,
    step: u32,
    level: Level,
    layer: Option<u32>,
    interner: &mut Interner,
) -> Result<Vec<GroupEntry>, WireError> {
    let n = d.len("group entry count", MIN_GROUP_ENTRY_LEN as usize, u64::MAX)?;
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        let at = d.offset();
        let ordinal = d.u64("record ordinal")?;
        let position = d.u32("coordinate position")?;
        let pat = d.offset();
        let phase = match d.u32("coordinate phase")? {
            0 => Phase::Prefill,
            1 => Phase::Decode,
            p => return Err(d.error_at(pat, format!("unknown phase code {p}"))),
        };
        let path_at = d.offset();
        let path = d.str("coordinate path", moeconf_fingerprint::MAX_PATH_LEN as u64)?;
        Coord::validate_path(path).map_err(|m| d.error_at(path_at, m))?;
        let path = interner.path(path);
        let dat = d.offset();
        let dc = d.u32("record dtype")?;
        let dtype =
            DType::from_code(dc).ok_or_else(|| d.error_at(dat, format!("unknown dtype code {dc}")))?;
        let rank = d.len("record shape", 8, MAX_RANK as u64)?;
        let mut dims = [0u64; MAX_RANK];
        for dim in dims.iter_mut().take(rank) {
            *dim = d.u64("record dimension")?;
        }
        let shape = interner.shape(&dims[..rank]);
        let digest = Digest(d.array32("record digest")?);
        let oat = d.offset();
        let coord = Coord {
            step,
            position,
            phase,
            layer,
            path,
        };
        let payload = if d.option_tag("record payload")? {
            let offset = d.u64("payload offset")?;
            let len = d.u64("payload length")?;
            if TensorView::byte_len(dtype, &shape) != Some(len) {
                return Err(d.error_at(
                    oat,
                    format!("record {coord}: payload length {len} does not match shape {shape:?} of {dtype}"),
                ));
            }
            Some(PayloadRef { offset, len })
        } else {
            None
        };
        entries.push(GroupEntry {
            ordinal,
            entry: IndexEntry {
                coord,
                level,
                dtype,
                shape,
                digest,
                payload,
            },
            at,
        });
    }
    Ok(entries)
}

/// Encodes a step block: kind, step, then each level with its group
/// references (layer, digest, records, block offset, length and digest).
pub fn encode_step_block(step: u32, levels: &[LevelRefs]) -> Vec<u8> {
    let mut e = Encoder::with_capacity(24 + levels.iter().map(|l| 12 + 96 * l.groups.len()).sum::<usize>());
    e.u32(KIND_STEP).u32(step).len(levels.len());
    for l in levels {
        e.u32(l.level.code()).len(l.groups.len());
        for g in &l.groups {
            e.opt_u32(g.layer).raw(&g.digest.0).u64(g.records);
            g.block.encode(&mut e);
        }
    }
    e.into_bytes()
}

/// Decodes a step block: its step and levels (structure only).
pub fn decode_step_block(bytes: &[u8], base: u64) -> Result<(u32, Vec<LevelRefs>), WireError> {
    let mut d = Decoder::new(bytes, base);
    kind(&mut d, KIND_STEP, "step")?;
    let step = d.u32("step block step")?;
    let n = d.len("step block level count", MIN_LEVEL_LEN as usize, 5)?;
    let mut levels = Vec::with_capacity(n);
    for _ in 0..n {
        let level = level_code(&mut d, "step block level")?;
        let g = d.len("level group count", MIN_GROUP_REF_LEN as usize, u64::MAX)?;
        let mut groups = Vec::with_capacity(g);
        for _ in 0..g {
            let layer = d.opt_u32("group layer")?;
            let digest = Digest(d.array32("group digest")?);
            let records = d.u64("group record count")?;
            let block = BlockRef::decode(&mut d, "group block reference")?;
            groups.push(GroupRef {
                layer,
                digest,
                records,
                block,
            });
        }
        levels.push(LevelRefs { level, groups });
    }
    d.finish("step block")?;
    Ok((step, levels))
}

/// Encodes the root block: kind, then one reference per step (step, digest,
/// records per level, block offset, length and digest; version 3's level
/// digests when the references carry them).
pub fn encode_root_block(steps: &[StepRef]) -> Vec<u8> {
    let mut e = Encoder::with_capacity(12 + STEP_REF_LEN_V3 as usize * steps.len());
    encode_root_block_head(&mut e, steps.len() as u64);
    for s in steps {
        s.encode(&mut e);
    }
    e.into_bytes()
}

/// What precedes a root block's step references: its kind and their count
/// (a writer that streams the references writes this first).
pub fn encode_root_block_head(e: &mut Encoder, steps: u64) {
    e.u32(KIND_ROOT).u64(steps);
}

/// Decodes the root block of `version` (2 or 3; structure only).
pub fn decode_root_block(bytes: &[u8], base: u64, version: u32) -> Result<Vec<StepRef>, WireError> {
    let mut steps = Vec::new();
    for_each_step_ref(bytes, base, version, |n, s| {
        if steps.is_empty() {
            steps.reserve_exact(n);
        }
        steps.push(s);
    })?;
    Ok(steps)
}

/// The parts of a decoded root block a reader keeps.
pub struct RootParts {
    /// Each step's summary (step, digest, record counts).
    pub summaries: Vec<crate::nodes::StepSummary>,
    /// Each step block's reference.
    pub blocks: Vec<BlockRef>,
    /// Version 3: each step's level digests (empty in version 2).
    pub level_digests: Vec<[Digest; 5]>,
}

/// [`decode_root_block`] into the parts a reader keeps, without another
/// copy of the list.
pub fn decode_root_block_split(bytes: &[u8], base: u64, version: u32) -> Result<RootParts, WireError> {
    let (mut summaries, mut blocks, mut level_digests) = (Vec::new(), Vec::new(), Vec::new());
    for_each_step_ref(bytes, base, version, |n, s| {
        if summaries.is_empty() {
            summaries.reserve_exact(n);
            blocks.reserve_exact(n);
            if s.level_digests.is_some() {
                level_digests.reserve_exact(n);
            }
        }
        if let Some(l) = s.level_digests {
            level_digests.push(l);
        }
        summaries.push(crate::nodes::StepSummary {
            step: s.step,
            digest: s.digest,
            level_records: s.level_records,
        });
        blocks.push(s.block);
    })?;
    Ok(RootParts {
        summaries,
        blocks,
        level_digests,
    })
}

/// Decodes the root block, calling `each` with the number of steps (its
/// length checked against the block's size) and every step reference in
/// order; fails on trailing bytes.
fn for_each_step_ref(
    bytes: &[u8],
    base: u64,
    version: u32,
    mut each: impl FnMut(usize, StepRef),
) -> Result<(), WireError> {
    let mut d = Decoder::new(bytes, base);
    kind(&mut d, KIND_ROOT, "root")?;
    let n = d.len("root block step count", step_ref_len(version) as usize, u64::MAX)?;
    for _ in 0..n {
        let step = d.u32("step reference step")?;
        let digest = Digest(d.array32("step digest")?);
        let mut level_records = [0u64; 5];
        for n in level_records.iter_mut() {
            *n = d.u64("step level record count")?;
        }
        let block = BlockRef::decode(&mut d, "step block reference")?;
        let level_digests = if version >= FORMAT_V3 {
            let mut l = [Digest::ZERO; 5];
            for x in l.iter_mut() {
                *x = Digest(d.array32("step level digest")?);
            }
            Some(l)
        } else {
            None
        };
        each(
            n,
            StepRef {
                step,
                digest,
                level_records,
                block,
                level_digests,
            },
        );
    }
    d.finish("root block")
}

/// The 136-byte trailer of version 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrailerV2 {
    /// The root block (it ends where the trailer starts).
    pub root_block: BlockRef,
    pub record_count: u64,
    /// Root digest of the fingerprint tree (docs/format.md §4.3).
    pub root: Digest,
    /// Checksum of preamble, header and the trailer's first 96 bytes.
    pub checksum: Digest,
}

impl TrailerV2 {
    /// The first 96 bytes: magic, root block offset and length, record
    /// count, root digest, root block digest (what the checksum covers).
    pub fn covered_bytes(&self) -> [u8; 96] {
        let mut e = Encoder::new();
        e.raw(&END_MAGIC)
            .u64(self.root_block.offset)
            .u64(self.root_block.len)
            .u64(self.record_count)
            .raw(&self.root.0)
            .raw(&self.root_block.digest.0);
        let mut out = [0u8; 96];
        out.copy_from_slice(e.as_bytes());
        out
    }

    /// All 136 bytes: covered part, checksum, end magic again.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = self.covered_bytes().to_vec();
        v.extend_from_slice(&self.checksum.0);
        v.extend_from_slice(&END_MAGIC);
        v
    }
}

/// The version 2 checksum: `H(wire("moeconf.checksum.v2") ‖ preamble and
/// header ‖ trailer[0..96))`. The blocks are covered by their digests.
pub fn checksum_v2(alg: Algorithm, preamble_and_header: &[u8], covered: &[u8; 96]) -> Digest {
    let mut h = alg.hasher();
    let mut e = Encoder::new();
    e.str(DOMAIN_CHECKSUM_V2);
    h.update(e.as_bytes());
    h.update(preamble_and_header);
    h.update(covered);
    h.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn entry(position: u32, path: &str, payload: Option<PayloadRef>) -> IndexEntry {
        IndexEntry {
            coord: Coord {
                step: 3,
                position,
                phase: Phase::Decode,
                layer: Some(2),
                path: path.into(),
            },
            level: Level::L3,
            dtype: DType::F32,
            shape: Arc::from(&[2u64][..]),
            digest: Digest([7; 32]),
            payload,
        }
    }

    #[test]
    fn blocks_round_trip_and_refuse_trailing_bytes() {
        let es = [
            entry(5, "router.topk", None),
            entry(6, "moe.combine", Some(PayloadRef { offset: 128, len: 8 })),
        ];
        let b = encode_group_block(
            3,
            Level::L3,
            Some(2),
            es.iter().enumerate().map(|(i, e)| (i as u64 + 9, e)),
        );
        let g = decode_group_block(&b, 1000, &mut Interner::new(), true).unwrap();
        assert_eq!((g.step, g.level, g.layer), (3, Level::L3, Some(2)));
        assert_eq!(g.entries.len(), 2);
        assert_eq!(g.entries[1].ordinal, 10);
        assert_eq!(g.entries[1].entry, es[1]);
        assert_eq!(g.entries[0].at, 1000 + 4 + 4 + 4 + 5 + 8);
        let mut longer = b.clone();
        longer.push(0);
        assert!(decode_group_block(&longer, 0, &mut Interner::new(), false).is_err());

        let block = BlockRef {
            offset: 64,
            len: 10,
            digest: Digest([1; 32]),
        };
        let levels = vec![LevelRefs {
            level: Level::L3,
            groups: vec![GroupRef {
                layer: None,
                digest: Digest([2; 32]),
                records: 4,
                block,
            }],
        }];
        let s = encode_step_block(3, &levels);
        assert_eq!(decode_step_block(&s, 0).unwrap(), (3, levels));
        let mut steps = vec![StepRef {
            step: 3,
            digest: Digest([3; 32]),
            level_records: [0, 0, 0, 4, 0],
            block,
            level_digests: None,
        }];
        let r = encode_root_block(&steps);
        assert_eq!(r.len() as u64, 12 + STEP_REF_LEN);
        assert_eq!(decode_root_block(&r, 0, FORMAT_V2).unwrap(), steps);
        // Version 3 appends the level digests; neither version reads the other.
        steps[0].level_digests = Some([
            Digest::ZERO,
            Digest::ZERO,
            Digest::ZERO,
            Digest([4; 32]),
            Digest::ZERO,
        ]);
        let r3 = encode_root_block(&steps);
        assert_eq!(r3.len() as u64, 12 + STEP_REF_LEN_V3);
        assert_eq!(decode_root_block(&r3, 0, FORMAT_V3).unwrap(), steps);
        assert!(decode_root_block(&r3, 0, FORMAT_V2).is_err());
        assert!(decode_root_block(&r, 0, FORMAT_V3).is_err());
        // A block of one kind is not read as another.
        assert!(decode_step_block(&r, 0).is_err());
        assert!(decode_root_block(&s, 0, FORMAT_V2).is_err());
    }
}
