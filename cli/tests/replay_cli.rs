//! `moeconf replay` as a process: exit codes 0 (reproduced), 1 (origins),
//! 2 (incomplete capture, wrong model), the JSON document, teacher forcing.

use std::path::Path;
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

fn moeconf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .output()
        .expect("run moeconf")
}

fn run(out: &Path, extra: &[&str]) {
    let o = moeconf(&run_args(out, "4", extra));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

#[test]
fn replay_exit_codes_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let native = dir.path().join("native.bin");
    run(&native, &["--capture", "replay"]);
    let o = moeconf(&["replay", s(&native)]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stdout));
    assert!(String::from_utf8_lossy(&o.stdout).contains("REPRODUCED"));

    let fork = dir.path().join("fork.bin");
    run(
        &fork,
        &[
            "--capture",
            "replay",
            "--fork-layer",
            "3",
            "--fork-step",
            "1",
            "--fork-contract",
            "b",
        ],
    );
    let o = moeconf(&["replay", s(&fork), "--format", "json"]);
    assert_eq!(o.status.code(), Some(1));
    let v = json(&o);
    assert_eq!(v["kind"], "moeconf.replay");
    assert_eq!(v["mode"], "layers");
    assert_eq!(v["schema_version"], 1);
    assert_eq!(v["summary"]["origins"], 1, "{v:#}");
    assert_eq!(v["origins"][0]["step"], 1);
    assert_eq!(v["origins"][0]["layer"], 3);
    assert_eq!(v["origins"][0]["part"], "ffn");
    assert_eq!(v["origins"][0]["first_difference"]["record"], "moe.combine");
    assert_eq!(v["origins"][0]["reproduced_under"], "b");
    // 4 steps × 20 units; after the origin: 10 halves and the head of step
    // 1, and all 40 units of steps 2 and 3, every one downstream of it.
    assert_eq!(v["summary"]["units"], 80);
    assert_eq!(v["summary"]["propagated"], 51, "{v:#}");

    // -o writes the same document; teacher forcing measures the fork.
    let out = dir.path().join("r.json");
    let o = moeconf(&["replay", s(&fork), "--format", "json", "-o", s(&out)]);
    assert_eq!(o.status.code(), Some(1));
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(written, v);
    let o = moeconf(&["replay", "--teacher-force", s(&fork), "--format", "json"]);
    assert_eq!(o.status.code(), Some(1));
    let t = json(&o);
    assert_eq!(t["mode"], "teacher_force");
    assert_eq!(t["steps"][0]["identical"], true);
    assert_eq!(t["steps"][1]["identical"], false);
    assert!(t["steps"][1]["kl"].as_f64().unwrap() > 0.0);
    assert_eq!(t["l3"], false);

    // Measured propagation marks fewer units than reachability; --l3 adds
    // the per-layer comparison (layers before the fork identical).
    let o = moeconf(&["replay", s(&fork), "--format", "json", "--measure-propagation"]);
    assert_eq!(o.status.code(), Some(1));
    let mv = json(&o);
    assert_eq!(mv["measured_propagation"], true);
    let measured = mv["summary"]["propagated"].as_u64().unwrap();
    assert!(measured > 0 && measured < 51, "{measured}");
    let o = moeconf(&["replay", "--teacher-force", "--l3", s(&fork), "--format", "json"]);
    let t = json(&o);
    let layers = t["steps"][1]["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 9);
    assert_eq!(layers[2]["identical"], true);
    assert_eq!(layers[3]["identical"], false);
    // --l3 only with --teacher-force.
    let o = moeconf(&["replay", "--l3", s(&fork)]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn an_incomplete_capture_is_exit_2_unless_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("default.bin");
    run(&p, &[]);
    let o = moeconf(&["replay", s(&p)]);
    assert_eq!(o.status.code(), Some(2));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("payload of state.window_kv at steps 0,1,2"),
        "{text}"
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("--allow-incomplete"));
    let o = moeconf(&["replay", s(&p), "--allow-incomplete"]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stdout));
    // Teacher forcing needs the logits' payloads, which default keeps.
    let o = moeconf(&["replay", "--teacher-force", s(&p)]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    // Without L1 payloads it names what is missing.
    let f = dir.path().join("fp.bin");
    run(&f, &["--capture", "fingerprints"]);
    let o = moeconf(&["replay", "--teacher-force", s(&f)]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("lm.logits payload at step 0"), "{err}");
}

