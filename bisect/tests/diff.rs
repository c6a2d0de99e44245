//! End-to-end tests of the bisection on synthetic traces with known injected
//! differences (tests/common/mod.rs builds them in the runtime's record order).

mod common;

use common::*;
use moeconf_bisect::{
    diff, Absorption, BisectError, DiffOptions, ExplanationStatus, LevelStatus, ValueComparison, Verdict,
};
use moeconf_contract::{b_class_of, b_class_representative, AggregationContract, Order};

fn pair(
    reference: &Synth,
    candidate: &Synth,
) -> (tempfile::TempDir, moeconf_schema::Trace, moeconf_schema::Trace) {
    let dir = tempfile::tempdir().unwrap();
    let r = reference.write(&dir.path().join("ref.bin"));
    let c = candidate.write(&dir.path().join("cand.bin"));
    (dir, r, c)
}

fn b_class(class: u64) -> AggregationContract {
    AggregationContract::b().with_order(Order::BClass(class))
}

#[test]
fn identical_traces_are_equivalent() {
    let mut cand = Synth::reference();
    // Expected backend differences are shown, not refused, and do not break equivalence.
    cand.binding.contract = "c".into();
    cand.provenance.threads = 8;
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    assert_eq!(rep.verdict, Verdict::Equivalent);
    assert_eq!(rep.exit_code(), 0);
    assert!(rep.first_divergence.is_none());
    for st in [
        rep.levels.l0.status,
        rep.levels.l1.status,
        rep.levels.l2.status,
        rep.levels.l3.status,
        rep.levels.l4.status,
    ] {
        assert_eq!(st, LevelStatus::Match);
    }
    let fields: Vec<&str> = rep
        .comparability
        .expected_differences
        .iter()
        .map(|d| d.field.as_str())
        .collect();
    assert_eq!(fields, ["contract", "provenance.threads"]);
    assert!(rep.summary.starts_with("equivalent"), "{}", rep.summary);
    let text = rep.render_text(false);
    assert!(text.starts_with("EQUIVALENT"), "{text}");
    assert!(!text.contains('\x1b'));
}

/// A B fork at (step, layer, position): the report must name exactly that
/// event and operator, and contract inference the injected class.
fn check_b_fork(step: u32, layer: u32, position: u32, class: u64) {
    let cand = Synth::candidate(Inject::Combine {
        step,
        layer,
        position,
        contract: b_class(class),
    });
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    assert_eq!(rep.verdict, Verdict::Divergent);
    let fd = rep.first_divergence.as_ref().expect("localized");
    assert_eq!(
        (
            fd.level.as_str(),
            fd.step,
            fd.position,
            fd.layer,
            fd.operator.as_str()
        ),
        ("L4", step, position, Some(layer), "moe.combine"),
        "fork at step {step} layer {layer} position {position}: {fd:?}"
    );
    // L3: the post-FFN checkpoint of that event is the first to differ; the
    // post-attention checkpoint before it matches.
    let l3 = &rep.levels.l3;
    let first = l3.first.as_ref().unwrap();
    assert_eq!(
        (first.step, first.layer, first.position, first.path.as_str()),
        (step, Some(layer), position, "layer.post_ffn_mhc")
    );
    let last = l3.last_matched_checkpoint.as_ref().unwrap();
    assert_eq!(
        (last.layer, last.position, last.path.as_str()),
        (Some(layer), position, "layer.post_attn_mhc")
    );
    assert!(l3.route.is_none(), "routes are unchanged");
    // L4: inputs of the combine match.
    let loc = rep.levels.l4.localized.as_ref().unwrap();
    assert!(loc.inputs_match);
    assert!(loc
        .inputs
        .iter()
        .any(|i| i.input.starts_with("moe.term.*") && i.status == "match" && i.records == 6));
    let Some(ValueComparison::Float(num)) = loc.comparison.as_ref() else {
        panic!("a float comparison: {:?}", loc.comparison)
    };
    assert!(num.differing > 0 && num.differing <= num.elements);
    // Both sides are explained: the candidate as the injected B class (the
    // two permutations of the class, one entry), the reference as native.
    let con = rep.levels.l4.contract.as_ref().unwrap();
    let e = con.candidate_explanation.as_ref().unwrap();
    assert_eq!(e.status, ExplanationStatus::Explained);
    let b = e
        .permutations
        .iter()
        .find(|p| p.family == "b")
        .expect("B reproduces the candidate");
    assert_eq!(
        b.listed,
        vec![format!("class:{class}")],
        "exactly the injected class"
    );
    assert_eq!((b.matching, b.tried), (2, 720));
    // A class that contains a named order is reported by that name.
    let (member, words) = if class == b_class_of(&[0, 1, 2, 3, 4, 5]).unwrap() {
        ("b".to_string(), "router slot order".to_string())
    } else if class == b_class_of(&[5, 4, 3, 2, 1, 0]).unwrap() {
        ("b+order=reversed".to_string(), "reversed slot order".to_string())
    } else {
        (format!("b+order=class:{class}"), format!("B class {class}"))
    };
    assert_eq!(con.candidate.as_deref(), Some(member.as_str()));
    assert_eq!(e.order.as_deref(), Some(words.as_str()));
    assert_eq!(fd.contract, con.candidate);
    let re = con.reference_explanation.as_ref().unwrap();
    assert_eq!(re.simplest.as_deref(), Some("c"), "{re:?}");
    assert_eq!(con.reference_is_native, Some(true));
    // The state of layers up to the fork layer stays identical at that boundary.
    // (A fork in the last layer leaves every layer's state identical.)
    let l2 = &rep.levels.l2;
    if layer + 1 < LAYERS {
        assert_eq!(l2.step, Some(step));
        assert_eq!(l2.identical_layers, (0..=layer).collect::<Vec<_>>());
    } else {
        assert_eq!(l2.status, LevelStatus::Match);
    }
    let text = rep.render_text(false);
    assert!(
        text.contains(&format!(
            "candidate's moe.combine at layer {layer} step {step} equals {member}"
        )) && text.contains(&format!(
            "reference's moe.combine at layer {layer} step {step} equals c"
        )),
        "{text}"
    );
    assert!(
        text.lines().last().unwrap().contains("operator moe.combine"),
        "{text}"
    );
}

