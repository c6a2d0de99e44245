//! `moeconf export gguf` end to end: a verified export, `--verify` of a good and of a tampered
//! file, and the bad inputs (a checkpoint outside llama.cpp's constraints, a file that is not a
//! GGUF, an output that is an input), each exit 2 with a message naming what is wrong.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn moeconf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .env(
            "MOECONF_CACHE_DIR",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("moeconf-fixtures"),
        )
        .output()
        .expect("spawn moeconf")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 test path")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn twin() -> PathBuf {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("moeconf-fixtures");
    moeconf_fixtures::ensure_builtin_in(moeconf_fixtures::BUILTIN_TINY_V4_FP8_BF16, &root).expect("fixture")
}

#[test]
fn export_verify_and_tampering() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("m.gguf");
    let o = moeconf(&[
        "export",
        "gguf",
        "--model",
        "builtin:tiny-v4-fp8-bf16",
        "--type",
        "bf16",
        "-o",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("264 tensors") && t.contains("bit-identical"), "{t}");
    let o = moeconf(&["export", "gguf", "--model", s(&twin()), "--verify", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).starts_with("verified"), "{}", text(&o));
    // One byte of the last tensor's data changed: the verification names the tensor.
    let mut bytes = std::fs::read(&out).expect("read");
    let n = bytes.len();
    bytes[n - 100] ^= 0x40;
    std::fs::write(&out, &bytes).expect("write");
    let o = moeconf(&[
        "export",
        "gguf",
        "--model",
        "builtin:tiny-v4-fp8-bf16",
        "--verify",
        s(&out),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("blk.8.ffn_up_shexp.weight element"),
        "{}",
        text(&o)
    );
}

#[test]
fn bad_inputs_exit_2_with_a_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("x.gguf");
    let o = moeconf(&["export", "gguf", "--model", "builtin:tiny-v4", "-o", s(&out)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("HCA compress rate is 16"), "{}", text(&o));
    assert!(!out.exists());
    std::fs::write(&out, b"not a gguf").expect("write");
    let o = moeconf(&[
        "export",
        "gguf",
        "--model",
        "builtin:tiny-v4-fp8-bf16",
        "--verify",
        s(&out),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("x.gguf") && text(&o).contains("not a GGUF file"),
        "{}",
        text(&o)
    );
    // The output may never be a model file.
    let model = twin();
    let target = model.join("config.json");
    let before = std::fs::read(&target).expect("read config");
    let o = moeconf(&["export", "gguf", "--model", s(&model), "-o", s(&target)]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(std::fs::read(&target).expect("read config"), before);
    let o = moeconf(&["export", "gguf", "--model", "builtin:tiny-v4-fp8-bf16"]);
    assert_eq!(o.status.code(), Some(2));
}
