//! Hostile user strings through every report format (docs/ci.md §5, the
//! escaping rule of `moeconf_output::escape`), end to end on the built
//! binary: trace file names (backticks and long backtick runs, HTML tags,
//! newlines and `\r`, pipes, `&` and quotes, bidi overrides, escape
//! sequences), gate profile names from a policy file (NUL and `/` too) and
//! prompt texts that reach a report as forced binding differences. Checked:
//! Markdown keeps each name inside one code span and tables keep their
//! columns, no raw HTML; JUnit is well-formed XML 1.0; JSON gives back the
//! exact string; text and HTML carry no raw control or bidi character and
//! HTML no tag from user data. `inspect` and `replay` are checked too.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{run_args, s};

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

/// Names a file can have (no NUL, no `/`).
const FILE_NAMES: &[&str] = &[
    "x` <img src=x onerror=alert(1)> `y",
    "```fenced``` and ``two``",
    "````````````````````````````````````````",
    "`lead and trail`",
    "<img src=x onerror=alert(1)>",
    "<script>alert(1)<\\script>",
    "line\nFAIL: forged line\r",
    "a|b||c |",
    "back\\|slash\\",
    "&amp; & \"dq\" 'sq' &#0;",
    "rtl\u{202e}nib.exe\u{2066}x\u{2069}",
    "ansi\u{1b}[31mred\u{7}",
];

/// Profile names: any string TOML can hold.
const PROFILE_NAMES: &[&str] = &[
    "x` <img src=https://example.invalid/a.png> `y",
    "<script>alert(1)</script>",
    "nul\0byte",
    "line\nFAIL: forged\r",
    "p|i|p|e",
    "`",
    "rtl\u{202e}lmth.exe",
];

fn moeconf(cwd: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args).current_dir(cwd);
    for k in [
        "MOECONF_POLICY",
        "MOECONF_PROFILE",
        "MOECONF_FORMAT",
        "MOECONF_LEVELS",
        "MOECONF_EQUAL_NAN",
        "MOECONF_ROUTE_NEAR_TIE_MARGIN",
        "MOECONF_ARGMAX_NEAR_TIE_MARGIN",
    ] {
        c.env_remove(k);
    }
    c.output().expect("spawn moeconf")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("UTF-8 report")
}

/// A report run that must give a verdict (exit 0 or 1), not an error.
fn report(cwd: &Path, args: &[&str]) -> String {
    let o = moeconf(cwd, args);
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "{args:?}: exit {:?}: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    stdout(&o)
}

/// The visible form the reports give a name (the rule of `moeconf_output::escape::text`).
fn visible(s: &str) -> String {
    let mut o = String::new();
    for c in s.chars() {
        match c {
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            '\0' => o.push_str("\\0"),
            c if c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') => {
                o.push_str(&format!("\\u{{{:x}}}", c as u32))
            }
            c => o.push(c),
        }
    }
    o
}

/// Asserts `doc` holds no control character but line ends (and tabs) and no bidi control.
fn no_hidden(what: &str, doc: &str) {
    if let Some(c) = doc.chars().find(|&c| {
        (c.is_control() && c != '\n' && c != '\t')
            || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    }) {
        panic!("{what}: raw {c:?} in\n{doc}");
    }
}

// ---------------------------------------------------------------- Markdown

/// One line of Markdown split as CommonMark reads it: code span contents and
/// the text outside them (backslash escapes kept). An opening backtick run
/// without a closer is an error (the text after it would be at its mercy).
fn md_spans(line: &str) -> Result<(Vec<String>, String), String> {
    let c: Vec<char> = line.chars().collect();
    let (mut spans, mut text, mut i) = (Vec::new(), String::new(), 0);
    while i < c.len() {
        if c[i] == '\\' && i + 1 < c.len() && c[i + 1].is_ascii_punctuation() {
            text.push(c[i]);
            text.push(c[i + 1]);
            i += 2;
        } else if c[i] == '`' {
            let n = c[i..].iter().take_while(|&&x| x == '`').count();
            let mut j = i + n;
            let close = loop {
                if j >= c.len() {
                    break None;
                }
                if c[j] == '`' {
                    let m = c[j..].iter().take_while(|&&x| x == '`').count();
                    if m == n {
                        break Some(j);
                    }
                    j += m;
                } else {
                    j += 1;
                }
            };
            let Some(j) = close else {
                return Err(format!("unclosed backtick run of {n} at {i}"));
            };
            let mut content: String = c[i + n..j].iter().collect();
            if content.len() >= 2
                && content.starts_with(' ')
                && content.ends_with(' ')
                && !content.chars().all(|x| x == ' ')
            {
                content = content[1..content.len() - 1].to_string();
            }
            spans.push(content);
            i = j + n;
        } else {
            text.push(c[i]);
            i += 1;
        }
    }
    Ok((spans, text))
}

