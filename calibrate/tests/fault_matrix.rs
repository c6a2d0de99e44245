//! Protocol 10's matrix itself, independent of how the bisector localizes:
//! it has at least 20 fault kinds, expects a divergence at every operator
//! record of the catalogue (docs/operators.md §3), includes absorbed,
//! carried-state, cache storage/read, decode-only and integer-record
//! faults, and in both profiles every effective case's expected step, layer
//! and record is the first record that really differs between the two
//! traces (in execution order over every level). The long-context cases
//! (issue 35 item 4) run on the long prompt, act there at exactly their
//! onset, and change no bit on "why the sheep".

use std::collections::BTreeSet;

use moeconf_calibrate::fault_matrix::{
    long_context_kinds, long_context_matrix, long_prompt, matrix, MatrixPrompt,
};
use moeconf_calibrate::{Ctx, CtxOptions, Sizes, TraceRequest};
use moeconf_contract::NativeCombine;
use moeconf_fingerprint::catalogue::{ExecGroup, Presence};
use moeconf_fingerprint::Component;
use moeconf_reference_runtime::faults::FaultPlan;
use moeconf_reference_runtime::precision::Precision;
use moeconf_schema::Trace;

fn ctx(out: &std::path::Path) -> Ctx {
    let m = moeconf_runner::load_model("builtin:tiny-v4").expect("built-in model");
    let opts = CtxOptions {
        precision: Precision::Bf16,
        fork_layer: 5,
        sizes: Sizes::QUICK,
        out: out.to_path_buf(),
        progress: moeconf_shard::ProgressMode::Off,
    };
    Ctx::new(m, opts).expect("context")
}

#[test]
fn the_matrix_covers_every_operator_with_enough_kinds() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = ctx(dir.path());
    let ids = ctx.encode("why the sheep").unwrap();
    for precision in [Precision::Bf16, Precision::F32] {
        let cases = matrix(&ctx, precision, &ids, Sizes::QUICK.tokens).unwrap();
        let kinds: BTreeSet<String> = cases
            .iter()
            .flat_map(|c| &c.faults)
            .map(|f| {
                // One kind per variant, whatever its parameters.
                let n = f.kind.name();
                n.split(['=', ':']).next().unwrap_or(&n).to_string()
            })
            .collect();
        assert!(kinds.len() >= 20, "{} kinds: {kinds:?}", kinds.len());
        let expected: BTreeSet<Component> = cases.iter().map(|c| c.expect.component).collect();
        // Every per-layer operator record of these profiles (the diagnostic router.margin is
        // derived from router.scores and read by nothing), the embedding and
        // the head's logits.
        let operators = Component::ALL
            .iter()
            .copied()
            .filter(|c| {
                c.exec_group() == ExecGroup::Layer
                    && *c != Component::RouterMargin
                    && c.spec().presence != Presence::CaptureOnly
                    // The official profile's quantization sites have no record in
                    // bf16/f32: calibrate/tests/official_sites.rs localizes them.
                    && !c.spec().presence.is_quantized()
            })
            .chain([Component::EmbedOutput, Component::LmLogits]);
        for c in operators {
            assert!(expected.contains(&c), "{precision:?}: no fault localized at {c}");
        }
        // Carried state, both caches' storage and read, integer records.
        for c in [
            Component::StateCompressorOverlapGate,
            Component::StateIndexerBufferKv,
            Component::AttnWindowRead,
            Component::AttnCompressedRead,
            Component::AttnIndexerRead,
            Component::RouterTopk,
            Component::AttnIndexerTopk,
        ] {
            assert!(expected.contains(&c), "{c}");
        }
        // A fault active at every step that bites from the first decode step,
        // and the two-event absorbed nudge of issue 13 gap 1.
        assert!(cases
            .iter()
            .any(|c| c.faults.iter().any(|f| f.step.is_none()) && c.expect.step >= 1));
        assert!(cases
            .iter()
            .any(|c| c.faults.len() == 2 && c.expect.component == Component::MoeCombine));
        assert!(cases.iter().all(|c| c.prompt == MatrixPrompt::Short));
    }
    // The long-context cases: one per kind, active at every step and
    // position of its layer, on a prompt that reaches every onset (so each
    // is expected in the prefill), at its kind's record.
    let (text, long) = long_prompt(&ctx).unwrap();
    let cfg = ctx.m.model.config();
    let cases = long_context_matrix(&ctx, long.len(), Sizes::QUICK.tokens);
    let kinds: Vec<_> = cases.iter().map(|c| c.faults[0].kind.clone()).collect();
    assert_eq!(kinds, long_context_kinds().to_vec(), "{text:?}");
    for c in &cases {
        let f = &c.faults[0];
        let layer = f.layer.unwrap();
        let onset = f
            .kind
            .long_context_onset(cfg, cfg.layer_types[layer as usize])
            .unwrap();
        assert!((onset as usize) < long.len(), "{}: onset {onset}", f.kind.name());
        assert!(f.step.is_none() && f.position.is_none() && c.faults.len() == 1);
        assert_eq!(c.prompt, MatrixPrompt::Long);
        assert_eq!((c.expect.step, c.expect.layer), (0, Some(layer)));
        assert_eq!(c.expect.component, f.kind.component());
    }
    // The fewest words of the passage: one word fewer does not reach the latest onset.
    let words: Vec<&str> = text.split_whitespace().collect();
    let shorter = ctx.encode(&words[..words.len() - 1].join(" ")).unwrap();
    let latest = cases
        .iter()
        .map(|c| {
            let l = c.faults[0].layer.unwrap() as usize;
            c.faults[0]
                .kind
                .long_context_onset(cfg, cfg.layer_types[l])
                .unwrap()
        })
        .max()
        .unwrap();
    assert!(shorter.len() <= latest as usize, "{} ids", shorter.len());
}

