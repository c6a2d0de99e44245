//! Contract inference: which aggregation contract and order reproduces a
//! recorded `moe.combine` output bitwise from the recorded routed terms and
//! shared-expert output of the same trace?
//!
//! Candidates, in the order they are reported: the native contract (C, identity
//! order); then, first with the BF16 output rounding and, only if nothing
//! matched, with the FP32 output: P32, C and A under all k! orders
//! (lexicographic permutation indices), B under its k!/2 structural classes
//! (the first-pair quotient: both members of a class give identical bits),
//! the pairwise tree, the exact sum and the FP64 accumulator (identity order).
//! Each candidate is evaluated element by element and abandoned at its first
//! mismatching element, so most of the ~2 500 candidates for k = 6 cost a few
//! element evaluations. Orders are enumerated for k ≤ [`MAX_INFERENCE_K`].

use moeconf_contract::{
    all_permutations, b_class_representatives, identity_permutation, prove_invariance, AggregationContract,
    OutputRounding,
};
use moeconf_fingerprint::{canonical_f32_bits, CanonPolicy};
use serde::Serialize;

/// Largest number of routed terms whose orders are enumerated (8! = 40 320).
pub const MAX_INFERENCE_K: usize = 8;

/// Most matching orders listed per scheme (the count is always complete).
pub const MAX_LISTED_ORDERS: usize = 16;

/// How a scheme's orders are numbered in a [`SchemeMatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderKind {
    /// Only the identity (selection) order was tried.
    Identity,
    /// Lexicographic permutation indices in `0..k!`.
    PermutationIndex,
    /// B structural classes in `0..k!/2`.
    BClass,
}

/// The orders of one scheme that reproduce the output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SchemeMatch {
    /// Scheme name as the contract parser reads it (`b`, `p32+output=f32`, `native`, …).
    pub scheme: String,
    /// How `orders` are numbered.
    pub order_kind: OrderKind,
    /// Matching orders (at most [`MAX_LISTED_ORDERS`]), ascending.
    pub orders: Vec<u64>,
    /// Number of matching orders.
    pub matching: u64,
    /// Number of orders tried.
    pub tried: u64,
}

impl SchemeMatch {
    /// `scheme B, class 135`, `scheme A, orders index:3, index:9 (2 of 720)`, `scheme exact`.
    pub fn explain(&self) -> String {
        let name = match self.scheme.as_str() {
            "native" => "native (C, identity order)".to_string(),
            s => {
                format!("scheme {}", s.split('+').next().unwrap_or(s).to_uppercase())
                    + &self
                        .scheme
                        .find('+')
                        .map(|i| self.scheme[i..].to_string())
                        .unwrap_or_default()
            }
        };
        let (one, many) = match self.order_kind {
            OrderKind::Identity => return name,
            OrderKind::PermutationIndex => ("order index", "order indices"),
            OrderKind::BClass => ("class", "classes"),
        };
        if self.matching == self.tried && self.tried > 1 {
            return format!(
                "{name}, any order (all {} {many} reproduce it: order-invariant on these terms)",
                self.tried
            );
        }
        let list: Vec<String> = self.orders.iter().map(|o| o.to_string()).collect();
        if self.matching == 1 {
            return format!("{name}, {one} {}", list.join(", "));
        }
        let more = if self.matching as usize > self.orders.len() {
            ", …"
        } else {
            ""
        };
        let (label, count) = (many, format!(" ({} of {})", self.matching, self.tried));
        format!("{name}, {label} {}{more}{count}", list.join(", "))
    }
}

/// Result of inferring the contract of one combine event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Inference {
    /// Number of routed terms.
    pub k: usize,
    /// Elements per term.
    pub elements: usize,
    /// Every scheme with at least one matching order, in the order tried.
    pub matches: Vec<SchemeMatch>,
    /// Whether the native contract (C, identity order) reproduces the output.
    pub native: bool,
}

impl Inference {
    /// The simplest explanation (the first match), e.g. `scheme B, class 135`.
    pub fn explain(&self) -> Option<String> {
        self.matches.first().map(SchemeMatch::explain)
    }
}

struct Event<'a> {
    terms: &'a [Vec<f32>],
    shared: &'a [f32],
    combine: &'a [f32],
    canon: CanonPolicy,
}

impl Event<'_> {
    /// Whether `contract` under `perm` reproduces every element. Elements are
    /// evaluated in growing chunks (1, 8, 64, 512, then 4096 at a time) and
    /// the evaluation stops at the first chunk with a mismatch: a wrong order
    /// almost always fails on the first element, a right one costs one
    /// contract call per chunk.
    fn reproduces(&self, contract: &AggregationContract, perm: &[usize]) -> bool {
        let d = self.combine.len();
        let mut out: Vec<f32> = Vec::new();
        let mut slices: Vec<&[f32]> = Vec::with_capacity(self.terms.len());
        let (mut start, mut len) = (0usize, 1usize);
        while start < d {
            let end = (start + len).min(d);
            slices.clear();
            slices.extend(self.terms.iter().map(|t| &t[start..end]));
            out.clear();
            out.resize(end - start, 0.0);
            if contract
                .try_combine_with_permutation(perm, &slices, &self.shared[start..end], &mut out)
                .is_err()
            {
                return false;
            }
            let same = out
                .iter()
                .zip(&self.combine[start..end])
                .all(|(o, y)| canonical_f32_bits(o.to_bits(), self.canon) == y.to_bits());
            if !same {
                return false;
            }
            start = end;
            len = (len * 8).min(4096);
        }
        true
    }

    fn scheme(
        &self,
        name: String,
        contract: &AggregationContract,
        orders: &[Vec<usize>],
        kind: OrderKind,
    ) -> Option<SchemeMatch> {
        // When every partial sum of every order is provably exact, all orders
        // give the same bits: evaluate one and count all (the static proof of
        // the contract's order-sensitivity certificate).
        if orders.len() > 1 {
            let refs: Vec<&[f32]> = self.terms.iter().map(|t| t.as_slice()).collect();
            if prove_invariance(contract, &refs, self.combine.len()).is_some() {
                let all = self.reproduces(contract, &orders[0]);
                return all.then(|| SchemeMatch {
                    scheme: name,
                    order_kind: kind,
                    orders: (0..orders.len().min(MAX_LISTED_ORDERS) as u64).collect(),
                    matching: orders.len() as u64,
                    tried: orders.len() as u64,
                });
            }
        }
        let mut listed = Vec::new();
        let mut matching = 0u64;
        for (i, perm) in orders.iter().enumerate() {
            if self.reproduces(contract, perm) {
                matching += 1;
                if listed.len() < MAX_LISTED_ORDERS {
                    listed.push(i as u64);
                }
            }
        }
        (matching > 0).then_some(SchemeMatch {
            scheme: name,
            order_kind: kind,
            orders: listed,
            matching,
            tried: orders.len() as u64,
        })
    }
}

