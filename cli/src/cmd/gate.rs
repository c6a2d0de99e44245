//! `moeconf gate`: CI gate (part 6); being written.

use std::process::ExitCode;

/// Arguments of `moeconf gate`.
#[derive(Debug, clap::Args)]
pub struct GateArgs {
    /// Input path.
    pub input: Option<std::path::PathBuf>,
}

pub fn run(a: &GateArgs) -> anyhow::Result<ExitCode> {
    let _ = &a.input;
    anyhow::bail!("gate: not available in this build yet")
}