#[test]
fn b_fork_is_localized_at_several_layers_and_positions() {
    // Decode steps (one position) and the prefill (position inside the prompt).
    check_b_fork(1, 2, PROMPT, 135);
    check_b_fork(2, 0, PROMPT + 1, 7);
    check_b_fork(0, 1, 1, 359);
    check_b_fork(3, 3, PROMPT + 2, 200);
}

#[test]
fn other_contracts_are_inferred() {
    // A permuted A order and P32: inference reports the permutation index.
    for (contract, scheme) in [
        (
            AggregationContract::a().with_order(Order::PermutationIndex(451)),
            "a",
        ),
        (
            AggregationContract::p32().with_order(Order::PermutationIndex(3)),
            "p32",
        ),
    ] {
        let cand = Synth::candidate(Inject::Combine {
            step: 1,
            layer: 1,
            position: PROMPT,
            contract,
        });
        let (_d, r, c) = pair(&Synth::reference(), &cand);
        let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
        let con = rep.levels.l4.contract.clone().unwrap();
        let e = con.candidate_explanation.clone().unwrap();
        let m = e
            .permutations
            .iter()
            .find(|m| m.family == scheme)
            .unwrap_or_else(|| panic!("{scheme}: {e:?}"));
        let expect = if scheme == "a" { 451 } else { 3 };
        assert!(
            m.listed.contains(&format!("index:{expect}")) || m.matching == m.tried,
            "{m:?}"
        );
    }
    // Sanity of the class numbering used above.
    assert_eq!(b_class_representative(6, 0).unwrap(), vec![0, 1, 2, 3, 4, 5]);
}

/// A combine outside what inference tries (a tree under an explicit
/// permutation, tried only under the named orders) is said to match nothing,
/// with the closest members and how many values they get wrong, while the
/// reference is still explained.
#[test]
fn unexplained_candidate_reports_the_closest_members() {
    let contract = AggregationContract::parse("a+shape=tree+order=index:451").unwrap();
    let cand = Synth::candidate(Inject::Combine {
        step: 1,
        layer: 1,
        position: PROMPT,
        contract,
    });
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let fd = rep.first_divergence.as_ref().unwrap();
    assert_eq!(fd.operator, "moe.combine");
    assert!(fd.contract.is_none(), "{fd:?}");
    let con = rep.levels.l4.contract.as_ref().unwrap();
    let e = con.candidate_explanation.as_ref().unwrap();
    assert_eq!(e.status, ExplanationStatus::Unexplained, "{e:?}");
    assert!(e.simplest.is_none() && con.candidate.is_none());
    assert!(!e.closest.is_empty());
    for n in &e.closest {
        assert!(n.differing >= 1 && n.differing <= n.elements, "{n:?}");
    }
    assert!(e.closest.windows(2).all(|w| w[0].differing <= w[1].differing));
    // The reference is explained on its own.
    let re = con.reference_explanation.as_ref().unwrap();
    assert_eq!(re.status, ExplanationStatus::Explained);
    let text = rep.render_text(false);
    assert!(
        text.contains(
            "candidate's moe.combine at layer 1 step 1: no grammar member reproduces it; closest members: "
        ),
        "{text}"
    );
    // Closeness in ulps, not only in a count of differing values.
    assert!(
        e.closest.iter().all(|n| n.max_ulps.is_some_and(|u| u >= 1)),
        "{e:?}"
    );
    assert!(text.contains(" ulp)"), "{text}");
    // A reordered tree is no scaling: the fit reads every coefficient as 1 and is left out.
    assert!(e.fit.is_none(), "{:?}", e.fit);
}

/// The last checkpoint of the step before `bound` in execution order, from
/// every L3 group of the step read whole (what the report named when it
/// counted the earlier checkpoints): the oracle of the lookup at the
/// coordinates execution order gives.
fn last_checkpoint_read_whole(
    t: &moeconf_schema::Trace,
    bound: &moeconf_bisect::RecordRef,
) -> Option<(Option<u32>, u32, String)> {
    use moeconf_fingerprint::catalogue::ExecKey;
    use moeconf_fingerprint::{Coord, Phase};
    let key = |c: &Coord| (ExecKey::of(c), c.phase, c.path.to_string());
    let b = Coord {
        step: bound.step,
        position: bound.position,
        phase: if bound.phase == "prefill" {
            Phase::Prefill
        } else {
            Phase::Decode
        },
        layer: bound.layer,
        path: bound.path.as_str().into(),
    };
    let level = t
        .step(b.step)
        .unwrap()
        .unwrap()
        .level(moeconf_fingerprint::Level::L3)
        .unwrap();
    level
        .groups
        .iter()
        .flat_map(|g| t.read_group(g).unwrap())
        .map(|h| h.entry().coord.clone())
        .filter(|c| c.path.ends_with("_mhc") && key(c) < key(&b))
        .max_by_key(key)
        .map(|c| (c.layer, c.position, c.path.to_string()))
}

