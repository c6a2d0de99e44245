//! The HTML page: one file, inline CSS, no scripts, no external URL.

use crate::svg::esc;
use std::fmt::Write;

/// Inline style sheet (system fonts only).
const STYLE: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;max-width:1200px}\
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:28px 0 6px;border-bottom:1px solid #ddd;padding-bottom:4px}\
.note{color:#555;font-size:13px;margin:4px 0 10px}code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}\
pre{background:#f6f6f6;padding:8px;overflow-x:auto;white-space:pre-wrap}\
table{border-collapse:collapse;font-size:12px;margin:6px 0}td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}\
th{background:#f2f2f2}.badge{display:inline-block;padding:3px 10px;border-radius:4px;font-weight:bold;color:#fff}\
.bad{background:#b2182b}.good{background:#1a7837}.warn{background:#8c510a}.row{display:flex;flex-wrap:wrap;gap:24px}\
.head td:first-child{color:#555;white-space:nowrap}figure{margin:0}summary{cursor:pointer;font-size:13px}";

/// An HTML document under construction.
pub struct Page {
    title: String,
    body: String,
}

impl Page {
    /// A page titled `title`.
    pub fn new(title: &str) -> Page {
        Page {
            title: title.into(),
            body: String::new(),
        }
    }

    /// A top heading.
    pub fn h1(&mut self, text: &str) {
        let _ = writeln!(self.body, "<h1>{}</h1>", esc(text));
    }

    /// A section heading.
    pub fn h2(&mut self, text: &str) {
        let _ = writeln!(self.body, "<h2>{}</h2>", esc(text));
    }

    /// A paragraph of explanatory text.
    pub fn note(&mut self, text: &str) {
        let _ = writeln!(self.body, "<p class=\"note\">{}</p>", esc(text));
    }

    /// Preformatted text.
    pub fn pre(&mut self, text: &str) {
        let _ = writeln!(self.body, "<pre>{}</pre>", esc(text));
    }

    /// A verdict badge followed by a line of text.
    pub fn badge(&mut self, label: &str, class: &str, text: &str) {
        let _ = writeln!(
            self.body,
            "<p><span class=\"badge {class}\">{}</span> {}</p>",
            esc(label),
            esc(text)
        );
    }

    /// Already-built markup (an SVG from this crate).
    pub fn raw(&mut self, html: &str) {
        self.body.push_str(html);
    }

    /// Starts a row of side-by-side figures.
    pub fn row_start(&mut self) {
        self.body.push_str("<div class=\"row\">\n");
    }

    /// Ends a row of figures.
    pub fn row_end(&mut self) {
        self.body.push_str("</div>\n");
    }

    /// A figure with a caption.
    pub fn figure(&mut self, svg: &str, caption: &str) {
        let _ = writeln!(
            self.body,
            "<figure>{svg}<figcaption class=\"note\">{}</figcaption></figure>",
            esc(caption)
        );
    }

    /// Starts a collapsed block with a one-line summary (no script needed).
    pub fn details_start(&mut self, summary: &str) {
        let _ = writeln!(self.body, "<details><summary>{}</summary>", esc(summary));
    }

    /// Ends a collapsed block.
    pub fn details_end(&mut self) {
        self.body.push_str("</details>\n");
    }

    /// A table; `class` may be empty.
    pub fn table(&mut self, class: &str, header: &[&str], rows: &[Vec<String>]) {
        let _ = write!(self.body, "<table class=\"{class}\">");
        if !header.is_empty() {
            self.body.push_str("<tr>");
            for h in header {
                let _ = write!(self.body, "<th>{}</th>", esc(h));
            }
            self.body.push_str("</tr>");
        }
        for r in rows {
            self.body.push_str("<tr>");
            for c in r {
                let _ = write!(self.body, "<td>{}</td>", esc(c));
            }
            self.body.push_str("</tr>\n");
        }
        self.body.push_str("</table>\n");
    }

    /// The finished document.
    pub fn finish(self) -> String {
        format!(
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{}</body>\n</html>\n",
            esc(&self.title),
            self.body
        )
    }
}
