//! `moeconf explain`: which combine contract does one trace's backend
//! implement? Every MoE combine event of the trace (its recorded
//! `moe.term.*`, `moe.shared` and `moe.combine` payloads, and the router's
//! `router.topk` / `router.gates` where recorded) is explained against the
//! whole grammar ([`moeconf_contract::explain_event`]), with no reference
//! trace, and the events are aggregated into a trace-level rule
//! ("b+order=asc-id — ascending expert id: 81/81 events").
//!
//! Missing data is an error naming the record, never a silent pass: a trace
//! without `moe.combine` records, a combine event without its shared output
//! or with a gap in its terms, or any of them without a payload. Without
//! router payloads the expert-id and gate orders are not tried, and the
//! report says so.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};

use moeconf_contract::{
    backends_for_capture, explain_event, AggregationContract, ContractError, EventContext, EventExplanation,
    InferOptions, KnownBackend, Observation, TraceInference,
};
use moeconf_fingerprint::{bf16_to_f32, canonical_f32_bits, Component, DType};
use moeconf_schema::{Trace, TraceError};
use serde::ser::{Error as _, SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};

use crate::explanation::{order_words, CombineExplanation, EquivalentReport, ReasonReport};
use crate::numeric::{f32_values, int_values};

/// Version of the JSON document of [`TraceExplanation`] (docs/contracts.md).
pub const EXPLAIN_SCHEMA_VERSION: u32 = 2;

/// Most rules listed in [`TraceRule::rules`].
pub const MAX_LISTED_RULES: usize = 8;

/// Most events listed in [`TraceRule::outside_best_rule`].
pub const MAX_LISTED_OUTLIERS: usize = 16;

/// Events [`explain_trace`] reads, then explains, at a time, and between two
/// releases of the mapped pages their payloads were read from
/// ([`Trace::release_step`]): small enough that a long prefill's
/// explanation holds a few megabytes of payloads and of the file resident,
/// large enough that the pages shared by neighbouring events are rarely
/// mapped again.
const CHUNK: usize = 64;

/// One event's explanation and what the report takes from it.
struct Explained {
    e: EventExplanation,
    /// Its rules ([`EventExplanation::rules`]), described.
    rules: Vec<String>,
    report: CombineExplanation,
    /// [`explanation_hash`] of `report`.
    hash: u64,
    /// Whether each known backend's combine reproduces it.
    reproduced: Vec<bool>,
}

/// Why a trace could not be explained.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExplainError {
    /// The trace holds no `moe.combine` record.
    #[error("{trace}: no moe.combine records (capture L4 with payloads: moeconf run --capture all)")]
    NoCombineEvents {
        /// The trace file.
        trace: String,
    },
    /// A record the explanation needs is absent.
    #[error("{trace}: step {step} layer {layer} position {position} has a moe.combine record but no {what}")]
    MissingRecord {
        trace: String,
        /// Forward step.
        step: u32,
        /// Decoder layer.
        layer: u32,
        position: u32,
        /// What is missing (`moe.shared`, `moe.term.2`, `moe.term.* records`).
        what: String,
    },
    /// A record holds no payload or one that is not f32/bf16 (i32 for `router.topk`).
    #[error("{trace}: {record} at step {step} layer {layer} position {position}: {problem}")]
    BadPayload {
        trace: String,
        /// Its path.
        record: String,
        /// Forward step.
        step: u32,
        /// Decoder layer.
        layer: u32,
        position: u32,
        /// What is wrong.
        problem: String,
    },
    /// The recorded values are inconsistent (lengths).
    #[error("{trace}: step {step} layer {layer} position {position}: inconsistent combine event")]
    Inconsistent {
        trace: String,
        /// Forward step.
        step: u32,
        /// Decoder layer.
        layer: u32,
        position: u32,
        /// What the inference engine refused.
        #[source]
        source: ContractError,
    },
    /// A payload failed verification or could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
}

/// One explained event, as [`EventList`] hands it out (serialized as one
/// element of the report's `events`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EventView<'a> {
    /// Forward step.
    pub step: u32,
    /// Decoder layer.
    pub layer: u32,
    pub position: u32,
    /// Selected expert ids in slot order (empty when `router.topk` was not recorded).
    pub experts: &'a [u32],
    pub explanation: &'a CombineExplanation,
}

/// Where one event of an [`EventList`] is, and what its explanation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EventEntry {
    step: u32,
    layer: u32,
    position: u32,
    /// Index of its explanation in [`EventList::explanations`].
    explanation: usize,
    /// End of its expert ids in [`EventList::experts`] (they start where the
    /// previous event's end).
    experts_end: usize,
}

/// Every explained event of a trace, in order, held compactly: each
/// distinct explanation once, and per event its place, its expert ids and
/// which explanation it has.
///
/// A long prefill's events mostly share a handful of explanations (a
/// 1,024-token prompt's 9,243 events have 28), and an explanation lists up to
/// [`crate::MAX_LISTED_EQUIVALENTS`] members with their reasons: holding one
/// per event made `moeconf explain`'s memory grow by tens of kilobytes per
/// event. Events whose explanations all differ (orders that change from
/// token to token) still cost one explanation each: the JSON report prints
/// every one of them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EventList {
    explanations: Vec<CombineExplanation>,
    entries: Vec<EventEntry>,
    experts: Vec<u32>,
    /// While events are added: the explanations by [`explanation_hash`].
    by_hash: HashMap<u64, Vec<usize>>,
}

