//! `moeconf certify`: exactness certificate (part 3); being written.

use std::process::ExitCode;

/// Arguments of `moeconf certify`.
#[derive(Debug, clap::Args)]
pub struct CertifyArgs {
    /// Input path.
    pub input: Option<std::path::PathBuf>,
}

pub fn run(a: &CertifyArgs) -> anyhow::Result<ExitCode> {
    let _ = &a.input;
    anyhow::bail!("certify: not available in this build yet")
}
