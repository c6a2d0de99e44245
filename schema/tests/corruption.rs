//! Untrusted input: every truncation and every single-byte corruption of a
//! valid trace is rejected with an error (never a panic, never accepted), in
//! both container versions; a version 2 trace read lazily rejects every
//! corrupted byte of the blocks and payloads it reads.

mod common;

use common::{write_small, write_small_version};
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
    for version in [1, 2] {
        let p = dir.path().join("t.bin");
        write_small_version(&p, Algorithm::Blake3, version);
        let bytes = std::fs::read(&p).unwrap();
        assert!(check(bytes.clone()).is_ok());
        for n in 0..bytes.len() {
            let e = check(bytes[..n].to_vec()).expect_err("truncated trace accepted");
            let msg = e.to_string();
            assert!(msg.starts_with("case.bin: "), "message names the file: {msg}");
        }
    }
}

#[test]
fn every_single_byte_flip_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    for version in [1, 2] {
        for alg in [Algorithm::Blake3, Algorithm::Sha256] {
            let p = dir.path().join("t.bin");
            write_small_version(&p, alg, version);
            let bytes = std::fs::read(&p).unwrap();
            for i in 0..bytes.len() {
                for mask in [0x01u8, 0x80, 0xff] {
                    let mut b = bytes.clone();
                    b[i] ^= mask;
                    let e = check(b).expect_err(&format!("v{version}: flip {mask:#x} at byte {i} accepted"));
                    // Every error but a version mismatch carries a byte offset.
                    if !matches!(e, TraceError::UnsupportedVersion { .. }) {
                        assert!(e.offset().is_some(), "{e}");
                    }
                }
            }
        }
    }
}

/// Reads every node and payload of a version 2 trace the lazy way (what a
/// comparison does, on every path at once), without the full verification.
fn walk_lazily(bytes: Vec<u8>) -> Result<(), TraceError> {
    let t = Trace::from_bytes(Path::new("case.bin"), bytes)?;
    for s in t.steps().to_vec() {
        let node = t.step(s.step)?.expect("listed step");
        for g in node.levels.iter().flat_map(|l| &l.groups) {
            for &i in t.group_records(g)? {
                t.payload_verified(i)?;
            }
        }
    }
    Ok(())
}

/// Integrity on every used path: a version 2 trace read lazily (no full
/// verification) refuses every flipped byte of every block and payload it
/// reads, and of the header and trailer. The only bytes a lazy read does
/// not look at are the zero padding between chunks (which `inspect` and
/// every full verification check, see above) and the layout facts only a
/// whole-file check can see.
#[test]
fn a_lazy_read_refuses_every_flipped_byte_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    write_small_version(&p, Algorithm::Blake3, 2);
    let bytes = std::fs::read(&p).unwrap();
    walk_lazily(bytes.clone()).unwrap();
    let t = Trace::open(&p).unwrap();
    walk_lazily(bytes.clone()).unwrap();
    // Every byte the lazy walk reads: header, trailer, blocks, payloads.
    let mut read = vec![false; bytes.len()];
    let mut mark = |from: u64, len: u64| read[from as usize..(from + len) as usize].fill(true);
    let header_len = u64::from_le_bytes(bytes[24..32].try_into().unwrap());
    mark(0, 32 + header_len);
    mark(bytes.len() as u64 - 136, 136);
    for s in t.steps().to_vec() {
        let node = t.step(s.step).unwrap().unwrap();
        for g in node.levels.iter().flat_map(|l| &l.groups) {
            for &i in t.group_records(g).unwrap() {
                if let Some(p) = t.record(i).payload {
                    mark(p.offset, p.len);
                }
            }
        }
    }
    for (offset, len) in t.blocks_read() {
        mark(offset, len);
    }
    let mut checked = 0;
    for i in (0..bytes.len()).filter(|&i| read[i]) {
        let mut b = bytes.clone();
        b[i] ^= 0x01;
        assert!(walk_lazily(b).is_err(), "flip at byte {i} read and accepted");
        checked += 1;
    }
    // What is not read is padding, which must be zero.
    for i in (0..bytes.len()).filter(|&i| !read[i]) {
        assert_eq!(bytes[i], 0, "byte {i} is neither read nor padding");
    }
    assert!(
        checked > bytes.len() / 2,
        "{checked} of {} bytes read",
        bytes.len()
    );
}

#[test]
fn future_versions_are_refused_with_the_supported_version() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    write_small(&p, Algorithm::Blake3);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8] = 5;
    let e = check(bytes).unwrap_err();
    assert_eq!(
        e.to_string(),
        "case.bin: trace format version 5 is not supported (this build reads versions 1 to 4); upgrade \
         moeconf or re-capture the trace"
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
    // Versions 2 and 3 (3 also reads every step's levels from the root block).
    for version in [2, 3] {
        mutations_never_panic(version);
    }
}

fn mutations_never_panic(version: u32) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    common::write_small_version(&p, Algorithm::Blake3, version);
    let base = std::fs::read(&p).unwrap();
    let mut s: u64 = 0x9e37_79b9_7f4a_7c15 ^ u64::from(version);
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
    for version in [1, 2] {
        corrupted_payload_is_refused(version);
    }
}

fn corrupted_payload_is_refused(version: u32) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    write_small_version(&p, Algorithm::Blake3, version);
    let t = Trace::open(&p).unwrap();
    let i = t
        .records()
        .unwrap()
        .iter()
        .position(|e| e.payload.is_some())
        .unwrap();
    let off = t.records().unwrap()[i].payload.unwrap().offset;
    let others: Vec<usize> = (0..t.records().unwrap().len())
        .filter(|&k| k != i && t.records().unwrap()[k].payload.is_some())
        .collect();
    drop(t);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[off as usize] ^= 0x01;
    let t = Trace::from_bytes(Path::new("case.bin"), bytes.clone()).expect("payload-only corruption opens");
    // The records of a version 2 trace are reached through its index first.
    assert_eq!(t.records().unwrap().len(), 14);
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
    write_small_version(&p, Algorithm::Blake3, version);
    let t = Trace::open_verified(&p).unwrap();
    for k in 0..t.records().unwrap().len() {
        assert_eq!(
            t.payload_verified(k).unwrap().is_some(),
            t.records().unwrap()[k].payload.is_some()
        );
    }
}
