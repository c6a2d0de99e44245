//! `moeconf diff` as a process: exit codes 0 (equivalent), 1 (divergent) and
//! 2 (not comparable, unreadable), text and JSON output.

use moeconf_fingerprint::{Algorithm, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{Binding, CaptureSpec, Header, TraceWriter};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

/// A small trace: two steps of tokens, logits and one layer's post-FFN state;
/// `bump` changes the layer state of step 1 and the token of step 1.
fn write(path: &Path, prompt: &str, bump: bool) {
    let binding = Binding {
        prompt: moeconf_schema::PromptBinding {
            text: prompt.into(),
            ids: vec![1, 2],
        },
        decoding: moeconf_schema::Decoding {
            strategy: "greedy".into(),
            max_new_tokens: 2,
        },
        capture: CaptureSpec {
            levels: moeconf_fingerprint::LevelSet::ALL,
            payload_levels: moeconf_fingerprint::LevelSet::ALL,
        },
        ..Binding::default()
    };
    let mut w = TraceWriter::create(
        path,
        Algorithm::Blake3,
        Header {
            binding,
            ..Header::default()
        },
    )
    .unwrap();
    for step in 0..2u32 {
        let c = |layer: Option<u32>, path: &str| Coord {
            step,
            position: step + 1,
            phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
            layer,
            path: path.into(),
        };
        let changed = bump && step == 1;
        let state: Vec<u8> = [1.0f32, 2.0, if changed { 3.5 } else { 3.0 }]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        w.append(
            c(Some(0), "layer.post_ffn_mhc"),
            Level::L3,
            TensorView {
                dtype: DType::F32,
                shape: &[1, 3],
                bytes: &state,
            },
            true,
        )
        .unwrap();
        let tok = if changed { 9i32 } else { 4 + step as i32 }.to_le_bytes();
        w.append(
            c(None, "token.output"),
            Level::L0,
            TensorView {
                dtype: DType::I32,
                shape: &[1],
                bytes: &tok,
            },
            true,
        )
        .unwrap();
    }
    w.finish().unwrap();
}

fn moeconf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .env_remove("NO_COLOR")
        .output()
        .unwrap()
}

struct Fixture {
    _dir: tempfile::TempDir,
    reference: PathBuf,
    same: PathBuf,
    divergent: PathBuf,
    other_prompt: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    write(&p("ref.bin"), "hello", false);
    write(&p("same.bin"), "hello", false);
    write(&p("div.bin"), "hello", true);
    write(&p("other.bin"), "goodbye", false);
    Fixture {
        reference: p("ref.bin"),
        same: p("same.bin"),
        divergent: p("div.bin"),
        other_prompt: p("other.bin"),
        _dir: dir,
    }
}

