//! The whole suite: runs the selected protocols in the paper's order, as
//! independent jobs (all of them, or one shard's: docs/scale.md), and
//! assembles `calibration.json`, the TSV tables and the printed report
//! (docs/calibration.md); or writes one shard's partial result, and rebuilds
//! the same outputs from the partials of every shard ([`merged`]).

use std::path::Path;
use std::time::Instant;

use moeconf_runner::{Field, FieldMessage};
use moeconf_shard::jobs::{owned, run_jobs};
use moeconf_shard::{Attachment, JobGroup, JobResult, Merged, Progress, RunIdentity, Shard};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::jobs::{JobOut, Jobs, Params, Single};
use crate::{
    breadth, fault_matrix, fork_sweep, long_fork, persistent, propagation, replay, substitution,
    CalibrateError, Claim, Ctx, Result, Section, Sizes, Table,
};

/// Version of `calibration.json` (2: no timings, so that reruns and merged
/// shards are byte-identical; the times go to stderr).
pub const CALIBRATION_SCHEMA_VERSION: u32 = 2;

/// The highest protocol number (protocols are numbered 1..=`PROTOCOL_COUNT`).
pub const PROTOCOL_COUNT: u32 = 11;

/// The command name recorded in partial results of the suite.
pub const COMMAND: &str = "calibrate";

/// One entry of the suite: how its jobs are planned and its sections assembled.
struct Protocol {
    /// Key of its progress line, timing, job group and error context.
    name: &'static str,
    /// Protocol numbers (`--only`) that select it (3, 4 and 5 run together).
    numbers: &'static [u32],
    /// Plans its jobs.
    plan: for<'a> fn(&'a Ctx) -> Result<Box<dyn Jobs + 'a>>,
    /// Assembles its sections from all its job results.
    assemble: fn(&Params, &[Value]) -> Result<Vec<Section>>,
    /// Runs only when `--only` names it (not in the default selection).
    opt_in: bool,
}

/// Protocol 6: one job.
fn post_mhc(_ctx: &Ctx) -> Result<Box<dyn Jobs + '_>> {
    Ok(Box::new(Single::new(|c| Ok(vec![substitution::post_mhc(c)?]))))
}

/// Protocol 7: one job.
fn persistent_state(_ctx: &Ctx) -> Result<Box<dyn Jobs + '_>> {
    Ok(Box::new(Single::new(|c| {
        Ok(vec![substitution::persistent_state(c)?])
    })))
}

/// Protocol 11: one job.
fn context_fork(_ctx: &Ctx) -> Result<Box<dyn Jobs + '_>> {
    Ok(Box::new(Single::new(|c| Ok(vec![long_fork::run(c)?]))))
}

/// Protocol 8: one job.
fn propagation(_ctx: &Ctx) -> Result<Box<dyn Jobs + '_>> {
    Ok(Box::new(Single::new(|c| Ok(vec![propagation::run(c)?]))))
}

/// The suite, in the paper's order.
const PROTOCOLS: [Protocol; 9] = [
    Protocol {
        name: "replay",
        numbers: &[1],
        plan: replay::plan,
        assemble: replay::assemble,
        opt_in: false,
    },
    Protocol {
        name: "fork_sweep",
        numbers: &[2],
        plan: fork_sweep::plan,
        assemble: fork_sweep::assemble,
        opt_in: false,
    },
    Protocol {
        name: "persistent",
        numbers: &[3, 4, 5],
        plan: persistent::plan,
        assemble: persistent::assemble,
        opt_in: false,
    },
    Protocol {
        name: "post_mhc_substitution",
        numbers: &[6],
        plan: post_mhc,
        assemble: |_, r| Single::assemble("post_mhc_substitution", r),
        opt_in: false,
    },
    Protocol {
        name: "persistent_state_substitution",
        numbers: &[7],
        plan: persistent_state,
        assemble: |_, r| Single::assemble("persistent_state_substitution", r),
        opt_in: false,
    },
    Protocol {
        name: "propagation",
        numbers: &[8],
        plan: propagation,
        assemble: |_, r| Single::assemble("propagation", r),
        opt_in: false,
    },
    Protocol {
        name: "breadth",
        numbers: &[9],
        plan: breadth::plan,
        assemble: breadth::assemble,
        opt_in: false,
    },
    Protocol {
        name: "fault_matrix",
        numbers: &[10],
        plan: fault_matrix::plan,
        assemble: fault_matrix::assemble,
        opt_in: false,
    },
    Protocol {
        name: "context_fork",
        numbers: &[11],
        plan: context_fork,
        assemble: |_, r| Single::assemble("context_fork", r),
        opt_in: true,
    },
];

