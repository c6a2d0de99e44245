//! Protocol 7, the persistent-state substitution control (section 3.2.3).

use std::collections::BTreeMap;

use moeconf_contract::{ForkPoint, NativeCombine};
use moeconf_fingerprint::catalogue::level_of_path;
use moeconf_fingerprint::{Component, Level};
use moeconf_reference_runtime::capture::NullSink;
use moeconf_reference_runtime::state::{CompressorState, DecodeState, LayerState};
use serde_json::{json, Value};

use super::{candidate_classes, fork, yes, PROMPT};
use crate::{
    bitwise_eq, compare_records, frac, CalibrateError, Claim, Collect, Ctx, Kept, Result, Section, Table,
    Tally,
};

/// The L2 records of one layer at one decode boundary: (path, bytes) in emission order.
type StateCheckpoint = Vec<(String, Vec<u8>)>;

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

/// [`floats`], mutable.
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

/// Where protocol 7 substitutes and how far it drives.
struct Plan {
    /// The fork event (first decode forward at the fork layer).
    point: ForkPoint,
    /// Generated tokens at the decode boundary (the state after the fork forward).
    boundary: usize,
    /// Driver tokens.
    n: usize,
}

impl Plan {
    fn new(ctx: &Ctx) -> Plan {
        let point = ForkPoint::first_decode(ctx.fork_layer);
        let boundary = point.step as usize + 1;
        Plan {
            point,
            boundary,
            n: ctx.sizes.control_tokens.max(boundary + 2),
        }
    }
}

/// The branch protocol 7 substitutes: its class and both states at the boundary.
struct Chosen {
    class: u64,
    production: DecodeState,
    branch: DecodeState,
}

/// The first candidate class whose next prediction at the boundary equals production's.
fn choose_branch(ctx: &Ctx, ids: &[u32], plan: &Plan) -> Result<Chosen> {
    let mut null = NullSink;
    let production = ctx.generate(ids, plan.boundary, &NativeCombine, None, &mut null)?;
    for class in candidate_classes(ctx, ids, plan.point)? {
        let branch = ctx.generate(ids, plan.boundary, &fork(plan.point, class), None, &mut null)?;
        if branch.pending == production.pending {
            return Ok(Chosen {
                class,
                production,
                branch,
            });
        }
    }
    Err(CalibrateError::Invalid(
        "no B class at the fork keeps production's next prediction: the persistent-state control cannot run"
            .into(),
    ))
}

/// ΔS = S_B − S_P over every float of the persistent state.
struct StateDelta {
    /// Float values of the state.
    values: usize,
    /// Values that differ.
    differing: usize,
    /// max |ΔS|.
    max_diff: f64,
    /// Layers an FP32 ΔS reconstructs bitwise.
    fp32_layers: usize,
    /// Layers an FP64 ΔS reconstructs bitwise.
    fp64_layers: usize,
    /// Layers with S_B = S_P bitwise.
    identical_layers: Vec<usize>,
    /// Per-layer JSON rows.
    layer_rows: Vec<Value>,
    /// S_P + ΔS (FP64 delta), layer by layer.
    reconstructed: DecodeState,
}

/// Measures ΔS per layer and reconstructs S_P + ΔS with the FP64 delta
/// (an addition, not a copy of S_B).
fn state_delta(sp: &DecodeState, sb: &DecodeState) -> Result<StateDelta> {
    if sp.layers.len() != sb.layers.len() {
        return Err(CalibrateError::Invalid(
            "production and branch states have different layer counts".into(),
        ));
    }
    let mut d = StateDelta {
        values: 0,
        differing: 0,
        max_diff: 0.0,
        fp32_layers: 0,
        fp64_layers: 0,
        identical_layers: Vec::new(),
        layer_rows: Vec::new(),
        reconstructed: sp.clone(),
    };
    for (li, (lp, lb)) in sp.layers.iter().zip(&sb.layers).enumerate() {
        let (fp, fb) = (floats(lp), floats(lb));
        if fp.len() != fb.len() || fp.iter().zip(&fb).any(|(a, b)| a.len() != b.len()) {
            return Err(CalibrateError::Invalid(format!(
                "layer {li}: production and branch states have different shapes"
            )));
        }
        let (mut ok32, mut ok64, mut diff_here, mut vals_here) = (true, true, 0usize, 0usize);
        for (a, b) in fp.iter().zip(&fb) {
            for (x, y) in a.iter().zip(b.iter()) {
                vals_here += 1;
                if x.to_bits() != y.to_bits() {
                    diff_here += 1;
                    d.max_diff = d.max_diff.max((f64::from(*x) - f64::from(*y)).abs());
                }
                let d32 = y - x;
                ok32 &= (x + d32).to_bits() == y.to_bits();
                let d64 = f64::from(*y) - f64::from(*x);
                ok64 &= ((f64::from(*x) + d64) as f32).to_bits() == y.to_bits();
            }
        }
        for (r, b) in floats_mut(&mut d.reconstructed.layers[li]).into_iter().zip(&fb) {
            for (x, y) in r.iter_mut().zip(b.iter()) {
                let d64 = f64::from(*y) - f64::from(*x);
                *x = (f64::from(*x) + d64) as f32;
            }
        }
        d.values += vals_here;
        d.differing += diff_here;
        d.fp32_layers += usize::from(ok32);
        d.fp64_layers += usize::from(ok64);
        if diff_here == 0 {
            d.identical_layers.push(li);
        }
        d.layer_rows
            .push(json!({"layer": li, "values": vals_here, "differing": diff_here,
            "fp32_reconstructs": ok32, "fp64_reconstructs": ok64}));
    }
    Ok(d)
}

