//! This crate provides the comparison of two moeconf traces: it walks both
//! fingerprint trees, descends only where digests differ, and localizes the
//! first divergent step, layer and operator through the L0–L4 hierarchy
//! (paper section 4.5), then names the numerical contract that explains a
//! divergent MoE combine.
//!
//! # Brief overview
//!
//! * [`diff`] compares a reference and a candidate [`Trace`](moeconf_schema::Trace)
//!   under [`DiffOptions`] and returns a [`DiffReport`], or a [`BisectError`]
//!   when the bindings are not comparable.
//! * [`DiffReport`] serializes to the JSON document of docs/diff.md
//!   ([`DiffReport::to_json`]) and renders to text ([`DiffReport::render_text`]).
//! * At a localized `moe.combine`, both sides are explained against the
//!   whole combine grammar ([`CombineExplanation`]: the simplest reproducing
//!   member, the indistinguishable others and why, or the closest members);
//!   [`explain_trace`] does the same for every event of one trace
//!   (`moeconf explain`).
//! * [`summarize`] is the element-wise comparison behind every numeric
//!   summary (count, max |Δ|, ULPs, minimum passing tolerances, worst element).
//!
//! Flow: the reference runtime (or a backend's hooks) writes traces with
//! `moeconf_schema::TraceWriter`; `moeconf diff ref.bin cand.bin` opens both
//! and calls [`diff`]; `moeconf gate` reuses the same report.
//!
//! ```
//! use moeconf_bisect::{diff, DiffOptions, Verdict};
//! use moeconf_fingerprint::{Algorithm, Coord, DType, Level, Phase, TensorView};
//! use moeconf_schema::{Header, Trace, TraceWriter};
//! let dir = tempfile::tempdir().unwrap();
//! let write = |name: &str, token: i32| {
//!     let path = dir.path().join(name);
//!     let mut header = Header::default();
//!     header.binding.decoding.max_new_tokens = 1;
//!     let mut w = TraceWriter::create(&path, Algorithm::Blake3, header).unwrap();
//!     let coord = Coord { step: 0, position: 0, phase: Phase::Prefill, layer: None, path: "token.output".into() };
//!     let bytes = token.to_le_bytes();
//!     w.append(coord, Level::L0, TensorView { dtype: DType::I32, shape: &[1], bytes: &bytes }, true).unwrap();
//!     w.finish().unwrap();
//!     Trace::open(&path).unwrap()
//! };
//! let (a, b) = (write("a.bin", 7), write("b.bin", 9));
//! assert_eq!(diff(&a, &a, &DiffOptions::default()).unwrap().verdict, Verdict::Equivalent);
//! let report = diff(&a, &b, &DiffOptions::default()).unwrap();
//! assert_eq!(report.verdict, Verdict::Divergent);
//! assert_eq!(report.levels.l0.ordinal, Some(1));
//! ```
#![forbid(unsafe_code)]

pub mod certify;
mod comparability;
mod contract_report;
mod counterfactual;
mod coverage;
mod ctx;
mod diff;
mod divergence;
mod error;
mod explain;
mod explanation;
mod incomplete;
mod layerkind;
mod numeric;
mod operators;
mod pairing;
mod passed;
mod quantization;
mod render;
mod report;
mod storage;
mod textdiff;
mod walk;

pub use certify::{certify, certify_within, CertifyError, CertifyLimits, CertifyReport, Family};
pub use comparability::{compare_bindings, Comparability};
pub use coverage::{not_captured_reason, NOT_CAPTURED_NOTE};
pub use diff::{diff, open_pair, open_pair_with, DiffOptions};
pub use divergence::MAX_DIVERGENCES;
pub use error::{BisectError, FieldDifference};
pub use explain::{
    explain_trace, BackendReport, EventList, EventView, ExplainError, FixedPermutationReport,
    KnownCombineReport, RuleReport, TraceExplanation, TraceRule, EXPLAIN_SCHEMA_VERSION, MAX_LISTED_RULES,
};
pub use explanation::{
    order_words, CombineExplanation, EquivalentReport, ExplanationStatus, NearMissReport, PermutationReport,
    ReasonReport, MAX_LISTED_EQUIVALENTS,
};
pub use incomplete::Incomplete;
pub use moeconf_fingerprint::Half;
pub use numeric::{
    compare_ids, compare_values, element_ordinal, element_value, int_values, summarize, unravel,
    IdComparison, NumericSummary, ValueComparison, WorstElement, MAX_LISTED_IDS,
};
pub use operators::{half_of, inputs_of, InputSpec};
pub use pairing::{differing_pairs, RecordPair};
pub use report::{
    Absorption, BeyondStorage, ContractReport, CoverageLimit, DiffReport, Divergence, DivergenceKind,
    EarlierCheckpoints, FirstDivergence, InputCheck, L0Report, L1Report, L2Report, L3Report, L4Report,
    LayerKind, LevelStatus, Levels, Localized, NeededRecord, OneSided, RecordRef, RouteDivergence,
    StateComponent, StateLayer, StoragePrecision, TextOp, TextPosition, TextSummary, TraceSummary,
    UncomparedLevel, Verdict, DIFF_SCHEMA_VERSION,
};
pub use textdiff::{
    compare_texts, describe_summary, render_inline, TextComparison, TEXT_DIFF_DEADLINE, TEXT_DIFF_MAX_TOKENS,
};
pub use walk::{Side, SideError};
