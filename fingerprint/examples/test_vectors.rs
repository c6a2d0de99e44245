//! Prints fixtures/test-vectors/fingerprint.json: record digests for small
//! tensors of every dtype and canonicalization case.
//!
//! Run: `cargo run -p moeconf-fingerprint --example test_vectors > fixtures/test-vectors/fingerprint.json`
//! The vectors are pinned only after `fixtures/test-vectors/check_vectors.py`
//! (an independent Python implementation with hashlib + blake3) agrees.

use moeconf_fingerprint::{
    canonicalize_in_place, record_digest, record_prefix, Algorithm, CanonPolicy, Coord, DType, Level, Phase,
    TensorView,
};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

struct Case {
    name: &'static str,
    coord: Coord,
    level: Level,
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
    fold: bool,
}

fn c(step: u32, position: u32, phase: Phase, layer: Option<u32>, path: &str) -> Coord {
    Coord {
        step,
        position,
        phase,
        layer,
        path: path.into(),
    }
}

fn main() {
    let f32s = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let cases = vec![
        Case {
            name: "f32 with -0 and a non-canonical NaN, -0 preserved",
            coord: c(1, 4, Phase::Decode, Some(5), "moe.combine"),
            level: Level::L4,
            dtype: DType::F32,
            shape: vec![4],
            bytes: f32s(&[0x3f80_0000, 0x8000_0000, 0xffc0_0001, 0x0000_0001]),
            fold: false,
        },
        Case {
            name: "same tensor, -0 folded to +0",
            coord: c(1, 4, Phase::Decode, Some(5), "moe.combine"),
            level: Level::L4,
            dtype: DType::F32,
            shape: vec![4],
            bytes: f32s(&[0x3f80_0000, 0x8000_0000, 0xffc0_0001, 0x0000_0001]),
            fold: true,
        },
        Case {
            name: "bf16 2x2 with a signalling NaN and -inf",
            coord: c(0, 2, Phase::Prefill, Some(0), "layer.post_ffn_mhc"),
            level: Level::L3,
            dtype: DType::BF16,
            shape: vec![2, 2],
            bytes: [0x3f80u16, 0x7f81, 0xff80, 0x8000]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
            fold: false,
        },
        Case {
            name: "f64 pair with a negative NaN",
            coord: c(2, 5, Phase::Decode, Some(1), "state.window_kv"),
            level: Level::L2,
            dtype: DType::F64,
            shape: vec![2],
            bytes: [0x3ff0_0000_0000_0000u64, 0xfff8_0000_0000_0000]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
            fold: false,
        },
        Case {
            name: "i32 token ids, model-global",
            coord: c(0, 0, Phase::Prefill, None, "token.input"),
            level: Level::L0,
            dtype: DType::I32,
            shape: vec![3],
            bytes: [17i32, 0, -1].iter().flat_map(|x| x.to_le_bytes()).collect(),
            fold: false,
        },
        Case {
            name: "i64 scalar (empty shape)",
            coord: c(3, 6, Phase::Decode, Some(2), "state.compressor.entry_count"),
            level: Level::L2,
            dtype: DType::I64,
            shape: vec![],
            bytes: 1i64.to_le_bytes().to_vec(),
            fold: false,
        },
        Case {
            name: "u32 pair",
            coord: c(1, 3, Phase::Decode, Some(4), "router.topk"),
            level: Level::L3,
            dtype: DType::U32,
            shape: vec![2],
            bytes: [7u32, 31].iter().flat_map(|x| x.to_le_bytes()).collect(),
            fold: false,
        },
        Case {
            name: "u8 UTF-8 text",
            coord: c(1, 3, Phase::Decode, None, "text.continuation"),
            level: Level::L0,
            dtype: DType::U8,
            shape: vec![8],
            bytes: "sheep羊".as_bytes().to_vec(),
            fold: false,
        },
        Case {
            name: "empty f32 [0, 4] (an absent overlap)",
            coord: c(1, 3, Phase::Decode, Some(2), "state.compressor.overlap_kv"),
            level: Level::L2,
            dtype: DType::F32,
            shape: vec![0, 4],
            bytes: vec![],
            fold: false,
        },
    ];
    println!("{{");
    println!("  \"_comment\": \"Record-digest test vectors for docs/format.md section 4.1. Each case gives the coordinate, level, dtype, shape, the raw little-endian input bytes, the canonicalization policy, the canonical bytes, the full preimage, and the BLAKE3 and SHA-256 digests. Regenerate with `cargo run -p moeconf-fingerprint --example test_vectors`; check independently with `python3 fixtures/test-vectors/check_vectors.py`.\",");
    println!("  \"records\": [");
    for (i, k) in cases.iter().enumerate() {
        let policy = CanonPolicy {
            fold_negative_zero: k.fold,
        };
        let t = TensorView {
            dtype: k.dtype,
            shape: &k.shape,
            bytes: &k.bytes,
        };
        let mut canon = k.bytes.clone();
        canonicalize_in_place(k.dtype, &mut canon, policy);
        let mut pre = record_prefix(&k.coord, k.level, k.dtype, &k.shape, canon.len() as u64);
        pre.extend_from_slice(&canon);
        let b3 = record_digest(Algorithm::Blake3, policy, &k.coord, k.level, t).unwrap();
        let sha = record_digest(Algorithm::Sha256, policy, &k.coord, k.level, t).unwrap();
        let layer = match k.coord.layer {
            Some(l) => l.to_string(),
            None => "null".into(),
        };
        println!("    {{");
        println!("      \"name\": \"{}\",", k.name);
        println!(
            "      \"coord\": {{\"step\": {}, \"position\": {}, \"phase\": \"{}\", \"layer\": {layer}, \"path\": \"{}\"}},",
            k.coord.step,
            k.coord.position,
            k.coord.phase.name(),
            k.coord.path
        );
        println!(
            "      \"level\": \"{}\", \"dtype\": \"{}\", \"shape\": {:?},",
            k.level, k.dtype, k.shape
        );
        println!("      \"fold_negative_zero\": {},", k.fold);
        println!("      \"input_hex\": \"{}\",", hex(&k.bytes));
        println!("      \"canonical_hex\": \"{}\",", hex(&canon));
        println!("      \"preimage_hex\": \"{}\",", hex(&pre));
        println!("      \"blake3\": \"{}\",", b3);
        println!("      \"sha256\": \"{}\"", sha);
        println!("    }}{}", if i + 1 < cases.len() { "," } else { "" });
    }
    println!("  ]");
    println!("}}");
}
