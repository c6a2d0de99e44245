//! Rewriting a trace in another container format version (`moeconf
//! convert`): the same records, payloads, binding and provenance, hence the
//! same root digest, stored as version 1 (a flat index) or version 2
//! (persisted tree nodes, docs/format.md §11).
//!
//! The input is verified in full first, so nothing unverified is carried
//! over; every payload is hashed again on its way into the output and must
//! give its record's digest, and the output's root must be the input's.

use crate::error::TraceError;
use crate::layout::Header;
use crate::writer::{TraceWriter, WriteSummary};
use crate::Trace;
use moeconf_fingerprint::Digest;
use moeconf_output::CheckedOutput;
use std::path::Path;

/// What [`convert`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvertSummary {
    /// The input's container format version.
    pub from: u32,
    /// The output's.
    pub to: u32,
    /// Root digest of both (they are equal by construction and checked).
    pub root: Digest,
    /// Whether the records had to be put in step order (a version 1 input
    /// whose write order goes back to an earlier step; version 2 takes
    /// records step by step). Write order within each step is kept.
    pub reordered: bool,
    /// What the writer wrote.
    pub written: WriteSummary,
}

/// Writes the trace at `input` to `output` in container format `version`
/// (1, 2, 3 or 4). `output` must have been checked against `input`
/// ([`moeconf_output::check_output`] with the input among its inputs).
pub fn convert(input: &Path, output: &CheckedOutput, version: u32) -> Result<ConvertSummary, TraceError> {
    let src = Trace::open_verified(input)?;
    let records = src.records()?;
    let mut order: Vec<usize> = (0..records.len()).collect();
    let in_step_order = records.windows(2).all(|w| w[0].coord.step <= w[1].coord.step);
    if crate::v2::is_block_format(version) && !in_step_order {
        order.sort_by_key(|&i| records[i].coord.step);
    }
    let header = Header {
        binding: src.binding().clone(),
        provenance: src.provenance().clone(),
    };
    let mut w = TraceWriter::create_version(output, src.algorithm(), header, version)?;
    for &i in &order {
        w.append_from(&src, i)?;
    }
    let written = w.finish()?;
    if written.root != src.root() {
        // Not reached: the records and the binding are the input's.
        let _ = std::fs::remove_file(output.path());
        return Err(TraceError::invalid(
            output.path(),
            format!(
                "the converted trace's root {} is not the input's {}; removed",
                written.root,
                src.root()
            ),
        ));
    }
    Ok(ConvertSummary {
        from: src.format_version(),
        to: version,
        root: written.root,
        reordered: crate::v2::is_block_format(version) && !in_step_order,
        written,
    })
}
