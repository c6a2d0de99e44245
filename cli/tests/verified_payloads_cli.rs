//! Corrupted payloads are errors, never verdicts. Every file here opens
//! (preamble, header, index, checksum and root are intact: only payload
//! bytes are changed, so only the record digest no longer matches), and
//! every command that reads it must exit 2 naming the file, the record and
//! the byte offset, where it used to give a verdict from the corrupted
//! bytes (a gate FAIL turned into PASS, a changed certify count with exit 0).
//!
//! Version 1 traces are verified in full by every command, so any corrupted
//! payload byte is an error. Version 2 traces are verified as `diff` and
//! `gate` read them (docs/ci.md §12): a corrupted byte they read is an
//! error, and a corrupted byte they do not read cannot change what they
//! say (the report is the clean file's, byte for byte) — and with
//! `--verify-all` it is an error too. `inspect`, `certify` and `--bless`
//! verify every byte of both versions.

use moeconf_fingerprint::{Algorithm, Component, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{Binding, CaptureSpec, Header, Trace, TraceWriter};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

/// A policy whose argmax near-tie threshold (0.05) lies between the
/// reference margin (0.09375) and its corrupted value (0.0234375).
const POLICY: &str = r#"default_profile = "t"

[profile.t]
levels = { L0 = "tolerance", L1 = "tolerance", L2 = "info", L3 = "tolerance", L4 = "info" }
argmax_near_tie_margin = 0.05
rules = [ { path = "*", check = "exact" } ]
# The synthetic traces hold L0 only (the built-in default also requires L1).
required = ["judged"]
"#;

/// The reference's step-0 `lm.margin`.
const MARGIN: f32 = 0.09375;

/// A scratch repository with the policy above, whose synthetic traces are
/// written in container format `version`.
struct Repo {
    dir: tempfile::TempDir,
    version: u32,
}

impl Repo {
    fn new() -> Repo {
        Repo::version(2)
    }

    fn version(version: u32) -> Repo {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(".git")).unwrap();
        std::fs::write(dir.path().join("moeconf.toml"), POLICY).unwrap();
        Repo { dir, version }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
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

    /// A one-step trace: `token.output` = `token`, `lm.margin` = `margin`.
    fn synthetic(&self, name: &str, token: i32, margin: f32) -> PathBuf {
        let path = self.path(name);
        let binding = Binding {
            decoding: moeconf_schema::Decoding {
                strategy: "greedy".into(),
                max_new_tokens: 1,
            },
            capture: CaptureSpec {
                levels: moeconf_fingerprint::LevelSet::ALL,
                payload_levels: moeconf_fingerprint::LevelSet::ALL,
            },
            ..Binding::default()
        };
        let header = Header {
            binding,
            ..Header::default()
        };
        let out = moeconf_output::check_output(&path, &moeconf_output::Inputs::new()).unwrap();
        let mut w = TraceWriter::create_version(&out, Algorithm::Blake3, header, self.version).unwrap();
        let coord = |c: Component| Coord {
            step: 0,
            position: 0,
            phase: Phase::Prefill,
            layer: None,
            path: c.path().into(),
        };
        let records = [
            (Component::TokenOutput, DType::I32, token.to_le_bytes()),
            (Component::LmMargin, DType::F32, margin.to_le_bytes()),
        ];
        for (c, dtype, bytes) in records {
            let view = TensorView {
                dtype,
                shape: &[1],
                bytes: &bytes,
            };
            w.append(coord(c), Level::L0, view, true).unwrap();
        }
        w.finish().unwrap();
        path
    }

    /// `moeconf run` on the fixture (2 new tokens) with extra arguments.
    fn run(&self, name: &str, extra: &[&str]) -> PathBuf {
        let out = self.path(name);
        let r = Command::new(BIN)
            .args(run_args(&out, "2", extra))
            .output()
            .unwrap();
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        out
    }
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exit code")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// XORs `mask` into byte `k` of the payload of the first record matching
/// `pick`, in place, and returns (record index, offset of its payload). Only
/// payload bytes change: the file still opens.
fn corrupt(path: &Path, pick: impl Fn(&Coord) -> bool, k: usize, mask: u8) -> (usize, u64) {
    let t = Trace::open(path).unwrap();
    let i = t
        .records()
        .unwrap()
        .iter()
        .position(|e| e.payload.is_some() && pick(&e.coord))
        .expect("a record with a payload");
    let off = t.records().unwrap()[i].payload.unwrap().offset;
    drop(t);
    let mut bytes = std::fs::read(path).unwrap();
    bytes[off as usize + k] ^= mask;
    std::fs::write(path, &bytes).unwrap();
    Trace::open(path).expect("a payload-only corruption still opens");
    (i, off)
}

/// Exit 2, and the message names the file, the record and the offset.
fn assert_corruption_error(o: &Output, file: &Path, (i, off): (usize, u64)) {
    let err = stderr(o);
    assert_eq!(code(o), 2, "stdout:\n{}\nstderr:\n{err}", stdout(o));
    let name = file.file_name().unwrap().to_str().unwrap();
    assert!(
        err.contains(&format!("{name}: byte {off}: record {i} ")),
        "names file, byte offset and record: {err}"
    );
    assert!(err.contains("do not match the record digest"), "{err}");
}

/// The reference of finding 1: its step-0 margin 0.09375 becomes 0.0234375
/// (one bit of the exponent), below the 0.05 threshold.
fn corrupted_margin_reference(repo: &Repo) -> (PathBuf, (usize, u64)) {
    let r = repo.synthetic("ref.bin", 5, MARGIN);
    let at = corrupt(
        &r,
        |c| Component::LmMargin.matches(&c.path) && c.step == 0,
        3,
        0x01,
    );
    (r, at)
}

/// `got` says exactly what `want` says, but of `corrupted` where `want`
/// names `clean`: a corrupted byte the command did not read changed nothing.
fn assert_same_answer(got: &Output, want: &Output, corrupted: &Path, clean: &Path) {
    let name = |p: &Path| p.to_str().unwrap().to_string();
    assert_eq!(code(got), code(want), "{}\n{}", stdout(got), stderr(got));
    assert_eq!(
        stdout(got).replace(&name(corrupted), &name(clean)),
        stdout(want),
        "the corrupted file's answer differs from the clean file's"
    );
}

#[test]
fn corrupted_reference_margin_never_turns_a_gate_fail_into_a_pass() {
    for version in [1, 2] {
        let repo = Repo::version(version);
        let clean = repo.synthetic("clean.bin", 5, MARGIN);
        let cand = repo.synthetic("cand.bin", 7, MARGIN);
        let o = repo.moeconf(&["gate", s(&clean), s(&cand)]);
        assert_eq!(code(&o), 1, "the clean margin is no near-tie: {}", stdout(&o));

        // The margin decides whether the token flip is a near-tie: it is read,
        // and its corruption is an error in both versions.
        let (r, at) = corrupted_margin_reference(&repo);
        let o = repo.moeconf(&["gate", s(&r), s(&cand)]);
        assert_corruption_error(&o, &r, at);
        // Under git bisect a broken reference is a broken setup, not a skip.
        let o = repo.moeconf(&["gate", "--bisect-exit-codes", s(&r), s(&cand)]);
        assert_eq!(code(&o), 128, "{}", stderr(&o));
        // The corrupted file as the candidate: its margin decides nothing (the
        // reference's does, and the two margins' digests are equal).
        let o = repo.moeconf(&["gate", s(&cand), s(&r)]);
        if version == 1 {
            assert_corruption_error(&o, &r, at);
        } else {
            let want = repo.moeconf(&["gate", s(&cand), s(&clean)]);
            assert_same_answer(&o, &want, &r, &clean);
        }
        let o = repo.moeconf(&["gate", "--verify-all", s(&cand), s(&r)]);
        assert_corruption_error(&o, &r, at);
    }
}

#[test]
fn a_token_flip_above_the_near_tie_threshold_fails_showing_the_reference_margin() {
    // docs/ci.md §4: "A flip above the threshold fails, and the failure
    // message shows the reference margin."
    let repo = Repo::new();
    let clean = repo.synthetic("clean.bin", 5, MARGIN);
    let cand = repo.synthetic("cand.bin", 7, MARGIN);
    let o = repo.moeconf(&["gate", s(&clean), s(&cand)]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    let out = stdout(&o);
    assert!(
        out.contains("argmax flip [5] -> [7] (reference margin 9.375e-2, near-tie threshold 5e-2)"),
        "{out}"
    );
    let o = repo.moeconf(&["gate", s(&clean), s(&cand), "--format", "json"]);
    assert!(stdout(&o).contains("reference margin 9.375e-2"), "{}", stdout(&o));
}

#[test]
fn diff_of_a_corrupted_trace_is_an_error() {
    for version in [1, 2] {
        let repo = Repo::version(version);
        let cand = repo.synthetic("cand.bin", 7, MARGIN);
        let same = repo.synthetic("same.bin", 5, MARGIN);
        let clean = repo.synthetic("clean.bin", 5, MARGIN);
        let (r, at) = corrupted_margin_reference(&repo);
        for (a, b) in [(&r, &cand), (&cand, &r), (&r, &same), (&same, &r)] {
            let o = repo.moeconf(&["diff", s(a), s(b)]);
            if version == 1 {
                assert_corruption_error(&o, &r, at);
            } else {
                // The margins' digests are equal: the diff never reads them.
                let swap = |p: &PathBuf| if *p == r { clean.clone() } else { p.clone() };
                let want = repo.moeconf(&["diff", s(&swap(a)), s(&swap(b))]);
                assert_same_answer(&o, &want, &r, &clean);
            }
            let o = repo.moeconf(&["diff", "--verify-all", s(a), s(b)]);
            assert_corruption_error(&o, &r, at);
        }
    }
}

/// A version 2 diff reads the payloads of the records that differ: their
/// corruption is an error, whichever side holds it.
#[test]
fn diff_of_a_corrupted_payload_it_reads_is_an_error() {
    let repo = Repo::new();
    let cand = repo.synthetic("cand.bin", 7, MARGIN);
    let r = repo.synthetic("ref.bin", 5, MARGIN);
    let at = corrupt(&r, |c| Component::TokenOutput.matches(&c.path), 0, 0x01);
    for (a, b) in [(&r, &cand), (&cand, &r)] {
        assert_corruption_error(&repo.moeconf(&["diff", s(a), s(b)]), &r, at);
        assert_corruption_error(&repo.moeconf(&["gate", s(a), s(b)]), &r, at);
    }
}

/// A version 2 diff and gate read the step and group blocks on the path they
/// descend, each checked against its parent: a flipped byte in any of them
/// is an error naming the block, where a block the descent does not enter
/// changes nothing.
#[test]
fn corrupted_tree_nodes_on_the_path_are_errors() {
    let repo = Repo::new();
    let cand = repo.synthetic("cand.bin", 7, MARGIN);
    let clean = repo.synthetic("clean.bin", 5, MARGIN);
    let t = Trace::open(&clean).unwrap();
    let node = t.step(0).unwrap().unwrap();
    t.group_records(&node.levels[0].groups[0]).unwrap();
    // The root block, step 0's block and its L0 group block: all on the
    // path of the token difference.
    let blocks = t.blocks_read();
    assert_eq!(blocks.len(), 3, "{blocks:?}");
    drop(t);
    let bytes = std::fs::read(&clean).unwrap();
    for (k, &(offset, len)) in blocks.iter().enumerate() {
        for at in [offset, offset + len / 2, offset + len - 1] {
            let bad = repo.path("bad.bin");
            let mut b = bytes.clone();
            b[at as usize] ^= 0x10;
            std::fs::write(&bad, &b).unwrap();
            for args in [
                vec!["diff", s(&bad), s(&cand)],
                vec!["diff", s(&cand), s(&bad)],
                vec!["gate", s(&bad), s(&cand)],
            ] {
                let o = repo.moeconf(&args);
                let err = stderr(&o);
                assert_eq!(code(&o), 2, "block {k} byte {at}: {args:?}: {}", stdout(&o));
                assert!(err.contains("bad.bin: byte "), "names file and offset: {err}");
                assert!(
                    err.contains("does not match its digest") || err.contains("root block"),
                    "block {k} byte {at}: {err}"
                );
            }
            // The candidate's blocks are checked alike (gate: exit 125 under
            // git bisect, the candidate cannot be tested).
            let o = repo.moeconf(&["gate", "--bisect-exit-codes", s(&cand), s(&bad)]);
            assert_eq!(code(&o), 125, "{}", stderr(&o));
        }
    }
}

#[test]
fn gate_baseline_modes_refuse_a_corrupted_candidate() {
    for version in [1, 2] {
        let repo = Repo::version(version);
        let clean = repo.synthetic("clean.bin", 5, MARGIN);
        let base = repo.path("base.json");
        let o = repo.moeconf(&["gate", "--bless", "--baseline", s(&base), s(&clean)]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let (r, at) = corrupted_margin_reference(&repo);
        // Same record digests as the blessed trace, but a corrupted payload.
        let o = repo.moeconf(&["gate", "--baseline", s(&base), s(&r)]);
        if version == 1 {
            assert_corruption_error(&o, &r, at);
        } else {
            // Its step digests are the blessed ones: nothing of it is read.
            let want = repo.moeconf(&["gate", "--baseline", s(&base), s(&clean)]);
            assert_same_answer(&o, &want, &r, &clean);
        }
        let o = repo.moeconf(&["gate", "--verify-all", "--baseline", s(&base), s(&r)]);
        assert_corruption_error(&o, &r, at);
        // Nor is a corrupted trace blessed.
        let base2 = repo.path("base2.json");
        let o = repo.moeconf(&["gate", "--bless", "--baseline", s(&base2), s(&r)]);
        assert_corruption_error(&o, &r, at);
        assert!(!base2.exists(), "no baseline written from a corrupted trace");
    }
}

#[test]
fn certify_of_a_corrupted_term_is_an_error() {
    let repo = Repo::new();
    let t = repo.run("all.bin", &["--capture", "all"]);
    let o = repo.moeconf(&["certify", s(&t)]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let term0 = format!("{}0", Component::MoeTerm.path());
    let at = corrupt(&t, |c| c.path == term0, 2, 0x40);
    let o = repo.moeconf(&["certify", s(&t)]);
    assert_corruption_error(&o, &t, at);
}

#[test]
fn inspect_refuses_a_corrupted_payload_unless_told_not_to_verify() {
    for version in [1, 2] {
        let repo = Repo::version(version);
        let (r, at) = corrupted_margin_reference(&repo);
        assert_corruption_error(&repo.moeconf(&["inspect", s(&r)]), &r, at);
        let o = repo.moeconf(&["inspect", s(&r), "--no-verify"]);
        assert_eq!(code(&o), 0);
        assert!(stdout(&o).contains("payloads not re-hashed"), "{}", stdout(&o));
    }
}
