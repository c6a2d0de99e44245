//! Running a matrix: the base and every configuration traced into the output
//! directory, each configuration's trace bisected against the base's and
//! judged by its expectation.
//!
//! Trust: a configuration passes only from data its digests commit to. Every
//! trace is verified in full before it is compared, must hold every step of
//! its run, and must be comparable with the base (or `force` is set and the
//! differences are reported); anything else is an `error` cell, and a matrix
//! with an error cell exits 2, never 0.

use crate::command;
use crate::error::InvarianceError;
use crate::expect::{Expectation, Expectations};
use crate::matrix::{Backend, Configuration, KnobValue, Matrix, ReferenceRun};
use crate::outcome::{BaseResult, Cell, CellStatus, Compared, InvarianceReport};
use moeconf_bisect::{diff, DiffOptions, DiffReport};
use moeconf_gate::policy::Profile;
use moeconf_runner::{default_contract_for, parse_capture, CombineChoice, LoadedModel, RunSpec};
use moeconf_schema::{Trace, Verification};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What the run needs besides the matrix.
pub struct RunOptions<'a> {
    /// Expectations resolved from the matrix and the policy.
    pub expectations: &'a Expectations,
    /// Profile name → the resolved gate profile (every profile the expectations name).
    pub profiles: &'a BTreeMap<String, Profile>,
    /// Where the policy came from (reports).
    pub policy_source: String,
    /// The directory the results are written into (the temporary directory
    /// of an atomic output directory).
    pub dir: &'a Path,
    /// The loaded model (reference backend).
    pub model: Option<&'a LoadedModel>,
    /// Called with one line per finished configuration (progress).
    pub progress: &'a dyn Fn(&str),
    /// Write an HTML diff page per configuration.
    pub pages: bool,
}

/// File name of configuration `i`'s trace, page or log (`c01.bin`, …): made
/// from the index, never from a name in the matrix.
pub fn file_name(i: usize, ext: &str) -> String {
    format!("c{:02}.{ext}", i + 1)
}

/// Whether `rel` is an entry the output directory holds (what a previous
/// result may hold when the directory is replaced).
pub fn is_result_entry(rel: &str) -> bool {
    if matches!(rel, "base.bin" | "base.log" | "index.html" | "invariance.json") {
        return true;
    }
    let Some(rest) = rel.strip_prefix('c') else {
        return false;
    };
    let Some((num, ext)) = rest.split_once('.') else {
        return false;
    };
    num.len() >= 2
        && num.len() <= 3
        && num.bytes().all(|b| b.is_ascii_digit())
        && matches!(ext, "bin" | "html" | "log")
}

/// Runs the matrix and judges every configuration. Errors of the base (it
/// could not be traced or opened) end the run; errors of one configuration
/// become its `error` cell.
pub fn run_matrix(m: &Matrix, o: &RunOptions<'_>) -> Result<InvarianceReport, InvarianceError> {
    let base_path = o.dir.join("base.bin");
    let t = Instant::now();
    trace_config(m, &m.base, &base_path, &o.dir.join("base.log"), o.model)
        .map_err(|message| InvarianceError::Base { message })?;
    let base = open_complete(&base_path).map_err(|message| InvarianceError::Base { message })?;
    (o.progress)(&format!(
        "base: traced in {:.2} s, root {}",
        t.elapsed().as_secs_f64(),
        base.root().to_hex()
    ));
    let mut cells = Vec::with_capacity(m.configs.len());
    for (i, cfg) in m.configs.iter().enumerate() {
        let t = Instant::now();
        let cell = judge_config(m, o, &base, &base_path, i, cfg);
        (o.progress)(&format!(
            "[{}/{}] {}: {} ({:.2} s)",
            i + 1,
            m.configs.len(),
            cfg.name,
            cell.status.label(),
            t.elapsed().as_secs_f64()
        ));
        cells.push(cell);
    }
    Ok(InvarianceReport::new(
        m,
        o.expectations,
        &o.policy_source,
        BaseResult {
            name: m.base.name.clone(),
            knobs: m.base.knobs.clone(),
            trace: "base.bin".into(),
            root: base.root().to_hex(),
        },
        cells,
    ))
}

