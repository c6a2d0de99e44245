//! The reproducing set of one event: matching variants and orders, the
//! simplest member, the equivalents.

use super::*;
use crate::named::{EventContext, OrderGroup, NAMED_ORDERS, NAMED_SHAPES};
use crate::order::{b_class_of, index_of_permutation, permutation_from_index};
use crate::spec::{Accumulator, AggregationContract, Order, Shape};

/// A named order that reproduces the output, with the permutation it gives at the event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderMatch {
    /// The named leaf order.
    pub order: Order,
    /// Its permutation of the slots at this event.
    pub permutation: Vec<usize>,
}

/// The sequential permutations of one variant that reproduce the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermutationMatches {
    /// Number of routed terms k.
    pub k: usize,
    /// k!: permutations tried.
    pub tried: u64,
    /// How many reproduce the output.
    pub matching: u64,
    /// The first matching lexicographic indices (at most [`MAX_LISTED_PERMUTATIONS`]).
    pub listed: Vec<u64>,
    pub(crate) bits: Vec<u64>,
}

impl PermutationMatches {
    /// Whether the permutation with lexicographic index `i` reproduces the output.
    pub fn contains(&self, i: u64) -> bool {
        self.bits
            .get((i / 64) as usize)
            .is_some_and(|w| w >> (i % 64) & 1 == 1)
    }
}

/// How order-insensitive a matching variant is on this event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invariance {
    /// Every order tried reproduces the output and the partial-sum proof
    /// holds at every element (or the accumulator is exact).
    Proven,
    /// Every order tried reproduces the output, without a proof.
    Observed,
}

/// One variant (contract without its order) with at least one reproducing order.
#[derive(Debug, Clone, PartialEq)]
pub struct VariantMatch {
    /// The variant: every field but the order (which is `identity` here).
    pub family: AggregationContract,
    /// Other spellings that give identical bits on every input, with the reason.
    pub aliases: Vec<(AggregationContract, Reason)>,
    /// Set when this variant was not evaluated itself because on this data
    /// it gives the same bits as another: that variant and why.
    pub evaluated_as: Option<(AggregationContract, Vec<Reason>)>,
    /// The named orders that reproduce the output.
    pub named: Vec<OrderMatch>,
    /// For the sequential shape with enumerated permutations: which reproduce it.
    pub permutations: Option<PermutationMatches>,
    /// Set when every order tried reproduces the output.
    pub invariance: Option<Invariance>,
}

impl VariantMatch {
    /// The simplest reproducing member of this variant (its first named
    /// order, else its lowest permutation index, written as its B class for
    /// a sequential B-like family: [`AggregationContract::is_b_like`]).
    pub fn best(&self) -> AggregationContract {
        let order = match (self.named.first(), &self.permutations) {
            (Some(m), _) => m.order.clone(),
            (None, Some(p)) => self.explicit_order(p.k, p.listed.first().copied().unwrap_or(0)),
            (None, None) => Order::Identity,
        };
        self.family.clone().with_order(order)
    }

    /// The permutation with lexicographic index `i` as this variant's
    /// reports write it: a B class for a sequential B-like family (both
    /// members of a class give the same bits, [`Reason::FirstPairCommutes`]),
    /// else the index.
    pub fn explicit_order(&self, k: usize, i: u64) -> Order {
        explicit_order(&self.family, k, i)
    }

    /// The reproducing explicit orders listed (at most
    /// [`MAX_LISTED_PERMUTATIONS`] permutations), as [`VariantMatch::explicit_order`]
    /// writes them, without repeats (the two members of a B class are one entry).
    pub fn listed_orders(&self) -> Vec<Order> {
        let Some(p) = &self.permutations else {
            return Vec::new();
        };
        let mut out: Vec<Order> = Vec::new();
        for &i in &p.listed {
            let o = self.explicit_order(p.k, i);
            if !out.contains(&o) {
                out.push(o);
            }
        }
        out
    }

    /// Every reproducing member with a named order.
    pub fn named_contracts(&self) -> Vec<AggregationContract> {
        self.named
            .iter()
            .map(|m| self.family.clone().with_order(m.order.clone()))
            .collect()
    }
}

/// A grammar member that does not reproduce the output, with how many values differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NearMiss {
    /// The contract (with its named order).
    pub contract: AggregationContract,
    /// Output values whose bits differ from the observed ones.
    pub differing: usize,
    /// The largest distance of a differing value from the observed one, in
    /// ulps of the output format (`None` when a NaN is involved).
    pub max_ulps: Option<u64>,
}

/// Another reproducing member and why it cannot be told apart from the simplest.
#[derive(Debug, Clone, PartialEq)]
pub struct Equivalent {
    /// The member.
    pub contract: AggregationContract,
    /// Why it gives the same bits as the simplest member here.
    pub reasons: Vec<Reason>,
}

/// The set of grammar members that reproduce one event.
#[derive(Debug, Clone, PartialEq)]
pub struct EventExplanation {
    /// Number of routed terms.
    pub k: usize,
    /// Output values D.
    pub elements: usize,
    pub facts: DataFacts,
    /// The named orders resolved at the event, grouped where they coincide.
    pub orders: Vec<OrderGroup>,
    /// Every reproducing variant, simplest first.
    pub matches: Vec<VariantMatch>,
    /// (variant, order) candidates evaluated.
    pub candidates: u64,
    /// When nothing reproduces the output: the closest named-order members.
    pub closest: Vec<NearMiss>,
    /// When nothing reproduces the output: the output read as scaled terms
    /// and shared output ([`fit_event`]).
    pub fit: Option<Fit>,
}

