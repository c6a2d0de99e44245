//! This crate provides moeconf's reference runtime: a deterministic CPU
//! implementation of the DeepSeek-V4 architecture whose every operator has a
//! written numerical contract, with a pluggable MoE aggregation contract and
//! capture of L0–L4 state.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod actquant;
mod attention;
pub mod capture;
mod compressor;
pub mod config;
mod context;
pub mod continuation;
pub mod error;
pub mod faults;
pub mod files;
pub mod fork;
pub mod generate;
pub mod head;
mod indexer;
pub mod kernels;
pub mod linear;
pub mod mhc;
pub mod model;
mod moe;
pub mod official;
pub mod precision;
mod quant;
pub mod replay;
mod rmsnorm;
mod rope;
mod router;
pub mod state;
pub mod tokenizer;
pub mod vllm;
pub mod weights;