impl EventList {
    /// Adds an event at the end, whose explanation's [`explanation_hash`] is `hash`.
    fn push_hashed(
        &mut self,
        (step, layer, position): Key,
        experts: &[u32],
        explanation: CombineExplanation,
        hash: u64,
    ) {
        let ids = self.by_hash.entry(hash).or_default();
        let found = ids.iter().copied().find(|&i| {
            self.explanations
                .get(i)
                .is_some_and(|x| identical(x, &explanation))
        });
        let explanation = match found {
            Some(i) => i,
            None => {
                self.explanations.push(explanation);
                ids.push(self.explanations.len() - 1);
                self.explanations.len() - 1
            }
        };
        self.experts.extend_from_slice(experts);
        self.entries.push(EventEntry {
            step,
            layer,
            position,
            explanation,
            experts_end: self.experts.len(),
        });
    }

    /// Drops what only adding needed.
    fn finish(&mut self) {
        self.by_hash = HashMap::new();
        self.entries.shrink_to_fit();
        self.experts.shrink_to_fit();
        self.explanations.shrink_to_fit();
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is no event.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// How many distinct explanations the events have.
    pub fn distinct_explanations(&self) -> usize {
        self.explanations.len()
    }

    /// Every event, in order.
    pub fn iter(&self) -> impl Iterator<Item = EventView<'_>> + '_ {
        let mut start = 0;
        self.entries.iter().map(move |e| {
            let experts = self.experts.get(start..e.experts_end).unwrap_or_default();
            start = e.experts_end;
            EventView {
                step: e.step,
                layer: e.layer,
                position: e.position,
                experts,
                explanation: &self.explanations[e.explanation],
            }
        })
    }
}

impl<'a> IntoIterator for &'a EventList {
    type Item = EventView<'a>;
    type IntoIter = Box<dyn Iterator<Item = EventView<'a>> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

/// Serialized as the list of every event (what a `Vec` of them would give).
impl Serialize for EventList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.len()))?;
        for e in self.iter() {
            seq.serialize_element(&e)?;
        }
        seq.end()
    }
}

/// A hash of an explanation for [`EventList`]'s sharing (equal explanations
/// hash equal; [`identical`] decides). The equivalents' reasons are hashed
/// by their codes only: their texts are the bulk of an explanation and
/// rarely tell two apart that the rest does not.
fn explanation_hash(x: &CombineExplanation) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    x.status.hash(&mut h);
    x.k.hash(&mut h);
    x.elements.hash(&mut h);
    x.simplest.hash(&mut h);
    x.order.hash(&mut h);
    x.equivalent_count.hash(&mut h);
    for q in &x.equivalents {
        q.contract.hash(&mut h);
        for r in &q.reasons {
            (&r.code, r.structural).hash(&mut h);
        }
    }
    x.permutations.hash(&mut h);
    x.closest.hash(&mut h);
    x.candidates.hash(&mut h);
    if let Some(f) = &x.fit {
        f.changes.hash(&mut h);
        fit_bits(f).hash(&mut h);
        f.placement.hash(&mut h);
        f.output.hash(&mut h);
        f.differing.hash(&mut h);
        f.elements.hash(&mut h);
        f.max_ulps.hash(&mut h);
        f.summary.hash(&mut h);
    }
    h.finish()
}

/// The bits of a fit's coefficients (fitted, used), routed then shared.
fn fit_bits(f: &crate::explanation::FitReport) -> Vec<(Option<u64>, u32)> {
    f.terms
        .iter()
        .chain(std::iter::once(&f.shared))
        .map(|c| (c.fitted.map(f64::to_bits), c.used.to_bits()))
        .collect()
}

/// Whether two explanations serialize to the same text: equal, with their
/// floating-point values equal bit for bit (`==` alone takes -0.0 for 0.0).
fn identical(a: &CombineExplanation, b: &CombineExplanation) -> bool {
    a == b
        && match (&a.fit, &b.fit) {
            (Some(x), Some(y)) => fit_bits(x) == fit_bits(y),
            _ => true,
        }
}

/// For every rule seen so far, the first [`MAX_LISTED_OUTLIERS`] events it
/// does not reproduce: what [`TraceRule::outside_best_rule`] lists once the
/// best rule is known, without keeping every event's rules.
#[derive(Debug, Default)]
struct Outliers {
    /// The first [`MAX_LISTED_OUTLIERS`] events (a rule first seen at an
    /// event reproduced none of the earlier ones).
    first: Vec<EventRef>,
    misses: HashMap<String, Vec<EventRef>>,
}

impl Outliers {
    /// Adds the event at `at`, which the rules `rules` (described) reproduce.
    fn add(&mut self, at: EventRef, rules: &[String]) {
        let here: HashSet<&str> = rules.iter().map(String::as_str).collect();
        for r in &here {
            if !self.misses.contains_key(*r) {
                self.misses.insert((*r).to_string(), self.first.clone());
            }
        }
        for (r, m) in &mut self.misses {
            if m.len() < MAX_LISTED_OUTLIERS && !here.contains(r.as_str()) {
                m.push(at);
            }
        }
        if self.first.len() < MAX_LISTED_OUTLIERS {
            self.first.push(at);
        }
    }

