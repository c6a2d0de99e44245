//! "Well-formed lies": a structure-aware rewriter of format version 2, 3 and 4
//! traces (docs/format.md §11) that changes what the root digest does not
//! commit to, then recomputes every block digest, block reference, the root
//! block digest and the checksum, so that the result is internally
//! consistent yet says something false.
//!
//! The root (§4.3) commits to the algorithm, the binding and the records'
//! digests in canonical order. It does not commit to write-order numbers
//! (`GroupEntry.ordinal`), per-level record counts (`StepRef.level_records`),
//! `GroupRef.records`, the trailer's `record_count`, offsets, chunk layout
//! and padding, or the provenance. A [`Lie`] rewrites one of those; the
//! metamorphic oracle (`testkit/tests/lies.rs`, [`crate::targets::lies_case`])
//! demands that every consumer gives a trace and any lie of it the same
//! answer, or an error.
//!
//! [`Model::decode`] reads every node of a valid version 2 trace with the
//! schema crate's own block decoders; [`Model::encode`] lays the nodes out
//! again as §11.1 says (a chunk at the next multiple of 64 after the
//! previous one, plus any extra padding a lie asks for), so that encoding
//! an unchanged model gives the input back byte for byte. Version 4's paged
//! groups (§11.9) are decoded from their pages and laid out as pages again
//! (their chaining values recomputed), so every lie above applies to them
//! too: a [`Lie::Pad`] can move a page block, a count lie changes the
//! record count the pages' layout is computed from. [`PageLie`] falsifies a
//! page or a page table itself (a corruption with recomputed digests, which
//! readers must refuse: `testkit/tests/pages.rs`, `tests/paged_cli.rs`).

use arbitrary::Unstructured;
use moeconf_fingerprint::group_pages::GroupPages;
use moeconf_fingerprint::group_prefix;
use moeconf_fingerprint::{Algorithm, Digest, Interner, Level};
use moeconf_schema::layout::{align_up, Preamble, END_MAGIC, MAGIC, PREAMBLE_LEN};
use moeconf_schema::v2::{
    block_digest, checksum_v2, decode_group_block, decode_page_block, decode_root_block, decode_step_block,
    encode_group_block, encode_page_block, encode_paged_group_block, encode_root_block, encode_step_block,
    is_block_format, is_paged_format, BlockRef, GroupRef, LevelRefs, PageRef, StepRef, TrailerV2,
    TRAILER_V2_LEN,
};
use moeconf_schema::{Header, IndexEntry, PayloadRef};

/// One record of a group block, with its payload bytes.
#[derive(Debug, Clone)]
pub struct EntryModel {
    /// Its write-order number as the file claims it.
    pub ordinal: u64,
    /// The record (its payload offset is rewritten on encoding).
    pub entry: IndexEntry,
    /// Its payload bytes, when it keeps one.
    pub payload: Option<Vec<u8>>,
}

/// One group (step, level, layer) of a step.
#[derive(Debug, Clone)]
pub struct GroupModel {
    /// The layer, or `None` for model-global records.
    pub layer: Option<u32>,
    /// Its fingerprint digest (committed to by the root).
    pub digest: Digest,
    /// `GroupRef.records` as the step block claims it.
    pub records: u64,
    /// Its entries, in block (canonical) order (a paged group's from
    /// every page, each once).
    pub entries: Vec<EntryModel>,
    /// Version 4: a falsification of the group's pages to make on encoding
    /// (not a lie about an uncommitted fact: each is a corruption whose
    /// block digests are recomputed, which a reader must refuse).
    pub page_lie: Option<PageLie>,
}

/// A falsified page of a paged group (version 4), [`GroupModel::page_lie`].
/// A page index past the group's last page (or, for a lie about a page
/// and the one after it, its last page) makes the lie a no-op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageLie {
    /// The page table lists a wrong chaining value for this page.
    Cv(usize),
    /// The page holds the records one further on (its count unchanged).
    Shift(usize),
    /// The page's copy of the record it shares with the page before has
    /// another write-order number (that of the page's second record).
    Boundary(usize),
    /// The page's copy of a record in its middle (shared with no other
    /// page) has another digest: the page no longer hashes to its value.
    Digest(usize),
    /// The page table leaves out the last page.
    Missing,
    /// This page's block reference covers its bytes but the last.
    Truncated(usize),
    /// The page leaves out its first record (for a page after the first,
    /// the record it shares with the page before): one entry short.
    Omit(usize),
    /// The page also holds the record after its last (one entry too many;
    /// for a page before the last, a record of the page after).
    Extra(usize),
    /// The page's second record is a copy of its first (a record repeated,
    /// the count unchanged).
    Repeat(usize),
    /// Two adjacent records in the page's middle trade places.
    SwapWithin(usize),
    /// The page's copy of the record it shares with the page after has
    /// another write-order number (that of the page's second-to-last).
    BoundaryEnd(usize),
    /// The page's copy of the record it shares with the page before has
    /// another payload reference (none, or the page's second record's) or,
    /// without a payload, another shape; its digest unchanged.
    BoundaryField(usize),
    /// The page block names another page number (the next, or for the
    /// last page the one before).
    Renumber(usize),
    /// The table lists this page and the next in swapped order (values
    /// and blocks).
    SwapTable(usize),
    /// The table swaps the blocks of this page and the next, values in
    /// order.
    SwapBlocks(usize),
    /// The blocks of this page and the next are written in swapped file
    /// order (the table refers to each correctly).
    FileOrder(usize),
    /// The table's entry for the next page refers to this page's block
    /// (the next page's value kept).
    Duplicate(usize),
}

