//! Merging the partial results of every shard of one run: the checks that
//! make a merge refuse anything but exactly one verified partial per shard
//! of one run, and the run's job results in job order.

use std::io::Write;
use std::ops::Range;
use std::path::Path;

use serde_json::Value;

use crate::error::{Result, ShardError};
use crate::partial::{Partial, RunIdentity};

/// The verified partials of every shard of one run.
#[derive(Debug)]
pub struct Merged {
    partials: Vec<Partial>,
    results: Vec<Value>,
    /// (partial, file index), ordered by (job, name).
    files: Vec<(usize, usize)>,
}

/// One attached file of a merged run.
#[derive(Debug, Clone, Copy)]
pub struct MergedFile<'a> {
    /// Its path relative to the output directory.
    pub name: &'a str,
    /// The job that produced it.
    pub job: usize,
    /// Its length.
    pub bytes: u64,
    partial: usize,
    index: usize,
}

impl Merged {
    /// Checks `partials` (opened and verified with [`Partial::open`]): all of
    /// one run (same command, arguments, inputs, moeconf version, job list
    /// and shard count), every shard exactly once, no file attached twice.
    pub fn new(partials: Vec<Partial>) -> Result<Merged> {
        let first = partials.first().ok_or(ShardError::NoPartials)?;
        let count = first.shard().count();
        for p in &partials[1..] {
            if let Some(what) = run_difference(first, p) {
                return Err(ShardError::DifferentRuns {
                    a: first.path().to_path_buf(),
                    b: p.path().to_path_buf(),
                    what,
                });
            }
        }
        let mut by_index: Vec<Option<usize>> = vec![None; count as usize];
        for (i, p) in partials.iter().enumerate() {
            let slot = &mut by_index[p.shard().index() as usize];
            if let Some(prev) = *slot {
                return Err(ShardError::DuplicateShard {
                    shard: p.shard().to_string(),
                    a: partials[prev].path().to_path_buf(),
                    b: p.path().to_path_buf(),
                });
            }
            *slot = Some(i);
        }
        let missing: Vec<u32> = (0..count).filter(|&i| by_index[i as usize].is_none()).collect();
        if !missing.is_empty() {
            let mut list = missing
                .iter()
                .take(20)
                .map(|i| format!("{i}/{count}"))
                .collect::<Vec<_>>()
                .join(", ");
            if missing.len() > 20 {
                list.push_str(&format!(", ... ({} in all)", missing.len()));
            }
            return Err(ShardError::MissingShards {
                missing: list,
                several: missing.len() > 1,
                count,
            });
        }
        let total = first.run().total_jobs();
        let mut results: Vec<Option<Value>> = vec![None; total];
        let mut files = Vec::new();
        for (pi, p) in partials.iter().enumerate() {
            for r in &p.manifest().results {
                results[r.job] = Some(r.result.clone());
            }
            files.extend((0..p.manifest().files.len()).map(|fi| (pi, fi)));
        }
        let entry = |&(p, f): &(usize, usize)| &partials[p].manifest().files[f];
        files.sort_by(|a, b| {
            let (x, y) = (entry(a), entry(b));
            (x.job, &x.name).cmp(&(y.job, &y.name))
        });
        for w in files.windows(2) {
            if entry(&w[0]).name == entry(&w[1]).name {
                return Err(ShardError::DuplicateFile {
                    name: entry(&w[0]).name.clone(),
                    a: partials[w[0].0].path().to_path_buf(),
                    b: partials[w[1].0].path().to_path_buf(),
                });
            }
        }
        // Every partial holds exactly its shard's jobs (checked when opened)
        // and every shard is present, so every job has its result.
        let results = results
            .into_iter()
            .enumerate()
            .map(|(j, r)| {
                r.ok_or_else(|| ShardError::Invalid {
                    path: first.path().to_path_buf(),
                    detail: format!("no shard holds job {j}"),
                })
            })
            .collect::<Result<Vec<Value>>>()?;
        Ok(Merged {
            partials,
            results,
            files,
        })
    }

    /// Opens every path and merges.
    pub fn open(paths: &[&Path]) -> Result<Merged> {
        Merged::new(paths.iter().map(|p| Partial::open(p)).collect::<Result<_>>()?)
    }

    pub fn run(&self) -> &RunIdentity {
        self.partials[0].run()
    }

