//! Coverage is part of the verdict (docs/ci.md, "What moeconf promises about
//! its exit codes"): a level, step or record missing on one side never
//! passes. Each test here gave exit 0 (or a silent pass) on the old code:
//! an empty candidate against a blessed baseline, an empty reference, a
//! candidate that captured only L0 under `--profile strict`, a baseline
//! with `steps: []` or without a required level, a baseline whose binding
//! (prompt, decoding) differs from the candidate's, a version-1 baseline
//! without binding fields, and `moeconf diff` of a candidate that captured
//! fewer levels or of two empty traces.

use moeconf_fingerprint::{Algorithm, Component, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{Binding, CaptureSpec, Header, IndexEntry, Trace, TraceWriter};
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

    /// Blesses `trace` into `name` and returns the baseline's path.
    fn bless(&self, name: &str, trace: &Path) -> PathBuf {
        let base = self.path(name);
        let o = self.moeconf(&["gate", "--bless", "--baseline", s(&base), s(trace)]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        base
    }
}

/// A copy of `src` (written with `--capture all`, so every record keeps its
/// payload) under the same header, keeping only the records `keep` accepts.
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

/// Rewrites a baseline file through `edit`.
fn edit_baseline(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut b: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut b);
    std::fs::write(path, serde_json::to_string_pretty(&b).unwrap()).unwrap();
}

