//! Fault injection (`faults::FaultPlan`, `Model::step_with_faults`): no plan
//! and a plan that never matches are bitwise the plain runtime; each
//! effective fault leaves every record before its operator's record
//! unchanged and changes exactly that record first; the post-mHC
//! intervention adds ΔH once.

mod common;

use common::{digests, fixture_model, prompt};
use moeconf_contract::{AggregationContract, NativeCombine, Order};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
use moeconf_reference_runtime::model::StepOptions;
use moeconf_reference_runtime::precision::Precision;

const TOKENS: u32 = 5;

fn run(plan: Option<&FaultPlan>) -> MemorySink {
    let m = fixture_model();
    let ids = prompt(1, 5);
    let opts = StepOptions {
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let mut sink = MemorySink::all();
    let mut st = m.new_state();
    while st.step < TOKENS {
        let input = if st.step == 0 {
            ids.clone()
        } else {
            vec![st.pending.unwrap()]
        };
        match plan {
            Some(p) => m
                .step_with_faults(&mut st, &input, &opts, Some(p), &mut sink)
                .unwrap(),
            None => m.step(&mut st, &input, &opts, &mut sink).unwrap(),
        };
    }
    sink
}

#[test]
fn no_fault_is_the_plain_runtime() {
    let plain = digests(&run(None));
    assert_eq!(digests(&run(Some(&FaultPlan::new(vec![])))), plain);
    // A fault at a step the run never reaches changes nothing.
    let never = FaultPlan::new(vec![Fault::at(99, 3, FaultKind::RouterNearTieFlip)]);
    assert_eq!(digests(&run(Some(&never))), plain);
}

#[test]
fn each_fault_first_changes_its_own_operator() {
    let base = run(None);
    let bd = digests(&base);
    // Layer 2 is CSA; with a 5-token prompt, step 3's token (count 8) closes a CSA window (rate 4).
    let cases = vec![
        Fault::at(3, 2, FaultKind::AttentionSoftmaxBf16Accumulator),
        Fault::at(2, 1, FaultKind::AttentionOutputTruncate),
        Fault::at(1, 4, FaultKind::FfnNormEpsilon(1e-2)),
        Fault::at(2, 6, FaultKind::RouterNearTieFlip),
        Fault::at(1, 7, FaultKind::RoundedRoutedMerge),
        Fault::at(3, 8, FaultKind::KvLowPrecision { mantissa_bits: 3 }),
        Fault::at(3, 4, FaultKind::CompressorPoolingBf16Accumulator),
        Fault::at(
            2,
            5,
            FaultKind::CombineContract(AggregationContract::b().with_order(Order::BClass(135))),
        ),
    ];
    for f in cases {
        let sink = run(Some(&FaultPlan::new(vec![f.clone()])));
        let d = digests(&sink);
        assert_eq!(d.len(), bd.len(), "{}", f.kind.name());
        let first = d.iter().zip(&bd).position(|(a, b)| a != b);
        let i = first.unwrap_or_else(|| panic!("{} changed nothing", f.kind.name()));
        let c = &sink.records[i].coord;
        assert_eq!(
            (Some(c.step), c.layer, c.path.as_str()),
            (f.step, f.layer, f.kind.operator()),
            "{}",
            f.kind.name()
        );
    }
}

#[test]
fn post_mhc_intervention_adds_delta_once() {
    let base = run(None);
    let at = |s: &MemorySink| {
        s.records
            .iter()
            .find(|r| r.coord.path == "layer.post_ffn_mhc" && r.coord.step == 1 && r.coord.layer == Some(5))
            .map(|r| r.f32s())
            .unwrap()
    };
    let h = at(&base);
    let mut delta = vec![0.0f32; h.len()];
    delta[3] = 0.5;
    delta[100] = -0.25;
    let plan = FaultPlan::new(vec![Fault::at(1, 5, FaultKind::AddPostFfnMhc(delta.clone()))]);
    let sink = run(Some(&plan));
    let pre = plan.pre_add_states();
    assert_eq!(pre.len(), 1, "added exactly once");
    assert_eq!(pre[0], h);
    let expect: Vec<f32> = h.iter().zip(&delta).map(|(a, b)| a + b).collect();
    assert_eq!(at(&sink), expect);
    // A zero ΔH is the plain runtime.
    let zero = FaultPlan::new(vec![Fault::at(
        1,
        5,
        FaultKind::AddPostFfnMhc(vec![0.0; h.len()]),
    )]);
    assert_eq!(digests(&run(Some(&zero))), digests(&base));
}
