//! `moeconf invariance`: which serving knob changes the state, and in which
//! operator (docs/invariance.md).
//!
//! "Greedy decoding gives other text at another batch size" is the commonest
//! determinism complaint against serving engines, and their own tests say
//! only *whether* (tokens and logprobs of batch 1 against batch N). This
//! crate runs one backend under a matrix of configurations — thread count,
//! batch composition, chunked prefill, or any knob a capture command takes
//! — traces each, bisects each trace against the base configuration's with
//! the diff engine, and judges each by what the policy declares: bitwise,
//! within a gate profile's tolerances, or informational. The answer names
//! the first step, layer and operator where a knob's configuration departs.
//!
//! * [`matrix`]: the matrix file, validated as a whole before anything runs.
//! * [`preset`]: built-in matrices.
//! * [`expect`]: expectations (matrix `[expect]`, policy `[invariance]`).
//! * [`command`]: the command backend's templates and process handling.
//! * [`run`]: tracing, comparing and judging every configuration.
//! * [`outcome`]: the report (JSON, text, the HTML matrix's data).
#![forbid(unsafe_code)]

pub mod command;
mod error;
pub mod expect;
pub mod matrix;
pub mod outcome;
pub mod preset;
pub mod run;

pub use error::InvarianceError;
pub use expect::{Expectation, Expectations};
pub use matrix::{Backend, Configuration, KnobValue, Matrix, ReferenceRun, RunOverrides};
pub use outcome::{CellStatus, InvarianceReport, INVARIANCE_SCHEMA_VERSION};
pub use run::{is_result_entry, run_matrix, RunOptions};
