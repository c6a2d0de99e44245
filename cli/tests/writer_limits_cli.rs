//! Writers obey the reader (docs/format.md §10), end to end: `import` and
//! `run` refuse (exit 2, naming the file and the field, writing nothing)
//! a trace whose header `inspect` would refuse, instead of exiting 0 with
//! it, so a `git bisect run` script that imports a candidate stops on the
//! error instead of gating an unreadable trace (which `--bisect-exit-codes`
//! would turn into 125, "skip").

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

fn moeconf(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn moeconf")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A dump directory with one `token.output` tensor and a manifest with
/// `extra_fields` spliced in (and `decoding` as given).
fn dump(dir: &Path, decoding: &str, extra_fields: &str) -> PathBuf {
    let d = dir.join("dump");
    std::fs::create_dir_all(&d).unwrap();
    let z = "0".repeat(64);
    std::fs::write(
        d.join("manifest.json"),
        format!(
            r#"{{"model": {{"name": "m", "config_digest": "{z}", "weights_digest": "{z}"}},
 "tokenizer": {{"digest": "{z}"}}, "prompt": {{"text": "a", "ids": [1]}}, "max_new_tokens": 2,
 "decoding": "{decoding}", "precision": "bf16", "contract": "native", "schedule": "identity",
 "runtime": {{"name": "t", "version": "1"}}{extra_fields}}}"#
        ),
    )
    .unwrap();
    let ids = 7i32.to_le_bytes();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![1], &ids).unwrap();
    safetensors::serialize_to_file(
        vec![("step.0.pos.0.token.output", view)],
        None,
        &d.join("a.safetensors"),
    )
    .unwrap();
    d
}

fn refused(o: &Output, needles: &[&str], out: &Path) {
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{e}");
    for n in needles {
        assert!(e.contains(n), "stderr lacks {n:?}: {e}");
    }
    assert!(!out.exists(), "a trace the reader refuses was written");
    let dir = out.parent().unwrap();
    let tmp: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(tmp.is_empty(), "temporary files left: {tmp:?}");
}

#[test]
fn import_refuses_a_manifest_whose_trace_the_reader_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cand.bin");
    // The reader caps the decoding strategy at 64 bytes.
    let d = dump(dir.path(), &"g".repeat(65), "");
    let o = moeconf(&["import", s(&d), "-o", s(&out)]);
    refused(
        &o,
        &["manifest.json", "decoding strategy", "exceeds the limit 64"],
        &out,
    );
    std::fs::remove_dir_all(&d).unwrap();
    // ... and a header's extras at 4096.
    let extra: Vec<String> = (0..4097).map(|i| format!("\"k{i:05}\": \"v\"")).collect();
    let d = dump(
        dir.path(),
        "greedy",
        &format!(", \"extra\": {{{}}}", extra.join(", ")),
    );
    let o = moeconf(&["import", s(&d), "-o", s(&out)]);
    refused(
        &o,
        &["manifest.json", "binding extras", "exceeds the limit 4096"],
        &out,
    );
    std::fs::remove_dir_all(&d).unwrap();
    // At the limits, the import is accepted and inspect verifies it.
    let d = dump(dir.path(), &"g".repeat(64), "");
    let o = moeconf(&["import", s(&d), "-o", s(&out)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(moeconf(&["inspect", s(&out)]).status.success());
}

#[test]
fn run_refuses_a_prompt_longer_than_the_readers_string_cap_before_running() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = dir.path().join("prompt.txt");
    // Words, so that the prompt is within the token limit but over the 1 MiB string cap.
    let text = "why the sheep ".repeat((1 << 20) / 14 + 1);
    assert!(text.len() > 1 << 20);
    std::fs::write(&prompt, text).unwrap();
    let out = dir.path().join("big.bin");
    let o = moeconf(&[
        "run",
        "--prompt-file",
        s(&prompt),
        "--max-new-tokens",
        "1",
        // Small enough for any machine's memory estimate: the refusal
        // under test is the string cap's.
        "--capture",
        "L0",
        "--prefill-chunk",
        "256",
        "-o",
        s(&out),
    ]);
    refused(&o, &["big.bin", "prompt text", "exceeds the limit 1048576"], &out);
}