impl PageLie {
    /// Draws a page lie; its page index is a byte (taken modulo the group's
    /// page count when applied, [`Lie::Page`]).
    pub fn draw(u: &mut Unstructured<'_>) -> arbitrary::Result<PageLie> {
        let j = usize::from(u.arbitrary::<u8>()?);
        Ok(match u.int_in_range(0..=16u8)? {
            0 => PageLie::Cv(j),
            1 => PageLie::Shift(j),
            2 => PageLie::Boundary(j),
            3 => PageLie::Digest(j),
            4 => PageLie::Missing,
            5 => PageLie::Truncated(j),
            6 => PageLie::Omit(j),
            7 => PageLie::Extra(j),
            8 => PageLie::Repeat(j),
            9 => PageLie::SwapWithin(j),
            10 => PageLie::BoundaryEnd(j),
            11 => PageLie::BoundaryField(j),
            12 => PageLie::Renumber(j),
            13 => PageLie::SwapTable(j),
            14 => PageLie::SwapBlocks(j),
            15 => PageLie::FileOrder(j),
            _ => PageLie::Duplicate(j),
        })
    }

    /// The page it falsifies (`None` for [`PageLie::Missing`]).
    pub fn page(self) -> Option<usize> {
        use PageLie::*;
        match self {
            Missing => None,
            Cv(j) | Shift(j) | Boundary(j) | Digest(j) | Truncated(j) | Omit(j) | Extra(j) | Repeat(j)
            | SwapWithin(j) | BoundaryEnd(j) | BoundaryField(j) | Renumber(j) | SwapTable(j)
            | SwapBlocks(j) | FileOrder(j) | Duplicate(j) => Some(j),
        }
    }

    /// The same lie about page `j`.
    pub fn at(self, j: usize) -> PageLie {
        use PageLie::*;
        match self {
            Missing => Missing,
            Cv(_) => Cv(j),
            Shift(_) => Shift(j),
            Boundary(_) => Boundary(j),
            Digest(_) => Digest(j),
            Truncated(_) => Truncated(j),
            Omit(_) => Omit(j),
            Extra(_) => Extra(j),
            Repeat(_) => Repeat(j),
            SwapWithin(_) => SwapWithin(j),
            BoundaryEnd(_) => BoundaryEnd(j),
            BoundaryField(_) => BoundaryField(j),
            Renumber(_) => Renumber(j),
            SwapTable(_) => SwapTable(j),
            SwapBlocks(_) => SwapBlocks(j),
            FileOrder(_) => FileOrder(j),
            Duplicate(_) => Duplicate(j),
        }
    }
}

/// One level of a step.
#[derive(Debug, Clone)]
pub struct LevelModel {
    pub level: Level,
    /// Its groups in tree order.
    pub groups: Vec<GroupModel>,
}

/// Where an entry is: (level index, group index, entry index) in a step.
pub type EntryAt = (usize, usize, usize);

/// One step: its nodes and the order of its payload chunks.
#[derive(Debug, Clone)]
pub struct StepModel {
    pub step: u32,
    /// Its fingerprint digest.
    pub digest: Digest,
    /// `StepRef.level_records` as the root block claims it.
    pub level_records: [u64; 5],
    /// Version 3: `StepRef.level_digests` as the root block lists them.
    pub level_digests: Option<[Digest; 5]>,
    /// Its levels, ascending.
    pub levels: Vec<LevelModel>,
    /// The entries that keep a payload, in the order their chunks appear.
    pub payload_order: Vec<EntryAt>,
}

impl StepModel {
    /// Every entry of the step, in tree order.
    pub fn entries(&self) -> Vec<EntryAt> {
        let mut v = Vec::new();
        for (li, l) in self.levels.iter().enumerate() {
            for (gi, g) in l.groups.iter().enumerate() {
                v.extend((0..g.entries.len()).map(|ei| (li, gi, ei)));
            }
        }
        v
    }

    pub fn entry_mut(&mut self, at: EntryAt) -> Option<&mut EntryModel> {
        self.levels
            .get_mut(at.0)?
            .groups
            .get_mut(at.1)?
            .entries
            .get_mut(at.2)
    }

    pub fn entry(&self, at: EntryAt) -> Option<&EntryModel> {
        self.levels.get(at.0)?.groups.get(at.1)?.entries.get(at.2)
    }

    /// The entry of the record with path `path` (first in tree order).
    pub fn find(&self, path: &str) -> Option<EntryAt> {
        self.entries()
            .into_iter()
            .find(|&at| self.entry(at).is_some_and(|e| &*e.entry.coord.path == path))
    }
}

/// A whole version 2 trace as nodes, with what it claims besides the root.
#[derive(Debug, Clone)]
pub struct Model {
    /// Container format version (2, 3 or 4).
    pub version: u32,
    pub alg: Algorithm,
    /// Binding and provenance.
    pub header: Header,
    /// The trailer's root digest.
    pub root: Digest,
    /// The trailer's `record_count`.
    pub record_count: u64,
    /// Steps in root block order.
    pub steps: Vec<StepModel>,
    /// Extra zero padding, in 64-byte blocks, before chunk number `i` of
    /// the file (every payload and block, in file order; the root block
    /// last): `(i, blocks)`.
    pub padding: Vec<(usize, u64)>,
}

/// Why a trace could not be decoded or re-encoded.
pub type LieError = String;

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn slice(b: &[u8], r: BlockRef) -> Result<&[u8], LieError> {
    let end = r.end().ok_or("block reference overflows")?;
    b.get(r.offset as usize..end as usize)
        .ok_or_else(|| format!("block {}..{end} outside the file", r.offset))
}

