//! `moeconf inspect`: what a trace is of and what it holds.

use crate::cli::{Format, InspectArgs};
use crate::output::{human_bytes, print_json};
use moeconf_fingerprint::Level;
use moeconf_schema::{Trace, FORMAT_VERSION};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;

/// Version of the JSON document printed by `inspect --format json`.
pub const INSPECT_SCHEMA_VERSION: u32 = 1;

#[derive(Default)]
struct Counts {
    records: u64,
    payloads: u64,
    payload_bytes: u64,
}

pub fn run(a: &InspectArgs) -> anyhow::Result<ExitCode> {
    let t = Trace::open(&a.trace)?;
    let verified = if a.no_verify {
        None
    } else {
        Some(t.verify_payloads()?)
    };
    // (level, path) -> counts, in level then path order.
    let mut per: BTreeMap<(Level, String), Counts> = BTreeMap::new();
    let mut total = Counts::default();
    let (mut first_step, mut last_step) = (u32::MAX, 0u32);
    for r in t.records() {
        let c = per.entry((r.level, r.coord.path.clone())).or_default();
        c.records += 1;
        total.records += 1;
        if let Some(p) = r.payload {
            c.payloads += 1;
            c.payload_bytes += p.len;
            total.payloads += 1;
            total.payload_bytes += p.len;
        }
        first_step = first_step.min(r.coord.step);
        last_step = last_step.max(r.coord.step);
    }
    let steps = t.tree().steps.len();

    match a.format {
        Format::Json => {
            let mut levels = Map::new();
            for level in Level::ALL {
                let mut comps = Map::new();
                let (mut n, mut p) = (0u64, 0u64);
                for ((l, path), c) in per.iter().filter(|((l, _), _)| *l == level) {
                    debug_assert_eq!(*l, level);
                    n += c.records;
                    p += c.payloads;
                    comps.insert(
                        path.clone(),
                        json!({"records": c.records, "payloads": c.payloads, "payload_bytes": c.payload_bytes}),
                    );
                }
                levels.insert(
                    level.name().to_string(),
                    json!({"describes": level.describe(), "records": n, "payloads": p, "components": comps}),
                );
            }
            let doc = json!({
                "schema_version": INSPECT_SCHEMA_VERSION,
                "kind": "moeconf.inspect",
                "file": a.trace.display().to_string(),
                "file_bytes": t.file_len(),
                "format_version": FORMAT_VERSION,
                "algorithm": t.algorithm().name(),
                "root": t.root().to_hex(),
                "binding_digest": t.binding_digest().to_hex(),
                "binding": t.binding().to_json(a.tensors),
                "provenance": t.provenance().to_json(),
                "records": {
                    "total": total.records,
                    "with_payload": total.payloads,
                    "payload_bytes": total.payload_bytes,
                    "payloads_present": total.payloads > 0,
                    "by_level": levels,
                },
                "steps": {"count": steps, "first": if steps > 0 { json!(first_step) } else { Value::Null }, "last": if steps > 0 { json!(last_step) } else { Value::Null }},
                "verified": match verified { Some(v) => json!({"payloads": v.payloads, "payload_bytes": v.payload_bytes}), None => Value::Null },
            });
            print_json(&doc)?;
        }
        Format::Text => {
            let b = t.binding();
            let p = t.provenance();
            let mut o = std::io::stdout().lock();
            writeln!(
                o,
                "trace      {} ({}, format v{FORMAT_VERSION}, {})",
                a.trace.display(),
                human_bytes(t.file_len()),
                t.algorithm()
            )?;
            writeln!(o, "root       {}", t.root())?;
            writeln!(
                o,
                "model      {}  config {}  weights {} ({} tensors)",
                b.model.name,
                b.model.config_digest.short(),
                b.model.weights_digest.short(),
                b.model.tensors.len()
            )?;
            if a.tensors {
                for td in &b.model.tensors {
                    writeln!(
                        o,
                        "             {:<48} {:>5} {:?} {}",
                        td.name,
                        td.dtype,
                        td.shape,
                        td.digest.short()
                    )?;
                }
            }
            writeln!(
                o,
                "tokenizer  {}  {}",
                b.tokenizer.name,
                b.tokenizer.digest.short()
            )?;
            writeln!(
                o,
                "prompt     {:?} ({} ids: {:?})",
                b.prompt.text,
                b.prompt.ids.len(),
                b.prompt.ids
            )?;
            writeln!(
                o,
                "decoding   {}, {} new tokens",
                b.decoding.strategy, b.decoding.max_new_tokens
            )?;
            writeln!(
                o,
                "precision  {}   contract {}   schedule {}",
                b.precision, b.contract, b.schedule
            )?;
            writeln!(o, "capture    {}", b.capture.describe())?;
            writeln!(
                o,
                "canonical  NaN -> canonical quiet NaN; -0 {}",
                if b.canon.fold_negative_zero {
                    "folded to +0"
                } else {
                    "preserved"
                }
            )?;
            for (k, v) in &b.extra {
                writeln!(o, "extra      {k} = {v}")?;
            }
            writeln!(
                o,
                "runtime    {} {}, {} threads (provenance, not hashed)",
                p.runtime, p.version, p.threads
            )?;
            writeln!(
                o,
                "records    {} in {} steps ({} with payloads, {})",
                total.records,
                steps,
                total.payloads,
                human_bytes(total.payload_bytes)
            )?;
            writeln!(
                o,
                "  level  {:<36} {:>8} {:>9}",
                "component", "records", "payloads"
            )?;
            for ((level, path), c) in &per {
                writeln!(
                    o,
                    "  {:<6} {:<36} {:>8} {:>9}",
                    level.name(),
                    path,
                    c.records,
                    c.payloads
                )?;
            }
            match verified {
                Some(v) => writeln!(
                    o,
                    "verified   every byte: checksum, root, {} payloads re-hashed ({})",
                    v.payloads,
                    human_bytes(v.payload_bytes)
                )?,
                None => writeln!(
                    o,
                    "verified   checksum and root (payloads not re-hashed: --no-verify)"
                )?,
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
