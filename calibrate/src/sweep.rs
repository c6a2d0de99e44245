//! The report of `moeconf sweep`, the paper's trace-freeze-fork protocol
//! (sections 2.4.1 and 3.2) on any prompt, fork point and scheme: the
//! schemes a sweep evaluates, the JSON document (every branch's digests,
//! routes and tokens) and the text report (the paper's table per scheme and
//! the basin rank-frequency). The sweep itself runs in the reference runtime
//! ([`moeconf_reference_runtime::fork::sweep`]).

use std::fmt::Write as _;

use moeconf_contract::{AggregationContract, ForkPoint};
use moeconf_fingerprint::Algorithm;
use moeconf_fingerprint::Digest;
use moeconf_reference_runtime::fork::{
    assemble_sweep, sweep_job_count, Branch, BranchResult, SchemeSummary, StepRoutes, SweepJobs, SweepReport,
};
use moeconf_reference_runtime::tokenizer::Detokenize;
use moeconf_report::{SweepBranch, SweepView};
use moeconf_runner::{
    build_combine, check_contract_precision, check_fork_point, CombineChoice, Field, FieldMessage,
    LoadedModel,
};
use moeconf_shard::{JobGroup, JobResult, Merged, Progress, ProgressMode, RunIdentity, Shard};
use serde::{Deserialize, Serialize};
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
        let mut s =
            Scheme::enumerate(name, k).map_err(CalibrateError::option(FieldMessage::of(Field::Scheme)))?;
        if let Some(n) = req.limit {
            s.truncate(n);
        }
        schemes.push(s);
    }
    if !req.branches.is_empty() {
        let mut branches = Vec::new();
        for b in req.branches {
            let option = FieldMessage::of(Field::Branch).text(format!(" {b:?}"));
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
        return Err(CalibrateError::Field(
            FieldMessage::default()
                .text("nothing to sweep: give ")
                .field(Field::Scheme)
                .text(" a,b or ")
                .field(Field::Branch)
                .text(" CONTRACT"),
        ));
    }
    Ok(schemes)
}

/// Run description shared by the text and JSON reports.
pub struct SweepHeader<'a> {
    /// The model as given.
    pub model: &'a str,
    pub prompt: &'a str,
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

/// The JSON form of a [`BranchResult`] in partial results: every field, digests in hex.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct BranchRecord {
    label: String,
    contract: String,
    weight: u64,
    fork_moe: String,
    fork_post_mhc: String,
    steps: Vec<StepRecord>,
    tokens: Vec<u32>,
    text: Option<String>,
    records: u64,
    digest: String,
}

/// The JSON form of [`StepRoutes`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StepRecord {
    step: u32,
    input: Vec<u32>,
    output: u32,
    topk: Vec<Vec<u32>>,
}

impl From<&BranchResult> for BranchRecord {
    fn from(r: &BranchResult) -> BranchRecord {
        BranchRecord {
            label: r.label.clone(),
            contract: r.contract.clone(),
            weight: r.weight,
            fork_moe: r.fork_moe.to_hex(),
            fork_post_mhc: r.fork_post_mhc.to_hex(),
            steps: r
                .steps
                .iter()
                .map(|s| StepRecord {
                    step: s.step,
                    input: s.input.clone(),
                    output: s.output,
                    topk: s.topk.clone(),
                })
                .collect(),
            tokens: r.tokens.clone(),
            text: r.text.clone(),
            records: r.records,
            digest: r.digest.to_hex(),
        }
    }
}

