//! Protocols 3–5 (paper sections 2.4.5, 2.4.6, 2.7, 3.6; tables B.4, B.5):
//!
//! 3. persistent layer-static ablation: the three depth prompts × S request
//!    seeds × P32/C/A/B, each a greedy run whose every MoE layer uses the
//!    seed's layer-static permutation; native route divergence, native
//!    token-sequence divergence and unique continuations;
//! 4. same-mode canonical reference: the identity order per scheme and
//!    prompt; canonical-vs-native and random-vs-canonical divergence;
//! 5. C intermediate check: every C run's MoE outputs, post-mHC states,
//!    router scores (hence every next router) and LM logits, at every step,
//!    layer and position, bitwise equal to the native run's. Must hold.
//!
//! Routes are every `router.topk` record of the run (all steps, layers and
//! positions); token sequences are the generated ids.

use std::collections::HashSet;

use moeconf_contract::{
    prompt_hash, AggregationContract, MoeCombine, NativeCombine, Schedule, ScheduledCombine,
    DEFAULT_EXPERIMENT_SEED,
};
use moeconf_fingerprint::Component;
use moeconf_fixtures::Prompt;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::jobs::{decode, JobOut, Jobs, Params};
use crate::{frac, max_abs_diff, CalibrateError, Claim, Collect, Ctx, Kept, Result, Section, Table};

/// One of the paper's four aggregation schemes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaperScheme {
    /// FP32 operands and accumulator.
    P32,
    /// BF16 operands, FP32 accumulator (order-invariant on BF16 values).
    C,
    /// BF16 operands, BF16 accumulator after the first sum.
    A,
    /// BF16 operands and accumulator.
    B,
}

impl PaperScheme {
    /// The scheme's preset name (`p32`, `c`, `a`, `b`).
    pub fn name(self) -> &'static str {
        match self {
            PaperScheme::P32 => "p32",
            PaperScheme::C => "c",
            PaperScheme::A => "a",
            PaperScheme::B => "b",
        }
    }

    /// The scheme's contract, identity order.
    pub fn contract(self) -> AggregationContract {
        match self {
            PaperScheme::P32 => AggregationContract::p32(),
            PaperScheme::C => AggregationContract::c(),
            PaperScheme::A => AggregationContract::a(),
            PaperScheme::B => AggregationContract::b(),
        }
    }
}

/// The paper's four schemes, in table order.
pub const SCHEMES: [PaperScheme; 4] = [PaperScheme::P32, PaperScheme::C, PaperScheme::A, PaperScheme::B];

/// The intermediates of the C check, in the order of table B.5's groups
/// (MoE, post-mHC, router, LM).
const INTERMEDIATES: [Component; 4] = [
    Component::MoeCombine,
    Component::LayerPostFfnMhc,
    Component::RouterScores,
    Component::LmLogits,
];

/// What a run keeps besides its routes and tokens.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// Routes only.
    Routes,
    /// Routes and the C check's intermediates.
    Intermediates,
}

/// What one run produced.
struct RunOut {
    tokens: Vec<u32>,
    routes: Vec<Vec<u8>>,
    intermediates: Vec<Kept>,
}

fn run_one(ctx: &Ctx, ids: &[u32], combine: &dyn MoeCombine, keep: Keep) -> Result<RunOut> {
    let mut components = vec![Component::RouterTopk];
    if keep == Keep::Intermediates {
        components.extend(INTERMEDIATES);
    }
    let mut sink = Collect::new(&components);
    let state = ctx.generate(ids, ctx.sizes.tokens, combine, None, &mut sink)?;
    let (routes, intermediates): (Vec<Kept>, Vec<Kept>) = sink
        .kept
        .into_iter()
        .partition(|k| Component::RouterTopk.matches(&k.coord.path));
    Ok(RunOut {
        tokens: state.generated,
        routes: routes.into_iter().map(|k| k.bytes).collect(),
        intermediates,
    })
}

/// The C check of one run against native.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct CCheck {
    /// Records missing on one side or at another coordinate.
    missing: usize,
    /// Max |Δ| per intermediate group (the order of `INTERMEDIATES`).
    max: [f64; 4],
    /// Whether every record is bitwise equal.
    bitwise: bool,
}

fn compare_intermediates(native: &[Kept], run: &[Kept]) -> CCheck {
    let mut c = CCheck {
        missing: native.len().abs_diff(run.len()),
        max: [0.0; 4],
        bitwise: native.len() == run.len(),
    };
    for (a, b) in native.iter().zip(run) {
        if a.coord != b.coord {
            c.missing += 1;
            c.bitwise = false;
            continue;
        }
        let g = INTERMEDIATES
            .iter()
            .position(|i| i.matches(&a.coord.path))
            .unwrap_or(0);
        if a.bytes != b.bytes {
            c.bitwise = false;
        }
        c.max[g] = c.max[g].max(max_abs_diff(&a.f32s(), &b.f32s()));
    }
    c
}

