//! Protocol 11, the fork protocol at a context (issue 35 item 4): the
//! paper's single-layer fork (section 3.2: scheme B, class 135, at the fork
//! layer in the first decode forward) against the native run, both
//! continued greedily, at the short context ("why the sheep") and, with
//! `--context N`, at an N-token prompt ([`context_prompt`]), side by side.
//!
//! The prefill (step 0) is the same computation in both runs (the fork is at
//! step 1), so it runs once and the decode state is cloned; the two runs
//! then advance in lockstep and are compared step by step, nothing being
//! kept beyond the current step (a 32k-token context's records would not
//! fit in memory):
//!
//! * L0: the generated tokens (first differing generated token);
//! * L1: the step's logits (max |Δ|, argmax);
//! * L3: every post-mHC checkpoint (`layer.post_attn_mhc`,
//!   `layer.post_ffn_mhc`) and route (`router.topk`) of the step: how many
//!   differ, max |Δ| of the post-mHC state, the first differing checkpoint;
//! * L2: the persistent state after the step, compared value by value in
//!   every layer and component (window, compressor and indexer buffers,
//!   caches, overlap): differing layers, components and values, max |Δ|.
//!
//! The fork's own MoE output (`moe.combine` at the fork layer, step 1) is
//! compared too: a class that leaves it unchanged is reported as such.
//!
//! Structural claim (any model, any context): at the fork step every
//! post-mHC checkpoint before the fork layer's FFN half is bitwise equal,
//! and the state after it is bitwise equal in the layers up to the fork
//! layer (its attention state was committed before its MoE ran).

use moeconf_contract::{b_class_count, AggregationContract, ForkCombine, ForkPoint, NativeCombine, Order};
use moeconf_fingerprint::{Component, Coord, Level, TensorView};
use moeconf_reference_runtime::capture::{CaptureError, CaptureSink, NullSink};
use moeconf_reference_runtime::state::{CompressorState, DecodeState, LayerState};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::fault_matrix::LONG_PASSAGE;
use crate::{max_abs_diff, CalibrateError, Claim, Ctx, Kept, Result, Section, Table};

/// The short context's prompt (the paper's and the demo's).
pub const SHORT_PROMPT: &str = "why the sheep";

/// The paper's B class.
const PAPER_CLASS: u64 = 135;

/// Seed of the word draw of [`context_prompt`].
const PROMPT_SEED: u64 = 0x6d6f_6563_6f6e_6633;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The text of [`context_prompt`] with `words` words: word i is the word of
/// [`LONG_PASSAGE`] at index splitmix64(seed + i) mod its word count (a
/// deterministic draw, not a repetition of the passage).
pub fn context_text(words: usize) -> String {
    let pool: Vec<&str> = LONG_PASSAGE.split_whitespace().collect();
    let mut s = String::new();
    for i in 0..words {
        if i > 0 {
            s.push(' ');
        }
        let j = (splitmix64(PROMPT_SEED.wrapping_add(i as u64)) % pool.len() as u64) as usize;
        s.push_str(pool[j]);
    }
    s
}

/// A prompt of exactly `n` tokens: the ids of [`context_text`] with enough
/// words (doubled until it reaches `n` ids), cut to the first `n`.
pub fn context_prompt(ctx: &Ctx, n: usize) -> Result<Vec<u32>> {
    if n == 0 {
        return Err(CalibrateError::Invalid("a context of 0 tokens".into()));
    }
    let mut words = n.div_ceil(2).max(1);
    loop {
        let ids = ctx.encode(&context_text(words))?;
        if ids.len() >= n {
            return Ok(ids[..n].to_vec());
        }
        // Every word is at least one id, so 2n words always reach n ids.
        if words >= n.saturating_mul(2) {
            return Err(CalibrateError::Invalid(format!(
                "{words} words of the passage give {} ids, fewer than {n}",
                ids.len()
            )));
        }
        words = words.saturating_mul(2).min(n.saturating_mul(2));
    }
}

/// The records one step of one run leaves: post-mHC checkpoints, routes,
/// logits and (at the fork step) the MoE combine, in emission order.
struct StepSink {
    /// Whether L4 is wanted (the fork step only, for `moe.combine`).
    l4: bool,
    kept: Vec<Kept>,
}

