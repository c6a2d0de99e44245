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
use moeconf_fingerprint::Component;
use moeconf_reference_runtime::state::DecodeState;
use serde_json::{json, Map, Value};

use crate::{max_abs_diff, Collect, Ctx, Kept, Result, Section, Table};

const PROMPT: &str = "why the sheep";
const KEEP: [Component; 7] = [
    Component::MoeCombine,
    Component::LayerPostFfnMhc,
    Component::RouterTopk,
    Component::RouterScores,
    Component::RouterMargin,
    Component::LmLogits,
    Component::LmMargin,
];

fn coord_text(k: &Kept) -> String {
    format!(
        "step {}, position {}, layer {}",
        k.coord.step,
        k.coord.position,
        k.coord.layer.map_or("-".into(), |l| l.to_string())
    )
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

/// `-` for a missing value.
fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}

/// The native and the candidate run, captured.
struct Pair {
    nat: Collect,
    cand: Collect,
}

/// The propagation table and its JSON object, filled stage by stage.
struct Trace {
    t: Table,
    j: Map<String, Value>,
}

/// Runs protocol 8.
pub fn run(ctx: &Ctx) -> Result<Section> {
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
    let pair = Pair { nat, cand };

    let mut tr = Trace {
        t: Table::new(
            "propagation_trace",
            &format!(
                "Representative persistent-schedule propagation trace (section 3.2.1): \"{PROMPT}\", B, seed 0"
            ),
            &["Stage", "Native reference", "B, seed 0", "Observed difference"],
        ),
        j: Map::new(),
    };
    tr.first_moe(&pair);
    tr.first_route(&pair);
    tr.first_logits(&pair);
    tr.tokens(ctx, &ns, &cs)?;
    Ok(Section {
        key: "propagation".into(),
        tables: vec![tr.t],
        json: Value::Object(tr.j),
        claims: vec![],
    })
}

impl Trace {
    /// A stage where the runs do not differ.
    fn absent(&mut self, stage: &str, observed: String) {
        self.t.row(vec![stage.into(), "-".into(), "-".into(), observed]);
    }

    /// The first differing MoE output and the post-mHC state at that layer.
    fn first_moe(&mut self, p: &Pair) {
        let first = p
            .nat
            .of(Component::MoeCombine)
            .zip(p.cand.of(Component::MoeCombine))
            .find(|(a, b)| a.coord == b.coord && a.bytes != b.bytes);
        let Some((a, b)) = first else {
            self.absent(
                "First differing MoE output",
                "none: all MoE outputs bitwise equal".into(),
            );
            return;
        };
        let d = max_abs_diff(&a.f32s(), &b.f32s());
        self.t.row(vec![
            format!("First differing MoE output ({})", coord_text(a)),
            "captured FP32 vector".into(),
            "captured FP32 vector".into(),
            format!("not bitwise equal; max L∞ = {d}"),
        ]);
        self.j.insert(
            "first_moe".into(),
            json!({"step": a.coord.step, "position": a.coord.position, "layer": a.coord.layer, "max_abs": d}),
        );
        let Some(m) = p.nat.at_site(Component::LayerPostFfnMhc, a) else {
            return;
        };
        let Some(mc) = p.cand.kept.iter().find(|x| x.coord == m.coord) else {
            return;
        };
        let d = max_abs_diff(&m.f32s(), &mc.f32s());
        self.t.row(vec![
            "Post-mHC state at that layer".into(),
            "captured FP32 vector".into(),
            "captured FP32 vector".into(),
            if m.bytes == mc.bytes {
                "bitwise equal".into()
            } else {
                format!("not bitwise equal; max L∞ = {d}")
            },
        ]);
        self.j.insert("post_mhc_max_abs".into(), json!(d));
    }