/// The L3 line names as last match the checkpoint just before the first
/// differing one in execution order (layer-major, then position, then the
/// attention half before the FFN half): the same position's attention
/// checkpoint, the position before's FFN checkpoint, the layer before's
/// last, or none for the first checkpoint of a step. Attention forks make
/// the attention half's checkpoint the first to differ.
#[test]
fn the_last_matched_checkpoint_is_the_one_before_in_execution_order() {
    use moeconf_bisect::EarlierCheckpoints;
    let decode = PROMPT + 1;
    // (step, layer, position of the fork), the expected last match.
    for (step, layer, position, expect) in [
        (0, 0, 0, None),
        (0, 0, 2, Some((Some(0), 1, "layer.post_ffn_mhc"))),
        (0, 2, 0, Some((Some(1), PROMPT - 1, "layer.post_ffn_mhc"))),
        (0, 3, 1, Some((Some(3), 0, "layer.post_ffn_mhc"))),
        (2, 0, decode, None),
        (2, 3, decode, Some((Some(2), decode, "layer.post_ffn_mhc"))),
    ] {
        let cand = Synth::candidate(Inject::Attention {
            step,
            layer,
            position,
        });
        let (_d, r, c) = pair(&Synth::reference(), &cand);
        let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
        let l3 = &rep.levels.l3;
        let first = l3.first.as_ref().unwrap();
        assert_eq!(
            (first.step, first.layer, first.position, first.path.as_str()),
            (step, Some(layer), position, "layer.post_attn_mhc")
        );
        let named = l3
            .last_matched_checkpoint
            .as_ref()
            .map(|m| (m.layer, m.position, m.path.clone()));
        let expect = expect.map(|(l, p, path)| (l, p, path.to_string()));
        assert_eq!(
            named, expect,
            "fork at step {step} layer {layer} position {position}"
        );
        assert_eq!(named, last_checkpoint_read_whole(&r, first));
        assert_eq!(
            l3.earlier_checkpoints,
            Some(if expect.is_some() {
                EarlierCheckpoints::Match
            } else {
                EarlierCheckpoints::None
            })
        );
        let text = rep.render_text(false);
        match &named {
            Some(_) => assert!(
                text.contains(&format!(
                    "   every earlier checkpoint of step {step} matches; last match: "
                )),
                "{text}"
            ),
            None => assert!(
                text.contains(&format!("   it is the first checkpoint of step {step}\n")),
                "{text}"
            ),
        }
    }
}

#[test]
fn attention_divergence_is_localized_at_attn_output() {
    let cand = Synth::candidate(Inject::Attention {
        step: 2,
        layer: 1,
        position: PROMPT + 1,
    });
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    // The steps inside attn.output that no record captures are named.
    let text = rep.render_text(false);
    assert!(
        text.contains("inside it, not captured: the inverse RoPE, the grouped projections W_oa"),
        "{text}"
    );
    let fd = rep.first_divergence.unwrap();
    assert_eq!(
        (fd.level.as_str(), fd.step, fd.layer, fd.operator.as_str()),
        ("L4", 2, Some(1), "attn.output")
    );
    assert!(fd.contract.is_none());
    let l3 = rep.levels.l3.first.unwrap();
    assert_eq!((l3.layer, l3.path.as_str()), (Some(1), "layer.post_attn_mhc"));
    let loc = rep.levels.l4.localized.unwrap();
    assert!(loc.inputs_match);
    assert_eq!(loc.inputs.len(), 1);
    assert_eq!(
        (loc.inputs[0].input.as_str(), loc.inputs[0].status.as_str()),
        ("attn.core (layer 1)", "match")
    );
    assert!(rep.levels.l4.contract.is_none());
    assert!(loc
        .uncaptured_steps
        .as_deref()
        .is_some_and(|u| u.contains("W_ob")));
}

#[test]
fn state_only_difference_is_reported_at_l2() {
    let cand = Synth::candidate(Inject::State { step: 2, layer: 3 });
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    assert_eq!(rep.verdict, Verdict::Divergent);
    for st in [
        rep.levels.l0.status,
        rep.levels.l1.status,
        rep.levels.l3.status,
        rep.levels.l4.status,
    ] {
        assert_eq!(st, LevelStatus::Match);
    }
    let l2 = &rep.levels.l2;
    assert_eq!(l2.status, LevelStatus::Differ);
    assert_eq!((l2.step, l2.differing_steps), (Some(2), 1));
    assert_eq!(l2.layers.len(), 1);
    assert_eq!(l2.layers[0].layer, Some(3));
    let comp = &l2.layers[0].components[0];
    assert_eq!(comp.path, "state.window_kv");
    assert_eq!(comp.values, Some(4 * HD as u64));
    assert!(comp.differing_values.unwrap() > 0);
    assert_eq!(l2.identical_layers, vec![0, 1, 2]);
    let fd = rep.first_divergence.unwrap();
    assert_eq!(
        (fd.level.as_str(), fd.step, fd.layer, fd.operator.as_str()),
        ("L2", 2, Some(3), "state.window_kv")
    );
}

