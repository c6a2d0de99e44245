//! A run is valid or it is an error, and hostile inputs cost bounded work:
//! config values out of range, non-finite values, fork requests that cannot
//! take effect, oversized or non-regular input files and absurd thread
//! counts all exit 2 with a message naming what is wrong, and no trace is
//! left behind. Each test runs the binary on a small modified copy of the
//! built-in fixture (the cached fixture itself is never modified) with a
//! deadline, so a regression to a hang fails instead of blocking the suite.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Runs the binary with `args`, killing it and failing the test if it has
/// not exited after `secs` seconds.
fn moeconf_within(secs: u64, args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn moeconf");
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("collect output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("moeconf {args:?} did not finish within {secs} s (hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn moeconf(args: &[&str]) -> Output {
    moeconf_within(120, args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts exit 2 and that stderr contains every one of `needles`.
fn error_naming(o: &Output, needles: &[&str]) -> String {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(2), "expected exit 2, stderr: {e}");
    for n in needles {
        assert!(e.contains(n), "stderr does not name {n:?}: {e}");
    }
    e
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 test path")
}

/// A copy of the built-in fixture in `dir/model`: config.json and
/// tokenizer.json copied, model.safetensors hard-linked (copied when
/// `own_weights` or when linking fails) so tests can edit the copies.
fn model_copy(dir: &Path, own_weights: bool) -> PathBuf {
    let src = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").expect("built-in fixture");
    let dst = dir.join("model");
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let (from, to) = (src.join("model.safetensors"), dst.join("model.safetensors"));
    if own_weights || std::fs::hard_link(&from, &to).is_err() {
        std::fs::copy(&from, &to).unwrap();
    }
    dst
}

/// Rewrites `model/config.json` through `edit`.
fn edit_config(model: &Path, edit: impl FnOnce(&mut Value)) {
    let path = model.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Overwrites every element of tensor `name` of `model/model.safetensors`
/// (an owned copy) with NaN.
fn poison_tensor(model: &Path, name: &str) {
    let path = model.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let (start, len, dtype) = {
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor(name).unwrap();
        let start = t.data().as_ptr() as usize - bytes.as_ptr() as usize;
        (start, t.data().len(), t.dtype())
    };
    let nan: Vec<u8> = match dtype {
        safetensors::Dtype::BF16 => vec![0xc0, 0x7f],
        safetensors::Dtype::F32 => f32::NAN.to_le_bytes().to_vec(),
        other => panic!("unexpected dtype {other:?}"),
    };
    for chunk in bytes[start..start + len].chunks_exact_mut(nan.len()) {
        chunk.copy_from_slice(&nan);
    }
    std::fs::write(&path, bytes).unwrap();
}

/// `run` on `model` with "why the sheep", writing `out`.
fn run_on<'a>(model: &'a Path, out: &'a Path, tokens: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "run",
        "--model",
        s(model),
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        tokens,
        "-o",
        s(out),
    ];
    args.extend_from_slice(extra);
    args
}

/// No trace and no temporary file of it is left in `dir`.
fn nothing_written(dir: &Path, name: &str) {
    let left: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.contains(name))
        .collect();
    assert!(left.is_empty(), "left on disk: {left:?}");
}

#[test]
fn config_values_out_of_range_are_refused_naming_key_value_and_range() {
    type Edit = fn(&mut Value);
    let cases: [(&str, &str, Edit); 14] = [
        ("rope_theta", "0", |v| v["rope_theta"] = 0.0.into()),
        ("compress_rope_theta", "-5", |v| {
            v["compress_rope_theta"] = (-5.0).into()
        }),
        ("rope_parameters.factor", "0", |v| {
            v["rope_parameters"]["factor"] = 0.0.into()
        }),
        ("rope_parameters.original_max_position_embeddings", "0", |v| {
            v["rope_parameters"]["original_max_position_embeddings"] = 0.into()
        }),
        ("rope_parameters.beta_fast", "0", |v| {
            v["rope_parameters"]["beta_fast"] = 0.0.into()
        }),
        ("rope_parameters.beta_slow", "-1", |v| {
            v["rope_parameters"]["beta_slow"] = (-1.0).into()
        }),
        ("hc_sinkhorn_iters", "16777216", |v| {
            v["hc_sinkhorn_iters"] = (1u64 << 24).into()
        }),
        ("hc_eps", "0", |v| v["hc_eps"] = 0.0.into()),
        ("rms_norm_eps", "0", |v| v["rms_norm_eps"] = 0.0.into()),
        ("routed_scaling_factor", "-1.5", |v| {
            v["routed_scaling_factor"] = (-1.5).into()
        }),
        ("hc_mult", "100000", |v| v["hc_mult"] = 100_000.into()),
        ("num_hidden_layers", "5000", |v| {
            v["num_hidden_layers"] = 5000.into()
        }),
        ("swiglu_limit", "0", |v| v["swiglu_limit"] = 0.0.into()),
        ("partial_rotary_factor", "1.5", |v| {
            v["partial_rotary_factor"] = 1.5.into()
        }),
    ];
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), false);
    let pristine = std::fs::read(model.join("config.json")).unwrap();
    for (key, value, edit) in cases {
        std::fs::write(model.join("config.json"), &pristine).unwrap();
        edit_config(&model, edit);
        let out = dir.path().join("t.bin");
        let o = moeconf_within(60, &run_on(&model, &out, "1", &[]));
        let e = error_naming(&o, &["config.json", &format!("`{key}`"), value]);
        assert!(
            e.contains("expected") || e.contains("must"),
            "{key}: no allowed range in {e}"
        );
        nothing_written(dir.path(), "t.bin");
    }
}

