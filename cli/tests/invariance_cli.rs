//! End-to-end: `moeconf invariance` on the reference runtime's presets (every
//! knob invariant, equal roots), on a command backend whose knob does change
//! the execution (FAIL, localized), under a policy's expectations, and with
//! failing commands and bad matrices (exit 2, never a verdict).

use std::path::Path;
use std::process::{Command, Output};

/// The path as UTF-8 (test paths always are).
fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 test path")
}

fn moeconf_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .current_dir(cwd)
        .env_remove("MOECONF_POLICY")
        .env_remove("MOECONF_PROFILE")
        .output()
        .expect("spawn moeconf")
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: stdout {} stderr {}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

#[test]
fn the_reference_presets_are_invariant_with_equal_roots_and_link_every_page() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("inv");
    let o = moeconf_in(
        dir.path(),
        &[
            "invariance",
            "--preset",
            "reference-knobs",
            "--max-new-tokens",
            "2",
            "--out",
            s(&out),
            "--format",
            "json",
            "-q",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&o);
    assert_eq!(v["kind"], "moeconf.invariance");
    assert_eq!(v["verdict"], "pass");
    let base_root = v["base"]["root"].as_str().unwrap().to_string();
    let cells = v["configurations"].as_array().unwrap();
    assert_eq!(cells.len(), 6);
    let index = std::fs::read_to_string(out.join("index.html")).unwrap();
    for (i, c) in cells.iter().enumerate() {
        assert_eq!(c["status"], "pass", "{c}");
        assert_eq!(
            c["root"].as_str(),
            Some(base_root.as_str()),
            "{}: root differs",
            c["name"]
        );
        assert_eq!(c["compared"]["tokens_equal"], true);
        assert_eq!(c["compared"]["logits_bitwise"], true);
        assert!(c["error"].is_null(), "a judged cell has no error: {c}");
        let page = format!("c{:02}.html", i + 1);
        assert_eq!(c["diff_page"], page.as_str());
        assert!(out.join(&page).is_file());
        assert!(
            index.contains(&format!("<a href=\"{page}\">")),
            "index links {page}"
        );
    }
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("invariance.json")).unwrap()).unwrap();
    assert_eq!(saved, v, "invariance.json is the report printed");

    // Rerun into the same directory: replaced as a whole, byte-identical report.
    let again = moeconf_in(
        dir.path(),
        &[
            "invariance",
            "--preset",
            "reference-knobs",
            "--max-new-tokens",
            "2",
            "--out",
            s(&out),
            "--format",
            "json",
            "-q",
        ],
    );
    assert_eq!(again.status.code(), Some(0));
    assert_eq!(again.stdout, o.stdout, "reruns give the same report");
}

