//! The parameterized [`AggregationContract`] and its presets.
//!
//! A contract is operand precision × accumulator × shape × order × output
//! rounding. For k gate-weighted FP32 routed terms `v_0 … v_{k−1}` (length D,
//! selection order), a permutation `π` (from the [`Order`]) and the shared
//! expert output `s`, each output element is computed independently:
//!
//! 1. operands: `u_j = O(v_{π_j})`, with `O` = identity ([`OperandPrecision::F32`])
//!    or R_BF16 ([`OperandPrecision::Bf16`], exact promotion back to FP32);
//! 2. routed reduction from a zero accumulator, [`Shape::Sequential`]:
//!    `a_0 = +0`, `a_{j+1} = Acc(a_j, u_j)`; or [`Shape::PairwiseTree`] (see there);
//! 3. merge: `y = Out(FP32(a_k) + s)` with one FP32 addition, `Out` = R_BF16
//!    ([`OutputRounding::Bf16`], the paper's common merge) or identity
//!    ([`OutputRounding::F32`]); a NaN result is replaced by the canonical
//!    quiet NaN `0x7fc0_0000`.
//!
//! `Acc` by [`Accumulator`]: `F32`: `fl32(a + u)`; `Bf16`: `R_BF16(fl32(a + u))`
//! (the paper's "BF16 round after every addition", computed as an FP32
//! addition followed by R_BF16); `F64`: `fl64(a + u)` with `a` in f64 and
//! `FP32(a_k)` the IEEE round-to-nearest-even conversion (Rust `as f32`);
//! `Exact`: the exact real sum of all `u_j` in a superaccumulator, rounded once
//! to FP32 (round to nearest, ties to even) to form `FP32(a_k)`: order and
//! shape do not change it; `ExactFused`: the exact real sum of all `u_j` and
//! `s`, rounded once directly to the output precision (this replaces step 3).
//! The paper's presets (section 2.5):
//!
//! | preset | operand | accumulator | shape | output |
//! |---|---|---|---|---|
//! | `p32` | F32 | F32 | sequential | BF16 |
//! | `c` (= `native` with the identity order) | BF16 | F32 | sequential | BF16 |
//! | `a` | F32 | BF16 | sequential | BF16 |
//! | `b` | BF16 | BF16 | sequential | BF16 |
//! | `exact` | BF16 | exact | sequential | BF16 |
//! | `f64` | BF16 | F64 | sequential | BF16 |
//! | `tree` | BF16 | F32 | pairwise tree | BF16 |
//! | `exact-fused` | BF16 | exact, `s` included | — | BF16, one rounding |

use std::fmt;

use super::error::ContractError;
use super::exact::ExactSum;
use super::order::{
    b_class_representative, identity_permutation, permutation_from_index, validate_permutation,
};
use super::{CombineEvent, MoeCombine};
use crate::bf16::r_bf16;

/// The canonical quiet NaN every contract writes in place of a NaN result
/// (NaN sign and payload after IEEE arithmetic are not specified by Rust and
/// differ between machines; this keeps the output bits machine-independent).
pub const CANONICAL_NAN_BITS: u32 = 0x7fc0_0000;

/// Representation of each routed term before it enters the accumulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OperandPrecision {
    /// The FP32 term `v_j` itself.
    F32,
    /// `FP32(R_BF16(v_j))`: the term rounded to BF16, exactly promoted.
    Bf16,
}

/// Precision of the cross-expert accumulator and the rounding after each addition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Accumulator {
    /// FP32 container, `fl32(a + u)` after every addition.
    F32,
    /// BF16 container: `R_BF16(fl32(a + u))` after every addition.
    Bf16,
    /// FP64 container, `fl64(a + u)`; converted to FP32 once (`as f32`, ties to even) before the merge.
    F64,
    /// The exact real sum, rounded once to FP32 (ties to even) before the merge; order-invariant.
    Exact,
    /// The exact real sum of the k operands **and** the shared output `s`,
    /// rounded once, directly to the output precision (ties to even): the
    /// correctly rounded MoE output. Replaces the separate merge; order-invariant.
    ExactFused,
}

/// Association of the routed reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shape {
    /// Left-to-right chain from `+0`: `(((+0 ⊕ u_0) ⊕ u_1) ⊕ …) ⊕ u_{k−1}` (paper section 2.4.1).
    Sequential,
    /// Fixed pairwise tree: each level adds neighbours `(x_0 ⊕ x_1), (x_2 ⊕ x_3), …`,
    /// an odd last element moves up unchanged, until one value remains; then
    /// `a_k = +0 ⊕ root` (zero initial accumulator: only maps a −0 root to +0).
    /// For k = 6: `((u0⊕u1) ⊕ (u2⊕u3)) ⊕ (u4⊕u5)`.
    PairwiseTree,
}