/// What the suite produced.
#[derive(Debug, Clone)]
pub struct Suite {
    /// Every protocol's sections, in the paper's order.
    pub sections: Vec<Section>,
}

/// The run description recorded at the top of `calibration.json`, and in
/// every partial result as the run's arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunInfo {
    /// The model as given (`builtin:tiny-v4` or a directory).
    pub model: String,
    /// Precision profile name.
    pub precision: String,
    /// Whether the reduced sizes were asked for.
    pub quick: bool,
    /// Layer of the single-layer fork.
    pub fork_layer: u32,
    /// The sizes used.
    pub sizes: Sizes,
    /// The protocols selected (`--only`, sorted; empty = all).
    pub only: Vec<u32>,
    /// Routed experts per token of the model (what assembling needs of it).
    pub experts_per_tok: usize,
}

impl RunInfo {
    /// What assembling the sections needs.
    pub fn params(&self) -> Params {
        Params {
            sizes: self.sizes,
            fork_layer: self.fork_layer,
            k: self.experts_per_tok,
        }
    }
}

/// Checks a protocol selection: every number must name a protocol.
pub fn check_selection(only: &[u32]) -> Result<()> {
    match only.iter().find(|&&p| !(1..=PROTOCOL_COUNT).contains(&p)) {
        Some(bad) => Err(CalibrateError::Field(
            FieldMessage::of(Field::Only).text(format!(" {bad}: protocols are numbered 1..{PROTOCOL_COUNT}")),
        )),
        None => Ok(()),
    }
}

/// A `--only` list sorted and without repeats (the same selection, however written).
pub fn normalize_selection(only: &[u32]) -> Vec<u32> {
    let mut v = only.to_vec();
    v.sort_unstable();
    v.dedup();
    v
}

/// The protocols `only` selects (all but the opt-in ones when empty), in
/// the paper's order.
fn selected(only: &[u32]) -> impl Iterator<Item = &'static Protocol> + '_ {
    PROTOCOLS.iter().filter(move |p| {
        if only.is_empty() {
            !p.opt_in
        } else {
            p.numbers.iter().any(|n| only.contains(n))
        }
    })
}

/// The jobs one shard of the suite ran.
pub struct ShardRun {
    /// The run's job list: every selected protocol's job count.
    pub groups: Vec<JobGroup>,
    /// The shard's job results, ascending by job.
    pub results: Vec<JobResult>,
    /// Output files its jobs left in the context's output directory: (job, relative path).
    pub files: Vec<(usize, String)>,
}

/// Runs the jobs of `shard` of the protocols `only` selects (all when
/// empty), in the paper's order, each protocol's jobs in parallel; a failing
/// protocol stops the suite with its name in the error.
pub fn run_shard(ctx: &Ctx, only: &[u32], shard: Shard) -> Result<ShardRun> {
    let mut run = ShardRun {
        groups: Vec::new(),
        results: Vec::new(),
        files: Vec::new(),
    };
    let mut offset = 0;
    for p in selected(only) {
        let t = Instant::now();
        let err = |e| CalibrateError::Protocol {
            name: p.name,
            source: Box::new(e),
        };
        let mut jobs = (p.plan)(ctx).map_err(err)?;
        let count = jobs.count();
        let mine = owned(shard, offset..offset + count);
        if !mine.is_empty() {
            jobs.prepare(ctx, &mine).map_err(err)?;
        }
        let progress = Progress::new(
            ctx.progress,
            &format!("calibrate: {}", p.name),
            "jobs",
            mine.len(),
        );
        let outs: Vec<JobOut> = run_jobs(&mine, &progress, |j| jobs.run(ctx, j)).map_err(err)?;
        progress.finish();
        for (&j, out) in mine.iter().zip(outs) {
            run.files.extend(out.files.into_iter().map(|f| (offset + j, f)));
            run.results.push(JobResult {
                job: offset + j,
                result: out.result,
            });
        }
        ctx.note(&format!(
            "    {} done in {:.1} s ({} of {count} jobs)",
            p.name,
            t.elapsed().as_secs_f64(),
            mine.len()
        ));
        run.groups.push(JobGroup {
            name: p.name.into(),
            jobs: count,
        });
        offset += count;
    }
    Ok(run)
}

/// Assembles the sections of every protocol of `groups` (the run's job list,
/// in the paper's order) from `results`, every job's result in job order.
pub fn assemble(params: &Params, groups: &[JobGroup], results: &[Value]) -> Result<Suite> {
    let mut sections = Vec::new();
    let mut offset = 0;
    for g in groups {
        let p = PROTOCOLS
            .iter()
            .find(|p| p.name == g.name)
            .ok_or_else(|| CalibrateError::Merge(format!("unknown protocol {:?}", g.name)))?;
        let r = results
            .get(offset..offset + g.jobs)
            .ok_or_else(|| CalibrateError::Merge(format!("{}: missing job results", g.name)))?;
        let s = (p.assemble)(params, r).map_err(|e| CalibrateError::Protocol {
            name: p.name,
            source: Box::new(e),
        })?;
        sections.extend(s);
        offset += g.jobs;
    }
    Ok(Suite { sections })
}

