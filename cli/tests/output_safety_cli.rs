//! Safe outputs (docs/format.md "Writer guarantees"), end to end: every
//! output path of `run`, `import`, `gate`, `sweep`, `demo`, `calibrate` and
//! `bench diff` is checked before any work starts. An existing output that
//! is not a regular file (directory, FIFO, socket) is refused, as is a
//! symbolic link, a missing parent directory, and an output that is the same
//! file (same device and inode, by path or by hard link) as any input of the
//! command. Temporary files are removed on every error path, are named
//! `.NAME.moeconf-tmp.PID.RAND`, and stale ones next to an output are
//! reported; an interrupted write (SIGINT, SIGTERM, SIGHUP) removes its
//! temporary file and still ends by the signal. Reports, baselines and
//! traces get the mode 0666 & !umask.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

fn moeconf(args: &[&str]) -> Output {
    moeconf_in(Path::new("."), args)
}

fn moeconf_in(cwd: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args).current_dir(cwd);
    for k in [
        "MOECONF_POLICY",
        "MOECONF_PROFILE",
        "MOECONF_FORMAT",
        "MOECONF_LEVELS",
    ] {
        c.env_remove(k);
    }
    c.output().expect("spawn moeconf")
}

/// Runs `script` with `sh -c`, `$M` naming the binary (for umask and ulimit).
fn sh(cwd: &Path, script: &str) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .env("M", BIN)
        .current_dir(cwd)
        .output()
        .expect("spawn sh")
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts exit 2 with a message containing every one of `needles`, and
/// that no run happened (`moeconf run` reports its generation on stderr).
fn refused(o: &Output, needles: &[&str]) {
    let e = err(o);
    assert_eq!(code(o), 2, "expected exit 2, got {}: {e}", code(o));
    for n in needles {
        assert!(e.contains(n), "stderr lacks {n:?}: {e}");
    }
    assert!(
        !e.contains("generated in"),
        "the run started before the check: {e}"
    );
}

/// A finished trace of the built-in model (2 new tokens).
fn trace(path: &Path) -> PathBuf {
    let o = moeconf(&run_args(path, "2", &[]));
    assert!(o.status.success(), "{}", err(&o));
    path.to_path_buf()
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

/// Names of the temporary files (ours and the old pattern) in `dir`.
fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".moeconf-tmp.") || n.contains(".tmp-") || n.starts_with(".tmp"))
        .collect()
}

fn mkfifo(p: &Path) {
    let st = Command::new("mkfifo").arg(p).status().expect("mkfifo");
    assert!(st.success());
}

/// A copy of the built-in model (config.json, tokenizer.json, model.safetensors).
fn model_copy(dir: &Path) -> PathBuf {
    let src = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").expect("built-in fixture");
    let dst = dir.join("model");
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    dst
}

#[test]
fn outputs_that_are_not_regular_files_are_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.bin");
    mkfifo(&fifo);
    let o = moeconf(&run_args(&fifo, "2", &[]));
    refused(&o, &["fifo.bin", "FIFO", "not a regular file"]);
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());

    let sock = dir.path().join("sock.bin");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let o = moeconf(&run_args(&sock, "2", &[]));
    refused(&o, &["sock.bin", "socket"]);
    assert!(std::fs::symlink_metadata(&sock).unwrap().file_type().is_socket());

    let d = dir.path().join("out.bin");
    std::fs::create_dir(&d).unwrap();
    let o = moeconf(&run_args(&d, "2", &[]));
    refused(&o, &["out.bin", "is a directory"]);
    assert!(d.is_dir());

    // The same for report files: nothing is printed and nothing judged.
    let r = trace(&dir.path().join("r.bin"));
    for flag in ["--junit", "--output"] {
        let o = moeconf(&["gate", s(&r), s(&r), flag, s(&fifo)]);
        refused(&o, &["fifo.bin", "FIFO"]);
        assert!(o.stdout.is_empty(), "the gate ran before refusing its output");
    }
    let o = moeconf(&["gate", "--bless", "--baseline", s(&d), s(&r)]);
    refused(&o, &["out.bin", "is a directory"]);
    let o = moeconf(&[
        "sweep",
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "2",
        "--scheme",
        "b",
        "--limit",
        "2",
        "-q",
        "-o",
        s(&fifo),
    ]);
    refused(&o, &["FIFO"]);
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    assert!(
        temporaries(dir.path()).is_empty(),
        "{:?}",
        temporaries(dir.path())
    );
}

