//! End-to-end tests of `moeconf import` (docs/import.md): a generated dump
//! directory becomes a trace that `moeconf inspect` verifies; a dump of every
//! record of a `moeconf run --capture all` trace re-imports to the very same
//! root (and `moeconf diff` finds the two equivalent); dtype conversions are
//! exact; malformed dumps and manifests exit 2 with a message naming the file.

use moeconf_fingerprint::DType;
use moeconf_schema::Trace;
use safetensors::tensor::TensorView as StView;
use safetensors::Dtype;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn moeconf(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .env("MOECONF_CACHE_DIR", cache)
        .output()
        .expect("spawn moeconf")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// One dumped tensor: name, dtype, shape, little-endian bytes.
type Dumped = (String, Dtype, Vec<usize>, Vec<u8>);

/// Writes a safetensors file of dumped tensors.
fn write_st(path: &Path, tensors: &[Dumped]) {
    let views: Vec<(String, StView<'_>)> = tensors
        .iter()
        .map(|(n, d, sh, b)| (n.clone(), StView::new(*d, sh.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn manifest(extra_fields: &str) -> String {
    format!(
        r#"{{
  "model": {{"name": "dumped-backend", "config_digest": "{z}", "weights_digest": "{z}"}},
  "tokenizer": {{"digest": "{z}"}},
  "prompt": {{"text": "why the sheep", "ids": [11, 12]}},
  "max_new_tokens": 2,
  "precision": "bf16",
  "contract": "native",
  "schedule": "identity",
  "runtime": {{"name": "test-backend", "version": "0.1"}}{extra_fields}
}}"#,
        z = "0".repeat(64)
    )
}

/// A small dump: two steps, global and per-layer tensors, every supported dtype.
fn small_dump(dir: &Path) -> Vec<Dumped> {
    let f16 = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let t = vec![
        (
            "step.0.pos.0.token.input".to_string(),
            Dtype::I64,
            vec![2],
            [11i64, 12].iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        (
            "step.0.pos.1.token.output".into(),
            Dtype::I64,
            vec![1],
            7i64.to_le_bytes().to_vec(),
        ),
        (
            "step.0.pos.1.lm.logits".into(),
            Dtype::F32,
            vec![3],
            f32s(&[0.5, -0.0, 2.0]),
        ),
        // bf16 1.5, -inf; widened exactly to f32.
        (
            "step.0.pos.1.layer.0.layer.post_ffn_mhc".into(),
            Dtype::BF16,
            vec![2, 1],
            f16(&[0x3fc0, 0xff80]),
        ),
        // f16 1.0, -2.5, 65504, 2^-24 (subnormal), -0.0.
        (
            "step.0.pos.1.layer.0.attn.output".into(),
            Dtype::F16,
            vec![5],
            f16(&[0x3c00, 0xc100, 0x7bff, 0x0001, 0x8000]),
        ),
        (
            "step.0.pos.1.layer.0.moe.combine".into(),
            Dtype::F64,
            vec![1],
            0.1f64.to_le_bytes().to_vec(),
        ),
        (
            "step.0.pos.1.layer.0.state.cumulative_length".into(),
            Dtype::I32,
            vec![1],
            2i32.to_le_bytes().to_vec(),
        ),
        (
            "step.1.pos.2.token.input".into(),
            Dtype::I32,
            vec![1],
            7i32.to_le_bytes().to_vec(),
        ),
        (
            "step.1.pos.2.text.continuation".into(),
            Dtype::U8,
            vec![3],
            b"ok!".to_vec(),
        ),
        (
            "step.1.pos.2.layer.1.router.topk".into(),
            Dtype::U32,
            vec![2],
            [3u32, 1].iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
    ];
    std::fs::create_dir_all(dir).unwrap();
    // Two files, to check that a dump may be split.
    write_st(&dir.join("a.safetensors"), &t[..5]);
    write_st(&dir.join("b.safetensors"), &t[5..]);
    t
}

fn inspect_json(path: &Path, cache: &Path) -> serde_json::Value {
    let o = moeconf(&["inspect", s(path), "--format", "json"], cache);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn small_dump_imports_and_inspects() {
    let tmp = tempfile::tempdir().unwrap();
    let dump = tmp.path().join("dump");
    let t = small_dump(&dump);
    std::fs::write(
        dump.join("manifest.json"),
        manifest(r#", "extra": {"z": "1", "a": "2"}"#),
    )
    .unwrap();
    let out = tmp.path().join("imported.bin");
    let o = moeconf(&["import", s(&dump), "-o", s(&out)], tmp.path());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let v = inspect_json(&out, tmp.path());
    assert_eq!(v["records"]["total"], t.len());
    assert_eq!(v["records"]["with_payload"], t.len());
    assert_eq!(v["steps"]["count"], 2);
    assert_eq!(v["binding"]["model"]["name"], "dumped-backend");
    assert_eq!(v["binding"]["prompt"]["ids"], serde_json::json!([11, 12]));
    assert_eq!(v["binding"]["precision"], "bf16");
    assert_eq!(v["binding"]["extra"], serde_json::json!([["a", "2"], ["z", "1"]]));
    assert_eq!(v["provenance"]["runtime"], "test-backend");
    for (level, n) in [("L0", 4), ("L1", 1), ("L2", 1), ("L3", 2), ("L4", 2)] {
        assert_eq!(v["records"]["by_level"][level]["records"], n, "{level}");
    }

    let trace = Trace::open(&out).unwrap();
    let rec = |path: &str| {
        let i = trace
            .records()
            .unwrap()
            .iter()
            .position(|r| r.coord.path == path)
            .unwrap();
        (
            trace.records().unwrap()[i].clone(),
            trace.payload_verified(i).unwrap().unwrap().to_vec(),
        )
    };
    // Ids become the catalogue's i32, counters its i64.
    let (r, b) = rec("token.output");
    assert_eq!((r.dtype, b), (DType::I32, 7i32.to_le_bytes().to_vec()));
    let (r, b) = rec("state.cumulative_length");
    assert_eq!(
        (r.dtype, r.coord.layer, b),
        (DType::I64, Some(0), 2i64.to_le_bytes().to_vec())
    );
    // bf16 and f16 widen exactly to f32; f64 stays f64; u32/u8 stay.
    let (r, b) = rec("layer.post_ffn_mhc");
    assert_eq!(
        (r.dtype, r.shape.to_vec(), b),
        (DType::F32, vec![2, 1], f32s(&[1.5, f32::NEG_INFINITY]))
    );
    let (r, b) = rec("attn.output");
    assert_eq!(
        (r.dtype, b),
        (DType::F32, f32s(&[1.0, -2.5, 65504.0, 2f32.powi(-24), -0.0]))
    );
    assert_eq!(rec("moe.combine").0.dtype, DType::F64);
    assert_eq!(rec("router.topk").0.dtype, DType::U32);
    // Step 1 is a decode step; step 0 the prefill.
    let (r, _) = rec("text.continuation");
    assert_eq!((r.coord.step, r.coord.phase.name()), (1, "decode"));
    // Execution order: token.input first, layer records before the step's outputs.
    let order: Vec<&str> = trace
        .records()
        .unwrap()
        .iter()
        .map(|r| r.coord.path.as_str())
        .collect();
    assert_eq!(
        &order[..4],
        &["token.input", "attn.output", "moe.combine", "layer.post_ffn_mhc"]
    );

    // Importing twice gives byte-identical traces (no timestamps, no paths).
    let again = tmp.path().join("again.bin");
    assert!(moeconf(&["import", s(&dump), "-o", s(&again)], tmp.path())
        .status
        .success());
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&again).unwrap());

    // --payloads selects the payload levels recorded in the binding's capture spec
    // (records of at most 256 bytes, all of them here, keep their bytes anyway); the
    // capture spec is hashed, so the root changes with it.
    let fp = tmp.path().join("fp.bin");
    assert!(moeconf(
        &["import", s(&dump), "-o", s(&fp), "--payloads", "L0"],
        tmp.path()
    )
    .status
    .success());
    let v2 = inspect_json(&fp, tmp.path());
    assert_eq!(
        v2["binding"]["capture"]["payload_levels"],
        serde_json::json!(["L0"])
    );
    assert_eq!(v2["records"]["with_payload"], t.len());
    assert_ne!(v2["root"], v["root"]);
}

/// The built-in model directory materialized under `cache`.
fn builtin_dir(cache: &Path) -> PathBuf {
    std::fs::read_dir(cache)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("tiny-v4-"))
        })
        .expect("built-in model in the cache")
}

#[test]
fn dump_of_a_reference_run_reimports_to_the_same_root() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run.bin");
    let o = moeconf(
        &[
            "run",
            "--model",
            "builtin:tiny-v4",
            "--prompt",
            "why the sheep",
            "--max-new-tokens",
            "2",
            "--capture",
            "all",
            "-o",
            s(&run),
        ],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let trace = Trace::open(&run).unwrap();
    let b = trace.binding();

    // Dump every record by the naming convention, the way a PyTorch backend would:
    // ids as int64, bf16-representable float tensors as BF16, the rest as stored.
    let dump = tmp.path().join("dump");
    std::fs::create_dir_all(&dump).unwrap();
    let mut per_step: Vec<Vec<Dumped>> = vec![vec![]; 2];
    let (mut bf16_count, mut i64_count) = (0, 0);
    for (i, r) in trace.records().unwrap().iter().enumerate() {
        let c = &r.coord;
        let name = match c.layer {
            Some(l) => format!("step.{}.pos.{}.layer.{l}.{}", c.step, c.position, c.path),
            None => format!("step.{}.pos.{}.{}", c.step, c.position, c.path),
        };
        let bytes = trace.payload_verified(i).unwrap().unwrap().to_vec();
        let shape: Vec<usize> = r.shape.iter().map(|&d| d as usize).collect();
        let (dtype, bytes) = match r.dtype {
            DType::F32 if bytes.chunks_exact(4).all(|x| x[0] == 0 && x[1] == 0) => {
                bf16_count += 1;
                (
                    Dtype::BF16,
                    bytes.chunks_exact(4).flat_map(|x| [x[2], x[3]]).collect(),
                )
            }
            DType::F32 => (Dtype::F32, bytes),
            DType::I32 => {
                i64_count += 1;
                let wide = bytes
                    .chunks_exact(4)
                    .flat_map(|x| (i32::from_le_bytes([x[0], x[1], x[2], x[3]]) as i64).to_le_bytes())
                    .collect();
                (Dtype::I64, wide)
            }
            DType::I64 => (Dtype::I64, bytes),
            DType::U8 => (Dtype::U8, bytes),
            other => panic!("unexpected dtype {other:?} in a reference trace"),
        };
        per_step[c.step as usize].push((name, dtype, shape, bytes));
    }
    assert!(bf16_count > 100 && i64_count > 10, "{bf16_count} {i64_count}");
    for (step, tensors) in per_step.iter().enumerate() {
        write_st(&dump.join(format!("step{step}.safetensors")), tensors);
    }
    let model_dir = builtin_dir(tmp.path());
    let manifest = serde_json::json!({
        "model": {"name": b.model.name, "dir": model_dir},
        "tokenizer": {"name": b.tokenizer.name, "file": model_dir.join("tokenizer.json")},
        "prompt": {"text": b.prompt.text, "ids": b.prompt.ids},
        "max_new_tokens": b.decoding.max_new_tokens,
        "precision": b.precision,
        "contract": b.contract,
        "schedule": b.schedule,
        "runtime": {"name": "dumped-reference", "version": "1", "threads": 1},
    });
    std::fs::write(dump.join("manifest.json"), manifest.to_string()).unwrap();
    let imported = tmp.path().join("imported.bin");
    let o = moeconf(&["import", s(&dump), "-o", s(&imported)], tmp.path());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let t2 = Trace::open(&imported).unwrap();
    t2.verify_payloads().unwrap();
    assert_eq!(t2.binding(), trace.binding());
    assert_eq!(t2.root(), trace.root());
    assert_eq!(t2.records().unwrap().len(), trace.records().unwrap().len());
    assert_eq!(t2.provenance().runtime, "dumped-reference");
    let o = moeconf(&["diff", s(&run), s(&imported)], tmp.path());
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stdout));
}

/// Runs import on `dump` and expects exit 2 with every `needles` in stderr and no output file.
fn expect_error(tmp: &Path, dump: &Path, extra: &[&str], needles: &[&str]) {
    let out = tmp.join("never.bin");
    let mut args = vec!["import", s(dump), "-o", s(&out)];
    args.extend_from_slice(extra);
    let o = moeconf(&args, tmp);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for n in needles {
        assert!(err.contains(n), "expected {n:?} in: {err}");
    }
    assert!(!out.exists());
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn malformed_dumps_exit_2_with_clear_messages() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let good = |name: &str| -> PathBuf {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("manifest.json"), manifest("")).unwrap();
        d
    };
    let one = |d: &Path, name: &str, dtype: Dtype, bytes: Vec<u8>| {
        let n = bytes.len() / (dtype.bitsize() / 8);
        write_st(
            &d.join("x.safetensors"),
            &[(name.to_string(), dtype, vec![n], bytes)],
        );
    };

    // A tensor name outside the convention.
    let d = good("badname");
    one(&d, "model.layers.0.mlp.out", Dtype::F32, f32s(&[1.0]));
    expect_error(
        dir,
        &d,
        &[],
        &[
            "x.safetensors",
            "model.layers.0.mlp.out",
            "does not follow the convention",
        ],
    );

    // Leading zeros would make two names for one coordinate.
    let d = good("zeros");
    one(&d, "step.0.pos.01.lm.logits", Dtype::F32, f32s(&[1.0]));
    expect_error(dir, &d, &[], &["step.0.pos.01.lm.logits", "not a decimal u32"]);

    // A component with no level.
    let d = good("nolevel");
    one(&d, "step.0.pos.0.custom.op", Dtype::F32, f32s(&[1.0]));
    expect_error(dir, &d, &[], &["custom.op", "component_levels"]);
    // ... which the manifest can map.
    std::fs::write(
        d.join("manifest.json"),
        manifest(r#", "component_levels": {"custom.": "L4"}"#),
    )
    .unwrap();
    let ok = dir.join("mapped.bin");
    assert!(moeconf(&["import", s(&d), "-o", s(&ok)], dir).status.success());

    // A mapping may not move a catalogue component to another level: a
    // trace with `moe.combine` at L0 would only ever differ from every
    // reference, for a reason nobody would look for.
    let d = good("moved");
    one(&d, "step.0.pos.0.layer.0.moe.combine", Dtype::F32, f32s(&[1.0]));
    std::fs::write(
        d.join("manifest.json"),
        manifest(r#", "component_levels": {"moe.": "L0"}"#),
    )
    .unwrap();
    expect_error(
        dir,
        &d,
        &[],
        &["moe.combine", "at L0", "catalogue component of level L4"],
    );

    // Unsupported dtype.
    let d = good("dtype");
    one(&d, "step.0.pos.0.layer.0.attn.q", Dtype::I8, vec![1, 2]);
    expect_error(
        dir,
        &d,
        &[],
        &["step.0.pos.0.layer.0.attn.q", "unsupported dtype I8"],
    );

    // An id that does not fit the catalogue's i32.
    let d = good("range");
    one(
        &d,
        "step.0.pos.0.token.output",
        Dtype::I64,
        (1i64 << 40).to_le_bytes().to_vec(),
    );
    expect_error(dir, &d, &[], &["token.output", "does not fit"]);

    // A step beyond max_new_tokens.
    let d = good("step");
    one(&d, "step.2.pos.5.lm.logits", Dtype::F32, f32s(&[1.0]));
    expect_error(dir, &d, &[], &["step 2 but the manifest says max_new_tokens = 2"]);

    // Missing manifest field.
    let d = good("field");
    one(&d, "step.0.pos.0.lm.logits", Dtype::F32, f32s(&[1.0]));
    let m = manifest("").replace("  \"precision\": \"bf16\",\n", "");
    std::fs::write(d.join("manifest.json"), m).unwrap();
    expect_error(dir, &d, &[], &["manifest.json", "missing field `precision`"]);

    // Unknown manifest field (a typo must not be ignored).
    std::fs::write(d.join("manifest.json"), manifest(r#", "precission": "f32""#)).unwrap();
    expect_error(dir, &d, &[], &["manifest.json", "unknown field `precission`"]);

    // Model given neither as a directory nor as digests; bad hex.
    let m = manifest("").replace(
        &format!(
            r#""config_digest": "{z}", "weights_digest": "{z}""#,
            z = "0".repeat(64)
        ),
        r#""config_digest": "abc""#,
    );
    std::fs::write(d.join("manifest.json"), m).unwrap();
    expect_error(dir, &d, &[], &["manifest.json", "model needs either"]);
    let m = manifest("").replacen(&"0".repeat(64), "xyz", 1);
    std::fs::write(d.join("manifest.json"), m).unwrap();
    expect_error(
        dir,
        &d,
        &[],
        &["manifest.json", "model.config_digest", "not 64 hex digits"],
    );

    // No manifest at all; invalid JSON.
    std::fs::remove_file(d.join("manifest.json")).unwrap();
    expect_error(dir, &d, &[], &["manifest.json", "docs/import.md"]);
    std::fs::write(d.join("manifest.json"), "{").unwrap();
    expect_error(dir, &d, &[], &["manifest.json", "invalid manifest"]);

    // Not a safetensors file; no dump files; duplicate tensor across files.
    let d = good("corrupt");
    std::fs::write(
        d.join("x.safetensors"),
        b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage",
    )
    .unwrap();
    expect_error(dir, &d, &[], &["x.safetensors", "not a valid safetensors file"]);
    let d = good("empty");
    expect_error(dir, &d, &[], &["no *.safetensors files"]);
    let d = good("dup");
    for f in ["a", "b"] {
        write_st(
            &d.join(format!("{f}.safetensors")),
            &[("step.0.pos.0.lm.logits".into(), Dtype::F32, vec![1], f32s(&[1.0]))],
        );
    }
    expect_error(dir, &d, &[], &["b.safetensors", "appears in more than one file"]);

    // Bad --payloads and a missing directory.
    expect_error(dir, &d, &["--payloads", "L9"], &["--payloads", "L9"]);
    expect_error(dir, &dir.join("nope"), &[], &["nope", "not a directory"]);
}
