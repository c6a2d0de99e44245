//! Fuzz target `certify`: the body and oracles are
//! `moeconf_testkit::targets::certify_case` (structure-aware: the input drives
//! a generator of root-consistent traces written with the project's writer).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = moeconf_testkit::targets::certify_case(data, moeconf_testkit::seeds::fuzz_dir());
});
