//! Writing reports to stdout, and the checks every output file of a
//! command passes before any work starts (docs/format.md §10).

use anyhow::{bail, Context};
use moeconf_output::{CheckedOutput, Inputs};
use std::io::Write;
use std::path::Path;

/// Prints a JSON value, pretty, with a trailing newline.
///
/// The text is buffered and written in as few write(2) calls as its size
/// allows: stdout is line-buffered, and a report written line by line costs
/// one system call (and one wake-up of the reading process) per line. A
/// failed write, such as a closed pipe, is still an error of the command.
pub fn print_json(v: &serde_json::Value) -> anyhow::Result<()> {
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    serde_json::to_writer_pretty(&mut out, v)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}

/// Prints a JSON document that `write` writes (pretty, as [`print_json`]
/// prints a value), with a trailing newline, buffered as [`print_json`]: for
/// a report too large to build as a `serde_json::Value` first.
pub fn print_json_with(write: impl FnOnce(&mut dyn Write) -> serde_json::Result<()>) -> anyhow::Result<()> {
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    write(&mut out)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}

/// Writes a rendered text report to stdout.
pub fn print_text(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

/// Checks every output of a command against its inputs before any work
/// (`moeconf_output`: directory exists, nothing but a regular file
/// to replace, no symbolic link, no input, no output given twice) and warns
/// on stderr about stale temporary files next to them.
pub fn check_outputs(outputs: &[&Path], inputs: &Inputs) -> anyhow::Result<Vec<CheckedOutput>> {
    let checked = moeconf_output::check_outputs(outputs, inputs)?;
    for c in &checked {
        warn_stale(c);
    }
    Ok(checked)
}

/// [`check_outputs`] for one output.
pub fn check_output(output: &Path, inputs: &Inputs) -> anyhow::Result<CheckedOutput> {
    let mut v = check_outputs(&[output], inputs)?;
    v.pop().context("no output checked")
}

/// Warns about temporary files that a killed writer left next to `c`.
fn warn_stale(c: &CheckedOutput) {
    for t in c.stale_temporaries() {
        eprintln!(
            "moeconf: warning: stale temporary file {} next to {}: left by process {}, which no longer runs \
             (a write that was killed); moeconf does not remove it, delete it",
            t.path.display(),
            c.path().display(),
            t.pid
        );
    }
}

/// Adds the files of the model `spec` (a directory; a `builtin:` model is
/// added from its materialized directory once loaded) to `inputs`.
pub fn add_model_inputs(spec: &str, inputs: &mut Inputs) {
    let dir = Path::new(spec);
    if !spec.starts_with("builtin:") && dir.is_dir() {
        inputs.dir_files(dir, "model file");
    }
}

/// An output directory (`--out`, `--out-dir`): refused when something other
/// than a directory is there, created (with its parents) otherwise.
pub fn output_dir(option: &str, dir: &Path) -> anyhow::Result<()> {
    if let Ok(m) = std::fs::metadata(dir) {
        if !m.is_dir() {
            bail!("{option} {}: not a directory", dir.display());
        }
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("{option} {}: cannot create the directory", dir.display()))
}