#[test]
fn another_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("n.bin");
    run(&p, &["--capture", "replay"]);
    // A model directory with the same config but other weights: a copy of
    // the builtin with one byte of the last tensor's data changed.
    let src = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").unwrap();
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        let mut bytes = std::fs::read(e.path()).unwrap();
        if e.path().extension().is_some_and(|x| x == "safetensors") {
            let n = bytes.len();
            bytes[n - 1] ^= 0x01;
        }
        std::fs::write(other.join(e.file_name()), bytes).unwrap();
    }
    let o = moeconf(&["replay", s(&p), "--model", s(&other)]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("n.bin") && err.contains("other weights"), "{err}");
}

#[test]
fn the_report_may_not_overwrite_the_candidate() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.bin");
    run(&p, &["--capture", "replay"]);
    let before = std::fs::read(&p).unwrap();
    let o = moeconf(&["replay", s(&p), "-o", s(&p)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(!String::from_utf8_lossy(&o.stderr).is_empty());
    assert_eq!(std::fs::read(&p).unwrap(), before);
    let missing_dir = dir.path().join("no/such/dir/r.txt");
    let o = moeconf(&["replay", s(&p), "-o", s(&missing_dir)]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn the_html_origin_map_marks_the_fork_and_its_propagation() {
    let dir = tempfile::tempdir().unwrap();
    let fork = dir.path().join("fork.bin");
    run(
        &fork,
        &[
            "--capture",
            "replay",
            "--fork-layer",
            "5",
            "--fork-contract",
            "b",
            "--fork-order",
            "class:135",
        ],
    );
    let page = dir.path().join("replay.html");
    let o = moeconf(&["replay", s(&fork), "--html", s(&page)]);
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stdout));
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(!html.contains("http://") && !html.contains("<script"));
    // The fork's cell: an origin reproduced under the B class; the same
    // layer one step later and the layers below it only propagate.
    assert!(html.contains("<title>layer 5, step 1: ffn: origin at moe.combine (position 5), reproduced under b+order=class:135"), "{html}");
    assert!(html.contains("<title>layer 6, step 1: attention: reproduced (propagation)"));
    assert!(html.contains("<title>layer 4, step 1: attention: reproduced; ffn: reproduced</title>"));
    assert_eq!(html.matches(": origin at ").count(), 1, "exactly one origin");
    // The page is an output like any other: never the candidate.
    let o = moeconf(&["replay", s(&fork), "--html", s(&fork)]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn the_contract_flag_names_the_references_contract() {
    // A run under B in ascending expert id: replayed under its own binding
    // it reproduces (exit 0); `--contract c` makes FFN halves origins at the
    // combine (exit 1) and the report names the contract run; a notation
    // that names no grammar member is an error naming the trace (exit 2).
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("b-asc.bin");
    run(&t, &["--capture", "replay", "--contract", "b+order=asc-id"]);
    assert_eq!(moeconf(&["replay", s(&t)]).status.code(), Some(0));
    let o = moeconf(&["replay", s(&t), "--contract", "c", "--format", "json"]);
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&o);
    assert_eq!(v["reference"]["contract"], "c");
    let origins = v["origins"].as_array().unwrap();
    assert!(!origins.is_empty());
    for u in origins {
        assert_eq!(u["part"], "ffn", "{u:#}");
        assert_eq!(u["first_difference"]["record"], "moe.combine", "{u:#}");
    }
    let o = moeconf(&["replay", s(&t), "--contract", "hf-native"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("b-asc.bin") && err.contains("hf-native"), "{err}");
}

#[test]
fn a_corrupted_payload_is_an_error_even_where_replay_does_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("all.bin");
    run(&t, &["--capture", "all"]);
    let mut bytes = std::fs::read(&t).unwrap();
    // The middle of the file lies in the payloads (L4 operator records,
    // which layer replay compares by digest and does not read).
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    let bad = dir.path().join("bad.bin");
    std::fs::write(&bad, &bytes).unwrap();
    for cmd in [
        vec!["replay", s(&bad)],
        vec!["replay", "--teacher-force", s(&bad)],
        vec!["explain", s(&bad)],
    ] {
        let o = moeconf(&cmd);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
        assert!(String::from_utf8_lossy(&o.stderr).contains("bad.bin"), "{cmd:?}");
    }
}
