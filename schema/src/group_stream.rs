//! A step's groups kept in tree order while their records arrive, and the
//! page blocks of long ones encoded before the step ends (format version 4,
//! BLAKE3; docs/format.md §11.6).
//!
//! A step's group blocks follow its last payload (§11.1), so they cannot be
//! written before the step ends. Sorting and encoding them all then made
//! the writer's longest pause: a 4,096-token prefill's 1.1 M entries took
//! 0.7 s, which the first decode step waited for. Most records of a group
//! arrive in tree order already — positions ascending, a position's records
//! together — so each group puts a (position, phase)'s records in path
//! order when the next one starts, and once a page's records are final
//! ([`GroupPages::entries`] does not depend on the group's length for a
//! full page) its page block is encoded, and its bytes kept in an unnamed
//! temporary file beside the trace. The step's end copies them to their
//! place and encodes the rest. A group whose records arrive out of tree
//! order is sorted at the step's end as before. Either way the file's bytes
//! are the same: only when the work is done differs.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use moeconf_fingerprint::group_pages::GroupPages;
use moeconf_fingerprint::{group_prefix, Digest, Level, Phase};

use crate::layout::IndexEntry;
use crate::v2::{block_digest, encode_page_block};
use crate::writer::tree_key;
use moeconf_fingerprint::Algorithm;

/// More distinct (level, layer) groups than this in one step and the step
/// is ordered at its end as a whole (an imported trace may use any layer
/// numbers; the runtime's steps hold a few dozen groups).
const MAX_GROUPS: usize = 4096;

/// A page block encoded before its step ended, held in the temporary file.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spilled {
    /// Where its bytes start in the temporary file, and how many.
    at: u64,
    pub(crate) len: u64,
    /// Its block digest.
    pub(crate) digest: Digest,
    /// Its page's chaining value; page 0's depends on the group's record
    /// count (in the prefix) and is computed when the group ends.
    pub(crate) cv: Digest,
}

/// One group at the step's end: its members in tree order (indices into
/// the step's entries) and the page blocks already encoded (pages
/// `0..spilled.len()`).
pub(crate) struct EndedGroup {
    pub(crate) level: Level,
    pub(crate) layer: Option<u32>,
    pub(crate) members: Vec<usize>,
    pub(crate) spilled: Vec<Spilled>,
}

/// A group whose records have come in tree order so far.
struct Stream {
    /// Members in tree order, final.
    placed: Vec<u32>,
    /// The records of the latest (position, phase), in arrival order.
    open: Vec<u32>,
    open_at: (u32, Phase),
    spilled: Vec<Spilled>,
    /// The group's page layout, long enough that no full page is cut
    /// short by the group's end (which records a full page holds does not
    /// depend on the group's length).
    layout: GroupPages,
}

enum Order {
    Stream(Stream),
    /// Members in arrival order, sorted at the step's end.
    Unordered(Vec<u32>),
}

struct Group {
    level: Level,
    layer: Option<u32>,
    order: Order,
}

/// The current step's groups.
pub(crate) struct StepGroups {
    /// Whether page blocks are encoded before the step ends.
    on: bool,
    alg: Algorithm,
    dir: PathBuf,
    groups: Vec<Group>,
    index: HashMap<(Level, Option<u32>), usize>,
    /// The last group a record went to.
    last: Option<usize>,
    /// Too many groups, or too many entries for 32-bit indices: the step is
    /// ordered at its end as a whole.
    given_up: bool,
    spill: Option<File>,
    spill_len: u64,
    /// The step and the write-order number of its first record.
    step: u32,
    base: u64,
    /// Page blocks encoded in the current step so far (tests).
    spilled_pages: u64,
}