#[test]
fn token_divergence_reports_ordinal_and_text_diff() {
    // The fork at step 1 changes the token predicted by step 2 (ordinal 3);
    // a route changes at step 3.
    let mut cand = Synth::candidate(Inject::Combine {
        step: 1,
        layer: 2,
        position: PROMPT,
        contract: b_class(135),
    });
    cand.token_step = Some(3);
    cand.route_change = Some((3, 0, PROMPT + 2));
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let l0 = &rep.levels.l0;
    assert_eq!(l0.ordinal, Some(3));
    assert_eq!(l0.reference_token, Some(i64::from(token_of(2))));
    assert_eq!(l0.candidate_token, Some(i64::from(token_of(2) + 1)));
    assert_eq!(l0.reference_token_text, Some(word(token_of(2))));
    assert_eq!(l0.candidate_token_text, Some(word(token_of(2) + 1)));
    let tags: Vec<&str> = l0.text_diff.iter().map(|o| o.tag.as_str()).collect();
    assert!(
        tags.contains(&"delete") && tags.contains(&"insert"),
        "{:?}",
        l0.text_diff
    );
    assert!(l0.text_diff[0].tag == "equal" && l0.text_diff[0].text.starts_with(&word(token_of(0))));
    // L1 at the fork step: logits differ, the argmax does not.
    let l1 = &rep.levels.l1;
    assert_eq!(l1.first.as_ref().unwrap().step, 1);
    assert_eq!(l1.argmax_changed, Some(false));
    assert_eq!(
        (l1.reference_margin, l1.candidate_margin),
        (Some(1.0), Some(0.75))
    );
    assert_eq!(l1.logits.as_ref().unwrap().elements, V as u64);
    // The route change at step 3 layer 0: one expert leaves, one enters.
    let route = rep.levels.l3.route.as_ref().unwrap();
    assert_eq!(
        (route.at.step, route.at.layer, route.at.position),
        (3, Some(0), PROMPT + 2)
    );
    assert_eq!((route.entering.len(), route.leaving.len()), (1, 1));
    assert!(route.reference_margin.is_some() && route.candidate_margin.is_some());
    // The localization is still the fork.
    let fd = rep.first_divergence.unwrap();
    assert_eq!(
        (fd.step, fd.layer, fd.operator.as_str()),
        (1, Some(2), "moe.combine")
    );
    assert!(
        rep.summary.contains("visible at generated token 3"),
        "{}",
        rep.summary
    );
}

#[test]
fn fingerprints_without_payloads_still_localize() {
    let mut cand = Synth::candidate(Inject::Combine {
        step: 1,
        layer: 2,
        position: PROMPT,
        contract: b_class(135),
    });
    cand.payloads = false;
    let mut reference = Synth::reference();
    reference.payloads = false;
    let (_d, r, c) = pair(&reference, &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let fd = rep.first_divergence.as_ref().unwrap();
    assert_eq!(
        (fd.step, fd.layer, fd.operator.as_str()),
        (1, Some(2), "moe.combine")
    );
    assert!(fd.contract.is_none());
    let con = rep.levels.l4.contract.as_ref().unwrap();
    assert!(
        con.candidate.is_none() && con.candidate_note.as_ref().unwrap().contains("payload"),
        "{con:?}"
    );
    assert!(rep.levels.l4.localized.as_ref().unwrap().comparison.is_none());
}

#[test]
fn non_comparable_bindings_list_every_field() {
    let mut cand = Synth::reference();
    cand.binding.prompt.ids = vec![5, 6, 8];
    cand.binding.prompt.text = "why the goat".into();
    cand.binding.decoding.max_new_tokens = 9;
    cand.binding.model.weights_digest = moeconf_fingerprint::Digest([1; 32]);
    cand.binding.contract = "b".into();
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let err = diff(&r, &c, &DiffOptions::default()).unwrap_err();
    let BisectError::NotComparable { fields } = &err else {
        panic!("{err}")
    };
    let names: Vec<&str> = fields
        .iter()
        .map(|f| f.field.split(' ').next().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "model.weights_digest",
            "prompt.text",
            "prompt.ids",
            "decoding.max_new_tokens"
        ]
    );
    let msg = err.to_string();
    assert!(
        msg.contains("first difference at index 2") && msg.contains("--force"),
        "{msg}"
    );
    // Forced: compared, and the refused fields are carried in the report.
    let rep = diff(
        &r,
        &c,
        &DiffOptions {
            force: true,
            ..DiffOptions::default()
        },
    )
    .unwrap();
    assert_eq!(rep.comparability.forced_over.len(), 4);
    assert_eq!(rep.verdict, Verdict::Equivalent);
}

