//! Aggregation of many events' explanations into a trace-level rule.

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::named::NAMED_ORDERS;
use crate::spec::{AggregationContract, Order};

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
pub(crate) struct PermTally {
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
        // Each named order's permutation once (borrowed), then every pair.
        let perms: Vec<Option<&[usize]>> = NAMED_ORDERS.iter().map(|o| e.permutation_of(o)).collect();
        for (i, pa) in perms.iter().enumerate() {
            for (j, pb) in perms.iter().enumerate().skip(i + 1) {
                if pa.is_none() || pa != pb {
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
