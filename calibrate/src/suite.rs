//! The whole suite: runs the selected protocols in the paper's order, times
//! them, and assembles `calibration.json` (docs/calibration.md).

use std::path::Path;
use std::time::Instant;

use moeconf_reference_runtime::precision::Precision;
use serde_json::{json, Value};

use crate::{
    breadth, fault_matrix, fork_sweep, persistent, propagation, replay, substitution, write_atomic,
    CalibrateError, Claim, Ctx, Result, Section, Sizes, Table,
};

/// Version of `calibration.json`.
pub const CALIBRATION_SCHEMA_VERSION: u32 = 1;

/// The highest protocol number (protocols are numbered 1..=`PROTOCOL_COUNT`).
pub const PROTOCOL_COUNT: u32 = 10;

/// One entry of the suite: a protocol function and the numbers that select it.
struct Protocol {
    /// Key of its progress line, timing and error context.
    name: &'static str,
    /// Protocol numbers (`--only`) that select it (3, 4 and 5 run together).
    numbers: &'static [u32],
    /// Runs it.
    run: fn(&Ctx) -> Result<Vec<Section>>,
}

/// The suite, in the paper's order.
const PROTOCOLS: [Protocol; 8] = [
    Protocol {
        name: "replay",
        numbers: &[1],
        run: |ctx| Ok(vec![replay::run(ctx)?]),
    },
    Protocol {
        name: "fork_sweep",
        numbers: &[2],
        run: |ctx| Ok(vec![fork_sweep::run(ctx)?]),
    },
    Protocol {
        name: "persistent",
        numbers: &[3, 4, 5],
        run: persistent::run,
    },
    Protocol {
        name: "post_mhc_substitution",
        numbers: &[6],
        run: |ctx| Ok(vec![substitution::post_mhc(ctx)?]),
    },
    Protocol {
        name: "persistent_state_substitution",
        numbers: &[7],
        run: |ctx| Ok(vec![substitution::persistent_state(ctx)?]),
    },
    Protocol {
        name: "propagation",
        numbers: &[8],
        run: |ctx| Ok(vec![propagation::run(ctx)?]),
    },
    Protocol {
        name: "breadth",
        numbers: &[9],
        run: |ctx| Ok(vec![breadth::run(ctx)?]),
    },
    Protocol {
        name: "fault_matrix",
        numbers: &[10],
        run: |ctx| Ok(vec![fault_matrix::run(ctx)?]),
    },
];

/// How long one protocol took.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Timing {
    /// The protocol's key.
    pub protocol: &'static str,
    /// Wall-clock seconds.
    pub seconds: f64,
}

/// What the suite produced.
#[derive(Debug, Clone)]
pub struct Suite {
    /// Every protocol's sections, in the paper's order.
    pub sections: Vec<Section>,
    /// Per-protocol wall-clock times.
    pub timings: Vec<Timing>,
}

/// The run description recorded at the top of `calibration.json`.
pub struct RunInfo<'a> {
    /// The model as given (`builtin:tiny-v4` or a directory).
    pub model: &'a str,
    /// Precision profile.
    pub precision: Precision,
    /// Whether the reduced sizes were asked for.
    pub quick: bool,
    /// Layer of the single-layer fork.
    pub fork_layer: u32,
    /// The sizes used.
    pub sizes: Sizes,
}

/// Checks a `--only` list: every number must name a protocol.
pub fn check_selection(only: &[u32]) -> Result<()> {
    match only.iter().find(|&&p| !(1..=PROTOCOL_COUNT).contains(&p)) {
        Some(bad) => Err(CalibrateError::Invalid(format!(
            "--only {bad}: protocols are numbered 1..{PROTOCOL_COUNT}"
        ))),
        None => Ok(()),
    }
}

