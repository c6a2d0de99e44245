//! Protocol 9, exploratory breadth (paper sections 2.4.7, 3.5, table B.3):
//! the committed 50-prompt file (25 English, 25 Chinese, stable ids). For
//! each prompt, the first decode forward's MoE event at the fork layer is
//! captured natively and combined under all B structural classes; the class
//! with the largest L∞ distance from the native MoE output (ties: lowest
//! class) is injected. Horizons are staged (paper: 8/16/32 tokens): only
//! prompts whose branch and native continuations have the same text so far
//! are carried to the next horizon, and events are keyed by prompt id so a
//! repeated row is never counted as new.

use std::collections::{BTreeSet, HashSet};

use moeconf_contract::{b_class_count, AggregationContract, ForkCombine, ForkPoint, NativeCombine, Order};
use moeconf_fixtures::{Language, Prompt, PromptKind};
use moeconf_reference_runtime::capture::NullSink;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::fork_sweep::capture_event;
use crate::jobs::{decode, JobOut, Jobs, Params};
use crate::{frac, max_abs_diff, CalibrateError, Ctx, Result, Section, Table};

/// The B branch injected for one prompt, and what the class scan saw.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Pick {
    class: u64,
    linf: f64,
    distinct: usize,
    differ: usize,
    classes: u64,
}

/// The B class with the largest L∞ distance from the native MoE output
/// at `point` (ties: the lowest class).
fn pick_branch(ctx: &Ctx, ids: &[u32], point: ForkPoint) -> Result<Pick> {
    let ev = capture_event(ctx, ids, point.layer, point.step)?;
    let refs: Vec<&[f32]> = ev.terms.iter().map(|v| v.as_slice()).collect();
    let n = b_class_count(ctx.k())?;
    let mut y = vec![0.0f32; ev.shared.len()];
    let (mut best, mut best_d) = (0u64, -1.0f64);
    let mut outputs = HashSet::new();
    let mut differ = 0;
    for c in 0..n {
        AggregationContract::b()
            .with_order(Order::BClass(c))
            .try_combine(&refs, &ev.shared, &mut y)?;
        let d = max_abs_diff(&y, &ev.native);
        if y.iter().zip(&ev.native).any(|(a, b)| a.to_bits() != b.to_bits()) {
            differ += 1;
        }
        outputs.insert(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        if d > best_d {
            best = c;
            best_d = d;
        }
    }
    Ok(Pick {
        class: best,
        linf: best_d,
        distinct: outputs.len(),
        differ,
        classes: n,
    })
}

/// One prompt's job: the branch scan, then the continuations at each
/// horizon until they separate (the staged horizons of one prompt depend on
/// nothing but that prompt).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PromptRun {
    pick: Pick,
    /// The continuations at each horizon run, in horizon order; only the
    /// last may differ.
    stages: Vec<Texts>,
}

/// Protocol 9's jobs: one per breadth prompt.
struct Breadth {
    ids: Vec<Vec<u32>>,
    point: ForkPoint,
}

impl Jobs for Breadth {
    fn count(&self) -> usize {
        self.ids.len()
    }

    fn run(&self, ctx: &Ctx, job: usize) -> Result<JobOut> {
        let ids = &self.ids[job];
        let pick = pick_branch(ctx, ids, self.point)?;
        let mut stages: Vec<Texts> = Vec::new();
        for &h in &ctx.sizes.horizons {
            let texts = stage_run(ctx, self.point, ids, pick.class, h)?;
            let differs = texts.native != texts.branch;
            stages.push(texts);
            if differs {
                break;
            }
        }
        JobOut::of(&PromptRun { pick, stages })
    }
}

fn prompts(sizes: &crate::Sizes) -> Vec<Prompt> {
    moeconf_fixtures::breadth_prompts()
        .into_iter()
        .take(sizes.breadth_prompts)
        .collect()
}

/// Plans protocol 9.
pub fn plan(ctx: &Ctx) -> Result<Box<dyn Jobs + '_>> {
    let prompts = prompts(&ctx.sizes);
    ctx.note(&format!(
        "[9] breadth: {} prompts, horizons {:?}",
        prompts.len(),
        ctx.sizes.horizons
    ));
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| ctx.encode(&p.text))
        .collect::<Result<_>>()?;
    Ok(Box::new(Breadth {
        ids,
        point: ForkPoint::first_decode(ctx.fork_layer),
    }))
}

