//! The reader refuses records that no writer may write (docs/format.md §3.1,
//! §3.2, §7), even in a file whose checksum and root are consistent: a
//! decode record at step 0, a prefill record at a later step, a step at or
//! beyond `max_new_tokens`, and a fingerprint-only record whose byte length
//! (product of the shape times the element size) does not fit in a u64.
//! The files are assembled here from the layout's building blocks, bypassing
//! the writer's own checks, as a hostile or buggy producer would, in both
//! container versions (a version 2 reader refuses such a record when it
//! reads its group, or its step when it opens the root block).

use moeconf_fingerprint::wire::Encoder;
use moeconf_fingerprint::{
    binding_digest, group_digest, level_digest, root_digest, step_digest, Algorithm, Coord, DType, Digest,
    Level, Phase,
};
use moeconf_schema::layout::{align_up, checksum, fingerprint_tree, Preamble, Trailer};
use moeconf_schema::v2::{
    block_digest, checksum_v2, encode_group_block, encode_root_block, encode_step_block, BlockRef, GroupRef,
    LevelRefs, StepRef, TrailerV2,
};
use moeconf_schema::{Header, IndexEntry, Trace};
use std::path::Path;

/// A fingerprint-only version 2 trace of one step holding `entries` (one
/// level, one layer group), with correct digests, checksum and root.
fn raw_trace_v2(header: &Header, entries: &[IndexEntry]) -> Vec<u8> {
    let alg = Algorithm::Blake3;
    let hb = header.to_bytes();
    let mut file = Preamble {
        algorithm: alg,
        header_len: hb.len() as u64,
    }
    .to_bytes_version(2)
    .to_vec();
    file.extend_from_slice(&hb);
    let ph = file.clone();
    let block = |file: &mut Vec<u8>, bytes: Vec<u8>| {
        file.resize(align_up(file.len() as u64).unwrap() as usize, 0);
        let b = BlockRef {
            offset: file.len() as u64,
            len: bytes.len() as u64,
            digest: block_digest(alg, &bytes),
        };
        file.extend_from_slice(&bytes);
        b
    };
    let (step, level, layer) = (entries[0].coord.step, entries[0].level, entries[0].coord.layer);
    let g = block(
        &mut file,
        encode_group_block(
            step,
            level,
            layer,
            entries.iter().enumerate().map(|(i, e)| (i as u64, e)),
        ),
    );
    let gd = group_digest(alg, step, level, layer, entries.iter().map(|e| e.digest));
    let levels = vec![LevelRefs {
        level,
        groups: vec![GroupRef {
            layer,
            digest: gd,
            records: entries.len() as u64,
            block: g,
        }],
    }];
    let s = block(&mut file, encode_step_block(step, &levels));
    let sd = step_digest(
        alg,
        step,
        [(level, level_digest(alg, step, level, [gd].into_iter()))].into_iter(),
    );
    let mut level_records = [0u64; 5];
    level_records[level.code() as usize] = entries.len() as u64;
    let steps = [StepRef {
        step,
        digest: sd,
        level_records,
        block: s,
        level_digests: None,
    }];
    let r = block(&mut file, encode_root_block(&steps));
    let bd = binding_digest(alg, &header.binding.to_bytes());
    let mut t = TrailerV2 {
        root_block: r,
        record_count: entries.len() as u64,
        root: root_digest(alg, bd, [(step, sd)].into_iter()),
        checksum: Digest::ZERO,
    };
    t.checksum = checksum_v2(alg, &ph, &t.covered_bytes());
    file.extend_from_slice(&t.to_bytes());
    file
}

