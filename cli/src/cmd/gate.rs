//! `moeconf gate`: CI gate for kernel changes (docs/ci.md).
//!
//! Judges a candidate trace against a reference trace, or against blessed
//! fingerprints (`--baseline`), under a reviewed policy (`moeconf.toml`),
//! and reports in text, JSON, JUnit XML or Markdown.
//!
//! Exit codes: 0 pass, 1 fail (including a candidate that lacks a required
//! level, a step or a record: docs/ci.md §2 "Coverage"), 2 error (also a
//! reference or baseline that cannot gate: empty, without a required level,
//! a binding that does not match; and a side that lacks steps of its run
//! unless `--allow-incomplete`). With `--bisect-exit-codes` (for
//! `git bisect run`): 0 good, 1 bad, 125 skip (the candidate trace is missing,
//! unreadable or incomplete, so this commit cannot be tested), 128 for any other error
//! (a broken policy or reference aborts the bisection instead of marking
//! every commit bad).

use anyhow::Context;
use moeconf_gate::baseline::Baseline;
use moeconf_gate::policy::{self, Overrides};
use moeconf_gate::{
    against_baseline_with, against_reference_run, report_junit, report_md, write_checked, FileKind,
    GateError, GateReport,
};
use moeconf_output::{CheckedOutput, Inputs};
use moeconf_schema::{Trace, Verification};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::output::check_outputs;
use std::process::ExitCode;

/// Report format of `moeconf gate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GateFormat {
    /// Human-readable text, summary line last.
    Text,
    /// One JSON document (`schema_version`, `kind: moeconf.gate`).
    Json,
    /// JUnit XML: one test case per level and per failing rule.
    Junit,
    /// Markdown for pull-request comments and `$GITHUB_STEP_SUMMARY`.
    Md,
}

/// Arguments of `moeconf gate`.
#[derive(Debug, clap::Args)]
pub struct GateArgs {
    /// REFERENCE CANDIDATE, or only CANDIDATE with --baseline.
    #[arg(required = true, num_args = 1..=2, value_name = "TRACE")]
    pub traces: Vec<PathBuf>,
    /// Policy file (default: moeconf.toml at the repository root; env MOECONF_POLICY).
    #[arg(long, value_name = "FILE")]
    pub policy: Option<PathBuf>,
    /// Profile of the policy (`[profile.NAME]`; built in: default, strict; env MOECONF_PROFILE).
    #[arg(long, value_name = "NAME")]
    pub profile: Option<String>,
    /// Report format on stdout (env MOECONF_FORMAT).
    #[arg(long, value_enum)]
    pub format: Option<GateFormat>,
    /// Also write the report (in --format) to this file. Every output file (--output, --junit, the
    /// --bless baseline) is checked before the traces are read: its directory must exist, and it
    /// must not be a directory, FIFO, device, socket, symbolic link, an input (a trace, the policy,
    /// a baseline being read) or another output; it is written atomically with mode 0666 & !umask.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Also write a JUnit XML report to this file.
    #[arg(long, value_name = "FILE")]
    pub junit: Option<PathBuf>,
    /// Also write a self-contained HTML report: the gate verdict above the diff's pictures
    /// (layer x step heatmaps, margins, the localized operator). Against a baseline (digests
    /// only) the page holds the verdict without pictures.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Override a level's mode, e.g. --level L2=info (repeatable; env MOECONF_LEVELS=L2=info,L4=info).
    #[arg(long, value_name = "LEVEL=MODE")]
    pub level: Vec<String>,
    /// Whether both-NaN elements pass (env MOECONF_EQUAL_NAN).
    #[arg(long, value_name = "BOOL")]
    pub equal_nan: Option<bool>,
    /// Route flips whose reference router.margin is below this are near-ties (0 disables).
    #[arg(long, value_name = "MARGIN")]
    pub route_near_tie_margin: Option<f64>,
    /// Token/argmax flips whose reference lm.margin is below this are near-ties (0 disables).
    #[arg(long, value_name = "MARGIN")]
    pub argmax_near_tie_margin: Option<f64>,
    /// Levels both sides must hold: L0..L4, judged, reference, comma-separated, or none
    /// (env MOECONF_REQUIRED; default L0,L1,judged, strict: reference).
    #[arg(long, value_name = "LIST")]
    pub required: Option<String>,
    /// Compare even when the bindings (of the traces, or of the baseline and the candidate) name a
    /// different model, tokenizer, prompt or decoding configuration (noted in the report).
    #[arg(long)]
    pub force: bool,
    /// Blessed fingerprints: compare the candidate with them, or write them with --bless.
    #[arg(long, value_name = "FILE")]
    pub baseline: Option<PathBuf>,
    /// Record the candidate's fingerprints as the accepted baseline (review the file's diff, then commit).
    #[arg(long, requires = "baseline")]
    pub bless: bool,
    /// Verify every byte of both traces before judging, not only what the
    /// verdict reads (version 2 traces are otherwise verified node by node
    /// and payload by payload as the gate reads them; version 1 traces and
    /// --bless always verify every byte).
    #[arg(long)]
    pub verify_all: bool,
    /// Exit codes for `git bisect run`: 0 good, 1 bad, 125 skip (candidate unreadable or incomplete),
    /// 128 other errors.
    #[arg(long)]
    pub bisect_exit_codes: bool,
    /// Judge (or bless) even when a trace or the baseline lacks steps of its run (fewer than the
    /// binding's max_new_tokens); the report then says `incomplete: k of n steps`. Without it an
    /// incomplete side is an error (exit 2), not a verdict.
    #[arg(long)]
    pub allow_incomplete: bool,
}

