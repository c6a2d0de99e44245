//! Arguments several commands share, defined once.

use moeconf_shard::Shard;

/// How a command made of independent jobs runs them: which shard, with how
/// many threads, with or without progress (`sweep`, `calibrate`).
#[derive(Debug, Clone, clap::Args)]
pub struct JobArgs {
    /// Run only shard I of N (0-based: 0/N .. N-1/N) of the command's independent jobs (job j
    /// belongs to shard j mod N) and write their partial result to the output (-o FILE, --out
    /// FILE); `moeconf merge` combines the partials of every shard into exactly the unsharded
    /// outputs (docs/scale.md).
    #[arg(long, value_name = "I/N")]
    pub shard: Option<Shard>,
    /// No progress on stderr (a bar when stderr and stdout are terminals, else a line per 10 %).
    #[arg(long, short = 'q')]
    pub quiet: bool,
    /// Worker threads (results never depend on it; at most 4 × the cores, at least 64 allowed).
    #[arg(long)]
    pub threads: Option<usize>,
}
