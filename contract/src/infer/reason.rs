//! Why two grammar members give the same bits: the reasons, the data facts
//! they rest on, and `why()`.

use std::collections::BTreeSet;

use super::*;
use crate::order::b_canonical;
use crate::spec::{Accumulator, AggregationContract, OperandPrecision, Order, SharedMerge};

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
    pub(crate) exact: [[[bool; 3]; 2]; 2],
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
        // operand=fma's products are never materialized: no fact covers them.
        operand != OperandPrecision::Fma
            && self.exact[op_index(operand)][usize::from(with_shared)][prec_index(precision_bits)]
    }
}

pub(crate) fn op_index(o: OperandPrecision) -> usize {
    match o {
        OperandPrecision::Bf16 => 0,
        OperandPrecision::F32 => 1,
        // Not tried by inference; ranked after the others by `simplicity`.
        OperandPrecision::Fma => 2,
    }
}

pub(crate) fn prec_index(bits: u32) -> usize {
    match bits {
        8 => 0,
        24 => 1,
        _ => 2,
    }
}

pub(crate) const PRECISIONS: [u32; 3] = [8, 24, 53];

/// Significand bits of an accumulator (exact: `None`).
pub(crate) fn acc_bits(a: Accumulator) -> Option<u32> {
    match a {
        Accumulator::Bf16 => Some(8),
        Accumulator::F32 => Some(24),
        Accumulator::F64 => Some(53),
        Accumulator::Exact => None,
    }
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
pub(crate) fn family_reasons(
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