/// Final rounding of the merged output `a_k + s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutputRounding {
    /// `y = R_BF16(FP32(a_k) + FP32(s))`: the paper's common shared-expert merge.
    Bf16,
    /// `y = FP32(a_k) + FP32(s)` with no further rounding (for the FP32 profile).
    F32,
}

/// Which permutation of the routed terms a contract applies (see
/// [`super::order`] for the conventions and enumeration orders).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Order {
    /// Selection order `[0, 1, …, k−1]`.
    Identity,
    /// An explicit permutation: `perm[j]` is the term consumed at step j.
    Permutation(Vec<usize>),
    /// The permutation with this lexicographic index in `0..k!` (0 = identity).
    PermutationIndex(u64),
    /// The canonical representative of this B structural class in `0..k!/2`.
    BClass(u64),
}

impl Order {
    /// The permutation of `0..k` this order denotes.
    pub fn resolve(&self, k: usize) -> Result<Vec<usize>, ContractError> {
        match self {
            Order::Identity => Ok(identity_permutation(k)),
            Order::Permutation(p) => {
                validate_permutation(k, p)?;
                Ok(p.clone())
            }
            Order::PermutationIndex(i) => permutation_from_index(k, *i),
            Order::BClass(c) => b_class_representative(k, *c),
        }
    }

    /// Parses an order: `identity`, `index:N` (lexicographic permutation
    /// index), `class:N` (B class representative), `perm:3,1,0,2,4,5` or a bare
    /// comma-separated permutation `3,1,0,2,4,5`. A bare integer `N` is a
    /// B class when `bare_integer_is_class` (the `b` contract), otherwise a
    /// permutation index. Case-insensitive; whitespace around items is ignored.
    pub fn parse(s: &str, bare_integer_is_class: bool) -> Result<Order, ContractError> {
        let err = |reason: &str| ContractError::InvalidOrder {
            given: s.to_string(),
            reason: reason.to_string(),
        };
        let t = s.trim().to_ascii_lowercase();
        let number = |v: &str| {
            v.trim()
                .parse::<u64>()
                .map_err(|_| err("expected a non-negative integer after the colon"))
        };
        if t == "identity" || t == "id" {
            return Ok(Order::Identity);
        }
        if let Some(v) = t.strip_prefix("index:") {
            return Ok(Order::PermutationIndex(number(v)?));
        }
        if let Some(v) = t.strip_prefix("class:").or_else(|| t.strip_prefix("b-class:")) {
            return Ok(Order::BClass(number(v)?));
        }
        let list = t.strip_prefix("perm:").unwrap_or(&t);
        if list.contains(',') || t.starts_with("perm:") {
            let perm = list
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| err("expected a comma-separated list of term indices"))?;
            return Ok(Order::Permutation(perm));
        }
        if let Ok(n) = t.parse::<u64>() {
            return Ok(if bare_integer_is_class {
                Order::BClass(n)
            } else {
                Order::PermutationIndex(n)
            });
        }
        Err(err(
            "expected identity, index:N, class:N, perm:I,J,… or a comma-separated permutation",
        ))
    }
}

impl fmt::Display for Order {
    /// The form accepted by [`Order::parse`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Order::Identity => write!(f, "identity"),
            Order::Permutation(p) => {
                write!(f, "perm:")?;
                for (i, x) in p.iter().enumerate() {
                    write!(f, "{}{x}", if i == 0 { "" } else { "," })?;
                }
                Ok(())
            }
            Order::PermutationIndex(i) => write!(f, "index:{i}"),
            Order::BClass(c) => write!(f, "class:{c}"),
        }
    }
}

/// One MoE aggregation contract: operand precision × accumulator × shape ×
/// order × output rounding (see the module docs for the exact equations).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AggregationContract {
    /// Representation of each routed term.
    pub operand: OperandPrecision,
    /// Cross-expert accumulator and its per-addition rounding.
    pub accumulator: Accumulator,
    /// Association of the routed reduction.
    pub shape: Shape,
    /// Permutation applied to the routed terms.
    pub order: Order,
    /// Final rounding after the shared-expert merge.
    pub output: OutputRounding,
}

