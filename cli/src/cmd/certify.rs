//! `moeconf certify`: the exactness certificate of every captured MoE event.
//!
//! For each MoE combine event of a trace whose L4 payloads hold the routed
//! terms `moe.term.0..k-1` and `moe.shared` (traces written with
//! `moeconf run --capture all`), evaluates each requested contract family
//! under all k! orders ([`order_sensitivity`]) and reports the number of
//! bitwise-distinct outputs and, when it applies, the static proof of order
//! invariance. The summary counts the order-invariant events per contract.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use moeconf_contract::{order_sensitivity, AggregationContract, Certificate, InvarianceProof, Order};
use moeconf_fingerprint::{DType, Phase};
use moeconf_schema::Trace;
use serde_json::{json, Value};

use crate::cli::Format;
use crate::output::print_json;

/// Version of the JSON document written by `moeconf certify`.
pub const CERTIFY_SCHEMA_VERSION: u32 = 1;

const CERTIFY_EXAMPLES: &str = "Examples:
  moeconf run --prompt \"why the sheep\" --capture all -o full.bin
  moeconf certify full.bin
  moeconf certify full.bin --contract c,a,b
  moeconf certify full.bin --contract c,b --format json > cert.json

Contracts are families (native, p32, c, a, b, exact, tree, f64, exact-fused, ...); their own
order is ignored: every one of the k! orders (k <= 8) is evaluated. `distinct` is the number of
bitwise-distinct MoE outputs over all orders (1 = order-invariant on this event); a proof says
why invariance holds for any order (exact accumulator, or every partial sum exactly
representable).";

/// Arguments of `moeconf certify`.
#[derive(Debug, clap::Args)]
#[command(after_help = CERTIFY_EXAMPLES)]
pub struct CertifyArgs {
    /// The trace (written with `moeconf run --capture all`, or any trace with L4 payloads of
    /// moe.term.* and moe.shared).
    pub trace: PathBuf,
    /// Contract families to certify, comma-separated (e.g. c,a,b).
    #[arg(long, value_delimiter = ',', default_value = "c")]
    pub contract: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Print only the summary (text format).
    #[arg(long)]
    pub summary_only: bool,
}

/// One MoE event of the trace: its coordinates and record indices.
#[derive(Debug, Default)]
struct Event {
    step: u32,
    position: u32,
    layer: u32,
    phase: Option<Phase>,
    terms: Vec<(usize, usize)>,
    shared: Option<usize>,
}

fn proof_name(p: Option<InvarianceProof>) -> Option<String> {
    p.map(|p| match p {
        InvarianceProof::ExactAccumulator => "exact accumulator".to_string(),
        InvarianceProof::AllPartialSumsExact { precision_bits } => {
            format!("all partial sums exact in {precision_bits} bits")
        }
    })
}

/// The FP32 values of a record's payload, checked against dtype and length.
fn f32_payload(trace: &Trace, i: usize, what: &str) -> anyhow::Result<Option<Vec<f32>>> {
    let e = &trace.records()[i];
    if e.dtype != DType::F32 {
        bail!(
            "{}: record {what} at step {} position {} has dtype {:?}, expected f32",
            trace.path().display(),
            e.coord.step,
            e.coord.position,
            e.dtype
        );
    }
    let Some(bytes) = trace.payload(i) else {
        return Ok(None);
    };
    if bytes.len() % 4 != 0 {
        bail!(
            "{}: record {what}: payload of {} bytes is not f32",
            trace.path().display(),
            bytes.len()
        );
    }
    Ok(Some(
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ))
}

/// Groups the trace's moe.term.* / moe.shared records by (step, position, layer), in first-seen order.
fn collect_events(trace: &Trace) -> Vec<Event> {
    let mut index: HashMap<(u32, u32, u32), usize> = HashMap::new();
    let mut events: Vec<Event> = Vec::new();
    for (i, e) in trace.records().iter().enumerate() {
        let path = e.coord.path.as_str();
        let term = path
            .strip_prefix("moe.term.")
            .and_then(|j| j.parse::<usize>().ok());
        if term.is_none() && path != "moe.shared" {
            continue;
        }
        let Some(layer) = e.coord.layer else { continue };
        let key = (e.coord.step, e.coord.position, layer);
        let at = *index.entry(key).or_insert_with(|| {
            events.push(Event {
                step: key.0,
                position: key.1,
                layer,
                phase: Some(e.coord.phase),
                ..Event::default()
            });
            events.len() - 1
        });
        match term {
            Some(j) => events[at].terms.push((j, i)),
            None => events[at].shared = Some(i),
        }
    }
    events
}

/// Per-event certificate rows for every family.
struct Row {
    event: Event,
    k: usize,
    certs: Vec<Certificate>,
}

