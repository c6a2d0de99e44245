//! Running the jobs a shard owns.

use std::ops::Range;

use rayon::prelude::*;

use crate::progress::Progress;
use crate::spec::Shard;

/// The jobs of `range` (indices in the run's job list) that `shard` owns,
/// as indices local to the range.
pub fn owned(shard: Shard, range: Range<usize>) -> Vec<usize> {
    let start = range.start;
    range.filter(|&j| shard.owns(j)).map(|j| j - start).collect()
}

/// Runs `run(local)` for every `local` index of `jobs` in parallel (rayon,
/// one task per job), counting each on `progress`; results come back in the
/// order of `jobs` whatever the thread count. The first error is returned.
pub fn run_jobs<T, E, F>(jobs: &[usize], progress: &Progress, run: F) -> Result<Vec<T>, E>
where
    T: Send,
    E: Send,
    F: Fn(usize) -> Result<T, E> + Sync,
{
    jobs.par_iter()
        .map(|&j| {
            let r = run(j);
            progress.inc();
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::ProgressMode;

    #[test]
    fn owned_is_local_and_results_keep_order() {
        let s = Shard::new(1, 3).unwrap();
        assert_eq!(owned(s, 10..20), vec![0, 3, 6, 9]); // jobs 10, 13, 16, 19
        let p = Progress::new(ProgressMode::Off, "t", "jobs", 4);
        let r: Result<Vec<usize>, ()> = run_jobs(&[5, 1, 9, 2], &p, |j| Ok(j * 10));
        assert_eq!(r.unwrap(), vec![50, 10, 90, 20]);
        assert_eq!(p.done(), 4);
    }
}
