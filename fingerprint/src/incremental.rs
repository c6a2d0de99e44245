//! BLAKE3 of a buffer that changes a little between digests: the digest of
//! persistent state that grows with the context (compressed KV entries are
//! appended, rarely rewritten) at a cost proportional to what changed.
//!
//! The value is exactly `blake3::hash(data)`: the buffer is cut into blocks
//! of a power-of-two number of BLAKE3 chunks, each block's chaining value is
//! kept, and the root is rebuilt by merging them along BLAKE3's own tree
//! (`blake3::hazmat`: every left subtree is the largest power of two of
//! bytes strictly smaller than its parent). After a change only the blocks
//! it touches (and the partial last block) are hashed again; merging the
//! cached values costs one compression per block, about 0.1 µs.
//!
//! What the cache cannot see is a write it was not told about. A caller
//! reports the byte ranges it rewrote ([`IncrementalBlake3::digest`]'s
//! `rewritten`); a bug that rewrites old bytes without reporting them would
//! leave a stale block value. [`IncrementalBlake3::verify_next`] re-hashes a
//! few cached blocks per call, round robin, and [`IncrementalBlake3::verify_all`]
//! all of them: an unreported rewrite that lasts is found within one sweep
//! or at the end of a run; one undone before the sweep reaches its block is
//! not seen (the digests in between are of the bytes before it).
//!
//! Independent check: the tests compare every digest with `blake3::hash` of
//! the same bytes, over random sizes, appends, rewrites and truncations.

use blake3::hazmat::{left_subtree_len, merge_subtrees_non_root, merge_subtrees_root, HasherExt, Mode};
use blake3::{Hasher, CHUNK_LEN};
use std::collections::HashMap;
use std::ops::Range;

/// Default block: 16 BLAKE3 chunks (16 KiB), what BLAKE3's widest SIMD path
/// (AVX-512, 16 chunks at once) needs to run at full speed; small enough that
/// the fixed cost of a digest (the prefix's block, the last block, one
/// verified block) stays below a few tens of KiB.
pub const DEFAULT_BLOCK: usize = 16 * CHUNK_LEN;

/// A cached block value that no longer matches its bytes (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bytes {start}..{end} changed without being reported as rewritten (block {block})")]
pub struct StaleBlock {
    pub block: usize,
    pub start: usize,
    pub end: usize,
}

/// The BLAKE3 digest of one buffer across its changes.
#[derive(Debug, Clone)]
pub struct IncrementalBlake3 {
    block: usize,
    /// Chaining value of each block of the last digested buffer (the last
    /// one may be partial).
    cvs: Vec<[u8; 32]>,
    /// Length of the last digested stream.
    len: usize,
    /// Next block [`Self::verify_next`] checks.
    cursor: usize,
    /// Length of the prefix of the last stream.
    prefix_len: usize,
    /// Bytes hashed by the last [`Self::digest`] (for cost accounting and tests).
    last_hashed: usize,
    /// Chunk values of the first block (a changing prefix re-hashes only
    /// the chunks it covers) and of the last one (an append re-hashes only
    /// the chunks it touches).
    head: BlockChunks,
    tail: BlockChunks,
    /// Chaining values of complete power-of-two subtrees of whole blocks
    /// that neither hold the first block (the prefix changes at every
    /// digest) nor reach past the last complete one, keyed by (offset,
    /// length): they do not change when bytes are appended, so the root of
    /// a grown stream merges O(log blocks) values instead of one per block.
    /// Cleared whenever a block inside one may have changed (a reported
    /// rewrite, a truncation, a new prefix length).
    subtrees: HashMap<(usize, usize), [u8; 32]>,
    /// Chaining values of the other subtrees that do not hold the first
    /// block (those reaching the stream's end), kept only while every block
    /// after the first has the value it had (same length, no rewrite): a
    /// digest whose only change is the prefix then merges just the first
    /// block's path to the root.
    volatile: HashMap<(usize, usize), [u8; 32]>,
}

/// The chaining values of the chunks of one block, as last hashed.
#[derive(Debug, Clone, Default)]
struct BlockChunks {
    /// Which block (`None`: nothing cached).
    block: Option<usize>,
    /// Bytes of the block the values covered (its complete chunks are reusable).
    len: usize,
    cvs: Vec<[u8; 32]>,
    /// The block's chaining value merged from `cvs`: reused whole when no
    /// byte of the block may have changed.
    value: [u8; 32],
    /// Chaining values of subtrees of whole chunks, keyed by (first chunk,
    /// chunks), merged from chunk values none of which has been hashed
    /// again since: a digest that re-hashes one chunk merges O(log chunks).
    merged: HashMap<(usize, usize), [u8; 32]>,
}

