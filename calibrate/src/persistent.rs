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
    prompt_hash, AggregationContract, NativeCombine, Schedule, ScheduledCombine, DEFAULT_EXPERIMENT_SEED,
};
use rayon::prelude::*;
use serde_json::json;

use super::{frac, max_abs_diff, Claim, Collect, Ctx, Kept, Section, Table};

/// The paper's four schemes, in table order.
pub const SCHEMES: [&str; 4] = ["p32", "c", "a", "b"];

/// The intermediates of the C check, with the group each belongs to.
const INTERMEDIATES: [(&str, &str); 4] = [
    ("moe.combine", "MoE"),
    ("layer.post_ffn_mhc", "post-mHC"),
    ("router.scores", "Router"),
    ("lm.logits", "LM"),
];

/// What one run produced.
struct RunOut {
    tokens: Vec<u32>,
    routes: Vec<Vec<u8>>,
    intermediates: Vec<Kept>,
}

fn run_one(
    ctx: &Ctx,
    ids: &[u32],
    combine: &dyn moeconf_contract::MoeCombine,
    keep_intermediates: bool,
) -> anyhow::Result<RunOut> {
    let mut paths = vec!["router.topk"];
    if keep_intermediates {
        paths.extend(INTERMEDIATES.iter().map(|(p, _)| *p));
    }
    let mut sink = Collect::new(&paths);
    let state = ctx.generate(ids, ctx.sizes.tokens, combine, None, &mut sink)?;
    let (routes, intermediates): (Vec<Kept>, Vec<Kept>) =
        sink.kept.into_iter().partition(|k| k.coord.path == "router.topk");
    Ok(RunOut {
        tokens: state.generated,
        routes: routes.into_iter().map(|k| k.bytes).collect(),
        intermediates,
    })
}

/// C-check comparison of one run against native: (missing records, max |Δ| per group, all bitwise).
fn compare_intermediates(native: &[Kept], run: &[Kept]) -> (usize, [f64; 4], bool) {
    let mut missing = native.len().abs_diff(run.len());
    let mut max = [0.0f64; 4];
    let mut bitwise = missing == 0;
    for (a, b) in native.iter().zip(run) {
        if a.coord != b.coord {
            missing += 1;
            bitwise = false;
            continue;
        }
        let g = INTERMEDIATES
            .iter()
            .position(|(p, _)| *p == a.coord.path)
            .unwrap_or(0);
        if a.bytes != b.bytes {
            bitwise = false;
        }
        max[g] = max[g].max(max_abs_diff(&a.f32s(), &b.f32s()));
    }
    (missing, max, bitwise)
}

#[derive(Clone, Copy)]
enum Job {
    Native(usize),
    Canonical(usize, usize),
    Random(usize, usize, u64),
}

