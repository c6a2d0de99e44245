//! The combine grammar: the parameterized [`AggregationContract`], its
//! presets, and its textual notation.
//!
//! A contract is terms × accumulator × start × shape × order × shared merge ×
//! routed rounding × output. For k gate-weighted FP32 routed terms
//! `v_0 … v_{k−1}` (length D, router slot order), the shared expert output
//! `s`, and the event's expert ids and gate weights (for the named orders that
//! need them, [`EventContext`]), each output element is computed
//! independently:
//!
//! 1. **terms**: `u_j = T(v_j)`, with `T` = identity ([`OperandPrecision::F32`])
//!    or R_BF16 ([`OperandPrecision::Bf16`], exact promotion back to FP32);
//! 2. **operand list**: the terms in the [`Order`]'s permutation `π`,
//!    `u_{π_0} … u_{π_{k−1}}`, with `s` prepended ([`SharedMerge::First`]) or
//!    appended ([`SharedMerge::Last`]) when the shared expert is summed in the
//!    same accumulator;
//! 3. **reduction** of the operand list in the [`Accumulator`] by the
//!    [`Shape`] (sequential chain, pairwise tree or SIMD lane fold), each
//!    chain starting from `+0` or, with [`Start::First`], from its first
//!    operand alone;
//! 4. **merge**: with [`SharedMerge::Separate`], `r = FP32(a)` (optionally
//!    rounded with R_BF16, [`RoutedRounding::Bf16`]) and `y = Out(fl32(r + s))`;
//!    otherwise `y = Out(FP32(a))`; `Out` = R_BF16 ([`OutputRounding::Bf16`])
//!    or identity ([`OutputRounding::F32`]). A NaN result is replaced by the
//!    canonical quiet NaN `0x7fc0_0000`.
//!
//! docs/contracts.md states every equation (including the exact and FP64
//! accumulators' conversions) and the notation; `crate::kernel` evaluates it.
//! The paper's presets (section 2.5) and the notation's other names:
//!
//! | preset | terms | accumulator | shape | shared | output |
//! |---|---|---|---|---|---|
//! | `p32` | f32 | f32 | sequential | separate | bf16 |
//! | `c` (= `native`) | bf16 | f32 | sequential | separate | bf16 |
//! | `a` | f32 | bf16 | sequential | separate | bf16 |
//! | `b` | bf16 | bf16 | sequential | separate | bf16 |
//! | `exact` | bf16 | exact | sequential | separate | bf16 |
//! | `f64` | bf16 | f64 | sequential | separate | bf16 |
//! | `tree` | bf16 | f32 | pairwise tree | separate | bf16 |
//! | `exact-fused` | bf16 | exact | sequential | last (one rounding) | bf16 |

use std::fmt;
use std::sync::LazyLock;

use super::error::ContractError;
use super::named::EventContext;
use super::order::{
    b_class_representative, identity_permutation, permutation_from_index, validate_permutation,
};
use super::{CombineEvent, MoeCombine};

/// The canonical quiet NaN every contract writes in place of a NaN result
/// (NaN sign and payload after IEEE arithmetic are not specified by Rust and
/// differ between machines; this keeps the output bits machine-independent).
pub const CANONICAL_NAN_BITS: u32 = 0x7fc0_0000;

/// Representation of each routed term before it enters the accumulator
/// (notation key `operand`, alias `terms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OperandPrecision {
    /// The FP32 term `v_j` itself.
    F32,
    /// `FP32(R_BF16(v_j))`: the term rounded to BF16, exactly promoted.
    Bf16,
    /// Never formed: each routed step of the chain is `a ← fma(u_j, g_j, a)`
    /// on the expert's unweighted FP32 output `u_j` and its gate `g_j` (one
    /// rounding per step; with [`Start::First`] the chain begins at
    /// `fl32(u_0 · g_0)`), the shared expert, when in the accumulator, added
    /// as usual. Only with the FP32 accumulator and the sequential shape
    /// (notation `operand=fma`). vLLM-CPU's BF16-expert kernel sums this way
    /// (`cpu_fused_moe.cpp`, docs/interop-vllm.md §4.1). Needs the event's
    /// unweighted outputs ([`crate::CombineEvent::units`]): a trace's
    /// recorded terms cannot reproduce it, so inference never tries it.
    Fma,
}

