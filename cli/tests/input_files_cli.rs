//! Inputs are regular files (docs/format.md §7, docs/import.md "Errors"):
//! every command refuses a FIFO, a directory, a character device
//! (`/dev/null`) or a symbolic link to a FIFO where it expects an input file,
//! before opening it for reading. Each command is run on the built binary
//! under a watchdog: a FIFO opened for reading would block forever (no
//! writer ever appears), so a hang fails the test as such. The exit code
//! must be 2 and stderr must name the path and what it is. `import` refuses
//! a dump entry named `*.safetensors` that is not a regular file instead of
//! skipping it, and names the dump file of a tensor of unsupported rank.

use safetensors::tensor::TensorView as StView;
use safetensors::Dtype;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{run_args, s};

/// How long a command may take before it counts as blocked.
const WATCHDOG: Duration = Duration::from_secs(20);

/// Runs the binary in `cwd`, killing it (and failing) after [`WATCHDOG`].
/// Output goes to files, so a chatty command cannot fill a pipe and stall.
fn moeconf(cwd: &Path, args: &[&str]) -> Output {
    let logs = tempfile::tempdir().unwrap();
    let (out, err) = (logs.path().join("out"), logs.path().join("err"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_moeconf"));
    cmd.args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap());
    for k in [
        "MOECONF_POLICY",
        "MOECONF_PROFILE",
        "MOECONF_FORMAT",
        "MOECONF_LEVELS",
    ] {
        cmd.env_remove(k);
    }
    let mut child = cmd.spawn().expect("spawn moeconf");
    let deadline = Instant::now() + WATCHDOG;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("moeconf {args:?} did not finish within {WATCHDOG:?}: blocked on an input");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: std::fs::read(&out).unwrap(),
        stderr: std::fs::read(&err).unwrap(),
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts exit 2 and that stderr contains every one of `needles`.
fn refused(o: &Output, args: &[&str], needles: &[&str]) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: expected exit 2, stderr: {e}");
    for n in needles {
        assert!(e.contains(n), "{args:?}: stderr does not name {n:?}: {e}");
    }
}

fn mkfifo(p: &Path) {
    let st = Command::new("mkfifo").arg(p).status().expect("mkfifo");
    assert!(st.success(), "mkfifo {}", p.display());
}

/// A path that is not a regular file, and what stderr must say about it.
struct Bad {
    path: PathBuf,
    says: Vec<String>,
}

/// A FIFO, a directory, `/dev/null` and a symbolic link to a FIFO, in `dir`.
fn bad_inputs(dir: &Path) -> Vec<Bad> {
    let fifo = dir.join("in.fifo");
    mkfifo(&fifo);
    let d = dir.join("in.dir");
    std::fs::create_dir(&d).unwrap();
    let link = dir.join("in.link");
    std::os::unix::fs::symlink(&fifo, &link).unwrap();
    let bad = |path: PathBuf, says: &[&str]| Bad {
        says: std::iter::once(s(&path).to_string())
            .chain(says.iter().map(|x| x.to_string()))
            .collect(),
        path,
    };
    vec![
        bad(fifo.clone(), &["is a FIFO (named pipe), not a regular file"]),
        bad(d, &["is a directory, not a regular file"]),
        bad(
            PathBuf::from("/dev/null"),
            &["is a character device, not a regular file"],
        ),
        bad(
            link,
            &[
                &format!("is a symbolic link to {}", s(&fifo)),
                "which is a FIFO (named pipe), not a regular file",
            ],
        ),
    ]
}

/// Every command family that reads a trace, a policy, a baseline or a
/// partial refuses each kind of non-regular input, promptly.
#[test]
fn trace_policy_baseline_and_partial_inputs_must_be_regular_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good = d.join("good.bin");
    let o = moeconf(d, &run_args(&good, "2", &[]));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let g = s(&good);
    let out = d.join("out.bin");
    for bad in bad_inputs(d) {
        let p = s(&bad.path);
        let says: Vec<&str> = bad.says.iter().map(String::as_str).collect();
        let cases: Vec<Vec<&str>> = vec![
            vec!["inspect", p],
            vec!["diff", g, p],
            vec!["diff", p, g],
            vec!["convert", p, "-o", s(&out)],
            vec!["gate", g, p],
            vec!["gate", p, g],
            vec!["gate", "--policy", p, g, g],
            vec!["gate", "--baseline", p, g],
            vec!["replay", p],
            vec!["explain", p],
            vec!["certify", p],
            vec!["merge", p],
        ];
        for args in cases {
            let o = moeconf(d, &args);
            refused(&o, &args, &says);
        }
        assert!(!out.exists(), "convert wrote an output from {p}");
    }
}

/// A moeconf.toml at the repository root that is not a regular file is an
/// error naming it, not silently replaced by the built-in policy.
#[test]
fn a_discovered_policy_that_is_a_fifo_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good = d.join("good.bin");
    let o = moeconf(d, &run_args(&good, "2", &[]));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    std::fs::create_dir(d.join(".git")).unwrap();
    mkfifo(&d.join("moeconf.toml"));
    let args = ["gate", s(&good), s(&good)];
    let o = moeconf(d, &args);
    refused(&o, &args, &["moeconf.toml", "is a FIFO (named pipe)"]);
}

/// One dumped tensor: name, dtype, shape, little-endian bytes.
type Dumped = (String, Dtype, Vec<usize>, Vec<u8>);

