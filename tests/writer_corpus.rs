//! The shared writer corpus (`tests/writer_corpus.json`, docs/format.md §10):
//! the Rust writer accepts exactly the cases marked `accept`, every trace it
//! accepts is accepted (fully verified) by the reader, a refused case leaves
//! no file at all, and the Python writer (`python/tests/writer_corpus.py`)
//! accepts and refuses the same cases and writes byte-identical files — in
//! both container versions (`expect_v1`, where given, is a case's answer for
//! version 1: version 2 takes records step by step, version 1 in any order).
//!
//! A value the Rust writer's types cannot hold (a u32 field beyond 2^32 - 1,
//! an unknown level, dtype or phase, bytes that are not UTF-8) counts as
//! refused: it cannot reach the Rust writer at all. The Python half needs
//! `python3` with numpy and blake3; without them it prints a note and only
//! the Rust half runs.

use moeconf_fingerprint::{Algorithm, Coord, DType, Digest, Level, LevelSet, Phase, TensorView};
use moeconf_schema::{Binding, Header, Provenance, TensorDigest, Trace, TraceWriter};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A corpus string: plain, `{"repeat": S, "count": N}` or `{"utf8_hex": H}`.
fn string(v: &Value) -> Result<String, String> {
    if let Some(s) = v.as_str() {
        return Ok(s.to_string());
    }
    if let (Some(s), Some(n)) = (v["repeat"].as_str(), v["count"].as_u64()) {
        return Ok(s.repeat(n as usize));
    }
    if let Some(h) = v["utf8_hex"].as_str() {
        let bytes = hex(h)?;
        return String::from_utf8(bytes).map_err(|_| "not UTF-8".to_string());
    }
    Err(format!("not a string: {v}"))
}

fn hex(s: &str) -> Result<Vec<u8>, String> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2).ok_or("odd hex")?, 16).map_err(|e| e.to_string()))
        .collect()
}

fn digest(v: &Value) -> Result<Digest, String> {
    Digest::from_hex(v.as_str().ok_or("digest")?).ok_or_else(|| "not 32 bytes".to_string())
}

fn u32_of(v: &Value) -> Result<u32, String> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| format!("{v} is not a u32"))
}

/// A level set from its wire bit mask; a level above L4 is refused, as the
/// writer of another language must refuse it.
fn level_set(v: &Value) -> Result<LevelSet, String> {
    let bits = u32_of(v)?;
    LevelSet::from_bits(bits).ok_or_else(|| format!("capture levels {bits:#b} name a level above L4"))
}

fn u64s(v: &Value) -> Result<Vec<u64>, String> {
    v.as_array()
        .ok_or("not a list")?
        .iter()
        .map(|d| d.as_u64().ok_or_else(|| format!("{d} is not a u64")))
        .collect()
}

/// A corpus pair list: `[[k, v], ...]` or `{"generate": N}`.
fn pairs(v: &Value) -> Result<Vec<(String, String)>, String> {
    if let Some(n) = v["generate"].as_u64() {
        return Ok((0..n).map(|i| (format!("k{i:05}"), "v".to_string())).collect());
    }
    v.as_array()
        .ok_or("pairs")?
        .iter()
        .map(|p| Ok((string(&p[0])?, string(&p[1])?)))
        .collect()
}

/// The header of a case, with the Python writer's defaults for missing fields.
fn header(case: &Value) -> Result<Header, String> {
    let mut b = Binding {
        contract: "native".into(),
        schedule: "identity".into(),
        ..Binding::default()
    };
    b.capture.levels = LevelSet::ALL;
    let empty = serde_json::Map::new();
    for (k, v) in case["binding"].as_object().unwrap_or(&empty) {
        match k.as_str() {
            "model_name" => b.model.name = string(v)?,
            "config_digest" => b.model.config_digest = digest(v)?,
            "weights_digest" => b.model.weights_digest = digest(v)?,
            "tensors" => {
                for t in v.as_array().ok_or("tensors")? {
                    b.model.tensors.push(TensorDigest {
                        name: string(&t["name"])?,
                        dtype: string(&t["dtype"])?,
                        shape: u64s(&t["shape"])?,
                        digest: digest(&t["digest"])?,
                    });
                }
            }
            "tokenizer_name" => b.tokenizer.name = string(v)?,
            "tokenizer_digest" => b.tokenizer.digest = digest(v)?,
            "prompt_text" => b.prompt.text = string(v)?,
            "prompt_ids" => {
                b.prompt.ids = v
                    .as_array()
                    .ok_or("ids")?
                    .iter()
                    .map(u32_of)
                    .collect::<Result<_, _>>()?
            }
            "decoding_strategy" => b.decoding.strategy = string(v)?,
            "max_new_tokens" => b.decoding.max_new_tokens = u32_of(v)?,
            "precision" => b.precision = string(v)?,
            "contract" => b.contract = string(v)?,
            "schedule" => b.schedule = string(v)?,
            "capture_levels" => b.capture.levels = level_set(v)?,
            "capture_payload_levels" => b.capture.payload_levels = level_set(v)?,
            "fold_negative_zero" => b.canon.fold_negative_zero = v.as_bool().ok_or("bool")?,
            "extra" => b.extra = pairs(v)?,
            other => panic!("corpus: unknown binding field {other}"),
        }
    }
    let provenance = match case.get("provenance") {
        None => Provenance {
            runtime: "moeconf-python".into(),
            version: String::new(),
            threads: 1,
            notes: vec![],
        },
        Some(p) => Provenance {
            runtime: string(&p["runtime"])?,
            version: string(&p["version"])?,
            threads: u32_of(&p["threads"])?,
            notes: pairs(&p["notes"])?,
        },
    };
    Ok(Header {
        binding: b,
        provenance,
    })
}

