//! Line and bar charts in SVG.

use crate::svg::Svg;

/// One line of a line chart.
pub struct Series<'a> {
    /// Legend text.
    pub name: &'a str,
    /// One value per x position (`None`: not captured).
    pub values: &'a [Option<f64>],
    /// Stroke colour.
    pub color: &'a str,
    /// Dashed (so the two sides differ without colour too).
    pub dashed: bool,
}

/// A line chart over `xs` with an optional vertical marker at an x index.
pub fn line_chart(
    xs: &[String],
    series: &[Series<'_>],
    marker: Option<(usize, &str)>,
    label: &str,
    y_title: &str,
) -> String {
    let (left, top, w, h) = (56.0, 24.0, 560.0, 200.0);
    let mut svg = Svg::new(left + w + 160.0, top + h + 48.0, label);
    let ymax = series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .copied()
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let ymax = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
    let n = xs.len().max(1);
    let x = |i: usize| {
        left + if n == 1 {
            w / 2.0
        } else {
            w * i as f64 / (n - 1) as f64
        }
    };
    let y = |v: f64| top + h - h * (v.max(0.0) / ymax);
    svg.line((left, top + h), (left + w, top + h), "#444", 1.0, false);
    svg.line((left, top), (left, top + h), "#444", 1.0, false);
    for k in 0..=4 {
        let v = ymax * k as f64 / 4.0;
        svg.text(left - 4.0, y(v) + 4.0, &format!("{v:.3}"), "end", 10.0, "");
        svg.line((left, y(v)), (left + w, y(v)), "#eeeeee", 1.0, false);
    }
    let every = (n / 16).max(1);
    for (i, s) in xs.iter().enumerate().step_by(every) {
        svg.text(x(i), top + h + 14.0, s, "middle", 10.0, "");
    }
    svg.text(left, top - 8.0, y_title, "start", 11.0, "");
    svg.text(left + w, top + h + 32.0, "step", "end", 11.0, "");
    if let Some((i, text)) = marker {
        svg.line((x(i), top), (x(i), top + h), "#d62728", 2.0, true);
        svg.text(x(i) + 4.0, top + 10.0, text, "start", 10.0, " fill=\"#d62728\"");
    }
    for (k, s) in series.iter().enumerate() {
        let mut run: Vec<(f64, f64)> = Vec::new();
        let flush = |svg: &mut Svg, run: &mut Vec<(f64, f64)>| {
            if run.len() > 1 {
                svg.polyline(run, s.color, 2.0, s.name);
            }
            run.clear();
        };
        for (i, v) in s.values.iter().enumerate() {
            match v.filter(|v| v.is_finite()) {
                Some(v) => {
                    run.push((x(i), y(v)));
                    svg.dot(
                        x(i),
                        y(v),
                        if s.dashed { 2.5 } else { 3.5 },
                        s.color,
                        &format!("{} at step {}: {v:.6e}", s.name, xs[i]),
                    );
                }
                None => flush(&mut svg, &mut run),
            }
        }
        flush(&mut svg, &mut run);
        let ly = top + 14.0 + 18.0 * k as f64;
        svg.line(
            (left + w + 12.0, ly),
            (left + w + 36.0, ly),
            s.color,
            2.0,
            s.dashed,
        );
        svg.text(left + w + 40.0, ly + 4.0, s.name, "start", 11.0, "");
    }
    svg.finish()
}

/// A vertical bar chart of labelled counts.
pub fn bar_chart(bars: &[(String, u64)], label: &str, x_title: &str, y_title: &str, color: &str) -> String {
    let (left, top, h) = (56.0, 24.0, 180.0);
    let bw = (560.0 / bars.len().max(1) as f64).clamp(4.0, 40.0);
    let w = bw * bars.len().max(1) as f64;
    let mut svg = Svg::new((left + w + 40.0).max(360.0), top + h + 52.0, label);
    let max = bars.iter().map(|b| b.1).max().unwrap_or(0).max(1) as f64;
    svg.line((left, top + h), (left + w, top + h), "#444", 1.0, false);
    svg.text(left, top - 8.0, y_title, "start", 11.0, "");
    svg.text(left - 4.0, top + 4.0, &format!("{}", max as u64), "end", 10.0, "");
    svg.text(left - 4.0, top + h, "0", "end", 10.0, "");
    let every = (bars.len() / 16).max(1);
    for (i, (name, count)) in bars.iter().enumerate() {
        let bh = h * (*count as f64) / max;
        let x = left + i as f64 * bw;
        svg.rect(
            (x + 1.0, top + h - bh, bw - 2.0, bh),
            color,
            None,
            &format!("{name}: {count}"),
        );
        if i % every == 0 {
            svg.text(x + bw / 2.0, top + h + 14.0, name, "middle", 10.0, "");
        }
    }
    svg.text(left + w, top + h + 34.0, x_title, "end", 11.0, "");
    svg.finish()
}
