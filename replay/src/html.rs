//! The replay report as the HTML origin map ([`moeconf_report::render_replay`]):
//! rows embed, layer 0 … layer L−1, head; columns steps; each cell the worst
//! outcome of its units (an origin over propagation over reproduction).

use crate::report::{LayerReport, Status, UnitResult};
use crate::units::Part;
use moeconf_report::{OriginCell, OriginKind, ReplayView};

/// What the page shows of `r`.
pub fn html_view(r: &LayerReport) -> ReplayView {
    let mut steps: Vec<u32> = r.units.iter().map(|u| u.unit.step).collect();
    steps.sort_unstable();
    steps.dedup();
    let layers = r.layers as usize;
    let mut rows = vec!["embed".to_string()];
    rows.extend((0..layers).map(|l| format!("layer {l}")));
    rows.push("head".into());
    let ncols = steps.len();
    let mut cells: Vec<Option<OriginCell>> = vec![None; rows.len() * ncols];
    let mut origins = Vec::new();
    for u in &r.units {
        let row = match (u.unit.part, u.unit.layer) {
            (Part::Embed, _) => 0,
            (Part::Head, _) => layers + 1,
            (_, Some(l)) if (l as usize) < layers => l as usize + 1,
            _ => continue,
        };
        let Ok(col) = steps.binary_search(&u.unit.step) else {
            continue;
        };
        let (kind, title) = describe(u);
        let slot = &mut cells[row * ncols + col];
        match slot {
            Some(c) if c.kind >= kind => {
                c.title.push_str("; ");
                c.title.push_str(&title);
            }
            Some(c) => {
                c.title = format!("{title}; {}", c.title);
                c.kind = kind;
            }
            None => *slot = Some(OriginCell { kind, title }),
        }
        if u.status == Status::Origin {
            origins.push(vec![
                u.unit.step.to_string(),
                u.unit.layer.map_or("-".into(), |l| l.to_string()),
                u.unit.part.name().to_string(),
                u.first_difference
                    .as_ref()
                    .map_or("-".into(), |d| format!("{} (position {})", d.record, d.position)),
                u.reproduced_under.clone().unwrap_or_else(|| "-".into()),
            ]);
        }
    }
    let count = |s: Status| r.units.iter().filter(|u| u.status == s).count();
    ReplayView {
        header: vec![
            ("candidate".into(), r.candidate.clone()),
            ("model".into(), r.model.clone()),
            ("precision".into(), r.precision.clone()),
            ("reference contract".into(), r.contract.clone()),
        ],
        summary: format!(
            "{} origin(s), {} unit(s) propagating, {} reproduced, {} not replayable, of {} units{}",
            count(Status::Origin),
            r.propagated(),
            count(Status::Reproduced),
            count(Status::NotReplayable),
            r.units.len(),
            // The page never reads as a plain REPRODUCED when steps are missing.
            r.incomplete.as_ref().map_or(String::new(), |c| format!("; {c}"))
        ),
        has_origin: count(Status::Origin) > 0,
        rows,
        cols: steps.iter().map(|s| s.to_string()).collect(),
        cells,
        origins,
    }
}

/// The map category and tooltip of one unit.
fn describe(u: &UnitResult) -> (OriginKind, String) {
    let part = u.unit.part.name();
    match u.status {
        Status::Origin => {
            let at = u.first_difference.as_ref().map_or(String::new(), |d| {
                format!(" at {} (position {})", d.record, d.position)
            });
            let kind = match (&u.reproduced_under, u.absorbed) {
                (Some(_), _) => OriginKind::UnderContract,
                (None, true) => OriginKind::AbsorbedOrigin,
                (None, false) => OriginKind::Origin,
            };
            let under = u
                .reproduced_under
                .as_ref()
                .map_or(String::new(), |c| format!(", reproduced under {c}"));
            (kind, format!("{part}: origin{at}{under}"))
        }
        Status::NotReplayable => (OriginKind::NotReplayable, format!("{part}: not replayable")),
        Status::Reproduced if u.propagates() => (
            OriginKind::Propagated,
            format!("{part}: reproduced (propagation)"),
        ),
        Status::Reproduced => (OriginKind::Reproduced, format!("{part}: reproduced")),
    }
}