/// The cells of a GitHub table row: split on pipes the row scanner does
/// not pair with a backslash, then `\|` unescaped.
fn md_cells(row: &str) -> Vec<String> {
    let c: Vec<char> = row.trim().chars().collect();
    let (mut cells, mut cur, mut i) = (Vec::new(), String::new(), 0);
    while i < c.len() {
        if c[i] == '\\' && i + 1 < c.len() && c[i + 1].is_ascii_punctuation() {
            cur.push(c[i]);
            cur.push(c[i + 1]);
            i += 2;
        } else if c[i] == '|' {
            cells.push(std::mem::take(&mut cur));
            i += 1;
        } else {
            cur.push(c[i]);
            i += 1;
        }
    }
    cells.push(cur);
    // The leading and trailing pipes bound no cell.
    cells.remove(0);
    cells.pop();
    cells.into_iter().map(|x| x.replace("\\|", "|")).collect()
}

/// Checks a Markdown report: every line parses into closed code spans,
/// text outside them holds no `<` (raw HTML, autolinks), every table row has
/// its header's cell count, and each of `names` is, in its visible form, the
/// whole content of a code span.
fn check_md(md: &str, names: &[&str]) {
    no_hidden("markdown", md);
    let mut spans = Vec::new();
    let mut columns: Option<usize> = None;
    for line in md.lines() {
        let parts = if line.starts_with('|') {
            let cells = md_cells(line);
            match columns {
                None => columns = Some(cells.len()),
                Some(n) => assert_eq!(cells.len(), n, "table row {line:?} in\n{md}"),
            }
            cells
        } else {
            columns = None;
            vec![line.to_string()]
        };
        for p in parts {
            let (sp, text) = md_spans(&p).unwrap_or_else(|e| panic!("{e} in {line:?}:\n{md}"));
            assert!(
                !text.contains('<'),
                "raw `<` outside code spans in {line:?}:\n{md}"
            );
            assert!(
                !text.contains("]("),
                "a link or image outside code spans in {line:?}:\n{md}"
            );
            spans.extend(sp);
        }
    }
    for n in names {
        let v = visible(n);
        assert!(
            spans.contains(&v),
            "no code span holds {v:?} whole; spans {spans:?}:\n{md}"
        );
    }
}

// ---------------------------------------------------------------- XML

/// Checks entities and characters of XML text or an attribute value.
fn xml_chars(t: &str) -> Result<(), String> {
    for (i, c) in t.char_indices() {
        let ok = matches!(c, '\t' | '\n' | '\r')
            || ('\u{20}'..='\u{d7ff}').contains(&c)
            || ('\u{e000}'..='\u{fffd}').contains(&c)
            || c >= '\u{10000}';
        if !ok {
            return Err(format!("character {c:?} XML 1.0 forbids"));
        }
        if c == '<' {
            return Err("raw `<`".into());
        }
        if c == '&' {
            let rest = &t[i + 1..];
            let end = rest.find(';').ok_or("`&` without `;`")?;
            let e = &rest[..end];
            let named = ["amp", "lt", "gt", "quot", "apos"].contains(&e);
            let num = e
                .strip_prefix("#x")
                .map(|h| u32::from_str_radix(h, 16))
                .or_else(|| e.strip_prefix('#').map(str::parse::<u32>))
                .and_then(Result::ok)
                .and_then(char::from_u32)
                .is_some_and(|c| c != '\0' && (c >= ' ' || matches!(c, '\t' | '\n' | '\r')));
            if !named && !num {
                return Err(format!("bad entity &{e};"));
            }
        }
    }
    Ok(())
}

