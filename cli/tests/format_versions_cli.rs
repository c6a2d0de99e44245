//! Both container format versions as a user meets them (docs/format.md §11):
//! `run` writes version 4; `moeconf convert` rewrites a trace in any
//! version with the same root and refuses the outputs every command refuses;
//! and `diff`, `gate`, `inspect` and `explain` say the same thing of the same
//! records in either version (also of mixed pairs), so version 1 traces read
//! and diff exactly as before.

use moeconf_schema::Trace;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

fn moeconf(dir: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args).current_dir(dir);
    for (k, _) in std::env::vars() {
        if k.starts_with("MOECONF_") {
            c.env_remove(k);
        }
    }
    c.output().unwrap()
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

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `moeconf run` (4 tokens, every level with payloads) into `out`.
fn run(dir: &Path, out: &Path, extra: &[&str]) {
    let mut args = run_args(out, "4", &["--capture", "all"]);
    args.extend_from_slice(extra);
    let o = moeconf(dir, &args);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `moeconf convert IN -o OUT --to V`, which must succeed.
fn convert(dir: &Path, input: &Path, out: &Path, to: &str) {
    let o = moeconf(dir, &["convert", s(input), "-o", s(out), "--to", to]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// `text` with every path of `from` replaced by the matching one of `to`.
fn renamed(text: &str, from: &[&Path], to: &[&Path]) -> String {
    let mut t = text.to_string();
    for (a, b) in from.iter().zip(to) {
        t = t.replace(s(a), s(b));
    }
    t
}

#[test]
fn run_writes_version_4_and_convert_keeps_the_root_every_way() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let v4 = d.join("run.bin");
    run(d, &v4, &[]);
    let t4 = Trace::open_verified(&v4).unwrap();
    assert_eq!(t4.format_version(), 4);
    let mut inspected = Vec::new();
    for to in ["1", "2", "3"] {
        let (v, back) = (d.join(format!("v{to}.bin")), d.join(format!("back{to}.bin")));
        convert(d, &v4, &v, to);
        let t = Trace::open_verified(&v).unwrap();
        assert_eq!(t.format_version().to_string(), to);
        assert_eq!(t.root(), t4.root(), "the same tree in every version");
        assert_eq!(t.record_count(), t4.record_count());
        convert(d, &v, &back, "4");
        assert_eq!(
            std::fs::read(&back).unwrap(),
            std::fs::read(&v4).unwrap(),
            "4 -> {to} -> 4 gives run's file back"
        );
        inspected.push(v);
    }
    inspected.push(v4.clone());
    // inspect says the same of every version but the version.
    let mut js: Vec<serde_json::Value> = inspected
        .iter()
        .map(|p| serde_json::from_str(&stdout(&moeconf(d, &["inspect", s(p), "--format", "json"]))).unwrap())
        .collect();
    assert_eq!(
        js.iter()
            .map(|j| j["format_version"].as_u64())
            .collect::<Vec<_>>(),
        [Some(1), Some(2), Some(3), Some(4)]
    );
    for j in &mut js {
        let o = j.as_object_mut().unwrap();
        for k in ["file", "file_bytes", "format_version"] {
            o.remove(k);
        }
    }
    assert_eq!(js[0], js[3]);
    assert_eq!(js[1], js[3]);
    assert_eq!(js[2], js[3]);
    // The shipped version 1 test vector converts with its pinned root.
    let vector = repo_root().join("fixtures/test-vectors/minimal-trace.bin");
    let conv = d.join("minimal-v2.bin");
    convert(d, &vector, &conv, "2");
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("fixtures/test-vectors/minimal-trace.json")).unwrap(),
    )
    .unwrap();
    let t = Trace::open_verified(&conv).unwrap();
    assert_eq!(t.root().to_hex(), meta["root"].as_str().unwrap());
    assert_eq!(Trace::open_verified(&vector).unwrap().format_version(), 1);
}