impl StepGroups {
    /// Groups of a writer whose temporary file goes in `dir`; `on` only
    /// for paged groups (version 4 with BLAKE3).
    pub(crate) fn new(dir: &Path, alg: Algorithm, on: bool) -> StepGroups {
        StepGroups {
            on,
            alg,
            dir: dir.to_path_buf(),
            groups: Vec::new(),
            index: HashMap::new(),
            last: None,
            given_up: false,
            spill: None,
            spill_len: 0,
            step: 0,
            base: 0,
            spilled_pages: 0,
        }
    }

    /// Before the step's first record (switched off mid-step, the step
    /// would be ordered at its end as a whole).
    pub(crate) fn set_on(&mut self, on: bool) {
        self.on = on;
    }

    /// Takes entry `i` of the step (`entries[i]`, just appended; `base` is
    /// the write-order number of `entries[0]`).
    pub(crate) fn add(&mut self, entries: &[IndexEntry], i: usize, base: u64) {
        if !self.on || self.given_up {
            return;
        }
        let Ok(i32_) = u32::try_from(i) else {
            self.give_up();
            return;
        };
        let e = &entries[i];
        if self.groups.is_empty() {
            self.step = e.coord.step;
            self.base = base;
        }
        let key = (e.level, e.coord.layer);
        let g = match self
            .last
            .filter(|&g| (self.groups[g].level, self.groups[g].layer) == key)
        {
            Some(g) => g,
            None => match self.index.get(&key) {
                Some(&g) => g,
                None => {
                    let prefix_len = group_prefix(e.coord.step, key.0, key.1, 0).len() as u64;
                    let layout = GroupPages::new(prefix_len, 1 << 40);
                    let (Some(layout), true) = (layout, self.groups.len() < MAX_GROUPS) else {
                        self.give_up();
                        return;
                    };
                    self.groups.push(Group {
                        level: key.0,
                        layer: key.1,
                        order: Order::Stream(Stream {
                            placed: Vec::new(),
                            open: Vec::new(),
                            open_at: (e.coord.position, e.coord.phase),
                            spilled: Vec::new(),
                            layout,
                        }),
                    });
                    self.index.insert(key, self.groups.len() - 1);
                    self.groups.len() - 1
                }
            },
        };
        self.last = Some(g);
        let at = (e.coord.position, e.coord.phase);
        let group = &mut self.groups[g];
        let s = match &mut group.order {
            Order::Stream(s) => s,
            Order::Unordered(m) => {
                m.push(i32_);
                return;
            }
        };
        if at == s.open_at {
            s.open.push(i32_);
            return;
        }
        if at < s.open_at {
            // Out of tree order: sorted at the step's end.
            let mut m = std::mem::take(&mut s.placed);
            m.append(&mut s.open);
            m.push(i32_);
            group.order = Order::Unordered(m);
            return;
        }
        close_open(s, entries);
        s.open.push(i32_);
        s.open_at = at;
        let (level, layer) = (group.level, group.layer);
        if let Err(()) = self.spill_full_pages(g, level, layer, entries) {
            // The temporary file failed: this group is encoded at the end.
            if let Order::Stream(s) = &mut self.groups[g].order {
                let mut m = std::mem::take(&mut s.placed);
                m.append(&mut s.open);
                self.groups[g].order = Order::Unordered(m);
            }
        }
    }

    fn give_up(&mut self) {
        self.given_up = true;
        self.groups.clear();
        self.index.clear();
        self.last = None;
    }

