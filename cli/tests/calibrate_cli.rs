//! `moeconf calibrate --quick` end to end: exit 0, and the structural claims
//! that must hold on any model, read back from calibration.json and the TSV
//! files. Model-dependent counts (basins, divergence rates) are not pinned.

use std::process::Command;

use serde_json::Value;

fn calibrate(dir: &std::path::Path, extra: &[&str]) -> (std::process::Output, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(["calibrate", "--quick", "--quiet", "--out"])
        .arg(dir)
        .args(extra)
        .output()
        .expect("run moeconf");
    let text = std::fs::read_to_string(dir.join("calibration.json")).expect("calibration.json written");
    let json: Value = serde_json::from_str(&text).expect("valid JSON");
    (out, json)
}

#[test]
fn quick_calibration_passes_every_structural_claim() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (out, j) = calibrate(dir.path(), &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(j["schema_version"], 2);
    assert!(j.get("timings").is_none() && j.get("wall_seconds").is_none());
    assert_eq!(j["quick"], true);
    assert_eq!(j["all_claims_hold"], true);
    let p = &j["protocols"];
    // Protocol 11 is opt-in: not in the default selection.
    assert!(p.get("context_fork").is_none());
    assert!(j["sizes"].get("context").is_none());

    // 1: native replay bitwise identical.
    assert!(p["replay"]["prompts"].as_u64().unwrap() >= 1);
    assert_eq!(p["replay"]["identical"], p["replay"]["prompts"]);

    // 2: 720 raw B orders collapse to 360 classes, members bitwise equal; A has 720 orders.
    let f = &p["fork_sweep"];
    assert_eq!(f["b_raw_orders"], 720);
    assert_eq!(f["b_classes_observed"], 360);
    assert_eq!(f["b_classes_bitwise_consistent"], true);
    let schemes = f["schemes"].as_array().unwrap();
    assert_eq!(schemes[0]["raw_permutations"], 720);
    assert_eq!(schemes[1]["structural_classes"], 360);

    // 5: C bitwise equal to native everywhere.
    let c = &p["c_intermediate"];
    assert_eq!(c["all_bitwise"], true);
    assert!(c["runs"].as_u64().unwrap() >= 3);
    for row in c["per_prompt"].as_array().unwrap() {
        assert_eq!(row["missing_records"], 0);
        assert_eq!(row["moe_max_abs"], 0.0);
        assert_eq!(row["lm_max_abs"], 0.0);
    }
    // C has no route or token divergence in the persistent ablation either.
    let c_row = p["persistent"]["per_scheme"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["scheme"] == "c")
        .unwrap();
    assert_eq!(c_row["native_route_divergence"], 0);
    assert_eq!(c_row["native_token_divergence"], 0);

    // 6: post-mHC substitution reproduces the branch.
    let m = &p["post_mhc_substitution"];
    assert_eq!(m["pre_add_equals_h_p"], true);
    assert_eq!(m["reconstructed_equals_h_b"], true);
    assert_eq!(m["post_mhc_equal"], m["post_mhc_compared"]);
    assert_eq!(m["routes_equal"], m["routes_compared"]);
    assert_eq!(m["prefork_equal"], m["prefork_compared"]);
    assert_eq!(m["predictions_equal"], true);

    // 7: FP64 ΔS reconstructs every layer; the continuation is reproduced.
    let s = &p["persistent_state_substitution"];
    assert_eq!(s["fp64_layers_reconstructed"], s["layers"]);
    assert_eq!(s["reconstructed_equals_s_b"], true);
    assert_eq!(s["post_mhc_equal"], s["post_mhc_compared"]);
    assert_eq!(s["state_checkpoints_equal"], s["state_checkpoints_compared"]);
    assert_eq!(s["routes_equal"], s["routes_compared"]);
    assert!(s["post_mhc_compared"].as_u64().unwrap() > 0);

    // 10: every effective fault localized exactly (N/N, N >= 8); silent faults equivalent.
    let fm = &p["fault_matrix"];
    assert!(fm["effective"].as_u64().unwrap() >= 8);
    assert_eq!(fm["localized"], fm["effective"]);
    assert_eq!(fm["silent_reported_equivalent"], fm["silent"]);

    // The other protocols ran and wrote their tables.
    assert!(p["propagation"].is_object());
    assert!(p["breadth"]["stages"].as_array().unwrap().len() == 3);
    for tsv in [
        "replay",
        "basin_counts",
        "basin_rank_frequency",
        "persistent_ablation",
        "persistent_canonical_axes",
        "canonical_reference",
        "c_intermediate_summary",
        "mhc_equivalence_summary",
        "kv_equivalence_summary",
        "propagation_trace",
        "breadth_summary",
        "fault_localization",
    ] {
        let path = dir.path().join(format!("{tsv}.tsv"));
        assert!(path.is_file(), "{tsv}.tsv missing");
    }
    assert!(stdout.contains("Structural claims:"));
}

#[test]
fn bad_arguments_are_usage_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(["calibrate", "--quick", "--only", "12", "--out"])
        .arg(dir.path())
        .output()
        .expect("run moeconf");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--only 12"));
    // --context is protocol 11's alone, and a context has at least one token.
    for args in [
        &["--only", "2", "--context", "64"][..],
        &["--context", "64"][..],
        &["--only", "11", "--context", "0"][..],
        &["--only", "11", "--context", "1048577"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_moeconf"))
            .args(["calibrate", "--quick", "--quiet", "--out"])
            .arg(dir.path().join("c"))
            .args(args)
            .output()
            .expect("run moeconf");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--context"),
            "{args:?}"
        );
        assert!(!dir.path().join("c").exists(), "{args:?}");
    }
}

/// Protocol 11 (opt-in) at a short context: the short prompt and a
/// 300-token one side by side, the structural claim held, the fork visible
/// in the state after the fork step and only in layers after the fork.
#[test]
fn context_fork_at_a_short_context() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (out, j) = calibrate(
        dir.path(),
        &["--only", "11", "--context", "300", "--fork-tokens", "6"],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = &j["protocols"]["context_fork"];
    let runs = s["contexts"].as_array().expect("contexts");
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[1]["prompt_tokens"], 300);
    for r in runs {
        assert_eq!(r["steps"].as_array().map(Vec::len), Some(5), "{r}");
        assert_eq!(r["prefix_mhc_equal"], r["prefix_mhc_total"]);
        assert_eq!(r["prefix_state_equal"], true);
        if r["fork_changed_moe"] == true {
            // The fork's own post-mHC at layer 5 is the first checkpoint to differ.
            assert_eq!(r["first_mhc"]["step"], 1, "{r}");
            assert_eq!(r["first_mhc"]["layer"], 5, "{r}");
            assert_eq!(r["first_mhc"]["record"], "layer.post_ffn_mhc", "{r}");
        }
        if let Some(l) = r["first_state"][1].as_u64() {
            assert!(l > 5, "{r}");
        }
    }
    assert!(dir.path().join("context_fork.tsv").is_file());
    assert!(dir.path().join("context_fork_steps.tsv").is_file());
    assert!(String::from_utf8_lossy(&out.stdout).contains("[ok] context_fork_prefix_identical"));
    assert_eq!(j["sizes"]["context"], 300);
}
