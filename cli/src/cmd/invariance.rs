//! `moeconf invariance`: one backend under a matrix of serving
//! configurations, each bisected against the base (docs/invariance.md).

use crate::args::Format;
use crate::output::print_json;
use anyhow::Context;
use moeconf_gate::policy::{self, Overrides};
use moeconf_invariance::matrix::{self, Backend, ReferenceRun, RunOverrides};
use moeconf_invariance::{preset, run_matrix, Expectations, Matrix, RunOptions};
use moeconf_output::{AtomicDir, Inputs};
use moeconf_runner::limits::MAX_PROTOCOL_TOKENS;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

const INVARIANCE_EXAMPLES: &str = "Examples:
  moeconf invariance --preset reference --out inv            # 1/2 threads x batch 1/3 x prefill chunk 1/2/all
  moeconf invariance --preset reference-knobs --prompt \"why the sheep\" --out inv --format json
  moeconf invariance matrix.toml --out inv                   # your matrix (docs/invariance.md §2)
  moeconf invariance matrix.toml --policy policy.toml --out inv    # expectations from its [invariance]

A matrix names a backend (the reference runtime in this process, or any command that writes a
moeconf trace, with {knob} placeholders), a base configuration and the configurations to
compare with it. Each configuration is traced into --out, verified, bisected against the base
and judged by the expectation of the knobs it changes: bitwise (the default), profile:NAME (the
gate passes under that profile of the policy file) or info. The policy file's [invariance]
section overrides the matrix's [expect] table. --out receives base.bin, c01.bin, ... (traces),
c01.html, ... (each configuration's diff page), index.html (the matrix) and invariance.json,
written atomically (the directory is replaced as a whole).

Exit codes: 0 every configuration keeps its expectation, 1 one does not, 2 error (including a
configuration that could not be traced, verified or compared: no verdict is drawn from it).";

/// Arguments of `moeconf invariance`.
#[derive(Debug, clap::Args)]
#[command(after_help = INVARIANCE_EXAMPLES)]
pub struct InvarianceArgs {
    /// The matrix file (TOML, docs/invariance.md §2); or use --preset.
    #[arg(required_unless_present = "preset", conflicts_with = "preset")]
    pub matrix: Option<PathBuf>,
    /// A built-in matrix: reference (the 12-combination matrix of threads × batch × prefill
    /// chunk), reference-knobs (one knob at a time, 6 configurations), or another backend's
    /// (transformers, llamacpp, llamacpp-fa-off, vllm: the matrix files of python/invariance/, which
    /// need --model and the backend's Python environment on PATH as python3).
    #[arg(long)]
    pub preset: Option<String>,
    /// The output directory (created, or replaced when it holds a previous result).
    #[arg(long)]
    pub out: PathBuf,
    /// Model (overrides the matrix's [run] model; presets: builtin:tiny-v4).
    #[arg(long)]
    pub model: Option<String>,
    /// Prompt (overrides the matrix's; presets: "why the sheep").
    #[arg(long)]
    pub prompt: Option<String>,
    /// Tokens generated (overrides the matrix's; presets: 8).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=MAX_PROTOCOL_TOKENS as i64))]
    pub max_new_tokens: Option<u32>,
    /// Precision profile of the reference runtime (overrides the matrix's; default bf16).
    #[arg(long)]
    pub precision: Option<String>,
    /// Policy file whose [invariance] section declares the expectations (default:
    /// moeconf.toml at the repository root, when it exists; MOECONF_POLICY).
    // The text is the option's --help: `[invariance]` is the TOML table, not a link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Report format on stdout.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Do not write a diff page per configuration (index.html still links nothing).
    #[arg(long)]
    pub no_pages: bool,
    /// No progress lines on stderr.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// The matrix the arguments name.
fn matrix_of(a: &InvarianceArgs) -> anyhow::Result<Matrix> {
    let o = RunOverrides {
        model: a.model.clone(),
        prompt: a.prompt.clone(),
        max_new_tokens: a.max_new_tokens,
        precision: a.precision.clone(),
    };
    Ok(match (&a.matrix, &a.preset) {
        (Some(path), _) => matrix::read(path, &o)?,
        (None, Some(name)) if preset::backend_preset(name, &o).is_some() => {
            if o.model.is_none() {
                anyhow::bail!(
                    "--preset {name} needs --model: what its capture loads (python/invariance/{name}.toml says what)"
                );
            }
            preset::backend_preset(name, &o).context("preset")??
        }
        (None, Some(name)) => preset::preset(
            name,
            ReferenceRun {
                model: o.model.unwrap_or_else(|| "builtin:tiny-v4".into()),
                prompt: o.prompt.unwrap_or_else(|| "why the sheep".into()),
                max_new_tokens: o.max_new_tokens.unwrap_or(8),
                precision: o.precision.unwrap_or_else(|| "bf16".into()),
                capture: "all".into(),
            },
        )?,
        (None, None) => anyhow::bail!("give a matrix file or --preset NAME"),
    })
}

/// Runs `moeconf invariance`.
pub fn run(a: &InvarianceArgs) -> anyhow::Result<ExitCode> {
    let m = matrix_of(a)?;
    let env = |k: &str| std::env::var(k).ok();
    let overrides = Overrides {
        policy: a.policy.clone(),
        ..Overrides::default()
    }
    .over(Overrides::from_env(env)?);
    let cwd = std::env::current_dir().context("current directory")?;
    let (section, source) = policy::invariance_section(&overrides, &cwd)?;
    let expectations = Expectations::new(&m.expect, &m.source, &section, &source.describe())?;
    for cfg in &m.configs {
        expectations
            .of(cfg)
            .map_err(|e| anyhow::anyhow!("configuration {:?}: {e}", cfg.name))?;
    }
    let mut profiles = BTreeMap::new();
    for name in expectations.profiles() {
        let o = Overrides {
            profile: Some(name.clone()),
            ..overrides.clone()
        };
        let (profile, _) =
            policy::resolve(&o, &cwd).with_context(|| format!("profile {name:?} of the expectations"))?;
        profiles.insert(name, profile);
    }
    let mut inputs = Inputs::new();
    if let Some(p) = &a.matrix {
        inputs.file(p, "matrix file");
    }
    if let policy::Source::File(p) = &source {
        inputs.file(p, "policy file");
    }
    moeconf_output::check_output_dir(&a.out, &inputs, moeconf_invariance::is_result_entry)?;
    let model = match &m.backend {
        Backend::Reference(r) => {
            let loaded = moeconf_runner::load_model(&r.model)?;
            inputs.dir_files(&loaded.dir, "model file");
            Some(loaded)
        }
        Backend::Command(_) => None,
    };
    let checked = moeconf_output::check_output_dir(&a.out, &inputs, moeconf_invariance::is_result_entry)?;
    let result = AtomicDir::create(&checked)?;
    let quiet = a.quiet;
    let progress = move |line: &str| {
        if !quiet {
            eprintln!("moeconf invariance: {line}");
        }
    };
    let report = run_matrix(
        &m,
        &RunOptions {
            expectations: &expectations,
            profiles: &profiles,
            policy_source: source.describe(),
            dir: result.temp_path(),
            model: model.as_ref(),
            progress: &progress,
            pages: !a.no_pages,
        },
    )?;
    let json = serde_json::to_vec_pretty(&report.to_json()).context("encoding the JSON report")?;
    let tmp = result.temp_path();
    std::fs::write(tmp.join("invariance.json"), json).context("writing invariance.json")?;
    let page = moeconf_report::render_invariance(&report.view());
    std::fs::write(tmp.join("index.html"), page).context("writing index.html")?;
    result.commit()?;
    match a.format {
        Format::Json => print_json(&report.to_json())?,
        Format::Text => {
            let mut out = std::io::stdout().lock();
            out.write_all(report.render_text().as_bytes())?;
            writeln!(out, "matrix page: {}", a.out.join("index.html").display())?;
            out.flush()?;
        }
    }
    Ok(ExitCode::from(report.exit_code()))
}
