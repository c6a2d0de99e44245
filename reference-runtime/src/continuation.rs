//! The `text.continuation` record decoded incrementally: the decoding of
//! every generated id so far, at a cost per step that does not grow with
//! the number of generated ids, and exactly the bytes of the full decode.
//!
//! A detokenizer's output for `ids[..n+1]` is not always its output for
//! `ids[..n]` plus a suffix: a character split across byte-level tokens
//! decodes to U+FFFD until its last byte arrives. [`Continuation`] keeps a
//! *closed* prefix `ids[..j]` whose decoding can no longer change, and
//! decodes only the window `ids[j..]` with the detokenizer itself:
//!
//! ```text
//! decode(ids[..n]) = decode(ids[..j]) + decode(ids[j..n])
//! ```
//!
//! which holds for a detokenizer that [splits at complete
//! characters](crate::tokenizer::Detokenize::splits_at_complete_chars)
//! when `decode(ids[..j])` is empty or does not end in U+FFFD. By
//! induction (closed at `j` and `decode(ids[j..k])` empty or not ending in
//! U+FFFD makes `decode(ids[..k])` so too), `j` moves to `n` whenever the
//! window's decoding does not end in U+FFFD: the window holds the tokens of
//! an unfinished character (a few), or of a run of tokens each of which
//! left the text ending in U+FFFD (a run of invalid bytes). Other
//! detokenizers are decoded in full at every step, as before.

use crate::error::RuntimeError;
use crate::tokenizer::Detokenize;

/// The incremental decoding of a growing id sequence (see the module
/// documentation). A cache of a function of the ids: states that differ
/// only in it are equal.
#[derive(Debug, Clone, Default)]
pub struct Continuation {
    /// The decoding of the first `decoded` ids.
    text: String,
    /// Ids decoded so far.
    decoded: usize,
    /// The closed prefix: `ids[..closed]` decodes to `text[..closed_bytes]`,
    /// which no later id changes.
    closed: usize,
    closed_bytes: usize,
    /// `ids[closed..decoded]` as last decoded (checked on each update).
    window: Vec<u32>,
    /// Decodes of the whole sequence so far (for tests).
    full_decodes: u64,
    /// Ids passed to the detokenizer so far (for tests).
    ids_decoded: u64,
}

impl PartialEq for Continuation {
    /// Always equal: the cache is a function of the generated ids, which
    /// the state compares.
    fn eq(&self, _other: &Continuation) -> bool {
        true
    }
}

impl Continuation {
    /// The decoding of `ids`, a sequence that extends the one of the last
    /// call (the generated ids only grow), and how many leading bytes it
    /// shares with the last call's text. `det` must be the detokenizer of
    /// every call. A sequence whose window (the ids after the closed
    /// prefix) is not as last seen is decoded in full.
    pub fn update(&mut self, det: &dyn Detokenize, ids: &[u32]) -> Result<(&str, usize), RuntimeError> {
        let splits = det.splits_at_complete_chars();
        let extends = splits
            && ids.len() >= self.decoded
            && self.decoded >= self.closed
            && ids.get(self.closed..self.decoded) == Some(&self.window[..]);
        if !extends {
            let text = det.decode(ids)?;
            self.full_decodes += 1;
            self.ids_decoded += ids.len() as u64;
            let kept = common_prefix(&self.text, &text);
            self.text = text;
            self.decoded = ids.len();
            self.closed = 0;
            self.closed_bytes = 0;
            self.window.clear();
            if splits {
                self.window.extend_from_slice(ids);
                self.close();
            }
            return Ok((&self.text, kept));
        }
        let tail = det.decode(&ids[self.closed..])?;
        self.ids_decoded += (ids.len() - self.closed) as u64;
        let kept = self.closed_bytes + common_prefix(&self.text[self.closed_bytes..], &tail);
        self.text.truncate(self.closed_bytes);
        self.text.push_str(&tail);
        self.window.extend_from_slice(&ids[self.decoded..]);
        self.decoded = ids.len();
        self.close();
        Ok((&self.text, kept))
    }

    /// Moves the closed prefix to the end when the text does not end in
    /// U+FFFD (or the window decodes to nothing).
    fn close(&mut self) {
        if self.text.len() == self.closed_bytes || !self.text.ends_with('\u{FFFD}') {
            self.closed = self.decoded;
            self.closed_bytes = self.text.len();
            self.window.clear();
        }
    }

    /// The decoding of the ids of the last [`Continuation::update`].
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whole-sequence decodes so far.
    pub fn full_decodes(&self) -> u64 {
        self.full_decodes
    }

    /// Ids passed to the detokenizer so far (the decoding's cost).
    pub fn ids_decoded(&self) -> u64 {
        self.ids_decoded
    }
}

/// Length of the longest common prefix of `a` and `b`, in bytes.
fn common_prefix(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}