fn write_st(path: &Path, tensors: &[Dumped]) {
    let views: Vec<(String, StView<'_>)> = tensors
        .iter()
        .map(|(n, d, sh, b)| (n.clone(), StView::new(*d, sh.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A dump directory with a manifest and one valid dump file.
fn dump_dir(dir: &Path) -> PathBuf {
    let dump = dir.join("dump");
    std::fs::create_dir(&dump).unwrap();
    let z = "0".repeat(64);
    std::fs::write(
        dump.join("manifest.json"),
        format!(
            r#"{{
  "model": {{"name": "dumped", "config_digest": "{z}", "weights_digest": "{z}"}},
  "tokenizer": {{"digest": "{z}"}},
  "prompt": {{"text": "why the sheep", "ids": [11, 12]}},
  "max_new_tokens": 2,
  "precision": "bf16",
  "contract": "native",
  "schedule": "identity",
  "runtime": {{"name": "test-backend", "version": "0.1"}}
}}"#
        ),
    )
    .unwrap();
    let logits: Vec<u8> = [0.5f32, 1.0, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    write_st(
        &dump.join("a.safetensors"),
        &[("step.0.pos.1.lm.logits".into(), Dtype::F32, vec![3], logits)],
    );
    dump
}

/// Puts something at a path.
type Make<'a> = Box<dyn Fn() + 'a>;

/// A dump entry named `*.safetensors` that is a FIFO, a directory, a link to
/// `/dev/null`, a link to a FIFO or a dangling link makes `import` fail
/// naming it (main skipped it and wrote a trace with fewer records); a
/// manifest that is a FIFO is refused too. No output is written.
#[test]
fn import_refuses_dump_files_that_are_not_regular_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dump = dump_dir(d);
    let out = d.join("imported.bin");
    let args = ["import", s(&dump), "-o", s(&out)];
    // The dump imports as it is.
    let o = moeconf(d, &args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    std::fs::remove_file(&out).unwrap();

    let x = dump.join("x.safetensors");
    let fifo = d.join("elsewhere.fifo");
    mkfifo(&fifo);
    let make: Vec<(&str, Make<'_>)> = vec![
        (
            "is a FIFO (named pipe), not a regular file",
            Box::new(|| mkfifo(&x)),
        ),
        (
            "is a directory, not a regular file",
            Box::new(|| std::fs::create_dir(&x).unwrap()),
        ),
        (
            "symbolic link to /dev/null, which is a character device",
            Box::new(|| std::os::unix::fs::symlink("/dev/null", &x).unwrap()),
        ),
        (
            "which is a FIFO (named pipe), not a regular file",
            Box::new(|| std::os::unix::fs::symlink(&fifo, &x).unwrap()),
        ),
        (
            "which does not exist",
            Box::new(|| std::os::unix::fs::symlink(d.join("nowhere"), &x).unwrap()),
        ),
    ];
    for (says, make) in make {
        make();
        let o = moeconf(d, &args);
        refused(&o, &args, &[s(&x), "dump file", says]);
        assert!(!out.exists(), "a trace was written without {}", x.display());
        if std::fs::symlink_metadata(&x).unwrap().is_dir() {
            std::fs::remove_dir(&x).unwrap();
        } else {
            std::fs::remove_file(&x).unwrap();
        }
    }

    let args = ["import", s(&dump), "--manifest", s(&fifo), "-o", s(&out)];
    let o = moeconf(d, &args);
    refused(&o, &args, &[s(&fifo), "manifest", "is a FIFO (named pipe)"]);
    assert!(!out.exists());
}

/// A tensor of rank 9 (a trace record has at most 8 dimensions) is refused
/// naming the dump file and the tensor, not the output trace.
#[test]
fn import_names_the_dump_file_of_a_tensor_of_unsupported_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dump = dump_dir(d);
    let bad = dump.join("rank9.safetensors");
    let name = "step.0.pos.1.layer.0.attn.output";
    write_st(
        &bad,
        &[(name.into(), Dtype::F32, vec![1; 9], 1.0f32.to_le_bytes().to_vec())],
    );
    let out = d.join("imported.bin");
    let args = ["import", s(&dump), "-o", s(&out)];
    let o = moeconf(d, &args);
    refused(&o, &args, &[s(&bad), name, "rank 9"]);
    assert!(
        !stderr(&o).contains("imported.bin"),
        "the error names the output: {}",
        stderr(&o)
    );
    assert!(!out.exists());
}

/// `run --model DIR` whose weights file is a symbolic link to a FIFO (or
/// whose tokenizer is a link to `/dev/null`) is refused naming the link,
/// before anything runs.
#[test]
fn model_files_that_link_to_a_fifo_or_device_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let src = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").expect("built-in fixture");
    let model = d.join("model");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        std::fs::copy(src.join(f), model.join(f)).unwrap();
    }
    let fifo = d.join("w.fifo");
    mkfifo(&fifo);
    let out = d.join("t.bin");
    let args = [
        "run",
        "--model",
        s(&model),
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "1",
        "-o",
        s(&out),
    ];
    let link = model.join("z.safetensors");
    std::os::unix::fs::symlink(&fifo, &link).unwrap();
    let o = moeconf(d, &args);
    refused(&o, &args, &[s(&link), "symbolic link to", "FIFO (named pipe)"]);
    std::fs::remove_file(&link).unwrap();

    let tok = model.join("tokenizer.json");
    std::fs::remove_file(&tok).unwrap();
    std::os::unix::fs::symlink("/dev/null", &tok).unwrap();
    let o = moeconf(d, &args);
    refused(&o, &args, &[s(&tok), "character device"]);
    assert!(!out.exists());
}
