//! `moeconf import DIR -o TRACE`: a canonical trace from a backend's tensor
//! dumps (the library side is `moeconf_schema::import`; docs/import.md).

use crate::output::check_output;
use moeconf_fingerprint::CanonPolicy;
use moeconf_output::Inputs;
use moeconf_schema::import::{import, parse_payloads, ImportOptions};
use moeconf_schema::inspect::human_bytes;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `moeconf import`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  moeconf import dumps/ -o cand.bin\n  moeconf import dumps/ --manifest dumps/manifest.json --payloads L1,L3 -o cand.bin\n\nNaming convention and manifest: docs/import.md"
)]
pub struct ImportArgs {
    /// Dump directory: `manifest.json` and `*.safetensors` files with tensors
    /// named `step.{t}.pos.{p}[.layer.{i}].{component}` (docs/import.md).
    pub input: PathBuf,
    /// Output trace file, written atomically. Checked before anything is read: its directory must
    /// exist, and it must not be a directory, FIFO, device, socket, symbolic link, or the same file
    /// as an input (a dump file, the manifest, the model directory's files or tokenizer file the
    /// manifest names).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Manifest file (default: DIR/manifest.json); relative paths inside it
    /// are resolved against its own directory.
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Digest algorithm of the trace.
    #[arg(long, default_value = "blake3", value_parser = ["blake3", "sha256"])]
    pub digest: String,
    /// Fold -0.0 to +0.0 before hashing (recorded in the binding).
    #[arg(long)]
    pub fold_negative_zero: bool,
    /// Levels whose records keep their tensor bytes: all, none, or a list such
    /// as L0,L1,L3. Records of at most 256 bytes always keep theirs.
    #[arg(long, default_value = "all")]
    pub payloads: String,
}

/// Runs `moeconf import`.
pub fn run(a: &ImportArgs) -> anyhow::Result<ExitCode> {
    let algorithm = crate::args::algorithm(&a.digest)?;
    // The dump and the manifest now; the import adds the files the manifest names.
    let mut inputs = Inputs::new();
    inputs.dir_files(&a.input, "dump file");
    inputs.file(
        &a.manifest
            .clone()
            .unwrap_or_else(|| a.input.join("manifest.json")),
        "manifest",
    );
    check_output(&a.output, &inputs)?;
    let payload_levels = parse_payloads(&a.payloads).map_err(|m| anyhow::anyhow!("--payloads: {m}"))?;
    let s = import(&ImportOptions {
        input: a.input.clone(),
        output: a.output.clone(),
        manifest: a.manifest.clone(),
        algorithm,
        canon: CanonPolicy {
            fold_negative_zero: a.fold_negative_zero,
        },
        payload_levels,
    })?;
    eprintln!(
        "wrote {} ({}, {} records, {} with payloads), root {}",
        a.output.display(),
        human_bytes(s.bytes),
        s.records,
        s.payloads,
        s.root
    );
    Ok(ExitCode::SUCCESS)
}