/// An error with the exit code it maps to under `--bisect-exit-codes`.
struct Failed {
    err: anyhow::Error,
    /// The candidate cannot be tested: `git bisect run` skips the commit.
    skip: bool,
}

/// Any error but an unreadable candidate: the setup is broken.
fn setup(err: impl Into<anyhow::Error>) -> Failed {
    Failed {
        err: err.into(),
        skip: false,
    }
}

impl From<GateError> for Failed {
    fn from(e: GateError) -> Failed {
        Failed {
            skip: e.is_candidate_unreadable(),
            err: e.into(),
        }
    }
}

/// The overrides given on the command line.
fn cli_overrides(a: &GateArgs) -> anyhow::Result<Overrides> {
    Ok(Overrides {
        policy: a.policy.clone(),
        profile: a.profile.clone(),
        levels: a
            .level
            .iter()
            .map(|s| policy::parse_level_mode(s).with_context(|| format!("--level {s}")))
            .collect::<anyhow::Result<_>>()?,
        equal_nan: a.equal_nan,
        route_near_tie_margin: a.route_near_tie_margin,
        argmax_near_tie_margin: a.argmax_near_tie_margin,
        required: a
            .required
            .as_deref()
            .map(|r| policy::Requirement::parse_list(r).with_context(|| format!("--required {r}")))
            .transpose()?,
    })
}

/// `--format`, else `MOECONF_FORMAT`, else text.
fn format_of(flag: Option<GateFormat>, env: Option<String>) -> anyhow::Result<GateFormat> {
    if let Some(f) = flag {
        return Ok(f);
    }
    match env.as_deref().filter(|v| !v.is_empty()) {
        None => Ok(GateFormat::Text),
        Some(v) => <GateFormat as clap::ValueEnum>::from_str(v, true)
            .map_err(|_| anyhow::anyhow!("MOECONF_FORMAT={v:?}: expected text, json, junit or md")),
    }
}

fn render(r: &GateReport, f: GateFormat) -> anyhow::Result<String> {
    Ok(match f {
        GateFormat::Text => r.render_text(),
        GateFormat::Json => {
            let mut s = serde_json::to_string_pretty(&r.to_json())?;
            s.push('\n');
            s
        }
        GateFormat::Junit => report_junit::render(r),
        GateFormat::Md => report_md::render(r),
    })
}

/// The reference and candidate traces given: `(None, candidate)` with `--baseline`.
fn traces(a: &GateArgs) -> anyhow::Result<(Option<&PathBuf>, &PathBuf)> {
    match (a.traces.as_slice(), &a.baseline) {
        ([c], Some(_)) => Ok((None, c)),
        ([r, c], None) => Ok((Some(r), c)),
        ([_, _], Some(_)) => {
            anyhow::bail!("give either REFERENCE CANDIDATE or --baseline FILE CANDIDATE, not both")
        }
        _ => {
            anyhow::bail!("one trace given: add the reference trace (REFERENCE CANDIDATE) or --baseline FILE")
        }
    }
}

