//! Escaping of user-controlled strings (trace file names, policy profile and
//! rule names, binding strings such as the model name or prompt text) for
//! every report format, so that such a string can neither forge report
//! structure (a line, a table cell, a code span, an XML element) nor carry
//! active markup (raw HTML in Markdown or HTML), nor visually reorder a line
//! (Unicode bidi controls).
//!
//! One rule is shared by all formats: a *hidden* character (a control
//! character, C0, DEL or C1, or a bidi control U+202A–U+202E, U+2066–U+2069)
//! is written visibly as its Rust escape (`\n`, `\r`, `\t`, `\0`,
//! `\u{202e}`). A backslash is kept as it is, so the form is for reading,
//! not for parsing back (JSON carries the exact string). On top of that:
//!
//! * [`text`]: the visible form only (names in text reports);
//!   [`multiline`] keeps newline and tab (generated text shown as text).
//! * [`xml`]: markup characters as entities; newline and tab kept (XML 1.0
//!   allows them and multi-line bodies pass through it), every other hidden
//!   character, and the noncharacters U+FFFE/U+FFFF XML 1.0 forbids, in the
//!   visible form (even `&#0;` is not well-formed XML).
//! * [`md_code`] and [`md_text`]: a Markdown code span whose backtick fence
//!   is longer than any backtick run inside, and plain Markdown text with
//!   `&`, `<`, `>` as entities and the inline-markup punctuation
//!   backslash-escaped; both escape `|` when they fill a table cell.

use std::borrow::Cow;

/// Where a Markdown fragment goes: a GitHub-flavoured table cell (whose
/// pipes must be escaped) or running text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MdContext {
    /// Inside a table row: `|` would end the cell.
    Cell,
    /// A paragraph, list item or block quote line.
    Inline,
}

/// Whether `c` is a Unicode bidi embedding, override or isolate control
/// (U+202A–U+202E, U+2066–U+2069), which can reorder how a line reads.
pub fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Whether a report shows `c` escaped: control characters (C0, DEL, C1)
/// and bidi controls.
pub fn is_hidden(c: char) -> bool {
    c.is_control() || is_bidi_control(c)
}

/// Appends the visible form of a hidden character `c`.
fn push_visible(o: &mut String, c: char) {
    match c {
        '\n' => o.push_str("\\n"),
        '\r' => o.push_str("\\r"),
        '\t' => o.push_str("\\t"),
        '\0' => o.push_str("\\0"),
        c => o.push_str(&format!("\\u{{{:x}}}", c as u32)),
    }
}

/// `s` with every hidden character in its visible form (borrowed when `s`
/// has none): for text reports, so a name can neither start a new line nor
/// reverse the rest of one.
pub fn text(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_hidden) {
        return Cow::Borrowed(s);
    }
    let mut o = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if is_hidden(c) {
            push_visible(&mut o, c);
        } else {
            o.push(c);
        }
    }
    Cow::Owned(o)
}

/// `s` with every hidden character but newline and tab in its visible form
/// (borrowed when it has none): for multi-line text a report shows as text,
/// such as a generated continuation, whose line breaks are its own but whose
/// terminal escapes (`\u{1b}`) or bidi controls must not act.
pub fn multiline(s: &str) -> Cow<'_, str> {
    let keep = |c: char| c == '\n' || c == '\t';
    if !s.chars().any(|c| is_hidden(c) && !keep(c)) {
        return Cow::Borrowed(s);
    }
    let mut o = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if is_hidden(c) && !keep(c) {
            push_visible(&mut o, c);
        } else {
            o.push(c);
        }
    }
    Cow::Owned(o)
}

/// `s` for XML 1.0 (and HTML) content and attribute values: `&`, `<`, `>`,
/// `"` and `'` as entities; tab and newline kept; other hidden characters
/// and U+FFFE/U+FFFF in their visible form.
pub fn xml(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            '\t' | '\n' => o.push(c),
            '\u{fffe}' | '\u{ffff}' => push_visible(&mut o, c),
            c if is_hidden(c) => push_visible(&mut o, c),
            c => o.push(c),
        }
    }
    o
}