/// Names of the presets, in the order [`AggregationContract::describe`] tries them.
pub const PRESET_NAMES: [&str; 9] = [
    "native",
    "p32",
    "c",
    "a",
    "b",
    "exact",
    "tree",
    "f64",
    "exact-fused",
];

impl AggregationContract {
    const fn preset(operand: OperandPrecision, accumulator: Accumulator, shape: Shape) -> Self {
        AggregationContract {
            operand,
            accumulator,
            shape,
            order: Order::Identity,
            output: OutputRounding::Bf16,
        }
    }

    /// P32: FP32 terms, FP32 accumulator (paper eq. P32).
    pub const fn p32() -> Self {
        Self::preset(OperandPrecision::F32, Accumulator::F32, Shape::Sequential)
    }

    /// C: BF16-rounded terms exactly promoted, FP32 accumulator (paper eq. C).
    pub const fn c() -> Self {
        Self::preset(OperandPrecision::Bf16, Accumulator::F32, Shape::Sequential)
    }

    /// A: FP32 terms, BF16 round after every addition (paper eq. A).
    pub const fn a() -> Self {
        Self::preset(OperandPrecision::F32, Accumulator::Bf16, Shape::Sequential)
    }

    /// B: BF16-rounded terms, BF16 round after every addition (paper eq. B).
    pub const fn b() -> Self {
        Self::preset(OperandPrecision::Bf16, Accumulator::Bf16, Shape::Sequential)
    }

    /// The runtime's default contract: C with the identity order (bitwise
    /// equal to [`super::combine_native`]).
    pub const fn native() -> Self {
        Self::c()
    }

    /// BF16-rounded terms summed exactly, rounded once to FP32, then the common merge.
    pub const fn exact() -> Self {
        Self::preset(OperandPrecision::Bf16, Accumulator::Exact, Shape::Sequential)
    }

    /// BF16-rounded terms and the shared output summed exactly and rounded
    /// once to BF16: the correctly rounded MoE output.
    pub const fn exact_fused() -> Self {
        Self::preset(OperandPrecision::Bf16, Accumulator::ExactFused, Shape::Sequential)
    }

    /// BF16-rounded terms, FP32 accumulator, fixed pairwise tree.
    pub const fn tree() -> Self {
        Self::preset(OperandPrecision::Bf16, Accumulator::F32, Shape::PairwiseTree)
    }

    /// BF16-rounded terms, FP64 accumulator, converted to FP32 once before the merge.
    pub const fn f64() -> Self {
        Self::preset(OperandPrecision::Bf16, Accumulator::F64, Shape::Sequential)
    }

    /// The preset with this name (case-insensitive), identity order.
    pub fn from_preset_name(name: &str) -> Option<Self> {
        Some(match name.trim().to_ascii_lowercase().as_str() {
            "native" => Self::native(),
            "p32" => Self::p32(),
            "c" => Self::c(),
            "a" => Self::a(),
            "b" => Self::b(),
            "exact" => Self::exact(),
            "tree" => Self::tree(),
            "f64" => Self::f64(),
            "exact-fused" => Self::exact_fused(),
            _ => return None,
        })
    }

