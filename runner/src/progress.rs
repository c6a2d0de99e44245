//! Progress of a long run on the terminal: the prefill's layer and
//! position (a chunked prefill: its chunk and layer, the positions done,
//! the rate and the time left), then the decode step and its rate, on one
//! line of standard error rewritten at most twice a second. Only when standard error is a
//! terminal, so logs and pipes get the final summary alone.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use moeconf_reference_runtime::capture::Progress;

/// How often the line is rewritten.
const EVERY: Duration = Duration::from_millis(500);
/// Calls between two looks at the clock (a call comes per layer and
/// position: reading the clock each time would cost more than the report).
const CALLS_PER_LOOK: u32 = 64;

/// The progress line of one run.
pub struct TerminalProgress {
    max_new_tokens: u32,
    start: Instant,
    last: Instant,
    calls: u32,
    /// When the decode began (for its rate).
    decode_start: Option<(Instant, u32)>,
    shown: bool,
}

impl TerminalProgress {
    /// A reporter for a run of `max_new_tokens` steps, if standard error is a terminal.
    pub fn if_terminal(max_new_tokens: u32) -> Option<TerminalProgress> {
        std::io::stderr()
            .is_terminal()
            .then(|| TerminalProgress::new(max_new_tokens))
    }

    fn new(max_new_tokens: u32) -> TerminalProgress {
        let now = Instant::now();
        TerminalProgress {
            max_new_tokens,
            start: now,
            last: now,
            calls: 0,
            decode_start: None,
            shown: false,
        }
    }

    /// Notes where the forward is; rewrites the line when it is due.
    pub fn report(&mut self, p: Progress) {
        self.calls += 1;
        if self.calls < CALLS_PER_LOOK && !(p.step >= 1 && p.layer == 0) {
            return;
        }
        self.calls = 0;
        let now = Instant::now();
        if p.step >= 1 && self.decode_start.is_none() {
            self.decode_start = Some((now, p.step));
        }
        if now.duration_since(self.last) < EVERY {
            return;
        }
        self.last = now;
        let line = self.line(&p, now);
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[K{line}");
        let _ = err.flush();
        self.shown = true;
    }

    /// The progress line at `p`.
    fn line(&self, p: &Progress, now: Instant) -> String {
        let elapsed = now.duration_since(self.start).as_secs_f64();
        if p.step == 0 && p.chunk < p.positions {
            chunked_prefill_line(p, elapsed)
        } else if p.step == 0 {
            let of = (p.layer as u64 * p.positions + p.done) as f64;
            let all = (p.layers as u64 * p.positions).max(1) as f64;
            format!(
                "prefill {:.1}%: layer {}/{}, position {}/{} ({elapsed:.0} s)",
                100.0 * of / all,
                p.layer + 1,
                p.layers,
                p.done,
                p.positions
            )
        } else {
            let rate = self.decode_start.map_or(0.0, |(t, s)| {
                f64::from(p.step - s) / now.duration_since(t).as_secs_f64().max(1e-9)
            });
            format!(
                "decode: step {}/{} ({rate:.1} tokens/s, {elapsed:.0} s)",
                p.step,
                self.max_new_tokens.saturating_sub(1)
            )
        }
    }

    /// Erases the line (before the run's summary is printed).
    pub fn clear(&mut self) {
        if self.shown {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
            self.shown = false;
        }
    }
}

/// The progress line of a chunked prefill at `p`, `elapsed` seconds into
/// the run: the chunk and its layer, the positions that have left the last
/// layer, the rate in positions per second and the time left, both from the
/// work done (each chunk runs every layer before the next starts).
fn chunked_prefill_line(p: &Progress, elapsed: f64) -> String {
    let chunk = p.chunk.max(1);
    let start = p.done / chunk * chunk;
    let end = (start + chunk).min(p.positions);
    let layers = u64::from(p.layers.max(1));
    let done_work = start * layers + u64::from(p.layer) * (end - start) + (p.done - start);
    let all_work = (p.positions * layers).max(1);
    let fraction = done_work as f64 / all_work as f64;
    let rate = if elapsed > 0.0 {
        fraction * p.positions as f64 / elapsed
    } else {
        0.0
    };
    let eta = if fraction > 0.0 {
        format!("ETA {}", seconds(elapsed * (1.0 - fraction) / fraction))
    } else {
        "ETA ?".to_string()
    };
    format!(
        "prefill {:.1}%: chunk {}/{} (layer {}/{}), {}/{} positions done, {rate:.0} positions/s, {eta} ({})",
        100.0 * fraction,
        start / chunk + 1,
        p.positions.div_ceil(chunk),
        p.layer + 1,
        p.layers,
        start,
        p.positions,
        seconds(elapsed)
    )
}

/// `s` seconds as `42 s`, or `12 min 5 s` from a minute on.
fn seconds(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    if s < 60 {
        format!("{s} s")
    } else {
        format!("{} min {} s", s / 60, s % 60)
    }
}

/// A run that fails part way drops its reporter before its error is
/// printed: the line is erased then too, so the error starts a line of its own.
impl Drop for TerminalProgress {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_where_the_prefill_and_the_decode_are() {
        let mut t = TerminalProgress::new(100);
        let p = Progress {
            step: 0,
            layer: 4,
            layers: 9,
            done: 500,
            positions: 1000,
            chunk: 1000,
        };
        let now = t.start + Duration::from_secs(3);
        assert_eq!(
            t.line(&p, now),
            "prefill 50.0%: layer 5/9, position 500/1000 (3 s)"
        );
        t.decode_start = Some((t.start, 1));
        let d = Progress {
            step: 11,
            positions: 1,
            done: 0,
            ..p
        };
        assert_eq!(
            t.line(&d, t.start + Duration::from_secs(5)),
            "decode: step 11/99 (2.0 tokens/s, 5 s)"
        );
    }

