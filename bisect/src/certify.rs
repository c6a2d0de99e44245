//! The exactness certificate of every MoE event a trace captured
//! (`moeconf certify`).
//!
//! For each MoE combine event whose L4 payloads hold the routed terms
//! `moe.term.0..k-1` and `moe.shared` (traces written with `--capture all`),
//! evaluates each requested contract family under all k! orders
//! ([`order_sensitivity`]) and reports the number of bitwise-distinct
//! outputs and, when it applies, the static proof of order invariance. The
//! summary counts the order-invariant events per contract.
//!
//! It lives beside contract inference (`explain`, [`crate::explain_trace`]): both read the
//! routed terms of a recorded combine back from a trace.
//!
//! **Bounded work.** Certifying an event evaluates k! orders of D values
//! (its *work*, in order-values) per family, and holds the distinct outputs
//! of one event in memory (at most 4 bytes per order-value). Before any
//! evaluation every event is checked: k ≤ [`MAX_CERTIFIED_K`], the event's
//! work ≤ [`CertifyLimits::max_event_work`], and the sum over all events and
//! families ≤ [`CertifyLimits::max_total_work`]. Anything beyond is an error
//! naming the event or the totals and the limit to raise; a certificate is
//! never computed for part of the events and presented as complete.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use moeconf_contract::{
    factorial, order_sensitivity, AggregationContract, Certificate, ContractError, InvarianceProof,
    MAX_CERTIFIED_K,
};
use moeconf_fingerprint::{Component, DType, Phase};
use moeconf_schema::{Trace, TraceError};
use serde_json::{json, Value};

/// Version of the JSON document of [`CertifyReport::to_json`].
pub const CERTIFY_SCHEMA_VERSION: u32 = 1;

/// Default [`CertifyLimits::max_event_work`]: 2^25 order-values (at most
/// 128 MiB of distinct outputs for one event; k = 8 allows D ≤ 832, k = 6
/// D ≤ 46 603).
pub const DEFAULT_MAX_EVENT_WORK: u64 = 1 << 25;

/// Default [`CertifyLimits::max_total_work`]: 2^28 order-values over all
/// events and families (about 5–8 s on the 2-core development machine).
pub const DEFAULT_MAX_TOTAL_WORK: u64 = 1 << 28;

/// How much work one `certify` run may do (module docs, "Bounded work").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CertifyLimits {
    /// Largest k! × D of one event (also bounds its memory: 4 bytes per order-value).
    pub max_event_work: u64,
    /// Largest Σ k! × D over every certified event and family.
    pub max_total_work: u64,
}

impl Default for CertifyLimits {
    fn default() -> Self {
        CertifyLimits {
            max_event_work: DEFAULT_MAX_EVENT_WORK,
            max_total_work: DEFAULT_MAX_TOTAL_WORK,
        }
    }
}