/// One run of the protocols (indices into the prompts and [`SCHEMES`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Job {
    Native { prompt: usize },
    Canonical { prompt: usize, scheme: usize },
    Random { prompt: usize, scheme: usize, seed: u64 },
}

impl Job {
    /// Every job: per prompt the native run, then per scheme the canonical
    /// run and `seeds` layer-static runs.
    fn all(prompts: usize, seeds: u64) -> Vec<Job> {
        let mut jobs = Vec::new();
        for prompt in 0..prompts {
            jobs.push(Job::Native { prompt });
            for scheme in 0..SCHEMES.len() {
                jobs.push(Job::Canonical { prompt, scheme });
                for seed in 0..seeds {
                    jobs.push(Job::Random { prompt, scheme, seed });
                }
            }
        }
        jobs
    }

    /// The prompt, and whether the run is of scheme C (checked against native).
    fn prompt_and_c(self) -> (usize, bool) {
        match self {
            Job::Native { prompt } => (prompt, false),
            Job::Canonical { prompt, scheme } | Job::Random { prompt, scheme, .. } => {
                (prompt, SCHEMES[scheme] == PaperScheme::C)
            }
        }
    }

    fn run(self, ctx: &Ctx, prompts: &[Prompt], ids: &[Vec<u32>]) -> Result<RunOut> {
        let scheduled = |prompt: usize, scheme: usize, schedule: Schedule| {
            let s = SCHEMES[scheme];
            let c = ScheduledCombine::new(s.contract(), schedule, prompt_hash(&prompts[prompt].text));
            let keep = if s == PaperScheme::C {
                Keep::Intermediates
            } else {
                Keep::Routes
            };
            run_one(ctx, &ids[prompt], &c, keep)
        };
        match self {
            Job::Native { prompt } => run_one(ctx, &ids[prompt], &NativeCombine, Keep::Intermediates),
            Job::Canonical { prompt, scheme } => scheduled(prompt, scheme, Schedule::Identity),
            Job::Random { prompt, scheme, seed } => scheduled(
                prompt,
                scheme,
                Schedule::LayerStatic {
                    experiment_seed: DEFAULT_EXPERIMENT_SEED,
                    request_seed: seed,
                },
            ),
        }
    }
}

/// What a job keeps of its run (its result): the generated ids, a digest
/// of the routes, the number of C-check intermediates, and for a C run the
/// check of its intermediates against the native run of its prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct RunSummary {
    tokens: Vec<u32>,
    /// BLAKE3 (hex) of every `router.topk` record in order (each one's length, then its bytes):
    /// equal digests stand for equal routes.
    routes: String,
    intermediates: usize,
    c_check: Option<CCheck>,
}

fn routes_digest(routes: &[Vec<u8>]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&(routes.len() as u64).to_le_bytes());
    for r in routes {
        h.update(&(r.len() as u64).to_le_bytes());
        h.update(r);
    }
    h.finalize().to_hex().to_string()
}

impl RunSummary {
    fn of(out: &RunOut, c_check: Option<CCheck>) -> RunSummary {
        RunSummary {
            tokens: out.tokens.clone(),
            routes: routes_digest(&out.routes),
            intermediates: out.intermediates.len(),
            c_check,
        }
    }
}

/// The runs indexed by prompt and scheme.
struct Runs<'a> {
    native: Vec<Option<&'a RunSummary>>,
    canonical: Vec<Vec<Option<&'a RunSummary>>>,
    random: Vec<Vec<Vec<&'a RunSummary>>>,
}

impl<'a> Runs<'a> {
    fn index(prompts: usize, jobs: &[Job], outs: &'a [RunSummary]) -> Runs<'a> {
        let mut r = Runs {
            native: vec![None; prompts],
            canonical: vec![vec![None; SCHEMES.len()]; prompts],
            random: vec![vec![Vec::new(); SCHEMES.len()]; prompts],
        };
        for (job, out) in jobs.iter().zip(outs) {
            match *job {
                Job::Native { prompt } => r.native[prompt] = Some(out),
                Job::Canonical { prompt, scheme } => r.canonical[prompt][scheme] = Some(out),
                Job::Random { prompt, scheme, .. } => r.random[prompt][scheme].push(out),
            }
        }
        r
    }
}

/// Protocols 3–5's jobs: every run of [`Job::all`].
struct Persistent {
    prompts: Vec<Prompt>,
    ids: Vec<Vec<u32>>,
    jobs: Vec<Job>,
    /// The native run of each prompt that an owned job needs (its own job, or a C check).
    natives: Vec<Option<RunOut>>,
}

impl Jobs for Persistent {
    fn count(&self) -> usize {
        self.jobs.len()
    }

