//! Exactness certificate: is a contract order-invariant on given terms?
//!
//! [`order_sensitivity`] evaluates a contract family (operand, accumulator,
//! shape, output; its own order is ignored) under all k! permutations and
//! counts the bitwise-distinct outputs. Independently it tries to **prove**
//! order invariance from the exact sum ([`InvarianceProof`]):
//!
//! * the [`Accumulator::Exact`] and [`Accumulator::ExactFused`] accumulators are
//!   order-invariant by construction;
//! * otherwise, for each element, let `u_j` be the operand-rounded terms and
//!   `q` the smallest power of two dividing all nonzero `u_j` (their common
//!   quantum). Every partial sum of every order and tree shape is a subset sum,
//!   an integer multiple of `q` of magnitude at most `S = Σ|u_j|`. If
//!   `S/q ≤ 2^p` (p = 24 for FP32, 8 for BF16, 53 for FP64), `S < 2^128`, and
//!   (BF16 only) `q ≥ 2^−133`, every partial sum is exactly representable in
//!   the accumulator, so every addition and rounding is exact and every order
//!   yields the exact sum; an exact zero is +0 in every order (a +0 start
//!   never produces −0 by addition, and a tree's final `+0 ⊕ root` maps a −0
//!   root to +0). Equal `a_k` give equal merged outputs. Non-finite operands
//!   prevent the proof (except for the exact accumulators).
//!
//! The proof is a sufficient condition: an unproven set may still be
//! invariant, which the enumeration then shows.

use std::collections::HashSet;

use rayon::prelude::*;

use super::error::ContractError;
use super::order::{factorial, permutation_from_index};
use super::spec::{Accumulator, AggregationContract, OperandPrecision};
use crate::bf16::r_bf16;

/// The largest k [`order_sensitivity`] enumerates (8! = 40 320 orders).
pub const MAX_CERTIFIED_K: usize = 8;

/// Why a contract is proven order-invariant on a set of terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvarianceProof {
    /// The accumulator is the exact sum rounded once.
    ExactAccumulator,
    /// Every subset sum of every element is exactly representable in the
    /// accumulator of `precision_bits` significand bits.
    AllPartialSumsExact {
        /// Significand precision of the accumulator (24, 8 or 53).
        precision_bits: u32,
    },
}

/// Result of [`order_sensitivity`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Certificate {
    /// Number of orders evaluated: k!.
    pub orders: usize,
    /// Number of bitwise-distinct output vectors over all orders.
    pub distinct_outputs: usize,
    /// Number of output elements whose bits differ between at least two orders.
    pub sensitive_elements: usize,
    /// The static proof of order invariance from the exact sum, if one applies.
    pub proof: Option<InvarianceProof>,
}

impl Certificate {
    /// Whether all k! orders give the same output bits.
    pub fn is_order_invariant(&self) -> bool {
        self.distinct_outputs == 1
    }
}

/// Evaluates `family` under all k! permutations of `terms` (k = `terms.len()`
/// ≤ [`MAX_CERTIFIED_K`]) and reports distinct outputs and the static proof.
/// Orders are evaluated in parallel but collected in index order, so the
/// result does not depend on the thread count.
pub fn order_sensitivity(
    family: &AggregationContract,
    terms: &[&[f32]],
    shared: &[f32],
) -> Result<Certificate, ContractError> {
    let k = terms.len();
    if k > MAX_CERTIFIED_K {
        return Err(ContractError::TooManyTerms {
            k,
            what: "the order-sensitivity certificate",
            max: MAX_CERTIFIED_K,
        });
    }
    let d = shared.len();
    let orders = factorial(k).unwrap_or(1);
    // Evaluate in chunks to bound memory by distinct outputs plus one chunk.
    const CHUNK: u64 = 256;
    let mut distinct: HashSet<Vec<u32>> = HashSet::new();
    let mut first: Option<Vec<u32>> = None;
    let mut sensitive = vec![false; d];
    let mut start = 0u64;
    while start < orders {
        let end = (start + CHUNK).min(orders);
        let outs: Vec<Vec<u32>> = (start..end)
            .into_par_iter()
            .map(|i| -> Result<Vec<u32>, ContractError> {
                let perm = permutation_from_index(k, i)?;
                let mut out = vec![0.0f32; d];
                family.try_combine_with_permutation(&perm, terms, shared, &mut out)?;
                Ok(out.iter().map(|x| x.to_bits()).collect())
            })
            .collect::<Result<_, _>>()?;
        for o in outs {
            let f = first.get_or_insert_with(|| o.clone());
            for ((s, a), b) in sensitive.iter_mut().zip(f.iter()).zip(&o) {
                *s |= a != b;
            }
            distinct.insert(o);
        }
        start = end;
    }
    Ok(Certificate {
        orders: orders as usize,
        distinct_outputs: distinct.len(),
        sensitive_elements: sensitive.iter().filter(|&&s| s).count(),
        proof: prove_invariance(family, terms, d),
    })
}

/// The static order-invariance proof of the module docs, if it applies to
/// every element.
pub fn prove_invariance(family: &AggregationContract, terms: &[&[f32]], d: usize) -> Option<InvarianceProof> {
    let (precision_bits, min_quantum_exp) = match family.accumulator {
        Accumulator::Exact | Accumulator::ExactFused => return Some(InvarianceProof::ExactAccumulator),
        Accumulator::F32 => (24u32, -149i32),
        Accumulator::Bf16 => (8, -133),
        Accumulator::F64 => (53, -1074),
    };
    for e in 0..d {
        // (significand, exponent of its least significant set bit) per nonzero operand.
        let mut parts: Vec<(u64, i32)> = Vec::with_capacity(terms.len());
        for t in terms {
            let v = *t.get(e)?;
            let u = match family.operand {
                OperandPrecision::F32 => v,
                OperandPrecision::Bf16 => r_bf16(v),
            };
            if !u.is_finite() {
                return None;
            }
            let bits = u.to_bits();
            let exp_field = ((bits >> 23) & 0xff) as i32;
            let frac = u64::from(bits & 0x007f_ffff);
            let (sig, exp) = if exp_field == 0 {
                (frac, -149)
            } else {
                (frac | 0x0080_0000, exp_field - 150)
            };
            if sig == 0 {
                continue;
            }
            let tz = sig.trailing_zeros();
            parts.push((sig >> tz, exp + tz as i32));
        }
        let Some(q) = parts.iter().map(|&(_, x)| x).min() else {
            continue; // all zeros: every order gives +0
        };
        if q < min_quantum_exp {
            return None;
        }
        // S/q = Σ sig · 2^(exp − q); each must stay ≤ 2^p, so shifts ≤ p.
        let mut units: u128 = 0;
        for &(sig, exp) in &parts {
            let shift = (exp - q) as u32;
            if shift > precision_bits {
                return None;
            }
            units += u128::from(sig) << shift;
        }
        if units > 1u128 << precision_bits {
            return None;
        }
        // S = units · 2^q < 2^128  ⇔  log2(units) + q < 128.
        let log2_ceil = 128 - (units - 1).leading_zeros() as i32; // ceil(log2 units) for units ≥ 1
        if log2_ceil + q > 127 {
            return None;
        }
    }
    Some(InvarianceProof::AllPartialSumsExact { precision_bits })
}
