//! Evaluation of one grammar member on one output element.
//!
//! A [`Plan`] is the association of one contract at one event: the operand
//! list (terms in the order's permutation, with the shared expert inserted
//! when it is summed in the accumulator) compiled for the contract's
//! [`Shape`] and [`Start`]. Operands are addressed by index into an operand
//! array `ops` of length k + 1: `ops[j]` is the (operand-rounded) term of
//! slot j, `ops[k]` the shared output `s`.

use super::exact::ExactSum;
use super::spec::{
    Accumulator, AggregationContract, LaneFold, OperandPrecision, OutputRounding, RoutedRounding, Shape,
    SharedMerge, Start, CANONICAL_NAN_BITS,
};
use crate::bf16::r_bf16;

/// The term as it enters the accumulator.
#[inline]
pub(crate) fn operand(p: OperandPrecision, v: f32) -> f32 {
    match p {
        // `Fma` never reaches here (its terms are not operands); as f32.
        OperandPrecision::F32 | OperandPrecision::Fma => v,
        OperandPrecision::Bf16 => r_bf16(v),
    }
}

/// One output element of an `operand=fma` contract (FP32 accumulator,
/// sequential shape): along `leaves`, a routed leaf j steps
/// `a ← fma(u_j, g_j, a)` (`u_j` = `ops[j]`, the unweighted output; the
/// chain's lone first leaf is `fl32(u_j · g_j)`), the shared leaf (index k)
/// `a ← fl32(a + s)`; then the merge and output rounding of the other
/// members. `f32::mul_add` is IEEE fusedMultiplyAdd (correctly rounded on
/// every target, in hardware or in software), so the bits do not depend on
/// the CPU.
pub(crate) fn eval_fma_chain(
    c: &AggregationContract,
    leaves: &[u16],
    zero: bool,
    ops: &[f32],
    gates: &[f32],
) -> f32 {
    let k = gates.len();
    let step = |a: Option<f32>, l: u16| {
        let i = l as usize;
        let x = ops[i];
        Some(match (a, gates.get(i)) {
            (None, Some(&g)) => x * g,
            (Some(a), Some(&g)) => x.mul_add(g, a),
            (None, None) => x,
            (Some(a), None) => a + x,
        })
    };
    debug_assert_eq!(ops.len(), k + 1);
    let a = leaves
        .iter()
        .fold(zero.then_some(0.0f32), |a, &l| step(a, l))
        .unwrap_or(0.0);
    let y = finish_f32(c, a, ops);
    if y.is_nan() {
        f32::from_bits(CANONICAL_NAN_BITS)
    } else {
        y
    }
}

/// One instruction of a postfix reduction program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Instr {
    /// Push `+0`.
    Zero,
    /// Push operand `ops[i]`.
    Op(u16),
    /// Convert the top value to the accumulator (a chain's lone first operand).
    Conv,
    /// Pop `b`, pop `a`, push `Acc(a + b)`.
    Add,
}

/// How one contract reduces the operands of one event.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Plan {
    /// A sequential chain over these operand indices, from `+0` (`zero`) or from the first.
    Chain {
        /// Operand indices in chain order.
        leaves: Vec<u16>,
        /// Whether the chain starts from `+0`.
        zero: bool,
    },
    /// Any other association, as a postfix program.
    Program(Vec<Instr>),
    /// The exact accumulator: the operands in any order.
    Exact(Vec<u16>),
}

/// Reusable evaluation stacks.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    f32s: Vec<f32>,
    f64s: Vec<f64>,
}

/// The operand list of `c` under the slot permutation `perm`: the term
/// indices, with the shared expert (index k) first or last when it is in
/// the accumulator.
pub(crate) fn leaves(c: &AggregationContract, perm: &[usize]) -> Vec<u16> {
    let k = perm.len() as u16;
    let mut v: Vec<u16> = Vec::with_capacity(perm.len() + 1);
    if c.shared == SharedMerge::First {
        v.push(k);
    }
    v.extend(perm.iter().map(|&p| p as u16));
    if c.shared == SharedMerge::Last {
        v.push(k);
    }
    v
}

fn chain_program(leaves: &[u16], zero: bool) -> Vec<Instr> {
    let mut p = Vec::with_capacity(2 * leaves.len() + 1);
    match (zero, leaves.split_first()) {
        (false, Some((first, rest))) => {
            p.push(Instr::Op(*first));
            p.push(Instr::Conv);
            for &l in rest {
                p.extend([Instr::Op(l), Instr::Add]);
            }
        }
        _ => {
            p.push(Instr::Zero);
            for &l in leaves {
                p.extend([Instr::Op(l), Instr::Add]);
            }
        }
    }
    p
}