#[test]
fn non_finite_weights_are_an_error_naming_step_layer_and_operator() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), true);
    poison_tensor(&model, "layers.3.ffn_norm.weight");
    let out = dir.path().join("nan.bin");
    let o = moeconf(&run_on(&model, &out, "2", &[]));
    let e = error_naming(
        &o,
        &[
            "non-finite",
            "step 0",
            "layer 3",
            "position 0",
            "`ffn.norm`",
            "--allow-non-finite",
        ],
    );
    assert!(!e.contains("wrote"), "{e}");
    nothing_written(dir.path(), "nan.bin");

    // Explicitly allowed: the trace is written and its binding says so.
    let o = moeconf(&run_on(&model, &out, "2", &["--allow-non-finite"]));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = moeconf(&["inspect", s(&out), "--format", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let extra = v["binding"]["extra"].to_string();
    assert!(extra.contains("non_finite") && extra.contains("allow"), "{extra}");
}

#[test]
fn fork_requests_that_cannot_take_effect_are_refused_before_running() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fork.bin");
    let model = "builtin:tiny-v4";
    let base = |extra: &[&'static str]| {
        let mut a: Vec<String> = [
            "run",
            "--model",
            model,
            "--prompt",
            "why the sheep",
            "--max-new-tokens",
            "2",
            "-o",
            s(&out),
            "--fork-layer",
            "3",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect();
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    // "why the sheep" is 5 prompt tokens: step 0 processes positions 0..4, step 1 position 5.
    for (extra, needle) in [
        (&["--fork-step", "99"][..], "--fork-step 99"),
        (&["--fork-step", "2"][..], "--fork-step 2"),
        (
            &["--fork-step", "1", "--fork-position", "0"][..],
            "--fork-position 0",
        ),
        (&["--fork-position", "4"][..], "--fork-position 4"),
        (
            &["--fork-step", "0", "--fork-position", "5"][..],
            "--fork-position 5",
        ),
    ] {
        let args = base(extra);
        let refs: Vec<&str> = args.iter().map(|x| x.as_str()).collect();
        let o = moeconf(&refs);
        error_naming(&o, &[needle]);
        nothing_written(dir.path(), "fork.bin");
    }
    // Processed positions are accepted.
    for extra in [
        &["--fork-step", "0", "--fork-position", "4"][..],
        &["--fork-position", "5"][..],
    ] {
        let args = base(extra);
        let refs: Vec<&str> = args.iter().map(|x| x.as_str()).collect();
        let o = moeconf(&refs);
        assert_eq!(o.status.code(), Some(0), "{extra:?}: {}", stderr(&o));
    }
    // demo's fork is at step 1: one generated token never reaches it.
    let o = moeconf(&[
        "demo",
        "--max-new-tokens",
        "1",
        "--out-dir",
        s(&dir.path().join("demo")),
    ]);
    error_naming(&o, &["--fork-step 1", "--max-new-tokens 1"]);
    // sweep refuses positions its fork step does not process, before running.
    let o = moeconf(&[
        "sweep",
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "2",
        "--fork-position",
        "0",
        "--scheme",
        "b",
        "--limit",
        "1",
        "-q",
    ]);
    error_naming(&o, &["--fork-position 0", "step 1"]);
    // calibrate checks its fork layer before creating its output directory.
    let cal = dir.path().join("cal");
    let o = moeconf(&[
        "calibrate",
        "--quick",
        "-q",
        "--fork-layer",
        "99",
        "--out",
        s(&cal),
    ]);
    error_naming(&o, &["--fork-layer 99"]);
    assert!(
        !cal.exists(),
        "calibrate created its output directory before refusing"
    );
}

#[test]
fn absurd_thread_counts_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.bin");
    let o = moeconf_within(30, &common_run(&out, &["--threads", "20000"]));
    error_naming(&o, &["--threads 20000", "at most"]);
    let o = moeconf_within(30, &["sweep", "--prompt", "x", "--threads", "20000", "-q"]);
    error_naming(&o, &["--threads 20000", "at most"]);
    let o = moeconf_within(
        30,
        &[
            "calibrate",
            "--quick",
            "--threads",
            "20000",
            "--out",
            s(&dir.path().join("c")),
        ],
    );
    error_naming(&o, &["--threads 20000", "at most"]);
    let o = moeconf_within(
        30,
        &[
            "calibrate",
            "--quick",
            "--threads",
            "0",
            "--out",
            s(&dir.path().join("c")),
        ],
    );
    error_naming(&o, &["--threads"]);
}

fn common_run<'a>(out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "run",
        "--model",
        "builtin:tiny-v4",
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "1",
        "-o",
        s(out),
    ];
    a.extend_from_slice(extra);
    a
}