    /// The events `rule` does not reproduce (at most [`MAX_LISTED_OUTLIERS`]).
    fn of(&self, rule: &str) -> Vec<EventRef> {
        self.misses
            .get(rule)
            .cloned()
            .unwrap_or_else(|| self.first.clone())
    }
}

/// A rule (a member with a named order) and the events it reproduces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuleReport {
    /// The member in the notation.
    pub contract: String,
    /// What determines its order, in words.
    pub order: String,
    /// Events it reproduces.
    pub events: usize,
}

/// An explicit permutation set that reproduces every event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FixedPermutationReport {
    /// The variant (order `identity`) in the notation.
    pub family: String,
    /// How many of the k! permutations reproduce every event.
    pub matching: u64,
    /// The first few lexicographic permutation indices.
    pub listed: Vec<u64>,
}

/// The trace-level verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceRule {
    /// MoE combine events explained.
    pub events: usize,
    /// Events some grammar member reproduces.
    pub explained_events: usize,
    /// Events no grammar member reproduces.
    pub unexplained_events: usize,
    /// The simplest rule reproducing every event, in the notation: a member
    /// with a named order, else one with a fixed explicit permutation.
    pub rule: Option<String>,
    /// What determines its order, in words.
    pub rule_order: Option<String>,
    /// Other rules reproducing every event, with why they are indistinguishable on this trace.
    pub equivalents: Vec<EquivalentReport>,
    /// The rules reproducing the most events (at most [`MAX_LISTED_RULES`]).
    pub rules: Vec<RuleReport>,
    /// Explicit permutations reproducing every event (sequential variants).
    pub fixed_permutations: Vec<FixedPermutationReport>,
    /// One line: the rule and its count, or what is unexplained.
    pub headline: String,
    /// When no rule explains every event: the events the best rule (the
    /// first of `rules`) does not reproduce (at most `MAX_LISTED_OUTLIERS`).
    pub outside_best_rule: Vec<EventRef>,
}

/// Where an event is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EventRef {
    /// Forward step.
    pub step: u32,
    /// Decoder layer.
    pub layer: u32,
    pub position: u32,
}

/// A known backend's combine, evaluated on every event of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KnownCombineReport {
    /// `moeconf_contract::KNOWN_BACKENDS` id (`vllm-cpu-mxfp4`, …).
    pub id: String,
    /// What it is, in words.
    pub description: String,
    /// Its contract in the notation.
    pub contract: String,
    /// Where the contract comes from.
    pub source: String,
    /// Why the recorded terms cannot reproduce the contract, if they cannot
    /// (`reproduced_events` is then 0 and means nothing).
    pub not_checkable: Option<String>,
    /// Events whose recorded output the contract reproduces bitwise from the
    /// recorded terms and shared output.
    pub reproduced_events: usize,
}

/// The backend that wrote the trace, as its provenance names it, and its
/// known combine(s) (`moeconf_contract::backends_for_capture`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BackendReport {
    /// The provenance's runtime (`vllm`, `transformers`, `llama.cpp`).
    pub runtime: String,
    /// Its version.
    pub version: String,
    /// True when the provenance selects one form; false when it lacks the
    /// note that tells the runtime's forms apart (every form is listed).
    pub selected: bool,
    /// The provenance note that selects the form (`vllm.moe_experts`), if any.
    pub selected_by: Option<String>,
    /// That note's value in the trace, when it has one (a value no form
    /// lists, such as an experts class of another CPU, leaves `selected` false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selected_by_value: Option<String>,
    /// The known combines, evaluated on every event.
    pub known: Vec<KnownCombineReport>,
}

/// The explanation of every MoE combine event of one trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceExplanation {
    /// [`EXPLAIN_SCHEMA_VERSION`].
    pub schema_version: u32,
    pub trace: String,
    /// The contract the trace's binding declares (as the writer described it).
    pub declared_contract: String,
    /// The trace-level verdict.
    pub verdict: TraceRule,
    /// Limits of what was tried (e.g. no router payloads: no expert-id orders).
    pub notes: Vec<String>,
    /// The backend the provenance names and its known combine(s); `None` when
    /// the runtime is not one of `moeconf_contract::KNOWN_BACKENDS` (the
    /// reference runtime declares its contract in the binding instead).
    pub backend: Option<BackendReport>,
    /// Every event, in the trace's write order of `moe.combine`.
    pub events: EventList,
}

/// Record indices of one combine event.
#[derive(Debug, Default)]
struct EventRecords {
    combine: usize,
    shared: Option<usize>,
    terms: BTreeMap<u32, usize>,
    topk: Option<usize>,
    gates: Option<usize>,
}

/// Key of an event: (step, layer, position).
type Key = (u32, u32, u32);