impl Model {
    /// Decodes every node of a version 2 trace (nothing is verified beyond
    /// what decoding needs: give it a trace a reader accepted).
    pub fn decode(bytes: &[u8]) -> Result<Model, LieError> {
        let version = u32_at(bytes, 8).filter(|&v| is_block_format(v));
        let Some(version) = version.filter(|_| bytes.get(..8) == Some(&MAGIC[..])) else {
            return Err("not a version 2, 3 or 4 trace".into());
        };
        let alg = u32_at(bytes, 16)
            .and_then(Algorithm::from_code)
            .ok_or("unknown algorithm")?;
        let header_len = u64_at(bytes, 24).ok_or("short preamble")? as usize;
        let header_end = (PREAMBLE_LEN as usize)
            .checked_add(header_len)
            .ok_or("header length overflows")?;
        let header = Header::decode(
            bytes
                .get(PREAMBLE_LEN as usize..header_end)
                .ok_or("short header")?,
            PREAMBLE_LEN,
        )
        .map_err(|e| e.to_string())?;
        let t = bytes
            .len()
            .checked_sub(TRAILER_V2_LEN as usize)
            .ok_or("shorter than a trailer")?;
        let tr = &bytes[t..];
        let root_ref = BlockRef {
            offset: u64_at(tr, 8).ok_or("short trailer")?,
            len: u64_at(tr, 16).ok_or("short trailer")?,
            digest: Digest([0; 32]),
        };
        let record_count = u64_at(tr, 24).ok_or("short trailer")?;
        let root = Digest(
            tr.get(32..64)
                .and_then(|x| x.try_into().ok())
                .ok_or("short trailer")?,
        );
        let root_bytes = slice(bytes, root_ref)?;
        let refs = decode_root_block(root_bytes, root_ref.offset, version).map_err(|e| e.to_string())?;
        let mut interner = Interner::new();
        let mut steps = Vec::with_capacity(refs.len());
        for s in refs {
            let (step, levels) =
                decode_step_block(slice(bytes, s.block)?, s.block.offset).map_err(|e| e.to_string())?;
            let mut lm = Vec::with_capacity(levels.len());
            let mut payloads: Vec<(u64, EntryAt)> = Vec::new();
            for (li, l) in levels.into_iter().enumerate() {
                let mut groups = Vec::with_capacity(l.groups.len());
                for (gi, g) in l.groups.into_iter().enumerate() {
                    let gb = decode_group_block(
                        slice(bytes, g.block)?,
                        g.block.offset,
                        &mut interner,
                        is_paged_format(version),
                    )
                    .map_err(|e| e.to_string())?;
                    let mut all = gb.entries;
                    if !gb.pages.is_empty() {
                        // A paged group: every page's records, a record two
                        // pages share once.
                        let layout =
                            layout_of(l.level, g.layer, g.records).ok_or("group length overflows")?;
                        for (j, p) in gb.pages.iter().enumerate() {
                            let pb = decode_page_block(slice(bytes, p.block)?, p.block.offset, &mut interner)
                                .map_err(|e| e.to_string())?;
                            let start = layout.entries(j as u64).start as usize;
                            let skip = all.len().saturating_sub(start);
                            all.extend(pb.entries.into_iter().skip(skip));
                        }
                    }
                    let mut entries = Vec::with_capacity(all.len());
                    for (ei, ge) in all.into_iter().enumerate() {
                        let payload = match ge.entry.payload {
                            Some(p) => {
                                payloads.push((p.offset, (li, gi, ei)));
                                let r = BlockRef {
                                    offset: p.offset,
                                    len: p.len,
                                    digest: Digest([0; 32]),
                                };
                                Some(slice(bytes, r)?.to_vec())
                            }
                            None => None,
                        };
                        entries.push(EntryModel {
                            ordinal: ge.ordinal,
                            entry: ge.entry,
                            payload,
                        });
                    }
                    groups.push(GroupModel {
                        layer: g.layer,
                        digest: g.digest,
                        records: g.records,
                        entries,
                        page_lie: None,
                    });
                }
                lm.push(LevelModel {
                    level: l.level,
                    groups,
                });
            }
            payloads.sort_by_key(|&(o, _)| o);
            steps.push(StepModel {
                step,
                digest: s.digest,
                level_records: s.level_records,
                level_digests: s.level_digests,
                levels: lm,
                payload_order: payloads.into_iter().map(|(_, at)| at).collect(),
            });
        }
        Ok(Model {
            version,
            alg,
            header,
            root,
            record_count,
            steps,
            padding: Vec::new(),
        })
    }

