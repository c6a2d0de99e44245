//! Trace-freeze-fork: a continuation from a snapshot equals a full replay of
//! the same branch; sweeps do not depend on the thread count; raw B
//! permutations of one structural class give bitwise identical MoE outputs.
//!
//! The full 720 A + 360 B sweep with 8-token continuations is `#[ignore]`d:
//! `cargo test --release -p moeconf-reference-runtime --test fork -- --ignored --nocapture`.

mod common;

use std::collections::HashMap;

use common::{digests, fixture_model, prompt};
use moeconf_contract::{
    b_class_of, permutation_from_index, AggregationContract, ForkCombine, ForkPoint, NativeCombine, Order,
};
use moeconf_fingerprint::{record_digest, Algorithm, CanonPolicy};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::fork::{sweep, Branch, Scheme, Snapshot, SweepOptions, SweepReport};
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::StepOptions;
use moeconf_reference_runtime::precision::Precision;

const LAYER: u32 = 5;

fn opts(max_new_tokens: usize) -> SweepOptions<'static> {
    SweepOptions {
        point: ForkPoint::first_decode(LAYER),
        max_new_tokens,
        precision: Precision::Bf16,
        base: &NativeCombine,
        detokenizer: None,
        algorithm: Algorithm::Blake3,
        canon: CanonPolicy::default(),
    }
}

/// BLAKE3 chain of the record digests of `records` (as the sweep's DigestSink computes it).
fn chain(records: &[moeconf_reference_runtime::capture::Record]) -> String {
    let mut h = Algorithm::Blake3.hasher();
    for r in records {
        let d = record_digest(
            Algorithm::Blake3,
            CanonPolicy::default(),
            &r.coord,
            r.level,
            r.view(),
        )
        .unwrap();
        h.update(&d.0);
    }
    h.finalize().to_hex()
}

fn replay(fork: &ForkCombine, ids: &[u32], n: usize) -> (Vec<u32>, MemorySink) {
    let m = fixture_model();
    let mut sink = MemorySink::all();
    let g = m
        .generate(
            ids,
            &GenerateOptions {
                max_new_tokens: n,
                precision: Precision::Bf16,
                combine: fork,
                detokenizer: None,
                allow_non_finite: false,
            },
            &mut sink,
        )
        .unwrap();
    (g.tokens, sink)
}

#[test]
fn continuation_from_snapshot_equals_full_replay() {
    let m = fixture_model();
    let ids = prompt(3, 11);
    let n = 6;
    let native = StepOptions {
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let mut prefix = MemorySink::all();
    let snap = Snapshot::freeze(m, &ids, 1, &native, &mut prefix).unwrap();
    assert_eq!(snap.step(), 1);
    assert_eq!(snap.state().position, ids.len() as u32);
    assert!(snap.state().pending.is_some());

    let mut changed = 0;
    for class in [0u64, 7, 135, 359] {
        let fork = ForkCombine::new(
            ForkPoint::first_decode(LAYER),
            AggregationContract::b().with_order(Order::BClass(class)),
        );
        let (tokens, full) = replay(&fork, &ids, n);
        let sopts = StepOptions {
            precision: Precision::Bf16,
            combine: &fork,
            detokenizer: None,
            allow_non_finite: false,
        };
        // Continue twice: the snapshot must not be consumed or altered.
        for _ in 0..2 {
            let mut cont = MemorySink::all();
            let g = snap.continue_with(m, n, &sopts, &mut cont).unwrap();
            assert_eq!(g.tokens, tokens, "class {class}: tokens");
            let mut joined = prefix.records.clone();
            joined.extend(cont.records.iter().cloned());
            assert_eq!(joined.len(), full.records.len(), "class {class}: record count");
            assert!(
                joined == full.records,
                "class {class}: records differ from the replay"
            );
            let mut j = MemorySink::all();
            j.records = joined;
            assert_eq!(digests(&j), digests(&full), "class {class}: record digests");
            assert!(cont.records.iter().all(|r| r.coord.step >= 1));
        }
        // The fork is real: the fork event's MoE output differs from native for some class.
        let (_, nat) = replay(
            &ForkCombine::new(ForkPoint::first_decode(LAYER), AggregationContract::c()),
            &ids,
            n,
        );
        let at = |s: &MemorySink| {
            s.records
                .iter()
                .find(|r| r.coord.path == "moe.combine" && r.coord.step == 1 && r.coord.layer == Some(LAYER))
                .map(|r| r.bytes.clone())
        };
        if at(&full) != at(&nat) {
            changed += 1;
        }
    }
    assert!(changed > 0, "no tested B class changed the fork event");
}

#[test]
fn sweep_branch_digest_matches_replay_records() {
    let m = fixture_model();
    let ids = prompt(5, 9);
    let n = 4;
    let mut b = Scheme::enumerate("b", 6).unwrap();
    b.truncate(3);
    let report = sweep(m, &ids, std::slice::from_ref(&b), &opts(n), None).unwrap();
    for (branch, res) in b.branches.iter().zip(&report.branches[0]) {
        let fork = ForkCombine::new(ForkPoint::first_decode(LAYER), branch.contract.clone());
        let (tokens, full) = replay(&fork, &ids, n);
        assert_eq!(res.tokens, tokens);
        let after: Vec<_> = full
            .records
            .iter()
            .filter(|r| r.coord.step >= 1)
            .cloned()
            .collect();
        assert_eq!(res.records, after.len() as u64);
        assert_eq!(res.digest.to_hex(), chain(&after), "{}", branch.label);
        let moe = full
            .records
            .iter()
            .find(|r| r.coord.path == "moe.combine" && r.coord.step == 1 && r.coord.layer == Some(LAYER))
            .unwrap();
        let d = record_digest(
            Algorithm::Blake3,
            CanonPolicy::default(),
            &moe.coord,
            moe.level,
            moe.view(),
        )
        .unwrap();
        assert_eq!(res.fork_moe, d);
        assert_eq!(res.steps.len(), n - 1);
        assert_eq!(res.steps[0].input, vec![tokens[0]]);
        assert_eq!(
            res.steps.iter().map(|s| s.output).collect::<Vec<_>>(),
            tokens[1..].to_vec()
        );
        assert!(res
            .steps
            .iter()
            .all(|s| s.topk.len() == 9 && s.topk.iter().all(|t| t.len() == 6)));
    }
    // The reference branch is the native run.
    let (tokens, _) = replay(
        &ForkCombine::new(ForkPoint::first_decode(LAYER), AggregationContract::c()),
        &ids,
        n,
    );
    assert_eq!(report.reference.tokens, tokens);
}

fn pooled(threads: usize, schemes: &[Scheme], ids: &[u32], n: usize) -> SweepReport {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| sweep(fixture_model(), ids, schemes, &opts(n), None).unwrap())
}

