//! Partial coverage: where localization must stop because one trace did not
//! capture some inputs of the localized record.
//!
//! A backend that computes intermediate values inside a fused kernel (llama.cpp's
//! `DSV4_HC_PRE`, `LIGHTNING_INDEXER`, attention over its caches) gives its capture no
//! record of them, while the reference records every operator. When the first differing
//! record's inputs include such records (held by one trace only), "its inputs match"
//! would rest on inputs nobody compared: the operator cannot be separated from them.
//! Localization then ends at that record — the finest level both traces captured there —
//! and the report names the records that would be needed to go further, with the side
//! that lacks them and the reason its capture gives (the provenance note
//! [`NOT_CAPTURED_NOTE`], docs/format.md §5.2.2).
//!
//! Capture-only components (`moe.routed`, catalogue presence `CaptureOnly`) are never
//! needed from the reference: the reference computes their consumers without them.

use crate::ctx::Ctx;
use crate::operators::{describe_input, producer};
use crate::report::{CoverageLimit, NeededRecord};
use moeconf_fingerprint::catalogue::Presence;
use moeconf_fingerprint::Level;
use moeconf_schema::Trace;

/// The provenance note in which a capture lists what it could not observe:
/// `path: reason` items separated by `; ` (docs/format.md §5.2.2). Informative:
/// a malformed note only loses the reasons.
pub const NOT_CAPTURED_NOTE: &str = "moeconf.not_captured";

/// The reason `t`'s capture gives for not recording `path` (exact path or `prefix*`).
pub fn not_captured_reason(t: &Trace, path: &str) -> Option<String> {
    let note = t
        .provenance()
        .notes
        .iter()
        .find(|(k, _)| k == NOT_CAPTURED_NOTE)
        .map(|(_, v)| v.as_str())?;
    note.split("; ").find_map(|item| {
        let (p, reason) = item.split_once(": ")?;
        let hit = match p.strip_suffix('*') {
            Some(stem) => path.starts_with(stem),
            None => p == path,
        };
        hit.then(|| reason.trim().to_string())
    })
}

impl Ctx<'_> {
    /// The coverage limit of the record `path` at (`step`, `layer`, `position`), whose
    /// level is `level`: the inputs one trace holds and the other does not (`None` when
    /// both hold every input they are expected to).
    pub(crate) fn coverage_limit(
        &self,
        step: u32,
        layer: Option<u32>,
        position: u32,
        path: &str,
        level: Level,
    ) -> Option<CoverageLimit> {
        let mut needed = Vec::new();
        for (spec, _, pairs) in self.input_pairs(step, layer, position, path) {
            let r_lacks = pairs.iter().any(|p| p.r.is_none());
            let c_lacks = pairs.iter().any(|p| p.c.is_none());
            let capture_only =
                producer(&spec.path).is_some_and(|c| c.spec().presence == Presence::CaptureOnly);
            let (missing_in, lacking) = match (r_lacks, c_lacks) {
                (false, true) => ("candidate", self.s.c),
                (true, false) if !capture_only => ("reference", self.s.r),
                _ => continue,
            };
            let held = pairs.iter().filter(|p| p.r.is_some() != p.c.is_some()).count() as u64;
            let stem = spec.path.trim_end_matches('.');
            let probe = if spec.prefix {
                format!("{stem}.*")
            } else {
                spec.path.clone()
            };
            needed.push(NeededRecord {
                record: describe_input(&spec),
                missing_in: missing_in.into(),
                held_by_other: held,
                reason: not_captured_reason(lacking, &spec.path)
                    .or_else(|| not_captured_reason(lacking, &probe)),
            });
        }
        (!needed.is_empty()).then(|| CoverageLimit {
            finest_level: level.to_string(),
            needed,
        })
    }
}

/// `the candidate did not capture attn.window_read (layer 0)` for the needed records, grouped by side.
pub(crate) fn needed_words(c: &CoverageLimit) -> String {
    let mut parts = Vec::new();
    for side in ["candidate", "reference"] {
        let recs: Vec<&str> = c
            .needed
            .iter()
            .filter(|n| n.missing_in == side)
            .map(|n| n.record.as_str())
            .collect();
        if !recs.is_empty() {
            parts.push(format!("the {side} did not capture {}", recs.join(", ")));
        }
    }
    parts.join("; ")
}