/// Checks every output (`--output`, `--junit`, the baseline `--bless`
/// writes) before any work: see `moeconf_output`. The inputs are the
/// traces, the policy file and a baseline being read.
fn check_gate_outputs(
    a: &GateArgs,
    traces: (Option<&PathBuf>, &PathBuf),
    policy: &policy::Source,
) -> anyhow::Result<GateOutputs> {
    let mut inputs = Inputs::new();
    if let Some(r) = traces.0 {
        inputs.file(r, "reference trace");
    }
    inputs.file(traces.1, "candidate trace");
    if let policy::Source::File(p) = policy {
        inputs.file(p, "policy file");
    }
    let baseline = a.baseline.as_ref().filter(|_| a.bless);
    if let (Some(b), false) = (&a.baseline, a.bless) {
        inputs.file(b, "baseline");
    }
    let paths: Vec<&Path> = [
        a.output.as_deref(),
        a.junit.as_deref(),
        a.html.as_deref(),
        baseline.map(|b| b.as_path()),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut checked = check_outputs(&paths, &inputs)?.into_iter();
    let mut next = |given: bool| if given { checked.next() } else { None };
    Ok(GateOutputs {
        output: next(a.output.is_some()),
        junit: next(a.junit.is_some()),
        html: next(a.html.is_some()),
        baseline: next(baseline.is_some()),
    })
}

/// The checked output files of one gate run.
struct GateOutputs {
    output: Option<CheckedOutput>,
    junit: Option<CheckedOutput>,
    html: Option<CheckedOutput>,
    baseline: Option<CheckedOutput>,
}

/// `--bless`: records the candidate's fingerprints in `out` and says what changed.
fn bless(candidate: &Trace, out: &CheckedOutput) -> Result<(), GateError> {
    let file = out.path();
    let previous = Baseline::blessed_root(file);
    let b = Baseline::of(candidate)?;
    write_checked(out, b.text(file)?.as_bytes(), FileKind::Baseline)?;
    println!(
        "blessed {} into {}: {} steps, root {}{}\nreview the change with `git diff {}` and commit it",
        candidate.path().display(),
        file.display(),
        b.steps.len(),
        b.root,
        match previous {
            Some(p) if p == b.root => " (unchanged)".to_string(),
            Some(p) => format!(" (was {p})"),
            None => " (new baseline)".to_string(),
        },
        file.display()
    );
    Ok(())
}

fn gate(a: &GateArgs) -> Result<u8, Failed> {
    let env = |k: &str| std::env::var(k).ok();
    let overrides = cli_overrides(a)
        .and_then(|cli| Ok(cli.over(Overrides::from_env(env)?)))
        .map_err(setup)?;
    let format = format_of(a.format, env("MOECONF_FORMAT")).map_err(setup)?;
    let cwd = std::env::current_dir()
        .context("current directory")
        .map_err(setup)?;
    let (profile, source) = policy::resolve(&overrides, &cwd)?;
    let (reference, candidate) = traces(a).map_err(setup)?;
    if a.bless && reference.is_some() {
        return Err(setup(anyhow::anyhow!(
            "--bless records one candidate: give only CANDIDATE"
        )));
    }
    let outputs = check_gate_outputs(a, (reference, candidate), &source).map_err(setup)?;
    // What is judged is verified before it is used (every byte with
    // --verify-all, of a version 1 trace, and before blessing).
    let verification = if a.verify_all || a.bless {
        Verification::Full
    } else {
        Verification::OnUse
    };
    let cand = Trace::open_for(candidate, verification).map_err(GateError::Candidate)?;
    // Against a reference: the reference and the diff the gate computed,
    // for the HTML page (drawn from them, not computed again).
    let mut drawn: Option<(Trace, Option<moeconf_bisect::DiffReport>)> = None;
    let mut report = match (reference, &a.baseline) {
        (_, Some(_)) if a.bless => {
            let out = outputs
                .baseline
                .as_ref()
                .context("--bless needs --baseline")
                .map_err(setup)?;
            let incomplete: Vec<String> = crate::complete::describe(&cand).into_iter().collect();
            crate::complete::require(&incomplete, a.allow_incomplete, "not blessed")
                .map_err(|err| Failed { err, skip: true })?;
            bless(&cand, out)?;
            return Ok(0);
        }
        (None, Some(file)) => against_baseline_with(file, &cand, &profile, a.force, verification)?,
        (Some(rp), _) => {
            let run = against_reference_run(rp, &cand, &profile, a.force, verification)?;
            drawn = Some((run.reference, run.diff));
            run.report
        }
        (None, None) => return Err(setup(anyhow::anyhow!("nothing to compare against"))),
    };
    require_complete(&report, a.allow_incomplete)?;
    report.policy_source = source.describe();
    emit(&report, format, &outputs, drawn, &cand, a.force)?;
    Ok(report.exit_code())
}

/// A side without every step of its run: not a verdict (the candidate's
/// makes the commit untestable under `git bisect run`), unless `allow`.
fn require_complete(report: &GateReport, allow: bool) -> Result<(), Failed> {
    let incomplete: Vec<String> = report
        .incomplete
        .iter()
        .map(|i| report.incomplete_file(i))
        .collect();
    crate::complete::require(&incomplete, allow, "not a verdict").map_err(|err| Failed {
        err,
        skip: report.candidate_incomplete(),
    })
}

/// Prints the verdict in `format` and writes the files asked for: the
/// report, JUnit XML, the HTML page (drawn from the diff the gate computed,
/// `drawn`, against a reference trace).
fn emit(
    report: &GateReport,
    format: GateFormat,
    outputs: &GateOutputs,
    drawn: Option<(Trace, Option<moeconf_bisect::DiffReport>)>,
    cand: &Trace,
    force: bool,
) -> Result<(), Failed> {
    let text = render(report, format).map_err(setup)?;
    {
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())
            .and_then(|_| out.flush())
            .map_err(setup)?;
    }
    if let Some(out) = &outputs.output {
        write_checked(out, text.as_bytes(), FileKind::Report)?;
    }
    if let Some(out) = &outputs.junit {
        write_checked(out, report_junit::render(report).as_bytes(), FileKind::Report)?;
    }
    if let Some(out) = &outputs.html {
        let page = html_page(report, drawn, cand, force).map_err(setup)?;
        write_checked(out, page.as_bytes(), FileKind::Report)?;
    }
    Ok(())
}