/// Precision of the cross-expert accumulator and the rounding after each addition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Accumulator {
    /// FP32 container, `fl32(a + u)` after every addition.
    F32,
    /// BF16 container: `R_BF16(fl32(a + u))` after every addition.
    Bf16,
    /// FP64 container, `fl64(a + u)`; leaves the accumulator through one
    /// f64 → f32 conversion (`as f32`, ties to even).
    F64,
    /// The exact real sum, rounded once, directly to the precision of the
    /// stage it goes to (FP32 for the merge, BF16 for `routed=bf16` or a BF16
    /// output when the shared expert is in the accumulator). Order, shape and
    /// start do not change it. `exact-fused` is this accumulator with the
    /// shared expert in it ([`SharedMerge::Last`]): the correctly rounded
    /// MoE output.
    Exact,
}

/// How the k routed operands (and `s`, when in the accumulator) are
/// associated. The leaves are the operand list in the [`Order`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Shape {
    /// Left-to-right chain: `(((a_0 ⊕ x_0) ⊕ x_1) ⊕ …) ⊕ x_{n−1}` (paper section 2.4.1).
    Sequential,
    /// Balanced pairwise tree: each level adds neighbours `(x_0 ⊕ x_1), (x_2 ⊕ x_3), …`,
    /// an odd last element moves up unchanged, until one value remains; then
    /// `a = +0 ⊕ root` (with [`Start::Zero`]). For k = 6:
    /// `((x0⊕x1) ⊕ (x2⊕x3)) ⊕ (x4⊕x5)`.
    PairwiseTree,
    /// SIMD lanes: lane `l < width` accumulates the operands at positions
    /// `l, l + width, l + 2·width, …` as a chain (from `+0`, or from its first
    /// operand with [`Start::First`]; an empty lane is `+0`), then the lanes
    /// are folded by `fold`.
    Lanes {
        /// Number of lanes: a power of two, 2 ..= 64.
        width: u8,
        /// How the lane partial sums are folded.
        fold: LaneFold,
    },
}

/// How SIMD lane partial sums are folded into one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LaneFold {
    /// Repeated halving (a horizontal reduction): with w lanes left,
    /// `p_i ← p_i ⊕ p_{i + w/2}` for `i < w/2`, until one lane remains.
    Halving,
    /// Left to right: `((p_0 ⊕ p_1) ⊕ p_2) ⊕ … ⊕ p_{w−1}`.
    Sequential,
}

/// Where the shared expert output `s` is merged (notation key `shared`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SharedMerge {
    /// The routed sum is completed first, then `y = Out(fl32(r + s))` with
    /// one FP32 addition (the paper's common merge).
    Separate,
    /// `s` is the last operand of the routed accumulator.
    Last,
    /// `s` is the first operand of the routed accumulator (with
    /// [`Start::First`], the accumulator's initial value).
    First,
}

/// Rounding of the routed sum before a [`SharedMerge::Separate`] merge
/// (notation key `routed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RoutedRounding {
    /// The routed sum enters the merge as FP32 (`FP32(a)`).
    F32,
    /// The routed sum is rounded to BF16 first: `r = R_BF16(FP32(a))` (the
    /// exact accumulator rounds once, directly to BF16).
    Bf16,
}

/// How every accumulation chain begins (notation key `start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Start {
    /// From `+0`: the first operand is added to `+0` (the paper's `a_0 = +0`).
    Zero,
    /// From the first operand alone, converted to the accumulator
    /// (`R_BF16(x)` for BF16, `x` otherwise). Differs from [`Start::Zero`]
    /// only in the sign of a zero: a chain whose operands are all `−0` ends at
    /// `−0` instead of `+0`.
    First,
}

/// Final rounding of the MoE output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OutputRounding {
    /// `y = R_BF16(…)`: the paper's common shared-expert merge.
    Bf16,
    /// No further rounding (FP32 output).
    F32,
}

/// Which permutation of the routed terms (the leaves of the [`Shape`]) a
/// contract applies (see [`super::order`] for the permutation conventions
/// and `crate::named` for the orders determined by the event).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Order {
    /// Router slot order `[0, 1, …, k−1]` (notation `identity` or `slot`).
    Identity,
    /// Reversed slot order `[k−1, …, 1, 0]` (`reversed`).
    Reversed,
    /// Ascending expert id; equal ids in slot order (`asc-id`).
    AscendingId,
    /// Descending expert id; equal ids in slot order (`desc-id`).
    DescendingId,
    /// Descending gate weight (IEEE total order); bitwise-equal gates in slot order (`desc-gate`).
    DescendingGate,
    /// Ascending gate weight (IEEE total order); bitwise-equal gates in slot order (`asc-gate`).
    AscendingGate,
    /// An explicit permutation: `perm[j]` is the slot of the term at position j.
    Permutation(Vec<usize>),
    /// The permutation with this lexicographic index in `0..k!` (0 = identity).
    PermutationIndex(u64),
    /// The canonical representative of this B structural class in `0..k!/2`.
    BClass(u64),
}

