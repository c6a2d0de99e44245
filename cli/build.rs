//! Links the `moeconf` binary as a position-dependent executable.
//!
//! A position-independent `moeconf` carries ~30,000 dynamic relocations
//! (every vtable, string table and static slice of the dependencies): the
//! dynamic loader writes ~300 pages before `main` runs, about 1 ms of the
//! 1.5 ms that `moeconf --version` takes, and most of what a
//! `moeconf diff` of two 10^7-record traces costs beyond its own work
//! (docs/performance.md, "Scale"). Linked without PIE the addresses are
//! fixed at link time and those relocations are gone. Only the binaries
//! of this package are affected (`rustc-link-arg-bins`): libraries, tests,
//! proc-macros and build scripts are linked as before.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    // The GNU toolchain's linker driver (cc) understands -no-pie; other
    // targets keep their defaults.
    if os == "linux" && env == "gnu" {
        println!("cargo:rustc-link-arg-bins=-no-pie");
    }
}
