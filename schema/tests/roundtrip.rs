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
        assert_eq!(t.records().unwrap().len() as u64, summary.records);
        assert_eq!(summary.records, 2 * (2 + 2 * 2 + 1));
        assert_eq!(t.binding(), &header().binding);
        assert_eq!(t.provenance(), &header().provenance);
        let v = t.verify_payloads().unwrap();
        assert_eq!(v.payloads, summary.payloads);
        assert_eq!(summary.payloads, 2 * (2 + 2));
        // Records come back in write (execution) order with matching digests.
        assert_eq!(t.records().unwrap()[1].coord.path, "lm.logits");
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
        assert_eq!(t.records().unwrap()[1].digest, want);
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
    for r in t.records().unwrap() {
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
    // A duplicate coordinate is refused when appended (it used to be
    // refused only by `finish`), and leaves the writer as it was.
    let e = w
        .append(coord(0, None, "text.continuation"), Level::L0, ok, false)
        .unwrap_err();
    assert!(
        e.to_string().contains("already appended (duplicate coordinate)"),
        "{e}"
    );
    // Version 2 takes records step by step.
    w.append(coord(1, None, "text.continuation"), Level::L0, ok, false)
        .unwrap();
    let e = w
        .append(coord(0, None, "token.output"), Level::L0, ok, false)
        .unwrap_err();
    assert!(e.to_string().contains("step 0 after step 1"), "{e}");
    let summary = w.finish().unwrap();
    assert_eq!(summary.records, 2);
    let t = Trace::open_verified(&p).unwrap();
    assert_eq!(t.record_count(), 2);

    // Version 1 refuses the duplicate too, and takes steps in any order.
    let out = moeconf_output::check_output(&p, &moeconf_output::Inputs::new()).unwrap();
    let mut w = TraceWriter::create_version(&out, Algorithm::Blake3, header(), 1).unwrap();
    w.append(coord(1, None, "text.continuation"), Level::L0, ok, true)
        .unwrap();
    w.append(coord(0, None, "text.continuation"), Level::L0, ok, true)
        .unwrap();
    let e = w
        .append(coord(1, None, "text.continuation"), Level::L0, ok, false)
        .unwrap_err();
    assert!(
        e.to_string().contains("already appended (duplicate coordinate)"),
        "{e}"
    );
    w.finish().unwrap();
    assert_eq!(Trace::open_verified(&p).unwrap().format_version(), 1);
}

/// Copies every record of `src` (opened verified) into a new trace of
/// `version` at `out`, as `moeconf convert` does.
fn convert(src: &Trace, out: &std::path::Path, version: u32) -> moeconf_schema::WriteSummary {
    let checked = moeconf_output::check_output(out, &moeconf_output::Inputs::new()).unwrap();
    let header = moeconf_schema::Header {
        binding: src.binding().clone(),
        provenance: src.provenance().clone(),
    };
    let mut w = TraceWriter::create_version(&checked, src.algorithm(), header, version).unwrap();
    for i in 0..src.records().unwrap().len() {
        w.append_from(src, i).unwrap();
    }
    w.finish().unwrap()
}