/// The continuation after the boundary: the branch from scratch against
/// production continued from S_P + ΔS.
struct Continuation {
    /// Later post-mHC states.
    mhc: Tally,
    /// Later routes.
    routes: Tally,
    /// Later persistent-state checkpoints (one per step and layer).
    states: Tally,
    /// Predictions of the reconstructed run equal the branch's.
    tokens_ok: bool,
    branch_text: String,
    reconstructed_text: String,
    production_text: String,
    production_differs: bool,
}

/// Persistent-state checkpoints at or after the boundary: one per (step, layer), all components.
fn checkpoints(c: &Collect, boundary: usize) -> BTreeMap<(u32, Option<u32>), StateCheckpoint> {
    let mut m: BTreeMap<(u32, Option<u32>), StateCheckpoint> = BTreeMap::new();
    for k in c
        .kept
        .iter()
        .filter(|k| level_of_path(&k.coord.path) == Some(Level::L2) && k.coord.step as usize >= boundary)
    {
        m.entry((k.coord.step, k.coord.layer))
            .or_default()
            .push((k.coord.path.to_string(), k.bytes.clone()));
    }
    m
}

fn continue_runs(
    ctx: &Ctx,
    ids: &[u32],
    plan: &Plan,
    class: u64,
    reconstructed: DecodeState,
) -> Result<Continuation> {
    let (point, boundary, n) = (plan.point, plan.boundary, plan.n);
    let keep = [Component::LayerPostFfnMhc, Component::RouterTopk];
    let mut branch = Collect::with_level(&keep, Level::L2);
    let bstate = ctx.generate(ids, n, &fork(point, class), None, &mut branch)?;
    let mut inter = Collect::with_level(&keep, Level::L2);
    let mut st = reconstructed;
    ctx.advance(&mut st, ids, n, &NativeCombine, None, &mut inter)?;
    let mut prod = Collect::new(&[]);
    let pstate = ctx.generate(ids, n, &NativeCombine, None, &mut prod)?;
    let later = |k: &Kept| k.coord.step as usize >= boundary;
    let (gi, gb) = (checkpoints(&inter, boundary), checkpoints(&branch, boundary));
    Ok(Continuation {
        mhc: compare_records(&inter, &branch, Component::LayerPostFfnMhc, later),
        routes: compare_records(&inter, &branch, Component::RouterTopk, later),
        states: Tally {
            equal: gi.iter().filter(|(k, v)| gb.get(k) == Some(v)).count(),
            total: gi.len().max(gb.len()),
        },
        tokens_ok: st.generated == bstate.generated,
        branch_text: ctx.decode(&bstate.generated)?,
        reconstructed_text: ctx.decode(&st.generated)?,
        production_text: ctx.decode(&pstate.generated)?,
        production_differs: pstate.generated != bstate.generated,
    })
}

/// Protocol 7.
pub fn persistent_state(ctx: &Ctx) -> Result<Section> {
    let ids = ctx.encode(PROMPT)?;
    let plan = Plan::new(ctx);
    let chosen = choose_branch(ctx, &ids, &plan)?;
    ctx.note(&format!(
        "[7] persistent-state substitution control: B class {}, boundary after step {}",
        chosen.class, plan.point.step
    ));
    let delta = state_delta(&chosen.production, &chosen.branch)?;
    let recon_ok = state_eq(&delta.reconstructed, &chosen.branch);
    let layers = chosen.production.layers.len();
    let cont = continue_runs(ctx, &ids, &plan, chosen.class, delta.reconstructed.clone())?;
    let r = Report {
        class: chosen.class,
        point: plan.point,
        n: plan.n,
        layers,
        recon_ok,
        delta,
        cont,
    };
    Ok(Section {
        key: "persistent_state_substitution".into(),
        tables: vec![r.table()],
        json: r.json(),
        claims: r.claims(),
    })
}

