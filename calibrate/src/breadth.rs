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
use rayon::prelude::*;
use serde_json::json;

use super::fork_sweep::capture_event;
use super::{frac, max_abs_diff, Ctx, Section, Table};

struct Pick {
    class: u64,
    linf: f64,
    distinct: usize,
    differ: usize,
    classes: u64,
}

fn pick_branch(ctx: &Ctx, ids: &[u32], point: ForkPoint) -> anyhow::Result<Pick> {
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

/// Runs protocol 9.
pub fn run(ctx: &Ctx) -> anyhow::Result<Section> {
    let prompts: Vec<Prompt> = moeconf_fixtures::breadth_prompts()
        .into_iter()
        .take(ctx.sizes.breadth_prompts)
        .collect();
    let point = ForkPoint::first_decode(ctx.fork_layer);
    ctx.note(&format!(
        "[9] breadth: {} prompts, horizons {:?}",
        prompts.len(),
        ctx.sizes.horizons
    ));
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| ctx.encode(&p.text))
        .collect::<anyhow::Result<_>>()?;
    let picks: Vec<Pick> = ids
        .par_iter()
        .map(|i| pick_branch(ctx, i, point))
        .collect::<anyhow::Result<_>>()?;

    let mut t = Table::new(
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
    );
    let total = prompts.len();
    let mut separated: BTreeSet<usize> = BTreeSet::new();
    let mut first_stage: Vec<usize> = Vec::new();
    let mut stages = Vec::new();
    let mut texts: Vec<Option<(String, String, usize)>> = vec![None; total];
    for (si, &h) in ctx.sizes.horizons.iter().enumerate() {
        let at_risk: Vec<usize> = (0..total).filter(|i| !separated.contains(i)).collect();
        let rows: Vec<(usize, bool, String, String)> = at_risk
            .par_iter()
            .map(|&i| -> anyhow::Result<(usize, bool, String, String)> {
                let mut null = NullSink;
                let ns = ctx.generate(&ids[i], h.max(2), &NativeCombine, None, &mut null)?;
                let fork = ForkCombine::new(
                    point,
                    AggregationContract::b().with_order(Order::BClass(picks[i].class)),
                );
                let bs = ctx.generate(&ids[i], h.max(2), &fork, None, &mut null)?;
                let (nt, bt) = (ctx.decode(&ns.generated)?, ctx.decode(&bs.generated)?);
                Ok((i, nt != bt, nt, bt))
            })
            .collect::<anyhow::Result<_>>()?;
        let diffs: Vec<usize> = rows.iter().filter(|r| r.1).map(|r| r.0).collect();
        let repeated = diffs.iter().filter(|i| separated.contains(i)).count();
        let new: Vec<usize> = diffs.iter().copied().filter(|i| !separated.contains(i)).collect();
        for (i, _, nt, bt) in &rows {
            texts[*i] = Some((nt.clone(), bt.clone(), h));
        }
        separated.extend(new.iter().copied());
        if si == 0 {
            first_stage = new.clone();
        }
        t.row(vec![
            format!("{h} tokens"),
            at_risk.len().to_string(),
            new.len().to_string(),
            frac(separated.len(), total),
            diffs.len().to_string(),
            repeated.to_string(),
        ]);
        stages.push(
            json!({"horizon": h, "at_risk": at_risk.len(), "new_separated": new.len(),
            "cumulative_separated": separated.len(), "saved_file_text_differences": diffs.len(),
            "repeated_prior_events": repeated,
            "new_ids": new.iter().map(|&i| prompts[i].id.clone()).collect::<Vec<_>>()}),
        );
    }
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
            ctx.sizes.horizons[0]
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
    let json = json!({
        "prompts": total, "fork_layer": point.layer, "fork_step": point.step,
        "horizons": ctx.sizes.horizons, "stages": stages,
        "first_horizon": {"english": [en, en_n], "chinese": [zh, zh_n], "ordinary": [nat, nat_n], "sensitivity": [sen, sen_n]},
        "per_prompt": prompts.iter().enumerate().map(|(i, p)| json!({
            "id": p.id, "language": p.language.as_str(), "kind": p.kind.as_str(),
            "class": picks[i].class, "max_linf": picks[i].linf, "distinct_b_outputs": picks[i].distinct,
            "classes_differing_from_native": picks[i].differ, "classes": picks[i].classes,
            "separated": separated.contains(&i),
            "native_text": texts[i].as_ref().map(|t| t.0.clone()), "branch_text": texts[i].as_ref().map(|t| t.1.clone()),
            "last_horizon_run": texts[i].as_ref().map(|t| t.2),
        })).collect::<Vec<_>>(),
    });
    Ok(Section {
        key: "breadth".into(),
        tables: vec![t, b],
        json,
        claims: vec![],
    })
}
