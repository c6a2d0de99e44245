//! Protocol 8, the representative propagation trace (paper section 3.2.1):
//! "why the sheep", scheme B at every MoE layer under the layer-static
//! schedule of request seed 0, against the native reference. Reports, in
//! execution order: the first MoE output that differs, the post-mHC
//! difference at that point, the first router whose selected set changes
//! (entering and leaving experts, both selection margins, score max |Δ|),
//! the first-position LM logits (argmax, rank-1/2 margins, max |Δ|), the
//! first changed generated ordinal, and both continuations.

use std::collections::BTreeSet;

use moeconf_contract::{
    prompt_hash, AggregationContract, NativeCombine, Schedule, ScheduledCombine, DEFAULT_EXPERIMENT_SEED,
};
use serde_json::json;

use super::{max_abs_diff, Collect, Ctx, Kept, Section, Table};

const PROMPT: &str = "why the sheep";
const KEEP: [&str; 7] = [
    "moe.combine",
    "layer.post_ffn_mhc",
    "router.topk",
    "router.scores",
    "router.margin",
    "lm.logits",
    "lm.margin",
];

fn coord_text(k: &Kept) -> String {
    format!(
        "step {}, position {}, layer {}",
        k.coord.step,
        k.coord.position,
        k.coord.layer.map_or("-".into(), |l| l.to_string())
    )
}

fn same_coord<'a>(c: &'a Collect, k: &Kept) -> Option<&'a Kept> {
    c.kept.iter().find(|x| x.coord == k.coord)
}

fn argmax(v: &[f32]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, x) in v.iter().enumerate() {
        if best.is_none_or(|b| *x > v[b]) {
            best = Some(i);
        }
    }
    best
}