#[test]
fn symbolic_link_outputs_are_refused_and_neither_link_nor_target_changes() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target.txt");
    std::fs::write(&target, "keep me").unwrap();
    let link = dir.path().join("link.bin");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let o = moeconf(&run_args(&link, "2", &[]));
    refused(&o, &["link.bin", "symbolic link"]);
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(read(&target), b"keep me");
    // A dangling link too: moeconf never creates a file through a link.
    let dangling = dir.path().join("dangling.bin");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
    let o = moeconf(&run_args(&dangling, "2", &[]));
    refused(&o, &["dangling.bin", "symbolic link"]);
    assert!(!dir.path().join("nowhere").exists());
    let r = trace(&dir.path().join("r.bin"));
    let o = moeconf(&["gate", s(&r), s(&r), "--junit", s(&link)]);
    refused(&o, &["link.bin", "symbolic link"]);
    assert_eq!(read(&target), b"keep me");
}

#[test]
fn run_refuses_an_output_that_is_one_of_its_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path());
    let weights = model.join("model.safetensors");
    let before = read(&weights);
    let m = s(&model);
    let o = moeconf(&[
        "run",
        "--model",
        m,
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "2",
        "-o",
        s(&weights),
    ]);
    refused(&o, &["model.safetensors", "same file as", "input"]);
    assert_eq!(read(&weights), before, "the model was overwritten");
    // Through a hard link: same device and inode, another name.
    let link = dir.path().join("config-link.bin");
    std::fs::hard_link(model.join("config.json"), &link).unwrap();
    let cfg = read(&model.join("config.json"));
    let o = moeconf(&[
        "run",
        "--model",
        m,
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "2",
        "-o",
        s(&link),
    ]);
    refused(&o, &["config-link.bin", "same file as", "config.json"]);
    assert_eq!(read(&model.join("config.json")), cfg);
    let tok = model.join("tokenizer.json");
    let o = moeconf(&[
        "run",
        "--model",
        m,
        "--prompt",
        "x",
        "--max-new-tokens",
        "2",
        "-o",
        s(&tok),
    ]);
    refused(&o, &["tokenizer.json", "same file as"]);
    // The prompt file, and the built-in model's cached files.
    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, "why the sheep").unwrap();
    let o = moeconf(&[
        "run",
        "--prompt-file",
        s(&prompt),
        "--max-new-tokens",
        "2",
        "-o",
        s(&prompt),
    ]);
    refused(&o, &["prompt.txt", "same file as", "prompt"]);
    assert_eq!(read(&prompt), b"why the sheep");
    // (In a private cache, so that a failure cannot damage the shared one.)
    let cache = dir.path().join("cache");
    let builtin = moeconf_fixtures::builtin::ensure_tiny_v4_in(&cache).unwrap();
    let cached = builtin.join("config.json");
    let before = read(&cached);
    let o = Command::new(BIN)
        .args(run_args(&cached, "2", &[]))
        .env("MOECONF_CACHE_DIR", &cache)
        .output()
        .unwrap();
    refused(&o, &["config.json", "same file as"]);
    assert_eq!(read(&cached), before);
    let o = moeconf(&[
        "sweep",
        "--prompt-file",
        s(&prompt),
        "--max-new-tokens",
        "2",
        "--scheme",
        "b",
        "--limit",
        "2",
        "-q",
        "-o",
        s(&prompt),
    ]);
    refused(&o, &["prompt.txt", "same file as"]);
}

/// A dump directory of two small tensors with a manifest.
fn dump(dir: &Path) -> PathBuf {
    let d = dir.join("dump");
    std::fs::create_dir_all(&d).unwrap();
    let z = "0".repeat(64);
    std::fs::write(
        d.join("manifest.json"),
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
        &d.join("a.safetensors"),
    )
    .unwrap();
    d
}