/// The events of the records `ids` (in write order) of `t`.
fn index_events(t: &Trace, ids: impl Iterator<Item = usize>) -> (Vec<Key>, BTreeMap<Key, EventRecords>) {
    let mut order: Vec<Key> = Vec::new();
    let mut found: BTreeMap<Key, EventRecords> = BTreeMap::new();
    let mut side: Vec<(Key, Component, Option<u32>, usize)> = Vec::new();
    for i in ids {
        let r = t.record(i);
        let Some(layer) = r.coord.layer else { continue };
        let Some((c, j)) = Component::parse(&r.coord.path) else {
            continue;
        };
        let key = (r.coord.step, layer, r.coord.position);
        match c {
            Component::MoeCombine => {
                if let std::collections::btree_map::Entry::Vacant(v) = found.entry(key) {
                    order.push(key);
                    v.insert(EventRecords {
                        combine: i,
                        ..EventRecords::default()
                    });
                }
            }
            Component::MoeShared | Component::MoeTerm | Component::RouterTopk | Component::RouterGates => {
                side.push((key, c, j, i))
            }
            _ => {}
        }
    }
    for (key, c, j, i) in side {
        let Some(e) = found.get_mut(&key) else { continue };
        match (c, j) {
            (Component::MoeShared, _) => e.shared = e.shared.or(Some(i)),
            (Component::MoeTerm, Some(j)) => {
                e.terms.entry(j).or_insert(i);
            }
            (Component::RouterTopk, _) => e.topk = e.topk.or(Some(i)),
            (Component::RouterGates, _) => e.gates = e.gates.or(Some(i)),
            _ => {}
        }
    }
    (order, found)
}

/// One event's values, read and checked.
struct EventData {
    terms: Vec<Vec<f32>>,
    shared: Vec<f32>,
    combine: Vec<f32>,
    experts: Vec<u32>,
    gates: Vec<f32>,
}

struct Reader<'a> {
    t: &'a Trace,
    name: String,
}

impl Reader<'_> {
    fn bad(&self, i: usize, problem: &str) -> ExplainError {
        let c = &self.t.record(i).coord;
        ExplainError::BadPayload {
            trace: self.name.clone(),
            record: c.path.to_string(),
            step: c.step,
            layer: c.layer.unwrap_or(0),
            position: c.position,
            problem: problem.to_string(),
        }
    }

    /// Real values of record `i` (f32, or bf16 widened exactly).
    fn reals(&self, i: usize) -> Result<Vec<f32>, ExplainError> {
        let e = self.t.record(i);
        let bytes = self
            .t
            .payload_verified(i)?
            .ok_or_else(|| self.bad(i, "no payload (capture L4 with payloads: --capture all)"))?;
        let v = match e.dtype {
            DType::BF16 if bytes.len().is_multiple_of(2) => Some(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            _ => f32_values(e.dtype, bytes),
        };
        v.ok_or_else(|| self.bad(i, &format!("payload is {}, expected f32 or bf16", e.dtype)))
    }

    fn read(&self, key: Key, r: &EventRecords, notes: &mut Notes) -> Result<EventData, ExplainError> {
        let (step, layer, position) = key;
        let missing = |what: String| ExplainError::MissingRecord {
            trace: self.name.clone(),
            step,
            layer,
            position,
            what,
        };
        let shared_i = r
            .shared
            .ok_or_else(|| missing(Component::MoeShared.path().to_string()))?;
        if r.terms.is_empty() {
            return Err(missing(format!("{}* records", Component::MoeTerm.path())));
        }
        let mut terms = Vec::with_capacity(r.terms.len());
        for (n, (&j, &i)) in r.terms.iter().enumerate() {
            if j as usize != n {
                return Err(missing(Component::MoeTerm.indexed_path(n as u32)));
            }
            terms.push(self.reals(i)?);
        }
        let experts = match r.topk {
            Some(i) => match self.t.payload_verified(i)? {
                Some(bytes) => int_values(self.t.record(i).dtype, bytes)
                    .and_then(|v| {
                        v.into_iter()
                            .map(|x| u32::try_from(x).ok())
                            .collect::<Option<Vec<u32>>>()
                    })
                    .ok_or_else(|| self.bad(i, "expected non-negative integer expert ids"))?,
                None => {
                    notes.no_topk_payload += 1;
                    Vec::new()
                }
            },
            None => {
                notes.no_topk += 1;
                Vec::new()
            }
        };
        let gates = match r.gates {
            Some(i) if self.t.payload_verified(i)?.is_some() => self.reals(i)?,
            Some(_) => {
                notes.no_gates_payload += 1;
                Vec::new()
            }
            None => {
                notes.no_gates += 1;
                Vec::new()
            }
        };
        Ok(EventData {
            terms,
            shared: self.reals(shared_i)?,
            combine: self.reals(r.combine)?,
            experts,
            gates,
        })
    }
}

/// Counts of events whose router records were absent or payload-less.
#[derive(Debug, Default)]
struct Notes {
    no_topk: usize,
    no_topk_payload: usize,
    no_gates: usize,
    no_gates_payload: usize,
}

impl Notes {
    fn lines(&self, events: usize) -> Vec<String> {
        let mut out = Vec::new();
        let mut say = |n: usize, what: &str, tried: &str| {
            if n > 0 {
                out.push(format!(
                    "{n} of {events} events {what}: the {tried} orders were not tried there"
                ));
            }
        };
        say(self.no_topk, "have no router.topk record", "expert-id");
        say(
            self.no_topk_payload,
            "have router.topk without payload",
            "expert-id",
        );
        say(self.no_gates, "have no router.gates record", "gate");
        say(self.no_gates_payload, "have router.gates without payload", "gate");
        out
    }
}

