//! Executions per second of each consumer target body on seeded inputs,
//! without a fuzzer: `cargo run --release -p moeconf-testkit --example
//! throughput [N]` (the figure libFuzzer cannot exceed on this machine).
//! Oracle failures are counted, not fatal.
fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000);
    let dir = moeconf_testkit::seeds::fuzz_dir();
    for (name, body) in [
        (
            "diff",
            moeconf_testkit::targets::diff_case as fn(&[u8], &std::path::Path) -> u32,
        ),
        ("gate", moeconf_testkit::targets::gate_case),
        ("certify", moeconf_testkit::targets::certify_case),
        ("import", moeconf_testkit::targets::import_case),
        ("lies", moeconf_testkit::targets::lies_case),
    ] {
        // An oracle failure panics (what libFuzzer reports as a crash):
        // counted, not fatal, so that every target is measured.
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let mut failed = 0;
        let t = std::time::Instant::now();
        for data in moeconf_testkit::seeds::inputs(7, n) {
            failed += usize::from(std::panic::catch_unwind(|| body(&data, dir)).is_err());
        }
        let s = t.elapsed().as_secs_f64();
        std::panic::set_hook(hook);
        println!(
            "{name:8} {n} executions in {s:.2} s: {:.0} exec/s ({failed} oracle failures)",
            n as f64 / s
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}
