//! `moeconf demo`: the README's main job. Two traces of the built-in model,
//! identical except for one MoE reduction, and the diff that localizes it.

use crate::cli::{DemoArgs, Format};
use crate::cmd::diff::{self, DiffArgs};
use anyhow::Context;
use moeconf_fingerprint::{Algorithm, CanonPolicy};
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::{load_model, parse_capture, run_to_trace, CombineChoice, RunSpec};
use std::process::ExitCode;

pub fn run(a: &DemoArgs) -> anyhow::Result<ExitCode> {
    let text = a.format == Format::Text;
    std::fs::create_dir_all(&a.out_dir).with_context(|| format!("creating {}", a.out_dir.display()))?;
    let reference = a.out_dir.join("ref.bin");
    let candidate = a.out_dir.join("cand.bin");
    if text {
        eprintln!("moeconf demo: loading the built-in tiny DeepSeek-V4 fixture (generated on first use) ...");
    }
    let m = load_model("builtin:tiny-v4")?;
    let capture = parse_capture("all")?;
    let native = CombineChoice::default();
    let fork = CombineChoice {
        fork_layer: Some(a.fork_layer),
        fork_contract: Some(a.fork_contract.clone()),
        fork_order: Some(a.fork_order.clone()),
        ..CombineChoice::default()
    };
    let spec = |c| RunSpec {
        prompt: &a.prompt,
        max_new_tokens: a.max_new_tokens,
        precision: Precision::Bf16,
        combine: c,
        capture,
        algorithm: Algorithm::Blake3,
        canon: CanonPolicy::default(),
    };
    let r = run_to_trace(&m, &spec(&native), &reference)?;
    let c = run_to_trace(&m, &spec(&fork), &candidate)?;
    if text {
        println!();
        println!(
            "reference  {}  native MoE combine everywhere",
            reference.display()
        );
        println!("           generated {:?}", r.text);
        println!(
            "candidate  {}  identical, except the MoE aggregation of layer {} in the first decode step\n           uses contract {} order {} (BF16 rounding after every addition)",
            candidate.display(),
            a.fork_layer,
            a.fork_contract,
            a.fork_order
        );
        println!("           generated {:?}", c.text);
        println!();
        println!("$ moeconf diff {} {}", reference.display(), candidate.display());
        println!();
    }
    let code = diff::run(&DiffArgs::new(reference, candidate, a.format))?;
    if text {
        println!();
        println!(
            "The demo worked: the diff found the one changed reduction. (`moeconf diff` itself exits 1 on a \
             divergence, 0 when equivalent, 2 on error; the demo exits 0 once the report is printed.)"
        );
    }
    let _ = code;
    Ok(ExitCode::SUCCESS)
}