/// Runs the protocols `only` selects (all when empty), in the paper's
/// order; a failing protocol stops the suite with its name in the error.
pub fn run(ctx: &Ctx, only: &[u32]) -> Result<Suite> {
    let want = |p: &Protocol| only.is_empty() || p.numbers.iter().any(|n| only.contains(n));
    let mut suite = Suite {
        sections: Vec::new(),
        timings: Vec::new(),
    };
    for p in PROTOCOLS.iter().filter(|p| want(p)) {
        let t = Instant::now();
        let sections = (p.run)(ctx).map_err(|e| CalibrateError::Protocol {
            name: p.name,
            source: Box::new(e),
        })?;
        let seconds = t.elapsed().as_secs_f64();
        ctx.note(&format!("    {} done in {seconds:.1} s", p.name));
        suite.timings.push(Timing {
            protocol: p.name,
            seconds,
        });
        suite.sections.extend(sections);
    }
    Ok(suite)
}

impl Suite {
    /// Every table, in print order.
    pub fn tables(&self) -> impl Iterator<Item = &Table> {
        self.sections.iter().flat_map(|s| &s.tables)
    }

    /// Every structural claim, in order.
    pub fn claims(&self) -> Vec<Claim> {
        self.sections
            .iter()
            .flat_map(|s| s.claims.iter().cloned())
            .collect()
    }

    /// Whether every structural claim holds (the suite's exit status).
    pub fn all_hold(&self) -> bool {
        self.sections.iter().flat_map(|s| &s.claims).all(|c| c.holds)
    }

    /// The claims block printed after the tables.
    pub fn render_claims(&self) -> String {
        let mut o = String::from("Structural claims:\n");
        for c in self.sections.iter().flat_map(|s| &s.claims) {
            let mark = if c.holds { "ok" } else { "FAIL" };
            o.push_str(&format!("  [{mark}] {}: {}\n", c.id, c.detail));
        }
        o
    }

    /// The `calibration.json` document; `wall_seconds` is the whole command's time.
    pub fn to_json(&self, info: &RunInfo<'_>, wall_seconds: f64) -> Value {
        let mut protocols = serde_json::Map::new();
        for s in &self.sections {
            protocols.insert(s.key.clone(), s.json.clone());
        }
        let sizes = &info.sizes;
        json!({
            "schema_version": CALIBRATION_SCHEMA_VERSION,
            "kind": "moeconf.calibration",
            "model": info.model,
            "precision": info.precision.name(),
            "quick": info.quick,
            "fork_layer": info.fork_layer,
            "sizes": {
                "tokens": sizes.tokens, "fork_tokens": sizes.fork_tokens,
                "fork_branches": if sizes.fork_branches == usize::MAX { None } else { Some(sizes.fork_branches) },
                "seeds": sizes.seeds, "control_tokens": sizes.control_tokens, "horizons": sizes.horizons,
            },
            "protocols": protocols,
            "claims": self.claims(),
            "all_claims_hold": self.all_hold(),
            "timings": self.timings,
            "wall_seconds": wall_seconds,
        })
    }
}

/// Writes a JSON document (pretty, trailing newline) to `path`, atomically.
pub fn write_json(path: &Path, doc: &Value) -> Result<()> {
    let mut bytes = serde_json::to_vec_pretty(doc)?;
    bytes.push(b'\n');
    write_atomic(path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_protocol_number_selects_exactly_one_entry() {
        for n in 1..=PROTOCOL_COUNT {
            assert_eq!(
                PROTOCOLS.iter().filter(|p| p.numbers.contains(&n)).count(),
                1,
                "{n}"
            );
        }
        assert!(check_selection(&[1, 10]).is_ok());
        let e = check_selection(&[0]).unwrap_err().to_string();
        assert_eq!(e, "--only 0: protocols are numbered 1..10");
    }

    #[test]
    fn claims_block_and_verdict() {
        let section = |holds| Section {
            key: "k".into(),
            tables: vec![],
            json: Value::Null,
            claims: vec![Claim::new("c", holds, "detail".into())],
        };
        let mut s = Suite {
            sections: vec![section(true)],
            timings: vec![],
        };
        assert!(s.all_hold());
        assert_eq!(s.render_claims(), "Structural claims:\n  [ok] c: detail\n");
        s.sections.push(section(false));
        assert!(!s.all_hold());
        assert!(s.render_claims().ends_with("  [FAIL] c: detail\n"));
    }
}
