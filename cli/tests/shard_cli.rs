//! `--shard I/N` and `moeconf merge` end to end (docs/scale.md): the merged
//! outputs of `sweep` (stdout in both formats, `-o` JSON, `--html`) and of
//! `calibrate` (stdout, exit code, calibration.json, TSVs, traces) are byte
//! for byte those of the unsharded run for several shard counts, including
//! more shards than jobs; progress (plain lines when redirected, a bar on a
//! terminal) changes no output byte; and every refusal exits 2 with the
//! reason and writes nothing.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

fn moeconf(cwd: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("spawn moeconf")
}

fn ok(o: &Output) -> &Output {
    assert_eq!(
        o.status.code(),
        Some(0),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn refused(o: &Output, needles: &[&str]) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "stderr: {e}");
    for n in needles {
        assert!(e.contains(n), "{n:?} not in: {e}");
    }
    assert!(
        o.stdout.is_empty(),
        "printed on a refusal: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    e
}

/// 11 jobs: the native reference and 5 branches of each of A and B.
const SWEEP: &[&str] = &[
    "sweep",
    "--prompt",
    "why the sheep",
    "--scheme",
    "a,b",
    "--limit",
    "5",
    "--max-new-tokens",
    "3",
];
const SWEEP_JOBS: u32 = 11;

fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(extra).copied().collect()
}

/// Runs the `n` shards of `args` in `dir`, writing `PREFIX-N-I.part`; returns their paths.
fn shards(dir: &Path, prefix: &str, args: &[&str], n: u32, partial_option: &str) -> Vec<String> {
    (0..n)
        .map(|i| {
            let part = format!("{prefix}-{n}-{i}.part");
            let spec = format!("{i}/{n}");
            let o = moeconf(dir, &with(args, &["--shard", &spec, partial_option, &part]));
            ok(&o);
            assert!(o.stdout.is_empty(), "a shard prints nothing on stdout");
            part
        })
        .collect()
}

#[test]
fn sharded_sweep_merges_to_the_unsharded_bytes_in_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for format in ["text", "json"] {
        let args = with(SWEEP, &["--format", format]);
        let whole = moeconf(d, &with(&args, &["-o", "whole.json", "--html", "whole.html"]));
        ok(&whole);
        let counts: &[u32] = if format == "text" {
            &[1, 2, 3, SWEEP_JOBS + 1]
        } else {
            &[2]
        };
        for &n in counts {
            let mut parts = shards(d, format, &args, n, "-o");
            parts.reverse();
            let mut merge: Vec<&str> = vec!["merge"];
            merge.extend(parts.iter().map(|p| p.as_str()));
            merge.extend(["-o", "merged.json", "--html", "merged.html"]);
            let m = moeconf(d, &merge);
            ok(&m);
            assert!(m.stdout == whole.stdout, "{format} stdout differs for n = {n}");
            for (a, b) in [("whole.json", "merged.json"), ("whole.html", "merged.html")] {
                assert!(
                    std::fs::read(d.join(a)).unwrap() == std::fs::read(d.join(b)).unwrap(),
                    "{b} differs for n = {n} ({format})"
                );
            }
            // Without -o and --html the merge prints the same report.
            let mut bare: Vec<&str> = vec!["merge"];
            bare.extend(parts.iter().map(|p| p.as_str()));
            assert!(ok(&moeconf(d, &bare)).stdout == whole.stdout);
        }
    }
    // More shards than jobs: the last shard owns no job and its partial is still needed.
    let part = format!("text-{}-{}.part", SWEEP_JOBS + 1, SWEEP_JOBS);
    let bytes = std::fs::read(d.join(&part)).unwrap();
    assert!(bytes.starts_with(b"MOECONF-PARTIAL\n"));
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("\"results\":[]"), "{part} should be empty");
}