/// One record of a case: coordinate, level, dtype, shape, bytes, keep.
type Rec = (Coord, Level, DType, Vec<u64>, Vec<u8>, bool);

fn record(r: &Value) -> Result<Rec, String> {
    let phase = match r["phase"].as_str() {
        Some("prefill") => Phase::Prefill,
        Some("decode") => Phase::Decode,
        p => return Err(format!("phase {p:?}")),
    };
    let layer = match &r["layer"] {
        Value::Null => None,
        l => Some(u32_of(l)?),
    };
    let coord = Coord {
        step: u32_of(&r["step"])?,
        position: u32_of(&r["position"])?,
        phase,
        layer,
        path: r["path"].as_str().ok_or("path")?.into(),
    };
    let level = Level::from_code(u32_of(&r["level"])?).ok_or("level")?;
    let dtype = DType::from_name(r["dtype"].as_str().ok_or("dtype")?).ok_or("unknown dtype")?;
    let shape = u64s(&r["shape"])?;
    let bytes = hex(r["data_hex"].as_str().ok_or("data")?)?;
    Ok((
        coord,
        level,
        dtype,
        shape,
        bytes,
        r["keep_payload"].as_bool().unwrap_or(false),
    ))
}

/// Whether a case must be accepted by a writer of container `version`.
fn accepts(case: &Value, version: u32) -> bool {
    let expect = match (version, case.get("expect_v1")) {
        (1, Some(e)) => e,
        _ => &case["expect"],
    };
    expect == "accept"
}

/// Writes one case with the Rust writer in container `version`: `Ok(root)`
/// or why it was refused.
fn write_case(case: &Value, out: &Path, version: u32) -> Result<Digest, String> {
    let header = header(case)?;
    let records = case["records"].as_array().map_or(Ok(vec![]), |rs| {
        rs.iter().map(record).collect::<Result<Vec<_>, _>>()
    })?;
    let checked =
        moeconf_output::check_output(out, &moeconf_output::Inputs::new()).map_err(|e| e.to_string())?;
    let mut w = TraceWriter::create_version(&checked, Algorithm::Blake3, header, version)
        .map_err(|e| e.to_string())?;
    for (coord, level, dtype, shape, bytes, keep) in records {
        let view = TensorView {
            dtype,
            shape: &shape,
            bytes: &bytes,
        };
        w.append(coord, level, view, keep).map_err(|e| e.to_string())?;
    }
    Ok(w.finish().map_err(|e| e.to_string())?.root)
}

fn corpus() -> Vec<Value> {
    let text = std::fs::read_to_string(repo().join("tests/writer_corpus.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

#[test]
fn rust_writer_matches_the_corpus_and_its_reader_accepts_what_it_writes() {
    let dir = tempfile::tempdir().unwrap();
    let cases = corpus();
    assert!(cases.len() >= 40);
    let mut wrong = vec![];
    for version in [1, 2] {
        let mut roots = Vec::new();
        for (i, case) in cases.iter().enumerate() {
            let out = dir.path().join(format!("v{version}-case{i:03}.bin"));
            let name = case["name"].as_str().unwrap();
            let got = write_case(case, &out, version);
            if got.is_ok() != accepts(case, version) {
                wrong.push(format!(
                    "v{version} {name}: expected accept {}, got {got:?}",
                    accepts(case, version)
                ));
            }
            match got {
                Ok(root) => {
                    let t = Trace::open_verified(&out)
                        .unwrap_or_else(|e| panic!("{name}: the reader refuses: {e}"));
                    assert_eq!(t.root(), root, "{name}");
                    assert_eq!(t.format_version(), version, "{name}");
                    roots.push((i, root));
                }
                Err(_) => assert!(!out.exists(), "{name}: a refused case left a file"),
            }
        }
        // What both versions accept has the same root in both.
        if version == 2 {
            for (i, root) in roots {
                let v1 = Trace::open_verified(&dir.path().join(format!("v1-case{i:03}.bin"))).unwrap();
                assert_eq!(v1.root(), root, "{}: version 1 and 2 roots", cases[i]["name"]);
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

#[test]
fn python_and_rust_writers_accept_and_refuse_the_same_cases() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import numpy, blake3"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("note: {python} with numpy and blake3 not available; skipping the Python half");
        return;
    }
    for version in [1, 2] {
        let (rust_dir, py_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let out = Command::new(&python)
            .arg(repo().join("python/tests/writer_corpus.py"))
            .arg(repo().join("tests/writer_corpus.json"))
            .arg(py_dir.path())
            .arg(version.to_string())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let py: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
        let cases = corpus();
        assert_eq!(py.len(), cases.len());
        for (i, (case, p)) in cases.iter().zip(&py).enumerate() {
            let name = case["name"].as_str().unwrap();
            let file = format!("case{i:03}.bin");
            let rust = write_case(case, &rust_dir.path().join(&file), version);
            assert_eq!(
                rust.is_ok(),
                p["accepted"].as_bool().unwrap(),
                "v{version} {name}: Rust {rust:?}, Python {p}"
            );
            if let Ok(root) = rust {
                assert_eq!(p["root"].as_str(), Some(root.to_hex().as_str()), "{name}");
                let (a, b) = (
                    std::fs::read(rust_dir.path().join(&file)).unwrap(),
                    std::fs::read(py_dir.path().join(&file)).unwrap(),
                );
                assert!(a == b, "v{version} {name}: the two writers' files differ");
            }
        }
    }
}
