//! Comparing two traces and printing the report: the work of `moeconf diff`,
//! which `moeconf demo` runs too.

use crate::args::Format;
use crate::output::{check_output, print_json};
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

/// One comparison and where its report goes.
#[derive(Debug, Clone)]
pub struct DiffJob {
    /// The reference trace.
    pub reference: PathBuf,
    /// The candidate trace.
    pub candidate: PathBuf,
    /// The report's format on stdout.
    pub format: Format,
    /// Compare traces whose bindings differ (the differences are reported).
    pub force: bool,
    /// Infer the contracts at a divergent `moe.combine`.
    pub contract_inference: bool,
    /// Colors of the text report.
    pub color: ColorChoice,
    /// Where to write the HTML report too.
    pub html: Option<PathBuf>,
    /// Verify every byte before comparing, or only what the report reads.
    pub verification: Verification,
    /// Compare traces that lack steps of their run.
    pub allow_incomplete: bool,
}

impl DiffJob {
    /// The default comparison of `reference` and `candidate`.
    pub fn new(reference: PathBuf, candidate: PathBuf, format: Format) -> DiffJob {
        DiffJob {
            reference,
            candidate,
            format,
            force: false,
            contract_inference: true,
            color: ColorChoice::Auto,
            html: None,
            verification: Verification::OnUse,
            allow_incomplete: false,
        }
    }
}

/// Whether to color: `auto` means stdout is a terminal and `NO_COLOR` is
/// unset or empty (<https://no-color.org>).
fn use_color(choice: ColorChoice, is_tty: bool, no_color: Option<std::ffi::OsString>) -> bool {
    match choice {
        ColorChoice::Always => true,
        ColorChoice::Never => false,
        ColorChoice::Auto => is_tty && no_color.is_none_or(|v| v.is_empty()),
    }
}

/// Compares, prints the report, writes the HTML page if asked; the exit
/// code is the diff's (0 equivalent, 1 divergent).
pub fn run_diff(job: &DiffJob) -> anyhow::Result<ExitCode> {
    let html = match &job.html {
        Some(p) => {
            let mut inputs = Inputs::new();
            inputs.file(&job.reference, "reference trace");
            inputs.file(&job.candidate, "candidate trace");
            Some(check_output(p, &inputs)?)
        }
        None => None,
    };
    let (reference, candidate) = open_pair_with(&job.reference, &job.candidate, job.verification)?;
    let incomplete: Vec<String> = [&reference, &candidate]
        .into_iter()
        .filter_map(crate::complete::describe)
        .collect();
    crate::complete::require(&incomplete, job.allow_incomplete, "not compared")?;
    let opts = DiffOptions {
        force: job.force,
        contract_inference: job.contract_inference,
    };
    let report = diff(&reference, &candidate, &opts)
        .with_context(|| format!("diff {} {}", job.reference.display(), job.candidate.display()))?;
    match job.format {
        Format::Json => print_json(&report.to_json())?,
        Format::Text => {
            let color = use_color(
                job.color,
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
