//! Descent of the two hash trees: only subtrees whose digests differ are
//! entered, so an unchanged step costs one 32-byte comparison and no record,
//! payload or tensor byte is touched.
//!
//! A version 2 trace reads a step's node and a group's records from its
//! file the first time the walk enters them, verifying each against its
//! parent ([`Trace::step`], [`Trace::group_records`]). A read that fails
//! does not interrupt the walk: [`Sides`] remembers the first failure (and
//! treats the node as empty), and every entry point that walks
//! ([`crate::diff`], [`crate::differing_pairs`]) returns that failure
//! instead of its result, so no answer ever rests on a node that failed
//! verification.

use moeconf_fingerprint::catalogue::ExecKey;
use moeconf_fingerprint::{Component, Coord, Level, RecordPath};
use moeconf_schema::{
    GroupNode, GroupRecords, IndexEntry, LevelNode, StepNode, StepSummary, Trace, TraceError,
};
use std::cell::RefCell;
use std::cmp::Ordering;
use std::collections::HashMap;

/// One record position in the comparison: the index of the record in the
/// reference and in the candidate (`None` when that side lacks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Pair {
    /// Index into the reference's records.
    pub r: Option<usize>,
    /// Index into the candidate's records.
    pub c: Option<usize>,
}

impl Pair {}

/// Which trace of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Reference,
    Candidate,
}

/// A node of one trace of a comparison failed to read or verify.
/// Its text and source are the trace error's own (it names the file).
#[derive(Debug)]
pub struct SideError {
    /// The trace that failed.
    pub side: Side,
    /// What failed (names the file and the byte offset).
    pub error: TraceError,
}

impl std::fmt::Display for SideError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for SideError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

/// Both traces, side by side, and the first failure to read either's nodes.
pub(crate) struct Sides<'a> {
    pub r: &'a Trace,
    pub c: &'a Trace,
    failure: RefCell<Option<SideError>>,
    /// [`Sides::differing_records`] of the (step, level)s asked for so far:
    /// every part of a diff asks for the first divergent step's records.
    differing: RefCell<HashMap<(u32, Level), Vec<Pair>>>,
}

fn tree_key(e: &IndexEntry) -> (u32, moeconf_fingerprint::Phase, &str) {
    (e.coord.position, e.coord.phase, e.coord.path.as_str())
}