impl StepSink {
    const KEEP: [Component; 4] = [
        Component::LayerPostAttnMhc,
        Component::LayerPostFfnMhc,
        Component::RouterTopk,
        Component::LmLogits,
    ];

    fn new(l4: bool) -> StepSink {
        StepSink { l4, kept: Vec::new() }
    }

    fn of(&self, c: Component) -> impl Iterator<Item = &Kept> + '_ {
        self.kept.iter().filter(move |k| c.matches(&k.coord.path))
    }
}

impl CaptureSink for StepSink {
    fn wants(&self, level: Level) -> bool {
        matches!(level, Level::L1 | Level::L3) || (self.l4 && level == Level::L4)
    }

    fn record(&mut self, coord: Coord, _level: Level, tensor: TensorView<'_>) -> Result<(), CaptureError> {
        let keep = Self::KEEP.iter().any(|c| c.matches(&coord.path))
            || (self.l4 && Component::MoeCombine.matches(&coord.path));
        if keep {
            self.kept.push(Kept {
                coord,
                bytes: tensor.bytes.to_vec(),
            });
        }
        Ok(())
    }
}

/// The float arrays of one compressor state, named under `name`.
fn compressor_arrays<'a>(name: &str, c: &'a CompressorState, v: &mut Vec<(String, &'a [f32])>) {
    v.push((format!("{name}.buffer_kv"), &c.buffer_kv));
    v.push((format!("{name}.buffer_gate"), &c.buffer_gate));
    v.push((format!("{name}.compressed_kv"), &c.compressed_kv));
    if let Some(o) = &c.overlap_kv {
        v.push((format!("{name}.overlap_kv"), o));
    }
    if let Some(o) = &c.overlap_gate {
        v.push((format!("{name}.overlap_gate"), o));
    }
}

/// Every float component of one layer's persistent state, named.
fn components(ls: &LayerState) -> Vec<(String, &[f32])> {
    let mut v: Vec<(String, &[f32])> = vec![("window_kv".into(), &ls.window_kv)];
    if let Some(c) = &ls.compressor {
        compressor_arrays("compressor", c, &mut v);
    }
    if let Some(c) = &ls.indexer {
        compressor_arrays("indexer", c, &mut v);
    }
    v
}

/// The persistent state of two runs compared after one step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct StateCmp {
    /// Layers with a differing value (ascending).
    layers: Vec<u32>,
    /// Differing components (one per layer and array) of all components.
    components: usize,
    /// Their names, `L<layer>.<array>` (e.g. `L6.compressor.compressed_kv`).
    differing: Vec<String>,
    components_total: usize,
    values: u64,
    values_total: u64,
    max_abs: f64,
}

fn compare_states(a: &DecodeState, b: &DecodeState) -> Result<StateCmp> {
    if a.layers.len() != b.layers.len() {
        return Err(CalibrateError::Invalid(
            "the two runs' states have different layer counts".into(),
        ));
    }
    let mut s = StateCmp::default();
    for (li, (la, lb)) in a.layers.iter().zip(&b.layers).enumerate() {
        let (ca, cb) = (components(la), components(lb));
        if ca.len() != cb.len() {
            return Err(CalibrateError::Invalid(format!(
                "layer {li}: the states have different components"
            )));
        }
        let mut layer_differs = false;
        for ((name, x), (_, y)) in ca.iter().zip(&cb) {
            if x.len() != y.len() {
                return Err(CalibrateError::Invalid(format!(
                    "layer {li} {name}: the states have different sizes"
                )));
            }
            s.components_total += 1;
            s.values_total += x.len() as u64;
            let mut n = 0u64;
            for (p, q) in x.iter().zip(y.iter()) {
                if p.to_bits() != q.to_bits() {
                    n += 1;
                    s.max_abs = s.max_abs.max((f64::from(*p) - f64::from(*q)).abs());
                }
            }
            if n > 0 {
                s.components += 1;
                s.differing.push(format!("L{li}.{name}"));
                s.values += n;
                layer_differs = true;
            }
        }
        if layer_differs {
            s.layers.push(li as u32);
        }
    }
    Ok(s)
}