/// A small XML 1.0 well-formedness check (what a JUnit reader needs):
/// declaration, one root, balanced elements, quoted unique attributes,
/// valid characters and entities.
fn check_xml(doc: &str) -> Result<(), String> {
    let mut rest = doc
        .strip_prefix("<?xml version=\"1.0\" encoding=\"UTF-8\"?>")
        .ok_or("no XML declaration")?;
    let mut stack: Vec<String> = Vec::new();
    let mut roots = 0;
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && n.chars().all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c))
    };
    while !rest.is_empty() {
        let lt = rest.find('<').unwrap_or(rest.len());
        let text = &rest[..lt];
        xml_chars(text)?;
        if stack.is_empty() && !text.trim().is_empty() {
            return Err(format!("text outside the root: {text:?}"));
        }
        rest = &rest[lt..];
        if rest.is_empty() {
            break;
        }
        if let Some(r) = rest.strip_prefix("</") {
            let gt = r.find('>').ok_or("unclosed end tag")?;
            let name = r[..gt].trim_end();
            if stack.pop().as_deref() != Some(name) {
                return Err(format!("end tag </{name}> does not match"));
            }
            rest = &r[gt + 1..];
            continue;
        }
        let r = &rest[1..];
        let end = r
            .find(|c: char| c.is_whitespace() || c == '>' || c == '/')
            .ok_or("unclosed tag")?;
        let name = &r[..end];
        if !name_ok(name) {
            return Err(format!("bad element name {name:?}"));
        }
        let mut a = &r[end..];
        let mut seen = Vec::new();
        let empty = loop {
            a = a.trim_start();
            if let Some(x) = a.strip_prefix("/>") {
                a = x;
                break true;
            }
            if let Some(x) = a.strip_prefix('>') {
                a = x;
                break false;
            }
            let eq = a.find('=').ok_or("attribute without `=`")?;
            let an = a[..eq].trim();
            if !name_ok(an) || seen.contains(&an) {
                return Err(format!("bad or repeated attribute {an:?} of <{name}>"));
            }
            seen.push(an);
            let v = a[eq + 1..].trim_start();
            let q = v
                .chars()
                .next()
                .filter(|&q| q == '"' || q == '\'')
                .ok_or("unquoted attribute")?;
            let close = v[1..].find(q).ok_or("unterminated attribute")?;
            xml_chars(&v[1..1 + close]).map_err(|e| format!("attribute {an} of <{name}>: {e}"))?;
            a = &v[close + 2..];
        };
        if stack.is_empty() {
            roots += 1;
        }
        if !empty {
            stack.push(name.to_string());
        }
        rest = a;
    }
    if !stack.is_empty() || roots != 1 {
        return Err(format!("unbalanced: open {stack:?}, {roots} roots"));
    }
    Ok(())
}

// ---------------------------------------------------------------- HTML

/// Checks an HTML page: no raw control or bidi character, and every tag is
/// one the report writer emits (so no tag came from user data).
fn check_html(page: &str) {
    no_hidden("html", page);
    const TAGS: &[&str] = &[
        "!DOCTYPE",
        "html",
        "head",
        "meta",
        "title",
        "style",
        "body",
        "h1",
        "h2",
        "p",
        "pre",
        "span",
        "div",
        "figure",
        "figcaption",
        "details",
        "summary",
        "table",
        "tr",
        "th",
        "td",
        "svg",
        "rect",
        "text",
        "line",
        "polyline",
        "circle",
        "g",
        "code",
        "b",
        "a",
    ];
    for (i, _) in page.match_indices('<') {
        let tag: String = page[i + 1..]
            .trim_start_matches('/')
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '!')
            .collect();
        assert!(
            TAGS.contains(&tag.as_str()),
            "tag {tag:?} not written by the report at {:?}",
            &page[i..(i + 60).min(page.len())]
        );
    }
    let lower = page.to_ascii_lowercase();
    for bad in ["<img", "<script", "javascript:"] {
        assert!(!lower.contains(bad), "{bad} in the page");
    }
}

// ---------------------------------------------------------------- tests

