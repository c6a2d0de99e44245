//! Protocol 10's matrix itself, independent of how the bisector localizes:
//! it has at least 20 fault kinds, expects a divergence at every operator
//! record of the catalogue (docs/operators.md §3), includes absorbed,
//! carried-state, cache storage/read, decode-only and integer-record
//! faults, and in both profiles every effective case's expected step, layer
//! and record is the first record that really differs between the two
//! traces (in execution order over every level).

use std::collections::BTreeSet;

use moeconf_calibrate::fault_matrix::matrix;
use moeconf_calibrate::{Ctx, CtxOptions, Sizes};
use moeconf_fingerprint::catalogue::{ExecGroup, Presence};
use moeconf_fingerprint::Component;
use moeconf_reference_runtime::precision::Precision;

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