impl Default for IncrementalBlake3 {
    fn default() -> Self {
        IncrementalBlake3::new(DEFAULT_BLOCK)
    }
}

impl IncrementalBlake3 {
    /// A digest with blocks of `block` bytes: a power-of-two multiple of
    /// [`CHUNK_LEN`] (anything else is rounded up to the next one).
    pub fn new(block: usize) -> IncrementalBlake3 {
        let block = block.max(CHUNK_LEN).next_power_of_two();
        IncrementalBlake3 {
            block,
            cvs: Vec::new(),
            len: 0,
            cursor: 0,
            prefix_len: 0,
            last_hashed: 0,
            head: BlockChunks::default(),
            tail: BlockChunks::default(),
            subtrees: HashMap::new(),
            volatile: HashMap::new(),
        }
    }

    /// Bytes hashed by the last [`Self::digest`] call.
    pub fn last_hashed(&self) -> usize {
        self.last_hashed
    }

    /// The chaining value of block `i` of the stream `s` (non-root).
    fn block_cv(&self, s: Stream<'_>, i: usize) -> [u8; 32] {
        let start = i * self.block;
        let end = (start + self.block).min(s.len());
        let mut h = Hasher::new();
        h.set_input_offset(start as u64);
        s.feed(&mut h, start..end);
        h.finalize_non_root()
    }

    /// Block `i` of the stream from chunk values: the cached chunks of
    /// `cache` (when it holds block `i`) that were complete, are complete
    /// now and meet none of the `changed` byte ranges are reused, the others
    /// hashed; `cache` then holds block `i`'s chunks. Adds the bytes hashed
    /// to `last_hashed`.
    fn block_cv_chunked(
        s: Stream<'_>,
        block: usize,
        i: usize,
        cache: &mut BlockChunks,
        changed: &[Range<usize>],
        last_hashed: &mut usize,
    ) -> [u8; 32] {
        let start = i * block;
        let end = (start + block).min(s.len());
        let len = end - start;
        let same = cache.block == Some(i);
        let untouched = |r: &Range<usize>| r.is_empty() || r.end <= start || end <= r.start;
        if same && len == cache.len && !cache.cvs.is_empty() && changed.iter().all(untouched) {
            return cache.value;
        }
        let mut merged = if same {
            std::mem::take(&mut cache.merged)
        } else {
            HashMap::new()
        };
        let cvs = Self::chunk_values(
            s,
            start,
            end,
            0,
            same.then_some(&*cache),
            changed,
            &mut merged,
            last_hashed,
        );
        let cv = merge_chunks_memo(&cvs, 0, len, &mut merged);
        *cache = BlockChunks {
            block: Some(i),
            len,
            cvs,
            value: cv,
            merged,
        };
        cv
    }

    /// The chunk values of the block of bytes `start..end` of the stream:
    /// those of `cached` (the same block's, as last hashed) that were
    /// complete, are complete now and meet none of the `changed` ranges, the
    /// others hashed (adding to `last_hashed`, and dropping from `merged`
    /// every subtree holding them). The first `skip` chunks are left zero.
    #[allow(clippy::too_many_arguments)]
    fn chunk_values(
        s: Stream<'_>,
        start: usize,
        end: usize,
        skip: usize,
        cached: Option<&BlockChunks>,
        changed: &[Range<usize>],
        merged: &mut HashMap<(usize, usize), [u8; 32]>,
        last_hashed: &mut usize,
    ) -> Vec<[u8; 32]> {
        let chunks = (end - start).div_ceil(CHUNK_LEN);
        let mut cvs = vec![[0; 32]; skip.min(chunks)];
        for c in skip..chunks {
            let cs = start + c * CHUNK_LEN;
            let ce = (cs + CHUNK_LEN).min(end);
            let reuse = cached.filter(|cache| {
                ce - cs == CHUNK_LEN
                    && (c + 1) * CHUNK_LEN <= cache.len
                    && c < cache.cvs.len()
                    && changed.iter().all(|r| r.end <= cs || ce <= r.start)
            });
            match reuse {
                Some(cache) => cvs.push(cache.cvs[c]),
                None => {
                    let mut h = Hasher::new();
                    h.set_input_offset(cs as u64);
                    s.feed(&mut h, cs..ce);
                    cvs.push(h.finalize_non_root());
                    *last_hashed += ce - cs;
                    merged.retain(|&(first, n), _| c < first || first + n <= c);
                }
            }
        }
        cvs
    }