#[test]
fn import_refuses_an_output_that_is_part_of_its_dump() {
    let dir = tempfile::tempdir().unwrap();
    let d = dump(dir.path());
    for victim in ["manifest.json", "a.safetensors"] {
        let p = d.join(victim);
        let before = read(&p);
        let o = moeconf(&["import", s(&d), "-o", s(&p)]);
        refused(&o, &[victim, "same file as"]);
        assert_eq!(read(&p), before, "{victim} was overwritten");
    }
    let link = dir.path().join("hard.bin");
    std::fs::hard_link(d.join("a.safetensors"), &link).unwrap();
    let o = moeconf(&["import", s(&d), "-o", s(&link)]);
    refused(&o, &["hard.bin", "same file as", "a.safetensors"]);
    // A manifest given with --manifest elsewhere is an input too.
    let m2 = dir.path().join("m2.json");
    std::fs::copy(d.join("manifest.json"), &m2).unwrap();
    let o = moeconf(&["import", s(&d), "--manifest", s(&m2), "-o", s(&m2)]);
    refused(&o, &["m2.json", "same file as"]);
    let ok = moeconf(&["import", s(&d), "-o", s(&dir.path().join("ok.bin"))]);
    assert!(ok.status.success(), "{}", err(&ok));
}

#[test]
fn gate_refuses_outputs_that_are_its_inputs_or_each_other() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join(".git")).unwrap();
    let r = trace(&dir.path().join("ref.bin"));
    let c = trace(&dir.path().join("cand.bin"));
    let (rb, cb) = (read(&r), read(&c));
    let o = moeconf(&["gate", "--bless", "--baseline", s(&r), s(&r)]);
    refused(&o, &["ref.bin", "same file as"]);
    assert_eq!(read(&r), rb, "blessing overwrote the trace");
    for flag in ["--output", "--junit"] {
        let o = moeconf(&["gate", s(&r), s(&c), flag, s(&r)]);
        refused(&o, &["ref.bin", "same file as"]);
        let o = moeconf(&["gate", s(&r), s(&c), flag, s(&c)]);
        refused(&o, &["cand.bin", "same file as"]);
    }
    assert_eq!((read(&r), read(&c)), (rb, cb));
    let x = dir.path().join("x.xml");
    let o = moeconf(&["gate", s(&r), s(&c), "--output", s(&x), "--junit", s(&x)]);
    refused(&o, &["x.xml", "more than one output"]);
    // The policy file and a baseline being read are inputs.
    let policy = dir.path().join("moeconf.toml");
    std::fs::write(&policy, "").unwrap();
    let o = moeconf_in(dir.path(), &["gate", s(&r), s(&c), "--output", s(&policy)]);
    refused(&o, &["moeconf.toml", "same file as", "policy"]);
    let base = dir.path().join("base.json");
    let o = moeconf(&["gate", "--bless", "--baseline", s(&base), s(&c)]);
    assert!(o.status.success(), "{}", err(&o));
    let bb = read(&base);
    let o = moeconf(&["gate", "--baseline", s(&base), s(&c), "--junit", s(&base)]);
    refused(&o, &["base.json", "same file as", "baseline"]);
    assert_eq!(read(&base), bb);
    // Re-blessing the same baseline is a plain output replacement.
    let o = moeconf(&["gate", "--bless", "--baseline", s(&base), s(&c)]);
    assert!(o.status.success(), "{}", err(&o));
}

#[test]
fn missing_directories_and_directory_outputs_are_found_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope").join("x.bin");
    let o = moeconf(&run_args(&missing, "2", &[]));
    refused(&o, &["nope", "does not exist"]);
    let file = dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let under_file = file.join("x.bin");
    let o = moeconf(&run_args(&under_file, "2", &[]));
    refused(&o, &["file", "not a directory"]);
    let r = trace(&dir.path().join("r.bin"));
    let o = moeconf(&["gate", s(&r), s(&r), "--junit", s(&missing)]);
    refused(&o, &["nope", "does not exist"]);
    assert!(
        o.stdout.is_empty(),
        "the report was printed before the output was found unwritable"
    );
    let o = moeconf(&["gate", "--bless", "--baseline", s(&missing), s(&r)]);
    refused(&o, &["nope", "does not exist"]);
    let d = dump(dir.path());
    let o = moeconf(&["import", s(&d), "-o", s(&missing)]);
    refused(&o, &["nope", "does not exist"]);
    let o = moeconf(&[
        "sweep",
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "2",
        "--scheme",
        "b",
        "-q",
        "-o",
        s(&missing),
    ]);
    refused(&o, &["nope", "does not exist"]);
    assert!(!err(&o).contains("branches"), "the sweep ran: {}", err(&o));
    let o = moeconf(&["calibrate", "--quick", "--only", "1", "-q", "--out", s(&file)]);
    refused(&o, &["file", "not a directory"]);
    let o = moeconf(&["demo", "--out-dir", s(&file)]);
    refused(&o, &["file", "not a directory"]);
    let o = moeconf(&["bench", "diff", "--mib", "1", "--repeat", "1", "--dir", s(&file)]);
    refused(&o, &["file", "not a directory"]);
    // bench diff removes its two traces afterwards: it never takes over existing files.
    let bd = dir.path().join("bench");
    std::fs::create_dir(&bd).unwrap();
    std::fs::write(bd.join("bench-ref.bin"), "mine").unwrap();
    let o = moeconf(&["bench", "diff", "--mib", "1", "--repeat", "1", "--dir", s(&bd)]);
    refused(&o, &["bench-ref.bin", "already exists"]);
    assert_eq!(read(&bd.join("bench-ref.bin")), b"mine");
}