/// Assembles protocol 9 from its job results.
pub fn assemble(params: &Params, results: &[Value]) -> Result<Vec<Section>> {
    let prompts = prompts(&params.sizes);
    let point = ForkPoint::first_decode(params.fork_layer);
    let runs: Vec<PromptRun> = decode("breadth", results)?;
    if runs.len() != prompts.len() {
        return Err(CalibrateError::Merge(format!(
            "breadth: {} job results for {} prompts",
            runs.len(),
            prompts.len()
        )));
    }
    let picks: Vec<Pick> = runs.iter().map(|r| r.pick.clone()).collect();
    let stages = Stages::assemble(params, &runs)?;
    let b = breakdown(params, &prompts, &picks, &stages.first_stage);
    let json = json!({
        "prompts": prompts.len(), "fork_layer": point.layer, "fork_step": point.step,
        "horizons": params.sizes.horizons, "stages": stages.json(&prompts),
        "first_horizon": b.json,
        "per_prompt": prompts.iter().enumerate().map(|(i, p)| {
            let text = stages.texts[i].as_ref();
            json!({
                "id": p.id, "language": p.language.as_str(), "kind": p.kind.as_str(),
                "class": picks[i].class, "max_linf": picks[i].linf, "distinct_b_outputs": picks[i].distinct,
                "classes_differing_from_native": picks[i].differ, "classes": picks[i].classes,
                "separated": stages.separated.contains(&i),
                "native_text": text.map(|t| t.native.clone()), "branch_text": text.map(|t| t.branch.clone()),
                "last_horizon_run": text.map(|t| t.horizon),
            })
        }).collect::<Vec<_>>(),
    });
    Ok(vec![Section {
        key: "breadth".into(),
        tables: vec![stages.table, b.table],
        json,
        claims: vec![],
    }])
}

/// Both continuations of one prompt at one horizon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Texts {
    native: String,
    branch: String,
    horizon: usize,
}

/// One stage's result for one prompt.
struct StageRun {
    prompt: usize,
    texts: Texts,
}

impl StageRun {
    fn differs(&self) -> bool {
        self.texts.native != self.texts.branch
    }
}

/// One stage of the staged horizons.
struct Stage {
    horizon: usize,
    at_risk: usize,
    new: Vec<usize>,
    cumulative: usize,
    differences: usize,
    repeated: usize,
}

/// The staged-horizon accounting (table B.3).
struct Stages {
    table: Table,
    stages: Vec<Stage>,
    separated: BTreeSet<usize>,
    first_stage: Vec<usize>,
    texts: Vec<Option<Texts>>,
}

/// Native and branch continuations of one prompt to horizon `h` (at least 2 tokens).
fn stage_run(ctx: &Ctx, point: ForkPoint, ids: &[u32], class: u64, h: usize) -> Result<Texts> {
    let mut null = NullSink;
    let ns = ctx.generate(ids, h.max(2), &NativeCombine, None, &mut null)?;
    let fork = ForkCombine::new(point, AggregationContract::b().with_order(Order::BClass(class)));
    let bs = ctx.generate(ids, h.max(2), &fork, None, &mut null)?;
    Ok(Texts {
        native: ctx.decode(&ns.generated)?,
        branch: ctx.decode(&bs.generated)?,
        horizon: h,
    })
}

