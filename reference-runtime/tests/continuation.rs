//! The incremental decoding of `text.continuation` ([`Continuation`]) gives
//! exactly the full decode of the generated ids at every step, on many id
//! sequences (split multi-byte UTF-8, invalid bytes, special tokens, the
//! fixture tokenizer's byte symbols), at a cost that does not grow with the
//! number of ids; detokenizers without the splitting property (other HF
//! decoders) are decoded in full, as before.

use moeconf_contract::NativeCombine;
use moeconf_fingerprint::Level;
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::continuation::Continuation;
use moeconf_reference_runtime::error::RuntimeError;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::model::Model;
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::tokenizer::{Detokenize, Tokenizer};

/// A byte-level detokenizer over a table of per-id byte strings, decoding as
/// the `ByteLevel` decoder does: concatenate, then `from_utf8_lossy`.
struct Bytes(Vec<Vec<u8>>);

impl Detokenize for Bytes {
    fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
        let b: Vec<u8> = ids
            .iter()
            .flat_map(|&i| self.0.get(i as usize).cloned().unwrap_or_default())
            .collect();
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
    fn splits_at_complete_chars(&self) -> bool {
        true
    }
}

/// Tokens that split characters every way: every single byte, the pieces of
/// 2-, 3- and 4-byte characters, a literal U+FFFD, an empty token (a special
/// token), ASCII words.
fn tricky_table() -> Vec<Vec<u8>> {
    let mut t: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for s in ["é", "羊", "😀", "\u{FFFD}", "why", " the", " sheep"] {
        let b = s.as_bytes();
        t.push(b.to_vec());
        for cut in 1..b.len() {
            t.push(b[..cut].to_vec());
            t.push(b[cut..].to_vec());
        }
    }
    t.push(Vec::new());
    t.push("ab\u{FFFD}".as_bytes().to_vec());
    t.push(vec![b'x', 0xE7]); // a complete char then a lead byte
    t
}

/// A deterministic pseudo-random generator (SplitMix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Grows `ids` one id at a time and checks every step against the full
/// decode, and the kept prefix against the previous text. Returns the
/// decoder's state.
fn check_growth(det: &dyn Detokenize, ids: &[u32]) -> Continuation {
    let mut c = Continuation::default();
    let mut prev = String::new();
    for n in 1..=ids.len() {
        let full = det.decode(&ids[..n]).unwrap();
        let (text, kept) = c.update(det, &ids[..n]).unwrap();
        assert_eq!(text, full, "ids {:?}", &ids[..n]);
        assert!(kept <= prev.len() && kept <= full.len());
        assert_eq!(
            prev.as_bytes()[..kept],
            full.as_bytes()[..kept],
            "kept {kept} of {:?}",
            &ids[..n]
        );
        prev = full;
    }
    c
}

#[test]
fn split_characters_invalid_bytes_and_empty_tokens_decode_as_in_full() {
    let det = Bytes(tricky_table());
    let n = det.0.len();
    let mut rng = Rng(7);
    for _ in 0..400 {
        let len = 1 + rng.below(60);
        // Mostly the pieces and words (the table's end), some single bytes.
        let ids: Vec<u32> = (0..len)
            .map(|_| if rng.below(4) == 0 { rng.below(256) } else { 256 + rng.below(n - 256) } as u32)
            .collect();
        let c = check_growth(&det, &ids);
        assert_eq!(c.full_decodes(), 0, "extensions are never decoded in full");
    }
    // Every pair and triple of the pieces of the multi-byte characters.
    for a in 256..n as u32 {
        for b in 256..n as u32 {
            check_growth(&det, &[a, b, a]);
        }
    }
}

#[test]
fn decoding_cost_does_not_grow_with_the_generated_ids() {
    // 3,000 ids of complete and split characters: each step decodes the
    // few ids of the unfinished character, never the whole sequence
    // (a full decode per step would pass 4.5 million ids).
    let det = Bytes(tricky_table());
    let n = det.0.len();
    let mut rng = Rng(11);
    let ids: Vec<u32> = (0..3000).map(|_| (256 + rng.below(n - 256)) as u32).collect();
    let mut c = Continuation::default();
    for k in 1..=ids.len() {
        c.update(&det, &ids[..k]).unwrap();
    }
    assert_eq!(c.text(), det.decode(&ids).unwrap());
    assert!(
        c.ids_decoded() < 8 * ids.len() as u64,
        "{} ids decoded for {} steps",
        c.ids_decoded(),
        ids.len()
    );
}

