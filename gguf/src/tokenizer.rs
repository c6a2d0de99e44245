//! The tokenizer of a checkpoint (`tokenizer.json`) as GGUF `tokenizer.ggml.*` metadata, so
//! that llama.cpp tokenizes the prompt itself.
//!
//! Only the tokenizer llama.cpp's `gpt2` model with the `gpt-2` pre-tokenizer reproduces is
//! accepted (llama-cpp-python 0.3.36, `src/llama-vocab.cpp`): a byte-level BPE (`model.type`
//! `BPE`, a `ByteLevel` pre-tokenizer with the GPT-2 split regex and no prefix space, no
//! normalizer, no byte fallback, no subword prefix or suffix). The moeconf fixture tokenizer
//! is such a BPE. Anything else is refused with the key that differs: llama.cpp would
//! otherwise tokenize the prompt differently, and the capture compares the two tokenizations
//! anyway.
//!
//! Ids are dense: `tokenizer.ggml.tokens[i]` is the token of id `i` (the byte-level strings of
//! the vocabulary, special tokens by their content); ids between the tokenizer's size and the
//! model's `vocab_size` are filled with `[PAD{id}]` of type UNUSED, as llama.cpp's converter
//! does. Token types: special added tokens CONTROL (3), other added tokens USER_DEFINED (4),
//! the rest NORMAL (1). Merges are written as `"left right"` in rank order.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value as Json;

use crate::value::Value;
use crate::GgufError;

/// llama.cpp's `LLAMA_TOKEN_TYPE_NORMAL`.
pub const TOKEN_TYPE_NORMAL: i32 = 1;
/// `LLAMA_TOKEN_TYPE_CONTROL`.
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// `LLAMA_TOKEN_TYPE_USER_DEFINED`.
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;
/// `LLAMA_TOKEN_TYPE_UNUSED`.
pub const TOKEN_TYPE_UNUSED: i32 = 5;

/// Largest tokenizer.json read (the V4 tokenizer is about 8 MB).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// A byte-level BPE vocabulary ready for GGUF.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufVocab {
    /// Token of each id.
    pub tokens: Vec<String>,
    /// Type of each id.
    pub token_types: Vec<i32>,
    /// Merges in rank order, `"left right"`.
    pub merges: Vec<String>,
}

impl GgufVocab {
    /// The `tokenizer.ggml.*` metadata, with `bos` / `eos` ids. BOS and EOS are not added
    /// automatically: moeconf feeds the prompt's ids without special tokens, as the reference
    /// runtime does.
    pub fn metadata(&self, bos: Option<u32>, eos: Option<u32>) -> Vec<(String, Value)> {
        let mut kv = vec![
            ("tokenizer.ggml.model".to_string(), Value::Str("gpt2".into())),
            ("tokenizer.ggml.pre".to_string(), Value::Str("gpt-2".into())),
            (
                "tokenizer.ggml.tokens".to_string(),
                Value::strs(self.tokens.iter().cloned()),
            ),
            (
                "tokenizer.ggml.token_type".to_string(),
                Value::i32s(self.token_types.iter().copied()),
            ),
            (
                "tokenizer.ggml.merges".to_string(),
                Value::strs(self.merges.iter().cloned()),
            ),
        ];
        if let Some(b) = bos {
            kv.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(b)));
        }
        if let Some(e) = eos {
            kv.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(e)));
        }
        kv.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)));
        kv.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)));
        kv
    }
}

fn unsupported(path: &Path, what: impl std::fmt::Display) -> GgufError {
    GgufError::Unsupported(format!(
        "{}: {what}; llama.cpp's gpt2 tokenizer with the gpt-2 pre-tokenizer would not reproduce it",
        path.display()
    ))
}

/// Reads `path` (a `tokenizer.json`) into a vocabulary of `vocab_size` ids.
pub fn read_tokenizer(path: &Path, vocab_size: usize) -> Result<GgufVocab, GgufError> {
    let bytes = moeconf_reference_runtime::files::read_capped(path, "tokenizer.json", MAX_TOKENIZER_BYTES)?;
    let json: Json = serde_json::from_slice(&bytes)
        .map_err(|e| GgufError::Invalid(format!("{}: invalid JSON: {e}", path.display())))?;
    vocab_from_json(path, &json, vocab_size)
}

