//! Inline diff of two continuations with the `similar` crate, bounded in
//! time and memory (docs/diff.md, "Bounded work").
//!
//! Myers' diff costs O((N + M) · D) for D differing tokens: two unrelated
//! 100 000-character continuations took minutes. So the texts are first
//! trimmed of their common prefix and suffix (linear); when the differing
//! middle of either side holds more than [`TEXT_DIFF_MAX_TOKENS`] diff tokens
//! (words and whitespace runs; characters for unspaced scripts), no inline
//! diff is computed and a [`TextSummary`] is reported instead: the first
//! differing character (byte and character offset, line and column), both
//! lengths and a positional count of differing characters. Below the bound
//! the diff runs with a deadline of [`TEXT_DIFF_DEADLINE`] (similar then
//! falls back to a coarser but still correct edit script); at the bound a
//! worst-case diff takes well under that (docs/performance.md), so the
//! deadline is a safety net that normal inputs never reach.

use crate::report::{TextOp, TextPosition, TextSummary};
use moeconf_output::escape::multiline;
use similar::{ChangeTag, TextDiff};
use std::time::{Duration, Instant};

/// Largest differing middle, in diff tokens per side, that gets an inline diff.
pub const TEXT_DIFF_MAX_TOKENS: usize = 2048;

/// Deadline of one inline diff (similar's `deadline`).
pub const TEXT_DIFF_DEADLINE: Duration = Duration::from_secs(1);

/// How two differing continuations are shown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextComparison {
    /// An inline diff (adjacent segments of the same tag merged).
    Inline(Vec<TextOp>),
    /// The middle is too long to diff: where and how much they differ.
    Summary(TextSummary),
}

/// Whether the text reads without spaces between words (CJK scripts), so a
/// character diff is the meaningful granularity.
fn is_unspaced(s: &str) -> bool {
    s.chars()
        .any(|c| matches!(c as u32, 0x2E80..=0x9FFF | 0xAC00..=0xD7AF | 0xF900..=0xFAFF | 0xFF00..=0xFFEF))
}

/// The two texts without their common prefix and common suffix (on
/// character boundaries), and the prefix's byte length.
fn middles<'a, 'b>(a: &'a str, b: &'b str) -> (&'a str, &'b str, usize) {
    let prefix = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or_else(|| a.len().min(b.len()), |((i, _), _)| i);
    let (ra, rb) = (&a[prefix..], &b[prefix..]);
    let suffix: usize = ra
        .chars()
        .rev()
        .zip(rb.chars().rev())
        .take_while(|(x, y)| x == y)
        .map(|(x, _)| x.len_utf8())
        .sum();
    (&ra[..ra.len() - suffix], &rb[..rb.len() - suffix], prefix)
}

/// The diff tokens of `s`: characters for unspaced scripts, else runs of
/// whitespace and of non-whitespace (as similar's word tokenizer splits).
fn tokens(s: &str, unspaced: bool) -> usize {
    if unspaced {
        return s.chars().count();
    }
    let mut n = 0;
    let mut last: Option<bool> = None;
    for c in s.chars() {
        let ws = c.is_whitespace();
        if last != Some(ws) {
            n += 1;
            last = Some(ws);
        }
    }
    n
}

/// Word diff (character diff for unspaced scripts) of `reference` against
/// `candidate` when their differing middle is within
/// [`TEXT_DIFF_MAX_TOKENS`], under [`TEXT_DIFF_DEADLINE`]; else the summary.
pub fn compare_texts(reference: &str, candidate: &str) -> TextComparison {
    compare_texts_within(
        reference,
        candidate,
        TEXT_DIFF_MAX_TOKENS,
        Instant::now() + TEXT_DIFF_DEADLINE,
    )
}

/// [`compare_texts`] with an explicit bound and deadline.
fn compare_texts_within(a: &str, b: &str, max_tokens: usize, deadline: Instant) -> TextComparison {
    let unspaced = is_unspaced(a) || is_unspaced(b);
    let (ma, mb, prefix) = middles(a, b);
    let longest = tokens(ma, unspaced).max(tokens(mb, unspaced));
    if longest > max_tokens {
        let unit = if unspaced {
            "characters"
        } else {
            "words and spaces"
        };
        let reason = format!(
            "the differing part holds {longest} diff tokens ({unit}), more than the {max_tokens} an inline diff \
             is computed for"
        );
        return TextComparison::Summary(summarize(a, b, prefix, reason));
    }
    TextComparison::Inline(diff_ops(a, b, unspaced, deadline))
}

