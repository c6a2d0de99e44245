//! `moeconf gate` as a process, on traces of the built-in fixture (2 new
//! tokens, so every run takes a fraction of a second): pass/fail verdicts,
//! the JUnit localization of a B fork, the f32-vs-bf16 policy decision,
//! baselines, exit codes, precedence, and the docs/ci.md recipe end to end.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

/// A scratch repository: `.git` marker, traces, and the `ci` policy of docs/ci.md as moeconf.toml.
struct Repo {
    dir: tempfile::TempDir,
}

impl Repo {
    fn new() -> Repo {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(".git")).unwrap();
        std::fs::write(
            dir.path().join("moeconf.toml"),
            between("<!-- ci-policy:begin -->", "<!-- ci-policy:end -->", "toml"),
        )
        .unwrap();
        Repo { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `moeconf run` on the fixture with extra arguments, into `name`.
    fn trace(&self, name: &str, extra: &[&str]) -> PathBuf {
        let out = self.path(name);
        let r = Command::new(BIN)
            .args(run_args(&out, "2", extra))
            .output()
            .unwrap();
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        out
    }

    /// `moeconf gate ARGS` run in the repository root with a clean MOECONF_* environment.
    fn gate(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        self.gate_in(self.dir.path(), args, env)
    }

    fn gate_in(&self, cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut c = Command::new(BIN);
        c.arg("gate").args(args).current_dir(cwd);
        for k in [
            "MOECONF_POLICY",
            "MOECONF_PROFILE",
            "MOECONF_FORMAT",
            "MOECONF_LEVELS",
            "MOECONF_EQUAL_NAN",
            "MOECONF_ROUTE_NEAR_TIE_MARGIN",
            "MOECONF_ARGMAX_NEAR_TIE_MARGIN",
        ] {
            c.env_remove(k);
        }
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().unwrap()
    }
}

/// The fenced block of `lang` between two markers of docs/ci.md.
fn between(begin: &str, end: &str, lang: &str) -> String {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/ci.md")).unwrap();
    let start = doc.find(begin).expect("begin marker") + begin.len();
    let stop = doc[start..].find(end).expect("end marker") + start;
    let block = &doc[start..stop];
    let fence = format!("```{lang}\n");
    let a = block.find(&fence).expect("fenced block") + fence.len();
    let b = block[a..].find("```").expect("closing fence") + a;
    block[a..b].to_string()
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

#[test]
fn equivalent_traces_pass_in_every_format() {
    let repo = Repo::new();
    let r = repo.trace("ref.bin", &[]);
    let again = repo.trace("again.bin", &["--threads", "2"]);
    for profile in ["strict", "ci", "default"] {
        let o = repo.gate(&[s(&r), s(&again), "--profile", profile], &[]);
        assert_eq!(
            code(&o),
            0,
            "{profile}: {}{}",
            stdout(&o),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            stdout(&o).trim_end().ends_with("0 near-ties"),
            "summary line last: {}",
            stdout(&o)
        );
    }
    let j = json(&repo.gate(&[s(&r), s(&again), "--format", "json"], &[]));
    assert_eq!(j["verdict"], "pass");
    assert_eq!(j["kind"], "moeconf.gate");
    assert!(j["levels"]
        .as_array()
        .unwrap()
        .iter()
        .all(|l| l["status"] == "pass"));
    let x = stdout(&repo.gate(&[s(&r), s(&again), "--format", "junit"], &[]));
    assert!(
        x.starts_with("<?xml") && x.contains("failures=\"0\"") && x.matches("<testcase").count() == 5,
        "{x}"
    );
    let md = stdout(&repo.gate(&[s(&r), s(&again), "--format", "md"], &[]));
    assert!(
        md.contains("PASS") && md.contains("| L4 operator intermediates | bitwise | PASS |"),
        "{md}"
    );
}

#[test]
fn b_fork_fails_with_a_junit_file_naming_the_localized_operator() {
    let repo = Repo::new();
    let r = repo.trace("ref.bin", &[]);
    let fork = repo.trace(
        "fork.bin",
        &["--fork-layer", "5", "--fork-contract", "b", "--fork-order", "135"],
    );
    let junit = repo.path("gate.xml");
    let o = repo.gate(
        &[s(&r), s(&fork), "--profile", "strict", "--junit", s(&junit)],
        &[],
    );
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    let x = std::fs::read_to_string(&junit).unwrap();
    // The L4 test case fails at the combine of layer 5 in step 1, and the diff localization agrees.
    assert!(
        x.contains("<failure message=\"L4 at step 1 pos 5 (decode) layer 5 moe.combine: differs bitwise\""),
        "{x}"
    );
    assert!(
        x.contains("first divergence (moeconf diff): step 1 pos 5 layer 5 operator moe.combine (L4)"),
        "{x}"
    );
    assert!(
        x.contains("name=\"rule bitwise [L4]\""),
        "one test case per failing rule: {x}"
    );
    let j = json(&repo.gate(&[s(&r), s(&fork), "--format", "json"], &[]));
    assert_eq!(j["localization"]["operator"], "moe.combine");
    assert_eq!(j["localization"]["layer"], 5);
    assert_eq!(j["localization"]["step"], 1);
    // The ci profile rejects it too: the changed token's reference margin (0.5) is no near-tie.
    let o = repo.gate(&[s(&r), s(&fork), "--profile", "ci"], &[]);
    assert_eq!(code(&o), 1);
    assert!(
        stdout(&o).contains("argmax flip 821 -> 793 (reference margin 5.000e-1"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn f32_vs_bf16_passes_only_under_the_tolerant_profile() {
    let repo = Repo::new();
    let r = repo.trace("ref.bin", &[]);
    let f = repo.trace("f32.bin", &["--precision", "f32"]);
    let o = repo.gate(&[s(&r), s(&f), "--profile", "ci", "--format", "json"], &[]);
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    let j = json(&o);
    assert_eq!(j["verdict"], "warn", "passes with near-tie warnings");
    let ties = j["near_ties"].as_array().unwrap();
    assert!(!ties.is_empty() && ties.iter().all(|t| t["kind"] == "route"));
    assert!(ties
        .iter()
        .all(|t| t["reference_margin"].as_f64().unwrap() < 0.25));
    let levels = j["levels"].as_array().unwrap();
    assert_eq!(levels[1]["status"], "pass");
    assert!(
        levels[1]["differing"].as_u64().unwrap() > 0,
        "the logits do differ"
    );
    // The smallest passing tolerances are printed per rule.
    let text = stdout(&repo.gate(&[s(&r), s(&f), "--profile", "ci"], &[]));
    assert!(
        text.contains("smallest passing tolerance: topk_overlap_min <= 8.750e-1, kl_max >= "),
        "{text}"
    );
    assert!(
        text.contains("near-ties (warnings)") && text.contains("reference margin"),
        "{text}"
    );
    for profile in ["strict", "default"] {
        let o = repo.gate(&[s(&r), s(&f), "--profile", profile], &[]);
        assert_eq!(code(&o), 1, "{profile} must refuse a precision change");
    }
    // The bf16 element-wise defaults alone are not enough on the logits.
    let o = repo.gate(
        &[
            s(&r),
            s(&f),
            "--profile",
            "default",
            "--level",
            "L1=tolerance",
            "--format",
            "json",
        ],
        &[],
    );
    assert_eq!(json(&o)["levels"][1]["status"], "fail");
    // Without the route near-tie rule the route flips fail, and the message shows the margin.
    let o = repo.gate(
        &[s(&r), s(&f), "--profile", "ci", "--route-near-tie-margin", "0"],
        &[],
    );
    assert_eq!(code(&o), 1);
    // Since a1f22d7 the message names the flip and the margin before the rule's verdict.
    assert!(
        stdout(&o).contains("router.topk: route flip ")
            && stdout(&o).contains("near-tie rule off): differs (rule requires exact equality)"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn tolerance_without_payloads_is_inconclusive() {
    let repo = Repo::new();
    let r = repo.trace("ref.bin", &[]);
    let f = repo.trace("f32.bin", &["--precision", "f32"]);
    let o = repo.gate(&[s(&r), s(&f), "--profile", "ci", "--level", "L2=tolerance"], &[]);
    assert_eq!(code(&o), 1);
    let t = stdout(&o);
    assert!(
        t.contains("inconclusive") && t.contains("--capture L2+payload"),
        "{t}"
    );
    // With payloads the same gate is decided (and passes).
    let ra = repo.trace("ref_all.bin", &["--capture", "all"]);
    let fa = repo.trace("f32_all.bin", &["--capture", "all", "--precision", "f32"]);
    let o = repo.gate(
        &[s(&ra), s(&fa), "--profile", "ci", "--level", "L2=tolerance"],
        &[],
    );
    assert_eq!(code(&o), 0, "{}", stdout(&o));
}

#[test]
fn baselines_bless_and_compare() {
    let repo = Repo::new();
    let r = repo.trace("ref.bin", &[]);
    let fork = repo.trace(
        "fork.bin",
        &["--fork-layer", "5", "--fork-contract", "b", "--fork-order", "135"],
    );
    let base = repo.path("moeconf-baseline.json");
    let o = repo.gate(&["--bless", "--baseline", s(&base), s(&r)], &[]);
    assert_eq!(code(&o), 0);
    assert!(stdout(&o).contains("(new baseline)"));
    let b: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&base).unwrap()).unwrap();
    assert_eq!(b["kind"], "moeconf.baseline");
    assert_eq!(b["steps"].as_array().unwrap().len(), 2);
    assert_eq!(b["steps"][0]["levels"].as_object().unwrap().len(), 5);
    let o = repo.gate(&["--baseline", s(&base), s(&r)], &[]);
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    let o = repo.gate(&["--baseline", s(&base), s(&fork), "--format", "json"], &[]);
    assert_eq!(code(&o), 1);
    let j = json(&o);
    assert_eq!(j["against"], "baseline");
    assert_eq!(
        j["levels"][4]["first_failure"]["at"]["step"], 1,
        "step 0 is unchanged by the fork"
    );
    // Re-blessing reports the old root; an info level is not compared.
    let o = repo.gate(&["--bless", "--baseline", s(&base), s(&fork)], &[]);
    assert!(stdout(&o).contains("(was "), "{}", stdout(&o));
    let o = repo.gate(
        &[
            "--baseline",
            s(&base),
            s(&r),
            "--level",
            "L0=info",
            "--level",
            "L1=info",
            "--level",
            "L2=info",
            "--level",
            "L3=info",
            "--level",
            "L4=info",
        ],
        &[],
    );
    assert_eq!(code(&o), 0);
    // Misuse and a corrupt baseline are errors (2).
    assert_eq!(
        code(&repo.gate(&["--bless", "--baseline", s(&base), s(&r), s(&fork)], &[])),
        2
    );
    assert_eq!(
        code(&repo.gate(&["--baseline", s(&base), s(&r), s(&fork)], &[])),
        2
    );
    assert_eq!(code(&repo.gate(&[s(&r)], &[])), 2);
    std::fs::write(&base, "{\"kind\": 3}").unwrap();
    let o = repo.gate(&["--baseline", s(&base), s(&r)], &[]);
    assert_eq!(code(&o), 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("moeconf-baseline.json"));
}

#[test]
fn exit_codes_and_bisect_mode() {
    let repo = Repo::new();
    let r = repo.trace("ref.bin", &[]);
    let fork = repo.trace(
        "fork.bin",
        &["--fork-layer", "5", "--fork-contract", "b", "--fork-order", "135"],
    );
    let missing = repo.path("missing.bin");
    let bad_policy = repo.path("bad.toml");
    std::fs::write(&bad_policy, "[profile.default]\nrules = []\n").unwrap();
    let b = "--bisect-exit-codes";
    assert_eq!(code(&repo.gate(&[b, s(&r), s(&r)], &[])), 0);
    assert_eq!(code(&repo.gate(&[b, s(&r), s(&fork)], &[])), 1);
    assert_eq!(code(&repo.gate(&[b, s(&r), s(&missing)], &[])), 125);
    assert_eq!(code(&repo.gate(&[s(&r), s(&missing)], &[])), 2);
    std::fs::write(repo.path("garbage.bin"), b"not a trace").unwrap();
    assert_eq!(
        code(&repo.gate(&[b, s(&r), s(&repo.path("garbage.bin"))], &[])),
        125
    );
    let o = repo.gate(&[b, "--policy", s(&bad_policy), s(&r), s(&r)], &[]);
    assert_eq!(code(&o), 128, "a broken policy aborts the bisection");
    let o = repo.gate(&["--policy", s(&bad_policy), s(&r), s(&r)], &[]);
    assert_eq!(code(&o), 2);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no catch-all"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        code(&repo.gate(&[b, s(&missing), s(&r)], &[])),
        128,
        "an unreadable reference is no skip"
    );
}

#[test]
fn discovery_environment_and_flags_in_precedence_order() {
    let repo = Repo::new();
    let r = repo.trace("ref.bin", &[]);
    let f = repo.trace("f32.bin", &["--precision", "f32"]);
    let sub = repo.path("deep/er");
    std::fs::create_dir_all(&sub).unwrap();
    // Discovered from a subdirectory at the repository root; profile from the environment.
    let o = repo.gate_in(
        &sub,
        &[s(&r), s(&f), "--format", "json"],
        &[("MOECONF_PROFILE", "ci")],
    );
    assert_eq!(code(&o), 0);
    let j = json(&o);
    assert_eq!(j["profile"]["name"], "ci");
    assert!(j["policy_source"].as_str().unwrap().ends_with("moeconf.toml"));
    // The flag beats the environment.
    let o = repo.gate(
        &[s(&r), s(&f), "--profile", "strict"],
        &[("MOECONF_PROFILE", "ci")],
    );
    assert_eq!(code(&o), 1);
    // MOECONF_FORMAT, MOECONF_LEVELS, MOECONF_EQUAL_NAN and the margins; flags over them.
    let env = [
        ("MOECONF_PROFILE", "ci"),
        ("MOECONF_FORMAT", "json"),
        ("MOECONF_LEVELS", "L4=bitwise"),
        ("MOECONF_EQUAL_NAN", "true"),
        ("MOECONF_ARGMAX_NEAR_TIE_MARGIN", "0.125"),
        ("MOECONF_ROUTE_NEAR_TIE_MARGIN", "0"),
    ];
    let o = repo.gate(&[s(&r), s(&f)], &env);
    let j = json(&o);
    assert_eq!(j["profile"]["levels"][4], "bitwise");
    assert_eq!(j["profile"]["equal_nan"], true);
    assert_eq!(j["profile"]["argmax_near_tie_margin"], 0.125);
    assert_eq!(j["profile"]["route_near_tie_margin"], 0.0);
    assert_eq!(code(&o), 1, "L4 bitwise and no route near-ties");
    let o = repo.gate(
        &[
            s(&r),
            s(&f),
            "--level",
            "L4=info",
            "--equal-nan",
            "false",
            "--argmax-near-tie-margin",
            "0.5",
            "--route-near-tie-margin",
            "0.25",
        ],
        &env,
    );
    let j = json(&o);
    assert_eq!(j["profile"]["levels"][4], "info");
    assert_eq!(j["profile"]["equal_nan"], false);
    assert_eq!(j["profile"]["argmax_near_tie_margin"], 0.5);
    assert_eq!(code(&o), 0);
    // Outside a repository with no policy: built-in defaults. --policy names a file explicitly.
    let elsewhere = tempfile::tempdir().unwrap();
    std::fs::create_dir(elsewhere.path().join(".git")).unwrap();
    let j = json(&repo.gate_in(elsewhere.path(), &[s(&r), s(&f), "--format", "json"], &[]));
    assert_eq!(j["policy_source"], "built-in defaults");
    let pol = repo.path("moeconf.toml");
    let o = repo.gate_in(
        elsewhere.path(),
        &[s(&r), s(&f), "--policy", s(&pol), "--profile", "ci"],
        &[],
    );
    assert_eq!(code(&o), 0);
    let o = repo.gate_in(
        elsewhere.path(),
        &[s(&r), s(&f), "--profile", "ci"],
        &[("MOECONF_POLICY", s(&pol))],
    );
    assert_eq!(code(&o), 0);
    assert_eq!(code(&repo.gate(&[s(&r), s(&f), "--profile", "nope"], &[])), 2);
    assert_eq!(code(&repo.gate(&[s(&r), s(&f), "--level", "L7=info"], &[])), 2);
}

#[test]
fn output_and_junit_files_and_argmax_near_ties() {
    let repo = Repo::new();
    let r = repo.trace("ref.bin", &[]);
    let fork = repo.trace(
        "fork.bin",
        &["--fork-layer", "5", "--fork-contract", "b", "--fork-order", "135"],
    );
    let (out, junit) = (repo.path("gate.md"), repo.path("gate.xml"));
    let o = repo.gate(
        &[
            s(&r),
            s(&fork),
            "--format",
            "md",
            "--output",
            s(&out),
            "--junit",
            s(&junit),
        ],
        &[],
    );
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        stdout(&o),
        "--output holds the same report"
    );
    assert!(stdout(&o).contains("FAIL") && stdout(&o).contains("**First divergence:**"));
    assert!(std::fs::read_to_string(&junit).unwrap().contains("<testsuites"));
    // An argmax near-tie threshold above the changed token's margin (0.5) accepts the token
    // flip at step 1 as a near-tie, and step 1's later records are not gated.
    let o = repo.gate(
        &[
            s(&r),
            s(&fork),
            "--profile",
            "ci",
            "--argmax-near-tie-margin",
            "0.75",
            "--format",
            "json",
        ],
        &[],
    );
    let j = json(&o);
    let ties = j["near_ties"].as_array().unwrap();
    assert!(
        ties.iter()
            .any(|t| t["kind"] == "argmax" && t["at"]["path"] == "token.output"),
        "{j}"
    );
    assert_eq!(j["levels"][0]["status"], "warn");
    // The logits gates still fail the fork (KL 4.2e-2 > 1e-2), so the verdict is fail.
    assert_eq!(code(&o), 1);
}

#[test]
fn the_ci_md_recipe_runs_end_to_end() {
    let repo = Repo::new();
    let script = repo.path("recipe.sh");
    std::fs::write(
        &script,
        between("<!-- recipe:begin -->", "<!-- recipe:end -->", "sh"),
    )
    .unwrap();
    let bin_dir = Path::new(BIN).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = Command::new("sh")
        .arg(&script)
        .current_dir(repo.dir.path())
        .env("PATH", path)
        .env_remove("MOECONF_PROFILE")
        .env_remove("MOECONF_FORMAT")
        .env_remove("MOECONF_POLICY")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{}\n{}",
        stdout(&o),
        String::from_utf8_lossy(&o.stderr)
    );
    let md = std::fs::read_to_string(repo.path("reports/gate.md")).unwrap();
    assert!(
        md.contains("moeconf gate: ✅ PASS") && md.contains("Near-ties"),
        "{md}"
    );
    assert!(std::fs::read_to_string(repo.path("reports/gate.xml"))
        .unwrap()
        .contains("failures=\"0\""));
    let strict: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo.path("reports/strict.json")).unwrap()).unwrap();
    assert_eq!(strict["verdict"], "fail");
    assert!(repo.path("reports/baseline.json").is_file());
}
