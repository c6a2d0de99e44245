//! Tokenization through the `tokenizers` crate from a `tokenizer.json`:
//! `encode` adds no special tokens; `decode` keeps special tokens out.

use std::path::{Path, PathBuf};

use crate::error::RuntimeError;
use crate::files::{read_capped, MAX_TOKENIZER_BYTES};

/// Turns generated ids into text (for the `text.continuation` record).
pub trait Detokenize: Sync {
    /// Decodes ids to text.
    fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError>;

    /// Whether this decoding splits at complete characters: for every id
    /// sequence `a ‖ b`, `decode(a ‖ b) == decode(a) + decode(b)` whenever
    /// `decode(a)` is empty or does not end in U+FFFD. The incremental
    /// decoding of the `text.continuation` record
    /// ([`crate::continuation::Continuation`]) relies on it and re-decodes
    /// everything at every step when it is `false` (the default, always
    /// correct). Implement `true` only with a proof.
    fn splits_at_complete_chars(&self) -> bool {
        false
    }
}

/// A `tokenizer.json` loaded with the `tokenizers` crate.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("path", &self.path).finish()
    }
}

impl Tokenizer {
    /// Loads `path`, a regular file of at most [`MAX_TOKENIZER_BYTES`].
    pub fn from_file(path: &Path) -> Result<Tokenizer, RuntimeError> {
        let bytes = read_capped(path, "tokenizer.json", MAX_TOKENIZER_BYTES)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| RuntimeError::Tokenizer {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| RuntimeError::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` for a model of `vocab_size` tokens: an id the
    /// model has no embedding for (a tokenizer that does not belong to the
    /// model, or an added token past its vocabulary) is an error naming this
    /// file, the token and its id, before anything runs.
    pub fn encode_for(&self, text: &str, vocab_size: usize) -> Result<Vec<u32>, RuntimeError> {
        let ids = self.encode(text)?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            let token = self.inner.id_to_token(id).unwrap_or_default();
            return Err(RuntimeError::Tokenizer {
                path: self.path.clone(),
                message: format!(
                    "the prompt's token {token:?} has id {id}, outside the model's vocabulary \
                     0..{vocab_size} (config.json `vocab_size`): this tokenizer does not match the model"
                ),
            });
        }
        Ok(ids)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

impl Detokenize for Tokenizer {
    fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
        self.inner.decode(ids, true).map_err(|e| RuntimeError::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        })
    }

    /// `true` for a `tokenizer.json` whose decoder is exactly `ByteLevel`
    /// (the fixture tokenizer's and DeepSeek's), from the `tokenizers`
    /// 0.22 source: `Tokenizer::decode` maps each id to its token on its
    /// own (special tokens dropped, unknown ids skipped), and the
    /// `ByteLevel` decoder maps each token to bytes on its own, concatenates
    /// them and returns `String::from_utf8_lossy` of the whole. So
    /// `decode(a ‖ b) = lossy(B(a) ‖ B(b))`. If `lossy(B(a))` is empty, `B(a)`
    /// is; if it does not end in U+FFFD, `B(a)` ends with a complete valid
    /// character (every invalid or incomplete sequence is replaced by a
    /// U+FFFD that ends the output), and the lossy scan then reaches the
    /// end of `B(a)` at a character boundary having emitted `lossy(B(a))`
    /// whatever follows (UTF-8 is prefix-free, and a sequence that starts
    /// before that character ends before it: its lead byte is not a
    /// continuation byte). Hence `lossy(B(a) ‖ B(b)) = lossy(B(a)) +
    /// lossy(B(b))`. Every other decoder (none: ids joined by spaces;
    /// Metaspace, WordPiece, CTC, sequences, ...) is decoded in full.
    /// `reference-runtime/tests/continuation.rs` checks the property against
    /// the full decode (a `tokenizers` upgrade that changed it fails there).
    fn splits_at_complete_chars(&self) -> bool {
        matches!(
            self.inner.get_decoder(),
            Some(tokenizers::decoders::DecoderWrapper::ByteLevel(_))
        )
    }
}
