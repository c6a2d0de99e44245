//! This crate provides moeconf's reference runtime: a deterministic CPU
//! implementation of the DeepSeek-V4 architecture whose every operator has a
//! written numerical contract, with a pluggable MoE aggregation contract and
//! capture of L0–L4 state.
#![deny(missing_docs)]

pub mod bf16;
pub mod contract;
