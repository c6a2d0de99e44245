//! The context one token's pass through one decoder layer shares across its
//! operators (attention, router, experts, combine): the configuration, the
//! precision profile and combine contract of the run, where the token is,
//! and the calibration faults active there.

use crate::capture::At;
use crate::config::ModelConfig;
use crate::faults::{Active, FaultPlan};
use crate::precision::Precision;
use moeconf_contract::MoeCombine;

/// What every operator of one (step, layer, position) needs besides its
/// weights and state.
#[derive(Clone, Copy)]
pub(crate) struct TokenCtx<'a> {
    /// The validated configuration.
    pub cfg: &'a ModelConfig,
    /// Precision profile.
    pub p: Precision,
    /// The run's MoE combine (a fault in `fx` may replace it).
    pub combine: &'a dyn MoeCombine,
    /// Forward step.
    pub step: u32,
    /// Decoder layer.
    pub layer: u32,
    /// Absolute token position.
    pub position: u32,
    /// Token id at this position (hash routing).
    pub token: u32,
    /// Faults active at this coordinate (`Active::default()` without a plan).
    pub fx: &'a Active<'a>,
    /// The fault plan of the run, if any (observes interventions).
    pub plan: Option<&'a FaultPlan>,
}

impl TokenCtx<'_> {
    /// Where this token's layer records belong.
    pub fn at(&self) -> At {
        At::layer(self.position, self.layer)
    }
}
