//! BLAKE3-256 of many short messages at once, one chunk per SIMD lane.
//!
//! A record of a few KiB is one to a few BLAKE3 chunks, and the chunk's
//! blocks are chained: hashing records one by one compresses one 64-byte
//! block at a time, which leaves the vector units mostly idle (the
//! `blake3` crate's own SIMD parallelism is across the chunks of *one*
//! long input). Here eight chunks — of the same or of different messages —
//! are compressed side by side, one per 32-bit lane, and each message's
//! chunk chaining values are then merged into its BLAKE3 tree. The result
//! is BLAKE3-256 exactly (the tests compare every message with the
//! `blake3` crate); only the order in which independent compressions run
//! differs, which cannot change a digest.
//!
//! The kernel is AVX2 (eight blocks transposed into word vectors), with
//! AVX-512VL's rotate instruction where the CPU has it, chosen by runtime
//! CPU detection: the dispatch decides speed only, never a bit of output.
//! Without AVX2 there is no kernel ([`digests`] says so) and callers hash
//! one message at a time; a portable version of the same arithmetic over
//! `[u32; 8]` arrays is the tests' independent reference.

// Only the x86-64 kernels (and the tests) use the scheduler.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

/// Lanes compressed together.
const LANES: usize = 8;
/// One 32-bit word of every lane.
type V = [u32; LANES];

/// BLAKE3's initial chaining value (the SHA-256 IV).
const IV: [u32; 8] = [
    0x6A09_E667,
    0xBB67_AE85,
    0x3C6E_F372,
    0xA54F_F53A,
    0x510E_527F,
    0x9B05_688C,
    0x1F83_D9AB,
    0x5BE0_CD19,
];
/// BLAKE3's message word permutation, applied between rounds.
const PERMUTATION: [usize; 16] = [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8];
/// Block flags (BLAKE3 specification, §2.1).
const CHUNK_START: u32 = 1;
const CHUNK_END: u32 = 2;
const PARENT: u32 = 4;
const ROOT: u32 = 8;
/// The block idle lanes compress (their results are dropped).
static ZERO: [u8; BLOCK] = [0; BLOCK];
/// Bytes of a block and of a chunk.
const BLOCK: usize = 64;
const CHUNK: usize = 1024;

/// The message words each of the 7 rounds reads, in order: round `r`
/// uses the permutation applied `r` times.
const SCHEDULE: [[usize; 16]; 7] = schedule();

const fn schedule() -> [[usize; 16]; 7] {
    let mut s = [[0usize; 16]; 7];
    let mut i = 0;
    while i < 16 {
        s[0][i] = i;
        i += 1;
    }
    let mut r = 1;
    while r < 7 {
        let mut i = 0;
        while i < 16 {
            s[r][i] = s[r - 1][PERMUTATION[i]];
            i += 1;
        }
        r += 1;
    }
    s
}

/// One message: `head` followed by `tail`. `head.len()` must be a multiple
/// of 64 (so that no block straddles the two), as record preimages are.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Message<'a> {
    /// The first bytes (a record's fixed prefix).
    pub head: &'a [u8],
    /// The rest (a record's data bytes).
    pub tail: &'a [u8],
}

impl Message<'_> {
    fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    /// Chunks of the message (an empty message is one empty chunk).
    fn chunks(&self) -> usize {
        self.len().div_ceil(CHUNK).max(1)
    }

    /// The block at byte `offset` (a multiple of 64): the whole block when
    /// 64 bytes are there, else the remainder zero-padded into `pad`; and
    /// its length.
    fn block<'s>(&'s self, offset: usize, pad: &'s mut [u8; BLOCK]) -> (&'s [u8; BLOCK], u32) {
        let (src, at) = if offset < self.head.len() {
            (self.head, offset)
        } else {
            (self.tail, offset - self.head.len())
        };
        let rest = src.get(at..).unwrap_or(&[]);
        match rest.first_chunk::<BLOCK>() {
            Some(b) => (b, BLOCK as u32),
            None => {
                *pad = [0; BLOCK];
                pad[..rest.len()].copy_from_slice(rest);
                (pad, rest.len() as u32)
            }
        }
    }
}

/// Whether [`digests`] can take this message (its head is whole blocks).
pub(crate) fn accepts(head_len: usize) -> bool {
    head_len.is_multiple_of(BLOCK)
}