/// The HTML page of a gate run: the verdict and, against a reference
/// trace, the diff's pictures.
fn html_page(
    report: &GateReport,
    drawn: Option<(Trace, Option<moeconf_bisect::DiffReport>)>,
    cand: &Trace,
    force: bool,
) -> anyhow::Result<String> {
    let summary = moeconf_report::GateSummary {
        verdict: report.verdict.label().into(),
        policy: report.policy_source.clone(),
        lines: render(report, GateFormat::Text)?
            .lines()
            .map(String::from)
            .collect(),
    };
    let Some((r, d)) = drawn else {
        return Ok(moeconf_report::render_gate_only(&summary));
    };
    let d = match d {
        Some(d) => d,
        // No level in common: the diff's own error, as the page cannot be drawn.
        None => moeconf_bisect::diff(
            &r,
            cand,
            &moeconf_bisect::DiffOptions {
                force,
                contract_inference: true,
            },
        )?,
    };
    Ok(moeconf_report::render_diff(&r, cand, &d, Some(&summary))?)
}

/// Runs `moeconf gate`.
pub fn run(a: &GateArgs) -> anyhow::Result<ExitCode> {
    match gate(a) {
        Ok(code) => Ok(ExitCode::from(code)),
        Err(f) if a.bisect_exit_codes => {
            let msg = crate::args::render_error(&f.err);
            eprintln!("moeconf: {}", moeconf_output::escape::multiline(&msg));
            Ok(ExitCode::from(if f.skip { 125 } else { 128 }))
        }
        Err(f) => Err(f.err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_precedence() {
        assert_eq!(
            format_of(Some(GateFormat::Md), Some("json".into())).unwrap(),
            GateFormat::Md
        );
        assert_eq!(format_of(None, Some("junit".into())).unwrap(), GateFormat::Junit);
        assert_eq!(format_of(None, Some("".into())).unwrap(), GateFormat::Text);
        assert_eq!(format_of(None, None).unwrap(), GateFormat::Text);
        assert!(format_of(None, Some("xml".into())).is_err());
    }
}