impl Order {
    /// The permutation of `0..k` this order denotes, for the orders that do
    /// not depend on the event (every order but the expert-id and gate
    /// orders, which need [`Order::resolve_in`]).
    pub fn resolve(&self, k: usize) -> Result<Vec<usize>, ContractError> {
        self.resolve_in(k, None)
    }

    /// The permutation of `0..k` this order denotes at an event with this
    /// context (required by the expert-id and gate orders).
    pub fn resolve_in(&self, k: usize, ctx: Option<&EventContext<'_>>) -> Result<Vec<usize>, ContractError> {
        match self {
            Order::Identity => Ok(identity_permutation(k)),
            Order::Reversed => Ok((0..k).rev().collect()),
            Order::AscendingId | Order::DescendingId | Order::DescendingGate | Order::AscendingGate => {
                let ctx = ctx.ok_or_else(|| ContractError::NeedsEventContext {
                    order: self.to_string(),
                })?;
                ctx.permutation(self, k)
            }
            Order::Permutation(p) => {
                validate_permutation(k, p)?;
                Ok(p.clone())
            }
            Order::PermutationIndex(i) => permutation_from_index(k, *i),
            Order::BClass(c) => b_class_representative(k, *c),
        }
    }

    /// Whether this order is named by what determines it (slot, reversed,
    /// expert id or gate), rather than an explicit permutation.
    pub fn is_named(&self) -> bool {
        !matches!(
            self,
            Order::Permutation(_) | Order::PermutationIndex(_) | Order::BClass(_)
        )
    }

    /// What determines the order, in words (`ascending expert id`, …; an
    /// explicit permutation is `permutation perm:…`).
    pub fn name(&self) -> String {
        match self {
            Order::Identity => "router slot order".into(),
            Order::Reversed => "reversed slot order".into(),
            Order::AscendingId => "ascending expert id".into(),
            Order::DescendingId => "descending expert id".into(),
            Order::DescendingGate => "descending gate weight".into(),
            Order::AscendingGate => "ascending gate weight".into(),
            other => format!("permutation {other}"),
        }
    }

    /// Parses an order: `identity` (alias `slot`), `reversed`, `asc-id`,
    /// `desc-id`, `desc-gate`, `asc-gate`, `index:N` (lexicographic
    /// permutation index), `class:N` (B class representative),
    /// `perm:3,1,0,2,4,5` or a bare comma-separated permutation `3,1,0,2,4,5`.
    /// A bare integer `N` is a B class when `bare_integer_is_class` (the `b`
    /// contract), otherwise a permutation index. Case-insensitive; whitespace
    /// around items is ignored.
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
        match t.as_str() {
            "identity" | "id" | "slot" => return Ok(Order::Identity),
            "reversed" | "reverse" => return Ok(Order::Reversed),
            "asc-id" => return Ok(Order::AscendingId),
            "desc-id" => return Ok(Order::DescendingId),
            "desc-gate" => return Ok(Order::DescendingGate),
            "asc-gate" => return Ok(Order::AscendingGate),
            _ => {}
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
            "expected identity (slot), reversed, asc-id, desc-id, desc-gate, asc-gate, index:N, class:N, perm:I,J,… or a comma-separated permutation",
        ))
    }
}

impl fmt::Display for Order {
    /// The form accepted by [`Order::parse`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Order::Identity => write!(f, "identity"),
            Order::Reversed => write!(f, "reversed"),
            Order::AscendingId => write!(f, "asc-id"),
            Order::DescendingId => write!(f, "desc-id"),
            Order::DescendingGate => write!(f, "desc-gate"),
            Order::AscendingGate => write!(f, "asc-gate"),
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

impl Shape {
    /// Parses `sequential` (alias `seq`), `tree`, `lanes:W` (halving fold)
    /// or `lanes:W:seq` (sequential fold), W a power of two in 2 ..= 64.
    /// `lanes:2:seq` is `lanes:2` (both folds are one addition).
    pub fn parse(s: &str) -> Result<Shape, String> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "sequential" | "seq" => return Ok(Shape::Sequential),
            "tree" => return Ok(Shape::PairwiseTree),
            _ => {}
        }
        let bad = || {
            "shape must be sequential, tree, lanes:W or lanes:W:seq (W a power of two, 2..=64)".to_string()
        };
        let rest = t.strip_prefix("lanes:").ok_or_else(bad)?;
        let (w, fold) = match rest.split_once(':') {
            None => (rest, LaneFold::Halving),
            Some((w, "seq")) => (w, LaneFold::Sequential),
            Some(_) => return Err(bad()),
        };
        let width: u8 = w.trim().parse().map_err(|_| bad())?;
        if !(2..=64).contains(&width) || !width.is_power_of_two() {
            return Err(bad());
        }
        let fold = if width == 2 { LaneFold::Halving } else { fold };
        Ok(Shape::Lanes { width, fold })
    }

    /// What the shape is, in words (`sequential`, `pairwise tree`, `4-lane fold (halving)`).
    pub fn name(&self) -> String {
        match self {
            Shape::Sequential => "sequential".into(),
            Shape::PairwiseTree => "balanced pairwise tree".into(),
            Shape::Lanes { width, fold } => format!(
                "{width}-lane partial sums, {} fold",
                match fold {
                    LaneFold::Halving => "halving",
                    LaneFold::Sequential => "left-to-right",
                }
            ),
        }
    }
}