#[test]
fn prompt_files_are_size_capped() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.bin");
    let run = |file: &str| {
        moeconf_within(
            30,
            &[
                "run",
                "--prompt-file",
                file,
                "--max-new-tokens",
                "1",
                "-o",
                s(&out),
            ],
        )
    };
    // An endless device: refused after reading the limit, not when memory runs out.
    let o = run("/dev/zero");
    error_naming(&o, &["--prompt-file /dev/zero", "16 MiB"]);
    // A regular file over the limit (sparse, so it costs no disk).
    let big = dir.path().join("big.txt");
    std::fs::File::create(&big)
        .unwrap()
        .set_len((16 << 20) + 1)
        .unwrap();
    let o = run(s(&big));
    error_naming(&o, &["big.txt", "16 MiB"]);
    nothing_written(dir.path(), "t.bin");
    // A small prompt file still works.
    let small = dir.path().join("p.txt");
    std::fs::write(&small, "why the sheep").unwrap();
    let o = run(s(&small));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn oversized_and_non_regular_model_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), false);
    let out = dir.path().join("t.bin");
    let pristine = std::fs::read(model.join("config.json")).unwrap();

    // config.json over its 16 MiB cap (sparse).
    std::fs::File::create(model.join("config.json"))
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let o = moeconf_within(30, &run_on(&model, &out, "1", &[]));
    error_naming(&o, &["config.json", "16 MiB"]);
    std::fs::write(model.join("config.json"), &pristine).unwrap();

    // tokenizer.json over its 256 MiB cap (sparse).
    let tok = model.join("tokenizer.json");
    let tok_bytes = std::fs::read(&tok).unwrap();
    std::fs::File::create(&tok)
        .unwrap()
        .set_len((256 << 20) + 1)
        .unwrap();
    let o = moeconf_within(30, &run_on(&model, &out, "1", &[]));
    error_naming(&o, &["tokenizer.json", "256 MiB"]);
    std::fs::write(&tok, &tok_bytes).unwrap();

    // A directory named like a safetensors file.
    let d = model.join("x.safetensors");
    std::fs::create_dir(&d).unwrap();
    let o = moeconf_within(30, &run_on(&model, &out, "1", &[]));
    let e = error_naming(
        &o,
        &["x.safetensors", "is a directory, expected a safetensors file"],
    );
    assert!(!e.contains("os error 19"), "{e}");
    std::fs::remove_dir(&d).unwrap();

    #[cfg(unix)]
    {
        // A symlink loop.
        let l = model.join("loop.safetensors");
        std::os::unix::fs::symlink(&l, &l).unwrap();
        let o = moeconf_within(30, &run_on(&model, &out, "1", &[]));
        let e = error_naming(&o, &["loop.safetensors", "symbolic link"]);
        assert_eq!(e.matches("Too many levels").count(), 1, "repeated: {e}");
        std::fs::remove_file(&l).unwrap();

        // A FIFO (opening it would block forever).
        let f = model.join("fifo.safetensors");
        let status = Command::new("mkfifo").arg(&f).status().unwrap();
        assert!(status.success());
        let o = moeconf_within(30, &run_on(&model, &out, "1", &[]));
        error_naming(&o, &["fifo.safetensors", "FIFO", "expected a safetensors file"]);
        std::fs::remove_file(&f).unwrap();

        // config.json as a FIFO.
        let c = model.join("config.json");
        std::fs::remove_file(&c).unwrap();
        let status = Command::new("mkfifo").arg(&c).status().unwrap();
        assert!(status.success());
        let o = moeconf_within(30, &run_on(&model, &out, "1", &[]));
        error_naming(&o, &["config.json", "FIFO"]);
        std::fs::remove_file(&c).unwrap();
        std::fs::write(&c, &pristine).unwrap();
    }

    // An empty safetensors file.
    std::fs::write(model.join("empty.safetensors"), b"").unwrap();
    let o = moeconf_within(30, &run_on(&model, &out, "1", &[]));
    error_naming(&o, &["empty.safetensors"]);
    std::fs::remove_file(model.join("empty.safetensors")).unwrap();
    nothing_written(dir.path(), "t.bin");

    // The unmodified copy still runs.
    let o = moeconf(&run_on(&model, &out, "1", &[]));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

/// A tokenizer whose prompt tokens have ids past the model's vocabulary (an
/// added token the checkpoint has no embedding for) is refused before
/// anything runs, naming the tokenizer file, the token and its id; no trace
/// is left behind.
#[test]
fn prompt_tokens_past_the_vocabulary_name_the_tokenizer_and_token() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_copy(tmp.path(), false);
    let path = model.join("tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab = t["model"]["vocab"].as_object().unwrap().len();
    t["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({
        "id": vocab, "content": "sheep", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": false
    }));
    std::fs::write(&path, serde_json::to_string(&t).unwrap()).unwrap();
    let out = tmp.path().join("t.bin");
    let o = moeconf_within(60, &run_on(&model, &out, "1", &[]));
    let id = vocab.to_string();
    error_naming(&o, &["tokenizer.json", "\"sheep\"", &id, "vocab_size"]);
    assert!(!out.exists());
}
