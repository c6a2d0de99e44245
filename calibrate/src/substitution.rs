//! Protocols 6 and 7, the two endpoint-substitution controls (paper
//! sections 2.4.2, 2.4.3, 3.2.2, 3.2.3) on one single-layer B branch of
//! "why the sheep" at the fork layer, first decode forward (step 1).
//!
//! Branch selection (computed, not chosen by hand): the first B class in
//! cyclic order from 135 (the paper's class; class 0 when k!/2 ≤ 135) whose
//! MoE output at the fork differs from the native output; protocol 7
//! additionally requires that the branch and production independently
//! predict the same next token at the decode boundary (no token is forced).
//!
//! 6. Post-mHC substitution: ΔH = H_B − H_P in FP32 at (step 1, fork layer);
//!    a native run with the runtime's `AddPostFfnMhc` intervention adds ΔH
//!    once after the FFN-half hc_post. The pre-add state must equal H_P and
//!    the result H_B bitwise; every later post-mHC state, route, prediction
//!    and the text must equal the branch's; the pre-fork layers must match.
//! 7. Persistent-state substitution: at the decode boundary after step 1,
//!    ΔS = S_B − S_P over every float of the persistent state; count layers
//!    an FP32 ΔS and an FP64 ΔS reconstruct bitwise; then continue
//!    production from the FP64-reconstructed state and compare every later
//!    post-mHC state, persistent-state checkpoint, route, prediction and text.

use std::collections::BTreeMap;

use anyhow::{bail, Context};
use moeconf_contract::{b_class_count, AggregationContract, ForkCombine, ForkPoint, NativeCombine, Order};
use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
use moeconf_reference_runtime::state::{CompressorState, DecodeState, LayerState};
use serde_json::json;

use super::fork_sweep::capture_event;
use super::{bitwise_eq, frac, max_abs_diff, Claim, Collect, Ctx, Kept, Section, Table};

const PROMPT: &str = "why the sheep";

/// The L2 records of one layer at one decode boundary: (path, bytes) in emission order.
type StateCheckpoint = Vec<(String, Vec<u8>)>;

/// Candidate B classes in the selection order: cyclic from 135, MoE output differing from native.
fn candidate_classes(ctx: &Ctx, ids: &[u32], point: ForkPoint) -> anyhow::Result<Vec<u64>> {
    let n = b_class_count(ctx.k())?;
    let start = if n > 135 { 135 } else { 0 };
    let ev = capture_event(ctx, ids, point.layer, point.step)?;
    let refs: Vec<&[f32]> = ev.terms.iter().map(|v| v.as_slice()).collect();
    let mut y = vec![0.0f32; ev.shared.len()];
    let mut out = Vec::new();
    for i in 0..n {
        let c = (start + i) % n;
        AggregationContract::b()
            .with_order(Order::BClass(c))
            .try_combine(&refs, &ev.shared, &mut y)?;
        if !bitwise_eq(&y, &ev.native) {
            out.push(c);
        }
    }
    Ok(out)
}

fn fork(point: ForkPoint, class: u64) -> ForkCombine {
    ForkCombine::new(point, AggregationContract::b().with_order(Order::BClass(class)))
}

/// Pairs records of two runs by coordinate (records at steps ≥ `from_step`
/// with `path`), counting (equal, total); a record missing on one side counts as unequal.
fn compare_path(a: &Collect, b: &Collect, path: &str, from: impl Fn(&Kept) -> bool) -> (usize, usize) {
    let sel = |c: &Collect| -> Vec<Kept> { c.path(path).filter(|k| from(k)).cloned().collect() };
    let (x, y) = (sel(a), sel(b));
    let equal = x
        .iter()
        .zip(&y)
        .filter(|(p, q)| p.coord == q.coord && p.bytes == q.bytes)
        .count();
    (equal, x.len().max(y.len()))
}

