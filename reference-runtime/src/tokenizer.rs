//! Tokenization through the `tokenizers` crate from a `tokenizer.json`:
//! `encode` adds no special tokens; `decode` keeps special tokens out.

use std::path::{Path, PathBuf};

use crate::error::RuntimeError;
use crate::files::{read_capped, MAX_TOKENIZER_BYTES};

/// Turns generated ids into text (for the `text.continuation` record).
pub trait Detokenize: Sync {
    /// Decodes ids to text.
    fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError>;
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
}
