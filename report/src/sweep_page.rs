//! The sweep report page: how many fork branches land in each distinct
//! continuation (the paper's basin rank-frequency) and where continuations
//! part from the native one.

use crate::charts::bar_chart;
use crate::grid::{heatmap, Cell, Grid, HeatmapStyle, Measure, MAX_COLUMNS, MAX_ROWS};
use crate::page::Page;
use crate::scale::LogScale;
use std::collections::BTreeMap;

/// One branch of a sweep: its label and generated tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SweepBranch {
    /// E.g. `B class 135` or `A order 17`.
    pub label: String,
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// The text of each generated token (same length as `tokens`).
    pub pieces: Vec<String>,
}

/// Everything the sweep page shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SweepView {
    /// (field, value) lines of the header: model, prompt, fork point, schemes.
    pub header: Vec<(String, String)>,
    /// The native branch.
    pub reference: SweepBranch,
    /// Every forked branch, in sweep order.
    pub branches: Vec<SweepBranch>,
}

/// A distinct continuation and the branches that produce it.
struct Basin<'a> {
    tokens: &'a [u32],
    pieces: &'a [String],
    labels: Vec<&'a str>,
}

/// Renders the sweep page. Deterministic: basins are ranked by size, ties
/// by the first branch that reached them.
pub fn render_sweep(v: &SweepView) -> String {
    let basins = basins(v);
    let mut p = Page::new("moeconf sweep report");
    p.h1("moeconf sweep report");
    let native = basins
        .iter()
        .position(|b| b.tokens == v.reference.tokens.as_slice());
    let departed: usize = basins
        .iter()
        .filter(|b| b.tokens != v.reference.tokens.as_slice())
        .map(|b| b.labels.len())
        .sum();
    let class = if departed > 0 { "bad" } else { "good" };
    p.badge(
        &format!("{} basins", basins.len()),
        class,
        &format!(
            "{} branches; {departed} end in a continuation other than the native one",
            v.branches.len()
        ),
    );
    let mut rows: Vec<Vec<String>> = v.header.iter().map(|(a, b)| vec![a.clone(), b.clone()]).collect();
    rows.push(vec!["native continuation".into(), v.reference.pieces.concat()]);
    p.table("head", &[], &rows);

    p.h2("Basin rank-frequency");
    p.note("Branches per distinct continuation, largest first (the paper's basin rank-frequency). The native continuation's rank is marked in the table.");
    let bars: Vec<(String, u64)> = basins
        .iter()
        .take(MAX_COLUMNS)
        .enumerate()
        .map(|(i, b)| ((i + 1).to_string(), b.labels.len() as u64))
        .collect();
    p.raw(&bar_chart(
        &bars,
        "branches per distinct continuation by rank",
        "rank",
        "branches",
        "#31688e",
    ));
    let rows: Vec<Vec<String>> = basins
        .iter()
        .take(40)
        .enumerate()
        .map(|(i, b)| {
            vec![
                format!("{}{}", i + 1, if Some(i) == native { " (native)" } else { "" }),
                b.labels.len().to_string(),
                first_difference(b.tokens, &v.reference.tokens).map_or("-".into(), |d| d.to_string()),
                b.pieces.concat(),
                b.labels.iter().take(4).copied().collect::<Vec<_>>().join(", "),
            ]
        })
        .collect();
    p.table(
        "",
        &[
            "rank",
            "branches",
            "first differing token",
            "continuation",
            "branches (first 4)",
        ],
        &rows,
    );

    p.h2("Where continuations part (basin × token)");
    let g = token_grid(&basins, v);
    let st = HeatmapStyle {
        label: "generated tokens of each basin compared with the native continuation",
        x_title: "generated token",
        y_title: "basin (rank, branches)",
        unit: "token differs from native",
        measure: Measure::Fraction,
        scale: LogScale { lo: -1, hi: 0 },
    };
    p.figure(
        &heatmap(&g.aggregated(MAX_ROWS, MAX_COLUMNS), &st),
        "White: the same token as the native continuation; coloured: a different token (hover for the text). The red outline marks each basin's first differing token.",
    );
    p.finish()
}

/// Distinct continuations, largest first.
fn basins(v: &SweepView) -> Vec<Basin<'_>> {
    let mut by: BTreeMap<&[u32], (usize, Basin<'_>)> = BTreeMap::new();
    for (i, b) in v.branches.iter().enumerate() {
        by.entry(b.tokens.as_slice())
            .or_insert_with(|| {
                (
                    i,
                    Basin {
                        tokens: &b.tokens,
                        pieces: &b.pieces,
                        labels: Vec::new(),
                    },
                )
            })
            .1
            .labels
            .push(&b.label);
    }
    let mut out: Vec<(usize, Basin<'_>)> = by.into_values().collect();
    out.sort_by(|a, b| b.1.labels.len().cmp(&a.1.labels.len()).then(a.0.cmp(&b.0)));
    out.into_iter().map(|x| x.1).collect()
}

/// The first token index at which `a` and `b` differ.
fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or_else(|| (a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// Basins × token positions: a cell differs where the basin's token is not
/// the native one.
fn token_grid(basins: &[Basin<'_>], v: &SweepView) -> Grid {
    let len = basins.iter().map(|b| b.tokens.len()).max().unwrap_or(0);
    let mut g = Grid::new(
        basins
            .iter()
            .enumerate()
            .map(|(i, b)| format!("#{} ({})", i + 1, b.labels.len()))
            .collect(),
        (0..len).map(|i| i.to_string()).collect(),
    );
    for (r, b) in basins.iter().enumerate() {
        let first = first_difference(b.tokens, &v.reference.tokens);
        for (c, &t) in b.tokens.iter().enumerate() {
            let differs = v.reference.tokens.get(c) != Some(&t);
            let piece = b.pieces.get(c).map_or("", String::as_str);
            let native = v.reference.pieces.get(c).map_or("", String::as_str);
            if let Some(cell) = g.at(r, c) {
                *cell = Cell {
                    elements: 1,
                    differing: u64::from(differs),
                    max_abs: 0.0,
                    records: 1,
                    first: first == Some(c),
                    notes: vec![format!("token {t} {piece:?} (native {native:?})")],
                    ..Cell::default()
                };
            }
        }
    }
    g
}
