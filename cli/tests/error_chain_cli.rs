//! Errors say each thing once. An error whose text repeats its source's
//! prints as "X: Y: X: Y" through anyhow's `{:#}` chain (the way `moeconf`
//! prints every error); file-level errors name the file once and keep the
//! operating system's reason as their source.

use moeconf_schema::Trace;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

/// `msg` split at ": " has no segment that occurs twice.
fn assert_says_everything_once(msg: &str) {
    let parts: Vec<&str> = msg.trim_end().split(": ").collect();
    for (i, p) in parts.iter().enumerate() {
        assert!(!parts[i + 1..].contains(p), "segment {p:?} repeats in {msg:?}");
    }
}

#[test]
fn an_io_error_through_anyhow_names_file_action_and_reason_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.bin");
    let e = Trace::open(&missing).err().expect("missing file");
    let msg = format!("{:#}", anyhow::Error::from(e));
    assert_says_everything_once(&msg);
    assert_eq!(msg.matches("missing.bin").count(), 1, "{msg}");
    assert_eq!(msg.matches("(os error 2)").count(), 1, "{msg}");
    assert!(msg.contains("opening trace"), "{msg}");
}

#[test]
fn commands_report_a_missing_trace_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.bin");
    let m = missing.to_str().unwrap();
    for args in [
        vec!["inspect", m],
        vec!["certify", m],
        vec!["diff", m, m],
        vec!["gate", m, m],
        vec!["gate", "--bisect-exit-codes", m, m],
    ] {
        let o = Command::new(BIN)
            .args(&args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert_ne!(o.status.code(), Some(0), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        let line = err
            .lines()
            .find(|l| l.starts_with("moeconf: "))
            .expect("an error line");
        assert_says_everything_once(line);
        assert_eq!(line.matches("missing.bin").count(), 1, "{args:?}: {line}");
        assert_eq!(line.matches("(os error 2)").count(), 1, "{args:?}: {line}");
    }
}