#[test]
fn convert_refuses_the_outputs_every_command_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let input = d.join("in.bin");
    run(d, &input, &[]);
    let before = std::fs::read(&input).unwrap();
    let refuse = |out: &Path, what: &str| {
        let o = moeconf(d, &["convert", s(&input), "-o", s(out), "--to", "1"]);
        assert_eq!(code(&o), 2, "{what}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(s(out)),
            "{what}: names the output: {}",
            stderr(&o)
        );
    };
    refuse(&input, "the input itself");
    let link = d.join("hard.bin");
    std::fs::hard_link(&input, &link).unwrap();
    refuse(&link, "a hard link to the input");
    let sym = d.join("sym.bin");
    std::os::unix::fs::symlink(d.join("elsewhere.bin"), &sym).unwrap();
    refuse(&sym, "a symbolic link");
    std::fs::create_dir(d.join("adir")).unwrap();
    refuse(&d.join("adir"), "a directory");
    refuse(Path::new("/dev/null"), "a device");
    refuse(&d.join("missing/out.bin"), "a missing directory");
    assert_eq!(std::fs::read(&input).unwrap(), before, "the input is untouched");
    // A corrupted input is an error, and nothing is written.
    let mut bad = before.clone();
    let t = Trace::open(&input).unwrap();
    let p = t
        .records()
        .unwrap()
        .iter()
        .find_map(|e| e.payload.filter(|p| p.len > 0))
        .unwrap();
    drop(t);
    bad[p.offset as usize] ^= 1;
    let badp = d.join("bad.bin");
    std::fs::write(&badp, &bad).unwrap();
    let out = d.join("out.bin");
    let o = moeconf(d, &["convert", s(&badp), "-o", s(&out)]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("do not match the record digest"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
    let leftovers: Vec<_> = std::fs::read_dir(d)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "no temporary file left: {leftovers:?}");
    // --to accepts 1, 2, 3 and 4 only.
    let o = moeconf(d, &["convert", s(&input), "-o", s(&out), "--to", "5"]);
    assert_eq!(code(&o), 2);
}

/// The same divergent pair in versions 1, 2, 3 and mixed: `diff` (text and
/// JSON), `gate` and `explain` give identical answers, so every pinned
/// report of a version 1 or 2 trace stays what it was.
#[test]
fn diff_gate_and_explain_answer_the_same_for_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join(".git")).unwrap();
    let (r2, c2) = (d.join("r2.bin"), d.join("c2.bin"));
    run(d, &r2, &[]);
    run(
        d,
        &c2,
        &[
            "--fork-layer",
            "5",
            "--fork-contract",
            "b",
            "--fork-order",
            "17",
            "--fork-step",
            "2",
        ],
    );
    // `run` writes version 4: r2 and c2 are its files, converted.
    let (r4, c4) = (d.join("r4.bin"), d.join("c4.bin"));
    std::fs::rename(&r2, &r4).unwrap();
    std::fs::rename(&c2, &c4).unwrap();
    let (r3, c3) = (d.join("r3.bin"), d.join("c3.bin"));
    convert(d, &r4, &r3, "3");
    convert(d, &c4, &c3, "3");
    convert(d, &r3, &r2, "2");
    convert(d, &c3, &c2, "2");
    let (r1, c1) = (d.join("r1.bin"), d.join("c1.bin"));
    convert(d, &r2, &r1, "1");
    convert(d, &c2, &c1, "1");
    let v2: [&Path; 2] = [&r2, &c2];
    for (r, c) in [
        (&r1, &c1),
        (&r1, &c2),
        (&r2, &c1),
        (&r3, &c3),
        (&r3, &c1),
        (&r2, &c3),
        (&r4, &c4),
        (&r4, &c1),
        (&r3, &c4),
    ] {
        let names: [&Path; 2] = [r, c];
        for args in [
            vec!["diff"],
            vec!["diff", "--format", "json"],
            vec!["diff", "--format", "json", "--no-contract-inference"],
            vec!["gate"],
            vec!["gate", "--format", "json"],
            vec!["gate", "--profile", "strict"],
        ] {
            let mut a = args.clone();
            a.extend([s(r), s(c)]);
            let got = moeconf(d, &a);
            let mut b = args.clone();
            b.extend([s(&r2), s(&c2)]);
            let want = moeconf(d, &b);
            assert_eq!(code(&got), code(&want), "{a:?}: {}", stderr(&got));
            assert!(code(&want) == 1, "{b:?} is divergent: {}", stderr(&want));
            assert_eq!(renamed(&stdout(&got), &names, &v2), stdout(&want), "{a:?}");
        }
    }
    for (v, t) in [
        (&c1, &c2),
        (&r1, &r2),
        (&c3, &c2),
        (&r3, &r2),
        (&c4, &c2),
        (&r4, &r2),
    ] {
        let got = moeconf(d, &["explain", s(v), "--format", "json"]);
        let want = moeconf(d, &["explain", s(t), "--format", "json"]);
        assert_eq!(code(&got), code(&want), "{}", stderr(&got));
        assert_eq!(renamed(&stdout(&got), &[v], &[t]), stdout(&want));
    }
    // Equal traces in either version are equivalent, whatever their versions.
    for (a, b) in [(&r1, &r2), (&r1, &r3), (&r3, &r2), (&r4, &r1), (&r4, &r3)] {
        let o = moeconf(d, &["diff", s(a), s(b)]);
        assert_eq!(code(&o), 0, "{}", stdout(&o));
    }
}

