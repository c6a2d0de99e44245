//! The MoE output recorded as `moe.combine` is exactly the native combine of
//! the recorded terms and shared-expert output, and the persistent-state
//! invariants of notes §4 hold at every decode boundary.

mod common;

use common::{fixture_model, prompt};
use moeconf_contract::{combine_native, NativeCombine};
use moeconf_fingerprint::Level;
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::precision::Precision;

fn run(max_new: usize, p: &[u32]) -> MemorySink {
    let mut sink = MemorySink::all();
    let opts = GenerateOptions {
        max_new_tokens: max_new,
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    fixture_model().generate(p, &opts, &mut sink).unwrap();
    sink
}

#[test]
fn native_combine_equals_captured_moe_combine() {
    let sink = run(6, &prompt(1, 13));
    let recs = &sink.records;
    let mut checked = 0;
    for (i, r) in recs.iter().enumerate() {
        if r.coord.path != "moe.combine" {
            continue;
        }
        // The k terms and the shared output precede the combine, in order.
        let k = 6;
        let terms: Vec<Vec<f32>> = (0..k).map(|j| recs[i - 1 - k + j].f32s()).collect();
        for (j, t) in recs[i - 1 - k..i - 1].iter().enumerate() {
            assert_eq!(t.coord.path, format!("moe.term.{j}"));
            assert_eq!(
                (t.coord.position, t.coord.layer),
                (r.coord.position, r.coord.layer)
            );
        }
        assert_eq!(recs[i - 1].coord.path, "moe.shared");
        let shared = recs[i - 1].f32s();
        let refs: Vec<&[f32]> = terms.iter().map(|v| v.as_slice()).collect();
        let mut y = vec![0.0f32; shared.len()];
        combine_native(&refs, &shared, &mut y);
        let got = r.f32s();
        assert!(
            y.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
            "combine differs at {:?}",
            r.coord
        );
        checked += 1;
    }
    // 13 prompt positions + 5 decode positions, 9 layers.
    assert_eq!(checked, (13 + 5) * 9);
}

#[test]
fn state_invariants_hold_at_every_decode_boundary() {
    let p = prompt(2, 21);
    let sink = run(20, &p);
    let cfg = fixture_model().config();
    for r in sink.records.iter().filter(|r| r.level == Level::L2) {
        let c = i64::from(r.coord.position) + 1;
        let layer = r.coord.layer.unwrap() as usize;
        let rate = cfg.compress_rate(cfg.layer_types[layer]) as i64;
        let val = |r: &moeconf_reference_runtime::capture::Record| {
            i64::from_le_bytes(r.bytes[..8].try_into().unwrap())
        };
        match r.coord.path.as_str() {
            "state.cumulative_length" => assert_eq!(val(r), c),
            "state.window_kv" => assert_eq!(r.shape[0] as i64, c.min(cfg.sliding_window as i64 - 1)),
            "state.compressor.entry_count" | "state.indexer.entry_count" => assert_eq!(val(r), c / rate),
            "state.compressor.buffer_kv" | "state.indexer.buffer_gate" => {
                assert_eq!(r.shape[0] as i64, c % rate)
            }
            "state.compressor.overlap_kv" => {
                assert_eq!(r.shape[0] as i64, if c < rate { 0 } else { rate });
            }
            _ => {}
        }
    }
    // Decode boundaries: one per step.
    assert_eq!(
        sink.by_path("state.cumulative_length").count(),
        20 * cfg.num_layers()
    );
}

#[test]
fn chunked_prefill_equals_token_by_token() {
    // The runtime processes a prefill token by token with the cache, so a
    // 21-token prefill followed by decodes must give bit-identical logits to a
    // 40-token prefill of the same sequence at position 39.
    let p = prompt(4, 21);
    let model = fixture_model();
    let opts = GenerateOptions {
        max_new_tokens: 20,
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let mut s1 = MemorySink::with_levels(&[Level::L1]);
    let g = model.generate(&p, &opts, &mut s1).unwrap();
    let mut full = p.clone();
    full.extend_from_slice(&g.tokens[..19]);
    let mut s2 = MemorySink::with_levels(&[Level::L1]);
    let g2 = model
        .generate(
            &full,
            &GenerateOptions {
                max_new_tokens: 1,
                ..opts
            },
            &mut s2,
        )
        .unwrap();
    assert_eq!(g2.tokens[0], g.tokens[19]);
    let a = s1.by_path("lm.logits").last().unwrap().bytes.clone();
    let b = s2.by_path("lm.logits").last().unwrap().bytes.clone();
    assert_eq!(a, b);
}

#[test]
fn unwanted_levels_are_skipped_without_changing_results() {
    let p = prompt(5, 9);
    let all = run(4, &p);
    let model = fixture_model();
    let opts = GenerateOptions {
        max_new_tokens: 4,
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let mut only = MemorySink::with_levels(&[Level::L1, Level::L2]);
    model.generate(&p, &opts, &mut only).unwrap();
    assert!(only
        .records
        .iter()
        .all(|r| r.level == Level::L1 || r.level == Level::L2));
    let filtered: Vec<_> = all
        .records
        .iter()
        .filter(|r| r.level == Level::L1 || r.level == Level::L2)
        .cloned()
        .collect();
    assert_eq!(only.records, filtered);
}

#[test]
fn bf16_profile_activations_are_bf16_values() {
    // Every rounding point of docs/operators.md leaves a BF16 value (low 16 bits
    // zero). Not rounded by contract: the FP32 routed terms, the FP32 margins,
    // the overlap gate (which carries the FP32 position bias), the mHC weight
    // path (pre weights, post weights, combination matrix) and the indexer
    // scores, which HF keeps in FP32.
    let sink = run(6, &prompt(6, 21));
    let not_rounded = [
        "moe.term.",
        "router.margin",
        "lm.margin",
        "overlap_gate",
        "hc_pre_weights",
        "hc_post_weights",
        "hc_comb",
        "indexer_scores",
    ];
    let mut checked = 0;
    for r in sink
        .records
        .iter()
        .filter(|r| r.dtype == moeconf_fingerprint::DType::F32)
    {
        if not_rounded.iter().any(|p| r.coord.path.contains(p)) {
            continue;
        }
        for v in r.f32s() {
            assert_eq!(
                v.to_bits() & 0xffff,
                0,
                "{:?} holds a non-BF16 value {v:e}",
                r.coord
            );
        }
        checked += 1;
    }
    assert!(checked > 1000);
    // And the FP32 terms really are not rounded (so the combine decides).
    assert!(sink
        .by_path("moe.term.0")
        .any(|r| r.f32s().iter().any(|v| v.to_bits() & 0xffff != 0)));
}

/// Checks at every event that the runtime hands the combine each routed
/// expert's output before its gate (`CombineEvent::units`, what
/// `operand=fma` reads): one per term, and the term is the gate times it
/// (rounded to BF16 in the vllm-cpu profile, `copy_mul_stub`). Then
/// combines natively.
struct UnitsCheck {
    bf16_terms: bool,
    events: std::sync::atomic::AtomicUsize,
}

impl moeconf_contract::MoeCombine for UnitsCheck {
    fn combine(
        &self,
        e: &moeconf_contract::CombineEvent<'_>,
        terms: &[&[f32]],
        shared: &[f32],
        out: &mut [f32],
    ) {
        assert_eq!((e.units.len(), e.gates.len()), (terms.len(), terms.len()));
        for ((u, t), g) in e.units.iter().zip(terms).zip(e.gates) {
            assert_eq!(u.len(), t.len());
            for (&u, &t) in u.iter().zip(t.iter()) {
                let want = match self.bf16_terms {
                    true => half::bf16::from_f32(g * u).to_f32(),
                    false => g * u,
                };
                assert_eq!(want.to_bits(), t.to_bits(), "term {t} from unit {u} and gate {g}");
            }
        }
        self.events.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        combine_native(terms, shared, out)
    }

    fn describe(&self) -> String {
        "units-check".into()
    }
}

#[test]
fn the_combine_receives_each_experts_output_before_its_gate() {
    for (p, bf16_terms) in [(Precision::Bf16, false), (Precision::VllmCpu, true)] {
        let check = UnitsCheck {
            bf16_terms,
            events: Default::default(),
        };
        let opts = GenerateOptions {
            max_new_tokens: 2,
            precision: p,
            combine: &check,
            detokenizer: None,
            allow_non_finite: false,
        };
        fixture_model()
            .generate(&prompt(2, 5), &opts, &mut MemorySink::all())
            .unwrap();
        // 5 prompt positions + 1 decode position, 9 layers.
        assert_eq!(check.events.into_inner(), 6 * 9, "{p:?}");
    }
}
