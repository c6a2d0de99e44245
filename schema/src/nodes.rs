//! The fingerprint tree of an opened trace as its readers see it: steps,
//! levels and layer groups with their digests (docs/format.md §4.3).
//!
//! A version 1 trace holds its whole tree in memory from the moment it is
//! opened; a version 2 trace reads a step's node, and a group's records,
//! from the file the first time they are asked for ([`Trace::step`],
//! [`Trace::group_records`]), verifying each against its parent up to the
//! trailer. The types are the same for both, so a comparison walks either
//! without knowing which it has.

use crate::v2::BlockRef;
use crate::IndexEntry;
use moeconf_fingerprint::{Digest, Level, LevelSet};
use std::sync::OnceLock;

#[allow(unused_imports)] // doc links
use crate::Trace;

/// One step as the root lists it: known as soon as a trace is open.
///
/// The step number and digest are what the root digest commits to. The
/// per-level record counts are the root block's own (version 2): no digest
/// a comparison checks covers them, so they are checked against the step's
/// block when the step is read ([`Trace::step`]) and are never the basis of
/// a verdict or a report line: which levels a step holds comes from its
/// verified node ([`StepNode::held`], [`Trace::held_levels`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepSummary {
    pub step: u32,
    pub digest: Digest,
    /// Records of the step at each level L0..L4, as the root block declares
    /// them (checked against the step block when the step is read).
    pub level_records: [u64; 5],
}

impl StepSummary {
    /// Records of the step, as the root block declares them.
    pub fn declared_records(&self) -> u64 {
        self.level_records.iter().sum()
    }
}

/// The levels of one step.
#[derive(Debug)]
pub struct StepNode {
    pub step: u32,
    pub digest: Digest,
    /// Its levels, ascending.
    pub levels: Vec<LevelNode>,
    /// Version 2: where the step's payloads end (its first group block).
    pub(crate) payload_end: u64,
    /// Version 2: the group blocks, in tree order (empty for version 1).
    pub(crate) blocks: Box<[BlockRef]>,
}

impl StepNode {
    /// The levels the step holds (committed by its step digest).
    pub fn held(&self) -> LevelSet {
        self.levels.iter().map(|l| l.level).collect()
    }

    /// The level node for `level`, if present.
    pub fn level(&self, level: Level) -> Option<&LevelNode> {
        self.levels.iter().find(|l| l.level == level)
    }
}

/// The layer groups of one (step, level).
#[derive(Debug)]
pub struct LevelNode {
    pub level: Level,
    pub digest: Digest,
    /// Its layer groups, `None` first then by layer.
    pub groups: Vec<GroupNode>,
}

impl LevelNode {
    /// The group for `layer`, if present.
    pub fn group(&self, layer: Option<u32>) -> Option<&GroupNode> {
        self.groups.iter().find(|g| g.layer == layer)
    }
}

/// The records of one (step, level, layer). Its digest and record count
/// are known with its step; the records themselves come from
/// [`Trace::group_records`].
#[derive(Debug)]
pub struct GroupNode {
    /// The layer, or `None` for model-global records.
    pub layer: Option<u32>,
    pub digest: Digest,
    /// Records in the group.
    pub records: u64,
    pub(crate) at: GroupAt,
    pub(crate) content: OnceLock<Result<GroupContent, Fault>>,
    /// Version 4, a paged group: its verified page table and the pages
    /// read so far (docs/format.md §11.9). Boxed: every group of every
    /// loaded step carries the slot, few groups are paged.
    pub(crate) paged: OnceLock<Box<Result<Paged, Fault>>>,
}

/// A paged group's table, verified against the group digest, and its
/// pages, each verified against its chaining value on first read.
#[derive(Debug)]
pub(crate) struct Paged {
    pub layout: moeconf_fingerprint::group_pages::GroupPages,
    /// The group preimage's prefix (hashed with page 0).
    pub prefix: Vec<u8>,
    /// Each page's chaining value, in page order.
    pub cvs: Box<[Digest]>,
    /// Each page's block.
    pub blocks: Box<[BlockRef]>,
    /// Each page's checked entries (ids and entries, as a group's).
    pub pages: Box<[OnceLock<Result<GroupContent, Fault>>]>,
    /// Each page whose records `Trace::group_page_entries` has made
    /// reachable by number and found in canonical order once: later reads
    /// of it check only its first record against the page before.
    pub settled: Box<[std::sync::atomic::AtomicBool]>,
}

