//! Progress of long commands on stderr. A bar ([`indicatif`]) only when
//! both stderr and stdout are terminals; otherwise (output redirected,
//! logs of a batch job) one plain line per tenth of the work; nothing with
//! `--quiet`. Progress never writes to stdout and never changes a result:
//! it only counts finished jobs.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// A bar redrawn in place on stderr.
    Bar,
    /// A line on stderr at each tenth of the work.
    Lines,
    Off,
}

impl ProgressMode {
    /// `Off` when `quiet`, `Bar` when stderr and stdout are terminals, else `Lines`.
    pub fn detect(quiet: bool) -> ProgressMode {
        if quiet {
            ProgressMode::Off
        } else if std::io::stderr().is_terminal() && std::io::stdout().is_terminal() {
            ProgressMode::Bar
        } else {
            ProgressMode::Lines
        }
    }

    pub fn enabled(self) -> bool {
        self != ProgressMode::Off
    }
}

/// A counter of finished jobs, callable from worker threads.
pub struct Progress {
    mode: ProgressMode,
    bar: Option<ProgressBar>,
    prefix: String,
    unit: String,
    total: usize,
    done: AtomicUsize,
    shown: AtomicUsize,
}

impl Progress {
    /// Progress of `total` jobs, labelled `prefix` (e.g. `sweep`) and counted in `unit` (e.g. `branches`).
    pub fn new(mode: ProgressMode, prefix: &str, unit: &str, total: usize) -> Progress {
        let bar = (mode == ProgressMode::Bar).then(|| {
            let style =
                ProgressStyle::with_template("{prefix} [{bar:32}] {pos}/{len} {msg} ({elapsed}, eta {eta})")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> ");
            let b = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
            b.set_style(style);
            b.set_prefix(prefix.to_string());
            b.set_message(unit.to_string());
            b
        });
        Progress {
            mode,
            bar,
            prefix: prefix.into(),
            unit: unit.into(),
            total,
            done: AtomicUsize::new(0),
            shown: AtomicUsize::new(0),
        }
    }

    /// Counts one finished job.
    pub fn inc(&self) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        match self.mode {
            ProgressMode::Off => {}
            ProgressMode::Bar => {
                if let Some(b) = &self.bar {
                    b.inc(1);
                }
            }
            ProgressMode::Lines => {
                let step = self.total.div_ceil(10).max(1);
                if (done == self.total || done.is_multiple_of(step))
                    && self.shown.fetch_max(done, Ordering::Relaxed) < done
                {
                    eprintln!("{}: {done}/{} {}", self.prefix, self.total, self.unit);
                }
            }
        }
    }

    /// Jobs counted so far.
    pub fn done(&self) -> usize {
        self.done.load(Ordering::Relaxed)
    }

    /// Removes the bar (lines and counts stay).
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_in_every_mode() {
        for mode in [ProgressMode::Off, ProgressMode::Lines, ProgressMode::Bar] {
            let p = Progress::new(mode, "test", "jobs", 25);
            for _ in 0..25 {
                p.inc();
            }
            assert_eq!(p.done(), 25);
            p.finish();
        }
        assert!(!ProgressMode::detect(true).enabled());
    }
}