impl fmt::Display for Shape {
    /// The form accepted by [`Shape::parse`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Shape::Sequential => write!(f, "sequential"),
            Shape::PairwiseTree => write!(f, "tree"),
            Shape::Lanes {
                width,
                fold: LaneFold::Halving,
            } => write!(f, "lanes:{width}"),
            Shape::Lanes {
                width,
                fold: LaneFold::Sequential,
            } => write!(f, "lanes:{width}:seq"),
        }
    }
}

/// One MoE aggregation contract: a member of the combine grammar (see the
/// module docs for the equations and docs/contracts.md for the notation).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AggregationContract {
    /// Representation of each routed term.
    pub operand: OperandPrecision,
    /// Cross-expert accumulator and its per-addition rounding.
    pub accumulator: Accumulator,
    /// Association of the reduction.
    pub shape: Shape,
    /// Permutation applied to the routed terms.
    pub order: Order,
    /// How each accumulation chain begins.
    pub start: Start,
    /// Where the shared expert is merged.
    pub shared: SharedMerge,
    /// Rounding of the routed sum before a separate merge.
    pub routed: RoutedRounding,
    /// Final rounding of the output.
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

/// The presets [`AggregationContract::describe`] names a base after
/// ([`PRESET_NAMES`] without `native`, in that order), parsed once: `moeconf
/// explain` describes every rule of every event of a trace, and parsing the
/// names anew for each description was a measurable share of its time.
static DESCRIBE_PRESETS: LazyLock<Vec<(&'static str, AggregationContract)>> = LazyLock::new(|| {
    PRESET_NAMES[1..]
        .iter()
        .filter_map(|n| AggregationContract::from_preset_name(n).map(|p| (*n, p)))
        .collect()
});

/// Most contracts (without their orders) whose descriptions a thread keeps:
/// more than the grammar's members, so that only contracts outside it (such
/// as lane widths nothing names) can find the cache full.
const MAX_CACHED_FAMILIES: usize = 4096;

