//! `moeconf diff`: L0–L4 bisection of two traces (filled in by part 4).

use crate::cli::Format;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `moeconf diff`.
#[derive(Debug, clap::Args)]
pub struct DiffArgs {
    /// The reference trace.
    pub reference: PathBuf,
    /// The candidate trace.
    pub candidate: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

pub fn run(a: &DiffArgs) -> anyhow::Result<ExitCode> {
    let _ = (&a.reference, &a.candidate, a.format);
    anyhow::bail!("diff: not available in this build yet")
}
