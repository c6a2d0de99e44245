//! The report of `moeconf sweep`, the paper's trace-freeze-fork protocol
//! (sections 2.4.1 and 3.2) on any prompt, fork point and scheme: the
//! schemes a sweep evaluates, the JSON document (every branch's digests,
//! routes and tokens) and the text report (the paper's table per scheme and
//! the basin rank-frequency). The sweep itself runs in the reference runtime
//! ([`moeconf_reference_runtime::fork::sweep`]).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};

use moeconf_contract::AggregationContract;
use moeconf_fingerprint::Algorithm;
use moeconf_reference_runtime::fork::{Branch, BranchResult, SchemeSummary, SweepReport};
use moeconf_reference_runtime::tokenizer::Detokenize;
use moeconf_report::{SweepBranch, SweepView};
use serde_json::{json, Value};

pub use moeconf_reference_runtime::fork::Scheme;

use crate::{CalibrateError, Result};

/// Version of the JSON document written by `moeconf sweep`.
pub const SWEEP_SCHEMA_VERSION: u32 = 1;

/// What a sweep evaluates, as given on the command line.
pub struct SchemeRequest<'a> {
    /// Contract families swept over their structural classes (`--scheme`).
    pub schemes: &'a [String],
    /// Explicit branch contracts, swept as one more scheme `explicit` (`--branch`).
    pub branches: &'a [String],
    /// Evaluate only the first N branches of each scheme (`--limit`).
    pub limit: Option<usize>,
}

/// Builds the schemes of a request for k terms.
pub fn build_schemes(req: &SchemeRequest<'_>, k: usize) -> Result<Vec<Scheme>> {
    let mut schemes = Vec::new();
    for name in req.schemes.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let mut s = Scheme::enumerate(name, k).map_err(CalibrateError::option("--scheme"))?;
        if let Some(n) = req.limit {
            s.truncate(n);
        }
        schemes.push(s);
    }
    if !req.branches.is_empty() {
        let mut branches = Vec::new();
        for b in req.branches {
            let option = format!("--branch {b:?}");
            let c = AggregationContract::parse(b).map_err(CalibrateError::option(option.clone()))?;
            c.validate_for_k(k).map_err(CalibrateError::option(option))?;
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
        return Err(CalibrateError::Invalid(
            "nothing to sweep: give --scheme a,b or --branch CONTRACT".into(),
        ));
    }
    Ok(schemes)
}

/// Run description shared by the text and JSON reports.
pub struct SweepHeader<'a> {
    /// The model as given.
    pub model: &'a str,
    /// Prompt text.
    pub prompt: &'a str,
    /// Its token ids.
    pub prompt_ids: &'a [u32],
    /// Precision profile name.
    pub precision: &'a str,
    /// Contract of every other MoE event.
    pub base_contract: &'a str,
    /// Order schedule of the base contract.
    pub base_schedule: &'a str,
    /// Digest algorithm of the branch fingerprints.
    pub algorithm: Algorithm,
    /// Routed experts per token.
    pub k: usize,
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

fn scheme_json(s: &SchemeSummary, bs: &[BranchResult]) -> Value {
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
}

/// The JSON document (deterministic: no timings).
pub fn report_json(h: &SweepHeader<'_>, r: &SweepReport) -> Value {
    let schemes: Vec<Value> = r
        .summaries
        .iter()
        .zip(&r.branches)
        .map(|(s, bs)| scheme_json(s, bs))
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

/// The text report: the run, the per-scheme table and the first `top`
/// basins of each scheme.
pub fn render_text(h: &SweepHeader<'_>, r: &SweepReport, top: usize) -> String {
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
    o.push_str(&summary_table(&r.summaries));
    for (s, bs) in r.summaries.iter().zip(&r.branches) {
        render_basins(&mut o, s, bs, top);
    }
    o
}

/// The per-scheme table: first column left-aligned, the others right-aligned.
fn summary_table(summaries: &[SchemeSummary]) -> String {
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
    let rows: Vec<Vec<String>> = summaries
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
    let mut o = String::new();
    let _ = writeln!(o, "{}", line(&cols));
    for row in &rows {
        let cells: Vec<&str> = row.iter().map(|x| x.as_str()).collect();
        let _ = writeln!(o, "{}", line(&cells));
    }
    o
}

/// The basin rank-frequency of one scheme.
fn render_basins(o: &mut String, s: &SchemeSummary, bs: &[BranchResult], top: usize) {
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

/// A progress counter on stderr: on a terminal a line rewritten in place,
/// otherwise one line per 10 %.
pub struct SweepProgress {
    quiet: bool,
    tty: bool,
    shown: AtomicUsize,
}

impl SweepProgress {
    /// A counter that prints nothing when `quiet`, and rewrites one line in
    /// place when stderr is a terminal (`tty`).
    pub fn new(quiet: bool, tty: bool) -> SweepProgress {
        SweepProgress {
            quiet,
            tty,
            shown: AtomicUsize::new(0),
        }
    }

    /// Reports `done` of `total` branches (callable from worker threads).
    pub fn report(&self, done: usize, total: usize) {
        if self.quiet {
            return;
        }
        let step = if self.tty { 1 } else { total.div_ceil(10).max(1) };
        if done == total || done.is_multiple_of(step) {
            let prev = self.shown.fetch_max(done, Ordering::Relaxed);
            if prev < done {
                if self.tty {
                    eprint!("\rsweep: {done}/{total} branches");
                } else {
                    eprintln!("sweep: {done}/{total} branches");
                }
            }
        }
    }

    /// Ends the counter line and reports the sweep's size and time.
    pub fn finish(&self, report: &SweepReport, secs: f64) {
        if self.quiet {
            return;
        }
        let n: usize = report.branches.iter().map(|b| b.len()).sum::<usize>() + 1;
        if self.tty {
            eprintln!();
        }
        eprintln!(
            "moeconf sweep: {n} branches (incl. the native reference) in {secs:.2} s on {} threads",
            rayon::current_num_threads()
        );
    }
}

/// What the sweep's HTML page shows ([`moeconf_report::render_sweep`]): the
/// header, the native branch and every forked branch with its tokens' texts.
pub fn html_view(h: &SweepHeader<'_>, r: &SweepReport, detok: &dyn Detokenize) -> Result<SweepView> {
    let branch = |b: &BranchResult| -> Result<SweepBranch> {
        Ok(SweepBranch {
            label: b.label.clone(),
            tokens: b.tokens.clone(),
            pieces: b
                .tokens
                .iter()
                .map(|&t| detok.decode(&[t]))
                .collect::<std::result::Result<_, _>>()?,
        })
    };
    let p = &r.point;
    let fork = match p.position {
        Some(pos) => format!("layer {} step {} position {pos}", p.layer, p.step),
        None => format!("layer {} step {}", p.layer, p.step),
    };
    Ok(SweepView {
        header: vec![
            ("model".into(), h.model.into()),
            ("prompt".into(), h.prompt.into()),
            ("precision".into(), h.precision.into()),
            ("base contract".into(), h.base_contract.into()),
            ("fork".into(), fork),
            ("generated tokens per branch".into(), r.max_new_tokens.to_string()),
        ],
        reference: branch(&r.reference)?,
        branches: r.branches.iter().flatten().map(branch).collect::<Result<_>>()?,
    })
}
