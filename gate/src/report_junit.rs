//! JUnit XML rendering of a gate report, for CI test reporters (GitLab,
//! Jenkins, GitHub test-report actions): one `<testcase>` per level, plus one
//! per rule that failed, each failure carrying the localization message.
//!
//! The document follows the common Ant/Surefire JUnit schema:
//! `<testsuites>` → `<testsuite name tests failures errors skipped>` →
//! `<testcase classname name>` with `<failure message type>`, `<skipped>`
//! or `<system-out>`.

use crate::report::{GateReport, LevelResult, NearTie, RuleResult, Status};
use std::fmt::Write;

use moeconf_output::escape::text;
/// Escapes a string for XML content and attribute values (the shared rule
/// of [`moeconf_output::escape::xml`]: markup as entities, characters XML 1.0
/// forbids written visibly). User strings (trace, profile and rule names) are
/// also given in their visible form first ([`text`]), so a newline in a name
/// shows as `\n` instead of starting a line of a message.
pub use moeconf_output::escape::xml as escape;

/// One `<testcase>`.
struct Case {
    name: String,
    /// `(message, body)` of a `<failure>`.
    failure: Option<(String, String)>,
    /// The message of a `<skipped>`.
    skipped: Option<String>,
    /// `<system-out>` text (none when empty).
    out: String,
}

impl Case {
    /// A level's test case: fails with the first failure and the
    /// localization, skipped when the level was not compared.
    fn level(l: &LevelResult, localized: Option<&str>) -> Case {
        let mut out = format!(
            "{} steps, {} records differ, {} fail",
            l.steps, l.differing, l.failed
        );
        if let Some(d) = &l.first_difference {
            out.push_str(&format!("\nfirst difference: {}", d.describe_location()));
        }
        if let Some(m) = &l.minimal {
            out.push_str(&format!(
                "\nwould have matched element-wise with {}",
                m.describe()
            ));
        }
        let failure = (l.status == Status::Fail).then(|| {
            let msg = match &l.first_failure {
                Some(f) => format!("{} at {}", l.level.name(), f.describe()),
                None => format!("{} fails", l.level.name()),
            };
            let mut body = msg.clone();
            if let Some(loc) = localized {
                body.push('\n');
                body.push_str(loc);
            }
            body.push('\n');
            body.push_str(&out);
            (msg, body)
        });
        Case {
            name: format!("{} {} [{}]", l.level.name(), l.describe, l.mode.name()),
            failure,
            skipped: (l.status == Status::NotCompared)
                .then(|| "level not captured by both sides".to_string()),
            out,
        }
    }

    /// A failing rule's test case, with its smallest passing tolerance.
    fn rule(rule: &RuleResult, localized: Option<&str>) -> Case {
        let msg = match &rule.first_failure {
            Some(f) => format!("{} at {}", f.at.level, f.describe()),
            None => "fails".into(),
        };
        let mut body = format!("{msg}\n{} of {} differing records fail", rule.failed, rule.judged);
        if let Some(loc) = localized {
            body.push('\n');
            body.push_str(loc);
        }
        if let Some(m) = &rule.minimal {
            body.push_str(&format!("\nsmallest passing tolerance: {}", m.describe()));
        }
        Case {
            name: format!("rule {} [{}]", text(&rule.rule), rule.level_names(",")),
            failure: Some((msg, body)),
            skipped: None,
            out: String::new(),
        }
    }

    /// A near-tie's (passing) test case, with the warning in `<system-out>`.
    fn near_tie(n: &NearTie) -> Case {
        Case {
            name: format!("near-tie {} {}", n.kind.name(), n.at.describe_location()),
            failure: None,
            skipped: None,
            out: format!(
                "WARNING: {} flip accepted as a near-tie: {} (reference margin {:.3e} < threshold {})",
                n.kind.name(),
                n.change,
                n.reference_margin,
                n.threshold
            ),
        }
    }

    /// The `<testcase>` element.
    fn write(&self, x: &mut String, class: &str) {
        let _ = write!(
            x,
            "    <testcase classname=\"{}\" name=\"{}\"",
            escape(class),
            escape(&self.name)
        );
        if self.failure.is_none() && self.skipped.is_none() && self.out.is_empty() {
            x.push_str("/>\n");
            return;
        }
        x.push_str(">\n");
        if let Some((msg, body)) = &self.failure {
            let _ = writeln!(
                x,
                "      <failure message=\"{}\" type=\"moeconf.gate\">{}</failure>",
                escape(msg),
                escape(body)
            );
        }
        if let Some(s) = &self.skipped {
            let _ = writeln!(x, "      <skipped message=\"{}\"/>", escape(s));
        }
        if !self.out.is_empty() {
            let _ = writeln!(x, "      <system-out>{}</system-out>", escape(&self.out));
        }
        x.push_str("    </testcase>\n");
    }
}

/// The report as a JUnit XML document.
pub fn render(r: &GateReport) -> String {
    let localized = r
        .localization_line()
        .map(|l| format!("first divergence (moeconf diff): {l}"));
    let localized = localized.as_deref();
    let cases: Vec<Case> = r
        .levels
        .iter()
        .map(|l| Case::level(l, localized))
        .chain(
            r.rules
                .iter()
                .filter(|x| x.status == Status::Fail)
                .map(|x| Case::rule(x, localized)),
        )
        .chain(r.near_ties.iter().map(Case::near_tie))
        .chain(r.incomplete.iter().map(|i| Case {
            name: format!("completeness of the {}", i.side),
            failure: None,
            skipped: Some(i.note.clone()),
            out: String::new(),
        }))
        .collect();
    let failures = cases.iter().filter(|c| c.failure.is_some()).count();
    let skipped = cases.iter().filter(|c| c.skipped.is_some()).count();
    let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        x,
        "<testsuites name=\"moeconf gate\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\">",
        cases.len()
    );
    let _ =
        writeln!(
        x,
        "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\">",
        escape(&format!("moeconf gate {} vs {}", text(&r.candidate), text(&r.reference))),
        cases.len()
    );
    let _ = writeln!(x, "    <properties>");
    for (k, v) in [
        ("profile", r.profile.name.as_str()),
        ("policy", r.policy_source.as_str()),
        ("against", r.against.as_str()),
        ("candidate_root", r.candidate_root.as_str()),
    ] {
        let _ = writeln!(x, "      <property name=\"{k}\" value=\"{}\"/>", escape(&text(v)));
    }
    let _ = writeln!(x, "    </properties>");
    let class = format!("moeconf.gate.{}", text(&r.profile.name));
    for c in &cases {
        c.write(&mut x, &class);
    }
    x.push_str("  </testsuite>\n</testsuites>\n");
    x
}
