//! Fuzz target: any bytes given to the trace reader must be rejected with an
//! error or accepted and fully verifiable, never panic or over-allocate.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    moeconf_schema::fuzz_read(data);
});
