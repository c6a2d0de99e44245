//! Trace-freeze-fork (paper section 2.4.1): run a request natively up to a
//! fork point, freeze the complete decode state there ([`Snapshot`]), and run
//! many continuations from the frozen state, each changing only one MoE
//! aggregation ([`sweep`]).
//!
//! # Fork point and snapshot
//!
//! A [`ForkPoint`] names a layer L and a forward step s (by default s = 1, the
//! forward that consumes the first emitted token g_1, the paper's
//! FORK_TOKEN = −1). Steps before s do not contain the forked event, so every
//! branch executes them identically: [`Snapshot::freeze`] runs steps 0..s once
//! with the base combine and keeps the [`DecodeState`] *before* step s's
//! forward (persistent caches, position, step counter, pending token g_s,
//! prompt and generated tokens). [`Snapshot::continue_with`] clones that state
//! and runs steps s..N−1 (N = `max_new_tokens`) with any combine. A
//! continuation is bitwise identical to a full replay of the same branch from
//! scratch (the prefix records of the replay are the freeze's records; tested
//! in `tests/fork.rs`).
//!
//! # Sweep
//!
//! [`sweep`] freezes once, then runs a native reference branch (the base
//! combine everywhere) and every [`Branch`] of every [`Scheme`] (e.g. all 720
//! A permutation indices, all 360 B classes for k = 6) in parallel with rayon,
//! one task per branch. Each branch captures every level through a
//! [`DigestSink`] that hashes records instead of storing them. Branch results
//! are collected in branch order and every per-branch value is computed by one
//! thread in a fixed order, so the [`SweepReport`] does not depend on the
//! thread count. Per scheme, [`SchemeSummary`] counts the paper's table
//! columns (section 3.2): raw permutations, structural classes, distinct MoE
//! outputs, distinct post-mHC states and continuation basins with their
//! rank-frequency.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};

use moeconf_fingerprint::{
    record_digest_with_sink, Algorithm, CanonPolicy, Component, Coord, Digest, Level, StreamHasher,
    TensorView,
};
use rayon::prelude::*;

use crate::capture::{CaptureError, CaptureSink};
use crate::error::RuntimeError;
use crate::generate::Generation;
use crate::model::{Model, StepOptions};
use crate::precision::Precision;
use crate::state::DecodeState;
use crate::tokenizer::Detokenize;
use moeconf_contract::{
    b_class_count, factorial, AggregationContract, CombineEvent, ForkCombine, ForkPoint, MoeCombine, Order,
    MAX_ENUMERATED_K,
};

/// The frozen state of a request just before the forward of a fork step.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    state: DecodeState,
    prompt: Vec<u32>,
}

impl Snapshot {
    /// Runs steps `0..fork_step` of the greedy generation after `prompt_ids`
    /// with `opts` (records go to `sink`) and freezes the state before step
    /// `fork_step`'s forward. `fork_step = 0` freezes the empty state (a
    /// prefill fork); `fork_step = 1` is the state after prefill with g_1 pending.
    pub fn freeze(
        model: &Model,
        prompt_ids: &[u32],
        fork_step: u32,
        opts: &StepOptions<'_>,
        sink: &mut dyn CaptureSink,
    ) -> Result<Snapshot, RuntimeError> {
        if prompt_ids.is_empty() {
            return Err(RuntimeError::Input("the prompt has no tokens".into()));
        }
        let mut snap = Snapshot {
            state: model.new_state(),
            prompt: prompt_ids.to_vec(),
        };
        while snap.state.step < fork_step {
            snap.advance(model, opts, sink)?;
        }
        Ok(snap)
    }

    /// The frozen decode state (its `step` is the fork step).
    pub fn state(&self) -> &DecodeState {
        &self.state
    }

    /// The forward step the snapshot is frozen before.
    pub fn step(&self) -> u32 {
        self.state.step
    }

    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// Runs one forward from the current state (the prompt at step 0, else
    /// the pending token).
    fn advance(
        &mut self,
        model: &Model,
        opts: &StepOptions<'_>,
        sink: &mut dyn CaptureSink,
    ) -> Result<Vec<f32>, RuntimeError> {
        let out = if self.state.step == 0 {
            model.step(&mut self.state, &self.prompt, opts, sink)?
        } else {
            let next = self
                .state
                .pending
                .ok_or_else(|| RuntimeError::Input("the frozen state has no pending token".into()))?;
            model.step(&mut self.state, &[next], opts, sink)?
        };
        Ok(out.logits)
    }