/// Why a trace cannot be certified. Every variant names the trace file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CertifyError {
    /// The trace has no routed-term or shared-expert records at all.
    #[error(
        "{}: the trace has no {} / {} records (L4 not captured); re-run with --capture all",
        path.display(), Component::MoeTerm, Component::MoeShared
    )]
    NoEvents {
        /// The trace file.
        path: PathBuf,
    },
    /// No event keeps the payloads of all its terms and its shared output.
    #[error(
        "{}: none of the {events} MoE events keeps the payloads of {} and {}; re-run with --capture all",
        path.display(), Component::MoeTerm, Component::MoeShared
    )]
    NoPayloads {
        path: PathBuf,
        /// Events without payloads.
        events: usize,
    },
    /// An event's records are inconsistent (the message says how and where).
    #[error("{}: {at}: {what}", path.display())]
    Malformed {
        path: PathBuf,
        /// The event (`step S position P layer L`).
        at: String,
        /// What is wrong.
        what: String,
    },
    /// A routed-term or shared-expert record is not FP32.
    #[error(
        "{}: record {record} at step {step} position {position} has dtype {dtype:?}, expected f32",
        path.display()
    )]
    NotF32 {
        path: PathBuf,
        /// The record's path.
        record: String,
        step: u32,
        position: u32,
        dtype: DType,
    },
    /// A payload is not a whole number of FP32 values.
    #[error("{}: record {record}: payload of {bytes} bytes is not f32", path.display())]
    PayloadNotF32 {
        path: PathBuf,
        /// The record's path.
        record: String,
        /// The payload's length.
        bytes: usize,
    },
    /// A payload does not match its record digest (or is otherwise
    /// invalid): the message names the file, the record and its offset.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// An event has more routed terms than certify enumerates orders for.
    #[error(
        "{}: {at}: k = {k} routed terms: certify enumerates all k! orders and supports k <= {max}",
        path.display()
    )]
    TooManyTerms {
        path: PathBuf,
        /// The event.
        at: String,
        /// Its routed terms.
        k: usize,
        /// The largest supported k.
        max: usize,
    },
    /// One event needs more work than the per-event limit.
    #[error(
        "{}: {at}: k = {k} routed terms of {d} values: {k}! orders x {d} values = {work} order-values, more than \
         the per-event limit of {limit} (raise it with --max-event-work; one event's distinct outputs are held \
         in memory, up to 4 bytes per order-value)",
        path.display()
    )]
    EventTooLarge {
        path: PathBuf,
        /// The event.
        at: String,
        /// Its routed terms.
        k: usize,
        /// Values per term.
        d: u64,
        /// k! × D (saturating).
        work: u64,
        limit: u64,
    },
    /// All events together need more work than the total limit.
    #[error(
        "{}: certifying {events} MoE events under {families} contract famil{} takes {work} order-values (k! x D \
         summed), more than the limit of {limit}: raise it with --max-work, or certify fewer families",
        path.display(), if *families == 1 { "y" } else { "ies" }
    )]
    TooMuchWork {
        path: PathBuf,
        /// Events with payloads.
        events: usize,
        /// Families requested.
        families: usize,
        /// The total (saturating).
        work: u64,
        limit: u64,
    },
    /// A contract family cannot be evaluated on an event.
    #[error("{}: {at}: --contract {contract}", path.display())]
    Contract {
        path: PathBuf,
        /// The event.
        at: String,
        /// The contract as given.
        contract: String,
        /// Why it cannot be evaluated.
        #[source]
        source: Box<ContractError>,
    },
}

/// A contract family to certify, with the name it was given by.
#[derive(Debug, Clone)]
pub struct Family {
    /// The name as given (e.g. `c`).
    pub name: String,
    /// The family (its own order is ignored: every order is evaluated).
    pub contract: AggregationContract,
}

/// One MoE event of the trace: its coordinates and record indices.
#[derive(Debug, Clone)]
pub struct MoeEvent {
    /// Forward step.
    pub step: u32,
    /// Absolute position.
    pub position: u32,
    /// Decoder layer.
    pub layer: u32,
    pub phase: Phase,
    /// (term index J, record index) of each `moe.term.J`, sorted by J.
    terms: Vec<(usize, usize)>,
    /// Record index of `moe.shared`.
    shared: Option<usize>,
}

impl MoeEvent {
    fn at(&self) -> String {
        format!(
            "step {} position {} layer {}",
            self.step, self.position, self.layer
        )
    }
}

/// The certificates of one event, one per family.
#[derive(Debug, Clone)]
pub struct EventCertificates {
    pub event: MoeEvent,
    /// Routed terms (k).
    pub k: usize,
    /// One certificate per family, in the families' order.
    pub certs: Vec<Certificate>,
}

/// Every event's certificates.
#[derive(Debug, Clone)]
pub struct CertifyReport {
    pub trace: PathBuf,
    pub families: Vec<Family>,
    /// Events with payloads, in first-seen order.
    pub rows: Vec<EventCertificates>,
    /// Events skipped because a payload is missing.
    pub without_payload: usize,
}

