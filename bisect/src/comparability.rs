//! Binding comparison: may two traces be compared at all, and which expected
//! backend differences should the report show?
//!
//! Refusing fields (a difference means the traces describe different
//! experiments): model config and weights digests, tokenizer digest, prompt
//! text and ids, decoding strategy and length, canonicalization policy.
//! Shown fields (differences expected between backends under test): model and
//! tokenizer display names, the weight formats read from the tensor list (FP8/MXFP4
//! vs bf16: a difference the weights digest refuses anyway, named for the reader), precision profile, aggregation contract,
//! schedule, capture spec, extra binding facts, and the whole provenance
//! (runtime, version, threads, notes).

use crate::error::FieldDifference;
use moeconf_schema::{Binding, Provenance};

/// Result of comparing two bindings and provenances.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Comparability {
    /// Refusing fields that differ (empty unless the comparison was forced).
    pub forced_over: Vec<FieldDifference>,
    /// Expected backend differences, shown for information.
    pub expected_differences: Vec<FieldDifference>,
}

fn short_list<T: std::fmt::Debug>(v: &[T]) -> String {
    const SHOW: usize = 12;
    if v.len() <= SHOW {
        format!("{v:?} ({} items)", v.len())
    } else {
        format!("{:?}… ({} items)", &v[..SHOW], v.len())
    }
}

fn first_difference<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn push(out: &mut Vec<FieldDifference>, field: &str, r: String, c: String) {
    if r != c {
        out.push(FieldDifference {
            field: field.to_string(),
            reference: r,
            candidate: c,
        });
    }
}

/// Splits the binding differences into refusing and shown ones.
/// Returns `(refusing, shown)`.
pub fn compare_bindings(
    r: &Binding,
    c: &Binding,
    rp: &Provenance,
    cp: &Provenance,
) -> (Vec<FieldDifference>, Vec<FieldDifference>) {
    (refusing(r, c), shown(r, c, rp, cp))
}

/// Differences that mean the traces describe different experiments.
fn refusing(r: &Binding, c: &Binding) -> Vec<FieldDifference> {
    let mut refuse = Vec::new();
    push(
        &mut refuse,
        "model.config_digest",
        r.model.config_digest.to_hex(),
        c.model.config_digest.to_hex(),
    );
    push(
        &mut refuse,
        "model.weights_digest",
        r.model.weights_digest.to_hex(),
        c.model.weights_digest.to_hex(),
    );
    push(
        &mut refuse,
        "tokenizer.digest",
        r.tokenizer.digest.to_hex(),
        c.tokenizer.digest.to_hex(),
    );
    push(
        &mut refuse,
        "prompt.text",
        format!("{:?}", r.prompt.text),
        format!("{:?}", c.prompt.text),
    );
    if r.prompt.ids != c.prompt.ids {
        let at = first_difference(&r.prompt.ids, &c.prompt.ids);
        refuse.push(FieldDifference {
            field: "prompt.ids".into(),
            reference: short_list(&r.prompt.ids),
            candidate: format!("{}; first difference at index {at}", short_list(&c.prompt.ids)),
        });
    }
    push(
        &mut refuse,
        "decoding.strategy",
        r.decoding.strategy.clone(),
        c.decoding.strategy.clone(),
    );
    push(
        &mut refuse,
        "decoding.max_new_tokens",
        r.decoding.max_new_tokens.to_string(),
        c.decoding.max_new_tokens.to_string(),
    );
    push(
        &mut refuse,
        "canon.fold_negative_zero",
        r.canon.fold_negative_zero.to_string(),
        c.canon.fold_negative_zero.to_string(),
    );
    refuse
}

/// Differences expected between backends under test, shown for information.
fn shown(r: &Binding, c: &Binding, rp: &Provenance, cp: &Provenance) -> Vec<FieldDifference> {
    let mut shown = Vec::new();
    push(
        &mut shown,
        "model.name",
        r.model.name.clone(),
        c.model.name.clone(),
    );
    push(
        &mut shown,
        "model.weight_formats",
        r.model.weight_formats(),
        c.model.weight_formats(),
    );
    push(
        &mut shown,
        "tokenizer.name",
        r.tokenizer.name.clone(),
        c.tokenizer.name.clone(),
    );
    push(&mut shown, "precision", r.precision.clone(), c.precision.clone());
    push(&mut shown, "contract", r.contract.clone(), c.contract.clone());
    push(&mut shown, "schedule", r.schedule.clone(), c.schedule.clone());
    push(&mut shown, "capture", r.capture.describe(), c.capture.describe());
    push(
        &mut shown,
        "extra",
        format!("{:?}", r.extra),
        format!("{:?}", c.extra),
    );
    push(
        &mut shown,
        "provenance.runtime",
        rp.runtime.clone(),
        cp.runtime.clone(),
    );
    push(
        &mut shown,
        "provenance.version",
        rp.version.clone(),
        cp.version.clone(),
    );
    push(
        &mut shown,
        "provenance.threads",
        rp.threads.to_string(),
        cp.threads.to_string(),
    );
    push(
        &mut shown,
        "provenance.notes",
        format!("{:?}", rp.notes),
        format!("{:?}", cp.notes),
    );
    shown
}
