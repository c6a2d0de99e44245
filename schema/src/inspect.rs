//! What a trace is of and what it holds (`moeconf inspect`): the binding,
//! digest algorithm, root digest and record counts per level and component,
//! rendered as text or as a JSON document.
//!
//! Memory is proportional to what is printed, not to the trace: counting
//! keeps one entry per (level, component path) and borrows the paths from
//! the trace's index; both renderings are written to a stream, and the one
//! list that can be large (the model's weight tensors, up to 2^20 of them,
//! with `--tensors`) is serialized element by element instead of being
//! built as one document in memory.

use std::collections::BTreeMap;
use std::io::{self, Write};

use moeconf_fingerprint::Level;
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{json, Map, Value};

use crate::{TensorDigest, Trace, TraceError, VerifySummary};
use moeconf_fingerprint::RecordPath;
use moeconf_output::escape::text;

/// Version of the JSON document of [`Inspection::write_json`].
pub const INSPECT_SCHEMA_VERSION: u32 = 1;

/// Renders a byte count with a binary unit (`12.3 KiB`).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// What to inspect besides the counts.
#[derive(Debug, Clone, Copy, Default)]
pub struct InspectOptions {
    /// Re-hash every payload ([`Trace::verify_payloads`]); header, index,
    /// checksum and root are verified on open either way.
    pub verify_payloads: bool,
    /// List every weight tensor digest of the model binding.
    pub list_tensors: bool,
}

/// Record counts of one component, one level or the whole trace.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    records: u64,
    payloads: u64,
    payload_bytes: u64,
}

/// A trace's summary, ready to render.
pub struct Inspection<'a> {
    trace: &'a Trace,
    opts: InspectOptions,
    /// (level, path) -> counts, in level then path order (paths shared
    /// with the trace's index: no allocation per record).
    per: BTreeMap<(Level, RecordPath), Counts>,
    total: Counts,
    first_step: u32,
    last_step: u32,
    verified: Option<VerifySummary>,
}

impl<'a> Inspection<'a> {
    /// Counts the records of `trace` (and re-hashes its payloads when asked).
    pub fn new(trace: &'a Trace, opts: InspectOptions) -> Result<Inspection<'a>, TraceError> {
        let verified = if opts.verify_payloads {
            Some(trace.verify_payloads()?)
        } else {
            None
        };
        let mut per: BTreeMap<(Level, RecordPath), Counts> = BTreeMap::new();
        let mut total = Counts::default();
        let (mut first_step, mut last_step) = (u32::MAX, 0u32);
        // Record by record, without keeping a version 2 trace's index.
        trace.for_each_record(|_, r| {
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
        })?;
        Ok(Inspection {
            trace,
            opts,
            per,
            total,
            first_step,
            last_step,
            verified,
        })
    }

    fn steps(&self) -> usize {
        self.trace.steps().len()
    }

    /// The JSON document (`kind: moeconf.inspect`, docs/format.md §9)
    /// without the weight tensor list, which [`Inspection::write_json`]
    /// streams into `binding.model.tensors`.
    fn document(&self) -> Value {
        let t = self.trace;
        let mut levels = Map::new();
        for level in Level::ALL {
            let mut comps = Map::new();
            let (mut n, mut p) = (0u64, 0u64);
            for ((_, path), c) in self.per.iter().filter(|((l, _), _)| *l == level) {
                n += c.records;
                p += c.payloads;
                comps.insert(
                    path.to_string(),
                    json!({"records": c.records, "payloads": c.payloads, "payload_bytes": c.payload_bytes}),
                );
            }
            levels.insert(
                level.name().to_string(),
                json!({"describes": level.describe(), "records": n, "payloads": p, "components": comps}),
            );
        }
        let steps = self.steps();
        let total = &self.total;
        let step = |s: u32| if steps > 0 { json!(s) } else { Value::Null };
        json!({
            "schema_version": INSPECT_SCHEMA_VERSION,
            "kind": "moeconf.inspect",
            "file": t.path().display().to_string(),
            "file_bytes": t.file_len(),
            "format_version": t.format_version(),
            "algorithm": t.algorithm().name(),
            "root": t.root().to_hex(),
            "binding_digest": t.binding_digest().to_hex(),
            "binding": t.binding().to_json(false),
            "provenance": t.provenance().to_json(),
            "records": {
                "total": total.records,
                "with_payload": total.payloads,
                "payload_bytes": total.payload_bytes,
                "payloads_present": total.payloads > 0,
                "by_level": levels,
            },
            "steps": {"count": steps, "first": step(self.first_step), "last": step(self.last_step)},
            "verified": match &self.verified { Some(v) => json!({"payloads": v.payloads, "payload_bytes": v.payload_bytes}), None => Value::Null },
        })
    }

    /// Writes the JSON document (`kind: moeconf.inspect`, docs/format.md
    /// §9), pretty-printed with a final newline. With
    /// [`InspectOptions::list_tensors`] the weight tensors are serialized
    /// one by one into `binding.model.tensors` (keys stay sorted, as in the
    /// rest of the document).
    pub fn write_json(&self, out: &mut dyn Write) -> io::Result<()> {
        let doc = self.document();
        let tensors = TensorsJson(&self.trace.binding().model.tensors);
        let spliced = Splice {
            value: &doc,
            path: &["binding", "model"],
            key: "tensors",
            extra: &tensors,
        };
        if self.opts.list_tensors {
            serde_json::to_writer_pretty(&mut *out, &spliced)?;
        } else {
            serde_json::to_writer_pretty(&mut *out, &doc)?;
        }
        writeln!(out)
    }

    /// Writes the text report: binding and provenance, then the counts.
    pub fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        self.render_binding(out)?;
        self.render_records(out)
    }

