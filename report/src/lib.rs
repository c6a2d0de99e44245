//! Self-contained HTML reports for `moeconf diff`, `gate`, `sweep`, `replay`
//! and `invariance`.
//!
//! The text report is precise; the first question a kernel engineer asks —
//! *where* in layers × steps two executions part and how the difference
//! spreads — is a picture. This crate draws it as one HTML file with inline
//! CSS and hand-written SVG: no scripts, no fonts, no external URL, so it
//! works offline and as a CI artifact.
//!
//! Why hand-written SVG rather than a plotting crate: the charts are
//! heatmaps, bar charts and line charts over at most a few hundred cells
//! ([`MAX_COLUMNS`] × [`MAX_ROWS`] after aggregation), which a ~100-line
//! SVG module draws; it adds no dependency (a plotting crate with an SVG
//! backend brings tens of crates and font handling), and every number is
//! formatted by this crate with a fixed precision, so the same traces give a
//! byte-identical report on every machine. Colours come from a sequential
//! palette readable under the common colour-vision deficiencies (see
//! [`scale`]), and every cell also carries its numbers in a `<title>`
//! tooltip and in tables, so nothing is conveyed by colour alone.
#![forbid(unsafe_code)]

mod charts;
mod diff_page;
mod error;
mod grid;
mod invariance_page;
mod maps;
mod page;
mod replay_page;
pub mod scale;
mod svg;
mod sweep_page;

pub use diff_page::{render_diff, render_gate_only, GateSummary};
pub use error::ReportError;
pub use grid::{Cell, Grid, MAX_COLUMNS, MAX_ROWS};
pub use invariance_page::{render_invariance, InvarianceRow, InvarianceView};
pub use maps::{DiffMaps, Histogram, MarginSeries};
pub use replay_page::{render_replay, OriginCell, OriginKind, ReplayView};
pub use sweep_page::{render_sweep, SweepBranch, SweepView};
