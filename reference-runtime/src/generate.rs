//! Greedy generation: a prefill step over the prompt, then token-by-token
//! decode steps (capture.md: step 0 predicts g_1; step s ≥ 1 consumes g_s at
//! position P+s−1 and predicts g_{s+1}; N new tokens take N forwards).

use crate::capture::CaptureSink;
use crate::error::RuntimeError;
use crate::model::{Model, StepOptions};
use crate::precision::Precision;
use crate::state::DecodeState;
use crate::tokenizer::Detokenize;
use moeconf_contract::MoeCombine;

/// Options of [`Model::generate`].
#[derive(Clone, Copy)]
pub struct GenerateOptions<'a> {
    /// Number of tokens to predict (= number of forward steps).
    pub max_new_tokens: usize,
    pub precision: Precision,
    /// The MoE combine contract.
    pub combine: &'a dyn MoeCombine,
    /// Decoder for `text.continuation` records (omitted when `None`).
    pub detokenizer: Option<&'a dyn Detokenize>,
    /// Record non-finite values instead of failing ([`StepOptions::allow_non_finite`]).
    pub allow_non_finite: bool,
}

#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated tokens g_1..g_N.
    pub tokens: Vec<u32>,
    /// Logits of the last step.
    pub last_logits: Vec<f32>,
    /// The state after the last step (the last prediction is pending).
    pub state: DecodeState,
}

impl Model {
    /// Greedy generation of `opts.max_new_tokens` tokens after `prompt_ids`.
    pub fn generate(
        &self,
        prompt_ids: &[u32],
        opts: &GenerateOptions<'_>,
        sink: &mut dyn CaptureSink,
    ) -> Result<Generation, RuntimeError> {
        let mut state = self.new_state();
        let sopts = StepOptions {
            precision: opts.precision,
            combine: opts.combine,
            detokenizer: opts.detokenizer,
            allow_non_finite: opts.allow_non_finite,
        };
        let mut last_logits = Vec::new();
        for s in 0..opts.max_new_tokens {
            let out = if s == 0 {
                self.step(&mut state, prompt_ids, &sopts, sink)?
            } else {
                let next = state
                    .pending
                    .ok_or_else(|| RuntimeError::Input("no pending token".into()))?;
                self.step(&mut state, &[next], &sopts, sink)?
            };
            last_logits = out.logits;
        }
        Ok(Generation {
            tokens: state.generated.clone(),
            last_logits,
            state,
        })
    }
}
