//! Version 4's paged groups (docs/format.md §11.9): a group whose digest
//! preimage is longer than one page is stored as page blocks under a page
//! table. The table is read and checked on the group's first use (its
//! pages' chaining values merge to the group digest); a page is read and
//! checked on its own first use (its records hash to its chaining value),
//! so a comparison reads only the pages whose values differ.

use super::{lock, tree_key, Site, Store, Trace};
use crate::layout::{IndexEntry, PAYLOAD_ALIGN};
use crate::nodes::{Fault, GroupContent, GroupNode, Paged};
use crate::v2::{decode_group_block, decode_page_block, is_paged_format, BlockRef, GroupEntry, PageRef};
use moeconf_fingerprint::group_pages::GroupPages;
use moeconf_fingerprint::{group_prefix, Algorithm, Digest, Interner};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

impl Store {
    /// The page layout of group `g` when the file stores it paged: format
    /// version 4, BLAKE3, and a preimage longer than one page for the
    /// record count its step block gives (not committed by itself, but it
    /// is part of the preimage: a false count makes the pages' values not
    /// merge to the group digest).
    pub(super) fn paged_layout(&self, t: &Trace, g: &GroupNode) -> Option<GroupPages> {
        if !is_paged_format(t.version) || t.alg != Algorithm::Blake3 {
            return None;
        }
        let prefix = group_prefix(0, g.at.level, g.layer, g.records).len() as u64;
        GroupPages::new(prefix, g.records).filter(GroupPages::is_paged)
    }

    /// Checks a paged group's page table (`pages`, from its verified group
    /// block): one page per page of the layout, each page block 64-aligned,
    /// after the previous group's block and before its own, in page order
    /// without overlap; and the pages' chaining values merge to the group
    /// digest of the step block.
    pub(super) fn table(
        &self,
        g: &GroupNode,
        site: &Site<'_>,
        layout: GroupPages,
        pages: Vec<PageRef>,
    ) -> Result<Paged, Fault> {
        let at = site.block.offset;
        let fail = |m: String| Fault::new(at, format!("{}: {m}", site.name));
        if pages.len() as u64 != layout.count() {
            return Err(fail(format!(
                "has {} pages, a group of {} records has {}",
                pages.len(),
                g.records,
                layout.count()
            )));
        }
        // The previous group's block (or the step's part) bounds the pages.
        let mut cursor = match g.at.block.checked_sub(1) {
            Some(b) => site
                .node
                .blocks
                .get(b as usize)
                .and_then(BlockRef::end)
                .unwrap_or(u64::MAX),
            None => self.regions[site.k],
        };
        for (j, p) in pages.iter().enumerate() {
            let end = p.block.end();
            if !p.block.offset.is_multiple_of(PAYLOAD_ALIGN)
                || p.block.offset < cursor
                || end.is_none_or(|e| e > site.block.offset)
            {
                return Err(fail(format!(
                    "page {j}'s block at {} (+{}) is misaligned, out of order or not between the previous \
                     group's block and this one",
                    p.block.offset, p.block.len
                )));
            }
            cursor = end.unwrap_or(u64::MAX);
        }
        let cvs: Vec<Digest> = pages.iter().map(|p| p.cv).collect();
        if layout.digest(&cvs) != Some(g.digest) {
            return Err(fail(
                "its pages' chaining values do not merge to the group digest in its step block (a false \
                 record count or a corrupted page table)"
                    .into(),
            ));
        }
        let step = site.step.step;
        Ok(Paged {
            layout,
            prefix: group_prefix(step, g.at.level, g.layer, g.records),
            cvs: cvs.into_boxed_slice(),
            blocks: pages.iter().map(|p| p.block).collect(),
            pages: (0..pages.len()).map(|_| OnceLock::new()).collect(),
            settled: (0..pages.len()).map(|_| Default::default()).collect(),
        })
    }

