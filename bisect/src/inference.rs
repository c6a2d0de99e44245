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

use moeconf_fingerprint::{canonical_f32_bits, CanonPolicy};
use moeconf_reference_runtime::contract::{
    all_permutations, b_class_representatives, identity_permutation, AggregationContract, OutputRounding,
};
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
    /// Whether `contract` under `perm` reproduces every element, stopping at
    /// the first mismatch.
    fn reproduces(&self, contract: &AggregationContract, perm: &[usize]) -> bool {
        let mut out = [0.0f32];
        let mut slices: Vec<&[f32]> = Vec::with_capacity(self.terms.len());
        for d in 0..self.combine.len() {
            slices.clear();
            slices.extend(self.terms.iter().map(|t| &t[d..d + 1]));
            if contract
                .try_combine_with_permutation(perm, &slices, &self.shared[d..d + 1], &mut out)
                .is_err()
            {
                return false;
            }
            if canonical_f32_bits(out[0].to_bits(), self.canon) != self.combine[d].to_bits() {
                return false;
            }
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
