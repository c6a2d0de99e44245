//! A small SVG writer: elements appended to a string, every coordinate
//! formatted with one decimal so output is byte-identical everywhere.

use std::fmt::Write;

/// Escapes text for XML content and attribute values (the shared rule of
/// [`moeconf_output::escape::xml`], also used by the gate's JUnit report).
pub use moeconf_output::escape::xml as esc;

/// A coordinate with one decimal (no `-0.0`).
pub fn n(v: f64) -> String {
    let r = (v * 10.0).round() / 10.0;
    if r == 0.0 || !r.is_finite() {
        return "0".into();
    }
    if r.fract() == 0.0 {
        format!("{r:.0}")
    } else {
        format!("{r:.1}")
    }
}

/// An SVG document under construction.
pub struct Svg {
    body: String,
    width: f64,
    height: f64,
    label: String,
}

impl Svg {
    /// A drawing of `width` × `height` user units, described by `label` for
    /// screen readers.
    pub fn new(width: f64, height: f64, label: &str) -> Svg {
        Svg {
            body: String::new(),
            width,
            height,
            label: label.into(),
        }
    }

    /// A filled rectangle with an optional tooltip and stroke.
    pub fn rect(
        &mut self,
        (x, y, w, h): (f64, f64, f64, f64),
        fill: &str,
        stroke: Option<(&str, f64)>,
        title: &str,
    ) {
        let _ = write!(
            self.body,
            r#"<rect x="{}" y="{}" width="{}" height="{}" fill="{}""#,
            n(x),
            n(y),
            n(w),
            n(h),
            fill
        );
        if let Some((c, sw)) = stroke {
            let _ = write!(self.body, r#" stroke="{c}" stroke-width="{}""#, n(sw));
        }
        if title.is_empty() {
            self.body.push_str("/>");
        } else {
            let _ = write!(self.body, "><title>{}</title></rect>", esc(title));
        }
        self.body.push('\n');
    }

    /// Text anchored at (`x`, `y`): `anchor` is `start`, `middle` or `end`.
    pub fn text(&mut self, x: f64, y: f64, s: &str, anchor: &str, size: f64, extra: &str) {
        let _ = writeln!(
            self.body,
            r#"<text x="{}" y="{}" text-anchor="{anchor}" font-size="{}"{extra}>{}</text>"#,
            n(x),
            n(y),
            n(size),
            esc(s)
        );
    }

    /// A straight line.
    pub fn line(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), stroke: &str, width: f64, dash: bool) {
        let d = if dash { r#" stroke-dasharray="4 3""# } else { "" };
        let _ = writeln!(
            self.body,
            r#"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{stroke}" stroke-width="{}"{d}/>"#,
            n(x1),
            n(y1),
            n(x2),
            n(y2),
            n(width)
        );
    }

    /// A polyline through `points`, with a tooltip.
    pub fn polyline(&mut self, points: &[(f64, f64)], stroke: &str, width: f64, title: &str) {
        let pts: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{},{}", n(x), n(y)))
            .collect();
        let _ = writeln!(
            self.body,
            r#"<polyline points="{}" fill="none" stroke="{stroke}" stroke-width="{}"><title>{}</title></polyline>"#,
            pts.join(" "),
            n(width),
            esc(title)
        );
    }

    /// A small circle (a data point) with a tooltip.
    pub fn dot(&mut self, x: f64, y: f64, r: f64, fill: &str, title: &str) {
        let _ = writeln!(
            self.body,
            r#"<circle cx="{}" cy="{}" r="{}" fill="{fill}"><title>{}</title></circle>"#,
            n(x),
            n(y),
            n(r),
            esc(title)
        );
    }

    /// The finished `<svg>` element.
    pub fn finish(self) -> String {
        format!(
            "<svg role=\"img\" aria-label=\"{}\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" font-family=\"sans-serif\">\n{}</svg>\n",
            esc(&self.label),
            n(self.width),
            n(self.height),
            n(self.width),
            n(self.height),
            self.body
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_fixed_and_never_negative_zero() {
        assert_eq!(n(-0.0), "0");
        assert_eq!(n(-0.04), "0");
        assert_eq!(n(3.0), "3");
        assert_eq!(n(3.25), "3.3");
        assert_eq!(n(f64::NAN), "0");
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(esc("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&#39;");
        assert_eq!(esc("x\u{1}y"), "x\\u{1}y");
    }
}
