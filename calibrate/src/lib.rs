//! The calibration suite (`moeconf calibrate`): the paper's experiments
//! (section 2.4) reproduced on the reference runtime, plus the bisector's own
//! fault-injection localization matrix. Each protocol lives in its own
//! module and returns a [`Section`]: tables in the paper's layout, a JSON
//! object, and the structural [`Claim`]s that must hold on any model;
//! [`suite`] runs the selected protocols and assembles `calibration.json`.
//!
//! The crate also holds the report of `moeconf sweep` ([`sweep`]), the
//! trace-freeze-fork protocol run on any prompt and scheme.
//!
//! Every count is computed from runs; nothing is typed in. Runs are
//! independent and use rayon only over whole runs, so the results do not
//! depend on the thread count.
#![forbid(unsafe_code)]

pub mod breadth;
mod collect;
mod ctx;
mod error;
pub mod fault_matrix;
pub mod fork_sweep;
pub mod jobs;
pub mod long_fork;
pub mod persistent;
pub mod propagation;
pub mod replay;
mod report;
pub mod substitution;
pub mod suite;
pub mod sweep;

pub use collect::{bitwise_eq, compare_records, max_abs_diff, Collect, Kept, Tally};
pub use ctx::{inputs_json, Ctx, CtxOptions, Sizes, TraceRequest, ALGORITHM};
pub use error::{CalibrateError, Result};
pub use report::{frac, write_atomic, Claim, Section, Table};
