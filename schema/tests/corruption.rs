//! Untrusted input: every truncation and every single-byte corruption of a
//! valid trace is rejected with an error (never a panic, never accepted).

mod common;

use common::write_small;
use moeconf_fingerprint::Algorithm;
use moeconf_schema::{Trace, TraceError};
use std::path::Path;

fn check(bytes: Vec<u8>) -> Result<(), TraceError> {
    let t = Trace::from_bytes(Path::new("case.bin"), bytes)?;
    t.verify_payloads()?;
    Ok(())
}

#[test]
fn every_truncation_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    write_small(&p, Algorithm::Blake3);
    let bytes = std::fs::read(&p).unwrap();
    assert!(check(bytes.clone()).is_ok());
    for n in 0..bytes.len() {
        let e = check(bytes[..n].to_vec()).expect_err("truncated trace accepted");
        let msg = e.to_string();
        assert!(msg.starts_with("case.bin: "), "message names the file: {msg}");
    }
}

#[test]
fn every_single_byte_flip_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    for alg in [Algorithm::Blake3, Algorithm::Sha256] {
        let p = dir.path().join("t.bin");
        write_small(&p, alg);
        let bytes = std::fs::read(&p).unwrap();
        for i in 0..bytes.len() {
            for mask in [0x01u8, 0x80, 0xff] {
                let mut b = bytes.clone();
                b[i] ^= mask;
                let e = check(b).expect_err(&format!("flip {mask:#x} at byte {i} accepted"));
                // Every error but a version mismatch carries a byte offset.
                if !matches!(e, TraceError::UnsupportedVersion { .. }) {
                    assert!(e.offset().is_some(), "{e}");
                }
            }
        }
    }
}

#[test]
fn future_versions_are_refused_with_the_supported_version() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    write_small(&p, Algorithm::Blake3);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8] = 2;
    let e = check(bytes).unwrap_err();
    assert_eq!(
        e.to_string(),
        "case.bin: trace format version 2 is not supported (this build reads version 1); upgrade moeconf or \
         re-capture the trace"
    );
}

#[test]
fn garbage_and_empty_files_are_rejected() {
    assert!(check(Vec::new())
        .unwrap_err()
        .to_string()
        .contains("shorter than the smallest trace"));
    assert!(check(vec![0u8; 500])
        .unwrap_err()
        .to_string()
        .contains("bad magic"));
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("missing.bin");
    let e = Trace::open(&p).err().unwrap();
    assert!(e.to_string().contains("missing.bin: opening trace"), "{e}");
}

/// A deterministic mutation fuzzer over the reader, the same body as the
/// `cargo fuzz` target in fuzz/: random multi-byte corruptions, splices and
/// length changes must never panic.
#[test]
fn random_mutations_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    write_small(&p, Algorithm::Blake3);
    let base = std::fs::read(&p).unwrap();
    let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for _ in 0..3000 {
        let mut b = base.clone();
        for _ in 0..(1 + next() % 4) {
            let i = (next() % b.len() as u64) as usize;
            match next() % 3 {
                0 => b[i] = next() as u8,
                1 => {
                    let v = (next() % 0x1_0000_0000) as u32;
                    let end = (i + 4).min(b.len());
                    b[i..end].copy_from_slice(&v.to_le_bytes()[..end - i]);
                }
                _ => b.truncate(i.max(1)),
            }
        }
        moeconf_schema::fuzz_read(&b);
    }
}

/// The reader hands out payload bytes only through the verified accessor:
/// a payload whose bytes no longer match its record digest (index,
/// checksum and root intact, so the file opens) is an error naming the
/// file, the record and the payload's offset, on every read, from
/// `payload_verified`, `verify_payloads` and `open_verified` alike; the
/// other records stay readable.
#[test]
fn a_corrupted_payload_is_refused_by_every_accessor() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    write_small(&p, Algorithm::Blake3);
    let t = Trace::open(&p).unwrap();
    let i = t.records().iter().position(|e| e.payload.is_some()).unwrap();
    let off = t.records()[i].payload.unwrap().offset;
    let others: Vec<usize> = (0..t.records().len())
        .filter(|&k| k != i && t.records()[k].payload.is_some())
        .collect();
    drop(t);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[off as usize] ^= 0x01;
    let t = Trace::from_bytes(Path::new("case.bin"), bytes.clone()).expect("payload-only corruption opens");
    let want = format!("case.bin: byte {off}: record {i} (");
    for _ in 0..2 {
        let e = t.payload_verified(i).expect_err("corrupted payload handed out");
        assert!(e.to_string().starts_with(&want), "{e}");
        assert!(e.to_string().contains("do not match the record digest"), "{e}");
        assert_eq!(e.offset(), Some(off));
    }
    for &k in &others {
        assert!(t.payload_verified(k).unwrap().is_some(), "record {k}");
    }
    let e = t.verify_payloads().expect_err("verification passed");
    assert!(e.to_string().starts_with(&want), "{e}");
    std::fs::write(&p, &bytes).unwrap();
    let e = Trace::open_verified(&p).err().expect("open_verified accepted it");
    assert_eq!(e.offset(), Some(off), "{e}");
    // After a successful verification every payload is served (from the cache).
    write_small(&p, Algorithm::Blake3);
    let t = Trace::open_verified(&p).unwrap();
    for k in 0..t.records().len() {
        assert_eq!(
            t.payload_verified(k).unwrap().is_some(),
            t.records()[k].payload.is_some()
        );
    }
}