/// A fingerprint-only version 1 trace of `entries` under `header`, with a
/// correct checksum and root.
fn raw_trace(header: &Header, entries: &[IndexEntry]) -> Vec<u8> {
    let alg = Algorithm::Blake3;
    let hb = header.to_bytes();
    let mut file = Preamble {
        algorithm: alg,
        header_len: hb.len() as u64,
    }
    .to_bytes_version(1)
    .to_vec();
    file.extend_from_slice(&hb);
    let ph = file.clone();
    file.resize(align_up(file.len() as u64).unwrap() as usize, 0);
    let mut e = Encoder::new();
    e.len(entries.len());
    for x in entries {
        x.encode(&mut e);
    }
    let index = e.into_bytes();
    let (_, tree) = fingerprint_tree(alg, &header.binding, entries).unwrap();
    let mut t = Trailer {
        index_offset: file.len() as u64,
        index_len: index.len() as u64,
        record_count: entries.len() as u64,
        root: tree.root,
        checksum: Digest::ZERO,
    };
    t.checksum = checksum(alg, &ph, &index, &t.covered_bytes());
    file.extend_from_slice(&index);
    file.extend_from_slice(&t.to_bytes());
    file
}

fn entry(step: u32, phase: Phase, shape: &[u64]) -> IndexEntry {
    IndexEntry {
        coord: Coord {
            step,
            position: step,
            phase,
            layer: None,
            path: "token.output".into(),
        },
        level: Level::L0,
        dtype: DType::I32,
        shape: shape.into(),
        digest: Digest([7; 32]),
        payload: None,
    }
}

/// Reads a one-record raw trace of both versions (the version 2 trace with
/// its every node read): `Ok(())` or the reader's message, which must be the
/// same for both but for the byte offset.
fn open(max_new_tokens: u32, e: IndexEntry) -> Result<(), String> {
    let mut h = Header::default();
    h.binding.decoding.max_new_tokens = max_new_tokens;
    let v1 = Trace::from_bytes(Path::new("raw.bin"), raw_trace(&h, std::slice::from_ref(&e)))
        .map(drop)
        .map_err(|e| e.to_string());
    let v2 = Trace::from_bytes(Path::new("raw.bin"), raw_trace_v2(&h, &[e]))
        .and_then(|t| t.records().map(drop))
        .map_err(|e| e.to_string());
    let tail = |r: &Result<(), String>| {
        r.clone()
            .map_err(|m| m.rsplit(": ").next().unwrap_or("").to_string())
    };
    assert_eq!(tail(&v1), tail(&v2), "version 1 {v1:?}, version 2 {v2:?}");
    v2
}

#[test]
fn consistent_records_are_read() {
    assert!(open(2, entry(0, Phase::Prefill, &[1])).is_ok());
    assert!(open(2, entry(1, Phase::Decode, &[1])).is_ok());
    // A zero dimension makes the byte length 0 whatever the other dimensions.
    assert!(open(1, entry(0, Phase::Prefill, &[1 << 63, 4, 0])).is_ok());
    assert!(open(1, entry(0, Phase::Prefill, &[0, 1 << 63, 4])).is_ok());
}

#[test]
fn step_and_phase_must_agree_with_each_other_and_the_binding() {
    let e = open(2, entry(0, Phase::Decode, &[1])).unwrap_err();
    assert!(
        e.contains("raw.bin: byte") && e.contains("step 0 is the prefill forward"),
        "{e}"
    );
    let e = open(3, entry(2, Phase::Prefill, &[1])).unwrap_err();
    assert!(e.contains("step 2 is a decode forward"), "{e}");
    let e = open(2, entry(2, Phase::Decode, &[1])).unwrap_err();
    assert!(e.contains("max_new_tokens = 2 allows steps 0..1"), "{e}");
    let e = open(0, entry(0, Phase::Prefill, &[1])).unwrap_err();
    assert!(e.contains("max_new_tokens = 0 allows no step"), "{e}");
}

#[test]
fn fingerprint_only_records_whose_byte_length_overflows_are_refused() {
    for shape in [&[1u64 << 32, 1 << 32][..], &[u64::MAX], &[1 << 62, 2]] {
        let e = open(1, entry(0, Phase::Prefill, shape)).unwrap_err();
        assert!(e.contains("more than 2^64 - 1 bytes"), "{shape:?}: {e}");
    }
}
