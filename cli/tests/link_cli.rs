//! The binary is linked as cli/build.rs says: on Linux with the GNU
//! toolchain, position-dependent (no ~30,000 dynamic relocations to apply at
//! every start) and without `libgcc_s.so.1` (its load-time `cpuid` probes).

#[test]
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn the_binary_is_position_dependent_and_needs_no_libgcc_s() {
    let bin = std::fs::read(env!("CARGO_BIN_EXE_moeconf")).expect("read the binary");
    assert_eq!(&bin[..4], b"\x7fELF");
    // e_type (little-endian u16 at offset 16): 2 is ET_EXEC, 3 (ET_DYN) a PIE.
    assert_eq!(
        u16::from_le_bytes([bin[16], bin[17]]),
        2,
        "linked as a PIE: cli/build.rs's -no-pie is missing"
    );
    // The dynamic section names libgcc_s.so.1 when the shared unwinder is linked.
    let needle = b"libgcc_s.so.1";
    assert!(
        !bin.windows(needle.len()).any(|w| w == needle),
        "the binary needs libgcc_s.so.1: cli/build.rs's static gcc_eh is missing"
    );
}
