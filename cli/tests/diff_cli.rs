//! `moeconf diff` as a process: exit codes 0 (equivalent), 1 (divergent) and
//! 2 (not comparable, unreadable), text and JSON output.

use moeconf_fingerprint::{Algorithm, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{Binding, CaptureSpec, Header, TraceWriter};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A small trace: two steps of tokens, logits and one layer's post-FFN state;
/// `bump` changes the layer state of step 1 and the token of step 1.
fn write(path: &Path, prompt: &str, bump: bool) {
    let binding = Binding {
        prompt: moeconf_schema::PromptBinding {
            text: prompt.into(),
            ids: vec![1, 2],
        },
        capture: CaptureSpec {
            levels: 0b11111,
            payload_levels: 0b11111,
        },
        ..Binding::default()
    };
    let mut w = TraceWriter::create(
        path,
        Algorithm::Blake3,
        Header {
            binding,
            ..Header::default()
        },
    )
    .unwrap();
    for step in 0..2u32 {
        let c = |layer: Option<u32>, path: &str| Coord {
            step,
            position: step + 1,
            phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
            layer,
            path: path.into(),
        };
        let changed = bump && step == 1;
        let state: Vec<u8> = [1.0f32, 2.0, if changed { 3.5 } else { 3.0 }]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        w.append(
            c(Some(0), "layer.post_ffn_mhc"),
            Level::L3,
            TensorView {
                dtype: DType::F32,
                shape: &[1, 3],
                bytes: &state,
            },
            true,
        )
        .unwrap();
        let tok = if changed { 9i32 } else { 4 + step as i32 }.to_le_bytes();
        w.append(
            c(None, "token.output"),
            Level::L0,
            TensorView {
                dtype: DType::I32,
                shape: &[1],
                bytes: &tok,
            },
            true,
        )
        .unwrap();
    }
    w.finish().unwrap();
}

fn moeconf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .env_remove("NO_COLOR")
        .output()
        .unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

struct Fixture {
    _dir: tempfile::TempDir,
    reference: PathBuf,
    same: PathBuf,
    divergent: PathBuf,
    other_prompt: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    write(&p("ref.bin"), "hello", false);
    write(&p("same.bin"), "hello", false);
    write(&p("div.bin"), "hello", true);
    write(&p("other.bin"), "goodbye", false);
    Fixture {
        reference: p("ref.bin"),
        same: p("same.bin"),
        divergent: p("div.bin"),
        other_prompt: p("other.bin"),
        _dir: dir,
    }
}

#[test]
fn exit_codes_follow_diff_and_cmp() {
    let f = fixture();
    let out = moeconf(&["diff", s(&f.reference), s(&f.same)]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("EQUIVALENT"), "{text}");
    assert!(!text.contains('\x1b'), "no colors when stdout is not a terminal");

    let out = moeconf(&["diff", s(&f.reference), s(&f.divergent)]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("DIVERGENT"), "{text}");
    let last = text.lines().last().unwrap();
    assert!(
        last.contains("first divergence: L3 step 1") && last.contains("layer 0"),
        "{last}"
    );

    let out = moeconf(&["diff", s(&f.reference), s(&f.other_prompt)]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("not comparable") && err.contains("prompt.text"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
    // --force compares anyway (the records are identical).
    let out = moeconf(&["diff", "--force", s(&f.reference), s(&f.other_prompt)]);
    assert_eq!(out.status.code(), Some(0));

    let missing = f.reference.with_file_name("missing.bin");
    let out = moeconf(&["diff", s(&f.reference), s(&missing)]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn json_output_is_one_versioned_document() {
    let f = fixture();
    let out = moeconf(&["diff", "--format", "json", s(&f.reference), s(&f.divergent)]);
    assert_eq!(out.status.code(), Some(1));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["schema_version"], 1);
    assert_eq!(j["verdict"], "divergent");
    assert_eq!(j["first_divergence"]["level"], "L3");
    assert_eq!(j["first_divergence"]["operator"], "layer.post_ffn_mhc");
    assert_eq!(j["levels"]["L0"]["ordinal"], 2);
    assert_eq!(j["levels"]["L3"]["numeric"]["max_abs_delta"], 0.5);

    let out = moeconf(&["diff", "--color", "always", s(&f.reference), s(&f.divergent)]);
    assert!(String::from_utf8(out.stdout).unwrap().contains('\x1b'));
}
