//! The pinned record-digest vectors of fixtures/test-vectors/fingerprint.json
//! (checked against an independent Python implementation before pinning).

use moeconf_fingerprint::{
    canonicalize_in_place, record_digest, record_prefix, Algorithm, CanonPolicy, Coord, DType, Level, Phase,
    TensorView,
};
use serde_json::Value;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn record_vectors_match() {
    let text = include_str!("../../fixtures/test-vectors/fingerprint.json");
    let doc: Value = serde_json::from_str(text).unwrap();
    let recs = doc["records"].as_array().unwrap();
    assert_eq!(recs.len(), 9);
    for r in recs {
        let c = &r["coord"];
        let coord = Coord {
            step: c["step"].as_u64().unwrap() as u32,
            position: c["position"].as_u64().unwrap() as u32,
            phase: if c["phase"] == "prefill" {
                Phase::Prefill
            } else {
                Phase::Decode
            },
            layer: c["layer"].as_u64().map(|l| l as u32),
            path: c["path"].as_str().unwrap().into(),
        };
        let level = Level::from_name(r["level"].as_str().unwrap()).unwrap();
        let dtype = DType::from_name(r["dtype"].as_str().unwrap()).unwrap();
        let shape: Vec<u64> = r["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let policy = CanonPolicy {
            fold_negative_zero: r["fold_negative_zero"].as_bool().unwrap(),
        };
        let input = unhex(r["input_hex"].as_str().unwrap());
        let mut canon = input.clone();
        canonicalize_in_place(dtype, &mut canon, policy);
        assert_eq!(
            canon,
            unhex(r["canonical_hex"].as_str().unwrap()),
            "{}",
            r["name"]
        );
        let mut pre = record_prefix(&coord, level, dtype, &shape, canon.len() as u64);
        pre.extend_from_slice(&canon);
        assert_eq!(pre, unhex(r["preimage_hex"].as_str().unwrap()), "{}", r["name"]);
        let t = TensorView {
            dtype,
            shape: &shape,
            bytes: &input,
        };
        for (alg, key) in [(Algorithm::Blake3, "blake3"), (Algorithm::Sha256, "sha256")] {
            let d = record_digest(alg, policy, &coord, level, t).unwrap();
            assert_eq!(d.to_hex(), r[key].as_str().unwrap(), "{} {key}", r["name"]);
        }
    }
}