/// Explains the MoE combine event of `t` at (step, layer, position) (the
/// diff's localized `moe.combine`): `Ok(None)` when `t` has no `moe.combine`
/// record there; router records missing or without payload only narrow the
/// orders tried.
/// The records of one event's step, layer and position (every level), in
/// execution order: read through the tree, so explaining one event of a
/// version 2 trace reads that step's groups of that layer only.
fn event_records(t: &Trace, (step, layer, position): Key) -> Result<Vec<usize>, TraceError> {
    let mut ids = Vec::new();
    let Some(node) = t.step(step)? else {
        return Ok(ids);
    };
    for l in &node.levels {
        if let Some(g) = l.group(Some(layer)) {
            // A paged group (format version 4) reads only the pages holding
            // the position.
            ids.extend(t.group_entries_at(g, position)?.into_iter().map(|(i, _)| i));
        }
    }
    // Execution order from the coordinates, never the write-order numbers
    // (which no digest commits to, docs/format.md §11.5).
    ids.sort_by_cached_key(|&i| {
        let c = &t.record(i).coord;
        (
            moeconf_fingerprint::catalogue::ExecKey::of(c),
            c.phase,
            c.path.clone(),
        )
    });
    Ok(ids)
}

/// One side's combine event for the counterfactual at the combine
/// (`crate::counterfactual`): what it read and wrote, and the contracts
/// that reproduce its output from its own terms.
pub(crate) struct SideEvent {
    pub terms: Vec<Vec<f32>>,
    pub shared: Vec<f32>,
    pub combine: Vec<f32>,
    pub experts: Vec<u32>,
    pub gates: Vec<f32>,
    pub rules: Vec<moeconf_contract::AggregationContract>,
    pub canon: moeconf_fingerprint::CanonPolicy,
}

/// The data of `t`'s combine event at `key` and its explanation (`None`:
/// the trace has no such event); what [`side_event`] and [`explain_one`] share.
fn read_and_explain(
    t: &Trace,
    name: &str,
    key: (u32, u32, u32),
) -> Result<Option<(EventData, EventExplanation)>, ExplainError> {
    let reader = Reader {
        t,
        name: name.to_string(),
    };
    let (_, records) = index_events(t, event_records(t, key)?.into_iter());
    let Some(r) = records.get(&key) else {
        return Ok(None);
    };
    let d = reader.read(key, r, &mut Notes::default())?;
    let canon = t.binding().canon;
    let canonicalize = move |bits: u32| canonical_f32_bits(bits, canon);
    let opts = InferOptions {
        canonicalize: Some(&canonicalize),
        ..InferOptions::default()
    };
    let e = explain_data(&d, &opts, name, key)?;
    Ok(Some((d, e)))
}

/// [`SideEvent`] of `t` at `key` (`None`: the trace has no such event).
pub(crate) fn side_event(
    t: &Trace,
    name: &str,
    key: (u32, u32, u32),
) -> Result<Option<SideEvent>, ExplainError> {
    let Some((d, e)) = read_and_explain(t, name, key)? else {
        return Ok(None);
    };
    // The simplest member first (a variant reproduced only by an explicit
    // permutation, such as a B class, has no named rule), then every named one.
    let rules: Vec<_> = e.simplest().into_iter().chain(e.rules()).collect();
    Ok(Some(SideEvent {
        terms: d.terms,
        shared: d.shared,
        combine: d.combine,
        experts: d.experts,
        gates: d.gates,
        rules,
        canon: t.binding().canon,
    }))
}

pub(crate) fn explain_one(
    t: &Trace,
    name: &str,
    key: (u32, u32, u32),
) -> Result<Option<(EventExplanation, EventContextOwned)>, ExplainError> {
    let Some((d, e)) = read_and_explain(t, name, key)? else {
        return Ok(None);
    };
    Ok(Some((
        e,
        EventContextOwned {
            experts: d.experts,
            gates: d.gates,
        },
    )))
}

/// Explains one event's data (`name` and `key` name it in errors).
fn explain_data(
    d: &EventData,
    opts: &InferOptions<'_>,
    name: &str,
    key: Key,
) -> Result<EventExplanation, ExplainError> {
    let refs: Vec<&[f32]> = d.terms.iter().map(Vec::as_slice).collect();
    let obs = Observation {
        terms: &refs,
        shared: &d.shared,
        output: &d.combine,
        experts: &d.experts,
        gates: &d.gates,
    };
    explain_event(&obs, opts).map_err(|source| ExplainError::Inconsistent {
        trace: name.into(),
        step: key.0,
        layer: key.1,
        position: key.2,
        source,
    })
}

/// An event's router choice (expert ids and gates in slot order), owned.
#[derive(Debug, Clone, Default)]
pub(crate) struct EventContextOwned {
    pub(crate) experts: Vec<u32>,
    pub(crate) gates: Vec<f32>,
}