/// Everything protocol 7 reports.
struct Report {
    class: u64,
    point: ForkPoint,
    /// Driver tokens.
    n: usize,
    layers: usize,
    /// S_P + ΔS = S_B bitwise.
    recon_ok: bool,
    delta: StateDelta,
    cont: Continuation,
}

impl Report {
    fn text_ok(&self) -> bool {
        self.cont.branch_text == self.cont.reconstructed_text
    }

    fn table(&self) -> Table {
        let (d, c) = (&self.delta, &self.cont);
        let mut t = Table::new(
            "kv_equivalence_summary",
            &format!(
                "Persistent-state substitution control (section 3.2.3): \"{PROMPT}\", B class {}, boundary after step {}",
                self.class, self.point.step
            ),
            &["Quantity", "Result"],
        );
        let rows: [(String, String); 13] = [
            ("Full persistent state values".into(), d.values.to_string()),
            (
                "Values differing (S_B vs S_P)".into(),
                format!("{}; max |ΔS| = {}", d.differing, d.max_diff),
            ),
            (
                "Layers bitwise identical (S_B vs S_P)".into(),
                format!("{:?}", d.identical_layers),
            ),
            (
                "FP32 ΔS reconstructs".into(),
                format!("{} layers", frac(d.fp32_layers, self.layers)),
            ),
            (
                "FP64 ΔS reconstructs".into(),
                format!("{} layers", frac(d.fp64_layers, self.layers)),
            ),
            (
                "Reconstructed state = S_B (bitwise, all layers)".into(),
                yes(self.recon_ok).into(),
            ),
            (
                "Next driver token (branch = production, not forced)".into(),
                "yes".into(),
            ),
            ("Later post-mHC states".into(), c.mhc.frac()),
            ("Later persistent-state checkpoints".into(), c.states.frac()),
            ("Later routes".into(), c.routes.frac()),
            (
                format!("Driver predictions ({})", self.n),
                yes(c.tokens_ok).into(),
            ),
            ("Generated text".into(), yes(self.text_ok()).into()),
            (
                "Production continuation differs from branch".into(),
                yes(c.production_differs).into(),
            ),
        ];
        for (q, r) in rows {
            t.row(vec![q, r]);
        }
        t
    }

    fn json(&self) -> Value {
        let (d, c) = (&self.delta, &self.cont);
        json!({
            "prompt": PROMPT, "class": self.class, "layer": self.point.layer, "boundary_after_step": self.point.step,
            "driver_tokens": self.n, "values": d.values, "differing_values": d.differing, "max_abs_delta": d.max_diff,
            "identical_layers": d.identical_layers, "layers": self.layers,
            "fp32_layers_reconstructed": d.fp32_layers, "fp64_layers_reconstructed": d.fp64_layers,
            "reconstructed_equals_s_b": self.recon_ok,
            "post_mhc_equal": c.mhc.equal, "post_mhc_compared": c.mhc.total,
            "state_checkpoints_equal": c.states.equal, "state_checkpoints_compared": c.states.total,
            "routes_equal": c.routes.equal, "routes_compared": c.routes.total,
            "predictions_equal": c.tokens_ok, "text_equal": self.text_ok(),
            "branch_text": c.branch_text, "production_text": c.production_text, "per_layer": d.layer_rows,
        })
    }

    fn claims(&self) -> Vec<Claim> {
        let (d, c) = (&self.delta, &self.cont);
        let holds = self.recon_ok
            && c.mhc.all()
            && c.states.all()
            && c.routes.all()
            && c.tokens_ok
            && self.text_ok()
            && c.mhc.total > 0;
        vec![
            Claim::new(
                "fp64_delta_reconstructs_every_layer",
                d.fp64_layers == self.layers,
                format!(
                    "FP64 ΔS reconstructs {} layers (FP32 ΔS: {})",
                    frac(d.fp64_layers, self.layers),
                    frac(d.fp32_layers, self.layers)
                ),
            ),
            Claim::new(
                "persistent_state_substitution_reproduces_branch",
                holds,
                format!(
                    "post-mHC {}, state checkpoints {}, routes {}, predictions and text {}",
                    c.mhc.frac(),
                    c.states.frac(),
                    c.routes.frac(),
                    yes(c.tokens_ok && self.text_ok())
                ),
            ),
        ]
    }
}