impl BranchRecord {
    /// The branch result back.
    pub(crate) fn into_result(self) -> Result<BranchResult> {
        let hex = |what: &str, s: &str| {
            Digest::from_hex(s).ok_or_else(|| {
                CalibrateError::Merge(format!(
                    "branch {}: {what} {s:?} is not a 64-digit hex digest",
                    self.label
                ))
            })
        };
        Ok(BranchResult {
            fork_moe: hex("fork_moe", &self.fork_moe)?,
            fork_post_mhc: hex("fork_post_mhc", &self.fork_post_mhc)?,
            digest: hex("digest", &self.digest)?,
            steps: self
                .steps
                .iter()
                .map(|s| StepRoutes {
                    step: s.step,
                    input: s.input.clone(),
                    output: s.output,
                    topk: s.topk.clone(),
                })
                .collect(),
            label: self.label,
            contract: self.contract,
            weight: self.weight,
            tokens: self.tokens,
            text: self.text,
            records: self.records,
        })
    }
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

/// The summary line of a finished sweep on stderr (not with `--quiet`):
/// how many jobs ran, how long they took, on how many threads.
pub fn finish_message(jobs: usize, of: usize, shard: Shard, secs: f64) -> String {
    let what = if shard.is_whole() {
        format!("{jobs} branches (incl. the native reference)")
    } else {
        format!("shard {shard}: {jobs} of {of} jobs (branches incl. the native reference)")
    };
    format!(
        "moeconf sweep: {what} in {secs:.2} s on {} threads",
        rayon::current_num_threads()
    )
}

/// The command name recorded in partial results of `moeconf sweep`.
pub const COMMAND: &str = "sweep";

/// The name of the sweep's one job group (the native reference, then every branch).
pub const JOB_GROUP: &str = "branches";

/// Everything of a sweep's request that shapes its outputs (recorded as
/// the arguments of its partial results), and the values derived from it
/// that rendering the outputs needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepArguments {
    /// The model's name.
    pub model: String,
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    /// Layer of the single-layer fork.
    pub fork_layer: u32,
    /// Forward step of the fork.
    pub fork_step: u32,
    /// Absolute position the fork is restricted to, if any.
    pub fork_position: Option<u32>,
    /// `--scheme` values.
    pub schemes: Vec<String>,
    /// `--branch` values.
    pub branches: Vec<String>,
    /// `--limit`.
    pub limit: Option<usize>,
    /// Tokens generated per branch.
    pub max_new_tokens: usize,
    /// Precision profile name.
    pub precision: String,
    /// Contract of every other MoE event, described.
    pub base_contract: String,
    /// Its order schedule, described.
    pub base_schedule: String,
    /// Digest algorithm name.
    pub algorithm: String,
    /// Routed experts per token.
    pub experts_per_tok: usize,
    /// Report format on stdout (`text` or `json`).
    pub format: String,
    /// Basins listed per scheme in the text report.
    pub top: usize,
}

impl SweepArguments {
    /// The schemes the arguments sweep.
    pub fn schemes(&self) -> Result<Vec<Scheme>> {
        build_schemes(
            &SchemeRequest {
                schemes: &self.schemes,
                branches: &self.branches,
                limit: self.limit,
            },
            self.experts_per_tok,
        )
    }

    pub fn point(&self) -> ForkPoint {
        ForkPoint {
            layer: self.fork_layer,
            step: self.fork_step,
            position: self.fork_position,
        }
    }
}

/// One job's result: the branch, and the text of each of its tokens (for the HTML page).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SweepJob {
    branch: BranchRecord,
    pieces: Vec<String>,
}

/// Runs the jobs `jobs` (indices of [`SweepJobs`]) in parallel, counting
/// them on `progress`; returns their results in the order of `jobs`.
pub fn run_jobs(
    sweep: &SweepJobs<'_>,
    jobs: &[usize],
    detok: &dyn Detokenize,
    progress: &Progress,
) -> Result<Vec<Value>> {
    moeconf_shard::jobs::run_jobs(jobs, progress, |j| {
        let b = sweep.run(j)?;
        let pieces = b
            .tokens
            .iter()
            .map(|&t| detok.decode(&[t]))
            .collect::<std::result::Result<_, _>>()?;
        Ok(serde_json::to_value(SweepJob {
            branch: BranchRecord::from(&b),
            pieces,
        })?)
    })
}

/// What a sweep prints and writes.
pub struct SweepOutputs {
    /// The JSON report (`--format json`, `-o FILE`).
    pub doc: Value,
    /// What goes to stdout (the text report, or the JSON document).
    pub stdout: String,
    /// The HTML page, when asked for.
    pub html: Option<String>,
}

/// The sweep's outputs from the results of all its jobs, in job order.
pub fn outputs(args: &SweepArguments, results: &[Value], html: bool) -> Result<SweepOutputs> {
    let jobs: Vec<SweepJob> = results
        .iter()
        .enumerate()
        .map(|(i, v)| {
            SweepJob::deserialize(v)
                .map_err(|e| CalibrateError::Merge(format!("sweep job {i}: result of the wrong form: {e}")))
        })
        .collect::<Result<_>>()?;
    let schemes = args.schemes()?;
    let mut pieces = Vec::with_capacity(jobs.len());
    let mut branches = Vec::with_capacity(jobs.len());
    for j in jobs {
        if j.pieces.len() != j.branch.tokens.len() {
            return Err(CalibrateError::Merge(format!(
                "sweep branch {}: {} token texts for {} tokens",
                j.branch.label,
                j.pieces.len(),
                j.branch.tokens.len()
            )));
        }
        pieces.push(j.pieces);
        branches.push(j.branch.into_result()?);
    }
    let report = assemble_sweep(args.point(), args.max_new_tokens, &schemes, branches)?;
    let algorithm = Algorithm::from_name(&args.algorithm)
        .ok_or_else(|| CalibrateError::Merge(format!("unknown digest algorithm {:?}", args.algorithm)))?;
    let header = SweepHeader {
        model: &args.model,
        prompt: &args.prompt,
        prompt_ids: &args.prompt_ids,
        precision: &args.precision,
        base_contract: &args.base_contract,
        base_schedule: &args.base_schedule,
        algorithm,
        k: args.experts_per_tok,
    };
    let doc = report_json(&header, &report);
    let stdout = match args.format.as_str() {
        "json" => {
            let mut s = serde_json::to_string_pretty(&doc)?;
            s.push('\n');
            s
        }
        _ => render_text(&header, &report, args.top),
    };
    let html = html.then(|| moeconf_report::render_sweep(&html_view(&header, &report, &pieces)));
    Ok(SweepOutputs { doc, stdout, html })
}