/// The FP32 values of a record's payload, checked against dtype and length.
fn f32_payload(trace: &Trace, i: usize, what: &str) -> Result<Option<Vec<f32>>, CertifyError> {
    let e = trace.record(i);
    if e.dtype != DType::F32 {
        return Err(CertifyError::NotF32 {
            path: trace.path().to_path_buf(),
            record: what.to_string(),
            step: e.coord.step,
            position: e.coord.position,
            dtype: e.dtype,
        });
    }
    let Some(bytes) = trace.payload_verified(i)? else {
        return Ok(None);
    };
    if bytes.len() % 4 != 0 {
        return Err(CertifyError::PayloadNotF32 {
            path: trace.path().to_path_buf(),
            record: what.to_string(),
            bytes: bytes.len(),
        });
    }
    Ok(Some(
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ))
}

/// Groups the trace's routed-term and shared-expert records by (step,
/// position, layer), in first-seen order.
fn collect_events(trace: &Trace) -> Result<Vec<MoeEvent>, CertifyError> {
    let mut index: HashMap<(u32, u32, u32), usize> = HashMap::new();
    let mut events: Vec<MoeEvent> = Vec::new();
    for (i, e) in trace.records()?.iter().enumerate() {
        let path = e.coord.path.as_str();
        let term = path
            .strip_prefix(Component::MoeTerm.path())
            .and_then(|j| j.parse::<usize>().ok());
        if term.is_none() && !Component::MoeShared.matches(path) {
            continue;
        }
        let Some(layer) = e.coord.layer else { continue };
        let key = (e.coord.step, e.coord.position, layer);
        let at = *index.entry(key).or_insert_with(|| {
            events.push(MoeEvent {
                step: key.0,
                position: key.1,
                layer,
                phase: e.coord.phase,
                terms: Vec::new(),
                shared: None,
            });
            events.len() - 1
        });
        match term {
            Some(j) => events[at].terms.push((j, i)),
            None => events[at].shared = Some(i),
        }
    }
    Ok(events)
}

/// The FP32 values of one event.
struct EventValues {
    /// Routed terms, in term order.
    terms: Vec<Vec<f32>>,
    /// Shared-expert output.
    shared: Vec<f32>,
}

/// The routed terms and shared output of one event, or `None` when a
/// payload is missing.
fn event_values(trace: &Trace, ev: &MoeEvent) -> Result<Option<EventValues>, CertifyError> {
    let k = ev.terms.len();
    let malformed = |what: String| CertifyError::Malformed {
        path: trace.path().to_path_buf(),
        at: ev.at(),
        what,
    };
    let term = |j: usize| Component::MoeTerm.indexed_path(j as u32);
    if ev.terms.iter().enumerate().any(|(j, &(tj, _))| j != tj) {
        return Err(malformed(format!(
            "moe.term indices are not 0..{} without gaps or duplicates",
            k.saturating_sub(1)
        )));
    }
    let Some(si) = ev.shared else {
        return Err(malformed(format!(
            "{} without {}",
            Component::MoeTerm,
            Component::MoeShared
        )));
    };
    let Some(shared) = f32_payload(trace, si, Component::MoeShared.path())? else {
        return Ok(None);
    };
    let mut terms = Vec::with_capacity(k);
    for &(j, ti) in &ev.terms {
        match f32_payload(trace, ti, &term(j))? {
            Some(t) if t.len() == shared.len() => terms.push(t),
            Some(t) => {
                return Err(malformed(format!(
                    "{} has {} values but {} has {}",
                    term(j),
                    t.len(),
                    Component::MoeShared,
                    shared.len()
                )))
            }
            None => return Ok(None),
        }
    }
    Ok(Some(EventValues { terms, shared }))
}

/// Whether every record of an event keeps its payload.
fn has_payloads(trace: &Trace, ev: &MoeEvent) -> bool {
    let kept = |i: usize| trace.get_record(i).is_some_and(|e| e.payload.is_some());
    ev.shared.is_some_and(kept) && ev.terms.iter().all(|&(_, i)| kept(i))
}

