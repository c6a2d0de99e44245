//! The quantized fixture `builtin:tiny-v4-fp8` (FP8 E4M3 dense projections with UE8M0
//! 128×128 block scales, MXFP4 experts, one MTP block) against its exact BF16 dequantization
//! `builtin:tiny-v4-fp8-bf16`, written independently by the generator: every weight decodes
//! to the same FP32 value, and both profiles produce bit-identical records, so the FP8/FP4
//! kernels follow the documented dot8 order on the dequantized weights (docs/operators.md §8).

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::{digests, prompt, F32Combine};
use moeconf_contract::{MoeCombine, NativeCombine};
use moeconf_fixtures::{ensure_builtin_in, BUILTIN_TINY_V4_FP8, BUILTIN_TINY_V4_FP8_BF16};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::Model;
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::weights::{LinearFormat, Mat, WeightDType};

fn dir(name: &str) -> PathBuf {
    let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("moeconf-fixtures");
    ensure_builtin_in(name, &root).expect("materialize")
}

fn models() -> &'static (Model, Model) {
    static M: OnceLock<(Model, Model)> = OnceLock::new();
    M.get_or_init(|| {
        (
            Model::load(&dir(BUILTIN_TINY_V4_FP8)).expect("load fp8"),
            Model::load(&dir(BUILTIN_TINY_V4_FP8_BF16)).expect("load bf16 twin"),
        )
    })
}

fn mats(m: &Model) -> Vec<Mat> {
    let mut out = Vec::new();
    for i in 0..m.config().num_layers() {
        m.layer_weights(i)
            .expect("layer")
            .for_each_mat(&mut |x| out.push(x.clone()));
    }
    for t in m.mtp() {
        t.block.for_each_mat(&mut |x| out.push(x.clone()));
        out.push(t.e_proj.clone());
        out.push(t.h_proj.clone());
    }
    out
}

#[test]
fn the_fixture_is_fp8_and_mxfp4_with_an_mtp_block() {
    let (q, b) = models();
    assert_eq!(q.config().weights.dense, LinearFormat::Fp8Block128);
    assert_eq!(q.config().weights.experts, LinearFormat::Mxfp4);
    assert!(!b.config().weights.is_quantized());
    assert_eq!(q.mtp().len(), 1);
    assert_eq!(b.mtp().len(), 1);
    let layer = q.layer_weights(2).expect("layer 2");
    assert_eq!(layer.attn.wq_a.dtype(), WeightDType::Fp8E4m3);
    assert_eq!(layer.attn.wkv.rows(), 192); // a ragged 64-row edge block
    assert_eq!(layer.moe.experts[0].w1.dtype(), WeightDType::Mxfp4);
    assert_eq!(layer.moe.shared.w2.dtype(), WeightDType::Fp8E4m3);
    assert_eq!(layer.moe.router.gate.dtype(), WeightDType::Bf16);
    let bytes = q.weight_bytes();
    let fp4 = bytes
        .iter()
        .find(|(d, _, _)| *d == WeightDType::Mxfp4)
        .expect("mxfp4");
    // 10 MoE blocks (9 layers + MTP) × 32 experts × 3 matrices × 128·256/2 bytes.
    assert_eq!(fp4.1, 10 * 32 * 3 * 128 * 256 / 2);
    assert_eq!(fp4.2, 10 * 32 * 3 * 128 * 256 / 32);
}

#[test]
fn every_weight_decodes_to_its_bf16_twin() {
    let (q, b) = models();
    let (mq, mb) = (mats(q), mats(b));
    assert_eq!(mq.len(), mb.len());
    let mut quantized = 0;
    for (x, y) in mq.iter().zip(&mb) {
        assert_eq!((x.rows(), x.cols()), (y.rows(), y.cols()));
        if x.dtype().quant().is_some() {
            quantized += 1;
            assert_eq!(y.dtype(), WeightDType::Bf16);
        }
        for r in 0..x.rows() {
            let (a, c) = (x.row_f32(r), y.row_f32(r));
            let same = a.iter().zip(&c).all(|(u, v)| u.to_bits() == v.to_bits());
            assert!(
                same,
                "row {r} of a {:?} [{}, {}] matrix differs",
                x.dtype(),
                x.rows(),
                x.cols()
            );
        }
    }
    assert!(quantized > 300, "{quantized}");
}