#[test]
fn sweep_is_independent_of_thread_count() {
    let ids = prompt(1, 8);
    let mut a = Scheme::enumerate("a", 6).unwrap();
    a.truncate(40);
    let mut b = Scheme::enumerate("b", 6).unwrap();
    b.truncate(40);
    let schemes = [a, b];
    let one = pooled(1, &schemes, &ids, 3);
    let two = pooled(2, &schemes, &ids, 3);
    assert_eq!(one, two);
    assert_eq!(one.branches[0].len(), 40);
    assert_eq!(one.summaries[1].raw_permutations, 720);
    assert_eq!(one.summaries[1].structural_classes, 360);
    assert_eq!(one.summaries[0].structural_classes, 720);
    // Not degenerate: the first 40 A orders give more than one MoE output.
    assert!(one.summaries[0].distinct_moe_outputs > 1);
    let s = &one.summaries[0];
    assert_eq!(
        s.basin_rank_frequency.iter().map(|b| b.branches).sum::<usize>(),
        40
    );
    assert!(s
        .basin_rank_frequency
        .windows(2)
        .all(|w| w[0].branches >= w[1].branches));
}

#[test]
fn raw_b_permutations_of_one_class_give_identical_moe_outputs() {
    let ids = prompt(2, 10);
    let k = 6;
    let family = AggregationContract::b();
    let branches: Vec<Branch> = (0..720u64)
        .map(|i| Branch {
            label: format!("index:{i}"),
            contract: family.clone().with_order(Order::PermutationIndex(i)),
            weight: 1,
        })
        .collect();
    let raw = Scheme::explicit("b-raw", family, branches, k);
    let classes = Scheme::enumerate("b", k).unwrap();
    let report = sweep(fixture_model(), &ids, &[raw, classes], &opts(2), None).unwrap();
    let mut by_class: HashMap<u64, Vec<usize>> = HashMap::new();
    for i in 0..720u64 {
        let perm = permutation_from_index(k, i).unwrap();
        by_class
            .entry(b_class_of(&perm).unwrap())
            .or_default()
            .push(i as usize);
    }
    assert_eq!(by_class.len(), 360);
    for (class, members) in &by_class {
        assert_eq!(members.len(), 2);
        let d: Vec<_> = members.iter().map(|&i| report.branches[0][i].fork_moe).collect();
        assert_eq!(d[0], d[1], "class {class}: members {members:?} differ");
        assert_eq!(
            report.branches[1][*class as usize].fork_moe, d[0],
            "class {class} representative"
        );
    }
    let raw_sum = &report.summaries[0];
    let class_sum = &report.summaries[1];
    assert!(raw_sum.distinct_moe_outputs <= 360);
    assert_eq!(raw_sum.distinct_moe_outputs, class_sum.distinct_moe_outputs);
    // Not vacuous: orders do change the output on this event.
    assert!(class_sum.distinct_moe_outputs > 1);
}

