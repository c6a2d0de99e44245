//! The result of a matrix: one cell per configuration (tokens equal?, logits
//! bitwise?, L0–L4 verdicts, first divergent step/layer/operator, the
//! expectation and whether it held), as JSON, text and the HTML matrix.

use crate::expect::Expectations;
use crate::matrix::{Backend, Configuration, Knobs, Matrix};
use moeconf_bisect::{DiffReport, FirstDivergence, LevelStatus};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Version of the JSON document (`kind: moeconf.invariance`).
pub const INVARIANCE_SCHEMA_VERSION: u32 = 1;

/// Whether a configuration kept what it is expected to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CellStatus {
    /// It keeps its expectation (bitwise equal, or the gate passes).
    Pass,
    /// It does not.
    Fail,
    /// Expected `info`: reported, never failed.
    Info,
    /// No verdict: it could not be traced, opened, verified or compared.
    Error,
}

impl CellStatus {
    /// `PASS`, `FAIL`, `INFO`, `ERROR`.
    pub fn label(self) -> &'static str {
        match self {
            CellStatus::Pass => "PASS",
            CellStatus::Fail => "FAIL",
            CellStatus::Info => "INFO",
            CellStatus::Error => "ERROR",
        }
    }
}

/// What the diff against the base found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Compared {
    /// Every level both hold equal bit for bit (the diff's `equivalent`).
    pub equivalent: bool,
    /// L0 (tokens and text) equal; `None` when L0 was not compared.
    pub tokens_equal: Option<bool>,
    /// L1 (logits, margins) bitwise equal; `None` when not compared.
    pub logits_bitwise: Option<bool>,
    /// `L0`…`L4` → `match`, `differ` or `not_compared`.
    pub levels: BTreeMap<String, String>,
    /// The diff's headline: the first differing record in execution order.
    pub first_divergence: Option<FirstDivergence>,
    /// The diff's one-line summary.
    pub summary: String,
}

impl Compared {
    /// The facts of `r` a matrix cell shows.
    pub fn of(r: &DiffReport) -> Compared {
        let name = |s: LevelStatus| match s {
            LevelStatus::Match => "match",
            LevelStatus::Differ => "differ",
            LevelStatus::NotCompared => "not_compared",
        };
        let equal = |s: LevelStatus| match s {
            LevelStatus::Match => Some(true),
            LevelStatus::Differ => Some(false),
            LevelStatus::NotCompared => None,
        };
        let l = &r.levels;
        let statuses = [
            ("L0", l.l0.status),
            ("L1", l.l1.status),
            ("L2", l.l2.status),
            ("L3", l.l3.status),
            ("L4", l.l4.status),
        ];
        Compared {
            equivalent: r.exit_code() == 0,
            tokens_equal: equal(l.l0.status),
            logits_bitwise: equal(l.l1.status),
            levels: statuses
                .iter()
                .map(|(k, s)| (k.to_string(), name(*s).to_string()))
                .collect(),
            first_divergence: r.first_divergence.clone(),
            summary: r.summary.clone(),
        }
    }

    /// `step S pos P layer L OPERATOR` of the first divergence, or `—`.
    pub fn where_text(&self) -> String {
        match &self.first_divergence {
            None => "—".into(),
            Some(f) => {
                let layer = f.layer.map(|l| format!(" layer {l}")).unwrap_or_default();
                format!(
                    "{} step {} pos {}{layer} {}",
                    f.level, f.step, f.position, f.operator
                )
            }
        }
    }
}

/// One configuration's cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cell {
    pub name: String,
    pub knobs: Knobs,
    /// Knobs whose value differs from the base's.
    pub changed: Vec<String>,
    /// `bitwise`, `profile:NAME` or `info` (empty when it could not be resolved).
    pub expectation: String,
    pub status: CellStatus,
    /// Its trace, relative to the output directory.
    pub trace: String,
    /// Its trace's root digest (hex), once opened.
    pub root: Option<String>,
    /// The comparison with the base.
    pub compared: Option<Compared>,
    /// The gate's verdict (`pass`, `warn`, `fail`) under the expectation's profile.
    pub gate: Option<String>,
    /// Its diff page, relative to the output directory.
    pub diff_page: Option<String>,
    /// Why there is no verdict (status `error`).
    pub error: Option<String>,
}

impl Cell {
    /// A cell not yet judged (status `error` until it is).
    pub fn new(cfg: &Configuration, trace: &str) -> Cell {
        Cell {
            name: cfg.name.clone(),
            knobs: cfg.knobs.clone(),
            changed: cfg.changed.clone(),
            expectation: String::new(),
            status: CellStatus::Error,
            trace: trace.into(),
            root: None,
            compared: None,
            gate: None,
            diff_page: None,
            error: Some("not judged".into()),
        }
    }

