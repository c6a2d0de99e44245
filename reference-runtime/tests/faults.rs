//! Fault injection (`faults::FaultPlan`, `Model::step_with_faults`): no plan
//! and a plan that never matches are bitwise the plain runtime; every fault
//! kind, in both profiles, leaves every record before its own record
//! ([`FaultKind::component`], in execution order over every level)
//! unchanged and changes exactly that record first, and changes some bit in
//! at least one profile; the post-mHC intervention adds ΔH once.

mod common;

use common::{digests, fixture_model, prompt};
use moeconf_contract::{AggregationContract, NativeCombine, Order};
use moeconf_fingerprint::Half;
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::config::AttentionKind;
use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
use moeconf_reference_runtime::model::StepOptions;
use moeconf_reference_runtime::precision::Precision;

const TOKENS: u32 = 5;

fn run(plan: Option<&FaultPlan>) -> MemorySink {
    run_in(plan, Precision::Bf16)
}

/// The 5-token prompt for 5 steps in `precision` with the native combine
/// (as the calibration matrix runs it), capturing every level.
fn run_in(plan: Option<&FaultPlan>, precision: Precision) -> MemorySink {
    run_ids(plan, precision, &prompt(1, 5), TOKENS)
}

/// `ids` for `steps` steps in `precision` with the native combine, capturing
/// every level.
fn run_ids(plan: Option<&FaultPlan>, precision: Precision, ids: &[u32], steps: u32) -> MemorySink {
    let m = fixture_model();
    let opts = StepOptions {
        precision,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let mut sink = MemorySink::all();
    let mut st = m.new_state();
    while st.step < steps {
        let input = if st.step == 0 {
            ids.to_vec()
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

/// A fault and the record that must be the first to differ (in execution
/// order over every level): its step, layer and component.
struct Case {
    fault: Fault,
    step: u32,
    layer: Option<u32>,
}

impl Case {
    /// The fault's own step and layer.
    fn at(step: u32, layer: u32, kind: FaultKind) -> Case {
        Case {
            fault: Fault::at(step, layer, kind),
            step,
            layer: Some(layer),
        }
    }
}

/// Every fault kind, at coordinates of the 5-token prompt and 5 steps
/// (positions 0..8): layers 0, 1, 8 sliding, 2/4/6 CSA, 3/5/7 HCA, 0–2
/// hash-routed; window w = 8 is full from position 7 (step 3); CSA windows
/// (rate 4) close at positions 3 (prefill) and 7 (step 3).
fn cases() -> Vec<Case> {
    use FaultKind as K;
    use Half::{Attention as A, Ffn as F};
    let b135 = AggregationContract::b().with_order(Order::BClass(135));
    let mut v = vec![
        Case {
            fault: Fault::at(2, 0, K::EmbeddingWrongRow),
            step: 2,
            layer: None,
        },
        Case {
            fault: Fault::at(2, 0, K::HeadNormEpsilon(1e-2)),
            step: 2,
            layer: None,
        },
        // Split-K decode kernel at every step of layer 2: the prefill is
        // untouched, the first decode step is not.
        Case {
            fault: Fault {
                step: None,
                layer: Some(2),
                position: None,
                kind: K::AttentionSplitKDecode,
            },
            step: 1,
            layer: Some(2),
        },
    ];
    for (h, step, layer) in [(A, 1, 3), (F, 2, 5)] {
        v.push(Case::at(step, layer, K::MhcPreWeightsWithoutEpsilon(h)));
        v.push(Case::at(step, layer, K::MhcPostWeightsTruncated(h)));
        v.push(Case::at(step, layer, K::MhcSinkhornWithoutEpsilon(h)));
        v.push(Case::at(step, layer, K::MhcCollapseBf16Weights(h)));
        v.push(Case::at(step, layer, K::MhcPostMixBf16Accumulator(h)));
    }
    v.extend([
        Case::at(1, 4, K::AttnNormEpsilon(1e-2)),
        Case::at(2, 3, K::QueryRopePositionOffByOne),
        Case::at(3, 2, K::AttentionSoftmaxReversed),
        Case::at(3, 2, K::AttentionSoftmaxBf16Accumulator),
        Case::at(2, 6, K::DerotationSkipped),
        Case::at(2, 1, K::AttentionOutputTruncate),
        Case::at(3, 8, K::KvLowPrecision { mantissa_bits: 3 }),
        Case::at(2, 0, K::WindowStoreLowPrecision { mantissa_bits: 3 }),
        Case::at(3, 1, K::WindowReadDropsOldest),
        Case::at(3, 4, K::CompressorPoolingReversed),
        Case::at(3, 4, K::CompressorPoolingBf16Accumulator),
        Case::at(3, 2, K::CompressorIgnoresOverlap),
        Case::at(3, 4, K::CompressorOverlapGateWithoutBias),
        Case::at(3, 6, K::CompressedStoreLowPrecision { mantissa_bits: 3 }),
        Case::at(3, 6, K::IndexerCompressorPoolingBf16Accumulator),
        Case::at(1, 2, K::IndexerBufferLowPrecision { mantissa_bits: 3 }),
        Case::at(3, 2, K::IndexerStoreLowPrecision { mantissa_bits: 3 }),
        Case::at(3, 2, K::IndexerScoreScaleAfterSum),
        Case::at(3, 4, K::IndexerTopkDropsLast),
        Case::at(1, 4, K::FfnNormEpsilon(1e-2)),
        Case::at(1, 4, K::RouterSoftplusBf16Exp),
        Case::at(2, 6, K::RouterNearTieFlip),
        Case::at(1, 1, K::HashRouteNextRow),
        Case::at(2, 6, K::RouterGateScaleBeforeDivide),
        Case::at(1, 5, K::RoutedExpertSwigluLimit(0.25)),
        Case::at(1, 5, K::SharedExpertSwigluLimit(0.25)),
        Case::at(1, 7, K::RoutedTermRounded),
        Case::at(1, 7, K::SharedExpertFirst),
        Case::at(1, 7, K::RoundedRoutedMerge),
        Case::at(2, 5, K::CombineContract(b135)),
        Case::at(2, 5, K::CombineElementNudge { element: 0 }),
        // Uncaptured steps inside a captured operator.
        Case::at(3, 4, K::CompressorNormEpsilon(1e-2)),
        Case::at(2, 3, K::KvProjectionTruncate),
        Case::at(2, 1, K::OutputGroupTruncate { group: 1 }),
        // Scaling faults.
        Case::at(1, 7, K::SharedExpertScaled(1.5)),
        Case::at(1, 7, K::RoutedScalingAppliedTwice),
        Case::at(1, 5, K::GateOnUnroundedProduct),
    ]);
    v
}

#[test]
fn each_fault_first_changes_its_own_record_in_both_profiles() {
    let mut silent = Vec::new();
    let cases = cases();
    for precision in [Precision::Bf16, Precision::F32] {
        let base = run_in(None, precision);
        let bd = digests(&base);
        for case in &cases {
            let name = case.fault.kind.name();
            let sink = run_in(Some(&FaultPlan::new(vec![case.fault.clone()])), precision);
            let d = digests(&sink);
            let Some(i) = d.iter().zip(&bd).position(|(a, b)| a != b) else {
                assert_eq!(d.len(), bd.len(), "{name}");
                silent.push((name, precision));
                continue;
            };
            let c = &sink.records[i].coord;
            assert_eq!(base.records[i].coord, *c, "{name}: the record sequences part");
            let expect = case.fault.kind.component();
            assert!(
                (c.step, c.layer) == (case.step, case.layer) && expect.matches(&c.path),
                "{name} ({precision:?}): first difference at {c}, expected step {} layer {:?} {expect}",
                case.step,
                case.layer
            );
        }
    }
    // Every kind changes some bit in at least one profile, except the
    // shared-expert-first order: the native combine rounds every routed term
    // to BF16 in both profiles, and FP32 sums of BF16 values are exact here.
    for case in &cases {
        let name = case.fault.kind.name();
        let n = silent.iter().filter(|(s, _)| *s == name).count();
        let may_be_silent = case.fault.kind == FaultKind::SharedExpertFirst;
        assert!(n < 2 || may_be_silent, "{name} is silent in both profiles");
    }
    eprintln!("silent: {silent:?}");
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

/// The long-context kinds (issue 35 item 4).
fn long_context_kinds() -> [FaultKind; 3] {
    [
        FaultKind::IndexerTopkTakesNextEntry,
        FaultKind::WindowRingReadOffByOne,
        FaultKind::CompressedPositionOffByOne,
    ]
}

/// A fault active at every step and position of one layer (or of every layer).
fn everywhere(layer: Option<u32>, kind: FaultKind) -> Fault {
    Fault {
        step: None,
        layer,
        position: None,
        kind,
    }
}

/// The first record that differs between two runs (same record sequence
/// up to it).
fn first_difference<'a>(
    base: &MemorySink,
    sink: &'a MemorySink,
    name: &str,
) -> Option<&'a moeconf_fingerprint::Coord> {
    let (bd, d) = (digests(base), digests(sink));
    let i = d.iter().zip(&bd).position(|(a, b)| a != b);
    if i.is_none() {
        assert_eq!(d.len(), bd.len(), "{name}");
    }
    let c = &sink.records[i?].coord;
    assert_eq!(base.records[i?].coord, *c, "{name}: the record sequences part");
    Some(c)
}

/// The long-context kinds, active at every layer, step and position, change
/// no bit at a short context (positions 0..6: before the ring's second wrap,
/// before T > K_I, before any second compression window); on a long prompt
/// each, active at every step and position of one layer, first changes its
/// own record exactly at its onset ([`FaultKind::long_context_onset`]):
/// in the prefill when the prompt reaches the onset, in the first decode
/// step when the prompt ends just before it. Both profiles.
#[test]
fn long_context_faults_are_silent_when_short_and_localized_when_long() {
    let cfg = fixture_model().config();
    let short = prompt(1, 5);
    let every = FaultPlan::new(
        long_context_kinds()
            .into_iter()
            .map(|k| everywhere(None, k))
            .collect(),
    );
    let long = prompt(3, 40);
    // (kind, layer): sliding, CSA and HCA layers.
    let cases = [
        (FaultKind::WindowRingReadOffByOne, 0u32),
        (FaultKind::WindowRingReadOffByOne, 3),
        (FaultKind::IndexerTopkTakesNextEntry, 2),
        (FaultKind::IndexerTopkTakesNextEntry, 6),
        (FaultKind::CompressedPositionOffByOne, 3),
        (FaultKind::CompressedPositionOffByOne, 4),
    ];
    // tiny-v4: w = 8, CSA rate 4, HCA rate 16, K_I = 4.
    let onset = |k: FaultKind, t| k.long_context_onset(cfg, t);
    let (sl, csa, hca) = (AttentionKind::Sliding, AttentionKind::Csa, AttentionKind::Hca);
    assert_eq!(
        (cfg.sliding_window, cfg.csa_rate, cfg.hca_rate, cfg.index_topk),
        (8, 4, 16, 4)
    );
    for t in [sl, csa, hca] {
        // The ring of 8 slots has wrapped twice at position 16, on every layer.
        assert_eq!(onset(FaultKind::WindowRingReadOffByOne, t), Some(16));
    }
    // T = 5 > K_I entries from position 19, on CSA layers only.
    assert_eq!(onset(FaultKind::IndexerTopkTakesNextEntry, csa), Some(19));
    assert_eq!(onset(FaultKind::IndexerTopkTakesNextEntry, hca), None);
    // The second window closes at 2·rate − 1; no compressor on sliding layers.
    assert_eq!(onset(FaultKind::CompressedPositionOffByOne, csa), Some(7));
    assert_eq!(onset(FaultKind::CompressedPositionOffByOne, hca), Some(31));
    assert_eq!(onset(FaultKind::CompressedPositionOffByOne, sl), None);
    assert_eq!(onset(FaultKind::WindowReadDropsOldest, sl), None);
    for precision in [Precision::Bf16, Precision::F32] {
        let onsets: Vec<u32> = long_context_kinds()
            .iter()
            .flat_map(|k| {
                cfg.layer_types
                    .iter()
                    .filter_map(|&t| k.long_context_onset(cfg, t))
            })
            .collect();
        // 5 prompt tokens and 2 decode steps: positions 0..6, before every onset.
        assert!(onsets.iter().all(|&o| o >= 7), "{onsets:?}");
        let base = run_ids(None, precision, &short, 3);
        let faulty = run_ids(Some(&every), precision, &short, 3);
        assert_eq!(first_difference(&base, &faulty, "short"), None, "{precision:?}");
        assert_eq!(digests(&faulty), digests(&base));

        let base = run_ids(None, precision, &long, 2);
        for (kind, layer) in &cases {
            let name = kind.name();
            let lt = cfg.layer_types[*layer as usize];
            let onset = kind.long_context_onset(cfg, lt).unwrap();
            assert!(onset < long.len() as u32, "{name}: onset {onset}");
            let plan = FaultPlan::new(vec![everywhere(Some(*layer), kind.clone())]);
            let sink = run_ids(Some(&plan), precision, &long, 2);
            let c = first_difference(&base, &sink, &name)
                .unwrap_or_else(|| panic!("{name} ({precision:?}) changed nothing at layer {layer}"));
            let expect = kind.component();
            assert!(
                c.step == 0 && c.layer == Some(*layer) && c.position == onset && expect.matches(&c.path),
                "{name} ({precision:?}): first difference at {c}, expected step 0 layer {layer} position {onset} {expect}"
            );
        }
        // The prompt ends just before the onset: the prefill is untouched
        // and the first decode step (at the onset) is not.
        for (kind, layer) in [
            (FaultKind::WindowRingReadOffByOne, 1u32),
            (FaultKind::IndexerTopkTakesNextEntry, 4),
            (FaultKind::CompressedPositionOffByOne, 5),
        ] {
            let name = kind.name();
            let onset = kind
                .long_context_onset(cfg, cfg.layer_types[layer as usize])
                .unwrap();
            let ids = prompt(5, onset);
            let base = run_ids(None, precision, &ids, 2);
            let plan = FaultPlan::new(vec![everywhere(Some(layer), kind.clone())]);
            let sink = run_ids(Some(&plan), precision, &ids, 2);
            let c = first_difference(&base, &sink, &name)
                .unwrap_or_else(|| panic!("{name} ({precision:?}) changed nothing in the decode step"));
            let expect = kind.component();
            assert!(
                c.step == 1 && c.layer == Some(layer) && c.position == onset && expect.matches(&c.path),
                "{name} ({precision:?}): first difference at {c}, expected step 1 layer {layer} position {onset} {expect}"
            );
        }
    }
}
