//! Dot products and matrix–vector products with a fixed, documented
//! reduction order (docs/operators.md, "dot8").
//!
//! `dot8`: element i is multiplied in FP32 (no fused multiply-add) and added to
//! lane `i mod 8` (lanes start at +0, each lane accumulates in increasing i);
//! the 8 lanes are then folded as `((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`. The
//! order is plain Rust, identical on every CPU: the compiler may vectorize the
//! lanes but cannot reassociate them. BF16 weights are promoted exactly to FP32
//! on the fly (`moeconf_fingerprint::bf16_to_f32`, and its in-word form in
//! the paired kernel) inside the loop, reading the memory map directly.
//!
//! Matrix–vector products parallelize over output rows only (each row is one
//! independent `dot8`), so results do not depend on the thread count.

use moeconf_fingerprint::bf16_to_f32;
use rayon::prelude::*;

use crate::quant::{self, FP8_BLOCK, MXFP4_GROUP};
use crate::weights::{scale_value, Mat, WeightDType};

/// Number of accumulator lanes of [`dot8`].
pub const LANES: usize = 8;

/// Minimum rows·cols of a matrix–vector product before it is split over rayon
/// (smaller products finish faster than a worker wakes up on a busy 2-core machine).
pub const PAR_MIN_WORK: usize = 1 << 19;

/// Minimum multiply–adds of one expert (3·I·D) before the k + 1 expert
/// evaluations of a token run on rayon.
pub const PAR_MIN_EXPERT_WORK: usize = 1 << 18;

#[inline]
fn fold8(l: [f32; LANES]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// `dot8` of two FP32 vectors of equal length (the shorter length is used).
#[inline]
pub fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut lo = [0.0f32; 4];
    let mut hi = [0.0f32; 4];
    let blocks = n / LANES;
    for k in 0..blocks {
        let x: &[f32; LANES] = a[k * LANES..k * LANES + LANES]
            .try_into()
            .unwrap_or(&[0.0; LANES]);
        let y: &[f32; LANES] = b[k * LANES..k * LANES + LANES]
            .try_into()
            .unwrap_or(&[0.0; LANES]);
        for j in 0..4 {
            lo[j] += x[j] * y[j];
            hi[j] += x[4 + j] * y[4 + j];
        }
    }
    for i in blocks * LANES..n {
        let j = i % LANES;
        if j < 4 {
            lo[j] += a[i] * b[i];
        } else {
            hi[j - 4] += a[i] * b[i];
        }
    }
    fold8([lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]])
}

#[inline]
fn bf16_at(c: &[u8], j: usize) -> f32 {
    bf16_to_f32(u16::from_le_bytes([c[2 * j], c[2 * j + 1]]))
}

