//! The diff (and gate) report page.

use crate::charts::{bar_chart, line_chart, Series};
use crate::error::ReportError;
use crate::grid::{heatmap, Grid, HeatmapStyle, Measure, MAX_COLUMNS, MAX_ROWS};
use crate::maps::DiffMaps;
use crate::page::Page;
use crate::scale::LogScale;
use moeconf_bisect::{DiffReport, Verdict};
use moeconf_schema::Trace;

/// The gate's verdict, shown above the diff when the page reports a gate run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GateSummary {
    /// `PASS`, `WARN` or `FAIL`.
    pub verdict: String,
    /// Where the policy came from.
    pub policy: String,
    /// One line per check (failures first).
    pub lines: Vec<String>,
}

/// Renders the HTML report of `report`, the diff of `reference` and
/// `candidate` (both opened verified); `gate` adds the gate's verdict.
/// Deterministic: the same inputs give the same bytes.
pub fn render_diff(
    reference: &Trace,
    candidate: &Trace,
    report: &DiffReport,
    gate: Option<&GateSummary>,
) -> Result<String, ReportError> {
    let maps = DiffMaps::gather(reference, candidate, report)?;
    let title = if gate.is_some() {
        "moeconf gate report"
    } else {
        "moeconf diff report"
    };
    let mut p = Page::new(title);
    p.h1(title);
    if let Some(g) = gate {
        gate_header(&mut p, g);
    }
    header(&mut p, report);
    divergences(&mut p, report, &maps);
    layer_state(&mut p, &maps.layer_state);
    persistent(&mut p, &maps.persistent);
    margins(&mut p, &maps);
    localized(&mut p, &maps);
    Ok(p.finish())
}

/// The page of a gate run against a baseline (digests only): the verdict
/// and the gate's report, without pictures (they need a reference trace).
pub fn render_gate_only(gate: &GateSummary) -> String {
    let mut p = Page::new("moeconf gate report");
    p.h1("moeconf gate report");
    gate_header(&mut p, gate);
    p.note("Compared against a baseline, which holds digests only: the layer x step pictures need a reference trace (moeconf gate REFERENCE CANDIDATE --html FILE).");
    p.finish()
}

/// The gate verdict badge and its text report.
fn gate_header(p: &mut Page, g: &GateSummary) {
    let class = match g.verdict.as_str() {
        "PASS" => "good",
        "WARN" => "warn",
        _ => "bad",
    };
    p.badge(&g.verdict, class, &format!("gate verdict ({})", g.policy));
    p.pre(&g.lines.join("\n"));
}

/// Verdict, the two traces, the first divergence and the contracts.
fn header(p: &mut Page, r: &DiffReport) {
    let (label, class) = match r.verdict {
        Verdict::Equivalent => ("EQUIVALENT", "good"),
        Verdict::Divergent => ("DIVERGENT", "bad"),
    };
    p.badge(label, class, &r.summary);
    let side = |s: &moeconf_bisect::TraceSummary| {
        format!(
            "{} (runtime {}, precision {}, contract {}, {} steps, root {})",
            s.path,
            s.runtime,
            s.precision,
            s.contract,
            s.steps,
            &s.root[..s.root.len().min(16)]
        )
    };
    let mut rows = vec![
        vec!["reference".into(), side(&r.reference)],
        vec!["candidate".into(), side(&r.candidate)],
    ];
    if let Some(f) = &r.first_divergence {
        let layer = f.layer.map_or(String::new(), |l| format!(" layer {l}"));
        let kind = f
            .kind
            .map_or("unclassified".to_string(), |k| k.name().to_string());
        rows.push(vec![
            "first divergence".into(),
            format!(
                "{} step {} position {}{layer} operator {} ({kind})",
                f.level, f.step, f.position, f.operator
            ),
        ]);
    }
    if let Some(c) = &r.levels.l4.contract {
        if let Some(cand) = &c.candidate {
            rows.push(vec!["candidate contract".into(), cand.clone()]);
        }
        if let Some(re) = &c.reference {
            rows.push(vec!["reference contract".into(), re.clone()]);
        }
        if let Some(n) = &c.candidate_note {
            rows.push(vec!["candidate contract note".into(), n.clone()]);
        }
        if let Some(n) = &c.reference_note {
            rows.push(vec!["reference contract note".into(), n.clone()]);
        }
    }
    p.table("head", &[], &rows);
}

