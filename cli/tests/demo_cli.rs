//! The README's main job: `moeconf demo` traces the built-in model natively
//! and with one B-class reduction at layer 5, and the report localizes it.

use std::process::Command;

#[test]
fn demo_localizes_the_injected_reduction() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(["demo", "--out-dir"])
        .arg(dir.path())
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("DIVERGENT"), "{out}");
    let last = out
        .lines()
        .find(|l| l.starts_with("first divergence:"))
        .unwrap_or_else(|| panic!("no summary line in {out}"));
    assert!(
        last.contains("step 1") && last.contains("layer 5") && last.contains("moe.combine"),
        "{last}"
    );
    assert!(last.contains("candidate contract: b+order=class:135"), "{last}");
    assert!(dir.path().join("ref.bin").exists() && dir.path().join("cand.bin").exists());

    // JSON form of the same report.
    let o = Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(["demo", "--format", "json", "--out-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["verdict"], "divergent");
    assert_eq!(v["first_divergence"]["step"], 1);
    assert_eq!(v["first_divergence"]["layer"], 5);
    assert_eq!(v["first_divergence"]["operator"], "moe.combine");
}