/// One decode step of the two runs compared.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct StepRow {
    step: u32,
    /// Tokens predicted by the step (generated token `step + 1`, 1-based).
    native_token: u32,
    fork_token: u32,
    /// Post-mHC checkpoints of the step that differ, of all.
    mhc_differing: usize,
    mhc_total: usize,
    /// Max |Δ| over the step's post-mHC checkpoints.
    mhc_max_abs: f64,
    /// `router.topk` records that differ, of all.
    routes_differing: usize,
    routes_total: usize,
    /// Max |Δ| of the step's logits.
    logits_max_abs: f64,
    /// The persistent state after the step.
    state: StateCmp,
}

/// The first post-mHC checkpoint that differs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct FirstMhc {
    step: u32,
    layer: u32,
    record: String,
}

/// The protocol at one context.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ContextRun {
    /// `short` or `N tokens`.
    name: String,
    prompt_tokens: usize,
    /// Prefill seconds are not recorded (results are byte-identical across runs).
    class: u64,
    /// Whether the fork changed the MoE output at the fork event.
    fork_changed_moe: bool,
    /// Max |Δ| of the fork's MoE output.
    fork_moe_max_abs: f64,
    first_mhc: Option<FirstMhc>,
    /// First decode boundary (after step s) and layer whose state differs.
    first_state: Option<(u32, u32)>,
    /// First step whose predicted token differs (generated token step + 1).
    first_token_step: Option<u32>,
    /// Post-mHC checkpoints of the fork step before the fork layer's FFN half: equal / total.
    prefix_mhc_equal: usize,
    prefix_mhc_total: usize,
    /// Layers up to the fork layer equal in the state after the fork step.
    prefix_state_equal: bool,
    native_text: String,
    fork_text: String,
    steps: Vec<StepRow>,
}

/// One run's records of a step, by kind.
fn mhc(s: &StepSink) -> Vec<&Kept> {
    s.kept
        .iter()
        .filter(|k| {
            Component::LayerPostAttnMhc.matches(&k.coord.path)
                || Component::LayerPostFfnMhc.matches(&k.coord.path)
        })
        .collect()
}