/// Runs every job of the protocols `only` selects and assembles them.
pub fn run(ctx: &Ctx, only: &[u32]) -> Result<Suite> {
    let r = run_shard(ctx, only, Shard::WHOLE)?;
    let results: Vec<Value> = r.results.into_iter().map(|j| j.result).collect();
    assemble(&ctx.params(), &r.groups, &results)
}

/// The identity of a suite run (partial results of its shards record it).
pub fn identity(ctx: &Ctx, info: &RunInfo, groups: Vec<JobGroup>) -> Result<RunIdentity> {
    Ok(RunIdentity {
        moeconf_version: moeconf_shard::MOECONF_VERSION.into(),
        command: COMMAND.into(),
        arguments: serde_json::to_value(info)?,
        inputs: ctx.inputs_json(),
        jobs: groups,
    })
}

/// Writes the partial result of one shard's run to `out`: its job results
/// and the output files its jobs left in the context's output directory.
pub fn write_partial(
    ctx: &Ctx,
    info: &RunInfo,
    shard: Shard,
    run: ShardRun,
    out: &moeconf_output::CheckedOutput,
) -> Result<()> {
    let identity = identity(ctx, info, run.groups)?;
    let files: Vec<Attachment> = run
        .files
        .into_iter()
        .map(|(job, name)| Attachment {
            source: ctx.out.join(&name),
            name,
            job,
        })
        .collect();
    moeconf_shard::write_partial(out, &identity, shard, run.results, &files)?;
    Ok(())
}

/// A scratch directory next to the partial result `partial`, for the files
/// a shard's jobs write before they are attached: removed when dropped, and
/// registered as a temporary (`moeconf_output::register_temporary`)
/// so an interrupted shard (Ctrl-C) removes it too.
pub fn scratch_dir(partial: &Path) -> Result<Scratch> {
    let dir = partial
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let d = tempfile::Builder::new()
        .prefix(".moeconf-shard.")
        .tempdir_in(dir)
        .map_err(CalibrateError::io(format!(
            "creating a scratch directory in {}",
            dir.display()
        )))?;
    moeconf_output::register_temporary(d.path());
    Ok(Scratch(d))
}

/// A shard's scratch directory ([`scratch_dir`]).
#[derive(Debug)]
pub struct Scratch(tempfile::TempDir);

impl Scratch {
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Removed before it is forgotten, so an interruption in between
        // still finds it registered.
        let _ = std::fs::remove_dir_all(self.0.path());
        moeconf_output::deregister_temporary(self.0.path());
    }
}

/// Whether `rel` (relative to a calibration's output directory,
/// `/`-separated) is part of a calibration's result: `calibration.json`, a
/// `*.tsv` table, the `traces` directory or a trace in it. An existing
/// output directory holding nothing else is replaced as a whole.
pub fn is_result_entry(rel: &str) -> bool {
    rel == "calibration.json"
        || rel == "traces"
        || (!rel.contains('/') && rel.ends_with(".tsv"))
        || is_trace_name(rel)
}

/// Whether `name` is a file the suite may write into its output directory
/// from a partial: a trace, `traces/NAME.bin`.
pub fn is_trace_name(name: &str) -> bool {
    name.strip_prefix("traces/")
        .is_some_and(|n| !n.contains('/') && n.ends_with(".bin"))
}

/// The run and its suite, rebuilt from the partials of every shard.
pub fn merged(m: &Merged) -> Result<(RunInfo, Suite)> {
    let run = m.run();
    if run.command != COMMAND {
        return Err(CalibrateError::Merge(format!(
            "the partials are of `moeconf {}`, not of `moeconf {COMMAND}`",
            run.command
        )));
    }
    let info: RunInfo = serde_json::from_value(run.arguments.clone())
        .map_err(|e| CalibrateError::Merge(format!("the recorded arguments: {e}")))?;
    let want: Vec<&str> = selected(&info.only).map(|p| p.name).collect();
    let have: Vec<&str> = run.jobs.iter().map(|g| g.name.as_str()).collect();
    if want != have {
        return Err(CalibrateError::Merge(format!(
            "the job list names protocols {have:?}, the selection {:?} runs {want:?}",
            info.only
        )));
    }
    if let Some(f) = m.files().iter().find(|f| !is_trace_name(f.name)) {
        return Err(CalibrateError::Merge(format!(
            "attached file {:?} is not a trace (traces/NAME.bin)",
            f.name
        )));
    }
    let suite = assemble(&info.params(), &run.jobs, m.results())?;
    Ok((info, suite))
}

