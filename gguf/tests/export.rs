//! The export of the llama.cpp fixture to GGUF, read back: metadata as llama.cpp's
//! `deepseek4` loader reads it, tensor names / dimensions / types, bit-identical values, and
//! the errors for inputs that are not such an export.

use std::path::{Path, PathBuf};

use moeconf_gguf::deepseek4::ExportType;
use moeconf_gguf::read::GgufFile;
use moeconf_gguf::value::Value;
use moeconf_gguf::write::{write_gguf, TensorInfo};
use moeconf_gguf::{export, verify, GgmlType, GgufError};
use moeconf_reference_runtime::weights::LinearFormat;

/// The quantized fixture (FP8 dense, MXFP4 experts; CSA 4 / HCA 128, index_head_dim 128: within
/// llama.cpp's deepseek4 constraints).
fn fixture() -> PathBuf {
    moeconf_fixtures::ensure_builtin(moeconf_fixtures::BUILTIN_TINY_V4_FP8).expect("fixture")
}

/// Its exact BF16 dequantization.
fn twin() -> PathBuf {
    moeconf_fixtures::ensure_builtin(moeconf_fixtures::BUILTIN_TINY_V4_FP8_BF16).expect("fixture")
}

fn u(file: &GgufFile, k: &str) -> u64 {
    file.get(k)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("{k}"))
}

#[test]
fn f32_and_bf16_exports_hold_the_deepseek4_metadata_and_verify_bit_for_bit() {
    let dir = fixture();
    let tmp = tempfile::tempdir().expect("tempdir");
    for (ty, want_matrix) in [
        (ExportType::F32, GgmlType::F32),
        (ExportType::Bf16, GgmlType::Bf16),
    ] {
        let out = tmp.path().join(format!("m-{}.gguf", ty.name()));
        let s = export(&dir, &out, ty, "builtin:tiny-v4-fp8").expect("export");
        let f = GgufFile::open(&out).expect("open");
        assert_eq!(f.architecture(), Some("deepseek4"));
        assert_eq!(u(&f, "deepseek4.block_count"), 9);
        assert_eq!(u(&f, "deepseek4.embedding_length"), 256);
        assert_eq!(u(&f, "deepseek4.expert_count"), 32);
        assert_eq!(u(&f, "deepseek4.expert_used_count"), 6);
        assert_eq!(u(&f, "deepseek4.hash_layer_count"), 3);
        assert_eq!(u(&f, "deepseek4.attention.indexer.key_length"), 128);
        assert_eq!(u(&f, "deepseek4.expert_gating_func"), 4);
        let ratios: Vec<u64> = f
            .get("deepseek4.attention.compress_ratios")
            .and_then(Value::as_array)
            .expect("ratios")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert_eq!(ratios, vec![0, 0, 4, 128, 4, 128, 4, 128, 0]);
        assert_eq!(f.get("tokenizer.ggml.pre").and_then(Value::as_str), Some("gpt-2"));
        assert_eq!(
            f.get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(|a| a.len()),
            Some(1024)
        );
        // Stacked experts: ne = [cols, rows, E], in the export type; vectors stay F32; tid2eid I32.
        let g = f.tensor("blk.3.ffn_gate_exps.weight").expect("gate exps");
        assert_eq!((g.ne.clone(), g.ty), (vec![256, 128, 32], Some(want_matrix)));
        let dn = f.tensor("blk.3.ffn_down_exps.weight").expect("down exps");
        assert_eq!(dn.ne, vec![128, 256, 32]);
        // FP8 dense projections: their exact values in the export type.
        assert_eq!(
            f.tensor("blk.3.attn_q_b.weight").map(|t| (t.ne.clone(), t.ty)),
            Some((vec![128, 1536], Some(want_matrix)))
        );
        assert_eq!(
            f.tensor("blk.3.attn_norm.weight").and_then(|t| t.ty),
            Some(GgmlType::F32)
        );
        assert_eq!(
            f.tensor("blk.3.hc_attn_fn.weight").map(|t| (t.ne.clone(), t.ty)),
            Some((vec![1024, 24], Some(GgmlType::F32)))
        );
        let tid = f.tensor("blk.0.ffn_gate_tid2eid.weight").expect("tid2eid");
        assert_eq!((tid.ne.clone(), tid.ty), (vec![6, 1024], Some(GgmlType::I32)));
        assert!(f.tensor("blk.0.exp_probs_b.bias").is_none());
        assert!(f.tensor("blk.3.exp_probs_b.bias").is_some());
        // CSA layers have the indexer, HCA layers only the compressor, sliding layers neither.
        assert!(f.tensor("blk.2.indexer_compressor_kv.weight").is_some());
        assert!(f.tensor("blk.3.indexer_compressor_kv.weight").is_none());
        assert_eq!(
            f.tensor("blk.3.attn_compressor_ape.weight").map(|t| t.ne.clone()),
            Some(vec![192, 128])
        );
        assert!(f.tensor("blk.0.attn_compressor_kv.weight").is_none());
        // Expert 5 of layer 3 is the 6th slice of the stack, equal to its checkpoint tensor.
        let stack = f.tensor_f32("blk.3.ffn_up_exps.weight").expect("up exps");
        let ckpt = moeconf_gguf::source::Checkpoint::open(&dir).expect("ckpt");
        // (read through the runtime's loader from the MXFP4 checkpoint; compared as values:
        // ggml dequantizes the -0 code to +0).
        let e5 = ckpt
            .matrix_values("layers.3.ffn.experts.5.w3.weight", 128, 256, LinearFormat::Mxfp4)
            .expect("w3");
        assert_eq!(&stack[5 * 128 * 256..6 * 128 * 256], &e5[..]);
        // Every value was compared, and verifying the file again from disk agrees.
        assert_eq!(s.tensors, f.tensors.len());
        assert!(s.values_verified > 10_000_000, "{}", s.values_verified);
        assert_eq!(verify(&dir, &out, "x").expect("verify"), s);
    }
}