/// A finished 2-token trace of the built-in model.
fn trace(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let o = moeconf(dir, &run_args(&out, "2", extra));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// The fork of gate_cli.rs: fails at L3/L4 with a localized first divergence.
const FORK: &[&str] = &["--fork-layer", "5", "--fork-contract", "b", "--fork-order", "135"];

#[test]
fn hostile_file_names_stay_inert_in_every_gate_diff_and_inspect_format() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join(".git")).unwrap();
    let r = trace(d, "ref.bin", &[]);
    let fork = trace(d, "fork.bin", FORK);
    // The line count of each text report for ordinary names: a name cannot add a line.
    let plain_lines = |args: &[&str]| report(d, args).lines().count();
    let gate_lines = plain_lines(&["gate", s(&r), s(&fork)]);
    let diff_lines = plain_lines(&["diff", s(&r), s(&fork)]);
    let inspect_lines = plain_lines(&["inspect", s(&fork)]);
    for (k, name) in FILE_NAMES.iter().enumerate() {
        let sub = d.join(format!("n{k}"));
        std::fs::create_dir(&sub).unwrap();
        let (rn, cn) = (sub.join(format!("r{name}")), sub.join(name));
        std::fs::copy(&r, &rn).unwrap();
        std::fs::copy(&fork, &cn).unwrap();
        let (rs, cs) = (s(&rn), s(&cn));
        let ctx = format!("file name {name:?}");

        let text = report(d, &["gate", rs, cs]);
        no_hidden(&ctx, &text);
        assert_eq!(text.lines().count(), gate_lines, "{ctx}: gate text\n{text}");
        assert!(text.contains(&visible(cs)), "{ctx}: gate text\n{text}");

        let j: serde_json::Value =
            serde_json::from_str(&report(d, &["gate", rs, cs, "--format", "json"])).unwrap();
        assert_eq!(j["candidate"], cs, "{ctx}");
        assert_eq!(j["reference"], rs, "{ctx}");

        let x = report(d, &["gate", rs, cs, "--format", "junit"]);
        check_xml(&x).unwrap_or_else(|e| panic!("{ctx}: JUnit: {e}\n{x}"));
        no_hidden(&ctx, &x);

        check_md(&report(d, &["gate", rs, cs, "--format", "md"]), &[rs, cs]);

        let html = sub.join("gate.html");
        report(d, &["gate", rs, cs, "--html", s(&html)]);
        check_html(&std::fs::read_to_string(&html).unwrap());

        let text = report(d, &["diff", rs, cs]);
        no_hidden(&ctx, &text);
        assert_eq!(text.lines().count(), diff_lines, "{ctx}: diff text\n{text}");
        assert!(text.contains(&visible(cs)), "{ctx}: diff text\n{text}");

        let j: serde_json::Value =
            serde_json::from_str(&report(d, &["diff", rs, cs, "--format", "json"])).unwrap();
        let json = j.to_string();
        assert!(
            json.contains(&serde_json::Value::from(cs).to_string()),
            "{ctx}: diff JSON lacks the exact name: {json}"
        );

        let html = sub.join("diff.html");
        report(d, &["diff", rs, cs, "--html", s(&html)]);
        check_html(&std::fs::read_to_string(&html).unwrap());

        let text = report(d, &["inspect", cs]);
        no_hidden(&ctx, &text);
        assert_eq!(text.lines().count(), inspect_lines, "{ctx}: inspect\n{text}");
        assert!(text.contains(&visible(cs)), "{ctx}: inspect\n{text}");
    }
}

/// `s` as a TOML basic string.
fn toml_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if c.is_control() => o.push_str(&format!("\\u{:04X}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

#[test]
fn hostile_profile_names_stay_inert_in_every_gate_format() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join(".git")).unwrap();
    let r = trace(d, "ref.bin", &[]);
    let fork = trace(d, "fork.bin", FORK);
    let policy = d.join("moeconf.toml");
    for name in PROFILE_NAMES {
        let ctx = format!("profile {name:?}");
        let q = toml_str(name);
        std::fs::write(
            &policy,
            format!("default_profile = {q}\n[profile.{q}]\nlevels = {{ L3 = \"tolerance\" }}\n"),
        )
        .unwrap();
        let args = ["gate", s(&r), s(&fork)];
        let text = report(d, &args);
        no_hidden(&ctx, &text);
        assert!(
            text.contains(&format!("(profile {}, ", visible(name))),
            "{ctx}:\n{text}"
        );

        let j: serde_json::Value =
            serde_json::from_str(&report(d, &[&args[..], &["--format", "json"]].concat())).unwrap();
        assert_eq!(j["profile"]["name"], *name, "{ctx}");

        let x = report(d, &[&args[..], &["--format", "junit"]].concat());
        check_xml(&x).unwrap_or_else(|e| panic!("{ctx}: JUnit: {e}\n{x}"));
        no_hidden(&ctx, &x);

        check_md(&report(d, &[&args[..], &["--format", "md"]].concat()), &[name]);

        let html = d.join("gate.html");
        report(d, &[&args[..], &["--html", s(&html)]].concat());
        check_html(&std::fs::read_to_string(&html).unwrap());
    }
}

