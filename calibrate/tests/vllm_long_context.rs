//! Long-context conformance on the vLLM fixture (issue 35 item 4), opt-in
//! (`#[ignore]`: minutes, not seconds; docs/calibration.md "Long context on
//! the vLLM fixture" has the measured times):
//!
//! ```text
//! cargo test --release -p moeconf-calibrate --test vllm_long_context -- --ignored --nocapture --test-threads 1
//! ```
//!
//! `builtin:tiny-v4-vllm` (index_topk 512, CSA rate 4, HCA rate 128,
//! window 8; layers `[sliding, CSA, HCA, CSA, HCA]`) in the bf16 profile.
//! Its indexer selects only once a CSA layer holds more than 512 compressed
//! entries (from position 4·513 − 1 = 2051), so the three long-context
//! faults of the fault matrix (`fault_matrix::long_context_matrix`: the
//! window ring on the sliding layer, the indexer top-k cut on the second CSA
//! layer, the compressed position on the first HCA layer) are run on a
//! prompt past every onset, each diffed against the native trace; the
//! diff's headline must be exactly the case's step, layer and record, at its
//! onset position. A second test runs the native fixture at 8 192 tokens
//! and checks from the trace's own index that `attn.indexer_topk` selects
//! 512 of more than 512 scored entries (2 048 at the last position), then
//! localizes the indexer fault there too.
//!
//! Traces are written with `--capture fingerprints` (digests and shapes of
//! every level, no payloads): `capture all` would not fit on disk at these
//! lengths. They go to a temporary directory, removed at the end.

use std::path::Path;
use std::time::Instant;

use moeconf_bisect::{diff, DiffOptions};
use moeconf_calibrate::fault_matrix::{latest_onset, long_context_kinds, long_context_matrix, Case};
use moeconf_calibrate::long_fork::context_prompt;
use moeconf_calibrate::{Ctx, CtxOptions, Sizes, TraceRequest};
use moeconf_contract::NativeCombine;
use moeconf_reference_runtime::config::AttentionKind;
use moeconf_reference_runtime::faults::FaultPlan;
use moeconf_reference_runtime::precision::Precision;
use moeconf_schema::Trace;

/// Generated tokens of every run: the prefill and one decode step.
const TOKENS: usize = 2;

fn ctx(out: &Path) -> Ctx {
    let m = moeconf_runner::load_model("builtin:tiny-v4-vllm").expect("built-in model");
    let opts = CtxOptions {
        precision: Precision::Bf16,
        // Any layer of the five: no protocol with a fork runs here.
        fork_layer: 3,
        sizes: Sizes::QUICK,
        out: out.to_path_buf(),
        progress: moeconf_shard::ProgressMode::Off,
    };
    Ctx::new(m, opts).expect("context")
}

/// Writes one fingerprint trace of `ids` (with `faults`) to `path`; its seconds.
fn write(ctx: &Ctx, ids: &[u32], faults: Option<&FaultPlan>, path: &Path) -> f64 {
    let t = Instant::now();
    ctx.write_trace_captured(
        TraceRequest {
            prompt: "",
            prompt_ids: ids,
            tokens: TOKENS,
            combine: &NativeCombine,
            faults,
            notes: vec![],
            path,
        },
        Precision::Bf16,
        "fingerprints",
    )
    .expect("trace");
    t.elapsed().as_secs_f64()
}

/// The case's trace diffed against the reference: the headline must be the
/// case's step, layer and record, at the kind's onset position.
fn localize(ctx: &Ctx, reference: &Path, ids: &[u32], case: &Case, dir: &Path) {
    let f = &case.faults[0];
    let cfg = ctx.m.model.config();
    let layer = f.layer.expect("a layer");
    let onset = f
        .kind
        .long_context_onset(cfg, cfg.layer_types[layer as usize])
        .expect("an onset");
    assert!((onset as usize) < ids.len(), "{}: onset {onset}", f.kind.name());
    let path = dir.join(format!("{}.bin", f.kind.name()));
    let secs = write(ctx, ids, Some(&FaultPlan::new(case.faults.clone())), &path);
    let (r, c) = (
        Trace::open_verified(reference).expect("reference"),
        Trace::open_verified(&path).expect("candidate"),
    );
    let t = Instant::now();
    let report = diff(&r, &c, &DiffOptions::default()).expect("diff");
    let d = report
        .first_divergence
        .as_ref()
        .unwrap_or_else(|| panic!("{}: no divergence", f.kind.name()));
    eprintln!(
        "{}: layer {layer}, onset {onset}: candidate {secs:.1} s, diff {:.1} s: {}",
        f.kind.name(),
        t.elapsed().as_secs_f64(),
        report.summary
    );
    assert_eq!(
        (d.step, d.layer, d.operator.as_str(), d.position),
        (
            case.expect.step,
            case.expect.layer,
            case.expect.component.path(),
            onset
        ),
        "{}",
        report.summary
    );
    drop((r, c));
    std::fs::remove_file(&path).expect("remove the candidate trace");
}

