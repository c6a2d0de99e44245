//! Writing the result files of `calibrate` and `sweep`, which `merge`
//! writes too from the partial results of their shards.

use crate::output::check_output;
use anyhow::Context;
use moeconf_calibrate::suite;
use moeconf_calibrate::sweep::SweepOutputs;
use moeconf_output::{write_all_checked, write_checked, AtomicDir, CheckedDir, CheckedOutput, Inputs};
use std::path::Path;
use std::process::ExitCode;

/// Checks, before any work, the output directory `out` of a calibration
/// (`option` names it in messages): it may not exist yet (its parents are
/// created), or be empty, or hold only a previous calibration's result
/// (`calibration.json`, `*.tsv`, `traces/*.bin`, none of them an input),
/// which the new result replaces as a whole once complete
/// (docs/format.md §10). Warns about stale temporaries next to it.
pub fn check_calibration_dir(option: &str, out: &Path, inputs: &Inputs) -> anyhow::Result<CheckedDir> {
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.exists() {
            std::fs::create_dir_all(parent).with_context(|| {
                format!(
                    "{option} {}: cannot create the directory {}",
                    out.display(),
                    parent.display()
                )
            })?;
        }
    }
    let checked = moeconf_output::check_output_dir(out, inputs, suite::is_result_entry)?;
    for t in checked.stale_temporaries() {
        eprintln!(
            "moeconf: warning: stale temporary {} next to {}: left by process {}, which no longer runs \
             (a write that was killed); moeconf does not remove it, delete it",
            t.path.display(),
            out.display(),
            t.pid
        );
    }
    Ok(checked)
}

/// Writes the suite's files into the temporary directory of `result` (the
/// traces are already there), renames it into place and prints the report.
pub fn write_calibration(result: AtomicDir, o: &suite::Outputs, inputs: &Inputs) -> anyhow::Result<()> {
    for (name, bytes) in &o.files {
        write_checked(&check_output(&result.temp_path().join(name), inputs)?, bytes)?;
    }
    result.commit()?;
    crate::output::print_text(&o.stdout)
}

/// Exit 0 when every structural claim holds, else 1.
pub fn calibration_exit(o: &suite::Outputs) -> ExitCode {
    if o.all_hold {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Writes the JSON report to `-o FILE` and the HTML page to `--html FILE`
/// (both checked before the sweep), each in full before either is renamed
/// into place.
pub fn write_sweep(
    output: Option<&CheckedOutput>,
    html: Option<&CheckedOutput>,
    o: &SweepOutputs,
) -> anyhow::Result<()> {
    let mut json = serde_json::to_vec_pretty(&o.doc)?;
    json.push(b'\n');
    let mut files: Vec<(&CheckedOutput, &[u8])> = Vec::new();
    if let Some(out) = output {
        files.push((out, &json));
    }
    if let (Some(out), Some(page)) = (html, &o.html) {
        files.push((out, page.as_bytes()));
    }
    Ok(write_all_checked(&files)?)
}
