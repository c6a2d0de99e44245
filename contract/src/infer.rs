//! Equivalence-aware contract inference: which grammar members (contract ×
//! named order) reproduce an observed MoE combine output bitwise, which of
//! them is the simplest, and why the others cannot be told apart on this data.
//!
//! # Candidates
//!
//! Every *variant* (terms × accumulator × start × shape × shared merge ×
//! routed rounding × output; [`grammar_variants`]) is tried, after two
//! reductions that never lose a member:
//!
//! * **structural**: variants that give identical bits on every input
//!   (k ≥ 1) are tried once, as their [`normalized`] representative, and the
//!   others are reported as its aliases ([`Reason::is_structural`]);
//! * **this data**: when every routed term is BF16-valued, FP32 terms equal
//!   BF16 terms; when no operand is ±0 or tiny, `start=first` equals
//!   `start=zero` ([`DataFacts`]). Such a variant is reported as a match of
//!   its own, with the reason and the variant it was evaluated as.
//!
//! Orders: for the sequential shape every permutation of the k slots
//! (k ≤ [`InferOptions::max_permutation_k`]; lexicographic indices, the
//! named orders among them), otherwise the named orders of
//! [`crate::NAMED_ORDERS`] resolved at the event. The exact accumulator has a
//! single order (it is order-free).
//!
//! # Cost
//!
//! Each candidate is evaluated element by element and dropped at its first
//! mismatching element. Two further cuts keep order-insensitive data cheap:
//! at an element where every subset sum of the operands is exact in the
//! accumulator ([`crate::partial_sums_exact`]) all orders give the same bits,
//! so one evaluation decides for all of them; and for a sequential variant
//! whose operands are exact in its accumulator and whose first two operands
//! are routed terms, a permutation and its first-pair swap give the same bits
//! (the paper's B classes, which hold for P32, C and FP64 too), so only the
//! member with `perm[0] < perm[1]` is evaluated. Variants run in parallel and
//! are collected in a fixed order: results do not depend on threads.
//!
//! # Simplest
//!
//! [`simplicity`] orders grammar members: a named order before an explicit
//! permutation; then fewer fields that differ from the native contract `c`
//! (terms bf16, accumulator f32, sequential, start zero, shared separate,
//! routed f32, output bf16); then, field by field, the values in the order
//! the enums list them (terms bf16 before f32; accumulator f32, bf16, f64,
//! exact; shapes in [`crate::NAMED_SHAPES`] order; shared separate, last,
//! first; …); then the order ([`crate::NAMED_ORDERS`] order, then the
//! permutation index).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use rayon::prelude::*;

use super::certificate::partial_sums_exact;
use super::error::ContractError;
use super::kernel::{leaves, operand, Plan, PlanRef, Scratch};
use super::named::{order_groups, EventContext, OrderGroup, NAMED_ORDERS, NAMED_SHAPES};
use super::order::{all_permutations, b_canonical, b_class_of, index_of_permutation, permutation_from_index};
use super::spec::{
    Accumulator, AggregationContract, OperandPrecision, Order, OutputRounding, RoutedRounding, Shape,
    SharedMerge, Start,
};
use crate::bf16::r_bf16;

/// Largest k for which every permutation of the sequential shape is tried
/// by default (8! = 40 320).
pub const MAX_PERMUTATION_K: usize = 8;

/// Matching permutation indices listed per variant (the count is always complete).
pub const MAX_LISTED_PERMUTATIONS: usize = 16;

/// One MoE combine event as observed: everything in router slot order.
#[derive(Debug, Clone, Copy)]
pub struct Observation<'a> {
    /// The k gate-weighted routed terms, each of length D.
    pub terms: &'a [&'a [f32]],
    /// The shared expert output, length D.
    pub shared: &'a [f32],
    /// The observed MoE output, length D.
    pub output: &'a [f32],
    /// Expert id of each slot (empty if unknown: the expert-id orders are not tried).
    pub experts: &'a [u32],
    /// Gate weight of each slot (empty if unknown: the gate orders are not tried).
    pub gates: &'a [f32],
}

/// Options of [`explain_event`].
#[derive(Clone, Copy)]
pub struct InferOptions<'a> {
    /// Maps a computed output's bits to the bits the observation would hold
    /// (for example the trace's NaN canonicalization); identity if `None`.
    pub canonicalize: Option<&'a (dyn Fn(u32) -> u32 + Sync)>,
    /// Largest k for which every sequential permutation is tried (beyond it,
    /// only the named orders). At most [`crate::MAX_ENUMERATED_K`].
    pub max_permutation_k: usize,
    /// How many near misses to report when nothing matches.
    pub closest: usize,
}

impl Default for InferOptions<'_> {
    fn default() -> Self {
        InferOptions {
            canonicalize: None,
            max_permutation_k: MAX_PERMUTATION_K,
            closest: 5,
        }
    }
}

impl std::fmt::Debug for InferOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InferOptions")
            .field("canonicalize", &self.canonicalize.is_some())
            .field("max_permutation_k", &self.max_permutation_k)
            .field("closest", &self.closest)
            .finish()
    }
}