#[test]
fn native_export_keeps_mxfp4_experts_bit_for_bit_and_equals_the_bf16_twin() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let native = tmp.path().join("n.gguf");
    let s = export(&fixture(), &native, ExportType::Native, "n").expect("export");
    let f = GgufFile::open(&native).expect("open");
    let g = f.tensor("blk.4.ffn_down_exps.weight").expect("down exps");
    assert_eq!(
        (g.ne.clone(), g.ty, g.bytes),
        (
            vec![128, 256, 32],
            Some(GgmlType::Mxfp4),
            128 / 32 * 17 * 256 * 32
        )
    );
    // Dense projections (FP8 in the checkpoint) are BF16: this ggml has no block-scaled FP8 type.
    assert_eq!(
        f.tensor("blk.4.attn_wkv.weight")
            .or(f.tensor("blk.4.attn_kv.weight"))
            .and_then(|t| t.ty),
        Some(GgmlType::Bf16)
    );
    assert!(
        s.mxfp4_negative_zeros > 0,
        "the fixture's MXFP4 experts hold -0 codes"
    );
    // The BF16 twin's bf16 export holds the same values, bit for bit (up to ggml's +0 for -0).
    let b = tmp.path().join("b.gguf");
    export(&twin(), &b, ExportType::Bf16, "b").expect("export twin");
    let fb = GgufFile::open(&b).expect("open");
    for t in [
        "blk.4.ffn_down_exps.weight",
        "blk.2.attn_q_b.weight",
        "output.weight",
    ] {
        let (x, y) = (f.tensor_f32(t).expect("native"), fb.tensor_f32(t).expect("twin"));
        assert_eq!(x.len(), y.len());
        assert!(x.iter().zip(&y).all(|(a, b)| a == b), "{t}");
    }
}

/// Rewrites `src` into `dst` with `edit` applied to (metadata, tensors with their data).
fn rewrite(
    src: &Path,
    dst: &Path,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<(TensorInfo, Vec<u8>)>),
) {
    let f = GgufFile::open(src).expect("open");
    let mut kvs = f.kvs.clone();
    let mut tensors: Vec<(TensorInfo, Vec<u8>)> = f
        .tensors
        .iter()
        .map(|t| {
            (
                TensorInfo {
                    name: t.name.clone(),
                    ne: t.ne.clone(),
                    ty: t.ty.expect("known type"),
                },
                f.tensor_bytes(t).to_vec(),
            )
        })
        .collect();
    edit(&mut kvs, &mut tensors);
    let infos: Vec<TensorInfo> = tensors.iter().map(|(i, _)| i.clone()).collect();
    write_gguf(dst, &kvs, &infos, |i, w| {
        w.write_all(&tensors[i].1).map_err(|e| GgufError::Io {
            path: dst.to_path_buf(),
            source: e,
        })
    })
    .expect("write");
}

