//! End to end with the fixture tokenizer: a text prompt is encoded, generated
//! from, and every step's `text.continuation` record is the UTF-8 decoding of
//! all generated ids so far.

use moeconf_contract::NativeCombine;
use moeconf_fingerprint::{DType, Level};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::Model;
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::tokenizer::{Detokenize, Tokenizer};

#[test]
fn text_prompt_generates_and_records_continuations() {
    let dir = tempfile::tempdir().unwrap();
    let files = moeconf_fixtures::write_tiny_v4_all(dir.path()).unwrap();
    let model = Model::load(dir.path()).unwrap();
    let tok = Tokenizer::from_file(&files.tokenizer).unwrap();
    for prompt in ["why the sheep", "为什么羊会叫"] {
        let ids = tok.encode(prompt).unwrap();
        assert!(!ids.is_empty());
        assert!(ids.iter().all(|&i| (i as usize) < model.config().vocab_size));
        let mut sink = MemorySink::with_levels(&[Level::L0]);
        let opts = GenerateOptions {
            max_new_tokens: 8,
            precision: Precision::Bf16,
            combine: &NativeCombine,
            detokenizer: Some(&tok),
            allow_non_finite: false,
        };
        let g = model.generate(&ids, &opts, &mut sink).unwrap();
        let texts: Vec<_> = sink.by_path("text.continuation").collect();
        assert_eq!(texts.len(), 8);
        for (s, r) in texts.iter().enumerate() {
            assert_eq!(r.dtype, DType::U8);
            assert_eq!(r.bytes, tok.decode(&g.tokens[..=s]).unwrap().into_bytes());
        }
        let inputs: Vec<_> = sink.by_path("token.input").collect();
        assert_eq!(
            inputs[0].i32s(),
            ids.iter().map(|&i| i as i32).collect::<Vec<_>>()
        );
    }
}

#[test]
fn missing_tokenizer_file_is_named() {
    let err = Tokenizer::from_file(std::path::Path::new("/nonexistent/tokenizer.json")).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/tokenizer.json"), "{err}");
}
