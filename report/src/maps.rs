//! What the pictures show, gathered from two verified traces and the diff
//! report: the L3 layer-state grid (layers × steps), the L2 persistent-state
//! grid (layer and component × boundary), both sides' top-1 margins, and
//! the |Δ| histogram of the localized operator.
//!
//! Only records whose digests differ are read (through the same hash-tree
//! pairing the diff uses); every other record is identical by digest and is
//! counted from the index alone.

use crate::error::ReportError;
use crate::grid::{Cell, Grid};
use moeconf_bisect::{
    compare_ids, differing_pairs, int_values, summarize, unravel, DiffReport, DivergenceKind, RecordRef,
};
use moeconf_fingerprint::{Component, Level};
use moeconf_schema::{IndexEntry, Trace};
use std::collections::{BTreeMap, BTreeSet, HashSet};

/// Both sides' top-1 margins (`lm.margin`) per step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MarginSeries {
    /// Steps, ascending.
    pub steps: Vec<u32>,
    /// The reference's margin at each step (`None` where not captured).
    pub reference: Vec<Option<f64>>,
    /// The candidate's margin at each step.
    pub candidate: Vec<Option<f64>>,
    /// The step whose token differs first (L0), if any.
    pub first_token_change: Option<u32>,
}

/// The distribution of |Δ| of one record, by decade.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// The record, e.g. `step 1 pos 5 layer 5 moe.combine`.
    pub record: String,
    /// (decade d, count of differing values with 10^d ≤ |Δ| < 10^(d+1)), ascending.
    pub bins: Vec<(i32, u64)>,
    /// Values that are equal.
    pub equal: u64,
    /// The largest differences: (index, reference, candidate), largest first.
    pub worst: Vec<(Vec<u64>, f64, f64)>,
}

/// Everything the diff report draws.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DiffMaps {
    /// L3 post-mHC checkpoints: rows `layer N`, columns steps.
    pub layer_state: Grid,
    /// L2 persistent state: rows `layer N component`, columns boundaries.
    pub persistent: Grid,
    /// L1 margins.
    pub margins: MarginSeries,
    /// The localized operator's |Δ| distribution.
    pub histogram: Option<Histogram>,
    /// Divergences outside any layer (embedding, head), as text.
    pub global: Vec<String>,
}

/// Largest number of worst elements listed.
const WORST: usize = 8;

impl DiffMaps {
    /// Gathers the maps of `r` (reference) and `c` (candidate), both opened
    /// verified, whose diff is `report`.
    pub fn gather(r: &Trace, c: &Trace, report: &DiffReport) -> Result<DiffMaps, ReportError> {
        // The pictures cover every record: both whole indexes (kept by the
        // traces, so [`all`] returns them afterwards).
        r.records()?;
        c.records()?;
        let steps: Vec<u32> = all(r)
            .iter()
            .chain(all(c))
            .map(|e| e.coord.step)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let col: BTreeMap<u32, usize> = steps.iter().enumerate().map(|(i, &s)| (s, i)).collect();
        let cols: Vec<String> = steps.iter().map(|s| s.to_string()).collect();
        let pairs = differing_pairs(r, c).map_err(|f| ReportError::Trace(f.error))?;
        let differing: HashSet<usize> = pairs.iter().filter_map(|p| p.reference).collect();
        let mut maps = DiffMaps {
            layer_state: layer_grid(r, c, cols.clone()),
            persistent: state_grid(r, c, cols),
            margins: margins(r, c, report)?,
            histogram: histogram(r, c, report)?,
            global: Vec::new(),
        };
        // Identical records: counted from the index.
        for (i, e) in all(r).iter().enumerate() {
            if !differing.contains(&i) {
                if let Some(cell) = maps.cell_of(e, &col) {
                    cell.records += 1;
                    cell.elements += elements(e);
                }
            }
        }
        for p in &pairs {
            let (re, ce) = (p.reference.map(|i| r.record(i)), p.candidate.map(|i| c.record(i)));
            let Some(e) = re.or(ce) else { continue };
            let values = compare_pair(r, c, (p.reference, p.candidate))?;
            let route = route_note(r, c, (p.reference, p.candidate))?;
            if let Some(cell) = maps.cell_of(e, &col) {
                cell.records += 1;
                match values {
                    Some((d, n, m)) => {
                        cell.differing += d;
                        cell.elements += n;
                        cell.max_abs = cell.max_abs.max(m);
                    }
                    None => cell.opaque += 1,
                }
            }
            if let (Some(note), Some(l)) = (route, e.coord.layer) {
                if let Some(&ci) = col.get(&e.coord.step) {
                    if let Some(cell) = maps.layer_state.at(l as usize, ci) {
                        if !cell.marks.contains('R') {
                            cell.marks.push('R');
                        }
                        if cell.notes.len() < crate::grid::MAX_NOTES {
                            cell.notes.push(note);
                        }
                    }
                }
            }
        }
        maps.mark_divergences(report, &col);
        Ok(maps)
    }