    /// Reads and checks page `j` of a paged group: its block's digest
    /// against the table, that it names the group and the page, that it
    /// holds exactly the records the layout puts in the page, every record
    /// as a group block's, and that their digests hash to the page's
    /// chaining value.
    fn read_page(
        &self,
        t: &Trace,
        g: &GroupNode,
        site: &Site<'_>,
        paged: &Paged,
        j: usize,
        interner: &mut Interner,
    ) -> Result<Vec<GroupEntry>, Fault> {
        let block = *paged
            .blocks
            .get(j)
            .ok_or_else(|| Fault::new(site.block.offset, format!("{}: no page {j}", site.name)))?;
        let name = format!("{} page {j}", site.name);
        let bytes = self.block(t, block, &name)?;
        self.pages_read.fetch_add(1, Ordering::Relaxed);
        let decoded = decode_page_block(bytes, block.offset, interner)
            .map_err(|e| Fault::new(e.offset, format!("{name}: {}", e.what)))?;
        let fail = |m: String| Fault::new(block.offset, format!("{name}: {m}"));
        if (decoded.step, decoded.level, decoded.layer, decoded.page as usize)
            != (site.step.step, g.at.level, g.layer, j)
        {
            return Err(fail(format!(
                "says it holds step {} level {} layer {:?} page {}",
                decoded.step, decoded.level, decoded.layer, decoded.page
            )));
        }
        let range = paged.layout.entries(j as u64);
        if decoded.entries.len() as u64 != range.end - range.start {
            return Err(fail(format!(
                "holds {} records, the group's layout puts {} in it (records {}..{})",
                decoded.entries.len(),
                range.end - range.start,
                range.start,
                range.end
            )));
        }
        self.check_entries(t, site, &decoded.entries)
            .map_err(|f| Fault::new(f.offset, format!("{} (page {j})", f.what)))?;
        let digests: Vec<Digest> = decoded.entries.iter().map(|e| e.entry.digest).collect();
        if paged.layout.cv(j as u64, &paged.prefix, &digests) != paged.cvs.get(j).copied() {
            return Err(fail(
                "its records do not hash to the page's chaining value in the group's page table (a \
                 corrupted or shifted page)"
                    .into(),
            ));
        }
        Ok(decoded.entries)
    }

    /// Every record of a paged group, from every page: each page checked as
    /// [`Store::read_page`] checks it, a record two pages share identical
    /// in both, and the whole in strictly ascending canonical order.
    pub(super) fn read_all_pages(
        &self,
        t: &Trace,
        g: &GroupNode,
        site: &Site<'_>,
        paged: &Paged,
        interner: &mut Interner,
    ) -> Result<Vec<GroupEntry>, Fault> {
        let declared = usize::try_from(g.records).unwrap_or(usize::MAX);
        // Bounded by the page blocks' sizes, whatever the count claims.
        let room = paged.blocks.iter().fold(0u64, |n, b| n.saturating_add(b.len)) / 32;
        let mut out: Vec<GroupEntry> = Vec::with_capacity(declared.min(room as usize));
        for j in 0..paged.blocks.len() {
            let entries = self.read_page(t, g, site, paged, j, interner)?;
            let shared =
                j > 0 && paged.layout.entries(j as u64 - 1).end > paged.layout.entries(j as u64).start;
            let mut it = entries.into_iter();
            if shared {
                if let Some(first) = it.next() {
                    check_shared(site, j, out.last(), &first)?;
                }
            }
            for e in it {
                check_after(site, j, out.last(), &e)?;
                out.push(e);
            }
        }
        if out.len() as u64 != g.records {
            return Err(Fault::new(
                site.block.offset,
                format!(
                    "{}: its pages hold {} records, its step says {}",
                    site.name,
                    out.len(),
                    g.records
                ),
            ));
        }
        Ok(out)
    }

