//! `dot8` over several rows at once, with x86 SIMD versions selected at run
//! time (docs/operators.md §2, "dot8").
//!
//! One `dot8` is a single dependency chain per lane: element i goes to lane
//! `i mod 8`, each lane accumulates in increasing i. A kernel that computes
//! [`ROWS`] rows side by side keeps that order for each row exactly, it only
//! has [`ROWS`] independent chains in flight instead of one. The AVX2 kernel
//! holds one row's 8 lanes in one 256-bit register: per block of 8 elements
//! it widens the 8 BF16 weights (`bits << 16`, exact), multiplies by the 8
//! inputs (`vmulps`, one rounding) and adds the products to the lanes
//! (`vaddps`, one rounding). No fused multiply-add is ever emitted: the
//! intrinsics are separate multiply and add instructions, and Rust never
//! contracts floating-point operations. The partial block at the end of a
//! row and the fold `((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))` run in scalar code.
//! Every kernel therefore returns the bits of the portable reference
//! ([`crate::linear::dot8`] and its BF16 forms) on every input, including
//! ±0, subnormals and infinities; tests check this on random and special
//! values for every kernel the machine can run.
//!
//! The kernel is chosen per call from the CPU's features
//! (`is_x86_feature_detected!`, cached by std); since all kernels give the
//! same bits, the choice can never change a result, only its speed.
//! [`set_portable_only`] forces the portable kernels (tests compare whole
//! runs with and without SIMD).

use std::sync::atomic::{AtomicBool, Ordering};

use crate::linear::{dot8, dot8_bf16, dot8_f32_bytes, LANES};

/// Rows computed side by side by the multi-row kernels.
pub const ROWS: usize = 8;

/// When set, every dispatching function uses the portable kernels.
static PORTABLE_ONLY: AtomicBool = AtomicBool::new(false);

/// Forces the portable (non-SIMD) kernels when `on` (for tests and for
/// checking a machine's SIMD kernels against the portable ones end to end;
/// results are bit-identical either way).
pub fn set_portable_only(on: bool) {
    PORTABLE_ONLY.store(on, Ordering::Relaxed);
}

/// The kernel family a call uses on this machine: `"avx2"` or `"portable"`.
pub fn kernel_name() -> &'static str {
    if avx2() {
        "avx2"
    } else {
        "portable"
    }
}

/// Whether a SIMD kernel serves [`dot8_rows`] and [`dot8_f32_many`] on
/// this machine (callers with a faster portable path of their own use it
/// otherwise).
#[inline]
pub fn simd_available() -> bool {
    avx2()
}

/// When set, the AVX-512VL kernels are not used (tests of the AVX2 ones).
#[cfg(test)]
static NO_AVX512: AtomicBool = AtomicBool::new(false);