/// `s` as a Markdown code span: hidden characters in their visible form, a
/// backtick fence one longer than the longest backtick run inside, padded
/// with a space on both sides when the content starts or ends with a
/// backtick (or with spaces on both ends, which CommonMark would strip).
/// In a table cell, `|` becomes `\|` (GitHub unescapes it inside code spans
/// too) and a backslash run right before a `|` is doubled, so that the
/// table's `\`-pairing cannot unescape the pipe.
pub fn md_code(s: &str, ctx: MdContext) -> String {
    let visible = text(s);
    let body: Cow<'_, str> = if ctx == MdContext::Cell && visible.contains('|') {
        let mut o = String::with_capacity(visible.len() + 4);
        let mut run = 0usize;
        for c in visible.chars() {
            match c {
                '\\' => run += 1,
                '|' => {
                    // Double the run: 2k backslashes pair up, `\|` stays an escaped pipe.
                    o.extend(std::iter::repeat_n('\\', 2 * run + 1));
                    o.push('|');
                    run = 0;
                }
                c => {
                    o.extend(std::iter::repeat_n('\\', run));
                    o.push(c);
                    run = 0;
                }
            }
        }
        o.extend(std::iter::repeat_n('\\', run));
        Cow::Owned(o)
    } else {
        visible
    };
    if body.is_empty() {
        return "` `".into();
    }
    let longest = body.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    let fence = "`".repeat(longest + 1);
    let pad = body.starts_with('`')
        || body.ends_with('`')
        || (body.starts_with(' ') && body.ends_with(' ') && !body.trim_matches(' ').is_empty());
    let sp = if pad { " " } else { "" };
    format!("{fence}{sp}{body}{sp}{fence}")
}

/// `s` as plain Markdown text: hidden characters in their visible form,
/// `&`, `<` and `>` as HTML entities (no raw HTML, autolink or entity), and
/// `\`, `` ` ``, `*`, `_`, `~`, `[`, `]` backslash-escaped (no code span,
/// emphasis, link or image); `|` too in a table cell.
pub fn md_text(s: &str, ctx: MdContext) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '\\' | '`' | '*' | '_' | '~' | '[' | ']' => {
                o.push('\\');
                o.push(c);
            }
            '|' if ctx == MdContext::Cell => o.push_str("\\|"),
            c if is_hidden(c) => push_visible(&mut o, c),
            c => o.push(c),
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use MdContext::{Cell, Inline};

    #[test]
    fn text_shows_controls_and_bidi_overrides_escaped() {
        assert!(matches!(text("ref.bin"), Cow::Borrowed("ref.bin")));
        assert_eq!(
            text("a\nb\r\t\0\u{1b}\u{7f}\u{85}\u{202e}c\u{2066}"),
            "a\\nb\\r\\t\\0\\u{1b}\\u{7f}\\u{85}\\u{202e}c\\u{2066}"
        );
        // Ordinary non-ASCII text is not hidden.
        assert_eq!(text("é✅日本"), "é✅日本");
    }

    #[test]
    fn multiline_keeps_line_breaks_only() {
        assert!(matches!(multiline("a\n\tb"), Cow::Borrowed("a\n\tb")));
        assert_eq!(multiline("a\n\u{1b}[2J\r\u{202e}b"), "a\n\\u{1b}[2J\\r\\u{202e}b");
    }

    #[test]
    fn xml_escapes_markup_and_replaces_what_xml_forbids() {
        assert_eq!(
            xml("a<b & \"c\" 'd'>\te\nf"),
            "a&lt;b &amp; &quot;c&quot; &#39;d&#39;&gt;\te\nf"
        );
        assert_eq!(
            xml("\0\u{1}\r\u{fffe}\u{ffff}\u{202e}"),
            "\\0\\u{1}\\r\\u{fffe}\\u{ffff}\\u{202e}"
        );
    }

    #[test]
    fn code_span_fence_outgrows_every_backtick_run() {
        assert_eq!(md_code("ref.bin", Inline), "`ref.bin`");
        assert_eq!(md_code("a`b", Inline), "``a`b``");
        assert_eq!(md_code("x```y", Inline), "````x```y````");
        assert_eq!(md_code("`x", Inline), "`` `x ``");
        assert_eq!(md_code("x`", Inline), "`` x` ``");
        assert_eq!(md_code(" x ", Inline), "`  x  `");
        assert_eq!(md_code("  ", Inline), "`  `");
        assert_eq!(md_code("", Inline), "` `");
        assert_eq!(md_code("a\nb", Inline), "`a\\nb`");
    }

    #[test]
    fn code_span_in_a_cell_keeps_its_pipes_escaped() {
        assert_eq!(md_code("a|b", Inline), "`a|b`");
        assert_eq!(md_code("a|b", Cell), "`a\\|b`");
        // One user backslash before a pipe: `\\` pairs, then `\|`.
        assert_eq!(md_code("a\\|b", Cell), "`a\\\\\\|b`");
        assert_eq!(md_code("a\\b\\", Cell), "`a\\b\\`");
    }

    #[test]
    fn text_has_no_active_markup() {
        assert_eq!(
            md_text(
                "<img src=x onerror=alert(1)> & ![a](b) *e* _u_ ~s~ `c` \\",
                Inline
            ),
            "&lt;img src=x onerror=alert(1)&gt; &amp; !\\[a\\](b) \\*e\\* \\_u\\_ \\~s\\~ \\`c\\` \\\\"
        );
        assert_eq!(md_text("a|b\nc", Inline), "a|b\\nc");
        assert_eq!(md_text("a|b\nc", Cell), "a\\|b\\nc");
        assert_eq!(
            md_text("moeconf.toml (built-in)", Cell),
            "moeconf.toml (built-in)"
        );
    }
}
