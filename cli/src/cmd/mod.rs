//! One module per subcommand, each with its `Args` beside its `run` (what
//! they share is in `crate::args`; the dispatch is `main.rs`'s).

pub mod bench;
pub mod calibrate;
pub mod certify;
pub mod completions;
pub mod convert;
pub mod demo;
pub mod diff;
pub mod explain;
pub mod export;
pub mod gate;
pub mod import;
pub mod inspect;
pub mod invariance;
pub mod merge;
pub mod replay;
pub mod run;
pub mod sweep;
