//! Shared helpers for the workspace-level integration tests in `tests/`.

use std::path::{Path, PathBuf};

/// The `moeconf` binary the tests run: `$MOECONF_BIN`, else the one built
/// beside the test executable (`target/PROFILE/deps/NAME-HASH` →
/// `target/PROFILE/moeconf`). Panics with the build command when missing.
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("MOECONF_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("moeconf"))
        .expect("target directory");
    assert!(
        bin.is_file(),
        "{} not found: build it first (cargo build --release -p moeconf) or set MOECONF_BIN",
        bin.display()
    );
    bin
}