    /// This contract with another order.
    pub fn with_order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    /// Parses a contract: a preset name (`native|p32|c|a|b|exact|tree|f64|exact-fused`,
    /// case-insensitive), optionally followed by `+key=value` overrides with
    /// keys `operand` (`f32|bf16`), `accumulator`/`acc` (`f32|bf16|f64|exact|exact-fused`),
    /// `shape` (`sequential|tree`), `output` (`bf16|f32`) and `order` (see
    /// [`Order::parse`]; a bare integer is a B class for the B operand and
    /// accumulator, otherwise a permutation index). A string that starts with
    /// an override starts from `c`. Examples: `b`, `b+order=class:135`,
    /// `c+shape=tree`, `exact+operand=f32`, `p32+output=f32`.
    pub fn parse(s: &str) -> Result<Self, ContractError> {
        let mut parts = s.split('+');
        let first = parts.next().unwrap_or("").trim();
        let mut contract;
        let mut overrides: Vec<&str> = Vec::new();
        if first.contains('=') {
            contract = Self::c();
            overrides.push(first);
        } else {
            contract = Self::from_preset_name(first)
                .ok_or_else(|| ContractError::UnknownContract { given: s.to_string() })?;
        }
        overrides.extend(parts);
        let mut order_text = None;
        for token in overrides {
            let bad = |reason: &str| ContractError::InvalidOverride {
                given: token.to_string(),
                reason: reason.to_string(),
            };
            let (key, value) = token.split_once('=').ok_or_else(|| bad("expected key=value"))?;
            let value = value.trim().to_ascii_lowercase();
            match key.trim().to_ascii_lowercase().as_str() {
                "operand" => {
                    contract.operand = match value.as_str() {
                        "f32" => OperandPrecision::F32,
                        "bf16" => OperandPrecision::Bf16,
                        _ => return Err(bad("operand must be f32 or bf16")),
                    }
                }
                "accumulator" | "acc" => {
                    contract.accumulator = match value.as_str() {
                        "f32" => Accumulator::F32,
                        "bf16" => Accumulator::Bf16,
                        "f64" => Accumulator::F64,
                        "exact" => Accumulator::Exact,
                        "exact-fused" => Accumulator::ExactFused,
                        _ => return Err(bad("accumulator must be f32, bf16, f64, exact or exact-fused")),
                    }
                }
                "shape" => {
                    contract.shape = match value.as_str() {
                        "sequential" | "seq" => Shape::Sequential,
                        "tree" => Shape::PairwiseTree,
                        _ => return Err(bad("shape must be sequential or tree")),
                    }
                }
                "output" => {
                    contract.output = match value.as_str() {
                        "bf16" => OutputRounding::Bf16,
                        "f32" => OutputRounding::F32,
                        _ => return Err(bad("output must be bf16 or f32")),
                    }
                }
                "order" => order_text = Some(value),
                _ => return Err(bad("unknown key (operand, accumulator, shape, output, order)")),
            }
        }
        if let Some(text) = order_text {
            contract.order = Order::parse(&text, contract.is_b_like())?;
        }
        Ok(contract)
    }

    /// Whether operand and accumulator are both BF16 (the B scheme, where the
    /// first-pair symmetry holds and bare order integers denote classes).
    pub fn is_b_like(&self) -> bool {
        self.operand == OperandPrecision::Bf16 && self.accumulator == Accumulator::Bf16
    }

    /// A canonical description that [`AggregationContract::parse`] reads back:
    /// the first preset (in `p32, c, a, b, exact, tree, f64, exact-fused` order) whose
    /// operand, accumulator and shape match, then `+output=f32` and
    /// `+order=…` when they differ from the preset's. C with the identity
    /// order is described as `c` (the runtime's [`super::NativeCombine`]
    /// describes itself as `native`).
    pub fn describe(&self) -> String {
        let base = PRESET_NAMES[1..]
            .iter()
            .filter_map(|n| Self::from_preset_name(n).map(|p| (*n, p)))
            .find(|(_, p)| {
                p.operand == self.operand && p.accumulator == self.accumulator && p.shape == self.shape
            });
        let mut s = match base {
            Some((name, _)) => name.to_string(),
            None => {
                // No preset has this operand/accumulator/shape combination:
                // spell out all three.
                let op = match self.operand {
                    OperandPrecision::F32 => "f32",
                    OperandPrecision::Bf16 => "bf16",
                };
                let acc = match self.accumulator {
                    Accumulator::F32 => "f32",
                    Accumulator::Bf16 => "bf16",
                    Accumulator::F64 => "f64",
                    Accumulator::Exact => "exact",
                    Accumulator::ExactFused => "exact-fused",
                };
                let shape = match self.shape {
                    Shape::Sequential => "sequential",
                    Shape::PairwiseTree => "tree",
                };
                format!("operand={op}+accumulator={acc}+shape={shape}")
            }
        };
        if self.output == OutputRounding::F32 {
            s.push_str("+output=f32");
        }
        if self.order != Order::Identity {
            s.push_str(&format!("+order={}", self.order));
        }
        s
    }

    /// Checks that the order is valid for k terms.
    pub fn validate_for_k(&self, k: usize) -> Result<(), ContractError> {
        self.order.resolve(k).map(|_| ())
    }

    /// Combines with the contract's own order, checking every length and the
    /// order against k = `terms.len()`.
    pub fn try_combine(
        &self,
        terms: &[&[f32]],
        shared: &[f32],
        out: &mut [f32],
    ) -> Result<(), ContractError> {
        let perm = self.order.resolve(terms.len())?;
        self.try_combine_with_permutation(&perm, terms, shared, out)
    }

