//! Two things for the `moeconf` binary: the commit it is built from, for
//! `moeconf --version` (below), and a link for a short start-up:
//! position-dependent, and with GCC's unwinder linked in instead of loaded
//! from `libgcc_s.so.1`.
//!
//! A position-independent `moeconf` carries ~30,000 dynamic relocations
//! (every vtable, string table and static slice of the dependencies): the
//! dynamic loader writes ~300 pages before `main` runs, about 1 ms of the
//! 1.5 ms that `moeconf --version` took, and most of what a
//! `moeconf diff` of two 10^7-record traces costs beyond its own work
//! (docs/performance.md, "Scale"). Linked without PIE the addresses are
//! fixed at link time and those relocations are gone. Only the binaries
//! of this package are affected (`rustc-link-arg-bins`): libraries,
//! proc-macros and build scripts are linked as before.
//!
//! `libgcc_s.so.1` runs `__cpu_indicator_init` when it is loaded, a series
//! of `cpuid` instructions; under a hypervisor each one traps (5 µs each on
//! the machine we measure on), about 0.1 ms of every start. The static
//! `libgcc_eh.a` provides the same unwinder (`_Unwind_*`, what Rust's panics
//! use): named here, before the standard library's `-lgcc_s`, it resolves
//! those symbols, and the linker's `--as-needed` then drops the shared
//! library. This is what GCC's own `-static-libgcc` does.
//!
//! The commit: `MOECONF_BUILD_COMMIT` in the environment wins (a build from a source
//! archive, where there is no repository); otherwise `git rev-parse HEAD` of
//! the checkout being built; otherwise `unknown`. Like ripgrep's, the commit
//! does not say whether the work tree had local changes. Cargo re-runs this
//! script when HEAD moves (the files `HEAD`, the branch it names and
//! `packed-refs`), not on every source change.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    link_for_start_up();
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

/// The start-up link described above (Linux, GNU toolchain only).
fn link_for_start_up() {
    println!("cargo:rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    // The GNU toolchain's linker driver (cc) understands -no-pie, and GCC
    // ships libgcc_eh.a beside libgcc_s; other targets keep their defaults.
    if os == "linux" && env == "gnu" {
        println!("cargo:rustc-link-arg-bins=-no-pie");
        println!("cargo:rustc-link-lib=static:-bundle=gcc_eh");
    }
}
