//! Reduction orders: permutations of the k routed terms, their lexicographic
//! index, and the B structural classes of the first-pair symmetry (paper
//! section 2.6).
//!
//! # Conventions
//!
//! * A permutation `perm` of `0..k` lists the **term consumed at each step**:
//!   the routed reduction is `a_0 = +0`, `a_{j+1} = Accumulate(a_j, v[perm[j]])`
//!   (paper section 2.4.1, `π_j = perm[j]`). Terms are indexed in selection
//!   order, i.e. the order in which the runtime passes them.
//! * **Permutation index**: the rank of `perm` in the lexicographic order of
//!   all k! permutations of `0..k` (factorial number system / Lehmer code).
//!   Index 0 is the identity `[0, 1, …, k−1]`, index k!−1 the reversal. For
//!   k = 3: 0 = `[0,1,2]`, 1 = `[0,2,1]`, 2 = `[1,0,2]`, 3 = `[1,2,0]`,
//!   4 = `[2,0,1]`, 5 = `[2,1,0]`.
//! * **B structural classes**: for k ≥ 2, two permutations that differ only
//!   by swapping their first two entries give bitwise identical B outputs
//!   (`0 ⊕ x = x` and `x ⊕ y = y ⊕ x`), so the k! permutations fall into k!/2
//!   classes of exactly two. The canonical representative of a class is its
//!   member with `perm[0] < perm[1]`; class ids `0..k!/2` number the
//!   representatives in lexicographic order (so class 0 is the identity). For
//!   k < 2 there is a single class, id 0, holding the single permutation.

use super::error::ContractError;

/// The largest k whose k! fits in a `u64` (20! ≈ 2.4·10^18).
pub const MAX_INDEXED_K: usize = 20;

/// k!, or `None` if it does not fit in a `u64` (k > 20).
pub fn factorial(k: usize) -> Option<u64> {
    (1..=k as u64).try_fold(1u64, |acc, i| acc.checked_mul(i))
}

fn factorial_checked(k: usize) -> Result<u64, ContractError> {
    factorial(k).ok_or(ContractError::TooManyTerms {
        k,
        what: "permutation indices",
        max: MAX_INDEXED_K,
    })
}

/// Checks that `perm` is a permutation of `0..k`.
pub fn validate_permutation(k: usize, perm: &[usize]) -> Result<(), ContractError> {
    let bad = || ContractError::NotAPermutation {
        k,
        perm: perm.to_vec(),
    };
    if perm.len() != k {
        return Err(bad());
    }
    let mut seen = vec![false; k];
    for &p in perm {
        match seen.get_mut(p) {
            Some(s) if !*s => *s = true,
            _ => return Err(bad()),
        }
    }
    Ok(())
}

/// The identity permutation `[0, 1, …, k−1]`.
pub fn identity_permutation(k: usize) -> Vec<usize> {
    (0..k).collect()
}

/// The permutation of `0..k` with lexicographic index `index` (0 = identity).
pub fn permutation_from_index(k: usize, index: u64) -> Result<Vec<usize>, ContractError> {
    let count = factorial_checked(k)?;
    if index >= count {
        return Err(ContractError::IndexOutOfRange { k, index, count });
    }
    let mut available: Vec<usize> = (0..k).collect();
    let mut rest = index;
    let mut perm = Vec::with_capacity(k);
    for i in 0..k {
        // (k-1-i)! ≤ k! fits, checked above.
        let f = factorial(k - 1 - i).unwrap_or(1);
        let digit = (rest / f) as usize;
        rest %= f;
        perm.push(available.remove(digit));
    }
    Ok(perm)
}

/// The lexicographic index of a permutation of `0..perm.len()` (inverse of
/// [`permutation_from_index`]).
pub fn index_of_permutation(perm: &[usize]) -> Result<u64, ContractError> {
    let k = perm.len();
    validate_permutation(k, perm)?;
    factorial_checked(k)?;
    let mut index = 0u64;
    for (i, &p) in perm.iter().enumerate() {
        let smaller_after = perm[i + 1..].iter().filter(|&&q| q < p).count() as u64;
        index += smaller_after * factorial(k - 1 - i).unwrap_or(1);
    }
    Ok(index)
}