impl EventExplanation {
    /// Whether some member reproduces the output.
    pub fn explained(&self) -> bool {
        !self.matches.is_empty()
    }

    /// The simplest reproducing member ([`simplicity`]).
    pub fn simplest(&self) -> Option<AggregationContract> {
        self.matches.first().map(VariantMatch::best)
    }

    /// Every other reproducing member with a named order (every variant's
    /// named orders; a variant reproduced only by explicit permutations
    /// contributes its best one) and the structural aliases of every variant
    /// (with its best order), each with why it is indistinguishable from the
    /// simplest on this event.
    pub fn equivalents(&self) -> Vec<Equivalent> {
        let Some(best) = self.simplest() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, m) in self.matches.iter().enumerate() {
            let named = m.named_contracts();
            let mut members: Vec<AggregationContract> = if named.is_empty() { vec![m.best()] } else { named };
            if i == 0 {
                members.retain(|c| *c != best);
            }
            let order = if i == 0 {
                best.order.clone()
            } else {
                m.best().order
            };
            for (alias, reason) in &m.aliases {
                if *reason != Reason::ExactIgnoresOrder {
                    members.push(alias.clone().with_order(order.clone()));
                }
            }
            for c in members {
                let rel = match (self.resolve(&best.order), self.resolve(&c.order)) {
                    (Some(p), Some(q)) => OrderRelation::of(&p, &q),
                    _ => OrderRelation::Other,
                };
                out.push(Equivalent {
                    reasons: why(&best, &c, &self.facts, rel),
                    contract: c,
                });
            }
        }
        out
    }

    /// The permutation the named order `o` gives at this event, borrowed.
    pub(crate) fn permutation_of(&self, o: &Order) -> Option<&[usize]> {
        self.orders
            .iter()
            .find(|g| g.orders.contains(o))
            .map(|g| g.permutation.as_slice())
    }

    /// The permutation of any order at this event (named orders as resolved
    /// here, explicit ones for this k).
    fn resolve(&self, o: &Order) -> Option<Vec<usize>> {
        if o.is_named() {
            self.permutation_of(o).map(<[usize]>::to_vec)
        } else {
            o.resolve(self.k).ok()
        }
    }

    /// Whether `contract` (with its order resolved at this event's context)
    /// is in the reproducing set. Orders that were not tried (a non-sequential
    /// shape over an explicit permutation, or permutations beyond the
    /// enumeration limit) count as not in the set.
    pub fn contains(&self, contract: &AggregationContract, ctx: &EventContext<'_>) -> bool {
        let family = normalized(&contract.clone().with_order(Order::Identity));
        let Some(m) = self.matches.iter().find(|m| m.family == family) else {
            return false;
        };
        if m.family.accumulator == Accumulator::Exact {
            return true;
        }
        let Ok(perm) = contract.order.resolve_in(self.k, Some(ctx)) else {
            return false;
        };
        if m.named.iter().any(|o| o.permutation == perm) {
            return true;
        }
        match &m.permutations {
            Some(p) => index_of_permutation(&perm).is_ok_and(|i| p.contains(i)),
            None => false,
        }
    }

    /// Every reproducing member with a named order (and, for the exact
    /// accumulator, its single order): the rules a trace tallies.
    /// Structural aliases (other spellings of a variant, except the exact
    /// accumulator's shapes and starts) are included with the same orders.
    pub fn rules(&self) -> Vec<AggregationContract> {
        let mut out = Vec::new();
        for m in &self.matches {
            let named = m.named_contracts();
            for (alias, reason) in &m.aliases {
                if *reason != Reason::ExactIgnoresOrder {
                    out.extend(named.iter().map(|c| alias.clone().with_order(c.order.clone())));
                }
            }
            out.extend(named);
        }
        out
    }
}

/// The permutation of k slots with lexicographic index `i` as reports write
/// it for `family`: its B class for a sequential B-like family (both members
/// of a class give the same bits, [`Reason::FirstPairCommutes`]), else
/// `index:i`.
pub fn explicit_order(family: &AggregationContract, k: usize, i: u64) -> Order {
    if family.is_b_like() && family.shape == Shape::Sequential {
        if let Some(c) = permutation_from_index(k, i)
            .ok()
            .and_then(|p| b_class_of(&p).ok())
        {
            return Order::BClass(c);
        }
    }
    Order::PermutationIndex(i)
}

/// The simplicity key of a grammar member (smaller is simpler; see the module docs).
pub fn simplicity(c: &AggregationContract) -> (u8, u8, [u8; 7], u64) {
    let native = AggregationContract::c();
    let deviations = [
        c.operand != native.operand,
        c.accumulator != native.accumulator,
        c.shape != native.shape,
        c.start != native.start,
        c.shared != native.shared,
        c.routed != native.routed,
        c.output != native.output,
    ]
    .iter()
    .filter(|&&d| d)
    .count() as u8;
    let shape_rank = NAMED_SHAPES
        .iter()
        .position(|s| *s == c.shape)
        .unwrap_or(NAMED_SHAPES.len()) as u8;
    let fields = [
        op_index(c.operand) as u8,
        c.accumulator as u8,
        shape_rank,
        c.start as u8,
        c.shared as u8,
        c.routed as u8,
        c.output as u8,
    ];
    let (explicit, rank) = match NAMED_ORDERS.iter().position(|o| *o == c.order) {
        Some(i) => (0, i as u64),
        None => {
            let index = match &c.order {
                Order::PermutationIndex(i) => *i,
                Order::Permutation(p) => index_of_permutation(p).unwrap_or(u64::MAX),
                Order::BClass(b) => *b,
                _ => u64::MAX,
            };
            (1, index)
        }
    };
    (explicit, deviations, fields, rank)
}