    /// Combines with an explicit permutation instead of the contract's order
    /// (schedules and the certificate use this).
    pub fn try_combine_with_permutation(
        &self,
        perm: &[usize],
        terms: &[&[f32]],
        shared: &[f32],
        out: &mut [f32],
    ) -> Result<(), ContractError> {
        validate_permutation(terms.len(), perm)?;
        let d = out.len();
        if shared.len() != d {
            return Err(ContractError::LengthMismatch {
                what: "shared".into(),
                got: shared.len(),
                expected: d,
            });
        }
        for (j, t) in terms.iter().enumerate() {
            if t.len() != d {
                return Err(ContractError::LengthMismatch {
                    what: format!("term {j}"),
                    got: t.len(),
                    expected: d,
                });
            }
        }
        self.combine_unchecked(perm, terms, shared, out);
        Ok(())
    }

    /// The kernel: lengths and permutation already validated.
    fn combine_unchecked(&self, perm: &[usize], terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        let mut ops = vec![0.0f32; perm.len()];
        let mut scratch = Vec::with_capacity(perm.len());
        for (d, y) in out.iter_mut().enumerate() {
            for (op, &p) in ops.iter_mut().zip(perm) {
                let v = terms[p][d];
                *op = match self.operand {
                    OperandPrecision::F32 => v,
                    OperandPrecision::Bf16 => r_bf16(v),
                };
            }
            let r = if self.accumulator == Accumulator::ExactFused {
                let mut s = ExactSum::new();
                for &x in &ops {
                    s.add(x);
                }
                s.add(shared[d]);
                match self.output {
                    OutputRounding::Bf16 => s.to_bf16(),
                    OutputRounding::F32 => s.to_f32(),
                }
            } else {
                let merged = self.reduce(&ops, &mut scratch) + shared[d];
                match self.output {
                    OutputRounding::Bf16 => r_bf16(merged),
                    OutputRounding::F32 => merged,
                }
            };
            *y = if r.is_nan() {
                f32::from_bits(CANONICAL_NAN_BITS)
            } else {
                r
            };
        }
    }

    /// The routed reduction of one element's operands (already permuted and
    /// operand-rounded), returned as `FP32(a_k)` (for `ExactFused`, the
    /// routed part alone, rounded once to FP32).
    pub(crate) fn reduce(&self, ops: &[f32], scratch: &mut Vec<f32>) -> f32 {
        match self.accumulator {
            Accumulator::Exact | Accumulator::ExactFused => {
                let mut s = ExactSum::new();
                for &x in ops {
                    s.add(x);
                }
                s.to_f32()
            }
            Accumulator::F64 => {
                let add = |a: f64, b: f64| a + b;
                let mut wide: Vec<f64> = ops.iter().map(|&x| f64::from(x)).collect();
                (reduce_shape(self.shape, &mut wide, 0.0f64, add)) as f32
            }
            Accumulator::F32 => {
                scratch.clear();
                scratch.extend_from_slice(ops);
                reduce_shape(self.shape, scratch, 0.0f32, |a, b| a + b)
            }
            Accumulator::Bf16 => {
                scratch.clear();
                scratch.extend_from_slice(ops);
                reduce_shape(self.shape, scratch, 0.0f32, |a, b| r_bf16(a + b))
            }
        }
    }
}

/// Reduces `xs` with `add` in the given shape from the zero accumulator `zero`
/// (+0). `xs` is used as scratch.
fn reduce_shape<T: Copy>(shape: Shape, xs: &mut Vec<T>, zero: T, add: impl Fn(T, T) -> T) -> T {
    match shape {
        Shape::Sequential => xs.iter().fold(zero, |a, &x| add(a, x)),
        Shape::PairwiseTree => {
            if xs.is_empty() {
                return zero;
            }
            while xs.len() > 1 {
                let n = xs.len();
                for i in 0..n / 2 {
                    xs[i] = add(xs[2 * i], xs[2 * i + 1]);
                }
                if n % 2 == 1 {
                    xs[n / 2] = xs[n - 1];
                }
                xs.truncate(n.div_ceil(2));
            }
            add(zero, xs[0])
        }
    }
}

impl std::str::FromStr for AggregationContract {
    type Err = ContractError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for AggregationContract {
    /// The same text as [`AggregationContract::describe`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

impl MoeCombine for AggregationContract {
    /// Applies the contract's own order to every event (the event is ignored).
    ///
    /// # Panics
    ///
    /// If the order is not valid for k = `terms.len()` or the slice lengths
    /// differ; call [`AggregationContract::validate_for_k`] once at setup (the
    /// runtime does, with the config's `num_experts_per_tok`).
    fn combine(&self, _event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        if let Err(e) = self.try_combine(terms, shared, out) {
            panic!("MoE combine with contract {}: {e}", self.describe());
        }
    }

    fn describe(&self) -> String {
        AggregationContract::describe(self)
    }
}