/// Checks every event with payloads against the limits before any
/// evaluation: k, the event's work and the total (module docs).
fn check_limits(
    trace: &Trace,
    events: &[MoeEvent],
    families: usize,
    limits: CertifyLimits,
) -> Result<(), CertifyError> {
    let path = || trace.path().to_path_buf();
    let (mut total, mut counted) = (0u64, 0usize);
    for ev in events.iter().filter(|ev| has_payloads(trace, ev)) {
        let k = ev.terms.len();
        if k > MAX_CERTIFIED_K {
            return Err(CertifyError::TooManyTerms {
                path: path(),
                at: ev.at(),
                k,
                max: MAX_CERTIFIED_K,
            });
        }
        let d = ev.shared.and_then(|i| trace.get_record(i)).map_or(0, |e| {
            e.shape
                .iter()
                .try_fold(1u64, |a, &x| a.checked_mul(x))
                .unwrap_or(u64::MAX)
        });
        let work = factorial(k).unwrap_or(u64::MAX).saturating_mul(d);
        if work > limits.max_event_work {
            return Err(CertifyError::EventTooLarge {
                path: path(),
                at: ev.at(),
                k,
                d,
                work,
                limit: limits.max_event_work,
            });
        }
        total = total.saturating_add(work.saturating_mul(families as u64));
        counted += 1;
    }
    if total > limits.max_total_work {
        return Err(CertifyError::TooMuchWork {
            path: path(),
            events: counted,
            families,
            work: total,
            limit: limits.max_total_work,
        });
    }
    Ok(())
}

/// Certifies every MoE event of `trace` under each family, within the
/// default [`CertifyLimits`].
pub fn certify(trace: &Trace, families: &[Family]) -> Result<CertifyReport, CertifyError> {
    certify_within(trace, families, CertifyLimits::default())
}

/// Certifies every MoE event of `trace` under each family, after checking
/// that the whole run stays within `limits` (an error otherwise: never a
/// partial certificate).
pub fn certify_within(
    trace: &Trace,
    families: &[Family],
    limits: CertifyLimits,
) -> Result<CertifyReport, CertifyError> {
    let path = || trace.path().to_path_buf();
    let events = collect_events(trace)?;
    if events.is_empty() {
        return Err(CertifyError::NoEvents { path: path() });
    }
    check_limits(trace, &events, families.len(), limits)?;
    let mut rows = Vec::new();
    let mut without_payload = 0usize;
    for mut ev in events {
        ev.terms.sort();
        let Some(EventValues { terms, shared }) = event_values(trace, &ev)? else {
            without_payload += 1;
            continue;
        };
        let refs: Vec<&[f32]> = terms.iter().map(|t| t.as_slice()).collect();
        let mut certs = Vec::with_capacity(families.len());
        for f in families {
            certs.push(order_sensitivity(&f.contract, &refs, &shared).map_err(|source| {
                CertifyError::Contract {
                    path: path(),
                    at: ev.at(),
                    contract: f.name.clone(),
                    source: Box::new(source),
                }
            })?);
        }
        rows.push(EventCertificates {
            k: ev.terms.len(),
            event: ev,
            certs,
        });
    }
    if rows.is_empty() {
        return Err(CertifyError::NoPayloads {
            path: path(),
            events: without_payload,
        });
    }
    Ok(CertifyReport {
        trace: path(),
        families: families.to_vec(),
        rows,
        without_payload,
    })
}

fn proof_name(p: Option<InvarianceProof>) -> Option<String> {
    p.map(|p| match p {
        InvarianceProof::ExactAccumulator => "exact accumulator".to_string(),
        InvarianceProof::AllPartialSumsExact { precision_bits } => {
            format!("all partial sums exact in {precision_bits} bits")
        }
    })
}