/// Positions (last first) whose `attn.indexer_topk` on a CSA layer selects
/// the full index_topk out of more scored entries: (position, layer, selected, scored).
fn selections(ctx: &Ctx, trace: &Path) -> Vec<(u32, u32, u64, u64)> {
    let cfg = ctx.m.model.config();
    let t = Trace::open_verified(trace).expect("trace");
    let recs = t.records().expect("records");
    let csa = |l: Option<u32>| l.is_some_and(|l| cfg.layer_types[l as usize] == AttentionKind::Csa);
    let len = |p: &str, e: &moeconf_schema::IndexEntry| {
        (e.coord.path.as_str() == p && csa(e.coord.layer)).then(|| e.shape.iter().product::<u64>())
    };
    let mut out = Vec::new();
    let mut scored = None;
    for e in recs.iter() {
        if let Some(n) = len("attn.indexer_scores", e) {
            scored = Some((e.coord.position, e.coord.layer, n));
        }
        if let Some(k) = len("attn.indexer_topk", e) {
            if let Some((pos, layer, n)) = scored {
                if pos == e.coord.position && layer == e.coord.layer && n > k {
                    out.push((pos, layer.unwrap_or(0), k, n));
                }
            }
        }
    }
    out.reverse();
    out
}

#[test]
#[ignore = "minutes: the vLLM fixture past its indexer onset (docs/calibration.md)"]
fn long_context_faults_localized_on_the_vllm_fixture() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ctx = ctx(dir.path());
    let cfg = ctx.m.model.config();
    assert_eq!(cfg.index_topk, 512);
    // One position past the latest onset of the three kinds on any layer.
    let need = latest_onset(cfg).expect("onsets") as usize + 1;
    assert_eq!(need, 2052, "the indexer's onset 4·513 − 1 = 2051 is the latest");
    let ids = context_prompt(&ctx, need + 12).expect("prompt");
    let reference = dir.path().join("reference.bin");
    let secs = write(&ctx, &ids, None, &reference);
    eprintln!("reference: {} tokens in {secs:.1} s", ids.len());
    let sel = selections(&ctx, &reference);
    // Every selecting record, on either CSA layer, is at or after the onset.
    let first = sel.iter().map(|s| s.0).min();
    assert_eq!(first, Some(2051), "the first selecting position is the onset");
    let layers: std::collections::BTreeSet<u32> = sel.iter().filter(|s| s.0 == 2051).map(|s| s.1).collect();
    assert_eq!(
        layers.into_iter().collect::<Vec<_>>(),
        vec![1, 3],
        "both CSA layers select from 2051"
    );
    assert!(sel.iter().all(|&(_, _, k, n)| k == 512 && n > 512));
    let cases = long_context_matrix(&ctx, ids.len(), TOKENS);
    assert_eq!(
        cases.iter().map(|c| c.faults[0].kind.clone()).collect::<Vec<_>>(),
        long_context_kinds().to_vec()
    );
    for case in &cases {
        localize(&ctx, &reference, &ids, case, dir.path());
    }
}

#[test]
#[ignore = "minutes: the vLLM fixture at 8 192 tokens (docs/calibration.md)"]
fn indexer_selection_engages_on_the_vllm_fixture_at_8192_tokens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ctx = ctx(dir.path());
    let n: usize = std::env::var("MOECONF_VLLM_CONTEXT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8192);
    assert!(n >= 8192, "MOECONF_VLLM_CONTEXT {n}: at least 8192");
    let ids = context_prompt(&ctx, n).expect("prompt");
    let reference = dir.path().join("reference.bin");
    let secs = write(&ctx, &ids, None, &reference);
    let bytes = std::fs::metadata(&reference).map(|m| m.len()).unwrap_or(0);
    eprintln!("reference: {n} tokens in {secs:.1} s, {bytes} bytes");
    let sel = selections(&ctx, &reference);
    let (pos, _, k, scored) = *sel.first().expect("the indexer selects");
    eprintln!(
        "last selecting position {pos}: attn.indexer_topk {k} of {scored} entries; {} selecting records",
        sel.len()
    );
    // The decode step's position n: (n + 1) / 4 entries on a CSA layer.
    assert_eq!((pos as usize, k), (n, 512));
    assert_eq!(scored as usize, (n + 1) / 4);
    let case = long_context_matrix(&ctx, ids.len(), TOKENS)
        .into_iter()
        .find(|c| c.faults[0].kind == long_context_kinds()[1])
        .expect("the indexer case");
    localize(&ctx, &reference, &ids, &case, dir.path());
}