#[test]
fn verification_names_what_differs() {
    let dir = twin();
    let tmp = tempfile::tempdir().expect("tempdir");
    let good = tmp.path().join("good.gguf");
    export(&dir, &good, ExportType::Bf16, "m").expect("export");
    let bad = tmp.path().join("bad.gguf");
    let msg = |e: GgufError| e.to_string();

    // One bit of one expert weight flipped.
    rewrite(&good, &bad, |_, t| {
        let (_, data) = t
            .iter_mut()
            .find(|(i, _)| i.name == "blk.4.ffn_down_exps.weight")
            .expect("tensor");
        data[1000] ^= 0x01;
    });
    let e = msg(verify(&dir, &bad, "m").unwrap_err());
    assert!(
        e.contains("blk.4.ffn_down_exps.weight") && e.contains("element 500"),
        "{e}"
    );

    // A tensor removed.
    rewrite(&good, &bad, |_, t| {
        t.retain(|(i, _)| i.name != "blk.2.indexer.proj.weight")
    });
    let e = msg(verify(&dir, &bad, "m").unwrap_err());
    assert!(
        e.contains("blk.2.indexer.proj.weight") && e.contains("missing"),
        "{e}"
    );

    // Another architecture.
    rewrite(&good, &bad, |kv, _| {
        for (k, v) in kv.iter_mut() {
            if k == "general.architecture" {
                *v = Value::Str("llama".into());
            }
        }
    });
    let e = msg(verify(&dir, &bad, "m").unwrap_err());
    assert!(e.contains("\"llama\"") && e.contains("deepseek4"), "{e}");

    // A changed hyperparameter.
    rewrite(&good, &bad, |kv, _| {
        for (k, v) in kv.iter_mut() {
            if k == "deepseek4.attention.indexer.top_k" {
                *v = Value::U32(8);
            }
        }
    });
    let e = msg(verify(&dir, &bad, "m").unwrap_err());
    assert!(e.contains("deepseek4.attention.indexer.top_k"), "{e}");

    // Not a GGUF at all, and a truncated one: errors naming the file, no panic.
    std::fs::write(&bad, b"not a gguf file").expect("write");
    let e = msg(GgufFile::open(&bad).unwrap_err());
    assert!(e.contains("bad.gguf") && e.contains("magic"), "{e}");
    let bytes = std::fs::read(&good).expect("read");
    for cut in [3usize, 20, 1000, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&bad, &bytes[..cut]).expect("write");
        assert!(GgufFile::open(&bad).is_err(), "truncated at {cut} accepted");
    }
}

#[test]
fn checkpoints_outside_the_loader_constraints_are_refused() {
    // The tiny fixture's HCA rate 16 is not one llama.cpp loads.
    let dir = moeconf_fixtures::ensure_builtin(moeconf_fixtures::BUILTIN_TINY_V4).expect("fixture");
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("x.gguf");
    let e = export(&dir, &out, ExportType::F32, "m").unwrap_err().to_string();
    assert!(
        e.contains("config.json") && e.contains("HCA compress rate is 16") && e.contains("0, 4 or 128"),
        "{e}"
    );
    assert!(!out.exists());
}

#[test]
fn a_checkpoint_missing_a_tensor_is_refused_by_name() {
    let src = twin();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("m");
    std::fs::create_dir(&dir).expect("mkdir");
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.join(f)).expect("copy");
    }
    // Rewrite the safetensors without one tensor.
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let keep: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "layers.5.attn.compressor.norm.weight")
        .collect();
    safetensors::serialize_to_file(keep, None, &dir.join("model.safetensors")).expect("write");
    let e = export(&dir, &tmp.path().join("x.gguf"), ExportType::F32, "m")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layers.5.attn.compressor.norm.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn every_metadata_value_type_round_trips() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = tmp.path().join("v.gguf");
    let kvs = vec![
        ("a".to_string(), Value::U8(7)),
        ("b".to_string(), Value::I8(-7)),
        ("c".to_string(), Value::U16(700)),
        ("d".to_string(), Value::I16(-700)),
        ("e".to_string(), Value::U32(70_000)),
        ("f".to_string(), Value::I32(-70_000)),
        ("g".to_string(), Value::F32(0.5)),
        ("h".to_string(), Value::Bool(true)),
        ("i".to_string(), Value::Str("δ".into())),
        ("j".to_string(), Value::U64(1 << 40)),
        ("k".to_string(), Value::I64(-(1 << 40))),
        ("l".to_string(), Value::F64(0.25)),
        ("m".to_string(), Value::strs(["x", "y z"])),
        ("n".to_string(), Value::u32s([])),
    ];
    let t = vec![TensorInfo {
        name: "t".into(),
        ne: vec![32, 2],
        ty: GgmlType::Mxfp4,
    }];
    write_gguf(&p, &kvs, &t, |_, w| {
        w.write_all(&[0u8; 34]).map_err(|e| GgufError::Io {
            path: p.clone(),
            source: e,
        })
    })
    .expect("write");
    let f = GgufFile::open(&p).expect("open");
    assert_eq!(f.kvs, kvs);
    assert_eq!(
        f.tensor("t").map(|t| (t.bytes, t.ty)),
        Some((34, Some(GgmlType::Mxfp4)))
    );
    // A fill of the wrong length is refused and leaves no file.
    let q = tmp.path().join("w.gguf");
    assert!(
        write_gguf(&q, &kvs, &t, |_, w| w.write_all(&[0u8; 33]).map_err(|e| {
            GgufError::Io {
                path: q.clone(),
                source: e,
            }
        }))
        .is_err()
    );
    assert!(!q.exists());
}