    /// `blake3::hash(data)`, re-hashing only the blocks that differ from the
    /// last call's buffer: those past the last call's complete blocks
    /// (appended bytes, and a last block that was partial) and those
    /// overlapping `rewritten` (byte ranges of `data` written since the last
    /// call). A buffer shorter than the last one is a truncation.
    pub fn digest(&mut self, data: &[u8], rewritten: &[Range<usize>]) -> blake3::Hash {
        self.digest_stream(&[], data, rewritten)
    }

    /// `blake3::hash(prefix ‖ data)` (a record's preimage: its header, then
    /// its bytes), as [`Self::digest`] with `rewritten` in `data`'s
    /// coordinates. The prefix may change between calls (its block is always
    /// hashed again); a prefix of another length than the last call's starts
    /// over.
    pub fn digest_stream(&mut self, prefix: &[u8], data: &[u8], rewritten: &[Range<usize>]) -> blake3::Hash {
        self.update(prefix, data, rewritten)
    }

    fn update(&mut self, prefix: &[u8], data: &[u8], rewritten: &[Range<usize>]) -> blake3::Hash {
        let s = Stream { prefix, data };
        if prefix.len() != self.prefix_len {
            self.cvs.clear();
            self.len = 0;
            self.prefix_len = prefix.len();
            self.head = BlockChunks::default();
            self.tail = BlockChunks::default();
            self.subtrees.clear();
            self.volatile.clear();
        }
        let b = self.block;
        let total = s.len();
        let n = total.div_ceil(b);
        // Blocks from the first one that was partial (or did not exist) in
        // the last stream, or from the end of a truncated stream, change.
        let keep = (self.len / b).min(total / b).min(self.cvs.len());
        // The values this call recomputes (at most the old partial block
        // when the length is unchanged), to tell whether any block after
        // the first changed.
        let dropped = (self.cvs.len() - keep, self.cvs.get(keep).copied());
        let same_len = total == self.len;
        self.cvs.truncate(keep);
        self.last_hashed = 0;
        let p = prefix.len();
        // Every byte range that may differ from the last stream: the
        // prefix, the reported rewrites, and what was appended or cut.
        let mut changed: Vec<Range<usize>> = Vec::with_capacity(rewritten.len() + 2);
        changed.push(0..p);
        changed.extend(rewritten.iter().map(|r| r.start + p..r.end + p));
        changed.push(self.len.min(total)..self.len.max(total));
        let mut stale = vec![false; keep];
        for r in &changed[..changed.len() - 1] {
            let end = r.end.min(total);
            if r.start < end {
                for flag in stale.iter_mut().take(end.div_ceil(b)).skip(r.start / b) {
                    *flag = true;
                }
            }
        }
        // A truncation or a rewritten block may change a remembered subtree.
        if total < self.len || stale.iter().skip(1).any(|&x| x) {
            self.subtrees.clear();
        }
        for (i, _) in stale.iter().enumerate().filter(|(_, &x)| x) {
            self.cvs[i] = self.cv_of(s, i, n, &changed);
        }
        for i in keep..n {
            let cv = self.cv_of(s, i, n, &changed);
            self.cvs.push(cv);
        }
        let after_first_unchanged = same_len
            && rewritten.iter().all(|r| r.is_empty())
            && match dropped {
                (0, _) => n == keep,
                (1, old) => n == keep + 1 && (keep == 0 || self.cvs.get(keep).copied() == old),
                _ => false,
            };
        if !after_first_unchanged {
            self.volatile.clear();
        }
        self.len = total;
        if self.cursor >= n {
            self.cursor = 0;
        }
        self.root(s)
    }