    /// Encodes every page of group `g` whose records are all placed.
    fn spill_full_pages(
        &mut self,
        g: usize,
        level: Level,
        layer: Option<u32>,
        entries: &[IndexEntry],
    ) -> Result<(), ()> {
        let (step, base, alg) = (self.step, self.base, self.alg);
        loop {
            let Order::Stream(s) = &self.groups[g].order else {
                return Ok(());
            };
            let (j, layout) = (s.spilled.len() as u64, s.layout);
            let r = layout.entries(j);
            if (s.placed.len() as u64) < r.end {
                return Ok(());
            }
            let part = &s.placed[r.start as usize..r.end as usize];
            let digests: Vec<Digest> = part.iter().map(|&m| entries[m as usize].digest).collect();
            let cv = if j == 0 {
                Digest::ZERO
            } else {
                // Only page 0 reads the prefix; the length is what is checked.
                let prefix = group_prefix(step, level, layer, 0);
                layout.cv(j, &prefix, &digests).ok_or(())?
            };
            let bytes = encode_page_block(
                step,
                level,
                layer,
                j as u32,
                part.iter().map(|&m| (base + u64::from(m), &entries[m as usize])),
            );
            let digest = block_digest(alg, &bytes);
            let at = self.spill_len;
            self.spill_file()?.write_all_at(&bytes, at).map_err(|_| ())?;
            self.spill_len += bytes.len() as u64;
            self.spilled_pages += 1;
            if let Order::Stream(s) = &mut self.groups[g].order {
                s.spilled.push(Spilled {
                    at,
                    len: bytes.len() as u64,
                    digest,
                    cv,
                });
            }
        }
    }

    fn spill_file(&mut self) -> Result<&File, ()> {
        if self.spill.is_none() {
            self.spill = Some(tempfile::tempfile_in(&self.dir).map_err(|_| ())?);
        }
        self.spill.as_ref().ok_or(())
    }

    /// The temporary file and where a spilled page block's bytes lie in it.
    pub(crate) fn source(&self, s: &Spilled) -> std::io::Result<(&File, u64)> {
        let f = self
            .spill
            .as_ref()
            .ok_or_else(|| std::io::Error::other("no temporary file"))?;
        Ok((f, s.at))
    }

    /// The step's groups in tree order (level, then layer with none first),
    /// each with its members in tree order; `None` when the step is to be
    /// ordered as a whole. Call [`StepGroups::clear`] after using them.
    pub(crate) fn end_step(&mut self, entries: &[IndexEntry]) -> Option<Vec<EndedGroup>> {
        if !self.on || self.given_up {
            return None;
        }
        let mut out: Vec<EndedGroup> = std::mem::take(&mut self.groups)
            .into_iter()
            .map(|g| {
                let (members, spilled) = match g.order {
                    Order::Stream(mut s) => {
                        close_open(&mut s, entries);
                        (s.placed, s.spilled)
                    }
                    Order::Unordered(mut m) => {
                        m.sort_unstable_by(|&a, &b| {
                            tree_key(&entries[a as usize]).cmp(&tree_key(&entries[b as usize]))
                        });
                        (m, Vec::new())
                    }
                };
                EndedGroup {
                    level: g.level,
                    layer: g.layer,
                    members: members.into_iter().map(|m| m as usize).collect(),
                    spilled,
                }
            })
            .collect();
        out.sort_unstable_by_key(|g| (g.level, g.layer));
        Some(out)
    }

    /// Forgets the step: its groups, and the temporary file's bytes.
    pub(crate) fn clear(&mut self) {
        self.groups.clear();
        self.index.clear();
        self.last = None;
        self.given_up = false;
        if self.spill_len > 0 {
            if let Some(f) = &self.spill {
                if f.set_len(0).is_err() {
                    // Start a new file rather than keep a long one.
                    self.spill = None;
                }
            }
        }
        self.spill_len = 0;
        self.spilled_pages = 0;
    }

    /// Page blocks encoded early in the current step so far.
    #[cfg(test)]
    pub(crate) fn spilled_pages(&self) -> u64 {
        self.spilled_pages
    }
}

/// Puts the open (position, phase)'s records in tree order (their paths'
/// order) after the placed ones.
fn close_open(s: &mut Stream, entries: &[IndexEntry]) {
    s.open
        .sort_unstable_by(|&a, &b| tree_key(&entries[a as usize]).cmp(&tree_key(&entries[b as usize])));
    s.placed.append(&mut s.open);
}
