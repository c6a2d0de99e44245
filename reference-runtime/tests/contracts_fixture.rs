//! Aggregation contracts on the tiny-v4 fixture (whole runs of the model):
//! native == C(identity) bitwise over every captured record, and a
//! single-layer fork leaves everything before its event untouched while
//! changing the forked MoE output.

use std::sync::OnceLock;

use moeconf_contract::{
    AggregationContract, ForkCombine, ForkPoint, MoeCombine, NativeCombine, Order, Schedule, ScheduledCombine,
};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::Model;
use moeconf_reference_runtime::precision::Precision;

fn fixture_model() -> &'static Model {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        let d = DIR.get_or_init(|| {
            let d = tempfile::tempdir().expect("tempdir");
            moeconf_fixtures::checkpoint::write_tiny_v4(d.path()).expect("write fixture");
            d
        });
        Model::load(d.path()).expect("load fixture")
    })
}

/// 13 prompt ids and 6 generated tokens, every level captured with payloads.
fn run(combine: &dyn MoeCombine) -> (Vec<u32>, MemorySink) {
    let prompt: Vec<u32> = (0..13u32).map(|i| (i * 37 + 205) % 1024).collect();
    let mut sink = MemorySink::all();
    let opts = GenerateOptions {
        max_new_tokens: 6,
        precision: Precision::Bf16,
        combine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let g = fixture_model()
        .generate(&prompt, &opts, &mut sink)
        .expect("generate");
    (g.tokens, sink)
}

fn assert_same_records(a: &MemorySink, b: &MemorySink, what: &str) {
    assert_eq!(a.records.len(), b.records.len(), "{what}: record count");
    for (i, (x, y)) in a.records.iter().zip(&b.records).enumerate() {
        assert_eq!(x.coord, y.coord, "{what}: record {i} coordinate");
        assert!(x.bytes == y.bytes, "{what}: record {i} ({:?}) differs", x.coord);
    }
}

#[test]
fn native_equals_c_identity_on_the_fixture() {
    let (tokens, native) = run(&NativeCombine);
    assert!(
        native.records.iter().any(|r| r.coord.path == "moe.combine"),
        "the MoE output is captured"
    );
    let c = AggregationContract::parse("c").unwrap();
    let (t, s) = run(&c);
    assert_eq!(t, tokens);
    assert_same_records(&native, &s, "c");
    let scheduled = ScheduledCombine::new(AggregationContract::native(), Schedule::Identity, 0);
    let (t, s) = run(&scheduled);
    assert_eq!(t, tokens);
    assert_same_records(&native, &s, "native under the identity schedule");
}

#[test]
fn single_layer_fork_changes_only_from_its_event_on() {
    let (_, native) = run(&NativeCombine);
    // A in the reversed order at layer 5, first decode step: differs from native.
    let point = ForkPoint::first_decode(5);
    let fork = ForkCombine::new(
        point,
        AggregationContract::a().with_order(Order::PermutationIndex(719)),
    );
    let (_, forked) = run(&fork);
    assert_eq!(native.records.len(), forked.records.len());
    let mut forked_output_differs = false;
    for (x, y) in native.records.iter().zip(&forked.records) {
        assert_eq!(x.coord, y.coord);
        let before = x.coord.step < point.step
            || (x.coord.step == point.step && x.coord.layer.is_some_and(|l| l < point.layer));
        if before {
            assert!(x.bytes == y.bytes, "record {:?} before the fork changed", x.coord);
        }
        if x.coord.step == point.step && x.coord.layer == Some(point.layer) && x.coord.path == "moe.combine" {
            forked_output_differs = x.bytes != y.bytes;
        }
    }
    assert!(
        forked_output_differs,
        "the forked combine output differs from native"
    );
}