/// Explains every MoE combine event of `t` (named `name` in messages).
pub fn explain_trace(t: &Trace, name: &str) -> Result<TraceExplanation, ExplainError> {
    let reader = Reader {
        t,
        name: name.to_string(),
    };
    let (order, records) = index_events(t, 0..t.records()?.len());
    if order.is_empty() {
        return Err(ExplainError::NoCombineEvents { trace: name.into() });
    }
    let canon = t.binding().canon;
    let canonicalize = move |bits: u32| canonical_f32_bits(bits, canon);
    let opts = InferOptions {
        canonicalize: Some(&canonicalize),
        ..InferOptions::default()
    };
    let mut notes = Notes::default();
    let mut agg = TraceInference::new();
    let mut events = EventList::default();
    let mut outliers = Outliers::default();
    let prov = t.provenance();
    let (forms, selected) = backends_for_capture(&prov.runtime, &t.binding().precision, &prov.notes);
    let known: Vec<(&KnownBackend, AggregationContract)> = forms
        .into_iter()
        .filter_map(|b| AggregationContract::parse(b.contract).ok().map(|c| (b, c)))
        .collect();
    let mut reproduced = vec![0usize; known.len()];
    let explain = |(key, d): &(Key, EventData)| -> Result<Explained, ExplainError> {
        let e = explain_data(d, &opts, name, *key)?;
        let report = CombineExplanation::of(&e);
        Ok(Explained {
            rules: e.rules().iter().map(|c| c.describe()).collect(),
            hash: explanation_hash(&report),
            report,
            reproduced: known
                .iter()
                .map(|(_, c)| reproduces(c, d, &canonicalize))
                .collect(),
            e,
        })
    };
    for chunk in order.chunks(CHUNK) {
        // Read in order, up to the first event that cannot be read.
        let mut data = Vec::with_capacity(chunk.len());
        let mut unreadable = None;
        for key in chunk {
            let Some(r) = records.get(key) else { continue };
            match reader.read(*key, r, &mut notes) {
                Ok(d) => data.push((*key, d)),
                Err(err) => {
                    unreadable = Some(err);
                    break;
                }
            }
        }
        let explained: Vec<Result<Explained, ExplainError>> = data.iter().map(&explain).collect();
        // The first error in event order, as one event after another finds it.
        for ((key, d), x) in data.iter().zip(explained) {
            let x = x?;
            agg.add(&x.e);
            for (n, hit) in reproduced.iter_mut().zip(&x.reproduced) {
                *n += usize::from(*hit);
            }
            let (step, layer, position) = *key;
            outliers.add(
                EventRef {
                    step,
                    layer,
                    position,
                },
                &x.rules,
            );
            events.push_hashed(*key, &d.experts, x.report, x.hash);
        }
        if let Some(err) = unreadable {
            return Err(err);
        }
        // The payloads read stay mapped in this process's resident set (a
        // long prefill's events read pages across most of the file): drop
        // the pages of the chunk's steps (a later read maps them again from
        // the page cache).
        let mut steps: Vec<u32> = chunk.iter().map(|k| k.0).collect();
        steps.dedup();
        for step in steps {
            t.release_step(step);
        }
    }
    events.finish();
    let mut verdict = trace_rule(&agg, &events);
    if verdict.rule.is_none() {
        if let Some(best) = verdict.rules.first() {
            verdict.outside_best_rule = outliers.of(&best.contract);
        }
    }
    let selected_by = known
        .iter()
        .find_map(|(b, _)| b.captured_as.and_then(|c| c.note).map(|(k, _)| k.to_string()));
    let backend = (!known.is_empty()).then(|| BackendReport {
        runtime: prov.runtime.clone(),
        version: prov.version.clone(),
        selected,
        selected_by: selected_by.clone(),
        selected_by_value: selected_by
            .as_ref()
            .and_then(|note| prov.notes.iter().find(|(k, _)| k == note))
            .map(|(_, v)| v.clone()),
        known: known
            .iter()
            .zip(&reproduced)
            .map(|((b, _), &n)| KnownCombineReport {
                id: b.id.into(),
                description: b.description.into(),
                contract: b.contract.into(),
                source: b.source.into(),
                not_checkable: b.not_checkable.map(str::to_string),
                reproduced_events: n,
            })
            .collect(),
    });
    let mut note_lines = notes.lines(order.len());
    // A run under an operand=fma member declares a contract the recorded
    // terms cannot check: say so, so "no grammar member reproduces" is not
    // read as a contract the run broke.
    let declared = &t.binding().contract;
    if AggregationContract::parse(declared)
        .is_ok_and(|c| c.operand == moeconf_contract::OperandPrecision::Fma)
    {
        note_lines.push(format!(
            "the declared contract {declared} fuses each gate multiply into the sum (operand=fma): it reads the experts' outputs before their gates, which the trace does not record, so no rule inferred from the recorded terms can be it"
        ));
    }
    Ok(TraceExplanation {
        schema_version: EXPLAIN_SCHEMA_VERSION,
        trace: name.into(),
        declared_contract: t.binding().contract.clone(),
        verdict,
        notes: note_lines,
        backend,
        events,
    })
}

/// Whether `c` gives the event's recorded output bit for bit (after the
/// trace's canonicalization) from its recorded terms and shared output.
fn reproduces(c: &AggregationContract, d: &EventData, canonicalize: &dyn Fn(u32) -> u32) -> bool {
    let refs: Vec<&[f32]> = d.terms.iter().map(Vec::as_slice).collect();
    let ctx = EventContext {
        experts: &d.experts,
        gates: &d.gates,
    };
    let mut y = vec![0.0f32; d.combine.len()];
    c.try_combine_in(Some(&ctx), &refs, &d.shared, &mut y).is_ok()
        && y.iter()
            .zip(&d.combine)
            .all(|(a, b)| canonicalize(a.to_bits()) == canonicalize(b.to_bits()))
}