/// The identity of a sweep run, recorded in its partial results.
pub fn identity(args: &SweepArguments, inputs: Value, jobs: usize) -> Result<RunIdentity> {
    Ok(RunIdentity {
        moeconf_version: moeconf_shard::MOECONF_VERSION.into(),
        command: COMMAND.into(),
        arguments: serde_json::to_value(args)?,
        inputs,
        jobs: vec![JobGroup {
            name: JOB_GROUP.into(),
            jobs,
        }],
    })
}

/// The digests of what a sweep reads (the model's configuration and weights,
/// the tokenizer), for its partial results.
pub fn inputs(m: &LoadedModel) -> Result<Value> {
    let identity = moeconf_runner::model_identity(&m.name, &m.dir, crate::ALGORITHM)?;
    let tok_path = m.dir.join("tokenizer.json");
    let tok = moeconf_output::input::read_input(&tok_path, "tokenizer file")
        .map_err(moeconf_schema::InputError::from)?;
    Ok(crate::inputs_json(&identity, &crate::ALGORITHM.hash(&tok)))
}

/// The arguments of a sweep rebuilt from the partials of every shard, checked
/// against the job list.
pub fn merged(m: &Merged) -> Result<SweepArguments> {
    let run = m.run();
    if run.command != COMMAND {
        return Err(CalibrateError::Merge(format!(
            "the partials are of `moeconf {}`, not of `moeconf {COMMAND}`",
            run.command
        )));
    }
    let args: SweepArguments = serde_json::from_value(run.arguments.clone())
        .map_err(|e| CalibrateError::Merge(format!("the recorded arguments: {e}")))?;
    let want = sweep_job_count(&args.schemes()?);
    if run.jobs.len() != 1 || run.jobs[0].name != JOB_GROUP || run.jobs[0].jobs != want {
        return Err(CalibrateError::Merge(format!(
            "the job list does not match the arguments ({want} branch jobs expected)"
        )));
    }
    if let Some(f) = m.files().first() {
        return Err(CalibrateError::Merge(format!(
            "a sweep writes no files, but {:?} is attached",
            f.name
        )));
    }
    Ok(args)
}

/// What the sweep's HTML page shows ([`moeconf_report::render_sweep`]): the
/// header, the native branch and every forked branch with its tokens' texts
/// (`pieces`, per job: the reference's, then each branch's).
pub fn html_view(h: &SweepHeader<'_>, r: &SweepReport, pieces: &[Vec<String>]) -> SweepView {
    let branch = |b: &BranchResult, p: Option<&Vec<String>>| SweepBranch {
        label: b.label.clone(),
        tokens: b.tokens.clone(),
        pieces: p.cloned().unwrap_or_default(),
    };
    let p = &r.point;
    let fork = match p.position {
        Some(pos) => format!("layer {} step {} position {pos}", p.layer, p.step),
        None => format!("layer {} step {}", p.layer, p.step),
    };
    SweepView {
        header: vec![
            ("model".into(), h.model.into()),
            ("prompt".into(), h.prompt.into()),
            ("precision".into(), h.precision.into()),
            ("base contract".into(), h.base_contract.into()),
            ("fork".into(), fork),
            ("generated tokens per branch".into(), r.max_new_tokens.to_string()),
        ],
        reference: branch(&r.reference, pieces.first()),
        branches: r
            .branches
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, b)| branch(b, pieces.get(i + 1)))
            .collect(),
    }
}

/// What `moeconf sweep` is asked, once its arguments are parsed and its
/// model loaded: the one entry point a command (or a program) calls.
pub struct SweepRequest<'a> {
    pub model: &'a LoadedModel,
    pub prompt: &'a str,
    /// Where every branch forks.
    pub point: ForkPoint,
    /// Tokens generated per branch.
    pub max_new_tokens: u32,
    /// The schemes, explicit branches and branch limit.
    pub schemes: SchemeRequest<'a>,
    /// The combine of every other MoE event (the base).
    pub combine: &'a CombineChoice,
    pub precision: moeconf_reference_runtime::precision::Precision,
    /// Digest algorithm of the branch fingerprints.
    pub algorithm: Algorithm,
    /// The report's format name (`text` or `json`) and its top list's length.
    pub format: &'a str,
    /// Branches listed per scheme in the text report.
    pub top: usize,
    /// The shard to run; `None`: the whole sweep.
    pub shard: Option<Shard>,
    /// Whether the whole sweep's outputs include the HTML page.
    pub html: bool,
    pub progress: ProgressMode,
}

