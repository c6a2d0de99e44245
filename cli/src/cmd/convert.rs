//! `moeconf convert IN -o OUT [--to 1|2|3|4]`: the same trace in another
//! container format version (the library side is `moeconf_schema::convert`).

use crate::output::check_output;
use moeconf_output::Inputs;
use moeconf_schema::inspect::human_bytes;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `moeconf convert`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "The root digest does not change: every version stores the same records and the same hash tree.\n\nExamples:\n  moeconf convert ref.bin -o ref-v1.bin --to 1     # for readers that only know version 1\n  moeconf convert ref-v1.bin -o ref-v2.bin --to 2  # for readers that know versions 1 and 2\n  moeconf convert ref-v2.bin -o ref-v3.bin --to 3  # to version 3 (levels committed in the root block)\n  moeconf convert ref-v3.bin -o ref-v4.bin         # to version 4 (large groups paged)"
)]
pub struct ConvertArgs {
    /// The trace to convert (verified in full before anything is written).
    pub input: PathBuf,
    /// Output trace file, written atomically. Checked before the input is read: its directory must
    /// exist, and it must not be a directory, FIFO, device, socket, symbolic link, or the input
    /// itself (by name or hard link).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Container format version to write: 4 (version 3 with every layer group longer than a page
    /// stored as pages, so that a comparison reads only the pages that differ; the default of the
    /// Rust writers), 3 (persisted tree nodes with each step's levels committed in the root block),
    /// 2 (persisted tree nodes: a step's levels are read from its block) or 1 (a flat index).
    #[arg(long, default_value_t = moeconf_schema::DEFAULT_FORMAT_VERSION, value_parser = clap::value_parser!(u32).range(1..=4))]
    pub to: u32,
}

/// Runs `moeconf convert`.
pub fn run(a: &ConvertArgs) -> anyhow::Result<ExitCode> {
    let mut inputs = Inputs::new();
    inputs.file(&a.input, "input trace");
    let out = check_output(&a.output, &inputs)?;
    let s = moeconf_schema::convert::convert(&a.input, &out, a.to)?;
    eprintln!(
        "wrote {} (format version {} from {}, {}, {} records, {} with payloads), root {} (unchanged){}",
        a.output.display(),
        s.to,
        s.from,
        human_bytes(s.written.bytes),
        s.written.records,
        s.written.payloads,
        s.root,
        if s.reordered {
            "; records put in step order (versions 2, 3 and 4 take them step by step)"
        } else {
            ""
        }
    );
    Ok(ExitCode::SUCCESS)
}
