//! Protocol 6, the post-mHC substitution control (section 3.2.2).

use moeconf_contract::{ForkPoint, NativeCombine};
use moeconf_fingerprint::Component;
use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
use serde_json::{json, Value};

use super::{candidate_classes, fork, yes, PROMPT};
use crate::{
    bitwise_eq, compare_records, max_abs_diff, CalibrateError, Claim, Collect, Ctx, Kept, Result, Section,
    Table, Tally,
};

const MHC: Component = Component::LayerPostFfnMhc;

/// What protocol 6 measured.
struct PostMhc {
    class: u64,
    point: ForkPoint,
    /// Driver tokens.
    n: usize,
    /// Values of H_B.
    values: usize,
    /// max |ΔH|.
    dh_max: f64,
    /// The intervention's pre-add state equals H_P.
    pre_ok: bool,
    /// H_P + ΔH equals H_B.
    post_ok: bool,
    /// max |H_P + ΔH − H_B|.
    recon_err: f64,
    /// Post-mHC states from the injection point on, intervention vs branch.
    mhc: Tally,
    /// Routes from the fork step on, intervention vs branch.
    routes: Tally,
    /// Pre-fork post-mHC states of the fork step, branch vs native.
    prefork: Tally,
    /// max |Δ| over the pre-fork states.
    prefork_max: f64,
    /// Generated ids of intervention and branch equal.
    tokens_ok: bool,
    branch_text: String,
    intervention_text: String,
    native_text: String,
    branch_differs_from_native: bool,
}

/// Protocol 6.
pub fn post_mhc(ctx: &Ctx) -> Result<Section> {
    let ids = ctx.encode(PROMPT)?;
    let point = ForkPoint::first_decode(ctx.fork_layer);
    let n = ctx.sizes.control_tokens.max(3);
    let classes = candidate_classes(ctx, &ids, point)?;
    let class = *classes
        .first()
        .ok_or_else(|| CalibrateError::Invalid("no B class changes the fork's MoE output".into()))?;
    ctx.note(&format!(
        "[6] post-mHC substitution control: B class {class}, {n} driver tokens"
    ));
    let m = measure(ctx, &ids, point, class, n)?;
    Ok(Section {
        key: "post_mhc_substitution".into(),
        tables: vec![m.table()],
        json: m.json(),
        claims: vec![m.claim()],
    })
}

fn measure(ctx: &Ctx, ids: &[u32], point: ForkPoint, class: u64, n: usize) -> Result<PostMhc> {
    let keep = [MHC, Component::RouterTopk];
    let mut branch = Collect::new(&keep);
    let bstate = ctx.generate(ids, n, &fork(point, class), None, &mut branch)?;
    let mut native = Collect::new(&keep);
    let nstate = ctx.generate(ids, n, &NativeCombine, None, &mut native)?;
    let l = Some(point.layer);
    let state = |c: &Collect, what: &str| {
        c.at(MHC, point.step, l)
            .map(|k| k.f32s())
            .ok_or_else(|| CalibrateError::MissingRecord(format!("no {what}")))
    };
    let hp = state(&native, "native H_P")?;
    let hb = state(&branch, "branch H_B")?;
    let dh: Vec<f32> = hb.iter().zip(&hp).map(|(b, p)| b - p).collect();
    let dh_max = dh.iter().map(|v| f64::from(v.abs())).fold(0.0, f64::max);
    let position = native.at(MHC, point.step, l).map(|k| k.coord.position);
    let plan = FaultPlan::new(vec![Fault {
        step: Some(point.step),
        layer: l,
        position,
        kind: FaultKind::AddPostFfnMhc(dh),
    }]);
    let mut inter = Collect::new(&keep);
    let istate = ctx.generate(ids, n, &NativeCombine, Some(&plan), &mut inter)?;
    let pre = plan.pre_add_states();
    let hr = state(&inter, "reconstructed state")?;

    // From the injection point onward, in execution order.
    let after = |k: &Kept| k.coord.step > point.step || (k.coord.step == point.step && k.coord.layer >= l);
    let before = |k: &Kept| k.coord.step == point.step && k.coord.layer < l;
    let prefork_max = branch
        .of(MHC)
        .filter(|k| before(k))
        .zip(native.of(MHC).filter(|k| before(k)))
        .map(|(a, b)| max_abs_diff(&a.f32s(), &b.f32s()))
        .fold(0.0, f64::max);
    Ok(PostMhc {
        class,
        point,
        n,
        values: hb.len(),
        dh_max,
        pre_ok: pre.len() == 1 && bitwise_eq(&pre[0], &hp),
        post_ok: bitwise_eq(&hr, &hb),
        recon_err: max_abs_diff(&hr, &hb),
        mhc: compare_records(&inter, &branch, MHC, after),
        routes: compare_records(&inter, &branch, Component::RouterTopk, |k| {
            k.coord.step >= point.step
        }),
        prefork: compare_records(&branch, &native, MHC, before),
        prefork_max,
        tokens_ok: istate.generated == bstate.generated,
        branch_text: ctx.decode(&bstate.generated)?,
        intervention_text: ctx.decode(&istate.generated)?,
        native_text: ctx.decode(&nstate.generated)?,
        branch_differs_from_native: bstate.generated != nstate.generated,
    })
}

