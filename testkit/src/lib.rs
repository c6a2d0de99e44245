//! Test-only generators and oracles for moeconf (never a dependency of a
//! shipped crate; `publish = false`).
//!
//! Fuzzing only the trace reader leaves the commands that give verdicts
//! untested against hostile but internally consistent input. This crate
//! generates such input with the project's own writer and drives the
//! consumers with it:
//!
//! * [`gen`]: root-consistent traces of a small made-up MoE run, drawn
//!   from an [`arbitrary::Unstructured`] byte source;
//! * [`mutate`]: candidates that differ from their reference in drawn ways,
//!   and one flipped payload bit behind valid checksums;
//! * [`policy`]: gate policies from the documented grammar (docs/ci.md §2);
//! * [`dump`]: import dumps (docs/import.md) of a generated trace;
//! * [`lies`]: "well-formed lies", version 2 traces rewritten where the
//!   root does not commit (write-order numbers, record counts, layout,
//!   trailer count, provenance) with every digest and checksum recomputed;
//! * [`paged`]: format version 4 traces with paged groups (long prompts)
//!   and candidates differing inside, across or outside their pages, for
//!   the paged case of the `lies` target;
//! * [`metamorphic`]: the oracle that a lie gets its trace's answer or an
//!   error from every command, with the fixtures and lies of
//!   `testkit/tests/lies.rs`;
//! * [`targets`]: the bodies of the cargo-fuzz targets `diff`, `gate`,
//!   `certify`, `import` and `lies` (fuzz/), with their oracles asserted
//!   inside;
//! * [`seeds`]: deterministic inputs, so that the default test suite runs
//!   every body on a few thousand of them (`testkit/tests/consumers.rs`).
#![forbid(unsafe_code)]

pub mod dump;
pub mod gen;
pub mod lies;
pub mod metamorphic;
pub mod mutate;
pub mod paged;
pub mod policy;
pub mod seeds;
pub mod targets;
