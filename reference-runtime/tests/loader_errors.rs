//! Loader errors: a missing, extra or mis-shaped tensor, an unsupported dtype
//! and a malformed config each give a clear error naming the tensor or key,
//! never a panic.

mod common;

use std::path::Path;

use common::fixture_dir;
use moeconf_reference_runtime::model::Model;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Copies the fixture into `dst`, letting `edit` change the tensor list.
fn variant(dst: &Path, edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
    let src = fixture_dir();
    std::fs::copy(src.join("config.json"), dst.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut list: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    edit(&mut list);
    let views: Vec<(String, TensorView<'_>)> = list
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_named() {
    let d = tempfile::tempdir().unwrap();
    variant(d.path(), |l| {
        l.retain(|t| t.0 != "layers.4.ffn.experts.17.w2.weight")
    });
    let msg = load_err(d.path());
    assert!(
        msg.contains("layers.4.ffn.experts.17.w2.weight") && msg.contains("missing"),
        "{msg}"
    );
    assert!(msg.contains("[256, 64]"), "{msg}");
}

#[test]
fn extra_tensor_is_named() {
    let d = tempfile::tempdir().unwrap();
    variant(d.path(), |l| {
        l.push((
            "layers.0.attn.bogus.weight".into(),
            Dtype::F32,
            vec![2],
            vec![0; 8],
        ))
    });
    let msg = load_err(d.path());
    assert!(
        msg.contains("layers.0.attn.bogus.weight") && msg.contains("unexpected"),
        "{msg}"
    );
}

#[test]
fn wrong_shape_names_expected_and_got() {
    let d = tempfile::tempdir().unwrap();
    variant(d.path(), |l| {
        let t = l.iter_mut().find(|t| t.0 == "layers.2.attn.wkv.weight").unwrap();
        t.2 = vec![256, 64];
    });
    let msg = load_err(d.path());
    assert!(msg.contains("layers.2.attn.wkv.weight"), "{msg}");
    assert!(msg.contains("expected shape [64, 256], got [256, 64]"), "{msg}");
}

#[test]
fn fp8_dtype_is_refused() {
    let d = tempfile::tempdir().unwrap();
    variant(d.path(), |l| {
        let t = l.iter_mut().find(|t| t.0 == "layers.3.attn.wq_a.weight").unwrap();
        t.1 = Dtype::F8_E4M3;
        t.3.truncate(t.3.len() / 2);
    });
    let msg = load_err(d.path());
    assert!(
        msg.contains("layers.3.attn.wq_a.weight") && msg.contains("F8_E4M3") && msg.contains("FP8"),
        "{msg}"
    );
}

#[test]
fn malformed_configs_name_the_key() {
    let d = tempfile::tempdir().unwrap();
    let src = fixture_dir();
    std::fs::copy(src.join("model.safetensors"), d.path().join("model.safetensors")).unwrap();
    let text = std::fs::read_to_string(src.join("config.json")).unwrap();
    let cases: Vec<(String, &str)> = vec![
        (text.replace("\"hidden_size\"", "\"hidden_sizeX\""), "hidden_size"),
        (
            text.replace("\"sliding_attention\"", "\"full_attention\""),
            "layer_types[0]",
        ),
        (
            text.replace(
                "\"scoring_func\": \"sqrtsoftplus\"",
                "\"scoring_func\": \"softmax\"",
            ),
            "scoring_func",
        ),
        (text.replace("\"o_groups\": 2", "\"o_groups\": 3"), "o_groups"),
        (
            text.replace("\"deepseek_v4\"", "\"deepseek_v3\""),
            "`model_type` = \"deepseek_v3\"",
        ),
        (
            text.replace("\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true"),
            "`tie_word_embeddings` = true",
        ),
        (
            text.replacen('{', "{\"mlp_bias\": true, ", 1),
            "`mlp_bias` = true",
        ),
        ("{ not json".to_string(), "invalid JSON"),
        (
            text.replace("\"vocab_size\": 1024", "\"vocab_size\": -3"),
            "invalid JSON",
        ),
    ];
    for (cfg, key) in cases {
        std::fs::write(d.path().join("config.json"), cfg).unwrap();
        let msg = load_err(d.path());
        assert!(
            msg.contains(key) && msg.contains("config.json"),
            "expected {key:?} in {msg}"
        );
    }
}

#[test]
fn truncated_safetensors_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    let src = fixture_dir();
    std::fs::copy(src.join("config.json"), d.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    std::fs::write(d.path().join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let msg = load_err(d.path());
    assert!(
        msg.contains("model.safetensors") && msg.contains("malformed"),
        "{msg}"
    );
}

#[test]
fn non_regular_safetensors_entries_are_named() {
    // A directory (formerly "No such device (os error 19)"), an empty file,
    // and on Unix a FIFO (opening it blocked forever) and a symlink loop.
    let d = tempfile::tempdir().unwrap();
    let src = fixture_dir();
    std::fs::copy(src.join("config.json"), d.path().join("config.json")).unwrap();
    std::fs::copy(src.join("model.safetensors"), d.path().join("model.safetensors")).unwrap();
    let dir = d.path().join("x.safetensors");
    std::fs::create_dir(&dir).unwrap();
    let msg = load_err(d.path());
    assert!(
        msg.ends_with("x.safetensors: is a directory, expected a safetensors file"),
        "{msg}"
    );
    std::fs::remove_dir(&dir).unwrap();
    let empty = d.path().join("a.safetensors");
    std::fs::write(&empty, b"").unwrap();
    let msg = load_err(d.path());
    assert!(
        msg.contains("a.safetensors: malformed safetensors file: 0 bytes"),
        "{msg}"
    );
    std::fs::remove_file(&empty).unwrap();
    #[cfg(unix)]
    {
        let fifo = d.path().join("f.safetensors");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        let msg = load_err(d.path());
        assert!(
            msg.ends_with("f.safetensors: is a FIFO (named pipe), expected a safetensors file"),
            "{msg}"
        );
        std::fs::remove_file(&fifo).unwrap();
        let lp = d.path().join("l.safetensors");
        std::os::unix::fs::symlink(&lp, &lp).unwrap();
        let msg = load_err(d.path());
        assert!(
            msg.contains("cannot access") && msg.contains("l.safetensors"),
            "{msg}"
        );
    }
}

/// An unreadable file names the file once and keeps the operating system's
/// reason as the source, so an error chain (anyhow's `{:#}`) says each once.
#[test]
fn io_errors_do_not_repeat_their_source() {
    let d = tempfile::tempdir().unwrap();
    let Err(e) = Model::load(&d.path().join("absent")) else {
        panic!("loading a missing directory should fail");
    };
    let mut parts = vec![e.to_string()];
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        parts.push(s.to_string());
        src = s.source();
    }
    assert!(parts.len() >= 2, "the I/O error is the source: {parts:?}");
    for (i, p) in parts.iter().enumerate() {
        for q in &parts[i + 1..] {
            assert!(!p.contains(q.as_str()), "{p:?} repeats its source {q:?}");
        }
    }
    assert!(parts[0].contains("absent"), "{parts:?}");
}
