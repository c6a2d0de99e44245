//! Prints fixture statistics (development aid).
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::contract::NativeCombine;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::Model;
use moeconf_reference_runtime::precision::Precision;

fn main() {
    let dir = std::env::temp_dir().join("moeconf-explore");
    moeconf_fixtures::checkpoint::write_tiny_v4(&dir).unwrap();
    let model = Model::load(&dir).unwrap();
    for prec in [Precision::Bf16, Precision::F32] {
        for seed in 0..4u32 {
            let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + seed * 101 + 5) % 1024).collect();
            let mut sink = MemorySink::all();
            let opts = GenerateOptions {
                max_new_tokens: 20,
                precision: prec,
                combine: &NativeCombine,
                detokenizer: None,
            };
            let g = model.generate(&prompt, &opts, &mut sink).unwrap();
            let mut experts = std::collections::BTreeSet::new();
            let mut rm: Vec<f32> = Vec::new();
            for r in sink.by_path("router.topk") {
                for e in r.i32s() {
                    experts.insert((r.coord.layer, e));
                }
            }
            for r in sink.by_path("router.margin") {
                rm.extend(r.f32s());
            }
            let lm: Vec<f32> = sink.by_path("lm.margin").flat_map(|r| r.f32s()).collect();
            let mn = |v: &[f32]| v.iter().cloned().fold(f32::INFINITY, f32::min);
            let mx = |v: &[f32]| v.iter().cloned().fold(0.0, f32::max);
            println!("{:?} seed {seed}: tokens {:?}", prec, g.tokens);
            println!(
                "  distinct (layer,expert) {} router margin [{:e}, {:e}] lm margin [{:e}, {:e}] logits0 {:?}",
                experts.len(),
                mn(&rm),
                mx(&rm),
                mn(&lm),
                mx(&lm),
                &g.last_logits[..4]
            );
            let topk: Vec<Vec<i32>> = sink
                .by_path("attn.indexer_topk")
                .filter(|r| r.coord.layer == Some(2))
                .map(|r| r.i32s())
                .collect();
            println!("  indexer sel last {:?}", topk.last());
        }
    }
}
