//! Markdown rendering of a gate report: GitHub-flavoured, small enough for a
//! pull-request comment or `$GITHUB_STEP_SUMMARY` (one table, then details).
//!
//! Every string that is not a fixed label goes through
//! [`moeconf_output::escape`]: names (profile, traces, rules) as code spans
//! whose fence outgrows any backtick run inside, everything else as text with
//! `&`, `<`, `>` as entities and inline markup escaped, so a hostile file or
//! profile name can neither leave its span or cell nor carry raw HTML.

use crate::report::{GateReport, Status};
use moeconf_output::escape::{md_code, md_text, MdContext};

/// Text for a table cell.
fn cell(s: &str) -> String {
    md_text(s, MdContext::Cell)
}

/// Text for a paragraph, list item or quote.
fn inline(s: &str) -> String {
    md_text(s, MdContext::Inline)
}

/// The report as Markdown.
pub fn render(r: &GateReport) -> String {
    let mut s = format!(
        "### moeconf gate: {}{}\n\nProfile {} ({}), candidate {} against {} {}.\n\n",
        if r.verdict.passes() {
            "✅ PASS"
        } else {
            "❌ FAIL"
        },
        r.incomplete_label(),
        md_code(&r.profile.name, MdContext::Inline),
        inline(&r.policy_source),
        md_code(&r.candidate, MdContext::Inline),
        inline(&r.against),
        md_code(&r.reference, MdContext::Inline)
    );
    if let Some(l) = r.localization_line() {
        s.push_str(&format!("**First divergence:** {}\n\n", inline(&l)));
    }
    for i in &r.incomplete {
        s.push_str(&format!(
            "**Incomplete:** {} (only the steps present were judged)\n\n",
            cell(&format!("{} {}", i.side, r.incomplete_file(i)))
        ));
    }
    s.push_str("| Level | Mode | Status | Steps | Records differ | Records fail | First failure |\n");
    s.push_str("|---|---|---|---:|---:|---:|---|\n");
    for l in &r.levels {
        let first = l.first_failure.as_ref().map(|f| f.describe()).unwrap_or_default();
        s.push_str(&format!(
            "| {} {} | {} | {} | {} | {} | {} | {} |\n",
            l.level.name(),
            cell(&l.describe),
            l.mode.name(),
            l.status.label(),
            l.steps,
            l.differing,
            l.failed,
            cell(&first)
        ));
    }
    let failing: Vec<_> = r
        .rules
        .iter()
        .filter(|x| x.minimal.is_some() || x.status == Status::Fail)
        .collect();
    if !failing.is_empty() {
        s.push_str(
            "\n| Rule | Levels | Judged | Fail | Smallest passing tolerance |\n|---|---|---:|---:|---|\n",
        );
        for x in failing {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                md_code(&x.rule, MdContext::Cell),
                x.level_names(", "),
                x.judged,
                x.failed,
                cell(&x.minimal.map(|m| m.describe()).unwrap_or_default())
            ));
        }
    }
    if !r.near_ties.is_empty() {
        s.push_str("\n**Near-ties (warnings):**\n\n");
        for n in &r.near_ties {
            s.push_str(&format!("- {}\n", inline(&n.describe())));
        }
    }
    for n in &r.notes {
        s.push_str(&format!("\n> {}\n", inline(n)));
    }
    s.push_str(&format!("\n{}\n", inline(&r.summary)));
    s
}
