//! The replay report page: the origin map over layers × steps — where the
//! candidate computes differently on identical inputs (an origin), where
//! it only carries an earlier origin forward (reproduced on its own
//! inputs), and where a named contract explains the difference.

use crate::page::Page;
use crate::svg::Svg;

/// What replaying one (step, layer) showed, worst half-layer first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum OriginKind {
    /// Every replayed record reproduced bitwise.
    Reproduced,
    /// Reproduced bitwise on the candidate's own inputs, which carry an
    /// earlier origin forward (propagation, not a new origin).
    Propagated,
    /// Reproduced once a named contract is applied (e.g. another combine order).
    UnderContract,
    /// Inputs or outputs missing from the trace.
    NotReplayable,
    /// The candidate computes differently on identical inputs; the
    /// difference is absorbed before the next checkpoint.
    AbsorbedOrigin,
    /// The candidate computes differently on identical inputs.
    Origin,
}

impl OriginKind {
    /// Fill colour (categorical; each also has a letter mark).
    fn fill(self) -> &'static str {
        match self {
            OriginKind::Reproduced => "#ffffff",
            OriginKind::Propagated => "#fddbc7",
            OriginKind::UnderContract => "#fdb863",
            OriginKind::NotReplayable => "#e6e6e6",
            OriginKind::AbsorbedOrigin => "#b2abd2",
            OriginKind::Origin => "#b2182b",
        }
    }

    /// The letter drawn in the cell (so colour is not the only cue).
    fn mark(self) -> &'static str {
        match self {
            OriginKind::Reproduced => "",
            OriginKind::Propagated => "p",
            OriginKind::UnderContract => "C",
            OriginKind::NotReplayable => "–",
            OriginKind::AbsorbedOrigin => "a",
            OriginKind::Origin => "O",
        }
    }

    /// Legend text.
    fn legend(self) -> &'static str {
        match self {
            OriginKind::Reproduced => "reproduced bitwise",
            OriginKind::Propagated => "p: propagation (reproduced on inputs that carry an earlier origin)",
            OriginKind::UnderContract => {
                "C: origin reproduced under a named contract (e.g. another combine order)"
            }
            OriginKind::NotReplayable => "not replayable (inputs missing)",
            OriginKind::AbsorbedOrigin => "a: origin absorbed before the next checkpoint",
            OriginKind::Origin => "O: origin (computes differently on identical inputs)",
        }
    }
}

/// One cell of the origin map.
#[derive(Debug, Clone, PartialEq)]
pub struct OriginCell {
    /// The worst outcome among the cell's half-layers.
    pub kind: OriginKind,
    /// Tooltip text (which half, the first differing operator, the contract).
    pub title: String,
}

/// Everything the replay page shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayView {
    /// (field, value) lines of the header.
    pub header: Vec<(String, String)>,
    /// The one-line summary.
    pub summary: String,
    /// Whether any origin exists (the badge).
    pub has_origin: bool,
    /// Row labels (layers; model-global units as their own rows).
    pub rows: Vec<String>,
    /// Column labels (steps).
    pub cols: Vec<String>,
    /// `rows × cols` cells, row-major (`None`: not in the trace).
    pub cells: Vec<Option<OriginCell>>,
    /// One row per origin: step, layer, half, operator, contract.
    pub origins: Vec<Vec<String>>,
}

/// Renders the replay page. Deterministic.
pub fn render_replay(v: &ReplayView) -> String {
    let mut p = Page::new("moeconf replay report");
    p.h1("moeconf replay report");
    let (label, class) = if v.has_origin {
        ("ORIGINS", "bad")
    } else {
        ("REPRODUCED", "good")
    };
    p.badge(label, class, &v.summary);
    let rows: Vec<Vec<String>> = v.header.iter().map(|(a, b)| vec![a.clone(), b.clone()]).collect();
    p.table("head", &[], &rows);
    p.h2("Origin map over layers × steps");
    p.note("Each half-layer of the candidate was replayed in the reference on the candidate's own captured inputs. An origin is where the candidate computes differently on identical inputs; everything else that differs between the runs only carries an earlier origin forward.");
    p.raw(&origin_map(v));
    if !v.origins.is_empty() {
        p.h2("Origins");
        p.table(
            "",
            &["step", "layer", "half", "first differing record", "explained by"],
            &v.origins,
        );
    }
    p.finish()
}

