//! Writing reports to stdout.

use std::io::Write;

/// Prints a JSON value, pretty, with a trailing newline.
pub fn print_json(v: &serde_json::Value) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v)?;
    writeln!(out)?;
    Ok(())
}

/// Writes a rendered text report to stdout.
pub fn print_text(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}
