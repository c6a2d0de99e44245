//! The invariance matrix page: one row per configuration of a backend, its
//! changed knobs, whether tokens and logits stayed equal, the L0–L4 verdicts
//! as coloured cells, the first divergent operator, and a link to the
//! configuration's diff page.

use crate::page::Page;
use crate::svg::esc;
use std::fmt::Write;

/// One configuration's row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InvarianceRow {
    pub name: String,
    /// Its value of each knob of [`InvarianceView::knobs`] it changes (empty: the base's).
    pub knob_values: Vec<String>,
    /// `bitwise`, `profile:NAME` or `info`.
    pub expectation: String,
    /// Tokens equal to the base's (`None`: not compared).
    pub tokens: Option<bool>,
    /// Logits bitwise equal to the base's.
    pub logits: Option<bool>,
    /// `match`, `differ` or `not_compared` for L0…L4 (empty: not compared).
    pub levels: Vec<String>,
    /// Where it first departs (`—` when it does not).
    pub first: String,
    /// `PASS`, `FAIL`, `INFO` or `ERROR`.
    pub status: String,
    /// The gate's verdict under the expectation's profile.
    pub gate: Option<String>,
    /// Its diff page, relative to this page (a file name this tool chose).
    pub link: Option<String>,
    /// Why it has no verdict.
    pub error: Option<String>,
}

/// Everything the matrix page shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InvarianceView {
    /// (field, value) lines of the header.
    pub header: Vec<(String, String)>,
    /// `pass`, `fail` or `error`.
    pub verdict: String,
    /// The one-line summary.
    pub summary: String,
    /// The knobs some configuration changes (one column each).
    pub knobs: Vec<String>,
    pub rows: Vec<InvarianceRow>,
}

/// Colour class of a status or a level verdict (text always says it too).
fn class_of(v: &str) -> &'static str {
    match v {
        "PASS" | "match" | "equal" => "good",
        "FAIL" | "ERROR" | "differ" => "bad",
        "INFO" => "warn",
        _ => "",
    }
}

/// A link target this page may point at: a plain file name of this tool's
/// (`c01.html`), never a path or a URL.
fn safe_link(l: &str) -> bool {
    !l.is_empty()
        && l.len() <= 64
        && l.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_')
        && !l.starts_with('.')
}

fn td(s: &mut String, text: &str, class: &str) {
    if class.is_empty() {
        let _ = write!(s, "<td>{}</td>", esc(text));
    } else {
        let _ = write!(s, "<td class=\"cell {class}\">{}</td>", esc(text));
    }
}

fn equal_text(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "equal",
        Some(false) => "differ",
        None => "not compared",
    }
}

/// Renders the matrix page. Deterministic: the same view gives the same bytes.
pub fn render_invariance(v: &InvarianceView) -> String {
    let mut p = Page::new("moeconf invariance report");
    p.h1("moeconf invariance report");
    let class = match v.verdict.as_str() {
        "pass" => "good",
        "fail" => "bad",
        _ => "warn",
    };
    p.badge(&v.verdict.to_uppercase(), class, &v.summary);
    let head: Vec<Vec<String>> = v
        .header
        .iter()
        .map(|(k, val)| vec![k.clone(), val.clone()])
        .collect();
    p.table("head", &[], &head);
    p.h2("Matrix");
    p.note("One row per configuration, compared with the base. tokens: L0 equal; logits: L1 bitwise; L0–L4: each level's verdict (= match, ≠ differ, · not compared). A configuration's name links to its diff page (layer × step pictures and the localized operator).");
    let mut s = String::from("<table class=\"matrix\"><tr><th>configuration</th>");
    for k in &v.knobs {
        let _ = write!(s, "<th>{}</th>", esc(k));
    }
    s.push_str("<th>expect</th><th>tokens</th><th>logits</th><th>L0</th><th>L1</th><th>L2</th><th>L3</th><th>L4</th><th>first divergence</th><th>result</th></tr>\n");
    for r in &v.rows {
        s.push_str("<tr>");
        match r.link.as_deref().filter(|l| safe_link(l)) {
            Some(l) => {
                let _ = write!(s, "<td><a href=\"{}\">{}</a></td>", esc(l), esc(&r.name));
            }
            None => td(&mut s, &r.name, ""),
        }
        for k in &r.knob_values {
            td(&mut s, k, "");
        }
        td(&mut s, &r.expectation, "");
        td(&mut s, equal_text(r.tokens), class_of(equal_text(r.tokens)));
        td(&mut s, equal_text(r.logits), class_of(equal_text(r.logits)));
        for i in 0..5 {
            let l = r.levels.get(i).map(String::as_str).unwrap_or("");
            let mark = match l {
                "match" => "=",
                "differ" => "≠",
                _ => "·",
            };
            td(&mut s, mark, class_of(l));
        }
        td(&mut s, &r.first, "");
        let result = match &r.gate {
            Some(g) => format!("{} (gate {g})", r.status),
            None => r.status.clone(),
        };
        td(&mut s, &result, class_of(&r.status));
        s.push_str("</tr>\n");
        if let Some(e) = &r.error {
            let _ = writeln!(
                s,
                "<tr><td></td><td colspan=\"{}\"><pre>{}</pre></td></tr>",
                v.knobs.len() + 10,
                esc(e)
            );
        }
    }
    s.push_str("</table>\n<style>.matrix .cell.good{background:#d9f0d3}.matrix .cell.bad{background:#f4c7c3}.matrix .cell.warn{background:#fbe3b0}.matrix td{text-align:center}.matrix td:first-child{text-align:left}</style>\n");
    p.raw(&s);
    p.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, link: Option<&str>) -> InvarianceRow {
        InvarianceRow {
            name: name.into(),
            knob_values: vec!["2".into()],
            expectation: "bitwise".into(),
            tokens: Some(true),
            logits: Some(false),
            levels: vec![
                "match".into(),
                "differ".into(),
                "match".into(),
                "differ".into(),
                "differ".into(),
            ],
            first: "L4 step 0 pos 1 layer 0 attn.core".into(),
            status: "FAIL".into(),
            gate: None,
            link: link.map(str::to_string),
            error: None,
        }
    }

    #[test]
    fn rows_link_to_their_diff_pages_and_names_are_escaped() {
        let v = InvarianceView {
            header: vec![("backend".into(), "reference".into())],
            verdict: "fail".into(),
            summary: "1 configuration: 0 pass, 1 fail".into(),
            knobs: vec!["threads".into()],
            rows: vec![
                row("<img src=x onerror=alert(1)>", Some("c01.html")),
                row("two", Some("javascript:alert(1)")),
                row("three", Some("../../etc/passwd")),
            ],
        };
        let html = render_invariance(&v);
        assert!(html.contains("<a href=\"c01.html\">&lt;img src=x onerror=alert(1)&gt;</a>"));
        assert!(!html.contains("<img"));
        assert!(
            !html.contains("javascript:"),
            "a link that is not a plain file name is dropped"
        );
        assert!(!html.contains("etc/passwd\""));
        assert!(html.contains("attn.core"));
        assert!(html.contains("class=\"cell bad\">≠"));
        assert_eq!(html, render_invariance(&v), "deterministic");
    }
}