#[test]
fn json_has_the_documented_keys() {
    let cand = Synth::candidate(Inject::Combine {
        step: 1,
        layer: 2,
        position: PROMPT,
        contract: b_class(135),
    });
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let j = diff(&r, &c, &DiffOptions::default()).unwrap().to_json();
    assert_eq!(j["schema_version"], 5);
    assert_eq!(j["kind"], "moeconf.diff");
    assert_eq!(j["verdict"], "divergent");
    let fd = &j["first_divergence"];
    for key in [
        "level",
        "step",
        "position",
        "layer",
        "operator",
        "contract",
        "kind",
        "present_in",
    ] {
        assert!(fd.get(key).is_some(), "first_divergence.{key}");
    }
    assert_eq!(fd["kind"], "propagating");
    let d = &j["divergences"][0];
    for key in [
        "at",
        "kind",
        "checkpoint",
        "inputs",
        "inputs_match",
        "inputs_note",
        "layer_kind",
        "comparison",
    ] {
        assert!(d.get(key).is_some(), "divergences[0].{key}");
    }
    assert!(
        d["inputs_note"].is_null(),
        "every input matches bitwise and is observed"
    );
    for i in d["inputs"].as_array().unwrap() {
        assert!(i.get("recomputed").is_some_and(|r| r.is_null()), "{i}");
    }
    assert_eq!(j["rest"], "propagates");
    assert_eq!(fd["operator"], "moe.combine");
    assert_eq!(fd["contract"], "b+order=class:135");
    for level in ["L0", "L1", "L2", "L3", "L4"] {
        let l = &j["levels"][level];
        assert!(l["status"].is_string() && l["explains"].is_string(), "{level}");
        assert!(
            l.get("first").is_some() && l.get("differing_steps").is_some(),
            "{level}"
        );
    }
    let num = &j["levels"]["L4"]["localized"]["comparison"];
    assert_eq!(num["kind"], "float");
    for key in [
        "sign_changes",
        "differing",
        "elements",
        "max_abs_delta",
        "max_ulp",
        "min_atol",
        "min_rtol",
        "worst",
    ] {
        assert!(num.get(key).is_some(), "numeric.{key}");
    }
    let con = &j["levels"]["L4"]["contract"];
    assert_eq!(con["candidate_explanation"]["simplest"], "b+order=class:135");
    assert_eq!(con["candidate_explanation"]["status"], "explained");
    assert_eq!(con["reference_explanation"]["simplest"], "c");
    assert_eq!(con["reference_is_native"], true);
    for key in [
        "reference",
        "candidate",
        "comparability",
        "compared_levels",
        "unmatched_steps",
        "storage_precision",
        "one_side_only",
        "summary",
    ] {
        assert!(j.get(key).is_some(), "{key}");
    }
}

#[test]
fn different_algorithms_and_disjoint_levels_are_errors() {
    use moeconf_fingerprint::{Algorithm, Coord, DType, Level, Phase, TensorView};
    use moeconf_schema::{Header, Trace, TraceWriter};
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, alg: Algorithm, level: Level, path: &str| {
        let p = dir.path().join(name);
        let mut header = Header::default();
        header.binding.decoding.max_new_tokens = 1;
        let mut w = TraceWriter::create(&p, alg, header).unwrap();
        let c = Coord {
            step: 0,
            position: 0,
            phase: Phase::Prefill,
            layer: None,
            path: path.into(),
        };
        let b = 1i32.to_le_bytes();
        w.append(
            c,
            level,
            TensorView {
                dtype: DType::I32,
                shape: &[1],
                bytes: &b,
            },
            true,
        )
        .unwrap();
        w.finish().unwrap();
        Trace::open(&p).unwrap()
    };
    let a = write("a.bin", Algorithm::Blake3, Level::L0, "token.output");
    let b = write("b.bin", Algorithm::Sha256, Level::L0, "token.output");
    let err = diff(
        &a,
        &b,
        &DiffOptions {
            force: true,
            ..DiffOptions::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, BisectError::AlgorithmMismatch { .. }), "{err}");
    let c = write("c.bin", Algorithm::Blake3, Level::L1, "lm.margin");
    let err = diff(&a, &c, &DiffOptions::default()).unwrap_err();
    assert!(matches!(err, BisectError::NothingToCompare { .. }), "{err}");
}

/// Prints the text report of every scenario (run with `--nocapture` to read
/// them) and checks the shape every report shares: verdict first, one
/// section per level, each with a plain-language line, summary last.
#[test]
fn text_reports_have_verdict_sections_and_summary() {
    let mut token = Synth::candidate(Inject::Combine {
        step: 1,
        layer: 2,
        position: PROMPT,
        contract: b_class(135),
    });
    token.token_step = Some(3);
    for cand in [
        token,
        Synth::candidate(Inject::Attention {
            step: 2,
            layer: 1,
            position: PROMPT + 1,
        }),
        Synth::candidate(Inject::State { step: 2, layer: 3 }),
    ] {
        let (_d, r, c) = pair(&Synth::reference(), &cand);
        let text = diff(&r, &c, &DiffOptions::default()).unwrap().render_text(false);
        println!("{text}\n----------------------------------------");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("DIVERGENT: the candidate departs from the reference at step"));
        for (level, what) in [
            ("L0", "tokens / text"),
            ("L1", "logits"),
            ("L2", "full persistent state"),
            ("L3", "layer state"),
            ("L4", "operator"),
        ] {
            let i = lines
                .iter()
                .position(|l| l.starts_with(level) && l.contains(what))
                .unwrap_or_else(|| panic!("{level} section"));
            assert!(
                lines[i + 1].starts_with("   ") && lines[i + 1].len() > 40,
                "{level}: explanation line"
            );
        }
        assert!(lines.last().unwrap().starts_with("first divergence: "));
    }
}

