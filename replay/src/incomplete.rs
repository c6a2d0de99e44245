//! A candidate that lacks steps of its run (the rule:
//! `moeconf_schema::Completeness`): replay checks only the steps present,
//! so its reports carry the note and never exit 0 without
//! `--allow-incomplete`.

use moeconf_schema::{Completeness, Trace};
use serde_json::{json, Value};

/// The trace's completeness when it is incomplete.
pub(crate) fn of(trace: &Trace) -> Option<Completeness> {
    Some(trace.completeness()).filter(|c| !c.is_complete())
}

/// The JSON `incomplete` member: `null`, or the steps held and missing.
pub(crate) fn json(c: &Option<Completeness>) -> Value {
    c.as_ref().map_or(Value::Null, |c| {
        json!({
            "present_steps": c.present,
            "expected_steps": c.expected,
            "missing_steps": c.missing_steps(),
            "note": c.note(),
        })
    })
}
