//! Measuring tools the benchmarks share: the best wall-clock time of
//! repeated runs, this process's anonymous resident memory, and the
//! machine's memory read bandwidth. They measure nothing of moeconf's own,
//! so they live here with the benchmarks rather than in a library crate.

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

/// Current anonymous resident memory of this process in bytes (`RssAnon` of
/// `/proc/self/status`; Linux only, `None` elsewhere or if unreadable). Weights
/// are memory-mapped files, so they count as file-backed, not anonymous, memory:
/// this figure must not grow with the number of experts.
pub fn anon_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Peak resident memory of this process in bytes (`VmHWM` of
/// `/proc/self/status`; file-backed pages such as memory-mapped weights
/// included; Linux only, `None` elsewhere or if unreadable).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// First quartile, median and third quartile of sorted values (`None` when
/// empty): the values at a quarter, half and three quarters of the way,
/// rounded to the nearest index.
pub fn quartiles(sorted: &[f64]) -> Option<[f64; 3]> {
    let at = |q: usize| sorted[(q * (sorted.len() - 1) + 2) / 4];
    (!sorted.is_empty()).then(|| [at(1), at(2), at(3)])
}

/// Memory read bandwidth in bytes per second: the best of `repeat`
/// streaming reads of a `bytes`-byte buffer (touched once before), summed
/// in 64-bit words by `threads` threads over contiguous parts. The buffer
/// is freed before returning.
pub fn read_bandwidth(bytes: usize, threads: usize, repeat: u32) -> f64 {
    let words = (bytes / 8).max(1);
    let buf: Vec<u64> = (0..words as u64).collect();
    let threads = threads.max(1);
    let part = words.div_ceil(threads);
    let mut best = 0.0f64;
    let mut sink = 0u64;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = buf.chunks(part).map(|c| s.spawn(move || sum_words(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        let secs = t.elapsed().as_secs_f64();
        sink ^= sums.iter().fold(0, |a, b| a ^ b);
        best = best.max((words * 8) as f64 / secs.max(1e-12));
    }
    std::hint::black_box(sink);
    best
}

/// Wrapping sum of `w` in 8 independent lanes (vectorizes; bound by memory).
fn sum_words(w: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut it = w.chunks_exact(8);
    for c in &mut it {
        for j in 0..8 {
            acc[j] = acc[j].wrapping_add(c[j]);
        }
    }
    let tail = it.remainder().iter().fold(0u64, |a, b| a.wrapping_add(*b));
    acc.iter().fold(tail, |a, b| a.wrapping_add(*b))
}
