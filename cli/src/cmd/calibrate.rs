//! `moeconf calibrate`: run the paper's experiments and the fault-injection
//! localization matrix on the reference runtime (see `moeconf_calibrate` and
//! docs/calibration.md), print every table in the paper's layout, write
//! `calibration.json` and one TSV per table into `--out`, and exit 1 when a
//! structural claim fails.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use moeconf_reference_runtime::precision::Precision;
use serde_json::json;

use moeconf_calibrate::{self, write_atomic, Ctx, Section, Sizes};
use moeconf_runner::load_model;

/// Version of `calibration.json`.
pub const CALIBRATION_SCHEMA_VERSION: u32 = 1;

const EXAMPLES: &str = "Examples:
  moeconf calibrate --quick --out cal-quick
  moeconf calibrate --out cal-full                 # the paper's sizes (720 A, 360 B, 64 seeds, 50 prompts)
  moeconf calibrate --only 2,10 --out cal          # only the fork sweep and the fault matrix

Protocols: 1 native replay, 2 single-layer A/B fork, 3 persistent layer-static ablation,
4 same-mode canonical reference, 5 C intermediate check, 6 post-mHC substitution control,
7 persistent-state substitution control, 8 representative propagation trace, 9 breadth,
10 fault-injection localization matrix. Exit codes: 0 all structural claims hold, 1 a claim
failed, 2 error.";

/// Arguments of `moeconf calibrate`.
#[derive(Debug, clap::Args)]
#[command(after_help = EXAMPLES)]
pub struct CalibrateArgs {
    /// Model: `builtin:tiny-v4` or a directory with config.json, *.safetensors and tokenizer.json.
    #[arg(long, default_value = "builtin:tiny-v4")]
    pub model: String,
    /// Output directory for calibration.json, the TSV tables and the fault-matrix traces.
    #[arg(long, default_value = "moeconf-calibration")]
    pub out: PathBuf,
    /// Reduced version of every protocol (fewer seeds, classes, prompts, shorter continuations).
    #[arg(long)]
    pub quick: bool,
    /// Run only these protocols (comma-separated numbers 1..10; 3, 4 and 5 run together).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<u32>,
    /// Layer of the single-layer fork (paper: 5).
    #[arg(long, default_value_t = 5)]
    pub fork_layer: u32,
    /// Precision profile: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// Request seeds per prompt and scheme in protocols 3-5 (default: 64, quick: 6).
    #[arg(long)]
    pub seeds: Option<u64>,
    /// Tokens generated per fork branch in protocol 2 (default: 8, quick: 4; at least 2).
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..=4096))]
    pub fork_tokens: Option<u32>,
    /// Tokens generated in protocols 1, 3-5, 8 and 10 (default: 8, quick: 6; at least 4).
    #[arg(long, value_parser = clap::value_parser!(u32).range(4..=4096))]
    pub tokens: Option<u32>,
    /// No progress on stderr.
    #[arg(long, short = 'q')]
    pub quiet: bool,
    /// Worker threads (results never depend on it).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// Runs `moeconf calibrate`.