/// The number of B structural classes: k!/2 for k ≥ 2, 1 for k < 2.
pub fn b_class_count(k: usize) -> Result<u64, ContractError> {
    let f = factorial_checked(k)?;
    Ok(if k < 2 { 1 } else { f / 2 })
}

/// The canonical representative of `perm`'s B class: `perm` with its first
/// two entries sorted ascending.
pub fn b_canonical(perm: &[usize]) -> Vec<usize> {
    let mut p = perm.to_vec();
    if p.len() >= 2 && p[0] > p[1] {
        p.swap(0, 1);
    }
    p
}

/// Number of ordered pairs `(a', b')` with `a' < b' < k` that precede `(a, b)`
/// lexicographically (requires `a < b < k`).
fn rep_pairs_before(k: usize, a: usize, b: usize) -> u64 {
    let (k, a, b) = (k as u64, a as u64, b as u64);
    a * (k - 1) - a * a.saturating_sub(1) / 2 + (b - a - 1)
}

/// The B structural class id of `perm` (see the module docs for the
/// numbering). `perm` and the permutation with its first two entries swapped
/// have the same class.
pub fn b_class_of(perm: &[usize]) -> Result<u64, ContractError> {
    let k = perm.len();
    validate_permutation(k, perm)?;
    factorial_checked(k)?;
    if k < 2 {
        return Ok(0);
    }
    let rep = b_canonical(perm);
    let suffix_count = factorial(k - 2).unwrap_or(1);
    // The suffix rank is the lexicographic index modulo (k−2)!: the first two
    // entries only select the block of (k−2)! permutations.
    let suffix_rank = index_of_permutation(&rep)? % suffix_count;
    Ok(rep_pairs_before(k, rep[0], rep[1]) * suffix_count + suffix_rank)
}

/// The canonical representative (the member with `perm[0] < perm[1]`) of B
/// class `class` for k terms.
pub fn b_class_representative(k: usize, class: u64) -> Result<Vec<usize>, ContractError> {
    let count = b_class_count(k)?;
    if class >= count {
        return Err(ContractError::ClassOutOfRange { k, class, count });
    }
    if k < 2 {
        return Ok(identity_permutation(k));
    }
    let suffix_count = factorial(k - 2).unwrap_or(1);
    let mut pair_rank = class / suffix_count;
    let suffix_rank = class % suffix_count;
    let mut pair = (0, 1);
    for a in 0..k - 1 {
        let with_a = (k - 1 - a) as u64;
        if pair_rank < with_a {
            pair = (a, a + 1 + pair_rank as usize);
            break;
        }
        pair_rank -= with_a;
    }
    let rest: Vec<usize> = (0..k).filter(|&x| x != pair.0 && x != pair.1).collect();
    let suffix = permutation_from_index(k - 2, suffix_rank)?;
    let mut perm = vec![pair.0, pair.1];
    perm.extend(suffix.into_iter().map(|i| rest[i]));
    Ok(perm)
}

/// The largest k for which [`all_permutations`] and [`b_class_representatives`]
/// enumerate (10! = 3 628 800 permutations).
pub const MAX_ENUMERATED_K: usize = 10;

/// Refuses k above [`MAX_ENUMERATED_K`] for `what`.
fn enumerable(k: usize, what: &'static str) -> Result<(), ContractError> {
    if k > MAX_ENUMERATED_K {
        return Err(ContractError::TooManyTerms {
            k,
            what,
            max: MAX_ENUMERATED_K,
        });
    }
    Ok(())
}

/// All k! permutations of `0..k` in lexicographic order (element i has index i).
pub fn all_permutations(k: usize) -> Result<Vec<Vec<usize>>, ContractError> {
    enumerable(k, "enumerating permutations")?;
    let count = factorial_checked(k)?;
    (0..count).map(|i| permutation_from_index(k, i)).collect()
}

/// The canonical representatives of all B classes, element i being class i.
pub fn b_class_representatives(k: usize) -> Result<Vec<Vec<usize>>, ContractError> {
    enumerable(k, "enumerating B classes")?;
    let count = b_class_count(k)?;
    (0..count).map(|c| b_class_representative(k, c)).collect()
}
