//! Copies that bypass the copying core's caches (non-temporal stores), for
//! bytes another core reads next: the capture's hand-over of records to the
//! trace writer's thread (`runner/src/capture_thread.rs`).

/// Appends `src` to `dst` like `extend_from_slice`, writing the aligned
/// part with non-temporal stores on x86-64: whole 64-byte cache lines with
/// AVX-512 where the CPU has it, else 32 bytes (AVX), else 16 (SSE2, always
/// present). The bytes are the same; only where they sit in the memory
/// hierarchy differs. Call [`fence`] before another thread may read them.
pub fn extend_streaming(dst: &mut Vec<u8>, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    extend_with(dst, src, x86::width());
    #[cfg(not(target_arch = "x86_64"))]
    dst.extend_from_slice(src);
}

/// Words [`extend_streaming_bf16_halves`] checks before it writes: a record
/// that is not BF16 nearly always shows it in its first words, and then
/// costs no more than this look.
const HALVES_PROBE: usize = 64;

/// Appends the high halves of `src`'s little-endian F32 words to `dst`,
/// with non-temporal stores as [`extend_streaming`], when every word's
/// low half is zero, that is when every value is a BF16 value widened (as
/// the bf16 profile's activations are): then the halves are the whole
/// information and the hand-over moves half the bytes;
/// [`widen_bf16_halves`] gives the words back, bit for bit. `false`, with
/// `dst` as it was, when a low half is not zero, `src` is not aligned
/// whole words, or the CPU has no vector narrowing (x86-64 without AVX2,
/// other architectures): the caller then copies the words.
pub fn extend_streaming_bf16_halves(dst: &mut Vec<u8>, src: &[u8]) -> bool {
    #[cfg(all(target_arch = "x86_64", target_endian = "little"))]
    {
        let Ok(words) = bytemuck::try_cast_slice::<u8, u32>(src) else {
            return false;
        };
        let Some(width) = x86::halves_width() else {
            return false;
        };
        let probe = &words[..words.len().min(HALVES_PROBE)];
        if probe.iter().fold(0, |a, w| a | w) & 0xFFFF != 0 {
            return false;
        }
        let start = dst.len();
        dst.reserve(2 * words.len());
        let spare = &mut dst.spare_capacity_mut()[..2 * words.len()];
        // SAFETY: `spare` has room for two bytes per word; `width` is what
        // `halves_width` found the CPU has.
        let low = unsafe { x86::halves(words, spare.as_mut_ptr() as *mut u8, width) };
        if low & 0xFFFF != 0 {
            return false;
        }
        // SAFETY: `halves` wrote every byte of the range.
        unsafe { dst.set_len(start + 2 * words.len()) };
        true
    }
    #[cfg(not(all(target_arch = "x86_64", target_endian = "little")))]
    {
        let _ = (dst, src);
        false
    }
}

/// Appends to `dst` the little-endian F32 words whose high halves are
/// `halves` (little-endian u16s; the low halves zero): the inverse of
/// [`extend_streaming_bf16_halves`].
pub fn widen_bf16_halves(dst: &mut Vec<u8>, halves: &[u8]) {
    dst.reserve(halves.len() * 2);
    for h in halves.chunks_exact(2) {
        dst.extend_from_slice(&[0, 0, h[0], h[1]]);
    }
}

