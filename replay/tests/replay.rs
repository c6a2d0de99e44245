//! Layer replay and teacher forcing on the built-in tiny model: faulted,
//! contract and forked candidates written by the runner (5 tokens each).

use std::path::{Path, PathBuf};

use moeconf_fingerprint::{Algorithm, CanonPolicy, Half};
use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
use moeconf_reference_runtime::precision::Precision;
use moeconf_replay::{replay_layers, teacher_force, LayerOptions, Part, Status, TeacherOptions, UnitId};
use moeconf_runner::{
    load_model, prepare_run, run_prepared_with_faults, CombineChoice, LoadedModel, RunSpec,
};
use moeconf_schema::{CaptureSpec, Trace};

const PROMPT: &str = "why the sheep";
const TOKENS: u32 = 5;

fn write(
    m: &LoadedModel,
    out: &Path,
    choice: &CombineChoice,
    faults: Option<&FaultPlan>,
    capture: CaptureSpec,
) {
    let spec = RunSpec {
        prompt: PROMPT,
        max_new_tokens: TOKENS,
        precision: Precision::Bf16,
        combine: choice,
        capture,
        algorithm: Algorithm::Blake3,
        canon: CanonPolicy::default(),
        allow_non_finite: false,
        prefill_chunk: None,
        batch_with: &[],
        progress: false,
    };
    let prepared = prepare_run(m, &spec).unwrap();
    run_prepared_with_faults(m, &spec, prepared, faults, out).unwrap();
}

fn trace(
    m: &LoadedModel,
    dir: &Path,
    name: &str,
    choice: &CombineChoice,
    faults: Option<&FaultPlan>,
) -> PathBuf {
    let p = dir.join(name);
    write(m, &p, choice, faults, CaptureSpec::REPLAY);
    p
}

fn origins(r: &moeconf_replay::LayerReport) -> Vec<UnitId> {
    r.origins().map(|u| u.unit).collect()
}

fn unit(step: u32, layer: u32, part: Part) -> UnitId {
    UnitId {
        step,
        layer: Some(layer),
        part,
    }
}

#[test]
fn a_native_run_reproduces_everywhere() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = trace(&m, dir.path(), "native.bin", &CombineChoice::default(), None);
    let r = replay_layers(&Trace::open(&p).unwrap(), &m, &LayerOptions::default()).unwrap();
    let layers = m.model.config().num_layers();
    // Per step: embedding, two halves per layer, head.
    assert_eq!(r.units.len(), TOKENS as usize * (2 * layers + 2));
    assert!(
        r.units.iter().all(|u| u.status == Status::Reproduced),
        "{}",
        r.render_text(false)
    );
    assert!(r
        .units
        .iter()
        .all(|u| u.compared > 0 && u.first_difference.is_none()));
    assert_eq!(r.exit_code(false), 0);
}

/// The vllm-cpu profile's kernels depend on how many tokens a forward holds
/// (AMX above 4 rows, the mHC's K block): replay computes each position
/// with its forward's size, the whole prompt or its prefill chunk (before:
/// a run replayed on its own profile showed origins at the prefill's mHC).
#[test]
fn a_vllm_cpu_run_reproduces_with_its_forward_sizes() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let prompt = "why the sheep went home late";
    for chunk in [None, Some(3)] {
        let p = dir.path().join(format!("vllm-{chunk:?}.bin"));
        let choice = CombineChoice {
            contract: moeconf_runner::default_contract(Precision::VllmCpu)
                .parse()
                .unwrap(),
            ..CombineChoice::default()
        };
        let spec = RunSpec {
            prompt,
            max_new_tokens: 2,
            precision: Precision::VllmCpu,
            combine: &choice,
            capture: CaptureSpec::REPLAY,
            algorithm: Algorithm::Blake3,
            canon: CanonPolicy::default(),
            allow_non_finite: false,
            prefill_chunk: chunk,
            batch_with: &[],
            progress: false,
        };
        assert!(
            m.tokenizer.encode(prompt).unwrap().len() > 4,
            "the prompt must reach the AMX path"
        );
        let prepared = prepare_run(&m, &spec).unwrap();
        run_prepared_with_faults(&m, &spec, prepared, None, &p).unwrap();
        let r = replay_layers(&Trace::open(&p).unwrap(), &m, &LayerOptions::default()).unwrap();
        assert!(
            r.units.iter().all(|u| u.status == Status::Reproduced),
            "chunk {chunk:?}: {}",
            r.render_text(false)
        );
    }
}