    /// Continues the frozen request to `max_new_tokens` generated tokens
    /// (steps `self.step()..max_new_tokens`) with `opts`, emitting the
    /// records of those steps to `sink`. Returns the whole generation (all
    /// generated tokens g_1..g_N, including those predicted before the fork).
    /// The snapshot itself is unchanged, so it can be continued again.
    pub fn continue_with(
        &self,
        model: &Model,
        max_new_tokens: usize,
        opts: &StepOptions<'_>,
        sink: &mut dyn CaptureSink,
    ) -> Result<Generation, RuntimeError> {
        if max_new_tokens <= self.state.step as usize {
            return Err(RuntimeError::Input(format!(
                "a continuation from a snapshot at step {} needs max_new_tokens > {} (got {max_new_tokens})",
                self.state.step, self.state.step
            )));
        }
        let mut run = self.clone();
        let mut last_logits = Vec::new();
        while (run.state.step as usize) < max_new_tokens {
            last_logits = run.advance(model, opts, sink)?;
        }
        Ok(Generation {
            tokens: run.state.generated.clone(),
            last_logits,
            state: run.state,
        })
    }
}

/// One branch of a fork: the contract (with its order) used at the fork event.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Branch {
    /// Short label, e.g. `index:17` or `class:135`.
    pub label: String,
    /// The contract applied at the fork event.
    pub contract: AggregationContract,
    /// How many raw permutations this branch stands for (2 for a B class
    /// with k ≥ 2, else 1): the raw-permutation measure of basins.
    pub weight: u64,
}

/// All branches of one scheme plus the counts of its full enumeration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheme {
    /// Scheme name as given (`a`, `b`, `c`, …).
    pub name: String,
    /// The contract family (order ignored).
    pub family: AggregationContract,
    /// k! : raw permutations of the k routed terms.
    pub raw_permutations: u64,
    /// Structural classes: k!/2 for B-like contracts (first-pair symmetry), else k!.
    pub structural_classes: u64,
    /// The branches to evaluate (all structural classes unless truncated).
    pub branches: Vec<Branch>,
}

impl Scheme {
    /// Every structural class of contract family `name` for k terms: for a
    /// B-like family (BF16 operands and accumulator) the k!/2 class
    /// representatives (`class:0..`), otherwise all k! permutation indices
    /// (`index:0..`, lexicographic; distinct A permutations are not merged).
    /// k ≤ [`MAX_ENUMERATED_K`].
    pub fn enumerate(name: &str, k: usize) -> Result<Scheme, RuntimeError> {
        let bad = |e: moeconf_contract::ContractError| RuntimeError::Input(format!("scheme {name:?}: {e}"));
        let family = AggregationContract::parse(name).map_err(bad)?;
        if k > MAX_ENUMERATED_K {
            return Err(RuntimeError::Input(format!(
                "scheme {name:?}: k = {k} terms is too many to enumerate (at most {MAX_ENUMERATED_K})"
            )));
        }
        let raw = factorial(k).unwrap_or(1);
        let (classes, branches) = if family.is_b_like() {
            let n = b_class_count(k).map_err(bad)?;
            let w = if k >= 2 { 2 } else { 1 };
            let b = (0..n)
                .map(|c| Branch {
                    label: format!("class:{c}"),
                    contract: family.clone().with_order(Order::BClass(c)),
                    weight: w,
                })
                .collect();
            (n, b)
        } else {
            let b = (0..raw)
                .map(|i| Branch {
                    label: format!("index:{i}"),
                    contract: family.clone().with_order(Order::PermutationIndex(i)),
                    weight: 1,
                })
                .collect();
            (raw, b)
        };
        Ok(Scheme {
            name: name.to_string(),
            family: family.with_order(Order::Identity),
            raw_permutations: raw,
            structural_classes: classes,
            branches,
        })
    }

    /// A scheme of explicitly listed branches (e.g. one contract per branch).
    pub fn explicit(name: &str, family: AggregationContract, branches: Vec<Branch>, k: usize) -> Scheme {
        let raw = factorial(k).unwrap_or(1);
        let classes = if family.is_b_like() {
            b_class_count(k).unwrap_or(raw)
        } else {
            raw
        };
        Scheme {
            name: name.to_string(),
            family,
            raw_permutations: raw,
            structural_classes: classes,
            branches,
        }
    }