fn trace_rule(agg: &TraceInference, events: &EventList) -> TraceRule {
    let v = agg.verdict();
    let rules: Vec<RuleReport> = v
        .rules
        .iter()
        .take(MAX_LISTED_RULES)
        .map(|r| RuleReport {
            contract: r.contract.describe(),
            order: order_words(&r.contract.order),
            events: r.events,
        })
        .collect();
    let explained = v.events - v.unexplained;
    let fixed = v.fixed_permutations.first().map(|(c, _, _)| c.clone());
    let rule = v.simplest.clone().or(fixed);
    let headline = match (&rule, rules.first()) {
        (Some(s), _) => format!(
            "{} — {}: {}/{} events",
            s.describe(),
            order_words(&s.order),
            v.events,
            v.events
        ),
        _ if v.unexplained == v.events => {
            let closest = events
                .iter()
                .find_map(|e| e.explanation.closest.first())
                .map(|n| format!("; closest: {}", n.words()))
                .unwrap_or_default();
            format!(
                "no grammar member reproduces {} of {} events{}{closest}",
                v.unexplained,
                v.events,
                fit_reading(events)
            )
        }
        (None, best) => {
            let mut s = String::from("no single rule explains every event");
            if let Some(b) = best {
                s.push_str(&format!(
                    "; best: {} — {}: {}/{} events",
                    b.contract, b.order, b.events, v.events
                ));
            }
            if v.unexplained > 0 {
                s.push_str(&format!(
                    "; no grammar member reproduces {} events",
                    v.unexplained
                ));
            }
            s
        }
    };
    TraceRule {
        events: v.events,
        explained_events: explained,
        unexplained_events: v.unexplained,
        rule: rule.as_ref().map(|c| c.describe()),
        rule_order: rule.as_ref().map(|c| order_words(&c.order)),
        equivalents: v
            .equivalents
            .iter()
            .map(|q| EquivalentReport {
                contract: q.contract.describe(),
                reasons: q.reasons.iter().map(ReasonReport::of).collect(),
            })
            .collect(),
        rules,
        fixed_permutations: v
            .fixed_permutations
            .iter()
            .map(|(c, n, listed)| FixedPermutationReport {
                family: c.describe(),
                matching: *n,
                listed: listed.clone(),
            })
            .collect(),
        headline,
        outside_best_rule: Vec::new(),
    }
}

impl TraceExplanation {
    /// The JSON document (docs/contracts.md, "moeconf explain").
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// Writes [`TraceExplanation::to_json`], pretty, byte for byte as
    /// `serde_json::to_writer_pretty` writes that value, without building
    /// it: the document of a long prefill is several hundred megabytes as a
    /// `serde_json::Value`, while this holds one event's value at a time.
    pub fn write_json_pretty<W: std::io::Write>(&self, w: W) -> serde_json::Result<()> {
        serde_json::to_writer_pretty(w, &AsValue(self))
    }

    /// The text report: the verdict, its equivalents, then one line per event.
    pub fn render_text(&self) -> String {
        use std::fmt::Write;
        let v = &self.verdict;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "trace {} (declared contract {}; {} MoE combine events)",
            self.trace, self.declared_contract, v.events
        );
        let _ = writeln!(o, "rule: {}", v.headline);
        for q in &v.equivalents {
            let why: Vec<&str> = q.reasons.iter().map(|r| r.text.as_str()).collect();
            let _ = writeln!(
                o,
                "  equivalent on this trace: {} — {}",
                q.contract,
                why.join("; ")
            );
        }
        if v.rule.is_none() {
            for r in &v.rules {
                let _ = writeln!(
                    o,
                    "  {} — {}: {}/{} events",
                    r.contract, r.order, r.events, v.events
                );
            }
            for e in &v.outside_best_rule {
                let why = self
                    .events
                    .iter()
                    .find(|x| (x.step, x.layer, x.position) == (e.step, e.layer, e.position))
                    .map(|x| x.explanation.summary())
                    .unwrap_or_default();
                let _ = writeln!(
                    o,
                    "  not explained by the best rule: step {} layer {} position {}: {why}",
                    e.step, e.layer, e.position
                );
            }
        }
        for f in &v.fixed_permutations {
            let _ = writeln!(
                o,
                "  fixed permutation: {} with {} of the k! permutations on every event (indices {:?})",
                f.family, f.matching, f.listed
            );
        }
        if let Some(b) = &self.backend {
            let _ = writeln!(o, "{}", b.headline());
            for k in &b.known {
                for l in k.lines(v.events) {
                    let _ = writeln!(o, "  {l}");
                }
            }
        }
        for n in &self.notes {
            let _ = writeln!(o, "note: {n}");
        }
        let _ = writeln!(o, "events:");
        for e in &self.events {
            let _ = writeln!(
                o,
                "  step {} layer {} position {} experts {:?}: {}",
                e.step,
                e.layer,
                e.position,
                e.experts,
                e.explanation.summary()
            );
        }
        o
    }
}