#[test]
fn two_faults_at_two_places_are_exactly_the_two_origins() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::new(vec![
        Fault::at(1, 2, FaultKind::AttentionOutputTruncate),
        Fault::at(3, 5, FaultKind::FfnNormEpsilon(0.5)),
    ]);
    let p = trace(
        &m,
        dir.path(),
        "faults.bin",
        &CombineChoice::default(),
        Some(&plan),
    );
    let r = replay_layers(&Trace::open(&p).unwrap(), &m, &LayerOptions::default()).unwrap();
    assert_eq!(
        origins(&r),
        vec![unit(1, 2, Part::Attention), unit(3, 5, Part::Ffn)],
        "{}",
        r.render_text(false)
    );
    let first: Vec<String> = r
        .origins()
        .map(|u| u.first_difference.as_ref().unwrap().record.clone())
        .collect();
    assert_eq!(first, vec!["attn.output", "ffn.norm"]);
    assert_eq!(r.count(Status::NotReplayable), 0);
    assert_eq!(r.exit_code(false), 1);
    // Later units are reproduced and marked downstream of the nearest origin.
    let after = r
        .units
        .iter()
        .find(|u| u.unit == unit(2, 0, Part::Attention))
        .unwrap();
    assert_eq!(after.status, Status::Reproduced);
    assert_eq!(after.downstream_of, Some(unit(1, 2, Part::Attention)));
    let before = r.units.iter().find(|u| u.unit == unit(1, 1, Part::Ffn)).unwrap();
    assert_eq!(before.downstream_of, None);
}

#[test]
fn a_contract_c_run_has_no_origin() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let choice = CombineChoice {
        contract: "c".parse().unwrap(),
        ..CombineChoice::default()
    };
    let p = trace(&m, dir.path(), "c.bin", &choice, None);
    let r = replay_layers(&Trace::open(&p).unwrap(), &m, &LayerOptions::default()).unwrap();
    assert_eq!(r.contract, "c");
    assert_eq!(r.count(Status::Origin), 0, "{}", r.render_text(false));
    assert_eq!(r.exit_code(false), 0);
}

#[test]
fn a_b_fork_is_one_origin_and_the_rest_propagates() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let choice = CombineChoice {
        fork_layer: Some(5),
        fork_step: Some(1),
        fork_contract: Some("b".parse().unwrap()),
        ..CombineChoice::default()
    };
    let p = trace(&m, dir.path(), "fork.bin", &choice, None);
    let r = replay_layers(&Trace::open(&p).unwrap(), &m, &LayerOptions::default()).unwrap();
    assert!(r.fork_ignored.is_some());
    assert_eq!(
        origins(&r),
        vec![unit(1, 5, Part::Ffn)],
        "{}",
        r.render_text(false)
    );
    let o = r.origins().next().unwrap();
    assert_eq!(o.first_difference.as_ref().unwrap().record, "moe.combine");
    // The fork's combine is reproduced under B from the (matching) terms.
    assert_eq!(o.reproduced_under.as_deref(), Some("b"));
    // Everything after the fork in execution order is reproduced on the
    // candidate's inputs and reported as propagation.
    let fork_key = unit(1, 5, Part::Ffn).exec_key();
    for u in r.units.iter().filter(|u| u.unit.exec_key() > fork_key) {
        assert_eq!(u.status, Status::Reproduced, "{}", u.unit);
        assert_eq!(u.downstream_of, Some(unit(1, 5, Part::Ffn)), "{}", u.unit);
    }
    assert!(r.propagated() > 0);
}

