//! `moeconf run --precision official` on the quantized fixture and `moeconf diff`
//! against the bf16 profile (docs/operators.md §10, docs/diff.md "Quantization
//! sites"): the two profiles differ, and the diff localizes their first
//! difference where their numerics first part — step 0, position 0, layer 0,
//! `attn.hc_post_weights` (DeepSeek's mHC pre mixes), its input matching — in
//! either direction, saying near the top that the profiles differ; the
//! quantization sites are reported apart from coverage differences; the
//! official profile defaults to DeepSeek's MoE combine and an explicit
//! `--contract` wins; a candidate that skips one site at one (step, layer) is
//! localized to exactly that site; two official traces are equivalent and the
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
fn official_and_bf16_part_where_their_numerics_first_differ() {
    let dir = tempfile::tempdir().unwrap();
    let bf16 = trace(dir.path(), "bf16", "1");
    let official = trace(dir.path(), "official", "1");

    for (r, c, side) in [(&bf16, &official, "candidate"), (&official, &bf16, "reference")] {
        let (code, v) = diff_json(r, c);
        assert_eq!(code, 1, "divergent: {v}");
        // Measured: the first operator the two profiles compute differently
        // is layer 0's mHC pre mixes, `(Φ·x)·rsqrt` (official, DeepSeek's
        // hc_pre) against `Φ·(x·rsqrt)` (bf16, transformers'): the post
        // weights differ by up to 4 ulp while the pre weights still match.
        let f = &v["first_divergence"];
        assert_eq!(f["level"], "L4", "{f}");
        assert_eq!(f["step"], 0, "{f}");
        assert_eq!(f["position"], 0, "{f}");
        assert_eq!(f["layer"], 0, "{f}");
        assert_eq!(f["operator"], "attn.hc_post_weights", "{f}");
        assert_eq!(f["present_in"], "both", "{f}");
        assert_eq!(f["kind"], "propagating", "{f}");
        let d = &v["divergences"][0];
        assert_eq!(d["inputs_match"], true, "{d}");
        assert_eq!(d["inputs"][0]["input"], "embed.output", "{d}");
        assert_eq!(d["inputs"][0]["status"], "match", "{d}");
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
    }

    // The text report says plainly, near the top, that the profiles differ,
    // and the binding records each side's combine (DeepSeek's for official).
    let o = moeconf(&["diff", s(&bf16), s(&official)]);
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8_lossy(&o.stdout);
    let head: String = text.lines().take(6).collect::<Vec<_>>().join("\n");
    assert!(
        head.contains(
            "different precision profiles: the reference ran precision profile bf16, the candidate official"
        ),
        "{text}"
    );
    assert!(
        head.contains("expected difference  precision: bf16 -> official"),
        "{text}"
    );
    assert!(
        head.contains("expected difference  contract: native -> c+shared=last+order=asc-id"),
        "{text}"
    );
    assert!(
        text.contains("first divergence: L4 step 0 position 0 layer 0 operator attn.hc_post_weights"),
        "{text}"
    );
    assert!(
        text.contains("Quantization sites held by one side only: 10 component(s)"),
        "{text}"
    );
    // Two traces of one profile get no such line.
    let o = moeconf(&["diff", s(&official), s(&official)]);
    assert_eq!(o.status.code(), Some(0));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("different precision profiles"));
}

