//! The adversarial corpus of issue 12 ("Trust: no verdict from unverified,
//! missing or hostile data, and no output that destroys an input"), in one
//! table. Every input is generated here at test time, hostile but
//! internally consistent (valid checksums and roots unless the case is
//! about a corrupted payload), and the built `moeconf` binary is run on
//! each: the exit code must be the expected one, the message must name the
//! file at fault, and every input listed as "intact" must have the same
//! BLAKE3 digest afterwards (and still be what it was: a FIFO, a symbolic
//! link, a device). tests/adversarial/README.md lists every case with its
//! finding.
//!
//! The binary is `$MOECONF_BIN`, else `moeconf` next to this test's build
//! directory (`target/release/moeconf` under `cargo test --release`), which
//! `cargo test --workspace` builds (the `moeconf` package's own tests need
//! it). Build it first when running this test alone:
//! `cargo build --release -p moeconf && cargo test --release --test adversarial`.

use moeconf_fingerprint::{Algorithm, Component, Coord, DType, Digest, LevelSet, Phase, TensorView};
use moeconf_schema::{Binding, CaptureSpec, Decoding, Header, PromptBinding, Trace, TraceWriter};
use moeconf_workspace_tests::binary;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn s(p: &Path) -> String {
    p.to_str().expect("UTF-8 test path").to_string()
}

/// What must still hold of an input after the command.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// A regular file with the same bytes.
    File,
    /// Still a FIFO.
    Fifo,
    /// Still a symbolic link (and its target keeps its bytes).
    Symlink,
    /// Still a character device.
    Device,
}

/// One case of the corpus.
struct Case {
    /// Short id, also in tests/adversarial/README.md.
    name: &'static str,
    /// The finding of issue 12 it belongs to (1–7).
    finding: u8,
    args: Vec<String>,
    /// Expected exit code.
    code: i32,
    /// Text the output (stderr, or stdout for a report) must contain:
    /// the file at fault.
    names: String,
    /// Inputs that must be left as they were.
    intact: Vec<(PathBuf, Kind)>,
    /// Paths that must not exist afterwards (a refused output).
    absent: Vec<PathBuf>,
}

impl Case {
    fn new(name: &'static str, finding: u8, code: i32, names: &str, args: &[&str]) -> Case {
        Case {
            name,
            finding,
            args: args.iter().map(|a| a.to_string()).collect(),
            code,
            names: names.to_string(),
            intact: Vec::new(),
            absent: Vec::new(),
        }
    }

    fn intact(mut self, p: &Path, kind: Kind) -> Case {
        self.intact.push((p.to_path_buf(), kind));
        self
    }

    fn absent(mut self, p: &Path) -> Case {
        self.absent.push(p.to_path_buf());
        self
    }
}

/// A record of a synthetic trace.
struct Rec {
    c: Component,
    index: Option<u32>,
    step: u32,
    layer: Option<u32>,
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
}

