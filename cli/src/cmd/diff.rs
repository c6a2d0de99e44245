//! `moeconf diff`: L0–L4 bisection of two traces (the `moeconf-bisect` walk).
//!
//! Exit codes: 0 equivalent, 1 divergent, 2 error (including traces that are
//! not comparable, reported with every differing binding field, and a trace
//! that lacks steps of its run unless `--allow-incomplete`).

use crate::args::Format;
use crate::compare::{run_diff, ColorChoice, DiffJob};
use moeconf_schema::Verification;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `moeconf diff`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Exit codes: 0 equivalent, 1 divergent, 2 error (including traces that are not comparable, and a trace \
without every step of its run unless --allow-incomplete).\n\nExamples:\n  moeconf diff ref.bin cand.bin\n  moeconf diff ref.bin cand.bin --format json > report.json\n  moeconf diff ref.bin cand.bin --html report.html   # layers x steps heatmaps, margins, |delta| histogram"
)]
pub struct DiffArgs {
    /// The reference trace.
    pub reference: PathBuf,
    /// The candidate trace.
    pub candidate: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Compare even when the bindings name a different model, tokenizer,
    /// prompt or decoding configuration (the differences are reported).
    #[arg(long)]
    pub force: bool,
    /// Skip contract inference at a divergent moe.combine.
    #[arg(long)]
    pub no_contract_inference: bool,
    /// Colors in the text report.
    #[arg(long, value_enum, default_value_t = ColorChoice::Auto)]
    pub color: ColorChoice,
    /// Also write a self-contained HTML report (no scripts, no network):
    /// the verdict, the L3 layer × step heatmaps with route changes and
    /// absorbed/propagating divergences, L2 state, both sides' margins and
    /// the localized operator's |Δ| histogram. Written atomically; refused
    /// when it names an input or a non-regular file.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Verify every byte of both traces before comparing, not only what the
    /// report reads (version 2 traces are otherwise verified node by node
    /// and payload by payload as the comparison reads them, so the cost
    /// follows the divergent path; version 1 traces are always verified in
    /// full).
    #[arg(long)]
    pub verify_all: bool,
    /// Compare even when a trace lacks steps of its run (fewer than the
    /// binding's max_new_tokens); the report then says `incomplete: k of n
    /// steps`. Without it, an incomplete trace is an error (exit 2).
    #[arg(long)]
    pub allow_incomplete: bool,
}

/// Runs `moeconf diff`.
pub fn run(a: &DiffArgs) -> anyhow::Result<ExitCode> {
    run_diff(&DiffJob {
        reference: a.reference.clone(),
        candidate: a.candidate.clone(),
        format: a.format,
        force: a.force,
        contract_inference: !a.no_contract_inference,
        color: a.color,
        html: a.html.clone(),
        verification: if a.verify_all {
            Verification::Full
        } else {
            Verification::OnUse
        },
        allow_incomplete: a.allow_incomplete,
    })
}
