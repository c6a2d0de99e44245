//! `explain_trace` on written traces shaped like a real bf16 backend's
//! capture (transformers: bf16 payloads of the terms, the shared output and
//! the combine; `router.topk` in slot order): the trace-level rule is named
//! by what determines the order, BF16-valued terms make A indistinguishable
//! from B (reported with the reason, not hidden), and missing data is an
//! error naming it.

use moeconf_bisect::{explain_trace, ExplainError, ExplanationStatus};
use moeconf_contract::bf16::r_bf16;
use moeconf_contract::{splitmix64, AggregationContract, EventContext};
use moeconf_fingerprint::{Algorithm, Component, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{Header, Trace, TraceWriter};
use std::path::Path;

const K: usize = 6;
const D: usize = 64;

/// What the written trace holds.
#[derive(Clone, Copy)]
struct Shape {
    /// Record router.topk (with payload).
    topk: bool,
    /// Record moe.shared.
    shared: bool,
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

/// A trace of `events` combine events computed with `contract`, terms and
/// outputs stored as bf16 (the values are BF16-valued by construction).
fn write(path: &Path, contract: &AggregationContract, events: u32, shape: Shape) {
    // One prefill step (the writer refuses steps beyond max_new_tokens).
    let mut header = Header::default();
    header.binding.decoding.max_new_tokens = 1;
    let mut w = TraceWriter::create(path, Algorithm::Blake3, header).unwrap();
    let mut x = 7u64;
    let mut next = || {
        x = x.wrapping_add(1);
        splitmix64(x)
    };
    for ev in 0..events {
        let layer = ev % 3;
        let position = ev / 3;
        let coord = |path: String| Coord {
            step: 0,
            position,
            phase: Phase::Prefill,
            layer: Some(layer),
            path: path.into(),
        };
        // Distinct expert ids, not sorted.
        let mut ids: Vec<u32> = Vec::new();
        while ids.len() < K {
            let id = (next() % 32) as u32;
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        let mut val = || {
            let u = (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            r_bf16(u * 2f32.powi((next() % 24) as i32 - 18))
        };
        let terms: Vec<Vec<f32>> = (0..K).map(|_| (0..D).map(|_| val()).collect()).collect();
        let shared: Vec<f32> = (0..D).map(|_| val()).collect();
        let refs: Vec<&[f32]> = terms.iter().map(Vec::as_slice).collect();
        let mut y = vec![0.0f32; D];
        let ctx = EventContext {
            experts: &ids,
            gates: &[],
        };
        contract
            .try_combine_in(Some(&ctx), &refs, &shared, &mut y)
            .unwrap();
        if shape.topk {
            let b: Vec<u8> = ids.iter().flat_map(|&i| (i as i32).to_le_bytes()).collect();
            let view = TensorView {
                dtype: DType::I32,
                shape: &[K as u64],
                bytes: &b,
            };
            w.append(coord(Component::RouterTopk.path().into()), Level::L3, view, true)
                .unwrap();
        }
        for (j, t) in terms.iter().enumerate() {
            let b = bf16_bytes(t);
            let view = TensorView {
                dtype: DType::BF16,
                shape: &[D as u64],
                bytes: &b,
            };
            w.append(
                coord(Component::MoeTerm.indexed_path(j as u32)),
                Level::L4,
                view,
                true,
            )
            .unwrap();
        }
        if shape.shared {
            let b = bf16_bytes(&shared);
            let view = TensorView {
                dtype: DType::BF16,
                shape: &[D as u64],
                bytes: &b,
            };
            w.append(coord(Component::MoeShared.path().into()), Level::L4, view, true)
                .unwrap();
        }
        let b = bf16_bytes(&y);
        let view = TensorView {
            dtype: DType::BF16,
            shape: &[D as u64],
            bytes: &b,
        };
        w.append(coord(Component::MoeCombine.path().into()), Level::L4, view, true)
            .unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn bf16_eager_like_trace_is_b_in_ascending_expert_id_with_a_equivalent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("eager.bin");
    let eager = AggregationContract::parse("b+order=asc-id").unwrap();
    write(
        &path,
        &eager,
        12,
        Shape {
            topk: true,
            shared: true,
        },
    );
    let t = Trace::open(&path).unwrap();
    let x = explain_trace(&t, "eager.bin").unwrap();
    let v = &x.verdict;
    assert_eq!((v.events, v.explained_events), (12, 12));
    assert_eq!(v.rule.as_deref(), Some("b+order=asc-id"), "{v:?}");
    assert_eq!(v.headline, "b+order=asc-id — ascending expert id: 12/12 events");
    let a = v
        .equivalents
        .iter()
        .find(|q| q.contract == "a+order=asc-id")
        .unwrap_or_else(|| panic!("A not listed: {v:?}"));
    assert!(a.reasons.iter().any(|r| r.code == "terms_bf16_valued"), "{a:?}");
    for e in &x.events {
        assert_eq!(e.explanation.status, ExplanationStatus::Explained);
        assert_eq!(e.experts.len(), K);
    }
    // No router.gates in this trace: said, not hidden.
    assert_eq!(
        x.notes,
        vec!["12 of 12 events have no router.gates record: the gate orders were not tried there".to_string()]
    );
    // The text report leads with the rule.
    let text = x.render_text();
    assert!(
        text.contains("rule: b+order=asc-id — ascending expert id: 12/12 events"),
        "{text}"
    );
}

#[test]
fn grouped_mm_like_trace_is_c_with_the_routed_sum_rounded() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("grouped.bin");
    let grouped = AggregationContract::parse("c+routed=bf16").unwrap();
    write(
        &path,
        &grouped,
        9,
        Shape {
            topk: true,
            shared: true,
        },
    );
    let x = explain_trace(&Trace::open(&path).unwrap(), "grouped.bin").unwrap();
    let v = &x.verdict;
    assert_eq!(v.explained_events, 9);
    let mut set = vec![v.rule.clone().unwrap()];
    set.extend(v.equivalents.iter().map(|q| q.contract.clone()));
    assert!(set.iter().any(|m| m == "c+routed=bf16"), "{set:?}");
    // The paper's C merge (one rounding) is not among them.
    assert!(!set.iter().any(|m| m == "c"), "{set:?}");
}

#[test]
fn without_router_ids_the_id_orders_are_not_tried_and_a_note_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("noids.bin");
    let eager = AggregationContract::parse("b+order=asc-id").unwrap();
    write(
        &path,
        &eager,
        6,
        Shape {
            topk: false,
            shared: true,
        },
    );
    let x = explain_trace(&Trace::open(&path).unwrap(), "noids.bin").unwrap();
    assert!(
        x.notes
            .iter()
            .any(|n| n.contains("6 of 6 events have no router.topk record")),
        "{:?}",
        x.notes
    );
    // Still reported: no rule names the order, but every event has its
    // explicit B classes.
    assert!(x.verdict.rule.as_deref() != Some("b+order=asc-id"));
    assert!(x
        .events
        .iter()
        .all(|e| e.explanation.status == ExplanationStatus::Explained));
}

#[test]
fn a_missing_shared_output_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("noshared.bin");
    let c = AggregationContract::c();
    write(
        &path,
        &c,
        3,
        Shape {
            topk: true,
            shared: false,
        },
    );
    let err = explain_trace(&Trace::open(&path).unwrap(), "noshared.bin").unwrap_err();
    assert!(matches!(err, ExplainError::MissingRecord { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("noshared.bin") && text.contains("moe.shared"),
        "{text}"
    );
}
