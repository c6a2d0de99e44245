//! Every example of every `--help` runs (docs/architecture.md "Help
//! examples"): the test walks the command tree through the built binary
//! (`moeconf --help`, then each command its "Commands:" section lists,
//! recursively), takes every line of an "Examples:" section that starts
//! with `moeconf `, and runs it with `sh -c` (globs, redirections and
//! comments as a user's shell would) with the binary first on `PATH`.
//!
//! The convention the examples follow:
//! * One command's examples run in order in one fresh directory, so an
//!   example may use what an earlier one of the same command wrote
//!   (`run ... -o cand.bin`, then `replay cand.bin`).
//! * That directory starts with the standard inputs: `ref.bin` and
//!   `cand.bin` (the first two `moeconf run --help` examples: the same
//!   prompt natively and under contract b, so they differ), `prompt.txt`,
//!   `ckpt/` (the released-format built-in model `builtin:tiny-v4-fp8` as a
//!   checkpoint directory), `dumps/` (a backend's tensor dumps with their
//!   manifest, docs/import.md), an empty `baselines/`, `matrix.toml` (an
//!   invariance matrix of the reference runtime, docs/invariance.md) and
//!   `policy.toml` (a policy with an `[invariance]` section).
//! * Examples run on the built-in fixtures and are quick (small
//!   `--max-new-tokens`, `--limit`, `calibrate --quick`).
//! * An example that needs an external backend (torch, llama.cpp, vLLM)
//!   ends with the comment `# needs BACKEND`; it is skipped, and named.
//!
//! The assertion is the exit code: 0 or 1 (a diff of differing traces
//! exits 1), never 2 (an error) nor anything else (a shell error, a signal).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

/// What marks an example that needs an external backend.
const EXTERNAL_MARKER: &str = "# needs ";

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn moeconf(cwd: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args).current_dir(cwd);
    clean_env(&mut c);
    c.output().expect("spawn moeconf")
}

/// Removes the environment that changes moeconf's defaults, and keeps help
/// lines unwrapped whatever the terminal.
fn clean_env(c: &mut Command) {
    for k in [
        "MOECONF_POLICY",
        "MOECONF_PROFILE",
        "MOECONF_FORMAT",
        "MOECONF_LEVELS",
    ] {
        c.env_remove(k);
    }
    c.env("COLUMNS", "1000");
}

/// The long help of the command `path` (`[]`: the top level).
fn help(path: &[String]) -> String {
    let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
    args.push("--help");
    let o = moeconf(Path::new("."), &args);
    assert_eq!(o.status.code(), Some(0), "moeconf {args:?}: {}", text(&o));
    String::from_utf8(o.stdout).expect("UTF-8 help")
}

/// The subcommands a help text lists under "Commands:" (without `help`).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| l.trim_end() != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        // Command names are indented by two spaces; deeper lines continue a description.
        .filter(|l| !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| *n != "help")
        .map(str::to_string)
        .collect()
}

/// The example command lines of a help text: the lines of its "Examples:"
/// sections that start with `moeconf `.
fn examples(help: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for l in help.lines() {
        if l.trim_end() == "Examples:" {
            inside = true;
            continue;
        }
        if inside {
            let t = l.trim();
            if t.starts_with("moeconf ") || t == "moeconf" {
                out.push(t.to_string());
            } else if !l.starts_with("  ") {
                inside = false;
            }
        }
    }
    out
}

/// Every command of the tree, with its examples, top level first.
fn tree() -> Vec<(Vec<String>, Vec<String>)> {
    let mut out = Vec::new();
    let mut stack = vec![Vec::<String>::new()];
    while let Some(path) = stack.pop() {
        let h = help(&path);
        for sub in subcommands(&h).into_iter().rev() {
            let mut p = path.clone();
            p.push(sub);
            stack.push(p);
        }
        out.push((path, examples(&h)));
    }
    out
}

/// Copies the directory `from` into `to` (files and directories only).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_type().unwrap().is_dir() {
            copy_dir(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}

