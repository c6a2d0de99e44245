//! Long runs from the command line (issue 35): the built-in long prompt,
//! the context bound that replaced the fixed `--max-new-tokens` cap, and
//! `bench runtime --context` at a context small enough for the default
//! suite. Each asserts what would fail if the feature broke.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 test path")
}

fn moeconf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args)
        .output()
        .expect("run moeconf")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn the_built_in_long_prompt_has_the_asked_tokens_and_is_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.bin"), dir.path().join("b.bin"));
    for out in [&a, &b] {
        let o = moeconf(&[
            "run",
            "--prompt-tokens",
            "300",
            "--max-new-tokens",
            "2",
            "--capture",
            "L0",
            "-o",
            s(out),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        // At least the tokens asked for, and no more than one word's worth beyond.
        let e = stderr(&o);
        let n: usize = e
            .split("moeconf run: ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{e}"));
        assert!((300..310).contains(&n), "{e}");
    }
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    // It replaces --prompt, never joins it.
    let o = moeconf(&[
        "run",
        "--prompt-tokens",
        "300",
        "--prompt",
        "why the sheep",
        "-o",
        s(&dir.path().join("c.bin")),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(!dir.path().join("c.bin").exists());
}

#[test]
fn more_tokens_than_the_old_cap_run_and_the_context_bound_is_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.bin");
    // Beyond the old 4,096 cap: accepted by the parser (the run itself is
    // not made here: a context beyond 2^20 is refused before the model runs).
    let o = moeconf(&[
        "run",
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "1048576",
        "-o",
        s(&out),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("exceed DeepSeek-V4's context of 1048576 tokens"),
        "{e}"
    );
    assert!(!out.exists());
    // A run past 4,096 decode steps is accepted (checked without running it
    // to the end: the parser and the estimate accept 5000).
    let o = moeconf(&[
        "run",
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        "5000",
        "--fork-layer",
        "99",
        "-o",
        s(&out),
    ]);
    // Refused for the fork layer, not for the token count.
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(!e.contains("max-new-tokens"), "{e}");
    assert!(e.contains("fork"), "{e}");
}

#[test]
fn bench_runtime_context_reports_cost_bytes_per_step_and_memory() {
    let o = moeconf(&[
        "bench",
        "runtime",
        "--context",
        "40,80",
        "--decode-tokens",
        "3",
        "--repeat",
        "1",
        "--separate-runs",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["kind"], "moeconf.bench.runtime.context");
    assert_eq!(v["measure"], "process_pairs");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (r, n) in rows.iter().zip([40, 80]) {
        assert_eq!(r["context"], n);
        assert!(r["decode_cost"]["median"].as_f64().unwrap() > 0.0);
        let b = &r["bytes_per_decode_step"];
        let (min, med, max) = (
            b["min"].as_u64().unwrap(),
            b["median"].as_u64().unwrap(),
            b["max"].as_u64().unwrap(),
        );
        assert!(0 < min && min <= med && med <= max, "{b}");
        assert!(r["prefill_bytes"].as_u64().unwrap() > med);
        assert!(r["trace_bytes"].as_u64().unwrap() >= r["prefill_bytes"].as_u64().unwrap() + 3 * min);
    }
    // The longer prompt's prefill part is larger (every position's records).
    assert!(rows[1]["prefill_bytes"].as_u64() > rows[0]["prefill_bytes"].as_u64());
    // --context excludes the other modes.
    let o = moeconf(&["bench", "runtime", "--context", "40", "--real-width"]);
    assert_eq!(o.status.code(), Some(2));
}

/// By default each pair is one child process holding both runs; the report
/// says so, and counts every segment but the first. Too few decode steps
/// exit 2 before any run, naming --separate-runs; that flag needs --context.
#[test]
fn bench_runtime_context_interleaved_reports_the_pairs_segments() {
    let o = moeconf(&[
        "bench",
        "runtime",
        "--context",
        "40",
        "--decode-tokens",
        "16",
        "--repeat",
        "2",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["measure"], "interleaved");
    assert_eq!(v["segment_steps"], 8);
    let r = &v["rows"][0];
    assert_eq!(r["decode_cost"]["rounds"], 2);
    assert!(r["decode_cost"]["median"].as_f64().unwrap() > 0.0, "{r}");
    assert!(
        r["decode_tokens_per_second"]["default"].as_f64().unwrap() > 0.0,
        "{r}"
    );
    assert!(r["bytes_per_decode_step"]["median"].as_u64().unwrap() > 0, "{r}");
    assert!(r["run_cost"]["median"].as_f64().unwrap() > 0.0, "{r}");
    assert!(stderr(&o).contains("both runs in one process"), "{}", stderr(&o));
    let o = moeconf(&["bench", "runtime", "--context", "40", "--decode-tokens", "15"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("at least 16 decode steps") && e.contains("--separate-runs"),
        "{e}"
    );
    let o = moeconf(&["bench", "runtime", "--separate-runs"]);
    assert_eq!(o.status.code(), Some(2));
}

/// Each measured run of `bench runtime --context` is a child process: the
/// hidden `--context-child` mode runs one and prints it as one JSON line; a
/// captured run leaves a finished trace. Without its companions it is refused.
#[test]
fn a_context_child_run_prints_its_timings_and_finishes_its_trace() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("child.bin");
    let o = moeconf(&[
        "bench",
        "runtime",
        "--context-child",
        "40",
        "--child-capture",
        "default",
        "--child-trace",
        s(&trace),
        "--decode-tokens",
        "3",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    for k in ["prefill_seconds", "decode_seconds", "median_step_seconds"] {
        assert!(v[k].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
    let o = moeconf(&["inspect", s(&trace)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = moeconf(&["bench", "runtime", "--context-child", "40"]);
    assert_eq!(o.status.code(), Some(2));
}

/// A trace that clearly won't fit the output's free space is refused before
/// the run (exit 2, naming the estimate, the free space, the output and what
/// lowers it; nothing written); one that fits runs, and a smaller capture
/// fits where the default does not. The free space is faked with the test
/// hook `MOECONF_TEST_FREE_SPACE`. Standard error is not a terminal here: no
/// estimate line is printed.
#[test]
fn a_trace_larger_than_the_free_space_is_refused_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.bin");
    let run = |free: &str, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_moeconf"))
            .env("MOECONF_TEST_FREE_SPACE", free)
            .args(["run", "--prompt", "why the sheep", "-o", s(&out)])
            .args(args)
            .output()
            .expect("run moeconf")
    };
    // About 27 MB at the default capture (docs/performance.md), 4 MB free.
    let o = run("4000000", &["--max-new-tokens", "200"]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    for part in [
        "would need an estimated",
        "MiB",
        "3.8 MiB free",
        s(&out),
        "--capture",
        "--max-new-tokens",
    ] {
        assert!(e.contains(part), "{part}: {e}");
    }
    assert!(!e.contains("generated in"), "refused before the run: {e}");
    assert!(!out.exists());
    // Tokens only: about 100 KB, fits.
    let o = run("4000000", &["--max-new-tokens", "200", "--capture", "L0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.exists());
    // Within the estimate's error of the free space: not refused.
    std::fs::remove_file(&out).unwrap();
    let o = run("25000000", &["--max-new-tokens", "200"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(!e.contains("estimated"), "no estimate line off a terminal: {e}");
    assert_eq!(e.lines().count(), 2, "the summary alone: {e}");
}

/// A chunked prefill on a terminal (a pseudo-terminal from util-linux
/// `script`) shows its chunk, the positions done, the rate and the time
/// left, after a line with the memory and trace estimates; off a terminal
/// standard error holds the run's summary alone, and the trace is the same
/// bytes either way.
#[test]
fn a_chunked_prefill_shows_its_progress_on_a_terminal_only() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, tty) = (dir.path().join("plain.bin"), dir.path().join("tty.bin"));
    let args = "run --prompt-tokens 4000 --prefill-chunk 500 --capture L0 --max-new-tokens 2";
    let o = Command::new(env!("CARGO_BIN_EXE_moeconf"))
        .args(args.split(' '))
        .args(["-o", s(&plain)])
        .output()
        .expect("run moeconf");
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert_eq!(e.lines().count(), 2, "the summary alone: {e}");
    assert!(
        !e.contains('\r') && !e.contains('\u{1b}'),
        "no redraws when redirected: {e:?}"
    );
    let cmd = format!("{} {args} -o {}", env!("CARGO_BIN_EXE_moeconf"), s(&tty));
    let o = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .env("TERM", "xterm")
        .output()
        .expect("util-linux script (a pseudo-terminal) is part of the machine");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let screen = String::from_utf8_lossy(&o.stdout);
    for part in [
        "moeconf run: estimated memory",
        ", trace ",
        "free)",
        "prefill ",
        ": chunk ",
        " (layer ",
        "positions done, ",
        " positions/s, ETA ",
    ] {
        assert!(screen.contains(part), "{part}: {screen:?}");
    }
    assert_eq!(std::fs::read(&plain).unwrap(), std::fs::read(&tty).unwrap());
}