#[test]
fn progress_changes_no_output_byte_and_draws_a_bar_only_on_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let quiet = moeconf(d, &with(SWEEP, &["-q", "-o", "quiet.json"]));
    assert!(ok(&quiet).stderr.is_empty(), "-q printed on stderr");
    let lines = moeconf(d, &with(SWEEP, &["-o", "lines.json"]));
    let err = String::from_utf8_lossy(&ok(&lines).stderr).into_owned();
    assert!(err.contains("sweep: 11/11 branches"), "{err}");
    assert!(
        !err.contains('\r') && !err.contains('\u{1b}'),
        "no redraws when redirected: {err:?}"
    );
    assert_eq!(lines.stdout, quiet.stdout);
    let q = std::fs::read(d.join("quiet.json")).unwrap();
    assert_eq!(std::fs::read(d.join("lines.json")).unwrap(), q);
    // On a pseudo-terminal (util-linux `script`) the bar is drawn on stderr; the report is the same.
    let cmd =
        format!("{BIN} sweep --prompt 'why the sheep' --scheme a,b --limit 5 --max-new-tokens 3 -o tty.json");
    let tty = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .env("TERM", "xterm")
        .current_dir(d)
        .output()
        .expect("util-linux script (a pseudo-terminal) is part of the machine");
    ok(&tty);
    assert_eq!(
        std::fs::read(d.join("tty.json")).unwrap(),
        q,
        "a bar changed the report"
    );
    let screen = String::from_utf8_lossy(&tty.stdout);
    assert!(screen.contains("moeconf sweep: 11 branches"), "{screen}");
    assert!(screen.contains("sweep ["), "no bar on a terminal: {screen:?}");
    assert!(
        !screen.contains("sweep: 11/11"),
        "plain lines on a terminal: {screen:?}"
    );
}

/// Every file under `dir` (relative path → bytes).
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn sharded_calibration_merges_to_the_unsharded_bytes_traces_included() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 1 + 1 + 1 substitution/propagation jobs and the fault matrix (2 × 47 jobs, with traces).
    let args = [
        "calibrate",
        "--quick",
        "--only",
        "6,7,8,10",
        "--tokens",
        "4",
        "-q",
    ];
    let whole = moeconf(d, &with(&args, &["--out", "cal"]));
    ok(&whole);
    let want = files(&d.join("cal"));
    assert!(want.contains_key("traces/fault-bf16-reference.bin") && want.contains_key("calibration.json"));
    for n in [1, 3] {
        let parts = shards(d, "cal", &args, n, "--out");
        let mut merge: Vec<&str> = vec!["merge"];
        merge.extend(parts.iter().map(|p| p.as_str()));
        merge.extend(["-o", "cal"]);
        std::fs::rename(d.join("cal"), d.join("whole")).unwrap();
        let m = moeconf(d, &merge);
        assert_eq!(m.status.code(), whole.status.code());
        assert!(m.stdout == whole.stdout, "stdout differs for n = {n}");
        let got = files(&d.join("cal"));
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "n = {n}"
        );
        for (k, v) in &want {
            assert!(got[k] == *v, "{k} differs for n = {n}");
        }
        std::fs::remove_dir_all(d.join("cal")).unwrap();
        std::fs::rename(d.join("whole"), d.join("cal")).unwrap();
    }
    // The shards' scratch directories are gone.
    let left: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // More shards than jobs (3 jobs, 5 shards): two shards are empty.
    let small = ["calibrate", "--quick", "--only", "6,7,8", "--tokens", "4", "-q"];
    let whole = moeconf(d, &with(&small, &["--out", "small"]));
    ok(&whole);
    let parts = shards(d, "small", &small, 5, "--out");
    let mut merge: Vec<&str> = vec!["merge"];
    merge.extend(parts.iter().map(|p| p.as_str()));
    merge.extend(["-o", "small2"]);
    let m = moeconf(d, &merge);
    ok(&m);
    let text = |o: &Output| String::from_utf8_lossy(&o.stdout).replace("small2", "small");
    assert_eq!(text(&m), text(&whole));
    assert_eq!(files(&d.join("small2")), files(&d.join("small")));
}

