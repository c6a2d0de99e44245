//! Inline diff of two continuations with the `similar` crate.

use crate::report::TextOp;
use similar::{ChangeTag, TextDiff};

/// Whether the text reads without spaces between words (CJK scripts), so a
/// character diff is the meaningful granularity.
fn is_unspaced(s: &str) -> bool {
    s.chars()
        .any(|c| matches!(c as u32, 0x2E80..=0x9FFF | 0xAC00..=0xD7AF | 0xF900..=0xFAFF | 0xFF00..=0xFFEF))
}

/// Word diff (character diff for unspaced scripts) of `reference` against
/// `candidate`, adjacent segments of the same tag merged.
pub fn inline_diff(reference: &str, candidate: &str) -> Vec<TextOp> {
    let diff = if is_unspaced(reference) || is_unspaced(candidate) {
        TextDiff::from_chars(reference, candidate)
    } else {
        TextDiff::from_words(reference, candidate)
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

/// Renders ops in `git diff --word-diff` style: `[-removed-]{+added+}`.
pub fn render_inline(ops: &[TextOp]) -> String {
    let mut s = String::new();
    for op in ops {
        match op.tag.as_str() {
            "delete" => s.push_str(&format!("[-{}-]", op.text)),
            "insert" => s.push_str(&format!("{{+{}+}}", op.text)),
            _ => s.push_str(&op.text),
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_and_char_diffs() {
        let ops = inline_diff("the sheep ate grass", "the sheep slept here");
        assert_eq!(
            render_inline(&ops),
            "the sheep [-ate-]{+slept+} [-grass-]{+here+}"
        );
        let ops = inline_diff("朋友昨天打来电话", "朋友今天打来电话");
        assert_eq!(render_inline(&ops), "朋友[-昨-]{+今+}天打来电话");
    }
}