#[test]
fn replay_is_the_same_on_one_and_two_threads() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::new(vec![Fault::at(
        2,
        3,
        FaultKind::MhcPostMixBf16Accumulator(Half::Ffn),
    )]);
    let p = trace(&m, dir.path(), "t.bin", &CombineChoice::default(), Some(&plan));
    let t = Trace::open(&p).unwrap();
    let json = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            replay_layers(&t, &m, &LayerOptions::default())
                .unwrap()
                .to_json(false)
        })
    };
    let (one, two) = (json(1), json(2));
    assert_eq!(one["summary"]["origins"], 1, "{one:#}");
    assert_eq!(
        serde_json::to_string(&one).unwrap(),
        serde_json::to_string(&two).unwrap()
    );
}

#[test]
fn a_trace_without_payloads_says_what_is_missing() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("fp.bin");
    write(
        &m,
        &p,
        &CombineChoice::default(),
        None,
        CaptureSpec::parse("default").unwrap(),
    );
    let r = replay_layers(&Trace::open(&p).unwrap(), &m, &LayerOptions::default()).unwrap();
    // default keeps L3 payloads but not L2: every attention half after the
    // prefill lacks its carried state; nothing is called reproduced there.
    assert_eq!(r.count(Status::Origin), 0);
    assert!(r.count(Status::NotReplayable) > 0);
    assert_eq!(r.exit_code(false), 2);
    assert_eq!(r.exit_code(true), 0);
    let missing = r.missing_summary();
    let window = missing
        .iter()
        .find(|(rec, payload, _)| rec == "state.window_kv" && *payload)
        .unwrap_or_else(|| panic!("{missing:?}"));
    assert_eq!(window.2, vec![0, 1, 2, 3]);
    let a = r
        .units
        .iter()
        .find(|u| u.unit == unit(2, 0, Part::Attention))
        .unwrap();
    assert_eq!(a.status, Status::NotReplayable);
    assert!(a.missing.iter().all(|x| x.step == 1 && x.layer == Some(0)));
}

#[test]
fn teacher_forcing_matches_a_native_run_and_measures_a_fork() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let native = trace(&m, dir.path(), "n.bin", &CombineChoice::default(), None);
    let r = teacher_force(&Trace::open(&native).unwrap(), &m, TeacherOptions::default()).unwrap();
    assert_eq!(r.steps.len(), TOKENS as usize);
    assert!(r
        .steps
        .iter()
        .all(|s| s.identical && s.kl == Some(0.0) && s.topk_overlap == 8));
    assert_eq!(r.exit_code(false), 0);
    let plan = FaultPlan::new(vec![Fault::at(1, 2, FaultKind::AttentionOutputTruncate)]);
    let f = trace(&m, dir.path(), "f.bin", &CombineChoice::default(), Some(&plan));
    let l3 = TeacherOptions {
        l3: true,
        ..TeacherOptions::default()
    };
    let r = teacher_force(&Trace::open(&f).unwrap(), &m, l3).unwrap();
    assert!(r.steps[0].identical, "the prefill is unfaulted");
    // L3: at step 1 the layers before the faulted layer 2 are identical, layer 2 is not.
    let same: Vec<bool> = r.steps[1].layers.iter().map(|l| l.identical).collect();
    assert_eq!(&same[..3], &[true, true, false]);
    assert!(r.steps[0]
        .layers
        .iter()
        .all(|l| l.identical && l.max_abs_diff == Some(0.0)));
    assert!(r.steps[1].layers[2].max_abs_diff.unwrap() > 0.0);
    assert!(!r.steps[1].identical);
    assert!(r.steps[1].kl.unwrap() > 0.0);
    assert_eq!(r.exit_code(false), 1);
}