/// Why two grammar members give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// On every input: the shared expert added last into a sequential FP32
    /// chain (or a BF16 chain with BF16 output) is the separate merge.
    SharedLastIsSeparate,
    /// On every input: the result of a BF16 accumulator is BF16-valued, so
    /// rounding it to BF16 again (`routed=bf16`, or the output rounding when
    /// the shared expert is in the accumulator) changes nothing.
    RoutedRoundingIsIdentity,
    /// On every input: the exact accumulator ignores order, shape and start.
    ExactIgnoresOrder,
    /// On every input: two orders that differ only in their first pair give
    /// the same bits when the operands are exact in the accumulator
    /// (`0 ⊕ x = x`, `x ⊕ y = y ⊕ x`; the paper's B classes).
    FirstPairCommutes,
    /// On this data: every routed term is BF16-valued, so FP32 and BF16 terms are the same operands.
    TermsBf16Valued,
    /// On this data: no operand is ±0 or tiny, so starting from `+0` or from
    /// the first operand never differs (they can only differ in a zero's sign).
    NoZeroOperands,
    /// On this data: every subset sum of every element's operands is exact
    /// in an accumulator of this many significand bits, so every order and
    /// every wider accumulator give the exact sum.
    PartialSumsExact {
        /// 8 (BF16), 24 (FP32) or 53 (FP64).
        precision_bits: u32,
    },
    /// On this data: the FP32 output is BF16-valued, so a final R_BF16 changes nothing.
    OutputBf16Valued,
    /// On this data: the two named orders give the same permutation.
    SameOrder,
    /// On this data: every value agrees, for no general reason moeconf knows.
    AgreeOnData,
}

impl Reason {
    /// Whether the reason holds on every input (not only on this data).
    pub fn is_structural(&self) -> bool {
        matches!(
            self,
            Reason::SharedLastIsSeparate
                | Reason::RoutedRoundingIsIdentity
                | Reason::ExactIgnoresOrder
                | Reason::FirstPairCommutes
        )
    }

    /// A stable snake_case identifier for reports (`terms_bf16_valued`, …).
    pub fn code(&self) -> &'static str {
        match self {
            Reason::SharedLastIsSeparate => "shared_last_is_separate",
            Reason::RoutedRoundingIsIdentity => "routed_rounding_is_identity",
            Reason::ExactIgnoresOrder => "exact_ignores_order",
            Reason::FirstPairCommutes => "first_pair_commutes",
            Reason::TermsBf16Valued => "terms_bf16_valued",
            Reason::NoZeroOperands => "no_zero_operands",
            Reason::PartialSumsExact { precision_bits: 8 } => "partial_sums_exact_bf16",
            Reason::PartialSumsExact { precision_bits: 24 } => "partial_sums_exact_f32",
            Reason::PartialSumsExact { .. } => "partial_sums_exact_f64",
            Reason::OutputBf16Valued => "output_bf16_valued",
            Reason::SameOrder => "same_order",
            Reason::AgreeOnData => "agree_on_data",
        }
    }

    /// The reason in words.
    pub fn text(&self) -> String {
        match self {
            Reason::SharedLastIsSeparate => {
                "the shared expert added last into the sequential chain is the separate merge (identical on every input)".into()
            }
            Reason::RoutedRoundingIsIdentity => {
                "a BF16 accumulator's result is already BF16-valued, so a further R_BF16 (routed=bf16, or the output rounding when the shared expert is in the accumulator) changes nothing (identical on every input)".into()
            }
            Reason::ExactIgnoresOrder => "the exact accumulator ignores order, shape and start (identical on every input)".into(),
            Reason::FirstPairCommutes => {
                "orders that differ only in their first pair give the same bits when the operands are exact in the accumulator (identical on every input)".into()
            }
            Reason::TermsBf16Valued => {
                "every routed term is BF16-valued, so FP32 terms and BF16-rounded terms are the same operands".into()
            }
            Reason::NoZeroOperands => {
                "no operand is ±0 or tiny, so starting from +0 or from the first operand gives the same bits".into()
            }
            Reason::PartialSumsExact { precision_bits } => format!(
                "every partial sum of every element is exact in {} (proof), so every order and every wider accumulator give the exact sum",
                match precision_bits {
                    8 => "BF16",
                    24 => "FP32",
                    _ => "FP64",
                }
            ),
            Reason::OutputBf16Valued => "the FP32 output is BF16-valued, so the final R_BF16 changes nothing".into(),
            Reason::SameOrder => "the two orders give the same permutation".into(),
            Reason::AgreeOnData => "they agree on every value of this data (no general reason)".into(),
        }
    }
}

/// Properties of an event's data that make grammar members indistinguishable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataFacts {
    /// Every routed term is BF16-valued (R_BF16 leaves its bits unchanged).
    pub terms_bf16: bool,
    /// No term (in either operand precision) and no shared value is ±0, below
    /// 2^−100 in magnitude or non-finite.
    pub zero_free: bool,
    /// Every observed output value is BF16-valued.
    pub output_bf16: bool,
    /// `exact[operand][shared in accumulator][precision]`: at every element
    /// every subset sum of the operands is exact (precision 0 = BF16, 1 =
    /// FP32, 2 = FP64; operand 0 = BF16 terms, 1 = FP32 terms).
    exact: [[[bool; 3]; 2]; 2],
}

