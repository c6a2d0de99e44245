//! Round trips through the writer and reader.

mod common;

use common::{coord, f32_bytes, header, write_small};
use moeconf_fingerprint::{
    record_digest, Algorithm, CanonPolicy, DType, Level, TensorView, CANONICAL_NAN_F32,
};
use moeconf_schema::{Trace, TraceWriter};

#[test]
fn written_trace_round_trips_for_both_algorithms() {
    let dir = tempfile::tempdir().unwrap();
    for alg in [Algorithm::Blake3, Algorithm::Sha256] {
        let path = dir.path().join(format!("{alg}.bin"));
        let summary = write_small(&path, alg);
        let t = Trace::open(&path).unwrap();
        assert_eq!(t.algorithm(), alg);
        assert_eq!(t.root(), summary.root);
        assert_eq!(t.records().len() as u64, summary.records);
        assert_eq!(summary.records, 2 * (2 + 2 * 2 + 1));
        assert_eq!(t.binding(), &header().binding);
        assert_eq!(t.provenance(), &header().provenance);
        let v = t.verify_payloads().unwrap();
        assert_eq!(v.payloads, summary.payloads);
        assert_eq!(summary.payloads, 2 * (2 + 2));
        // Records come back in write (execution) order with matching digests.
        assert_eq!(t.records()[1].coord.path, "lm.logits");
        let logits = t.payload_verified(1).unwrap().unwrap();
        let vals: Vec<u32> = logits
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(vals[1], 0x8000_0000, "negative zero preserved by default");
        assert_eq!(vals[2], CANONICAL_NAN_F32, "NaN canonicalized in the payload");
        let want = record_digest(
            alg,
            CanonPolicy::default(),
            &coord(0, None, "lm.logits"),
            Level::L1,
            TensorView {
                dtype: DType::F32,
                shape: &[4],
                bytes: &f32_bytes(&[0.5, -0.0, f32::NAN, 3.0]),
            },
        )
        .unwrap();
        assert_eq!(t.records()[1].digest, want);
        assert!(
            t.payload_verified(3).unwrap().is_none(),
            "fingerprint-only record has no payload"
        );
    }
}

#[test]
fn same_content_gives_byte_identical_files() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.bin");
    let b = dir.path().join("b.bin");
    write_small(&a, Algorithm::Blake3);
    write_small(&b, Algorithm::Blake3);
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
}

#[test]
fn payloads_are_aligned_for_memory_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    write_small(&p, Algorithm::Blake3);
    let t = Trace::open(&p).unwrap();
    for r in t.records() {
        if let Some(p) = r.payload {
            assert_eq!(p.offset % 64, 0);
        }
    }
}

#[test]
fn unfinished_writer_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    {
        let mut w = TraceWriter::create(&p, Algorithm::Blake3, header()).unwrap();
        let x = 1i32.to_le_bytes();
        w.append(
            coord(0, None, "token.output"),
            Level::L0,
            TensorView {
                dtype: DType::I32,
                shape: &[1],
                bytes: &x,
            },
            true,
        )
        .unwrap();
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "temp file removed, no final file"
    );
}

#[test]
fn writer_rejects_bad_records() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    let mut w = TraceWriter::create(&p, Algorithm::Blake3, header()).unwrap();
    let x = [0u8; 6];
    let e = w
        .append(
            coord(0, None, "lm.logits"),
            Level::L1,
            TensorView {
                dtype: DType::F32,
                shape: &[2],
                bytes: &x,
            },
            true,
        )
        .unwrap_err();
    assert!(e.to_string().contains("needs 8 bytes, got 6"), "{e}");
    let e = w
        .append(
            coord(0, None, "bad path"),
            Level::L1,
            TensorView {
                dtype: DType::U8,
                shape: &[6],
                bytes: &x,
            },
            true,
        )
        .unwrap_err();
    assert!(e.to_string().contains("invalid character"), "{e}");
    let ok = TensorView {
        dtype: DType::U8,
        shape: &[6],
        bytes: &x,
    };
    w.append(coord(0, None, "text.continuation"), Level::L0, ok, true)
        .unwrap();
    w.append(coord(0, None, "text.continuation"), Level::L0, ok, false)
        .unwrap();
    let e = w.finish().unwrap_err();
    assert!(e.to_string().contains("duplicate record"), "{e}");
    assert!(!p.exists());
}
