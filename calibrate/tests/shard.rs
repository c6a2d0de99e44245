//! Sharded calibration (docs/scale.md): for every protocol, running all the
//! shards of a run (n = 1, 2, 3 and more shards than jobs, so that some are
//! empty), writing each shard's partial result file, and merging them gives
//! byte for byte the outputs of the unsharded run: the printed report,
//! `calibration.json`, every TSV table and every trace.
//!
//! One context (one loaded model) serves every run of a test; only its
//! output directory changes. Sizes are far below `--quick` so that the
//! default suite stays fast; every protocol still runs every code path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use moeconf_calibrate::suite::{self, RunInfo};
use moeconf_calibrate::{Ctx, CtxOptions, Sizes};
use moeconf_output::{check_output, Inputs};
use moeconf_reference_runtime::precision::Precision;
use moeconf_shard::{Merged, ProgressMode, Shard};

/// Smaller than `--quick` (which the CLI test runs).
const TINY: Sizes = Sizes {
    replay_prompts: 2,
    tokens: 4,
    fork_tokens: 2,
    fork_branches: 3,
    seeds: 2,
    control_tokens: 4,
    breadth_prompts: 3,
    horizons: [2, 3, 4],
    context: None,
};

fn ctx() -> Ctx {
    let m = moeconf_runner::load_model("builtin:tiny-v4").expect("built-in model");
    let opts = CtxOptions {
        precision: Precision::Bf16,
        fork_layer: 5,
        sizes: TINY,
        out: PathBuf::new(),
        progress: ProgressMode::Off,
    };
    Ctx::new(m, opts).expect("context")
}

fn info(ctx: &Ctx, only: &[u32]) -> RunInfo {
    RunInfo {
        model: "builtin:tiny-v4".into(),
        precision: "bf16".into(),
        quick: false,
        fork_layer: 5,
        sizes: TINY,
        only: only.to_vec(),
        experts_per_tok: ctx.k(),
    }
}

/// Every file under `dir` (relative path → bytes).
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Writes outputs the way `moeconf calibrate` does; returns stdout.
fn write(dir: &Path, o: &suite::Outputs) -> String {
    for (name, bytes) in &o.files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    o.stdout.clone()
}

/// The unsharded run of `only` into `dir` (as `moeconf calibrate --out DIR`).
fn unsharded(ctx: &mut Ctx, only: &[u32], dir: &Path) -> String {
    std::fs::create_dir_all(dir.join("traces")).unwrap();
    ctx.out = dir.to_path_buf();
    let s = suite::run(ctx, only).unwrap();
    write(
        dir,
        &suite::outputs(&s, &info(ctx, only), Path::new("OUT")).unwrap(),
    )
}

/// Every shard of an `n`-shard run of `only`, each into its own scratch
/// directory and partial file, then merged into `dir` (as `moeconf merge -o DIR`).
fn sharded(ctx: &mut Ctx, only: &[u32], n: u32, work: &Path, dir: &Path) -> (String, Vec<usize>) {
    let mut parts = Vec::new();
    let mut sizes = Vec::new();
    // Given to the merge in reverse order: the order of the partials must not matter.
    for i in (0..n).rev() {
        let scratch = work.join(format!("scratch-{n}-{i}"));
        std::fs::create_dir_all(scratch.join("traces")).unwrap();
        ctx.out = scratch;
        let shard = Shard::new(i, n).unwrap();
        let run = suite::run_shard(ctx, only, shard).unwrap();
        sizes.push(run.results.len());
        let part = work.join(format!("part-{n}-{i}.part"));
        let out = check_output(&part, &Inputs::new()).unwrap();
        suite::write_partial(ctx, &info(ctx, only), shard, run, &out).unwrap();
        parts.push(part);
    }
    let paths: Vec<&Path> = parts.iter().map(|p| p.as_path()).collect();
    let m = Merged::open(&paths).unwrap();
    let (info, s) = suite::merged(&m).unwrap();
    std::fs::create_dir_all(dir.join("traces")).unwrap();
    for f in m.files() {
        let mut w = std::fs::File::create(dir.join(f.name)).unwrap();
        m.copy_file(&f, &mut w).unwrap();
    }
    (
        write(dir, &suite::outputs(&s, &info, Path::new("OUT")).unwrap()),
        sizes,
    )
}

/// Asserts that the merged outputs of n = 1, 2, 3 and `jobs + 2` shards are
/// the unsharded outputs byte for byte, and that the unsharded run wrote
/// `expect_files` (so that the comparison covers them).
fn byte_identical(only: &[u32], expect_files: &[&str]) {
    let mut ctx = ctx();
    let work = tempfile::tempdir().unwrap();
    let whole = work.path().join("whole");
    let stdout = unsharded(&mut ctx, only, &whole);
    let want = files(&whole);
    for f in expect_files {
        assert!(
            want.contains_key(*f),
            "the unsharded run wrote no {f}: {:?}",
            want.keys()
        );
    }
    let mut jobs = 0;
    // The last n exceeds the job count (known from n = 1): some shards are empty.
    for step in 0..4 {
        let n = [1, 2, 3, jobs as u32 + 2][step];
        let merged = work.path().join(format!("merged-{n}"));
        let (out, sizes) = sharded(&mut ctx, only, n, work.path(), &merged);
        if n == 1 {
            jobs = sizes[0];
            assert!(jobs >= 1);
        }
        assert_eq!(sizes.iter().sum::<usize>(), jobs, "n = {n}");
        if n as usize > jobs {
            assert!(
                sizes.contains(&0),
                "n = {n} > {jobs} jobs: some shard must be empty"
            );
        }
        assert_eq!(out, stdout, "stdout, n = {n}");
        let got = files(&merged);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "files, n = {n}"
        );
        for (name, bytes) in &want {
            assert!(got[name] == *bytes, "{name} differs, n = {n}");
        }
        std::fs::remove_dir_all(&merged).unwrap();
    }
}

#[test]
fn replay_sharded_is_byte_identical() {
    byte_identical(&[1], &["calibration.json", "replay.tsv"]);
}

#[test]
fn fork_sweep_sharded_is_byte_identical() {
    byte_identical(&[2], &["calibration.json", "basin_counts.tsv"]);
}

#[test]
fn persistent_canonical_and_c_check_sharded_are_byte_identical() {
    byte_identical(&[3], &["persistent_ablation.tsv", "c_intermediate_summary.tsv"]);
}

#[test]
fn substitutions_and_propagation_sharded_are_byte_identical() {
    byte_identical(&[6, 7, 8], &["propagation_trace.tsv"]);
}

#[test]
fn breadth_sharded_is_byte_identical() {
    byte_identical(&[9], &["breadth_summary.tsv", "breadth_breakdown.tsv"]);
}

#[test]
fn fault_matrix_sharded_is_byte_identical_traces_included() {
    byte_identical(
        &[10],
        &[
            "fault_localization.tsv",
            "traces/fault-bf16-reference.bin",
            "traces/fault-f32-01.bin",
        ],
    );
}
