//! Rust writer vs Python writer on the same tensors (docs/format.md is the only
//! contract between them).
//!
//! The test writes a set of known tensors (every dtype, NaN and -0, scalars,
//! several steps, layers and levels, payloads and fingerprint-only records)
//! with `moeconf_schema::TraceWriter`, describes the same records in a JSON
//! spec, and runs `python3 -m moeconf write SPEC -o py.bin` (the package in
//! `python/`). Both files must be byte-identical, have the same root, and each
//! must be read and fully verified by the other language's reader; when the
//! `moeconf` binary is built (`$MOECONF_BIN` or `target/{release,debug}/moeconf`)
//! `moeconf inspect --format json` must report the same root for the Python file.
//!
//! Needs `python3` with numpy and blake3 (`python/run_tests.sh` installs them);
//! without them the test prints a note and passes without checking.

use moeconf_fingerprint::{Algorithm, CanonPolicy, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{
    weights_digest, Binding, CaptureSpec, Decoding, Header, ModelIdentity, PromptBinding, Provenance,
    TensorDigest, TokenizerIdentity, Trace, TraceWriter,
};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One known record: coordinate, level, dtype, shape, little-endian bytes, keep payload.
struct Known {
    coord: Coord,
    level: Level,
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
    keep: bool,
}

fn coord(step: u32, position: u32, layer: Option<u32>, path: &str) -> Coord {
    Coord {
        step,
        position,
        phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
        layer,
        path: path.into(),
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The known tensors, in execution order.
fn known() -> Vec<Known> {
    let k = |c: Coord, level, dtype, shape: &[u64], bytes: Vec<u8>, keep| Known {
        coord: c,
        level,
        dtype,
        shape: shape.to_vec(),
        bytes,
        keep,
    };
    let neg_nan = f32::from_bits(0xffc0_0001);
    let ramp: Vec<f32> = (0..96).map(|i| (i as f32 - 40.0) / 7.0).collect();
    vec![
        k(
            coord(0, 0, None, "token.input"),
            Level::L0,
            DType::I32,
            &[3],
            [11i32, 12, 13].iter().flat_map(|x| x.to_le_bytes()).collect(),
            true,
        ),
        k(
            coord(0, 2, None, "token.output"),
            Level::L0,
            DType::I32,
            &[1],
            7i32.to_le_bytes().to_vec(),
            true,
        ),
        k(
            coord(0, 2, None, "lm.logits"),
            Level::L1,
            DType::F32,
            &[6],
            f32s(&[1.0, -0.0, neg_nan, f32::INFINITY, 1e-45, 3.5]),
            true,
        ),
        k(
            coord(0, 2, None, "lm.margin"),
            Level::L1,
            DType::F32,
            &[],
            f32s(&[0.25]),
            false,
        ),
        k(
            coord(0, 2, Some(0), "layer.post_ffn_mhc"),
            Level::L3,
            DType::F32,
            &[4, 24],
            f32s(&ramp),
            false,
        ),
        k(
            coord(0, 1, Some(0), "layer.post_ffn_mhc"),
            Level::L3,
            DType::F32,
            &[4, 24],
            f32s(&ramp[..].iter().rev().copied().collect::<Vec<_>>()),
            true,
        ),
        k(
            coord(0, 2, Some(1), "router.scores"),
            Level::L3,
            DType::BF16,
            &[4],
            vec![0x80, 0x3f, 0x81, 0xff, 0x00, 0x80, 0x80, 0x7f],
            true,
        ),
        k(
            coord(0, 2, Some(1), "moe.combine"),
            Level::L4,
            DType::F64,
            &[2],
            [0.1f64, -0.0].iter().flat_map(|x| x.to_le_bytes()).collect(),
            false,
        ),
        k(
            coord(0, 2, Some(1), "state.cumulative_length"),
            Level::L2,
            DType::I64,
            &[1],
            3i64.to_le_bytes().to_vec(),
            true,
        ),
        k(
            coord(1, 3, None, "token.input"),
            Level::L0,
            DType::I32,
            &[1],
            7i32.to_le_bytes().to_vec(),
            true,
        ),
        k(
            coord(1, 3, None, "text.continuation"),
            Level::L0,
            DType::U8,
            &[4],
            "é!\n".as_bytes().to_vec(),
            true,
        ),
        k(
            coord(1, 3, Some(2), "attn.indexer_topk"),
            Level::L4,
            DType::U32,
            &[2, 0],
            vec![],
            true,
        ),
        k(
            coord(1, 3, Some(2), "router.topk"),
            Level::L3,
            DType::U32,
            &[2],
            [5u32, 1].iter().flat_map(|x| x.to_le_bytes()).collect(),
            false,
        ),
    ]
}

fn header() -> Header {
    let alg = Algorithm::Blake3;
    let tensors = vec![
        TensorDigest {
            name: "embed.weight".into(),
            dtype: "bf16".into(),
            shape: vec![16, 8],
            digest: alg.hash(b"embed"),
        },
        TensorDigest {
            name: "layers.0.ffn.gate.weight".into(),
            dtype: "f32".into(),
            shape: vec![4, 8],
            digest: alg.hash(b"gate"),
        },
    ];
    Header {
        binding: Binding {
            model: ModelIdentity {
                name: "interop \"known\" tensors".into(),
                config_digest: alg.hash(b"{}"),
                weights_digest: weights_digest(alg, &tensors),
                tensors,
            },
            tokenizer: TokenizerIdentity {
                name: "tokenizer.json".into(),
                digest: alg.hash(b"tok"),
            },
            prompt: PromptBinding {
                text: "why the sheep\t\u{e9}\u{1F411}\\".into(),
                ids: vec![11, 12, 13],
            },
            decoding: Decoding {
                strategy: "greedy".into(),
                max_new_tokens: 2,
            },
            precision: "bf16".into(),
            contract: "native".into(),
            schedule: "identity".into(),
            capture: CaptureSpec {
                levels: moeconf_fingerprint::LevelSet::ALL,
                payload_levels: moeconf_fingerprint::LevelSet::of_mask(0b00011),
            },
            canon: CanonPolicy {
                fold_negative_zero: true,
            },
            extra: vec![("backend".into(), "test".into()), ("zeta".into(), "1".into())],
        },
        provenance: Provenance {
            runtime: "interop-test".into(),
            version: "1".into(),
            threads: 3,
            notes: vec![("note".into(), "not hashed".into())],
        },
    }
}

/// A JSON string literal (RFC 8259 escaping).
fn js(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn pairs(v: &[(String, String)]) -> String {
    let items: Vec<String> = v.iter().map(|(k, x)| format!("[{}, {}]", js(k), js(x))).collect();
    format!("[{}]", items.join(", "))
}

/// The JSON spec `python3 -m moeconf write` reads (see python/moeconf/__main__.py).
fn spec_json(h: &Header, records: &[Known]) -> String {
    let b = &h.binding;
    let tensors: Vec<String> = b
        .model
        .tensors
        .iter()
        .map(|t| {
            format!(
                "{{\"name\": {}, \"dtype\": {}, \"shape\": {:?}, \"digest\": \"{}\"}}",
                js(&t.name),
                js(&t.dtype),
                t.shape,
                t.digest.to_hex()
            )
        })
        .collect();
    let recs: Vec<String> = records
        .iter()
        .map(|r| {
            format!(
                "{{\"step\": {}, \"position\": {}, \"phase\": {}, \"layer\": {}, \"path\": {}, \"level\": \"{}\", \
                 \"dtype\": \"{}\", \"shape\": {:?}, \"data_hex\": \"{}\", \"keep_payload\": {}}}",
                r.coord.step,
                r.coord.position,
                r.coord.phase as u32,
                r.coord.layer.map_or("null".to_string(), |l| l.to_string()),
                js(&r.coord.path),
                r.level.name(),
                r.dtype.name(),
                r.shape,
                hex(&r.bytes),
                r.keep
            )
        })
        .collect();
    format!(
        "{{\"algorithm\": \"blake3\",\n \"binding\": {{\"model_name\": {}, \"config_digest\": \"{}\", \
         \"weights_digest\": \"{}\", \"tensors\": [{}], \"tokenizer_name\": {}, \"tokenizer_digest\": \"{}\", \
         \"prompt_text\": {}, \"prompt_ids\": {:?}, \"decoding_strategy\": {}, \"max_new_tokens\": {}, \
         \"precision\": {}, \"contract\": {}, \"schedule\": {}, \"capture_levels\": {}, \
         \"capture_payload_levels\": {}, \"fold_negative_zero\": {}, \"extra\": {}}},\n \
         \"provenance\": {{\"runtime\": {}, \"version\": {}, \"threads\": {}, \"notes\": {}}},\n \
         \"records\": [\n  {}\n ]}}\n",
        js(&b.model.name),
        b.model.config_digest.to_hex(),
        b.model.weights_digest.to_hex(),
        tensors.join(", "),
        js(&b.tokenizer.name),
        b.tokenizer.digest.to_hex(),
        js(&b.prompt.text),
        b.prompt.ids,
        js(&b.decoding.strategy),
        b.decoding.max_new_tokens,
        js(&b.precision),
        js(&b.contract),
        js(&b.schedule),
        b.capture.levels.bits(),
        b.capture.payload_levels.bits(),
        b.canon.fold_negative_zero,
        pairs(&b.extra),
        js(&h.provenance.runtime),
        js(&h.provenance.version),
        h.provenance.threads,
        pairs(&h.provenance.notes),
        recs.join(",\n  ")
    )
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `python3` with the package importable, if it and numpy/blake3 are available.
fn python() -> Option<Command> {
    let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import numpy, blake3"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        return None;
    }
    let mut c = Command::new(py);
    c.env("PYTHONPATH", repo().join("python"));
    Some(c)
}

fn moeconf_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MOECONF_BIN") {
        return Some(PathBuf::from(p));
    }
    ["release", "debug"]
        .iter()
        .map(|p| repo().join("target").join(p).join("moeconf"))
        .find(|p| p.is_file())
}

fn write_rust(path: &Path, h: Header, records: &[Known]) -> moeconf_schema::WriteSummary {
    write_rust_version(path, h, records, moeconf_schema::DEFAULT_FORMAT_VERSION)
}

fn write_rust_version(
    path: &Path,
    h: Header,
    records: &[Known],
    version: u32,
) -> moeconf_schema::WriteSummary {
    let out = moeconf_output::check_output(path, &moeconf_output::Inputs::new()).unwrap();
    let mut w = TraceWriter::create_version(&out, Algorithm::Blake3, h, version).unwrap();
    for r in records {
        let view = TensorView {
            dtype: r.dtype,
            shape: &r.shape,
            bytes: &r.bytes,
        };
        w.append(r.coord.clone(), r.level, view, r.keep).unwrap();
    }
    w.finish().unwrap()
}

/// Both container versions: the two writers write the same bytes, and each
/// reader accepts the other writer's file with the same root.
#[test]
fn python_and_rust_writers_agree_on_known_tensors() {
    if python().is_none() {
        eprintln!("note: python_interop skipped: python3 with numpy and blake3 not available (python/run_tests.sh installs them)");
        return;
    }
    for version in [1, 2] {
        writers_agree(version);
    }
}

fn writers_agree(version: u32) {
    let Some(mut py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let records = known();
    let rust_path = dir.path().join("rust.bin");
    let summary = write_rust_version(&rust_path, header(), &records, version);

    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, spec_json(&header(), &records)).unwrap();
    let py_path = dir.path().join("py.bin");
    let out = py
        .args(["-m", "moeconf", "write"])
        .arg(&spec)
        .arg("-o")
        .arg(&py_path)
        .args(["--format-version", &version.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python writer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(&summary.root.to_hex()), "{stdout}");

    // The Rust reader accepts and fully verifies the Python file: same root, same records.
    let tp = Trace::open(&py_path).unwrap();
    let tr = Trace::open(&rust_path).unwrap();
    assert_eq!((tp.format_version(), tr.format_version()), (version, version));
    let vp = tp.verify_payloads().unwrap();
    assert_eq!(vp.payloads, records.iter().filter(|r| r.keep).count() as u64);
    assert_eq!(tp.root(), summary.root);
    assert_eq!(tp.binding(), tr.binding());
    assert_eq!(tp.provenance(), tr.provenance());
    assert_eq!(tp.records().unwrap(), tr.records().unwrap());
    for i in 0..records.len() {
        assert_eq!(
            tp.payload_verified(i).unwrap(),
            tr.payload_verified(i).unwrap(),
            "record {i}"
        );
    }
    // Same header, same layout rules, same index: the two files are byte-identical.
    assert_eq!(
        std::fs::read(&py_path).unwrap(),
        std::fs::read(&rust_path).unwrap()
    );

    // The Python reader accepts the Rust file with the same root.
    let out = python()
        .unwrap()
        .args(["-m", "moeconf", "inspect"])
        .arg(&rust_path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("\"root\": \"{}\"", summary.root.to_hex())),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("\"records\": {}", records.len())),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("\"format_version\": {version}")),
        "{stdout}"
    );

    // The CLI, when built, reports the same root for the Python file.
    match moeconf_bin() {
        Some(bin) => {
            let out = Command::new(&bin)
                .arg("inspect")
                .arg(&py_path)
                .args(["--format", "json"])
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let s = String::from_utf8_lossy(&out.stdout);
            assert!(s.contains(&summary.root.to_hex()), "{s}");
        }
        None => eprintln!("note: moeconf binary not built; skipped the `moeconf inspect` check"),
    }
}

#[test]
fn python_rejects_a_corrupted_rust_trace_with_file_and_offset() {
    let Some(mut py) = python() else {
        eprintln!("note: python_interop skipped: python3 with numpy and blake3 not available");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rust.bin");
    write_rust(&path, header(), &known());
    let mut bytes = std::fs::read(&path).unwrap();
    let t = Trace::open(&path).unwrap();
    let off = t.records().unwrap()[2].payload.unwrap().offset as usize;
    bytes[off] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let out = py.args(["-m", "moeconf", "inspect"]).arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("rust.bin: byte {off}: record 2")), "{err}");
    assert!(err.contains("do not match the record digest"), "{err}");
}