    /// The grid cell a record counts in: L3 checkpoints in the layer-state
    /// grid, L2 state in the persistent grid; `None` for anything else.
    fn cell_of(&mut self, e: &IndexEntry, col: &BTreeMap<u32, usize>) -> Option<&mut Cell> {
        let ci = *col.get(&e.coord.step)?;
        let layer = e.coord.layer? as usize;
        let (component, _) = Component::parse(e.coord.path.as_str())?;
        if is_checkpoint(component) {
            return self.layer_state.at(layer, ci);
        }
        if e.level == Level::L2 {
            let row = self
                .persistent
                .rows
                .iter()
                .position(|x| *x == state_row(layer, e.coord.path.as_str()))?;
            return self.persistent.at(row, ci);
        }
        None
    }

    /// Marks every listed divergence (absorbed `A`, propagating `P`,
    /// unclassified `?`) on its cell and outlines the first divergence.
    fn mark_divergences(&mut self, report: &DiffReport, col: &BTreeMap<u32, usize>) {
        for d in &report.divergences {
            let mark = match d.kind {
                Some(DivergenceKind::Absorbed) => 'A',
                Some(DivergenceKind::Propagating) => 'P',
                None => '?',
            };
            let kind = d.kind.map_or("unclassified", |k| k.name());
            let note = format!("divergence: {} ({kind})", describe(&d.at));
            let grid = if d.at.level == "L2" {
                let row = d.at.layer.and_then(|l| {
                    self.persistent
                        .rows
                        .iter()
                        .position(|x| *x == state_row(l as usize, &d.at.path))
                });
                row.map(|r| (&mut self.persistent, r))
            } else {
                d.at.layer.map(|l| (&mut self.layer_state, l as usize))
            };
            match (grid, col.get(&d.at.step)) {
                (Some((g, row)), Some(&ci)) => {
                    if let Some(cell) = g.at(row, ci) {
                        if !cell.marks.contains(mark) {
                            cell.marks.push(mark);
                        }
                        cell.notes.push(note);
                    }
                }
                _ => self.global.push(note),
            }
        }
        if let Some(f) = &report.first_divergence {
            if let (Some(l), Some(&ci)) = (f.layer, col.get(&f.step)) {
                let target = if f.level == "L2" {
                    self.persistent
                        .rows
                        .iter()
                        .position(|x| *x == state_row(l as usize, &f.operator))
                        .map(|r| (&mut self.persistent, r))
                } else {
                    Some((&mut self.layer_state, l as usize))
                };
                if let Some(cell) = target.and_then(|(g, r)| g.at(r, ci)) {
                    cell.first = true;
                }
            }
        }
    }
}

/// Whether a component is a post-mHC layer-state checkpoint.
fn is_checkpoint(c: Component) -> bool {
    matches!(c, Component::LayerPostAttnMhc | Component::LayerPostFfnMhc)
}

/// The row label of a persistent-state component.
fn state_row(layer: usize, path: &str) -> String {
    format!("layer {layer} {path}")
}

/// A record reference as text.
fn describe(r: &RecordRef) -> String {
    match r.layer {
        Some(l) => format!("step {} pos {} layer {l} {}", r.step, r.position, r.path),
        None => format!("step {} pos {} {}", r.step, r.position, r.path),
    }
}

/// Every record of `t`, in write order: the index [`DiffMaps::gather`]
/// loaded (and verified) first; empty if it could not.
fn all(t: &Trace) -> &[IndexEntry] {
    t.records().unwrap_or(&[])
}

/// The number of values of a record.
fn elements(e: &IndexEntry) -> u64 {
    e.shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .unwrap_or(0)
}

/// Rows `layer 0 …` over every layer either trace has.
fn layer_grid(r: &Trace, c: &Trace, cols: Vec<String>) -> Grid {
    let layers = all(r)
        .iter()
        .chain(all(c))
        .filter_map(|e| e.coord.layer)
        .max()
        .map_or(0, |l| l as usize + 1);
    Grid::new((0..layers).map(|l| format!("layer {l}")).collect(), cols)
}

/// Rows for every (layer, state component) either trace has.
fn state_grid(r: &Trace, c: &Trace, cols: Vec<String>) -> Grid {
    let rows: BTreeSet<(u32, String)> = all(r)
        .iter()
        .chain(all(c))
        .filter(|e| e.level == Level::L2)
        .filter_map(|e| Some((e.coord.layer?, e.coord.path.as_str().to_string())))
        .collect();
    Grid::new(
        rows.into_iter().map(|(l, p)| state_row(l as usize, &p)).collect(),
        cols,
    )
}

/// A verified payload, `None` when the record holds none.
fn payload(t: &Trace, i: usize) -> Result<Option<&[u8]>, ReportError> {
    t.payload_verified(i).map_err(|source| ReportError::Payload {
        path: t.path().to_path_buf(),
        record: i,
        source,
    })
}

