//! `moeconf import`: safetensors import (part 7); being written.

use std::process::ExitCode;

/// Arguments of `moeconf import`.
#[derive(Debug, clap::Args)]
pub struct ImportArgs {
    /// Input path.
    pub input: Option<std::path::PathBuf>,
}

pub fn run(a: &ImportArgs) -> anyhow::Result<ExitCode> {
    let _ = &a.input;
    anyhow::bail!("import: not available in this build yet")
}
