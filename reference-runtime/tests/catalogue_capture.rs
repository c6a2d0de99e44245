//! The component catalogue against what the runtime really captures: every
//! record is a catalogue component of its level, on a layer kind that has
//! it, in the catalogue's execution order; every component that exists on a
//! layer kind is captured there; and every input the catalogue lists for an
//! operator (L3/L4) is a record the runtime captures at the place the input
//! names. So "its output differs while its inputs match" compares records
//! that exist, by construction.

mod common;

use std::collections::{BTreeSet, HashMap, HashSet};

use common::{fixture_model, prompt, F32Combine};
use moeconf_contract::{MoeCombine, NativeCombine};
use moeconf_fingerprint::catalogue::{ExecGroup, InputSource, Presence};
use moeconf_fingerprint::{Component, Level};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::Model;
use moeconf_reference_runtime::precision::Precision;

/// 21 prompt tokens + 20 decode steps (`--capture all`): the window wraps,
/// CSA and HCA windows close in prefill and in decode, the indexer selection
/// is sparse (T > K_I).
fn run(precision: Precision, combine: &dyn MoeCombine) -> MemorySink {
    run_on(fixture_model(), precision, combine)
}

/// [`run`] on `model`.
fn run_on(model: &Model, precision: Precision, combine: &dyn MoeCombine) -> MemorySink {
    let mut sink = MemorySink::all();
    let opts = GenerateOptions {
        max_new_tokens: 20,
        precision,
        combine,
        detokenizer: None,
        allow_non_finite: false,
    };
    model
        .generate(&prompt(3, 21), &opts, &mut sink)
        .expect("fixture run");
    sink
}

/// (step, position, layer, component) of a record.
type Key = (u32, u32, Option<u32>, Component);

/// `quantizes`: the profile records the quantization sites (catalogue
/// presence `Quantized`/`QuantizedOnEmit`); otherwise none may appear.
fn check(sink: &MemorySink, quantizes: bool) {
    check_on(fixture_model(), sink, quantizes)
}

