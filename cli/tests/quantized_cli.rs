//! The quantized fixture end to end, and hostile quantized checkpoints.
//!
//! `moeconf run` traces `builtin:tiny-v4-fp8` (FP8 E4M3 dense projections with UE8M0 block
//! scales, MXFP4 experts, an MTP block) and its exact BF16 dequantization
//! `builtin:tiny-v4-fp8-bf16`; `moeconf diff --force` finds them equivalent at every level
//! and lists the weight formats among the binding differences. Every broken variant of the
//! quantized checkpoint (missing or mis-shaped scales, a UE8M0 NaN scale, an E4M3 NaN
//! weight, an overflowing scale, packed sizes that do not match, FP4 where FP8 is expected
//! and the reverse, FP8 tensors under a config without `quantization_config`, unsupported
//! `quantization_config` values) exits 2 naming the file, the tensor or key, what was
//! expected and what was found; no trace is left behind.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::TensorView;
use safetensors::Dtype;

fn moeconf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .output()
        .expect("spawn moeconf")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 test path")
}

/// The materialized quantized fixture (generated once under cargo's target temp dir).
fn fixture() -> PathBuf {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("moeconf-fixtures");
    moeconf_fixtures::ensure_builtin_in(moeconf_fixtures::BUILTIN_TINY_V4_FP8, &root).expect("fixture")
}

type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

/// A copy of the quantized fixture in `dst` with its tensor list and config edited.
fn variant(dst: &Path, edit: impl FnOnce(&mut Tensors), edit_config: impl FnOnce(&mut serde_json::Value)) {
    let src = fixture();
    std::fs::copy(src.join("tokenizer.json"), dst.join("tokenizer.json")).expect("copy");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).expect("read")).expect("json");
    edit_config(&mut config);
    std::fs::write(dst.join("config.json"), config.to_string()).expect("write");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut list: Tensors = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    edit(&mut list);
    let views: Vec<(String, TensorView<'_>)> = list
        .iter()
        .map(|(n, d, sh, b)| (n.clone(), TensorView::new(*d, sh.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).expect("write");
}

fn tensor<'a>(l: &'a mut Tensors, name: &str) -> &'a mut (String, Dtype, Vec<usize>, Vec<u8>) {
    l.iter_mut()
        .find(|t| t.0 == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
}

/// Runs the model in `dir` and asserts exit 2, no trace, and every needle in stderr.
fn refused(dir: &Path, needles: &[&str]) {
    let out = dir.join("t.bin");
    let o = moeconf(&[
        "run",
        "--model",
        s(dir),
        "--prompt",
        "x",
        "--max-new-tokens",
        "1",
        "-o",
        s(&out),
    ]);
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "expected exit 2: {e}");
    assert!(!out.exists(), "a trace was left behind");
    for n in needles {
        assert!(e.contains(n), "stderr does not contain {n:?}: {e}");
    }
}