impl<'a> Sides<'a> {
    /// The two traces, no failure yet.
    pub fn new(r: &'a Trace, c: &'a Trace) -> Sides<'a> {
        Sides {
            r,
            c,
            failure: RefCell::new(None),
            differing: RefCell::new(HashMap::new()),
        }
    }

    /// The first failure to read a node during the walk, if any: the caller
    /// must return it instead of its result.
    pub fn take_failure(&self) -> Option<SideError> {
        self.failure.borrow_mut().take()
    }

    fn side_of(&self, t: &Trace) -> Side {
        if std::ptr::eq(t, self.r) {
            Side::Reference
        } else {
            Side::Candidate
        }
    }

    /// `r`'s value, or `fallback` after remembering its error.
    fn latch<T>(&self, t: &Trace, r: Result<T, TraceError>, fallback: T) -> T {
        match r {
            Ok(v) => v,
            Err(source) => {
                let mut f = self.failure.borrow_mut();
                if f.is_none() {
                    *f = Some(SideError {
                        side: self.side_of(t),
                        error: source,
                    });
                }
                fallback
            }
        }
    }

    /// The node of `step` in `t` (read on first use; `None` when absent or
    /// unreadable, the failure remembered).
    pub fn step_node(&self, t: &'a Trace, step: u32) -> Option<&'a StepNode> {
        let r = t.step(step);
        self.latch(t, r, None)
    }

    /// The record ids of a group of `t` (empty when unreadable, the failure
    /// remembered).
    pub fn group_ids(&self, t: &'a Trace, g: &'a GroupNode) -> &'a [usize] {
        let r = t.group_records(g);
        self.latch(t, r, &[])
    }

    /// The records of a group of `t` with their entries (empty when
    /// unreadable, the failure remembered).
    pub fn group_entries(&self, t: &'a Trace, g: &'a GroupNode) -> GroupRecords<'a> {
        let r = t.group_entries(g);
        self.latch(t, r, GroupRecords::empty())
    }

    /// The records of a group of `t`, read and verified but not kept by the
    /// trace (empty when unreadable, the failure remembered): for a question
    /// about the whole group that needs no record by id afterwards (which
    /// paths it holds, how many), at the cost of reading it, without the
    /// memory and the lookups of keeping it.
    pub fn group_held(&self, t: &'a Trace, g: &'a GroupNode) -> Vec<moeconf_schema::HeldRecord> {
        let r = t.read_group(g);
        self.latch(t, r, Vec::new())
    }

    /// The paths of `g`'s records at its first position (the position of
    /// its first record in canonical order), read and verified (empty when
    /// unreadable, the failure remembered). A paged group (format version
    /// 4) reads only its first page and the pages after it that still hold
    /// that position, so the cost does not grow with the group; any other
    /// group is read whole (a group block is at most a page's worth of
    /// records when the trace pages, docs/format.md §11.9) and not kept.
    pub fn group_first_position_paths(&self, t: &'a Trace, g: &'a GroupNode) -> Vec<RecordPath> {
        let paged = self.latch(t, t.group_pages(g), None).is_some();
        if paged {
            let first = self.latch(t, t.group_page_entries(g, &[0]), Vec::new());
            let Some(p0) = first.first().map(|(_, e)| e.coord.position) else {
                return Vec::new();
            };
            let at = self.latch(t, t.group_entries_at(g, p0), Vec::new());
            at.into_iter().map(|(_, e)| e.coord.path.clone()).collect()
        } else {
            let held = self.group_held(t, g);
            let Some(p0) = held.first().map(|h| h.entry().coord.position) else {
                return Vec::new();
            };
            held.into_iter()
                .take_while(|h| h.entry().coord.position == p0)
                .map(|h| h.entry().coord.path.clone())
                .collect()
        }
    }

    /// The group of (`step`, `level`, `layer`) in `t`.
    pub fn group(&self, t: &'a Trace, step: u32, level: Level, layer: Option<u32>) -> Option<&'a GroupNode> {
        self.step_node(t, step)
            .and_then(|s| s.level(level))
            .and_then(|l| l.group(layer))
    }

    /// The union of step numbers of both trees, ascending.
    pub fn steps(&self) -> Vec<u32> {
        self.paired_steps().map(|(step, _, _)| step).collect()
    }

    /// The union of the steps of both trees, ascending, with each side's
    /// summary of the step (`None` on a side without it): a merge of the
    /// two ascending step lists, no search.
    pub fn paired_steps(
        &self,
    ) -> impl Iterator<Item = (u32, Option<&'a StepSummary>, Option<&'a StepSummary>)> {
        let (mut rs, mut cs) = (self.r.steps().iter().peekable(), self.c.steps().iter().peekable());
        std::iter::from_fn(move || {
            let step = match (rs.peek(), cs.peek()) {
                (Some(a), Some(b)) => a.step.min(b.step),
                (Some(a), None) => a.step,
                (None, Some(b)) => b.step,
                (None, None) => return None,
            };
            let a = rs.next_if(|s| s.step == step);
            let b = cs.next_if(|s| s.step == step);
            Some((step, a, b))
        })
    }

    /// Both sides' level nodes of `level` at `step`.
    pub fn level_nodes(&self, step: u32, level: Level) -> (Option<&'a LevelNode>, Option<&'a LevelNode>) {
        let rs = self.step_node(self.r, step).and_then(|s| s.level(level));
        let cs = self.step_node(self.c, step).and_then(|s| s.level(level));
        (rs, cs)
    }

    /// Whether `level` differs at `step` (a level present on one side only
    /// differs). Reads the step nodes only where the step digests differ.
    pub fn level_differs(&self, step: u32, level: Level) -> bool {
        let (rs, cs) = (self.r.step_summary(step), self.c.step_summary(step));
        match (rs, cs) {
            (Some(a), Some(b)) if a.digest == b.digest => return false,
            (None, None) => return false,
            _ => {}
        }
        // Which levels a step holds comes from its verified node (committed
        // by the step digest), never from the root block's record counts.
        match self.level_nodes(step, level) {
            (None, None) => false,
            (Some(a), Some(b)) => a.digest != b.digest,
            _ => true,
        }
    }

    /// Steps (ascending) at which `level` differs. Steps whose digests are
    /// equal on both sides are passed over from the roots' summaries.
    pub fn differing_steps(&self, level: Level) -> Vec<u32> {
        self.paired_steps()
            .filter(|&(step, a, b)| match (a, b) {
                (Some(a), Some(b)) if a.digest == b.digest => false,
                _ => self.level_differs(step, level),
            })
            .map(|(step, _, _)| step)
            .collect()
    }

    /// The catalogue's execution-order key of a pair ([`ExecKey`], from the
    /// side that holds the record), then its phase and path (never the
    /// write-order numbers, which no digest commits to).
    pub fn exec_key(&self, p: Pair) -> (Option<ExecKey>, Option<(moeconf_fingerprint::Phase, RecordPath)>) {
        let e = self.entry(p);
        (
            e.map(|e| ExecKey::of(&e.coord)),
            e.map(|e| (e.coord.phase, e.coord.path.clone())),
        )
    }

    /// The differing records of `level` at `step`, in the catalogue's
    /// execution order ([`Sides::exec_key`]). Descends only into layer
    /// groups whose digests differ.
    pub fn differing_records(&self, step: u32, level: Level) -> Vec<Pair> {
        if let Some(v) = self.differing.borrow().get(&(step, level)) {
            return v.clone();
        }
        let out = self.find_differing_records(step, level);
        self.differing.borrow_mut().insert((step, level), out.clone());
        out
    }

    /// The differing records of `level` at `step` in its model-global group
    /// and the groups of layers before `below`, in execution order: the part
    /// of a step a divergence of layer `below` or later at an earlier step
    /// cannot reach while the fed tokens match. Descends into no other group.
    pub fn differing_records_below(&self, step: u32, level: Level, below: u32) -> Vec<Pair> {
        self.find_differing_records_in(step, level, |layer| layer.is_none_or(|l| l < below))
    }

    /// [`Sides::differing_records`], computed.
    fn find_differing_records(&self, step: u32, level: Level) -> Vec<Pair> {
        self.find_differing_records_in(step, level, |_| true)
    }

    /// The differing records of the groups whose layer `keep` accepts.
    fn find_differing_records_in(
        &self,
        step: u32,
        level: Level,
        keep: impl Fn(Option<u32>) -> bool,
    ) -> Vec<Pair> {
        let (rl, cl) = self.level_nodes(step, level);
        let rg: Vec<&GroupNode> = rl
            .map(|l| l.groups.iter().filter(|g| keep(g.layer)).collect())
            .unwrap_or_default();
        let cg: Vec<&GroupNode> = cl
            .map(|l| l.groups.iter().filter(|g| keep(g.layer)).collect())
            .unwrap_or_default();
        let mut out = Vec::new();
        let (mut i, mut j) = (0, 0);
        while i < rg.len() || j < cg.len() {
            let ord = match (rg.get(i), cg.get(j)) {
                (Some(a), Some(b)) => a.layer.cmp(&b.layer),
                (Some(_), None) => Ordering::Less,
                _ => Ordering::Greater,
            };
            match ord {
                Ordering::Less => {
                    let ids = self.group_ids(self.r, rg[i]);
                    out.extend(ids.iter().map(|&r| Pair { r: Some(r), c: None }));
                    i += 1;
                }
                Ordering::Greater => {
                    let ids = self.group_ids(self.c, cg[j]);
                    out.extend(ids.iter().map(|&c| Pair { r: None, c: Some(c) }));
                    j += 1;
                }
                Ordering::Equal => {
                    if rg[i].digest != cg[j].digest {
                        let (ra, ca) = match self.differing_pages(rg[i], cg[j]) {
                            Some(pair) => pair,
                            None => (
                                self.group_entries(self.r, rg[i]).iter().collect(),
                                self.group_entries(self.c, cg[j]).iter().collect(),
                            ),
                        };
                        merge_join(&ra, &ca, &mut out, |x, y| {
                            x.digest != y.digest || x.dtype != y.dtype || x.shape != y.shape
                        });
                    }
                    i += 1;
                    j += 1;
                }
            }
        }
        out.sort_by_cached_key(|&p| self.exec_key(p));
        out
    }

    /// The records of the pages that differ between two paged groups of the
    /// same (step, level, layer) (format version 4, docs/format.md §11.9),
    /// when both are stored paged with the same record count (the same
    /// layout): pages with equal chaining values hold the same record
    /// digests at the same places, so every differing record lies in a
    /// page whose values differ, and the records of those pages, merged,
    /// pair exactly as the whole groups' would (their keys lie strictly
    /// between the equal records around them). `None`: read the groups
    /// whole. A read that fails is remembered like any other.
    #[allow(clippy::type_complexity)]
    fn differing_pages(
        &self,
        a: &'a GroupNode,
        b: &'a GroupNode,
    ) -> Option<(Vec<(usize, &'a IndexEntry)>, Vec<(usize, &'a IndexEntry)>)> {
        if a.records != b.records {
            return None;
        }
        let va = self.latch(self.r, self.r.group_pages(a), None)?;
        let vb = self.latch(self.c, self.c.group_pages(b), None)?;
        if va.len() != vb.len() {
            return None;
        }
        let differ: Vec<u64> = (0..va.len())
            .filter(|&j| va[j] != vb[j])
            .map(|j| j as u64)
            .collect();
        let ra = self.r.group_page_entries(a, &differ);
        let ca = self.c.group_page_entries(b, &differ);
        Some((
            self.latch(self.r, ra, Vec::new()),
            self.latch(self.c, ca, Vec::new()),
        ))
    }

    /// The candidate's records of the pages of `b` whose chaining values
    /// differ from those of the reference's `a` (both paged alike, see
    /// [`Sides::differing_pages`]): every record of `b` that is not a record
    /// of `a` is among them. `None` when the groups are not paged alike.
    pub fn differing_page_records(
        &self,
        a: &'a GroupNode,
        b: &'a GroupNode,
    ) -> Option<Vec<(usize, &'a IndexEntry)>> {
        self.differing_pages(a, b).map(|(_, c)| c)
    }

    /// The coordinate-matched records of both traces: records of `level` at
    /// `step` in `layer` with this `path` (or path prefix), optionally at one
    /// position, paired by (position, phase, path).
    pub fn lookup(
        &self,
        step: u32,
        level: Level,
        layer: Option<u32>,
        position: Option<u32>,
        path: &str,
        prefix: bool,
    ) -> Vec<Pair> {
        let pick = |t: &'a Trace| -> Vec<(usize, &'a IndexEntry)> {
            let Some(g) = self.group(t, step, level, layer) else {
                return Vec::new();
            };
            // At one position, a paged group (format version 4) reads only
            // the pages holding it.
            let records: Vec<(usize, &'a IndexEntry)> = match position {
                Some(p) => {
                    let r = t.group_entries_at(g, p);
                    self.latch(t, r, Vec::new())
                }
                None => self.group_entries(t, g).iter().collect(),
            };
            records
                .into_iter()
                .filter(|(_, e)| {
                    position.is_none_or(|p| e.coord.position == p)
                        && if prefix {
                            e.coord.path.starts_with(path)
                        } else {
                            e.coord.path == path
                        }
                })
                .collect()
        };
        let (ra, ca) = (pick(self.r), pick(self.c));
        let mut out = Vec::new();
        merge_join(&ra, &ca, &mut out, |_, _| true);
        out
    }

    /// [`Sides::lookup`] of a catalogue component: its records (every member
    /// of a family) at the catalogue's level.
    pub fn lookup_component(
        &self,
        step: u32,
        layer: Option<u32>,
        position: Option<u32>,
        component: Component,
    ) -> Vec<Pair> {
        self.lookup(
            step,
            component.level(),
            layer,
            position,
            component.path(),
            component.is_family(),
        )
    }

    /// The last post-mHC checkpoint of `t` before `bound` (a checkpoint's
    /// coordinate) in its step, in execution order ([`ExecKey`], then phase
    /// and path; never write-order numbers), read at the coordinates that
    /// order puts it at, so that the reads do not grow with the positions
    /// or layers before it. Execution order is layer-major, then position,
    /// then the attention half's checkpoint before the FFN half's: the
    /// checkpoint before it is at the bound's own position, else at the
    /// position before in the same layer, else (the bound opens its layer)
    /// at the last position of the nearest earlier layer. A paged group
    /// (format version 4) reads the pages of those positions (and a
    /// layer's first page, to see that the bound opens it); any other
    /// group is read whole (a group block is at most a page's worth of
    /// records when the trace pages). A checkpoint not found where the
    /// order puts it (a partial or malformed trace) is
    /// [`Preceding::Unlocated`], never another record.
    pub fn checkpoint_before(&self, t: &'a Trace, bound: &Coord) -> Preceding {
        let key = |c: &Coord| (ExecKey::of(c), c.phase, c.path.clone());
        let kb = key(bound);
        let Some(layer) = bound.layer else {
            return Preceding::Unlocated;
        };
        let Some(level) = self.step_node(t, bound.step).and_then(|n| n.level(Level::L3)) else {
            return Preceding::None;
        };
        // A model-global group's records key as layer 0 ([`ExecKey`]): a
        // checkpoint path there (no well-formed trace holds one) could sort
        // anywhere in layer 0, so no answer within layer 0 is certain.
        let global = level.groups.iter().any(|g| g.layer.is_none());
        let last = |records: &[(usize, &IndexEntry)]| -> Option<usize> {
            records
                .iter()
                .filter(|(_, e)| crate::operators::is_checkpoint(&e.coord.path) && key(&e.coord) < kb)
                .max_by(|(_, a), (_, b)| key(&a.coord).cmp(&key(&b.coord)))
                .map(|&(id, _)| id)
        };
        let found = |id: usize| {
            if global && t.record(id).coord.layer == Some(0) {
                Preceding::Unlocated
            } else {
                Preceding::At(id)
            }
        };
        let at = |g: &'a GroupNode, position: u32| self.latch(t, t.group_entries_at(g, position), Vec::new());
        // The bound's own layer: its position, then the one before.
        if let Some(g) = level.group(Some(layer)) {
            if self.latch(t, t.group_pages(g), None).is_none() {
                let all: Vec<(usize, &IndexEntry)> = self.group_entries(t, g).iter().collect();
                if let Some(id) = last(&all) {
                    return found(id);
                }
            } else {
                if let Some(id) = last(&at(g, bound.position)) {
                    return found(id);
                }
                if let Some(id) = bound.position.checked_sub(1).and_then(|p| last(&at(g, p))) {
                    return found(id);
                }
                // Only when the layer holds no record before the bound's
                // position does the bound open it.
                let first = self.latch(t, t.group_page_entries(g, &[0]), Vec::new());
                if first
                    .first()
                    .is_none_or(|(_, e)| e.coord.position < bound.position)
                {
                    return Preceding::Unlocated;
                }
            }
        }
        // The bound opens its layer: the last checkpoint of the nearest
        // earlier layer (groups are in ascending layer order), at its last
        // position.
        let Some(g) = level
            .groups
            .iter()
            .rev()
            .find(|g| g.layer.is_some_and(|l| l < layer))
        else {
            return if global {
                Preceding::Unlocated
            } else {
                Preceding::None
            };
        };
        let id = match self.latch(t, t.group_pages(g), None) {
            None => {
                let all: Vec<(usize, &IndexEntry)> = self.group_entries(t, g).iter().collect();
                last(&all)
            }
            Some(cvs) => {
                let Some(j) = (cvs.len() as u64).checked_sub(1) else {
                    return Preceding::Unlocated;
                };
                let page = self.latch(t, t.group_page_entries(g, &[j]), Vec::new());
                match page.last() {
                    Some(&(_, e)) => last(&at(g, e.coord.position)),
                    None => None,
                }
            }
        };
        id.map_or(Preceding::Unlocated, found)
    }

    /// Whether both sides hold the record and their digests are equal.
    pub fn pair_equal(&self, p: Pair) -> bool {
        match (p.r, p.c) {
            (Some(a), Some(b)) => self.r.record(a).digest == self.c.record(b).digest,
            _ => false,
        }
    }

    /// The entry of a pair on whichever side has it (reference first).
    pub fn entry(&self, p: Pair) -> Option<&'a IndexEntry> {
        p.r.map(|i| self.r.record(i))
            .or_else(|| p.c.map(|i| self.c.record(i)))
    }
}