    /// The value of block `i` of `n`: the first and the last block through
    /// their chunk caches, any other hashed whole.
    fn cv_of(&mut self, s: Stream<'_>, i: usize, n: usize, changed: &[Range<usize>]) -> [u8; 32] {
        let b = self.block;
        if i == 0 {
            Self::block_cv_chunked(s, b, i, &mut self.head, changed, &mut self.last_hashed)
        } else if i + 1 == n {
            Self::block_cv_chunked(s, b, i, &mut self.tail, changed, &mut self.last_hashed)
        } else {
            // A block the tail cache held may now be complete: reuse its chunks.
            if self.tail.block == Some(i) {
                return Self::block_cv_chunked(s, b, i, &mut self.tail, changed, &mut self.last_hashed);
            }
            self.last_hashed += (s.len() - i * b).min(b);
            self.block_cv(s, i)
        }
    }

    /// The root from the cached block values (the stream itself only when it
    /// is at most one block, whose root is its plain hash).
    fn root(&mut self, s: Stream<'_>) -> blake3::Hash {
        let total = s.len();
        if total <= self.block {
            let mut h = Hasher::new();
            s.feed(&mut h, 0..total);
            return h.finalize();
        }
        let left = left_subtree_len(total as u64) as usize;
        merge_subtrees_root(
            &self.subtree(0, left),
            &self.subtree(left, total - left),
            Mode::Hash,
        )
    }

    /// Chaining value of the subtree of `len` bytes at `offset` (a multiple
    /// of the block size; BLAKE3's splits above one block fall on block
    /// boundaries because the block is a power of two of chunks).
    /// Subtrees of whole complete blocks after the first are remembered
    /// (`subtrees`); the stream's length is `self.len`.
    fn subtree(&mut self, offset: usize, len: usize) -> [u8; 32] {
        if len <= self.block {
            return self.cvs[offset / self.block];
        }
        let after_first = offset >= self.block;
        let stable = after_first && offset + len <= self.len / self.block * self.block;
        if after_first {
            let memo = if stable { &self.subtrees } else { &self.volatile };
            if let Some(cv) = memo.get(&(offset, len)) {
                return *cv;
            }
        }
        let left = left_subtree_len(len as u64) as usize;
        let l = self.subtree(offset, left);
        let r = self.subtree(offset + left, len - left);
        let cv = merge_subtrees_non_root(&l, &r, Mode::Hash);
        if stable {
            self.subtrees.insert((offset, len), cv);
        } else if after_first {
            self.volatile.insert((offset, len), cv);
        }
        cv
    }

    /// Re-hashes up to `blocks` cached blocks of `data` (the buffer of the
    /// last [`Self::digest`]), continuing where the last call stopped.
    pub fn verify_next(&mut self, data: &[u8], blocks: usize) -> Result<(), StaleBlock> {
        self.verify_next_stream(&[], data, blocks)
    }

    /// [`Self::verify_next`] of the stream `prefix ‖ data` of the last
    /// [`Self::digest_stream`].
    pub fn verify_next_stream(
        &mut self,
        prefix: &[u8],
        data: &[u8],
        blocks: usize,
    ) -> Result<(), StaleBlock> {
        let s = Stream { prefix, data };
        if s.len() != self.len || prefix.len() != self.prefix_len || self.cvs.is_empty() {
            return self.verify_all_stream(prefix, data);
        }
        for _ in 0..blocks.min(self.cvs.len()) {
            let i = self.cursor;
            self.check(s, i)?;
            self.cursor = (i + 1) % self.cvs.len();
        }
        Ok(())
    }

    /// Re-hashes every cached block of `data`.
    pub fn verify_all(&self, data: &[u8]) -> Result<(), StaleBlock> {
        self.verify_all_stream(&[], data)
    }

    /// Re-hashes every cached block of the stream `prefix ‖ data`.
    pub fn verify_all_stream(&self, prefix: &[u8], data: &[u8]) -> Result<(), StaleBlock> {
        let s = Stream { prefix, data };
        if s.len() != self.len || prefix.len() != self.prefix_len {
            return Err(StaleBlock {
                block: 0,
                start: self.len.min(s.len()),
                end: self.len.max(s.len()),
            });
        }
        (0..self.cvs.len()).try_for_each(|i| self.check(s, i))
    }

    /// Block `i` against its cached value; the error's range is in the
    /// stream's coordinates.
    fn check(&self, s: Stream<'_>, i: usize) -> Result<(), StaleBlock> {
        if self.block_cv(s, i) == self.cvs[i] {
            return Ok(());
        }
        let start = i * self.block;
        Err(StaleBlock {
            block: i,
            start,
            end: (start + self.block).min(s.len()),
        })
    }
}

