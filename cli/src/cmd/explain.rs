//! `moeconf explain`: which combine contract one trace's backend implements
//! (the logic is `moeconf_bisect::explain_trace`).
//!
//! Exit codes: 0 explained or reported (including events no grammar member
//! reproduces, which the report names), 2 error (missing records or
//! payloads, named in the message).

use crate::args::Format;
use crate::output::{print_json_with, print_text};
use clap::Args;
use moeconf_bisect::explain_trace;
use moeconf_schema::Trace;
use std::path::PathBuf;
use std::process::ExitCode;

/// `moeconf explain`.
#[derive(Debug, Args)]
#[command(
    after_help = "Needs f32 (or bf16) payloads of moe.term.*, moe.shared and moe.combine (moeconf run --capture all); router.topk and router.gates payloads, where recorded, let it name expert-id and gate orders.\n\nExit codes: 0 explained or reported, 2 error.\n\nExamples:\n  moeconf run --prompt \"why the sheep\" --capture all -o trace.bin\n  moeconf explain trace.bin\n  moeconf explain trace.bin --format json > explain.json"
)]
pub struct ExplainArgs {
    /// The trace file.
    pub trace: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// Runs `moeconf explain`.
pub fn run(a: &ExplainArgs) -> anyhow::Result<ExitCode> {
    // Every payload is re-hashed first (as for diff and gate).
    let t = Trace::open_verified(&a.trace)?;
    let report = explain_trace(&t, &a.trace.display().to_string())?;
    match a.format {
        Format::Json => print_json_with(|w| report.write_json_pretty(w))?,
        Format::Text => print_text(&report.render_text())?,
    }
    Ok(ExitCode::SUCCESS)
}