impl PostMhc {
    fn text_ok(&self) -> bool {
        self.branch_text == self.intervention_text
    }

    fn holds(&self) -> bool {
        self.pre_ok
            && self.post_ok
            && self.mhc.all()
            && self.routes.all()
            && self.tokens_ok
            && self.text_ok()
            && self.prefork.all()
    }

    fn table(&self) -> Table {
        let point = self.point;
        let mut t = Table::new(
            "mhc_equivalence_summary",
            &format!(
                "Post-mHC substitution control (section 3.2.2): \"{PROMPT}\", B class {}, layer {}, step {}",
                self.class, point.layer, point.step
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
                "{} vectors bitwise identical; max L∞ = {}",
                self.prefork.frac(),
                self.prefork_max
            ),
        ]);
        t.row(vec![
            "Intervention endpoint".into(),
            "B endpoint vs native H_P + ΔH".into(),
            format!(
                "layer {} post-mHC ({} values; max |ΔH| = {})",
                point.layer, self.values, self.dh_max
            ),
            format!(
                "pre-add = H_P: {}; H_P + ΔH = H_B: {}; reconstruction error = {}",
                yes(self.pre_ok),
                yes(self.post_ok),
                self.recon_err
            ),
        ]);
        t.row(vec![
            "Post-boundary latent trajectory".into(),
            "B branch vs native + ΔH".into(),
            "fork endpoint, later layers, later forwards".into(),
            format!("{} post-mHC vectors bitwise identical", self.mhc.frac()),
        ]);
        t.row(vec![
            "Routing and visible outputs".into(),
            "same pair".into(),
            format!(
                "{} route checkpoints, {} driver predictions, text",
                self.routes.total, self.n
            ),
            format!(
                "routes {}; predictions {}; text {}",
                self.routes.frac(),
                yes(self.tokens_ok),
                yes(self.text_ok())
            ),
        ]);
        t
    }

    fn json(&self) -> Value {
        json!({
            "prompt": PROMPT, "class": self.class, "layer": self.point.layer, "step": self.point.step,
            "driver_tokens": self.n,
            "delta_h_max_abs": self.dh_max, "pre_add_equals_h_p": self.pre_ok, "reconstructed_equals_h_b": self.post_ok,
            "reconstruction_error": self.recon_err,
            "post_mhc_equal": self.mhc.equal, "post_mhc_compared": self.mhc.total,
            "routes_equal": self.routes.equal, "routes_compared": self.routes.total,
            "predictions_equal": self.tokens_ok, "text_equal": self.text_ok(),
            "prefork_equal": self.prefork.equal, "prefork_compared": self.prefork.total,
            "prefork_max_abs": self.prefork_max,
            "branch_text": self.branch_text, "native_text": self.native_text,
            "branch_differs_from_native": self.branch_differs_from_native,
        })
    }

    fn claim(&self) -> Claim {
        Claim::new(
            "post_mhc_substitution_reproduces_branch",
            self.holds(),
            format!(
                "class {}: pre-fork {}, endpoint {}, post-mHC {}, routes {}, predictions and text {}",
                self.class,
                self.prefork.frac(),
                yes(self.pre_ok && self.post_ok),
                self.mhc.frac(),
                self.routes.frac(),
                yes(self.tokens_ok && self.text_ok())
            ),
        )
    }
}
