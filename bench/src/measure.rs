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

/// A distribution-free interval holding the median of the population
/// `sorted` was drawn from with probability at least 95 %: the order
/// statistics x_(k) and x_(n+1-k) (1-based) for the largest k whose
/// binomial tail P(Bin(n, 1/2) < k) is at most 2.5 %. `None` below 6
/// samples, where no such pair exists (n = 5: 2 × 1/32 = 6.25 %), and above
/// 1,000, where the tail's terms underflow in f64 (the bench takes at most
/// 100 pairs).
pub fn median_interval95(sorted: &[f64]) -> Option<(f64, f64)> {
    let n = sorted.len();
    if !(6..=1000).contains(&n) {
        return None;
    }
    // C(n, j) / 2^n summed for j = 0, 1, ...
    let scale = 0.5f64.powi(n as i32);
    let (mut c, mut tail, mut k) = (1.0f64, 0.0f64, 0usize);
    for j in 0..n {
        tail += c * scale;
        if tail > 0.025 {
            break;
        }
        k = j + 1;
        c = c * (n - j) as f64 / (j + 1) as f64;
    }
    (k >= 1).then(|| (sorted[k - 1], sorted[n - k]))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// C(n, j) exactly.
    fn choose(n: u128, j: u128) -> u128 {
        (0..j).fold(1u128, |c, i| c * (n - i) / (i + 1))
    }

    /// The interval's order statistics against exact binomial tails: the
    /// largest k with 2^n · P(Bin(n, 1/2) < k) ≤ 2^n / 40, for every n up
    /// to 60, and none below 6 samples.
    #[test]
    fn the_median_interval_takes_the_order_statistics_of_the_exact_binomial_tail() {
        for n in 1usize..=60 {
            let sorted: Vec<f64> = (0..n).map(|i| i as f64).collect();
            let total = 1u128 << n;
            let mut k = 0usize;
            let mut tail = 0u128;
            for j in 0..n {
                tail += choose(n as u128, j as u128);
                if tail * 40 > total {
                    break;
                }
                k = j + 1;
            }
            let expected = (n >= 6 && k >= 1).then(|| ((k - 1) as f64, (n - k) as f64));
            assert_eq!(median_interval95(&sorted), expected, "n = {n}");
        }
        // Known values: 15 samples give x(4) and x(12); 6 give the extremes.
        let v: Vec<f64> = (1..=15).map(f64::from).collect();
        assert_eq!(median_interval95(&v), Some((4.0, 12.0)));
        assert_eq!(median_interval95(&v[..6]), Some((1.0, 6.0)));
        assert_eq!(median_interval95(&v[..5]), None);
        assert_eq!(median_interval95(&vec![1.0; 1001]), None);
    }
}