/// Whether AVX-512F and AVX-512VL are available (and SIMD is not switched off).
#[inline]
fn avx512vl() -> bool {
    #[cfg(test)]
    if NO_AVX512.load(Ordering::Relaxed) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        avx2()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[inline]
fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        !PORTABLE_ONLY.load(Ordering::Relaxed) && std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Element type of the rows of a [`RowBlock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowDType {
    /// Little-endian bfloat16.
    Bf16,
    /// Little-endian IEEE binary32.
    F32,
}

impl RowDType {
    fn size(self) -> usize {
        match self {
            RowDType::Bf16 => 2,
            RowDType::F32 => 4,
        }
    }
}

/// Consecutive rows of a row-major matrix in little-endian storage: row `i`
/// is `bytes[i·stride .. i·stride + cols·size]`.
#[derive(Debug, Clone, Copy)]
pub struct RowBlock<'a> {
    /// The storage, starting at the first row.
    pub bytes: &'a [u8],
    /// Bytes from one row to the next (at least `cols · size`).
    pub stride: usize,
    /// Elements per row.
    pub cols: usize,
    /// Element type.
    pub dtype: RowDType,
}

impl RowBlock<'_> {
    /// Row `i`'s bytes, if the storage holds it.
    #[inline]
    fn row(&self, i: usize) -> Option<&[u8]> {
        let start = i.checked_mul(self.stride)?;
        let end = start.checked_add(self.cols.checked_mul(self.dtype.size())?)?;
        self.bytes.get(start..end)
    }
}

/// `out[i] = dot8(row i, x)` for `i < out.len()`, in FP32 without rounding.
/// `x.len()` must be `rows.cols` and the storage must hold `out.len()` rows
/// (rows it does not hold give NaN, which callers never see: [`crate::weights::Mat`]
/// validates its bounds at load).
pub fn dot8_rows(rows: &RowBlock<'_>, x: &[f32], out: &mut [f32]) {
    let n = rows.cols.min(x.len());
    let x = &x[..n];
    let complete = out.len().min(rows_held(rows));
    #[cfg(target_arch = "x86_64")]
    if avx2() && stride_ok(rows) {
        let (fast, rest) = out.split_at_mut(complete);
        // SAFETY: AVX2 is available (checked above); `rows_held` guarantees
        // every row of `fast` lies inside `rows.bytes`.
        unsafe { x86::dot8_rows_avx2(rows, x, fast) };
        rest.fill(f32::NAN);
        return;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = match rows.row(i) {
            Some(r) => match rows.dtype {
                RowDType::Bf16 => dot8_bf16(r, x),
                RowDType::F32 => dot8_f32_bytes(r, x),
            },
            None => f32::NAN,
        };
    }
}

/// Whether the stride covers a row (so row i starts at i·stride and ends
/// before row i+1 begins or overlaps it harmlessly; only reads happen).
fn stride_ok(rows: &RowBlock<'_>) -> bool {
    rows.cols
        .checked_mul(rows.dtype.size())
        .is_some_and(|b| b <= rows.stride || rows.cols == 0)
}

/// How many complete rows `rows.bytes` holds.
fn rows_held(rows: &RowBlock<'_>) -> usize {
    let row_bytes = rows.cols.saturating_mul(rows.dtype.size());
    if rows.stride == 0 {
        return if rows.bytes.len() >= row_bytes {
            usize::MAX
        } else {
            0
        };
    }
    if rows.bytes.len() < row_bytes {
        return 0;
    }
    (rows.bytes.len() - row_bytes) / rows.stride + 1
}

/// `out[i] = dot8(rows[i], x)` for FP32 rows given as slices (attention keys,
/// indexer keys), in FP32 without rounding.
pub fn dot8_f32_many(rows: &[&[f32]], x: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 is available (checked above).
        unsafe { x86::dot8_f32_many_avx2(rows, x, out) };
        return;
    }
    for (o, r) in out.iter_mut().zip(rows) {
        *o = dot8(r, x);
    }
}

/// A quantized weight format served by [`dot8_quant_rows`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantRows {
    /// FP8 E4M3 codes, one UE8M0 scale per 128 columns (the row's block-row scales).
    Fp8,
    /// [`QuantRows::Fp8`] whose codes are known to include neither NaN code
    /// (0x7F, 0xFF): decoded without the NaN fix-up. The caller vouches for
    /// it (the loader refuses NaN codes in FP8 weights); with a NaN
    /// code the result would be wrong, not NaN.
    Fp8Finite,
    /// MXFP4 (two E2M1 codes per byte, low nibble = even element), one UE8M0 scale per 32 columns.
    Mxfp4,
}

/// The largest FP8 scale code the SIMD kernel takes (the loader's maximum,
/// `quant::max_scale_code`); rows with larger codes go to the scalar kernel.
const FP8_MAX_SCALE_CODE: u8 = 246;

/// Most rows one [`dot8_quant_rows`] call takes.
pub const QUANT_ROWS: usize = ROWS;

/// `out[i] = dot8` of row `rows[i] = (codes, scale codes)` of format `kind`
/// with `x`, each weight decoded exactly as `decode(code) · 2^(e−127)` and
/// then multiplied with its input and added in the dot8 order: bit for bit
/// [`crate::linear::dot8_fp8`] / [`crate::linear::dot8_mxfp4`]. Returns
/// `false` (and computes nothing) when no SIMD kernel serves the call: no
/// SIMD on this machine, more than [`QUANT_ROWS`] rows, or an MXFP4 row
/// length that is not a multiple of 8 (callers then use the scalar kernels).
pub fn dot8_quant_rows(kind: QuantRows, rows: &[(&[u8], &[u8])], x: &[f32], out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if avx2()
        && std::arch::is_x86_feature_detected!("f16c")
        && rows.len() <= QUANT_ROWS
        && out.len() >= rows.len()
    {
        let n = x.len();
        let ok = rows.iter().all(|(codes, scales)| match kind {
            // Scale codes up to the loader's maximum (246) or NaN: 2^8 · scale stays finite.
            QuantRows::Fp8 | QuantRows::Fp8Finite => {
                let blocks = n.div_ceil(crate::quant::FP8_BLOCK);
                codes.len() >= n
                    && scales.len() >= blocks
                    && scales[..blocks]
                        .iter()
                        .all(|&e| e <= FP8_MAX_SCALE_CODE || e == 0xff)
            }
            QuantRows::Mxfp4 => {
                n.is_multiple_of(8)
                    && codes.len() >= n / 2
                    && scales.len() >= n.div_ceil(crate::quant::MXFP4_GROUP)
            }
        });
        if ok {
            if avx512vl() {
                // SAFETY: AVX2 and AVX-512F/VL are available (checked) and every row
                // holds the codes and scales of `n` elements (checked just now).
                unsafe { x86::dot8_quant_avx512vl(kind, rows, x, out) };
            } else {
                // SAFETY: AVX2 is available (checked above) and every row holds
                // the codes and scales of `n` elements (checked just now).
                unsafe { x86::dot8_quant_avx2(kind, rows, x, out) };
            }
            return true;
        }
    }
    let _ = (kind, rows, x, out);
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{QuantRows, RowBlock, RowDType, LANES, ROWS};
    use std::arch::x86_64::*;

    #[inline(always)]
    fn fold8(l: [f32; LANES]) -> f32 {
        ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    }

    /// The 8 lanes of `acc` plus the scalar tail `i = from..n` (lane i mod 8,
    /// increasing i), folded.
    ///
    /// # Safety
    /// The CPU must support AVX2 (only called from the kernels compiled with it); `x.len() ≥ n`.
    #[inline(always)]
    unsafe fn finish(acc: __m256, from: usize, n: usize, w: impl Fn(usize) -> f32, x: &[f32]) -> f32 {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let mut l = [0.0f32; LANES];
            _mm256_storeu_ps(l.as_mut_ptr(), acc);
            for i in from..n {
                l[i % LANES] += w(i) * x[i];
            }
            fold8(l)
        }
    }

    /// 8 weights of a row at element `8b`, widened to FP32.
    ///
    /// # Safety
    /// The CPU must support AVX2; the 16 bytes at `p + 16·b` (BF16) or the 32 bytes at `p + 32·b`
    /// (F32) must be readable.
    #[inline(always)]
    unsafe fn load8(p: *const u8, dtype: RowDType, b: usize) -> __m256 {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            match dtype {
                RowDType::Bf16 => {
                    let w = _mm_loadu_si128(p.add(16 * b) as *const __m128i);
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(w)))
                }
                RowDType::F32 => _mm256_loadu_ps(p.add(32 * b) as *const f32),
            }
        }
    }

    /// # Safety
    /// The 2 bytes at `p + 2·i` (BF16) or the 4 bytes at `p + 4·i` (F32) must be readable.
    #[inline(always)]
    unsafe fn scalar_at(p: *const u8, dtype: RowDType, i: usize) -> f32 {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            match dtype {
                RowDType::Bf16 => {
                    f32::from_bits((std::ptr::read_unaligned(p.add(2 * i) as *const u16) as u32) << 16)
                }
                RowDType::F32 => f32::from_bits(std::ptr::read_unaligned(p.add(4 * i) as *const u32)),
            }
        }
    }

    /// `R` rows starting at `p[0..R]`, `n` elements each. Each iteration
    /// also prefetches the bytes it consumes, `pf` bytes ahead of the first
    /// row (a hint: it cannot change a result).
    ///
    /// # Safety
    /// The CPU must support AVX2; each `p[r]` points to `n` readable elements of `dtype`, and
    /// `x.len() ≥ n`. `pf` may point anywhere: a prefetch never faults.
    #[inline(always)]
    unsafe fn rows_r<const R: usize>(
        p: [*const u8; R],
        dtype: RowDType,
        n: usize,
        x: &[f32],
        pf: Option<*const u8>,
    ) -> [f32; R] {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let blocks = n / LANES;
            let mut acc = [_mm256_setzero_ps(); R];
            let xp = x.as_ptr();
            let step = R * LANES * dtype.size();
            for b in 0..blocks {
                if let Some(pf) = pf {
                    let mut off = 0;
                    while off < step {
                        _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(b * step + off) as *const i8);
                        off += 64;
                    }
                }
                let xv = _mm256_loadu_ps(xp.add(LANES * b));
                for r in 0..R {
                    let w = load8(p[r], dtype, b);
                    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(w, xv));
                }
            }
            let mut out = [0.0f32; R];
            for r in 0..R {
                out[r] = finish(acc[r], blocks * LANES, n, |i| scalar_at(p[r], dtype, i), x);
            }
            out
        }
    }

    /// How far ahead of the rows being read the kernel prefetches (bytes).
    /// Measured on the fixture (rows of 128 B to 2 KiB, matrices of 32 KiB
    /// and up read once per token from the last-level cache): decode
    /// tokens per CPU-second 380–420 without software prefetch, 560–615
    /// with 4 KiB, 575–600 with 8 KiB, 460–530 with 16 KiB.
    const PREFETCH_BYTES: usize = 8192;

    /// Rows of a group are read as one stream and prefetched ahead only
    /// while the group spans at most this many bytes (short rows: the
    /// group's rows are contiguous, the hardware prefetcher sees 8 short
    /// streams and does not ramp up). Longer rows are 8 long sequential
    /// streams, which the hardware prefetcher follows by itself.
    const PREFETCH_MAX_GROUP_BYTES: usize = 32 * 1024;

    /// The prefetch distance for `rows` (0 = none).
    fn pf_dist(rows: &RowBlock<'_>) -> usize {
        let row = rows.cols * rows.dtype.size();
        if rows.stride == row && ROWS * row <= PREFETCH_MAX_GROUP_BYTES {
            PREFETCH_BYTES
        } else {
            0
        }
    }

    /// # Safety
    /// The CPU must support AVX2; rows `first .. first + R` of `rows` lie in `rows.bytes` with at
    /// least `n` elements each, and `x.len() ≥ n`.
    #[inline(always)]
    unsafe fn block_rows<const R: usize>(rows: &RowBlock<'_>, first: usize, n: usize, x: &[f32]) -> [f32; R] {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let base = rows.bytes.as_ptr();
            let p: [*const u8; R] = std::array::from_fn(|r| base.add((first + r) * rows.stride));
            let d = pf_dist(rows);
            let pf = (d > 0).then(|| p[0].wrapping_add(d));
            rows_r::<R>(p, rows.dtype, n, x, pf)
        }
    }

    /// 8 E4M3 codes decoded exactly, divided by 2^8: each code becomes the
    /// binary16 value with the same sign, the code's 7 low bits as the low 4
    /// exponent bits and 3 mantissa bits (`sext(code) << 7`, bit 14 cleared),
    /// which is `E4M3[code] · 2^-8` exactly for normal and subnormal codes
    /// alike; the two NaN codes get an all-ones exponent (binary16 NaN);
    /// `vcvtph2ps` widens exactly. The caller multiplies by `2^8 · scale`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; the 8 bytes at `codes` must be readable.
    #[inline(always)]
    unsafe fn decode_e4m3_over_256(codes: *const u8) -> __m256 {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let c = _mm_cvtepi8_epi16(_mm_loadl_epi64(codes as *const __m128i));
            let h = _mm_and_si128(_mm_slli_epi16::<7>(c), _mm_set1_epi16(0xbfffu16 as i16));
            let body = _mm_and_si128(h, _mm_set1_epi16(0x3f80));
            let nan = _mm_cmpeq_epi16(body, _mm_set1_epi16(0x3f80));
            let h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x4000)));
            _mm256_cvtph_ps(h)
        }
    }

    /// [`decode_e4m3_over_256`] for codes other than the two NaN codes:
    /// the same binary16 bits without the NaN fix-up (for such codes the
    /// fix-up changes nothing).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; the 8 bytes at `codes` must be readable.
    #[inline(always)]
    unsafe fn decode_e4m3_finite_over_256(codes: *const u8) -> __m256 {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let c = _mm_cvtepi8_epi16(_mm_loadl_epi64(codes as *const __m128i));
            _mm256_cvtph_ps(_mm_and_si128(
                _mm_slli_epi16::<7>(c),
                _mm_set1_epi16(0xbfffu16 as i16),
            ))
        }
    }

    /// The E2M1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (index = code & 7).
    const E2M1_MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

    /// 8 MXFP4 elements from the 4 bytes at `p` (nibble j of the
    /// little-endian word = element j), each `±magnitude · s` with `table` =
    /// the magnitudes times `s` (exact: s is a power of two and positive, so
    /// the sign can be applied after scaling, −0 included).
    ///
    /// # Safety
    /// The CPU must support AVX2; the 4 bytes at `p` must be readable.
    #[inline(always)]
    unsafe fn decode_mxfp4(p: *const u8, table: __m256) -> __m256 {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let word = std::ptr::read_unaligned(p as *const i32);
            let nib = _mm256_srlv_epi32(
                _mm256_set1_epi32(word),
                _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
            );
            let mag = _mm256_permutevar8x32_ps(table, nib);
            let sign = _mm256_and_si256(_mm256_slli_epi32::<28>(nib), _mm256_set1_epi32(i32::MIN));
            _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign))
        }
    }

    /// 8 MXFP4 elements from the 4 bytes at `p` with AVX-512VL's two-table
    /// permute: `lo` = the 8 magnitudes times `s`, `hi` = their negations
    /// (exact), so nibble bit 3 (the sign) selects the table.
    ///
    /// # Safety
    /// The CPU must support AVX2, AVX-512F and AVX-512VL; the 4 bytes at `p` must be readable.
    #[inline(always)]
    unsafe fn decode_mxfp4_signed(p: *const u8, lo: __m256, hi: __m256) -> __m256 {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let word = std::ptr::read_unaligned(p as *const i32);
            let nib = _mm256_srlv_epi32(
                _mm256_set1_epi32(word),
                _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
            );
            _mm256_permutex2var_ps(lo, nib, hi)
        }
    }

    /// `acc[r] += weights(r, bb) · x[8bb .. 8bb+8]` for every block `bb` of
    /// `blocks` and row `r`, in increasing `bb` (one multiply, then one add,
    /// each rounded: the dot8 lane order), prefetching `pf` ahead: the inner
    /// loop of [`quant_r`] for every weight format, `weights` decoding row
    /// `r`'s 8 weights of block `bb` exactly.
    ///
    /// # Safety
    /// The CPU must support AVX2; `xp` points to at least `8 · blocks.end` readable `f32`, and
    /// `weights` may be called for every row and block asked.
    #[inline(always)]
    unsafe fn accumulate_blocks<const R: usize>(
        acc: &mut [__m256; R],
        blocks: std::ops::Range<usize>,
        xp: *const f32,
        pf: Option<*const u8>,
        step: usize,
        weights: impl Fn(usize, usize) -> __m256,
    ) {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            for bb in blocks {
                prefetch_quant(pf, bb * step);
                let xv = _mm256_loadu_ps(xp.add(LANES * bb));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(weights(r, bb), xv));
                }
            }
        }
    }

    /// `R` quantized rows with the same input (`VL`: AVX-512VL is available).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C, and AVX-512F and AVX-512VL when `VL`; `rows.len() ≥ R`,
    /// and each of the first `R` rows holds the codes and scales of `x.len()` elements (MXFP4:
    /// `x.len()` a multiple of 8).
    #[inline(always)]
    unsafe fn quant_r<const R: usize, const VL: bool>(
        kind: QuantRows,
        rows: &[(&[u8], &[u8])],
        x: &[f32],
        pf: Option<*const u8>,
    ) -> [f32; R] {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            use crate::quant::{E2M1_PAIRS, E4M3, FP8_BLOCK, MXFP4_GROUP};
            use crate::weights::scale_value;
            let n = x.len();
            let blocks = n / LANES;
            let xp = x.as_ptr();
            let codes: [*const u8; R] = std::array::from_fn(|r| rows[r].0.as_ptr());
            let mut acc = [_mm256_setzero_ps(); R];
            let group = match kind {
                QuantRows::Fp8 | QuantRows::Fp8Finite => FP8_BLOCK,
                QuantRows::Mxfp4 => MXFP4_GROUP,
            } / LANES;
            let mags = _mm256_loadu_ps(E2M1_MAGNITUDES.as_ptr());
            // Code bytes of one 8-element block of the R rows: one cache line
            // of FP8, half of one of MXFP4.
            let step = R * match kind {
                QuantRows::Fp8 | QuantRows::Fp8Finite => LANES,
                QuantRows::Mxfp4 => LANES / 2,
            };
            let mut b = 0;
            while b < blocks {
                let g = b / group;
                let end = ((g + 1) * group).min(blocks);
                let s: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(scale_value(rows[r].1[g])));
                match kind {
                    QuantRows::Fp8 | QuantRows::Fp8Finite => {
                        // 2^8 · scale: exact (scale codes ≤ 246, so at most 2^127);
                        // (E4M3[c] · 2^-8) · (2^8 · s) is the same exact product as E4M3[c] · s.
                        let s256: [__m256; R] =
                            std::array::from_fn(|r| _mm256_mul_ps(s[r], _mm256_set1_ps(256.0)));
                        if kind == QuantRows::Fp8Finite {
                            accumulate_blocks(&mut acc, b..end, xp, pf, step, |r, bb| {
                                _mm256_mul_ps(decode_e4m3_finite_over_256(codes[r].add(LANES * bb)), s256[r])
                            });
                        } else {
                            accumulate_blocks(&mut acc, b..end, xp, pf, step, |r, bb| {
                                _mm256_mul_ps(decode_e4m3_over_256(codes[r].add(LANES * bb)), s256[r])
                            });
                        }
                    }
                    QuantRows::Mxfp4 => {
                        let table: [__m256; R] = std::array::from_fn(|r| _mm256_mul_ps(mags, s[r]));
                        if VL {
                            let neg: [__m256; R] =
                                std::array::from_fn(|r| _mm256_xor_ps(table[r], _mm256_set1_ps(-0.0)));
                            accumulate_blocks(&mut acc, b..end, xp, pf, step, |r, bb| {
                                decode_mxfp4_signed(codes[r].add(4 * bb), table[r], neg[r])
                            });
                        } else {
                            accumulate_blocks(&mut acc, b..end, xp, pf, step, |r, bb| {
                                decode_mxfp4(codes[r].add(4 * bb), table[r])
                            });
                        }
                    }
                }
                b = end;
            }
            let mut out = [0.0f32; R];
            for r in 0..R {
                let (c, sc) = rows[r];
                out[r] = match kind {
                    QuantRows::Fp8 | QuantRows::Fp8Finite => finish(
                        acc[r],
                        blocks * LANES,
                        n,
                        |i| E4M3[usize::from(c[i])] * scale_value(sc[i / FP8_BLOCK]),
                        x,
                    ),
                    // Row lengths are multiples of 8: no tail.
                    QuantRows::Mxfp4 => finish(
                        acc[r],
                        blocks * LANES,
                        n,
                        |i| E2M1_PAIRS[usize::from(c[i / 2])][i % 2] * scale_value(sc[i / MXFP4_GROUP]),
                        x,
                    ),
                };
            }
            out
        }
    }

    /// Where the quantized kernel prefetches from: [`PREFETCH_BYTES`] past
    /// the first row, when the group's rows are consecutive in memory and
    /// span at most [`PREFETCH_MAX_GROUP_BYTES`] (the same rule as the
    /// BF16 rows: short rows read as one stream the hardware prefetcher
    /// does not ramp up on); `None` otherwise. A hint only: it cannot
    /// change a result.
    #[inline(always)]
    fn quant_prefetch_base(kind: QuantRows, rows: &[(&[u8], &[u8])], n: usize) -> Option<*const u8> {
        let row = match kind {
            QuantRows::Fp8 | QuantRows::Fp8Finite => n,
            QuantRows::Mxfp4 => n / 2,
        };
        let first = rows.first()?.0.as_ptr();
        let consecutive = rows
            .iter()
            .enumerate()
            .all(|(k, r)| std::ptr::eq(r.0.as_ptr(), first.wrapping_add(k * row)));
        (consecutive && rows.len() * row <= PREFETCH_MAX_GROUP_BYTES)
            .then(|| first.wrapping_add(PREFETCH_BYTES))
    }

    /// Prefetches the cache line `off` bytes past `pf` (nothing without `pf`).
    ///
    /// # Safety
    /// None beyond running on x86-64: a prefetch never faults, whatever `pf` points to.
    #[inline(always)]
    unsafe fn prefetch_quant(pf: Option<*const u8>, off: usize) {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            if let Some(p) = pf {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off) as *const i8);
            }
        }
    }

    /// The rows of `rows` in groups of up to `MAXR` (`VL`: AVX-512VL is available).
    ///
    /// # Safety
    /// As [`quant_r`] for every row of `rows`, and `out.len() ≥ rows.len()`.
    #[inline(always)]
    unsafe fn quant_groups<const MAXR: usize, const VL: bool>(
        kind: QuantRows,
        rows: &[(&[u8], &[u8])],
        x: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let mut i = 0;
            while i < rows.len() {
                let left = rows.len() - i;
                if MAXR >= 8 && left >= 8 {
                    let pf = quant_prefetch_base(kind, &rows[i..i + 8], x.len());
                    out[i..i + 8].copy_from_slice(&quant_r::<8, VL>(kind, &rows[i..], x, pf));
                    i += 8;
                } else if left >= 4 {
                    let pf = quant_prefetch_base(kind, &rows[i..i + 4], x.len());
                    out[i..i + 4].copy_from_slice(&quant_r::<4, VL>(kind, &rows[i..], x, pf));
                    i += 4;
                } else if left >= 2 {
                    out[i..i + 2].copy_from_slice(&quant_r::<2, VL>(kind, &rows[i..], x, None));
                    i += 2;
                } else {
                    out[i] = quant_r::<1, VL>(kind, &rows[i..], x, None)[0];
                    i += 1;
                }
            }
        }
    }

    /// # Safety
    /// AVX2 and F16C must be available; `rows.len() ≤ QUANT_ROWS ≤ out.len()`, and
    /// every row holds the codes and scales of `x.len()` elements (MXFP4:
    /// `x.len()` a multiple of 8). Groups of 4 rows: with 16 vector
    /// registers, 8 rows' accumulators and scales would spill.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dot8_quant_avx2(
        kind: QuantRows,
        rows: &[(&[u8], &[u8])],
        x: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe { quant_groups::<4, false>(kind, rows, x, out) }
    }

    /// [`dot8_quant_avx2`] compiled with AVX-512VL's 32 vector registers, 8
    /// rows at once, MXFP4 decoded with the two-table permute (sign included);
    /// the same 256-bit separate multiplies and adds.
    ///
    /// # Safety
    /// As [`dot8_quant_avx2`], and AVX-512F/VL must be available.
    #[target_feature(enable = "avx2,f16c,avx512f,avx512vl")]
    pub(super) unsafe fn dot8_quant_avx512vl(
        kind: QuantRows,
        rows: &[(&[u8], &[u8])],
        x: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe { quant_groups::<8, true>(kind, rows, x, out) }
    }

    /// # Safety
    /// AVX2 must be available; `rows` must hold `out.len()` rows of
    /// `rows.cols ≥ x.len()` elements.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dot8_rows_avx2(rows: &RowBlock<'_>, x: &[f32], out: &mut [f32]) {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let n = x.len();
            let mut i = 0;
            let d = pf_dist(rows);
            if d > 0 {
                // The first bytes of the matrix, which no iteration prefetches.
                let base = rows.bytes.as_ptr();
                let mut off = 0;
                while off < d.min(rows.bytes.len()) {
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(off) as *const i8);
                    off += 64;
                }
            }
            while i + ROWS <= out.len() {
                let v = block_rows::<ROWS>(rows, i, n, x);
                out[i..i + ROWS].copy_from_slice(&v);
                i += ROWS;
            }
            while i + 2 <= out.len() {
                let v = block_rows::<2>(rows, i, n, x);
                out[i..i + 2].copy_from_slice(&v);
                i += 2;
            }
            if i < out.len() {
                out[i] = block_rows::<1>(rows, i, n, x)[0];
            }
        }
    }

    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dot8_f32_many_avx2(rows: &[&[f32]], x: &[f32], out: &mut [f32]) {
        // SAFETY: this function's contract (its # Safety section) is the caller's.
        unsafe {
            let m = rows.len().min(out.len());
            let ptr = |j: usize| rows[j].as_ptr() as *const u8;
            // Each row with the shorter of its length and x's (dot8's rule); runs
            // of rows of equal length (the common case: every key has d elements)
            // go through the multi-row kernel.
            let len = |j: usize| rows[j].len().min(x.len());
            let mut i = 0;
            while i < m {
                let n = len(i);
                let mut run = 1;
                while i + run < m && run < 4 && len(i + run) == n {
                    run += 1;
                }
                if run == 4 {
                    let v = rows_r::<4>(
                        [ptr(i), ptr(i + 1), ptr(i + 2), ptr(i + 3)],
                        RowDType::F32,
                        n,
                        x,
                        None,
                    );
                    out[i..i + 4].copy_from_slice(&v);
                } else if run >= 2 {
                    run = 2;
                    let v = rows_r::<2>([ptr(i), ptr(i + 1)], RowDType::F32, n, x, None);
                    out[i..i + 2].copy_from_slice(&v);
                } else {
                    out[i] = rows_r::<1>([ptr(i)], RowDType::F32, n, x, None)[0];
                }
                i += run;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Serializes the tests that flip [`set_portable_only`].
    static FLAG: Mutex<()> = Mutex::new(());

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// Random f32 bit patterns, weighted towards special values.
        fn special(&mut self) -> f32 {
            const SPECIAL: [u32; 10] = [
                0x0000_0000, // +0
                0x8000_0000, // -0
                0x0000_0001, // smallest subnormal
                0x807f_ffff, // largest negative subnormal
                0x7f80_0000, // +inf
                0xff80_0000, // -inf
                0x7f7f_ffff, // largest finite
                0x0080_0000, // smallest normal
                0x3f80_0000, // 1
                0xbf80_0000, // -1
            ];
            let r = self.next();
            match r % 4 {
                0 => f32::from_bits(SPECIAL[(r >> 8) as usize % SPECIAL.len()]),
                1 => f32::from_bits((r >> 16) as u32),
                _ => ((r >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32,
            }
        }
        fn normal(&mut self) -> f32 {
            ((self.next() >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32
        }
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    fn to_bf16_words(v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    }

    /// The documented order, written out sequentially.
    fn reference(w: &[f32], x: &[f32]) -> f32 {
        let mut l = [0.0f32; 8];
        for i in 0..w.len().min(x.len()) {
            l[i % 8] += w[i] * x[i];
        }
        ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    }

    fn check_rows(rng: &mut Rng, rows: usize, cols: usize, special: bool, offset: usize) {
        let gen = |rng: &mut Rng| if special { rng.special() } else { rng.normal() };
        let x: Vec<f32> = (0..cols).map(|_| gen(rng)).collect();
        // BF16 values (the low 16 bits cleared) so both storages hold the same weights.
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| f32::from_bits(gen(rng).to_bits() & 0xffff_0000))
            .collect();
        let stride_elems = cols + (rng.next() % 3) as usize;
        for dtype in [RowDType::Bf16, RowDType::F32] {
            let size = dtype.size();
            let mut bytes = vec![0u8; offset + rows * stride_elems * size];
            for r in 0..rows {
                let row = &w[r * cols..(r + 1) * cols];
                let enc: Vec<u8> = match dtype {
                    RowDType::Bf16 => to_bf16_words(row),
                    RowDType::F32 => row.iter().flat_map(|v| v.to_le_bytes()).collect(),
                };
                let s = offset + r * stride_elems * size;
                bytes[s..s + enc.len()].copy_from_slice(&enc);
            }
            let block = RowBlock {
                bytes: &bytes[offset..],
                stride: stride_elems * size,
                cols,
                dtype,
            };
            let mut got = vec![0.0f32; rows];
            dot8_rows(&block, &x, &mut got);
            for r in 0..rows {
                let want = reference(&w[r * cols..(r + 1) * cols], &x);
                assert!(
                    same(got[r], want),
                    "{dtype:?} rows {rows} cols {cols} row {r}: {:#x} vs {:#x} ({})",
                    got[r].to_bits(),
                    want.to_bits(),
                    kernel_name()
                );
            }
        }
        // The slice form over the same FP32 rows.
        let slices: Vec<&[f32]> = w.chunks(cols.max(1)).take(rows).collect();
        let mut got = vec![0.0f32; slices.len()];
        dot8_f32_many(&slices, &x, &mut got);
        for (r, s) in slices.iter().enumerate() {
            assert!(
                same(got[r], reference(s, &x)),
                "many rows {rows} cols {cols} row {r}"
            );
        }
    }

    fn sweep() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for rows in [0usize, 1, 2, 3, 7, 8, 9, 15, 16, 17, 33] {
            for cols in [0usize, 1, 5, 7, 8, 9, 15, 16, 17, 31, 64, 100, 257] {
                for special in [false, true] {
                    check_rows(&mut rng, rows, cols, special, (rows + cols) % 3);
                }
            }
        }
    }

    #[test]
    fn simd_and_portable_kernels_equal_the_sequential_reference_bitwise() {
        let _g = FLAG.lock().unwrap_or_else(|e| e.into_inner());
        set_portable_only(false);
        sweep();
        set_portable_only(true);
        sweep();
        set_portable_only(false);
    }

    #[test]
    fn mixed_lengths_follow_dot8s_shorter_length_rule() {
        let mut rng = Rng(7);
        let x: Vec<f32> = (0..40).map(|_| rng.normal()).collect();
        let rows: Vec<Vec<f32>> = [40usize, 40, 13, 40, 0, 39, 40, 40, 40, 8, 50]
            .iter()
            .map(|&n| (0..n).map(|_| rng.normal()).collect())
            .collect();
        let slices: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let mut got = vec![0.0f32; slices.len()];
        dot8_f32_many(&slices, &x, &mut got);
        for (g, r) in got.iter().zip(&slices) {
            assert_eq!(g.to_bits(), dot8(r, &x).to_bits());
        }
    }

    #[test]
    fn rows_outside_the_storage_are_nan() {
        let bytes = vec![0u8; 2 * 8 * 3];
        let block = RowBlock {
            bytes: &bytes,
            stride: 16,
            cols: 8,
            dtype: RowDType::Bf16,
        };
        let mut out = vec![1.0f32; 5];
        dot8_rows(&block, &[1.0; 8], &mut out);
        assert_eq!(&out[..3], &[0.0, 0.0, 0.0]);
        assert!(out[3].is_nan() && out[4].is_nan());
    }

    #[test]
    fn quantized_simd_kernels_equal_the_scalar_kernels_bitwise() {
        let _g = FLAG.lock().unwrap_or_else(|e| e.into_inner());
        set_portable_only(false);
        // The AVX-512VL kernels (where available), then the AVX2 ones.
        for no_avx512 in [false, true] {
            NO_AVX512.store(no_avx512, Ordering::Relaxed);
            quantized_sweep();
        }
        NO_AVX512.store(false, Ordering::Relaxed);
    }

    fn quantized_sweep() {
        use crate::linear::{dot8_fp8, dot8_mxfp4};
        use crate::quant::{FP8_BLOCK, MXFP4_GROUP};
        let mut rng = Rng(0x51ed_2701);
        let mut checked = 0;
        for n in [
            0usize, 8, 16, 24, 32, 64, 120, 128, 136, 256, 264, 384, 1000, 1024,
        ] {
            for rows in [1usize, 2, 3, 4, 5, 7, 8] {
                let x: Vec<f32> = (0..n).map(|_| rng.special()).collect();
                // Every code, subnormal, zero and NaN codes included; scales
                // over the whole accepted range, 2^-127 (subnormal) included,
                // and (3-row cases) any code, which the SIMD kernel declines
                // above 246.
                let fp8: Vec<Vec<u8>> = (0..rows)
                    .map(|_| (0..n).map(|_| (rng.next() & 0xff) as u8).collect())
                    .collect();
                let fp8_scales: Vec<Vec<u8>> = (0..rows)
                    .map(|_| {
                        (0..n.div_ceil(FP8_BLOCK))
                            .map(|_| match rng.next() % 5 {
                                0 => 0,
                                1 => (rng.next() % 247) as u8,
                                2 if rows == 3 => (rng.next() & 0xff) as u8,
                                _ => 110 + (rng.next() % 30) as u8,
                            })
                            .collect()
                    })
                    .collect();
                let m = n / 32 * 32;
                let fp4: Vec<Vec<u8>> = (0..rows)
                    .map(|_| (0..m / 2).map(|_| (rng.next() & 0xff) as u8).collect())
                    .collect();
                let fp4_scales: Vec<Vec<u8>> = (0..rows)
                    .map(|_| {
                        (0..m / MXFP4_GROUP)
                            .map(|_| match rng.next() % 4 {
                                0 => 0,
                                1 => (rng.next() % 253) as u8,
                                _ => 115 + (rng.next() % 20) as u8,
                            })
                            .collect()
                    })
                    .collect();
                let pairs: Vec<(&[u8], &[u8])> = fp8
                    .iter()
                    .zip(&fp8_scales)
                    .map(|(c, s)| (c.as_slice(), s.as_slice()))
                    .collect();
                let mut got = vec![0.0f32; rows];
                // The NaN-free decode, on the same rows with the NaN codes replaced.
                let finite: Vec<Vec<u8>> = fp8
                    .iter()
                    .map(|r| {
                        r.iter()
                            .map(|&c| if c & 0x7f == 0x7f { c ^ 1 } else { c })
                            .collect()
                    })
                    .collect();
                let fpairs: Vec<(&[u8], &[u8])> = finite
                    .iter()
                    .zip(&fp8_scales)
                    .map(|(c, s)| (c.as_slice(), s.as_slice()))
                    .collect();
                if dot8_quant_rows(QuantRows::Fp8Finite, &fpairs, &x, &mut got) {
                    for r in 0..rows {
                        let want = dot8_fp8(&finite[r], &fp8_scales[r], &x);
                        assert!(same(got[r], want), "fp8 finite n {n} rows {rows} row {r}");
                    }
                    checked += 1;
                }
                if dot8_quant_rows(QuantRows::Fp8, &pairs, &x, &mut got) {
                    for r in 0..rows {
                        let want = dot8_fp8(&fp8[r], &fp8_scales[r], &x);
                        assert!(
                            same(got[r], want),
                            "fp8 n {n} rows {rows} row {r}: {} vs {}",
                            got[r],
                            want
                        );
                    }
                    checked += 1;
                }
                let pairs: Vec<(&[u8], &[u8])> = fp4
                    .iter()
                    .zip(&fp4_scales)
                    .map(|(c, s)| (c.as_slice(), s.as_slice()))
                    .collect();
                if dot8_quant_rows(QuantRows::Mxfp4, &pairs, &x[..m], &mut got) {
                    for r in 0..rows {
                        let want = dot8_mxfp4(&fp4[r], &fp4_scales[r], &x[..m]);
                        assert!(
                            same(got[r], want),
                            "mxfp4 n {m} rows {rows} row {r}: {} vs {}",
                            got[r],
                            want
                        );
                    }
                    checked += 1;
                }
            }
        }
        // Every E4M3 code and every E2M1 nibble alone, at every scale code:
        // x = (1, 0, ..., 0) makes the dot product the decoded weight itself.
        let mut x = vec![0.0f32; 32];
        x[0] = 1.0;
        for e in 0..=255u8 {
            for c in 0..=255u8 {
                let (codes, sc) = ([c; 32], [e]);
                let mut got = [0.0f32];
                if dot8_quant_rows(QuantRows::Fp8, &[(&codes, &sc)], &x, &mut got) {
                    assert!(same(got[0], dot8_fp8(&codes, &sc, &x)), "E4M3 {c:#04x} scale {e}");
                }
                if c & 0x7f != 0x7f && dot8_quant_rows(QuantRows::Fp8Finite, &[(&codes, &sc)], &x, &mut got) {
                    assert!(
                        same(got[0], dot8_fp8(&codes, &sc, &x)),
                        "E4M3 {c:#04x} scale {e} (finite)"
                    );
                }
                let packed = [c; 16];
                if dot8_quant_rows(QuantRows::Mxfp4, &[(&packed, &sc)], &x, &mut got) {
                    assert!(
                        same(got[0], dot8_mxfp4(&packed, &sc, &x)),
                        "E2M1 pair {c:#04x} scale {e}"
                    );
                }
                // Two rows side by side (one 512-bit register where there is
                // one): another code and another scale in the second row.
                let (c2, e2) = (c ^ 0xa5, 255 - e);
                let (codes2, sc2, packed2) = ([c2; 32], [e2], [c2; 16]);
                let mut got = [0.0f32; 2];
                if dot8_quant_rows(QuantRows::Fp8, &[(&codes, &sc), (&codes2, &sc2)], &x, &mut got) {
                    assert!(
                        same(got[0], dot8_fp8(&codes, &sc, &x)),
                        "E4M3 {c:#04x} scale {e} (row 0 of 2)"
                    );
                    assert!(
                        same(got[1], dot8_fp8(&codes2, &sc2, &x)),
                        "E4M3 {c2:#04x} scale {e2} (row 1 of 2)"
                    );
                }
                if dot8_quant_rows(
                    QuantRows::Mxfp4,
                    &[(&packed, &sc), (&packed2, &sc2)],
                    &x,
                    &mut got,
                ) {
                    assert!(
                        same(got[0], dot8_mxfp4(&packed, &sc, &x)),
                        "E2M1 {c:#04x} scale {e} (row 0 of 2)"
                    );
                    assert!(
                        same(got[1], dot8_mxfp4(&packed2, &sc2, &x)),
                        "E2M1 {c2:#04x} scale {e2} (row 1 of 2)"
                    );
                }
            }
        }
        // Rows consecutive in one buffer (the layout of a weight matrix, where
        // the kernels prefetch ahead), 8 and 4 rows per group, every length
        // ending inside and outside a block.
        for n in [13usize, 128, 130, 256, 1024, 1032, 1037] {
            for rows in [4usize, 8, 12, 16] {
                let x: Vec<f32> = (0..n).map(|_| rng.special()).collect();
                let flat: Vec<u8> = (0..rows * n).map(|_| (rng.next() & 0xff) as u8).collect();
                let scales: Vec<u8> = (0..rows * n.div_ceil(MXFP4_GROUP))
                    .map(|_| 110 + (rng.next() % 30) as u8)
                    .collect();
                let per = n.div_ceil(FP8_BLOCK);
                let fp8: Vec<(&[u8], &[u8])> = (0..rows)
                    .map(|r| (&flat[r * n..(r + 1) * n], &scales[r * per..(r + 1) * per]))
                    .collect();
                let m = n / 32 * 32;
                let gper = m / MXFP4_GROUP;
                let fp4: Vec<(&[u8], &[u8])> = (0..rows)
                    .map(|r| {
                        (
                            &flat[r * m / 2..(r + 1) * m / 2],
                            &scales[r * gper..(r + 1) * gper],
                        )
                    })
                    .collect();
                for chunk in fp8.chunks(QUANT_ROWS) {
                    let mut got = vec![0.0f32; chunk.len()];
                    if dot8_quant_rows(QuantRows::Fp8, chunk, &x, &mut got) {
                        for (r, (c, sc)) in chunk.iter().enumerate() {
                            assert!(
                                same(got[r], dot8_fp8(c, sc, &x)),
                                "contiguous fp8 n {n} rows {rows}"
                            );
                        }
                        checked += 1;
                    }
                }
                for chunk in fp4.chunks(QUANT_ROWS) {
                    let mut got = vec![0.0f32; chunk.len()];
                    if dot8_quant_rows(QuantRows::Mxfp4, chunk, &x[..m], &mut got) {
                        for (r, (c, sc)) in chunk.iter().enumerate() {
                            assert!(
                                same(got[r], dot8_mxfp4(c, sc, &x[..m])),
                                "contiguous mxfp4 n {m} rows {rows}"
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
        // On a machine without AVX2 the calls decline and the scalar kernels serve.
        assert!(checked > 0 || !simd_available());
        // Finite inputs only: the kernels also agree on ordinary values.
        for n in [128usize, 256] {
            let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
            let c: Vec<u8> = (0..n)
                .map(|i| (i * 37 % 126) as u8 | ((i as u8 & 1) << 7))
                .collect();
            let sc = vec![127u8; n.div_ceil(FP8_BLOCK)];
            let mut got = [0.0f32];
            if dot8_quant_rows(QuantRows::Fp8, &[(&c, &sc)], &x, &mut got) {
                assert_eq!(got[0].to_bits(), dot8_fp8(&c, &sc, &x).to_bits());
                assert!(got[0].is_finite());
            }
        }
    }
}
