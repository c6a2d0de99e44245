//! The fixture is not degenerate: over several prompts, many distinct experts
//! are selected, router top-k margins and LM argmax margins span orders of
//! magnitude, the indexer selection is really sparse, and greedy continuations
//! are not a single repeated token.

mod common;

use std::collections::BTreeSet;

use common::{fixture_model, prompt, F32Combine};
use moeconf_contract::NativeCombine;
use moeconf_fingerprint::Level;
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::precision::Precision;

fn span(v: &[f32]) -> f32 {
    let pos: Vec<f32> = v.iter().copied().filter(|x| *x > 0.0).collect();
    let max = pos.iter().copied().fold(0.0f32, f32::max);
    let min = pos.iter().copied().fold(f32::INFINITY, f32::min);
    max / min
}

#[test]
fn fixture_is_not_degenerate() {
    let model = fixture_model();
    let cfg = model.config();
    let mut experts: Vec<BTreeSet<i32>> = vec![BTreeSet::new(); cfg.num_layers()];
    let (mut router_margins, mut lm_margins) = (Vec::new(), Vec::new());
    let mut sparse_selections = 0;
    for seed in 0..4 {
        let mut sink = MemorySink::with_levels(&[Level::L1, Level::L3, Level::L4]);
        let opts = GenerateOptions {
            max_new_tokens: 20,
            precision: Precision::Bf16,
            combine: &NativeCombine,
            detokenizer: None,
            allow_non_finite: false,
        };
        let g = model.generate(&prompt(seed, 21), &opts, &mut sink).unwrap();
        let distinct: BTreeSet<u32> = g.tokens.iter().copied().collect();
        assert!(
            distinct.len() >= 10,
            "prompt {seed}: continuation {:?} is nearly constant",
            g.tokens
        );
        for r in sink.by_path("router.topk") {
            experts[r.coord.layer.unwrap() as usize].extend(r.i32s());
        }
        router_margins.extend(sink.by_path("router.margin").flat_map(|r| r.f32s()));
        lm_margins.extend(sink.by_path("lm.margin").flat_map(|r| r.f32s()));
        for r in sink.by_path("attn.indexer_topk") {
            // Position t has floor((t+1)/4) entries; a selection of 4 among more is sparse.
            if ((r.coord.position + 1) / 4) as usize > r.i32s().len() {
                sparse_selections += 1;
            }
        }
    }
    for (l, set) in experts.iter().enumerate() {
        assert!(
            set.len() >= 28,
            "layer {l}: only {} distinct experts selected",
            set.len()
        );
    }
    let rs = span(&router_margins);
    // bf16 logits are quantized (ulp 2^-6 near |logit| = 2), which caps this span near 100;
    // the f32 span is checked over the fixture prompts below.
    let ls = span(&lm_margins);
    assert!(rs >= 1e3, "router margins span only {rs}");
    assert!(ls >= 50.0, "LM margins span only {ls}");
    assert!(
        sparse_selections > 100,
        "indexer selection sparse only {sparse_selections} times"
    );
    eprintln!("router margin span {rs:e}, lm margin span {ls:e}, sparse selections {sparse_selections}");
}

#[test]
fn fixture_prompts_give_varied_continuations() {
    // The fixture's own text prompts (depth + breadth sets), tokenized with the
    // fixture tokenizer: continuations vary across prompts and within each.
    let dir = tempfile::tempdir().unwrap();
    let files = moeconf_fixtures::write_tiny_v4_all(dir.path()).unwrap();
    let model = moeconf_reference_runtime::model::Model::load(dir.path()).unwrap();
    let tok = moeconf_reference_runtime::tokenizer::Tokenizer::from_file(&files.tokenizer).unwrap();
    let mut prompts = moeconf_fixtures::depth_prompts();
    prompts.extend(moeconf_fixtures::breadth_prompts());
    let mut firsts = BTreeSet::new();
    let (mut lm_margins, mut experts) = (Vec::new(), BTreeSet::new());
    for pr in &prompts {
        let ids = tok.encode(&pr.text).unwrap();
        let mut sink = MemorySink::with_levels(&[Level::L3]);
        let opts = GenerateOptions {
            max_new_tokens: 8,
            precision: Precision::Bf16,
            combine: &NativeCombine,
            detokenizer: None,
            allow_non_finite: false,
        };
        let g = model.generate(&ids, &opts, &mut sink).unwrap();
        let distinct: BTreeSet<u32> = g.tokens.iter().copied().collect();
        assert!(
            distinct.len() >= 3,
            "prompt {}: continuation {:?} is nearly constant",
            pr.id,
            g.tokens
        );
        firsts.insert(g.tokens[0]);
        for r in sink.by_path("router.topk") {
            experts.extend(r.i32s().into_iter().map(|e| (r.coord.layer, e)));
        }
        // bf16 logits are quantized (one ulp at |logit| ~ 2 is 2^-6), which caps the
        // span of bf16 margins near 100; the span is measured in the f32 profile,
        // whose margins are continuous.
        let mut l1 = MemorySink::with_levels(&[Level::L1]);
        let f32_opts = GenerateOptions {
            precision: Precision::F32,
            combine: &F32Combine,
            ..opts
        };
        model.generate(&ids, &f32_opts, &mut l1).unwrap();
        lm_margins.extend(l1.by_path("lm.margin").flat_map(|r| r.f32s()));
    }
    assert!(
        firsts.len() * 2 >= prompts.len(),
        "only {} distinct first tokens over {} prompts",
        firsts.len(),
        prompts.len()
    );
    let cfg = model.config();
    assert!(
        experts.len() * 10 >= cfg.num_layers() * cfg.n_routed_experts * 9,
        "only {} (layer, expert) pairs used",
        experts.len()
    );
    assert!(
        span(&lm_margins) >= 1000.0,
        "LM margins span only {}",
        span(&lm_margins)
    );
}