/// [`extend_streaming`] with stores `width` bytes wide, which must be at
/// most [`x86::width`].
#[cfg(target_arch = "x86_64")]
fn extend_with(dst: &mut Vec<u8>, src: &[u8], width: usize) {
    if src.len() >= 256 && width <= x86::width() {
        dst.reserve(src.len());
        let start = dst.len();
        let spare = &mut dst.spare_capacity_mut()[..src.len()];
        let base = spare.as_mut_ptr() as *mut u8;
        let head = base.align_offset(width).min(src.len());
        let body = (src.len() - head) / width * width;
        // SAFETY: `spare` has room for `src.len()` bytes; the copies
        // write inside it, the streamed `body` at `width`-aligned
        // addresses (`head` skips to the first) with the instructions
        // `width` says the CPU has, and the loads read inside `src`.
        // Every byte of the range is written before the length is set.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), base, head);
            x86::stream(src.as_ptr().add(head), base.add(head), body, width);
            let i = head + body;
            std::ptr::copy_nonoverlapping(src.as_ptr().add(i), base.add(i), src.len() - i);
            dst.set_len(start + src.len());
        }
        return;
    }
    dst.extend_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// The widest non-temporal store this CPU has, in bytes: 64, 32 or 16.
    pub(super) fn width() -> usize {
        static WIDTH: OnceLock<usize> = OnceLock::new();
        *WIDTH.get_or_init(|| {
            if std::arch::is_x86_feature_detected!("avx512f") {
                64
            } else if std::arch::is_x86_feature_detected!("avx") {
                32
            } else {
                16
            }
        })
    }

    /// The width of [`halves`]' stores, if the CPU can narrow words with
    /// vectors: 64 bytes with AVX-512F, 32 with AVX2.
    pub(super) fn halves_width() -> Option<usize> {
        static WIDTH: OnceLock<Option<usize>> = OnceLock::new();
        *WIDTH.get_or_init(|| {
            if std::arch::is_x86_feature_detected!("avx512f") {
                Some(64)
            } else if std::arch::is_x86_feature_detected!("avx2") {
                Some(32)
            } else {
                None
            }
        })
    }

    /// Writes the high halves of `words` to `dst` (two bytes each,
    /// little-endian), the aligned part with non-temporal stores `width`
    /// bytes wide, and returns the OR of every word.
    ///
    /// # Safety
    /// `width` is what [`halves_width`] returned; `dst` is valid for two
    /// bytes per word.
    pub(super) unsafe fn halves(words: &[u32], dst: *mut u8, width: usize) -> u32 {
        // Words before the first aligned store (all of them if `dst` is odd).
        let head = match (dst as usize) % 2 {
            0 => (dst.align_offset(width) / 2).min(words.len()),
            _ => words.len(),
        };
        let per = width / 2;
        let body = (words.len() - head) / per * per;
        let tail = head + body;
        // SAFETY: every write is inside `dst`'s two bytes per word, the
        // vector ones at `width`-aligned addresses with the instructions
        // `width` says the CPU has.
        unsafe {
            let mut or = scalar_halves(&words[..head], dst);
            or |= match width {
                64 => halves64(&words[head..tail], dst.add(2 * head)),
                _ => halves32(&words[head..tail], dst.add(2 * head)),
            };
            or | scalar_halves(&words[tail..], dst.add(2 * tail))
        }
    }

    /// # Safety
    /// `dst` is valid for two bytes per word.
    unsafe fn scalar_halves(words: &[u32], dst: *mut u8) -> u32 {
        let mut or = 0;
        for (i, &w) in words.iter().enumerate() {
            or |= w;
            // SAFETY: the caller's contract.
            unsafe {
                std::ptr::write_unaligned(dst.add(2 * i) as *mut [u8; 2], ((w >> 16) as u16).to_le_bytes())
            };
        }
        or
    }

    /// # Safety
    /// `words.len()` is a multiple of 32; `dst` is 64-aligned and valid for
    /// two bytes per word.
    #[target_feature(enable = "avx512f")]
    unsafe fn halves64(words: &[u32], dst: *mut u8) -> u32 {
        let mut or = _mm512_setzero_si512();
        let src = words.as_ptr() as *const __m512i;
        for i in 0..words.len() / 32 {
            // SAFETY: the caller's contract: 32 words read, 64 bytes written,
            // aligned.
            unsafe {
                let a = _mm512_loadu_si512(src.add(2 * i));
                let b = _mm512_loadu_si512(src.add(2 * i + 1));
                or = _mm512_or_si512(or, _mm512_or_si512(a, b));
                let lo = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(a));
                let hi = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(b));
                let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                _mm512_stream_si512(dst.add(64 * i) as *mut __m512i, v);
            }
        }
        _mm512_reduce_or_epi32(or) as u32
    }

    /// # Safety
    /// `words.len()` is a multiple of 16; `dst` is 32-aligned and valid for
    /// two bytes per word.
    #[target_feature(enable = "avx2")]
    unsafe fn halves32(words: &[u32], dst: *mut u8) -> u32 {
        let mut or = _mm256_setzero_si256();
        let src = words.as_ptr() as *const __m256i;
        for i in 0..words.len() / 16 {
            // SAFETY: the caller's contract: 16 words read, 32 bytes written,
            // aligned.
            unsafe {
                let a = _mm256_loadu_si256(src.add(2 * i));
                let b = _mm256_loadu_si256(src.add(2 * i + 1));
                or = _mm256_or_si256(or, _mm256_or_si256(a, b));
                // Shifted right, every word fits 16 bits: the unsigned
                // saturating pack is exact. It packs within 128-bit lanes,
                // so the permute puts the four 64-bit groups back in order.
                let packed = _mm256_packus_epi32(_mm256_srli_epi32::<16>(a), _mm256_srli_epi32::<16>(b));
                let v = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
                _mm256_stream_si256(dst.add(32 * i) as *mut __m256i, v);
            }
        }
        let mut lanes = [0u32; 8];
        // SAFETY: `lanes` holds 32 bytes.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, or) };
        lanes.iter().fold(0, |a, w| a | w)
    }

    /// Streams `len` bytes (a multiple of `width`) from `src` to `dst`.
    ///
    /// # Safety
    /// `width` is what [`width`] returned; `dst` is `width`-aligned; both
    /// ranges are valid for `len` bytes and do not overlap.
    pub(super) unsafe fn stream(src: *const u8, dst: *mut u8, len: usize, width: usize) {
        // SAFETY: the caller's contract, which each function needs; the
        // wider ones only where `width` found their instructions.
        unsafe {
            match width {
                64 => stream64(src, dst, len),
                32 => stream32(src, dst, len),
                _ => stream16(src, dst, len),
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn stream64(src: *const u8, dst: *mut u8, len: usize) {
        let mut i = 0;
        while i < len {
            // SAFETY: [`stream`]'s contract: both ranges hold `len` bytes,
            // `dst + i` is aligned to the store's width.
            unsafe {
                let v = _mm512_loadu_si512(src.add(i) as *const __m512i);
                _mm512_stream_si512(dst.add(i) as *mut __m512i, v);
            }
            i += 64;
        }
    }

    #[target_feature(enable = "avx")]
    unsafe fn stream32(src: *const u8, dst: *mut u8, len: usize) {
        let mut i = 0;
        while i < len {
            // SAFETY: [`stream`]'s contract: both ranges hold `len` bytes,
            // `dst + i` is aligned to the store's width.
            unsafe {
                let v = _mm256_loadu_si256(src.add(i) as *const __m256i);
                _mm256_stream_si256(dst.add(i) as *mut __m256i, v);
            }
            i += 32;
        }
    }

    unsafe fn stream16(src: *const u8, dst: *mut u8, len: usize) {
        let mut i = 0;
        while i < len {
            // SAFETY: [`stream`]'s contract: both ranges hold `len` bytes,
            // `dst + i` is aligned to the store's width.
            unsafe {
                let v = _mm_loadu_si128(src.add(i) as *const __m128i);
                _mm_stream_si128(dst.add(i) as *mut __m128i, v);
            }
            i += 16;
        }
    }
}

/// Orders every non-temporal store of this thread before later stores (an
/// `sfence` on x86-64): call before handing the bytes to another thread.
pub fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no operands and is part of SSE (always present).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every store width the CPU has, not only the widest.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_store_width_holds_the_same_bytes() {
        let src: Vec<u8> = (0..9000u32).map(|i| (i * 13 + i / 97) as u8).collect();
        for width in [16, 32, 64].into_iter().filter(|&w| w <= x86::width()) {
            for start in [0usize, 1, 31, 33, 63, 64, 65] {
                for len in [255usize, 256, 257, 319, 320, 1000, 4096, 8191] {
                    let mut a = vec![9u8; start];
                    let mut b = a.clone();
                    extend_with(&mut a, &src[5..5 + len], width);
                    b.extend_from_slice(&src[5..5 + len]);
                    fence();
                    assert_eq!(a, b, "width {width} start {start} len {len}");
                }
            }
        }
    }

    /// F32 words of BF16 values (low halves zero), one of them `odd` if set.
    fn widened(n: usize, odd: Option<usize>) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let bits = ((i as u32).wrapping_mul(2_654_435_761) & 0xFFFF_0000) | (odd == Some(i)) as u32;
                f32::from_bits(bits)
            })
            .collect()
    }

    #[test]
    fn bf16_halves_give_the_same_words_back_and_refuse_any_other_word() {
        // Where the CPU cannot narrow with vectors, every record is copied.
        #[cfg(target_arch = "x86_64")]
        let narrows = x86::halves_width().is_some();
        #[cfg(not(target_arch = "x86_64"))]
        let narrows = false;
        for n in [0usize, 1, 7, 63, 64, 65, 200, 513, 1541] {
            let words = widened(n, None);
            let bytes: &[u8] = bytemuck::cast_slice(&words);
            let mut dst = vec![7u8; 3];
            assert_eq!(extend_streaming_bf16_halves(&mut dst, bytes), narrows, "{n}");
            fence();
            if !narrows {
                assert_eq!(dst, [7u8; 3]);
                continue;
            }
            assert_eq!(dst.len(), 3 + 2 * n);
            let mut back = Vec::new();
            widen_bf16_halves(&mut back, &dst[3..]);
            assert_eq!(back, bytes, "{n}");
            // One word with a low bit set anywhere, in any chunk: refused,
            // and `dst` is left as it was.
            for odd in [0, n / 2, n.saturating_sub(1)].into_iter().filter(|&i| i < n) {
                let words = widened(n, Some(odd));
                let mut dst = vec![7u8; 3];
                assert!(
                    !extend_streaming_bf16_halves(&mut dst, bytemuck::cast_slice(&words)),
                    "{n} {odd}"
                );
                assert_eq!(dst, [7u8; 3]);
            }
        }
        // Every narrowing width the CPU has, at every alignment of `dst`.
        #[cfg(target_arch = "x86_64")]
        for width in [32, 64]
            .into_iter()
            .filter(|&w| x86::halves_width().is_some_and(|h| w <= h))
        {
            let words = widened(1000, None);
            let bits: Vec<u32> = words.iter().map(|w| w.to_bits()).collect();
            for start in [0usize, 1, 2, 30, 32, 62, 64] {
                for n in [0usize, 15, 16, 17, 31, 32, 33, 500, 1000] {
                    let mut out = vec![0u8; start + 2 * n + 64];
                    // SAFETY: `out` has room for two bytes per word after `start`.
                    let or = unsafe { x86::halves(&bits[..n], out.as_mut_ptr().add(start), width) };
                    fence();
                    let mut back = Vec::new();
                    widen_bf16_halves(&mut back, &out[start..start + 2 * n]);
                    assert_eq!(
                        back,
                        bytemuck::cast_slice::<u32, u8>(&bits[..n]),
                        "width {width} start {start} n {n}"
                    );
                    assert_eq!(or, bits[..n].iter().fold(0, |a, w| a | w));
                }
            }
        }
        // Not whole words.
        let words = widened(16, None);
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        assert!(!extend_streaming_bf16_halves(&mut Vec::new(), &bytes[..63]));
    }

    #[test]
    fn a_streamed_append_holds_the_same_bytes_at_every_length_and_alignment() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for start in [0usize, 1, 5, 15, 16, 17, 63, 64, 100] {
            for len in [
                0usize,
                1,
                15,
                16,
                17,
                255,
                256,
                257,
                300,
                1023,
                1024,
                1025,
                4096 + 7,
            ] {
                let mut a = vec![9u8; start];
                let mut b = a.clone();
                extend_streaming(&mut a, &src[3..3 + len]);
                b.extend_from_slice(&src[3..3 + len]);
                fence();
                assert_eq!(a, b, "start {start} len {len}");
            }
        }
    }
}