impl Stages {
    /// The accounting of every horizon from each prompt's runs: a prompt is
    /// at risk at a stage when it did not separate before it (then it was
    /// run at that horizon: its `stages[si]`).
    fn assemble(params: &Params, runs: &[PromptRun]) -> Result<Stages> {
        let total = runs.len();
        let mut s = Stages {
            table: Table::new(
                "breadth_summary",
                "Breadth stage accounting (table B.3): maximum-L∞ B branch at the fork, staged horizons",
                &[
                    "Horizon",
                    "At risk at stage start",
                    "New separated",
                    "Cumulative separated",
                    "Saved-file text differences",
                    "Repeated prior events",
                ],
            ),
            stages: Vec::new(),
            separated: BTreeSet::new(),
            first_stage: Vec::new(),
            texts: vec![None; total],
        };
        for (si, &h) in params.sizes.horizons.iter().enumerate() {
            let at_risk: Vec<usize> = (0..total).filter(|i| !s.separated.contains(i)).collect();
            let mut rows = Vec::with_capacity(at_risk.len());
            for &i in &at_risk {
                let texts = runs[i].stages.get(si).filter(|t| t.horizon == h).ok_or_else(|| {
                    CalibrateError::Merge(format!("breadth: prompt {i} has no run at horizon {h}"))
                })?;
                rows.push(StageRun {
                    prompt: i,
                    texts: texts.clone(),
                });
            }
            let diffs: Vec<usize> = rows.iter().filter(|r| r.differs()).map(|r| r.prompt).collect();
            let repeated = diffs.iter().filter(|i| s.separated.contains(i)).count();
            let new: Vec<usize> = diffs
                .iter()
                .copied()
                .filter(|i| !s.separated.contains(i))
                .collect();
            for r in rows {
                s.texts[r.prompt] = Some(r.texts);
            }
            s.separated.extend(new.iter().copied());
            if si == 0 {
                s.first_stage = new.clone();
            }
            let stage = Stage {
                horizon: h,
                at_risk: at_risk.len(),
                new,
                cumulative: s.separated.len(),
                differences: diffs.len(),
                repeated,
            };
            s.table.row(vec![
                format!("{h} tokens"),
                stage.at_risk.to_string(),
                stage.new.len().to_string(),
                frac(stage.cumulative, total),
                stage.differences.to_string(),
                stage.repeated.to_string(),
            ]);
            s.stages.push(stage);
        }
        Ok(s)
    }

    fn json(&self, prompts: &[Prompt]) -> Vec<Value> {
        self.stages
            .iter()
            .map(|st| {
                json!({"horizon": st.horizon, "at_risk": st.at_risk, "new_separated": st.new.len(),
                "cumulative_separated": st.cumulative, "saved_file_text_differences": st.differences,
                "repeated_prior_events": st.repeated,
                "new_ids": st.new.iter().map(|&i| prompts[i].id.clone()).collect::<Vec<_>>()})
            })
            .collect()
    }
}

/// The breakdown table by language and prompt type, and its JSON object.
struct Breakdown {
    table: Table,
    json: Value,
}

fn breakdown(params: &Params, prompts: &[Prompt], picks: &[Pick], first_stage: &[usize]) -> Breakdown {
    let total = prompts.len();
    let count = |f: &dyn Fn(&Prompt) -> bool| {
        (
            first_stage.iter().filter(|&&i| f(&prompts[i])).count(),
            prompts.iter().filter(|p| f(p)).count(),
        )
    };
    let (en, en_n) = count(&|p| p.language == Language::En);
    let (zh, zh_n) = count(&|p| p.language == Language::Zh);
    let (nat, nat_n) = count(&|p| p.kind == PromptKind::Natural);
    let (sen, sen_n) = count(&|p| p.kind == PromptKind::Sensitivity);
    let mut b = Table::new(
        "breadth_breakdown",
        &format!(
            "Breadth at {} tokens by language and prompt type; MoE-state separation",
            params.sizes.horizons[0]
        ),
        &[
            "Group",
            "Separated at first horizon",
            "B classes with MoE output ≠ native (all prompts)",
        ],
    );
    let all_differ = picks.iter().filter(|p| p.differ as u64 == p.classes).count();
    b.row(vec!["English".into(), frac(en, en_n), String::new()]);
    b.row(vec!["Chinese".into(), frac(zh, zh_n), String::new()]);
    b.row(vec!["Ordinary".into(), frac(nat, nat_n), String::new()]);
    b.row(vec![
        "Sensitivity candidates".into(),
        frac(sen, sen_n),
        String::new(),
    ]);
    b.row(vec![
        "All prompts".into(),
        frac(first_stage.len(), total),
        format!("{} prompts with every class differing", frac(all_differ, total)),
    ]);
    Breakdown {
        table: b,
        json: json!({"english": [en, en_n], "chinese": [zh, zh_n], "ordinary": [nat, nat_n], "sensitivity": [sen, sen_n]}),
    }
}
