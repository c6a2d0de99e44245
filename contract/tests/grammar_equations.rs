//! The combine grammar's fields against written-out equations
//! (docs/contracts.md, "The combine grammar"), the named orders against
//! hand-resolved permutations, the real backends' contracts against their
//! source formulas, and the notation's round trip over every member.

use moeconf_contract::bf16::r_bf16;
use moeconf_contract::{
    splitmix64, Accumulator, AggregationContract, EventContext, OperandPrecision, Order, OutputRounding,
    RoutedRounding, Shape, SharedMerge, Start, NAMED_ORDERS, NAMED_SHAPES,
};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        splitmix64(self.0)
    }

    /// Values over 2^−30 … 2^6 with random signs, some ±0.
    fn value(&mut self) -> f32 {
        match self.next() % 16 {
            0 => 0.0,
            1 => -0.0,
            _ => {
                let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                u * 2f32.powi((self.next() % 37) as i32 - 30)
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn combine(c: &AggregationContract, terms: &[Vec<f32>], shared: &[f32], ctx: &EventContext<'_>) -> Vec<f32> {
    let refs: Vec<&[f32]> = terms.iter().map(Vec::as_slice).collect();
    let mut y = vec![0.0f32; shared.len()];
    c.try_combine_in(Some(ctx), &refs, shared, &mut y).unwrap();
    y
}

fn canon(y: f32) -> f32 {
    if y.is_nan() {
        f32::from_bits(0x7fc0_0000)
    } else {
        y
    }
}

/// Sequential members, written out: operands, shared placement, start, the
/// accumulator's addition, routed rounding, merge and output.
fn sequential_reference(c: &AggregationContract, perm: &[usize], t: &[f32], s: f32) -> f32 {
    let op = |v: f32| match c.operand {
        OperandPrecision::F32 => v,
        OperandPrecision::Bf16 => r_bf16(v),
        OperandPrecision::Fma => unreachable!("operand=fma has no terms as operands"),
    };
    let mut list: Vec<f32> = perm.iter().map(|&j| op(t[j])).collect();
    match c.shared {
        SharedMerge::First => list.insert(0, s),
        SharedMerge::Last => list.push(s),
        SharedMerge::Separate => {}
    }
    let acc: f32 = match c.accumulator {
        Accumulator::F32 | Accumulator::Bf16 => {
            let add = |a: f32, b: f32| {
                if c.accumulator == Accumulator::Bf16 {
                    r_bf16(a + b)
                } else {
                    a + b
                }
            };
            let conv = |x: f32| {
                if c.accumulator == Accumulator::Bf16 {
                    r_bf16(x)
                } else {
                    x
                }
            };
            match (c.start, list.split_first()) {
                (Start::First, Some((first, rest))) => rest.iter().fold(conv(*first), |a, &x| add(a, x)),
                _ => list.iter().fold(0.0f32, |a, &x| add(a, x)),
            }
        }
        Accumulator::F64 => {
            let sum = match (c.start, list.split_first()) {
                (Start::First, Some((first, rest))) => {
                    rest.iter().fold(f64::from(*first), |a, &x| a + f64::from(x))
                }
                _ => list.iter().fold(0.0f64, |a, &x| a + f64::from(x)),
            };
            sum as f32
        }
        Accumulator::Exact => unreachable!("not written out here"),
    };
    let out = |y: f32| match c.output {
        OutputRounding::Bf16 => r_bf16(y),
        OutputRounding::F32 => y,
    };
    canon(match c.shared {
        SharedMerge::Separate => {
            let r = match c.routed {
                RoutedRounding::F32 => acc,
                RoutedRounding::Bf16 => r_bf16(acc),
            };
            out(r + s)
        }
        _ => out(acc),
    })
}

#[test]
fn sequential_fields_match_their_written_out_equations() {
    let mut rng = Rng(1);
    let ctx = EventContext::default();
    for operand in [OperandPrecision::F32, OperandPrecision::Bf16] {
        for accumulator in [Accumulator::F32, Accumulator::Bf16, Accumulator::F64] {
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
                                shape: Shape::Sequential,
                                order: Order::Reversed,
                                start,
                                shared,
                                routed,
                                output,
                            };
                            for k in [1usize, 3, 6] {
                                let d = 64;
                                let terms: Vec<Vec<f32>> =
                                    (0..k).map(|_| (0..d).map(|_| rng.value()).collect()).collect();
                                let s: Vec<f32> = (0..d).map(|_| r_bf16(rng.value())).collect();
                                let got = combine(&c, &terms, &s, &ctx);
                                let perm: Vec<usize> = (0..k).rev().collect();
                                let want: Vec<f32> = (0..d)
                                    .map(|e| {
                                        let t: Vec<f32> = terms.iter().map(|v| v[e]).collect();
                                        sequential_reference(&c, &perm, &t, s[e])
                                    })
                                    .collect();
                                assert_eq!(bits(&got), bits(&want), "{} k={k}", c.describe());
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn start_first_keeps_a_negative_zero_chain() {
    let terms = vec![vec![-0.0f32], vec![-0.0f32]];
    let ctx = EventContext::default();
    let first = AggregationContract::parse("p32+start=first+shared=last+output=f32").unwrap();
    let zero = AggregationContract::parse("p32+shared=last+output=f32").unwrap();
    assert_eq!(combine(&first, &terms, &[-0.0], &ctx)[0].to_bits(), 0x8000_0000);
    assert_eq!(combine(&zero, &terms, &[-0.0], &ctx)[0].to_bits(), 0);
}

#[test]
fn lane_folds_match_their_written_out_equations() {
    let mut rng = Rng(2);
    let ctx = EventContext::default();
    for _ in 0..200 {
        let t: Vec<Vec<f32>> = (0..6).map(|_| vec![rng.value()]).collect();
        let s = [r_bf16(rng.value())];
        let u: Vec<f32> = t.iter().map(|v| v[0]).collect();
        // lanes:4 (halving) over 6 operands: lanes (u0+u4), (u1+u5), u2, u3 from +0,
        // then (l0 + l2) and (l1 + l3), then their sum.
        let l = [
            ((0.0 + u[0]) + u[4]),
            ((0.0 + u[1]) + u[5]),
            (0.0 + u[2]),
            (0.0 + u[3]),
        ];
        let halving = (l[0] + l[2]) + (l[1] + l[3]);
        let seq = ((l[0] + l[1]) + l[2]) + l[3];
        let c = AggregationContract::parse("p32+shape=lanes:4+output=f32").unwrap();
        assert_eq!(
            combine(&c, &t, &s, &ctx)[0].to_bits(),
            canon(halving + s[0]).to_bits()
        );
        let c = AggregationContract::parse("p32+shape=lanes:4:seq+output=f32").unwrap();
        assert_eq!(
            combine(&c, &t, &s, &ctx)[0].to_bits(),
            canon(seq + s[0]).to_bits()
        );
        // lanes:8 over 6 operands: two empty lanes (+0).
        let p = [u[0], u[1], u[2], u[3], u[4], u[5], 0.0, 0.0].map(|x| 0.0 + x);
        let h4 = [p[0] + p[4], p[1] + p[5], p[2] + p[6], p[3] + p[7]];
        let h8 = (h4[0] + h4[2]) + (h4[1] + h4[3]);
        let c = AggregationContract::parse("p32+shape=lanes:8+output=f32").unwrap();
        assert_eq!(combine(&c, &t, &s, &ctx)[0].to_bits(), canon(h8 + s[0]).to_bits());
    }
}

#[test]
fn named_orders_resolve_from_the_router_choice() {
    let experts = [7u32, 3, 9, 1, 3];
    let gates = [0.25f32, 0.5, 0.125, 0.5, -0.0];
    let ctx = EventContext {
        experts: &experts,
        gates: &gates,
    };
    let p = |o: Order| ctx.permutation(&o, 5).unwrap();
    assert_eq!(p(Order::Identity), vec![0, 1, 2, 3, 4]);
    assert_eq!(p(Order::Reversed), vec![4, 3, 2, 1, 0]);
    // Equal ids (3 at slots 1 and 4) keep slot order in both directions.
    assert_eq!(p(Order::AscendingId), vec![3, 1, 4, 0, 2]);
    assert_eq!(p(Order::DescendingId), vec![2, 0, 1, 4, 3]);
    // Equal gates (0.5 at slots 1 and 3) keep slot order; −0 is the smallest.
    assert_eq!(p(Order::DescendingGate), vec![1, 3, 0, 2, 4]);
    assert_eq!(p(Order::AscendingGate), vec![4, 2, 0, 1, 3]);
    // Without the router choice the id and gate orders are errors.
    let none = EventContext::default();
    assert!(none.permutation(&Order::AscendingId, 5).is_err());
    assert!(Order::DescendingGate.resolve(5).is_err());
    // A contract applies the resolved order.
    let t: Vec<Vec<f32>> = vec![
        vec![1.0],
        vec![2f32.powi(-9)],
        vec![2f32.powi(-9)],
        vec![0.0],
        vec![0.0],
    ];
    let b = AggregationContract::parse("b+order=asc-id+output=f32").unwrap();
    let asc = AggregationContract::parse("b+order=perm:3,1,4,0,2+output=f32").unwrap();
    assert_eq!(
        bits(&combine(&b, &t, &[0.0], &ctx)),
        bits(&combine(&asc, &t, &[0.0], &ctx))
    );
}

#[test]
fn real_backend_contracts_compute_their_source_formulas() {
    let mut rng = Rng(3);
    let experts = [12u32, 4, 30, 7, 19, 1];
    let ctx = EventContext {
        experts: &experts,
        gates: &[],
    };
    let asc = [5usize, 1, 3, 0, 4, 2];
    for _ in 0..500 {
        let t: Vec<Vec<f32>> = (0..6).map(|_| vec![r_bf16(rng.value())]).collect();
        let s = [r_bf16(rng.value())];
        let u: Vec<f32> = t.iter().map(|v| v[0]).collect();
        // transformers grouped_mm / batched_mm bf16: y = R(R(Σ_slot fp32) + s).
        let sum = u.iter().fold(0.0f32, |a, &x| a + x);
        let grouped = AggregationContract::parse("c+routed=bf16").unwrap();
        assert_eq!(
            combine(&grouped, &t, &s, &ctx)[0].to_bits(),
            canon(r_bf16(r_bf16(sum) + s[0])).to_bits()
        );
        // transformers eager bf16: index_add_ per expert in ascending id on bf16, y = R(a + s).
        let a = asc.iter().fold(0.0f32, |a, &j| r_bf16(a + u[j]));
        let eager = AggregationContract::parse("b+order=asc-id").unwrap();
        assert_eq!(
            combine(&eager, &t, &s, &ctx)[0].to_bits(),
            canon(r_bf16(a + s[0])).to_bits()
        );
        // DeepSeek official: fp32 zeros, += in ascending id, += shared, one bf16 rounding.
        let y = asc.iter().fold(0.0f32, |a, &j| a + u[j]) + s[0];
        let official = AggregationContract::parse("c+shared=last+order=asc-id").unwrap();
        assert_eq!(
            combine(&official, &t, &s, &ctx)[0].to_bits(),
            canon(r_bf16(y)).to_bits()
        );
        // llama.cpp: ((t0 + t1) + t2) + … from the first term, then + shexp, f32.
        let f: Vec<Vec<f32>> = (0..6).map(|_| vec![rng.value()]).collect();
        let v: Vec<f32> = f.iter().map(|x| x[0]).collect();
        let moe = v[1..].iter().fold(v[0], |a, &x| a + x);
        let llama = AggregationContract::parse("p32+start=first+output=f32").unwrap();
        assert_eq!(
            combine(&llama, &f, &s, &ctx)[0].to_bits(),
            canon(moe + s[0]).to_bits()
        );
        // transformers fp32 eager: P32 ascending id, y = a + s unrounded.
        let a32 = asc.iter().fold(0.0f32, |a, &j| a + v[j]);
        let eager32 = AggregationContract::parse("p32+output=f32+order=asc-id").unwrap();
        assert_eq!(
            combine(&eager32, &f, &s, &ctx)[0].to_bits(),
            canon(a32 + s[0]).to_bits()
        );
    }
}

#[test]
fn notation_round_trips_for_every_member_and_order() {
    let mut n = 0;
    for shape in NAMED_SHAPES.into_iter().chain([Shape::Lanes {
        width: 16,
        fold: moeconf_contract::LaneFold::Sequential,
    }]) {
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
                                let orders = NAMED_ORDERS.into_iter().chain([
                                    Order::PermutationIndex(17),
                                    Order::BClass(3),
                                    Order::Permutation(vec![2, 0, 1]),
                                ]);
                                for order in orders {
                                    let c = AggregationContract {
                                        operand,
                                        accumulator,
                                        shape,
                                        order,
                                        start,
                                        shared,
                                        routed,
                                        output,
                                    };
                                    let text = c.describe();
                                    let back = AggregationContract::parse(&text)
                                        .unwrap_or_else(|e| panic!("{text}: {e}"));
                                    assert_eq!(back, c, "{text}");
                                    n += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(n > 8000, "{n}");
    // routed=bf16 with the shared expert in the accumulator is refused.
    assert!(AggregationContract::parse("c+shared=last+routed=bf16").is_err());
    // The presets keep their names.
    for p in [
        "native",
        "p32",
        "c",
        "a",
        "b",
        "exact",
        "tree",
        "f64",
        "exact-fused",
    ] {
        let c = AggregationContract::parse(p).unwrap();
        let want = if p == "native" { "c" } else { p };
        assert_eq!(c.describe(), want);
    }
}
