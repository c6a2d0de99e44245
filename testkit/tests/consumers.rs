//! The consumer fuzz targets' bodies (`moeconf_testkit::targets`) on
//! deterministic seeds: every oracle of the cargo-fuzz targets runs in the
//! default suite, so a regression fails `cargo test` without a fuzzer.
//! Each test also checks that its oracles were reached on a fair share of
//! the seeds (a generator that silently bails out would test nothing),
//! including, for `diff` and `gate`, the format version 2 oracles: a
//! flipped bit of a tree node read on use is an error, and (diff) a flipped
//! bit of a payload not read leaves the answer as it was.
//! Long runs: `cargo fuzz run diff` etc. (fuzz/README.md).

use moeconf_testkit::seeds::{inputs, scratch_root};
use moeconf_testkit::targets::{self, Seen, DIFFERENT, FLIP, NODE, PASSED, REFUSED, SAME, UNREAD, VERDICT};

/// Runs `body` on `n` seeded inputs in a fresh scratch directory and counts
/// how often each [`Seen`] bit was reached.
fn run(seed: u64, n: usize, body: fn(&[u8], &std::path::Path) -> Seen) -> [usize; 8] {
    let dir = tempfile::tempdir_in(scratch_root()).unwrap();
    let mut counts = [0usize; 8];
    for data in inputs(seed, n) {
        let seen = body(&data, dir.path());
        for (bit, c) in counts.iter_mut().enumerate() {
            *c += usize::from(seen & (1 << bit) != 0);
        }
    }
    eprintln!("seen counts (verdict, same, different, flip, passed, refused, node, unread) of {n} seeds: {counts:?}");
    counts
}

/// Asserts that every bit of `want` was reached on at least `min` seeds.
fn reached(counts: [usize; 8], want: Seen, min: usize) {
    for (bit, &c) in counts.iter().enumerate() {
        if want & (1 << bit) != 0 {
            assert!(c >= min, "oracle bit {bit} reached on only {c} seeds: {counts:?}");
        }
    }
}

const N: usize = 2000;

#[test]
fn diff_oracles_hold_on_seeded_inputs() {
    let c = run(1, N, targets::diff_case);
    reached(
        c,
        VERDICT | SAME | DIFFERENT | FLIP | PASSED | REFUSED | NODE | UNREAD,
        N / 20,
    );
}

#[test]
fn gate_oracles_hold_on_seeded_inputs() {
    let c = run(2, N, targets::gate_case);
    reached(
        c,
        VERDICT | SAME | DIFFERENT | FLIP | PASSED | REFUSED | NODE,
        N / 20,
    );
}

#[test]
fn certify_oracles_hold_on_seeded_inputs() {
    let c = run(3, N, targets::certify_case);
    reached(c, VERDICT | FLIP | PASSED | REFUSED, N / 20);
}

#[test]
fn import_oracles_hold_on_seeded_inputs() {
    let c = run(4, N, targets::import_case);
    reached(c, VERDICT | SAME | FLIP | PASSED | REFUSED, N / 20);
}
