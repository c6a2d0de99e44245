//! Which jobs a shard runs: `--shard i/n` (0-based `i`), job `j` of a run
//! belongs to shard `j mod n`.
//!
//! Round-robin over the run's job list (the concatenation of every
//! protocol's jobs, in order) is deterministic, needs nothing but the job
//! count, and is balanced twice: every shard gets ⌊J/n⌋ or ⌈J/n⌉ of the J
//! jobs, and, because neighbouring jobs of one protocol go to different
//! shards, about 1/n of each protocol's jobs (jobs of one protocol cost
//! about the same; jobs of different protocols do not).

use std::fmt;
use std::str::FromStr;

use crate::error::ShardError;

/// The most shards a run may be cut into.
pub const MAX_SHARDS: u32 = 1_000_000;

/// One shard of a run: the `index`-th (0-based) of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shard {
    index: u32,
    count: u32,
}

impl Shard {
    /// The whole run, unsharded (`0/1`).
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    /// Shard `index` (0-based) of `count`; refused unless `index < count`
    /// and `1 <= count <= MAX_SHARDS`.
    pub fn new(index: u32, count: u32) -> Result<Shard, ShardError> {
        if count == 0 || count > MAX_SHARDS {
            return Err(ShardError::Spec(format!(
                "{index}/{count}: the shard count must be 1..{MAX_SHARDS}"
            )));
        }
        if index >= count {
            return Err(ShardError::Spec(format!(
                "{index}/{count}: shard indices are 0-based, 0..{} for {count} shards (a 1-based \
                 index such as Slurm's --array=1-{count} needs $((SLURM_ARRAY_TASK_ID - 1)))",
                count - 1
            )));
        }
        Ok(Shard { index, count })
    }

    /// The 0-based index.
    pub fn index(self) -> u32 {
        self.index
    }

    pub fn count(self) -> u32 {
        self.count
    }

    /// Whether this is the whole run (`0/1`).
    pub fn is_whole(self) -> bool {
        self.count == 1
    }

    /// Whether job `job` (its index in the run's job list) belongs to this shard.
    pub fn owns(self, job: usize) -> bool {
        job % self.count as usize == self.index as usize
    }

    /// The jobs of this shard among `total`, ascending.
    pub fn jobs(self, total: usize) -> impl Iterator<Item = usize> {
        (self.index as usize..total).step_by(self.count as usize)
    }

    /// How many of `total` jobs this shard runs.
    pub fn job_count(self, total: usize) -> usize {
        total
            .saturating_sub(self.index as usize)
            .div_ceil(self.count as usize)
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl FromStr for Shard {
    type Err = ShardError;

    /// Parses `i/n` (decimal, 0-based `i`).
    fn from_str(s: &str) -> Result<Shard, ShardError> {
        let bad = || {
            ShardError::Spec(format!(
                "{s:?}: expected I/N with 0 <= I < N, e.g. 0/4 for the first of 4 shards"
            ))
        };
        let (i, n) = s.trim().split_once('/').ok_or_else(bad)?;
        let num = |x: &str| -> Result<u32, ShardError> {
            let x = x.trim();
            if x.is_empty() || !x.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            x.parse::<u32>().map_err(|_| bad())
        };
        Shard::new(num(i)?, num(n)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        assert_eq!("2/5".parse::<Shard>().unwrap(), Shard::new(2, 5).unwrap());
        assert_eq!(" 0/1 ".parse::<Shard>().unwrap(), Shard::WHOLE);
        for bad in [
            "",
            "1",
            "1/",
            "/2",
            "a/2",
            "-1/2",
            "+1/2",
            "1/2/3",
            "1.0/2",
            "99999999999/1",
        ] {
            assert!(bad.parse::<Shard>().is_err(), "{bad:?}");
        }
        let e = "4/4".parse::<Shard>().unwrap_err().to_string();
        assert!(e.contains("0-based") && e.contains("0..3"), "{e}");
        assert!("0/0".parse::<Shard>().is_err());
        assert!(format!("0/{}", MAX_SHARDS + 1).parse::<Shard>().is_err());
        assert_eq!(Shard::new(3, 7).unwrap().to_string(), "3/7");
    }

    #[test]
    fn shards_partition_the_jobs_and_are_balanced() {
        for total in [0usize, 1, 2, 5, 17, 100] {
            for n in 1..=12u32 {
                let mut seen = vec![0u32; total];
                let mut sizes = Vec::new();
                for i in 0..n {
                    let s = Shard::new(i, n).unwrap();
                    let jobs: Vec<usize> = s.jobs(total).collect();
                    assert_eq!(jobs.len(), s.job_count(total));
                    assert!(jobs.windows(2).all(|w| w[0] < w[1]));
                    for &j in &jobs {
                        assert!(s.owns(j));
                        seen[j] += 1;
                    }
                    sizes.push(jobs.len());
                }
                assert!(seen.iter().all(|&c| c == 1), "total {total} n {n}");
                let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                assert!(hi - lo <= 1, "total {total} n {n}: {sizes:?}");
            }
        }
    }
}