/// The chaining value of a subtree of `len` bytes from the values of its
/// chunks `first..` (BLAKE3's tree: the left subtree is the largest power
/// of two of chunks strictly smaller than its parent), through `memo`:
/// subtrees of whole chunks are looked up there by (first chunk, chunks),
/// and stored once merged.
fn merge_chunks_memo(
    cvs: &[[u8; 32]],
    first: usize,
    len: usize,
    memo: &mut HashMap<(usize, usize), [u8; 32]>,
) -> [u8; 32] {
    if len <= CHUNK_LEN || cvs.len() <= 1 {
        return cvs.first().copied().unwrap_or_default();
    }
    let whole = len.is_multiple_of(CHUNK_LEN);
    if whole {
        if let Some(cv) = memo.get(&(first, cvs.len())) {
            return *cv;
        }
    }
    let left = left_subtree_len(len as u64) as usize;
    let k = left / CHUNK_LEN;
    let l = merge_chunks_memo(&cvs[..k], first, left, memo);
    let r = merge_chunks_memo(&cvs[k..], first + k, len - left, memo);
    let cv = merge_subtrees_non_root(&l, &r, Mode::Hash);
    if whole {
        memo.insert((first, cvs.len()), cv);
    }
    cv
}

/// The hashed stream: `prefix` then `data`, addressed as one byte range.
#[derive(Clone, Copy)]
struct Stream<'a> {
    prefix: &'a [u8],
    data: &'a [u8],
}