#[test]
fn an_absorbed_fault_is_an_origin_that_nothing_inherits() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Routed terms rounded to BF16 where they are computed: the native
    // combine rounds every term the same way, so moe.term.J differs but the
    // FFN half's output (moe.combine, layer.post_ffn_mhc) is bitwise the same.
    let plan = FaultPlan::new(vec![Fault::at(3, 5, FaultKind::RoutedTermRounded)]);
    let p = trace(
        &m,
        dir.path(),
        "absorbed.bin",
        &CombineChoice::default(),
        Some(&plan),
    );
    let r = replay_layers(&Trace::open(&p).unwrap(), &m, &LayerOptions::default()).unwrap();
    assert_eq!(
        origins(&r),
        vec![unit(3, 5, Part::Ffn)],
        "{}",
        r.render_text(false)
    );
    let o = r.origins().next().unwrap();
    assert!(o.absorbed, "{}", r.render_text(false));
    assert!(o
        .first_difference
        .as_ref()
        .unwrap()
        .record
        .starts_with("moe.term."));
    assert_eq!(o.max_abs_diff, None);
    assert_eq!(r.propagated(), 0);
    assert_eq!(r.exit_code(false), 1);
}

#[test]
fn faults_in_carried_state_are_origins_where_the_state_is_written() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    // "why the sheep" has 5 prompt tokens and CSA windows of 4: step 3
    // closes a window, step 1 does not. Layers 4 and 6 are CSA layers.
    let plan = FaultPlan::new(vec![
        Fault::at(1, 4, FaultKind::IndexerBufferLowPrecision { mantissa_bits: 3 }),
        Fault::at(3, 6, FaultKind::CompressorOverlapGateWithoutBias),
    ]);
    let p = trace(
        &m,
        dir.path(),
        "state.bin",
        &CombineChoice::default(),
        Some(&plan),
    );
    let r = replay_layers(&Trace::open(&p).unwrap(), &m, &LayerOptions::default()).unwrap();
    assert_eq!(
        origins(&r),
        vec![unit(1, 4, Part::Attention), unit(3, 6, Part::Attention)],
        "{}",
        r.render_text(false)
    );
    // Only the state written at the boundary differs: the state record is
    // the first difference and an output; the step that later reads the
    // buffer (step 3, layer 4) is reproduced on the candidate's state.
    let firsts: Vec<(String, bool)> = r
        .origins()
        .map(|u| {
            let d = u.first_difference.as_ref().unwrap();
            (d.record.clone(), d.output)
        })
        .collect();
    assert_eq!(
        firsts,
        vec![
            ("state.indexer.buffer_kv".to_string(), true),
            ("state.compressor.overlap_gate".to_string(), true)
        ]
    );
    let read = r
        .units
        .iter()
        .find(|u| u.unit == unit(3, 4, Part::Attention))
        .unwrap();
    assert_eq!(read.status, Status::Reproduced);
    assert_eq!(read.downstream_of, Some(unit(1, 4, Part::Attention)));
}

#[test]
fn an_f32_run_reproduces_in_the_f32_profile() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("f32.bin");
    let choice = CombineChoice::default();
    let spec = RunSpec {
        prompt: PROMPT,
        max_new_tokens: 3,
        precision: Precision::F32,
        combine: &choice,
        capture: CaptureSpec::REPLAY,
        algorithm: Algorithm::Sha256,
        canon: CanonPolicy::default(),
        allow_non_finite: false,
        prefill_chunk: None,
        batch_with: &[],
        progress: false,
    };
    let prepared = prepare_run(&m, &spec).unwrap();
    run_prepared_with_faults(&m, &spec, prepared, None, &p).unwrap();
    let t = Trace::open(&p).unwrap();
    let r = replay_layers(&t, &m, &LayerOptions::default()).unwrap();
    assert_eq!(r.precision, "f32");
    assert_eq!(
        r.count(Status::Reproduced),
        r.units.len(),
        "{}",
        r.render_text(false)
    );
    // Replayed in the other profile, every half-layer and head computes
    // differently; the embedding (a row of the BF16 table) is the same.
    let bf16 = LayerOptions {
        precision: Some(Precision::Bf16),
        ..LayerOptions::default()
    };
    let r = replay_layers(&t, &m, &bf16).unwrap();
    for u in &r.units {
        let want = if u.unit.part == Part::Embed {
            Status::Reproduced
        } else {
            Status::Origin
        };
        assert_eq!(u.status, want, "{}", u.unit);
    }
}

