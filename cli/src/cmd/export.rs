//! `moeconf export gguf`: a checkpoint as a GGUF for llama.cpp's `deepseek4`, verified bit for
//! bit against the weights the reference runtime runs (the library side is `moeconf_gguf`;
//! docs/interop-llamacpp.md §2).

use anyhow::{bail, Context};
use moeconf_gguf::ExportType;
use std::path::PathBuf;
use std::process::ExitCode;

/// `moeconf export` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum ExportCommand {
    /// Write (or, with --verify, check) a GGUF of the model for llama.cpp's deepseek4
    /// architecture: tensor names and metadata as its loader expects, the tokenizer included,
    /// every value read back and compared bit for bit with the checkpoint's.
    #[command(
        after_help = "Examples:\n  moeconf export gguf --model builtin:tiny-v4-fp8-bf16 -o tiny.gguf\n  moeconf export gguf --model ./ckpt --type native -o ckpt.gguf\n  moeconf export gguf --model ./ckpt --verify ckpt.gguf\n\nTypes: f32 (every real tensor F32), bf16 (matrices BF16, vectors F32), native (bf16, but routed experts stored as MXFP4 stay MXFP4). FP8 weights are written as their exact BF16 values (this llama.cpp has no block-scaled FP8 type; Q8_0 would not be the same weights). Exit codes: 0 written / verified, 2 error."
    )]
    Gguf(GgufArgs),
}

/// Arguments of `moeconf export gguf`.
#[derive(Debug, clap::Args)]
pub struct GgufArgs {
    /// Model: a `builtin:` name or a directory with config.json, *.safetensors and tokenizer.json.
    #[arg(long)]
    pub model: String,
    /// Output GGUF file, written atomically (never a model file).
    #[arg(short, long, required_unless_present = "verify", conflicts_with = "verify")]
    pub output: Option<PathBuf>,
    /// Element types: f32, bf16 or native.
    #[arg(long = "type", default_value = "bf16", value_parser = ["f32", "bf16", "native"])]
    pub ty: String,
    /// Verify an existing GGUF against the model instead of writing one.
    #[arg(long)]
    pub verify: Option<PathBuf>,
    /// general.name of the GGUF (default: the --model value).
    #[arg(long)]
    pub name: Option<String>,
}

/// Runs `moeconf export`.
pub fn run(c: &ExportCommand) -> anyhow::Result<ExitCode> {
    match c {
        ExportCommand::Gguf(a) => gguf(a),
    }
}

fn gguf(a: &GgufArgs) -> anyhow::Result<ExitCode> {
    let dir = if a.model.starts_with("builtin:") {
        moeconf_fixtures::ensure_builtin(&a.model).with_context(|| format!("materializing {}", a.model))?
    } else {
        let d = PathBuf::from(&a.model);
        if !d.is_dir() {
            bail!("--model {}: not a directory (expected config.json, *.safetensors and tokenizer.json, or a builtin: name)", a.model);
        }
        d
    };
    let name = a.name.clone().unwrap_or_else(|| a.model.clone());
    let s = match (&a.output, &a.verify) {
        (Some(out), None) => {
            let ty = ExportType::parse(&a.ty).with_context(|| format!("--type {}", a.ty))?;
            moeconf_gguf::export(&dir, out, ty, &name)?
        }
        (None, Some(file)) => moeconf_gguf::verify(&dir, file, &name)?,
        _ => bail!("give -o FILE to write a GGUF or --verify FILE to check one"),
    };
    let types: Vec<String> = s.by_type.iter().map(|(t, n)| format!("{n} {t}")).collect();
    let zeros = if s.mxfp4_negative_zeros > 0 {
        format!(
            " except {} MXFP4 values that are -0 in the checkpoint and +0 in ggml (kvalues_mxfp4[8] = 0: equal values, other sign bit)",
            s.mxfp4_negative_zeros
        )
    } else {
        String::new()
    };
    println!(
        "{} {} ({} bytes): {} tensors ({}), {} metadata entries; {} values bit-identical to the checkpoint's (weights {}){zeros}",
        if a.verify.is_some() { "verified" } else { "wrote" },
        s.path.display(),
        s.bytes,
        s.tensors,
        types.join(", "),
        s.metadata,
        s.values_verified,
        &s.weights_digest[..12.min(s.weights_digest.len())]
    );
    Ok(ExitCode::SUCCESS)
}
