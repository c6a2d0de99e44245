//! End-to-end: `moeconf run` writes traces of the built-in model, `moeconf
//! inspect` reads them back in both formats, and bad input exits 2 with a
//! message naming the file.

use std::path::Path;
use std::process::{Command, Output};

mod common;
use common::run_args;

fn moeconf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .output()
        .expect("spawn moeconf")
}

fn run_trace(out: &Path, extra: &[&str]) -> Output {
    moeconf(&run_args(out, "4", extra))
}

fn root_of(path: &Path) -> String {
    let o = moeconf(&["inspect", path.to_str().unwrap(), "--format", "json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["root"].as_str().unwrap().to_string()
}

#[test]
fn run_then_inspect_text_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("ref.bin");
    let o = run_trace(&t, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let o = moeconf(&["inspect", t.to_str().unwrap()]);
    assert!(o.status.success());
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.contains("prompt     \"why the sheep\""), "{text}");
    assert!(text.contains("decoding   greedy, 4 new tokens"), "{text}");
    assert!(text.contains("contract native"), "{text}");
    assert!(text.contains("layer.post_ffn_mhc"), "{text}");
    assert!(text.contains("verified   every byte"), "{text}");

    let o = moeconf(&["inspect", t.to_str().unwrap(), "--format", "json"]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["schema_version"], 1);
    assert_eq!(v["algorithm"], "blake3");
    assert_eq!(v["binding"]["prompt"]["text"], "why the sheep");
    assert_eq!(v["binding"]["decoding"]["max_new_tokens"], 4);
    assert_eq!(v["steps"]["count"], 4);
    assert_eq!(v["records"]["payloads_present"], true);
    for level in ["L0", "L1", "L2", "L3", "L4"] {
        assert!(
            v["records"]["by_level"][level]["records"].as_u64().unwrap() > 0,
            "{level}"
        );
    }
    // Default capture: payloads for L1 and L3, fingerprints only for big L4 tensors.
    let comps = &v["records"]["by_level"]["L4"]["components"];
    assert_eq!(comps["moe.combine"]["payloads"], 0);
    assert!(
        v["records"]["by_level"]["L3"]["components"]["layer.post_ffn_mhc"]["payloads"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[test]
fn root_does_not_depend_on_threads_or_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut roots = Vec::new();
    for threads in ["1", "2", "4", "2"] {
        let t = dir.path().join(format!("t{}.bin", roots.len()));
        let o = run_trace(&t, &["--threads", threads]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        roots.push(root_of(&t));
    }
    assert!(roots.windows(2).all(|w| w[0] == w[1]), "{roots:?}");
    // Two runs with the same thread count are byte-identical files.
    let a = std::fs::read(dir.path().join("t1.bin")).unwrap();
    let b = std::fs::read(dir.path().join("t3.bin")).unwrap();
    assert_eq!(a, b);
}

/// A chunked prefill (`--prefill-chunk`) changes no record: the root is the
/// unchunked run's, `diff` says equivalent, and the provenance names the
/// chunk size; 0 is refused before anything runs.
#[test]
fn root_does_not_depend_on_the_prefill_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole.bin");
    let o = run_trace(&whole, &["--capture", "all"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for chunk in ["1", "2", "3"] {
        let t = dir.path().join(format!("chunk{chunk}.bin"));
        let o = run_trace(&t, &["--capture", "all", "--prefill-chunk", chunk]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(root_of(&t), root_of(&whole), "chunks of {chunk}");
        let o = moeconf(&["diff", whole.to_str().unwrap(), t.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stdout));
        let o = moeconf(&["inspect", t.to_str().unwrap(), "--format", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let notes = v["provenance"]["notes"].to_string();
        assert!(
            notes.contains("prefill_chunk") && notes.contains(chunk),
            "{notes}"
        );
    }
    let bad = dir.path().join("zero.bin");
    let o = run_trace(&bad, &["--prefill-chunk", "0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(!bad.exists());
}

/// Batched decoding (`--batch-with`) changes no record of the traced
/// sequence: the root is the solo run's, `diff` says equivalent, and the
/// provenance names the batch size; a batched prompt with no tokens exits 2
/// and leaves no file.
#[test]
fn root_does_not_depend_on_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let solo = dir.path().join("solo.bin");
    let o = run_trace(&solo, &["--capture", "all"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let t = dir.path().join("batched.bin");
    let o = run_trace(
        &t,
        &[
            "--capture",
            "all",
            "--batch-with",
            "the cat sat on the mat and then it sat again",
            "--batch-with",
            "sheep",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(root_of(&t), root_of(&solo));
    let o = moeconf(&["diff", solo.to_str().unwrap(), t.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stdout));
    let o = moeconf(&["inspect", t.to_str().unwrap(), "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let notes = v["provenance"]["notes"].to_string();
    assert!(
        notes.contains("batch_sequences") && notes.contains("3 (the traced sequence first)"),
        "{notes}"
    );
    // Batched and chunked together: still the solo root.
    let both = dir.path().join("both.bin");
    let o = run_trace(
        &both,
        &[
            "--capture",
            "all",
            "--batch-with",
            "sheep",
            "--prefill-chunk",
            "2",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(root_of(&both), root_of(&solo));
    let bad = dir.path().join("bad.bin");
    let o = run_trace(&bad, &["--batch-with", ""]);
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!bad.exists());
}

#[test]
fn contract_schedule_and_fork_are_bound() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("fork.bin");
    let o = run_trace(
        &t,
        &[
            "--fork-layer",
            "5",
            "--fork-contract",
            "b",
            "--fork-order",
            "135",
            "--digest",
            "sha256",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = moeconf(&["inspect", t.to_str().unwrap(), "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["algorithm"], "sha256");
    let sched = v["binding"]["schedule"].as_str().unwrap();
    assert!(sched.contains("layer=5") && sched.contains("step=1"), "{sched}");
}

#[test]
fn bad_input_exits_2_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("ref.bin");
    assert!(run_trace(&t, &["--capture", "fingerprints"]).status.success());
    let mut bytes = std::fs::read(&t).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0x40;
    let bad = dir.path().join("bad.bin");
    std::fs::write(&bad, &bytes).unwrap();
    let o = moeconf(&["inspect", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(
        err.starts_with("moeconf: ") && err.contains("bad.bin: byte "),
        "{err}"
    );

    let trunc = dir.path().join("trunc.bin");
    std::fs::write(&trunc, &bytes[..n - 10]).unwrap();
    let o = moeconf(&["inspect", trunc.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("truncated"));

    for args in [
        vec!["inspect", "/nonexistent/x.bin"],
        vec![
            "run",
            "--prompt",
            "x",
            "-o",
            "/tmp/never.bin",
            "--precision",
            "fp8",
        ],
        vec!["run", "--prompt", "x", "-o", "/tmp/never.bin", "--capture", "L9"],
        vec![
            "run",
            "--prompt",
            "x",
            "-o",
            "/tmp/never.bin",
            "--fork-order",
            "3",
        ],
        vec![
            "run",
            "--prompt",
            "x",
            "-o",
            "/tmp/never.bin",
            "--fork-layer",
            "5",
            "--fork-order",
            "360",
        ],
        vec![
            "run",
            "--prompt",
            "x",
            "-o",
            "/tmp/never.bin",
            "--model",
            "/nonexistent-model",
        ],
        vec!["bogus-subcommand"],
    ] {
        let o = moeconf(&args);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(!o.stderr.is_empty());
    }
    assert!(!Path::new("/tmp/never.bin").exists());
}
