//! Arguments several commands share, defined once, and their parsing.

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use moeconf_fingerprint::Algorithm;
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::Field;
use moeconf_shard::Shard;
use std::path::PathBuf;

/// How a command made of independent jobs runs them: which shard, with how
/// many threads, with or without progress (`sweep`, `calibrate`).
#[derive(Debug, Clone, clap::Args)]
pub struct JobArgs {
    /// Run only shard I of N (0-based: 0/N .. N-1/N) of the command's independent jobs (job j
    /// belongs to shard j mod N) and write their partial result to the output (-o FILE, --out
    /// FILE); `moeconf merge` combines the partials of every shard into exactly the unsharded
    /// outputs (docs/scale.md).
    #[arg(long, value_name = "I/N")]
    pub shard: Option<Shard>,
    /// No progress on stderr (a bar when stderr and stdout are terminals, else a line per 10 %).
    #[arg(long, short = 'q')]
    pub quiet: bool,
    /// Worker threads (results never depend on it; at most 4 × the cores, at least 64 allowed).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// Output format of reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Human-readable text.
    Text,
    /// One JSON document with a `schema_version` field.
    Json,
}

impl Format {
    /// The name the option takes.
    pub fn name(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Json => "json",
        }
    }
}

/// The model and prompt of a run (`moeconf run`, `moeconf sweep`).
#[derive(Debug, Args)]
pub struct ModelPromptArgs {
    /// Model: `builtin:tiny-v4`, `builtin:tiny-v4-fp8` (the released FP8 / MXFP4 format),
    /// `builtin:tiny-v4-fp8-bf16` (its BF16 dequantization), `builtin:tiny-v4-vllm` (the released
    /// format at the sizes vLLM's CPU path accepts), `builtin:tiny-v4-vllm-bf16` (its BF16
    /// dequantization) or a directory with config.json, *.safetensors and tokenizer.json.
    #[arg(long, default_value = "builtin:tiny-v4")]
    pub model: String,
    /// Prompt text (raw UTF-8, no chat template).
    #[arg(long, conflicts_with = "prompt_file")]
    pub prompt: Option<String>,
    /// Read the prompt text (UTF-8, at most 16 MiB) from a file.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
}

impl ModelPromptArgs {
    /// The prompt text, from `--prompt` or `--prompt-file`.
    pub fn prompt(&self) -> anyhow::Result<String> {
        match (&self.prompt, &self.prompt_file) {
            (Some(p), None) => Ok(p.clone()),
            (None, Some(f)) => Ok(moeconf_runner::limits::read_prompt_file(f)?),
            _ => bail!("give the prompt with --prompt TEXT or --prompt-file FILE"),
        }
    }

    /// The files these options read (a model directory's files, the prompt
    /// file), which no output of the command may be.
    pub fn inputs(&self) -> moeconf_output::Inputs {
        let mut inputs = moeconf_output::Inputs::new();
        crate::output::add_model_inputs(&self.model, &mut inputs);
        if let Some(f) = &self.prompt_file {
            inputs.file(f, "prompt file");
        }
        inputs
    }
}

/// Sets the global rayon pool size (results never depend on it), within
/// [`moeconf_runner::limits::max_threads`].
pub fn set_threads(threads: Option<usize>) -> anyhow::Result<()> {
    if let Some(n) = threads {
        moeconf_runner::limits::check_threads(n)?;
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("configuring the thread pool")?;
    }
    Ok(())
}

/// Parses `--precision`.
pub fn precision(name: &str) -> anyhow::Result<Precision> {
    Precision::from_name(name)
        .with_context(|| format!("--precision {name:?}: expected bf16, f32, official or vllm-cpu"))
}

/// Parses `--digest`.
pub fn algorithm(name: &str) -> anyhow::Result<Algorithm> {
    Algorithm::from_name(name).with_context(|| format!("--digest {name:?}"))
}

/// The flag that sets `field`: library errors name the values of a request
/// as [`Field`]s, and the binary words them as its own options.
pub fn flag(field: Field) -> String {
    match field {
        Field::Model => "--model",
        Field::Capture => "--capture",
        Field::Contract => "--contract",
        Field::Schedule => "--schedule",
        Field::ForkLayer => "--fork-layer",
        Field::ForkContract => "--fork-contract",
        Field::ForkOrder => "--fork-order",
        Field::ForkStep => "--fork-step",
        Field::ForkPosition => "--fork-position",
        Field::MaxNewTokens => "--max-new-tokens",
        Field::Threads => "--threads",
        Field::PromptFile => "--prompt-file",
        Field::AllowNonFinite => "--allow-non-finite",
        Field::Scheme => "--scheme",
        Field::Branch => "--branch",
        Field::Only => "--only",
    }
    .to_string()
}

/// An error and its causes on one line, `outer: inner: root` (anyhow's
/// `{:#}`), with the fields of library errors named by their flags.
pub fn render_error(err: &anyhow::Error) -> String {
    let flagged = |e: &(dyn std::error::Error + 'static)| {
        if let Some(r) = e.downcast_ref::<moeconf_runner::RunError>() {
            r.render_fields(flag)
        } else if let Some(c) = e.downcast_ref::<moeconf_calibrate::CalibrateError>() {
            c.render_fields(flag)
        } else {
            None
        }
    };
    err.chain()
        .map(|e| flagged(e).unwrap_or_else(|| e.to_string()))
        .collect::<Vec<_>>()
        .join(": ")
}
