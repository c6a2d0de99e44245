//! docs/architecture.md's crate map cannot drift from the manifests: for
//! every row naming a workspace crate, the "depends on" column names
//! exactly the workspace crates that crate depends on (normal
//! dependencies, from `cargo metadata`), and every other dependency it
//! names is one the crate really has. Rows are matched by crate name; the
//! column's short names drop the `moeconf-` prefix (`runtime` is
//! `moeconf-reference-runtime`); text in parentheses is a qualifier
//! (`schema (no runtime)`) and is not read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every workspace package's normal dependencies, by package name.
fn manifests() -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(repo())
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut map = BTreeMap::new();
    for p in v["packages"].as_array().unwrap() {
        let deps = p["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"].is_null())
            .map(|d| d["name"].as_str().unwrap().to_string())
            .collect();
        map.insert(p["name"].as_str().unwrap().to_string(), deps);
    }
    map
}

/// The workspace crate a short name of the column means, if any.
fn crate_of(short: &str) -> String {
    match short {
        "runtime" => "moeconf-reference-runtime".into(),
        s => format!("moeconf-{s}"),
    }
}

/// The names the "depends on" column lists: comma-separated, each the
/// first word of its part; text in parentheses is a qualifier, not read.
fn named(column: &str) -> Vec<String> {
    let mut plain = String::new();
    let mut depth = 0usize;
    for c in column.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            c if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    plain
        .split(',')
        .filter_map(|part| part.split_whitespace().next())
        .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric() && c != '-' && c != '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn the_crate_maps_dependency_column_is_the_manifests() {
    let text = std::fs::read_to_string(repo().join("docs/architecture.md")).unwrap();
    let manifests = manifests();
    let workspace: BTreeSet<&String> = manifests.keys().filter(|k| k.starts_with("moeconf-")).collect();
    let mut checked = BTreeSet::new();
    let mut wrong = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split(" | ").collect();
        if cells.len() < 4 {
            continue;
        }
        // The crate is the cell's first `code` span.
        let krate = cells[1].split('`').nth(1).unwrap_or("");
        let Some(deps) = manifests.get(krate) else {
            continue;
        };
        if krate == "moeconf" {
            // The binary: "every library crate".
            checked.insert(krate.to_string());
            continue;
        }
        let column = cells[3].trim_end_matches(" |").trim_end_matches('|').trim();
        let names = named(column);
        let internal: BTreeSet<String> = deps.iter().filter(|d| workspace.contains(d)).cloned().collect();
        let listed_internal: BTreeSet<String> = names
            .iter()
            .map(|n| crate_of(n))
            .filter(|c| workspace.contains(c))
            .collect();
        if listed_internal != internal {
            wrong.push(format!(
                "{krate}: the map lists workspace crates {listed_internal:?}, the manifest has {internal:?}"
            ));
        }
        for n in &names {
            let c = crate_of(n);
            if workspace.contains(&c) || n == "every" {
                continue;
            }
            // An external dependency the crate must really have.
            if !deps.contains(n) && !deps.contains(&n.replace('_', "-")) {
                wrong.push(format!(
                    "{krate}: the map names {n}, which is not among its dependencies {deps:?}"
                ));
            }
        }
        checked.insert(krate.to_string());
    }
    let missing: Vec<&&String> = workspace
        .iter()
        .filter(|k| !checked.contains(k.as_str()) && k.as_str() != "moeconf-workspace-tests")
        .collect();
    assert!(
        missing.is_empty(),
        "crates without a row in docs/architecture.md: {missing:?}"
    );
    assert!(
        wrong.is_empty(),
        "docs/architecture.md's crate map:\n{}",
        wrong.join("\n")
    );
}

/// Every repository path the docs cite in backticks (`dir/file.ext` whose
/// first component is a folder of this repository) exists: a moved or
/// renamed file cannot leave a stale citation. Paths of other projects
/// (`inference/model.py`, `models/deepseek_v4/...`) start with folders this
/// repository does not have and are not checked.
#[test]
fn every_repository_path_the_docs_cite_exists() {
    let root = repo();
    let top: BTreeSet<String> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "target")
        .collect();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.extend(["README.md", "fuzz/README.md", "python/README.md"].map(|p| root.join(p)));
    docs.sort();
    let mut cited = 0;
    let mut missing = Vec::new();
    for d in &docs {
        let text = std::fs::read_to_string(d).unwrap();
        for (i, span) in text.split('`').enumerate() {
            // Odd pieces are inside a code span.
            if i % 2 == 0 || span.contains(char::is_whitespace) || !span.contains('/') {
                continue;
            }
            let path = span.trim_end_matches([':', ',', '.']);
            let has_ext = Path::new(path).extension().is_some_and(|x| {
                ["rs", "md", "py", "toml", "sh", "json", "yml"].contains(&&*x.to_string_lossy())
            });
            let first = path.split('/').next().unwrap_or("");
            if !has_ext || !top.contains(first) || path.contains(['*', '{', '<']) {
                continue;
            }
            cited += 1;
            if !root.join(path).exists() {
                missing.push(format!(
                    "{}: {path}",
                    d.strip_prefix(&root).unwrap_or(d).display()
                ));
            }
        }
    }
    assert!(cited > 100, "only {cited} citations found");
    assert!(missing.is_empty(), "cited but missing:\n{}", missing.join("\n"));
}
