//! Fuzz target `lies`: the body and oracle are
//! `moeconf_testkit::targets::lies_case` (a generated version 2 trace F,
//! 1–3 drawn "well-formed lies" rewritten into it with every digest and
//! the checksum recomputed, and one command family run on F and the lie:
//! the lie gets F's answer or an error).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = moeconf_testkit::targets::lies_target(data, moeconf_testkit::seeds::fuzz_dir());
});