/// Every `.bin` under `dir` (recursively), sorted.
fn bins_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            bins_under(&p, out);
        } else if p.extension().is_some_and(|e| e == "bin") {
            out.push(p);
        }
    }
}

/// The shipped version 1 traces (every `.bin` of `fixtures/` that opens as
/// version 1) read and diff exactly as their `moeconf convert` to version 2:
/// `diff`, `gate` and `inspect` print the same JSON of the same records for
/// a version 1 pair, a version 2 pair and both mixed pairs.
#[test]
fn every_version_1_fixture_diffs_the_same_as_its_conversion() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join(".git")).unwrap();
    let mut bins = Vec::new();
    bins_under(&repo_root().join("fixtures"), &mut bins);
    let v1s: Vec<PathBuf> = bins
        .into_iter()
        .filter(|p| Trace::open_verified(p).is_ok_and(|t| t.format_version() == 1))
        .collect();
    assert!(
        v1s.iter().any(|p| p.ends_with("test-vectors/minimal-trace.bin")),
        "the version 1 test vector is among the fixtures: {v1s:?}"
    );
    for (n, fixture) in v1s.iter().enumerate() {
        // A copy, so that both sides of a pair are distinct paths.
        let (a1, b1) = (d.join(format!("a1-{n}.bin")), d.join(format!("b1-{n}.bin")));
        std::fs::copy(fixture, &a1).unwrap();
        std::fs::copy(fixture, &b1).unwrap();
        let (a2, b2) = (d.join(format!("a2-{n}.bin")), d.join(format!("b2-{n}.bin")));
        convert(d, fixture, &a2, "2");
        convert(d, fixture, &b2, "2");
        assert_eq!(Trace::open_verified(&a2).unwrap().format_version(), 2);
        let v2: [&Path; 2] = [&a2, &b2];
        for (r, c) in [(&a1, &b1), (&a1, &b2), (&a2, &b1)] {
            let names: [&Path; 2] = [r, c];
            for args in [
                vec!["diff", "--format", "json"],
                vec!["diff"],
                vec!["gate", "--format", "json"],
            ] {
                let mut a = args.clone();
                a.extend([s(r), s(c)]);
                let got = moeconf(d, &a);
                let mut b = args.clone();
                b.extend([s(&a2), s(&b2)]);
                let want = moeconf(d, &b);
                assert_eq!(code(&want), 0, "{} {b:?}: {}", fixture.display(), stderr(&want));
                assert_eq!(code(&got), 0, "{} {a:?}: {}", fixture.display(), stderr(&got));
                assert_eq!(
                    renamed(&stdout(&got), &names, &v2),
                    stdout(&want),
                    "{} {a:?}",
                    fixture.display()
                );
            }
        }
        let j = |p: &Path| -> serde_json::Value {
            let o = moeconf(d, &["inspect", s(p), "--format", "json"]);
            assert_eq!(code(&o), 0, "{}", stderr(&o));
            let mut v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
            for k in ["file", "file_bytes", "format_version"] {
                v.as_object_mut().unwrap().remove(k);
            }
            v
        };
        assert_eq!(j(&a1), j(&a2), "{}", fixture.display());
    }
}