#[test]
fn exit_codes_follow_diff_and_cmp() {
    let f = fixture();
    let out = moeconf(&["diff", s(&f.reference), s(&f.same)]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("EQUIVALENT"), "{text}");
    assert!(!text.contains('\x1b'), "no colors when stdout is not a terminal");

    let out = moeconf(&["diff", s(&f.reference), s(&f.divergent)]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("DIVERGENT"), "{text}");
    let last = text.lines().last().unwrap();
    assert!(
        last.contains("first divergence: L3 step 1") && last.contains("layer 0"),
        "{last}"
    );

    let out = moeconf(&["diff", s(&f.reference), s(&f.other_prompt)]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("not comparable") && err.contains("prompt.text"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
    // --force compares anyway (the records are identical).
    let out = moeconf(&["diff", "--force", s(&f.reference), s(&f.other_prompt)]);
    assert_eq!(out.status.code(), Some(0));

    let missing = f.reference.with_file_name("missing.bin");
    let out = moeconf(&["diff", s(&f.reference), s(&missing)]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn json_output_is_one_versioned_document() {
    let f = fixture();
    let out = moeconf(&["diff", "--format", "json", s(&f.reference), s(&f.divergent)]);
    assert_eq!(out.status.code(), Some(1));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["schema_version"], 5);
    assert_eq!(j["verdict"], "divergent");
    assert_eq!(j["first_divergence"]["level"], "L3");
    assert_eq!(j["first_divergence"]["operator"], "layer.post_ffn_mhc");
    assert_eq!(j["levels"]["L0"]["ordinal"], 2);
    assert_eq!(j["levels"]["L3"]["numeric"]["max_abs_delta"], 0.5);

    let out = moeconf(&["diff", "--color", "always", s(&f.reference), s(&f.divergent)]);
    assert!(String::from_utf8(out.stdout).unwrap().contains('\x1b'));
}

// ---------------------------------------------------------------------------
// End to end on the reference runtime: candidates with a known injected
// difference must be localized at exactly the injected step, layer and
// operator, and contract inference must name the injected contract.

const PROMPT: &str = "why the sheep";

fn run_trace(out: &Path, extra: &[&str]) {
    let mut args = run_args(out, "4", &["--capture", "all"]);
    args.extend_from_slice(extra);
    let o = moeconf(&args);
    assert!(
        o.status.success(),
        "run {extra:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn diff_json(reference: &Path, candidate: &Path) -> (i32, serde_json::Value) {
    let o = moeconf(&["diff", "--format", "json", s(reference), s(candidate)]);
    let code = o.status.code().unwrap_or(-1);
    assert!(code == 0 || code == 1, "{}", String::from_utf8_lossy(&o.stderr));
    (code, serde_json::from_slice(&o.stdout).unwrap())
}

#[test]
fn runtime_b_forks_are_localized_and_their_class_inferred() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("ref.bin");
    run_trace(&reference, &[]);
    let prompt_len = moeconf_schema::Trace::open(&reference)
        .unwrap()
        .binding()
        .prompt
        .ids
        .len() as u64;
    // (layer, class, step, position within the step's tokens)
    for (layer, class, step, position) in [
        (2u32, 135u64, 1u32, None),
        (5, 17, 2, None),
        (3, 300, 0, Some(1u64)),
    ] {
        let cand = dir.path().join(format!("fork-{layer}-{class}.bin"));
        let (layer_s, class_s, step_s) = (layer.to_string(), class.to_string(), step.to_string());
        let mut extra = vec![
            "--fork-layer",
            &layer_s,
            "--fork-contract",
            "b",
            "--fork-order",
            &class_s,
            "--fork-step",
            &step_s,
        ];
        let pos_s = position.map(|p| p.to_string());
        if let Some(p) = &pos_s {
            extra.extend(["--fork-position", p.as_str()]);
        }
        run_trace(&cand, &extra);
        let (code, j) = diff_json(&reference, &cand);
        assert_eq!(code, 1);
        let fd = &j["first_divergence"];
        let expect_pos = position.unwrap_or(prompt_len + u64::from(step) - 1);
        assert_eq!(
            (
                fd["step"].as_u64(),
                fd["layer"].as_u64(),
                fd["position"].as_u64(),
                fd["operator"].as_str()
            ),
            (
                Some(u64::from(step)),
                Some(u64::from(layer)),
                Some(expect_pos),
                Some("moe.combine")
            ),
            "fork layer {layer} class {class} step {step}: {fd}"
        );
        // The candidate is explained as exactly the injected B class (named
        // by what determines it when the class holds a named order).
        let con = &j["levels"]["L4"]["contract"];
        let e = &con["candidate_explanation"];
        let b = e["permutations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["family"] == "b")
            .unwrap_or_else(|| panic!("B not among {e}"));
        assert_eq!(b["listed"], serde_json::json!([format!("class:{class}")]), "{b}");
        assert_eq!(fd["contract"], e["simplest"]);
        assert_eq!(fd["contract"], format!("b+order=class:{class}"), "{e}");
        assert_eq!(con["reference_explanation"]["simplest"], "c");
        assert_eq!(con["reference_is_native"], true);
        assert_eq!(j["levels"]["L4"]["localized"]["inputs_match"], true);
    }
}

#[test]
fn runtime_layer_static_schedules_are_localized_and_c_is_equivalent() {
    use moeconf_contract::{b_class_of, permutation_from_index, prompt_hash, Schedule};
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("ref.bin");
    run_trace(&reference, &[]);
    for (scheme, sched) in [
        ("b", "layer-static:7"),
        ("a", "layer-static:7"),
        ("p32", "layer-static:7"),
        ("b", "token-dynamic:3"),
    ] {
        let schedule = Schedule::parse(sched).unwrap();
        let cand = dir.path().join(format!("{scheme}.bin"));
        run_trace(&cand, &["--contract", scheme, "--schedule", sched]);
        let (code, j) = diff_json(&reference, &cand);
        assert_eq!(code, 1, "{scheme} {sched}");
        let fd = &j["first_divergence"];
        assert_eq!(
            (fd["step"].as_u64(), fd["operator"].as_str()),
            (Some(0), Some("moe.combine")),
            "{scheme}: {fd}"
        );
        // The scheduled order of the localized layer is among the reproducing orders.
        let layer = fd["layer"].as_u64().unwrap() as u32;
        let position = fd["position"].as_u64().unwrap() as u32;
        let index = schedule
            .permutation_index(prompt_hash(PROMPT), layer, position, 6)
            .unwrap();
        let expect = if scheme == "b" {
            b_class_of(&permutation_from_index(6, index).unwrap()).unwrap()
        } else {
            index
        };
        let perms = j["levels"]["L4"]["contract"]["candidate_explanation"]["permutations"]
            .as_array()
            .unwrap()
            .clone();
        let m = perms
            .iter()
            .find(|m| m["family"] == scheme)
            .unwrap_or_else(|| panic!("{scheme} not inferred: {perms:?}"));
        let want = if scheme == "b" {
            format!("class:{expect}")
        } else {
            format!("index:{expect}")
        };
        let everything = m["matching"] == m["tried"];
        assert!(
            m["listed"].as_array().unwrap().iter().any(|o| *o == *want) || everything,
            "{scheme}: expected order {want}, got {m}"
        );
    }
    // C under any layer-static order reproduces the native result bitwise here.
    for seed in ["layer-static:7", "layer-static:11"] {
        let cand = dir.path().join("c.bin");
        run_trace(&cand, &["--contract", "c", "--schedule", seed]);
        let (code, j) = diff_json(&reference, &cand);
        assert_eq!(
            (code, j["verdict"].as_str()),
            (0, Some("equivalent")),
            "{seed}: {}",
            j["summary"]
        );
    }
}

/// A fork inside a 2,048-token prefill (layer 5, position 1,900): the L3
/// line's last match (the attention checkpoint of the fork's own position,
/// what counting the step's checkpoints named too) is read at its
/// position, so the reference reads a few pages more than the candidate
/// (the walk's), where counting the earlier checkpoints read the L3 groups
/// of layers 0–5 whole.
#[test]
fn a_prefill_forks_last_match_costs_the_pages_of_its_position() {
    use moeconf_bisect::{diff, DiffOptions, EarlierCheckpoints};
    use moeconf_schema::Trace;
    let dir = tempfile::tempdir().unwrap();
    let (pr, pc) = (dir.path().join("ref.bin"), dir.path().join("cand.bin"));
    let run = |out: &Path, extra: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            "builtin:tiny-v4",
            "--prompt-tokens",
            "2048",
            "--max-new-tokens",
            "2",
            "--capture",
            "L0,L1+payload,L2,L3,L4",
            "-o",
            s(out),
        ];
        args.extend_from_slice(extra);
        let o = moeconf(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    run(&pr, &[]);
    run(
        &pc,
        &["--fork-step", "0", "--fork-position", "1900", "--fork-layer", "5"],
    );
    let (r, c) = (Trace::open(&pr).unwrap(), Trace::open(&pc).unwrap());
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let l3 = &rep.levels.l3;
    let first = l3.first.as_ref().unwrap();
    assert_eq!(
        (first.step, first.layer, first.position, first.path.as_str()),
        (0, Some(5), 1900, "layer.post_ffn_mhc")
    );
    let last = l3.last_matched_checkpoint.as_ref().unwrap();
    assert_eq!(
        (last.step, last.layer, last.position, last.path.as_str()),
        (0, Some(5), 1900, "layer.post_attn_mhc")
    );
    assert_eq!(l3.earlier_checkpoints, Some(EarlierCheckpoints::Match));
    let (rp, cp) = (r.pages_read(), c.pages_read());
    // The L3 groups of layers 0-5 read whole: what the count cost.
    let whole = Trace::open(&pr).unwrap();
    let level = whole
        .step(0)
        .unwrap()
        .unwrap()
        .level(moeconf_fingerprint::Level::L3)
        .unwrap();
    for g in level.groups.iter().filter(|g| g.layer.is_some_and(|l| l <= 5)) {
        whole.read_group(g).unwrap();
    }
    eprintln!(
        "reference {rp} pages, candidate {cp}; L3 groups of layers 0-5: {}",
        whole.pages_read()
    );
    assert!(rp <= cp + 8, "reference {rp} pages, candidate {cp}");
    assert!(whole.pages_read() > 8, "the count's reads exceed the margin");
}
