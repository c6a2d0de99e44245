//! `--allow-incomplete` of `diff`, `gate` and `replay`: a side that lacks
//! steps of its run (`moeconf_schema::Completeness`) is an error (exit 2)
//! unless the flag is given; with it, the command's report says so.

use moeconf_schema::Trace;

/// `FILE: incomplete: k of n steps (missing …)` for `trace`, when it is
/// incomplete.
pub fn describe(trace: &Trace) -> Option<String> {
    let c = trace.completeness();
    (!c.is_complete()).then(|| format!("{}: {c}", trace.path().display()))
}

/// Refuses `incomplete` (one `FILE: incomplete: …` each) unless `allow`:
/// the error names every incomplete file and says what was not done
/// (`consequence`, e.g. `not compared`).
pub fn require(incomplete: &[String], allow: bool, consequence: &str) -> anyhow::Result<()> {
    if allow || incomplete.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "{}; {consequence}: a run is complete when it holds every step 0..max_new_tokens of its binding \
         (--allow-incomplete accepts and reports the steps present)",
        incomplete.join("; ")
    )
}