/// (differing, elements, max |Δ|) of a float record present on both sides
/// with values; `None` otherwise.
fn compare_pair(
    r: &Trace,
    c: &Trace,
    (ri, ci): (Option<usize>, Option<usize>),
) -> Result<Option<(u64, u64, f64)>, ReportError> {
    let (Some(ri), Some(ci)) = (ri, ci) else {
        return Ok(None);
    };
    let (re, ce) = (r.record(ri), c.record(ci));
    if !re.dtype.is_float() {
        return Ok(None);
    }
    let (Some(rb), Some(cb)) = (payload(r, ri)?, payload(c, ci)?) else {
        return Ok(None);
    };
    Ok(
        summarize(re.dtype, &re.shape, rb, ce.dtype, &ce.shape, cb).map(|s| {
            let m = if s.max_abs_delta.is_finite() {
                s.max_abs_delta
            } else {
                f64::INFINITY
            };
            (s.differing, s.elements, m)
        }),
    )
}

/// For a differing `router.topk`: "pos P: entering [..], leaving [..]".
fn route_note(
    r: &Trace,
    c: &Trace,
    (ri, ci): (Option<usize>, Option<usize>),
) -> Result<Option<String>, ReportError> {
    let (Some(ri), Some(ci)) = (ri, ci) else {
        return Ok(None);
    };
    let re = r.record(ri);
    if !Component::RouterTopk.matches(re.coord.path.as_str()) {
        return Ok(None);
    }
    let ce = c.record(ci);
    let (Some(rb), Some(cb)) = (payload(r, ri)?, payload(c, ci)?) else {
        return Ok(Some(format!(
            "route change at pos {} (no values)",
            re.coord.position
        )));
    };
    let (Some(a), Some(b)) = (int_values(re.dtype, rb), int_values(ce.dtype, cb)) else {
        return Ok(None);
    };
    let ids = compare_ids(&a, &b);
    Ok(Some(if ids.reordered {
        format!("route at pos {}: same experts reordered", re.coord.position)
    } else {
        format!(
            "route change at pos {}: entering {:?}, leaving {:?}",
            re.coord.position, ids.entering, ids.leaving
        )
    }))
}

/// Both sides' `lm.margin` per step.
fn margins(r: &Trace, c: &Trace, report: &DiffReport) -> Result<MarginSeries, ReportError> {
    let read = |t: &Trace| -> Result<BTreeMap<u32, f64>, ReportError> {
        let mut m = BTreeMap::new();
        for (i, e) in all(t).iter().enumerate() {
            if Component::LmMargin.matches(e.coord.path.as_str()) {
                if let Some(v) = payload(t, i)?.and_then(|b| e.dtype.value_f64(b, 0)) {
                    m.insert(e.coord.step, v);
                }
            }
        }
        Ok(m)
    };
    let (a, b) = (read(r)?, read(c)?);
    let steps: Vec<u32> = a
        .keys()
        .chain(b.keys())
        .copied()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    Ok(MarginSeries {
        reference: steps.iter().map(|s| a.get(s).copied()).collect(),
        candidate: steps.iter().map(|s| b.get(s).copied()).collect(),
        steps,
        first_token_change: report.levels.l0.first.as_ref().map(|f| f.step),
    })
}

/// The |Δ| histogram of the localized operator (or of the first divergence
/// when nothing is localized at L4).
fn histogram(r: &Trace, c: &Trace, report: &DiffReport) -> Result<Option<Histogram>, ReportError> {
    let at = report
        .levels
        .l4
        .localized
        .as_ref()
        .map(|l| &l.at)
        .or_else(|| report.divergences.first().map(|d| &d.at));
    let Some(at) = at else { return Ok(None) };
    let find = |t: &Trace| {
        all(t).iter().position(|e| {
            e.coord.step == at.step
                && e.coord.position == at.position
                && e.coord.layer == at.layer
                && e.coord.path.as_str() == at.path
        })
    };
    let (Some(ri), Some(ci)) = (find(r), find(c)) else {
        return Ok(None);
    };
    let (re, ce) = (r.record(ri), c.record(ci));
    if !re.dtype.is_float() || re.dtype != ce.dtype || re.shape != ce.shape {
        return Ok(None);
    }
    let (Some(rb), Some(cb)) = (payload(r, ri)?, payload(c, ci)?) else {
        return Ok(None);
    };
    let n = rb.len() / re.dtype.size().max(1);
    let mut bins: BTreeMap<i32, u64> = BTreeMap::new();
    let mut equal = 0u64;
    let mut worst: Vec<(f64, usize, f64, f64)> = Vec::new();
    for i in 0..n {
        let (Some(a), Some(b)) = (re.dtype.value_f64(rb, i), ce.dtype.value_f64(cb, i)) else {
            continue;
        };
        if a.to_bits() == b.to_bits() || a == b {
            equal += 1;
            continue;
        }
        let d = (a - b).abs();
        let decade = if d.is_finite() && d > 0.0 {
            d.log10().floor() as i32
        } else {
            300
        };
        *bins.entry(decade).or_default() += 1;
        worst.push((if d.is_nan() { f64::INFINITY } else { d }, i, a, b));
    }
    worst.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
    worst.truncate(WORST);
    Ok(Some(Histogram {
        record: describe(at),
        bins: bins.into_iter().collect(),
        equal,
        worst: worst
            .into_iter()
            .map(|(_, i, a, b)| (unravel(i as u64, &re.shape), a, b))
            .collect(),
    }))
}
