//! `moeconf run --precision official` on the quantized fixture and `moeconf diff`
//! against the bf16 profile (docs/operators.md §10, docs/diff.md "Quantization
//! sites"): the two profiles differ, and the diff localizes their first
//! difference to the first quantization site — step 0, position 0, layer 0,
//! `attn.norm_fp8`, held by the official trace only, its input `attn.norm`
//! matching — in either direction; the quantization sites are reported apart
//! from coverage differences; two official traces are equivalent and the
//! profile's root does not depend on the thread count; a model whose
//! dimensions DeepSeek's kernels reject is refused before anything is written.

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

/// The path as UTF-8 (test paths always are).
fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 test path")
}

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

fn moeconf(args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("MOECONF_") {
            c.env_remove(k);
        }
    }
    c.output().unwrap()
}

fn run(model: &str, precision: &str, threads: &str, out: &Path) -> Output {
    moeconf(&[
        "run",
        "--model",
        model,
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "4",
        "--capture",
        "all",
        "--precision",
        precision,
        "--threads",
        threads,
        "-o",
        s(out),
    ])
}

fn trace(dir: &Path, precision: &str, threads: &str) -> std::path::PathBuf {
    let out = dir.join(format!("{precision}-{threads}.bin"));
    let o = run("builtin:tiny-v4-fp8", precision, threads, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

fn diff_json(r: &Path, c: &Path) -> (i32, Value) {
    let o = moeconf(&["diff", s(r), s(c), "--format", "json"]);
    let code = o.status.code().unwrap_or(-1);
    let v: Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stderr)));
    (code, v)
}

#[test]
fn official_and_bf16_part_at_the_first_quantization_site() {
    let dir = tempfile::tempdir().unwrap();
    let bf16 = trace(dir.path(), "bf16", "1");
    let official = trace(dir.path(), "official", "1");

    for (r, c, side) in [(&bf16, &official, "candidate"), (&official, &bf16, "reference")] {
        let (code, v) = diff_json(r, c);
        assert_eq!(code, 1, "divergent: {v}");
        let f = &v["first_divergence"];
        assert_eq!(f["level"], "L4", "{f}");
        assert_eq!(f["step"], 0, "{f}");
        assert_eq!(f["position"], 0, "{f}");
        assert_eq!(f["layer"], 0, "{f}");
        assert_eq!(f["operator"], "attn.norm_fp8", "{f}");
        assert_eq!(f["present_in"], side, "{f}");
        assert_eq!(f["kind"], "propagating", "{f}");
        let d = &v["divergences"][0];
        assert_eq!(d["inputs_match"], true, "{d}");
        assert_eq!(d["inputs"][0]["input"], "attn.norm (layer 0)", "{d}");
        assert_eq!(d["inputs"][0]["status"], "match", "{d}");
        // Compared with what the other side reads instead (its attn.norm): the
        // quantization error, not "nothing to compare".
        let cmp = &v["levels"]["L4"]["localized"]["comparison"];
        assert_eq!(cmp["kind"], "float", "{cmp}");
        assert!(cmp["differing"].as_u64().unwrap() > 0, "{cmp}");
        // All ten sites are held by the official trace only, reported apart from coverage.
        let q = v["quantization_one_side"].as_array().unwrap();
        assert_eq!(q.len(), 10, "{q:?}");
        assert!(q.iter().all(|g| g["present_in"] == side), "{q:?}");
        let coverage = v["one_side_only"].as_array().unwrap();
        assert!(
            coverage
                .iter()
                .all(|g| !g["component"].as_str().unwrap().contains("_fp")),
            "{coverage:?}"
        );
        // The consumer of a site one side alone has reads a differing input.
        assert_eq!(v["levels"]["L4"]["localized"]["at"]["path"], "attn.norm_fp8");
    }

    // The text report says which side quantizes and why the other is the identity.
    let o = moeconf(&["diff", s(&bf16), s(&official)]);
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(
            "in attn.norm_fp8 (L4), quantized by the candidate only (the reference's precision profile bf16 has no quantization sites)"
        ),
        "{text}"
    );
    assert!(
        text.contains("first divergence: L4 step 0 position 0 layer 0 operator attn.norm_fp8 (quantized by the candidate only)"),
        "{text}"
    );
    assert!(
        text.contains("Quantization sites held by one side only: 10 component(s)"),
        "{text}"
    );
}

#[test]
fn official_traces_are_equivalent_and_thread_independent() {
    let dir = tempfile::tempdir().unwrap();
    let one = trace(dir.path(), "official", "1");
    let two = trace(dir.path(), "official", "2");
    let (code, v) = diff_json(&one, &two);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["verdict"], "equivalent");
    assert_eq!(v["reference"]["root"], v["candidate"]["root"]);
    assert_eq!(v["reference"]["precision"], "official");
}

#[test]
fn official_refuses_dimensions_the_kernels_reject() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("never.bin");
    let o = run("builtin:tiny-v4", "official", "1", &out);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("config.json: precision official: key `head_dim`")
            && err.contains("= 48 must be a positive multiple of 64"),
        "{err}"
    );
    assert!(!out.exists(), "nothing is written");
    let o = run("builtin:tiny-v4-fp8", "fp8", "1", &out);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("expected bf16, f32 or official"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