/// `dot8` of a BF16 row given as 16-bit words (little-endian storage order).
#[inline]
fn dot8_bf16_words(w: &[u16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (w, x) = (&w[..n], &x[..n]);
    let mut l = [0.0f32; LANES];
    let blocks = n / LANES;
    for b in 0..blocks {
        let c: &[u16; LANES] = w[b * LANES..b * LANES + LANES].try_into().unwrap_or(&[0; LANES]);
        let y: &[f32; LANES] = x[b * LANES..b * LANES + LANES]
            .try_into()
            .unwrap_or(&[0.0; LANES]);
        let wf: [f32; LANES] = std::array::from_fn(|j| bf16_to_f32(u16::from_le(c[j])));
        for j in 0..LANES {
            l[j] += wf[j] * y[j];
        }
    }
    for i in blocks * LANES..n {
        l[i % LANES] += bf16_to_f32(u16::from_le(w[i])) * x[i];
    }
    fold8(l)
}

/// `dot8` of a little-endian BF16 row (`2·n` bytes) with an FP32 vector.
/// Aligned rows are read as 16-bit words; unaligned rows byte by byte (same order, same result).
#[inline]
pub fn dot8_bf16(w: &[u8], x: &[f32]) -> f32 {
    if let Ok(words) = bytemuck::try_cast_slice::<u8, u16>(w) {
        return dot8_bf16_words(words, x);
    }
    dot8_le_bytes::<2>(w, x, bf16_at)
}

/// `dot8` of a little-endian row of `SIZE`-byte elements (read with `at`)
/// with an FP32 vector, element by element: the unaligned fallback of the
/// BF16 and FP32 byte kernels.
#[inline]
fn dot8_le_bytes<const SIZE: usize>(w: &[u8], x: &[f32], at: impl Fn(&[u8], usize) -> f32) -> f32 {
    let n = (w.len() / SIZE).min(x.len());
    let (w, x) = (&w[..SIZE * n], &x[..n]);
    let mut l = [0.0f32; LANES];
    let mut cw = w.chunks_exact(SIZE * LANES);
    let mut cx = x.chunks_exact(LANES);
    for (c, y) in (&mut cw).zip(&mut cx) {
        for j in 0..LANES {
            l[j] += at(c, j) * y[j];
        }
    }
    let rw = cw.remainder();
    for (j, y) in cx.remainder().iter().enumerate() {
        l[j] += at(rw, j) * y;
    }
    fold8(l)
}

#[inline]
fn f32_at(c: &[u8], j: usize) -> f32 {
    f32::from_le_bytes([c[4 * j], c[4 * j + 1], c[4 * j + 2], c[4 * j + 3]])
}

/// `dot8` of a little-endian FP32 row (`4·n` bytes) with an FP32 vector.
/// Aligned rows on little-endian hosts are read as f32 directly (same order, same result).
#[inline]
pub fn dot8_f32_bytes(w: &[u8], x: &[f32]) -> f32 {
    #[cfg(target_endian = "little")]
    if let Ok(words) = bytemuck::try_cast_slice::<u8, f32>(w) {
        return dot8(words, x);
    }
    dot8_le_bytes::<4>(w, x, f32_at)
}

/// The input vector of a BF16 matrix–vector product split into even and odd
/// elements once, so every row can be read as 32-bit words holding two BF16
/// values (low half = even element). Lane assignment and order are exactly
/// `dot8`'s: each accumulator holds one residue class of i mod 8, in increasing i.
struct SplitInput {
    even: Vec<f32>,
    odd: Vec<f32>,
    /// `x[n-1]` when n is odd.
    last: Option<f32>,
}

impl SplitInput {
    fn new(x: &[f32]) -> SplitInput {
        let pairs = x.len() / 2;
        SplitInput {
            even: (0..pairs).map(|q| x[2 * q]).collect(),
            odd: (0..pairs).map(|q| x[2 * q + 1]).collect(),
            last: if !x.len().is_multiple_of(2) {
                x.last().copied()
            } else {
                None
            },
        }
    }
}

/// `dot8` of a BF16 row stored as little-endian 32-bit words (two elements
/// each) with a [`SplitInput`]. Word q holds elements 2q (low) and 2q+1 (high);
/// element 2q belongs to class 2(q mod 4), element 2q+1 to class 2(q mod 4)+1.
///
/// The hot kernel of every BF16 linear: it widens both halves of a word in
/// place (`word << 16` for the low element, `word & 0xffff_0000` for the
/// high one), which is `moeconf_fingerprint::bf16_to_f32` of each half
/// without splitting the word into two u16 first.
#[inline]
fn dot8_bf16_pairs(w: &[u32], x: &SplitInput, tail: Option<u16>) -> f32 {
    let pairs = w.len().min(x.even.len());
    let (w, xe, xo) = (&w[..pairs], &x.even[..pairs], &x.odd[..pairs]);
    let mut ae = [0.0f32; 4];
    let mut ao = [0.0f32; 4];
    let blocks = pairs / 4;
    for b in 0..blocks {
        let ww: &[u32; 4] = w[4 * b..4 * b + 4].try_into().unwrap_or(&[0; 4]);
        let e: &[f32; 4] = xe[4 * b..4 * b + 4].try_into().unwrap_or(&[0.0; 4]);
        let o: &[f32; 4] = xo[4 * b..4 * b + 4].try_into().unwrap_or(&[0.0; 4]);
        for k in 0..4 {
            let word = u32::from_le(ww[k]);
            ae[k] += f32::from_bits(word << 16) * e[k];
            ao[k] += f32::from_bits(word & 0xffff_0000) * o[k];
        }
    }
    for q in blocks * 4..pairs {
        let word = u32::from_le(w[q]);
        ae[q % 4] += f32::from_bits(word << 16) * xe[q];
        ao[q % 4] += f32::from_bits(word & 0xffff_0000) * xo[q];
    }
    if let (Some(t), Some(xl)) = (tail, x.last) {
        ae[pairs % 4] += bf16_to_f32(t) * xl;
    }
    fold8([ae[0], ao[0], ae[1], ao[1], ae[2], ao[2], ae[3], ao[3]])
}

/// `dot8` of an FP8 E4M3 row (one code per element) with an FP32 vector, the
/// weights dequantized exactly on the fly: element i is `E4M3[code_i] · 2^(e_b − 127)`
/// with `e_b = scales[i / 128]` (the row's block-row scale codes, validated at load),
/// then multiplied with `x[i]` and added to lane `i mod 8` exactly as [`dot8`] does
/// on the dequantized row (block starts are multiples of 8, so lanes never shift).
#[inline]
pub fn dot8_fp8(codes: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let n = codes.len().min(x.len());
    let mut l = [0.0f32; LANES];
    // Each block is decoded into a buffer first (the table gather), then accumulated by the
    // same lane loop as `dot8`; the order of every product and sum is unchanged.
    let mut w = [0.0f32; FP8_BLOCK];
    for (b, (cb, xb)) in codes[..n]
        .chunks(FP8_BLOCK)
        .zip(x[..n].chunks(FP8_BLOCK))
        .enumerate()
    {
        let s = scales.get(b).map_or(f32::NAN, |&e| scale_value(e));
        for (wj, &c) in w.iter_mut().zip(cb) {
            *wj = quant::E4M3[usize::from(c)] * s;
        }
        accumulate_lanes(&mut l, &w[..cb.len()], xb);
    }
    fold8(l)
}

/// `l[i mod 8] += w[i] · x[i]` in increasing i (`w.len()` = `x.len()`, starting at a
/// multiple of 8 of the whole row): the inner loop of [`dot8`].
#[inline]
fn accumulate_lanes(l: &mut [f32; LANES], w: &[f32], x: &[f32]) {
    let mut cw = w.chunks_exact(LANES);
    let mut cx = x.chunks_exact(LANES);
    for (w8, x8) in (&mut cw).zip(&mut cx) {
        for j in 0..LANES {
            l[j] += w8[j] * x8[j];
        }
    }
    for (j, (wv, xv)) in cw.remainder().iter().zip(cx.remainder()).enumerate() {
        l[j] += wv * xv;
    }
}

/// `dot8` of an MXFP4 row (`n/2` bytes, byte k holding elements 2k (low nibble)
/// and 2k+1 (high nibble)) with an FP32 vector: element i is
/// `E2M1[nibble_i] · 2^(e_g − 127)` with `e_g = scales[i / 32]`, then the [`dot8`]
/// order on the dequantized row (each 32-element group covers whole lanes).
#[inline]
pub fn dot8_mxfp4(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let n = (2 * packed.len()).min(x.len()) & !1;
    let mut l = [0.0f32; LANES];
    let mut w = [0.0f32; MXFP4_GROUP];
    let groups = packed[..n / 2]
        .chunks(MXFP4_GROUP / 2)
        .zip(x[..n].chunks(MXFP4_GROUP));
    for (g, (pg, xg)) in groups.enumerate() {
        let s = scales.get(g).map_or(f32::NAN, |&e| scale_value(e));
        for (k, byte) in pg.iter().enumerate() {
            let [lo, hi] = quant::E2M1_PAIRS[usize::from(*byte)];
            w[2 * k] = lo * s;
            w[2 * k + 1] = hi * s;
        }
        accumulate_lanes(&mut l, &w[..2 * pg.len()], xg);
    }
    fold8(l)
}

/// The official profile's block-promoted dot product: for each block of
/// `block` consecutive elements, the partial `Σ w_i · x_i` in [`dot8`]'s lane
/// order (the lanes restart at +0 in every block), then the partials added in
/// increasing block order from +0 in FP32 — the per-K-tile promotion of
/// DeepSeek's `fp8_gemm` (block 128) and `fp4_gemm` (block 32)
/// (docs/operators.md §10.2). The reference form of [`blocked_dot_fp8`] and
/// [`blocked_dot_mxfp4`], which must give the same bits.
pub fn blocked_dot8(w: &[f32], x: &[f32], block: usize) -> f32 {
    let n = w.len().min(x.len());
    let block = block.max(1);
    w[..n]
        .chunks(block)
        .zip(x[..n].chunks(block))
        .fold(0.0f32, |acc, (wb, xb)| acc + dot8(wb, xb))
}

/// [`blocked_dot8`] with block 128 of an FP8 E4M3 row (one code per element,
/// `scales[b]` the UE8M0 code of 128-column block b) and the FP8-quantized
/// input `x`: the weights are dequantized exactly block by block. With
/// power-of-two scales, `Σ (c_i s_w)(q_i s_a)` rounds exactly as the kernel's
/// `(Σ c_i q_i) · (s_w s_a)` (no product is subnormal at these scales).
pub fn blocked_dot_fp8(codes: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let n = codes.len().min(x.len());
    let mut buf = [0.0f32; FP8_BLOCK];
    let mut acc = 0.0f32;
    for (b, (cb, xb)) in codes[..n]
        .chunks(FP8_BLOCK)
        .zip(x[..n].chunks(FP8_BLOCK))
        .enumerate()
    {
        let s = scales.get(b).map_or(f32::NAN, |&e| scale_value(e));
        for (v, &c) in buf.iter_mut().zip(cb) {
            *v = quant::E4M3[usize::from(c)] * s;
        }
        acc += dot8(&buf[..cb.len()], xb);
    }
    acc
}

/// [`blocked_dot8`] with block 32 of an MXFP4 row (`n/2` bytes, low nibble
/// the even element; `scales[g]` the UE8M0 code of 32-column group g) and the
/// FP8-quantized input `x` (`fp4_gemm`'s 32-wide K tiles).
pub fn blocked_dot_mxfp4(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let n = (2 * packed.len()).min(x.len()) & !1;
    let mut buf = [0.0f32; MXFP4_GROUP];
    let mut acc = 0.0f32;
    for (g, (pg, xg)) in packed[..n / 2]
        .chunks(MXFP4_GROUP / 2)
        .zip(x[..n].chunks(MXFP4_GROUP))
        .enumerate()
    {
        let s = scales.get(g).map_or(f32::NAN, |&e| scale_value(e));
        for (k, byte) in pg.iter().enumerate() {
            let [lo, hi] = quant::E2M1_PAIRS[usize::from(*byte)];
            buf[2 * k] = lo * s;
            buf[2 * k + 1] = hi * s;
        }
        acc += dot8(&buf[..2 * pg.len()], xg);
    }
    acc
}

/// Calls `rows(first, chunk)` for consecutive chunks of `out`, whose element
/// `i` is row `row0 + i`: in parallel chunks when the work (rows × `cols`)
/// reaches [`PAR_MIN_WORK`], else as one chunk. Rows are independent outputs,
/// each one sequential computation, so the split never changes a bit.
fn for_row_chunks(row0: usize, cols: usize, out: &mut [f32], rows: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if out.len() * cols >= PAR_MIN_WORK {
        let chunk = ((PAR_MIN_WORK / 4) / cols.max(1)).max(1);
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(ci, o)| rows(row0 + ci * chunk, o));
    } else {
        rows(row0, out);
    }
}

