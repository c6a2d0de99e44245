//! Markdown rendering of a gate report: GitHub-flavoured, small enough for a
//! pull-request comment or `$GITHUB_STEP_SUMMARY` (one table, then details).

use crate::report::{GateReport, Status};

/// Escapes `|` and newlines so text stays inside one table cell.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// The report as Markdown.
pub fn render(r: &GateReport) -> String {
    let mut s = format!(
        "### moeconf gate: {}{}\n\nProfile `{}` ({}), candidate `{}` against {} `{}`.\n\n",
        if r.verdict.passes() {
            "✅ PASS"
        } else {
            "❌ FAIL"
        },
        r.incomplete_label(),
        r.profile.name,
        cell(&r.policy_source),
        cell(&r.candidate),
        r.against,
        cell(&r.reference)
    );
    if let Some(l) = r.localization_line() {
        s.push_str(&format!("**First divergence:** {}\n\n", cell(&l)));
    }
    for i in &r.incomplete {
        s.push_str(&format!(
            "**Incomplete:** {} (only the steps present were judged)\n\n",
            cell(&format!("{} {}", i.side, r.incomplete_file(i)))
        ));
    }
    s.push_str("| Level | Mode | Status | Records | Differ | Fail | First failure |\n");
    s.push_str("|---|---|---|---:|---:|---:|---|\n");
    for l in &r.levels {
        let first = l.first_failure.as_ref().map(|f| f.describe()).unwrap_or_default();
        s.push_str(&format!(
            "| {} {} | {} | {} | {} | {} | {} | {} |\n",
            l.level.name(),
            l.describe,
            l.mode.name(),
            l.status.label(),
            l.records,
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
                "| `{}` | {} | {} | {} | {} |\n",
                cell(&x.rule),
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
            // Kind, margin and threshold hold no `|` or newline: escaping the
            // whole line equals escaping location and change.
            s.push_str(&format!("- {}\n", cell(&n.describe())));
        }
    }
    for n in &r.notes {
        s.push_str(&format!("\n> {}\n", cell(n)));
    }
    s.push_str(&format!("\n{}\n", r.summary));
    s
}