/// Runs protocol 8.
pub fn run(ctx: &Ctx) -> anyhow::Result<Section> {
    let ids = ctx.encode(PROMPT)?;
    let n = ctx.sizes.tokens;
    ctx.note("[8] representative propagation trace: B, layer-static seed 0");
    let mut nat = Collect::new(&KEEP);
    let ns = ctx.generate(&ids, n, &NativeCombine, None, &mut nat)?;
    let sched = Schedule::LayerStatic {
        experiment_seed: DEFAULT_EXPERIMENT_SEED,
        request_seed: 0,
    };
    let b = ScheduledCombine::new(AggregationContract::b(), sched, prompt_hash(PROMPT));
    let mut cand = Collect::new(&KEEP);
    let cs = ctx.generate(&ids, n, &b, None, &mut cand)?;

    let mut t = Table::new(
        "propagation_trace",
        &format!(
            "Representative persistent-schedule propagation trace (section 3.2.1): \"{PROMPT}\", B, seed 0"
        ),
        &["Stage", "Native reference", "B, seed 0", "Observed difference"],
    );
    let mut j = serde_json::Map::new();
    // First MoE output difference.
    let first_moe = nat
        .path("moe.combine")
        .zip(cand.path("moe.combine"))
        .find(|(a, b)| a.coord == b.coord && a.bytes != b.bytes);
    match first_moe {
        Some((a, b)) => {
            let d = max_abs_diff(&a.f32s(), &b.f32s());
            t.row(vec![
                format!("First differing MoE output ({})", coord_text(a)),
                "captured FP32 vector".into(),
                "captured FP32 vector".into(),
                format!("not bitwise equal; max L∞ = {d}"),
            ]);
            j.insert("first_moe".into(), json!({"step": a.coord.step, "position": a.coord.position, "layer": a.coord.layer, "max_abs": d}));
            let mhc_n = nat.path("layer.post_ffn_mhc").find(|x| {
                x.coord.step == a.coord.step
                    && x.coord.position == a.coord.position
                    && x.coord.layer == a.coord.layer
            });
            if let Some(m) = mhc_n {
                if let Some(mc) = same_coord(&cand, m) {
                    let d = max_abs_diff(&m.f32s(), &mc.f32s());
                    t.row(vec![
                        "Post-mHC state at that layer".into(),
                        "captured FP32 vector".into(),
                        "captured FP32 vector".into(),
                        if m.bytes == mc.bytes {
                            "bitwise equal".into()
                        } else {
                            format!("not bitwise equal; max L∞ = {d}")
                        },
                    ]);
                    j.insert("post_mhc_max_abs".into(), json!(d));
                }
            }
        }
        None => {
            t.row(vec![
                "First differing MoE output".into(),
                "-".into(),
                "-".into(),
                "none: all MoE outputs bitwise equal".into(),
            ]);
        }
    }
    // First router whose selected set changes.
    let set = |k: &Kept| k.i32s().into_iter().collect::<BTreeSet<i32>>();
    let first_route = nat
        .path("router.topk")
        .zip(cand.path("router.topk"))
        .find(|(a, b)| a.coord == b.coord && set(a) != set(b));
    if let Some((a, b)) = first_route {
        let (sa, sb) = (set(a), set(b));
        let entering: Vec<i32> = sb.difference(&sa).copied().collect();
        let leaving: Vec<i32> = sa.difference(&sb).copied().collect();
        let margin = |c: &Collect| {
            c.kept
                .iter()
                .find(|x| {
                    x.coord.path == "router.margin"
                        && x.coord.step == a.coord.step
                        && x.coord.position == a.coord.position
                        && x.coord.layer == a.coord.layer
                })
                .and_then(|x| x.f32s().first().copied())
        };
        let scores = |c: &Collect| {
            c.kept
                .iter()
                .find(|x| {
                    x.coord.path == "router.scores"
                        && x.coord.step == a.coord.step
                        && x.coord.position == a.coord.position
                        && x.coord.layer == a.coord.layer
                })
                .map(|x| x.f32s())
                .unwrap_or_default()
        };
        let dscore = max_abs_diff(&scores(&nat), &scores(&cand));
        let fmt = |s: &BTreeSet<i32>, m: Option<f32>| {
            format!(
                "top-{} {:?}; rank-k/k+1 margin {}",
                s.len(),
                s,
                m.map_or("-".into(), |v| v.to_string())
            )
        };
        t.row(vec![
            format!("First changed router ({})", coord_text(a)),
            fmt(&sa, margin(&nat)),
            fmt(&sb, margin(&cand)),
            format!("score max L∞ = {dscore}; entering {entering:?}, leaving {leaving:?}"),
        ]);
        j.insert(
            "first_route".into(),
            json!({"step": a.coord.step, "position": a.coord.position, "layer": a.coord.layer,
            "native": sa, "candidate": sb, "entering": entering, "leaving": leaving,
            "native_margin": margin(&nat), "candidate_margin": margin(&cand), "score_max_abs": dscore}),
        );
    } else {
        t.row(vec![
            "First changed router".into(),
            "-".into(),
            "-".into(),
            "none: every selected set equal".into(),
        ]);
    }
    // First-position LM logits (the prefill step).
    if let (Some(a), Some(b)) = (nat.at("lm.logits", 0, None), cand.at("lm.logits", 0, None)) {
        let (la, lb) = (a.f32s(), b.f32s());
        let m = |c: &Collect| c.at("lm.margin", 0, None).and_then(|x| x.f32s().first().copied());
        let d = max_abs_diff(&la, &lb);
        let (aa, ab) = (argmax(&la), argmax(&lb));
        t.row(vec![
            "First-position LM logits".into(),
            format!(
                "argmax {}; rank-1/2 margin {}",
                aa.map_or("-".into(), |v| v.to_string()),
                m(&nat).map_or("-".into(), |v| v.to_string())
            ),
            format!(
                "argmax {}; rank-1/2 margin {}",
                ab.map_or("-".into(), |v| v.to_string()),
                m(&cand).map_or("-".into(), |v| v.to_string())
            ),
            format!(
                "max L∞ = {d}; first greedy token {}",
                if aa == ab { "unchanged" } else { "changed" }
            ),
        ]);
        j.insert("first_logits".into(), json!({"native_argmax": aa, "candidate_argmax": ab, "native_margin": m(&nat), "candidate_margin": m(&cand), "max_abs": d}));
    }
    let first_tok = ns.generated.iter().zip(&cs.generated).position(|(a, b)| a != b);
    match first_tok {
        Some(i) => {
            t.row(vec![
                "First changed generated token".into(),
                format!("ordinal {}: token {}", i + 1, ns.generated[i]),
                format!("ordinal {}: token {}", i + 1, cs.generated[i]),
                format!("the first {i} generated token ids agree"),
            ]);
        }
        None => t.row(vec![
            "First changed generated token".into(),
            "-".into(),
            "-".into(),
            format!("none within {n} tokens"),
        ]),
    }
    let (nt, ct) = (ctx.decode(&ns.generated)?, ctx.decode(&cs.generated)?);
    t.row(vec![
        format!("{n}-token continuation"),
        format!("{nt:?}"),
        format!("{ct:?}"),
        if nt == ct {
            "same".into()
        } else {
            "different greedy continuation".into()
        },
    ]);
    j.insert("first_changed_ordinal".into(), json!(first_tok.map(|i| i + 1)));
    j.insert("native_text".into(), json!(nt));
    j.insert("candidate_text".into(), json!(ct));
    j.insert("native_tokens".into(), json!(ns.generated));
    j.insert("candidate_tokens".into(), json!(cs.generated));
    Ok(Section {
        key: "propagation".into(),
        tables: vec![t],
        json: serde_json::Value::Object(j),
        claims: vec![],
    })
}
