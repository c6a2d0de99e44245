//! Dot products and matrix–vector products with a fixed, documented
//! reduction order (docs/operators.md, "dot8").
//!
//! `dot8`: element i is multiplied in FP32 (no fused multiply-add) and added to
//! lane `i mod 8` (lanes start at +0, each lane accumulates in increasing i);
//! the 8 lanes are then folded as `((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`. The
//! order is plain Rust, identical on every CPU: the compiler may vectorize the
//! lanes but cannot reassociate them. BF16 weights are promoted exactly to FP32
//! on the fly (`bits << 16`) inside the loop, reading the memory map directly.
//!
//! Matrix–vector products parallelize over output rows only (each row is one
//! independent `dot8`), so results do not depend on the thread count.

use rayon::prelude::*;

use crate::weights::{Mat, WeightDType};

/// Number of accumulator lanes of [`dot8`].
pub const LANES: usize = 8;

/// Minimum rows·cols of a matrix–vector product before it is split over rayon.
pub const PAR_MIN_WORK: usize = 1 << 16;

#[inline]
fn fold8(l: [f32; LANES]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// `dot8` of two FP32 vectors of equal length (the shorter length is used).
#[inline]
pub fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut l = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..LANES {
            l[j] += x[j] * y[j];
        }
    }
    for (j, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        l[j] += x * y;
    }
    fold8(l)
}

#[inline]
fn bf16_at(c: &[u8], j: usize) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([c[2 * j], c[2 * j + 1]])) << 16)
}

/// `dot8` of a little-endian BF16 row (`2·n` bytes) with an FP32 vector.
#[inline]
pub fn dot8_bf16(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 2).min(x.len());
    let (w, x) = (&w[..2 * n], &x[..n]);
    let mut l = [0.0f32; LANES];
    let mut cw = w.chunks_exact(2 * LANES);
    let mut cx = x.chunks_exact(LANES);
    for (c, y) in (&mut cw).zip(&mut cx) {
        for j in 0..LANES {
            l[j] += bf16_at(c, j) * y[j];
        }
    }
    let rw = cw.remainder();
    for (j, y) in cx.remainder().iter().enumerate() {
        l[j] += bf16_at(rw, j) * y;
    }
    fold8(l)
}

#[inline]
fn f32_at(c: &[u8], j: usize) -> f32 {
    f32::from_le_bytes([c[4 * j], c[4 * j + 1], c[4 * j + 2], c[4 * j + 3]])
}

/// `dot8` of a little-endian FP32 row (`4·n` bytes) with an FP32 vector.
#[inline]
pub fn dot8_f32_bytes(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 4).min(x.len());
    let (w, x) = (&w[..4 * n], &x[..n]);
    let mut l = [0.0f32; LANES];
    let mut cw = w.chunks_exact(4 * LANES);
    let mut cx = x.chunks_exact(LANES);
    for (c, y) in (&mut cw).zip(&mut cx) {
        for j in 0..LANES {
            l[j] += f32_at(c, j) * y[j];
        }
    }
    let rw = cw.remainder();
    for (j, y) in cx.remainder().iter().enumerate() {
        l[j] += f32_at(rw, j) * y;
    }
    fold8(l)
}

impl Mat {
    /// `dot8` of row `r` with `x` (`x.len()` must be `cols`).
    #[inline]
    pub fn dot_row(&self, r: usize, x: &[f32]) -> f32 {
        let bytes = self.row_bytes(r);
        match self.dtype() {
            WeightDType::Bf16 => dot8_bf16(bytes, x),
            WeightDType::F32 => dot8_f32_bytes(bytes, x),
        }
    }

    /// `out[i] = dot8(W[row0 + i, :], x)` for `i < out.len()`; FP32 results,
    /// no rounding (callers apply the profile's rounding point).
    pub fn matvec_rows(&self, row0: usize, x: &[f32], out: &mut [f32]) {
        debug_assert_eq!(x.len(), self.cols());
        if out.len() * self.cols() >= PAR_MIN_WORK {
            let chunk = (PAR_MIN_WORK / self.cols().max(1)).max(1);
            out.par_chunks_mut(chunk).enumerate().for_each(|(ci, o)| {
                for (i, v) in o.iter_mut().enumerate() {
                    *v = self.dot_row(row0 + ci * chunk + i, x);
                }
            });
        } else {
            for (i, v) in out.iter_mut().enumerate() {
                *v = self.dot_row(row0 + i, x);
            }
        }
    }

    /// Full matrix–vector product `out = W·x` (FP32, unrounded).
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) {
        self.matvec_rows(0, x, &mut out[..self.rows()]);
    }

    /// `W·x` as a new vector, each output rounded with the profile's rounding point.
    pub fn linear(&self, x: &[f32], p: crate::precision::Precision) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows()];
        self.matvec(x, &mut out);
        p.round_slice(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let wf: Vec<u8> = (0..10).flat_map(|_| 1.0f32.to_le_bytes()).collect();
        assert_eq!(dot8_f32_bytes(&wf, &a), 1.0);
    }
}
