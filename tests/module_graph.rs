//! The files of `cli/` and `bisect/` import each other as a tree: no
//! import cycle among them, and no command module of `cli/src/cmd/`
//! imports another (what commands share lives beside them: `args`,
//! `output`, `compare`, `results`, `complete`). The graph's edges are the
//! `crate::MODULE` and `super::MODULE` paths each file names (in `use`
//! lines or inline), read from the sources; an item re-exported by the
//! crate root (`crate::Item`) is not followed, since `lib.rs`/`main.rs`
//! declares every module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every module of the crate whose sources are in `src`, by path from the
/// root (`cmd::diff`), with its file's text; the root itself is left out.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap().with_extension("");
            let name: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let name = match name.last().map(String::as_str) {
                Some("lib" | "main") if name.len() == 1 => continue,
                Some("mod") => name[..name.len() - 1].join("::"),
                _ => name.join("::"),
            };
            out.insert(name, std::fs::read_to_string(&p).unwrap());
        }
    }
    out
}

/// The identifier starting at `s` (letters, digits, `_`).
fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The modules of `all` that `from`'s text names: `crate::a::b` is `a::b`
/// when that is a module, else `a`; `crate::{a, b::c}` names each;
/// `super::x` is a sibling of `from`.
fn imports(from: &str, text: &str, all: &BTreeMap<String, String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    // Lines of tests (`mod tests` at the end of a file) are not imports of the module.
    let text = text.split("#[cfg(test)]").next().unwrap_or(text);
    let text: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let resolve = |path: &[&str], out: &mut BTreeSet<String>| {
        for n in (1..=path.len()).rev() {
            let m = path[..n].join("::");
            if all.contains_key(&m) {
                if m != from {
                    out.insert(m);
                }
                return;
            }
        }
    };
    let parent: Vec<&str> = {
        let mut p: Vec<&str> = from.split("::").collect();
        p.pop();
        p
    };
    for (prefix, base) in [("crate::", Vec::new()), ("super::", parent)] {
        let mut rest = text.as_str();
        while let Some(i) = rest.find(prefix) {
            let before = rest[..i].chars().last();
            rest = &rest[i + prefix.len()..];
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let mut path = base.clone();
                    path.extend(item.trim().split("::").map(|s| ident(s.trim())));
                    resolve(&path, &mut out);
                }
                continue;
            }
            let mut path = base.clone();
            let mut s = rest;
            loop {
                let id = ident(s);
                if id.is_empty() {
                    break;
                }
                path.push(id);
                s = &s[id.len()..];
                match s.strip_prefix("::") {
                    Some(t) if !t.starts_with('{') => s = t,
                    _ => break,
                }
            }
            resolve(&path, &mut out);
        }
    }
    out
}

/// A cycle of the import graph, if there is one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for m in graph.get(n).into_iter().flatten() {
            match state.get(m.as_str()) {
                Some(1) => {
                    let at = path.iter().position(|p| p == m).unwrap_or(0);
                    let mut c = path[at..].to_vec();
                    c.push(m.clone());
                    return Some(c);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(m, graph, state, path) {
                        return Some(c);
                    }
                }
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if !state.contains_key(n.as_str()) {
            if let Some(c) = visit(n, graph, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

fn graph_of(krate: &str) -> BTreeMap<String, BTreeSet<String>> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(krate).join("src");
    let all = modules(&src);
    all.iter()
        .map(|(name, text)| (name.clone(), imports(name, text, &all)))
        .collect()
}

#[test]
fn the_files_of_cli_and_bisect_import_each_other_as_a_tree() {
    for krate in ["cli", "bisect"] {
        let g = graph_of(krate);
        assert!(g.len() > 5, "{krate}: only {} modules found", g.len());
        if let Some(c) = cycle(&g) {
            panic!("{krate}/src: import cycle {}", c.join(" -> "));
        }
    }
}

#[test]
fn no_command_imports_another() {
    let g = graph_of("cli");
    for (from, to) in &g {
        if from.starts_with("cmd::") {
            let other: Vec<&String> = to.iter().filter(|m| m.starts_with("cmd::")).collect();
            assert!(other.is_empty(), "cli/src/{from}: imports {other:?}");
        }
    }
    // The reader finds the edges it guards (a parser that finds nothing would pass).
    assert!(g["cmd::diff"].contains("compare"), "{:?}", g["cmd::diff"]);
    assert!(g["cmd::merge"].contains("results"), "{:?}", g["cmd::merge"]);
    let b = graph_of("bisect");
    assert!(b["divergence"].contains("ctx"), "{:?}", b["divergence"]);
}

#[test]
fn the_reader_sees_a_cycle_and_a_grouped_import() {
    let mut all = BTreeMap::new();
    all.insert("a".to_string(), "use crate::{b, c::d};\n".to_string());
    all.insert("b".to_string(), "fn f() { crate::a::g() }\n".to_string());
    all.insert("c".to_string(), String::new());
    let g: BTreeMap<String, BTreeSet<String>> = all
        .iter()
        .map(|(n, t)| (n.clone(), imports(n, t, &all)))
        .collect();
    assert_eq!(g["a"], BTreeSet::from(["b".to_string(), "c".to_string()]));
    assert_eq!(cycle(&g), Some(vec!["a".into(), "b".into(), "a".into()]));
}