    /// The verified page table of group `g`, read on first use; `None`
    /// when the group is not stored paged.
    pub(in crate::reader) fn paged<'t>(
        &self,
        t: &'t Trace,
        g: &'t GroupNode,
    ) -> Result<Option<&'t Paged>, Fault> {
        let Some(layout) = self.paged_layout(t, g) else {
            return Ok(None);
        };
        let r = g.paged.get_or_init(|| Box::new(self.read_table(t, g, layout)));
        r.as_ref().as_ref().map(Some).map_err(Fault::clone)
    }

    /// Reads and checks group `g`'s page table ([`Store::paged`]).
    fn read_table(&self, t: &Trace, g: &GroupNode, layout: GroupPages) -> Result<Paged, Fault> {
        {
            let site = self.site(t, g)?;
            let bytes = self.block(t, site.block, &site.name)?;
            let decoded = decode_group_block(bytes, site.block.offset, &mut lock(&self.interner), true)
                .map_err(|e| Fault::new(e.offset, format!("{}: {}", site.name, e.what)))?;
            if (decoded.step, decoded.level, decoded.layer) != (site.step.step, g.at.level, g.layer)
                || decoded.pages.is_empty()
            {
                return Err(Fault::new(
                    site.block.offset,
                    format!(
                        "{}: is not the page table of step {} level {} layer {:?} (a group of {} records is \
                         stored in {} pages in format version 4)",
                        site.name,
                        site.step.step,
                        g.at.level,
                        g.layer,
                        g.records,
                        layout.count()
                    ),
                ));
            }
            self.table(g, &site, layout, decoded.pages)
        }
    }

    /// Page `j` of a paged group, read and checked on first use.
    fn page<'t>(
        &self,
        t: &'t Trace,
        g: &'t GroupNode,
        paged: &'t Paged,
        j: usize,
    ) -> Result<&'t GroupContent, Fault> {
        let slot = paged
            .pages
            .get(j)
            .ok_or_else(|| Fault::new(0, format!("no page {j}")))?;
        let r = slot.get_or_init(|| {
            let site = self.site(t, g)?;
            let entries = self.read_page(t, g, &site, paged, j, &mut lock(&self.interner))?;
            let (ids, entries): (Vec<usize>, Vec<IndexEntry>) =
                entries.into_iter().map(|e| (e.ordinal as usize, e.entry)).unzip();
            Ok(GroupContent {
                ids: ids.into_boxed_slice(),
                entries: entries.into_boxed_slice(),
            })
        });
        r.as_ref().map_err(Fault::clone)
    }

    /// The pages of a paged group read so far, with the positions of their
    /// first and last records (what a look-up by position bisects with
    /// before it reads another page).
    pub(in crate::reader) fn loaded_positions(&self, g: &GroupNode) -> Vec<(u64, u32, u32)> {
        let Some(Ok(paged)) = g.paged.get().map(|b| b.as_ref()) else {
            return Vec::new();
        };
        paged
            .pages
            .iter()
            .enumerate()
            .filter_map(|(j, slot)| match slot.get() {
                Some(Ok(c)) => Some((
                    j as u64,
                    c.entries.first()?.coord.position,
                    c.entries.last()?.coord.position,
                )),
                _ => None,
            })
            .collect()
    }

    /// The records of pages `want` of a paged group (ids and entries), in
    /// canonical order, a record two of them share once. A page's records
    /// are used only when every byte of their digests is checked: a page
    /// whose first or last record straddles into a neighbouring page is
    /// read with that neighbour (the shared record must be identical in
    /// both). The records become reachable by id. From the group's whole
    /// content when that is loaded.
    pub(in crate::reader) fn page_entries<'t>(
        &self,
        t: &'t Trace,
        g: &'t GroupNode,
        want: &[u64],
    ) -> Result<Vec<(usize, &'t IndexEntry)>, Fault> {
        let Some(paged) = self.paged(t, g)? else {
            return Err(Fault::new(0, "the group is not stored paged"));
        };
        let n = paged.pages.len() as u64;
        let mut want: Vec<u64> = want.iter().copied().filter(|&j| j < n).collect();
        want.sort_unstable();
        want.dedup();
        let layout = paged.layout;
        if let Some(Ok(c)) = g.content.get() {
            let mut out = Vec::new();
            let mut next = 0u64;
            for &j in &want {
                let r = layout.entries(j);
                for k in r.start.max(next)..r.end {
                    if let (Some(&id), Some(e)) = (c.ids.get(k as usize), c.entries.get(k as usize)) {
                        out.push((id, e));
                    }
                }
                next = next.max(r.end);
            }
            return Ok(out);
        }
        let shares = |a: u64, b: u64| layout.entries(a).end > layout.entries(b).start;
        let mut needed: Vec<u64> = Vec::with_capacity(want.len() * 3);
        for &j in &want {
            if j > 0 && shares(j - 1, j) {
                needed.push(j - 1);
            }
            needed.push(j);
            if j + 1 < n && shares(j, j + 1) {
                needed.push(j + 1);
            }
        }
        needed.sort_unstable();
        needed.dedup();
        let site = self.site(t, g)?;
        let mut loaded: Vec<(u64, &GroupContent)> = Vec::with_capacity(needed.len());
        for &j in &needed {
            loaded.push((j, self.page(t, g, paged, j as usize)?));
        }
        for w in loaded.windows(2) {
            let ((a, pa), (b, pb)) = (w[0], w[1]);
            if b != a + 1 {
                continue;
            }
            let last = pa.ids.last().zip(pa.entries.last());
            let first = pb.ids.first().zip(pb.entries.first());
            if let (Some((ia, ea)), Some((ib, eb))) = (last, first) {
                if shares(a, b) {
                    if ia != ib || ea != eb {
                        return Err(shared_fault(&site, b as usize, &ea.coord.to_string()));
                    }
                } else if tree_key(ea) >= tree_key(eb) {
                    return Err(order_fault(&site, b as usize, eb, ea));
                }
            }
        }
        let mut out: Vec<(usize, &IndexEntry)> = Vec::new();
        let mut next = 0u64;
        for (j, c) in loaded.iter().filter(|(j, _)| want.binary_search(j).is_ok()) {
            // A page settled by an earlier read (registered, and its records
            // found in ascending order) is not checked again record by
            // record: a look-up by position probes the same pages many times.
            let settled = paged
                .settled
                .get(*j as usize)
                .is_some_and(|f| f.load(Ordering::Acquire));
            if !settled {
                self.register(t, g, *j as u32, &c.ids, &c.entries)?;
            }
            let r = layout.entries(*j);
            // Skip the record shared with the previous wanted page.
            let skip = next.saturating_sub(r.start) as usize;
            for (n, (&id, e)) in c.ids.iter().zip(c.entries.iter()).skip(skip).enumerate() {
                if let Some((_, p)) = out.last() {
                    if (!settled || n == 0) && tree_key(p) >= tree_key(e) {
                        return Err(order_fault(&site, *j as usize, e, p));
                    }
                }
                out.push((id, e));
            }
            if !settled {
                if let Some(f) = paged.settled.get(*j as usize) {
                    f.store(true, Ordering::Release);
                }
            }
            next = next.max(r.end);
        }
        Ok(out)
    }
}