#[test]
fn corrupt_payload_on_the_divergent_path_is_an_error() {
    let cand = Synth::candidate(Inject::Combine {
        step: 1,
        layer: 2,
        position: PROMPT,
        contract: b_class(135),
    });
    let (dir, r, c) = pair(&Synth::reference(), &cand);
    let i = c
        .records()
        .unwrap()
        .iter()
        .position(|e| e.coord.step == 1 && e.coord.layer == Some(2) && e.coord.path == "moe.combine")
        .unwrap();
    let off = c.records().unwrap()[i].payload.unwrap().offset as usize;
    drop(c);
    let path = dir.path().join("cand.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[off] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    // The index and checksum are intact, so the trace opens; the payload read
    // on the divergent path is re-hashed and rejected.
    let c = moeconf_schema::Trace::open(&path).unwrap();
    let err = diff(&r, &c, &DiffOptions::default()).unwrap_err();
    assert!(matches!(err, BisectError::Trace(_)), "{err}");
    assert!(err.to_string().contains("moe.combine"), "{err}");
}

/// A divergence propagates only to what it can reach: a term difference
/// at prefill position 1 of layer 1 that its combine absorbs is not the
/// cause of a later layer's divergence at position 0 (attention is causal),
/// which is reported as a divergence of its own.
#[test]
fn a_divergence_never_propagates_to_an_earlier_position() {
    let mut cand = Synth::candidate(Inject::Term {
        step: 0,
        layer: 1,
        position: 1,
    });
    cand.also = vec![Inject::Combine {
        step: 0,
        layer: 3,
        position: 0,
        contract: b_class(5),
    }];
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let at = |d: &moeconf_bisect::Divergence| {
        (
            d.at.step,
            d.at.position,
            d.at.layer,
            d.at.path.clone(),
            d.kind.map(|k| k.name()),
        )
    };
    let got: Vec<_> = rep.divergences.iter().map(at).collect();
    assert_eq!(
        got,
        [
            (0, 1, Some(1), "moe.term.0".to_string(), Some("absorbed")),
            (0, 0, Some(3), "moe.combine".to_string(), Some("propagating")),
        ],
        "{}",
        rep.render_text(false)
    );
    // The absorbed one names its own (matching) consumer, never a record at
    // an earlier position.
    let cp = rep.divergences[0].checkpoint.as_ref().unwrap();
    assert_eq!(
        (cp.position, cp.layer, cp.path.as_str()),
        (1, Some(1), "moe.combine")
    );
    assert_eq!(rep.rest, "propagates");
}

/// Two independent divergences in one forward, the later at an earlier
/// position of a later layer: both are listed, in execution order.
#[test]
fn independent_divergences_of_one_forward_are_each_listed() {
    let mut cand = Synth::candidate(Inject::Combine {
        step: 0,
        layer: 1,
        position: 2,
        contract: b_class(5),
    });
    cand.also = vec![Inject::Combine {
        step: 0,
        layer: 3,
        position: 0,
        contract: b_class(9),
    }];
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let got: Vec<_> = rep
        .divergences
        .iter()
        .map(|d| {
            (
                d.at.position,
                d.at.layer,
                d.at.path.as_str(),
                d.kind.map(|k| k.name()),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (2, Some(1), "moe.combine", Some("propagating")),
            (0, Some(3), "moe.combine", Some("propagating")),
        ],
        "{}",
        rep.render_text(false)
    );
    // Each propagates to a checkpoint it can reach.
    for d in &rep.divergences {
        let cp = d.checkpoint.as_ref().unwrap();
        assert!(cp.position >= d.at.position, "{d:?}");
    }
}

/// A record only captures hold (`moe.routed`, the routed sum a backend
/// materializes inside its combine) is compared and reported, but the walk
/// and contract inference reach the combine that consumes it.
#[test]
fn an_observed_routed_sum_does_not_stop_the_walk_before_the_combine() {
    let mut reference = Synth::reference();
    reference.routed = true;
    let mut cand = Synth::candidate(Inject::Combine {
        step: 1,
        layer: 2,
        position: 3,
        contract: b_class(5),
    });
    cand.routed = true;
    let (_d, r, c) = pair(&reference, &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let text = rep.render_text(false);
    // The observation is reported as the combine's input, not as a divergence before it.
    let paths: Vec<&str> = rep.divergences.iter().map(|d| d.at.path.as_str()).collect();
    assert_eq!(paths, ["moe.combine"], "{text}");
    assert_eq!(
        rep.first_divergence.as_ref().map(|f| f.operator.as_str()),
        Some("moe.combine")
    );
    let loc = rep.levels.l4.localized.as_ref().expect("localized");
    assert_eq!(loc.at.path, "moe.combine", "{text}");
    assert!(loc.inputs_match, "{text}");
    assert!(
        loc.inputs
            .iter()
            .any(|i| i.input.starts_with("moe.routed") && i.status == "observed_differs"),
        "{:?}",
        loc.inputs
    );
    // Contract inference ran at the combine and names the injected class.
    let con = rep
        .levels
        .l4
        .contract
        .as_ref()
        .expect("contract inference at moe.combine");
    assert_eq!(con.candidate.as_deref(), Some("b+order=class:5"), "{text}");
}

/// "Not captured" lists only inputs the traces' profiles can have: no
/// quantization site (`*_fp8`) for bf16 traces, named or not by a known
/// profile, when neither trace holds any site there.
#[test]
fn quantization_sites_are_not_listed_as_missing_inputs_of_unquantized_traces() {
    for precision in ["bf16", "bf16-foreign-backend"] {
        let mut reference = Synth::reference();
        reference.binding.precision = precision.into();
        // moe.term.J reads moe.term_h_fp8.* where a profile quantizes.
        let mut cand = Synth::candidate(Inject::Term {
            step: 1,
            layer: 2,
            position: 3,
        });
        cand.binding.precision = precision.into();
        let (_d, r, c) = pair(&reference, &cand);
        let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
        let listed: Vec<&str> = rep
            .divergences
            .iter()
            .flat_map(|d| d.inputs.iter())
            .chain(rep.levels.l4.localized.iter().flat_map(|l| l.inputs.iter()))
            .map(|i| i.input.as_str())
            .collect();
        assert!(!listed.is_empty(), "{precision}");
        assert!(
            !listed.iter().any(|i| i.contains("fp8")),
            "{precision}: {listed:?}"
        );
    }
}

/// The summary line names the first divergence and the first later one
/// that is not absorbed, and says how many more the list holds.
#[test]
fn the_summary_says_how_many_divergences_it_does_not_name() {
    // In execution order: layer 1 position 2 (propagating), then two
    // absorbed term differences at earlier positions of later layers.
    let mut cand = Synth::candidate(Inject::Combine {
        step: 0,
        layer: 1,
        position: 2,
        contract: b_class(5),
    });
    cand.also = vec![
        Inject::Term {
            step: 0,
            layer: 2,
            position: 1,
        },
        Inject::Term {
            step: 0,
            layer: 3,
            position: 0,
        },
    ];
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let text = rep.render_text(false);
    assert_eq!(rep.divergences.len(), 3, "{text}");
    let summary = text.lines().find(|l| l.starts_with("first divergence:")).unwrap();
    assert!(
        summary.contains("; and 2 more divergences independent of it (listed above)"),
        "{summary}"
    );
    // Two absorbed, then a propagating one: the first and the propagating
    // one named, the other counted.
    let mut cand = Synth::candidate(Inject::Term {
        step: 0,
        layer: 1,
        position: 2,
    });
    cand.also = vec![
        // Earlier positions of later layers: none reachable from the others.
        Inject::Term {
            step: 0,
            layer: 2,
            position: 1,
        },
        Inject::Combine {
            step: 0,
            layer: 3,
            position: 0,
            contract: b_class(5),
        },
    ];
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let text = rep.render_text(false);
    assert_eq!(rep.divergences.len(), 3, "{text}");
    let summary = text.lines().find(|l| l.starts_with("first divergence:")).unwrap();
    assert!(
        summary.contains(
            "absorbed by the combine, which matches; then L4 step 0 position 0 layer 3 operator moe.combine, propagating; and 1 more divergence (listed above)"
        ),
        "{summary}"
    );
}

/// Counterfactual absorption at the combine: a one-ulp difference in one
/// routed term that R_BF16 erases on both sides, under a candidate whose
/// combine contract differs. Each side's rule gives its own output from the
/// other side's terms, so the term difference is absorbed by both contracts
/// and the walk reaches the combine, where both contracts are named.
#[test]
fn a_term_difference_both_contracts_absorb_leaves_the_contract_as_the_divergence() {
    contract_absorbs_a_term_difference(b_class(5), "b+order=class:5");
}

/// The same with a named order resolved at the event's routes (like
/// transformers eager's `b+order=asc-id`; the synthetic routes are ascending,
/// so the gate order stands in): each side's rule is evaluated with its own
/// routes and gates, not in slot order.
#[test]
fn a_named_order_rule_absorbs_a_term_difference_at_its_own_routes() {
    let by_gate = AggregationContract::parse("b+order=desc-gate").unwrap();
    contract_absorbs_a_term_difference(by_gate, "b+order=desc-gate");
}

fn contract_absorbs_a_term_difference(contract: AggregationContract, named: &str) {
    let mut cand = Synth::candidate(Inject::Combine {
        step: 1,
        layer: 2,
        position: 3,
        contract,
    });
    cand.also = vec![Inject::Nudge {
        step: 1,
        layer: 2,
        position: 3,
    }];
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let text = rep.render_text(false);
    let got: Vec<_> = rep
        .divergences
        .iter()
        .map(|d| (d.at.path.as_str(), d.kind.map(|k| k.name())))
        .collect();
    assert_eq!(
        got,
        [
            ("moe.term.1", Some("absorbed")),
            ("moe.combine", Some("propagating"))
        ],
        "{text}"
    );
    assert!(text.contains("absorbed by both contracts at"), "{text}");
    let loc = rep.levels.l4.localized.as_ref().unwrap();
    assert_eq!(loc.at.path, "moe.combine", "{text}");
    assert!(loc.inputs_match, "{text}");
    assert!(
        loc.inputs
            .iter()
            .any(|i| i.input.starts_with("moe.term.*") && i.status == "absorbed_by_contracts"),
        "{:?}",
        loc.inputs
    );
    let con = rep.levels.l4.contract.as_ref().unwrap();
    assert_eq!(con.candidate.as_deref(), Some(named), "{text}");
    assert_eq!(
        con.reference_explanation
            .as_ref()
            .and_then(|e| e.simplest.as_deref()),
        Some("c")
    );
}

/// Without a contract change, a term difference the combine does not absorb
/// on the other side stays the divergence (the counterfactual proves
/// nothing it cannot show).
#[test]
fn a_term_difference_under_one_contract_is_not_called_absorbed_by_contracts() {
    let cand = Synth::candidate(Inject::Term {
        step: 1,
        layer: 2,
        position: 3,
    });
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let text = rep.render_text(false);
    assert!(!text.contains("absorbed by both contracts"), "{text}");
    assert_eq!(rep.divergences[0].at.path, "moe.term.0", "{text}");
    // A one-ulp term difference R_BF16 erases, the same contract on both
    // sides: the combine matches, so it is absorbed the ordinary way (both
    // contracts would reproduce, but nothing differs at the combine).
    let cand = Synth::candidate(Inject::Nudge {
        step: 1,
        layer: 2,
        position: 3,
    });
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let text = rep.render_text(false);
    assert!(!text.contains("contracts"), "{text}");
    assert!(text.contains("absorbed by the combine, which matches"), "{text}");
}

/// A routed term that differs where its only consumer, the combine, matches
/// is absorbed there, whatever differs later (transformers grouped_mm vs
/// batched_mm: a layer-5 term at position 1 and an independent layer-7
/// divergence at position 0). Recomputed by the capture or not, the term is
/// classified the same way.
#[test]
fn a_term_whose_combine_matches_is_absorbed_at_its_consumer() {
    for recomputed in [false, true] {
        // In the prefill: the combine divergence sits at an earlier position
        // of a later layer, which the term cannot reach.
        let mut cand = Synth::candidate(Inject::Term {
            step: 0,
            layer: 2,
            position: 1,
        });
        cand.also.push(Inject::Combine {
            step: 0,
            layer: 3,
            position: 0,
            contract: b_class(5),
        });
        if recomputed {
            cand.provenance
                .notes
                .push(("moeconf.recomputed".into(), "moe.term.*".into()));
        }
        let (_d, r, c) = pair(&Synth::reference(), &cand);
        let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
        let text = rep.render_text(false);
        let got: Vec<_> = rep
            .divergences
            .iter()
            .map(|d| {
                (
                    d.at.path.as_str(),
                    d.at.layer,
                    d.kind.map(|k| k.name()),
                    d.absorbed_at,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "moe.term.0",
                    Some(2),
                    Some("absorbed"),
                    Some(Absorption::Consumer)
                ),
                ("moe.combine", Some(3), Some("propagating"), None)
            ],
            "{text}"
        );
        assert!(
            text.contains("absorbed: its only consumer, step 0 pos 1 (prefill) layer 2 moe.combine, matches"),
            "{text}"
        );
        assert!(
            rep.summary.contains("absorbed by the combine, which matches"),
            "{}",
            rep.summary
        );
    }
}

/// A later step fed the same tokens sees a divergence only through the
/// persistent state it changed: its own layer and later ones. A divergence
/// in an earlier layer of a later step is independent of it and is listed;
/// once a differing token is fed, nothing later is separated.
#[test]
fn a_divergence_reaches_later_steps_only_from_its_own_layer_on_while_the_tokens_match() {
    let first = Inject::Combine {
        step: 0,
        layer: 2,
        position: 0,
        contract: b_class(5),
    };
    let later = Inject::Combine {
        step: 2,
        layer: 0,
        position: PROMPT + 1,
        contract: b_class(9),
    };
    let mut cand = Synth::candidate(first.clone());
    cand.also = vec![later.clone()];
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let text = rep.render_text(false);
    let got: Vec<_> = rep
        .divergences
        .iter()
        .map(|d| {
            (
                d.at.step,
                d.at.position,
                d.at.layer,
                d.at.path.as_str(),
                d.kind.map(|k| k.name()),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (0, 0, Some(2), "moe.combine", Some("propagating")),
            (2, PROMPT + 1, Some(0), "moe.combine", Some("propagating")),
        ],
        "{text}"
    );
    // The later one is decided by a checkpoint the first cannot reach: its own layer's.
    let cp = rep.divergences[1].checkpoint.as_ref().unwrap();
    assert_eq!((cp.step, cp.layer), (2, Some(0)), "{text}");
    assert_eq!(rep.rest, "propagates");

    // The same pair with a differing token fed at step 1: everything later can
    // follow from the first divergence, so the walk stops there.
    let mut cand = Synth::candidate(first);
    cand.also = vec![later];
    cand.token_step = Some(1);
    let (_d, r, c) = pair(&Synth::reference(), &cand);
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let paths: Vec<_> = rep.divergences.iter().map(|d| (d.at.step, d.at.layer)).collect();
    assert_eq!(paths, [(0, Some(2))], "{}", rep.render_text(false));
    assert_eq!(rep.rest, "propagates");
}