    #[test]
    fn a_chunked_prefill_shows_its_chunk_positions_rate_and_time_left() {
        let t = TerminalProgress::new(8);
        // 8,192 positions in chunks of 1,024, 9 layers: chunks 1-3 done,
        // the fourth at layer 5 (of 9), its 513th position.
        let p = Progress {
            step: 0,
            layer: 4,
            layers: 9,
            done: 3 * 1024 + 512,
            positions: 8192,
            chunk: 1024,
        };
        // Work done: 3 chunks × 9 layers + 4.5 layers of the fourth = 31.5 of
        // 72 chunk-layers (43.75 %), in 7 s: 512 positions/s, 9 s left.
        assert_eq!(
            t.line(&p, t.start + Duration::from_secs(7)),
            "prefill 43.8%: chunk 4/8 (layer 5/9), 3072/8192 positions done, 512 positions/s, ETA 9 s (7 s)"
        );
        // A last chunk shorter than the others; minutes.
        let last = Progress {
            layer: 4,
            done: 8000 + 49,
            positions: 8100,
            chunk: 1000,
            ..p
        };
        assert_eq!(
            t.line(&last, t.start + Duration::from_secs(600)),
            "prefill 99.4%: chunk 9/9 (layer 5/9), 8000/8100 positions done, 13 positions/s, ETA 4 s (10 min 0 s)"
        );
        // Nothing done yet.
        let first = Progress {
            layer: 0,
            done: 0,
            ..p
        };
        assert!(t
            .line(&first, t.start)
            .contains("chunk 1/8 (layer 1/9), 0/8192 positions done, 0 positions/s, ETA ?"));
        // Unchunked (chunk = positions): the prefill line as before.
        let whole = Progress { chunk: 8192, ..p };
        assert!(t
            .line(&whole, t.start)
            .starts_with("prefill 49.3%: layer 5/9, position 3584/8192"));
    }
}