    /// Lays the model out as a version 2 file (§11.1, plus [`Model::padding`]),
    /// with every block digest and reference, the root block digest and the
    /// checksum computed from what is written.
    pub fn encode(&self) -> Result<Vec<u8>, LieError> {
        let header = self.header.to_bytes();
        let pre = Preamble {
            algorithm: self.alg,
            header_len: header.len() as u64,
        };
        let mut out = pre.to_bytes_version(self.version).to_vec();
        out.extend_from_slice(&header);
        let header_end = out.len();
        let mut chunk = 0usize;
        // Places one chunk at the next multiple of 64 (plus any extra padding).
        let mut place = |out: &mut Vec<u8>, bytes: &[u8]| -> Result<BlockRef, LieError> {
            let extra: u64 = self
                .padding
                .iter()
                .filter(|&&(i, _)| i == chunk)
                .map(|&(_, n)| n)
                .sum();
            chunk += 1;
            let at = align_up(out.len() as u64)
                .and_then(|a| a.checked_add(extra.checked_mul(64)?))
                .ok_or("offset overflows")?;
            if at > 1 << 32 {
                return Err("padding too large".into());
            }
            out.resize(at as usize, 0);
            out.extend_from_slice(bytes);
            Ok(BlockRef {
                offset: at,
                len: bytes.len() as u64,
                digest: block_digest(self.alg, bytes),
            })
        };
        let mut step_refs = Vec::with_capacity(self.steps.len());
        for s in &self.steps {
            let mut s2 = s.clone();
            for &at in &s.payload_order {
                let e = s2.entry_mut(at).ok_or("payload order names no entry")?;
                let bytes = e
                    .payload
                    .clone()
                    .ok_or("payload order names an entry without payload")?;
                let r = place(&mut out, &bytes)?;
                e.entry.payload = Some(PayloadRef {
                    offset: r.offset,
                    len: r.len,
                });
            }
            let mut levels = Vec::with_capacity(s2.levels.len());
            for l in &s2.levels {
                let mut groups = Vec::with_capacity(l.groups.len());
                for g in &l.groups {
                    let b = match self.layout(l.level, g) {
                        Some(layout) => {
                            let pages = encode_pages(&mut out, &mut place, s2.step, l.level, g, layout)?;
                            encode_paged_group_block(s2.step, l.level, g.layer, &pages)
                        }
                        None => encode_group_block(
                            s2.step,
                            l.level,
                            g.layer,
                            g.entries.iter().map(|e| (e.ordinal, &e.entry)),
                        ),
                    };
                    let block = place(&mut out, &b)?;
                    groups.push(GroupRef {
                        layer: g.layer,
                        digest: g.digest,
                        records: g.records,
                        block,
                    });
                }
                levels.push(LevelRefs {
                    level: l.level,
                    groups,
                });
            }
            let sb = encode_step_block(s2.step, &levels);
            let block = place(&mut out, &sb)?;
            step_refs.push(StepRef {
                step: s2.step,
                digest: s2.digest,
                level_records: s2.level_records,
                block,
                level_digests: s2.level_digests,
            });
        }
        let rb = encode_root_block(&step_refs);
        let root_block = place(&mut out, &rb)?;
        let mut tr = TrailerV2 {
            root_block,
            record_count: self.record_count,
            root: self.root,
            checksum: Digest([0; 32]),
        };
        tr.checksum = checksum_v2(self.alg, &out[..header_end], &tr.covered_bytes());
        out.extend_from_slice(&tr.to_bytes());
        debug_assert_eq!(&out[out.len() - 8..], &END_MAGIC);
        Ok(out)
    }

    /// The sum of every step's claimed `level_records`.
    pub fn claimed_total(&self) -> u64 {
        self.steps
            .iter()
            .flat_map(|s| s.level_records)
            .fold(0u64, |a, n| a.saturating_add(n))
    }

    /// The number of chunks [`Model::encode`] writes (payloads and blocks).
    pub fn chunks(&self) -> usize {
        1 + self
            .steps
            .iter()
            .map(|s| {
                let groups: usize = s
                    .levels
                    .iter()
                    .flat_map(|l| l.groups.iter().map(|g| 1 + self.pages_of(l.level, g)))
                    .sum();
                1 + s.payload_order.len() + groups
            })
            .sum::<usize>()
    }

    /// The number of page blocks [`Model::encode`] writes for group `g` of
    /// `level` (0 when it is not paged).
    pub fn pages_of(&self, level: Level, g: &GroupModel) -> usize {
        self.layout(level, g).map_or(0, |x| x.count() as usize)
    }

    /// The page layout [`Model::encode`] stores group `g` of `level` in
    /// (its records' count; version 4, BLAKE3), or `None` when the group
    /// is not paged.
    pub fn layout(&self, level: Level, g: &GroupModel) -> Option<GroupPages> {
        layout_of(level, g.layer, g.entries.len() as u64)
            .filter(|x| is_paged_format(self.version) && self.alg == Algorithm::Blake3 && x.is_paged())
    }

    /// The `n`-th paged group of step index `step` (modulo their count),
    /// or `None` when the step has none.
    pub fn paged_group(&self, step: usize, n: usize) -> Option<(usize, usize, usize)> {
        let paged: Vec<(usize, usize, usize)> = self
            .paged_groups()
            .into_iter()
            .filter(|&(s, _, _)| s == step)
            .collect();
        paged.get(n % paged.len().max(1)).copied()
    }

    /// Every paged group: (step index, level index, group index).
    pub fn paged_groups(&self) -> Vec<(usize, usize, usize)> {
        let mut v = Vec::new();
        for (si, s) in self.steps.iter().enumerate() {
            for (li, l) in s.levels.iter().enumerate() {
                for (gi, g) in l.groups.iter().enumerate() {
                    if self.layout(l.level, g).is_some() {
                        v.push((si, li, gi));
                    }
                }
            }
        }
        v
    }
}

