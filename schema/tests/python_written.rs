//! A trace written from docs/format.md by an independent Python
//! implementation (fixtures/test-vectors/check_vectors.py) is accepted by the
//! Rust reader with the same root.

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
