//! What a protocol produces: tables in the paper's layout, structural
//! claims and the protocol's JSON object, and the files they are written to.

use std::path::Path;

use serde_json::Value;

use crate::Result;

/// A table in the paper's layout.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Table {
    /// File stem of the TSV (e.g. `basin_counts`).
    pub name: String,
    /// Title printed above the table.
    pub title: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table.
    pub fn new(name: &str, title: &str, columns: &[&str]) -> Table {
        Table {
            name: name.into(),
            title: title.into(),
            columns: columns.iter().map(|c| c.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Aligned text (column widths in characters).
    pub fn render(&self) -> String {
        // Display width: East Asian wide characters take two columns.
        let w = |s: &str| {
            s.chars()
                .map(|c| {
                    let u = c as u32;
                    let wide = (0x1100..=0x115f).contains(&u)
                        || (0x2e80..=0xa4cf).contains(&u)
                        || (0xac00..=0xd7a3).contains(&u)
                        || (0xf900..=0xfaff).contains(&u)
                        || (0xfe30..=0xfe4f).contains(&u)
                        || (0xff00..=0xff60).contains(&u)
                        || (0xffe0..=0xffe6).contains(&u);
                    if wide {
                        2
                    } else {
                        1
                    }
                })
                .sum::<usize>()
        };
        let mut widths: Vec<usize> = self.columns.iter().map(|c| w(c)).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                if let Some(x) = widths.get_mut(i) {
                    *x = (*x).max(w(c));
                }
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                let pad = widths.get(i).copied().unwrap_or(0).saturating_sub(w(c));
                s.push_str(c);
                if i + 1 < cells.len() {
                    s.push_str(&" ".repeat(pad + 2));
                }
            }
            s.trim_end().to_string()
        };
        let mut out = format!("{}\n", self.title);
        out.push_str(&line(&self.columns));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }

    /// Writes the table as `NAME.tsv` into `dir`, atomically.
    pub fn write_tsv(&self, dir: &Path) -> Result<()> {
        write_atomic(&dir.join(format!("{}.tsv", self.name)), self.tsv().as_bytes())
    }

    /// Tab-separated values with a header line (tabs and newlines in cells become spaces).
    pub fn tsv(&self) -> String {
        let clean = |s: &String| s.replace(['\t', '\n', '\r'], " ");
        let mut out = self.columns.iter().map(clean).collect::<Vec<_>>().join("\t");
        out.push('\n');
        for r in &self.rows {
            out.push_str(&r.iter().map(clean).collect::<Vec<_>>().join("\t"));
            out.push('\n');
        }
        out
    }
}

/// A structural claim: must hold on any model, or the suite exits 1.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Claim {
    /// Stable identifier (e.g. `b_720_to_360`).
    pub id: String,
    /// What is claimed, with the measured numbers.
    pub detail: String,
    pub holds: bool,
}

impl Claim {
    pub fn new(id: &str, holds: bool, detail: String) -> Claim {
        Claim {
            id: id.into(),
            detail,
            holds,
        }
    }
}

/// What one protocol produced.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Section {
    /// Protocol key (e.g. `fork_sweep`).
    pub key: String,
    /// Printed tables.
    pub tables: Vec<Table>,
    /// The protocol's JSON object.
    pub json: Value,
    /// Structural claims checked.
    pub claims: Vec<Claim>,
}

/// Writes `bytes` to `path` through `moeconf_output`: the path is
/// checked (a regular file or nothing; no symbolic link; its directory
/// exists), the bytes go to a temporary sibling `.NAME.moeconf-tmp.PID.RAND`
/// (mode 0666 & !umask) that is synced and renamed over `path`, and any
/// error removes the temporary file. The error names the file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    Ok(moeconf_output::write_file(path, bytes)?)
}

/// `n/d` formatting of a count.
pub fn frac(n: usize, d: usize) -> String {
    format!("{n}/{d}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_aligns_by_display_width_and_tsv_cleans_cells() {
        let mut t = Table::new("t", "Title", &["A", "Bee"]);
        t.row(vec!["公".into(), "x\ty".into()]);
        t.row(vec!["long".into(), "z".into()]);
        assert_eq!(t.render(), "Title\nA     Bee\n公    x\ty\nlong  z\n");
        assert_eq!(t.tsv(), "A\tBee\n公\tx y\nlong\tz\n");
    }

    #[test]
    fn write_atomic_replaces_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let t = Table::new("counts", "Counts", &["n"]);
        t.write_tsv(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("counts.tsv")).unwrap(),
            "n\n"
        );
        write_atomic(&dir.path().join("counts.tsv"), b"m\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("counts.tsv")).unwrap(),
            "m\n"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary file left behind");
    }
}