    /// The text report as a string (see [`Inspection::write_text`]).
    pub fn render_text(&self) -> String {
        let mut buf = Vec::new();
        // Writing into a Vec cannot fail.
        let _ = self.write_text(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// The binding lines; file name and binding strings in the visible form
    /// of [`moeconf_output::escape::text`] (no raw newline or bidi control).
    fn render_binding(&self, o: &mut dyn Write) -> io::Result<()> {
        let t = self.trace;
        let b = t.binding();
        writeln!(
            o,
            "trace      {} ({}, format v{}, {})",
            text(&t.path().display().to_string()),
            human_bytes(t.file_len()),
            t.format_version(),
            t.algorithm()
        )?;
        writeln!(o, "root       {}", t.root())?;
        writeln!(
            o,
            "model      {}  config {}  weights {} ({} tensors)",
            text(&b.model.name),
            b.model.config_digest.short(),
            b.model.weights_digest.short(),
            b.model.tensors.len()
        )?;
        if self.opts.list_tensors {
            for td in &b.model.tensors {
                writeln!(
                    o,
                    "             {:<48} {:>5} {:?} {}",
                    text(&td.name),
                    td.dtype,
                    td.shape,
                    td.digest.short()
                )?;
            }
        }
        writeln!(
            o,
            "tokenizer  {}  {}",
            text(&b.tokenizer.name),
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
            text(&b.decoding.strategy),
            b.decoding.max_new_tokens
        )?;
        writeln!(
            o,
            "precision  {}   contract {}   schedule {}",
            text(&b.precision),
            text(&b.contract),
            text(&b.schedule)
        )?;
        writeln!(o, "capture    {}", b.capture.describe())?;
        let zero = if b.canon.fold_negative_zero {
            "folded to +0"
        } else {
            "preserved"
        };
        writeln!(o, "canonical  NaN -> canonical quiet NaN; -0 {zero}")?;
        for (k, v) in &b.extra {
            writeln!(o, "extra      {} = {}", text(k), text(v))?;
        }
        let p = t.provenance();
        writeln!(
            o,
            "runtime    {} {}, {} threads (provenance, not hashed)",
            text(&p.runtime),
            text(&p.version),
            p.threads
        )?;
        let r = p.recomputed();
        if r.is_empty() {
            writeln!(o, "values     observed: the capture recomputed no record")
        } else {
            writeln!(
                o,
                "values     recomputed by the capture (not the backend's own): {}; every other record observed",
                r.patterns().join(", ")
            )
        }
    }

    fn render_records(&self, o: &mut dyn Write) -> io::Result<()> {
        let total = &self.total;
        writeln!(
            o,
            "records    {} in {} steps ({} with payloads, {})",
            total.records,
            self.steps(),
            total.payloads,
            human_bytes(total.payload_bytes)
        )?;
        writeln!(
            o,
            "  level  {:<36} {:>8} {:>9}",
            "component", "records", "payloads"
        )?;
        for ((level, path), c) in &self.per {
            writeln!(
                o,
                "  {:<6} {:<36} {:>8} {:>9}",
                level.name(),
                path,
                c.records,
                c.payloads
            )?;
        }
        match &self.verified {
            Some(v) => writeln!(
                o,
                "verified   every byte: checksum, root, {} payloads re-hashed ({})",
                v.payloads,
                human_bytes(v.payload_bytes)
            ),
            None => writeln!(
                o,
                "verified   checksum and root (payloads not re-hashed: --no-verify)"
            ),
        }
    }
}

/// The weight tensors as a JSON array, serialized one element at a time.
struct TensorsJson<'a>(&'a [TensorDigest]);

impl Serialize for TensorsJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(TensorJson))
    }
}

/// One weight tensor: `{digest, dtype, name, shape}` (sorted keys).
struct TensorJson<'a>(&'a TensorDigest);

impl Serialize for TensorJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let t = self.0;
        let mut m = s.serialize_map(Some(4))?;
        m.serialize_entry("digest", &t.digest.to_hex())?;
        m.serialize_entry("dtype", &t.dtype)?;
        m.serialize_entry("name", &t.name)?;
        m.serialize_entry("shape", &t.shape)?;
        m.end()
    }
}

/// `value` serialized with `key: extra` added to the object found by
/// following `path` (object keys), at its sorted position, so that the
/// output equals that of the document with the entry inserted, without
/// building `extra` as a [`Value`].
struct Splice<'a, T: Serialize> {
    value: &'a Value,
    path: &'a [&'a str],
    key: &'a str,
    extra: &'a T,
}

impl<T: Serialize> Serialize for Splice<'_, T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let Value::Object(map) = self.value else {
            return self.value.serialize(s);
        };
        let here = self.path.is_empty();
        let mut m = s.serialize_map(Some(map.len() + usize::from(here)))?;
        let mut pending = here;
        for (k, v) in map {
            if pending && k.as_str() > self.key {
                m.serialize_entry(self.key, self.extra)?;
                pending = false;
            }
            match self.path.split_first() {
                Some((head, rest)) if k == head => m.serialize_entry(
                    k,
                    &Splice {
                        value: v,
                        path: rest,
                        key: self.key,
                        extra: self.extra,
                    },
                )?,
                _ => m.serialize_entry(k, v)?,
            }
        }
        if pending {
            m.serialize_entry(self.key, self.extra)?;
        }
        m.end()
    }
}
