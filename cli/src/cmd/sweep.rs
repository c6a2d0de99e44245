//! `moeconf sweep`: trace-freeze-fork sweep (paper section 2.4.1 and 3.2).
//!
//! Runs the request natively up to the fork step, freezes the decode state,
//! and runs every structural class of each scheme from the snapshot (all k!
//! permutation indices for A-like contracts, the k!/2 B classes for B-like
//! ones) with only the fork layer's MoE aggregation changed. Prints the
//! paper's table per scheme (raw permutations, structural classes, distinct
//! MoE outputs, distinct post-mHC states, basins) and the basin
//! rank-frequency; `--format json` / `-o FILE` give every branch's digests,
//! routes and tokens.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{bail, Context};
use moeconf_contract::{AggregationContract, ForkPoint};
use moeconf_fingerprint::{Algorithm, CanonPolicy};
use moeconf_reference_runtime::fork::{sweep, Branch, BranchResult, Scheme, SweepOptions, SweepReport};
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::tokenizer::Detokenize;
use serde_json::{json, Value};

use crate::cli::Format;
use crate::output::print_json;
use moeconf_runner::{build_combine, load_model, CombineChoice};

/// Version of the JSON document written by `moeconf sweep`.
pub const SWEEP_SCHEMA_VERSION: u32 = 1;

const SWEEP_EXAMPLES: &str = "Examples:
  moeconf sweep --model builtin:tiny-v4 --prompt \"why the sheep\" --fork-layer 5 --scheme a,b --max-new-tokens 8
  moeconf sweep --prompt \"why the sheep\" --scheme b --limit 20 --max-new-tokens 2 --format json
  moeconf sweep --prompt \"why the sheep\" --scheme a,b -o sweep.json
  moeconf sweep --prompt \"why the sheep\" --branch b+order=class:135 --branch a+order=index:17

A scheme is a contract family (native, p32, c, a, b, exact, tree, f64, exact-fused, or
operand=..+accumulator=..); it is swept over its structural classes: the k!/2 B classes for
B-like families (BF16 operands and accumulator, first-pair symmetry), all k! permutation
indices otherwise. --branch adds single explicit contracts (with +order=...) as one more
scheme named `explicit`. Basins are distinct continuation texts.";

/// Arguments of `moeconf sweep`.
#[derive(Debug, clap::Args)]
#[command(after_help = SWEEP_EXAMPLES)]
pub struct SweepArgs {
    /// Model: `builtin:tiny-v4` or a directory with config.json, *.safetensors and tokenizer.json.
    #[arg(long, default_value = "builtin:tiny-v4")]
    pub model: String,
    /// Prompt text (raw UTF-8, no chat template).
    #[arg(long, conflicts_with = "prompt_file")]
    pub prompt: Option<String>,
    /// Read the prompt text from a file.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Layer whose MoE aggregation is forked.
    #[arg(long, default_value_t = 5)]
    pub fork_layer: u32,
    /// Forward step of the fork (default 1: the forward that consumes the first emitted token).
    #[arg(long, default_value_t = 1)]
    pub fork_step: u32,
    /// Restrict the fork to one absolute position (for prefill forks, --fork-step 0).
    #[arg(long)]
    pub fork_position: Option<u32>,
    /// Schemes to sweep, comma-separated (e.g. a,b); repeatable.
    #[arg(long, value_delimiter = ',', default_value = "a,b")]
    pub scheme: Vec<String>,
    /// An explicit branch contract such as b+order=class:135 (repeatable; not comma-split).
    #[arg(long)]
    pub branch: Vec<String>,
    /// Evaluate only the first N branches of each scheme (quick runs).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Tokens generated per branch (steps 0..N-1); must exceed --fork-step.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_new_tokens: u32,
    /// Precision profile: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// Contract of every other MoE event (the base; default native).
    #[arg(long, default_value = "native")]
    pub contract: String,
    /// Order schedule of the base contract: identity, layer-static:SEED or token-dynamic:SEED.
    #[arg(long, default_value = "identity")]
    pub schedule: String,
    /// Digest algorithm of the branch fingerprints.
    #[arg(long, default_value = "blake3", value_parser = ["blake3", "sha256"])]
    pub digest: String,
    /// Report format on stdout.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Also write the JSON report (every branch) to FILE, atomically.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Basins listed per scheme in the text report.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// No progress counter on stderr.
    #[arg(long, short = 'q')]
    pub quiet: bool,
    /// Worker threads (results never depend on it).
    #[arg(long)]
    pub threads: Option<usize>,
}