/// Runs the protocol on `ids` for `n` generated tokens (steps 0..n-1).
fn at_context(ctx: &Ctx, name: &str, ids: &[u32], n: usize) -> Result<ContextRun> {
    let classes = b_class_count(ctx.k())?;
    let class = if classes > PAPER_CLASS { PAPER_CLASS } else { 0 };
    let point = ForkPoint::first_decode(ctx.fork_layer);
    let fork = ForkCombine::new(point, AggregationContract::b().with_order(Order::BClass(class)));
    let fl = ctx.fork_layer;
    ctx.note(&format!("[11] fork at {name}: prefill of {} tokens", ids.len()));
    let mut nat = ctx.m.model.new_state();
    ctx.advance(&mut nat, ids, 1, &NativeCombine, None, &mut NullSink)?;
    let mut frk: DecodeState = nat.clone();
    let mut run = ContextRun {
        name: name.into(),
        prompt_tokens: ids.len(),
        class,
        fork_changed_moe: false,
        fork_moe_max_abs: 0.0,
        first_mhc: None,
        first_state: None,
        first_token_step: None,
        prefix_mhc_equal: 0,
        prefix_mhc_total: 0,
        prefix_state_equal: false,
        native_text: String::new(),
        fork_text: String::new(),
        steps: Vec::new(),
    };
    for step in 1..n as u32 {
        let at_fork = step == point.step;
        let (mut sn, mut sf) = (StepSink::new(at_fork), StepSink::new(at_fork));
        ctx.advance(&mut nat, ids, step as usize + 1, &NativeCombine, None, &mut sn)?;
        ctx.advance(&mut frk, ids, step as usize + 1, &fork, None, &mut sf)?;
        let (mn, mf) = (mhc(&sn), mhc(&sf));
        if mn.len() != mf.len() {
            return Err(CalibrateError::Invalid(format!(
                "step {step}: the runs have different post-mHC records"
            )));
        }
        let mut row = StepRow {
            step,
            native_token: nat.generated.last().copied().unwrap_or(0),
            fork_token: frk.generated.last().copied().unwrap_or(0),
            mhc_differing: 0,
            mhc_total: mn.len(),
            mhc_max_abs: 0.0,
            routes_differing: 0,
            routes_total: 0,
            logits_max_abs: 0.0,
            state: compare_states(&nat, &frk)?,
        };
        for (a, b) in mn.iter().zip(&mf) {
            let differs = a.bytes != b.bytes;
            if differs {
                row.mhc_differing += 1;
                row.mhc_max_abs = row.mhc_max_abs.max(max_abs_diff(&a.f32s(), &b.f32s()));
                if run.first_mhc.is_none() {
                    run.first_mhc = Some(FirstMhc {
                        step,
                        layer: a.coord.layer.unwrap_or(0),
                        record: a.coord.path.to_string(),
                    });
                }
            }
            if at_fork {
                // Before the fork layer's FFN half: layers below it, and its attention half.
                let layer = a.coord.layer.unwrap_or(0);
                let before =
                    layer < fl || (layer == fl && Component::LayerPostAttnMhc.matches(&a.coord.path));
                if before {
                    run.prefix_mhc_total += 1;
                    run.prefix_mhc_equal += usize::from(!differs);
                }
            }
        }
        let (rn, rf): (Vec<&Kept>, Vec<&Kept>) = (
            sn.of(Component::RouterTopk).collect(),
            sf.of(Component::RouterTopk).collect(),
        );
        row.routes_total = rn.len().max(rf.len());
        row.routes_differing =
            rn.iter().zip(&rf).filter(|(a, b)| a.bytes != b.bytes).count() + rn.len().abs_diff(rf.len());
        if let (Some(a), Some(b)) = (
            sn.of(Component::LmLogits).last(),
            sf.of(Component::LmLogits).last(),
        ) {
            row.logits_max_abs = max_abs_diff(&a.f32s(), &b.f32s());
        }
        if at_fork {
            let pick = |s: &StepSink| {
                s.of(Component::MoeCombine)
                    .filter(|k| k.coord.layer == Some(fl))
                    .map(|k| k.f32s())
                    .collect::<Vec<_>>()
            };
            let (cn, cf) = (pick(&sn), pick(&sf));
            run.fork_changed_moe =
                cn.len() != cf.len() || cn.iter().zip(&cf).any(|(a, b)| !crate::bitwise_eq(a, b));
            run.fork_moe_max_abs = cn
                .iter()
                .zip(&cf)
                .map(|(a, b)| max_abs_diff(a, b))
                .fold(0.0, f64::max);
            run.prefix_state_equal = row.state.layers.iter().all(|&l| l > fl);
        }
        if run.first_state.is_none() {
            if let Some(&l) = row.state.layers.first() {
                run.first_state = Some((step, l));
            }
        }
        if run.first_token_step.is_none() && row.native_token != row.fork_token {
            run.first_token_step = Some(step);
        }
        run.steps.push(row);
    }
    let text = |s: &DecodeState| ctx.decode(&s.generated);
    run.native_text = text(&nat)?;
    run.fork_text = text(&frk)?;
    Ok(run)
}

fn fmt_abs(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else {
        format!("{x:.3e}")
    }
}

/// Whether a step's row is printed: the first 8 decode steps, every 8th,
/// the last, and the first step with a differing token.
fn printed(r: &StepRow, run: &ContextRun, last: u32) -> bool {
    r.step <= 8 || r.step.is_multiple_of(8) || r.step == last || Some(r.step) == run.first_token_step
}

/// Refuses a context of `c` prompt tokens and `n` decoded ones that exceeds
/// DeepSeek-V4's context or this machine's memory, before anything runs:
/// the protocol holds two decode states (native and forked) and captures
/// nothing but what it compares, so the estimate is the tokens-only run's
/// with its state counted twice.
fn check_context_fits(ctx: &Ctx, c: u64, n: u64) -> Result<()> {
    use moeconf_runner::limits::{available_memory, check_memory_for, estimate_memory, Sizing};
    let tokens_only = moeconf_runner::parse_capture("L0")?;
    let mut e = estimate_memory(ctx.m.model.config(), c, n, tokens_only, None);
    e.state = e.state.saturating_mul(2);
    check_memory_for(Sizing::CalibrateContext, &e, available_memory(), c, n)?;
    Ok(())
}