impl Stream<'_> {
    fn len(&self) -> usize {
        self.prefix.len() + self.data.len()
    }

    /// Feeds bytes `r` of the stream to `h`.
    fn feed(&self, h: &mut Hasher, r: Range<usize>) {
        let p = self.prefix.len();
        if r.start < p {
            h.update(&self.prefix[r.start..r.end.min(p)]);
        }
        if r.end > p {
            h.update(&self.data[r.start.max(p) - p..r.end - p]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic byte stream (xorshift).
    fn bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn every_length_around_the_tree_boundaries_equals_blake3() {
        for block in [CHUNK_LEN, 2 * CHUNK_LEN, 4 * CHUNK_LEN] {
            let data = bytes(7, 9 * block + 3);
            let mut lens: Vec<usize> = vec![0, 1, 63, 64, 65];
            for k in 1..=9 {
                lens.extend([k * block - 1, k * block, k * block + 1]);
                lens.extend([k * CHUNK_LEN - 1, k * CHUNK_LEN, k * CHUNK_LEN + 1]);
            }
            lens.sort();
            lens.dedup();
            for &n in &lens {
                let mut d = IncrementalBlake3::new(block);
                assert_eq!(
                    d.digest(&data[..n], &[]),
                    blake3::hash(&data[..n]),
                    "block {block} len {n}"
                );
            }
        }
    }

    #[test]
    fn appends_rewrites_and_truncations_equal_blake3_and_hash_only_what_changed() {
        let block = 2 * CHUNK_LEN;
        let mut data = Vec::new();
        let mut d = IncrementalBlake3::new(block);
        let mut seed = 1;
        for step in 0..200 {
            seed += 1;
            // Append a compressed "entry" of varying size.
            let entry = bytes(seed, 100 + (step * 37) % 900);
            data.extend_from_slice(&entry);
            let mut rewritten = Vec::new();
            if step % 17 == 5 && data.len() > 3000 {
                // Rewrite an old range, reported.
                let at = (step * 131) % (data.len() - 500);
                for x in &mut data[at..at + 500] {
                    *x = x.wrapping_add(1);
                }
                rewritten.push(at..at + 500);
            }
            if step % 53 == 52 {
                data.truncate(data.len() / 2);
            }
            assert_eq!(d.digest(&data, &rewritten), blake3::hash(&data), "step {step}");
            if rewritten.is_empty() && step % 53 != 52 {
                // An append re-hashes the new bytes and at most one old partial block.
                assert!(
                    d.last_hashed() <= entry.len() + block,
                    "step {step}: {}",
                    d.last_hashed()
                );
            }
        }
        assert!(d.verify_all(&data).is_ok());
    }

    #[test]
    fn remembered_subtrees_follow_prefixes_appends_rewrites_and_truncations() {
        // Many blocks (the remembered subtrees of blocks and of the first
        // block's chunks take part), a header that changes at every digest
        // and sometimes changes length, appends of every size, reported
        // rewrites anywhere (also inside remembered subtrees) and truncations:
        // every digest is blake3::hash of the whole preimage.
        for block in [CHUNK_LEN, 4 * CHUNK_LEN, DEFAULT_BLOCK] {
            let mut data = bytes(11, 37 * block + 5);
            let mut d = IncrementalBlake3::new(block);
            let mut seed = 100;
            for step in 0..160usize {
                seed += 1;
                let plen = if step % 41 == 40 { 192 } else { 128 };
                let mut prefix = bytes(seed, plen);
                prefix[0] = step as u8;
                let grow = match step % 7 {
                    0 => 0,
                    1 => 3 * block + 11,
                    _ => (step * 97) % (block + 300),
                };
                data.extend_from_slice(&bytes(seed + 7, grow));
                let mut rewritten = Vec::new();
                if step % 13 == 6 {
                    let at = (step * 7919) % (data.len() - 700);
                    for x in &mut data[at..at + 700] {
                        *x = x.wrapping_add(3);
                    }
                    rewritten.push(at..at + 700);
                }
                if step % 29 == 28 {
                    data.truncate(data.len() * 2 / 3);
                }
                let mut whole = prefix.clone();
                whole.extend_from_slice(&data);
                assert_eq!(
                    d.digest_stream(&prefix, &data, &rewritten),
                    blake3::hash(&whole),
                    "block {block} step {step}"
                );
                assert!(d.verify_next_stream(&prefix, &data, 2).is_ok());
            }
            let prefix = bytes(1, 128);
            let mut whole = prefix.clone();
            whole.extend_from_slice(&data);
            assert_eq!(d.digest_stream(&prefix, &data, &[]), blake3::hash(&whole));
            assert!(d.verify_all_stream(&prefix, &data).is_ok());
        }
    }

    #[test]
    fn an_unreported_rewrite_of_an_old_entry_is_found_by_verification() {
        let block = CHUNK_LEN;
        let mut data = bytes(3, 40 * block);
        let mut d = IncrementalBlake3::new(block);
        let honest = d.digest(&data, &[]);
        assert_eq!(honest, blake3::hash(&data));
        // A bug rewrites one old byte and does not say so; the next digest
        // (after an append) is stale ...
        data[5 * block + 17] ^= 0x40;
        data.extend_from_slice(&bytes(4, 100));
        let stale = d.digest(&data, &[]);
        assert_ne!(stale, blake3::hash(&data), "the cache cannot see it by itself");
        // ... and verification finds the block within one sweep.
        let mut found = None;
        for _ in 0..41 {
            if let Err(e) = d.verify_next(&data, 1) {
                found = Some(e);
                break;
            }
        }
        let e = found.expect("a sweep finds the rewritten block");
        assert_eq!(e.block, 5);
        assert!(e.start <= 5 * block + 17 && 5 * block + 17 < e.end);
        assert!(d.verify_all(&data).is_err());
    }

    #[test]
    fn a_changing_prefix_before_a_growing_buffer_equals_blake3_of_both() {
        let block = CHUNK_LEN;
        let mut d = IncrementalBlake3::new(block);
        let mut data = Vec::new();
        for step in 0u8..60 {
            let prefix = [step; 192];
            data.extend_from_slice(&bytes(u64::from(step) + 100, 333));
            let want = blake3::hash(&[&prefix[..], &data[..]].concat());
            assert_eq!(d.digest_stream(&prefix, &data, &[]), want, "step {step}");
            assert!(
                d.last_hashed() <= 333 + 2 * block,
                "step {step}: {}",
                d.last_hashed()
            );
            assert!(d.verify_next_stream(&prefix, &data, 2).is_ok());
        }
        // A prefix of another length starts over, still exact.
        let want = blake3::hash(&[&[9u8; 64][..], &data[..]].concat());
        assert_eq!(d.digest_stream(&[9; 64], &data, &[]), want);
        // A reported rewrite, in data coordinates.
        data[10] ^= 1;
        let want = blake3::hash(&[&[9u8; 64][..], &data[..]].concat());
        let rewritten = [std::ops::Range { start: 10, end: 11 }];
        assert_eq!(d.digest_stream(&[9; 64], &data, &rewritten), want);
        assert!(d.verify_all_stream(&[9; 64], &data).is_ok());
    }

    #[test]
    fn a_record_header_and_an_append_rehash_chunks_not_blocks() {
        // A record's preimage: a header that changes with the length, then
        // a growing buffer; default 16 KiB blocks. Each step hashes the
        // header's chunk, the appended bytes and the chunk they complete,
        // never a whole 16 KiB block.
        let mut d = IncrementalBlake3::default();
        let mut data = bytes(21, 3 * DEFAULT_BLOCK + 5000);
        for step in 0u64..80 {
            let prefix = [(step % 251) as u8; 96];
            data.extend_from_slice(&bytes(step + 500, 256));
            let want = blake3::hash(&[&prefix[..], &data[..]].concat());
            assert_eq!(d.digest_stream(&prefix, &data, &[]), want, "step {step}");
            if step > 0 {
                assert!(
                    d.last_hashed() <= 256 + 3 * CHUNK_LEN,
                    "step {step}: {}",
                    d.last_hashed()
                );
            }
            assert!(d.verify_next_stream(&prefix, &data, 1).is_ok());
        }
    }

    #[test]
    fn a_digest_whose_only_change_is_the_prefix_hashes_only_the_prefix_chunk() {
        // Most steps append nothing to a compressed cache (an entry every
        // few tokens): the header's chunk is hashed again, the partial last
        // block and the subtrees reaching the end are reused, and every
        // digest stays exact, also when the next step appends again.
        for tail in [0, 1, 700, CHUNK_LEN + 5] {
            let mut d = IncrementalBlake3::default();
            let mut data = bytes(31, 7 * DEFAULT_BLOCK + tail);
            for step in 0u8..40 {
                let prefix = [step; 96];
                let appended = step % 5 == 4;
                if appended {
                    data.extend_from_slice(&bytes(u64::from(step), 300));
                }
                let want = blake3::hash(&[&prefix[..], &data[..]].concat());
                assert_eq!(
                    d.digest_stream(&prefix, &data, &[]),
                    want,
                    "tail {tail} step {step}"
                );
                if step > 0 && !appended {
                    assert!(
                        d.last_hashed() <= CHUNK_LEN,
                        "tail {tail} step {step}: {}",
                        d.last_hashed()
                    );
                }
                assert!(d.verify_next_stream(&prefix, &data, 1).is_ok());
            }
        }
    }

    #[test]
    fn an_unreported_rewrite_of_the_partial_last_block_is_found_by_verification() {
        // The last block's value is reused when nothing was appended, so a
        // silent rewrite there is as invisible to the digest as one in an
        // old complete block, and verification finds it the same way.
        let mut d = IncrementalBlake3::default();
        let mut data = bytes(41, 3 * DEFAULT_BLOCK + 2000);
        let prefix = [1u8; 96];
        assert_eq!(
            d.digest_stream(&prefix, &data, &[]),
            blake3::hash(&[&prefix[..], &data[..]].concat())
        );
        let at = data.len() - 10;
        data[at] ^= 0x10;
        let prefix = [2u8; 96];
        let stale = d.digest_stream(&prefix, &data, &[]);
        assert_ne!(stale, blake3::hash(&[&prefix[..], &data[..]].concat()));
        let e = d
            .verify_all_stream(&prefix, &data)
            .expect_err("verification re-hashes the last block");
        assert!(e.start <= at + 96 && at + 96 < e.end, "{e}");
        // Reported, the same rewrite is exact.
        let mut d = IncrementalBlake3::default();
        data[at] ^= 0x10;
        d.digest_stream(&prefix, &data, &[]);
        data[at] ^= 0x10;
        let rewritten = [std::ops::Range {
            start: at,
            end: at + 1,
        }];
        assert_eq!(
            d.digest_stream(&[3u8; 96], &data, &rewritten),
            blake3::hash(&[&[3u8; 96][..], &data[..]].concat())
        );
    }

    #[test]
    fn the_default_block_matches_blake3_on_a_long_buffer() {
        let data = bytes(11, 5 * DEFAULT_BLOCK + 12345);
        let mut d = IncrementalBlake3::default();
        assert_eq!(d.digest(&data, &[]), blake3::hash(&data));
        let more = [data.clone(), bytes(12, 777)].concat();
        assert_eq!(d.digest(&more, &[]), blake3::hash(&more));
        assert!(d.last_hashed() <= 2 * CHUNK_LEN + 777);
    }
}