#[test]
fn an_empty_candidate_never_passes() {
    let repo = Repo::new();
    let r = repo.run("ref.bin", &["--capture", "all"]);
    let empty = filtered(&r, &repo.path("empty.bin"), |_| false);
    let base = repo.bless("base.json", &r);
    // An empty candidate holds 0 of its 2 steps: not a verdict (exit 2)
    // unless --allow-incomplete, and then its coverage fails.
    for profile in ["default", "strict"] {
        let o = repo.moeconf(&["gate", "--profile", profile, "--baseline", s(&base), s(&empty)]);
        assert_eq!(code(&o), 2, "{profile}: {}", both(&o));
        assert!(stderr(&o).contains("incomplete: 0 of 2 steps"), "{}", stderr(&o));
        let o = repo.moeconf(&[
            "gate",
            "--allow-incomplete",
            "--profile",
            profile,
            "--baseline",
            s(&base),
            s(&empty),
        ]);
        assert_eq!(code(&o), 1, "{profile}: {}", both(&o));
        assert!(
            stdout(&o).contains("required level missing from the candidate"),
            "{}",
            stdout(&o)
        );
        let o = repo.moeconf(&[
            "gate",
            "--allow-incomplete",
            "--profile",
            profile,
            s(&r),
            s(&empty),
        ]);
        assert_eq!(code(&o), 1, "{profile}: {}", both(&o));
    }
    // Not even with every requirement switched off: an empty trace is never
    // equivalent to a non-empty one.
    let o = repo.moeconf(&[
        "gate",
        "--allow-incomplete",
        "--required",
        "none",
        "--baseline",
        s(&base),
        s(&empty),
    ]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    let o = repo.moeconf(&[
        "gate",
        "--allow-incomplete",
        "--required",
        "none",
        s(&r),
        s(&empty),
    ]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    // `diff` agrees; blessing an empty trace is refused, also when
    // incomplete traces are accepted.
    assert_eq!(code(&repo.moeconf(&["diff", s(&r), s(&empty)])), 2);
    assert_eq!(
        code(&repo.moeconf(&["diff", "--allow-incomplete", s(&r), s(&empty)])),
        1
    );
    let e = repo.path("e.json");
    let o = repo.moeconf(&["gate", "--bless", "--baseline", s(&e), s(&empty)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(stderr(&o).contains("incomplete: 0 of 2 steps"), "{}", stderr(&o));
    let o = repo.moeconf(&[
        "gate",
        "--bless",
        "--allow-incomplete",
        "--baseline",
        s(&e),
        s(&empty),
    ]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(stderr(&o).contains("no records"), "{}", stderr(&o));
}

#[test]
fn an_empty_reference_is_an_error() {
    let repo = Repo::new();
    let r = repo.run("ref.bin", &["--capture", "all"]);
    let empty = filtered(&r, &repo.path("empty.bin"), |_| false);
    for profile in ["default", "strict"] {
        let o = repo.moeconf(&["gate", "--profile", profile, s(&empty), s(&r)]);
        assert_eq!(code(&o), 2, "{profile}: {}", both(&o));
        assert!(
            stderr(&o).contains("empty.bin") && stderr(&o).contains("no records"),
            "{}",
            stderr(&o)
        );
    }
    let o = repo.moeconf(&["gate", "--bisect-exit-codes", s(&empty), s(&r)]);
    assert_eq!(code(&o), 128, "a broken reference aborts a bisection");
    assert_eq!(code(&repo.moeconf(&["diff", s(&empty), s(&r)])), 2);
    assert_eq!(
        code(&repo.moeconf(&["diff", "--allow-incomplete", s(&empty), s(&r)])),
        1
    );
    // Two empty traces: nothing was compared, so nothing is equivalent.
    let o = repo.moeconf(&["diff", "--allow-incomplete", s(&empty), s(&empty)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    let o = repo.moeconf(&["gate", s(&empty), s(&empty)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
}

#[test]
fn strict_requires_every_level_the_reference_holds() {
    let repo = Repo::new();
    let r = repo.run("ref.bin", &[]);
    let l0 = repo.run("l0.bin", &["--capture", "L0"]);
    let o = repo.moeconf(&["gate", "--profile", "strict", s(&r), s(&l0), "--format", "json"]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    let j = json(&o);
    assert_eq!(j["verdict"], "fail");
    assert_eq!(j["levels"][0]["status"], "pass", "L0 itself matches");
    for l in 1..5 {
        let level = &j["levels"][l];
        assert_eq!(level["status"], "fail", "L{l}: {level}");
        let reason = level["first_failure"]["reason"].as_str().unwrap();
        assert!(
            reason.starts_with("required level missing from the candidate"),
            "{reason}"
        );
    }
    assert_eq!(j["profile"]["required"], serde_json::json!(["reference"]));
    // The default profile requires L0, L1 and every judged level the reference holds.
    let o = repo.moeconf(&["gate", s(&r), s(&l0), "--format", "json"]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    assert_eq!(json(&o)["levels"][1]["status"], "fail");
    // Info levels are not required by default; an explicit requirement can be relaxed.
    let info = [
        "--level", "L1=info", "--level", "L2=info", "--level", "L3=info", "--level", "L4=info",
    ];
    let mut args = vec!["gate", s(&r), s(&l0), "--required", "L0,judged"];
    args.extend(info);
    let o = repo.moeconf(&args);
    assert_eq!(code(&o), 0, "{}", both(&o));
    assert!(stdout(&o).contains("NOT COMPARED"), "{}", stdout(&o));
    // Against a baseline, the same.
    let base = repo.bless("base.json", &r);
    let o = repo.moeconf(&["gate", "--profile", "strict", "--baseline", s(&base), s(&l0)]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    // `diff` no longer calls a candidate with fewer levels equivalent.
    let o = repo.moeconf(&["diff", s(&r), s(&l0), "--format", "json"]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    let j = json(&o);
    assert_eq!(j["verdict"], "divergent");
    assert_eq!(
        j["uncompared_levels"],
        serde_json::json!([
            {"level": "L1", "present_in": "reference"},
            {"level": "L2", "present_in": "reference"},
            {"level": "L3", "present_in": "reference"},
            {"level": "L4", "present_in": "reference"},
        ])
    );
    assert!(
        j["summary"]
            .as_str()
            .unwrap()
            .contains("L1, L2, L3, L4 captured only by the reference"),
        "{}",
        j["summary"]
    );
}

#[test]
fn a_required_level_missing_from_the_reference_is_an_error() {
    let repo = Repo::new();
    let l0 = repo.run("l0.bin", &["--capture", "L0"]);
    let r = repo.run("ref.bin", &[]);
    let o = repo.moeconf(&["gate", s(&l0), s(&r)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    let e = stderr(&o);
    assert!(
        e.contains("l0.bin") && e.contains("L1") && e.contains("required"),
        "{e}"
    );
}

#[test]
fn baselines_without_steps_or_required_levels_are_refused() {
    let repo = Repo::new();
    let r = repo.run("ref.bin", &["--capture", "all"]);
    let base = repo.bless("base.json", &r);
    assert_eq!(code(&repo.moeconf(&["gate", "--baseline", s(&base), s(&r)])), 0);
    let no_steps = repo.path("no-steps.json");
    std::fs::copy(&base, &no_steps).unwrap();
    edit_baseline(&no_steps, |b| b["steps"] = serde_json::json!([]));
    let o = repo.moeconf(&["gate", "--baseline", s(&no_steps), s(&r)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(
        stderr(&o).contains("no-steps.json") && stderr(&o).contains("no steps"),
        "{}",
        stderr(&o)
    );
    // A baseline without L1 (required by the default profile): blessed from
    // a trace that holds no L1 record (editing the L1 digests out of a
    // baseline makes it inconsistent, an error of its own, below).
    let no_l1_trace = filtered(&r, &repo.path("no-l1.bin"), |e| e.level != Level::L1);
    let no_l1 = repo.bless("no-l1.json", &no_l1_trace);
    let o = repo.moeconf(&["gate", "--baseline", s(&no_l1), s(&r)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(
        stderr(&o).contains("no-l1.json") && stderr(&o).contains("L1"),
        "{}",
        stderr(&o)
    );
    let o = repo.moeconf(&["gate", "--bisect-exit-codes", "--baseline", s(&no_l1), s(&r)]);
    assert_eq!(code(&o), 128);
}

/// A baseline whose digests no longer belong together (one level digest,
/// one step digest or the root edited, or a level removed) is an error
/// naming the file, never a verdict: the comparison takes a step's blessed
/// level digests on trust once the candidate's step digest matches, so an
/// unchecked edit would pass unseen with the blessed run and fail the wrong
/// level with another.
#[test]
fn edited_baselines_are_refused() {
    let repo = Repo::new();
    let r = repo.run("ref.bin", &[]);
    let base = repo.bless("base.json", &r);
    let flip = |d: &serde_json::Value| {
        let t = d.as_str().unwrap();
        let first = if t.starts_with('0') { "1" } else { "0" };
        serde_json::Value::from(format!("{first}{}", &t[1..]))
    };
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "level",
            Box::new(move |b| {
                let d = &mut b["steps"][1]["levels"]["L3"];
                *d = flip(d);
            }),
            "step 1's digest",
        ),
        (
            "step",
            Box::new(move |b| {
                let d = &mut b["steps"][0]["digest"];
                *d = flip(d);
            }),
            "step 0's digest",
        ),
        (
            "root",
            Box::new(move |b| {
                let d = &mut b["root"];
                *d = flip(d);
            }),
            "the root",
        ),
        (
            "binding-digest",
            Box::new(move |b| {
                let d = &mut b["binding_digest"];
                *d = flip(d);
            }),
            "binding_digest is not the digest of the binding bytes",
        ),
        (
            // The readable binding edited to another run's config digest:
            // before baseline schema version 3 this passed a candidate of
            // that configuration.
            "binding-field",
            Box::new(move |b| {
                let d = &mut b["binding"]["model"]["config_digest"];
                *d = flip(d);
            }),
            "binding.model.config_digest is not what the blessed binding's own bytes say",
        ),
        (
            "binding-wire",
            Box::new(move |b| {
                let d = &mut b["binding_wire"];
                *d = flip(d);
            }),
            "binding_digest is not the digest of the binding bytes",
        ),
        (
            "no-l1",
            Box::new(|b| {
                for step in b["steps"].as_array_mut().unwrap() {
                    step["levels"].as_object_mut().unwrap().remove("L1");
                }
            }),
            "step 0's digest",
        ),
    ];
    for (name, edit, what) in cases {
        let edited = repo.path(&format!("{name}.json"));
        std::fs::copy(&base, &edited).unwrap();
        edit_baseline(&edited, edit);
        let o = repo.moeconf(&["gate", "--baseline", s(&edited), s(&r)]);
        assert_eq!(code(&o), 2, "{name}: {}", both(&o));
        let e = stderr(&o);
        assert!(
            e.contains(&format!("{name}.json")) && e.contains(what) && e.contains("edited or corrupted"),
            "{name}: {e}"
        );
    }
}

#[test]
fn baselines_check_the_binding_like_traces() {
    let repo = Repo::new();
    let r = repo.run("ref.bin", &[]);
    let base = repo.bless("base.json", &r);
    let b: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&base).unwrap()).unwrap();
    assert_eq!(b["schema_version"], 3);
    assert_eq!(b["binding"]["prompt"]["text"], "why the sheep");
    assert_eq!(b["binding"]["decoding"]["max_new_tokens"], 2);
    // Another prompt: refused like trace against trace, every field listed.
    let other = repo.path("other.bin");
    let mut args = run_args(&other, "2", &[]);
    args[4] = "why the goat";
    let o = Command::new(BIN).args(&args).output().unwrap();
    assert!(o.status.success());
    let o = repo.moeconf(&["gate", "--baseline", s(&base), s(&other)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    let e = stderr(&o);
    assert!(
        e.contains("base.json")
            && e.contains("prompt.text")
            && e.contains("prompt.ids")
            && e.contains("--force"),
        "{e}"
    );
    assert_eq!(
        code(&repo.moeconf(&["gate", "--baseline", s(&base), s(&r), s(&other)])),
        2
    );
    // Forced: compared (and failing), the forced fields noted.
    let o = repo.moeconf(&["gate", "--force", "--baseline", s(&base), s(&other)]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    assert!(stdout(&o).contains("forced over prompt.text"), "{}", stdout(&o));
    // Another decoding length.
    let longer = repo.path("longer.bin");
    let o = Command::new(BIN)
        .args(run_args(&longer, "3", &[]))
        .output()
        .unwrap();
    assert!(o.status.success());
    let o = repo.moeconf(&["gate", "--baseline", s(&base), s(&longer)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    assert!(stderr(&o).contains("decoding.max_new_tokens"), "{}", stderr(&o));
    // Precision is an expected backend difference: compared, not refused.
    let f32 = repo.run("f32.bin", &["--precision", "f32"]);
    let o = repo.moeconf(&["gate", "--baseline", s(&base), s(&f32)]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    // Trace against trace, --force reaches the comparability check too.
    let o = repo.moeconf(&["gate", s(&r), s(&other)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    let o = repo.moeconf(&["gate", "--force", s(&r), s(&other)]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    assert!(stdout(&o).contains("forced over prompt.text"), "{}", stdout(&o));
}

#[test]
fn version_1_baselines_are_refused_with_a_rebless_message() {
    let repo = Repo::new();
    let r = repo.run("ref.bin", &[]);
    let base = repo.bless("base.json", &r);
    // The version-1 layout: no binding object.
    edit_baseline(&base, |b| {
        b["schema_version"] = 1.into();
        b.as_object_mut().unwrap().remove("binding");
    });
    let o = repo.moeconf(&["gate", "--baseline", s(&base), s(&r)]);
    assert_eq!(code(&o), 2, "{}", both(&o));
    let e = stderr(&o);
    assert!(
        e.contains("base.json") && e.contains("schema version 1") && e.contains("--bless"),
        "{e}"
    );
    // Re-blessing replaces it (same root: the trace is unchanged).
    let o = repo.moeconf(&["gate", "--bless", "--baseline", s(&base), s(&r)]);
    assert_eq!(code(&o), 0, "{}", both(&o));
    assert!(stdout(&o).contains("(unchanged)"), "{}", stdout(&o));
    assert_eq!(code(&repo.moeconf(&["gate", "--baseline", s(&base), s(&r)])), 0);
}

#[test]
fn steps_and_records_on_one_side_fail_with_a_reason() {
    let repo = Repo::new();
    let r = repo.run("ref.bin", &["--capture", "all"]);
    let base = repo.bless("base.json", &r);
    // A step missing: incomplete (exit 2) unless accepted, and then it fails.
    let short = filtered(&r, &repo.path("short.bin"), |e| e.coord.step == 0);
    assert_eq!(code(&repo.moeconf(&["gate", s(&r), s(&short)])), 2);
    let o = repo.moeconf(&["gate", "--allow-incomplete", s(&r), s(&short)]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    assert!(stdout(&o).contains("only in the reference"), "{}", stdout(&o));
    let o = repo.moeconf(&["gate", "--allow-incomplete", "--baseline", s(&base), s(&short)]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    assert!(
        stdout(&o).contains("blessed step/level missing from the candidate"),
        "{}",
        stdout(&o)
    );
    // One component missing from a judged level.
    let no_margin = filtered(&r, &repo.path("no-margin.bin"), |e| {
        !Component::LmMargin.matches(&e.coord.path)
    });
    let o = repo.moeconf(&["gate", s(&r), s(&no_margin), "--format", "json"]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    let j = json(&o);
    assert_eq!(j["levels"][1]["status"], "fail");
    assert_eq!(
        j["levels"][1]["first_failure"]["reason"],
        "only in the reference (missing from the candidate)"
    );
    // A candidate holding a level whose records the reference lacks, while
    // both declare it: its records fail (they used to be ignored).
    let no_l2 = filtered(&r, &repo.path("no-l2.bin"), |e| e.level != Level::L2);
    let o = repo.moeconf(&["gate", "--required", "L0", s(&no_l2), s(&r), "--format", "json"]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    assert_eq!(
        json(&o)["levels"][2]["first_failure"]["reason"],
        "only in the candidate"
    );
}

/// Two traces of one L4 record without a layer (a model-global operator)
/// that differ: the summary names the record.
#[test]
fn a_differing_record_without_a_layer_is_named_in_the_summary() {
    let repo = Repo::new();
    let write = |name: &str, v: f32| {
        let path = repo.path(name);
        let binding = Binding {
            capture: CaptureSpec {
                levels: moeconf_fingerprint::LevelSet::ALL,
                payload_levels: moeconf_fingerprint::LevelSet::ALL,
            },
            decoding: moeconf_schema::Decoding {
                strategy: "greedy".into(),
                max_new_tokens: 1,
            },
            ..Binding::default()
        };
        let header = Header {
            binding,
            ..Header::default()
        };
        let mut w = TraceWriter::create(&path, Algorithm::Blake3, header).unwrap();
        let coord = Coord {
            step: 0,
            position: 0,
            phase: Phase::Prefill,
            layer: None,
            path: Component::AttnNorm.path().into(),
        };
        let bytes = v.to_le_bytes();
        let view = TensorView {
            dtype: DType::F32,
            shape: &[1],
            bytes: &bytes,
        };
        w.append(coord, Level::L4, view, true).unwrap();
        w.finish().unwrap();
        path
    };
    let (a, b) = (write("a.bin", 1.0), write("b.bin", 2.0));
    let o = repo.moeconf(&["diff", s(&a), s(&b)]);
    assert_eq!(code(&o), 1, "{}", both(&o));
    let out = stdout(&o);
    let summary = out.trim_end().lines().last().unwrap();
    assert!(!out.contains("steps []"), "{out}");
    assert_eq!(
        summary, "first divergence: L4 step 0 position 0 operator attn.norm",
        "{out}"
    );
    assert!(
        out.starts_with(
            "DIVERGENT: the candidate departs from the reference at step 0 position 0, in attn.norm (L4)"
        ),
        "{out}"
    );
}