/// Protocol 6.
pub fn post_mhc(ctx: &Ctx) -> anyhow::Result<Section> {
    let ids = ctx.encode(PROMPT)?;
    let point = ForkPoint::first_decode(ctx.fork_layer);
    let n = ctx.sizes.control_tokens.max(3);
    let classes = candidate_classes(ctx, &ids, point)?;
    let class = *classes
        .first()
        .context("no B class changes the fork's MoE output")?;
    ctx.note(&format!(
        "[6] post-mHC substitution control: B class {class}, {n} driver tokens"
    ));
    let keep = ["layer.post_ffn_mhc", "router.topk"];
    let mut branch = Collect::new(&keep);
    let bstate = ctx.generate(&ids, n, &fork(point, class), None, &mut branch)?;
    let mut native = Collect::new(&keep);
    let nstate = ctx.generate(&ids, n, &NativeCombine, None, &mut native)?;
    let l = Some(point.layer);
    let hp = native
        .at("layer.post_ffn_mhc", point.step, l)
        .context("no native H_P")?
        .f32s();
    let hb = branch
        .at("layer.post_ffn_mhc", point.step, l)
        .context("no branch H_B")?
        .f32s();
    let dh: Vec<f32> = hb.iter().zip(&hp).map(|(b, p)| b - p).collect();
    let dh_max = dh.iter().map(|v| f64::from(v.abs())).fold(0.0, f64::max);
    let position = native
        .at("layer.post_ffn_mhc", point.step, l)
        .map(|k| k.coord.position);
    let plan = FaultPlan::new(vec![Fault {
        step: Some(point.step),
        layer: l,
        position,
        kind: FaultKind::AddPostFfnMhc(dh),
    }]);
    let mut inter = Collect::new(&keep);
    let istate = ctx.generate(&ids, n, &NativeCombine, Some(&plan), &mut inter)?;
    let pre = plan.pre_add_states();
    let pre_ok = pre.len() == 1 && bitwise_eq(&pre[0], &hp);
    let hr = inter
        .at("layer.post_ffn_mhc", point.step, l)
        .context("no reconstructed state")?
        .f32s();
    let post_ok = bitwise_eq(&hr, &hb);
    let recon_err = max_abs_diff(&hr, &hb);

    // From the injection point onward, in execution order.
    let after = |k: &Kept| k.coord.step > point.step || (k.coord.step == point.step && k.coord.layer >= l);
    let (mhc_eq, mhc_n) = compare_path(&inter, &branch, "layer.post_ffn_mhc", after);
    let (route_eq, route_n) = compare_path(&inter, &branch, "router.topk", |k| k.coord.step >= point.step);
    let before = |k: &Kept| k.coord.step == point.step && k.coord.layer < l;
    let (pre_eq, pre_n) = compare_path(&branch, &native, "layer.post_ffn_mhc", before);
    let pre_max = branch
        .path("layer.post_ffn_mhc")
        .filter(|k| before(k))
        .zip(native.path("layer.post_ffn_mhc").filter(|k| before(k)))
        .map(|(a, b)| max_abs_diff(&a.f32s(), &b.f32s()))
        .fold(0.0, f64::max);
    let tokens_ok = istate.generated == bstate.generated;
    let (btext, itext, ntext) = (
        ctx.decode(&bstate.generated)?,
        ctx.decode(&istate.generated)?,
        ctx.decode(&nstate.generated)?,
    );
    let holds = pre_ok
        && post_ok
        && mhc_eq == mhc_n
        && route_eq == route_n
        && tokens_ok
        && btext == itext
        && pre_eq == pre_n;

    let mut t = Table::new(
        "mhc_equivalence_summary",
        &format!(
            "Post-mHC substitution control (section 3.2.2): \"{PROMPT}\", B class {class}, layer {}, step {}",
            point.layer, point.step
        ),
        &[
            "Control segment",
            "Compared executions",
            "Measured coverage",
            "Result",
        ],
    );
    t.row(vec![
        "Pre-fork trajectory".into(),
        "B branch vs native reference".into(),
        format!(
            "step {}, layers 0–{} post-mHC",
            point.step,
            point.layer.saturating_sub(1)
        ),
        format!(
            "{} vectors bitwise identical; max L∞ = {pre_max}",
            frac(pre_eq, pre_n)
        ),
    ]);
    t.row(vec![
        "Intervention endpoint".into(),
        "B endpoint vs native H_P + ΔH".into(),
        format!(
            "layer {} post-mHC ({} values; max |ΔH| = {dh_max})",
            point.layer,
            hb.len()
        ),
        format!(
            "pre-add = H_P: {}; H_P + ΔH = H_B: {}; reconstruction error = {recon_err}",
            yes(pre_ok),
            yes(post_ok)
        ),
    ]);
    t.row(vec![
        "Post-boundary latent trajectory".into(),
        "B branch vs native + ΔH".into(),
        "fork endpoint, later layers, later forwards".into(),
        format!("{} post-mHC vectors bitwise identical", frac(mhc_eq, mhc_n)),
    ]);
    t.row(vec![
        "Routing and visible outputs".into(),
        "same pair".into(),
        format!("{route_n} route checkpoints, {n} driver predictions, text"),
        format!(
            "routes {}; predictions {}; text {}",
            frac(route_eq, route_n),
            yes(tokens_ok),
            yes(btext == itext)
        ),
    ]);
    let json = json!({
        "prompt": PROMPT, "class": class, "layer": point.layer, "step": point.step, "driver_tokens": n,
        "delta_h_max_abs": dh_max, "pre_add_equals_h_p": pre_ok, "reconstructed_equals_h_b": post_ok,
        "reconstruction_error": recon_err,
        "post_mhc_equal": mhc_eq, "post_mhc_compared": mhc_n,
        "routes_equal": route_eq, "routes_compared": route_n,
        "predictions_equal": tokens_ok, "text_equal": btext == itext,
        "prefork_equal": pre_eq, "prefork_compared": pre_n, "prefork_max_abs": pre_max,
        "branch_text": btext, "native_text": ntext, "branch_differs_from_native": bstate.generated != nstate.generated,
    });
    Ok(Section {
        key: "post_mhc_substitution".into(),
        tables: vec![t],
        json,
        claims: vec![Claim::new(
            "post_mhc_substitution_reproduces_branch",
            holds,
            format!(
                "class {class}: pre-fork {}, endpoint {}, post-mHC {}, routes {}, predictions and text {}",
                frac(pre_eq, pre_n),
                yes(pre_ok && post_ok),
                frac(mhc_eq, mhc_n),
                frac(route_eq, route_n),
                yes(tokens_ok && btext == itext)
            ),
        )],
    })
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}

