//! Links the `moeconf` binary for a short start-up: position-dependent, and
//! with GCC's unwinder linked in instead of loaded from `libgcc_s.so.1`.
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

fn main() {
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