/// A field the root does not commit to, and how to rewrite it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lie {
    /// Permute the write-order numbers of one step (index into the root
    /// block's steps, modulo their count): rotate them by `by` in tree
    /// order, payload chunks left where they are.
    PermuteOrdinals {
        step: usize,
        /// Rotation (modulo the step's record count).
        by: usize,
    },
    /// Record `b` of a step (tree order) takes the number of record `a`:
    /// two records share one write-order number.
    ShareOrdinal {
        step: usize,
        /// Record whose number is copied.
        a: usize,
        /// Record that gets it.
        b: usize,
    },
    /// [`Lie::ShareOrdinal`] by record paths (the first record of each
    /// path in tree order), e.g. `lm.margin` and `token.output`.
    ShareOrdinalOf {
        step: usize,
        /// Path of the record whose number is copied.
        a: String,
        /// Path of the record that gets it.
        b: String,
    },
    /// Swap the numbers of the first records of two groups of one step
    /// (group indices in tree order across levels).
    SwapAcrossGroups {
        step: usize,
        /// First group.
        a: usize,
        /// Second group.
        b: usize,
    },
    /// Set `level_records[level]` of one step in the root block to `count`
    /// (claiming a level it does not hold, dropping one it holds (0), or
    /// changing a count). With `groups`, the first group of that level in
    /// the step block changes its `records` by the same amount (when the
    /// level exists and the result is not negative); with `trailer`, the
    /// trailer's `record_count` becomes the sum of the claimed counts.
    LevelRecords {
        step: usize,
        level: Level,
        /// The claimed count.
        count: u64,
        /// Rewrite the step block's group count consistently.
        groups: bool,
        /// Rewrite the trailer's record count consistently.
        trailer: bool,
    },
    /// Version 3: set one step's level digest for `level` in the root
    /// block to that of step `from` (modulo the step count) at the same
    /// level, or to a made-up digest when `from` names the step itself;
    /// its record count follows (0 for a zero digest, 1 where it was 0),
    /// so the reference stays well-formed and only its commitment to the
    /// step digest can tell (a no-op in version 2).
    LevelDigest {
        step: usize,
        level: Level,
        /// Step index whose digest is copied.
        from: usize,
    },
    /// Set `GroupRef.records` of one group (tree order) of a step.
    GroupRecords {
        step: usize,
        /// Group index in tree order across levels.
        group: usize,
        /// The claimed count.
        count: u64,
    },
    /// Set the trailer's `record_count`.
    RecordCount {
        /// The claimed count.
        count: u64,
    },
    /// Insert `blocks` × 64 zero bytes before chunk number `chunk` (modulo
    /// the number of chunks), moving it and everything after it; every
    /// offset is rewritten.
    Pad {
        /// Chunk index in file order.
        chunk: usize,
        /// Extra 64-byte blocks of zeros (1–4 when drawn).
        blocks: u64,
    },
    /// Reorder the payload chunks of one step (rotate by `by`), keeping
    /// each record's write-order number; offsets rewritten.
    ReorderPayloads {
        step: usize,
        /// Rotation.
        by: usize,
    },
    /// Version 4: falsify one page or page table of a paged group
    /// ([`PageLie`]): the `group`-th paged group of the step (modulo their
    /// count), its page index taken modulo the group's page count. A
    /// corruption behind recomputed block digests rather than a lie about
    /// an uncommitted fact, except the page blocks' order and placement;
    /// a no-op in a trace without a paged group.
    Page {
        step: usize,
        /// Index among the step's paged groups (tree order).
        group: usize,
        lie: PageLie,
    },
    /// Version 4: change `GroupRef.records` of a paged group (as
    /// [`Lie::Page`] picks it) by `delta` (when the result is not
    /// negative): the page layout moves by a few records, or the group is
    /// no longer paged. With `level`, the root block's count of its level
    /// and the trailer's `record_count` follow (and version 3's level
    /// digest stays listed).
    PagedRecords {
        step: usize,
        group: usize,
        delta: i16,
        level: bool,
    },
    /// Rewrite the provenance's runtime, version and thread count (its
    /// notes, which consumers interpret, are kept). The header length
    /// changes, and every offset after it with it.
    Provenance {
        /// The claimed runtime name.
        runtime: String,
        /// The claimed thread count.
        threads: u32,
    },
}

/// The class of a lie (for reports and for choosing in tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LieClass {
    /// Write-order numbers.
    Ordinals,
    /// Per-level and per-group record counts.
    Counts,
    /// Offsets and chunk layout.
    Layout,
    /// The trailer's record count.
    Trailer,
    Provenance,
    /// Version 4's pages and page tables ([`Lie::Page`]).
    Pages,
}

impl LieClass {
    /// The classes of lies about what the root does not commit to (every
    /// format version 2–4).
    pub const ALL: [LieClass; 5] = [
        LieClass::Ordinals,
        LieClass::Counts,
        LieClass::Layout,
        LieClass::Trailer,
        LieClass::Provenance,
    ];
    /// [`LieClass::ALL`] and [`LieClass::Pages`]: what the paged case of
    /// the `lies` target draws from.
    pub const PAGED: [LieClass; 6] = [
        LieClass::Ordinals,
        LieClass::Counts,
        LieClass::Layout,
        LieClass::Trailer,
        LieClass::Provenance,
        LieClass::Pages,
    ];
}

impl Lie {
    /// Which class of field it rewrites.
    pub fn class(&self) -> LieClass {
        match self {
            Lie::PermuteOrdinals { .. }
            | Lie::ShareOrdinal { .. }
            | Lie::ShareOrdinalOf { .. }
            | Lie::SwapAcrossGroups { .. } => LieClass::Ordinals,
            Lie::LevelRecords { .. } | Lie::GroupRecords { .. } | Lie::LevelDigest { .. } => LieClass::Counts,
            Lie::Pad { .. } | Lie::ReorderPayloads { .. } => LieClass::Layout,
            Lie::RecordCount { .. } => LieClass::Trailer,
            Lie::Provenance { .. } => LieClass::Provenance,
            Lie::Page { .. } | Lie::PagedRecords { .. } => LieClass::Pages,
        }
    }

    /// Draws a lie of any class.
    pub fn draw(u: &mut Unstructured<'_>) -> arbitrary::Result<Lie> {
        let class = *u.choose(&LieClass::ALL)?;
        Lie::draw_of(u, class)
    }