#[test]
fn failed_writes_leave_no_temporary_file_and_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let r = trace(&dir.path().join("r.bin"));
    // A file-size limit makes every write past 2 KiB fail with EFBIG (SIGXFSZ
    // ignored): the trace fails while being written or flushed in finish,
    // the reports while being written.
    // With payloads the trace outgrows the writer's buffer and a record's
    // write fails; fingerprints only, it fits and the flush in finish fails.
    for capture in ["all", "fingerprints"] {
        let o = sh(
            dir.path(),
            &format!(
                "trap '' XFSZ; ulimit -f 4; \"$M\" run --prompt 'why the sheep' --max-new-tokens 2 \
                 --capture {capture} -o big.bin"
            ),
        );
        assert_eq!(code(&o), 2, "{capture}: {}", err(&o));
        assert!(err(&o).contains("big.bin"), "{}", err(&o));
        assert!(!dir.path().join("big.bin").exists());
        assert!(
            temporaries(dir.path()).is_empty(),
            "{capture}: {:?}",
            temporaries(dir.path())
        );
    }
    let o = sh(
        dir.path(),
        &format!(
            "trap '' XFSZ; ulimit -f 0; \"$M\" gate {0} {0} --junit j.xml",
            s(&r)
        ),
    );
    assert_eq!(code(&o), 2, "{}", err(&o));
    assert!(!dir.path().join("j.xml").exists());
    let o = sh(
        dir.path(),
        &format!(
            "trap '' XFSZ; ulimit -f 0; \"$M\" gate --bless --baseline b.json {}",
            s(&r)
        ),
    );
    assert_eq!(code(&o), 2, "{}", err(&o));
    assert!(!dir.path().join("b.json").exists());
    assert!(
        temporaries(dir.path()).is_empty(),
        "{:?}",
        temporaries(dir.path())
    );
}

#[test]
fn stale_temporary_files_next_to_an_output_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.bin");
    // A process id above Linux's maximum (2^22) cannot be running.
    let stale = dir.path().join(".out.bin.moeconf-tmp.99999999.0123456789abcdef");
    let old = dir.path().join(".out.bin.tmp-99999999-0");
    std::fs::write(&stale, "partial").unwrap();
    std::fs::write(&old, "partial").unwrap();
    let o = moeconf(&run_args(&out, "2", &[]));
    assert!(o.status.success(), "{}", err(&o));
    let e = err(&o);
    for f in [&stale, &old] {
        let name = f.file_name().unwrap().to_str().unwrap();
        assert!(e.contains(name) && e.contains("stale temporary file"), "{e}");
        assert!(f.exists(), "moeconf does not remove what it did not create");
    }
    // Nothing to report when there is nothing stale.
    std::fs::remove_file(&stale).unwrap();
    std::fs::remove_file(&old).unwrap();
    let o = moeconf(&run_args(&out, "2", &[]));
    assert!(!err(&o).contains("stale"), "{}", err(&o));
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn outputs_get_the_mode_that_the_umask_gives() {
    let dir = tempfile::tempdir().unwrap();
    let d = dump(dir.path());
    for (umask, want) in [("022", 0o644), ("002", 0o664), ("077", 0o600)] {
        let sub = dir.path().join(format!("u{umask}"));
        std::fs::create_dir(&sub).unwrap();
        let script = format!(
            "umask {umask} && \"$M\" run --prompt 'why the sheep' --max-new-tokens 2 -o t.bin \
             && \"$M\" gate t.bin t.bin --junit j.xml --output r.txt >/dev/null \
             && \"$M\" gate --bless --baseline b.json t.bin >/dev/null \
             && \"$M\" sweep --prompt 'why the sheep' --max-new-tokens 2 --scheme b --limit 2 -q -o s.json >/dev/null \
             && \"$M\" import {} -o i.bin \
             && \"$M\" calibrate --quick --only 1 -q --out cal >/dev/null",
            s(&d)
        );
        let o = sh(&sub, &script);
        assert!(o.status.success(), "umask {umask}: {}", err(&o));
        for f in [
            "t.bin",
            "j.xml",
            "r.txt",
            "b.json",
            "s.json",
            "i.bin",
            "cal/calibration.json",
        ] {
            assert_eq!(mode(&sub.join(f)), want, "umask {umask}: {f}");
        }
        let tsv = std::fs::read_dir(sub.join("cal"))
            .unwrap()
            .filter_map(|e| e.ok())
            .find(|e| e.path().extension().is_some_and(|x| x == "tsv"))
            .expect("a TSV table");
        assert_eq!(mode(&tsv.path()), want, "umask {umask}: {:?}", tsv.path());
    }
}