    /// This cell with no verdict, for `message`.
    pub fn error(mut self, message: String) -> Cell {
        self.status = CellStatus::Error;
        self.error = Some(message);
        self
    }
}

/// The base configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BaseResult {
    pub name: String,
    pub knobs: Knobs,
    pub trace: String,
    pub root: String,
}

/// An expectation as declared.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Declared {
    pub knob: String,
    pub expectation: String,
    /// The file and table that declared it.
    pub source: String,
}

/// The whole result of `moeconf invariance`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InvarianceReport {
    /// [`INVARIANCE_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// `moeconf.invariance`.
    pub kind: String,
    /// `pass` (every configuration keeps its expectation), `fail`, or
    /// `error` (a configuration has no verdict).
    pub verdict: String,
    /// `reference` or `command`.
    pub backend: String,
    /// The request every configuration ran (model, prompt, …; a command's argv).
    pub request: BTreeMap<String, String>,
    /// The matrix file or preset.
    pub matrix: String,
    /// Where the policy came from.
    pub policy: String,
    /// Declared expectations (undeclared knobs are `bitwise`).
    pub expectations: Vec<Declared>,
    pub base: BaseResult,
    pub configurations: Vec<Cell>,
    /// One line.
    pub summary: String,
}

impl InvarianceReport {
    /// Assembles the report of `cells`.
    pub fn new(
        m: &Matrix,
        e: &Expectations,
        policy: &str,
        base: BaseResult,
        cells: Vec<Cell>,
    ) -> InvarianceReport {
        let count = |s: CellStatus| cells.iter().filter(|c| c.status == s).count();
        let (pass, fail, info, error) = (
            count(CellStatus::Pass),
            count(CellStatus::Fail),
            count(CellStatus::Info),
            count(CellStatus::Error),
        );
        let verdict = if error > 0 {
            "error"
        } else if fail > 0 {
            "fail"
        } else {
            "pass"
        };
        let summary = format!(
            "{} configuration{}: {pass} pass, {fail} fail, {info} info, {error} error",
            cells.len(),
            if cells.len() == 1 { "" } else { "s" }
        );
        let request = match &m.backend {
            Backend::Reference(r) => BTreeMap::from([
                ("model".to_string(), r.model.clone()),
                ("prompt".to_string(), r.prompt.clone()),
                ("max_new_tokens".to_string(), r.max_new_tokens.to_string()),
                ("precision".to_string(), r.precision.clone()),
                ("capture".to_string(), r.capture.clone()),
            ]),
            Backend::Command(c) => {
                let mut req: BTreeMap<String, String> =
                    c.values.iter().map(|(k, v)| (k.clone(), v.to_string())).collect();
                req.insert("command".into(), c.argv.join(" "));
                req
            }
        };
        InvarianceReport {
            schema_version: INVARIANCE_SCHEMA_VERSION,
            kind: "moeconf.invariance".into(),
            verdict: verdict.into(),
            backend: m.backend.name().into(),
            request,
            matrix: m.source.clone(),
            policy: policy.into(),
            expectations: e
                .declared()
                .into_iter()
                .map(|(knob, expectation, source)| Declared {
                    knob,
                    expectation,
                    source,
                })
                .collect(),
            base,
            configurations: cells,
            summary,
        }
    }

    /// 0 every configuration keeps its expectation, 1 one does not, 2 one has no verdict.
    pub fn exit_code(&self) -> u8 {
        match self.verdict.as_str() {
            "pass" => 0,
            "fail" => 1,
            _ => 2,
        }
    }