/// A record that page `j` shares with page `j − 1` must be the one the
/// previous page ended with.
fn check_shared(
    site: &Site<'_>,
    j: usize,
    previous: Option<&GroupEntry>,
    first: &GroupEntry,
) -> Result<(), Fault> {
    match previous {
        Some(p) if p.ordinal == first.ordinal && p.entry == first.entry => Ok(()),
        _ => Err(shared_fault(site, j, &first.entry.coord.to_string())),
    }
}

/// A record after `previous` (the last record of the pages before) in
/// canonical order.
fn check_after(
    site: &Site<'_>,
    j: usize,
    previous: Option<&GroupEntry>,
    e: &GroupEntry,
) -> Result<(), Fault> {
    match previous {
        Some(p) if tree_key(&p.entry) >= tree_key(&e.entry) => Err(order_fault(site, j, &e.entry, &p.entry)),
        _ => Ok(()),
    }
}

fn shared_fault(site: &Site<'_>, j: usize, coord: &str) -> Fault {
    Fault::new(
        site.block.offset,
        format!(
            "{}: record {coord}, which pages {} and {j} share, differs between them",
            site.name,
            j.saturating_sub(1)
        ),
    )
}

fn order_fault(site: &Site<'_>, j: usize, e: &IndexEntry, after: &IndexEntry) -> Fault {
    Fault::new(
        site.block.offset,
        format!(
            "{} page {j}: record {}: not in canonical order (or a duplicate) after {}",
            site.name, e.coord, after.coord
        ),
    )
}
