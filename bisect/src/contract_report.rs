//! Two-sided contract explanation at the localized `moe.combine`: the
//! reference and the candidate are each explained against the whole combine
//! grammar ([`moeconf_contract::explain_event`]), or each said to match
//! nothing, with the closest members and how many values they get wrong.

use moeconf_contract::{AggregationContract, EventContext};

use crate::ctx::Ctx;
use crate::error::BisectError;
use crate::explain::{explain_one, ExplainError};
use crate::explanation::CombineExplanation;
use crate::report::{ContractReport, RecordRef};
use moeconf_schema::Trace;

/// One side's explanation, or why there is none.
struct Side {
    explanation: Option<CombineExplanation>,
    /// Whether the native contract (`c`, slot order) is in the reproducing set.
    native: Option<bool>,
    note: Option<String>,
}

fn side(t: &Trace, label: &str, key: (u32, u32, u32)) -> Result<Side, BisectError> {
    match explain_one(t, label, key) {
        Ok(Some((e, ctx))) => {
            let context = EventContext {
                experts: &ctx.experts,
                gates: &ctx.gates,
            };
            Ok(Side {
                native: Some(e.contains(&AggregationContract::native(), &context)),
                explanation: Some(CombineExplanation::of(&e)),
                note: None,
            })
        }
        Ok(None) => Ok(Side {
            explanation: None,
            native: None,
            note: Some(format!("the {label} has no moe.combine record at this event")),
        }),
        Err(ExplainError::Trace(e)) => Err(BisectError::Trace(e)),
        Err(e) => Ok(Side {
            explanation: None,
            native: None,
            note: Some(format!("{e} (capture L4 with payloads to explain it)")),
        }),
    }
}

impl Ctx<'_> {
    /// The contract report at the localized combine event.
    pub(crate) fn contract(
        &self,
        step: u32,
        layer: u32,
        position: u32,
        at: RecordRef,
    ) -> Result<ContractReport, BisectError> {
        let key = (step, layer, position);
        let cand = side(self.s.c, "candidate", key)?;
        let refe = side(self.s.r, "reference", key)?;
        let simplest = |s: &Side| s.explanation.as_ref().and_then(|e| e.simplest.clone());
        Ok(ContractReport {
            at,
            candidate: simplest(&cand),
            reference: simplest(&refe),
            reference_is_native: refe.native,
            candidate_explanation: cand.explanation,
            reference_explanation: refe.explanation,
            candidate_note: cand.note,
            reference_note: refe.note,
        })
    }
}
