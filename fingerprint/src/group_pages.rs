//! A layer group's digest preimage cut into pages (trace format version 4,
//! docs/format.md §11.9).
//!
//! The group digest (§4.3) is `H(prefix ‖ d_0 ‖ … ‖ d_{n−1})`: a short
//! prefix ([`crate::group_prefix`]: domain tag, step, level, layer, record
//! count) then the 32-byte record digests. With BLAKE3, `H` is a tree hash,
//! so the preimage cut into aligned pages of [`PAGE_BYTES`] (a power of two
//! of BLAKE3 chunks) has one chaining value per page, and the page values
//! merge along BLAKE3's tree to the group digest
//! ([`crate::blake3_tree::root_from_block_cvs`]). A reader that holds the
//! page values (checked to merge to the group digest) can check one page's
//! record digests against its value without reading the others.
//!
//! Page `j` covers bytes `[j·S, min((j+1)·S, len))` of the preimage; it
//! holds the records whose digest bytes overlap that range, so a record
//! whose digest straddles a page boundary belongs to both pages
//! ([`GroupPages::entries`]). Which records a page holds is computed from
//! the prefix length, the record count and `S`: nothing stored says it.

use crate::algorithm::Digest;
use crate::blake3_tree::{block_cv, root_from_block_cvs};
use std::ops::Range;

/// Bytes of preimage per page: 128 BLAKE3 chunks (128 KiB), about 4,096
/// record digests.
pub const PAGE_BYTES: u64 = 128 * 1024;

/// The page layout of one group's preimage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPages {
    prefix_len: u64,
    records: u64,
    total: u64,
}

impl GroupPages {
    /// The layout of a group of `records` records whose prefix is
    /// `prefix_len` bytes; `None` when the preimage's length overflows.
    pub fn new(prefix_len: u64, records: u64) -> Option<GroupPages> {
        let total = records.checked_mul(32)?.checked_add(prefix_len)?;
        Some(GroupPages {
            prefix_len,
            records,
            total,
        })
    }

    /// The preimage's length in bytes.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The number of records.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Whether the preimage is longer than one page (only such a group is
    /// stored paged).
    pub fn is_paged(&self) -> bool {
        self.total > PAGE_BYTES
    }

    /// The number of pages.
    pub fn count(&self) -> u64 {
        self.total.div_ceil(PAGE_BYTES)
    }

    /// The preimage bytes of page `j`.
    pub fn bytes(&self, j: u64) -> Range<u64> {
        let a = j.saturating_mul(PAGE_BYTES).min(self.total);
        a..a.saturating_add(PAGE_BYTES).min(self.total)
    }

    /// The records (indices in canonical order) whose digest bytes overlap
    /// page `j`: a record straddling a page boundary is in both pages.
    pub fn entries(&self, j: u64) -> Range<u64> {
        let r = self.bytes(j);
        let p = self.prefix_len;
        let first = r.start.saturating_sub(p) / 32;
        let last = r.end.saturating_sub(p).div_ceil(32).min(self.records);
        first.min(last)..last
    }

    /// The chaining value of page `j` from the prefix (used by page 0
    /// only) and the record digests of [`GroupPages::entries`]`(j)`, in
    /// order. `None` when `digests` are not exactly that many.
    pub fn cv(&self, j: u64, prefix: &[u8], digests: &[Digest]) -> Option<Digest> {
        let r = self.bytes(j);
        let e = self.entries(j);
        if digests.len() as u64 != e.end - e.start || prefix.len() as u64 != self.prefix_len {
            return None;
        }
        let p = self.prefix_len;
        let head: &[u8] = if r.start < p {
            prefix.get(r.start as usize..r.end.min(p) as usize)?
        } else {
            &[]
        };
        let mut body = Vec::with_capacity(digests.len() * 32);
        for d in digests {
            body.extend_from_slice(&d.0);
        }
        // The digest bytes of the page: from the page's start (or the end
        // of the prefix) to its end, relative to the first record's bytes.
        let from = r.start.max(p) - p - 32 * e.start;
        let to = r.end.saturating_sub(p).saturating_sub(32 * e.start);
        let tail = body.get(from as usize..to.max(from) as usize)?;
        Some(Digest(block_cv(r.start, &[head, tail])))
    }

    /// The group digest from every page's chaining value; `None` when the
    /// group is not paged or the values are not one per page.
    pub fn digest(&self, cvs: &[Digest]) -> Option<Digest> {
        if !self.is_paged() {
            return None;
        }
        let raw: Vec<[u8; 32]> = cvs.iter().map(|d| d.0).collect();
        root_from_block_cvs(&raw, PAGE_BYTES, self.total).map(|h| Digest(*h.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{group_digest, group_prefix, Algorithm, Level};

    /// The reader bounds a differing page's records by the record it
    /// shares with each neighbour (schema's `page_entries`: a page is read
    /// with the neighbours its edge records straddle into, and records used
    /// together must be in canonical order). That holds because every page
    /// boundary falls inside a record digest: the group preimage's head is
    /// never a multiple of 32 bytes long. A format change that made it one
    /// must also read non-sharing neighbours.
    #[test]
    fn every_page_boundary_falls_inside_a_record_digest() {
        for layer in [None, Some(0), Some(u32::MAX)] {
            for n in [4096u64, 8193, 100_000] {
                let prefix = group_prefix(u32::MAX, Level::L4, layer, n);
                assert_ne!(prefix.len() % 32, 0, "layer {layer:?}");
                let g = GroupPages::new(prefix.len() as u64, n).unwrap();
                assert!(g.is_paged(), "{n} records");
                for j in 1..g.count() {
                    assert!(
                        g.entries(j - 1).end > g.entries(j).start,
                        "pages {} and {j} of {n} records share no record",
                        j - 1
                    );
                }
            }
        }
    }

    #[test]
    fn pages_merge_to_the_group_digest_and_cover_every_record() {
        for (layer, n) in [(None, 4096u64), (Some(3), 4095), (Some(7), 9000), (None, 12289)] {
            let digests: Vec<Digest> = (0..n).map(|i| Algorithm::Blake3.hash(&i.to_le_bytes())).collect();
            let prefix = group_prefix(2, Level::L4, layer, n);
            let g = GroupPages::new(prefix.len() as u64, n).unwrap();
            let want = group_digest(Algorithm::Blake3, 2, Level::L4, layer, digests.iter().copied());
            if !g.is_paged() {
                assert_eq!(g.digest(&[]), None);
                continue;
            }
            let mut covered = 0;
            let cvs: Vec<Digest> = (0..g.count())
                .map(|j| {
                    let e = g.entries(j);
                    // Consecutive pages share at most the straddling record.
                    assert!(e.start == covered || e.start + 1 == covered, "page {j}");
                    covered = e.end;
                    g.cv(j, &prefix, &digests[e.start as usize..e.end as usize])
                        .unwrap()
                })
                .collect();
            assert_eq!(covered, n);
            assert_eq!(g.digest(&cvs), Some(want), "layer {layer:?} n {n}");
            // A page value from the wrong records does not merge.
            let mut bad = cvs.clone();
            let e = g.entries(1);
            bad[1] = g
                .cv(1, &prefix, &digests[e.start as usize - 1..e.end as usize - 1])
                .unwrap();
            assert_ne!(g.digest(&bad), Some(want));
        }
    }
}