impl Mat {
    /// `dot8` of row `r` with `x` (`x.len()` must be `cols`).
    #[inline]
    pub fn dot_row(&self, r: usize, x: &[f32]) -> f32 {
        let bytes = self.row_bytes(r);
        match self.dtype() {
            WeightDType::Bf16 => dot8_bf16(bytes, x),
            WeightDType::F32 => dot8_f32_bytes(bytes, x),
            WeightDType::Fp8E4m3 => dot8_fp8(bytes, self.row_scales(r), x),
            WeightDType::Mxfp4 => dot8_mxfp4(bytes, self.row_scales(r), x),
        }
    }

    /// `out[i] = dot8(W[row0 + i, :], x)` for `i < out.len()`; FP32 results,
    /// no rounding (callers apply the profile's rounding point).
    pub fn matvec_rows(&self, row0: usize, x: &[f32], out: &mut [f32]) {
        debug_assert_eq!(x.len(), self.cols());
        let cols = self.cols();
        let simd_dtype = match self.dtype() {
            WeightDType::Bf16 => Some(crate::kernels::RowDType::Bf16),
            WeightDType::F32 => Some(crate::kernels::RowDType::F32),
            WeightDType::Fp8E4m3 | WeightDType::Mxfp4 => None,
        };
        if let (true, Some(dtype)) = (crate::kernels::simd_available(), simd_dtype) {
            // Several rows at a time on the SIMD kernel (same bits, crate::kernels).
            let rows = |r0: usize, o: &mut [f32]| {
                let block = crate::kernels::RowBlock {
                    bytes: self.rows_bytes(r0, o.len()),
                    stride: self.dtype().row_len(cols),
                    cols,
                    dtype,
                };
                crate::kernels::dot8_rows(&block, x, o);
            };
            for_row_chunks(row0, cols, out, rows);
            return;
        }
        let quant_kind = match self.dtype() {
            // No FP8 matrix holds a NaN code: `WeightLoader::linear`, the only
            // place that builds them, refuses 0x7F/0xFF.
            WeightDType::Fp8E4m3 => Some(crate::kernels::QuantRows::Fp8Finite),
            WeightDType::Mxfp4 => Some(crate::kernels::QuantRows::Mxfp4),
            WeightDType::Bf16 | WeightDType::F32 => None,
        };
        if let (true, Some(kind)) = (crate::kernels::simd_available(), quant_kind) {
            // Up to QUANT_ROWS rows at a time on the SIMD kernel (same bits), else row by row.
            let rows = |r0: usize, o: &mut [f32]| {
                for (ci, oc) in o.chunks_mut(crate::kernels::QUANT_ROWS).enumerate() {
                    let first = r0 + ci * crate::kernels::QUANT_ROWS;
                    let mut rs = [(&[][..], &[][..]); crate::kernels::QUANT_ROWS];
                    for (k, slot) in rs.iter_mut().take(oc.len()).enumerate() {
                        *slot = (self.row_bytes(first + k), self.row_scales(first + k));
                    }
                    if !crate::kernels::dot8_quant_rows(kind, &rs[..oc.len()], x, oc) {
                        for (k, v) in oc.iter_mut().enumerate() {
                            *v = self.dot_row(first + k, x);
                        }
                    }
                }
            };
            for_row_chunks(row0, cols, out, rows);
            return;
        }
        // BF16 rows whose storage is 4-byte aligned are read as 32-bit words.
        let split = (self.dtype() == WeightDType::Bf16 && self.words_aligned()).then(|| SplitInput::new(x));
        let row = |r: usize| -> f32 {
            match &split {
                Some(sx) => {
                    let bytes = self.row_bytes(r);
                    let (body, tail) = bytes.split_at(bytes.len() & !3);
                    let words: &[u32] = bytemuck::try_cast_slice(body).unwrap_or(&[]);
                    let t = (tail.len() == 2).then(|| u16::from_le_bytes([tail[0], tail[1]]));
                    dot8_bf16_pairs(words, sx, t)
                }
                None => self.dot_row(r, x),
            }
        };
        for_row_chunks(row0, cols, out, |r0, o| {
            for (i, v) in o.iter_mut().enumerate() {
                *v = row(r0 + i);
            }
        });
    }