fn rec(c: Component, step: u32, dtype: DType, shape: &[u64], bytes: Vec<u8>) -> Rec {
    Rec {
        c,
        index: None,
        step,
        layer: None,
        dtype,
        shape: shape.to_vec(),
        bytes,
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The binding every synthetic trace shares (so that any two compare).
fn binding(steps: u32, levels: u8) -> Binding {
    let levels = LevelSet::of_mask(levels);
    Binding {
        prompt: PromptBinding {
            text: "adversarial".into(),
            ids: vec![1, 2],
        },
        decoding: Decoding {
            strategy: "greedy".into(),
            max_new_tokens: steps,
        },
        capture: CaptureSpec {
            levels,
            payload_levels: levels,
        },
        ..Binding::default()
    }
}

/// Writes a synthetic trace (every record keeps its payload).
fn synth(path: &Path, b: Binding, recs: &[Rec]) -> PathBuf {
    let header = Header {
        binding: b,
        ..Header::default()
    };
    let mut w = TraceWriter::create(path, Algorithm::Blake3, header).unwrap();
    for r in recs {
        let path = match r.index {
            Some(j) => r.c.indexed_path(j),
            None => r.c.path().to_string(),
        };
        let coord = Coord {
            step: r.step,
            position: r.step,
            phase: if r.step == 0 {
                Phase::Prefill
            } else {
                Phase::Decode
            },
            layer: r.layer,
            path: path.as_str().into(),
        };
        let view = TensorView {
            dtype: r.dtype,
            shape: &r.shape,
            bytes: &r.bytes,
        };
        w.append(coord, r.c.level(), view, true).unwrap();
    }
    w.finish().unwrap();
    path.to_path_buf()
}

/// A one-step trace: the token and the margin behind it.
fn token_trace(path: &Path, token: i32, margin: f32) -> PathBuf {
    let recs = [
        rec(Component::LmMargin, 0, DType::F32, &[1], f32s(&[margin])),
        rec(
            Component::TokenOutput,
            0,
            DType::I32,
            &[1],
            token.to_le_bytes().to_vec(),
        ),
    ];
    synth(path, binding(1, 0b11111), &recs)
}

/// A copy of `src` with payload byte `k` of record `pick` XOR `mask`: the
/// checksums and the root stay valid, only that record's digest no longer
/// matches.
fn corrupt(src: &Path, dst: &Path, pick: Component, k: u64, mask: u8) -> PathBuf {
    let t = Trace::open_verified(src).unwrap();
    let e = t
        .records()
        .unwrap()
        .iter()
        .find(|e| Component::parse(&e.coord.path).is_some_and(|(c, _)| c == pick))
        .expect("record to corrupt");
    let at = e.payload.expect("payload").offset + k;
    let mut bytes = std::fs::read(src).unwrap();
    bytes[at as usize] ^= mask;
    std::fs::write(dst, bytes).unwrap();
    dst.to_path_buf()
}

/// One MoE event with `k` routed terms of `d` values and the shared output.
fn moe_trace(path: &Path, k: u32, d: usize) -> PathBuf {
    let mut recs = Vec::new();
    for j in 0..k {
        let v: Vec<f32> = (0..d).map(|i| (i as f32 + 1.0) * 0.5f32.powi(j as i32)).collect();
        recs.push(Rec {
            index: Some(j),
            layer: Some(0),
            ..rec(Component::MoeTerm, 0, DType::F32, &[d as u64], f32s(&v))
        });
    }
    recs.push(Rec {
        layer: Some(0),
        ..rec(
            Component::MoeShared,
            0,
            DType::F32,
            &[d as u64],
            f32s(&vec![0.25; d]),
        )
    });
    synth(path, binding(1, 0b10000), &recs)
}

/// A one-step trace whose continuation is `n` characters drawn from `seed`.
fn text_trace(path: &Path, seed: u64, n: usize) -> PathBuf {
    let mut x = seed;
    let text: Vec<u8> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            b'a' + (x >> 59) as u8 % 26
        })
        .collect();
    let recs = [rec(Component::TextContinuation, 0, DType::U8, &[n as u64], text)];
    synth(path, binding(1, 0b11111), &recs)
}

/// Rewrites a JSON file through `edit`.
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// A copy of the built-in model in `dir` (weights hard-linked unless
/// `own_weights`), its config passed through `edit`.
fn model_copy(dir: &Path, own_weights: bool, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let src = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").expect("built-in fixture");
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let (from, to) = (src.join("model.safetensors"), dir.join("model.safetensors"));
    if own_weights || std::fs::hard_link(&from, &to).is_err() {
        std::fs::copy(&from, &to).unwrap();
    }
    edit_json(&dir.join("config.json"), edit);
    dir.to_path_buf()
}

/// Overwrites every element of tensor `name` of `model/model.safetensors`
/// (an owned copy) with NaN, reading the safetensors header by hand.
fn poison_tensor(model: &Path, name: &str) {
    let path = model.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header[name];
    let (a, b) = (
        t["data_offsets"][0].as_u64().unwrap() as usize,
        t["data_offsets"][1].as_u64().unwrap() as usize,
    );
    let nan: &[u8] = match t["dtype"].as_str().unwrap() {
        "BF16" => &[0xc0, 0x7f],
        "F32" => &[0, 0, 0xc0, 0x7f],
        other => panic!("unexpected dtype {other}"),
    };
    for chunk in bytes[8 + n + a..8 + n + b].chunks_exact_mut(nan.len()) {
        chunk.copy_from_slice(nan);
    }
    std::fs::write(&path, bytes).unwrap();
}

