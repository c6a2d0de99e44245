//! Multi-file outputs appear whole or not at all (docs/format.md §10,
//! "Output directories"): `calibrate --out DIR` and `merge -o DIR` write
//! into a temporary sibling directory renamed into place at the end, so a
//! run killed partway leaves no `DIR` (or the previous result, untouched),
//! Ctrl-C removes the temporary directory, and an existing directory that
//! holds anything but a previous result is refused before any work.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

fn moeconf(cwd: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("spawn moeconf")
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
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

/// The names of `dir`'s entries, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Number of traces in `dir/traces` that the result keeps (0 if there is
/// none yet). Protocol 1 (replay) writes two traces per prompt there and
/// removes them once compared, several at a time with parallel jobs: they
/// are not counted, or a count seen before a kill could shrink after it.
fn traces_in(dir: &Path) -> usize {
    std::fs::read_dir(dir.join("traces")).map_or(0, |r| {
        r.filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".bin") && !n.starts_with("replay-"))
            .count()
    })
}

/// Starts `moeconf args` in `cwd` and waits until an entry of `cwd` whose
/// name starts with `prefix` (`{pid}` replaced by the child's process id)
/// holds at least `traces` traces: the run is then partway through its
/// output. Returns the child and that entry.
fn start_until(cwd: &Path, args: &[&str], prefix: &str, traces: usize) -> (Child, PathBuf) {
    let mut child = Command::new(BIN)
        .args(args)
        .current_dir(cwd)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let prefix = prefix.replace("{pid}", &child.id().to_string());
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let found = names(cwd)
            .into_iter()
            .find(|n| n.starts_with(&prefix))
            .map(|n| cwd.join(n));
        if let Some(dir) = found.filter(|d| traces_in(d) >= traces) {
            return (child, dir);
        }
        assert!(
            Instant::now() < deadline,
            "no {prefix}* with {traces} traces appeared"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the command ended before it could be stopped"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal(child: &Child, name: &str) {
    let k = Command::new("kill")
        .args(["-s", name, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(k.success());
}

/// The quick suite runs for seconds and writes 90-odd traces; killed after
/// its first few, it has written complete traces but no result.
const QUICK: &[&str] = &["calibrate", "--quick", "-q", "--out", "cal"];

#[test]
fn a_killed_calibration_leaves_no_result_or_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Nothing there before: nothing there after kill -9, but the hidden
    // temporary directory with the complete-looking traces.
    let (mut child, tmp) = start_until(d, QUICK, ".cal.moeconf-tmp.{pid}.", 3);
    signal(&child, "KILL");
    child.wait().unwrap();
    assert!(
        !d.join("cal").exists(),
        "a killed calibration left {:?}",
        names(d)
    );
    assert!(traces_in(&tmp) >= 3, "the run was not partway through its traces");
    // The next run reports the stale temporary directory, leaves it, and
    // writes its result.
    let o = moeconf(d, &["calibrate", "--quick", "--only", "1", "-q", "--out", "cal"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let tmp_name = tmp.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        err(&o).contains("stale temporary") && err(&o).contains(&tmp_name),
        "{}",
        err(&o)
    );
    assert!(tmp.exists());
    let previous = files(&d.join("cal"));
    assert!(previous.contains_key("calibration.json") && previous.contains_key("replay.tsv"));
    std::fs::remove_dir_all(&tmp).unwrap();
    // A previous result there: killed partway, the new run leaves it as it was.
    let (mut child, _) = start_until(d, QUICK, ".cal.moeconf-tmp.{pid}.", 3);
    signal(&child, "KILL");
    child.wait().unwrap();
    assert_eq!(files(&d.join("cal")), previous, "the previous result was changed");
}

#[test]
fn ctrl_c_removes_the_temporary_directory_and_leaves_no_result() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (mut child, tmp) = start_until(d, QUICK, ".cal.moeconf-tmp.{pid}.", 3);
    signal(&child, "INT");
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(2), "{status:?}");
    assert!(!tmp.exists());
    assert!(names(d).is_empty(), "left behind: {:?}", names(d));
    // A shard's scratch directory of traces (next to its partial) too.
    let shard = [
        "calibrate",
        "--quick",
        "--only",
        "10",
        "-q",
        "--shard",
        "0/2",
        "--out",
        "p.part",
    ];
    let (mut child, scratch) = start_until(d, &shard, ".moeconf-shard.", 3);
    signal(&child, "INT");
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(2), "{status:?}");
    assert!(!scratch.exists());
    assert!(names(d).is_empty(), "left behind: {:?}", names(d));
}

#[test]
fn merge_writes_the_calibration_whole_and_refuses_a_foreign_directory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let args = ["calibrate", "--quick", "--only", "1,10", "--tokens", "4", "-q"];
    let mut parts = Vec::new();
    for i in 0..2 {
        let part = format!("p{i}.part");
        let mut a = args.to_vec();
        let shard = format!("{i}/2");
        a.extend(["--shard", &shard, "--out", &part]);
        let o = moeconf(d, &a);
        assert_eq!(o.status.code(), Some(0), "{}", err(&o));
        parts.push(part);
    }
    let merge = |out: &str| {
        let mut a = vec!["merge"];
        a.extend(parts.iter().map(String::as_str));
        a.extend(["-o", out]);
        moeconf(d, &a)
    };
    // Killed as soon as its temporary directory appears: the output is
    // absent or complete, never partial.
    let whole = merge("whole");
    assert!(matches!(whole.status.code(), Some(0 | 1)), "{}", err(&whole));
    let want = files(&d.join("whole"));
    let mut a = vec!["merge"];
    a.extend(parts.iter().map(String::as_str));
    a.extend(["-o", "cal"]);
    let mut child = Command::new(BIN)
        .args(&a)
        .current_dir(d)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let prefix = format!(".cal.moeconf-tmp.{}.", child.id());
    while child.try_wait().unwrap().is_none() {
        if names(d).iter().any(|n| n.starts_with(&prefix)) {
            signal(&child, "KILL");
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    child.wait().unwrap();
    let cal = d.join("cal");
    assert!(
        !cal.exists() || files(&cal) == want,
        "a killed merge left a partial result"
    );
    // A directory holding something else is refused before anything is
    // written, and kept as it was.
    std::fs::create_dir_all(d.join("mine/traces")).unwrap();
    std::fs::write(d.join("mine/notes.txt"), "mine").unwrap();
    let o = merge("mine");
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err(&o).contains("notes.txt") && err(&o).contains("previous result"),
        "{}",
        err(&o)
    );
    assert_eq!(files(&d.join("mine")).len(), 1);
    // A previous result is replaced as a whole: an extra table goes.
    std::fs::write(d.join("whole/extra.tsv"), "old").unwrap();
    let again = merge("whole");
    assert_eq!(again.status.code(), whole.status.code(), "{}", err(&again));
    assert_eq!(files(&d.join("whole")), want);
}