/// The ids after the closed prefix (an unfinished character's) are checked
/// on each update; a sequence that differs there, or is shorter, is decoded
/// in full. (The closed prefix itself is not re-read: the generated ids only
/// grow, and a run checks its last text against a full decode.)
#[test]
fn a_sequence_that_is_not_an_extension_is_decoded_in_full() {
    let det = Bytes(tricky_table());
    let mut c = Continuation::default();
    c.update(&det, &[b'w' as u32, 0xE7]).unwrap(); // "w" and a lead byte
    let b = [b'w' as u32, 0x41, 0x42];
    let (text, kept) = c.update(&det, &b).unwrap();
    assert_eq!((text, kept), ("wAB", 1));
    assert_eq!(c.full_decodes(), 1);
    let (text, _) = c.update(&det, &[b'w' as u32]).unwrap();
    assert_eq!(text, "w");
    assert_eq!(c.full_decodes(), 2);
}

fn fixture_tokenizer(dir: &std::path::Path) -> Tokenizer {
    let files = moeconf_fixtures::write_tiny_v4_all(dir).unwrap();
    Tokenizer::from_file(&files.tokenizer).unwrap()
}

#[test]
fn the_fixture_tokenizer_decodes_incrementally_as_in_full() {
    let dir = tempfile::tempdir().unwrap();
    let tok = fixture_tokenizer(dir.path());
    assert!(tok.splits_at_complete_chars(), "a ByteLevel decoder");
    let vocab = tok.vocab_size();
    let mut rng = Rng(3);
    for round in 0..300 {
        let len = 1 + rng.below(80);
        // Any id: the special tokens (0, 1), the byte symbols (2..=257,
        // half of them continuation or lead bytes), the merges.
        let ids: Vec<u32> = (0..len)
            .map(|_| match round % 3 {
                0 => rng.below(vocab),
                1 => rng.below(258),
                _ => 128 + rng.below(130),
            } as u32)
            .collect();
        let c = check_growth(&tok, &ids);
        assert_eq!(c.full_decodes(), 0);
    }
    // Chinese and emoji text split at every token.
    for s in ["为什么羊会叫", "why the sheep 😀 é 羊", "\u{FFFD}x\u{FFFD}"] {
        check_growth(&tok, &tok.encode(s).unwrap());
    }
}

/// The fixture tokenizer with another decoder (or none): not the ByteLevel
/// decoder, so decoded in full at every step, and still equal.
#[test]
fn other_decoders_are_decoded_in_full() {
    let dir = tempfile::tempdir().unwrap();
    let files = moeconf_fixtures::write_tiny_v4_all(dir.path()).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&files.tokenizer).unwrap()).unwrap();
    let decoders = [
        serde_json::Value::Null,
        serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true}),
        serde_json::json!({"type": "WordPiece", "prefix": "##", "cleanup": true}),
        serde_json::json!({"type": "Sequence", "decoders": [{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]}),
    ];
    let mut rng = Rng(5);
    for (i, d) in decoders.into_iter().enumerate() {
        let mut j = json.clone();
        j["decoder"] = d;
        let path = dir.path().join(format!("tokenizer{i}.json"));
        std::fs::write(&path, serde_json::to_vec(&j).unwrap()).unwrap();
        let tok = Tokenizer::from_file(&path).unwrap();
        assert!(!tok.splits_at_complete_chars(), "decoder {i}");
        for _ in 0..20 {
            let ids: Vec<u32> = (0..1 + rng.below(30)).map(|_| rng.below(1024) as u32).collect();
            let c = check_growth(&tok, &ids);
            assert_eq!(c.full_decodes(), ids.len() as u64);
        }
    }
}

/// A generation's `text.continuation` records are the full decodes, and
/// were decoded incrementally (the state's decoder never decoded in full).
#[test]
fn generated_continuations_are_the_full_decodes() {
    let dir = tempfile::tempdir().unwrap();
    let tok = fixture_tokenizer(dir.path());
    let model = Model::load(dir.path()).unwrap();
    let ids = tok.encode("why the sheep").unwrap();
    let mut sink = MemorySink::with_levels(&[Level::L0]);
    let opts = GenerateOptions {
        max_new_tokens: 200,
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: Some(&tok),
        allow_non_finite: false,
    };
    let g = model.generate(&ids, &opts, &mut sink).unwrap();
    let texts: Vec<_> = sink.by_path("text.continuation").collect();
    assert_eq!(texts.len(), 200);
    for (s, r) in texts.iter().enumerate() {
        assert_eq!(
            r.bytes,
            tok.decode(&g.tokens[..=s]).unwrap().into_bytes(),
            "step {s}"
        );
    }
    assert_eq!(g.state.continuation.full_decodes(), 0);
    assert!(g.state.continuation.ids_decoded() < 8 * 200);
}
