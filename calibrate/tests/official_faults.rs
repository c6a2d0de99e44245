//! Issue 32's fault classes in the official profile (`builtin:tiny-v4-fp8`):
//! faults in steps no record captures (the compressor's norm, the KV
//! projection, one head group's `W_oa`) are localized at the operator that
//! holds them, with those steps named; scaling faults in the combine (the
//! shared expert scaled, the routed scaling factor applied twice) are
//! localized at `moe.combine`, where no grammar member reproduces the
//! candidate and the fit reads the scale. The bf16 and f32 profiles run the
//! same kinds in the fault matrix (`fault_matrix.rs`).

use moeconf_bisect::{diff, DiffOptions, Verdict};
use moeconf_calibrate::{Ctx, CtxOptions, Sizes, TraceRequest};
use moeconf_contract::NativeCombine;
use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
use moeconf_reference_runtime::precision::Precision;
use moeconf_schema::Trace;

const PROMPT: &str = "why the sheep";
const TOKENS: usize = 3;

/// A calibration context on a built-in model in one profile, writing under `out`.
fn context(model: &str, precision: Precision, out: &std::path::Path) -> Ctx {
    let m = moeconf_runner::load_model(model).expect("built-in model");
    Ctx::new(
        m,
        CtxOptions {
            precision,
            fork_layer: 5,
            sizes: Sizes::QUICK,
            out: out.to_path_buf(),
            progress: moeconf_shard::ProgressMode::Off,
        },
    )
    .expect("context")
}

#[test]
fn uncaptured_steps_and_scaling_faults_are_localized_and_read() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context("builtin:tiny-v4-fp8", Precision::Official, dir.path());
    let ids = ctx.encode(PROMPT).unwrap();
    assert_eq!(ids.len(), 5, "the cases assume a 5-token prompt");
    let write = |name: &str, plan: Option<&FaultPlan>| {
        let path = dir.path().join(name);
        ctx.write_trace(TraceRequest {
            prompt: PROMPT,
            prompt_ids: &ids,
            tokens: TOKENS,
            combine: &NativeCombine,
            faults: plan,
            notes: Vec::new(),
            path: &path,
        })
        .expect("trace");
        Trace::open_verified(&path).expect("open")
    };
    let reference = write("reference.bin", None);
    use moeconf_fingerprint::Component as C;
    use FaultKind as K;
    // (step, layer, kind, record, words the reading must hold): layer 2 is
    // CSA (its compressor closes a window at prefill position 3), 3 and 4 are
    // routed. The head groups' W_oa output is the input of the FP8 GEMM W_ob,
    // quantized at site Q7 (`attn.o_lat_fp8`): that record is the first to differ.
    let cases = [
        (
            0,
            2,
            K::CompressorNormEpsilon(1e-2),
            C::AttnCompressed,
            "its norm",
        ),
        (
            2,
            3,
            K::KvProjectionTruncate,
            C::AttnKv,
            "the KV projection (W_kv)",
        ),
        (
            2,
            3,
            K::OutputGroupTruncate { group: 1 },
            C::AttnOLatFp8,
            "the grouped projections W_oa",
        ),
        (
            2,
            3,
            K::SharedExpertScaled(1.5),
            C::MoeCombine,
            "shared expert × 1.5",
        ),
        (
            1,
            4,
            K::RoutedScalingAppliedTwice,
            C::MoeCombine,
            "routed terms × 1.5",
        ),
    ];
    for (step, layer, kind, record, words) in cases {
        let name = kind.name();
        let plan = FaultPlan::new(vec![Fault::at(step, layer, kind.clone())]);
        let candidate = write(&format!("{name}.bin"), Some(&plan));
        let report = diff(&reference, &candidate, &DiffOptions::default()).expect("diff");
        assert_eq!(report.verdict, Verdict::Divergent, "{name}");
        let f = report.first_divergence.as_ref().expect("a first divergence");
        assert_eq!((f.step, f.layer), (step, Some(layer)), "{name}: {}", f.operator);
        assert!(record.matches(&f.operator), "{name}: localized at {}", f.operator);
        let l4 = &report.levels.l4;
        let inside = l4.localized.as_ref().and_then(|l| l.uncaptured_steps.clone());
        let fit = l4
            .contract
            .as_ref()
            .and_then(|c| c.candidate_explanation.as_ref())
            .and_then(|e| e.fit.as_ref())
            .map(|f| f.summary.clone());
        let reading = format!("{} | {}", inside.unwrap_or_default(), fit.unwrap_or_default());
        assert!(reading.contains(words), "{name}: {reading}");
        assert!(report.render_text(false).contains(words), "{name}");
    }
}

/// `moeconf explain` on a run whose every combine scales the shared expert:
/// no grammar member reproduces any event, and the headline gives the fit's
/// reading and how many events it reproduces bitwise.
#[test]
fn explain_reads_a_scaling_bug_at_every_event() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context("builtin:tiny-v4", Precision::Bf16, dir.path());
    let ids = ctx.encode(PROMPT).unwrap();
    let plan = FaultPlan::new(vec![Fault {
        step: None,
        layer: None,
        position: None,
        kind: FaultKind::SharedExpertScaled(1.5),
    }]);
    let path = dir.path().join("scaled.bin");
    ctx.write_trace(TraceRequest {
        prompt: PROMPT,
        prompt_ids: &ids,
        tokens: TOKENS,
        combine: &NativeCombine,
        faults: Some(&plan),
        notes: Vec::new(),
        path: &path,
    })
    .expect("trace");
    let t = Trace::open_verified(&path).expect("open");
    let x = moeconf_bisect::explain_trace(&t, "scaled.bin").expect("explain");
    let h = &x.verdict.headline;
    assert!(h.starts_with("no grammar member reproduces"), "{h}");
    let events = x.verdict.events;
    assert!(events > 0);
    assert!(
        h.contains(&format!(
            "read as shared expert × 1.5 ({events} of {events} events reproduced bitwise"
        )),
        "{h}"
    );
}