    fn prepare(&mut self, ctx: &Ctx, owned: &[usize]) -> Result<()> {
        let mut need = vec![false; self.prompts.len()];
        for &j in owned {
            let job = self.jobs[j];
            let (p, c) = job.prompt_and_c();
            need[p] |= c || matches!(job, Job::Native { .. });
        }
        let (prompts, ids) = (&self.prompts, &self.ids);
        self.natives = need
            .par_iter()
            .enumerate()
            .map(|(p, &n)| {
                n.then(|| Job::Native { prompt: p }.run(ctx, prompts, ids))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    fn run(&self, ctx: &Ctx, job: usize) -> Result<JobOut> {
        let j = self.jobs[job];
        let (p, c) = j.prompt_and_c();
        let native = || {
            self.natives[p].as_ref().ok_or_else(|| {
                CalibrateError::Invalid(format!("the native run of prompt {p} was not prepared"))
            })
        };
        if let Job::Native { .. } = j {
            return JobOut::of(&RunSummary::of(native()?, None));
        }
        let out = j.run(ctx, &self.prompts, &self.ids)?;
        let check = if c {
            Some(compare_intermediates(
                &native()?.intermediates,
                &out.intermediates,
            ))
        } else {
            None
        };
        JobOut::of(&RunSummary::of(&out, check))
    }
}

/// Plans protocols 3, 4 and 5.
pub fn plan(ctx: &Ctx) -> Result<Box<dyn Jobs + '_>> {
    let prompts = moeconf_fixtures::depth_prompts();
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| ctx.encode(&p.text))
        .collect::<Result<_>>()?;
    let jobs = Job::all(prompts.len(), ctx.sizes.seeds);
    ctx.note(&format!(
        "[3-5] persistent layer-static ablation, canonical reference, C check: {} runs × {} tokens",
        jobs.len(),
        ctx.sizes.tokens
    ));
    Ok(Box::new(Persistent {
        natives: Vec::new(),
        prompts,
        ids,
        jobs,
    }))
}

/// Assembles protocols 3, 4 and 5 (three sections) from their job results.
pub fn assemble(params: &Params, results: &[Value]) -> Result<Vec<Section>> {
    let prompts = moeconf_fixtures::depth_prompts();
    let jobs = Job::all(prompts.len(), params.sizes.seeds);
    let outs: Vec<RunSummary> = decode("persistent", results)?;
    if outs.len() != jobs.len() {
        return Err(CalibrateError::Merge(format!(
            "persistent: {} job results for {} runs",
            outs.len(),
            jobs.len()
        )));
    }
    let runs = Runs::index(prompts.len(), &jobs, &outs);
    let (persistent, canonical) = ablation(params, &prompts, &runs);
    Ok(vec![persistent, canonical, c_intermediate(&prompts, &runs)?])
}

/// Protocol 3 and 4 counts of one (prompt, scheme) cell, or summed over prompts.
#[derive(Default)]
struct Counts {
    /// Random runs.
    runs: usize,
    /// Random runs whose routes differ from native.
    native_route: usize,
    /// Random runs whose tokens differ from native.
    native_tokens: usize,
    /// Random runs whose routes differ from the canonical run.
    canonical_route: usize,
    /// Random runs whose tokens differ from the canonical run.
    canonical_tokens: usize,
    /// Prompts whose canonical routes differ from native.
    canonical_vs_native_route: usize,
    /// Prompts whose canonical tokens differ from native.
    canonical_vs_native_tokens: usize,
}

impl Counts {
    fn of(nat: &RunSummary, can: &RunSummary, runs: &[&RunSummary]) -> Counts {
        let count = |f: &dyn Fn(&RunSummary) -> bool| runs.iter().filter(|r| f(r)).count();
        Counts {
            runs: runs.len(),
            native_route: count(&|r| r.routes != nat.routes),
            native_tokens: count(&|r| r.tokens != nat.tokens),
            canonical_route: count(&|r| r.routes != can.routes),
            canonical_tokens: count(&|r| r.tokens != can.tokens),
            canonical_vs_native_route: usize::from(can.routes != nat.routes),
            canonical_vs_native_tokens: usize::from(can.tokens != nat.tokens),
        }
    }