#[test]
fn demo_checks_its_two_traces_before_running() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("demo");
    std::fs::create_dir(&out).unwrap();
    let target = dir.path().join("precious");
    std::fs::write(&target, "keep").unwrap();
    std::os::unix::fs::symlink(&target, out.join("cand.bin")).unwrap();
    let o = moeconf(&["demo", "--out-dir", s(&out)]);
    refused(&o, &["cand.bin", "symbolic link"]);
    assert!(
        !out.join("ref.bin").exists(),
        "the reference run started before the check"
    );
    assert_eq!(read(&target), b"keep");
}

#[test]
fn a_killed_write_leaves_a_recognisable_temporary_file_that_the_next_run_reports() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.bin");
    let (mut child, tmp) = start_writing(&out);
    let pid = child.id();
    let prefix = format!(".out.bin.moeconf-tmp.{pid}.");
    child.kill().unwrap(); // SIGKILL: nothing can run
    child.wait().unwrap();
    let rand = tmp.strip_prefix(&prefix).unwrap();
    assert!(
        rand.len() == 16 && rand.bytes().all(|b| b.is_ascii_hexdigit()),
        "{tmp}"
    );
    assert!(!out.exists());
    let o = moeconf(&run_args(&out, "2", &[]));
    assert!(o.status.success(), "{}", err(&o));
    assert!(
        err(&o).contains(&tmp) && err(&o).contains(&format!("left by process {pid}")),
        "{}",
        err(&o)
    );
}

/// Starts a long `run` writing `out` (a file name in a directory of its
/// own) and waits until it has created its temporary file, which it names.
fn start_writing(out: &Path) -> (std::process::Child, String) {
    let mut child = Command::new(BIN)
        .args(run_args(out, "4000", &["--capture", "all"]))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (dir, name) = (out.parent().unwrap(), out.file_name().unwrap().to_string_lossy());
    let prefix = format!(".{name}.moeconf-tmp.{}.", child.id());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(n) = temporaries(dir).into_iter().find(|n| n.starts_with(&prefix)) {
            return (child, n);
        }
        assert!(std::time::Instant::now() < deadline, "no temporary file appeared");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it could be stopped"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn an_interrupted_write_removes_its_temporary_file_and_ends_by_the_signal() {
    use std::os::unix::process::ExitStatusExt;
    for (name, number) in [("INT", 2), ("TERM", 15), ("HUP", 1)] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.bin");
        let (mut child, _) = start_writing(&out);
        let k = Command::new("kill")
            .args(["-s", name, &child.id().to_string()])
            .status()
            .unwrap();
        assert!(k.success());
        let status = child.wait().unwrap();
        // Ended by the signal itself, as without the handling (a shell
        // reports 128 + the signal's number).
        assert_eq!(status.signal(), Some(number), "SIG{name}: {status:?}");
        assert!(
            temporaries(dir.path()).is_empty(),
            "SIG{name}: {:?}",
            temporaries(dir.path())
        );
        assert!(!out.exists(), "SIG{name}");
    }
}
