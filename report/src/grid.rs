//! A rows × columns grid of difference cells and its heatmap drawing,
//! aggregated when there are more columns or rows than a page can show.

use crate::scale::{LogScale, DIFFERS_UNKNOWN, IDENTICAL, NOT_CAPTURED};
use crate::svg::Svg;

/// Most columns drawn; more are merged into equal buckets.
pub const MAX_COLUMNS: usize = 120;
/// Most rows drawn; more are merged into equal buckets.
pub const MAX_ROWS: usize = 96;
/// Most tooltip lines kept per cell (the tables list the rest).
pub const MAX_NOTES: usize = 4;

/// What is known about the records of one cell.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Cell {
    /// Values compared (both sides hold the record with values).
    pub elements: u64,
    /// Values that differ.
    pub differing: u64,
    /// Largest |Δ| among them.
    pub max_abs: f64,
    /// Records that differ by digest without values to compare
    /// (fingerprint-only capture, or a record held by one side only).
    pub opaque: u64,
    /// Records in the cell.
    pub records: u64,
    /// Marks drawn on the cell: `A` absorbed, `P` propagating divergence,
    /// `R` route change, `O` origin; the first divergence is outlined.
    pub marks: String,
    /// The first divergence lies in this cell.
    pub first: bool,
    /// Tooltip lines (route changes, divergences).
    pub notes: Vec<String>,
}

impl Cell {
    /// Whether anything in the cell differs.
    pub fn differs(&self) -> bool {
        self.differing > 0 || self.opaque > 0
    }

    /// Fraction of compared values that differ (`None` without values).
    pub fn fraction(&self) -> Option<f64> {
        (self.elements > 0).then(|| self.differing as f64 / self.elements as f64)
    }

    /// Adds another cell's contents (bucket aggregation).
    pub fn absorb(&mut self, o: &Cell) {
        self.elements += o.elements;
        self.differing += o.differing;
        self.max_abs = self.max_abs.max(o.max_abs);
        self.opaque += o.opaque;
        self.records += o.records;
        self.first |= o.first;
        for m in o.marks.chars() {
            if !self.marks.contains(m) {
                self.marks.push(m);
            }
        }
        for n in &o.notes {
            if self.notes.len() < MAX_NOTES {
                self.notes.push(n.clone());
            }
        }
    }
}

/// A grid of cells, row-major; `None` where no record exists.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Grid {
    /// Row labels (top to bottom).
    pub rows: Vec<String>,
    /// Column labels (left to right).
    pub cols: Vec<String>,
    /// `rows.len() × cols.len()` cells.
    pub cells: Vec<Option<Cell>>,
}

/// Which number colours a heatmap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// Fraction of values that differ.
    Fraction,
    /// Largest |Δ|.
    MaxAbs,
}

impl Grid {
    /// An empty grid with these labels.
    pub fn new(rows: Vec<String>, cols: Vec<String>) -> Grid {
        let cells = vec![None; rows.len() * cols.len()];
        Grid { rows, cols, cells }
    }

    /// The cell at (`r`, `c`), created empty when absent.
    pub fn at(&mut self, r: usize, c: usize) -> Option<&mut Cell> {
        let w = self.cols.len();
        let slot = self.cells.get_mut(r * w + c)?;
        Some(slot.get_or_insert_with(Cell::default))
    }

    /// The cell at (`r`, `c`).
    pub fn get(&self, r: usize, c: usize) -> Option<&Cell> {
        self.cells.get(r * self.cols.len() + c)?.as_ref()
    }

    /// The grid with at most `max_rows` × `max_cols` cells: consecutive
    /// rows/columns are merged into equal buckets labelled by their range.
    pub fn aggregated(&self, max_rows: usize, max_cols: usize) -> Grid {
        let rb = buckets(self.rows.len(), max_rows.max(1));
        let cb = buckets(self.cols.len(), max_cols.max(1));
        let label = |labels: &[String], (a, b): (usize, usize)| {
            if b - a <= 1 {
                labels[a].clone()
            } else {
                format!("{}–{}", labels[a], labels[b - 1])
            }
        };
        let mut g = Grid::new(
            rb.iter().map(|&r| label(&self.rows, r)).collect(),
            cb.iter().map(|&c| label(&self.cols, c)).collect(),
        );
        for (ri, &(r0, r1)) in rb.iter().enumerate() {
            for (ci, &(c0, c1)) in cb.iter().enumerate() {
                for r in r0..r1 {
                    for c in c0..c1 {
                        if let (Some(src), Some(dst)) = (self.get(r, c).cloned(), g.at(ri, ci)) {
                            dst.absorb(&src);
                        }
                    }
                }
            }
        }
        // Cells that received nothing stay `None`.
        for (i, cell) in g.cells.iter_mut().enumerate() {
            if cell
                .as_ref()
                .is_some_and(|c| c.records == 0 && !c.first && c.marks.is_empty())
            {
                let (ri, ci) = (i / cb.len().max(1), i % cb.len().max(1));
                let any =
                    (rb[ri].0..rb[ri].1).any(|r| (cb[ci].0..cb[ci].1).any(|c| self.get(r, c).is_some()));
                if !any {
                    *cell = None;
                }
            }
        }
        g
    }

    /// Every value of `m` over differing cells (for the colour scale).
    pub fn values(&self, m: Measure) -> Vec<f64> {
        self.cells
            .iter()
            .flatten()
            .filter(|c| c.differs())
            .filter_map(|c| match m {
                Measure::Fraction => c.fraction(),
                Measure::MaxAbs => (c.elements > 0).then_some(c.max_abs),
            })
            .collect()
    }
}