/// A copy of the built-in quantized model `builtin:tiny-v4-fp8` in `dir` whose UE8M0 scale
/// tensor `name` starts with the NaN code 0xFF (the header read by hand).
fn quantized_with_nan_scale(dir: &Path, name: &str) -> PathBuf {
    let src =
        moeconf_fixtures::ensure_builtin(moeconf_fixtures::BUILTIN_TINY_V4_FP8).expect("built-in fixture");
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header[name]["dtype"], "F8_E8M0");
    let a = header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + a] = 0xFF;
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    dir.to_path_buf()
}

/// A dump directory (docs/import.md) with one token and a manifest whose
/// `decoding` is `decoding`.
fn dump(dir: &Path, decoding: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let name = format!("step.0.pos.0.{}", Component::TokenOutput.path());
    let mut header =
        serde_json::json!({ name: {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]} }).to_string();
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let mut st = (header.len() as u64).to_le_bytes().to_vec();
    st.extend_from_slice(header.as_bytes());
    st.extend_from_slice(&7i32.to_le_bytes());
    std::fs::write(dir.join("step0.safetensors"), st).unwrap();
    let zeros = "0".repeat(64);
    let manifest = serde_json::json!({
        "model": {"name": "m", "config_digest": zeros, "weights_digest": zeros},
        "tokenizer": {"digest": zeros},
        "prompt": {"text": "p", "ids": [1]},
        "max_new_tokens": 1,
        "decoding": decoding,
        "precision": "bf16",
        "contract": "native",
        "schedule": "identity",
        "runtime": {"name": "adversarial", "version": "1"},
    });
    std::fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
    dir.to_path_buf()
}

/// A policy whose argmax near-tie threshold (0.05) lies between the
/// reference margin (0.09375) and its corrupted value (0.0234375).
const NEAR_TIE_POLICY: &str = r#"default_profile = "t"
[profile.t]
levels = { L0 = "tolerance", L1 = "tolerance", L2 = "info", L3 = "info", L4 = "info" }
argmax_near_tie_margin = 0.05
rules = [ { path = "*", check = "exact" } ]
required = ["judged"]
"#;

/// Runs `moeconf ARGS` in `cwd` with a clean `MOECONF_*` environment.
fn moeconf(bin: &Path, cwd: &Path, args: &[String]) -> Output {
    let mut c = Command::new(bin);
    c.args(args).current_dir(cwd);
    for (k, _) in std::env::vars() {
        if k.starts_with("MOECONF_") {
            c.env_remove(k);
        }
    }
    c.output().unwrap()
}

fn digest(p: &Path) -> Option<Digest> {
    std::fs::read(p).ok().map(|b| Algorithm::Blake3.hash(&b))
}

fn kind_holds(p: &Path, kind: Kind) -> bool {
    let Ok(m) = std::fs::symlink_metadata(p) else {
        return false;
    };
    let t = m.file_type();
    match kind {
        Kind::File => t.is_file(),
        Kind::Fifo => t.is_fifo(),
        Kind::Symlink => t.is_symlink(),
        Kind::Device => t.is_char_device(),
    }
}

/// Runs one case; returns what went wrong, if anything.
fn check(bin: &Path, cwd: &Path, c: &Case) -> Option<String> {
    let before: Vec<Option<Digest>> = c
        .intact
        .iter()
        .map(|(p, k)| match k {
            Kind::File | Kind::Symlink => digest(p),
            Kind::Fifo | Kind::Device => None,
        })
        .collect();
    let o = moeconf(bin, cwd, &c.args);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    let mut problems = Vec::new();
    if o.status.code() != Some(c.code) {
        problems.push(format!("exit {:?}, expected {}", o.status.code(), c.code));
    }
    let said = if c.code == 2 {
        err.to_string()
    } else {
        format!("{out}{err}")
    };
    if !said.contains(&c.names) {
        problems.push(format!("the message does not name {:?}", c.names));
    }
    for ((p, k), d) in c.intact.iter().zip(before) {
        if !kind_holds(p, *k) {
            problems.push(format!("{} is no longer what it was", p.display()));
        } else if matches!(k, Kind::File | Kind::Symlink) && digest(p) != d {
            problems.push(format!("{} changed", p.display()));
        }
    }
    for p in &c.absent {
        if std::fs::symlink_metadata(p).is_ok() {
            problems.push(format!("{} was written", p.display()));
        }
    }
    (!problems.is_empty()).then(|| {
        format!(
            "[finding {}] {} (moeconf {}): {}\n  stdout: {}\n  stderr: {}",
            c.finding,
            c.name,
            c.args.join(" "),
            problems.join("; "),
            out.chars().take(600).collect::<String>(),
            err.chars().take(600).collect::<String>()
        )
    })
}