/// Traces one configuration, compares it and judges it.
fn judge_config(
    m: &Matrix,
    o: &RunOptions<'_>,
    base: &Trace,
    base_path: &Path,
    i: usize,
    cfg: &Configuration,
) -> Cell {
    let trace_name = file_name(i, "bin");
    let mut cell = Cell::new(cfg, &trace_name);
    let expectation = match o.expectations.of(cfg) {
        Ok(e) => e,
        Err(message) => return cell.error(message),
    };
    cell.expectation = expectation.label();
    let path = o.dir.join(&trace_name);
    if let Err(message) = trace_config(m, cfg, &path, &o.dir.join(file_name(i, "log")), o.model) {
        return cell.error(message);
    }
    let cand = match open_complete(&path) {
        Ok(t) => t,
        Err(message) => return cell.error(message),
    };
    cell.root = Some(cand.root().to_hex());
    let opts = DiffOptions {
        force: m.force,
        ..DiffOptions::default()
    };
    let report = match diff(base, &cand, &opts) {
        Ok(r) => r,
        Err(e) => return cell.error(format!("comparing with the base: {e}")),
    };
    cell.compared = Some(Compared::of(&report));
    let gate = match &expectation {
        Expectation::Profile(name) => match o.profiles.get(name) {
            Some(profile) => match gate_verdict(base_path, &cand, profile, m.force) {
                Ok(g) => Some(g),
                Err(message) => return cell.error(message),
            },
            None => return cell.error(format!("profile {name:?} was not resolved")),
        },
        _ => None,
    };
    if o.pages {
        let summary = gate.as_ref().map(|(verdict, lines)| moeconf_report::GateSummary {
            verdict: verdict.to_uppercase(),
            policy: o.policy_source.clone(),
            lines: lines.clone(),
        });
        let page = match moeconf_report::render_diff(base, &cand, &report, summary.as_ref()) {
            Ok(p) => p,
            Err(e) => return cell.error(format!("drawing the diff page: {e}")),
        };
        let page_name = file_name(i, "html");
        if let Err(e) = std::fs::write(o.dir.join(&page_name), page) {
            return cell.error(format!("writing {page_name}: {e}"));
        }
        cell.diff_page = Some(page_name);
    }
    cell.status = status(&expectation, &report, gate.as_ref().map(|(v, _)| v.as_str()));
    cell.gate = gate.map(|(v, _)| v);
    cell.error = None;
    cell
}

/// The status of a compared configuration under its expectation.
fn status(e: &Expectation, report: &DiffReport, gate: Option<&str>) -> CellStatus {
    let equal = report.exit_code() == 0;
    match e {
        Expectation::Bitwise if equal => CellStatus::Pass,
        Expectation::Bitwise => CellStatus::Fail,
        Expectation::Profile(_) => match gate {
            Some("pass") | Some("warn") => CellStatus::Pass,
            _ => CellStatus::Fail,
        },
        Expectation::Info => CellStatus::Info,
    }
}

/// The gate's verdict (`pass`, `warn`, `fail`) of `cand` against the base
/// under `profile`, and its failure lines.
fn gate_verdict(
    base_path: &Path,
    cand: &Trace,
    profile: &Profile,
    force: bool,
) -> Result<(String, Vec<String>), String> {
    let run = moeconf_gate::against_reference_run(base_path, cand, profile, force, Verification::Full)
        .map_err(|e| format!("gate under profile {:?}: {e}", profile.name))?;
    if !run.report.incomplete.is_empty() {
        return Err("the gate found a side without every step of its run".into());
    }
    let verdict = run.report.verdict.label().to_lowercase();
    let lines = run
        .report
        .render_text()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(20)
        .map(str::to_string)
        .collect();
    Ok((verdict, lines))
}

