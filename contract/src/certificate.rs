//! Exactness certificate: is a contract order-invariant on given terms?
//!
//! [`order_sensitivity`] evaluates a contract family (operand, accumulator,
//! shape, output; its own order is ignored) under all k! permutations and
//! counts the bitwise-distinct outputs. Independently it tries to **prove**
//! order invariance from the exact sum ([`InvarianceProof`]):
//!
//! * the [`Accumulator::Exact`] accumulator is order-invariant by construction;
//! * otherwise, for each element, let `u_j` be the operand-rounded terms (and
//!   `s`, when the shared expert is summed in the accumulator) and `q` the
//!   smallest power of two dividing all nonzero `u_j` (their common quantum). Every partial sum of every order and tree shape is a subset sum,
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
use super::spec::{Accumulator, AggregationContract, SharedMerge};

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
        proof: prove_invariance_with_shared(family, terms, Some(shared), d),
    })
}

/// The static order-invariance proof of the module docs, if it applies to
/// every element. A family that sums the shared expert in its accumulator
/// needs `shared` ([`prove_invariance_with_shared`]); without it no proof is
/// given for such a family (except the exact accumulator).
pub fn prove_invariance(family: &AggregationContract, terms: &[&[f32]], d: usize) -> Option<InvarianceProof> {
    prove_invariance_with_shared(family, terms, None, d)
}

/// [`prove_invariance`] with the shared expert output, which is one more
/// operand of the subset sums when the family sums it in the accumulator.
pub fn prove_invariance_with_shared(
    family: &AggregationContract,
    terms: &[&[f32]],
    shared: Option<&[f32]>,
    d: usize,
) -> Option<InvarianceProof> {
    let precision_bits = match family.accumulator {
        Accumulator::Exact => return Some(InvarianceProof::ExactAccumulator),
        Accumulator::F32 => 24u32,
        Accumulator::Bf16 => 8,
        Accumulator::F64 => 53,
    };
    let in_acc = family.shared != SharedMerge::Separate;
    if in_acc && shared.is_none() {
        return None;
    }
    let mut ops: Vec<f32> = Vec::with_capacity(terms.len() + 1);
    for e in 0..d {
        ops.clear();
        for t in terms {
            ops.push(crate::kernel::operand(family.operand, *t.get(e)?));
        }
        if in_acc {
            ops.push(*shared?.get(e)?);
        }
        if !partial_sums_exact(&ops, precision_bits) {
            return None;
        }
    }
    Some(InvarianceProof::AllPartialSumsExact { precision_bits })
}

/// Whether every subset sum of `ops` is exactly representable in a binary
/// floating-point format with `precision_bits` significand bits and the
/// exponent range of its container (24: FP32, 8: BF16 in FP32's range with
/// the subnormal quantum 2^−133, 53: FP64): the module docs' proof for one
/// element. Then every order, association and zero start gives the exact sum.
pub fn partial_sums_exact(ops: &[f32], precision_bits: u32) -> bool {
    let min_quantum_exp = match precision_bits {
        8 => -133,
        24 => -149,
        _ => -1074,
    };
    // (significand, exponent of its least significant set bit) per nonzero operand.
    let mut q = i32::MAX;
    let mut n = 0usize;
    let mut parts = [(0u64, 0i32); 16];
    let mut spill: Vec<(u64, i32)> = Vec::new();
    for &u in ops {
        if !u.is_finite() {
            return false;
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
        let part = (sig >> tz, exp + tz as i32);
        q = q.min(part.1);
        if n < parts.len() {
            parts[n] = part;
        } else {
            spill.push(part);
        }
        n += 1;
    }
    if n == 0 {
        return true; // all zeros: every order gives the same zero
    }
    if q < min_quantum_exp {
        return false;
    }
    // S/q = Σ sig · 2^(exp − q); each must stay ≤ 2^p, so shifts ≤ p.
    let mut units: u128 = 0;
    for &(sig, exp) in parts[..n.min(parts.len())].iter().chain(&spill) {
        let shift = (exp - q) as u32;
        if shift > precision_bits {
            return false;
        }
        units += u128::from(sig) << shift;
    }
    if units > 1u128 << precision_bits {
        return false;
    }
    // S = units · 2^q < 2^128  ⇔  log2(units) + q < 128.
    let log2_ceil = 128 - (units - 1).leading_zeros() as i32; // ceil(log2 units) for units ≥ 1
    log2_ceil + q <= 127
}