    /// Full matrix–vector product `out = W·x` (FP32, unrounded).
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) {
        self.matvec_rows(0, x, &mut out[..self.rows()]);
    }

    /// Whether DeepSeek's code quantizes this matrix's input before its GEMM
    /// (`linear`, M L108–120): FP8 and FP4 weights.
    pub fn quantizes_input(&self) -> bool {
        matches!(self.dtype(), WeightDType::Fp8E4m3 | WeightDType::Mxfp4)
    }

    /// Row `r` of the official profile's GEMM with the already quantized
    /// input `xq`: [`blocked_dot_fp8`] / [`blocked_dot_mxfp4`] for FP8 / FP4
    /// weights, plain [`dot8`] for BF16/F32 weights (a BF16 GEMM without
    /// activation quantization, like DeepSeek's `F.linear`).
    #[inline]
    pub fn dot_row_official(&self, r: usize, xq: &[f32]) -> f32 {
        let bytes = self.row_bytes(r);
        match self.dtype() {
            WeightDType::Fp8E4m3 => blocked_dot_fp8(bytes, self.row_scales(r), xq),
            WeightDType::Mxfp4 => blocked_dot_mxfp4(bytes, self.row_scales(r), xq),
            WeightDType::Bf16 | WeightDType::F32 => self.dot_row(r, xq),
        }
    }

    /// The official profile's linear: `R_BF16` of [`Mat::dot_row_official`]
    /// for every row (the GEMM's BF16 output), rows in parallel as
    /// [`Mat::matvec_rows`] splits them. `xq` must already be the GEMM input
    /// site's quantized values when [`Mat::quantizes_input`].
    pub fn linear_official(&self, xq: &[f32]) -> Vec<f32> {
        debug_assert_eq!(xq.len(), self.cols());
        let mut out = vec![0.0f32; self.rows()];
        let cols = self.cols();
        let row = |r: usize| moeconf_contract::bf16::r_bf16(self.dot_row_official(r, xq));
        for_row_chunks(0, cols, &mut out, |r0, o| {
            for (i, v) in o.iter_mut().enumerate() {
                *v = row(r0 + i);
            }
        });
        out
    }

    /// Row `r` of vLLM-CPU's GEMM for a forward of `rows` tokens
    /// (docs/interop-vllm.md §4.2.5 rules 1–3; crate::vllm): FP8 weights with
    /// `ext` through `fp8_scaled_mm_cpu` ([`crate::vllm::fp8_row`]: EXT
    /// decode, block promotion or AMX); every other weight, and FP8 without
    /// `ext` (wo_a, which vLLM dequantizes exactly to a BF16 copy), as exact
    /// BF16 values through [`crate::vllm::bf16_row`]. FP32, unrounded.
    pub fn dot_row_vllm(&self, r: usize, x: &[f32], rows: usize, ext: bool) -> f32 {
        match self.dtype() {
            WeightDType::Fp8E4m3 if ext => {
                let sc = self.row_scales(r);
                let scale = |b: usize| crate::weights::scale_value(sc.get(b).copied().unwrap_or(0xFF));
                crate::vllm::fp8_row(x, self.row_bytes(r), scale, rows)
            }
            _ => {
                let w = self.row_f32(r);
                crate::vllm::bf16_row(x, |k| w[k], rows)
            }
        }
    }

    /// `out[i]` = [`Mat::dot_row_vllm`] of row `row0 + i`, unrounded, rows in
    /// parallel as [`Mat::matvec_rows`] splits them.
    pub fn matvec_rows_vllm(&self, row0: usize, x: &[f32], out: &mut [f32], rows: usize, ext: bool) {
        debug_assert_eq!(x.len(), self.cols());
        for_row_chunks(row0, self.cols(), out, |r0, o| {
            for (i, v) in o.iter_mut().enumerate() {
                *v = self.dot_row_vllm(r0 + i, x, rows, ext);
            }
        });
    }

    /// vLLM-CPU's linear for a forward of `rows` tokens: every output
    /// [`Mat::dot_row_vllm`] (EXT decode for FP8), rounded with R_BF16.
    pub fn linear_vllm(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows()];
        self.matvec_rows_vllm(0, x, &mut out, rows, true);
        for v in &mut out {
            *v = moeconf_contract::bf16::r_bf16(*v);
        }
        out
    }

    /// `W·x` as a new vector, each output rounded with the profile's rounding
    /// point; in the vllm-cpu profile vLLM's GEMM for the current forward's
    /// M ([`Mat::linear_vllm`], [`crate::vllm::forward_rows`]).
    pub fn linear(&self, x: &[f32], p: crate::precision::Precision) -> Vec<f32> {
        if p == crate::precision::Precision::VllmCpu {
            return self.linear_vllm(x, crate::vllm::forward_rows());
        }
        let mut out = vec![0.0f32; self.rows()];
        self.matvec(x, &mut out);
        p.round_slice(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r_bf16_bytes(v: f32) -> [u8; 2] {
        moeconf_contract::bf16::to_bf16_bits(v).to_le_bytes()
    }

    #[test]
    fn dot8_order_is_lane_blocked() {
        // Index 1 and index 9 share lane 1 and cancel there; lane 0 keeps 1.0.
        // A sequential sum would give ((1 + 1e8) - 1e8) = 0 instead.
        let mut a = vec![0.0f32; 10];
        a[0] = 1.0;
        a[1] = 1e8;
        a[9] = -1e8;
        let b = vec![1.0f32; 10];
        assert_eq!(dot8(&a, &b), 1.0);
        let seq: f32 = a.iter().sum();
        assert_eq!(seq, 0.0);
        // bf16 weights of 1.0 (0x3f80) give the same value through the byte path.
        let w: Vec<u8> = (0..10).flat_map(|_| 0x3f80u16.to_le_bytes()).collect();
        assert_eq!(dot8_bf16(&w, &a), 1.0);
        // Unaligned storage takes the byte path and must give the same bits.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&w);
        let wa: Vec<u8> = (0..10).flat_map(|i| r_bf16_bytes(a[i] * 0.5 + 1.0)).collect();
        let mut wb = vec![0u8];
        wb.extend_from_slice(&wa);
        assert_eq!(dot8_bf16(&wa, &a).to_bits(), dot8_bf16(&wb[1..], &a).to_bits());
        assert_eq!(dot8_bf16(&shifted[1..], &a), 1.0);
        let wf: Vec<u8> = (0..10).flat_map(|_| 1.0f32.to_le_bytes()).collect();
        assert_eq!(dot8_f32_bytes(&wf, &a), 1.0);
    }

    #[test]
    fn paired_bf16_kernel_equals_dot8_bitwise() {
        // Lengths 0..40 cover every remainder of the 8-lane blocks and odd tails.
        let mut state = 0x1234_5678u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32 - 0.5) * 8.0
        };
        for n in 0..40usize {
            let x: Vec<f32> = (0..n).map(|_| next()).collect();
            let wv: Vec<f32> = (0..n).map(|_| moeconf_contract::bf16::r_bf16(next())).collect();
            let bytes: Vec<u8> = wv.iter().flat_map(|v| r_bf16_bytes(*v)).collect();
            let mut aligned: Vec<u32> = vec![0; n.div_ceil(2)];
            bytemuck::cast_slice_mut::<u32, u8>(&mut aligned)[..2 * n].copy_from_slice(&bytes);
            let words = &aligned[..n / 2];
            let tail =
                (!n.is_multiple_of(2)).then(|| u16::from_le_bytes([bytes[2 * n - 2], bytes[2 * n - 1]]));
            let got = dot8_bf16_pairs(words, &SplitInput::new(&x), tail);
            let want = dot8(&wv, &x);
            assert_eq!(got.to_bits(), want.to_bits(), "n = {n}");
            assert_eq!(dot8_bf16(&bytes, &x).to_bits(), want.to_bits(), "n = {n}");
            // Sequential reference of the documented lane order.
            let mut l = [0.0f32; 8];
            for i in 0..n {
                l[i % 8] += wv[i] * x[i];
            }
            let fold = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
            assert_eq!(want.to_bits(), fold.to_bits(), "n = {n}");
        }
    }

    #[test]
    fn blocked_kernels_equal_the_blocked_reference_bitwise() {
        // Random codes and scales; lengths covering whole and ragged blocks.
        let mut state = 0x2545_f491u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        for n in [32usize, 64, 128, 256, 384, 96] {
            let x: Vec<f32> = (0..n)
                .map(|_| moeconf_contract::bf16::r_bf16((next() as f32 / u32::MAX as f32 - 0.5) * 4.0))
                .collect();
            let codes: Vec<u8> = (0..n).map(|_| (next() % 256) as u8 & 0xf7).collect(); // no NaN codes
            let scales: Vec<u8> = (0..n.div_ceil(FP8_BLOCK))
                .map(|_| 120 + (next() % 10) as u8)
                .collect();
            let w: Vec<f32> = (0..n)
                .map(|i| quant::e4m3_to_f32(codes[i]) * 2f32.powi(i32::from(scales[i / FP8_BLOCK]) - 127))
                .collect();
            let want = blocked_dot8(&w, &x, FP8_BLOCK);
            assert_eq!(
                blocked_dot_fp8(&codes, &scales, &x).to_bits(),
                want.to_bits(),
                "fp8 n {n}"
            );
            // The block partials are summed in order: same as summing dot8 of each slice.
            let manual = w
                .chunks(128)
                .zip(x.chunks(128))
                .fold(0.0f32, |a, (wb, xb)| a + dot8(wb, xb));
            assert_eq!(want.to_bits(), manual.to_bits());
            let packed: Vec<u8> = (0..n / 2).map(|_| (next() % 256) as u8).collect();
            let gscales: Vec<u8> = (0..n / MXFP4_GROUP).map(|_| 122 + (next() % 8) as u8).collect();
            let w4: Vec<f32> = (0..n)
                .map(|i| {
                    quant::E2M1_PAIRS[usize::from(packed[i / 2])][i % 2]
                        * 2f32.powi(i32::from(gscales[i / MXFP4_GROUP]) - 127)
                })
                .collect();
            let want4 = blocked_dot8(&w4, &x, MXFP4_GROUP);
            assert_eq!(
                blocked_dot_mxfp4(&packed, &gscales, &x).to_bits(),
                want4.to_bits(),
                "mxfp4 n {n}"
            );
        }
        // The block order is the contract: 1e8 and −1e8 in lane 0 of two blocks
        // cancel inside dot8's lane, but block 0's partial absorbs the 1 of lane 1.
        let mut w = vec![0.0f32; 256];
        let x = vec![1.0f32; 256];
        w[0] = 1e8;
        w[1] = 1.0;
        w[128] = -1e8;
        assert_eq!(dot8(&w, &x), 1.0);
        assert_eq!(blocked_dot8(&w, &x, 128), 0.0);
    }

    #[test]
    fn quantized_kernels_equal_dot8_on_the_dequantized_row_bitwise() {
        let mut state = 0x9e37_79b9u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        // FP8: lengths across block and lane boundaries, ragged last blocks included.
        for n in [0usize, 1, 7, 8, 9, 127, 128, 129, 200, 256, 300] {
            let codes: Vec<u8> = (0..n)
                .map(|_| {
                    let c = (next() & 0xFF) as u8;
                    if quant::e4m3_is_nan(c) {
                        0x38
                    } else {
                        c
                    }
                })
                .collect();
            let scales: Vec<u8> = (0..n.div_ceil(FP8_BLOCK))
                .map(|_| 120 + (next() % 12) as u8)
                .collect();
            let x: Vec<f32> = (0..n)
                .map(|_| (next() as f32 / u32::MAX as f32 - 0.5) * 4.0)
                .collect();
            let w: Vec<f32> = (0..n)
                .map(|i| quant::e4m3_to_f32(codes[i]) * 2f32.powi(i32::from(scales[i / FP8_BLOCK]) - 127))
                .collect();
            assert_eq!(
                dot8_fp8(&codes, &scales, &x).to_bits(),
                dot8(&w, &x).to_bits(),
                "fp8 n = {n}"
            );
        }
        // MXFP4: whole groups of 32 (the loader requires it), several groups.
        for n in [0usize, 32, 64, 96, 256] {
            let packed: Vec<u8> = (0..n / 2).map(|_| (next() & 0xFF) as u8).collect();
            let scales: Vec<u8> = (0..n / MXFP4_GROUP).map(|_| 118 + (next() % 16) as u8).collect();
            let x: Vec<f32> = (0..n)
                .map(|_| (next() as f32 / u32::MAX as f32 - 0.5) * 4.0)
                .collect();
            let w: Vec<f32> = (0..n)
                .map(|i| {
                    let b = packed[i / 2];
                    let nib = if i % 2 == 0 { b & 0xF } else { b >> 4 };
                    quant::e2m1_to_f32(nib) * 2f32.powi(i32::from(scales[i / MXFP4_GROUP]) - 127)
                })
                .collect();
            assert_eq!(
                dot8_mxfp4(&packed, &scales, &x).to_bits(),
                dot8(&w, &x).to_bits(),
                "mxfp4 n = {n}"
            );
        }
    }
}