    /// Keeps only the first `n` branches (for quick runs and tests); the
    /// enumeration counts are unchanged.
    pub fn truncate(&mut self, n: usize) {
        self.branches.truncate(n);
    }
}

/// Options of a [`sweep`].
#[derive(Clone, Copy)]
pub struct SweepOptions<'a> {
    /// The forked event: layer and step (and optionally position).
    pub point: ForkPoint,
    /// Generated tokens per branch (steps 0..N−1); must exceed `point.step`.
    pub max_new_tokens: usize,
    pub precision: Precision,
    /// The combine of every event except the fork event (the runtime's native one by default).
    pub base: &'a dyn MoeCombine,
    /// Decoder for `text.continuation` records and branch texts.
    pub detokenizer: Option<&'a dyn Detokenize>,
    /// Digest algorithm of the record digests.
    pub algorithm: Algorithm,
    /// Canonicalization policy of the record digests.
    pub canon: CanonPolicy,
}

/// The routes and tokens of one forward step of a branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRoutes {
    /// Forward step.
    pub step: u32,
    /// Token ids consumed (`token.input`).
    pub input: Vec<u32>,
    /// Predicted id (`token.output`).
    pub output: u32,
    /// `router.topk` per layer at the last position of the step (selection order).
    pub topk: Vec<Vec<u32>>,
}

/// What one branch produced (every value computed by one thread in execution order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BranchResult {
    /// The branch label (`reference` for the native reference).
    pub label: String,
    /// The fork contract's description.
    pub contract: String,
    /// Raw permutations represented.
    pub weight: u64,
    /// Digest of the `moe.combine` output(s) of the fork layer at the fork
    /// step: the record digest if there is one event, else the algorithm's
    /// hash of the record digests in order.
    pub fork_moe: Digest,
    /// Same for `layer.post_ffn_mhc` of the fork layer at the fork step.
    pub fork_post_mhc: Digest,
    /// Routes and tokens of every step the branch ran (fork step onwards).
    pub steps: Vec<StepRoutes>,
    /// All generated ids g_1..g_N (the ones before the fork are shared).
    pub tokens: Vec<u32>,
    /// Decoded continuation (all generated ids), when a detokenizer was given.
    pub text: Option<String>,
    /// Records the branch emitted (fork step onwards, every level).
    pub records: u64,
    /// The algorithm's hash of all the branch's record digests in emission order.
    pub digest: Digest,
}

/// One continuation basin: the branches with the same continuation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Basin {
    /// The continuation text (or the token ids joined by spaces without a detokenizer).
    pub text: String,
    /// The generated ids.
    pub tokens: Vec<u32>,
    /// Branches (structural classes) in the basin.
    pub branches: usize,
    /// Raw permutations in the basin.
    pub raw_permutations: u64,
    /// Index (in the scheme's branch list) of the first branch of the basin.
    pub first_branch: usize,
}

/// The paper's per-scheme counts (section 3.2 table) for one sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemeSummary {
    /// Scheme name.
    pub scheme: String,
    /// Contract family description.
    pub family: String,
    /// k! of the full enumeration.
    pub raw_permutations: u64,
    /// Structural classes of the full enumeration.
    pub structural_classes: u64,
    /// Branches actually evaluated.
    pub evaluated: usize,
    /// Distinct fork MoE outputs among evaluated branches.
    pub distinct_moe_outputs: usize,
    /// Distinct post-mHC states at the fork layer.
    pub distinct_post_mhc: usize,
    /// Branches whose fork post-mHC state differs from the native reference.
    pub post_mhc_differs_from_reference: usize,
    /// Distinct continuations (generated id sequences).
    pub distinct_continuations: usize,
    /// Distinct continuation texts = basins (equal to the above without a detokenizer).
    pub basins: usize,
    /// Basins by decreasing size (ties: earlier first branch first).
    pub basin_rank_frequency: Vec<Basin>,
}

/// Results of a [`sweep`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepReport {
    pub point: ForkPoint,
    /// Generated tokens per branch.
    pub max_new_tokens: usize,
    /// The native reference branch (base combine at every event).
    pub reference: BranchResult,
    /// Per scheme: its branches' results in branch order.
    pub branches: Vec<Vec<BranchResult>>,
    /// Per scheme: the summary.
    pub summaries: Vec<SchemeSummary>,
}