    fn add(&mut self, c: &Counts) {
        self.runs += c.runs;
        self.native_route += c.native_route;
        self.native_tokens += c.native_tokens;
        self.canonical_route += c.canonical_route;
        self.canonical_tokens += c.canonical_tokens;
        self.canonical_vs_native_route += c.canonical_vs_native_route;
        self.canonical_vs_native_tokens += c.canonical_vs_native_tokens;
    }
}

/// One (prompt, scheme) cell of table B.4.
struct Cell {
    counts: Counts,
    /// Distinct token sequences over the random runs.
    unique: usize,
}

impl Cell {
    fn of(nat: &RunSummary, can: &RunSummary, random: &[&RunSummary]) -> Cell {
        Cell {
            counts: Counts::of(nat, can, random),
            unique: random
                .iter()
                .map(|r| r.tokens.clone())
                .collect::<HashSet<_>>()
                .len(),
        }
    }

    fn row(&self, prompt: &Prompt, scheme: PaperScheme) -> Vec<String> {
        let c = &self.counts;
        vec![
            format!("\"{}\"", prompt.text),
            scheme.name().to_uppercase(),
            frac(c.native_route, c.runs),
            frac(c.native_tokens, c.runs),
            self.unique.to_string(),
        ]
    }

    fn json(&self, prompt: &Prompt, scheme: PaperScheme) -> Value {
        let c = &self.counts;
        json!({
            "prompt_id": prompt.id, "scheme": scheme.name(), "schedules": c.runs,
            "native_route_divergence": c.native_route, "native_token_divergence": c.native_tokens,
            "unique_continuations": self.unique,
            "canonical_vs_native_route": c.canonical_vs_native_route == 1,
            "canonical_vs_native_tokens": c.canonical_vs_native_tokens == 1,
            "random_vs_canonical_route": c.canonical_route, "random_vs_canonical_tokens": c.canonical_tokens,
        })
    }
}

/// The three tables of protocols 3 and 4: B.4 (first part), 3.6 and B.4 (second part).
fn ablation_tables(params: &Params) -> [Table; 3] {
    let per_prompt = Table::new(
        "persistent_ablation",
        &format!(
            "Persistent layer-static ablation (table B.4): {} seeds per prompt and scheme, {} tokens",
            params.sizes.seeds, params.sizes.tokens
        ),
        &[
            "Prompt",
            "Scheme",
            "Native route divergence",
            "Native token-sequence divergence",
            "Unique continuations",
        ],
    );
    let agg = Table::new(
        "persistent_canonical_axes",
        "Persistent and same-mode reference axes (table 3.6)",
        &[
            "Scheme",
            "Native route",
            "Native token sequence",
            "Canonical route",
            "Canonical token sequence",
        ],
    );
    let canon_t = Table::new(
        "canonical_reference",
        "Same-mode canonical reference (table B.4, second part)",
        &[
            "Scheme",
            "Canonical vs. native token sequence",
            "Canonical vs. native route",
            "Random vs. canonical token sequence",
            "Random vs. canonical route",
        ],
    );
    [per_prompt, agg, canon_t]
}

/// Protocols 3 and 4: the persistent ablation (table B.4, first part, and
/// the aggregated table 3.6) and the canonical reference (table B.4, second part).
fn ablation(params: &Params, prompts: &[Prompt], runs: &Runs<'_>) -> (Section, Section) {
    let [mut per_prompt, mut agg, mut canon_t] = ablation_tables(params);
    let np = prompts.len();
    let mut json_rows = Vec::new();
    // Rows of table B.4 by (prompt, scheme), printed prompt-major as in the paper.
    let mut b4_rows: Vec<Vec<Option<Vec<String>>>> = vec![vec![None; SCHEMES.len()]; np];
    let mut json_schemes = Vec::new();
    for (si, &scheme) in SCHEMES.iter().enumerate() {
        let mut sum = Counts::default();
        for (pi, prompt) in prompts.iter().enumerate() {
            let (Some(nat), Some(can)) = (runs.native[pi], runs.canonical[pi][si]) else {
                continue;
            };
            let cell = Cell::of(nat, can, &runs.random[pi][si]);
            b4_rows[pi][si] = Some(cell.row(prompt, scheme));
            json_rows.push(cell.json(prompt, scheme));
            sum.add(&cell.counts);
        }
        let name = scheme.name();
        agg.row(vec![
            name.to_uppercase(),
            frac(sum.native_route, sum.runs),
            frac(sum.native_tokens, sum.runs),
            frac(sum.canonical_route, sum.runs),
            frac(sum.canonical_tokens, sum.runs),
        ]);
        canon_t.row(vec![
            name.to_uppercase(),
            frac(sum.canonical_vs_native_tokens, np),
            frac(sum.canonical_vs_native_route, np),
            frac(sum.canonical_tokens, sum.runs),
            frac(sum.canonical_route, sum.runs),
        ]);
        json_schemes.push(json!({
            "scheme": name, "trajectories": sum.runs,
            "native_route_divergence": sum.native_route, "native_token_divergence": sum.native_tokens,
            "canonical_route_divergence": sum.canonical_route, "canonical_token_divergence": sum.canonical_tokens,
            "canonical_vs_native_route": sum.canonical_vs_native_route,
            "canonical_vs_native_tokens": sum.canonical_vs_native_tokens, "prompts": np,
        }));
    }
    for row in b4_rows.into_iter().flatten().flatten() {
        per_prompt.row(row);
    }
    let persistent = Section {
        key: "persistent".into(),
        tables: vec![per_prompt, agg],
        json: json!({ "seeds": params.sizes.seeds, "tokens": params.sizes.tokens, "experiment_seed": DEFAULT_EXPERIMENT_SEED,
            "per_prompt": json_rows, "per_scheme": json_schemes }),
        claims: vec![],
    };
    let canonical = Section {
        key: "canonical".into(),
        tables: vec![canon_t],
        json: json!({ "per_scheme": json_schemes }),
        claims: vec![],
    };
    (persistent, canonical)
}

/// Protocol 5: the C intermediate check (table B.5).
fn c_intermediate(prompts: &[Prompt], runs: &Runs<'_>) -> Result<Section> {
    let ci = SCHEMES.iter().position(|x| *x == PaperScheme::C).unwrap_or(1);
    let mut b5 = Table::new(
        "c_intermediate_summary",
        "C intermediate check (table B.5): every step, layer and position",
        &[
            "Prompt",
            "Schedules",
            "Missing records",
            "MoE max L∞",
            "post-mHC max L∞",
            "Router max L∞",
            "LM max L∞",
            "All captured values bitwise identical",
        ],
    );
    let mut c_all = true;
    let mut c_runs = 0usize;
    let mut c_records = 0usize;
    let mut b5_json = Vec::new();
    for (pi, prompt) in prompts.iter().enumerate() {
        let Some(nat) = runs.native[pi] else { continue };
        let mut c_runs_here: Vec<&RunSummary> = runs.random[pi][ci].clone();
        if let Some(c) = runs.canonical[pi][ci] {
            c_runs_here.push(c);
        }
        let mut sum = CCheck {
            missing: 0,
            max: [0.0; 4],
            bitwise: true,
        };
        for r in &c_runs_here {
            let c = r.c_check.ok_or_else(|| {
                CalibrateError::Merge(format!(
                    "persistent: a C run of prompt {} has no C check",
                    prompt.id
                ))
            })?;
            sum.missing += c.missing;
            for (m, x) in sum.max.iter_mut().zip(c.max) {
                *m = m.max(x);
            }
            sum.bitwise &= c.bitwise && r.routes == nat.routes && r.tokens == nat.tokens;
            c_records += r.intermediates;
        }
        c_runs += c_runs_here.len();
        c_all &= sum.bitwise && nat.intermediates > 0;
        b5.row(vec![
            format!("\"{}\"", prompt.text),
            c_runs_here.len().to_string(),
            sum.missing.to_string(),
            format!("{}", sum.max[0]),
            format!("{}", sum.max[1]),
            format!("{}", sum.max[2]),
            format!("{}", sum.max[3]),
            if sum.bitwise { "yes" } else { "NO" }.into(),
        ]);
        b5_json.push(b5_json_row(prompt, c_runs_here.len(), &sum));
    }
    Ok(Section {
        key: "c_intermediate".into(),
        tables: vec![b5],
        json: json!({ "runs": c_runs, "records_compared": c_records, "all_bitwise": c_all, "per_prompt": b5_json }),
        claims: vec![Claim::new(
            "c_bitwise_native",
            c_all && c_runs > 0,
            format!(
                "{c_runs} C runs ({c_records} MoE/post-mHC/router/LM records): bitwise equal to native, same routes and tokens: {c_all}"
            ),
        )],
    })
}

fn b5_json_row(prompt: &Prompt, schedules: usize, c: &CCheck) -> Value {
    json!({
        "prompt_id": prompt.id, "schedules": schedules, "missing_records": c.missing,
        "moe_max_abs": c.max[0], "post_mhc_max_abs": c.max[1], "router_max_abs": c.max[2], "lm_max_abs": c.max[3],
        "bitwise_identical": c.bitwise,
    })
}