/// `n` items in at most `max` consecutive half-open ranges of equal size
/// (the last may be shorter).
fn buckets(n: usize, max: usize) -> Vec<(usize, usize)> {
    let size = n.div_ceil(max).max(1);
    (0..n).step_by(size).map(|a| (a, (a + size).min(n))).collect()
}

/// How a heatmap is laid out and labelled.
pub struct HeatmapStyle<'a> {
    /// Accessible description.
    pub label: &'a str,
    /// Axis title under the columns.
    pub x_title: &'a str,
    /// Axis title beside the rows.
    pub y_title: &'a str,
    /// Legend unit text.
    pub unit: &'a str,
    /// The number that colours a cell.
    pub measure: Measure,
    /// The colour scale.
    pub scale: LogScale,
}

/// Draws `g` as an SVG heatmap.
pub fn heatmap(g: &Grid, st: &HeatmapStyle<'_>) -> String {
    let cw = (640.0 / g.cols.len().max(1) as f64).clamp(4.0, 40.0);
    let ch = (420.0 / g.rows.len().max(1) as f64).clamp(10.0, 24.0);
    let left = 10.0 + 7.0 * g.rows.iter().map(|r| r.chars().count()).max().unwrap_or(1) as f64;
    let top = 20.0;
    let w = left + cw * g.cols.len() as f64 + 20.0;
    let h = top + ch * g.rows.len() as f64 + 96.0;
    let mut svg = Svg::new(w.max(left + 500.0), h, st.label);
    svg.text(4.0, 12.0, st.y_title, "start", 11.0, "");
    for (ri, r) in g.rows.iter().enumerate() {
        let y = top + ri as f64 * ch;
        svg.text(left - 4.0, y + ch * 0.75, r, "end", (ch * 0.7).min(11.0), "");
        for ci in 0..g.cols.len() {
            let x = left + ci as f64 * cw;
            draw_cell(&mut svg, (x, y, cw, ch), g.get(ri, ci), (r, &g.cols[ci]), st);
        }
    }
    let step = (g.cols.len() / 10).max(1);
    let by = top + ch * g.rows.len() as f64;
    for (ci, c) in g.cols.iter().enumerate().step_by(step) {
        svg.text(left + (ci as f64 + 0.5) * cw, by + 12.0, c, "middle", 10.0, "");
    }
    svg.text(left, by + 28.0, st.x_title, "start", 11.0, "");
    st.scale.legend(&mut svg, left, by + 50.0, st.unit);
    svg.finish()
}

/// One cell: its fill, outline and marks, and a tooltip with its numbers.
fn draw_cell(
    svg: &mut Svg,
    (x, y, w, h): (f64, f64, f64, f64),
    cell: Option<&Cell>,
    (row, col): (&str, &str),
    st: &HeatmapStyle<'_>,
) {
    let Some(c) = cell else {
        svg.rect(
            (x, y, w, h),
            NOT_CAPTURED,
            Some(("#ffffff", 0.5)),
            &format!("{row}, {col}: not captured"),
        );
        return;
    };
    let value = match st.measure {
        Measure::Fraction => c.fraction(),
        Measure::MaxAbs => (c.elements > 0).then_some(c.max_abs),
    };
    let fill = match (c.differs(), value) {
        (false, _) => IDENTICAL,
        (true, Some(v)) if c.differing > 0 => st.scale.color(v),
        (true, _) => DIFFERS_UNKNOWN,
    };
    let mut title = format!("{row}, {col}: ");
    if c.differs() {
        title.push_str(&format!(
            "{} of {} values differ, max |Δ| {:.3e}",
            c.differing, c.elements, c.max_abs
        ));
        if c.opaque > 0 {
            title.push_str(&format!("; {} record(s) differ without values", c.opaque));
        }
    } else {
        title.push_str(&format!("identical ({} records)", c.records));
    }
    for n in &c.notes {
        title.push('\n');
        title.push_str(n);
    }
    let stroke = if c.first {
        Some(("#d62728", 2.5))
    } else {
        Some(("#dddddd", 0.5))
    };
    svg.rect((x, y, w, h), fill, stroke, &title);
    if !c.marks.is_empty() && w >= 8.0 {
        let light = matches!(fill, "#b5de2b" | "#fde725" | "#6ece58" | "#ffffff" | "#e6e6e6");
        let color = if light {
            " fill=\"#000000\""
        } else {
            " fill=\"#ffffff\""
        };
        svg.text(
            x + w / 2.0,
            y + h * 0.78,
            &c.marks,
            "middle",
            (h * 0.75).min(11.0),
            color,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(d: u64, e: u64) -> Cell {
        Cell {
            elements: e,
            differing: d,
            max_abs: d as f64,
            records: 1,
            ..Cell::default()
        }
    }

    #[test]
    fn buckets_cover_every_item_once() {
        assert_eq!(buckets(10, 4), vec![(0, 3), (3, 6), (6, 9), (9, 10)]);
        assert_eq!(buckets(3, 10), vec![(0, 1), (1, 2), (2, 3)]);
        assert!(buckets(0, 5).is_empty());
    }

    #[test]
    fn aggregation_sums_counts_and_keeps_the_maximum() {
        let mut g = Grid::new(vec!["a".into()], (0..4).map(|i| i.to_string()).collect());
        *g.at(0, 0).unwrap() = cell(1, 10);
        *g.at(0, 1).unwrap() = cell(3, 10);
        *g.at(0, 3).unwrap() = cell(0, 10);
        let a = g.aggregated(8, 2);
        assert_eq!(a.cols, vec!["0–1", "2–3"]);
        let c0 = a.get(0, 0).unwrap();
        assert_eq!((c0.differing, c0.elements, c0.max_abs), (4, 20, 3.0));
        let c1 = a.get(0, 1).unwrap();
        assert_eq!((c1.differing, c1.elements), (0, 10));
    }
}
