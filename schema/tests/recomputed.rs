//! The recomputed-records marker (docs/format.md §5.2.1): written through
//! the provenance, read back, outside the root, malformed marks refused.

mod common;

use common::{coord, f32_bytes, header};
use moeconf_fingerprint::{Algorithm, DType, Level, TensorView};
use moeconf_schema::{Header, Recomputed, Trace, TraceWriter, RECOMPUTED_NOTE};
use std::path::Path;

fn write(path: &Path, h: Header) -> moeconf_schema::WriteSummary {
    let mut w = TraceWriter::create(path, Algorithm::Blake3, h).unwrap();
    let v = f32_bytes(&[1.0, 2.5]);
    for p in ["moe.term.0", "moe.term.1", "moe.combine"] {
        w.append(
            coord(0, Some(0), p),
            Level::L4,
            TensorView {
                dtype: DType::F32,
                shape: &[2],
                bytes: &v,
            },
            true,
        )
        .unwrap();
    }
    w.finish().unwrap()
}

#[test]
fn marker_round_trips_and_leaves_the_root_alone() {
    let dir = tempfile::tempdir().unwrap();
    let plain = write(&dir.path().join("plain.bin"), header());
    let mut h = header();
    h.provenance
        .set_recomputed(&Recomputed::from_patterns(&["moe.term.*"]).unwrap());
    let marked_path = dir.path().join("marked.bin");
    let marked = write(&marked_path, h);
    assert_eq!(plain.root, marked.root, "the marker is not under the root");
    let t = Trace::open_verified(&marked_path).unwrap();
    let r = t.provenance().recomputed();
    assert!(r.covers("moe.term.0") && r.covers("moe.term.1"));
    assert!(!r.covers("moe.combine"));
    let t = Trace::open(&dir.path().join("plain.bin")).unwrap();
    assert!(
        t.provenance().recomputed().is_empty(),
        "no marker: every record observed"
    );
}

#[test]
fn malformed_or_repeated_marker_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    for (i, notes) in [
        vec![(RECOMPUTED_NOTE, "moe term")],
        vec![(RECOMPUTED_NOTE, "moe.term.*"), (RECOMPUTED_NOTE, "moe.shared")],
    ]
    .into_iter()
    .enumerate()
    {
        let mut h = header();
        h.provenance.notes = notes
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let path = dir.path().join(format!("bad{i}.bin"));
        // The writer obeys the reader: it refuses the header before writing
        // anything (the reader's own refusal of such a file, written by a
        // foreign writer, is python/tests/test_interop.py's).
        let Err(err) = TraceWriter::create(&path, Algorithm::Blake3, h) else {
            panic!("malformed marker {i} accepted by the writer")
        };
        let err = err.to_string();
        assert!(err.contains(RECOMPUTED_NOTE), "{err}");
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert!(!path.exists());
    }
}