/// Runs protocols 3, 4 and 5; returns their three sections.
pub fn run(ctx: &Ctx) -> anyhow::Result<Vec<Section>> {
    let prompts = moeconf_fixtures::depth_prompts();
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| ctx.encode(&p.text))
        .collect::<anyhow::Result<_>>()?;
    let s = ctx.sizes.seeds;
    let mut jobs = Vec::new();
    for pi in 0..prompts.len() {
        jobs.push(Job::Native(pi));
        for si in 0..SCHEMES.len() {
            jobs.push(Job::Canonical(pi, si));
            for seed in 0..s {
                jobs.push(Job::Random(pi, si, seed));
            }
        }
    }
    ctx.note(&format!(
        "[3-5] persistent layer-static ablation, canonical reference, C check: {} runs × {} tokens",
        jobs.len(),
        ctx.sizes.tokens
    ));
    let contract = |si: usize| {
        AggregationContract::from_preset_name(SCHEMES[si]).unwrap_or_else(AggregationContract::native)
    };
    let outs: Vec<RunOut> = jobs
        .par_iter()
        .map(|job| match *job {
            Job::Native(pi) => run_one(ctx, &ids[pi], &NativeCombine, true),
            Job::Canonical(pi, si) => {
                let c =
                    ScheduledCombine::new(contract(si), Schedule::Identity, prompt_hash(&prompts[pi].text));
                run_one(ctx, &ids[pi], &c, SCHEMES[si] == "c")
            }
            Job::Random(pi, si, seed) => {
                let sched = Schedule::LayerStatic {
                    experiment_seed: DEFAULT_EXPERIMENT_SEED,
                    request_seed: seed,
                };
                let c = ScheduledCombine::new(contract(si), sched, prompt_hash(&prompts[pi].text));
                run_one(ctx, &ids[pi], &c, SCHEMES[si] == "c")
            }
        })
        .collect::<anyhow::Result<_>>()?;

    // Index the results.
    let mut native: Vec<Option<&RunOut>> = vec![None; prompts.len()];
    let mut canonical: Vec<Vec<Option<&RunOut>>> = vec![vec![None; SCHEMES.len()]; prompts.len()];
    let mut random: Vec<Vec<Vec<&RunOut>>> = vec![vec![Vec::new(); SCHEMES.len()]; prompts.len()];
    for (job, out) in jobs.iter().zip(&outs) {
        match *job {
            Job::Native(pi) => native[pi] = Some(out),
            Job::Canonical(pi, si) => canonical[pi][si] = Some(out),
            Job::Random(pi, si, _) => random[pi][si].push(out),
        }
    }

    // Protocol 3 (table B.4 first part) and the aggregated table 3.6.
    let mut per_prompt = Table::new(
        "persistent_ablation",
        &format!(
            "Persistent layer-static ablation (table B.4): {s} seeds per prompt and scheme, {} tokens",
            ctx.sizes.tokens
        ),
        &[
            "Prompt",
            "Scheme",
            "Native route divergence",
            "Native token-sequence divergence",
            "Unique continuations",
        ],
    );
    let mut agg = Table::new(
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
    let mut canon_t = Table::new(
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
    let mut json_rows = Vec::new();
    // Rows of table B.4 by (prompt, scheme), printed prompt-major as in the paper.
    let mut b4_rows: Vec<Vec<Option<Vec<String>>>> = vec![vec![None; SCHEMES.len()]; prompts.len()];
    let mut json_schemes = Vec::new();
    let np = prompts.len();
    for (si, scheme) in SCHEMES.iter().enumerate() {
        let (mut nr, mut nt, mut cr, mut ct, mut cnr, mut cnt, mut total) = (0, 0, 0, 0, 0, 0, 0);
        for pi in 0..np {
            let (Some(nat), Some(can)) = (native[pi], canonical[pi][si]) else {
                continue;
            };
            let runs = &random[pi][si];
            let route_div = runs.iter().filter(|r| r.routes != nat.routes).count();
            let tok_div = runs.iter().filter(|r| r.tokens != nat.tokens).count();
            let unique = runs
                .iter()
                .map(|r| r.tokens.clone())
                .collect::<HashSet<_>>()
                .len();
            let can_route = runs.iter().filter(|r| r.routes != can.routes).count();
            let can_tok = runs.iter().filter(|r| r.tokens != can.tokens).count();
            b4_rows[pi][si] = Some(vec![
                format!("\"{}\"", prompts[pi].text),
                scheme.to_uppercase(),
                frac(route_div, runs.len()),
                frac(tok_div, runs.len()),
                unique.to_string(),
            ]);
            json_rows.push(json!({
                "prompt_id": prompts[pi].id, "scheme": scheme, "schedules": runs.len(),
                "native_route_divergence": route_div, "native_token_divergence": tok_div,
                "unique_continuations": unique,
                "canonical_vs_native_route": can.routes != nat.routes,
                "canonical_vs_native_tokens": can.tokens != nat.tokens,
                "random_vs_canonical_route": can_route, "random_vs_canonical_tokens": can_tok,
            }));
            nr += route_div;
            nt += tok_div;
            cr += can_route;
            ct += can_tok;
            cnr += usize::from(can.routes != nat.routes);
            cnt += usize::from(can.tokens != nat.tokens);
            total += runs.len();
        }
        agg.row(vec![
            scheme.to_uppercase(),
            frac(nr, total),
            frac(nt, total),
            frac(cr, total),
            frac(ct, total),
        ]);
        canon_t.row(vec![
            scheme.to_uppercase(),
            frac(cnt, np),
            frac(cnr, np),
            frac(ct, total),
            frac(cr, total),
        ]);
        json_schemes.push(json!({
            "scheme": scheme, "trajectories": total,
            "native_route_divergence": nr, "native_token_divergence": nt,
            "canonical_route_divergence": cr, "canonical_token_divergence": ct,
            "canonical_vs_native_route": cnr, "canonical_vs_native_tokens": cnt, "prompts": np,
        }));
    }

    for row in b4_rows.into_iter().flatten().flatten() {
        per_prompt.row(row);
    }

    // Protocol 5: C intermediate check (table B.5).
    let ci = SCHEMES.iter().position(|x| *x == "c").unwrap_or(1);
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
    for pi in 0..np {
        let Some(nat) = native[pi] else { continue };
        let mut runs: Vec<&RunOut> = random[pi][ci].clone();
        if let Some(c) = canonical[pi][ci] {
            runs.push(c);
        }
        let mut missing = 0;
        let mut max = [0.0f64; 4];
        let mut bitwise = true;
        for r in &runs {
            let (m, mx, b) = compare_intermediates(&nat.intermediates, &r.intermediates);
            missing += m;
            for g in 0..4 {
                max[g] = max[g].max(mx[g]);
            }
            bitwise &= b && r.routes == nat.routes && r.tokens == nat.tokens;
            c_records += r.intermediates.len();
        }
        c_runs += runs.len();
        c_all &= bitwise && !nat.intermediates.is_empty();
        b5.row(vec![
            format!("\"{}\"", prompts[pi].text),
            runs.len().to_string(),
            missing.to_string(),
            format!("{}", max[0]),
            format!("{}", max[1]),
            format!("{}", max[2]),
            format!("{}", max[3]),
            if bitwise { "yes" } else { "NO" }.into(),
        ]);
        b5_json.push(json!({
            "prompt_id": prompts[pi].id, "schedules": runs.len(), "missing_records": missing,
            "moe_max_abs": max[0], "post_mhc_max_abs": max[1], "router_max_abs": max[2], "lm_max_abs": max[3],
            "bitwise_identical": bitwise,
        }));
    }

    Ok(vec![
        Section {
            key: "persistent".into(),
            tables: vec![per_prompt, agg],
            json: json!({ "seeds": s, "tokens": ctx.sizes.tokens, "experiment_seed": DEFAULT_EXPERIMENT_SEED,
                "per_prompt": json_rows, "per_scheme": json_schemes }),
            claims: vec![],
        },
        Section {
            key: "canonical".into(),
            tables: vec![canon_t],
            json: json!({ "per_scheme": json_schemes }),
            claims: vec![],
        },
        Section {
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
        },
    ])
}