/// What a sweep produced.
pub enum SweepOutcome {
    /// A shard's partial result: the run's identity and this shard's job
    /// results, for `moeconf_shard::write_partial`.
    Partial {
        /// The run's identity (arguments and input digests).
        identity: RunIdentity,
        shard: Shard,
        /// This shard's job results.
        results: Vec<JobResult>,
    },
    /// The whole sweep's outputs.
    Whole(SweepOutputs),
}

/// A finished sweep: its outcome and the one line that says how it went.
pub struct SweepRun {
    pub outcome: SweepOutcome,
    /// `moeconf sweep: N branches ...` (stderr, unless quiet).
    pub finished: String,
}

/// Runs the sweep `req` asks: checks the fork point and the prompt against
/// the model, builds the schemes and the base combine, runs this shard's
/// jobs (every job without a shard) and returns the partial result or the
/// whole sweep's outputs.
pub fn run(req: &SweepRequest<'_>) -> Result<SweepRun> {
    let m = req.model;
    let cfg = m.model.config();
    let k = cfg.experts_per_tok;
    let layers = cfg.layer_types.len();
    let prompt_ids = m.tokenizer.encode_for(req.prompt, cfg.vocab_size)?;
    if prompt_ids.is_empty() {
        return Err(CalibrateError::Invalid(format!(
            "the prompt {:?} tokenizes to no tokens",
            req.prompt
        )));
    }
    moeconf_runner::limits::check_prompt_tokens(prompt_ids.len())?;
    check_fork_point(req.point, true, prompt_ids.len(), req.max_new_tokens, layers)?;
    let schemes = build_schemes(&req.schemes, k)?;
    for s in &schemes {
        let field = match s.name.as_str() {
            "explicit" => Field::Branch,
            _ => Field::Scheme,
        };
        for b in &s.branches {
            check_contract_precision(&b.contract, req.precision, field)?;
        }
    }
    let base = build_combine(req.combine, k, req.prompt, layers, req.precision)?;
    let args = SweepArguments {
        model: m.name.clone(),
        prompt: req.prompt.to_string(),
        prompt_ids: prompt_ids.clone(),
        fork_layer: req.point.layer,
        fork_step: req.point.step,
        fork_position: req.point.position,
        schemes: req.schemes.schemes.to_vec(),
        branches: req.schemes.branches.to_vec(),
        limit: req.schemes.limit,
        max_new_tokens: req.max_new_tokens as usize,
        precision: req.precision.name().into(),
        base_contract: base.contract.clone(),
        base_schedule: base.schedule.clone(),
        algorithm: req.algorithm.name().into(),
        experts_per_tok: k,
        format: req.format.into(),
        top: req.top,
    };
    let shard = req.shard.unwrap_or(Shard::WHOLE);
    // The inputs' digests (every weight hashed) only for a partial result.
    let run_inputs = req.shard.is_some().then(|| inputs(m)).transpose()?;
    let opts = moeconf_reference_runtime::fork::SweepOptions {
        point: req.point,
        max_new_tokens: req.max_new_tokens as usize,
        precision: req.precision,
        base: base.combine.as_ref(),
        detokenizer: Some(&m.tokenizer as &dyn Detokenize),
        algorithm: req.algorithm,
        canon: moeconf_fingerprint::CanonPolicy::default(),
    };
    let t = std::time::Instant::now();
    let jobs = SweepJobs::prepare(&m.model, &prompt_ids, &schemes, &opts)?;
    let mine: Vec<usize> = shard.jobs(jobs.count()).collect();
    let progress = Progress::new(req.progress, "sweep", "branches", mine.len());
    let results = run_jobs(&jobs, &mine, &m.tokenizer, &progress)?;
    progress.finish();
    let finished = finish_message(mine.len(), jobs.count(), shard, t.elapsed().as_secs_f64());
    let outcome = match run_inputs {
        Some(inputs) => SweepOutcome::Partial {
            identity: identity(&args, inputs, jobs.count())?,
            shard,
            results: mine
                .iter()
                .zip(results)
                .map(|(&job, result)| JobResult { job, result })
                .collect(),
        },
        None => SweepOutcome::Whole(outputs(&args, &results, req.html)?),
    };
    Ok(SweepRun { outcome, finished })
}