pub fn run(a: &CalibrateArgs) -> anyhow::Result<ExitCode> {
    let start = Instant::now();
    if let Some(n) = a.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
            .context("--threads: cannot configure the worker pool")?;
    }
    let precision = Precision::from_name(&a.precision)
        .with_context(|| format!("--precision {:?}: expected bf16 or f32", a.precision))?;
    if let Some(bad) = a.only.iter().find(|&&p| !(1..=10).contains(&p)) {
        bail!("--only {bad}: protocols are numbered 1..10");
    }
    let mut sizes = if a.quick { Sizes::QUICK } else { Sizes::FULL };
    if let Some(s) = a.seeds {
        if s == 0 || s > 100_000 {
            bail!("--seeds {s}: expected 1..100000");
        }
        sizes.seeds = s;
    }
    if let Some(n) = a.fork_tokens {
        sizes.fork_tokens = n as usize;
    }
    if let Some(n) = a.tokens {
        sizes.tokens = n as usize;
    }
    std::fs::create_dir_all(a.out.join("traces"))
        .with_context(|| format!("--out {}: cannot create the directory", a.out.display()))?;
    let m = load_model(&a.model)?;
    let ctx = Ctx::new(m, precision, a.fork_layer, sizes, a.out.clone(), !a.quiet)?;
    let want = |p: u32| a.only.is_empty() || a.only.contains(&p);

    let mut sections: Vec<Section> = Vec::new();
    let mut timings = Vec::new();
    let mut timed = |name: &str, f: &dyn Fn() -> anyhow::Result<Vec<Section>>| -> anyhow::Result<()> {
        let t = Instant::now();
        let s = f().with_context(|| format!("protocol {name}"))?;
        let secs = t.elapsed().as_secs_f64();
        ctx.note(&format!("    {name} done in {secs:.1} s"));
        timings.push(json!({"protocol": name, "seconds": secs}));
        sections.extend(s);
        Ok(())
    };
    if want(1) {
        timed("replay", &|| Ok(vec![moeconf_calibrate::replay::run(&ctx)?]))?;
    }
    if want(2) {
        timed("fork_sweep", &|| {
            Ok(vec![moeconf_calibrate::fork_sweep::run(&ctx)?])
        })?;
    }
    if want(3) || want(4) || want(5) {
        timed("persistent", &|| moeconf_calibrate::persistent::run(&ctx))?;
    }
    if want(6) {
        timed("post_mhc_substitution", &|| {
            Ok(vec![moeconf_calibrate::substitution::post_mhc(&ctx)?])
        })?;
    }
    if want(7) {
        timed("persistent_state_substitution", &|| {
            Ok(vec![moeconf_calibrate::substitution::persistent_state(&ctx)?])
        })?;
    }
    if want(8) {
        timed("propagation", &|| {
            Ok(vec![moeconf_calibrate::propagation::run(&ctx)?])
        })?;
    }
    if want(9) {
        timed("breadth", &|| Ok(vec![moeconf_calibrate::breadth::run(&ctx)?]))?;
    }
    if want(10) {
        timed("fault_matrix", &|| {
            Ok(vec![moeconf_calibrate::fault_matrix::run(&ctx)?])
        })?;
    }

    // Print tables, write TSVs and the JSON document.
    let mut claims = Vec::new();
    let mut doc = serde_json::Map::new();
    for s in &sections {
        for t in &s.tables {
            println!("{}", t.render());
            write_atomic(&a.out.join(format!("{}.tsv", t.name)), t.tsv().as_bytes())?;
        }
        doc.insert(s.key.clone(), s.json.clone());
        claims.extend(s.claims.iter().cloned());
    }
    let all_hold = claims.iter().all(|c| c.holds);
    println!("Structural claims:");
    for c in &claims {
        println!(
            "  [{}] {}: {}",
            if c.holds { "ok" } else { "FAIL" },
            c.id,
            c.detail
        );
    }
    let wall = start.elapsed().as_secs_f64();
    let json = json!({
        "schema_version": CALIBRATION_SCHEMA_VERSION,
        "kind": "moeconf.calibration",
        "model": a.model,
        "precision": precision.name(),
        "quick": a.quick,
        "fork_layer": a.fork_layer,
        "sizes": {
            "tokens": sizes.tokens, "fork_tokens": sizes.fork_tokens,
            "fork_branches": if sizes.fork_branches == usize::MAX { None } else { Some(sizes.fork_branches) },
            "seeds": sizes.seeds, "control_tokens": sizes.control_tokens, "horizons": sizes.horizons,
        },
        "protocols": doc,
        "claims": claims,
        "all_claims_hold": all_hold,
        "timings": timings,
        "wall_seconds": wall,
    });
    let mut bytes = serde_json::to_vec_pretty(&json)?;
    bytes.push(b'\n');
    write_atomic(&a.out.join("calibration.json"), &bytes)?;
    println!("wall time: {wall:.1} s; results in {}", a.out.display());
    Ok(if all_hold {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
