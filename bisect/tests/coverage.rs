//! Partial coverage: a candidate whose capture could not observe some operator records
//! (a backend that fuses them away) — localization ends at the finest level both traces
//! captured, says so, and names the records needed to go further (docs/diff.md
//! "Partial coverage").

mod common;

use moeconf_bisect::{diff, DiffOptions, NOT_CAPTURED_NOTE};
use moeconf_fingerprint::{Algorithm, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{Header, Provenance, Trace, TraceWriter};
use std::path::Path;

const D: usize = 8;

/// One step, one layer, one position: the attention half's records. The candidate
/// perturbs `attn.core` (and what follows), and lacks every record in `drop`.
fn write(path: &Path, perturb: bool, drop: &[&str], notes: Vec<(String, String)>) -> Trace {
    let mut binding = common::base_binding();
    binding.decoding.max_new_tokens = 1;
    binding.prompt.ids = vec![5];
    let header = Header {
        binding,
        provenance: Provenance {
            runtime: "synthetic".into(),
            version: "0".into(),
            threads: 1,
            notes,
        },
    };
    let mut w = TraceWriter::create(path, Algorithm::Blake3, header).expect("create");
    let mut put = |layer: Option<u32>, p: &str, level: Level, dtype: DType, shape: &[u64], bytes: Vec<u8>| {
        if drop.contains(&p) {
            return;
        }
        let coord = Coord {
            step: 0,
            position: 0,
            phase: Phase::Prefill,
            layer,
            path: p.into(),
        };
        w.append(
            coord,
            level,
            TensorView {
                dtype,
                shape,
                bytes: &bytes,
            },
            true,
        )
        .expect("append");
    };
    let f = |seed: f32, bump: bool| -> Vec<u8> {
        (0..D)
            .flat_map(|i| (seed + i as f32 * 0.25 + if bump { 0.5 } else { 0.0 }).to_le_bytes())
            .collect()
    };
    put(
        None,
        "token.input",
        Level::L0,
        DType::I32,
        &[1],
        5i32.to_le_bytes().to_vec(),
    );
    put(
        None,
        "embed.output",
        Level::L4,
        DType::F32,
        &[D as u64],
        f(0.0, false),
    );
    let l = Some(0);
    put(
        l,
        "attn.hc_pre",
        Level::L4,
        DType::F32,
        &[D as u64],
        f(1.0, false),
    );
    put(l, "attn.norm", Level::L4, DType::F32, &[D as u64], f(2.0, false));
    put(l, "attn.q", Level::L4, DType::F32, &[D as u64], f(3.0, false));
    put(l, "attn.kv", Level::L4, DType::F32, &[D as u64], f(4.0, false));
    put(
        l,
        "attn.window_read",
        Level::L4,
        DType::F32,
        &[1, D as u64],
        f(4.0, false),
    );
    put(
        l,
        "attn.core",
        Level::L4,
        DType::F32,
        &[D as u64],
        f(5.0, perturb),
    );
    put(
        l,
        "attn.output",
        Level::L4,
        DType::F32,
        &[D as u64],
        f(6.0, perturb),
    );
    put(
        l,
        "layer.post_attn_mhc",
        Level::L3,
        DType::F32,
        &[D as u64],
        f(7.0, perturb),
    );
    w.finish().expect("finish");
    Trace::open(path).expect("open")
}

#[test]
fn localization_ends_where_the_candidate_stops_capturing_and_names_the_needed_records() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reference = write(&dir.path().join("r.bin"), false, &[], Vec::new());
    let note = (
        NOT_CAPTURED_NOTE.to_string(),
        "attn.window_read: read inside a fused attention kernel; attn.compressed_read: masked".to_string(),
    );
    let candidate = write(&dir.path().join("c.bin"), true, &["attn.window_read"], vec![note]);
    let rep = diff(&reference, &candidate, &DiffOptions::default()).expect("diff");
    let loc = rep.levels.l4.localized.as_ref().expect("localized");
    assert_eq!(loc.at.path, "attn.core");
    let cov = loc.coverage.as_ref().expect("coverage limit");
    assert_eq!(cov.finest_level, "L4");
    assert_eq!(cov.needed.len(), 1, "{:?}", cov.needed);
    let n = &cov.needed[0];
    assert!(n.record.starts_with("attn.window_read"), "{}", n.record);
    assert_eq!(n.missing_in, "candidate");
    assert_eq!(n.held_by_other, 1);
    assert_eq!(n.reason.as_deref(), Some("read inside a fused attention kernel"));
    // The first divergence carries the same limit, and the text says so everywhere.
    assert_eq!(rep.divergences[0].coverage.as_ref(), Some(cov));
    let text = rep.render_text(false);
    assert!(text.contains("localization ends here, at L4"), "{text}");
    assert!(
        text.contains("the candidate did not capture attn.window_read"),
        "{text}"
    );
    assert!(
        text.contains("to localize further, the candidate must capture attn.window_read"),
        "{text}"
    );
    assert!(
        text.contains("its capture says: read inside a fused attention kernel"),
        "{text}"
    );
    assert!(
        !text.contains("its output differs while its inputs match"),
        "{text}"
    );
    assert!(
        rep.summary.contains("localization ends here at L4"),
        "{}",
        rep.summary
    );
    let json = serde_json::to_value(&rep).expect("json");
    assert_eq!(
        json["levels"]["L4"]["localized"]["coverage"]["needed"][0]["missing_in"],
        "candidate"
    );

    // With the record captured on both sides, the operator itself is localized.
    let full = write(&dir.path().join("f.bin"), true, &[], Vec::new());
    let rep = diff(&reference, &full, &DiffOptions::default()).expect("diff");
    let loc = rep.levels.l4.localized.as_ref().expect("localized");
    assert_eq!(loc.at.path, "attn.core");
    assert!(loc.coverage.is_none());
    assert!(rep
        .render_text(false)
        .contains("its output differs while its inputs match"));
}

#[test]
fn a_candidate_with_no_operator_records_is_localized_to_the_layer_state() {
    // The candidate captured only L3 here: localization ends at the attention half's
    // checkpoint and names the reference's operator records it would need.
    let dir = tempfile::tempdir().expect("tempdir");
    let reference = write(&dir.path().join("r.bin"), false, &[], Vec::new());
    let candidate = write(
        &dir.path().join("c.bin"),
        true,
        &[
            "attn.hc_pre",
            "attn.norm",
            "attn.q",
            "attn.kv",
            "attn.window_read",
            "attn.core",
            "attn.output",
        ],
        Vec::new(),
    );
    let rep = diff(&reference, &candidate, &DiffOptions::default()).expect("diff");
    let d = &rep.divergences[0];
    assert_eq!(d.at.path, "layer.post_attn_mhc");
    let cov = d.coverage.as_ref().expect("coverage");
    assert_eq!(cov.finest_level, "L3");
    assert!(
        cov.needed
            .iter()
            .any(|n| n.record.starts_with("attn.output") && n.missing_in == "candidate"),
        "{cov:?}"
    );
    assert!(rep
        .render_text(false)
        .contains("localization ends at this record (L3"));
}