fn comp_refs(c: &CompressorState) -> Vec<&Vec<f32>> {
    let mut v = vec![&c.buffer_kv, &c.buffer_gate, &c.compressed_kv];
    v.extend(c.overlap_kv.iter());
    v.extend(c.overlap_gate.iter());
    v
}

fn comp_muts(c: &mut CompressorState) -> Vec<&mut Vec<f32>> {
    let mut v = vec![&mut c.buffer_kv, &mut c.buffer_gate, &mut c.compressed_kv];
    v.extend(c.overlap_kv.iter_mut());
    v.extend(c.overlap_gate.iter_mut());
    v
}

/// Every float component of one layer's persistent state, in canonical order.
fn floats(ls: &LayerState) -> Vec<&Vec<f32>> {
    let mut v = vec![&ls.window_kv];
    if let Some(c) = &ls.compressor {
        v.extend(comp_refs(c));
    }
    if let Some(c) = &ls.indexer {
        v.extend(comp_refs(c));
    }
    v
}

fn floats_mut(ls: &mut LayerState) -> Vec<&mut Vec<f32>> {
    let mut v = vec![&mut ls.window_kv];
    if let Some(c) = &mut ls.compressor {
        v.extend(comp_muts(c));
    }
    if let Some(c) = &mut ls.indexer {
        v.extend(comp_muts(c));
    }
    v
}

/// Bitwise equality of two persistent states (counters and every float).
fn state_eq(a: &DecodeState, b: &DecodeState) -> bool {
    a.position == b.position
        && a.step == b.step
        && a.pending == b.pending
        && a.generated == b.generated
        && a.layers.len() == b.layers.len()
        && a.layers.iter().zip(&b.layers).all(|(x, y)| {
            let (fx, fy) = (floats(x), floats(y));
            x.cumulative_length == y.cumulative_length
                && x.compressor.as_ref().map(|c| c.entry_count)
                    == y.compressor.as_ref().map(|c| c.entry_count)
                && x.indexer.as_ref().map(|c| c.entry_count) == y.indexer.as_ref().map(|c| c.entry_count)
                && fx.len() == fy.len()
                && fx.iter().zip(&fy).all(|(p, q)| bitwise_eq(p, q))
        })
}