/// The inline diff, adjacent segments of the same tag merged.
fn diff_ops(a: &str, b: &str, unspaced: bool, deadline: Instant) -> Vec<TextOp> {
    let mut config = TextDiff::configure();
    config.deadline(deadline);
    let diff = if unspaced {
        config.diff_chars(a, b)
    } else {
        config.diff_words(a, b)
    };
    let mut out: Vec<TextOp> = Vec::new();
    for change in diff.iter_all_changes() {
        let tag = match change.tag() {
            ChangeTag::Equal => "equal",
            ChangeTag::Delete => "delete",
            ChangeTag::Insert => "insert",
        };
        let text = change.value();
        match out.last_mut() {
            Some(last) if last.tag == tag => last.text.push_str(text),
            _ => out.push(TextOp {
                tag: tag.to_string(),
                text: text.to_string(),
            }),
        }
    }
    out
}

/// Where `a` and `b` (sharing their first `prefix` bytes) first differ,
/// their lengths and the positional count of differing characters: one
/// linear pass, no allocation beyond the result.
fn summarize(a: &str, b: &str, prefix: usize, reason: String) -> TextSummary {
    let shared = &a[..prefix];
    let line_start = shared.rfind('\n').map_or(0, |i| i + 1);
    let (na, nb) = (a.chars().count() as u64, b.chars().count() as u64);
    let positional = a.chars().zip(b.chars()).filter(|(x, y)| x != y).count() as u64;
    TextSummary {
        reason,
        first_difference: TextPosition {
            byte_offset: prefix as u64,
            char_offset: shared.chars().count() as u64,
            line: 1 + shared.matches('\n').count() as u64,
            column: 1 + shared[line_start..].chars().count() as u64,
        },
        reference_chars: na,
        candidate_chars: nb,
        differing_chars: positional + na.abs_diff(nb),
    }
}

/// Renders ops in `git diff --word-diff` style: `[-removed-]{+added+}`.
/// Control characters other than newline and tab, and bidi controls, are
/// written visibly ([`moeconf_output::escape::multiline`]): a continuation
/// cannot send terminal escapes or reorder the report.
pub fn render_inline(ops: &[TextOp]) -> String {
    let mut s = String::new();
    for op in ops {
        let text = multiline(&op.text);
        match op.tag.as_str() {
            "delete" => s.push_str(&format!("[-{text}-]")),
            "insert" => s.push_str(&format!("{{+{text}+}}")),
            _ => s.push_str(&text),
        }
    }
    s
}