/// The paper's "why the sheep"-style sweep on the fixture: 720 A orders and
/// 360 B classes, 8-token continuations. Prints the table and the time.
#[test]
#[ignore]
fn full_a_and_b_sweep() {
    let ids = prompt(4, 12);
    let schemes = [
        Scheme::enumerate("a", 6).unwrap(),
        Scheme::enumerate("b", 6).unwrap(),
    ];
    let t = std::time::Instant::now();
    let r = sweep(fixture_model(), &ids, &schemes, &opts(8), None).unwrap();
    let secs = t.elapsed().as_secs_f64();
    for s in &r.summaries {
        println!(
            "{}: raw {} classes {} moe {} post-mHC {} (differ from native {}) continuations {} basins {} top {:?}",
            s.scheme,
            s.raw_permutations,
            s.structural_classes,
            s.distinct_moe_outputs,
            s.distinct_post_mhc,
            s.post_mhc_differs_from_reference,
            s.distinct_continuations,
            s.basins,
            s.basin_rank_frequency.iter().map(|b| b.branches).collect::<Vec<_>>()
        );
    }
    println!(
        "1081 branches x 7 decode steps in {secs:.2} s on {} threads",
        rayon::current_num_threads()
    );
    assert_eq!(r.branches[0].len(), 720);
    assert_eq!(r.branches[1].len(), 360);
}

#[test]
fn snapshots_at_other_steps_equal_replays() {
    let m = fixture_model();
    let ids = prompt(6, 7);
    let n = 4;
    let native = StepOptions {
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    // A prefill fork restricted to the last prompt position, and a fork at step 2.
    let points = [
        ForkPoint {
            layer: 3,
            step: 0,
            position: Some(ids.len() as u32 - 1),
        },
        ForkPoint {
            layer: 7,
            step: 2,
            position: None,
        },
    ];
    for point in points {
        let mut prefix = MemorySink::all();
        let snap = Snapshot::freeze(m, &ids, point.step, &native, &mut prefix).unwrap();
        assert_eq!(snap.step(), point.step);
        let fork = ForkCombine::new(
            point,
            AggregationContract::a().with_order(Order::PermutationIndex(719)),
        );
        let (tokens, full) = replay(&fork, &ids, n);
        let sopts = StepOptions {
            precision: Precision::Bf16,
            combine: &fork,
            detokenizer: None,
            allow_non_finite: false,
        };
        let mut cont = MemorySink::all();
        let g = snap.continue_with(m, n, &sopts, &mut cont).unwrap();
        assert_eq!(g.tokens, tokens);
        let mut joined = prefix.records.clone();
        joined.extend(cont.records);
        assert!(joined == full.records, "{point:?}");
    }
    // A continuation must run the fork step.
    let snap = Snapshot::freeze(m, &ids, 2, &native, &mut MemorySink::all()).unwrap();
    assert!(snap.continue_with(m, 2, &native, &mut MemorySink::all()).is_err());
}

#[test]
fn sweep_rejects_a_fork_point_without_event() {
    let ids = prompt(1, 5);
    let mut o = opts(2);
    // Step 1 processes only position 5.
    o.point.position = Some(0);
    let mut b = Scheme::enumerate("b", 6).unwrap();
    b.truncate(1);
    let e = sweep(fixture_model(), &ids, &[b.clone()], &o, None).unwrap_err();
    assert!(e.to_string().contains("matched no MoE event"), "{e}");
    let mut o = opts(2);
    o.point.layer = 9;
    assert!(sweep(fixture_model(), &ids, &[b.clone()], &o, None).is_err());
    assert!(sweep(fixture_model(), &ids, &[b], &opts(1), None).is_err());
}

/// The sweep's distinct MoE outputs at the fork event equal the exactness
/// certificate's distinct outputs over the same captured terms (the terms are
/// the same in every branch: only the combine changes), for A, B and C.
#[test]
fn sweep_distinct_outputs_match_the_certificate() {
    use moeconf_contract::order_sensitivity;
    let ids = prompt(8, 9);
    let schemes: Vec<Scheme> = ["a", "b", "c"]
        .iter()
        .map(|s| Scheme::enumerate(s, 6).unwrap())
        .collect();
    let report = sweep(fixture_model(), &ids, &schemes, &opts(2), None).unwrap();
    let (_, native) = replay(
        &ForkCombine::new(ForkPoint::first_decode(LAYER), AggregationContract::c()),
        &ids,
        2,
    );
    let at = |path: &str| {
        native
            .records
            .iter()
            .find(|r| r.coord.path == path && r.coord.step == 1 && r.coord.layer == Some(LAYER))
            .unwrap()
            .f32s()
    };
    let terms: Vec<Vec<f32>> = (0..6).map(|j| at(&format!("moe.term.{j}"))).collect();
    let refs: Vec<&[f32]> = terms.iter().map(|t| t.as_slice()).collect();
    let shared = at("moe.shared");
    for (s, summary) in schemes.iter().zip(&report.summaries) {
        let cert = order_sensitivity(&s.family, &refs, &shared).unwrap();
        assert_eq!(summary.distinct_moe_outputs, cert.distinct_outputs, "{}", s.name);
    }
    // A rounds after every addition: the event is order-sensitive under A.
    assert!(report.summaries[0].distinct_moe_outputs > 1);
    // C at its identity order is the native reference.
    assert_eq!(report.branches[2][0].fork_moe, report.reference.fork_moe);
    assert_eq!(report.branches[2][0].digest, report.reference.digest);
}