#[test]
fn measured_propagation_tells_carried_differences_from_reachability() {
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let choice = CombineChoice {
        fork_layer: Some(5),
        fork_step: Some(1),
        fork_contract: Some("b".parse().unwrap()),
        ..CombineChoice::default()
    };
    let p = trace(&m, dir.path(), "fork.bin", &choice, None);
    let t = Trace::open(&p).unwrap();
    let opts = LayerOptions {
        measure_propagation: true,
        ..LayerOptions::default()
    };
    let r = replay_layers(&t, &m, &opts).unwrap();
    assert!(r.measured_propagation);
    assert_eq!(origins(&r), vec![unit(1, 5, Part::Ffn)]);
    let get = |u: UnitId| r.units.iter().find(|x| x.unit == u).unwrap();
    // Before the fork every input is the clean reference's.
    assert_eq!(get(unit(1, 5, Part::Attention)).inputs_differ, Some(false));
    assert_eq!(get(unit(1, 5, Part::Ffn)).inputs_differ, Some(false));
    // The next half reads the fork's output: measured propagation.
    let next = get(unit(1, 6, Part::Attention));
    assert_eq!(next.inputs_differ, Some(true));
    assert!(next.propagates());
    // The tokens are teacher-forced, so layer 0 at the next step reads the
    // clean embedding; its state was written before the fork: clean inputs,
    // although it is downstream of the fork by data flow.
    let l0 = get(unit(2, 0, Part::Attention));
    assert_eq!(l0.downstream_of, Some(unit(1, 5, Part::Ffn)));
    assert_eq!(l0.inputs_differ, Some(false));
    assert!(!l0.propagates());
    // Layer 5's attention at step 2 reads the state its step-1 attention
    // wrote before the fork (clean) and layer 4's output (clean): also clean.
    assert_eq!(get(unit(2, 5, Part::Attention)).inputs_differ, Some(false));
    // Layer 6's attention at step 2 reads state written from a forked input.
    assert_eq!(get(unit(2, 6, Part::Attention)).inputs_differ, Some(true));
    assert!(r.propagated() < r.units.iter().filter(|u| u.downstream_of.is_some()).count());
}

#[test]
fn a_faulted_run_that_allows_non_finite_values_still_writes_a_valid_binding() {
    // The fault plan is recorded in the binding's extra next to
    // `non_finite = allowed`, sorted by key as the format requires.
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("nf.bin");
    let choice = CombineChoice::default();
    let spec = RunSpec {
        prompt: PROMPT,
        max_new_tokens: 2,
        precision: Precision::Bf16,
        combine: &choice,
        capture: CaptureSpec::REPLAY,
        algorithm: Algorithm::Blake3,
        canon: CanonPolicy::default(),
        allow_non_finite: true,
        prefill_chunk: None,
        batch_with: &[],
        progress: false,
    };
    let plan = FaultPlan::new(vec![Fault::at(1, 0, FaultKind::AttentionOutputTruncate)]);
    let prepared = prepare_run(&m, &spec).unwrap();
    run_prepared_with_faults(&m, &spec, prepared, Some(&plan), &p).unwrap();
    let t = Trace::open(&p).unwrap();
    let keys: Vec<&str> = t.binding().extra.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, vec!["faults", "non_finite"]);
    let r = replay_layers(&t, &m, &LayerOptions::default()).unwrap();
    assert_eq!(origins(&r), vec![unit(1, 0, Part::Attention)]);
}

