//! The grammar's variants tried by inference and their structural
//! normalization.

use std::sync::OnceLock;

use super::*;
use crate::named::NAMED_SHAPES;
use crate::spec::{
    Accumulator, AggregationContract, OperandPrecision, Order, OutputRounding, RoutedRounding, Shape,
    SharedMerge, Start,
};

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
pub(crate) fn normalization_reason(c: &AggregationContract) -> Option<Reason> {
    normalization_reasons(c).into_iter().next()
}

/// Every structural reason `c` and [`normalized`]`(c)` differ by (empty if equal).
pub(crate) fn normalization_reasons(c: &AggregationContract) -> Vec<Reason> {
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
pub(crate) struct GrammarVariant {
    pub(crate) family: AggregationContract,
    pub(crate) aliases: Vec<(AggregationContract, Reason)>,
}

/// Every variant of the grammar inference tries (normalized representatives,
/// order `identity`): terms × accumulator × start × shape in
/// [`crate::NAMED_SHAPES`] × shared × routed × output, invalid combinations
/// (`routed=bf16` with the shared expert in the accumulator) left out.
pub fn grammar_variants() -> Vec<AggregationContract> {
    variants().iter().map(|v| v.family.clone()).collect()
}

pub(crate) fn variants() -> &'static [GrammarVariant] {
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
pub(crate) fn data_key(v: &AggregationContract, facts: &DataFacts) -> (AggregationContract, Vec<Reason>) {
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
