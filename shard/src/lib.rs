//! Sweeps that outgrow one machine (docs/scale.md): every sweep-like
//! command (`moeconf sweep`, `moeconf calibrate`) is a list of independent
//! jobs; `--shard i/n` runs the jobs of shard `i` ([`Shard`]) and writes a
//! self-describing, integrity-checked partial result file ([`partial`]);
//! `moeconf merge` opens every shard's partial and checks that they are
//! exactly the shards of one run ([`Merged`]) before the command rebuilds
//! its outputs from the job results, byte-identical to the unsharded run.
//!
//! The crate knows nothing about what a job computes: commands give it
//! their run identity, job results (JSON) and attached files, and get them
//! back in job order. It also holds the progress display of long commands
//! ([`progress`]).
#![forbid(unsafe_code)]

mod error;
pub mod jobs;
pub mod merge;
pub mod partial;
pub mod progress;
mod spec;

pub use error::{Result, ShardError};
pub use merge::{Merged, MergedFile};
pub use partial::{
    write_partial, Attachment, FileEntry, JobGroup, JobResult, Manifest, Partial, RunIdentity,
};
pub use progress::{Progress, ProgressMode};
pub use spec::{Shard, MAX_SHARDS};

/// The moeconf version recorded in every partial (merging partials of different versions is refused).
pub const MOECONF_VERSION: &str = env!("CARGO_PKG_VERSION");