#[test]
fn official_defaults_to_deepseeks_combine_and_an_explicit_contract_wins() {
    let dir = tempfile::tempdir().unwrap();
    let official = trace(dir.path(), "official", "1");
    let o = moeconf(&["inspect", s(&official), "--format", "json", "--no-verify"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["binding"]["contract"], "c+shared=last+order=asc-id",
        "{}",
        v["binding"]
    );
    let native = dir.path().join("official-native.bin");
    let o = moeconf(&[
        "run",
        "--model",
        "builtin:tiny-v4-fp8",
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "4",
        "--capture",
        "all",
        "--precision",
        "official",
        "--contract",
        "native",
        "-o",
        s(&native),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (code, v) = diff_json(&official, &native);
    assert_eq!(v["candidate"]["contract"], "native", "{v}");
    assert_eq!(v["reference"]["contract"], "c+shared=last+order=asc-id", "{v}");
    // The bf16 profile's default is unchanged.
    let bf16 = trace(dir.path(), "bf16", "1");
    let (_, b) = diff_json(&bf16, &bf16);
    assert_eq!(b["reference"]["contract"], "native", "{b}");
    // Measured on this fixture: the two combines give the same bits
    // everywhere (the official terms are BF16 values spanning few binades, so
    // every C-family FP32 sum of them is exact whatever the order,
    // docs/contracts.md), so only the bindings differ.
    assert_eq!(code, 0, "{v}");
}

/// A backend that runs DeepSeek's numerics but skips one quantization site
/// at one (step, layer): `moeconf diff` against an official trace names that
/// site, step and layer as the first divergence, its inputs matching. The
/// candidate is written through the calibration library (the CLI has no
/// fault option); both traces share the binding of `moeconf run`'s library.
#[test]
fn a_skipped_quantization_site_is_the_first_divergence() {
    use moeconf_calibrate::{Ctx, CtxOptions, Sizes, TraceRequest};
    use moeconf_contract::NativeCombine;
    use moeconf_fingerprint::Component;
    use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
    use moeconf_reference_runtime::precision::Precision;

    let dir = tempfile::tempdir().unwrap();
    let m = moeconf_runner::load_model("builtin:tiny-v4-fp8").expect("built-in quantized model");
    let ctx = Ctx::new(
        m,
        CtxOptions {
            precision: Precision::Official,
            fork_layer: 5,
            sizes: Sizes::QUICK,
            out: dir.path().to_path_buf(),
            progress: moeconf_shard::ProgressMode::Off,
        },
    )
    .expect("context");
    let prompt = "why the sheep";
    let ids = ctx.encode(prompt).unwrap();
    let write = |name: &str, plan: Option<&FaultPlan>| {
        let path = dir.path().join(name);
        ctx.write_trace(TraceRequest {
            prompt,
            prompt_ids: &ids,
            tokens: 3,
            combine: &NativeCombine,
            faults: plan,
            notes: Vec::new(),
            path: &path,
        })
        .expect("trace");
        path
    };
    let reference = write("reference.bin", None);
    // Site Q3 (the window KV's FP8 fake quantization) at step 2, layer 3 (HCA).
    let (site, step, layer) = (Component::AttnKvFp8, 2u32, 3u32);
    let plan = FaultPlan::new(vec![Fault::at(
        step,
        layer,
        FaultKind::QuantizationSiteSkipped(site),
    )]);
    let candidate = write("skipped.bin", Some(&plan));

    let (code, v) = diff_json(&reference, &candidate);
    assert_eq!(code, 1, "{v}");
    let f = &v["first_divergence"];
    assert_eq!(f["operator"], "attn.kv_fp8", "{f}");
    assert_eq!(f["step"], step, "{f}");
    assert_eq!(f["layer"], layer, "{f}");
    assert_eq!(f["present_in"], "both", "{f}");
    let d = &v["divergences"][0];
    assert_eq!(d["inputs_match"], true, "{d}");
    assert!(v["quantization_one_side"].as_array().unwrap().is_empty(), "{v}");
    let o = moeconf(&["diff", s(&reference), s(&candidate)]);
    let text = String::from_utf8_lossy(&o.stdout);
    if std::env::var_os("MOECONF_TEST_PRINT").is_some() {
        eprintln!("{text}");
    }
    assert!(
        text.contains(&format!("first divergence: L4 step {step} position"))
            && text.contains(&format!("layer {layer} operator attn.kv_fp8")),
        "{text}"
    );
    assert!(!text.contains("different precision profiles"), "{text}");
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
        String::from_utf8_lossy(&o.stderr).contains("expected bf16, f32, official or vllm-cpu"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The vllm-cpu profile's default combine follows the kernel vLLM picks by
/// the routed experts' format (docs/operators.md §11): `c+routed=bf16` for
/// MXFP4 experts, the fused-gate FMA sum (`operand=fma`) for BF16 experts;
/// a profile that never forms the experts' outputs before their gate
/// refuses `operand=fma` before it runs.
#[test]
fn vllm_cpu_profile_follows_the_experts_kernel_and_fma_needs_gate_free_outputs() {
    let dir = tempfile::tempdir().unwrap();
    for (model, want) in [
        ("builtin:tiny-v4-vllm", "c+routed=bf16"),
        (
            "builtin:tiny-v4-vllm-bf16",
            "p32+routed=bf16+start=first+operand=fma",
        ),
    ] {
        let out = dir.path().join(format!("{}.bin", model.replace(':', "-")));
        let o = run(model, "vllm-cpu", "1", &out);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let o = moeconf(&["inspect", s(&out), "--format", "json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["binding"]["contract"], want, "{model}: {}", v["binding"]);
        // explain says that the recorded terms cannot check a fused-gate sum.
        let o = moeconf(&["explain", s(&out)]);
        let text = String::from_utf8_lossy(&o.stdout);
        assert_eq!(
            text.contains("note: the declared contract") && text.contains("operand=fma"),
            want.ends_with("operand=fma"),
            "{model}: {text}"
        );
    }
    let out = dir.path().join("official-fma.bin");
    let o = moeconf(&[
        "run",
        "--model",
        "builtin:tiny-v4-vllm",
        "--prompt",
        "why",
        "--precision",
        "official",
        "--contract",
        "p32+operand=fma",
        "-o",
        s(&out),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("operand=fma") && err.contains("official profile"),
        "{err}"
    );
    assert!(!out.exists(), "nothing is written");
    // The sweep's branches and schemes are contracts too (before: a panic, exit 101).
    for (option, value) in [("--branch", "p32+operand=fma"), ("--scheme", "c+operand=fma")] {
        let o = moeconf(&[
            "sweep",
            "--model",
            "builtin:tiny-v4-vllm",
            "--precision",
            "official",
            "--prompt",
            "why",
            "--fork-layer",
            "1",
            "--max-new-tokens",
            "2",
            "--limit",
            "2",
            option,
            value,
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{option}: {err}");
        assert!(
            err.contains(option) && err.contains("operand=fma"),
            "{option}: {err}"
        );
    }
}