    /// The JSON document.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// The text report: one row per configuration.
    pub fn render_text(&self) -> String {
        let esc = |s: &str| moeconf_output::escape::text(s).into_owned();
        let mut s = String::new();
        let req: Vec<String> = self
            .request
            .iter()
            .map(|(k, v)| format!("{k}={}", esc(v)))
            .collect();
        let _ = writeln!(
            s,
            "moeconf invariance: {} backend, {}",
            self.backend,
            req.join(" · ")
        );
        let base: Vec<String> = self
            .base
            .knobs
            .iter()
            .map(|(k, v)| format!("{k}={}", esc(&v.to_string())))
            .collect();
        let _ = writeln!(
            s,
            "matrix: {}; base: {}",
            esc(&self.matrix),
            if base.is_empty() {
                "-".into()
            } else {
                base.join(" ")
            }
        );
        let declared: Vec<String> = self
            .expectations
            .iter()
            .map(|d| format!("{}={}", d.knob, d.expectation))
            .collect();
        let _ = writeln!(
            s,
            "policy: {}; expectations: {} (undeclared knobs: bitwise)",
            esc(&self.policy),
            if declared.is_empty() {
                "none declared".into()
            } else {
                declared.join(", ")
            }
        );
        let width = self
            .configurations
            .iter()
            .map(|c| esc(&c.name).chars().count())
            .max()
            .unwrap_or(13)
            .clamp(13, 48);
        let _ = writeln!(
            s,
            "\n  {:<width$}  {:<9} {:<6} {:<6} {:<14} {:<6} first divergence",
            "configuration", "expect", "tokens", "logits", "L0 L1 L2 L3 L4", "result"
        );
        for c in &self.configurations {
            let name = esc(&c.name);
            let (tokens, logits, levels, at) = match &c.compared {
                Some(d) => (
                    yes_no(d.tokens_equal, "equal", "differ"),
                    yes_no(d.logits_bitwise, "equal", "differ"),
                    ["L0", "L1", "L2", "L3", "L4"]
                        .iter()
                        .map(|l| match d.levels.get(*l).map(String::as_str) {
                            Some("match") => "=",
                            Some("differ") => "≠",
                            _ => "·",
                        })
                        .collect::<Vec<_>>()
                        .join("  "),
                    d.where_text(),
                ),
                None => ("-".into(), "-".into(), "-".into(), "-".into()),
            };
            let result = match (&c.status, &c.gate) {
                (_, Some(g)) => format!("{} (gate {g})", c.status.label()),
                _ => c.status.label().to_string(),
            };
            let _ = writeln!(
                s,
                "  {:<width$}  {:<9} {:<6} {:<6} {:<14} {:<6} {at}",
                name,
                if c.expectation.is_empty() {
                    "-"
                } else {
                    c.expectation.as_str()
                },
                tokens,
                logits,
                levels,
                result
            );
            if let Some(e) = &c.error {
                if c.status == CellStatus::Error {
                    for line in moeconf_output::escape::multiline(e).lines().take(12) {
                        let _ = writeln!(s, "      {line}");
                    }
                }
            }
        }
        let _ = writeln!(s, "\n{} → {}", self.summary, self.verdict.to_uppercase());
        s
    }

    /// The HTML matrix page's data.
    pub fn view(&self) -> moeconf_report::InvarianceView {
        let knob_names: Vec<String> = {
            let mut v: Vec<String> = self
                .configurations
                .iter()
                .flat_map(|c| c.changed.iter().cloned())
                .collect();
            v.sort();
            v.dedup();
            v
        };
        let mut header = vec![
            ("backend".to_string(), self.backend.clone()),
            ("matrix".to_string(), self.matrix.clone()),
            ("policy".to_string(), self.policy.clone()),
        ];
        header.extend(self.request.iter().map(|(k, v)| (k.clone(), v.clone())));
        let base_knobs: Vec<String> = self.base.knobs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        header.push(("base".into(), base_knobs.join(" ")));
        header.push(("base root".into(), self.base.root.clone()));
        moeconf_report::InvarianceView {
            header,
            verdict: self.verdict.clone(),
            summary: self.summary.clone(),
            knobs: knob_names.clone(),
            rows: self
                .configurations
                .iter()
                .map(|c| moeconf_report::InvarianceRow {
                    name: c.name.clone(),
                    knob_values: knob_names
                        .iter()
                        .map(|k| match c.knobs.get(k) {
                            Some(v) if c.changed.contains(k) => v.to_string(),
                            _ => String::new(),
                        })
                        .collect(),
                    expectation: c.expectation.clone(),
                    tokens: c.compared.as_ref().map(|d| d.tokens_equal).unwrap_or(None),
                    logits: c.compared.as_ref().map(|d| d.logits_bitwise).unwrap_or(None),
                    levels: c
                        .compared
                        .as_ref()
                        .map(|d| d.levels.values().cloned().collect())
                        .unwrap_or_default(),
                    first: c.compared.as_ref().map(Compared::where_text).unwrap_or_default(),
                    status: c.status.label().to_string(),
                    gate: c.gate.clone(),
                    link: c.diff_page.clone(),
                    error: c.error.clone().filter(|_| c.status == CellStatus::Error),
                })
                .collect(),
        }
    }
}

fn yes_no(v: Option<bool>, yes: &str, no: &str) -> String {
    match v {
        Some(true) => yes.into(),
        Some(false) => no.into(),
        None => "·".into(),
    }
}
