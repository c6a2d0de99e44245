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

mod fit;
mod members;
mod reason;
mod trace;
mod variants;

pub use fit::*;
pub use members::*;
#[allow(unused_imports)]
use members::*;
pub use reason::*;
#[allow(unused_imports)]
use reason::*;
pub use trace::*;
#[allow(unused_imports)]
use trace::*;
pub use variants::*;
#[allow(unused_imports)]
use variants::*;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

use crate::bf16::r_bf16;
use crate::certificate::partial_sums_exact;
use crate::error::ContractError;
use crate::kernel::{leaves, operand, Plan, PlanRef, Scratch};
use crate::named::{order_groups, EventContext};
use crate::order::{all_permutations, index_of_permutation};
use crate::spec::{Accumulator, AggregationContract, OperandPrecision, Order, Shape, SharedMerge, Start};

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

/// Whether the variant's sequential permutations fall into first-pair classes.
pub(crate) fn first_pair_symmetric(c: &AggregationContract) -> bool {
    c.shape == Shape::Sequential
        && c.shared != SharedMerge::First
        && (c.operand == OperandPrecision::Bf16 || c.accumulator != Accumulator::Bf16)
}

/// The event's data, prepared once for every variant.
pub(crate) struct Prepared<'a> {
    k: usize,
    d: usize,
    /// `ops[operand]`: element-major operand arrays, k + 1 values per element (`s` last).
    ops: [Vec<f32>; 2],
    target: Vec<u32>,
    /// `exact[operand][with shared][precision]`: per-element partial-sum proofs.
    exact: [[[Vec<bool>; 3]; 2]; 2],
    canon: Option<&'a (dyn Fn(u32) -> u32 + Sync)>,
    /// The permutation tables of k slots, when every permutation is enumerated.
    tables: Option<Arc<PermTables>>,
    named: Vec<(Order, Vec<usize>)>,
    facts: DataFacts,
}

pub(crate) fn shared_index(s: SharedMerge) -> usize {
    s as usize
}

/// What the sequential shape's enumeration needs for k slots and does not
/// depend on an event's data: for each of the k! permutations (lexicographic
/// index), its first-pair partner's index, and its chain operand lists per
/// shared placement (separate, last, first).
pub(crate) struct PermTables {
    partner: Vec<usize>,
    chains: [Vec<Vec<u16>>; 3],
}

impl PermTables {
    /// The tables of k slots (`None` when k! cannot be enumerated).
    fn build(k: usize) -> Option<PermTables> {
        let perms = all_permutations(k).ok()?;
        let partner = perms
            .iter()
            .map(|p| {
                let mut q = p.clone();
                if q.len() >= 2 {
                    q.swap(0, 1);
                }
                index_of_permutation(&q).unwrap_or(0) as usize
            })
            .collect();
        let chains = std::array::from_fn(|m| {
            let shared = [SharedMerge::Separate, SharedMerge::Last, SharedMerge::First][m];
            let mut c = AggregationContract::c();
            c.shared = shared;
            perms.iter().map(|p| leaves(&c, p)).collect()
        });
        Some(PermTables { partner, chains })
    }