/// Where the checkpoint before a bound lies in one trace
/// ([`Sides::checkpoint_before`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Preceding {
    /// No checkpoint of the step precedes the bound.
    None,
    /// The record id of the last checkpoint before the bound.
    At(usize),
    /// Not where execution order puts it (a partial or malformed trace);
    /// not searched further.
    Unlocated,
}

/// Merge-joins two record lists (id and entry) sorted in tree order:
/// records present on one side only are always emitted; records on both
/// sides are emitted when `keep_pair` says so.
fn merge_join(
    ra: &[(usize, &IndexEntry)],
    ca: &[(usize, &IndexEntry)],
    out: &mut Vec<Pair>,
    keep_pair: impl Fn(&IndexEntry, &IndexEntry) -> bool,
) {
    let (mut i, mut j) = (0, 0);
    while i < ra.len() || j < ca.len() {
        let ord = match (ra.get(i), ca.get(j)) {
            (Some(a), Some(b)) => tree_key(a.1).cmp(&tree_key(b.1)),
            (Some(_), None) => Ordering::Less,
            _ => Ordering::Greater,
        };
        match ord {
            Ordering::Less => {
                out.push(Pair {
                    r: Some(ra[i].0),
                    c: None,
                });
                i += 1;
            }
            Ordering::Greater => {
                out.push(Pair {
                    r: None,
                    c: Some(ca[j].0),
                });
                j += 1;
            }
            Ordering::Equal => {
                let ((a, x), (b, y)) = (ra[i], ca[j]);
                if keep_pair(x, y) {
                    out.push(Pair {
                        r: Some(a),
                        c: Some(b),
                    });
                }
                i += 1;
                j += 1;
            }
        }
    }
}