/// Runs protocol 11: the short context and, with `--context N`, N tokens.
pub fn run(ctx: &Ctx) -> Result<Section> {
    let n = ctx.sizes.fork_tokens;
    if let Some(c) = ctx.sizes.context {
        check_context_fits(ctx, u64::from(c), n as u64)?;
    }
    let mut runs = vec![at_context(ctx, "short", &ctx.encode(SHORT_PROMPT)?, n)?];
    if let Some(c) = ctx.sizes.context {
        let ids = context_prompt(ctx, c as usize)?;
        runs.push(at_context(ctx, &format!("{c} tokens"), &ids, n)?);
    }
    let mut summary = Table::new(
        "context_fork",
        &format!(
            "Fork protocol by context (B, layer {}, first decode forward, {n} generated tokens)",
            ctx.fork_layer
        ),
        &[
            "Context",
            "Prompt tokens",
            "B class",
            "Fork MoE output changed (max |Δ|)",
            "First differing post-mHC (step, layer, record)",
            "First differing state (after step, layer)",
            "First differing generated token",
            "Last step: post-mHC / routes / state layers / state values differing",
        ],
    );
    let mut per_step = Table::new(
        "context_fork_steps",
        "Fork protocol by context: divergence per decode step (native vs fork)",
        &[
            "Context",
            "Step",
            "Tokens (native, fork)",
            "Post-mHC differing",
            "Post-mHC max |Δ|",
            "Routes differing",
            "Logits max |Δ|",
            "State layers differing",
            "State values differing",
            "State max |Δ|",
        ],
    );
    for r in &runs {
        let last = r.steps.last();
        summary.row(vec![
            r.name.clone(),
            r.prompt_tokens.to_string(),
            r.class.to_string(),
            format!(
                "{} ({})",
                if r.fork_changed_moe { "yes" } else { "no" },
                fmt_abs(r.fork_moe_max_abs)
            ),
            r.first_mhc.as_ref().map_or("none".into(), |f| {
                format!("{}, {}, {}", f.step, f.layer, f.record)
            }),
            r.first_state.map_or("none".into(), |(s, l)| format!("{s}, {l}")),
            r.first_token_step
                .map_or(format!("none within {n}"), |s| format!("{} (step {s})", s + 1)),
            last.map_or("-".into(), |l| {
                format!(
                    "{}/{} / {}/{} / {} / {}/{}",
                    l.mhc_differing,
                    l.mhc_total,
                    l.routes_differing,
                    l.routes_total,
                    l.state.layers.len(),
                    l.state.values,
                    l.state.values_total
                )
            }),
        ]);
        let last_step = last.map_or(0, |l| l.step);
        for s in r.steps.iter().filter(|s| printed(s, r, last_step)) {
            per_step.row(vec![
                r.name.clone(),
                s.step.to_string(),
                format!("{}, {}", s.native_token, s.fork_token),
                format!("{}/{}", s.mhc_differing, s.mhc_total),
                fmt_abs(s.mhc_max_abs),
                format!("{}/{}", s.routes_differing, s.routes_total),
                fmt_abs(s.logits_max_abs),
                format!("{}", s.state.layers.len()),
                format!("{}/{}", s.state.values, s.state.values_total),
                fmt_abs(s.state.max_abs),
            ]);
        }
    }
    let holds = runs
        .iter()
        .all(|r| r.prefix_mhc_equal == r.prefix_mhc_total && r.prefix_state_equal);
    let detail = runs
        .iter()
        .map(|r| {
            format!(
                "{}: post-mHC before the fork {}/{} equal, state layers 0-{} after the fork step {}",
                r.name,
                r.prefix_mhc_equal,
                r.prefix_mhc_total,
                ctx.fork_layer,
                if r.prefix_state_equal { "equal" } else { "DIFFER" }
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    Ok(Section {
        key: "context_fork".into(),
        tables: vec![summary, per_step],
        json: json!({
            "fork_layer": ctx.fork_layer,
            "tokens": n,
            "contexts": runs,
        }),
        claims: vec![Claim::new("context_fork_prefix_identical", holds, detail)],
    })
}
