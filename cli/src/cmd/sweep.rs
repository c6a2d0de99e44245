//! `moeconf sweep`: trace-freeze-fork sweep (part 3); being written.

use std::process::ExitCode;

/// Arguments of `moeconf sweep`.
#[derive(Debug, clap::Args)]
pub struct SweepArgs {
    /// Input path.
    pub input: Option<std::path::PathBuf>,
}

pub fn run(a: &SweepArgs) -> anyhow::Result<ExitCode> {
    let _ = &a.input;
    anyhow::bail!("sweep: not available in this build yet")
}
