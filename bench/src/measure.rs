//! Measuring tools the benchmarks share: the best wall-clock time of
//! repeated runs. They measure nothing of moeconf's own, so they live here
//! with the benchmarks rather than in a library crate.

use std::time::Instant;

/// The best wall-clock time of `repeat` runs of `f`, in seconds (the least
/// disturbed run on a shared machine).
pub fn best_of(repeat: u32, mut f: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..repeat {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}
