//! Fuzz target `lies`: the body and oracle are
//! `moeconf_testkit::targets::lies_target`: an odd first byte runs the paged
//! case (`lies_paged_case`: a format version 4 trace F whose step-0 groups
//! are stored as pages, built once per process, lies of every class and
//! page lies rewritten into it), anything else the small case (`lies_case`:
//! a generated version 2 or 3 trace F); 1–3 drawn "well-formed lies"
//! rewritten into F with every digest and the checksum recomputed, and one
//! command case run on F and the lie: the lie gets F's answer or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = moeconf_testkit::targets::lies_target(data, moeconf_testkit::seeds::fuzz_dir());
});