/// A [`MoeCombine`] borrowing another (so a `&dyn MoeCombine` can be a fork base).
#[derive(Clone, Copy)]
struct BaseRef<'a>(&'a dyn MoeCombine);

impl MoeCombine for BaseRef<'_> {
    fn combine(&self, event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        self.0.combine(event, terms, shared, out)
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}

/// A capture sink that hashes every record instead of storing it: the chain
/// digest of all record digests, plus the fork digests, routes and tokens a
/// sweep reports.
pub struct DigestSink {
    alg: Algorithm,
    canon: CanonPolicy,
    point: ForkPoint,
    chain: StreamHasher,
    records: u64,
    fork_moe: Vec<Digest>,
    fork_post_mhc: Vec<Digest>,
    steps: BTreeMap<u32, StepRoutes>,
    layers: usize,
}

impl DigestSink {
    /// A sink hashing with `alg`/`canon`, watching the fork event `point` of a
    /// model with `layers` decoder layers.
    pub fn new(alg: Algorithm, canon: CanonPolicy, point: ForkPoint, layers: usize) -> DigestSink {
        DigestSink {
            alg,
            canon,
            point,
            chain: alg.hasher(),
            records: 0,
            fork_moe: Vec::new(),
            fork_post_mhc: Vec::new(),
            steps: BTreeMap::new(),
            layers,
        }
    }

    /// Number of records hashed so far.
    pub fn records(&self) -> u64 {
        self.records
    }

    fn fold(&self, ds: &[Digest]) -> Digest {
        match ds {
            [one] => *one,
            many => {
                let mut h = self.alg.hasher();
                for d in many {
                    h.update(&d.0);
                }
                h.finalize()
            }
        }
    }

    /// The chain digest, the fork digests and the per-step routes.
    fn finish(self) -> (Digest, Digest, Digest, Vec<StepRoutes>, u64) {
        let moe = self.fold(&self.fork_moe);
        let post = self.fold(&self.fork_post_mhc);
        let steps = self.steps.into_values().collect();
        (self.chain.finalize(), moe, post, steps, self.records)
    }
}

fn ints(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32)
        .collect()
}

impl CaptureSink for DigestSink {
    fn wants(&self, _level: Level) -> bool {
        true
    }