/// Opens `path` verified in full and requires every step of its run.
fn open_complete(path: &Path) -> Result<Trace, String> {
    let t = Trace::open_for(path, Verification::Full).map_err(|e| format!("{}: {e}", path.display()))?;
    let c = t.completeness();
    if !c.is_complete() {
        return Err(format!(
            "{}: {c} (a configuration is judged only on a run that holds every step)",
            path.display()
        ));
    }
    Ok(t)
}

/// Traces one configuration into `out` (`log`: the command's output).
fn trace_config(
    m: &Matrix,
    cfg: &Configuration,
    out: &Path,
    log: &Path,
    model: Option<&LoadedModel>,
) -> Result<(), String> {
    match &m.backend {
        Backend::Reference(r) => {
            let model = model.ok_or("the reference backend needs the loaded model")?;
            trace_reference(r, cfg, model, out)
        }
        Backend::Command(c) => {
            let rendered = command::render(c, &cfg.knobs, out)?;
            command::execute(&rendered, log, c.timeout).map_err(|f| {
                let tail = f.tail.trim();
                if tail.is_empty() {
                    f.reason
                } else {
                    format!("{}; the end of its output ({}):\n{tail}", f.reason, log.display())
                }
            })?;
            if !out.is_file() {
                return Err(format!(
                    "the command exited 0 but wrote no trace at {}",
                    out.display()
                ));
            }
            Ok(())
        }
    }
}

/// The reference runtime under one configuration, in this process (the
/// model is loaded once for the whole matrix); `threads` is a thread pool
/// of that size for this run only.
fn trace_reference(
    r: &ReferenceRun,
    cfg: &Configuration,
    model: &LoadedModel,
    out: &Path,
) -> Result<(), String> {
    let threads = match cfg.knobs.get("threads") {
        Some(KnobValue::Int(n)) => usize::try_from(*n).map_err(|_| format!("threads {n}"))?,
        _ => 1,
    };
    moeconf_runner::limits::check_threads(threads).map_err(|e| e.to_string())?;
    let batch_with: Vec<String> = match cfg.knobs.get("batch_with") {
        Some(KnobValue::List(p)) => p.clone(),
        _ => Vec::new(),
    };
    let prefill_chunk = match cfg.knobs.get("prefill_chunk") {
        Some(KnobValue::Int(n)) => Some(u32::try_from(*n).map_err(|_| format!("prefill_chunk {n}"))?),
        _ => None,
    };
    let precision =
        moeconf_reference_runtime::precision::Precision::from_name(&r.precision).ok_or_else(|| {
            format!(
                "precision {:?}: expected bf16, f32, official or vllm-cpu",
                r.precision
            )
        })?;
    let contract = default_contract_for(precision, model)
        .parse()
        .map_err(|e| format!("{e}"))?;
    let choice = CombineChoice {
        contract,
        ..CombineChoice::default()
    };
    let spec = RunSpec {
        prompt: &r.prompt,
        max_new_tokens: r.max_new_tokens,
        precision,
        combine: &choice,
        capture: parse_capture(&r.capture).map_err(|e| e.to_string())?,
        algorithm: moeconf_fingerprint::Algorithm::Blake3,
        canon: moeconf_fingerprint::CanonPolicy::default(),
        allow_non_finite: false,
        prefill_chunk,
        batch_with: &batch_with,
        progress: false,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| format!("a pool of {threads} threads: {e}"))?;
    pool.install(|| moeconf_runner::run_to_trace(model, &spec, out))
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The trace files a finished run wrote (for callers that list them).
pub fn trace_paths(dir: &Path, n: usize) -> Vec<PathBuf> {
    std::iter::once(dir.join("base.bin"))
        .chain((0..n).map(|i| dir.join(file_name(i, "bin"))))
        .collect()
}