fn add(mut a: Vec<Instr>, b: Vec<Instr>) -> Vec<Instr> {
    a.extend(b);
    a.push(Instr::Add);
    a
}

fn tree_program(leaves: &[u16], zero: bool) -> Vec<Instr> {
    if leaves.is_empty() {
        return vec![Instr::Zero];
    }
    let mut nodes: Vec<Vec<Instr>> = leaves.iter().map(|&l| vec![Instr::Op(l)]).collect();
    while nodes.len() > 1 {
        let mut next = Vec::with_capacity(nodes.len().div_ceil(2));
        let mut it = nodes.into_iter();
        while let Some(a) = it.next() {
            match it.next() {
                Some(b) => next.push(add(a, b)),
                None => next.push(a),
            }
        }
        nodes = next;
    }
    let root = nodes.pop().unwrap_or_default();
    if zero {
        add(vec![Instr::Zero], root)
    } else if leaves.len() == 1 {
        let mut r = root;
        r.push(Instr::Conv);
        r
    } else {
        root
    }
}

fn lanes_program(leaves: &[u16], zero: bool, width: usize, fold: LaneFold) -> Vec<Instr> {
    let mut lanes: Vec<Vec<Instr>> = (0..width)
        .map(|l| {
            let lane: Vec<u16> = leaves.iter().copied().skip(l).step_by(width).collect();
            chain_program(&lane, zero)
        })
        .collect();
    match fold {
        LaneFold::Halving => {
            while lanes.len() > 1 {
                let half = lanes.len() / 2;
                let upper = lanes.split_off(half);
                lanes = lanes.into_iter().zip(upper).map(|(a, b)| add(a, b)).collect();
            }
            lanes.pop().unwrap_or_default()
        }
        LaneFold::Sequential => {
            let mut it = lanes.into_iter();
            let first = it.next().unwrap_or_default();
            it.fold(first, add)
        }
    }
}

impl Plan {
    /// The plan of `c` under the slot permutation `perm` (validated by the caller).
    pub(crate) fn new(c: &AggregationContract, perm: &[usize]) -> Plan {
        let leaves = leaves(c, perm);
        let zero = c.start == Start::Zero;
        match (c.accumulator, c.shape) {
            (Accumulator::Exact, _) => Plan::Exact(leaves),
            (_, Shape::Sequential) => Plan::Chain { leaves, zero },
            (_, Shape::PairwiseTree) => Plan::Program(tree_program(&leaves, zero)),
            (_, Shape::Lanes { width, fold }) => {
                Plan::Program(lanes_program(&leaves, zero, width as usize, fold))
            }
        }
    }

    pub(crate) fn as_ref(&self) -> PlanRef<'_> {
        match self {
            Plan::Chain { leaves, zero } => PlanRef::Chain { leaves, zero: *zero },
            Plan::Program(p) => PlanRef::Program(p),
            Plan::Exact(leaves) => PlanRef::Exact(leaves),
        }
    }

    /// See [`PlanRef::eval`].
    #[inline]
    pub(crate) fn eval(&self, c: &AggregationContract, ops: &[f32], scratch: &mut Scratch) -> f32 {
        self.as_ref().eval(c, ops, scratch)
    }
}

