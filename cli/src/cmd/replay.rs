//! `moeconf replay`: replay a candidate trace on the reference runtime
//! (`moeconf-replay`, docs/replay.md). Layer replay by default, token
//! teacher forcing with `--teacher-force`.
//!
//! Exit codes (layer replay): 0 every replayable unit reproduced and none
//! missing (or `--allow-incomplete`), 1 an origin exists, 2 error or some
//! unit not replayable. Teacher forcing: 0 the logits are bitwise the
//! reference's at every step, 1 they differ, 2 error. Either mode: a
//! candidate without every step of its run is exit 2 unless
//! `--allow-incomplete`.

use crate::args::Format;
use crate::output::{print_json, print_text};
use anyhow::Context;
use moeconf_output::{write_checked, CheckedOutput};
use moeconf_reference_runtime::precision::Precision;
use moeconf_replay::{replay_layers, teacher_force, LayerOptions, TeacherOptions};
use moeconf_runner::{load_model, LoadedModel};
use moeconf_schema::Trace;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `moeconf replay`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Exit codes: 0 every replayed unit reproduced, 1 an origin found, 2 error or a unit not replayable \
(--allow-incomplete accepts). With --teacher-force: 0 logits bitwise identical at every step, 1 different, 2 error. \
A candidate without every step 0..max_new_tokens of its run is exit 2 in both modes unless --allow-incomplete.\n\n\
Examples:\n  moeconf run --prompt 'why the sheep' --capture replay -o cand.bin\n  moeconf replay cand.bin\n  \
moeconf replay cand.bin --format json -o replay.json\n  moeconf replay --teacher-force cand.bin\n\nCapture spec and report format: docs/replay.md"
)]
pub struct ReplayArgs {
    /// The candidate trace (captured with `--capture replay` or more).
    pub candidate: PathBuf,
    /// Reference model: `builtin:tiny-v4` or a checkpoint directory; by
    /// default the model the trace's binding names, when it is a builtin.
    #[arg(long)]
    pub model: Option<String>,
    /// Run the reference on the candidate's tokens and compare logits per
    /// step (KL divergence, top-k overlap, argmax agreement).
    #[arg(long)]
    pub teacher_force: bool,
    /// The reference's precision profile (bf16, f32, official) instead of the
    /// binding's; needed for traces whose binding names another runtime's
    /// profile (e.g. hf-bf16 from the Python capture).
    #[arg(long)]
    pub precision: Option<String>,
    /// The reference's aggregation contract (docs/contracts.md notation,
    /// e.g. `b+order=asc-id`) instead of the binding's; needed for traces
    /// whose binding names no grammar member (the Python capture's
    /// hf-native), and to replay under what `moeconf explain` found.
    #[arg(long)]
    pub contract: Option<String>,
    /// With --teacher-force: also compare every layer's output streams
    /// (layer.post_ffn_mhc, L3) per step.
    #[arg(long, requires = "teacher_force")]
    pub l3: bool,
    /// k of the top-k overlap (teacher forcing).
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    /// Measure propagation: run the reference teacher-forced on the
    /// candidate's tokens and mark the reproduced units whose inputs really
    /// differ from it (one more reference run; without it, propagation is
    /// data-flow reachability from an origin).
    #[arg(long)]
    pub measure_propagation: bool,
    /// Exit 0 even when some units could not be replayed (inputs missing)
    /// or the candidate lacks steps of its run (fewer than the binding's
    /// max_new_tokens; the report then says `incomplete: k of n steps`),
    /// provided no origin was found. Without it, a replay that could not
    /// check everything exits 2 (also with --teacher-force).
    #[arg(long)]
    pub allow_incomplete: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Write the report to this file instead of stdout.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Also write a self-contained HTML origin map (layers x steps: origins,
    /// propagation, reproduced, not replayable); layer replay only.
    #[arg(long, value_name = "FILE", conflicts_with = "teacher_force")]
    pub html: Option<PathBuf>,
    /// Worker threads (results never depend on it).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// The model to replay against: `--model`, else the binding's builtin.
fn model_spec(a: &ReplayArgs, trace: &Trace) -> anyhow::Result<String> {
    if let Some(m) = &a.model {
        return Ok(m.clone());
    }
    let name = &trace.binding().model.name;
    if name.starts_with("builtin:") {
        Ok(name.clone())
    } else {
        anyhow::bail!(
            "{}: bound to the model {name:?}; give its checkpoint directory with --model DIR",
            a.candidate.display()
        )
    }
}

/// Runs `moeconf replay`.
pub fn run(a: &ReplayArgs) -> anyhow::Result<ExitCode> {
    crate::args::set_threads(a.threads)?;
    if a.top_k == 0 {
        anyhow::bail!("--top-k 0: expected at least 1");
    }
    let mut inputs = moeconf_output::Inputs::new();
    inputs.file(&a.candidate, "candidate trace");
    if let Some(m) = &a.model {
        crate::output::add_model_inputs(m, &mut inputs);
    }
    let outs: Vec<&std::path::Path> = a.output.iter().chain(&a.html).map(|p| p.as_path()).collect();
    let mut checked = crate::output::check_outputs(&outs, &inputs)?.into_iter();
    let out = a.output.as_ref().and_then(|_| checked.next());
    let html = a.html.as_ref().and_then(|_| checked.next());
    // Every payload is re-hashed first: a verdict never rests on a trace
    // whose bytes disagree with its digests, whether replay reads them or not.
    let trace =
        Trace::open_verified(&a.candidate).with_context(|| format!("opening {}", a.candidate.display()))?;
    let incomplete: Vec<String> = crate::complete::describe(&trace).into_iter().collect();
    crate::complete::require(&incomplete, a.allow_incomplete, "not replayed")?;
    let m = load_model(&model_spec(a, &trace)?)?;
    let precision = a.precision.as_deref().map(crate::args::precision).transpose()?;
    let (text, json, code) = if a.teacher_force {
        teacher(a, &trace, &m, precision)?
    } else {
        layers(a, &trace, &m, precision, html.as_ref())?
    };
    match (a.format, out) {
        (Format::Json, None) => print_json(&json)?,
        (Format::Text, None) => print_text(&text)?,
        (Format::Json, Some(o)) => {
            let mut bytes = serde_json::to_vec_pretty(&json)?;
            bytes.push(b'\n');
            write_checked(&o, &bytes)?;
        }
        (Format::Text, Some(o)) => write_checked(&o, text.as_bytes())?,
    }
    Ok(ExitCode::from(code))
}

/// A report in both formats and its exit code.
type Rendered = (String, serde_json::Value, u8);

/// `--teacher-force`: every step from the trace's inputs.
fn teacher(
    a: &ReplayArgs,
    trace: &Trace,
    m: &LoadedModel,
    precision: Option<Precision>,
) -> anyhow::Result<Rendered> {
    let r = teacher_force(
        trace,
        m,
        TeacherOptions {
            top_k: a.top_k,
            precision,
            l3: a.l3,
            contract: a.contract.clone(),
        },
    )?;
    Ok((
        r.render_text(a.allow_incomplete),
        r.to_json(a.allow_incomplete),
        r.exit_code(a.allow_incomplete),
    ))
}

/// Layer by layer: every unit from the trace's own inputs, and the HTML
/// page if asked.
fn layers(
    a: &ReplayArgs,
    trace: &Trace,
    m: &LoadedModel,
    precision: Option<Precision>,
    html: Option<&CheckedOutput>,
) -> anyhow::Result<Rendered> {
    let r = replay_layers(
        trace,
        m,
        &LayerOptions {
            precision,
            contract: a.contract.clone(),
            measure_propagation: a.measure_propagation,
        },
    )?;
    let code = r.exit_code(a.allow_incomplete);
    if let Some(h) = html {
        write_checked(
            h,
            moeconf_report::render_replay(&moeconf_replay::html_view(&r)).as_bytes(),
        )?;
    }
    if code == 2 {
        eprintln!(
            "moeconf: {}: some units could not be replayed (the report lists the missing records and steps); \
             exit 2 (pass --allow-incomplete to accept)",
            a.candidate.display()
        );
    }
    Ok((
        r.render_text(a.allow_incomplete),
        r.to_json(a.allow_incomplete),
        code,
    ))
}