impl DataFacts {
    /// Facts that hold on no data (the identity of [`DataFacts::and`] is [`DataFacts::all`]).
    pub fn all() -> DataFacts {
        DataFacts {
            terms_bf16: true,
            zero_free: true,
            output_bf16: true,
            exact: [[[true; 3]; 2]; 2],
        }
    }

    /// The facts that hold on both data sets.
    pub fn and(&self, o: &DataFacts) -> DataFacts {
        let mut exact = self.exact;
        for (a, b) in exact
            .iter_mut()
            .flatten()
            .flatten()
            .zip(o.exact.iter().flatten().flatten())
        {
            *a &= *b;
        }
        DataFacts {
            terms_bf16: self.terms_bf16 && o.terms_bf16,
            zero_free: self.zero_free && o.zero_free,
            output_bf16: self.output_bf16 && o.output_bf16,
            exact,
        }
    }

    /// Whether every subset sum of every element's operands (`operand`
    /// terms, plus `s` if `with_shared`) is exact in the accumulator with
    /// `precision_bits` significand bits (8, 24 or 53).
    pub fn partial_sums_exact(
        &self,
        operand: OperandPrecision,
        with_shared: bool,
        precision_bits: u32,
    ) -> bool {
        self.exact[op_index(operand)][usize::from(with_shared)][prec_index(precision_bits)]
    }
}

fn op_index(o: OperandPrecision) -> usize {
    match o {
        OperandPrecision::Bf16 => 0,
        OperandPrecision::F32 => 1,
    }
}

fn prec_index(bits: u32) -> usize {
    match bits {
        8 => 0,
        24 => 1,
        _ => 2,
    }
}

const PRECISIONS: [u32; 3] = [8, 24, 53];