    /// The first router whose selected set changes.
    fn first_route(&mut self, p: &Pair) {
        let set = |k: &Kept| k.i32s().into_iter().collect::<BTreeSet<i32>>();
        let first = p
            .nat
            .of(Component::RouterTopk)
            .zip(p.cand.of(Component::RouterTopk))
            .find(|(a, b)| a.coord == b.coord && set(a) != set(b));
        let Some((a, b)) = first else {
            self.absent("First changed router", "none: every selected set equal".into());
            return;
        };
        let (sa, sb) = (set(a), set(b));
        let entering: Vec<i32> = sb.difference(&sa).copied().collect();
        let leaving: Vec<i32> = sa.difference(&sb).copied().collect();
        let margin = |c: &Collect| {
            c.at_site(Component::RouterMargin, a)
                .and_then(|x| x.f32s().first().copied())
        };
        let scores = |c: &Collect| {
            c.at_site(Component::RouterScores, a)
                .map(|x| x.f32s())
                .unwrap_or_default()
        };
        let dscore = max_abs_diff(&scores(&p.nat), &scores(&p.cand));
        let fmt = |s: &BTreeSet<i32>, m: Option<f32>| {
            format!("top-{} {:?}; rank-k/k+1 margin {}", s.len(), s, or_dash(m))
        };
        self.t.row(vec![
            format!("First changed router ({})", coord_text(a)),
            fmt(&sa, margin(&p.nat)),
            fmt(&sb, margin(&p.cand)),
            format!("score max L∞ = {dscore}; entering {entering:?}, leaving {leaving:?}"),
        ]);
        self.j.insert(
            "first_route".into(),
            json!({"step": a.coord.step, "position": a.coord.position, "layer": a.coord.layer,
            "native": sa, "candidate": sb, "entering": entering, "leaving": leaving,
            "native_margin": margin(&p.nat), "candidate_margin": margin(&p.cand), "score_max_abs": dscore}),
        );
    }

    /// The first-position LM logits (the prefill step).
    fn first_logits(&mut self, p: &Pair) {
        let (Some(a), Some(b)) = (
            p.nat.at(Component::LmLogits, 0, None),
            p.cand.at(Component::LmLogits, 0, None),
        ) else {
            return;
        };
        let (la, lb) = (a.f32s(), b.f32s());
        let m = |c: &Collect| {
            c.at(Component::LmMargin, 0, None)
                .and_then(|x| x.f32s().first().copied())
        };
        let d = max_abs_diff(&la, &lb);
        let (aa, ab) = (argmax(&la), argmax(&lb));
        self.t.row(vec![
            "First-position LM logits".into(),
            format!("argmax {}; rank-1/2 margin {}", or_dash(aa), or_dash(m(&p.nat))),
            format!("argmax {}; rank-1/2 margin {}", or_dash(ab), or_dash(m(&p.cand))),
            format!(
                "max L∞ = {d}; first greedy token {}",
                if aa == ab { "unchanged" } else { "changed" }
            ),
        ]);
        self.j.insert(
            "first_logits".into(),
            json!({"native_argmax": aa, "candidate_argmax": ab, "native_margin": m(&p.nat), "candidate_margin": m(&p.cand), "max_abs": d}),
        );
    }

    /// The first changed generated token and both continuations.
    fn tokens(&mut self, ctx: &Ctx, ns: &DecodeState, cs: &DecodeState) -> Result<()> {
        let n = ctx.sizes.tokens;
        let first_tok = ns.generated.iter().zip(&cs.generated).position(|(a, b)| a != b);
        match first_tok {
            Some(i) => self.t.row(vec![
                "First changed generated token".into(),
                format!("ordinal {}: token {}", i + 1, ns.generated[i]),
                format!("ordinal {}: token {}", i + 1, cs.generated[i]),
                format!("the first {i} generated token ids agree"),
            ]),
            None => self.absent("First changed generated token", format!("none within {n} tokens")),
        }
        let (nt, ct) = (ctx.decode(&ns.generated)?, ctx.decode(&cs.generated)?);
        self.t.row(vec![
            format!("{n}-token continuation"),
            format!("{nt:?}"),
            format!("{ct:?}"),
            if nt == ct {
                "same".into()
            } else {
                "different greedy continuation".into()
            },
        ]);
        self.j
            .insert("first_changed_ordinal".into(), json!(first_tok.map(|i| i + 1)));
        self.j.insert("native_text".into(), json!(nt));
        self.j.insert("candidate_text".into(), json!(ct));
        self.j.insert("native_tokens".into(), json!(ns.generated));
        self.j.insert("candidate_tokens".into(), json!(cs.generated));
        Ok(())
    }
}