/// The summary of one family over every event.
struct FamilySummary<'a> {
    name: &'a str,
    family: String,
    events: usize,
    order_invariant: usize,
    proven_invariant: usize,
    max_distinct_outputs: usize,
}

impl CertifyReport {
    fn summaries(&self) -> Vec<FamilySummary<'_>> {
        self.families
            .iter()
            .enumerate()
            .map(|(f, fam)| FamilySummary {
                name: &fam.name,
                family: fam.contract.describe(),
                events: self.rows.len(),
                order_invariant: self
                    .rows
                    .iter()
                    .filter(|r| r.certs[f].is_order_invariant())
                    .count(),
                proven_invariant: self.rows.iter().filter(|r| r.certs[f].proof.is_some()).count(),
                max_distinct_outputs: self
                    .rows
                    .iter()
                    .map(|r| r.certs[f].distinct_outputs)
                    .max()
                    .unwrap_or(0),
            })
            .collect()
    }

    /// The JSON document (`kind: moeconf.certify`).
    pub fn to_json(&self) -> Value {
        let summary: Vec<Value> = self
            .summaries()
            .iter()
            .map(|s| {
                json!({
                    "contract": s.name,
                    "family": s.family,
                    "events": s.events,
                    "order_invariant": s.order_invariant,
                    "proven_invariant": s.proven_invariant,
                    "max_distinct_outputs": s.max_distinct_outputs,
                })
            })
            .collect();
        let events: Vec<Value> = self.rows.iter().map(|r| self.event_json(r)).collect();
        json!({
            "schema_version": CERTIFY_SCHEMA_VERSION,
            "kind": "moeconf.certify",
            "trace": self.trace.display().to_string(),
            "events_without_payload": self.without_payload,
            "summary": summary,
            "events": events,
        })
    }

    fn event_json(&self, r: &EventCertificates) -> Value {
        let certs: Vec<Value> = self
            .families
            .iter()
            .zip(&r.certs)
            .map(|(f, c)| {
                json!({
                    "contract": f.name,
                    "orders": c.orders,
                    "distinct_outputs": c.distinct_outputs,
                    "sensitive_elements": c.sensitive_elements,
                    "order_invariant": c.is_order_invariant(),
                    "proof": proof_name(c.proof),
                })
            })
            .collect();
        json!({
            "step": r.event.step,
            "position": r.event.position,
            "layer": r.event.layer,
            "phase": r.event.phase.name(),
            "k": r.k,
            "certificates": certs,
        })
    }

    /// The text report: one line per event (unless `summary_only`), then the
    /// summary per family.
    pub fn render_text(&self, summary_only: bool) -> String {
        let mut o = String::new();
        let skipped = self.without_payload;
        let _ = writeln!(
            o,
            "certify {}: {} MoE events with L4 terms{}",
            self.trace.display(),
            self.rows.len(),
            if skipped > 0 {
                format!(" ({skipped} more without payloads skipped)")
            } else {
                String::new()
            }
        );
        if !summary_only {
            let _ = writeln!(
                o,
                "\n step   pos  layer  k  per contract: distinct outputs / orders [proof]"
            );
            for r in &self.rows {
                let e = &r.event;
                let _ = write!(o, "{:>5} {:>5} {:>6} {:>2} ", e.step, e.position, e.layer, r.k);
                for (f, c) in self.families.iter().zip(&r.certs) {
                    let proof = proof_name(c.proof)
                        .map(|p| format!(" [proof: {p}]"))
                        .unwrap_or_default();
                    let _ = write!(o, " {}: {}/{}{proof}", f.name, c.distinct_outputs, c.orders);
                }
                let _ = writeln!(o);
            }
        }
        let _ = writeln!(o, "\nsummary:");
        for s in self.summaries() {
            let _ = writeln!(
                o,
                "  {:<6} order-invariant on {}/{} events ({} proven from the exact sum); max {} distinct outputs",
                s.name, s.order_invariant, s.events, s.proven_invariant, s.max_distinct_outputs
            );
        }
        o
    }
}
