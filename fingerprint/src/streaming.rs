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