/// BLAKE3-256 of every message, in order; `None` on a CPU without a
/// vector kernel here (no AVX2), where the `blake3` crate one message at a
/// time is faster than eight lanes of scalar code.
///
/// # Panics
/// If a message's head is not a multiple of 64 bytes ([`accepts`]).
pub(crate) fn digests(messages: &[Message<'_>]) -> Option<Vec<[u8; 32]>> {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2");
        if avx2 && std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512vl") {
            // SAFETY: the CPU supports AVX2, AVX-512F and AVX-512VL (checked just above).
            return Some(unsafe { digests_avx512vl(messages) });
        }
        if avx2 {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return Some(unsafe { digests_avx2(messages) });
        }
    }
    let _ = messages;
    None
}

/// Whether [`digests`] has a vector kernel on this CPU.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`digests`] with the AVX2 kernel.
///
/// # Safety
/// The CPU must support AVX2 ([`digests`] checks before calling).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn digests_avx2(messages: &[Message<'_>]) -> Vec<[u8; 32]> {
    schedule_with(messages, |cv, blocks, lo, hi, len, flags| {
        // SAFETY: this function only runs on CPUs with AVX2.
        unsafe { avx2::compress8::<false>(cv, blocks, lo, hi, len, flags) }
    })
}

/// [`digests`] with the AVX2 kernel using AVX-512VL's 256-bit rotates.
///
/// # Safety
/// The CPU must support AVX2, AVX-512F and AVX-512VL ([`digests`] checks before calling).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512vl")]
unsafe fn digests_avx512vl(messages: &[Message<'_>]) -> Vec<[u8; 32]> {
    schedule_with(messages, |cv, blocks, lo, hi, len, flags| {
        // SAFETY: this function only runs on CPUs with AVX2 and AVX-512VL.
        unsafe { avx2::compress8::<true>(cv, blocks, lo, hi, len, flags) }
    })
}

/// [`digests`] with the portable kernel: the tests' independent check of
/// the scheduler and of the vector kernels.
#[cfg(test)]
fn digests_with(messages: &[Message<'_>]) -> Vec<[u8; 32]> {
    schedule_with(messages, compress_blocks)
}

/// The portable kernel: gathers every lane's message words, then
/// [`compress`].
#[cfg(test)]
#[inline(always)]
fn compress_blocks(cv: &mut [V; 8], blocks: [&[u8; BLOCK]; LANES], lo: V, hi: V, len: V, flags: V) {
    let mut m: [V; 16] = [[0; LANES]; 16];
    for (l, bytes) in blocks.iter().enumerate() {
        for (w, word) in m.iter_mut().enumerate() {
            let b = [bytes[4 * w], bytes[4 * w + 1], bytes[4 * w + 2], bytes[4 * w + 3]];
            word[l] = u32::from_le_bytes(b);
        }
    }
    compress(cv, &m, lo, hi, len, flags);
}

/// What one lane is compressing: a chunk of a message.
#[derive(Clone, Copy)]
struct Job {
    /// Message index.
    message: usize,
    /// Chunk index within the message (the BLAKE3 counter).
    chunk: usize,
    /// Next block of the chunk.
    block: usize,
    /// Blocks of the chunk.
    blocks: usize,
    /// Whether the chunk is the whole message (its last block is the root).
    root: bool,
    /// Where the chunk's chaining value goes in the flat list.
    slot: usize,
}

/// The scheduler: keeps every lane busy with some chunk's next block until
/// all chunks are done (compressing with `kernel`), then merges each
/// message's chunk values.
#[inline(always)]
fn schedule_with<K>(messages: &[Message<'_>], mut kernel: K) -> Vec<[u8; 32]>
where
    K: FnMut(&mut [V; 8], [&[u8; BLOCK]; LANES], V, V, V, V),
{
    // Chunk chaining values of every message, message after message.
    let mut first = Vec::with_capacity(messages.len());
    let mut total = 0usize;
    for m in messages {
        assert!(accepts(m.head.len()), "a message head must be whole blocks");
        first.push(total);
        total += m.chunks();
    }
    let mut cvs: Vec<[u32; 8]> = vec![[0; 8]; total];
    let mut jobs = messages.iter().enumerate().flat_map(|(i, m)| {
        let n = m.chunks();
        let len = m.len();
        let slot = first[i];
        (0..n).map(move |c| {
            let clen = (len - c * CHUNK).min(CHUNK);
            Job {
                message: i,
                chunk: c,
                block: 0,
                blocks: clen.div_ceil(BLOCK).max(1),
                root: n == 1,
                slot: slot + c,
            }
        })
    });
    let mut lanes: [Option<Job>; LANES] = [None; LANES];
    // Chaining values, word-major: cv[w][lane].
    let mut cv: [V; 8] = [[0; LANES]; 8];
    let mut pads = [[0u8; BLOCK]; LANES];
    loop {
        let mut busy = false;
        for (l, lane) in lanes.iter_mut().enumerate() {
            if lane.is_none() {
                *lane = jobs.next();
                if lane.is_some() {
                    for (w, iv) in IV.iter().enumerate() {
                        cv[w][l] = *iv;
                    }
                }
            }
            busy |= lane.is_some();
        }
        if !busy {
            break;
        }
        let (mut lo, mut hi, mut len, mut flags) =
            ([0u32; LANES], [0u32; LANES], [0u32; LANES], [0u32; LANES]);
        let mut blocks: [&[u8; BLOCK]; LANES] = [&ZERO; LANES];
        for (l, (lane, pad)) in lanes.iter().zip(pads.iter_mut()).enumerate() {
            let Some(j) = lane else { continue };
            let msg = &messages[j.message];
            let (bytes, n) = msg.block(j.chunk * CHUNK + j.block * BLOCK, pad);
            blocks[l] = bytes;
            let counter = j.chunk as u64;
            lo[l] = counter as u32;
            hi[l] = (counter >> 32) as u32;
            len[l] = n;
            let last = j.block + 1 == j.blocks;
            flags[l] = if j.block == 0 { CHUNK_START } else { 0 }
                | if last { CHUNK_END } else { 0 }
                | if last && j.root { ROOT } else { 0 };
        }
        kernel(&mut cv, blocks, lo, hi, len, flags);
        for (l, lane) in lanes.iter_mut().enumerate() {
            let Some(j) = lane else { continue };
            j.block += 1;
            if j.block == j.blocks {
                for (w, word) in cv.iter().enumerate() {
                    cvs[j.slot][w] = word[l];
                }
                *lane = None;
            }
        }
    }
    // Each message's tree, level by level: adjacent values become a
    // parent, an odd last one moves up unchanged (BLAKE3's left-full tree),
    // the parents of every message compressed side by side like the chunks.
    let mut levels: Vec<Vec<[u32; 8]>> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| match m.chunks() {
            1 => Vec::new(),
            n => cvs[first[i]..first[i] + n].to_vec(),
        })
        .collect();
    loop {
        // (message, pair) of every parent of this level.
        let pairs: Vec<(usize, usize)> = levels
            .iter()
            .enumerate()
            .flat_map(|(i, l)| (0..l.len() / 2).map(move |p| (i, p)))
            .collect();
        if pairs.is_empty() {
            break;
        }
        let mut parents: Vec<[u32; 8]> = vec![[0; 8]; pairs.len()];
        for (group, out) in pairs.chunks(LANES).zip(parents.chunks_mut(LANES)) {
            let mut blocks = [[0u8; BLOCK]; LANES];
            let mut flags = [0u32; LANES];
            for ((&(i, p), block), flag) in group.iter().zip(blocks.iter_mut()).zip(flags.iter_mut()) {
                let level = &levels[i];
                for (bytes, word) in block
                    .chunks_exact_mut(4)
                    .zip(level[2 * p].iter().chain(&level[2 * p + 1]))
                {
                    bytes.copy_from_slice(&word.to_le_bytes());
                }
                *flag = PARENT | if level.len() == 2 { ROOT } else { 0 };
            }
            let mut cv: [V; 8] = std::array::from_fn(|w| [IV[w]; LANES]);
            let refs: [&[u8; BLOCK]; LANES] = std::array::from_fn(|l| &blocks[l]);
            kernel(
                &mut cv,
                refs,
                [0; LANES],
                [0; LANES],
                [BLOCK as u32; LANES],
                flags,
            );
            for (l, o) in out.iter_mut().enumerate() {
                *o = std::array::from_fn(|w| cv[w][l]);
            }
        }
        let mut made = parents.into_iter();
        for level in levels.iter_mut().filter(|l| l.len() >= 2) {
            let mut next: Vec<[u32; 8]> = made.by_ref().take(level.len() / 2).collect();
            if level.len() % 2 == 1 {
                next.extend(level.last().copied());
            }
            *level = next;
        }
    }
    levels
        .iter()
        .enumerate()
        .map(|(i, level)| {
            let root = level.first().copied().unwrap_or(cvs[first[i]]);
            let mut out = [0u8; 32];
            for (o, w) in out.chunks_exact_mut(4).zip(root) {
                o.copy_from_slice(&w.to_le_bytes());
            }
            out
        })
        .collect()
}

#[cfg(test)]
#[inline(always)]
fn add(a: V, b: V) -> V {
    std::array::from_fn(|i| a[i].wrapping_add(b[i]))
}

#[cfg(test)]
#[inline(always)]
fn xor_rotr(a: V, b: V, n: u32) -> V {
    std::array::from_fn(|i| (a[i] ^ b[i]).rotate_right(n))
}

/// BLAKE3's quarter-round on four state words of every lane.
#[cfg(test)]
#[inline(always)]
fn g(s: &mut [V; 16], a: usize, b: usize, c: usize, d: usize, x: V, y: V) {
    s[a] = add(add(s[a], s[b]), x);
    s[d] = xor_rotr(s[d], s[a], 16);
    s[c] = add(s[c], s[d]);
    s[b] = xor_rotr(s[b], s[c], 12);
    s[a] = add(add(s[a], s[b]), y);
    s[d] = xor_rotr(s[d], s[a], 8);
    s[c] = add(s[c], s[d]);
    s[b] = xor_rotr(s[b], s[c], 7);
}

/// The BLAKE3 compression function in every lane; `cv` becomes the
/// output chaining value (the first 8 output words).
#[cfg(test)]
#[inline(always)]
fn compress(cv: &mut [V; 8], m: &[V; 16], lo: V, hi: V, len: V, flags: V) {
    let mut s: [V; 16] = [
        cv[0],
        cv[1],
        cv[2],
        cv[3],
        cv[4],
        cv[5],
        cv[6],
        cv[7],
        [IV[0]; LANES],
        [IV[1]; LANES],
        [IV[2]; LANES],
        [IV[3]; LANES],
        lo,
        hi,
        len,
        flags,
    ];
    for r in SCHEDULE {
        g(&mut s, 0, 4, 8, 12, m[r[0]], m[r[1]]);
        g(&mut s, 1, 5, 9, 13, m[r[2]], m[r[3]]);
        g(&mut s, 2, 6, 10, 14, m[r[4]], m[r[5]]);
        g(&mut s, 3, 7, 11, 15, m[r[6]], m[r[7]]);
        g(&mut s, 0, 5, 10, 15, m[r[8]], m[r[9]]);
        g(&mut s, 1, 6, 11, 12, m[r[10]], m[r[11]]);
        g(&mut s, 2, 7, 8, 13, m[r[12]], m[r[13]]);
        g(&mut s, 3, 4, 9, 14, m[r[14]], m[r[15]]);
    }
    for w in 0..8 {
        cv[w] = std::array::from_fn(|i| s[w][i] ^ s[w + 8][i]);
    }
}

/// The AVX2 kernel: eight blocks transposed into word vectors, then the
/// compression function on `__m256i` lanes.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BLOCK, IV, LANES, SCHEDULE, V};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2, and AVX-512F and AVX-512VL when `VL` (only called from the
    /// kernels compiled with them).
    #[inline(always)]
    unsafe fn rot<const N: i32, const VL: bool>(x: __m256i) -> __m256i {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            if VL {
                match N {
                    16 => _mm256_ror_epi32::<16>(x),
                    12 => _mm256_ror_epi32::<12>(x),
                    8 => _mm256_ror_epi32::<8>(x),
                    _ => _mm256_ror_epi32::<7>(x),
                }
            } else {
                match N {
                    16 => _mm256_shuffle_epi8(
                        x,
                        _mm256_setr_epi8(
                            2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13, 2, 3, 0, 1, 6, 7, 4, 5, 10,
                            11, 8, 9, 14, 15, 12, 13,
                        ),
                    ),
                    8 => _mm256_shuffle_epi8(
                        x,
                        _mm256_setr_epi8(
                            1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12, 1, 2, 3, 0, 5, 6, 7, 4, 9,
                            10, 11, 8, 13, 14, 15, 12,
                        ),
                    ),
                    12 => _mm256_or_si256(_mm256_srli_epi32::<12>(x), _mm256_slli_epi32::<20>(x)),
                    _ => _mm256_or_si256(_mm256_srli_epi32::<7>(x), _mm256_slli_epi32::<25>(x)),
                }
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX2, and AVX-512F and AVX-512VL when `VL`; `a`, `b`, `c`, `d` index
    /// `s`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn g<const VL: bool>(
        s: &mut [__m256i; 16],
        a: usize,
        b: usize,
        c: usize,
        d: usize,
        x: __m256i,
        y: __m256i,
    ) {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            s[a] = _mm256_add_epi32(_mm256_add_epi32(s[a], s[b]), x);
            s[d] = rot::<16, VL>(_mm256_xor_si256(s[d], s[a]));
            s[c] = _mm256_add_epi32(s[c], s[d]);
            s[b] = rot::<12, VL>(_mm256_xor_si256(s[b], s[c]));
            s[a] = _mm256_add_epi32(_mm256_add_epi32(s[a], s[b]), y);
            s[d] = rot::<8, VL>(_mm256_xor_si256(s[d], s[a]));
            s[c] = _mm256_add_epi32(s[c], s[d]);
            s[b] = rot::<7, VL>(_mm256_xor_si256(s[b], s[c]));
        }
    }

    /// Words `8 * half .. 8 * half + 8` of the eight blocks, one vector
    /// per word (an 8 x 8 transpose of 32-bit values).
    ///
    /// # Safety
    /// The CPU must support AVX2; `half` is 0 or 1.
    #[inline(always)]
    unsafe fn transpose(blocks: &[&[u8; BLOCK]; LANES], half: usize) -> [__m256i; 8] {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            // SAFETY (loads): each block is 64 bytes; `half` is 0 or 1.
            let r: [__m256i; 8] = std::array::from_fn(|l| {
                _mm256_loadu_si256(blocks[l].as_ptr().add(32 * half) as *const __m256i)
            });
            let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
            let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
            let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
            let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
            let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
            let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
            let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
            let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
            let u0 = _mm256_unpacklo_epi64(t0, t2);
            let u1 = _mm256_unpackhi_epi64(t0, t2);
            let u2 = _mm256_unpacklo_epi64(t1, t3);
            let u3 = _mm256_unpackhi_epi64(t1, t3);
            let u4 = _mm256_unpacklo_epi64(t4, t6);
            let u5 = _mm256_unpackhi_epi64(t4, t6);
            let u6 = _mm256_unpacklo_epi64(t5, t7);
            let u7 = _mm256_unpackhi_epi64(t5, t7);
            [
                _mm256_permute2x128_si256::<0x20>(u0, u4),
                _mm256_permute2x128_si256::<0x20>(u1, u5),
                _mm256_permute2x128_si256::<0x20>(u2, u6),
                _mm256_permute2x128_si256::<0x20>(u3, u7),
                _mm256_permute2x128_si256::<0x31>(u0, u4),
                _mm256_permute2x128_si256::<0x31>(u1, u5),
                _mm256_permute2x128_si256::<0x31>(u2, u6),
                _mm256_permute2x128_si256::<0x31>(u3, u7),
            ]
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[inline(always)]
    unsafe fn load(v: &V) -> __m256i {
        // SAFETY: `V` is 32 bytes.
        unsafe { _mm256_loadu_si256(v.as_ptr() as *const __m256i) }
    }

    /// The compression function in eight lanes (`VL`: rotate with
    /// AVX-512VL's `vprord`); `cv` becomes the output chaining value.
    ///
    /// # Safety
    /// The CPU must support AVX2, and AVX-512F and AVX-512VL when `VL`.
    #[inline(always)]
    pub(super) unsafe fn compress8<const VL: bool>(
        cv: &mut [V; 8],
        blocks: [&[u8; BLOCK]; LANES],
        lo: V,
        hi: V,
        len: V,
        flags: V,
    ) {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let (a, b) = (transpose(&blocks, 0), transpose(&blocks, 1));
            let m: [__m256i; 16] = std::array::from_fn(|w| if w < 8 { a[w] } else { b[w - 8] });
            let mut s: [__m256i; 16] = std::array::from_fn(|w| match w {
                0..8 => load(&cv[w]),
                8..12 => _mm256_set1_epi32(IV[w - 8] as i32),
                12 => load(&lo),
                13 => load(&hi),
                14 => load(&len),
                _ => load(&flags),
            });
            for r in SCHEDULE {
                g::<VL>(&mut s, 0, 4, 8, 12, m[r[0]], m[r[1]]);
                g::<VL>(&mut s, 1, 5, 9, 13, m[r[2]], m[r[3]]);
                g::<VL>(&mut s, 2, 6, 10, 14, m[r[4]], m[r[5]]);
                g::<VL>(&mut s, 3, 7, 11, 15, m[r[6]], m[r[7]]);
                g::<VL>(&mut s, 0, 5, 10, 15, m[r[8]], m[r[9]]);
                g::<VL>(&mut s, 1, 6, 11, 12, m[r[10]], m[r[11]]);
                g::<VL>(&mut s, 2, 7, 8, 13, m[r[12]], m[r[13]]);
                g::<VL>(&mut s, 3, 4, 9, 14, m[r[14]], m[r[15]]);
            }
            for w in 0..8 {
                let out = _mm256_xor_si256(s[w], s[w + 8]);
                // SAFETY: `V` is 32 bytes.
                _mm256_storeu_si256(cv[w].as_mut_ptr() as *mut __m256i, out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random bytes.
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    fn crate_digest(m: &Message<'_>) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(m.head);
        h.update(m.tail);
        *h.finalize().as_bytes()
    }

    fn check(all: &[(Vec<u8>, Vec<u8>)]) {
        let msgs: Vec<Message<'_>> = all.iter().map(|(h, t)| Message { head: h, tail: t }).collect();
        let want: Vec<[u8; 32]> = msgs.iter().map(crate_digest).collect();
        if available() {
            assert_eq!(digests(&msgs), Some(want.clone()), "dispatched");
        }
        assert_eq!(digests_with(&msgs), want, "portable");
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2 (checked just above).
                assert_eq!(unsafe { digests_avx2(&msgs) }, want, "AVX2");
            }
        }
    }

    #[test]
    fn every_length_up_to_five_chunks_matches_the_blake3_crate() {
        // Every tail length 0..=5 KiB + 1 after heads of 0, 64 and 128
        // bytes: every block boundary, partial block, chunk count and tree
        // shape up to 6 chunks, many messages sharing the lanes.
        for head in [0usize, 64, 128] {
            let all: Vec<_> = (0..=5 * CHUNK + 1)
                .map(|n| (bytes(head, n as u64), bytes(n, 7 + n as u64)))
                .collect();
            check(&all);
        }
    }

    #[test]
    fn larger_trees_fewer_messages_than_lanes_and_none_match() {
        // Chunk counts around powers of two (unbalanced trees), one message
        // alone, and mixes where lanes run out of work at different times.
        let lens = [
            7 * CHUNK,
            8 * CHUNK,
            8 * CHUNK + 1,
            9 * CHUNK - 1,
            16 * CHUNK,
            17 * CHUNK + 63,
            33 * CHUNK,
            100 * CHUNK + 5,
        ];
        for (i, &n) in lens.iter().enumerate() {
            check(&[(bytes(64, i as u64), bytes(n, i as u64))]);
        }
        let mixed: Vec<_> = lens
            .iter()
            .chain(&[1, 64, 1000, 2048])
            .enumerate()
            .map(|(i, &n)| (bytes(128, i as u64), bytes(n, 99 + i as u64)))
            .collect();
        check(&mixed);
        check(&[]);
    }

    #[test]
    fn the_schedule_is_the_specification_s() {
        // BLAKE3 reference implementation, MSG_SCHEDULE.
        assert_eq!(
            SCHEDULE[1],
            [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8]
        );
        assert_eq!(
            SCHEDULE[6],
            [11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13]
        );
    }
}