    /// Draws a lie of `class`.
    pub fn draw_of(u: &mut Unstructured<'_>, class: LieClass) -> arbitrary::Result<Lie> {
        let step = usize::from(u.arbitrary::<u8>()?);
        Ok(match class {
            LieClass::Ordinals => match u.int_in_range(0..=2u8)? {
                0 => Lie::PermuteOrdinals {
                    step,
                    by: usize::from(u.arbitrary::<u8>()?),
                },
                1 => Lie::ShareOrdinal {
                    step,
                    a: usize::from(u.arbitrary::<u8>()?),
                    b: usize::from(u.arbitrary::<u8>()?),
                },
                _ => Lie::SwapAcrossGroups {
                    step,
                    a: usize::from(u.arbitrary::<u8>()?),
                    b: usize::from(u.arbitrary::<u8>()?),
                },
            },
            LieClass::Counts => {
                if u.ratio(1, 5)? {
                    Lie::LevelDigest {
                        step,
                        level: Level::ALL[u.choose_index(5)?],
                        from: usize::from(u.arbitrary::<u8>()?),
                    }
                } else if u.ratio(1, 4)? {
                    Lie::GroupRecords {
                        step,
                        group: usize::from(u.arbitrary::<u8>()?),
                        count: u.int_in_range(0..=200)?,
                    }
                } else {
                    Lie::LevelRecords {
                        step,
                        level: Level::ALL[u.choose_index(5)?],
                        count: u.int_in_range(0..=200)?,
                        groups: u.arbitrary()?,
                        trailer: !u.ratio(1, 4)?,
                    }
                }
            }
            LieClass::Layout => {
                if u.arbitrary()? {
                    Lie::Pad {
                        chunk: usize::from(u.arbitrary::<u8>()?),
                        blocks: u.int_in_range(1..=4)?,
                    }
                } else {
                    Lie::ReorderPayloads {
                        step,
                        by: usize::from(u.arbitrary::<u8>()?),
                    }
                }
            }
            LieClass::Trailer => Lie::RecordCount {
                count: u.int_in_range(0..=300)?,
            },
            // Names the oracle's normalization knows (a runtime name is
            // printed by inspect and diff): 1–9 copies of one name, so that
            // the header length varies.
            LieClass::Provenance => Lie::Provenance {
                runtime: crate::metamorphic::LIAR.repeat(u.int_in_range(1..=9)?),
                threads: crate::metamorphic::LIAR_THREADS,
            },
            LieClass::Pages => {
                let group = usize::from(u.arbitrary::<u8>()?);
                if u.ratio(1, 5)? {
                    // Mostly a few records either way, sometimes thousands.
                    let delta = if u.ratio(1, 4)? {
                        u.arbitrary::<i16>()?
                    } else {
                        u.int_in_range(-3..=3)?
                    };
                    Lie::PagedRecords {
                        step,
                        group,
                        delta,
                        level: u.arbitrary()?,
                    }
                } else {
                    Lie::Page {
                        step,
                        group,
                        lie: PageLie::draw(u)?,
                    }
                }
            }
        })
    }

