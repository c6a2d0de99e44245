//! JUnit XML rendering of a gate report, for CI test reporters (GitLab,
//! Jenkins, GitHub test-report actions): one `<testcase>` per level, plus one
//! per rule that failed, each failure carrying the localization message.
//!
//! The document follows the common Ant/Surefire JUnit schema:
//! `<testsuites>` → `<testsuite name tests failures errors skipped>` →
//! `<testcase classname name>` with `<failure message type>`, `<skipped>`
//! or `<system-out>`.

use super::{GateReport, Status};
use std::fmt::Write;

/// Escapes text for XML attributes and content (control characters other
/// than tab/newline are dropped: XML 1.0 cannot carry them).
pub fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            '\t' | '\n' => o.push(ch),
            c if (c as u32) < 0x20 => {}
            c => o.push(c),
        }
    }
    o
}

struct Case {
    name: String,
    failure: Option<(String, String)>,
    skipped: Option<String>,
    out: String,
}

/// The report as a JUnit XML document.
pub fn render(r: &GateReport) -> String {
    let localized = r
        .localization_line()
        .map(|l| format!("first divergence (moeconf diff): {l}"));
    let mut cases: Vec<Case> = Vec::new();
    for l in &r.levels {
        let name = format!("{} {} [{}]", l.level, l.describe, l.mode.name());
        let mut out = format!("{} records, {} differ, {} fail", l.records, l.differing, l.failed);
        if let Some(d) = &l.first_difference {
            out.push_str(&format!("\nfirst difference: {}", d.describe()));
        }
        if let Some(m) = &l.minimal {
            out.push_str(&format!(
                "\nwould have matched element-wise with {}",
                m.describe()
            ));
        }
        let failure = (l.status == Status::Fail).then(|| {
            let f = l.first_failure.as_ref();
            let msg = match f {
                Some(f) => format!("{} at {}: {}", l.level, f.at.describe(), f.reason),
                None => format!("{} fails", l.level),
            };
            let mut body = msg.clone();
            if let Some(loc) = &localized {
                body.push('\n');
                body.push_str(loc);
            }
            body.push('\n');
            body.push_str(&out);
            (msg, body)
        });
        let skipped =
            (l.status == Status::NotCompared).then(|| "level not captured by both sides".to_string());
        cases.push(Case {
            name,
            failure,
            skipped,
            out,
        });
    }
    for rule in r.rules.iter().filter(|x| x.status == Status::Fail) {
        let name = format!("rule {} [{}]", rule.rule, rule.levels.join(","));
        let msg = match &rule.first_failure {
            Some(f) => format!("{} at {}: {}", f.at.level, f.at.describe(), f.reason),
            None => "fails".into(),
        };
        let mut body = format!("{msg}\n{} of {} differing records fail", rule.failed, rule.judged);
        if let Some(loc) = &localized {
            body.push('\n');
            body.push_str(loc);
        }
        if let Some(m) = &rule.minimal {
            body.push_str(&format!("\nsmallest passing tolerance: {}", m.describe()));
        }
        cases.push(Case {
            name,
            failure: Some((msg, body)),
            skipped: None,
            out: String::new(),
        });
    }
    for n in &r.near_ties {
        cases.push(Case {
            name: format!("near-tie {} {}", n.kind, n.at.describe()),
            failure: None,
            skipped: None,
            out: format!(
                "WARNING: {} flip accepted as a near-tie: {} (reference margin {:.3e} < threshold {})",
                n.kind, n.change, n.reference_margin, n.threshold
            ),
        });
    }
    let failures = cases.iter().filter(|c| c.failure.is_some()).count();
    let skipped = cases.iter().filter(|c| c.skipped.is_some()).count();
    let class = format!("moeconf.gate.{}", r.profile.name);
    let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        x,
        "<testsuites name=\"moeconf gate\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\">",
        cases.len()
    );
    let _ = writeln!(
        x,
        "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\">",
        escape(&format!("moeconf gate {} vs {}", r.candidate, r.reference)),
        cases.len()
    );
    let _ = writeln!(x, "    <properties>");
    for (k, v) in [
        ("profile", r.profile.name.as_str()),
        ("policy", r.policy_source.as_str()),
        ("against", r.against.as_str()),
        ("candidate_root", r.candidate_root.as_str()),
    ] {
        let _ = writeln!(x, "      <property name=\"{k}\" value=\"{}\"/>", escape(v));
    }
    let _ = writeln!(x, "    </properties>");
    for c in &cases {
        let _ = write!(
            x,
            "    <testcase classname=\"{}\" name=\"{}\"",
            escape(&class),
            escape(&c.name)
        );
        if c.failure.is_none() && c.skipped.is_none() && c.out.is_empty() {
            x.push_str("/>\n");
            continue;
        }
        x.push_str(">\n");
        if let Some((msg, body)) = &c.failure {
            let _ = writeln!(
                x,
                "      <failure message=\"{}\" type=\"moeconf.gate\">{}</failure>",
                escape(msg),
                escape(body)
            );
        }
        if let Some(s) = &c.skipped {
            let _ = writeln!(x, "      <skipped message=\"{}\"/>", escape(s));
        }
        if !c.out.is_empty() {
            let _ = writeln!(x, "      <system-out>{}</system-out>", escape(&c.out));
        }
        x.push_str("    </testcase>\n");
    }
    x.push_str("  </testsuite>\n</testsuites>\n");
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_drops_control_characters() {
        assert_eq!(
            escape("a<b & \"c\" 'd'>\u{1}\te"),
            "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;\te"
        );
    }
}