/// Findings 1 (verified payloads) and 2 (coverage).
fn trust_cases(bin: &Path, d: &Path) -> Vec<Case> {
    let p = |n: &str| s(&d.join(n));
    std::fs::write(d.join("near-tie.toml"), NEAR_TIE_POLICY).unwrap();
    let r = token_trace(&d.join("ref.bin"), 5, 0.09375);
    token_trace(&d.join("cand.bin"), 6, 0.09375);
    // 0.09375 = 0x3dc00000 -> 0x3cc00000 = 0.0234375 (below the 0.05 threshold).
    corrupt(&r, &d.join("ref-bad-margin.bin"), Component::LmMargin, 3, 0x01);
    corrupt(&r, &d.join("ref-bad-token.bin"), Component::TokenOutput, 0, 0x40);
    // The same trace in format version 1, which every command verifies in full.
    let r1 = d.join("ref-v1.bin");
    let o = moeconf(
        bin,
        d,
        &["convert", &s(&r), "-o", &s(&r1), "--to", "1"].map(String::from),
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "convert: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    corrupt(
        &r1,
        &d.join("ref-v1-bad-margin.bin"),
        Component::LmMargin,
        3,
        0x01,
    );
    corrupt(
        &r1,
        &d.join("ref-v1-bad-token.bin"),
        Component::TokenOutput,
        0,
        0x40,
    );
    let moe = moe_trace(&d.join("moe.bin"), 3, 4);
    corrupt(&moe, &d.join("moe-bad-term.bin"), Component::MoeTerm, 5, 0x10);
    moe_trace(&d.join("moe-oversized.bin"), 8, 1000);
    synth(&d.join("empty.bin"), binding(1, 0b11111), &[]);
    let l0 = [rec(
        Component::TokenOutput,
        0,
        DType::I32,
        &[1],
        5i32.to_le_bytes().to_vec(),
    )];
    synth(&d.join("l0-only.bin"), binding(1, 0b00001), &l0);
    let base = d.join("base.json");
    let o = moeconf(
        bin,
        d,
        &["gate", "--bless", "--baseline", &s(&base), &s(&r)].map(String::from),
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "bless: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::copy(&base, d.join("base-no-steps.json")).unwrap();
    edit_json(&d.join("base-no-steps.json"), |b| {
        b["steps"] = serde_json::json!([])
    });
    std::fs::copy(&base, d.join("base-other-prompt.json")).unwrap();
    edit_json(&d.join("base-other-prompt.json"), |b| {
        b["binding"]["prompt"]["text"] = "another prompt".into()
    });
    let pol = p("near-tie.toml");
    vec![
        Case::new(
            "gate-near-tie-control",
            1,
            1,
            "ref.bin",
            &["gate", "--policy", &pol, &p("ref.bin"), &p("cand.bin")],
        ),
        Case::new(
            "gate-corrupted-reference-margin",
            1,
            2,
            "ref-bad-margin.bin",
            &["gate", "--policy", &pol, &p("ref-bad-margin.bin"), &p("cand.bin")],
        ),
        Case::new(
            "gate-corrupted-reference-token",
            1,
            2,
            "ref-bad-token.bin",
            &["gate", &p("ref-bad-token.bin"), &p("cand.bin")],
        ),
        Case::new(
            "gate-baseline-corrupted-candidate",
            1,
            2,
            "ref-v1-bad-token.bin",
            &["gate", "--baseline", &p("base.json"), &p("ref-v1-bad-token.bin")],
        ),
        // Version 2 reads what the verdict uses: the step digests are the
        // blessed ones, so no record of the candidate is read, and the
        // corrupted byte cannot change the verdict (docs/ci.md §12).
        Case::new(
            "gate-baseline-corrupted-candidate-v2-unread",
            1,
            0,
            "ref-bad-token.bin",
            &["gate", "--baseline", &p("base.json"), &p("ref-bad-token.bin")],
        ),
        Case::new(
            "gate-baseline-corrupted-candidate-verify-all",
            1,
            2,
            "ref-bad-token.bin",
            &[
                "gate",
                "--verify-all",
                "--baseline",
                &p("base.json"),
                &p("ref-bad-token.bin"),
            ],
        ),
        Case::new(
            "diff-corrupted-candidate",
            1,
            2,
            "ref-v1-bad-margin.bin",
            &["diff", &p("ref.bin"), &p("ref-v1-bad-margin.bin")],
        ),
        Case::new(
            "diff-corrupted-candidate-v2-unread",
            1,
            0,
            "ref-bad-margin.bin",
            &["diff", &p("ref.bin"), &p("ref-bad-margin.bin")],
        ),
        Case::new(
            "diff-corrupted-candidate-verify-all",
            1,
            2,
            "ref-bad-margin.bin",
            &["diff", "--verify-all", &p("ref.bin"), &p("ref-bad-margin.bin")],
        ),
        Case::new(
            "inspect-corrupted-payload",
            1,
            2,
            "ref-bad-margin.bin",
            &["inspect", &p("ref-bad-margin.bin")],
        ),
        Case::new("certify-control", 1, 0, "moe.bin", &["certify", &p("moe.bin")]),
        Case::new(
            "certify-flipped-term",
            1,
            2,
            "moe-bad-term.bin",
            &["certify", &p("moe-bad-term.bin")],
        ),
        Case::new(
            "gate-empty-candidate-vs-baseline",
            2,
            2,
            "empty.bin",
            &["gate", "--baseline", &p("base.json"), &p("empty.bin")],
        ),
        Case::new(
            "gate-empty-candidate-vs-baseline-allowed",
            2,
            1,
            "empty.bin",
            &[
                "gate",
                "--allow-incomplete",
                "--baseline",
                &p("base.json"),
                &p("empty.bin"),
            ],
        ),
        Case::new(
            "gate-empty-candidate-required-none",
            2,
            1,
            "empty.bin",
            &[
                "gate",
                "--allow-incomplete",
                "--required",
                "none",
                &p("ref.bin"),
                &p("empty.bin"),
            ],
        ),
        Case::new(
            "gate-empty-reference",
            2,
            2,
            "empty.bin",
            &["gate", &p("empty.bin"), &p("ref.bin")],
        ),
        Case::new(
            "diff-empty-reference",
            2,
            2,
            "empty.bin",
            &["diff", &p("empty.bin"), &p("ref.bin")],
        ),
        Case::new(
            "diff-empty-reference-allowed",
            2,
            1,
            "empty.bin",
            &["diff", "--allow-incomplete", &p("empty.bin"), &p("ref.bin")],
        ),
        Case::new(
            "gate-strict-l0-only-candidate",
            2,
            1,
            "l0-only.bin",
            &["gate", "--profile", "strict", &p("ref.bin"), &p("l0-only.bin")],
        ),
        Case::new(
            "gate-baseline-without-steps",
            2,
            2,
            "base-no-steps.json",
            &["gate", "--baseline", &p("base-no-steps.json"), &p("ref.bin")],
        ),
        Case::new(
            "gate-baseline-other-binding",
            2,
            2,
            "base-other-prompt.json",
            &["gate", "--baseline", &p("base-other-prompt.json"), &p("ref.bin")],
        ),
        Case::new(
            "certify-oversized",
            5,
            2,
            "moe-oversized.bin",
            &["certify", &p("moe-oversized.bin")],
        ),
    ]
}

/// Finding 3 (outputs that would destroy an input or a special file).
fn output_cases(d: &Path) -> Vec<Case> {
    let p = |n: &str| s(&d.join(n));
    let (r, c) = (d.join("ref.bin"), d.join("cand.bin"));
    std::fs::write(d.join("prompt.txt"), "why the sheep").unwrap();
    let model = model_copy(&d.join("model-own"), true, |_| {});
    let weights = model.join("model.safetensors");
    let dumpdir = dump(&d.join("dump"), "greedy");
    let dumpfile = dumpdir.join("step0.safetensors");
    let fifo = d.join("out.fifo");
    let st = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(st.success(), "mkfifo");
    let target = d.join("report-target.txt");
    std::fs::write(&target, "keep me").unwrap();
    let link = d.join("report-link.txt");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let run = |out: &str, prompt: &[&str]| {
        let mut a = vec![
            "run",
            "--model",
            "builtin:tiny-v4",
            "--max-new-tokens",
            "1",
            "-o",
            out,
        ];
        a.extend_from_slice(if prompt.is_empty() {
            &["--prompt", "why the sheep"]
        } else {
            prompt
        });
        a.iter().map(|x| x.to_string()).collect::<Vec<String>>()
    };
    let mut cases = vec![
        Case::new("run-output-is-prompt-file", 3, 2, "prompt.txt", &[])
            .intact(&d.join("prompt.txt"), Kind::File),
        Case::new(
            "run-output-is-model-weights",
            3,
            2,
            "model.safetensors",
            &[
                "run",
                "--model",
                &s(&model),
                "--prompt",
                "why the sheep",
                "--max-new-tokens",
                "1",
                "-o",
                &s(&weights),
            ],
        )
        .intact(&weights, Kind::File),
        Case::new(
            "import-control",
            3,
            0,
            "imported.bin",
            &["import", &s(&dumpdir), "-o", &p("imported.bin")],
        ),
        Case::new(
            "import-output-is-dump-file",
            3,
            2,
            "step0.safetensors",
            &["import", &s(&dumpdir), "-o", &s(&dumpfile)],
        )
        .intact(&dumpfile, Kind::File),
        Case::new(
            "gate-bless-baseline-is-reference",
            3,
            2,
            "ref.bin",
            &["gate", "--bless", "--baseline", &s(&r), &s(&r)],
        )
        .intact(&r, Kind::File),
        Case::new(
            "gate-output-is-reference",
            3,
            2,
            "ref.bin",
            &["gate", "--output", &s(&r), &s(&r), &s(&c)],
        )
        .intact(&r, Kind::File)
        .intact(&c, Kind::File),
        Case::new(
            "gate-junit-is-candidate",
            3,
            2,
            "cand.bin",
            &["gate", "--junit", &s(&c), &s(&r), &s(&c)],
        )
        .intact(&r, Kind::File)
        .intact(&c, Kind::File),
        Case::new("run-output-fifo", 3, 2, "out.fifo", &[]).intact(&fifo, Kind::Fifo),
        Case::new(
            "gate-output-symlink",
            3,
            2,
            "report-link.txt",
            &["gate", "--output", &s(&link), &s(&r), &s(&r)],
        )
        .intact(&link, Kind::Symlink)
        .intact(&target, Kind::File),
        Case::new("run-output-dev-null", 3, 2, "/dev/null", &[]).intact(Path::new("/dev/null"), Kind::Device),
    ];
    cases[0].args = run(&p("prompt.txt"), &["--prompt-file", &p("prompt.txt")]);
    cases[7].args = run(&s(&fifo), &[]);
    cases[9].args = run("/dev/null", &[]);
    cases
}

/// Findings 4 (writer limits), 5 (bounded work), 6 (valid runs), 7.
fn limit_cases(d: &Path) -> Vec<Case> {
    let p = |n: &str| s(&d.join(n));
    let long = dump(&d.join("dump-long-decoding"), &"g".repeat(65));
    let big = d.join("big-prompt.txt");
    std::fs::write(&big, "why the sheep ".repeat((1 << 20) / 14 + 1)).unwrap();
    text_trace(&d.join("text-a.bin"), 1, 100_000);
    text_trace(&d.join("text-b.bin"), 2, 100_000);
    let rope = model_copy(&d.join("model-rope"), false, |v| v["rope_theta"] = 0.0.into());
    let sink = model_copy(&d.join("model-sinkhorn"), false, |v| {
        v["hc_sinkhorn_iters"] = (1u64 << 24).into()
    });
    let nan = model_copy(&d.join("model-nan"), true, |_| {});
    poison_tensor(&nan, "layers.0.ffn_norm.weight");
    let with_dir = model_copy(&d.join("model-dir"), false, |_| {});
    std::fs::create_dir(with_dir.join("x.safetensors")).unwrap();
    let nan_scale = quantized_with_nan_scale(&d.join("model-nan-scale"), "layers.3.attn.wq_b.scale");
    let run = |model: &str, out: &str, extra: &[&str]| {
        let mut a = vec![
            "run",
            "--model",
            model,
            "--prompt",
            "why the sheep",
            "--max-new-tokens",
            "2",
            "-o",
            out,
        ];
        a.extend_from_slice(extra);
        a.iter().map(|x| x.to_string()).collect::<Vec<String>>()
    };
    let out = |n: &str| d.join(n);
    let mut cases = vec![
        Case::new(
            "import-decoding-over-64-bytes",
            4,
            2,
            "manifest.json",
            &["import", &s(&long), "-o", &p("long.bin")],
        )
        .absent(&out("long.bin")),
        Case::new("run-prompt-over-1-mib", 4, 2, "prompt text", &[]).absent(&out("big.bin")),
        Case::new(
            "diff-100k-character-continuations",
            5,
            1,
            "text-b.bin",
            &["diff", &p("text-a.bin"), &p("text-b.bin")],
        ),
        Case::new("run-threads-20000", 5, 2, "--threads", &[]).absent(&out("threads.bin")),
        Case::new("run-prompt-file-dev-zero", 5, 2, "/dev/zero", &[]).absent(&out("zero.bin")),
        Case::new("run-sinkhorn-2-pow-24", 5, 2, "hc_sinkhorn_iters", &[]).absent(&out("sink.bin")),
        Case::new("run-rope-theta-zero", 6, 2, "rope_theta", &[]).absent(&out("rope.bin")),
        Case::new("run-fork-step-beyond-the-run", 6, 2, "--fork-step 99", &[]).absent(&out("fork.bin")),
        Case::new("run-nan-weights", 6, 2, "non-finite", &[]).absent(&out("nan.bin")),
        Case::new("run-directory-named-safetensors", 7, 2, "x.safetensors", &[]).absent(&out("dir.bin")),
        Case::new("run-ue8m0-nan-scale", 6, 2, "layers.3.attn.wq_b.scale", &[])
            .absent(&out("nan-scale.bin"))
            .intact(&nan_scale.join("model.safetensors"), Kind::File),
    ];
    cases[1].args = vec![
        "run".into(),
        "--prompt-file".into(),
        s(&big),
        "--max-new-tokens".into(),
        "1".into(),
        // Within any machine's memory estimate: the refusal under test is
        // the writer's string cap.
        "--capture".into(),
        "L0".into(),
        "--prefill-chunk".into(),
        "256".into(),
        "-o".into(),
        p("big.bin"),
    ];
    cases[3].args = run("builtin:tiny-v4", &p("threads.bin"), &["--threads", "20000"]);
    cases[4].args = vec![
        "run".into(),
        "--prompt-file".into(),
        "/dev/zero".into(),
        "--max-new-tokens".into(),
        "1".into(),
        "-o".into(),
        p("zero.bin"),
    ];
    cases[5].args = run(&s(&sink), &p("sink.bin"), &[]);
    cases[6].args = run(&s(&rope), &p("rope.bin"), &[]);
    cases[7].args = run(
        "builtin:tiny-v4",
        &p("fork.bin"),
        &["--fork-layer", "3", "--fork-step", "99"],
    );
    cases[8].args = run(&s(&nan), &p("nan.bin"), &[]);
    cases[9].args = run(&s(&with_dir), &p("dir.bin"), &[]);
    cases[10].args = run(&s(&nan_scale), &p("nan-scale.bin"), &[]);
    cases
}

#[test]
fn adversarial_corpus_gives_the_documented_exit_codes() {
    let bin = binary();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A repository root without a moeconf.toml: the built-in policy applies.
    std::fs::create_dir(d.join(".git")).unwrap();
    let mut cases = trust_cases(&bin, d);
    cases.extend(output_cases(d));
    cases.extend(limit_cases(d));
    let mut names: Vec<&str> = cases.iter().map(|c| c.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), cases.len(), "case names must be unique");
    for f in 1..=7 {
        assert!(cases.iter().any(|c| c.finding == f), "no case for finding {f}");
    }
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/adversarial/README.md"))
            .expect("tests/adversarial/README.md");
    let mut failures: Vec<String> = cases.iter().filter_map(|c| check(&bin, d, c)).collect();
    for c in &cases {
        let row = format!("| `{}` | {} | {} |", c.name, c.finding, c.code);
        if !readme.contains(&row) {
            failures.push(format!("tests/adversarial/README.md has no row {row}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} adversarial cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