fn run(m: &Model, precision: Precision, combine: &dyn MoeCombine) -> (Vec<u32>, MemorySink) {
    let mut sink = MemorySink::all();
    let opts = GenerateOptions {
        max_new_tokens: 12,
        precision,
        combine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let g = m.generate(&prompt(3, 21), &opts, &mut sink).expect("generate");
    (g.tokens, sink)
}

#[test]
fn quantized_and_dequantized_checkpoints_trace_identically_in_both_profiles() {
    let (q, b) = models();
    for (precision, combine) in [
        (Precision::Bf16, &NativeCombine as &dyn MoeCombine),
        (Precision::F32, &F32Combine as &dyn MoeCombine),
    ] {
        let (tq, sq) = run(q, precision, combine);
        let (tb, sb) = run(b, precision, combine);
        assert_eq!(tq, tb, "{precision:?}: tokens differ");
        assert!(sq.records.len() > 1000);
        let (dq, db) = (digests(&sq), digests(&sb));
        assert_eq!(dq.len(), db.len());
        if let Some(i) = (0..dq.len()).find(|&i| dq[i] != db[i]) {
            panic!("{precision:?}: record {i} ({:?}) differs", sq.records[i].coord);
        }
    }
}

#[test]
fn flash_width_spec_has_the_released_flash_sizes() {
    use moeconf_fixtures::checkpoint::V4Spec;
    for layers in 2..=4 {
        let spec = V4Spec::flash_width(layers);
        let cfg = moeconf_reference_runtime::config::ModelConfig::from_json(
            std::path::Path::new("flash/config.json"),
            &spec.config_json(),
        )
        .expect("flash config parses");
        assert_eq!(cfg.num_layers(), layers);
        assert_eq!(
            (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rope_dim),
            (4096, 64, 512, 64)
        );
        assert_eq!((cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank), (1024, 8, 1024));
        assert_eq!(
            (
                cfg.n_routed_experts,
                cfg.experts_per_tok,
                cfg.moe_intermediate_size
            ),
            (256, 6, 2048)
        );
        assert_eq!(
            (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk),
            (64, 128, 512)
        );
        assert_eq!((cfg.csa_rate, cfg.hca_rate, cfg.sliding_window), (4, 128, 128));
        assert_eq!(cfg.weights.experts, LinearFormat::Mxfp4);
        assert_eq!(cfg.weights.dense, LinearFormat::Fp8Block128);
        assert!(cfg
            .layer_types
            .contains(&moeconf_reference_runtime::config::AttentionKind::Csa));
        assert!(cfg
            .layer_types
            .contains(&moeconf_reference_runtime::config::AttentionKind::Hca));
    }
}

/// This process's anonymous resident memory in bytes (`RssAnon` of
/// `/proc/self/status`; `None` off Linux): mapped weights are file-backed,
/// so they do not count. The test's own reader: the runtime has no use for
/// one (`moeconf bench` has its own, `moeconf_bench::measure`).
fn anon_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status.lines().find_map(|l| l.strip_prefix("RssAnon:"))?;
    kb.split_whitespace()
        .next()?
        .parse::<u64>()
        .ok()?
        .checked_mul(1024)
}

/// Generates V4-Flash per-layer sizes with 8 experts and a 1024-token vocabulary (about
/// 450 MB), loads it and decodes two tokens; the anonymous RSS must stay far below the
/// checkpoint size (weights are mapped, the generator streams). Slow (about a minute):
/// `cargo test --release -p moeconf-reference-runtime --test quantized -- --ignored`.
#[test]
#[ignore = "writes ~450 MB; run with --ignored"]
fn flash_width_checkpoint_generates_streaming_and_loads_mapped() {
    use moeconf_fixtures::checkpoint::{write_v4, V4Spec};
    let spec = V4Spec {
        n_routed_experts: 8,
        vocab_size: 1024,
        ..V4Spec::flash_width(2)
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let files = write_v4(dir.path(), &spec).expect("generate");
    let size = std::fs::metadata(&files.weights).expect("meta").len();
    let rss_after_write = anon_rss_bytes();
    let m = Model::load(dir.path()).expect("load");
    let mut sink = MemorySink::with_levels(&[]);
    let opts = GenerateOptions {
        max_new_tokens: 2,
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let g = m.generate(&[5, 9, 11], &opts, &mut sink).expect("generate");
    assert_eq!(g.tokens.len(), 2);
    let rss = anon_rss_bytes();
    println!(
        "checkpoint {size} bytes; anonymous RSS after writing {rss_after_write:?}, after decoding {rss:?}"
    );
    if let Some(rss) = rss {
        assert!(rss < size / 4, "anonymous RSS {rss} vs checkpoint {size}");
    }
}