#[test]
fn the_quantized_fixture_traces_like_its_bf16_dequantization() {
    let d = tempfile::tempdir().expect("tempdir");
    let (a, b) = (d.path().join("fp8.bin"), d.path().join("bf16.bin"));
    for (model, out) in [
        (moeconf_fixtures::BUILTIN_TINY_V4_FP8, &a),
        (moeconf_fixtures::BUILTIN_TINY_V4_FP8_BF16, &b),
    ] {
        let o = moeconf(&[
            "run",
            "--model",
            model,
            "--prompt",
            "why the sheep",
            "--max-new-tokens",
            "6",
            "-o",
            s(out),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    // Different checkpoints: refused without --force, naming the weights digest.
    let o = moeconf(&["diff", s(&a), s(&b)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("model.weights_digest"));
    let o = moeconf(&["diff", "--force", s(&a), s(&b)]);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(0), "{text}");
    assert!(text.contains("EQUIVALENT"), "{text}");
    assert!(
        text.contains("model.weight_formats: dense fp8-e4m3 (UE8M0 128x128 scales), experts mxfp4 (E2M1, UE8M0 per 32) -> dense bf16, experts bf16"),
        "{text}"
    );
    // The bf16 profile differs from the f32 one on the quantized fixture too (the run is real).
    let c = d.path().join("f32.bin");
    let o = moeconf(&[
        "run",
        "--model",
        moeconf_fixtures::BUILTIN_TINY_V4_FP8,
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "6",
        "--precision",
        "f32",
        "--contract",
        "p32",
        "-o",
        s(&c),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = moeconf(&["diff", s(&a), s(&c)]);
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stdout));
}

/// `moeconf run` traces the vLLM fixture `builtin:tiny-v4-vllm` (the released format at the
/// sizes vLLM's CPU path accepts) and its BF16 twin; `diff --force` finds them equivalent.
/// Both are materialized under cargo's target temp dir (`MOECONF_CACHE_DIR`), not the user's.
#[test]
fn the_vllm_fixture_runs_and_traces_like_its_bf16_twin() {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("moeconf-fixtures");
    let d = tempfile::tempdir().expect("tempdir");
    let (a, b) = (d.path().join("vllm.bin"), d.path().join("vllm-bf16.bin"));
    for (model, out) in [
        (moeconf_fixtures::BUILTIN_TINY_V4_VLLM, &a),
        (moeconf_fixtures::BUILTIN_TINY_V4_VLLM_BF16, &b),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_moeconf"))
            .args([
                "run",
                "--model",
                model,
                "--prompt",
                "why the sheep",
                "--max-new-tokens",
                "4",
            ])
            .args(["-o", s(out)])
            .env("MOECONF_CACHE_DIR", &cache)
            .output()
            .expect("spawn moeconf");
        assert!(
            o.status.success(),
            "{model}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let o = moeconf(&["diff", "--force", s(&a), s(&b)]);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(0), "{text}");
    assert!(text.contains("EQUIVALENT"), "{text}");
    assert!(
        text.contains("model.weight_formats: dense fp8-e4m3 (UE8M0 128x128 scales), experts mxfp4 (E2M1, UE8M0 per 32) -> dense bf16, experts bf16"),
        "{text}"
    );
}

/// A `--model` that is neither a directory nor a built-in name is refused with every
/// built-in name listed, the vLLM fixtures included; an unknown `builtin:` name likewise.
#[test]
fn model_errors_list_every_builtin() {
    let d = tempfile::tempdir().expect("tempdir");
    let out = d.path().join("t.bin");
    for model in [s(&d.path().join("missing")), "builtin:tiny-v5"] {
        let o = moeconf(&["run", "--model", model, "--prompt", "x", "-o", s(&out)]);
        let e = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(2), "{e}");
        assert!(!out.exists());
        for name in moeconf_fixtures::BUILTIN_NAMES {
            assert!(e.contains(name), "{model}: {name} not listed: {e}");
        }
    }
}

#[test]
fn missing_and_misshaped_scales_are_named() {
    let d = tempfile::tempdir().expect("tempdir");
    variant(
        d.path(),
        |l| l.retain(|t| t.0 != "layers.2.attn.wkv.scale"),
        |_| {},
    );
    refused(
        d.path(),
        &[
            "layers.2.attn.wkv.scale",
            "missing",
            "F8_E8M0 shape [2, 2]",
            "layers.2.attn.wkv.weight",
        ],
    );
    let d = tempfile::tempdir().expect("tempdir");
    variant(
        d.path(),
        |l| tensor(l, "layers.2.attn.wkv.scale").2 = vec![1, 4],
        |_| {},
    );
    refused(
        d.path(),
        &[
            "model.safetensors",
            "layers.2.attn.wkv.scale",
            "expected shape [2, 2]",
            "got [1, 4]",
        ],
    );
    let d = tempfile::tempdir().expect("tempdir");
    variant(
        d.path(),
        |l| {
            let t = tensor(l, "layers.0.ffn.experts.3.w2.scale");
            t.1 = Dtype::F32;
            t.2 = vec![256, 1];
        },
        |_| {},
    );
    refused(
        d.path(),
        &[
            "layers.0.ffn.experts.3.w2.scale",
            "expected F8_E8M0",
            "found F32 [256, 1]",
        ],
    );
}

#[test]
fn nan_and_overflowing_codes_are_named() {
    let d = tempfile::tempdir().expect("tempdir");
    variant(
        d.path(),
        |l| tensor(l, "layers.4.ffn.experts.17.w1.scale").3[9] = 0xFF,
        |_| {},
    );
    refused(
        d.path(),
        &[
            "layers.4.ffn.experts.17.w1.scale",
            "element (1, 1) = 0xff",
            "UE8M0 NaN",
        ],
    );
    let d = tempfile::tempdir().expect("tempdir");
    variant(
        d.path(),
        |l| tensor(l, "layers.1.attn.wo_b.scale").3[0] = 250,
        |_| {},
    );
    refused(d.path(), &["layers.1.attn.wo_b.scale", "2^123", "overflows FP32"]);
    let d = tempfile::tempdir().expect("tempdir");
    variant(
        d.path(),
        |l| tensor(l, "layers.0.attn.wq_a.weight").3[300] = 0x7F,
        |_| {},
    );
    refused(
        d.path(),
        &["layers.0.attn.wq_a.weight", "element (1, 44)", "NaN code 0x7f"],
    );
}

#[test]
fn packed_sizes_and_formats_must_match_the_config() {
    // An expert stored unpacked (one byte per value).
    let d = tempfile::tempdir().expect("tempdir");
    variant(
        d.path(),
        |l| {
            let t = tensor(l, "layers.5.ffn.experts.2.w3.weight");
            t.2 = vec![128, 256];
            t.3 = vec![0; 128 * 256];
        },
        |_| {},
    );
    refused(
        d.path(),
        &[
            "layers.5.ffn.experts.2.w3.weight",
            "expected shape [128, 128], got [128, 256]",
            "packed MXFP4",
        ],
    );
    // FP4 where FP8 is expected.
    let d = tempfile::tempdir().expect("tempdir");
    variant(
        d.path(),
        |l| {
            let t = tensor(l, "layers.0.attn.wq_a.weight");
            t.1 = Dtype::I8;
            t.2 = vec![128, 128];
            t.3.truncate(128 * 128);
        },
        |_| {},
    );
    refused(
        d.path(),
        &[
            "layers.0.attn.wq_a.weight",
            "expected F8_E4M3",
            "found I8 [128, 128]",
        ],
    );
    // FP8 where FP4 is expected.
    let d = tempfile::tempdir().expect("tempdir");
    variant(
        d.path(),
        |l| {
            let t = tensor(l, "layers.3.ffn.experts.0.w1.weight");
            t.1 = Dtype::F8_E4M3;
            t.2 = vec![128, 256];
            t.3 = vec![0x38; 128 * 256];
        },
        |_| {},
    );
    refused(
        d.path(),
        &[
            "layers.3.ffn.experts.0.w1.weight",
            "expected I8 or U8 packed MXFP4",
            "found F8_E4M3 [128, 256]",
        ],
    );
    // FP8 tensors under a config that declares no quantization.
    let d = tempfile::tempdir().expect("tempdir");
    variant(
        d.path(),
        |_| {},
        |c| {
            let m = c.as_object_mut().expect("object");
            m.remove("quantization_config");
            m.remove("expert_dtype");
        },
    );
    refused(
        d.path(),
        &[
            "model.safetensors",
            "expected BF16 or F32",
            "found F8_E4M3",
            "quantization_config",
        ],
    );
}

#[test]
fn unsupported_quantization_configs_are_refused_by_key() {
    for (edit, needle) in [
        (
            (|c: &mut serde_json::Value| c["quantization_config"]["quant_method"] = "gptq".into())
                as fn(&mut serde_json::Value),
            "key `quantization_config.quant_method` = \"gptq\" is unsupported",
        ),
        (
            |c| c["quantization_config"]["weight_block_size"] = serde_json::json!([64, 64]),
            "key `quantization_config.weight_block_size` = [64,64] is unsupported",
        ),
        (
            |c| c["quantization_config"]["scale_fmt"] = "fp32".into(),
            "key `quantization_config.scale_fmt` = \"fp32\" is unsupported",
        ),
        (
            |c| c["expert_dtype"] = "nvfp4".into(),
            "key `expert_dtype` = \"nvfp4\" is unsupported",
        ),
    ] {
        let d = tempfile::tempdir().expect("tempdir");
        variant(d.path(), |_| {}, edit);
        refused(d.path(), &["config.json", needle]);
    }
}