#[test]
fn hostile_prompts_stay_inert_where_a_forced_gate_or_diff_reports_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join(".git")).unwrap();
    let prompt = |p: &str, name: &str| {
        let out = d.join(name);
        let mut args = run_args(&out, "2", &[]);
        let at = args.iter().position(|a| *a == "why the sheep").unwrap();
        args[at] = p;
        let o = moeconf(d, &args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        out
    };
    // A lone backtick and raw HTML: outside a code span on main's renderer.
    let hostile = "p <img src=x onerror=alert(1)> ` | \n> FAIL\u{202e}";
    let r = prompt("why the sheep", "ref.bin");
    let c = prompt(hostile, "cand.bin");
    let args = ["gate", s(&r), s(&c), "--force"];
    let md = report(d, &[&args[..], &["--format", "md"]].concat());
    assert!(
        md.contains("forced over prompt.text"),
        "the prompt reaches the report:\n{md}"
    );
    check_md(&md, &[]);
    let x = report(d, &[&args[..], &["--format", "junit"]].concat());
    check_xml(&x).unwrap_or_else(|e| panic!("JUnit: {e}\n{x}"));
    no_hidden("gate text", &report(d, &args));
    let html = d.join("gate.html");
    report(d, &[&args[..], &["--html", s(&html)]].concat());
    check_html(&std::fs::read_to_string(&html).unwrap());

    let diff = ["diff", s(&r), s(&c), "--force"];
    let text = report(d, &diff);
    assert!(text.contains("prompt.text"), "{text}");
    no_hidden("diff text", &text);
    let html = d.join("diff.html");
    report(d, &[&diff[..], &["--html", s(&html)]].concat());
    check_html(&std::fs::read_to_string(&html).unwrap());
}

#[test]
fn the_checkers_catch_what_they_look_for() {
    // Markdown: a backtick closing the span early, raw HTML, a pipe adding a column.
    assert!(md_spans("Profile `x` <img> `y`.").is_ok_and(|(sp, t)| sp == ["x", "y"] && t.contains('<')));
    assert!(md_spans("`a` ``b").is_err());
    assert_eq!(md_spans("``a`b``").unwrap().0, ["a`b"]);
    assert_eq!(md_spans("`` `x ``").unwrap().0, ["`x"]);
    assert_eq!(md_cells("| a | b\\|c |"), [" a ", " b|c "]);
    assert_eq!(md_cells("| a\\\\|c |").len(), 2);
    // XML: forbidden characters, raw `<`, unbalanced elements, &#0;.
    let decl = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
    assert!(check_xml(&format!("{decl}<a b=\"1\"><c/>t &amp; &#65;</a>\n")).is_ok());
    for bad in [
        "<a>\u{1}</a>",
        "<a>&#0;</a>",
        "<a b=\"<\"/>",
        "<a><b></a>",
        "<a/><b/>",
        "<a>&x;</a>",
    ] {
        assert!(check_xml(&format!("{decl}{bad}")).is_err(), "{bad}");
    }
}

#[test]
fn hostile_file_names_stay_inert_in_replay_reports() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fork = trace(
        d,
        "fork.bin",
        &["--capture", "replay", "--fork-layer", "5", "--fork-contract", "b"],
    );
    let plain = report(d, &["replay", s(&fork)]).lines().count();
    for (k, name) in FILE_NAMES.iter().enumerate().step_by(3) {
        let sub = d.join(format!("n{k}"));
        std::fs::create_dir(&sub).unwrap();
        let c = sub.join(name);
        std::fs::copy(&fork, &c).unwrap();
        let ctx = format!("file name {name:?}");
        let text = report(d, &["replay", s(&c)]);
        no_hidden(&ctx, &text);
        assert_eq!(text.lines().count(), plain, "{ctx}: replay text\n{text}");
        assert!(text.contains(&visible(s(&c))), "{ctx}: replay text\n{text}");
        let j: serde_json::Value =
            serde_json::from_str(&report(d, &["replay", s(&c), "--format", "json"])).unwrap();
        assert_eq!(j["candidate"], s(&c), "{ctx}");
        let html = sub.join("replay.html");
        report(d, &["replay", s(&c), "--html", s(&html)]);
        check_html(&std::fs::read_to_string(&html).unwrap());
    }
}

#[test]
fn error_messages_name_hostile_files_without_terminal_escapes() {
    let dir = tempfile::tempdir().unwrap();
    let name = dir.path().join("ansi\u{1b}]0;title\u{7}\u{1b}[2J rtl\u{202e}x");
    let o = moeconf(dir.path(), &["inspect", s(&name)]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(
        err.contains("\\u{1b}]0;title\\u{7}\\u{1b}[2J rtl\\u{202e}x"),
        "{err}"
    );
    let raw = err.trim_end().chars().find(|&c| c.is_control() && c != '\n');
    assert!(raw.is_none() && !err.contains('\u{202e}'), "{err:?}");
}