fn read_prompt(a: &SweepArgs) -> anyhow::Result<String> {
    match (&a.prompt, &a.prompt_file) {
        (Some(p), None) => Ok(p.clone()),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("--prompt-file {}: reading", f.display()))
        }
        _ => bail!("give the prompt with --prompt TEXT or --prompt-file FILE"),
    }
}

/// Builds the schemes of `--scheme` and `--branch` for k terms.
fn build_schemes(a: &SweepArgs, k: usize) -> anyhow::Result<Vec<Scheme>> {
    let mut schemes = Vec::new();
    for name in a.scheme.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let mut s = Scheme::enumerate(name, k).map_err(|e| anyhow::anyhow!("--scheme: {e}"))?;
        if let Some(n) = a.limit {
            s.truncate(n);
        }
        schemes.push(s);
    }
    if !a.branch.is_empty() {
        let mut branches = Vec::new();
        for b in &a.branch {
            let c = AggregationContract::parse(b).map_err(|e| anyhow::anyhow!("--branch {b:?}: {e}"))?;
            c.validate_for_k(k)
                .map_err(|e| anyhow::anyhow!("--branch {b:?}: {e}"))?;
            branches.push(Branch {
                label: c.describe(),
                contract: c,
                weight: 1,
            });
        }
        let family = branches[0].contract.clone();
        schemes.push(Scheme::explicit("explicit", family, branches, k));
    }
    if schemes.is_empty() {
        bail!("nothing to sweep: give --scheme a,b or --branch CONTRACT");
    }
    Ok(schemes)
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .with_context(|| format!("-o {}: not a file path", path.display()))?;
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("-o {}: cannot write", path.display()));
    }
    Ok(())
}

fn branch_json(r: &BranchResult) -> Value {
    json!({
        "label": r.label,
        "contract": r.contract,
        "raw_permutations": r.weight,
        "fork_moe_digest": r.fork_moe.to_hex(),
        "fork_post_mhc_digest": r.fork_post_mhc.to_hex(),
        "tokens": r.tokens,
        "text": r.text,
        "records": r.records,
        "digest": r.digest.to_hex(),
        "steps": r.steps.iter().map(|s| json!({
            "step": s.step,
            "input": s.input,
            "output": s.output,
            "router_topk": s.topk,
        })).collect::<Vec<_>>(),
    })
}