fn certify_all(
    trace: &Trace,
    families: &[(String, AggregationContract)],
) -> anyhow::Result<(Vec<Row>, usize)> {
    let events = collect_events(trace);
    if events.is_empty() {
        bail!(
            "{}: the trace has no moe.term.* / moe.shared records (L4 not captured); re-run with --capture all",
            trace.path().display()
        );
    }
    let mut rows = Vec::new();
    let mut without_payload = 0usize;
    for mut ev in events {
        ev.terms.sort();
        let k = ev.terms.len();
        let where_ = format!("step {} position {} layer {}", ev.step, ev.position, ev.layer);
        if ev.terms.iter().enumerate().any(|(j, &(tj, _))| j != tj) {
            bail!(
                "{}: {where_}: moe.term indices are not 0..{} without gaps or duplicates",
                trace.path().display(),
                k.saturating_sub(1)
            );
        }
        let Some(si) = ev.shared else {
            bail!(
                "{}: {where_}: moe.term.* without moe.shared",
                trace.path().display()
            );
        };
        let Some(shared) = f32_payload(trace, si, "moe.shared")? else {
            without_payload += 1;
            continue;
        };
        let mut terms = Vec::with_capacity(k);
        for &(j, ti) in &ev.terms {
            match f32_payload(trace, ti, &format!("moe.term.{j}"))? {
                Some(t) if t.len() == shared.len() => terms.push(t),
                Some(t) => bail!(
                    "{}: {where_}: moe.term.{j} has {} values but moe.shared has {}",
                    trace.path().display(),
                    t.len(),
                    shared.len()
                ),
                None => break,
            }
        }
        if terms.len() != k {
            without_payload += 1;
            continue;
        }
        let refs: Vec<&[f32]> = terms.iter().map(|t| t.as_slice()).collect();
        let mut certs = Vec::with_capacity(families.len());
        for (name, fam) in families {
            certs.push(order_sensitivity(fam, &refs, &shared).map_err(|e| {
                anyhow::anyhow!("{}: {where_}: --contract {name}: {e}", trace.path().display())
            })?);
        }
        rows.push(Row { event: ev, k, certs });
    }
    if rows.is_empty() {
        bail!(
            "{}: none of the {without_payload} MoE events keeps the payloads of moe.term.* and moe.shared; \
             re-run with --capture all",
            trace.path().display()
        );
    }
    Ok((rows, without_payload))
}

/// Runs `moeconf certify`.
pub fn run(a: &CertifyArgs) -> anyhow::Result<ExitCode> {
    let mut families = Vec::new();
    for name in a.contract.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let c = AggregationContract::parse(name).map_err(|e| anyhow::anyhow!("--contract {name:?}: {e}"))?;
        families.push((name.to_string(), c.with_order(Order::Identity)));
    }
    if families.is_empty() {
        bail!("--contract: give at least one contract family (e.g. c,a,b)");
    }
    let trace = Trace::open(&a.trace).with_context(|| format!("opening {}", a.trace.display()))?;
    let (rows, skipped) = certify_all(&trace, &families)?;

    let summary: Vec<Value> = families
        .iter()
        .enumerate()
        .map(|(f, (name, fam))| {
            let inv = rows.iter().filter(|r| r.certs[f].is_order_invariant()).count();
            let proven = rows.iter().filter(|r| r.certs[f].proof.is_some()).count();
            let max = rows
                .iter()
                .map(|r| r.certs[f].distinct_outputs)
                .max()
                .unwrap_or(0);
            json!({
                "contract": name,
                "family": fam.describe(),
                "events": rows.len(),
                "order_invariant": inv,
                "proven_invariant": proven,
                "max_distinct_outputs": max,
            })
        })
        .collect();
    match a.format {
        Format::Json => {
            let events: Vec<Value> = rows
                .iter()
                .map(|r| {
                    let certs: Vec<Value> = families
                        .iter()
                        .zip(&r.certs)
                        .map(|((name, _), c)| {
                            json!({
                                "contract": name,
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
                        "phase": r.event.phase.map(|p| p.name()),
                        "k": r.k,
                        "certificates": certs,
                    })
                })
                .collect();
            print_json(&json!({
                "schema_version": CERTIFY_SCHEMA_VERSION,
                "kind": "moeconf.certify",
                "trace": a.trace.display().to_string(),
                "events_without_payload": skipped,
                "summary": summary,
                "events": events,
            }))?;
        }
        Format::Text => {
            use std::fmt::Write as _;
            let mut o = String::new();
            let _ = writeln!(
                o,
                "certify {}: {} MoE events with L4 terms{}",
                a.trace.display(),
                rows.len(),
                if skipped > 0 {
                    format!(" ({skipped} more without payloads skipped)")
                } else {
                    String::new()
                }
            );
            if !a.summary_only {
                let _ = writeln!(
                    o,
                    "\n step   pos  layer  k  per contract: distinct outputs / orders [proof]"
                );
                for r in &rows {
                    let _ = write!(
                        o,
                        "{:>5} {:>5} {:>6} {:>2} ",
                        r.event.step, r.event.position, r.event.layer, r.k
                    );
                    for ((name, _), c) in families.iter().zip(&r.certs) {
                        let proof = proof_name(c.proof)
                            .map(|p| format!(" [proof: {p}]"))
                            .unwrap_or_default();
                        let _ = write!(o, " {name}: {}/{}{proof}", c.distinct_outputs, c.orders);
                    }
                    let _ = writeln!(o);
                }
            }
            let _ = writeln!(o, "\nsummary:");
            for s in &summary {
                let _ = writeln!(
                    o,
                    "  {:<6} order-invariant on {}/{} events ({} proven from the exact sum); max {} distinct outputs",
                    s["contract"].as_str().unwrap_or("?"),
                    s["order_invariant"],
                    s["events"],
                    s["proven_invariant"],
                    s["max_distinct_outputs"]
                );
            }
            let mut out = std::io::stdout().lock();
            out.write_all(o.as_bytes())?;
            out.flush()?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