    /// Applies the lie to `m`. Indices are taken modulo what exists; a lie
    /// with nothing to rewrite (a step without two records, a trace without
    /// payloads) leaves `m` as it is and returns `false`.
    pub fn apply(&self, m: &mut Model) -> bool {
        let n_steps = m.steps.len();
        let step_of = |i: usize| if n_steps == 0 { None } else { Some(i % n_steps) };
        match self {
            Lie::PermuteOrdinals { step, by } => {
                let Some(s) = step_of(*step).map(|i| &mut m.steps[i]) else {
                    return false;
                };
                let all = s.entries();
                let n = all.len();
                if n < 2 || by % n == 0 {
                    return false;
                }
                let ords: Vec<u64> = all
                    .iter()
                    .filter_map(|&at| s.entry(at).map(|e| e.ordinal))
                    .collect();
                for (i, &at) in all.iter().enumerate() {
                    if let Some(e) = s.entry_mut(at) {
                        e.ordinal = ords[(i + by) % n];
                    }
                }
                true
            }
            Lie::ShareOrdinal { step, a, b } => {
                let Some(s) = step_of(*step).map(|i| &mut m.steps[i]) else {
                    return false;
                };
                let all = s.entries();
                if all.len() < 2 {
                    return false;
                }
                let (a, mut b) = (all[a % all.len()], all[b % all.len()]);
                if a == b {
                    b = all[(all.iter().position(|&x| x == a).unwrap_or(0) + 1) % all.len()];
                }
                share(s, a, b)
            }
            Lie::ShareOrdinalOf { step, a, b } => {
                let Some(s) = step_of(*step).map(|i| &mut m.steps[i]) else {
                    return false;
                };
                match (s.find(a), s.find(b)) {
                    (Some(a), Some(b)) if a != b => share(s, a, b),
                    _ => false,
                }
            }
            Lie::SwapAcrossGroups { step, a, b } => {
                let Some(s) = step_of(*step).map(|i| &mut m.steps[i]) else {
                    return false;
                };
                let groups: Vec<(usize, usize)> = s
                    .levels
                    .iter()
                    .enumerate()
                    .flat_map(|(li, l)| (0..l.groups.len()).map(move |gi| (li, gi)))
                    .collect();
                if groups.len() < 2 {
                    return false;
                }
                let ga = groups[a % groups.len()];
                let mut gb = groups[b % groups.len()];
                if ga == gb {
                    gb = groups[(a % groups.len() + 1) % groups.len()];
                }
                let (x, y) = ((ga.0, ga.1, 0), (gb.0, gb.1, 0));
                let (Some(ox), Some(oy)) = (s.entry(x).map(|e| e.ordinal), s.entry(y).map(|e| e.ordinal))
                else {
                    return false;
                };
                if let Some(e) = s.entry_mut(x) {
                    e.ordinal = oy;
                }
                if let Some(e) = s.entry_mut(y) {
                    e.ordinal = ox;
                }
                true
            }
            Lie::LevelRecords {
                step,
                level,
                count,
                groups,
                trailer,
            } => {
                let Some(i) = step_of(*step) else {
                    return false;
                };
                let s = &mut m.steps[i];
                let l = level.code() as usize;
                let old = s.level_records[l];
                if old == *count {
                    return false;
                }
                s.level_records[l] = *count;
                // Version 3 lists a level digest exactly where a count is
                // not zero: keep that so, with a made-up digest.
                if let Some(d) = &mut s.level_digests {
                    if (*count == 0) != (d[l] == Digest::ZERO) {
                        d[l] = if *count == 0 { Digest::ZERO } else { MADE_UP };
                    }
                }
                if *groups {
                    if let Some(g) = s
                        .levels
                        .iter_mut()
                        .find(|x| x.level == *level)
                        .and_then(|x| x.groups.first_mut())
                    {
                        let new = i128::from(g.records) + i128::from(*count) - i128::from(old);
                        if let Ok(new) = u64::try_from(new) {
                            g.records = new;
                        }
                    }
                }
                if *trailer {
                    m.record_count = m.claimed_total();
                }
                true
            }
            Lie::LevelDigest { step, level, from } => {
                let (Some(i), Some(j)) = (step_of(*step), step_of(*from)) else {
                    return false;
                };
                let l = level.code() as usize;
                let Some(source) = m.steps[j].level_digests else {
                    return false;
                };
                let s = &mut m.steps[i];
                let Some(d) = &mut s.level_digests else {
                    return false;
                };
                let new = if i == j {
                    if d[l] == MADE_UP {
                        Digest::ZERO
                    } else {
                        MADE_UP
                    }
                } else {
                    source[l]
                };
                if d[l] == new {
                    return false;
                }
                d[l] = new;
                if new == Digest::ZERO {
                    s.level_records[l] = 0;
                } else if s.level_records[l] == 0 {
                    s.level_records[l] = 1;
                }
                m.record_count = m.claimed_total();
                true
            }
            Lie::GroupRecords { step, group, count } => {
                let Some(i) = step_of(*step) else {
                    return false;
                };
                let s = &mut m.steps[i];
                let n: usize = s.levels.iter().map(|l| l.groups.len()).sum();
                if n == 0 {
                    return false;
                }
                let Some(g) = s
                    .levels
                    .iter_mut()
                    .flat_map(|l| l.groups.iter_mut())
                    .nth(group % n)
                else {
                    return false;
                };
                if g.records == *count {
                    return false;
                }
                g.records = *count;
                true
            }
            Lie::RecordCount { count } => {
                if m.record_count == *count {
                    return false;
                }
                m.record_count = *count;
                true
            }
            Lie::Pad { chunk, blocks } => {
                if *blocks == 0 {
                    return false;
                }
                let n = m.chunks();
                m.padding.push((chunk % n, *blocks));
                true
            }
            Lie::ReorderPayloads { step, by } => {
                let Some(s) = step_of(*step).map(|i| &mut m.steps[i]) else {
                    return false;
                };
                let n = s.payload_order.len();
                if n < 2 || by % n == 0 {
                    return false;
                }
                s.payload_order.rotate_left(by % n);
                true
            }
            Lie::PagedRecords {
                step,
                group,
                delta,
                level,
            } => {
                let Some((si, li, gi)) = step_of(*step).and_then(|i| m.paged_group(i, *group)) else {
                    return false;
                };
                let s = &mut m.steps[si];
                let l = s.levels[li].level.code() as usize;
                let g = &mut s.levels[li].groups[gi];
                let Ok(new) = u64::try_from(i128::from(g.records) + i128::from(*delta)) else {
                    return false;
                };
                if *delta == 0 {
                    return false;
                }
                g.records = new;
                if *level {
                    let c = i128::from(s.level_records[l]) + i128::from(*delta);
                    s.level_records[l] = u64::try_from(c).unwrap_or(0);
                    if let Some(d) = &mut s.level_digests {
                        if (s.level_records[l] == 0) != (d[l] == Digest::ZERO) {
                            d[l] = if s.level_records[l] == 0 {
                                Digest::ZERO
                            } else {
                                MADE_UP
                            };
                        }
                    }
                    m.record_count = m.claimed_total();
                }
                true
            }
            Lie::Page { step, group, lie } => {
                let Some((si, li, gi)) = step_of(*step).and_then(|i| m.paged_group(i, *group)) else {
                    return false;
                };
                let level = m.steps[si].levels[li].level;
                let count = m.pages_of(level, &m.steps[si].levels[li].groups[gi]);
                let lie = match lie.page() {
                    Some(j) if count > 0 => lie.at(j % count),
                    _ => *lie,
                };
                m.steps[si].levels[li].groups[gi].page_lie = Some(lie);
                true
            }
            Lie::Provenance { runtime, threads } => {
                let p = &mut m.header.provenance;
                if p.runtime == *runtime && p.threads == *threads {
                    return false;
                }
                p.runtime = runtime.clone();
                p.threads = *threads;
                true
            }
        }
    }
}

/// The level digest a lie makes up.
const MADE_UP: Digest = Digest([0xA5; 32]);

/// Gives the entry at `b` the write-order number of the entry at `a`.
fn share(s: &mut StepModel, a: EntryAt, b: EntryAt) -> bool {
    let Some(o) = s.entry(a).map(|e| e.ordinal) else {
        return false;
    };
    match s.entry_mut(b) {
        Some(e) if e.ordinal != o => {
            e.ordinal = o;
            true
        }
        _ => false,
    }
}

/// The page layout of a group of `records` records at `level`, `layer`.
fn layout_of(level: Level, layer: Option<u32>, records: u64) -> Option<GroupPages> {
    GroupPages::new(group_prefix(0, level, layer, records).len() as u64, records)
}

