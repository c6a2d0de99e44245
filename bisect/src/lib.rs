//! This crate provides the comparison of two moeconf traces: it walks both
//! fingerprint trees, descends only where digests differ, and localizes the
//! first divergent step, layer and operator through the L0–L4 hierarchy.
//!
//! The walk itself arrives with part 4 of the roadmap (`moeconf diff`); the
//! crate exists now so the workspace layout is final.
#![deny(missing_docs)]