#[test]
fn merge_refuses_anything_but_every_shard_of_one_run_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = shards(d, "p", SWEEP, 3, "-o");
    let out = d.join("out.json");
    let merge = |parts: &[&str], extra: &[&str]| {
        let mut a: Vec<&str> = vec!["merge"];
        a.extend(parts);
        a.extend(extra);
        moeconf(d, &a)
    };
    let o = merge(&[&p[0], &p[2]], &["-o", "out.json"]);
    refused(&o, &["missing shard 1/3 of 3"]);
    let o = merge(&[&p[0], &p[1], &p[1], &p[2]], &["-o", "out.json"]);
    refused(&o, &["shard 1/3 is given twice"]);
    // Another run: different arguments, or the same arguments cut differently.
    let other = shards(d, "other", &with(SWEEP, &["--top", "3"]), 3, "-o");
    let o = merge(&[&p[0], &other[1], &p[2]], &["-o", "out.json"]);
    refused(&o, &["different runs", "arguments.top: 10 vs 3"]);
    let four = shards(d, "four", SWEEP, 4, "-o");
    let o = merge(&[&p[0], &four[1], &p[2]], &["-o", "out.json"]);
    refused(&o, &["different runs", "cut into 3 vs 4 shards"]);
    // A corrupted copy.
    let mut bytes = std::fs::read(d.join(&p[1])).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(d.join("bad.part"), &bytes).unwrap();
    let o = merge(&[&p[0], "bad.part", &p[2]], &["-o", "out.json"]);
    refused(&o, &["bad.part", "corrupted"]);
    std::fs::write(d.join("plain.json"), b"{}").unwrap();
    let o = merge(&["plain.json"], &[]);
    refused(&o, &["plain.json", "not a moeconf partial result file"]);
    assert!(!out.exists(), "a refused merge wrote its output");
    // An output that is an input (by path or hard link), a directory, a symbolic link.
    let o = merge(&[&p[0], &p[1], &p[2]], &["-o", &p[1]]);
    refused(&o, &["same file as the partial result file"]);
    std::fs::hard_link(d.join(&p[2]), d.join("link.json")).unwrap();
    let o = merge(&[&p[0], &p[1], &p[2]], &["-o", "link.json"]);
    refused(&o, &["link.json", "same file as the partial result file"]);
    let o = merge(&[&p[0], &p[1], &p[2]], &["--html", &p[0]]);
    refused(&o, &["same file as the partial result file"]);
    std::fs::create_dir(d.join("adir")).unwrap();
    let o = merge(&[&p[0], &p[1], &p[2]], &["-o", "adir"]);
    refused(&o, &["adir", "not a regular file"]);
    std::os::unix::fs::symlink("elsewhere.json", d.join("sym.json")).unwrap();
    let o = merge(&[&p[0], &p[1], &p[2]], &["-o", "sym.json"]);
    refused(&o, &["sym.json", "symbolic link"]);
    let o = merge(&[&p[0], &p[1], &p[2]], &["-o", "out.json", "--html", "out.json"]);
    refused(&o, &["more than one output"]);
    assert!(!out.exists());
    // Calibration partials: -o DIR is required, no HTML; a partial inside the output directory is refused.
    let c = shards(
        d,
        "c",
        &["calibrate", "--quick", "--only", "8", "--tokens", "4", "-q"],
        1,
        "--out",
    );
    refused(&merge(&[&c[0]], &[]), &["needs -o DIR"]);
    refused(
        &merge(&[&c[0]], &["-o", "cal", "--html", "x.html"]),
        &["no HTML report"],
    );
    std::fs::create_dir(d.join("cal")).unwrap();
    std::fs::copy(d.join(&c[0]), d.join("cal/calibration.json")).unwrap();
    refused(
        &merge(&["cal/calibration.json"], &["-o", "cal"]),
        &["calibration.json", "same file as the partial result file"],
    );
    ok(&merge(&[&c[0]], &["-o", "cal"]));
    // Shard options.
    let shard = |extra: &[&str]| moeconf(d, &with(SWEEP, extra));
    refused(&shard(&["--shard", "3/3", "-o", "x.part"]), &["0-based", "0..2"]);
    refused(&shard(&["--shard", "1/0", "-o", "x.part"]), &["shard count"]);
    refused(&shard(&["--shard", "1-3", "-o", "x.part"]), &["expected I/N"]);
    refused(&shard(&["--shard", "0/2"]), &["--shard needs -o FILE"]);
    refused(
        &shard(&["--shard", "0/2", "-o", "x.part", "--html", "x.html"]),
        &["moeconf merge"],
    );
    let o = moeconf(d, &["calibrate", "--quick", "--only", "8", "--shard", "0/2"]);
    refused(&o, &["--shard needs --out FILE"]);
    let o = moeconf(
        d,
        &[
            "calibrate",
            "--quick",
            "--only",
            "8",
            "--shard",
            "0/2",
            "--out",
            "adir",
        ],
    );
    refused(&o, &["adir", "not a regular file"]);
    assert!(!d.join("x.part").exists() && !d.join("moeconf-calibration").exists());
}