/// Everything the suite writes, as bytes: what it prints, and the files of
/// its output directory (besides the traces the jobs wrote).
pub struct Outputs {
    /// Printed on stdout: every table, the claims, where the results are.
    pub stdout: String,
    /// (name in the output directory, bytes), in writing order.
    pub files: Vec<(String, Vec<u8>)>,
    /// Whether every structural claim holds (exit 0, else 1).
    pub all_hold: bool,
}

/// The outputs of a suite run described by `info`, whose output directory
/// is shown as `out`.
pub fn outputs(suite: &Suite, info: &RunInfo, out: &Path) -> Result<Outputs> {
    let mut stdout = String::new();
    let mut files = Vec::new();
    for t in suite.tables() {
        stdout.push_str(&t.render());
        stdout.push('\n');
        files.push((format!("{}.tsv", t.name), t.tsv().into_bytes()));
    }
    stdout.push_str(&suite.render_claims());
    stdout.push_str(&format!("results in {}\n", out.display()));
    let mut json = serde_json::to_vec_pretty(&suite.to_json(info))?;
    json.push(b'\n');
    files.push(("calibration.json".into(), json));
    Ok(Outputs {
        stdout,
        files,
        all_hold: suite.all_hold(),
    })
}

impl Suite {
    /// Every table, in print order.
    pub fn tables(&self) -> impl Iterator<Item = &Table> {
        self.sections.iter().flat_map(|s| &s.tables)
    }

    /// Every structural claim, in order.
    pub fn claims(&self) -> Vec<Claim> {
        self.sections
            .iter()
            .flat_map(|s| s.claims.iter().cloned())
            .collect()
    }

    /// Whether every structural claim holds (the suite's exit status).
    pub fn all_hold(&self) -> bool {
        self.sections.iter().flat_map(|s| &s.claims).all(|c| c.holds)
    }

    /// The claims block printed after the tables.
    pub fn render_claims(&self) -> String {
        let mut o = String::from("Structural claims:\n");
        for c in self.sections.iter().flat_map(|s| &s.claims) {
            let mark = if c.holds { "ok" } else { "FAIL" };
            o.push_str(&format!("  [{mark}] {}: {}\n", c.id, c.detail));
        }
        o
    }

    /// The `calibration.json` document (deterministic: no timings).
    pub fn to_json(&self, info: &RunInfo) -> Value {
        let mut protocols = serde_json::Map::new();
        for s in &self.sections {
            protocols.insert(s.key.clone(), s.json.clone());
        }
        let sizes = &info.sizes;
        let mut sizes_json = json!({
            "tokens": sizes.tokens, "fork_tokens": sizes.fork_tokens,
            "fork_branches": if sizes.fork_branches == usize::MAX { None } else { Some(sizes.fork_branches) },
            "seeds": sizes.seeds, "control_tokens": sizes.control_tokens, "horizons": sizes.horizons,
        });
        if let (Some(c), Some(o)) = (sizes.context, sizes_json.as_object_mut()) {
            o.insert("context".into(), json!(c));
        }
        json!({
            "schema_version": CALIBRATION_SCHEMA_VERSION,
            "kind": "moeconf.calibration",
            "model": info.model,
            "precision": info.precision,
            "quick": info.quick,
            "fork_layer": info.fork_layer,
            "sizes": sizes_json,
            "protocols": protocols,
            "claims": self.claims(),
            "all_claims_hold": self.all_hold(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_protocol_number_selects_exactly_one_entry() {
        for n in 1..=PROTOCOL_COUNT {
            assert_eq!(
                PROTOCOLS.iter().filter(|p| p.numbers.contains(&n)).count(),
                1,
                "{n}"
            );
        }
        assert!(check_selection(&[1, 10]).is_ok());
        let e = check_selection(&[0]).unwrap_err().to_string();
        assert_eq!(e, "protocol selection 0: protocols are numbered 1..11");
        assert!(selected(&[]).all(|p| !p.opt_in));
        assert!(selected(&[11]).all(|p| p.name == "context_fork"));
    }

    #[test]
    fn claims_block_and_verdict() {
        let section = |holds| Section {
            key: "k".into(),
            tables: vec![],
            json: Value::Null,
            claims: vec![Claim::new("c", holds, "detail".into())],
        };
        let mut s = Suite {
            sections: vec![section(true)],
        };
        assert!(s.all_hold());
        assert_eq!(s.render_claims(), "Structural claims:\n  [ok] c: detail\n");
        s.sections.push(section(false));
        assert!(!s.all_hold());
        assert!(s.render_claims().ends_with("  [FAIL] c: detail\n"));
    }
}
