//! `moeconf diff`: L0–L4 bisection of two traces (the `moeconf-bisect` walk).
//!
//! Exit codes: 0 equivalent, 1 divergent, 2 error (including traces that are
//! not comparable, reported with every differing binding field, and a trace
//! that lacks steps of its run unless `--allow-incomplete`).

use crate::args::Format;
use crate::output::check_output;
use crate::output::print_json;
use anyhow::Context;
use moeconf_bisect::{diff, open_pair_with, DiffOptions};
use moeconf_output::Inputs;
use moeconf_schema::Verification;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

/// When to color the text report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ColorChoice {
    /// Only on a terminal and when `NO_COLOR` is unset or empty.
    Auto,
    /// Always (ANSI escapes even into files).
    Always,
    /// Never.
    Never,
}

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

impl DiffArgs {
    /// Default options for comparing `reference` and `candidate` (used by `moeconf demo`).
    pub fn new(reference: PathBuf, candidate: PathBuf, format: Format) -> DiffArgs {
        DiffArgs {
            reference,
            candidate,
            format,
            force: false,
            no_contract_inference: false,
            color: ColorChoice::Auto,
            html: None,
            verify_all: false,
            allow_incomplete: false,
        }
    }
}

/// Whether to color: `auto` means stdout is a terminal and `NO_COLOR` is
/// unset or empty (https://no-color.org).
fn use_color(choice: ColorChoice, is_tty: bool, no_color: Option<std::ffi::OsString>) -> bool {
    match choice {
        ColorChoice::Always => true,
        ColorChoice::Never => false,
        ColorChoice::Auto => is_tty && no_color.is_none_or(|v| v.is_empty()),
    }
}

/// Runs `moeconf diff`.
pub fn run(a: &DiffArgs) -> anyhow::Result<ExitCode> {
    let html = match &a.html {
        Some(p) => {
            let mut inputs = Inputs::new();
            inputs.file(&a.reference, "reference trace");
            inputs.file(&a.candidate, "candidate trace");
            Some(check_output(p, &inputs)?)
        }
        None => None,
    };
    let verification = if a.verify_all {
        Verification::Full
    } else {
        Verification::OnUse
    };
    let (reference, candidate) = open_pair_with(&a.reference, &a.candidate, verification)?;
    let incomplete: Vec<String> = [&reference, &candidate]
        .into_iter()
        .filter_map(super::complete::describe)
        .collect();
    super::complete::require(&incomplete, a.allow_incomplete, "not compared")?;
    let opts = DiffOptions {
        force: a.force,
        contract_inference: !a.no_contract_inference,
    };
    let report = diff(&reference, &candidate, &opts)
        .with_context(|| format!("diff {} {}", a.reference.display(), a.candidate.display()))?;
    match a.format {
        Format::Json => print_json(&report.to_json())?,
        Format::Text => {
            let color = use_color(
                a.color,
                std::io::stdout().is_terminal(),
                std::env::var_os("NO_COLOR"),
            );
            let mut out = std::io::stdout().lock();
            out.write_all(report.render_text(color).as_bytes())?;
            out.flush()?;
        }
    }
    if let Some(out) = &html {
        let page = moeconf_report::render_diff(&reference, &candidate, &report, None)?;
        moeconf_output::write_checked(out, page.as_bytes())
            .with_context(|| format!("writing the HTML report {}", out.path().display()))?;
    }
    Ok(ExitCode::from(report.exit_code()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn color_only_on_a_terminal_without_no_color() {
        assert!(use_color(ColorChoice::Auto, true, None));
        assert!(use_color(ColorChoice::Auto, true, Some("".into())));
        assert!(!use_color(ColorChoice::Auto, true, Some("1".into())));
        assert!(!use_color(ColorChoice::Auto, false, None));
        assert!(use_color(ColorChoice::Always, false, Some("1".into())));
        assert!(!use_color(ColorChoice::Never, true, None));
    }
}