    /// The tables of k slots, built once per process for k up to
    /// [`MAX_PERMUTATION_K`] (what every event of a trace shares: building
    /// them anew for each event was a large share of explaining a trace's
    /// events, in allocations; k = 8 holds about 7 MB) and anew above it.
    fn of(k: usize) -> Option<Arc<PermTables>> {
        static CACHE: [OnceLock<Option<Arc<PermTables>>>; MAX_PERMUTATION_K + 1] =
            [const { OnceLock::new() }; MAX_PERMUTATION_K + 1];
        match CACHE.get(k) {
            Some(cell) => cell.get_or_init(|| PermTables::build(k).map(Arc::new)).clone(),
            None => PermTables::build(k).map(Arc::new),
        }
    }
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
        let tables = if k <= max_k { PermTables::of(k) } else { None };
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
            tables,
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
pub(crate) enum Candidates {
    /// Every permutation (index = candidate), chain plans from the prepared tables.
    Permutations { symmetric: bool },
    /// One plan per distinct permutation of the named orders.
    Plans(NamedPlans),
}

/// The plans of one variant's candidates and their permutations, shared by
/// the variants that build the same ones ([`named_plans`]).
pub(crate) type NamedPlans = Arc<[(Plan, Vec<usize>)]>;

/// What a plan of a non-exact accumulator is built from besides the
/// permutation ([`Plan::new`] reads the shape, the shared placement and the
/// start, never the terms, accumulator or roundings).
type PlanKey = (Shape, SharedMerge, Start);

/// One plan per distinct permutation of the event's named orders, for `v`.
fn build_named_plans(v: &AggregationContract, p: &Prepared<'_>) -> NamedPlans {
    let mut plans: Vec<(Plan, Vec<usize>)> = Vec::new();
    for (_, perm) in &p.named {
        if !plans.iter().any(|(_, q)| q == perm) {
            plans.push((Plan::new(v, perm), perm.clone()));
        }
    }
    plans.into()
}

/// The named-order plans of every variant among `keys` that tries named
/// orders, built once per [`PlanKey`]: the variants that differ only in terms,
/// accumulator or roundings share them (building them per variant was a
/// fifth of an event's explanation, in allocations).
fn named_plans(keys: &[AggregationContract], p: &Prepared<'_>) -> HashMap<PlanKey, NamedPlans> {
    let mut out = HashMap::new();
    for v in keys {
        let enumerated = v.shape == Shape::Sequential && p.tables.is_some();
        if v.accumulator != Accumulator::Exact && !enumerated {
            out.entry((v.shape, v.shared, v.start))
                .or_insert_with(|| build_named_plans(v, p));
        }
    }
    out
}

/// The outcome of one variant: the indices of the reproducing candidates.
pub(crate) struct Outcome {
    alive: Vec<usize>,
    tried: usize,
    proven: bool,
}

/// The candidates of `v` at the event `p`, the named-order plans taken from
/// `named` ([`named_plans`] of the event's variants) where they are there.
pub(crate) fn candidates(
    v: &AggregationContract,
    p: &Prepared<'_>,
    named: &HashMap<PlanKey, NamedPlans>,
) -> Candidates {
    if v.accumulator == Accumulator::Exact {
        let id: Vec<usize> = (0..p.k).collect();
        return Candidates::Plans(Arc::from(vec![(Plan::new(v, &id), id)]));
    }
    if v.shape == Shape::Sequential && p.tables.is_some() {
        return Candidates::Permutations {
            symmetric: first_pair_symmetric(v) && p.k >= 2,
        };
    }
    match named.get(&(v.shape, v.shared, v.start)) {
        Some(plans) => Candidates::Plans(Arc::clone(plans)),
        None => Candidates::Plans(build_named_plans(v, p)),
    }
}

/// Evaluates one variant's candidates element by element (see the module docs).
pub(crate) fn evaluate(v: &AggregationContract, p: &Prepared<'_>, cands: &Candidates) -> Outcome {
    let zero = v.start == Start::Zero;
    let (chains, partner): (&[Vec<u16>], &[usize]) = match p.tables.as_deref() {
        Some(t) => (&t.chains[shared_index(v.shared)], &t.partner),
        None => (&[], &[]),
    };
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
            let n = partner.len();
            let reps = (0..n).filter(|&i| !*symmetric || partner[i] >= i).collect();
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
        let partners: Vec<usize> = alive.iter().map(|&i| partner[i]).collect();
        alive.extend(partners);
        alive.sort_unstable();
        alive.dedup();
    }
    Outcome { alive, tried, proven }
}

/// Counts the output values a plan gets wrong (no early exit), and the
/// largest distance of a wrong one in ulps of the output format (`None` when
/// a NaN is involved).
pub(crate) fn differing(v: &AggregationContract, plan: &Plan, p: &Prepared<'_>) -> (usize, Option<u64>) {
    let mut scratch = Scratch::default();
    let bf16 = p.facts.output_bf16;
    let (mut n, mut max) = (0usize, Some(0u64));
    for e in 0..p.d {
        let y = plan.eval(v, p.row(v, e), &mut scratch);
        if !p.matches(y, e) {
            n += 1;
            max = match (max, ulp_distance(y, f32::from_bits(p.target[e]), bf16)) {
                (Some(m), Some(u)) => Some(m.max(u)),
                _ => None,
            };
        }
    }
    (n, max)
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
    // The distinct keys in first-seen order, and each variant's key's place
    // among them (a map: a search of the list per variant was quadratic).
    let mut keys: Vec<AggregationContract> = Vec::new();
    let mut place: HashMap<&AggregationContract, usize> = HashMap::new();
    let slot: Vec<usize> = keyed
        .iter()
        .map(|(k, _)| {
            *place.entry(k).or_insert_with(|| {
                keys.push(k.clone());
                keys.len() - 1
            })
        })
        .collect();
    let named = named_plans(&keys, &p);
    let results: Vec<(Candidates, Outcome)> = keys
        .par_iter()
        .map(|v| {
            let c = candidates(v, &p, &named);
            let o = evaluate(v, &p, &c);
            (c, o)
        })
        .collect();
    let candidates_tried = results.iter().map(|(_, o)| o.tried as u64).sum();
    let mut matches = Vec::new();
    for ((v, (key, reasons)), &i) in all.iter().zip(&keyed).zip(&slot) {
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
    let fit = if matches.is_empty() {
        let canon = |b: u32| p.canon.map_or(b, |c| c(b));
        fit_event(obs.terms, obs.shared, obs.output, &canon)
    } else {
        None
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
        fit,
    })
}

pub(crate) fn variant_match(
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

pub(crate) fn closest(keys: &[AggregationContract], p: &Prepared<'_>, n: usize) -> Vec<NearMiss> {
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
                    let (differing, max_ulps) = differing(v, &plan, p);
                    NearMiss {
                        contract: v.clone().with_order(order.clone()),
                        differing,
                        max_ulps,
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect();
    near.sort_by_key(|m| {
        (
            m.differing,
            m.max_ulps.unwrap_or(u64::MAX),
            simplicity(&m.contract),
        )
    });
    near.dedup_by(|a, b| a.contract == b.contract);
    near.truncate(n);
    near
}
