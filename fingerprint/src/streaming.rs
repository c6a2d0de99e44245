//! Copies that bypass the copying core's caches (non-temporal stores), for
//! bytes another core reads next: the capture's hand-over of records to the
//! trace writer's thread (`runner/src/capture_thread.rs`).

/// Appends `src` to `dst` like `extend_from_slice`, writing the 16-byte
/// aligned part with non-temporal stores on x86-64 (SSE2, always present).
/// The bytes are the same; only where they sit in the memory hierarchy
/// differs. Call [`fence`] before another thread may read them.
pub fn extend_streaming(dst: &mut Vec<u8>, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        if src.len() >= 256 {
            dst.reserve(src.len());
            let start = dst.len();
            let spare = &mut dst.spare_capacity_mut()[..src.len()];
            let base = spare.as_mut_ptr() as *mut u8;
            let head = base.align_offset(16).min(src.len());
            let body = (src.len() - head) / 16 * 16;
            // SAFETY: `spare` has room for `src.len()` bytes; every store
            // below is inside it, the aligned ones at 16-byte aligned
            // addresses (`head` skips to the first), and the loads read
            // inside `src`. Every byte of the range is written before the
            // length is set.
            unsafe {
                use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
                std::ptr::copy_nonoverlapping(src.as_ptr(), base, head);
                let mut i = head;
                while i < head + body {
                    let v = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                    _mm_stream_si128(base.add(i) as *mut __m128i, v);
                    i += 16;
                }
                std::ptr::copy_nonoverlapping(src.as_ptr().add(i), base.add(i), src.len() - i);
                dst.set_len(start + src.len());
            }
            return;
        }
    }
    dst.extend_from_slice(src);
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
