//! A trace written from docs/format.md by an independent Python
//! implementation (fixtures/test-vectors/check_vectors.py) is accepted by the
//! Rust reader with the same root, in both container versions; converting the
//! version 1 file with the Rust writer gives the version 2 file byte for byte.

use moeconf_schema::Trace;
use std::path::Path;

#[test]
fn python_written_minimal_trace_is_read_with_the_same_root() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/test-vectors");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("minimal-trace.json")).unwrap()).unwrap();
    let t = Trace::open(&dir.join("minimal-trace.bin")).unwrap();
    t.verify_payloads().unwrap();
    assert_eq!(t.root().to_hex(), meta["root"].as_str().unwrap());
    assert_eq!(
        t.records().unwrap().len() as u64,
        meta["records"].as_u64().unwrap()
    );
    assert_eq!(
        t.records()
            .unwrap()
            .iter()
            .filter(|r| r.payload.is_some())
            .count() as u64,
        meta["payloads"].as_u64().unwrap()
    );
    assert_eq!(t.binding().prompt.text, "why the sheep");
    assert_eq!(t.binding().prompt.ids, vec![11, 12]);
}

#[test]
fn python_written_version_2_trace_is_the_rust_writers_version_2_file() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/test-vectors");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("minimal-trace.json")).unwrap()).unwrap();
    let v2 = dir.join(meta["file_v2"].as_str().unwrap());
    let t = Trace::open_verified(&v2).unwrap();
    assert_eq!(t.format_version(), 2);
    assert_eq!(t.root().to_hex(), meta["root"].as_str().unwrap());
    assert_eq!(t.record_count(), meta["records"].as_u64().unwrap());
    let v1 = Trace::open_verified(&dir.join("minimal-trace.bin")).unwrap();
    assert_eq!(t.records().unwrap(), v1.records().unwrap());
    let out = tempfile::tempdir().unwrap();
    let converted = out.path().join("v2.bin");
    let checked = moeconf_output::check_output(&converted, &moeconf_output::Inputs::new()).unwrap();
    let s = moeconf_schema::convert::convert(&dir.join("minimal-trace.bin"), &checked, 2).unwrap();
    assert_eq!(s.root, t.root());
    assert_eq!(std::fs::read(&converted).unwrap(), std::fs::read(&v2).unwrap());
}