thread_local! {
    /// The descriptions of the contracts (order `identity`) this thread has
    /// described ([`AggregationContract::describe`]), by their family key.
    static FAMILY_DESCRIPTIONS: std::cell::RefCell<std::collections::HashMap<u64, String>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

impl AggregationContract {
    const fn preset(operand: OperandPrecision, accumulator: Accumulator, shape: Shape) -> Self {
        AggregationContract {
            operand,
            accumulator,
            shape,
            order: Order::Identity,
            start: Start::Zero,
            shared: SharedMerge::Separate,
            routed: RoutedRounding::F32,
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
    /// once to BF16: the correctly rounded MoE output (the exact accumulator
    /// with the shared expert in it).
    pub const fn exact_fused() -> Self {
        let mut c = Self::exact();
        c.shared = SharedMerge::Last;
        c
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

    /// This contract with another shape.
    pub fn with_shape(mut self, shape: Shape) -> Self {
        self.shape = shape;
        self
    }

    /// Parses a contract in the notation of docs/contracts.md: a preset name
    /// (`native|p32|c|a|b|exact|tree|f64|exact-fused`, case-insensitive),
    /// optionally followed by `+key=value` overrides with keys
    /// `operand` (alias `terms`: `f32|bf16`), `accumulator` (alias `acc`:
    /// `f32|bf16|f64|exact|exact-fused`), `shape` (`sequential|tree|lanes:W|lanes:W:seq`),
    /// `order` (see [`Order::parse`]; a bare integer is a B class for the B
    /// operand and accumulator, otherwise a permutation index), `start`
    /// (`zero|first`), `shared` (`separate|last|first`), `routed`
    /// (`f32|bf16`) and `output` (`bf16|f32`). A string that starts with an
    /// override starts from `c`. `accumulator=exact-fused` means
    /// `accumulator=exact+shared=last`; any other `accumulator=` resets
    /// `shared` to `separate` (an explicit `shared=` wins). Examples: `b`,
    /// `b+order=class:135`, `b+order=asc-id`, `c+routed=bf16`,
    /// `p32+start=first+output=f32`, `c+shape=lanes:8`.
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
        let mut later: Vec<(&'static str, String)> = Vec::new();
        for token in overrides {
            let bad = |reason: &str| ContractError::InvalidOverride {
                given: token.to_string(),
                reason: reason.to_string(),
            };
            let (key, value) = token.split_once('=').ok_or_else(|| bad("expected key=value"))?;
            let value = value.trim().to_ascii_lowercase();
            match key.trim().to_ascii_lowercase().as_str() {
                "operand" | "terms" => {
                    contract.operand = match value.as_str() {
                        "f32" => OperandPrecision::F32,
                        "bf16" => OperandPrecision::Bf16,
                        "fma" => OperandPrecision::Fma,
                        _ => return Err(bad("operand must be f32, bf16 or fma")),
                    }
                }
                "accumulator" | "acc" => {
                    let (acc, shared) = match value.as_str() {
                        "f32" => (Accumulator::F32, SharedMerge::Separate),
                        "bf16" => (Accumulator::Bf16, SharedMerge::Separate),
                        "f64" => (Accumulator::F64, SharedMerge::Separate),
                        "exact" => (Accumulator::Exact, SharedMerge::Separate),
                        "exact-fused" => (Accumulator::Exact, SharedMerge::Last),
                        _ => return Err(bad("accumulator must be f32, bf16, f64, exact or exact-fused")),
                    };
                    contract.accumulator = acc;
                    contract.shared = shared;
                }
                "shape" => contract.shape = Shape::parse(&value).map_err(|r| bad(&r))?,
                "output" => {
                    contract.output = match value.as_str() {
                        "bf16" => OutputRounding::Bf16,
                        "f32" => OutputRounding::F32,
                        _ => return Err(bad("output must be bf16 or f32")),
                    }
                }
                "order" => order_text = Some(value),
                "shared" => later.push(("shared", value)),
                "routed" => later.push(("routed", value)),
                "start" => later.push(("start", value)),
                _ => return Err(bad(
                    "unknown key (operand/terms, accumulator, shape, order, start, shared, routed, output)",
                )),
            }
        }
        for (key, value) in later {
            contract.apply_late(key, &value)?;
        }
        if contract.routed == RoutedRounding::Bf16 && contract.shared != SharedMerge::Separate {
            return Err(ContractError::InvalidOverride {
                given: s.to_string(),
                reason: "routed=bf16 rounds the routed sum before a separate merge: it needs shared=separate"
                    .into(),
            });
        }
        if contract.operand == OperandPrecision::Fma
            && (contract.accumulator != Accumulator::F32 || contract.shape != Shape::Sequential)
        {
            return Err(ContractError::InvalidOverride {
                given: s.to_string(),
                reason: "operand=fma is a chain of FP32 fused multiply-adds: it needs accumulator=f32 and shape=sequential"
                    .into(),
            });
        }
        if let Some(text) = order_text {
            contract.order = Order::parse(&text, contract.bare_integer_is_class())?;
        }
        Ok(contract)
    }

    /// Applies a `shared=`, `routed=` or `start=` override (after the
    /// others, so an explicit `shared=` wins over an `accumulator=` reset).
    fn apply_late(&mut self, key: &str, value: &str) -> Result<(), ContractError> {
        let bad = |reason: &str| ContractError::InvalidOverride {
            given: format!("{key}={value}"),
            reason: reason.to_string(),
        };
        match key {
            "shared" => {
                self.shared = match value {
                    "separate" => SharedMerge::Separate,
                    "last" => SharedMerge::Last,
                    "first" => SharedMerge::First,
                    _ => return Err(bad("shared must be separate, last or first")),
                }
            }
            "routed" => {
                self.routed = match value {
                    "f32" => RoutedRounding::F32,
                    "bf16" => RoutedRounding::Bf16,
                    _ => return Err(bad("routed must be f32 or bf16")),
                }
            }
            _ => {
                self.start = match value {
                    "zero" => Start::Zero,
                    "first" => Start::First,
                    _ => return Err(bad("start must be zero or first")),
                }
            }
        }
        Ok(())
    }

    /// Whether a bare order integer denotes a B class: operand and
    /// accumulator both BF16 (the notation's rule, kept from the paper's `b`).
    fn bare_integer_is_class(&self) -> bool {
        self.operand == OperandPrecision::Bf16 && self.accumulator == Accumulator::Bf16
    }

    /// Whether this is a B-like family whose orders fall into the paper's
    /// B structural classes: BF16 operand and accumulator, sequential or tree
    /// shape, and the first two leaves are routed terms (`shared` is not
    /// `first`). Bare order integers denote B classes when operand and
    /// accumulator are BF16.
    pub fn is_b_like(&self) -> bool {
        self.bare_integer_is_class()
            && matches!(self.shape, Shape::Sequential | Shape::PairwiseTree)
            && self.shared != SharedMerge::First
    }

    /// The canonical notation, which [`AggregationContract::parse`] reads
    /// back to an equal contract. The base is the first preset (in `p32, c,
    /// a, b, exact, tree, f64, exact-fused` order) whose terms, accumulator,
    /// shape and shared merge match; else the first whose terms, accumulator
    /// and shape match; else, for a lane shape, the first whose terms and
    /// accumulator match (followed by `+shape=…`); else the spelled-out
    /// `operand=…+accumulator=…+shape=…`. Then, for each field that differs
    /// from the base, in this order: `+shared=`, `+routed=`, `+start=`,
    /// `+output=`, `+order=`. C with the identity order is described as `c`
    /// (the runtime's [`super::NativeCombine`] describes itself as `native`).
    /// Contracts of the notation before the grammar print as they did.
    ///
    /// Everything before `+order=` depends on the contract without its order
    /// alone: that part is kept per thread ([`FAMILY_DESCRIPTIONS`]), as
    /// `moeconf explain` describes the same few hundred grammar members
    /// for every event of a trace.
    pub fn describe(&self) -> String {
        if self.operand == OperandPrecision::Fma {
            // `+operand=fma` follows the order: not cached.
            return self.describe_uncached();
        }
        let key = self.family_key();
        let mut s = FAMILY_DESCRIPTIONS.with(|cache| {
            if let Some(d) = cache.borrow().get(&key) {
                return d.clone();
            }
            let family = AggregationContract {
                operand: self.operand,
                accumulator: self.accumulator,
                shape: self.shape,
                order: Order::Identity,
                start: self.start,
                shared: self.shared,
                routed: self.routed,
                output: self.output,
            };
            let d = family.describe_uncached();
            let mut cache = cache.borrow_mut();
            if cache.len() < MAX_CACHED_FAMILIES {
                cache.insert(key, d.clone());
            }
            d
        });
        self.push_order(&mut s);
        s
    }

    /// Every field but the order, packed into one number (a byte each, the
    /// shape's kind, lane width and fold in the top bits): the key of
    /// [`FAMILY_DESCRIPTIONS`], cheaper to hash than the contract.
    fn family_key(&self) -> u64 {
        let shape = match self.shape {
            Shape::Sequential => 0,
            Shape::PairwiseTree => 1,
            Shape::Lanes { width, fold } => 2 | u64::from(width) << 2 | (fold as u64) << 10,
        };
        self.operand as u64
            | (self.accumulator as u64) << 8
            | (self.start as u64) << 16
            | (self.shared as u64) << 24
            | (self.routed as u64) << 32
            | (self.output as u64) << 40
            | shape << 48
    }

    /// `+order=…` when the order is not the identity.
    fn push_order(&self, s: &mut String) {
        if self.order != Order::Identity {
            use fmt::Write as _;
            let _ = write!(s, "+order={}", self.order);
        }
    }

    /// [`AggregationContract::describe`], computed.
    fn describe_uncached(&self) -> String {
        if self.operand == OperandPrecision::Fma {
            let mut base = self.clone();
            base.operand = OperandPrecision::F32;
            return format!("{}+operand=fma", base.describe());
        }
        let presets: &[(&str, Self)] = &DESCRIBE_PRESETS;
        let same_core = |p: &Self| p.operand == self.operand && p.accumulator == self.accumulator;
        let found = presets
            .iter()
            .find(|(_, p)| same_core(p) && p.shape == self.shape && p.shared == self.shared)
            .or_else(|| {
                presets
                    .iter()
                    .find(|(_, p)| same_core(p) && p.shape == self.shape)
            });
        let lanes = matches!(self.shape, Shape::Lanes { .. });
        let (mut s, base) = match found {
            Some((name, p)) => (name.to_string(), p.clone()),
            None => match presets.iter().find(|(_, p)| lanes && same_core(p)) {
                Some((name, p)) => (
                    format!("{name}+shape={}", self.shape),
                    p.clone().with_shape(self.shape),
                ),
                None => self.spelled_out(),
            },
        };
        if self.shared != base.shared {
            s.push_str(match self.shared {
                SharedMerge::Separate => "+shared=separate",
                SharedMerge::Last => "+shared=last",
                SharedMerge::First => "+shared=first",
            });
        }
        if self.routed == RoutedRounding::Bf16 {
            s.push_str("+routed=bf16");
        }
        if self.start == Start::First {
            s.push_str("+start=first");
        }
        if self.output == OutputRounding::F32 {
            s.push_str("+output=f32");
        }
        self.push_order(&mut s);
        s
    }

    /// `operand=…+accumulator=…+shape=…` (no preset has this combination),
    /// and the contract that text parses to.
    fn spelled_out(&self) -> (String, Self) {
        let op = match self.operand {
            OperandPrecision::F32 => "f32",
            OperandPrecision::Bf16 => "bf16",
            OperandPrecision::Fma => "fma",
        };
        let fused = self.accumulator == Accumulator::Exact && self.shared != SharedMerge::Separate;
        let acc = match self.accumulator {
            Accumulator::F32 => "f32",
            Accumulator::Bf16 => "bf16",
            Accumulator::F64 => "f64",
            Accumulator::Exact if fused => "exact-fused",
            Accumulator::Exact => "exact",
        };
        let mut base = Self::c();
        base.operand = self.operand;
        base.accumulator = self.accumulator;
        base.shape = self.shape;
        base.shared = if fused {
            SharedMerge::Last
        } else {
            SharedMerge::Separate
        };
        (
            format!("operand={op}+accumulator={acc}+shape={}", self.shape),
            base,
        )
    }

    /// Checks that the order is valid for k terms (the expert-id and gate
    /// orders are valid for every k; they are resolved per event).
    pub fn validate_for_k(&self, k: usize) -> Result<(), ContractError> {
        if self.order.is_named() {
            return Ok(());
        }
        self.order.resolve(k).map(|_| ())
    }

    /// Combines with the contract's own order, checking every length and the
    /// order against k = `terms.len()`. The expert-id and gate orders need
    /// [`AggregationContract::try_combine_in`].
    pub fn try_combine(
        &self,
        terms: &[&[f32]],
        shared: &[f32],
        out: &mut [f32],
    ) -> Result<(), ContractError> {
        self.try_combine_in(None, terms, shared, out)
    }

    /// Combines with the contract's own order resolved at an event with this
    /// context (expert ids and gates in slot order).
    pub fn try_combine_in(
        &self,
        ctx: Option<&EventContext<'_>>,
        terms: &[&[f32]],
        shared: &[f32],
        out: &mut [f32],
    ) -> Result<(), ContractError> {
        let perm = self.order.resolve_in(terms.len(), ctx)?;
        self.try_combine_with_permutation(&perm, terms, shared, out)
    }

    /// Combines with an explicit permutation instead of the contract's order
    /// (schedules, inference and the certificate use this).
    pub fn try_combine_with_permutation(
        &self,
        perm: &[usize],
        terms: &[&[f32]],
        shared: &[f32],
        out: &mut [f32],
    ) -> Result<(), ContractError> {
        if self.operand == OperandPrecision::Fma {
            return Err(ContractError::NeedsUnits {
                contract: self.describe(),
            });
        }
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

    /// Combines one event under an explicit permutation: `operand=fma` from
    /// the event's unweighted outputs and gates, every other member from
    /// `terms` ([`AggregationContract::try_combine_with_permutation`]).
    pub fn try_combine_event_with_permutation(
        &self,
        perm: &[usize],
        event: &CombineEvent<'_>,
        terms: &[&[f32]],
        shared: &[f32],
        out: &mut [f32],
    ) -> Result<(), ContractError> {
        if self.operand != OperandPrecision::Fma {
            return self.try_combine_with_permutation(perm, terms, shared, out);
        }
        if self.accumulator != Accumulator::F32 || self.shape != Shape::Sequential {
            return Err(ContractError::InvalidOverride {
                given: self.describe(),
                reason: "operand=fma needs accumulator=f32 and shape=sequential".into(),
            });
        }
        let k = terms.len();
        if event.units.len() != k || event.gates.len() != k {
            return Err(ContractError::NeedsUnits {
                contract: self.describe(),
            });
        }
        validate_permutation(k, perm)?;
        let d = out.len();
        let lengths = event
            .units
            .iter()
            .enumerate()
            .map(|(j, u)| (format!("unit {j}"), u.len()))
            .chain(std::iter::once(("shared".to_string(), shared.len())));
        for (what, got) in lengths {
            if got != d {
                return Err(ContractError::LengthMismatch {
                    what,
                    got,
                    expected: d,
                });
            }
        }
        let leaves = crate::kernel::leaves(self, perm);
        let zero = self.start == Start::Zero;
        let mut ops = vec![0.0f32; k + 1];
        for (e, y) in out.iter_mut().enumerate() {
            for (op, u) in ops.iter_mut().zip(event.units) {
                *op = u[e];
            }
            ops[k] = shared[e];
            *y = crate::kernel::eval_fma_chain(self, &leaves, zero, &ops, event.gates);
        }
        Ok(())
    }

    /// The kernel: lengths and permutation already validated.
    fn combine_unchecked(&self, perm: &[usize], terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        let plan = crate::kernel::Plan::new(self, perm);
        let mut ops = vec![0.0f32; terms.len() + 1];
        let mut scratch = crate::kernel::Scratch::default();
        for (d, y) in out.iter_mut().enumerate() {
            for (op, t) in ops.iter_mut().zip(terms) {
                *op = crate::kernel::operand(self.operand, t[d]);
            }
            ops[terms.len()] = shared[d];
            *y = plan.eval(self, &ops, &mut scratch);
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
    /// Applies the contract's own order, resolved at `event` (its expert ids
    /// and gates; the other fields are ignored).
    ///
    /// # Panics
    ///
    /// If the order is not valid for k = `terms.len()` (or needs expert ids
    /// or gates the event does not have) or the slice lengths differ; call
    /// [`AggregationContract::validate_for_k`] once at setup (the runtime
    /// does, with the config's `num_experts_per_tok`).
    fn combine(&self, event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        let ctx = event.context();
        let result = self
            .order
            .resolve_in(terms.len(), Some(&ctx))
            .and_then(|perm| self.try_combine_event_with_permutation(&perm, event, terms, shared, out));
        if let Err(e) = result {
            panic!("MoE combine with contract {}: {e}", self.describe());
        }
    }

    fn describe(&self) -> String {
        AggregationContract::describe(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The presets `describe` reads from its cache are the ones the names
    /// parse to, every one of them, in [`PRESET_NAMES`] order: a preset
    /// added to or changed in `from_preset_name` without the cache following
    /// would change every description.
    #[test]
    fn cached_describe_presets_are_the_parsed_presets() {
        let parsed: Vec<(&str, AggregationContract)> = PRESET_NAMES[1..]
            .iter()
            .map(|n| {
                (
                    *n,
                    AggregationContract::from_preset_name(n).expect("every preset name parses"),
                )
            })
            .collect();
        assert_eq!(*DESCRIBE_PRESETS, parsed);
    }

    /// Every preset describes itself by its own name (or `c` for `native`,
    /// its alias) and reads back to itself.
    #[test]
    fn every_preset_describes_as_its_name_and_parses_back() {
        for name in PRESET_NAMES {
            let p = AggregationContract::from_preset_name(name).expect("every preset name parses");
            let d = p.describe();
            let expected = if name == "native" { "c" } else { name };
            assert_eq!(d, expected, "{name}");
            assert_eq!(AggregationContract::parse(&d).ok(), Some(p), "{name}");
        }
    }

    /// Every grammar variant, with a named and an explicit order, reads back
    /// from its description (the bases now come from the cache).
    #[test]
    fn every_grammar_variant_describes_and_parses_back() {
        for v in crate::grammar_variants() {
            for order in [Order::Identity, Order::PermutationIndex(5)] {
                let c = v.clone().with_order(order);
                let d = c.describe();
                assert_eq!(AggregationContract::parse(&d).ok(), Some(c), "{d}");
            }
        }
    }

    /// The cached description is the computed one, for every grammar
    /// variant and its `operand=fma` form, with named, explicit and
    /// identity orders, described twice (the second time from the cache).
    #[test]
    fn cached_descriptions_are_the_computed_ones() {
        let orders = [
            Order::Identity,
            Order::PermutationIndex(17),
            Order::BClass(3),
            Order::parse("asc-id", false).expect("a named order"),
        ];
        let mut keys: std::collections::HashMap<u64, AggregationContract> = std::collections::HashMap::new();
        for v in crate::grammar_variants() {
            let mut fma = v.clone();
            fma.operand = OperandPrecision::Fma;
            for c in [v, fma] {
                // Distinct contracts have distinct keys.
                if let Some(other) = keys.insert(c.family_key(), c.clone()) {
                    assert_eq!(other, c);
                }
                for order in &orders {
                    let c = c.clone().with_order(order.clone());
                    let computed = c.describe_uncached();
                    assert_eq!(c.describe(), computed);
                    assert_eq!(c.describe(), computed);
                }
            }
        }
    }
}