/// The records of one loaded layer group ([`Trace::group_entries`]): each
/// record's id (its write-order number) with its entry, in canonical tree
/// order (position, phase, path). What a comparison walks, so that reading
/// a group's records costs no lookup by id.
#[derive(Debug, Clone, Copy)]
pub struct GroupRecords<'a> {
    ids: &'a [usize],
    entries: Entries<'a>,
}

/// Where the entries of a [`GroupRecords`] are.
#[derive(Debug, Clone, Copy)]
enum Entries<'a> {
    /// Version 2: the group's own entries, one per id, in the same order.
    Group(&'a [IndexEntry]),
    /// Version 1: the trace's flat index, indexed by id.
    Flat(&'a [IndexEntry]),
}

impl<'a> GroupRecords<'a> {
    /// A group without records (what a walk uses for a group that failed to read).
    pub fn empty() -> GroupRecords<'a> {
        GroupRecords {
            ids: &[],
            entries: Entries::Group(&[]),
        }
    }

    /// A version 2 group: `entries[k]` is the record with id `ids[k]`.
    pub(crate) fn of_group(ids: &'a [usize], entries: &'a [IndexEntry]) -> GroupRecords<'a> {
        GroupRecords {
            ids,
            entries: Entries::Group(entries),
        }
    }

    /// A version 1 group: its ids index the trace's `flat` index.
    pub(crate) fn of_flat(ids: &'a [usize], flat: &'a [IndexEntry]) -> GroupRecords<'a> {
        GroupRecords {
            ids,
            entries: Entries::Flat(flat),
        }
    }

    /// The record ids, in canonical tree order (as [`Trace::group_records`]).
    pub fn ids(&self) -> &'a [usize] {
        self.ids
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The `k`-th record (id and entry) in tree order.
    pub fn get(&self, k: usize) -> Option<(usize, &'a IndexEntry)> {
        let id = *self.ids.get(k)?;
        let e = match self.entries {
            Entries::Group(v) => v.get(k)?,
            Entries::Flat(v) => v.get(id)?,
        };
        Some((id, e))
    }

    /// Every record (id and entry) in tree order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &'a IndexEntry)> + 'a {
        let this = *self;
        (0..self.ids.len()).filter_map(move |k| this.get(k))
    }
}

/// One record of a group read without the trace keeping it
/// ([`Trace::read_group`]): its id (write-order number) and its entry, as
/// the group's verified block holds them. Its payload is read with
/// [`Trace::held_payload`]; only the reader makes one.
#[derive(Debug, Clone)]
pub struct HeldRecord {
    pub(crate) id: usize,
    pub(crate) entry: IndexEntry,
}

impl HeldRecord {
    /// The record's id (its position in write order).
    pub fn id(&self) -> usize {
        self.id
    }

    /// The record's entry.
    pub fn entry(&self) -> &IndexEntry {
        &self.entry
    }
}

/// Where a group sits: its step (index into the root's steps), level and
/// position among the level's groups, and (version 2) its block's index in
/// [`StepNode`]'s blocks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupAt {
    pub step_index: u32,
    pub level: Level,
    pub level_index: u8,
    pub group_index: u32,
    pub block: u32,
}

/// A loaded group: the record ids (write-order numbers) in canonical order
/// and, for version 2, the entries themselves (version 1 keeps them in its
/// flat index).
#[derive(Debug)]
pub(crate) struct GroupContent {
    pub ids: Box<[usize]>,
    pub entries: Box<[IndexEntry]>,
}

/// A verification failure remembered by a lazily loaded node, turned into a
/// [`crate::TraceError`] naming the file each time the node is asked for.
#[derive(Debug, Clone)]
pub(crate) struct Fault {
    pub offset: u64,
    pub what: String,
}

impl Fault {
    pub fn new(offset: u64, what: impl Into<String>) -> Fault {
        Fault {
            offset,
            what: what.into(),
        }
    }
}