/// A borrowed [`Plan`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum PlanRef<'a> {
    /// See [`Plan::Chain`].
    Chain {
        /// Operand indices in chain order.
        leaves: &'a [u16],
        /// Whether the chain starts from `+0`.
        zero: bool,
    },
    /// See [`Plan::Program`].
    Program(&'a [Instr]),
    /// See [`Plan::Exact`].
    Exact(&'a [u16]),
}

impl PlanRef<'_> {
    /// The output element `y` of contract `c` (whose accumulator, start and
    /// shape this plan was built for) from the operand array `ops` (k
    /// operand-rounded terms in slot order, then `s`).
    #[inline]
    pub(crate) fn eval(self, c: &AggregationContract, ops: &[f32], scratch: &mut Scratch) -> f32 {
        let y = match c.accumulator {
            Accumulator::F32 => finish_f32(c, self.reduce(ops, scratch, |x| x, |a, b| a + b), ops),
            Accumulator::Bf16 => finish_f32(c, self.reduce(ops, scratch, r_bf16, |a, b| r_bf16(a + b)), ops),
            Accumulator::F64 => finish_f32(c, self.reduce_f64(ops, scratch) as f32, ops),
            Accumulator::Exact => self.finish_exact(c, ops),
        };
        if y.is_nan() {
            f32::from_bits(CANONICAL_NAN_BITS)
        } else {
            y
        }
    }

    /// The accumulator value of an FP32-container accumulator.
    #[inline]
    fn reduce(
        self,
        ops: &[f32],
        scratch: &mut Scratch,
        conv: impl Fn(f32) -> f32,
        add: impl Fn(f32, f32) -> f32,
    ) -> f32 {
        match self {
            PlanRef::Chain { leaves, zero } => match (zero, leaves.split_first()) {
                (false, Some((first, rest))) => rest
                    .iter()
                    .fold(conv(ops[*first as usize]), |a, &l| add(a, ops[l as usize])),
                _ => leaves.iter().fold(0.0f32, |a, &l| add(a, ops[l as usize])),
            },
            PlanRef::Program(p) => run(p, ops, &mut scratch.f32s, 0.0f32, |x| x, conv, add),
            PlanRef::Exact(_) => 0.0,
        }
    }

    fn reduce_f64(self, ops: &[f32], scratch: &mut Scratch) -> f64 {
        let add = |a: f64, b: f64| a + b;
        match self {
            PlanRef::Chain { leaves, zero } => match (zero, leaves.split_first()) {
                (false, Some((first, rest))) => rest.iter().fold(f64::from(ops[*first as usize]), |a, &l| {
                    add(a, f64::from(ops[l as usize]))
                }),
                _ => leaves
                    .iter()
                    .fold(0.0f64, |a, &l| add(a, f64::from(ops[l as usize]))),
            },
            PlanRef::Program(p) => run(p, ops, &mut scratch.f64s, 0.0f64, f64::from, |x| x, add),
            PlanRef::Exact(_) => 0.0,
        }
    }

    fn finish_exact(self, c: &AggregationContract, ops: &[f32]) -> f32 {
        let (PlanRef::Exact(leaves) | PlanRef::Chain { leaves, .. }) = self else {
            return f32::NAN;
        };
        let mut sum = ExactSum::new();
        for &l in leaves {
            sum.add(ops[l as usize]);
        }
        let to_bf16 = match c.shared {
            SharedMerge::Separate => c.routed == RoutedRounding::Bf16,
            _ => c.output == OutputRounding::Bf16,
        };
        let a = if to_bf16 { sum.to_bf16() } else { sum.to_f32() };
        match c.shared {
            SharedMerge::Separate => merge(c, a, ops),
            _ => a,
        }
    }
}

/// Runs a postfix program on a value stack.
#[inline]
fn run<V: Copy>(
    program: &[Instr],
    ops: &[f32],
    stack: &mut Vec<V>,
    zero: V,
    load: impl Fn(f32) -> V,
    conv: impl Fn(V) -> V,
    add: impl Fn(V, V) -> V,
) -> V {
    stack.clear();
    for ins in program {
        match *ins {
            Instr::Zero => stack.push(zero),
            Instr::Op(i) => stack.push(load(ops[i as usize])),
            Instr::Conv => {
                if let Some(top) = stack.last_mut() {
                    *top = conv(*top);
                }
            }
            Instr::Add => {
                let b = stack.pop().unwrap_or(zero);
                let a = stack.pop().unwrap_or(zero);
                stack.push(add(a, b));
            }
        }
    }
    stack.pop().unwrap_or(zero)
}

/// The stage after an FP32-valued accumulator `a`: the separate merge, or
/// the output rounding when `s` was in the accumulator.
#[inline]
fn finish_f32(c: &AggregationContract, a: f32, ops: &[f32]) -> f32 {
    match c.shared {
        SharedMerge::Separate => {
            let r = match c.routed {
                RoutedRounding::F32 => a,
                RoutedRounding::Bf16 => r_bf16(a),
            };
            merge(c, r, ops)
        }
        _ => out(c, a),
    }
}

/// `Out(fl32(r + s))`, `s` being the last operand.
#[inline]
fn merge(c: &AggregationContract, r: f32, ops: &[f32]) -> f32 {
    out(c, r + ops[ops.len() - 1])
}

#[inline]
fn out(c: &AggregationContract, y: f32) -> f32 {
    match c.output {
        OutputRounding::Bf16 => r_bf16(y),
        OutputRounding::F32 => y,
    }
}
