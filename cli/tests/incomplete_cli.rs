//! A run is complete when it holds every step 0..max_new_tokens of its
//! binding (`moeconf_schema::Completeness`). `diff`, `gate` (against a
//! reference and a baseline) and `replay` (layers and `--teacher-force`)
//! never exit 0 on an incomplete side unless `--allow-incomplete`, and then
//! their reports say `incomplete: k of n steps`. Each check here gave exit 0
//! before: an empty trace and a trace holding only step 0 of a 2-step run
//! replayed as REPRODUCED / IDENTICAL, and two traces truncated the same way
//! compared equal in `diff` and passed the gate.

use moeconf_fingerprint::TensorView;
use moeconf_schema::{Header, IndexEntry, Trace, TraceWriter};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

/// A scratch repository (`.git` marker, no policy file: built-in profiles).
struct Repo {
    dir: tempfile::TempDir,
}

impl Repo {
    fn new() -> Repo {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(".git")).unwrap();
        Repo { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `moeconf run` on the fixture, 2 new tokens, `--capture all` (every
    /// payload kept, so records can be copied and replay has its inputs).
    fn run(&self, name: &str) -> PathBuf {
        let out = self.path(name);
        let r = self.moeconf(&run_args(&out, "2", &["--capture", "all"]));
        assert!(r.status.success(), "{}", both(&r));
        out
    }

    /// `moeconf ARGS` in the repository with a clean MOECONF_* environment.
    fn moeconf(&self, args: &[&str]) -> Output {
        let mut c = Command::new(BIN);
        c.args(args).current_dir(self.dir.path());
        for (k, _) in std::env::vars() {
            if k.starts_with("MOECONF_") {
                c.env_remove(k);
            }
        }
        c.output().unwrap()
    }
}

/// A copy of `src` under the same header (so the same `max_new_tokens`),
/// keeping only the records `keep` accepts.
fn filtered(src: &Path, dst: &Path, keep: impl Fn(&IndexEntry) -> bool) -> PathBuf {
    let t = Trace::open_verified(src).unwrap();
    let header = Header {
        binding: t.binding().clone(),
        provenance: t.provenance().clone(),
    };
    let mut w = TraceWriter::create(dst, t.algorithm(), header).unwrap();
    for (i, e) in t.records().unwrap().iter().enumerate() {
        if !keep(e) {
            continue;
        }
        let bytes = t.payload_verified(i).unwrap().expect("a --capture all trace");
        let view = TensorView {
            dtype: e.dtype,
            shape: &e.shape,
            bytes,
        };
        w.append(e.coord.clone(), e.level, view, true).unwrap();
    }
    w.finish().unwrap();
    dst.to_path_buf()
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exit code")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn both(o: &Output) -> String {
    format!("{}{}", stdout(o), stderr(o))
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", both(o)))
}

const NOTE: &str = "incomplete: 1 of 2 steps (missing step 1)";

#[test]
fn diff_refuses_two_identically_truncated_traces_unless_allowed() {
    let repo = Repo::new();
    let full = repo.run("full.bin");
    let a = filtered(&full, &repo.path("a.bin"), |e| e.coord.step == 0);
    let b = filtered(&full, &repo.path("b.bin"), |e| e.coord.step == 0);
    // The complete run against itself is equivalent: the rule accepts it.
    assert_eq!(code(&repo.moeconf(&["diff", s(&full), s(&full)])), 0);
    let o = repo.moeconf(&["diff", s(&a), s(&b)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    let err = stderr(&o);
    assert!(err.contains(&format!("{}: {NOTE}", s(&a))), "{err}");
    assert!(err.contains(&format!("{}: {NOTE}", s(&b))), "{err}");
    assert!(err.contains("--allow-incomplete"), "{err}");
    // One incomplete side is enough.
    assert_eq!(code(&repo.moeconf(&["diff", s(&full), s(&b)])), 2);

    let o = repo.moeconf(&["diff", "--allow-incomplete", "--color", "never", s(&a), s(&b)]);
    assert_eq!(code(&o), 0, "{}", both(&o));
    let text = stdout(&o);
    assert!(
        text.contains(&format!("INCOMPLETE: reference {}: {NOTE}", s(&a))),
        "{text}"
    );
    let summary = text.lines().last().unwrap();
    assert!(summary.contains(NOTE), "the summary line says it: {summary}");
    let o = repo.moeconf(&["diff", "--allow-incomplete", "--format", "json", s(&a), s(&b)]);
    assert_eq!(code(&o), 0, "{}", both(&o));
    let j = json(&o);
    assert_eq!(j["verdict"], "equivalent");
    let inc = j["incomplete"].as_array().unwrap();
    assert_eq!(inc.len(), 2, "{j:#}");
    assert_eq!(inc[1]["side"], "candidate");
    assert_eq!(inc[1]["present_steps"], 1);
    assert_eq!(inc[1]["expected_steps"], 2);
    assert_eq!(inc[1]["missing_steps"], "1");
    assert_eq!(inc[1]["note"], NOTE);
    assert!(j["summary"].as_str().unwrap().contains(NOTE), "{j:#}");
    // Complete traces report no incomplete side.
    let o = repo.moeconf(&["diff", "--format", "json", s(&full), s(&full)]);
    assert_eq!(json(&o)["incomplete"], serde_json::json!([]));
}

#[test]
fn gate_refuses_incomplete_traces_unless_allowed() {
    let repo = Repo::new();
    let full = repo.run("full.bin");
    let a = filtered(&full, &repo.path("a.bin"), |e| e.coord.step == 0);
    let b = filtered(&full, &repo.path("b.bin"), |e| e.coord.step == 0);
    let o = repo.moeconf(&["gate", s(&a), s(&b)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(stdout(&o).is_empty(), "no report: {}", stdout(&o));
    assert!(
        stderr(&o).contains(&format!("{}: {NOTE}", s(&b))) && stderr(&o).contains("not a verdict"),
        "{}",
        stderr(&o)
    );
    // `git bisect run`: an incomplete candidate cannot be tested (skip), an
    // incomplete reference aborts.
    assert_eq!(
        code(&repo.moeconf(&["gate", "--bisect-exit-codes", s(&a), s(&b)])),
        125
    );
    assert_eq!(
        code(&repo.moeconf(&["gate", "--bisect-exit-codes", s(&full), s(&b)])),
        125
    );
    assert_eq!(
        code(&repo.moeconf(&["gate", "--bisect-exit-codes", s(&a), s(&full)])),
        128
    );

    let o = repo.moeconf(&["gate", "--allow-incomplete", s(&a), s(&b)]);
    assert_eq!(code(&o), 0, "{}", both(&o));
    let text = stdout(&o);
    assert!(text.starts_with("moeconf gate: PASS (incomplete)"), "{text}");
    assert!(
        text.contains(&format!("INCOMPLETE: candidate {}: {NOTE}", s(&b))),
        "{text}"
    );
    assert!(text.trim_end().lines().last().unwrap().contains(NOTE), "{text}");
    let o = repo.moeconf(&["gate", "--allow-incomplete", "--format", "json", s(&a), s(&b)]);
    let j = json(&o);
    assert_eq!(j["verdict"], "pass");
    assert_eq!(j["incomplete"].as_array().map(Vec::len), Some(2), "{j:#}");
    assert_eq!(j["incomplete"][0]["note"], NOTE);
    let o = repo.moeconf(&["gate", "--allow-incomplete", "--format", "md", s(&a), s(&b)]);
    assert!(
        stdout(&o).starts_with("### moeconf gate: ✅ PASS (incomplete)"),
        "{}",
        stdout(&o)
    );
    let o = repo.moeconf(&["gate", "--allow-incomplete", "--format", "junit", s(&a), s(&b)]);
    assert!(
        stdout(&o).contains(&format!("<skipped message=\"{NOTE}\"/>")),
        "{}",
        stdout(&o)
    );
}

#[test]
fn gate_refuses_incomplete_baselines_unless_allowed() {
    let repo = Repo::new();
    let full = repo.run("full.bin");
    let a = filtered(&full, &repo.path("a.bin"), |e| e.coord.step == 0);
    let b = filtered(&full, &repo.path("b.bin"), |e| e.coord.step == 0);
    // A baseline of the truncated trace (written by the library, as
    // `--bless` did before) against a candidate truncated the same way.
    let old = repo.path("old.json");
    moeconf_gate::baseline::Baseline::of(&Trace::open(&a).unwrap())
        .and_then(|bl| bl.write(&old))
        .unwrap();
    let o = repo.moeconf(&["gate", "--baseline", s(&old), s(&b)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    let want = format!("{}: {NOTE}", s(&old));
    assert!(
        stderr(&o).contains(&want) && stderr(&o).contains("not a verdict"),
        "{}",
        stderr(&o)
    );

    // Blessing an incomplete trace is refused unless allowed; a baseline
    // blessed from it gates nothing without the flag.
    let base = repo.path("base.json");
    let o = repo.moeconf(&["gate", "--bless", "--baseline", s(&base), s(&a)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(
        stderr(&o).contains(NOTE) && stderr(&o).contains("not blessed"),
        "{}",
        stderr(&o)
    );
    assert!(!base.exists());
    let o = repo.moeconf(&[
        "gate",
        "--bless",
        "--allow-incomplete",
        "--baseline",
        s(&base),
        s(&a),
    ]);
    assert_eq!(code(&o), 0, "{}", both(&o));
    let o = repo.moeconf(&["gate", "--baseline", s(&base), s(&b)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(
        stderr(&o).contains(&format!("{}: {NOTE}", s(&base))),
        "{}",
        stderr(&o)
    );
    let o = repo.moeconf(&[
        "gate",
        "--allow-incomplete",
        "--format",
        "json",
        "--baseline",
        s(&base),
        s(&b),
    ]);
    assert_eq!(code(&o), 0, "{}", both(&o));
    let j = json(&o);
    assert_eq!(j["incomplete"][0]["side"], "baseline", "{j:#}");
    assert_eq!(j["incomplete"][1]["side"], "candidate", "{j:#}");
    // A complete baseline against the truncated candidate: exit 2 without
    // the flag; with it, the missing step fails the coverage check.
    let full_base = repo.path("full.json");
    let o = repo.moeconf(&["gate", "--bless", "--baseline", s(&full_base), s(&full)]);
    assert_eq!(code(&o), 0, "{}", both(&o));
    assert_eq!(
        code(&repo.moeconf(&["gate", "--baseline", s(&full_base), s(&b)])),
        2
    );
    let o = repo.moeconf(&["gate", "--allow-incomplete", "--baseline", s(&full_base), s(&b)]);
    assert_eq!(code(&o), 1, "{}", both(&o));
}

#[test]
fn replay_refuses_an_empty_candidate() {
    let repo = Repo::new();
    let full = repo.run("full.bin");
    let empty = filtered(&full, &repo.path("empty.bin"), |_| false);
    for mode in [&[][..], &["--teacher-force"][..]] {
        let mut args = vec!["replay", s(&empty)];
        args.extend_from_slice(mode);
        let o = repo.moeconf(&args);
        assert_eq!(code(&o), 2, "{mode:?}: {}", both(&o));
        let want = format!("{}: incomplete: 0 of 2 steps (missing steps 0-1)", s(&empty));
        assert!(stderr(&o).contains(&want), "{}", stderr(&o));
    }
}

/// Layer replay and teacher forcing of a trace holding only step 0 of 2.
#[test]
fn replay_refuses_a_truncated_candidate_unless_allowed() {
    let repo = Repo::new();
    let full = repo.run("full.bin");
    let short = filtered(&full, &repo.path("short.bin"), |e| e.coord.step == 0);
    for mode in [&[][..], &["--teacher-force"][..]] {
        let mut args = vec!["replay", s(&short)];
        args.extend_from_slice(mode);
        let o = repo.moeconf(&args);
        assert_eq!(code(&o), 2, "{mode:?}: {}", both(&o));
        assert!(
            stderr(&o).contains(&format!("{}: {NOTE}", s(&short))),
            "{}",
            stderr(&o)
        );
        args.extend_from_slice(&["--allow-incomplete", "--format", "json"]);
        let o = repo.moeconf(&args);
        assert_eq!(code(&o), 0, "{mode:?}: {}", both(&o));
        let j = json(&o);
        assert_eq!(j["exit_code"], 0);
        assert_eq!(j["incomplete"]["note"], NOTE, "{j:#}");
        assert_eq!(j["incomplete"]["present_steps"], 1);
        args.truncate(args.len() - 2);
        let o = repo.moeconf(&args);
        assert!(
            stdout(&o).contains(&format!("INCOMPLETE: {}: {NOTE}", s(&short))),
            "{}",
            stdout(&o)
        );
        assert!(
            stdout(&o).contains("incomplete, accepted with --allow-incomplete"),
            "{}",
            stdout(&o)
        );
    }
    // The complete trace replays with no incomplete note.
    let o = repo.moeconf(&["replay", "--format", "json", s(&full)]);
    assert_eq!(code(&o), 0, "{}", both(&o));
    assert_eq!(json(&o)["incomplete"], serde_json::Value::Null);
}
