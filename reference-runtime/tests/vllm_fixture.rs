//! The vLLM fixture `builtin:tiny-v4-vllm` (the released FP8 E4M3 / MXFP4 format at the
//! smallest sizes vLLM's DeepSeek-V4 CPU path accepts: head_dim 512, indexer heads of 128,
//! index top-k 512, 64 routed experts, HCA rate 128) against its exact BF16 dequantization
//! `builtin:tiny-v4-vllm-bf16`: the reference runtime loads both, every weight decodes to the
//! same FP32 value, and both trace bit-identically in both profiles, on a short prompt with
//! every record and on a prompt long enough for the HCA compressor's first entry
//! (docs/operators.md §8.8).

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::{digests, prompt, F32Combine};
use moeconf_contract::{MoeCombine, NativeCombine};
use moeconf_fingerprint::Level;
use moeconf_fixtures::{ensure_builtin_in, BUILTIN_TINY_V4_VLLM, BUILTIN_TINY_V4_VLLM_BF16};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::config::AttentionKind;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::Model;
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::weights::{LinearFormat, Mat, WeightDType};

fn dir(name: &str) -> PathBuf {
    let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("moeconf-fixtures");
    ensure_builtin_in(name, &root).expect("materialize")
}

/// The quantized fixture and its BF16 twin, loaded once per test binary.
fn models() -> &'static (Model, Model) {
    static M: OnceLock<(Model, Model)> = OnceLock::new();
    M.get_or_init(|| {
        (
            Model::load(&dir(BUILTIN_TINY_V4_VLLM)).expect("load the vllm fixture"),
            Model::load(&dir(BUILTIN_TINY_V4_VLLM_BF16)).expect("load its bf16 twin"),
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
fn the_vllm_fixture_loads_with_the_sizes_vllm_cpu_enforces() {
    let (q, b) = models();
    for m in [q, b] {
        let c = m.config();
        assert_eq!((c.head_dim, c.rope_dim), (512, 64));
        assert_eq!((c.index_head_dim, c.index_topk), (128, 512));
        assert_eq!((c.n_routed_experts, c.experts_per_tok), (64, 6));
        assert_eq!((c.csa_rate, c.hca_rate), (4, 128));
        use AttentionKind::*;
        assert_eq!(c.layer_types, vec![Sliding, Csa, Hca, Csa, Hca]);
        assert_eq!(m.mtp().len(), 1);
    }
    assert_eq!(q.config().weights.dense, LinearFormat::Fp8Block128);
    assert_eq!(q.config().weights.experts, LinearFormat::Mxfp4);
    assert!(!b.config().weights.is_quantized());
    let layer = q.layer_weights(1).expect("layer 1");
    assert_eq!(layer.attn.wkv.dtype(), WeightDType::Fp8E4m3);
    assert_eq!(layer.attn.wkv.rows(), 512); // four full 128-row blocks
    assert_eq!(layer.moe.experts.len(), 64);
    assert_eq!(layer.moe.experts[63].w1.dtype(), WeightDType::Mxfp4);
    assert_eq!(layer.moe.shared.w2.dtype(), WeightDType::Fp8E4m3);
    let fp4 = q
        .weight_bytes()
        .into_iter()
        .find(|(d, _, _)| *d == WeightDType::Mxfp4)
        .expect("mxfp4");
    // 6 MoE blocks (5 layers + MTP) × 64 experts × 3 matrices × 128·256/2 bytes.
    assert_eq!(fp4.1, 6 * 64 * 3 * 128 * 256 / 2);
    assert_eq!(fp4.2, 6 * 64 * 3 * 128 * 256 / 32);
}

#[test]
fn every_weight_of_the_vllm_fixture_decodes_to_its_bf16_twin() {
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
    // 6 MoE blocks × (64 · 3 MXFP4 + 3 FP8 shared) + 5 layers and the MTP block × 5 FP8
    // attention projections + 2 CSA indexers' wq_b + the MTP e_proj/h_proj.
    assert_eq!(quantized, 6 * (64 * 3 + 3) + 6 * 5 + 2 + 2);
}

fn run(m: &Model, ids: &[u32], new: usize, precision: Precision, sink: &mut MemorySink) -> Vec<u32> {
    let combine: &dyn MoeCombine = match precision {
        Precision::F32 => &F32Combine,
        _ => &NativeCombine,
    };
    let opts = GenerateOptions {
        max_new_tokens: new,
        precision,
        combine,
        detokenizer: None,
        allow_non_finite: false,
    };
    m.generate(ids, &opts, sink).expect("generate").tokens
}

#[test]
fn the_vllm_fixture_and_its_twin_trace_identically_in_both_profiles() {
    let (q, b) = models();
    for precision in [Precision::Bf16, Precision::F32] {
        let (mut sq, mut sb) = (MemorySink::all(), MemorySink::all());
        let tq = run(q, &prompt(3, 13), 6, precision, &mut sq);
        let tb = run(b, &prompt(3, 13), 6, precision, &mut sb);
        assert_eq!(tq, tb, "{precision:?}: tokens differ");
        assert!(sq.records.len() > 1000, "{}", sq.records.len());
        let (dq, db) = (digests(&sq), digests(&sb));
        assert_eq!(dq.len(), db.len());
        if let Some(i) = (0..dq.len()).find(|&i| dq[i] != db[i]) {
            panic!("{precision:?}: record {i} ({:?}) differs", sq.records[i].coord);
        }
    }
}

/// 130 prompt tokens reach the HCA compressor's first entry (rate 128), which a short run
/// never does; the persistent state (L2) after each step, logits and tokens agree bit for bit.
/// The CSA indexer still selects every entry (at most 33 < index_topk 512): its learned selection
/// needs more than 2,048 tokens of context.
#[test]
fn a_prompt_past_the_hca_rate_fills_an_hca_entry_and_traces_identically() {
    let (q, b) = models();
    let ids = prompt(7, 130);
    let levels = [Level::L0, Level::L1, Level::L2];
    let (mut sq, mut sb) = (MemorySink::with_levels(&levels), MemorySink::with_levels(&levels));
    let tq = run(q, &ids, 2, Precision::Bf16, &mut sq);
    let tb = run(b, &ids, 2, Precision::Bf16, &mut sb);
    assert_eq!(tq, tb);
    assert_eq!(digests(&sq), digests(&sb));
    let hca_entries = sq
        .by_path("state.compressor.compressed_kv")
        .filter(|r| r.coord.layer == Some(2))
        .map(|r| r.shape.first().copied().unwrap_or(0))
        .max();
    assert_eq!(hca_entries, Some(1), "layer 2 (HCA) holds one compressed entry");
}

/// The vllm-cpu profile (docs/operators.md §11) follows vLLM's forward shape: a prompt prefilled
/// in one step runs its GEMMs with M = the prompt's length (AMX above 4 rows, 256-wide mHC
/// blocks), a chunked prefill of one token with M = 1 (VDPBF16PS, 128-wide blocks), so the two
/// part, where the bf16 profile's records are chunking-invariant. Runs are deterministic.
#[test]
fn the_vllm_cpu_profile_follows_the_forwards_m_and_is_deterministic() {
    use moeconf_reference_runtime::model::StepOptions;
    let (q, _) = models();
    let ids = prompt(5, 6);
    let step0 = |precision: Precision, chunk: Option<usize>| {
        let opts = StepOptions {
            precision,
            combine: &NativeCombine,
            detokenizer: None,
            allow_non_finite: false,
        };
        let mut state = q.new_state();
        let mut sink = MemorySink::all();
        match chunk {
            Some(c) => q.step_chunked(&mut state, &ids, &opts, c, &mut sink),
            None => q.step(&mut state, &ids, &opts, &mut sink),
        }
        .expect("step");
        let mut d = digests(&sink);
        d.sort();
        d
    };
    assert_eq!(step0(Precision::Bf16, None), step0(Precision::Bf16, Some(1)));
    let whole = step0(Precision::VllmCpu, None);
    assert_eq!(whole, step0(Precision::VllmCpu, None));
    assert_ne!(whole, step0(Precision::VllmCpu, Some(1)));
    // A chunk of 5 tokens is a forward of M = 5 for its first 5 tokens, like the whole prompt.
    assert_ne!(
        step0(Precision::VllmCpu, Some(5)),
        step0(Precision::VllmCpu, Some(1))
    );
    let (mut s1, mut s2) = (MemorySink::all(), MemorySink::all());
    let t1 = run(q, &ids, 4, Precision::VllmCpu, &mut s1);
    let t2 = run(q, &ids, 4, Precision::VllmCpu, &mut s2);
    assert_eq!((t1, digests(&s1)), (t2, digests(&s2)));
}