    pub fn shard_count(&self) -> u32 {
        self.partials[0].shard().count()
    }

    /// The partial files, in the order given.
    pub fn partials(&self) -> &[Partial] {
        &self.partials
    }

    /// Every job's result, in job order.
    pub fn results(&self) -> &[Value] {
        &self.results
    }

    /// The results of job group `name` (empty if the run has no such group).
    pub fn group(&self, name: &str) -> &[Value] {
        let r: Range<usize> = self.run().group_range(name).unwrap_or(0..0);
        &self.results[r]
    }

    /// Every attached file, ordered by job and name.
    pub fn files(&self) -> Vec<MergedFile<'_>> {
        self.files
            .iter()
            .map(|&(p, f)| {
                let e = &self.partials[p].manifest().files[f];
                MergedFile {
                    name: &e.name,
                    job: e.job,
                    bytes: e.bytes,
                    partial: p,
                    index: f,
                }
            })
            .collect()
    }

    /// Copies an attached file's bytes to `w`, verifying its digest.
    pub fn copy_file(&self, f: &MergedFile<'_>, w: &mut dyn Write) -> Result<()> {
        self.partials[f.partial].copy_file(f.index, w)
    }
}

/// The first field in which the runs of two partials differ, with both values.
fn run_difference(a: &Partial, b: &Partial) -> Option<String> {
    let (x, y) = (a.run(), b.run());
    if x.command != y.command {
        return Some(format!("command {:?} vs {:?}", x.command, y.command));
    }
    if x.moeconf_version != y.moeconf_version {
        return Some(format!(
            "moeconf version {} vs {}",
            x.moeconf_version, y.moeconf_version
        ));
    }
    if a.shard().count() != b.shard().count() {
        return Some(format!(
            "shard {} vs shard {} (cut into {} vs {} shards)",
            a.shard(),
            b.shard(),
            a.shard().count(),
            b.shard().count()
        ));
    }
    if let Some(d) = value_difference("arguments", &x.arguments, &y.arguments) {
        return Some(d);
    }
    if let Some(d) = value_difference("inputs", &x.inputs, &y.inputs) {
        return Some(d);
    }
    if x.jobs != y.jobs {
        let show = |r: &RunIdentity| {
            r.jobs
                .iter()
                .map(|g| format!("{} {}", g.name, g.jobs))
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Some(format!("job lists [{}] vs [{}]", show(x), show(y)));
    }
    None
}

/// A value for messages, cut to 80 characters.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() <= 80 {
        return s;
    }
    let cut: String = s.chars().take(77).collect();
    format!("{cut}...")
}

/// The path of the first difference between two JSON values, with both sides.
pub fn value_difference(path: &str, a: &Value, b: &Value) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) => {
                        if let Some(d) = value_difference(&format!("{path}.{k}"), v, w) {
                            return Some(d);
                        }
                    }
                    None => return Some(format!("{path}.{k}: {} vs (absent)", short(v))),
                }
            }
            y.iter()
                .find(|(k, _)| !x.contains_key(*k))
                .map(|(k, w)| format!("{path}.{k}: (absent) vs {}", short(w)))
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (v, w))| value_difference(&format!("{path}[{i}]"), v, w)),
        _ if a == b => None,
        _ => Some(format!("{path}: {} vs {}", short(a), short(b))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn value_difference_names_the_first_differing_path() {
        let a = json!({"model": "m", "sizes": {"seeds": 6, "tokens": [1, 2]}});
        assert_eq!(value_difference("arguments", &a, &a), None);
        let b = json!({"model": "m", "sizes": {"seeds": 7, "tokens": [1, 2]}});
        assert_eq!(
            value_difference("arguments", &a, &b).unwrap(),
            "arguments.sizes.seeds: 6 vs 7"
        );
        let c = json!({"model": "m", "sizes": {"seeds": 6, "tokens": [1, 3]}});
        assert_eq!(
            value_difference("arguments", &a, &c).unwrap(),
            "arguments.sizes.tokens[1]: 2 vs 3"
        );
        let d = json!({"model": "m"});
        assert!(value_difference("a", &a, &d).unwrap().contains("(absent)"));
        assert!(value_difference("a", &d, &a).unwrap().contains("(absent)"));
    }
}