/// One line describing a [`TextSummary`]: where the texts first differ and how much.
pub fn describe_summary(s: &TextSummary) -> String {
    let p = &s.first_difference;
    format!(
        "first difference at character {} (byte {}, line {}, column {}); reference {} characters, candidate {}; \
         {} characters differ position by position ({})",
        p.char_offset,
        p.byte_offset,
        p.line,
        p.column,
        s.reference_chars,
        s.candidate_chars,
        s.differing_chars,
        s.reason
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inline(a: &str, b: &str) -> String {
        match compare_texts(a, b) {
            TextComparison::Inline(ops) => render_inline(&ops),
            TextComparison::Summary(s) => panic!("summary: {s:?}"),
        }
    }

    #[test]
    fn word_and_char_diffs() {
        assert_eq!(
            inline("the sheep ate grass", "the sheep slept here"),
            "the sheep [-ate-]{+slept+} [-grass-]{+here+}"
        );
        assert_eq!(
            inline("朋友昨天打来电话", "朋友今天打来电话"),
            "朋友[-昨-]{+今+}天打来电话"
        );
    }

    /// The words of a deterministic pseudo-random text of `n` characters.
    fn prose(seed: u64, n: usize) -> String {
        let words = [
            "the", "sheep", "ate", "grass", "on", "a", "hill", "while", "wind", "moved",
        ];
        let mut x = seed;
        let mut s = String::new();
        while s.len() < n {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            s.push_str(words[(x >> 33) as usize % words.len()]);
            s.push(' ');
        }
        s.truncate(n);
        s
    }

    #[test]
    fn long_divergent_middles_get_a_summary_not_a_diff() {
        // Two unrelated 100 000-character continuations (minutes with an
        // unbounded Myers diff): above the bound, summarized.
        let (a, b) = (prose(1, 100_000), prose(2, 100_000));
        let TextComparison::Summary(s) = compare_texts(&a, &b) else {
            panic!("expected the summary above {TEXT_DIFF_MAX_TOKENS} tokens");
        };
        assert_eq!((s.reference_chars, s.candidate_chars), (100_000, 100_000));
        assert!(s.differing_chars > 0 && s.differing_chars <= 100_000);
        assert!(s.reason.contains("more than the 2048"), "{}", s.reason);
        // CJK: one token per character.
        let a: String = (0..100_000)
            .map(|i| char::from_u32(0x4e00 + (i * 7 % 200)).unwrap())
            .collect();
        let b: String = (0..100_000)
            .map(|i| char::from_u32(0x4e00 + (i * 11 % 200)).unwrap())
            .collect();
        assert!(matches!(compare_texts(&a, &b), TextComparison::Summary(_)));
        // A long text that differs in a short middle still gets its inline diff.
        let mut c = a.clone();
        let at = c.char_indices().nth(50_000).map(|(i, _)| i).unwrap();
        c.replace_range(at..at + 3 * 100, "x");
        assert!(matches!(compare_texts(&a, &c), TextComparison::Inline(_)));
        // Exactly at the bound: inline; one token more: summary.
        let (x, y) = ("a".repeat(TEXT_DIFF_MAX_TOKENS), "b".repeat(TEXT_DIFF_MAX_TOKENS));
        let far = Instant::now() + Duration::from_secs(60);
        let unspaced = |s: &str| format!("朋{s}");
        assert!(matches!(
            compare_texts_within(&unspaced(&x), &unspaced(&y), TEXT_DIFF_MAX_TOKENS, far),
            TextComparison::Inline(_)
        ));
        assert!(matches!(
            compare_texts_within(
                &unspaced(&(x + "a")),
                &unspaced(&(y + "b")),
                TEXT_DIFF_MAX_TOKENS,
                far
            ),
            TextComparison::Summary(_)
        ));
    }

    #[test]
    fn the_summary_locates_the_first_difference() {
        let a = "line one\nline two\nsame end";
        let b = "line one\nline tXo\nsame end";
        let (ma, mb, prefix) = middles(a, b);
        assert_eq!((ma, mb, prefix), ("w", "X", 15));
        let s = summarize(a, b, prefix, String::new());
        assert_eq!(
            s.first_difference,
            TextPosition {
                byte_offset: 15,
                char_offset: 15,
                line: 2,
                column: 7
            }
        );
        assert_eq!(s.differing_chars, 1);
        // Multi-byte characters: byte and character offsets differ; a
        // prefix of the other text differs at the end.
        let s = summarize(
            "朋友ab",
            "朋友abcd",
            middles("朋友ab", "朋友abcd").2,
            String::new(),
        );
        assert_eq!(
            (s.first_difference.byte_offset, s.first_difference.char_offset),
            (8, 4)
        );
        assert_eq!(s.differing_chars, 2);
        assert!(
            describe_summary(&s).starts_with("first difference at character 4 (byte 8, line 1, column 5)")
        );
    }

    #[test]
    fn the_diff_honours_its_deadline() {
        // With the deadline already past, similar gives up on a minimal
        // script and replaces the whole differing middle: still a correct
        // diff of both texts, computed at once.
        let ops = match compare_texts_within(
            "the sheep ate grass",
            "the sheep slept here",
            TEXT_DIFF_MAX_TOKENS,
            Instant::now(),
        ) {
            TextComparison::Inline(ops) => ops,
            TextComparison::Summary(s) => panic!("{s:?}"),
        };
        assert_eq!(render_inline(&ops), "the sheep [-ate grass-]{+slept here+}");
        let escape = [TextOp {
            tag: "insert".into(),
            text: "\u{1b}[2J\u{202e}x\n".into(),
        }];
        assert_eq!(render_inline(&escape), "{+\\u{1b}[2J\\u{202e}x\n+}");
        assert!(TEXT_DIFF_DEADLINE > Duration::ZERO && TEXT_DIFF_DEADLINE <= Duration::from_secs(1));
    }
}