    fn record(&mut self, coord: Coord, level: Level, tensor: TensorView<'_>) -> Result<(), CaptureError> {
        let d = record_digest_with_sink(self.alg, self.canon, &coord, level, tensor, false, |_| Ok(()))
            .map_err(|e| CaptureError::new(format!("fingerprinting {}: {e}", coord.path)))?;
        self.chain.update(&d.0);
        self.records += 1;
        let at_fork = coord.layer == Some(self.point.layer)
            && coord.step == self.point.step
            && self.point.position.is_none_or(|p| p == coord.position);
        let layers = self.layers;
        let entry = || StepRoutes {
            step: coord.step,
            input: Vec::new(),
            output: 0,
            topk: vec![Vec::new(); layers],
        };
        match Component::parse(&coord.path).map(|(c, _)| c) {
            Some(Component::MoeCombine) if at_fork => self.fork_moe.push(d),
            Some(Component::LayerPostFfnMhc) if at_fork => self.fork_post_mhc.push(d),
            Some(Component::TokenInput) => {
                self.steps.entry(coord.step).or_insert_with(entry).input = ints(tensor.bytes)
            }
            Some(Component::TokenOutput) => {
                let s = self.steps.entry(coord.step).or_insert_with(entry);
                s.output = ints(tensor.bytes).first().copied().unwrap_or(0);
            }
            Some(Component::RouterTopk) => {
                // Positions come in order, so the last write is the last position.
                let s = self.steps.entry(coord.step).or_insert_with(entry);
                if let Some(slot) = coord.layer.and_then(|l| s.topk.get_mut(l as usize)) {
                    *slot = ints(tensor.bytes);
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// Runs one branch from the snapshot with `combine` and hashes its records.
fn run_branch(
    model: &Model,
    snap: &Snapshot,
    opts: &SweepOptions<'_>,
    combine: &dyn MoeCombine,
    label: &str,
    weight: u64,
) -> Result<BranchResult, RuntimeError> {
    let mut sink = DigestSink::new(
        opts.algorithm,
        opts.canon,
        opts.point,
        model.config().num_layers(),
    );
    let sopts = StepOptions {
        precision: opts.precision,
        combine,
        detokenizer: opts.detokenizer,
        allow_non_finite: false,
    };
    let g = snap.continue_with(model, opts.max_new_tokens, &sopts, &mut sink)?;
    if sink.fork_moe.is_empty() {
        let p = opts.point;
        return Err(RuntimeError::Input(format!(
            "the fork point (layer {}, step {}{}) matched no MoE event",
            p.layer,
            p.step,
            p.position.map(|x| format!(", position {x}")).unwrap_or_default()
        )));
    }
    let text = match opts.detokenizer {
        Some(d) => Some(d.decode(&g.tokens)?),
        None => None,
    };
    let (digest, fork_moe, fork_post_mhc, steps, records) = sink.finish();
    Ok(BranchResult {
        label: label.to_string(),
        contract: combine.describe(),
        weight,
        fork_moe,
        fork_post_mhc,
        steps,
        tokens: g.tokens,
        text,
        records,
        digest,
    })
}

/// Summarizes one scheme's branch results against the reference.
pub fn summarize(scheme: &Scheme, results: &[BranchResult], reference: &BranchResult) -> SchemeSummary {
    let distinct = |f: &dyn Fn(&BranchResult) -> Digest| {
        results
            .iter()
            .map(f)
            .collect::<std::collections::HashSet<_>>()
            .len()
    };
    let continuations = results
        .iter()
        .map(|r| r.tokens.clone())
        .collect::<std::collections::HashSet<_>>()
        .len();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut basins: Vec<Basin> = Vec::new();
    for (i, r) in results.iter().enumerate() {
        let text = r.text.clone().unwrap_or_else(|| {
            r.tokens
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        });
        match index.get(&text) {
            Some(&b) => {
                basins[b].branches += 1;
                basins[b].raw_permutations += r.weight;
            }
            None => {
                index.insert(text.clone(), basins.len());
                basins.push(Basin {
                    text,
                    tokens: r.tokens.clone(),
                    branches: 1,
                    raw_permutations: r.weight,
                    first_branch: i,
                });
            }
        }
    }
    // Stable sort: ties keep first-branch order.
    basins.sort_by_key(|b| std::cmp::Reverse(b.branches));
    SchemeSummary {
        scheme: scheme.name.clone(),
        family: scheme.family.describe(),
        raw_permutations: scheme.raw_permutations,
        structural_classes: scheme.structural_classes,
        evaluated: results.len(),
        distinct_moe_outputs: distinct(&|r| r.fork_moe),
        distinct_post_mhc: distinct(&|r| r.fork_post_mhc),
        post_mhc_differs_from_reference: results
            .iter()
            .filter(|r| r.fork_post_mhc != reference.fork_post_mhc)
            .count(),
        distinct_continuations: continuations,
        basins: basins.len(),
        basin_rank_frequency: basins,
    }
}

/// The number of jobs of a sweep of `schemes`: the native reference, then
/// every branch of every scheme in order ([`SweepJobs::run`]).
pub fn sweep_job_count(schemes: &[Scheme]) -> usize {
    1 + schemes.iter().map(|s| s.branches.len()).sum::<usize>()
}

/// Checks a sweep's request: the fork layer exists, the fork step runs, every
/// branch contract fits k.
fn check_sweep(model: &Model, schemes: &[Scheme], opts: &SweepOptions<'_>) -> Result<(), RuntimeError> {
    let cfg = model.config();
    if opts.point.layer as usize >= cfg.num_layers() {
        return Err(RuntimeError::Input(format!(
            "fork layer {} is out of range: the model has {} layers",
            opts.point.layer,
            cfg.num_layers()
        )));
    }
    if opts.max_new_tokens <= opts.point.step as usize {
        return Err(RuntimeError::Input(format!(
            "a fork at step {} needs max_new_tokens > {} (got {})",
            opts.point.step, opts.point.step, opts.max_new_tokens
        )));
    }
    let k = cfg.experts_per_tok;
    for s in schemes {
        for b in &s.branches {
            b.contract
                .validate_for_k(k)
                .map_err(|e| RuntimeError::Input(format!("scheme {:?}, branch {}: {e}", s.name, b.label)))?;
        }
    }
    Ok(())
}

/// A sweep cut into its independent jobs, so that any subset can run (one
/// shard of a sweep spread over machines, docs/scale.md): job 0 is the
/// native reference, job 1 + i the i-th branch of the schemes' branches
/// flattened in order. Every job runs from the same frozen snapshot, and its
/// [`BranchResult`] does not depend on which other jobs run, or where.
pub struct SweepJobs<'a> {
    model: &'a Model,
    opts: SweepOptions<'a>,
    snap: Snapshot,
    /// The branch of job 1 + i.
    branches: Vec<Branch>,
}

impl<'a> SweepJobs<'a> {
    /// Checks the request and freezes the request at `opts.point.step`
    /// (running the steps before it with the base combine).
    pub fn prepare(
        model: &'a Model,
        prompt_ids: &[u32],
        schemes: &[Scheme],
        opts: &SweepOptions<'a>,
    ) -> Result<SweepJobs<'a>, RuntimeError> {
        check_sweep(model, schemes, opts)?;
        let base = BaseRef(opts.base);
        let freeze_opts = StepOptions {
            precision: opts.precision,
            combine: &base,
            detokenizer: opts.detokenizer,
            allow_non_finite: false,
        };
        let mut null = crate::capture::NullSink;
        let snap = Snapshot::freeze(model, prompt_ids, opts.point.step, &freeze_opts, &mut null)?;
        Ok(SweepJobs {
            model,
            opts: *opts,
            snap,
            branches: schemes.iter().flat_map(|s| s.branches.iter().cloned()).collect(),
        })
    }

    /// The number of jobs ([`sweep_job_count`]).
    pub fn count(&self) -> usize {
        1 + self.branches.len()
    }

    /// Runs job `job`: the native reference (0) or a branch.
    pub fn run(&self, job: usize) -> Result<BranchResult, RuntimeError> {
        let base = BaseRef(self.opts.base);
        if job == 0 {
            return run_branch(self.model, &self.snap, &self.opts, &base, "reference", 1);
        }
        let b = self
            .branches
            .get(job - 1)
            .ok_or_else(|| RuntimeError::Input(format!("the sweep has no job {job}")))?;
        let fork = ForkCombine::with_base(base, self.opts.point, b.contract.clone());
        run_branch(self.model, &self.snap, &self.opts, &fork, &b.label, b.weight)
    }
}

/// Builds the [`SweepReport`] of a sweep of `schemes` from the results of
/// all its jobs in job order ([`SweepJobs`]): the reference, then each
/// scheme's branches, summarized.
pub fn assemble_sweep(
    point: ForkPoint,
    max_new_tokens: usize,
    schemes: &[Scheme],
    results: Vec<BranchResult>,
) -> Result<SweepReport, RuntimeError> {
    if results.len() != sweep_job_count(schemes) {
        return Err(RuntimeError::Input(format!(
            "a sweep of these schemes has {} jobs, {} results were given",
            sweep_job_count(schemes),
            results.len()
        )));
    }
    let mut it = results.into_iter();
    let reference = it
        .next()
        .ok_or_else(|| RuntimeError::Input("the sweep produced no reference branch".into()))?;
    let mut branches = Vec::with_capacity(schemes.len());
    let mut summaries = Vec::with_capacity(schemes.len());
    for s in schemes {
        let rs: Vec<BranchResult> = it.by_ref().take(s.branches.len()).collect();
        summaries.push(summarize(s, &rs, &reference));
        branches.push(rs);
    }
    Ok(SweepReport {
        point,
        max_new_tokens,
        reference,
        branches,
        summaries,
    })
}

/// Freezes the request at `opts.point.step` (running the steps before it with
/// the base combine), then runs the native reference and every branch of every
/// scheme from the snapshot in parallel (rayon, one task per branch), and
/// summarizes. `progress(done, total)` is called after each finished branch
/// (from worker threads, in completion order; it never affects results).
pub fn sweep(
    model: &Model,
    prompt_ids: &[u32],
    schemes: &[Scheme],
    opts: &SweepOptions<'_>,
    progress: Option<&(dyn Fn(usize, usize) + Sync)>,
) -> Result<SweepReport, RuntimeError> {
    let jobs = SweepJobs::prepare(model, prompt_ids, schemes, opts)?;
    let total = jobs.count();
    let done = AtomicUsize::new(0);
    let results: Vec<BranchResult> = (0..total)
        .into_par_iter()
        .map(|j| {
            let r = jobs.run(j);
            let n = done.fetch_add(1, Ordering::Relaxed) + 1;
            if let Some(p) = progress {
                p(n, total);
            }
            r
        })
        .collect::<Result<_, _>>()?;
    assemble_sweep(opts.point, opts.max_new_tokens, schemes, results)
}