/// Significand bits of an accumulator (exact: `None`).
fn acc_bits(a: Accumulator) -> Option<u32> {
    match a {
        Accumulator::Bf16 => Some(8),
        Accumulator::F32 => Some(24),
        Accumulator::F64 => Some(53),
        Accumulator::Exact => None,
    }
}

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
    bits: Vec<u64>,
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
    /// The data's properties.
    pub facts: DataFacts,
    /// The named orders resolved at the event, grouped where they coincide.
    pub orders: Vec<OrderGroup>,
    /// Every reproducing variant, simplest first.
    pub matches: Vec<VariantMatch>,
    /// (variant, order) candidates evaluated.
    pub candidates: u64,
    /// When nothing reproduces the output: the closest named-order members.
    pub closest: Vec<NearMiss>,
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

    fn permutation_of(&self, o: &Order) -> Option<Vec<usize>> {
        self.orders
            .iter()
            .find(|g| g.orders.contains(o))
            .map(|g| g.permutation.clone())
    }

    /// The permutation of any order at this event (named orders as resolved
    /// here, explicit ones for this k).
    fn resolve(&self, o: &Order) -> Option<Vec<usize>> {
        if o.is_named() {
            self.permutation_of(o)
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

/// The structural representative of a contract: the member that gives
/// identical bits on every input with k ≥ 1 routed terms and is tried by
/// inference. Rules: the exact accumulator ignores shape, order and start
/// (`shared=first` becomes `last`); a BF16 accumulator makes `routed=bf16`
/// the identity, and with the shared expert in it the output rounding
/// (`output=f32` becomes `bf16`); in the sequential shape, `shared=last` is `separate` for
/// the FP32 accumulator and for the BF16 accumulator with BF16 output.
pub fn normalized(c: &AggregationContract) -> AggregationContract {
    let mut n = c.clone();
    if n.accumulator == Accumulator::Exact {
        n.shape = Shape::Sequential;
        n.order = Order::Identity;
        n.start = Start::Zero;
        if n.shared == SharedMerge::First {
            n.shared = SharedMerge::Last;
        }
    }
    if n.accumulator == Accumulator::Bf16 {
        n.routed = RoutedRounding::F32;
        if n.shared != SharedMerge::Separate {
            n.output = OutputRounding::Bf16;
        }
    }
    let last_is_separate = n.accumulator == Accumulator::F32
        || (n.accumulator == Accumulator::Bf16 && n.output == OutputRounding::Bf16);
    if n.shape == Shape::Sequential && n.shared == SharedMerge::Last && last_is_separate {
        n.shared = SharedMerge::Separate;
    }
    n
}

/// The structural reason `c` and [`normalized`]`(c)` agree (`None` if equal).
fn normalization_reason(c: &AggregationContract) -> Option<Reason> {
    normalization_reasons(c).into_iter().next()
}

/// Every structural reason `c` and [`normalized`]`(c)` differ by (empty if equal).
fn normalization_reasons(c: &AggregationContract) -> Vec<Reason> {
    let n = normalized(c);
    let mut r = Vec::new();
    if n == *c {
        return r;
    }
    if c.accumulator == Accumulator::Exact {
        r.push(Reason::ExactIgnoresOrder);
        return r;
    }
    if c.routed != n.routed || c.output != n.output {
        r.push(Reason::RoutedRoundingIsIdentity);
    }
    if c.shared != n.shared {
        r.push(Reason::SharedLastIsSeparate);
    }
    r
}

/// One grammar variant tried by inference, with its structural aliases.
#[derive(Debug, Clone)]
struct GrammarVariant {
    family: AggregationContract,
    aliases: Vec<(AggregationContract, Reason)>,
}

/// Every variant of the grammar inference tries (normalized representatives,
/// order `identity`): terms × accumulator × start × shape in
/// [`crate::NAMED_SHAPES`] × shared × routed × output, invalid combinations
/// (`routed=bf16` with the shared expert in the accumulator) left out.
pub fn grammar_variants() -> Vec<AggregationContract> {
    variants().iter().map(|v| v.family.clone()).collect()
}

fn variants() -> &'static [GrammarVariant] {
    static VARIANTS: OnceLock<Vec<GrammarVariant>> = OnceLock::new();
    VARIANTS.get_or_init(|| {
        let mut out: Vec<GrammarVariant> = Vec::new();
        for shape in NAMED_SHAPES {
            for operand in [OperandPrecision::Bf16, OperandPrecision::F32] {
                for accumulator in [
                    Accumulator::F32,
                    Accumulator::Bf16,
                    Accumulator::F64,
                    Accumulator::Exact,
                ] {
                    for start in [Start::Zero, Start::First] {
                        for shared in [SharedMerge::Separate, SharedMerge::Last, SharedMerge::First] {
                            for routed in [RoutedRounding::F32, RoutedRounding::Bf16] {
                                for output in [OutputRounding::Bf16, OutputRounding::F32] {
                                    if routed == RoutedRounding::Bf16 && shared != SharedMerge::Separate {
                                        continue;
                                    }
                                    let c = AggregationContract {
                                        operand,
                                        accumulator,
                                        shape,
                                        order: Order::Identity,
                                        start,
                                        shared,
                                        routed,
                                        output,
                                    };
                                    let n = normalized(&c);
                                    let reason = normalization_reason(&c);
                                    match out.iter_mut().find(|v| v.family == n) {
                                        Some(v) => {
                                            if let Some(r) = reason {
                                                if !v.aliases.iter().any(|(a, _)| *a == c) {
                                                    v.aliases.push((c, r));
                                                }
                                            }
                                        }
                                        None => {
                                            let aliases = reason.map(|r| (c, r)).into_iter().collect();
                                            out.push(GrammarVariant { family: n, aliases });
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    })
}

/// The variant actually evaluated for `v` on data with these facts, and the reasons.
fn data_key(v: &AggregationContract, facts: &DataFacts) -> (AggregationContract, Vec<Reason>) {
    let mut key = v.clone();
    let mut reasons = Vec::new();
    if facts.terms_bf16 && key.operand == OperandPrecision::F32 {
        key.operand = OperandPrecision::Bf16;
        reasons.push(Reason::TermsBf16Valued);
    }
    if facts.zero_free && key.start == Start::First {
        key.start = Start::Zero;
        reasons.push(Reason::NoZeroOperands);
    }
    (normalized(&key), reasons)
}

/// How the orders of two grammar members relate on some data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderRelation {
    /// They give the same permutation (on every event considered).
    Same,
    /// Their permutations differ only in the first two positions.
    FirstPairSwap,
    /// Anything else (or unknown).
    Other,
}

impl OrderRelation {
    /// The relation of two concrete permutations.
    pub fn of(p: &[usize], q: &[usize]) -> OrderRelation {
        if p == q {
            OrderRelation::Same
        } else if b_canonical(p) == b_canonical(q) {
            OrderRelation::FirstPairSwap
        } else {
            OrderRelation::Other
        }
    }
}

/// Why `b` gives the same bits as `a` on data with `facts`, their orders
/// being related by `rel`.
pub fn why(
    a: &AggregationContract,
    b: &AggregationContract,
    facts: &DataFacts,
    rel: OrderRelation,
) -> Vec<Reason> {
    let mut r = BTreeSet::new();
    let (fa, fb) = (
        a.clone().with_order(Order::Identity),
        b.clone().with_order(Order::Identity),
    );
    if fa != fb {
        // Structural differences first (each side against its representative),
        // then the per-field reasons between the representatives.
        r.extend(normalization_reasons(&fa));
        r.extend(normalization_reasons(&fb));
        let (na, nb) = (normalized(&fa), normalized(&fb));
        if na != nb {
            family_reasons(&na, &nb, facts, &mut r);
        }
    }
    if a.order != b.order || a.shape != b.shape {
        let exact_acc = a.accumulator == Accumulator::Exact && b.accumulator == Accumulator::Exact;
        let in_acc = a.shared != SharedMerge::Separate;
        let proof = acc_bits(a.accumulator).is_some_and(|p| facts.partial_sums_exact(a.operand, in_acc, p));
        if exact_acc {
            r.insert(Reason::ExactIgnoresOrder);
        } else if rel == OrderRelation::Same && a.shape == b.shape {
            r.insert(Reason::SameOrder);
        } else if proof {
            r.insert(Reason::PartialSumsExact {
                precision_bits: acc_bits(a.accumulator).unwrap_or(24),
            });
        } else if rel == OrderRelation::FirstPairSwap && a.shape == b.shape && first_pair_symmetric(a) {
            r.insert(Reason::FirstPairCommutes);
        } else {
            r.insert(Reason::AgreeOnData);
        }
    }
    r.into_iter().collect()
}

/// The per-field reasons two different variants agree.
fn family_reasons(
    a: &AggregationContract,
    b: &AggregationContract,
    facts: &DataFacts,
    r: &mut BTreeSet<Reason>,
) {
    if a.operand != b.operand {
        r.insert(if facts.terms_bf16 {
            Reason::TermsBf16Valued
        } else {
            Reason::AgreeOnData
        });
    }
    if a.start != b.start && a.accumulator != Accumulator::Exact {
        r.insert(if facts.zero_free {
            Reason::NoZeroOperands
        } else {
            Reason::AgreeOnData
        });
    }
    let in_acc = a.shared != SharedMerge::Separate;
    if a.accumulator != b.accumulator {
        let narrow = acc_bits(a.accumulator)
            .unwrap_or(53)
            .min(acc_bits(b.accumulator).unwrap_or(53));
        r.insert(if facts.partial_sums_exact(a.operand, in_acc, narrow) {
            Reason::PartialSumsExact {
                precision_bits: narrow,
            }
        } else {
            Reason::AgreeOnData
        });
    }
    if a.shared != b.shared {
        let bits = acc_bits(a.accumulator).unwrap_or(24).min(24);
        r.insert(if facts.partial_sums_exact(a.operand, true, bits) {
            Reason::PartialSumsExact { precision_bits: bits }
        } else {
            Reason::AgreeOnData
        });
    }
    if a.routed != b.routed {
        r.insert(Reason::AgreeOnData);
    }
    if a.output != b.output {
        r.insert(if facts.output_bf16 {
            Reason::OutputBf16Valued
        } else {
            Reason::AgreeOnData
        });
    }
}

/// Whether the variant's sequential permutations fall into first-pair classes.
fn first_pair_symmetric(c: &AggregationContract) -> bool {
    c.shape == Shape::Sequential
        && c.shared != SharedMerge::First
        && (c.operand == OperandPrecision::Bf16 || c.accumulator != Accumulator::Bf16)
}

/// The event's data, prepared once for every variant.
struct Prepared<'a> {
    k: usize,
    d: usize,
    /// `ops[operand]`: element-major operand arrays, k + 1 values per element (`s` last).
    ops: [Vec<f32>; 2],
    target: Vec<u32>,
    /// `exact[operand][with shared][precision]`: per-element partial-sum proofs.
    exact: [[[Vec<bool>; 3]; 2]; 2],
    canon: Option<&'a (dyn Fn(u32) -> u32 + Sync)>,
    /// All k! permutations (when enumerated), their first-pair partner index,
    /// and the chain operand lists per shared placement (separate, last, first).
    perms: Option<Vec<Vec<usize>>>,
    partner: Vec<usize>,
    chains: [Vec<Vec<u16>>; 3],
    named: Vec<(Order, Vec<usize>)>,
    facts: DataFacts,
}

fn shared_index(s: SharedMerge) -> usize {
    s as usize
}

impl<'a> Prepared<'a> {
    fn new(obs: &Observation<'_>, opts: &InferOptions<'a>) -> Result<Prepared<'a>, ContractError> {
        let k = obs.terms.len();
        let d = obs.output.len();
        if obs.shared.len() != d {
            return Err(ContractError::LengthMismatch {
                what: "shared".into(),
                got: obs.shared.len(),
                expected: d,
            });
        }
        for (j, t) in obs.terms.iter().enumerate() {
            if t.len() != d {
                return Err(ContractError::LengthMismatch {
                    what: format!("term {j}"),
                    got: t.len(),
                    expected: d,
                });
            }
        }
        let mut ops = [vec![0.0f32; d * (k + 1)], vec![0.0f32; d * (k + 1)]];
        for e in 0..d {
            for (j, t) in obs.terms.iter().enumerate() {
                ops[0][e * (k + 1) + j] = operand(OperandPrecision::Bf16, t[e]);
                ops[1][e * (k + 1) + j] = t[e];
            }
            ops[0][e * (k + 1) + k] = obs.shared[e];
            ops[1][e * (k + 1) + k] = obs.shared[e];
        }
        let exact: [[[Vec<bool>; 3]; 2]; 2] = std::array::from_fn(|o| {
            std::array::from_fn(|w| {
                std::array::from_fn(|p| {
                    (0..d)
                        .map(|e| {
                            let row = &ops[o][e * (k + 1)..(e + 1) * (k + 1)];
                            let n = if w == 1 { k + 1 } else { k };
                            partial_sums_exact(&row[..n], PRECISIONS[p])
                        })
                        .collect()
                })
            })
        });
        let facts = Self::facts(obs, &ops, &exact);
        let max_k = opts.max_permutation_k.min(crate::MAX_ENUMERATED_K);
        let perms = if k <= max_k {
            all_permutations(k).ok()
        } else {
            None
        };
        let partner = perms.as_ref().map_or_else(Vec::new, |ps| {
            ps.iter()
                .map(|p| {
                    let mut q = p.clone();
                    if q.len() >= 2 {
                        q.swap(0, 1);
                    }
                    index_of_permutation(&q).unwrap_or(0) as usize
                })
                .collect()
        });
        let chains = std::array::from_fn(|m| {
            let shared = [SharedMerge::Separate, SharedMerge::Last, SharedMerge::First][m];
            let mut c = AggregationContract::c();
            c.shared = shared;
            perms
                .as_ref()
                .map_or_else(Vec::new, |ps| ps.iter().map(|p| leaves(&c, p)).collect())
        });
        let ctx = EventContext {
            experts: obs.experts,
            gates: obs.gates,
        };
        let named = order_groups(&ctx, k)
            .into_iter()
            .flat_map(|g| g.orders.into_iter().map(move |o| (o, g.permutation.clone())))
            .collect();
        Ok(Prepared {
            k,
            d,
            ops,
            target: obs.output.iter().map(|y| y.to_bits()).collect(),
            exact,
            canon: opts.canonicalize,
            perms,
            partner,
            chains,
            named,
            facts,
        })
    }

    fn facts(obs: &Observation<'_>, ops: &[Vec<f32>; 2], exact: &[[[Vec<bool>; 3]; 2]; 2]) -> DataFacts {
        let is_bf16 = |x: f32| r_bf16(x).to_bits() == x.to_bits();
        let zero_risk = |x: f32| !x.is_finite() || x.abs() < f32::from_bits(0x0d80_0000); // 2^-100
        let terms_bf16 = obs.terms.iter().all(|t| t.iter().all(|&x| is_bf16(x)));
        let zero_free = ops.iter().all(|o| o.iter().all(|&x| !zero_risk(x)));
        let output_bf16 = obs.output.iter().all(|&y| is_bf16(y));
        DataFacts {
            terms_bf16,
            zero_free,
            output_bf16,
            exact: std::array::from_fn(|o| {
                std::array::from_fn(|w| std::array::from_fn(|p| exact[o][w][p].iter().all(|&b| b)))
            }),
        }
    }

    #[inline]
    fn matches(&self, y: f32, e: usize) -> bool {
        let bits = match self.canon {
            Some(c) => c(y.to_bits()),
            None => y.to_bits(),
        };
        bits == self.target[e]
    }

    fn row(&self, v: &AggregationContract, e: usize) -> &[f32] {
        let n = self.k + 1;
        &self.ops[op_index(v.operand)][e * n..(e + 1) * n]
    }
}

/// The candidates of one variant: plans and what they stand for.
enum Candidates {
    /// Every permutation (index = candidate), chain plans from the prepared tables.
    Permutations { symmetric: bool },
    /// One plan per distinct permutation of the named orders.
    Plans(Vec<(Plan, Vec<usize>)>),
}

/// The outcome of one variant: the indices of the reproducing candidates.
struct Outcome {
    alive: Vec<usize>,
    tried: usize,
    proven: bool,
}

fn candidates(v: &AggregationContract, p: &Prepared<'_>) -> Candidates {
    if v.accumulator == Accumulator::Exact {
        let id: Vec<usize> = (0..p.k).collect();
        return Candidates::Plans(vec![(Plan::new(v, &id), id)]);
    }
    if v.shape == Shape::Sequential && p.perms.is_some() {
        return Candidates::Permutations {
            symmetric: first_pair_symmetric(v) && p.k >= 2,
        };
    }
    let mut plans: Vec<(Plan, Vec<usize>)> = Vec::new();
    for (_, perm) in &p.named {
        if !plans.iter().any(|(_, q)| q == perm) {
            plans.push((Plan::new(v, perm), perm.clone()));
        }
    }
    Candidates::Plans(plans)
}

/// Evaluates one variant's candidates element by element (see the module docs).
fn evaluate(v: &AggregationContract, p: &Prepared<'_>, cands: &Candidates) -> Outcome {
    let zero = v.start == Start::Zero;
    let chains = &p.chains[shared_index(v.shared)];
    let plan_of = |i: usize| -> PlanRef<'_> {
        match cands {
            Candidates::Permutations { .. } => PlanRef::Chain {
                leaves: &chains[i],
                zero,
            },
            Candidates::Plans(ps) => ps[i].0.as_ref(),
        }
    };
    let (mut alive, tried): (Vec<usize>, usize) = match cands {
        Candidates::Permutations { symmetric } => {
            let n = p.partner.len();
            let reps = (0..n).filter(|&i| !*symmetric || p.partner[i] >= i).collect();
            (reps, n)
        }
        Candidates::Plans(ps) => ((0..ps.len()).collect(), ps.len()),
    };
    let in_acc = v.shared != SharedMerge::Separate;
    let proofs =
        acc_bits(v.accumulator).map(|b| &p.exact[op_index(v.operand)][usize::from(in_acc)][prec_index(b)]);
    let mut proven = true;
    let mut scratch = Scratch::default();
    for e in 0..p.d {
        if alive.is_empty() {
            break;
        }
        let row = p.row(v, e);
        let proof = proofs.is_none_or(|m| m[e]);
        proven &= proof;
        if proof {
            let y = plan_of(alive[0]).eval(v, row, &mut scratch);
            if !p.matches(y, e) {
                alive.clear();
            }
        } else {
            alive.retain(|&i| p.matches(plan_of(i).eval(v, row, &mut scratch), e));
        }
    }
    if let Candidates::Permutations { symmetric: true } = cands {
        let partners: Vec<usize> = alive.iter().map(|&i| p.partner[i]).collect();
        alive.extend(partners);
        alive.sort_unstable();
        alive.dedup();
    }
    Outcome { alive, tried, proven }
}

/// Counts the output values a plan gets wrong (no early exit).
fn differing(v: &AggregationContract, plan: &Plan, p: &Prepared<'_>) -> usize {
    let mut scratch = Scratch::default();
    (0..p.d)
        .filter(|&e| !p.matches(plan.eval(v, p.row(v, e), &mut scratch), e))
        .count()
}

/// The reproducing set of one event over the whole grammar (see the module docs).
pub fn explain_event(
    obs: &Observation<'_>,
    opts: &InferOptions<'_>,
) -> Result<EventExplanation, ContractError> {
    let p = Prepared::new(obs, opts)?;
    let all = variants();
    let keyed: Vec<(AggregationContract, Vec<Reason>)> =
        all.iter().map(|v| data_key(&v.family, &p.facts)).collect();
    let mut keys: Vec<AggregationContract> = Vec::new();
    for (k, _) in &keyed {
        if !keys.contains(k) {
            keys.push(k.clone());
        }
    }
    let results: Vec<(Candidates, Outcome)> = keys
        .par_iter()
        .map(|v| {
            let c = candidates(v, &p);
            let o = evaluate(v, &p, &c);
            (c, o)
        })
        .collect();
    let candidates_tried = results.iter().map(|(_, o)| o.tried as u64).sum();
    let mut matches = Vec::new();
    for (v, (key, reasons)) in all.iter().zip(&keyed) {
        let i = keys.iter().position(|k| k == key).unwrap_or(0);
        let (cands, outcome) = &results[i];
        if outcome.alive.is_empty() {
            continue;
        }
        let mut m = variant_match(&v.family, cands, outcome, &p);
        m.aliases = v.aliases.clone();
        if key != &v.family {
            m.evaluated_as = Some((key.clone(), reasons.clone()));
        }
        matches.push(m);
    }
    matches.sort_by_key(|m| simplicity(&m.best()));
    let closest = if matches.is_empty() && opts.closest > 0 {
        closest(&keys, &p, opts.closest)
    } else {
        Vec::new()
    };
    let ctx = EventContext {
        experts: obs.experts,
        gates: obs.gates,
    };
    Ok(EventExplanation {
        k: p.k,
        elements: p.d,
        facts: p.facts,
        orders: order_groups(&ctx, p.k),
        matches,
        candidates: candidates_tried,
        closest,
    })
}

fn variant_match(
    family: &AggregationContract,
    cands: &Candidates,
    o: &Outcome,
    p: &Prepared<'_>,
) -> VariantMatch {
    let exact = family.accumulator == Accumulator::Exact;
    let (named, permutations) = match cands {
        Candidates::Permutations { .. } => {
            let n = o.tried as u64;
            let mut bits = vec![0u64; o.tried.div_ceil(64)];
            for &i in &o.alive {
                bits[i / 64] |= 1 << (i % 64);
            }
            let pm = PermutationMatches {
                k: p.k,
                tried: n,
                matching: o.alive.len() as u64,
                listed: o
                    .alive
                    .iter()
                    .take(MAX_LISTED_PERMUTATIONS)
                    .map(|&i| i as u64)
                    .collect(),
                bits,
            };
            let named = p
                .named
                .iter()
                .filter(|(_, perm)| index_of_permutation(perm).is_ok_and(|i| pm.contains(i)))
                .map(|(order, perm)| OrderMatch {
                    order: order.clone(),
                    permutation: perm.clone(),
                })
                .collect();
            (named, Some(pm))
        }
        Candidates::Plans(plans) => {
            let named = p
                .named
                .iter()
                .filter(|(order, perm)| {
                    (exact && *order == Order::Identity)
                        || (!exact && o.alive.iter().any(|&i| plans[i].1 == *perm))
                })
                .map(|(order, perm)| OrderMatch {
                    order: order.clone(),
                    permutation: perm.clone(),
                })
                .collect();
            (named, None)
        }
    };
    let invariance = (o.alive.len() == o.tried && (o.tried > 1 || exact)).then_some(if o.proven || exact {
        Invariance::Proven
    } else {
        Invariance::Observed
    });
    VariantMatch {
        family: family.clone(),
        aliases: Vec::new(),
        evaluated_as: None,
        named,
        permutations,
        invariance,
    }
}

fn closest(keys: &[AggregationContract], p: &Prepared<'_>, n: usize) -> Vec<NearMiss> {
    let mut near: Vec<NearMiss> = keys
        .par_iter()
        .flat_map_iter(|v| {
            let orders: Vec<&(Order, Vec<usize>)> = if v.accumulator == Accumulator::Exact {
                p.named.iter().take(1).collect()
            } else {
                p.named.iter().collect()
            };
            orders
                .into_iter()
                .map(|(order, perm)| {
                    let plan = Plan::new(v, perm);
                    NearMiss {
                        contract: v.clone().with_order(order.clone()),
                        differing: differing(v, &plan, p),
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect();
    near.sort_by_key(|m| (m.differing, simplicity(&m.contract)));
    near.dedup_by(|a, b| a.contract == b.contract);
    near.truncate(n);
    near
}

/// A rule (a grammar member with a named order) and the events it explains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleCount {
    /// The rule.
    pub contract: AggregationContract,
    /// Events it reproduces.
    pub events: usize,
}

/// Per variant and k: the permutations that reproduced every event so far.
#[derive(Debug, Clone)]
struct PermTally {
    bits: Vec<u64>,
    events: usize,
    tried: u64,
}

/// The aggregate of many events' explanations (one trace): which rules
/// explain every event, and how the reproducing set narrows.
#[derive(Debug, Clone)]
pub struct TraceInference {
    events: usize,
    unexplained: usize,
    rules: BTreeMap<String, RuleCount>,
    perms: BTreeMap<(String, usize), PermTally>,
    facts: DataFacts,
    diverged: BTreeSet<(usize, usize)>,
}

impl Default for TraceInference {
    fn default() -> Self {
        TraceInference {
            events: 0,
            unexplained: 0,
            rules: BTreeMap::new(),
            perms: BTreeMap::new(),
            facts: DataFacts::all(),
            diverged: BTreeSet::new(),
        }
    }
}

/// The verdict over all events of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceVerdict {
    /// Events added.
    pub events: usize,
    /// Events no grammar member reproduces.
    pub unexplained: usize,
    /// Every rule that reproduces some event, by events explained (most
    /// first), then [`simplicity`].
    pub rules: Vec<RuleCount>,
    /// The simplest rule that reproduces every event.
    pub simplest: Option<AggregationContract>,
    /// The other rules that reproduce every event, with why they cannot be
    /// told apart from the simplest on this trace.
    pub equivalents: Vec<Equivalent>,
    /// Sequential variants with explicit permutations reproducing every
    /// event: the variant with its simplest such order ([`explicit_order`]
    /// of the lowest index), how many of the k! permutations, and the first
    /// few lexicographic indices.
    pub fixed_permutations: Vec<(AggregationContract, u64, Vec<u64>)>,
    /// The facts that held on every event.
    pub facts: DataFacts,
}

impl TraceInference {
    /// An empty aggregate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one event's explanation.
    pub fn add(&mut self, e: &EventExplanation) {
        self.events += 1;
        if !e.explained() {
            self.unexplained += 1;
            return;
        }
        self.facts = self.facts.and(&e.facts);
        for c in e.rules() {
            let key = c.describe();
            self.rules
                .entry(key)
                .or_insert(RuleCount {
                    contract: c,
                    events: 0,
                })
                .events += 1;
        }
        for m in &e.matches {
            if let Some(p) = &m.permutations {
                let key = (m.family.describe(), e.k);
                let t = self.perms.entry(key).or_insert_with(|| PermTally {
                    bits: p.bits.clone(),
                    events: 0,
                    tried: p.tried,
                });
                for (a, b) in t.bits.iter_mut().zip(&p.bits) {
                    *a &= *b;
                }
                t.events += 1;
            }
        }
        for (i, a) in NAMED_ORDERS.iter().enumerate() {
            for (j, b) in NAMED_ORDERS.iter().enumerate().skip(i + 1) {
                let pa = e.permutation_of(a);
                if pa.is_none() || pa != e.permutation_of(b) {
                    self.diverged.insert((i, j));
                }
            }
        }
    }

    /// Whether two named orders gave the same permutation on every event.
    fn coincide(&self, a: &Order, b: &Order) -> bool {
        let (Some(i), Some(j)) = (
            NAMED_ORDERS.iter().position(|o| o == a),
            NAMED_ORDERS.iter().position(|o| o == b),
        ) else {
            return false;
        };
        i == j || !self.diverged.contains(&(i.min(j), i.max(j)))
    }

    /// The verdict so far.
    pub fn verdict(&self) -> TraceVerdict {
        let mut rules: Vec<RuleCount> = self.rules.values().cloned().collect();
        rules.sort_by(|a, b| {
            b.events
                .cmp(&a.events)
                .then_with(|| simplicity(&a.contract).cmp(&simplicity(&b.contract)))
        });
        let all: Vec<&RuleCount> = rules
            .iter()
            .filter(|r| r.events == self.events && self.events > 0)
            .collect();
        let simplest = all.first().map(|r| r.contract.clone());
        let equivalents = match &simplest {
            Some(s) => all[1..]
                .iter()
                .map(|r| Equivalent {
                    contract: r.contract.clone(),
                    reasons: why(
                        s,
                        &r.contract,
                        &self.facts,
                        if self.coincide(&s.order, &r.contract.order) {
                            OrderRelation::Same
                        } else {
                            OrderRelation::Other
                        },
                    ),
                })
                .collect(),
            None => Vec::new(),
        };
        let mut fixed_permutations = Vec::new();
        for ((family, k), t) in &self.perms {
            if t.events != self.events {
                continue;
            }
            let listed: Vec<u64> = (0..t.tried)
                .filter(|&i| t.bits[(i / 64) as usize] >> (i % 64) & 1 == 1)
                .collect();
            if !listed.is_empty() {
                if let Ok(c) = AggregationContract::parse(family) {
                    let order = explicit_order(&c, *k, listed[0]);
                    let c = c.with_order(order);
                    let count = listed.len() as u64;
                    fixed_permutations.push((
                        c,
                        count,
                        listed.into_iter().take(MAX_LISTED_PERMUTATIONS).collect(),
                    ));
                }
            }
        }
        fixed_permutations.sort_by_key(|(c, _, _)| simplicity(c));
        TraceVerdict {
            events: self.events,
            unexplained: self.unexplained,
            rules,
            simplest,
            equivalents,
            fixed_permutations,
            facts: self.facts,
        }
    }
}