/// Protocol 7.
pub fn persistent_state(ctx: &Ctx) -> anyhow::Result<Section> {
    let ids = ctx.encode(PROMPT)?;
    let point = ForkPoint::first_decode(ctx.fork_layer);
    let boundary = point.step as usize + 1; // state after the fork forward
    let n = ctx.sizes.control_tokens.max(boundary + 2);
    // Select the branch: first candidate whose next prediction equals production's.
    let mut null = moeconf_reference_runtime::capture::NullSink;
    let sp = ctx.generate(&ids, boundary, &NativeCombine, None, &mut null)?;
    let mut chosen = None;
    for c in candidate_classes(ctx, &ids, point)? {
        let sb = ctx.generate(&ids, boundary, &fork(point, c), None, &mut null)?;
        if sb.pending == sp.pending {
            chosen = Some((c, sb));
            break;
        }
    }
    let Some((class, sb)) = chosen else {
        bail!("no B class at the fork keeps production's next prediction: the persistent-state control cannot run");
    };
    ctx.note(&format!(
        "[7] persistent-state substitution control: B class {class}, boundary after step {}",
        point.step
    ));
    if sp.layers.len() != sb.layers.len() {
        bail!("production and branch states have different layer counts");
    }
    // ΔS per layer; FP32 and FP64 reconstructions.
    let (mut values, mut differing, mut max_diff) = (0usize, 0usize, 0.0f64);
    let (mut fp32_layers, mut fp64_layers) = (0usize, 0usize);
    let mut identical_layers = Vec::new();
    let mut layer_rows = Vec::new();
    let mut recon = sp.clone();
    for (li, (lp, lb)) in sp.layers.iter().zip(&sb.layers).enumerate() {
        let (fp, fb) = (floats(lp), floats(lb));
        if fp.len() != fb.len() || fp.iter().zip(&fb).any(|(a, b)| a.len() != b.len()) {
            bail!("layer {li}: production and branch states have different shapes");
        }
        let (mut ok32, mut ok64, mut diff_here, mut vals_here) = (true, true, 0usize, 0usize);
        for (a, b) in fp.iter().zip(&fb) {
            for (x, y) in a.iter().zip(b.iter()) {
                vals_here += 1;
                if x.to_bits() != y.to_bits() {
                    diff_here += 1;
                    max_diff = max_diff.max((f64::from(*x) - f64::from(*y)).abs());
                }
                let d32 = y - x;
                ok32 &= (x + d32).to_bits() == y.to_bits();
                let d64 = f64::from(*y) - f64::from(*x);
                ok64 &= ((f64::from(*x) + d64) as f32).to_bits() == y.to_bits();
            }
        }
        // Apply the FP64 delta to the reconstruction (addition, not a copy of S_B).
        for (r, b) in floats_mut(&mut recon.layers[li]).into_iter().zip(&fb) {
            for (x, y) in r.iter_mut().zip(b.iter()) {
                let d64 = f64::from(*y) - f64::from(*x);
                *x = (f64::from(*x) + d64) as f32;
            }
        }
        values += vals_here;
        differing += diff_here;
        fp32_layers += usize::from(ok32);
        fp64_layers += usize::from(ok64);
        if diff_here == 0 {
            identical_layers.push(li);
        }
        layer_rows.push(json!({"layer": li, "values": vals_here, "differing": diff_here,
            "fp32_reconstructs": ok32, "fp64_reconstructs": ok64}));
    }
    let layers = sp.layers.len();
    let recon_ok = state_eq(&recon, &sb);

    // Continue: the branch from scratch (fork at step 1), production + ΔS from the boundary.
    let keep = ["layer.post_ffn_mhc", "router.topk", "state."];
    let mut branch = Collect::new(&keep);
    let bstate = ctx.generate(&ids, n, &fork(point, class), None, &mut branch)?;
    let mut inter = Collect::new(&keep);
    let mut st = recon;
    ctx.advance(&mut st, &ids, n, &NativeCombine, None, &mut inter)?;
    let mut prod = Collect::new(&[]);
    let pstate = ctx.generate(&ids, n, &NativeCombine, None, &mut prod)?;
    let later = |k: &Kept| k.coord.step as usize >= boundary;
    let (mhc_eq, mhc_n) = compare_path(&inter, &branch, "layer.post_ffn_mhc", later);
    let (route_eq, route_n) = compare_path(&inter, &branch, "router.topk", later);
    // Persistent-state checkpoints: one per (step, layer), all components.
    let group = |c: &Collect| {
        let mut m: BTreeMap<(u32, Option<u32>), StateCheckpoint> = BTreeMap::new();
        for k in c
            .kept
            .iter()
            .filter(|k| k.coord.path.starts_with("state.") && later(k))
        {
            m.entry((k.coord.step, k.coord.layer))
                .or_default()
                .push((k.coord.path.clone(), k.bytes.clone()));
        }
        m
    };
    let (gi, gb) = (group(&inter), group(&branch));
    let state_n = gi.len().max(gb.len());
    let state_eq_n = gi.iter().filter(|(k, v)| gb.get(k) == Some(v)).count();
    let tokens_ok = st.generated == bstate.generated;
    let (btext, itext, ptext) = (
        ctx.decode(&bstate.generated)?,
        ctx.decode(&st.generated)?,
        ctx.decode(&pstate.generated)?,
    );
    let holds = recon_ok
        && mhc_eq == mhc_n
        && state_eq_n == state_n
        && route_eq == route_n
        && tokens_ok
        && btext == itext
        && mhc_n > 0;

    let mut t = Table::new(
        "kv_equivalence_summary",
        &format!(
            "Persistent-state substitution control (section 3.2.3): \"{PROMPT}\", B class {class}, boundary after step {}",
            point.step
        ),
        &["Quantity", "Result"],
    );
    t.row(vec!["Full persistent state values".into(), values.to_string()]);
    t.row(vec![
        "Values differing (S_B vs S_P)".into(),
        format!("{differing}; max |ΔS| = {max_diff}"),
    ]);
    t.row(vec![
        "Layers bitwise identical (S_B vs S_P)".into(),
        format!("{identical_layers:?}"),
    ]);
    t.row(vec![
        "FP32 ΔS reconstructs".into(),
        format!("{} layers", frac(fp32_layers, layers)),
    ]);
    t.row(vec![
        "FP64 ΔS reconstructs".into(),
        format!("{} layers", frac(fp64_layers, layers)),
    ]);
    t.row(vec![
        "Reconstructed state = S_B (bitwise, all layers)".into(),
        yes(recon_ok).into(),
    ]);
    t.row(vec![
        "Next driver token (branch = production, not forced)".into(),
        "yes".into(),
    ]);
    t.row(vec!["Later post-mHC states".into(), frac(mhc_eq, mhc_n)]);
    t.row(vec![
        "Later persistent-state checkpoints".into(),
        frac(state_eq_n, state_n),
    ]);
    t.row(vec!["Later routes".into(), frac(route_eq, route_n)]);
    t.row(vec![format!("Driver predictions ({n})"), yes(tokens_ok).into()]);
    t.row(vec!["Generated text".into(), yes(btext == itext).into()]);
    t.row(vec![
        "Production continuation differs from branch".into(),
        yes(pstate.generated != bstate.generated).into(),
    ]);
    let json = json!({
        "prompt": PROMPT, "class": class, "layer": point.layer, "boundary_after_step": point.step,
        "driver_tokens": n, "values": values, "differing_values": differing, "max_abs_delta": max_diff,
        "identical_layers": identical_layers, "layers": layers,
        "fp32_layers_reconstructed": fp32_layers, "fp64_layers_reconstructed": fp64_layers,
        "reconstructed_equals_s_b": recon_ok,
        "post_mhc_equal": mhc_eq, "post_mhc_compared": mhc_n,
        "state_checkpoints_equal": state_eq_n, "state_checkpoints_compared": state_n,
        "routes_equal": route_eq, "routes_compared": route_n,
        "predictions_equal": tokens_ok, "text_equal": btext == itext,
        "branch_text": btext, "production_text": ptext, "per_layer": layer_rows,
    });
    Ok(Section {
        key: "persistent_state_substitution".into(),
        tables: vec![t],
        json,
        claims: vec![
            Claim::new(
                "fp64_delta_reconstructs_every_layer",
                fp64_layers == layers,
                format!(
                    "FP64 ΔS reconstructs {} layers (FP32 ΔS: {})",
                    frac(fp64_layers, layers),
                    frac(fp32_layers, layers)
                ),
            ),
            Claim::new(
                "persistent_state_substitution_reproduces_branch",
                holds,
                format!(
                    "post-mHC {}, state checkpoints {}, routes {}, predictions and text {}",
                    frac(mhc_eq, mhc_n),
                    frac(state_eq_n, state_n),
                    frac(route_eq, route_n),
                    yes(tokens_ok && btext == itext)
                ),
            ),
        ],
    })
}