/// The JSON document (deterministic: no timings).
fn report_json(h: &Header<'_>, r: &SweepReport) -> Value {
    let schemes: Vec<Value> = r
        .summaries
        .iter()
        .zip(&r.branches)
        .map(|(s, bs)| {
            json!({
                "scheme": s.scheme,
                "family": s.family,
                "raw_permutations": s.raw_permutations,
                "structural_classes": s.structural_classes,
                "evaluated": s.evaluated,
                "distinct_moe_outputs": s.distinct_moe_outputs,
                "distinct_post_mhc_states": s.distinct_post_mhc,
                "post_mhc_differs_from_reference": s.post_mhc_differs_from_reference,
                "distinct_continuations": s.distinct_continuations,
                "basins": s.basins,
                "basin_rank_frequency": s.basin_rank_frequency.iter().enumerate().map(|(i, b)| json!({
                    "rank": i + 1,
                    "text": b.text,
                    "tokens": b.tokens,
                    "branches": b.branches,
                    "raw_permutations": b.raw_permutations,
                    "first_branch": bs.get(b.first_branch).map(|x| x.label.as_str()),
                })).collect::<Vec<_>>(),
                "branches": bs.iter().map(branch_json).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "schema_version": SWEEP_SCHEMA_VERSION,
        "kind": "moeconf.sweep",
        "model": h.model,
        "prompt": { "text": h.prompt, "ids": h.prompt_ids },
        "precision": h.precision,
        "base_contract": h.base_contract,
        "base_schedule": h.base_schedule,
        "algorithm": h.algorithm.name(),
        "fork": { "layer": r.point.layer, "step": r.point.step, "position": r.point.position },
        "max_new_tokens": r.max_new_tokens,
        "experts_per_tok": h.k,
        "reference": branch_json(&r.reference),
        "schemes": schemes,
    })
}

/// Run description shared by the text and JSON reports.
struct Header<'a> {
    model: &'a str,
    prompt: &'a str,
    prompt_ids: &'a [u32],
    precision: &'a str,
    base_contract: &'a str,
    base_schedule: &'a str,
    algorithm: Algorithm,
    k: usize,
}

fn render_text(h: &Header<'_>, r: &SweepReport, top: usize) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let p = &r.point;
    let pos = p.position.map(|x| format!(", position {x}")).unwrap_or_default();
    let _ = writeln!(
        o,
        "sweep of {:?} ({} prompt tokens) on {}: fork at layer {}, step {}{pos}; {} new tokens per branch; base {} ({})",
        h.prompt,
        h.prompt_ids.len(),
        h.model,
        p.layer,
        p.step,
        r.max_new_tokens,
        h.base_contract,
        h.base_schedule
    );
    let reftext = r.reference.text.clone().unwrap_or_default();
    let _ = writeln!(o, "native reference: {reftext:?}\n");
    let cols = [
        "Scheme",
        "Raw permutations",
        "Structural classes",
        "Evaluated",
        "Distinct MoE outputs",
        "Distinct post-mHC states",
        "Post-mHC != native",
        "Basins (texts)",
    ];
    let rows: Vec<Vec<String>> = r
        .summaries
        .iter()
        .map(|s| {
            vec![
                s.scheme.to_uppercase(),
                s.raw_permutations.to_string(),
                s.structural_classes.to_string(),
                s.evaluated.to_string(),
                s.distinct_moe_outputs.to_string(),
                s.distinct_post_mhc.to_string(),
                s.post_mhc_differs_from_reference.to_string(),
                s.basins.to_string(),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..cols.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([cols[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[&str]| {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i == 0 {
                let _ = write!(s, "{c:<w$}");
            } else {
                let _ = write!(s, "  {c:>w$}");
            }
        }
        s
    };
    let _ = writeln!(o, "{}", line(&cols));
    for row in &rows {
        let cells: Vec<&str> = row.iter().map(|x| x.as_str()).collect();
        let _ = writeln!(o, "{}", line(&cells));
    }
    for (s, bs) in r.summaries.iter().zip(&r.branches) {
        let _ = writeln!(
            o,
            "\nbasins of {} ({}; {} distinct token sequences), rank-frequency in branches / raw permutations:",
            s.scheme.to_uppercase(),
            s.family,
            s.distinct_continuations
        );
        for (i, b) in s.basin_rank_frequency.iter().take(top).enumerate() {
            let first = bs.get(b.first_branch).map(|x| x.label.as_str()).unwrap_or("?");
            let _ = writeln!(
                o,
                "  {:>3}. {:>5} / {:<5} {:?} (first {first})",
                i + 1,
                b.branches,
                b.raw_permutations,
                b.text
            );
        }
        if s.basin_rank_frequency.len() > top {
            let _ = writeln!(
                o,
                "  ... {} more (see --format json)",
                s.basin_rank_frequency.len() - top
            );
        }
    }
    o
}

/// Runs `moeconf sweep`.
pub fn run(a: &SweepArgs) -> anyhow::Result<ExitCode> {
    crate::cmd::run::set_threads(a.threads)?;
    let prompt = read_prompt(a)?;
    let precision = Precision::from_name(&a.precision)
        .with_context(|| format!("--precision {:?}: expected bf16 or f32", a.precision))?;
    let algorithm = Algorithm::from_name(&a.digest).with_context(|| format!("--digest {:?}", a.digest))?;
    if a.max_new_tokens <= a.fork_step {
        bail!(
            "--max-new-tokens {} must exceed --fork-step {} (the fork step must run)",
            a.max_new_tokens,
            a.fork_step
        );
    }
    let m = load_model(&a.model)?;
    let cfg = m.model.config();
    let k = cfg.experts_per_tok;
    let layers = cfg.layer_types.len();
    if a.fork_layer as usize >= layers {
        bail!(
            "--fork-layer {}: the model has {layers} layers (0..{})",
            a.fork_layer,
            layers.saturating_sub(1)
        );
    }
    let schemes = build_schemes(a, k)?;
    let base = build_combine(
        &CombineChoice {
            contract: a.contract.clone(),
            schedule: a.schedule.clone(),
            ..CombineChoice::default()
        },
        k,
        &prompt,
        layers,
    )?;
    let prompt_ids = m.tokenizer.encode(&prompt)?;
    if prompt_ids.is_empty() {
        bail!("the prompt {prompt:?} tokenizes to no tokens");
    }
    let point = ForkPoint {
        layer: a.fork_layer,
        step: a.fork_step,
        position: a.fork_position,
    };
    let opts = SweepOptions {
        point,
        max_new_tokens: a.max_new_tokens as usize,
        precision,
        base: base.combine.as_ref(),
        detokenizer: Some(&m.tokenizer as &dyn Detokenize),
        algorithm,
        canon: CanonPolicy::default(),
    };
    let tty = std::io::stderr().is_terminal();
    let shown = AtomicUsize::new(0);
    let progress = |done: usize, total: usize| {
        if a.quiet {
            return;
        }
        // On a terminal: a counter line rewritten in place; otherwise one line per 10 %.
        let step = if tty { 1 } else { total.div_ceil(10).max(1) };
        if done == total || done.is_multiple_of(step) {
            let prev = shown.fetch_max(done, Ordering::Relaxed);
            if prev < done {
                if tty {
                    eprint!("\rsweep: {done}/{total} branches");
                } else {
                    eprintln!("sweep: {done}/{total} branches");
                }
            }
        }
    };
    let t = std::time::Instant::now();
    let report = sweep(&m.model, &prompt_ids, &schemes, &opts, Some(&progress))?;
    let secs = t.elapsed().as_secs_f64();
    if !a.quiet {
        let n: usize = report.branches.iter().map(|b| b.len()).sum::<usize>() + 1;
        if tty {
            eprintln!();
        }
        eprintln!(
            "moeconf sweep: {n} branches (incl. the native reference) in {secs:.2} s on {} threads",
            rayon::current_num_threads()
        );
    }
    let header = Header {
        model: &m.name,
        prompt: &prompt,
        prompt_ids: &prompt_ids,
        precision: precision.name(),
        base_contract: &base.contract,
        base_schedule: &base.schedule,
        algorithm,
        k,
    };
    let doc = report_json(&header, &report);
    if let Some(path) = &a.output {
        let mut bytes = serde_json::to_vec_pretty(&doc)?;
        bytes.push(b'\n');
        write_atomic(path, &bytes)?;
    }
    match a.format {
        Format::Json => print_json(&doc)?,
        Format::Text => {
            let mut out = std::io::stdout().lock();
            out.write_all(render_text(&header, &report, a.top).as_bytes())?;
            out.flush()?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