/// A command matrix whose knob is the MoE combine contract of `moeconf run`
/// itself: a knob that really changes the execution.
fn contract_matrix(dir: &Path, extra: &str) -> std::path::PathBuf {
    let bin = env!("CARGO_BIN_EXE_moeconf");
    let text = format!(
        r#"[run]
backend = "command"
model = "builtin:tiny-v4"
command = ["{bin}", "run", "--model", "{{model}}", "--prompt", "why the sheep", "--max-new-tokens", "2",
           "--capture", "all", "--contract", "{{contract}}", "-o", "{{output}}"]
[base]
contract = "native"
[[config]]
name = "same contract"
contract = "native"
[[config]]
contract = "b+order=reversed"
{extra}"#
    );
    let p = dir.join("matrix.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_knob_that_changes_the_combine_fails_and_is_localized_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let m = contract_matrix(dir.path(), "");
    let out = dir.path().join("inv");
    let o = moeconf_in(
        dir.path(),
        &["invariance", s(&m), "--out", s(&out), "--format", "json", "-q"],
    );
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&o);
    assert_eq!(v["verdict"], "fail");
    let cells = v["configurations"].as_array().unwrap();
    assert_eq!(cells[0]["name"], "same contract");
    assert_eq!(cells[0]["changed"], serde_json::json!([]));
    assert_eq!(cells[0]["status"], "pass", "a rerun is bitwise");
    assert_eq!(cells[1]["name"], "contract=b+order=reversed");
    assert_eq!(cells[1]["status"], "fail");
    let first = &cells[1]["compared"]["first_divergence"];
    assert_eq!(first["operator"], "moe.combine", "{first}");
    assert_eq!(first["step"], 0);

    // The text report says the same.
    let o = moeconf_in(dir.path(), &["invariance", s(&m), "--out", s(&out), "-q"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("FAIL") && text.contains("moe.combine"), "{text}");

    // Declared informational in the matrix: reported, exit 0.
    let m = contract_matrix(dir.path(), "[expect]\ncontract = \"info\"\n");
    let o = moeconf_in(
        dir.path(),
        &["invariance", s(&m), "--out", s(&out), "--format", "json", "-q"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(json(&o)["configurations"][1]["status"], "info");

    // The policy's [invariance] section overrides the matrix: bitwise again.
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, "[invariance]\ncontract = \"bitwise\"\n").unwrap();
    let o = moeconf_in(
        dir.path(),
        &[
            "invariance",
            s(&m),
            "--policy",
            s(&policy),
            "--out",
            s(&out),
            "--format",
            "json",
            "-q",
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(json(&o)["expectations"][0]["expectation"], "bitwise");

    // Within a gate profile whose levels are informational: the gate passes.
    std::fs::write(
        &policy,
        "[invariance]\ncontract = \"profile:loose\"\n[profile.loose]\nlevels = { L0 = \"info\", L1 = \"info\", L2 = \"info\", L3 = \"info\", L4 = \"info\" }\n",
    )
    .unwrap();
    let o = moeconf_in(
        dir.path(),
        &[
            "invariance",
            s(&m),
            "--policy",
            s(&policy),
            "--out",
            s(&out),
            "--format",
            "json",
            "-q",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&o);
    assert_eq!(v["configurations"][1]["gate"], "pass");
    assert_eq!(v["configurations"][1]["status"], "pass");

    // A profile the policy does not define: refused before anything runs.
    std::fs::write(&policy, "[invariance]\ncontract = \"profile:nope\"\n").unwrap();
    let o = moeconf_in(
        dir.path(),
        &[
            "invariance",
            s(&m),
            "--policy",
            s(&policy),
            "--out",
            s(&out),
            "-q",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nope"));
}

#[test]
fn configurations_without_a_verdict_exit_2_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_moeconf");
    // One configuration's command fails, one writes no trace, one writes a
    // trace and then cuts it short.
    let text = format!(
        r#"[run]
backend = "command"
command = ["sh", "-c", "{{script}}", "sh", "{{output}}"]
[base]
script = "'{bin}' run --prompt 'why the sheep' --max-new-tokens 2 -o \"$1\""
[[config]]
name = "fails"
script = "echo the backend broke >&2; exit 7"
[[config]]
name = "writes nothing"
script = "true"
[[config]]
name = "truncated"
script = "'{bin}' run --prompt 'why the sheep' --max-new-tokens 2 -o \"$1\" && head -c 3000 \"$1\" > \"$1.t\" && mv \"$1.t\" \"$1\""
"#
    );
    let m = dir.path().join("m.toml");
    std::fs::write(&m, text).unwrap();
    let out = dir.path().join("inv");
    let o = moeconf_in(
        dir.path(),
        &["invariance", s(&m), "--out", s(&out), "--format", "json", "-q"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&o);
    assert_eq!(v["verdict"], "error");
    let cells = v["configurations"].as_array().unwrap();
    for c in cells {
        assert_eq!(c["status"], "error", "{c}");
    }
    assert!(cells[0]["error"].as_str().unwrap().contains("the backend broke"));
    assert!(cells[1]["error"].as_str().unwrap().contains("wrote no trace"));
    assert!(!cells[2]["error"].as_str().unwrap().is_empty());

    // A bad matrix: exit 2 naming the file, nothing written.
    std::fs::write(
        &m,
        "[run]\nbackend = \"reference\"\nprompt = \"x\"\n[[config]]\nthread = 2\n",
    )
    .unwrap();
    let out2 = dir.path().join("inv2");
    let o = moeconf_in(dir.path(), &["invariance", s(&m), "--out", s(&out2)]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("m.toml") && err.contains("no knob \"thread\""),
        "{err}"
    );
    assert!(!out2.exists());

    // An output directory holding something else is not replaced.
    let busy = dir.path().join("busy");
    std::fs::create_dir(&busy).unwrap();
    std::fs::write(busy.join("notes.txt"), "mine").unwrap();
    let o = moeconf_in(
        dir.path(),
        &[
            "invariance",
            "--preset",
            "reference-knobs",
            "--out",
            s(&busy),
            "-q",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(std::fs::read_to_string(busy.join("notes.txt")).unwrap(), "mine");
}