/// [`read_tokenizer`] on parsed JSON (`path` only names the file in messages).
pub fn vocab_from_json(path: &Path, json: &Json, vocab_size: usize) -> Result<GgufVocab, GgufError> {
    let model = json.get("model").ok_or_else(|| unsupported(path, "no `model`"))?;
    if model.get("type").and_then(Json::as_str) != Some("BPE") {
        return Err(unsupported(
            path,
            format!(
                "`model.type` is {}, not \"BPE\"",
                model.get("type").unwrap_or(&Json::Null)
            ),
        ));
    }
    for (key, ok) in [
        ("byte_fallback", Json::Bool(false)),
        ("continuing_subword_prefix", Json::Null),
        ("end_of_word_suffix", Json::Null),
    ] {
        let v = model.get(key).unwrap_or(&Json::Null);
        let fine = v == &ok || (key != "byte_fallback" && v.as_str() == Some(""));
        if !fine {
            return Err(unsupported(path, format!("`model.{key}` is {v}")));
        }
    }
    if json.get("normalizer").is_some_and(|n| !n.is_null()) {
        return Err(unsupported(path, "it has a normalizer"));
    }
    let pre = json.get("pre_tokenizer").unwrap_or(&Json::Null);
    let byte_level = pre.get("type").and_then(Json::as_str) == Some("ByteLevel");
    if !byte_level
        || pre.get("add_prefix_space").and_then(Json::as_bool) != Some(false)
        || pre.get("use_regex").and_then(Json::as_bool) == Some(false)
    {
        return Err(unsupported(
            path,
            format!("the pre-tokenizer is {pre} (a ByteLevel with use_regex and without add_prefix_space is required)"),
        ));
    }
    let vocab = model
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| unsupported(path, "no `model.vocab` object"))?;
    let mut by_id: BTreeMap<u64, String> = BTreeMap::new();
    for (tok, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| unsupported(path, format!("vocabulary id of {tok:?} is {id}")))?;
        if by_id.insert(id, tok.clone()).is_some() {
            return Err(unsupported(
                path,
                format!("id {id} appears twice in the vocabulary"),
            ));
        }
    }
    let mut special: BTreeMap<u64, bool> = BTreeMap::new();
    for t in json
        .get("added_tokens")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
    {
        let id = t
            .get("id")
            .and_then(Json::as_u64)
            .ok_or_else(|| unsupported(path, format!("added token {t} has no id")))?;
        let content = t
            .get("content")
            .and_then(Json::as_str)
            .unwrap_or_default()
            .to_string();
        match by_id.get(&id) {
            Some(existing) if existing != &content => {
                return Err(unsupported(
                    path,
                    format!("added token id {id} is {content:?} but the vocabulary has {existing:?}"),
                ));
            }
            _ => {
                by_id.insert(id, content);
            }
        }
        special.insert(id, t.get("special").and_then(Json::as_bool).unwrap_or(false));
    }
    let n = by_id.keys().next_back().map_or(0, |&m| m as usize + 1);
    if n > vocab_size {
        return Err(unsupported(
            path,
            format!(
                "the tokenizer has ids up to {} but the model's vocab_size is {vocab_size}",
                n - 1
            ),
        ));
    }
    let mut tokens = Vec::with_capacity(vocab_size);
    let mut token_types = Vec::with_capacity(vocab_size);
    for id in 0..vocab_size as u64 {
        match by_id.get(&id) {
            Some(t) => {
                tokens.push(t.clone());
                token_types.push(match special.get(&id) {
                    Some(true) => TOKEN_TYPE_CONTROL,
                    Some(false) => TOKEN_TYPE_USER_DEFINED,
                    None => TOKEN_TYPE_NORMAL,
                });
            }
            None => {
                tokens.push(format!("[PAD{id}]"));
                token_types.push(TOKEN_TYPE_UNUSED);
            }
        }
    }
    let mut merges = Vec::new();
    for (i, m) in model
        .get("merges")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let (a, b) = match m {
            Json::String(s) => match s.split_once(' ') {
                Some((a, b)) => (a.to_string(), b.to_string()),
                None => return Err(unsupported(path, format!("merge {i} {s:?} has no space"))),
            },
            Json::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                _ => return Err(unsupported(path, format!("merge {i} is {m}"))),
            },
            _ => return Err(unsupported(path, format!("merge {i} is {m}"))),
        };
        if a.is_empty() || b.is_empty() || a.contains(' ') || b.contains(' ') {
            return Err(unsupported(
                path,
                format!("merge {i} ({a:?}, {b:?}) has an empty side or a space"),
            ));
        }
        merges.push(format!("{a} {b}"));
    }
    if merges.is_empty() {
        return Err(unsupported(path, "it has no merges"));
    }
    Ok(GgufVocab {
        tokens,
        token_types,
        merges,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Json {
        serde_json::json!({
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "added_tokens": [{"id": 0, "content": "<s>", "special": true}],
            "model": {"type": "BPE", "byte_fallback": false, "vocab": {"<s>": 0, "a": 1, "b": 2, "ab": 3},
                      "merges": [["a", "b"]]}
        })
    }

    #[test]
    fn a_byte_level_bpe_becomes_dense_tokens_types_and_merges() {
        let v = vocab_from_json(Path::new("t.json"), &tok(), 6).expect("vocab");
        assert_eq!(v.tokens, vec!["<s>", "a", "b", "ab", "[PAD4]", "[PAD5]"]);
        assert_eq!(v.token_types, vec![3, 1, 1, 1, 5, 5]);
        assert_eq!(v.merges, vec!["a b"]);
        let md = v.metadata(Some(0), Some(1));
        assert!(md.contains(&("tokenizer.ggml.pre".to_string(), Value::Str("gpt-2".into()))));
    }

    #[test]
    fn other_tokenizers_are_refused_naming_the_key() {
        let mut t = tok();
        t["pre_tokenizer"]["add_prefix_space"] = Json::Bool(true);
        let e = vocab_from_json(Path::new("t.json"), &t, 6)
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.json") && e.contains("pre-tokenizer"), "{e}");
        let mut t = tok();
        t["normalizer"] = serde_json::json!({"type": "NFC"});
        assert!(vocab_from_json(Path::new("t.json"), &t, 6)
            .unwrap_err()
            .to_string()
            .contains("normalizer"));
        let mut t = tok();
        t["model"]["type"] = Json::String("Unigram".into());
        assert!(vocab_from_json(Path::new("t.json"), &t, 6)
            .unwrap_err()
            .to_string()
            .contains("BPE"));
        assert!(vocab_from_json(Path::new("t.json"), &tok(), 3)
            .unwrap_err()
            .to_string()
            .contains("vocab_size"));
    }
}