/// The fields of a [`TraceExplanation`], in its order, with no events.
#[derive(Serialize)]
struct Head<'a> {
    schema_version: u32,
    trace: &'a str,
    declared_contract: &'a str,
    verdict: &'a TraceRule,
    notes: &'a [String],
    backend: &'a Option<BackendReport>,
    events: [u32; 0],
}

/// A [`TraceExplanation`] serialized as its `serde_json::Value` would be: the
/// keys in the order of that value's map (the value of [`Head`] tells it,
/// whichever map `serde_json` was built with) and every number as that value
/// holds it, the events converted one at a time.
struct AsValue<'a>(&'a TraceExplanation);

/// The events serialized as a list of their `serde_json::Value`s.
struct EventsAsValues<'a>(&'a EventList);

impl Serialize for EventsAsValues<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for e in self.0.iter() {
            seq.serialize_element(&serde_json::to_value(e).map_err(S::Error::custom)?)?;
        }
        seq.end()
    }
}

impl Serialize for AsValue<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        const EVENTS: &str = "events";
        let x = self.0;
        let head = serde_json::to_value(Head {
            schema_version: x.schema_version,
            trace: &x.trace,
            declared_contract: &x.declared_contract,
            verdict: &x.verdict,
            notes: &x.notes,
            backend: &x.backend,
            events: [],
        })
        .map_err(S::Error::custom)?;
        let serde_json::Value::Object(head) = head else {
            return Err(S::Error::custom("the report's head is not a JSON object"));
        };
        let mut m = s.serialize_map(Some(head.len()))?;
        for (k, v) in &head {
            if k == EVENTS {
                m.serialize_entry(k, &EventsAsValues(&x.events))?;
            } else {
                m.serialize_entry(k, v)?;
            }
        }
        m.end()
    }
}

impl BackendReport {
    /// `backend: vllm 0.32.0 (selected by provenance note vllm.moe_experts)`.
    pub fn headline(&self) -> String {
        let how = match (&self.selected_by, self.selected, &self.selected_by_value) {
            (Some(note), true, _) => format!("its known combine, selected by provenance note {note}"),
            (None, true, _) => "its known combine".to_string(),
            (Some(note), false, Some(value)) => format!(
                "its provenance note {note} names {value:?}, which no known form lists; every known form"
            ),
            (Some(note), false, None) => {
                format!("the trace does not say which form ran (no provenance note {note} naming one); every known form")
            }
            (None, false, _) => "every known form".to_string(),
        };
        format!("backend: {} {} — {how}:", self.runtime, self.version)
    }
}

impl KnownCombineReport {
    /// Its lines: the id, the contract and how many of `events` it reproduces
    /// (or why the recorded terms cannot tell), then the source.
    pub fn lines(&self, events: usize) -> Vec<String> {
        let mut out = match &self.not_checkable {
            None => vec![format!(
                "{}: {} reproduces {}/{events} events — {}",
                self.id, self.contract, self.reproduced_events, self.description
            )],
            Some(why) => vec![
                format!(
                    "{}: {} — not checkable from the recorded terms — {}",
                    self.id, self.contract, self.description
                ),
                format!("  why: {why}"),
            ],
        };
        out.push(format!("  source: {}", self.source));
        out
    }
}

/// `; every event reads as shared expert × 1.5 (256 of 256 values reproduced
/// bitwise in 40 of 40 events)`: the fit of the first unexplained event, and
/// how many events the same reading reproduces exactly (empty when no event
/// has a reading).
fn fit_reading(events: &EventList) -> String {
    let mut fits = events.iter().filter_map(|e| e.explanation.fit.as_ref());
    let Some(first) = fits.next() else {
        return String::new();
    };
    let same = std::iter::once(first)
        .chain(fits)
        .filter(|f| f.changes == first.changes && f.differing == 0)
        .count();
    format!(
        "; read as {} ({same} of {} events reproduced bitwise by that reading)",
        first.changes.join(", "),
        events.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`Outliers`] lists, for the rule asked for, the first events whose
    /// rules do not include it, as a scan of every event's rules would
    /// (whichever rule turns out best, including one first seen late and
    /// one seen from the start).
    #[test]
    fn outliers_are_the_first_events_a_rule_misses() {
        let names = ["c", "c+order=asc-id", "b", "a+order=desc-gate"];
        // Event n reproduced by the rules whose bit is set in a pattern
        // that changes with n (some events by none).
        let rules_of = |n: usize| -> Vec<String> {
            let bits = (n * 7 + n / 5) % 16;
            names
                .iter()
                .enumerate()
                .filter(|(i, _)| bits >> i & 1 == 1 && !(n < 30 && *i == 3))
                .map(|(_, r)| r.to_string())
                .collect()
        };
        let at = |n: usize| EventRef {
            step: 0,
            layer: (n % 3) as u32,
            position: n as u32,
        };
        let mut o = Outliers::default();
        let events = 200;
        for n in 0..events {
            o.add(at(n), &rules_of(n));
        }
        for rule in names {
            let expected: Vec<EventRef> = (0..events)
                .filter(|&n| !rules_of(n).iter().any(|r| r == rule))
                .take(MAX_LISTED_OUTLIERS)
                .map(at)
                .collect();
            assert_eq!(o.of(rule), expected, "{rule}");
        }
    }
}