/// The map itself (categorical colours plus letters, with a legend).
fn origin_map(v: &ReplayView) -> String {
    let cw = (640.0 / v.cols.len().max(1) as f64).clamp(3.0, 40.0);
    let ch = (420.0 / v.rows.len().max(1) as f64).clamp(10.0, 24.0);
    let left = 10.0 + 7.0 * v.rows.iter().map(|r| r.chars().count()).max().unwrap_or(1) as f64;
    let top = 20.0;
    let legend = [
        OriginKind::Origin,
        OriginKind::AbsorbedOrigin,
        OriginKind::UnderContract,
        OriginKind::Propagated,
        OriginKind::Reproduced,
        OriginKind::NotReplayable,
    ];
    let h = top + ch * v.rows.len() as f64 + 40.0 + 16.0 * legend.len() as f64;
    let w = (left + cw * v.cols.len() as f64 + 20.0).max(left + 420.0);
    let mut svg = Svg::new(w, h, "replay origin map, layers by steps");
    svg.text(4.0, 12.0, "layer", "start", 11.0, "");
    let ncols = v.cols.len();
    for (ri, r) in v.rows.iter().enumerate() {
        let y = top + ri as f64 * ch;
        svg.text(left - 4.0, y + ch * 0.75, r, "end", (ch * 0.7).min(11.0), "");
        for (ci, c) in v.cols.iter().enumerate() {
            let x = left + ci as f64 * cw;
            match v.cells.get(ri * ncols + ci).and_then(|c| c.as_ref()) {
                Some(cell) => {
                    let title = format!("{r}, step {c}: {}", cell.title);
                    svg.rect((x, y, cw, ch), cell.kind.fill(), Some(("#dddddd", 0.5)), &title);
                    let mark = cell.kind.mark();
                    if !mark.is_empty() && cw >= 8.0 {
                        let color = if cell.kind == OriginKind::Origin {
                            " fill=\"#ffffff\""
                        } else {
                            " fill=\"#000000\""
                        };
                        svg.text(
                            x + cw / 2.0,
                            y + ch * 0.78,
                            mark,
                            "middle",
                            (ch * 0.75).min(11.0),
                            color,
                        );
                    }
                }
                None => svg.rect(
                    (x, y, cw, ch),
                    "#f7f7f7",
                    None,
                    &format!("{r}, step {c}: not in the trace"),
                ),
            }
        }
    }
    let by = top + ch * v.rows.len() as f64;
    let every = (ncols / 10).max(1);
    for (ci, c) in v.cols.iter().enumerate().step_by(every) {
        svg.text(left + (ci as f64 + 0.5) * cw, by + 12.0, c, "middle", 10.0, "");
    }
    svg.text(left, by + 28.0, "decode step (0 = prefill)", "start", 11.0, "");
    for (i, k) in legend.iter().enumerate() {
        let y = by + 40.0 + 16.0 * i as f64;
        svg.rect((left, y, 12.0, 12.0), k.fill(), Some(("#888888", 1.0)), "");
        svg.text(left + 18.0, y + 10.0, k.legend(), "start", 10.0, "");
    }
    svg.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_origin_cell_is_drawn_and_marked() {
        let v = ReplayView {
            summary: "1 origin".into(),
            has_origin: true,
            rows: vec!["layer 0".into(), "layer 1".into()],
            cols: vec!["0".into(), "1".into()],
            cells: vec![
                Some(OriginCell {
                    kind: OriginKind::Reproduced,
                    title: "ok".into(),
                }),
                Some(OriginCell {
                    kind: OriginKind::Reproduced,
                    title: "ok".into(),
                }),
                Some(OriginCell {
                    kind: OriginKind::Reproduced,
                    title: "ok".into(),
                }),
                Some(OriginCell {
                    kind: OriginKind::Origin,
                    title: "ffn moe.combine".into(),
                }),
            ],
            ..ReplayView::default()
        };
        let html = render_replay(&v);
        assert!(html.contains("<title>layer 1, step 1: ffn moe.combine</title>"));
        assert!(html.contains(r##"fill="#b2182b""##));
        assert_eq!(render_replay(&v), html);
    }
}