/// The long-context cases' plans change no bit on "why the sheep" (the
/// matrix's short prompt, with the matrix's tokens): the candidate trace has
/// the reference's root digest, in both profiles.
#[test]
fn long_context_cases_are_silent_on_the_short_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = ctx(dir.path());
    let ids = ctx.encode("why the sheep").unwrap();
    let (_, long) = long_prompt(&ctx).unwrap();
    let cases = long_context_matrix(&ctx, long.len(), Sizes::QUICK.tokens);
    assert_eq!(cases.len(), 3);
    for precision in [Precision::Bf16, Precision::F32] {
        let write = |name: &str, plan: Option<&FaultPlan>| {
            let path = dir.path().join(format!("{name}-{}.bin", precision.name()));
            ctx.write_trace_in(
                TraceRequest {
                    prompt: "why the sheep",
                    prompt_ids: &ids,
                    tokens: Sizes::QUICK.tokens,
                    combine: &NativeCombine,
                    faults: plan,
                    notes: vec![],
                    path: &path,
                },
                precision,
            )
            .unwrap();
            Trace::open_verified(&path).unwrap().root()
        };
        let reference = write("reference", None);
        for (i, c) in cases.iter().enumerate() {
            let plan = FaultPlan::new(c.faults.clone());
            assert_eq!(
                write(&format!("{i}"), Some(&plan)),
                reference,
                "{} ({precision:?}) changed bits on the short prompt",
                c.name()
            );
        }
    }
}

#[test]
fn every_expectation_is_the_first_differing_record_in_both_profiles() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = ctx(dir.path());
    let suite = moeconf_calibrate::suite::run(&ctx, &[10]).unwrap();
    let section = &suite.sections[0];
    let rows = section.json["rows"].as_array().unwrap();
    let mut effective = [0usize; 2];
    for r in rows {
        if r["effective"] == true {
            assert_eq!(
                r["first_differing_record_is_expected"], true,
                "{} ({}): expected {} but the traces first differ at {}",
                r["fault"], r["profile"], r["expected"], r["first_differing_record"]
            );
            effective[(r["profile"] == "f32") as usize] += 1;
        } else {
            assert_eq!(
                r["diff_equivalent"], true,
                "{} ({}) is silent",
                r["fault"], r["profile"]
            );
        }
    }
    assert!(
        effective.iter().all(|&n| n >= 30),
        "effective cases per profile: {effective:?}"
    );
    // The long-context cases: in each profile every one acts on the long
    // prompt and the diff's headline names its step, layer and record at
    // exactly its onset position.
    let cfg = ctx.m.model.config();
    for profile in ["bf16", "f32"] {
        let long: Vec<&serde_json::Value> = rows
            .iter()
            .filter(|r| r["profile"] == profile && r["prompt"] == "long")
            .collect();
        assert_eq!(long.len(), 3, "{profile}");
        for r in long {
            assert_eq!(
                (&r["effective"], &r["localized"]),
                (&true.into(), &true.into()),
                "{r}"
            );
            let kind = long_context_kinds()
                .into_iter()
                .find(|k| r["fault"] == k.name())
                .unwrap_or_else(|| panic!("not a long-context kind: {}", r["fault"]));
            let layer = r["expected"]["layer"].as_u64().unwrap() as usize;
            let onset = kind.long_context_onset(cfg, cfg.layer_types[layer]).unwrap();
            assert_eq!(r["found"]["position"], onset, "{r}");
        }
    }
    assert_eq!(section.json["long_context"]["localized"], 6);
    // Faults in uncaptured sub-operators name the steps inside the localized
    // operator; scaling faults the fitted scale (issue 32, items 4 and 5).
    for profile in ["bf16", "f32"] {
        let worded: Vec<&serde_json::Value> = rows
            .iter()
            .filter(|r| r["profile"] == profile && !r["worded"].is_null())
            .collect();
        assert!(
            worded.len() >= 5,
            "{profile}: {} rows require a reading",
            worded.len()
        );
        for r in worded {
            assert_eq!(
                r["worded"], true,
                "{} ({profile}): the reading {} lacks {}",
                r["fault"], r["reading"], r["expected_reading"]
            );
        }
    }
    // Issue 13 gap 1: in each profile exactly one moe.combine record differs
    // (one value, nudged), and the FFN hc_post absorbs it.
    let absorbed: Vec<&serde_json::Value> = rows
        .iter()
        .filter(|r| {
            r["faults"].as_array().unwrap().len() == 1 && r["fault"].as_str().unwrap().contains("nudged")
        })
        .collect();
    assert_eq!(absorbed.len(), 2);
    for r in absorbed {
        assert_eq!(r["divergence"], "absorbed", "{r}");
        assert_eq!(r["differing_records"], 1, "{r}");
        assert_eq!(r["first_differing_record"]["operator"], "moe.combine");
    }
}
