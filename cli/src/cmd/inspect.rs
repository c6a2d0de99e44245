//! `moeconf inspect`: what a trace is of and what it holds (the rendering
//! is `moeconf_schema::inspect`).

use crate::args::Format;
use clap::Args;
use moeconf_schema::inspect::{InspectOptions, Inspection};
use moeconf_schema::Trace;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

/// `moeconf inspect`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  moeconf inspect ref.bin\n  moeconf inspect ref.bin --format json > ref.json"
)]
pub struct InspectArgs {
    /// The trace file.
    pub trace: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Skip re-hashing payloads (faster on very large traces; header, index,
    /// checksum and root are still verified).
    #[arg(long)]
    pub no_verify: bool,
    /// Also list every weight tensor digest of the model binding.
    #[arg(long)]
    pub tensors: bool,
}

/// Runs `moeconf inspect`.
pub fn run(a: &InspectArgs) -> anyhow::Result<ExitCode> {
    let t = Trace::open(&a.trace)?;
    let opts = InspectOptions {
        verify_payloads: !a.no_verify,
        list_tensors: a.tensors,
    };
    let inspection = Inspection::new(&t, opts)?;
    // Streamed: memory stays proportional to the summary, not to the
    // tensor list or the report's length.
    let mut out = BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    match a.format {
        Format::Json => inspection.write_json(&mut out)?,
        Format::Text => inspection.write_text(&mut out)?,
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}