/// A backend's tensor dumps with their manifest (docs/import.md): one step,
/// the emitted token.
fn write_dumps(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let z = "0".repeat(64);
    std::fs::write(
        dir.join("manifest.json"),
        format!(
            r#"{{"model": {{"name": "m", "config_digest": "{z}", "weights_digest": "{z}"}},
 "tokenizer": {{"digest": "{z}"}}, "prompt": {{"text": "a", "ids": [1]}}, "max_new_tokens": 2,
 "precision": "bf16", "contract": "native", "schedule": "identity",
 "runtime": {{"name": "t", "version": "1"}}}}"#
        ),
    )
    .unwrap();
    let ids = 7i32.to_le_bytes();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![1], &ids).unwrap();
    safetensors::serialize_to_file(
        vec![("step.0.pos.0.token.output", view)],
        None,
        &dir.join("a.safetensors"),
    )
    .unwrap();
}

/// The standard inputs every command's examples start with (see the module
/// documentation), made with the `run --help` examples that write them.
fn standard_inputs(dir: &Path, run_examples: &[String]) -> PathBuf {
    let inputs = dir.join("inputs");
    std::fs::create_dir_all(inputs.join("baselines")).unwrap();
    std::fs::write(inputs.join("prompt.txt"), "why the sheep").unwrap();
    std::fs::write(
        inputs.join("matrix.toml"),
        "[run]\nbackend = \"reference\"\nprompt = \"why the sheep\"\nmax_new_tokens = 2\n\
         [[config]]\nthreads = 2\n[[config]]\nprefill_chunk = 1\n",
    )
    .unwrap();
    std::fs::write(
        inputs.join("policy.toml"),
        "[invariance]\nthreads = \"bitwise\"\nprefill_chunk = \"bitwise\"\n",
    )
    .unwrap();
    write_dumps(&inputs.join("dumps"));
    let ckpt =
        moeconf_fixtures::ensure_builtin_in(moeconf_fixtures::BUILTIN_TINY_V4_FP8, &dir.join("fixtures"))
            .expect("the built-in checkpoint");
    copy_dir(&ckpt, &inputs.join("ckpt"));
    for want in ["-o ref.bin", "-o cand.bin"] {
        let ex = run_examples
            .iter()
            .find(|e| e.ends_with(want))
            .unwrap_or_else(|| panic!("no `moeconf run` example writes {want}: {run_examples:?}"));
        let o = shell(&inputs, ex);
        assert_eq!(o.status.code(), Some(0), "{ex}: {}", text(&o));
    }
    inputs
}

/// Runs one example line in `cwd` as a shell would, with this moeconf first
/// on `PATH`.
fn shell(cwd: &Path, line: &str) -> Output {
    let bin_dir = Path::new(BIN).parent().unwrap();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin_dir.to_path_buf()];
    dirs.extend(std::env::split_paths(&path));
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(line)
        .current_dir(cwd)
        .env("PATH", std::env::join_paths(dirs).unwrap())
        .env("GITHUB_STEP_SUMMARY", cwd.join("step-summary.md"));
    clean_env(&mut c);
    c.output().expect("spawn sh")
}

#[test]
fn every_help_example_runs() {
    let tree = tree();
    let names: Vec<String> = tree.iter().map(|(p, _)| p.join(" ")).collect();
    // The walk found the commands and the nested ones.
    for want in [
        "run",
        "diff",
        "gate",
        "calibrate",
        "merge",
        "export",
        "export gguf",
        "bench fingerprint",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
    }
    let run_examples = &tree
        .iter()
        .find(|(p, _)| p.len() == 1 && p[0] == "run")
        .expect("run")
        .1;
    let work = tempfile::tempdir().unwrap();
    let inputs = standard_inputs(work.path(), run_examples);
    let (mut ran, mut skipped, mut failed) = (0, Vec::new(), Vec::new());
    for (i, (path, examples)) in tree.iter().enumerate() {
        if examples.is_empty() {
            continue;
        }
        let dir = work.path().join(format!("cmd-{i}"));
        copy_dir(&inputs, &dir);
        for ex in examples {
            if ex.contains(EXTERNAL_MARKER) {
                skipped.push(ex.clone());
                continue;
            }
            let o = shell(&dir, ex);
            ran += 1;
            if !matches!(o.status.code(), Some(0 | 1)) {
                failed.push(format!(
                    "moeconf {} --help: `{ex}` exited {:?}:\n{}",
                    path.join(" "),
                    o.status,
                    text(&o)
                ));
            }
        }
    }
    eprintln!("{ran} examples ran; skipped (external backend): {skipped:?}");
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
    assert!(ran >= 40, "only {ran} examples ran");
}