/// Infers the contract of one combine event from its `terms` (selection
/// order), `shared` output and recorded `combine` output. Returns `None` when
/// the lengths disagree, there are no terms, or k exceeds
/// [`MAX_INFERENCE_K`] (only then is enumeration refused).
pub fn infer(terms: &[Vec<f32>], shared: &[f32], combine: &[f32], canon: CanonPolicy) -> Option<Inference> {
    let k = terms.len();
    let d = combine.len();
    if k == 0 || k > MAX_INFERENCE_K || shared.len() != d || terms.iter().any(|t| t.len() != d) {
        return None;
    }
    let ev = Event {
        terms,
        shared,
        combine,
        canon,
    };
    let identity = vec![identity_permutation(k)];
    let perms = all_permutations(k).ok()?;
    let classes = b_class_representatives(k).ok()?;
    let native = ev.reproduces(&AggregationContract::native(), &identity[0]);
    let mut matches = Vec::new();
    if native {
        matches.push(SchemeMatch {
            scheme: "native".into(),
            order_kind: OrderKind::Identity,
            orders: vec![0],
            matching: 1,
            tried: 1,
        });
    }
    for output in [OutputRounding::Bf16, OutputRounding::F32] {
        let found_before = matches.len();
        for preset in ["p32", "c", "a", "b", "tree", "exact", "f64"] {
            let Some(mut contract) = AggregationContract::from_preset_name(preset) else {
                continue;
            };
            contract.output = output;
            let name = contract.describe();
            let m = match preset {
                "p32" | "c" | "a" => ev.scheme(name, &contract, &perms, OrderKind::PermutationIndex),
                "b" => ev.scheme(name, &contract, &classes, OrderKind::BClass),
                _ => ev.scheme(name, &contract, &identity, OrderKind::Identity),
            };
            matches.extend(m);
        }
        if matches.len() > found_before || native {
            break;
        }
    }
    Some(Inference {
        k,
        elements: d,
        matches,
        native,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeconf_contract::{b_class_representative, Order};

    fn terms(seed: u64, k: usize, d: usize) -> Vec<Vec<f32>> {
        let mut x = seed;
        (0..k)
            .map(|_| {
                (0..d)
                    .map(|_| {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn names_the_b_class_and_the_native_contract() {
        let t = terms(1, 6, 64);
        let shared: Vec<f32> = terms(2, 1, 64).remove(0);
        let refs: Vec<&[f32]> = t.iter().map(|v| v.as_slice()).collect();
        let mut y = vec![0.0; 64];
        let b = AggregationContract::b().with_order(Order::BClass(135));
        b.try_combine(&refs, &shared, &mut y).unwrap();
        let inf = infer(&t, &shared, &y, CanonPolicy::default()).unwrap();
        assert!(!inf.native);
        assert_eq!(inf.explain().as_deref(), Some("scheme B, class 135"));
        assert_eq!(b_class_representative(6, 135).unwrap().len(), 6);
        AggregationContract::native()
            .try_combine(&refs, &shared, &mut y)
            .unwrap();
        let inf = infer(&t, &shared, &y, CanonPolicy::default()).unwrap();
        assert!(inf.native);
        assert_eq!(inf.explain().as_deref(), Some("native (C, identity order)"));
    }

    #[test]
    fn order_invariant_terms_match_every_order_through_the_proof() {
        // Small integers: every partial sum is exact in every accumulator, so
        // all 720 orders of P32 reproduce the output (and the proof says so).
        let t: Vec<Vec<f32>> = (0..6)
            .map(|j| (0..32).map(|i| ((i * 7 + j * 3) % 11) as f32).collect())
            .collect();
        let shared = vec![1.0f32; 32];
        let refs: Vec<&[f32]> = t.iter().map(|v| v.as_slice()).collect();
        let mut y = vec![0.0; 32];
        AggregationContract::p32()
            .try_combine(&refs, &shared, &mut y)
            .unwrap();
        let inf = infer(&t, &shared, &y, CanonPolicy::default()).unwrap();
        assert!(inf.native, "exact sums: native gives the same bits");
        let p32 = inf.matches.iter().find(|m| m.scheme == "p32").unwrap();
        assert_eq!((p32.matching, p32.tried), (720, 720));
        assert!(p32.explain().contains("any order"));
        let b = inf.matches.iter().find(|m| m.scheme == "b").unwrap();
        assert_eq!(b.matching, 360);
    }
}