/// The list of divergences (absorbed / propagating).
fn divergences(p: &mut Page, r: &DiffReport, maps: &DiffMaps) {
    if r.divergences.is_empty() {
        return;
    }
    p.h2("Divergences in execution order");
    p.note("Each row is a record that differs while its inputs match. Propagating: a later checkpoint it can reach differs (marked P on the maps). Absorbed: rounding erased it before the next checkpoint (marked A).");
    let rows: Vec<Vec<String>> = r
        .divergences
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let at = &d.at;
            vec![
                (i + 1).to_string(),
                at.level.clone(),
                at.step.to_string(),
                at.position.to_string(),
                at.layer.map_or("-".into(), |l| l.to_string()),
                at.path.clone(),
                d.kind.map_or("unclassified".into(), |k| k.name().into()),
                d.checkpoint.as_ref().map_or("-".into(), |c| {
                    format!(
                        "step {} layer {} {}",
                        c.step,
                        c.layer.map_or("-".into(), |l| l.to_string()),
                        c.path
                    )
                }),
            ]
        })
        .collect();
    p.table(
        "",
        &[
            "#",
            "level",
            "step",
            "pos",
            "layer",
            "record",
            "kind",
            "deciding checkpoint",
        ],
        &rows,
    );
    for g in &maps.global {
        p.note(g);
    }
}

/// The two L3 heatmaps side by side and the route changes.
fn layer_state(p: &mut Page, g: &Grid) {
    p.h2("L3 layer state (post-mHC) over layers × steps");
    if g.rows.is_empty() || g.cols.is_empty() {
        p.note("No layer-state checkpoints in these traces.");
        return;
    }
    let a = g.aggregated(MAX_ROWS, MAX_COLUMNS);
    if a.cols.len() < g.cols.len() || a.rows.len() < g.rows.len() {
        p.note(&format!(
            "{} steps × {} layers aggregated into {} × {} cells (counts summed, max |Δ| maximal).",
            g.cols.len(),
            g.rows.len(),
            a.cols.len(),
            a.rows.len()
        ));
    }
    if let Some(spread) = spread(g) {
        p.note(&spread);
    }
    p.note("Each cell: both post-mHC checkpoints (attention and FFN half) of a layer at a step, all positions. Red outline: the first divergence. Marks: P propagating, A absorbed, R route change. Hover a cell for its numbers.");
    let frac = HeatmapStyle {
        label: "fraction of layer-state values that differ, layers by steps",
        x_title: "decode step (0 = prefill)",
        y_title: "layer",
        unit: "fraction of values differing",
        measure: Measure::Fraction,
        scale: LogScale::covering(
            a.values(Measure::Fraction).into_iter(),
            LogScale { lo: -4, hi: 0 },
        ),
    };
    let abs = HeatmapStyle {
        label: "largest absolute difference of layer-state values, layers by steps",
        unit: "max |Δ| (value units)",
        measure: Measure::MaxAbs,
        scale: LogScale::covering(a.values(Measure::MaxAbs).into_iter(), LogScale { lo: -4, hi: 0 }),
        ..frac
    };
    p.row_start();
    p.figure(&heatmap(&a, &frac), "Fraction of values that differ (log scale).");
    p.figure(&heatmap(&a, &abs), "Largest |Δ| (log scale).");
    p.row_end();
    let routes: Vec<Vec<String>> = g
        .cells
        .iter()
        .enumerate()
        .filter_map(|(i, c)| Some((i, c.as_ref()?)))
        .filter(|(_, c)| c.marks.contains('R'))
        .flat_map(|(i, c)| {
            let (r, col) = (i / g.cols.len(), i % g.cols.len());
            c.notes
                .iter()
                .filter(|n| n.starts_with("route"))
                .map(move |n| vec![g.cols[col].clone(), g.rows[r].clone(), n.clone()])
        })
        .take(64)
        .collect();
    if !routes.is_empty() {
        p.details_start(&format!(
            "Route changes (router.topk), the first {}",
            routes.len()
        ));
        p.table("", &["step", "layer", "change"], &routes);
        p.details_end();
    }
}