/// Version 2 stores the same tree: the same records written in either
/// version have the same root, records (in write order) and payloads, and
/// converting either way is lossless (version 1 → 2 → 1 gives the original
/// bytes back).
#[test]
fn both_versions_hold_the_same_records_under_the_same_root() {
    let dir = tempfile::tempdir().unwrap();
    for alg in [Algorithm::Blake3, Algorithm::Sha256] {
        let (p1, p2) = (dir.path().join("v1.bin"), dir.path().join("v2.bin"));
        let s1 = common::write_small_version(&p1, alg, 1);
        let s2 = common::write_small_version(&p2, alg, 2);
        assert_eq!(s1.root, s2.root, "{alg}: same records, same root");
        assert_eq!((s1.records, s1.payloads), (s2.records, s2.payloads));
        let (t1, t2) = (
            Trace::open_verified(&p1).unwrap(),
            Trace::open_verified(&p2).unwrap(),
        );
        assert_eq!((t1.format_version(), t2.format_version()), (1, 2));
        assert_eq!(t1.root(), t2.root());
        assert_eq!(t1.binding_digest(), t2.binding_digest());
        assert_eq!(t1.steps(), t2.steps(), "step digests and record counts");
        let (r1, r2) = (t1.records().unwrap(), t2.records().unwrap());
        assert_eq!(r1.len(), r2.len());
        for (i, (a, b)) in r1.iter().zip(r2).enumerate() {
            assert_eq!(
                (&a.coord, a.level, a.dtype, &a.shape, a.digest),
                (&b.coord, b.level, b.dtype, &b.shape, b.digest),
                "record {i}"
            );
            assert_eq!(
                t1.payload_verified(i).unwrap(),
                t2.payload_verified(i).unwrap(),
                "record {i}"
            );
        }
        for s in t1.steps() {
            let (n1, n2) = (
                t1.step(s.step).unwrap().unwrap(),
                t2.step(s.step).unwrap().unwrap(),
            );
            for (l1, l2) in n1.levels.iter().zip(&n2.levels) {
                assert_eq!((l1.level, l1.digest), (l2.level, l2.digest));
                for (g1, g2) in l1.groups.iter().zip(&l2.groups) {
                    assert_eq!(
                        (g1.layer, g1.digest, g1.records),
                        (g2.layer, g2.digest, g2.records)
                    );
                    assert_eq!(t1.group_records(g1).unwrap(), t2.group_records(g2).unwrap());
                    // The entries handed out with the ids are the records
                    // those ids name, in both versions.
                    for (t, g) in [(&t1, g1), (&t2, g2)] {
                        let recs = t.group_entries(g).unwrap();
                        assert_eq!(recs.ids(), t.group_records(g).unwrap());
                        assert_eq!(recs.iter().count(), recs.len());
                        for (i, e) in recs.iter() {
                            assert_eq!(e, t.record(i), "record {i}");
                        }
                    }
                }
            }
        }
        // Converting: 1 → 2 gives the writer's version 2 file, 2 → 1 the
        // writer's version 1 file, byte for byte.
        let (c2, c1) = (dir.path().join("c2.bin"), dir.path().join("c1.bin"));
        assert_eq!(convert(&t1, &c2, 2).root, s1.root);
        assert_eq!(std::fs::read(&c2).unwrap(), std::fs::read(&p2).unwrap());
        let back = Trace::open_verified(&c2).unwrap();
        assert_eq!(convert(&back, &c1, 1).root, s1.root);
        assert_eq!(std::fs::read(&c1).unwrap(), std::fs::read(&p1).unwrap());
        // Version 3: the same records and root; 2 → 3 gives the writer's
        // version 3 file, 3 → 2 and 3 → 1 the writer's files again.
        let p3 = dir.path().join("v3.bin");
        let s3 = common::write_small_version(&p3, alg, 3);
        assert_eq!(s3.root, s1.root, "{alg}: same records, same root");
        let t3 = Trace::open_verified(&p3).unwrap();
        assert_eq!(t3.format_version(), 3);
        assert_eq!(t3.steps(), t2.steps(), "step digests and record counts");
        assert_eq!(t3.records().unwrap(), t2.records().unwrap());
        assert_eq!(t3.held_levels().unwrap(), t2.held_levels().unwrap());
        let c3 = dir.path().join("c3.bin");
        assert_eq!(convert(&t2, &c3, 3).root, s1.root);
        assert_eq!(std::fs::read(&c3).unwrap(), std::fs::read(&p3).unwrap());
        for (to, want) in [(2, &p2), (1, &p1)] {
            let out = dir.path().join(format!("from3-{to}.bin"));
            assert_eq!(convert(&t3, &out, to).root, s1.root);
            assert_eq!(
                std::fs::read(&out).unwrap(),
                std::fs::read(want).unwrap(),
                "3 -> {to}"
            );
        }
    }
}

/// A version 3 trace gives every step's levels from its root block: no
/// step block is read for them (docs/format.md §11.8).
#[test]
fn version_3_level_sets_read_no_step_block() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    common::write_small_version(&p, Algorithm::Blake3, 3);
    let t = Trace::open(&p).unwrap();
    let by_step = t.levels_by_step(0..t.steps().len()).unwrap();
    assert_eq!(by_step.len(), 2);
    assert_eq!(t.blocks_read().len(), 1, "only the root block");
    let v2 = dir.path().join("t2.bin");
    common::write_small_version(&v2, Algorithm::Blake3, 2);
    let t2 = Trace::open(&v2).unwrap();
    assert_eq!(t2.levels_by_step(0..2).unwrap(), by_step);
    assert_eq!(t2.blocks_read().len(), 3, "version 2 reads both step blocks");
}

/// A version 2 trace opens by reading its root block only; a step's block
/// and a group's block are read when first asked for, once.
#[test]
fn version_2_reads_nodes_on_first_use() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    common::write_small_version(&p, Algorithm::Blake3, 2);
    let t = Trace::open(&p).unwrap();
    assert_eq!(t.blocks_read().len(), 1, "only the root block");
    assert_eq!(t.steps().len(), 2);
    assert_eq!(t.record_count(), 14);
    assert!(t.get_record(0).is_none(), "no record is in memory yet");
    let node = t.step(1).unwrap().unwrap();
    assert_eq!(t.blocks_read().len(), 2, "the root and step 1's block");
    let g = node.level(Level::L3).unwrap().group(Some(1)).unwrap();
    let ids = t.group_records(g).unwrap().to_vec();
    assert_eq!(t.blocks_read().len(), 3);
    assert_eq!(ids.len(), 1);
    assert_eq!(t.record(ids[0]).coord.path, "layer.post_ffn_mhc");
    assert_eq!(t.record(ids[0]).coord.layer, Some(1));
    // Again: nothing more is read.
    t.step(1).unwrap();
    t.group_records(g).unwrap();
    assert_eq!(t.blocks_read().len(), 3);
    assert!(t.payload_verified(ids[0]).unwrap().is_some());
    assert_eq!(t.payloads_read(), ids);
}
