//! The diff speed benchmark (two ≥ 1 GiB traces differing in one record,
//! diff against a plain byte comparison). Ignored by default because it
//! writes 2 GiB; run it with:
//!
//! ```text
//! cargo test --release -p moeconf-bench --test diff -- --ignored --nocapture
//! ```
//!
//! It prints the measured times and ratio (target: diff < 1% of the byte
//! comparison) and asserts only that the injected record is the one localized.

use moeconf_bench::diff::{bench_diff, BENCH_LAYERS};

#[test]
#[ignore = "writes two 1 GiB traces; run explicitly (see the module docs)"]
fn diff_touches_only_the_divergent_path() {
    let dir =
        tempfile::tempdir_in(std::env::var_os("MOECONF_BENCH_DIR").unwrap_or_else(|| ".".into())).unwrap();
    let r = bench_diff(dir.path(), 1 << 30, 256 << 10, 3).unwrap();
    println!("{}", serde_json::to_string_pretty(&r).unwrap());
    println!(
        "diff {:.4} s (open {:.4} s + walk {:.4} s) vs byte comparison {:.4} s: ratio {:.3}% (walk alone {:.3}%)",
        r.diff_seconds,
        r.open_seconds,
        r.walk_seconds,
        r.byte_compare_seconds,
        r.ratio * 100.0,
        r.walk_seconds / r.byte_compare_seconds * 100.0
    );
    assert!(r.file_bytes >= 1 << 30);
    let fd = r.localized.unwrap();
    assert_eq!(
        (fd.layer, fd.operator.as_str()),
        (Some(BENCH_LAYERS / 2), "moe.combine")
    );
}

#[test]
fn small_benchmark_localizes_the_injected_record() {
    let dir = tempfile::tempdir().unwrap();
    let r = bench_diff(dir.path(), 1 << 20, 4096, 1).unwrap();
    let fd = r.localized.unwrap();
    let steps = (r.records / (u64::from(BENCH_LAYERS) * 4)) as u32;
    assert_eq!(
        (fd.step, fd.layer, fd.operator.as_str()),
        (steps - 2, Some(BENCH_LAYERS / 2), "moe.combine")
    );
    // One f32 value differs in the payloads; the index and trailer digests differ too.
    assert!(r.differing_bytes > 0);
}