/// [`check`] of a run of `model`.
fn check_on(model: &Model, sink: &MemorySink, quantizes: bool) {
    let cfg = model.config();
    let kinds = |layer: u32| cfg.catalogue_kinds(layer as usize).expect("layer of the model");
    let mut present: HashSet<Key> = HashSet::new();
    let mut state: HashSet<(u32, u32, Component)> = HashSet::new();
    let mut step_inputs: HashSet<u32> = HashSet::new();
    let mut positions: HashMap<u32, BTreeSet<u32>> = HashMap::new();
    for r in &sink.records {
        let c = &r.coord;
        let (comp, _) =
            Component::parse(&c.path).unwrap_or_else(|| panic!("{} is not in the catalogue", c.path));
        assert_eq!(r.level, comp.level(), "{}", c.path);
        if let Some(l) = c.layer {
            let (a, f) = kinds(l);
            assert!(
                comp.spec().layers.contains(a, f),
                "{} captured on layer {l} ({a:?}, {f:?})",
                c.path
            );
        }
        present.insert((c.step, c.position, c.layer, comp));
        match comp.exec_group() {
            ExecGroup::State => {
                state.insert((c.step, c.layer.expect("state is per layer"), comp));
            }
            ExecGroup::StepInput if comp == Component::TokenInput => {
                step_inputs.insert(c.step);
            }
            ExecGroup::Layer => {
                positions.entry(c.step).or_default().insert(c.position);
            }
            _ => {}
        }
    }

    // Execution order: within one (step, layer, position) the records follow the catalogue ranks.
    for w in sink.records.windows(2) {
        let (a, b) = (&w[0].coord, &w[1].coord);
        if a.step == b.step && a.layer.is_some() && a.layer == b.layer && a.position == b.position {
            let ra = moeconf_fingerprint::catalogue::exec_rank(&a.path);
            let rb = moeconf_fingerprint::catalogue::exec_rank(&b.path);
            let (ca, cb) = (
                Component::parse(&a.path).unwrap().0,
                Component::parse(&b.path).unwrap().0,
            );
            if ca.exec_group() == ExecGroup::Layer && cb.exec_group() == ExecGroup::Layer {
                assert!(ra < rb, "{} before {} at {a}", a.path, b.path);
            }
        }
    }

    let mut on_emit_inputs_seen: HashMap<Component, usize> = HashMap::new();
    let mut checked_inputs = 0usize;
    for (&step, pos) in &positions {
        for &t in pos {
            assert!(
                present.contains(&(step, t, None, Component::EmbedOutput)),
                "embed.output step {step} pos {t}"
            );
            for layer in 0..cfg.num_layers() as u32 {
                let (a, f) = kinds(layer);
                for &comp in Component::ALL
                    .iter()
                    .filter(|c| c.exec_group() == ExecGroup::Layer)
                {
                    let spec = comp.spec();
                    let here = present.contains(&(step, t, Some(layer), comp));
                    if !spec.layers.contains(a, f) {
                        continue;
                    }
                    if spec.presence == Presence::Always {
                        assert!(here, "{comp} missing at step {step} pos {t} layer {layer}");
                    }
                    if spec.presence == Presence::Quantized && quantizes {
                        // Every GEMM of the quantized fixture is quantized: each site exists.
                        assert!(here, "site {comp} missing at step {step} pos {t} layer {layer}");
                    }
                    if spec.presence.is_quantized() && !quantizes {
                        assert!(
                            !here,
                            "{comp} is a quantization site, yet emitted by a profile without any at step {step} pos {t} layer {layer}"
                        );
                    }
                    if spec.presence == Presence::CaptureOnly {
                        assert!(
                            !here,
                            "{comp} is capture-only, yet emitted at step {step} pos {t} layer {layer}"
                        );
                    }
                    if !here {
                        continue;
                    }
                    for input in spec.inputs {
                        checked_inputs += 1;
                        match input.source {
                            InputSource::SameLayer => {
                                let ic = input.component;
                                if !ic.spec().layers.contains(a, f) {
                                    continue;
                                }
                                let found = present.contains(&(step, t, Some(layer), ic));
                                match ic.spec().presence {
                                    Presence::Always => assert!(
                                        found,
                                        "{comp} reads {ic}, not captured at step {step} pos {t} layer {layer}"
                                    ),
                                    Presence::OnEmit | Presence::QuantizedOnEmit => {
                                        *on_emit_inputs_seen.entry(ic).or_default() += found as usize
                                    }
                                    Presence::Quantized => assert!(
                                        found || !quantizes,
                                        "{comp} reads the site {ic}, not captured at step {step} pos {t} layer {layer}"
                                    ),
                                    Presence::CaptureOnly => assert!(
                                        !found,
                                        "{ic} is capture-only, yet the runtime emitted it at step {step} pos {t} layer {layer}"
                                    ),
                                }
                            }
                            InputSource::LayerInput => {
                                let key = match layer.checked_sub(1) {
                                    Some(prev) => (step, t, Some(prev), Component::LayerPostFfnMhc),
                                    None => (step, t, None, Component::EmbedOutput),
                                };
                                assert!(present.contains(&key), "{comp}: layer input {key:?} not captured");
                            }
                            InputSource::CarriedState => {
                                if let Some(prev) = step.checked_sub(1) {
                                    for &sc in Component::ALL.iter().filter(|c| c.level() == Level::L2) {
                                        if sc.spec().layers.contains(a, f) {
                                            assert!(
                                                state.contains(&(prev, layer, sc)),
                                                "{comp}: carried {sc} of layer {layer} at step {prev} not captured"
                                            );
                                        }
                                    }
                                }
                            }
                            InputSource::StepInput => {
                                assert!(step_inputs.contains(&step), "{comp}: token.input of step {step}")
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(checked_inputs > 1000, "only {checked_inputs} inputs checked");
    // The run emits compressed entries on every compressor kind, so the
    // inputs that exist only where an entry is emitted were exercised too.
    for c in [Component::AttnCompressed, Component::AttnIndexerCompressed] {
        assert!(
            on_emit_inputs_seen.get(&c).copied().unwrap_or(0) > 0,
            "{c} never seen as an input"
        );
    }
    let hca_entry = sink.by_path(Component::AttnCompressed.path()).any(|r| {
        r.coord
            .layer
            .is_some_and(|l| kinds(l).0 == moeconf_fingerprint::catalogue::AttentionKind::Hca)
    });
    let tokens = positions
        .values()
        .flat_map(|p| p.iter())
        .max()
        .map_or(0, |&t| t as usize + 1);
    // (The quantized fixture's HCA rate, 128, is longer than the run.)
    assert!(
        hca_entry || tokens < cfg.hca_rate,
        "no HCA window closed: lengthen the run"
    );
    let sparse = sink
        .by_path(Component::AttnIndexerScores.path())
        .any(|r| r.shape[0] as usize > cfg.index_topk);
    assert!(sparse, "the indexer selection was never sparse: lengthen the run");
}

#[test]
fn catalogue_inputs_are_captured() {
    check(&run(Precision::Bf16, &NativeCombine), false);
    check(&run(Precision::F32, &F32Combine), false);
}

/// The official profile on the quantized fixture (every GEMM quantized): every
/// quantization site is captured wherever it exists, and read where the
/// catalogue says.
#[test]
fn catalogue_inputs_are_captured_in_the_official_profile() {
    let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("moeconf-fixtures");
    let dir =
        moeconf_fixtures::ensure_builtin_in(moeconf_fixtures::BUILTIN_TINY_V4_FP8, &root).expect("fixture");
    let model = Model::load(&dir).expect("load");
    let sink = run_on(&model, Precision::Official, &NativeCombine);
    check_on(&model, &sink, true);
    for site in moeconf_reference_runtime::official::SITES {
        assert!(
            sink.records.iter().any(|r| site.matches(&r.coord.path)),
            "{site} never captured"
        );
    }
}

#[test]
fn read_views_are_what_attention_reads() {
    // Without a fault the window read is exactly the stored window plus the
    // new kv, and an HCA layer's compressed read is every stored entry.
    let sink = run(Precision::Bf16, &NativeCombine);
    let d = fixture_model().config().head_dim;
    let w = fixture_model().config().sliding_window;
    let find = |path: &str, step: u32, pos: u32, layer: u32| {
        sink.records
            .iter()
            .find(|r| {
                r.coord.path == path
                    && r.coord.step == step
                    && r.coord.position == pos
                    && r.coord.layer == Some(layer)
            })
            .map(|r| r.f32s())
    };
    // Step 1 reads the state of the boundary after step 0 plus its own kv.
    let step1 = sink
        .by_path(Component::AttnWindowRead.path())
        .find(|r| r.coord.step == 1)
        .unwrap();
    let (pos, layer) = (step1.coord.position, step1.coord.layer.unwrap());
    let state = sink
        .records
        .iter()
        .find(|r| {
            r.coord.path == Component::StateWindowKv.path()
                && r.coord.step == 0
                && r.coord.layer == Some(layer)
        })
        .unwrap()
        .f32s();
    let kv = find(Component::AttnKv.path(), 1, pos, layer).unwrap();
    let mut expect = state.clone();
    expect.extend_from_slice(&kv);
    assert_eq!(step1.f32s(), expect);
    assert_eq!(step1.shape, vec![(state.len() / d + 1) as u64, d as u64]);
    assert!(step1.shape[0] as usize <= w);
}