/// How the difference spreads, in words: the first step where a layer's
/// state differs and which layers differ there, and the first step from
/// which every layer differs.
fn spread(g: &Grid) -> Option<String> {
    let differs = |r: usize, c: usize| g.get(r, c).is_some_and(|x| x.differs());
    let first = (0..g.cols.len()).find(|&c| (0..g.rows.len()).any(|r| differs(r, c)))?;
    let layers: Vec<usize> = (0..g.rows.len()).filter(|&r| differs(r, first)).collect();
    let mut text = format!(
        "Spread: the layer state first differs at step {}, in {} of {} layers ({});",
        g.cols[first],
        layers.len(),
        g.rows.len(),
        ranges(&layers)
    );
    let every = |c: usize| (0..g.rows.len()).all(|r| differs(r, c) || g.get(r, c).is_none());
    let all = (first..g.cols.len()).find(|&c| (c..g.cols.len()).all(every));
    match all {
        Some(c) => text.push_str(&format!(" every layer differs from step {} on.", g.cols[c])),
        None => text.push_str(" no later step has every layer differing."),
    }
    Some(text)
}

/// `0-3, 5, 7-8` for row indices shown as layers.
fn ranges(v: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            format!("layer {}", v[i])
        } else {
            format!("layers {}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

/// The L2 persistent-state heatmap.
fn persistent(p: &mut Page, g: &Grid) {
    p.h2("L2 persistent state per component × layer over decode boundaries");
    if g.rows.is_empty() {
        p.note("No persistent-state records in these traces.");
        return;
    }
    let a = g.aggregated(MAX_ROWS / 2, MAX_COLUMNS);
    let st = HeatmapStyle {
        label: "fraction of persistent-state values that differ, by component and layer over boundaries",
        x_title: "boundary after step",
        y_title: "layer and state component",
        unit: "fraction of values differing",
        measure: Measure::Fraction,
        scale: LogScale::covering(
            a.values(Measure::Fraction).into_iter(),
            LogScale { lo: -4, hi: 0 },
        ),
    };
    p.figure(&heatmap(&a, &st), "What each layer carries from one token to the next (KV window, compressor and indexer buffers), compared after every step.");
}

/// Both sides' top-1 margins with the first token change.
fn margins(p: &mut Page, maps: &DiffMaps) {
    let m = &maps.margins;
    p.h2("L1 top-1 margins over steps");
    if m.steps.is_empty() {
        p.note("No lm.margin records with values in these traces.");
        return;
    }
    let xs: Vec<String> = m.steps.iter().map(|s| s.to_string()).collect();
    let marker = m
        .first_token_change
        .and_then(|s| m.steps.iter().position(|&x| x == s))
        .map(|i| (i, "first token change"));
    let series = [
        Series {
            name: "reference",
            values: &m.reference,
            color: "#1f77b4",
            dashed: false,
        },
        Series {
            name: "candidate",
            values: &m.candidate,
            color: "#ff7f0e",
            dashed: true,
        },
    ];
    let svg = line_chart(
        &xs,
        &series,
        marker,
        "top-1 minus top-2 logit margin per step, reference and candidate",
        "margin (logit units)",
    );
    p.figure(
        &svg,
        "A small margin is a near tie: the smallest difference upstream can flip the token there.",
    );
}

/// The localized operator's |Δ| histogram and worst elements.
fn localized(p: &mut Page, maps: &DiffMaps) {
    let Some(h) = &maps.histogram else { return };
    p.h2(&format!("Localized operator: {}", h.record));
    let bars: Vec<(String, u64)> = h.bins.iter().map(|(d, n)| (format!("1e{d}"), *n)).collect();
    let differing: u64 = h.bins.iter().map(|b| b.1).sum();
    p.note(&format!("{differing} values differ, {} are equal. |Δ| by decade (a bar labelled 1e-3 counts 1e-3 ≤ |Δ| < 1e-2):", h.equal));
    if !bars.is_empty() {
        p.raw(&bar_chart(
            &bars,
            "histogram of absolute differences by decade",
            "|Δ| decade",
            "values",
            "#3e4989",
        ));
    }
    let rows: Vec<Vec<String>> = h
        .worst
        .iter()
        .map(|(i, a, b)| {
            vec![
                format!("{i:?}"),
                format!("{a:.6e}"),
                format!("{b:.6e}"),
                format!("{:.3e}", (a - b).abs()),
            ]
        })
        .collect();
    p.table("", &["index", "reference", "candidate", "|Δ|"], &rows);
}
