//! The component catalogue (`moeconf_fingerprint::catalogue`) is the one
//! place that spells component paths. This test scans the library and binary
//! sources of every crate (not tests, benches, examples or `#[cfg(test)]`
//! modules, and not the catalogue itself) for string literals that are a
//! catalogue path, a member of a catalogue family, or a catalogue namespace
//! prefix, and fails listing every one it finds.

use moeconf_fingerprint::catalogue::{Component, NAMESPACES};
use std::path::{Path, PathBuf};

/// The folder of every workspace crate (from `cargo metadata`, so that a
/// new crate is scanned without being listed here), but the root package
/// whose library is test support.
fn crates(root: &Path) -> Vec<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(root)
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut dirs: Vec<PathBuf> = v["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["name"] != "moeconf-workspace-tests")
        .filter_map(|p| {
            Path::new(p["manifest_path"].as_str()?)
                .parent()
                .map(Path::to_path_buf)
        })
        .collect();
    dirs.sort();
    dirs
}

/// The one file allowed to spell paths.
const CATALOGUE: &str = "fingerprint/src/catalogue.rs";

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The string literals of one line (plain `"..."` literals; escapes skipped).
fn literals(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = line.chars().peekable();
    let mut cur: Option<String> = None;
    while let Some(c) = chars.next() {
        match (&mut cur, c) {
            (None, '/') if chars.peek() == Some(&'/') => break,
            (None, '\'') => {
                // A char literal such as '"' must not open a string.
                let rest: String = chars.clone().take(3).collect();
                if rest.starts_with("\"'") || rest.starts_with("\\\"") {
                    chars.next();
                    chars.next();
                }
            }
            (None, '"') => cur = Some(String::new()),
            (Some(s), '\\') => {
                if let Some(n) = chars.next() {
                    s.push('\\');
                    s.push(n);
                }
            }
            (Some(_), '"') => out.push(cur.take().unwrap_or_default()),
            (Some(s), ch) => s.push(ch),
            (None, _) => {}
        }
    }
    out
}

fn is_component_literal(s: &str) -> bool {
    Component::parse(s).is_some()
        || Component::ALL.iter().any(|c| c.is_family() && s == c.path())
        || NAMESPACES.iter().any(|(p, _)| s == *p)
}

#[test]
fn no_component_path_literals_outside_the_catalogue() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut violations = Vec::new();
    let crates = crates(root);
    assert!(
        crates.len() >= 17,
        "only {} crates found: {crates:?}",
        crates.len()
    );
    for krate in &crates {
        let mut files = Vec::new();
        rust_files(&krate.join("src"), &mut files);
        files.sort();
        for f in files {
            let rel = f
                .strip_prefix(root)
                .unwrap_or(&f)
                .to_string_lossy()
                .replace('\\', "/");
            if rel == CATALOGUE {
                continue;
            }
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            for (i, line) in text.lines().enumerate() {
                if line.trim_start().starts_with("#[cfg(test)]") {
                    break; // test modules close every file that has one
                }
                let t = line.trim_start();
                if t.starts_with("//") {
                    continue;
                }
                for lit in literals(line) {
                    if is_component_literal(&lit) {
                        violations.push(format!("{rel}:{}: {lit:?}", i + 1));
                    }
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "{} component path literal(s) outside the catalogue; use moeconf_fingerprint::Component instead:\n{}",
        violations.len(),
        violations.join("\n")
    );
}

#[test]
fn the_scanner_sees_literals() {
    assert_eq!(
        literals(r#"let x = "router.topk"; // "moe.combine""#),
        vec!["router.topk"]
    );
    assert_eq!(literals(r#"f('"', "a\"b")"#), vec![r#"a\"b"#]);
    assert!(is_component_literal("moe.term.3"));
    assert!(is_component_literal("moe.term."));
    assert!(is_component_literal("state."));
    assert!(!is_component_literal("state"));
    assert!(!is_component_literal("moe.term.x"));
}
