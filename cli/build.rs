//! Records the commit the binary is built from, for `moeconf --version`.
//!
//! `MOECONF_BUILD_COMMIT` in the environment wins (a build from a source
//! archive, where there is no repository); otherwise `git rev-parse HEAD` of
//! the checkout being built; otherwise `unknown`. Like ripgrep's, the commit
//! does not say whether the work tree had local changes. Cargo re-runs this
//! script when HEAD moves (the files `HEAD`, the branch it names and
//! `packed-refs`), not on every source change.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=MOECONF_BUILD_COMMIT");
    let commit = std::env::var("MOECONF_BUILD_COMMIT")
        .ok()
        .filter(|c| is_commit(c))
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=MOECONF_BUILD_COMMIT={commit}");
}

/// A commit name worth printing: 7 to 64 hexadecimal digits.
fn is_commit(s: &str) -> bool {
    (7..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `git rev-parse HEAD`, and the files whose change moves it.
fn git_commit() -> Option<String> {
    let commit = git(&["rev-parse", "HEAD"])?;
    for name in ["HEAD", "packed-refs"] {
        rerun_if_changed(name);
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        rerun_if_changed(&branch);
    }
    is_commit(&commit).then_some(commit)
}

/// Tells cargo to re-run when the repository file `name` (resolved with
/// `git rev-parse --git-path`, which knows worktrees) changes.
fn rerun_if_changed(name: &str) {
    if let Some(path) = git(&["rev-parse", "--git-path", name]) {
        let path = PathBuf::from(path);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

/// The trimmed standard output of a successful `git ARGS`.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}