#[test]
fn the_contract_override_replaces_the_bindings_contract() {
    // A run under B in ascending expert id: replayed under its own binding it
    // reproduces everywhere; under `--contract c` every FFN half whose combine
    // the two contracts round differently is an origin at `moe.combine`, and
    // no attention half or head is (their inputs are the candidate's own).
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let choice = CombineChoice {
        contract: "b+order=asc-id".parse().unwrap(),
        ..CombineChoice::default()
    };
    let p = trace(&m, dir.path(), "b-asc.bin", &choice, None);
    let t = Trace::open(&p).unwrap();
    let own = replay_layers(&t, &m, &LayerOptions::default()).unwrap();
    assert_eq!(own.contract, "b+order=asc-id");
    assert_eq!(own.count(Status::Origin), 0, "{}", own.render_text(false));
    let under_c = LayerOptions {
        contract: Some("c".into()),
        ..LayerOptions::default()
    };
    let r = replay_layers(&t, &m, &under_c).unwrap();
    assert_eq!(r.contract, "c");
    assert!(r.count(Status::Origin) > 0, "{}", r.render_text(false));
    for u in r.origins() {
        assert_eq!(u.unit.part, Part::Ffn, "{}", u.unit);
        let d = u.first_difference.as_ref().unwrap();
        assert_eq!(d.record, "moe.combine", "{}", u.unit);
    }
    // The same under its own notation given explicitly; an unknown one is an error.
    let same = LayerOptions {
        contract: Some("b+order=asc-id".into()),
        ..LayerOptions::default()
    };
    assert_eq!(replay_layers(&t, &m, &same).unwrap().count(Status::Origin), 0);
    let bad = LayerOptions {
        contract: Some("hf-native".into()),
        ..LayerOptions::default()
    };
    let Err(e) = replay_layers(&t, &m, &bad) else {
        panic!("an unknown contract is refused")
    };
    assert!(e.to_string().contains("cannot be run"), "{e}");
}

#[test]
fn streaming_the_candidate_changes_no_report() {
    // Replay reads the candidate group by group and drops what no later
    // unit reads; the former whole-index lookup must give the same report,
    // byte for byte, on a multi-step run with origins, propagation and
    // (measured) carried state, on one thread and on two.
    let m = load_model("builtin:tiny-v4").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::new(vec![
        Fault::at(1, 2, FaultKind::AttentionOutputTruncate),
        Fault::at(3, 5, FaultKind::FfnNormEpsilon(0.5)),
    ]);
    let p = trace(&m, dir.path(), "t.bin", &CombineChoice::default(), Some(&plan));
    for measure_propagation in [false, true] {
        let opts = LayerOptions {
            measure_propagation,
            ..LayerOptions::default()
        };
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let (streamed, whole) = pool.install(|| {
                // A fresh trace each: nothing the other path read is in memory.
                let a = replay_layers(&Trace::open(&p).unwrap(), &m, &opts).unwrap();
                let b =
                    moeconf_replay::replay_layers_whole_index(&Trace::open(&p).unwrap(), &m, &opts).unwrap();
                (a, b)
            });
            assert_eq!(
                streamed.units.len(),
                TOKENS as usize * (2 * m.model.config().num_layers() + 2)
            );
            assert_eq!(
                streamed.count(Status::Origin),
                2,
                "{}",
                streamed.render_text(false)
            );
            assert_eq!(
                serde_json::to_string(&streamed.to_json(false)).unwrap(),
                serde_json::to_string(&whole.to_json(false)).unwrap()
            );
            assert_eq!(streamed.render_text(false), whole.render_text(false));
        }
    }
    // At most a few layers' groups are held at once, not the whole trace.
    let t = Trace::open(&p).unwrap();
    let (_, peak) = moeconf_replay::replay_layers_held(&t, &m, &LayerOptions::default()).unwrap();
    let total = t.record_count() as usize;
    assert!(
        peak > 0 && peak * 2 < total,
        "held {peak} of {total} records at once"
    );
    // Teacher forcing reads the same candidate streamed.
    let t = Trace::open(&p).unwrap();
    let tf = teacher_force(
        &t,
        &m,
        TeacherOptions {
            l3: true,
            ..TeacherOptions::default()
        },
    )
    .unwrap();
    assert_eq!(tf.steps.len(), TOKENS as usize);
}