/// Places one chunk in the file being encoded ([`Model::encode`]).
type Place<'a> = dyn FnMut(&mut Vec<u8>, &[u8]) -> Result<BlockRef, LieError> + 'a;

/// Places a paged group's page blocks (version 4, §11.9) and returns its
/// page table, applying the group's [`PageLie`].
fn encode_pages(
    out: &mut Vec<u8>,
    place: &mut Place<'_>,
    step: u32,
    level: Level,
    g: &GroupModel,
    layout: GroupPages,
) -> Result<Vec<PageRef>, LieError> {
    let prefix = group_prefix(step, level, g.layer, layout.records());
    let count = layout.count() as usize;
    let lie = g.page_lie;
    let here = |j: usize| lie.and_then(PageLie::page) == Some(j);
    let entry = |i: usize| -> Result<(u64, IndexEntry), LieError> {
        let e = g.entries.get(i).ok_or("page outside its group")?;
        Ok((e.ordinal, e.entry.clone()))
    };
    let mut blocks = Vec::with_capacity(count);
    for j in 0..count {
        let r = layout.entries(j as u64);
        let (a, b) = (r.start as usize, r.end as usize);
        let digests: Vec<Digest> = g
            .entries
            .get(a..b)
            .ok_or("page outside its group")?
            .iter()
            .map(|e| e.entry.digest)
            .collect();
        let mut cv = layout
            .cv(j as u64, &prefix, &digests)
            .ok_or("page outside its group")?;
        let mut held: Vec<(u64, IndexEntry)> = (a..b).map(entry).collect::<Result<_, _>>()?;
        let mut number = j as u32;
        if here(j) {
            let n = held.len();
            match lie {
                Some(PageLie::Cv(_)) => cv.0[0] ^= 1,
                Some(PageLie::Shift(_)) if b < g.entries.len() => {
                    held = (a + 1..b + 1).map(entry).collect::<Result<_, _>>()?;
                }
                Some(PageLie::Boundary(_)) if n > 1 => held[0].0 = held[1].0,
                Some(PageLie::Digest(_)) if n > 2 => held[n / 2].1.digest.0[0] ^= 1,
                Some(PageLie::Omit(_)) if n > 0 => {
                    held.remove(0);
                }
                Some(PageLie::Extra(_)) if b < g.entries.len() => held.push(entry(b)?),
                Some(PageLie::Repeat(_)) if n > 1 => held[1] = held[0].clone(),
                Some(PageLie::SwapWithin(_)) if n > 3 => held.swap(n / 2, n / 2 + 1),
                Some(PageLie::BoundaryEnd(_)) if n > 1 => held[n - 1].0 = held[n - 2].0,
                Some(PageLie::BoundaryField(_)) if n > 1 => {
                    let other = held[1].1.payload;
                    let e = &mut held[0].1;
                    match e.payload {
                        Some(_) if other.is_some() && other != e.payload => e.payload = other,
                        Some(_) => e.payload = None,
                        None => {
                            let mut shape = e.shape.to_vec();
                            shape.push(1);
                            e.shape = shape.into();
                        }
                    }
                }
                Some(PageLie::Renumber(_)) => {
                    number = if j + 1 < count {
                        j as u32 + 1
                    } else {
                        (j as u32).saturating_sub(1)
                    }
                }
                _ => {}
            }
        }
        let bytes = encode_page_block(step, level, g.layer, number, held.iter().map(|(o, e)| (*o, e)));
        blocks.push((cv, bytes));
    }
    // The file order of the page blocks.
    let mut order: Vec<usize> = (0..count).collect();
    if let Some(PageLie::FileOrder(p)) = lie {
        if p + 1 < count {
            order.swap(p, p + 1);
        }
    }
    let mut refs: Vec<Option<BlockRef>> = vec![None; count];
    for &j in &order {
        let bytes = &blocks[j].1;
        let mut block = place(out, bytes)?;
        if lie == Some(PageLie::Truncated(j)) && !bytes.is_empty() {
            block.len -= 1;
            block.digest = block_digest(Algorithm::Blake3, &bytes[..bytes.len() - 1]);
        }
        refs[j] = Some(block);
    }
    let mut pages = Vec::with_capacity(count);
    for (j, r) in refs.into_iter().enumerate() {
        pages.push(PageRef {
            cv: blocks[j].0,
            block: r.ok_or("a page block was not placed")?,
        });
    }
    match lie {
        Some(PageLie::Missing) => {
            pages.pop();
        }
        Some(PageLie::SwapTable(p)) if p + 1 < count => pages.swap(p, p + 1),
        Some(PageLie::SwapBlocks(p)) if p + 1 < count => {
            let x = pages[p].block;
            pages[p].block = pages[p + 1].block;
            pages[p + 1].block = x;
        }
        Some(PageLie::Duplicate(p)) if p + 1 < count => pages[p + 1].block = pages[p].block,
        _ => {}
    }
    Ok(pages)
}

/// Applies `lies` to the version 2 trace `bytes` and re-encodes it,
/// internally consistent. `Ok(None)` when no lie had anything to rewrite.
pub fn lie(bytes: &[u8], lies: &[Lie]) -> Result<Option<Vec<u8>>, LieError> {
    let mut m = Model::decode(bytes)?;
    let mut changed = false;
    for l in lies {
        changed |= l.apply(&mut m);
    }
    if !changed {
        return Ok(None);
    }
    m.encode().map(Some)
}

/// Applies one lie (see [`lie`]).
pub fn lie1(bytes: &[u8], l: &Lie) -> Result<Option<Vec<u8>>, LieError> {
    lie(bytes, std::slice::from_ref(l))
}
