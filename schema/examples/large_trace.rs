//! Writes large synthetic traces for the memory and time measurements of
//! docs/performance.md ("Inspect memory"):
//!
//! ```sh
//! cargo run --release -p moeconf-schema --example large_trace -- records 1000000 rec1m.bin
//! cargo run --release -p moeconf-schema --example large_trace -- tensors 1048576 ten1m.bin
//! /usr/bin/time -v target/release/moeconf inspect rec1m.bin
//! ```
//!
//! `records N` writes N small records (8 × i32 payloads) over 61 layers and
//! four components per step; `tensors N` writes a header whose model lists N
//! weight tensors (the reader's maximum is 2^20) and 16 records.

use moeconf_fingerprint::{Algorithm, Component, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{weights_digest, Binding, CaptureSpec, Header, TensorDigest, TraceWriter};
use std::path::Path;

/// Components of one synthetic layer.
const COMPONENTS: [Component; 4] = [
    Component::RouterTopk,
    Component::RouterMargin,
    Component::MoeCombine,
    Component::LayerPostFfnMhc,
];

/// Layers per step.
const LAYERS: usize = 61;

/// `n` tensor digests, sorted by name as a binding lists them (docs/format.md §5.2).
fn tensors(n: usize) -> Vec<TensorDigest> {
    let mut v: Vec<TensorDigest> = (0..n)
        .map(|i| TensorDigest {
            name: format!("layers.{}.experts.{}.w{}", i / 768, (i / 3) % 256, i % 3),
            dtype: "bf16".into(),
            shape: vec![2048, 7168],
            digest: Algorithm::Blake3.hash(&(i as u64).to_le_bytes()),
        })
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, kind, n, out] = args.as_slice() else {
        return Err("usage: large_trace records|tensors N OUT".into());
    };
    let n: usize = n.parse()?;
    let mut binding = Binding {
        capture: CaptureSpec {
            levels: moeconf_fingerprint::LevelSet::ALL,
            payload_levels: moeconf_fingerprint::LevelSet::ALL,
        },
        ..Binding::default()
    };
    let records = match kind.as_str() {
        "records" => n,
        "tensors" => {
            binding.model.tensors = tensors(n);
            binding.model.weights_digest = weights_digest(Algorithm::Blake3, &binding.model.tensors);
            16
        }
        _ => return Err(format!("unknown kind {kind:?} (records or tensors)").into()),
    };
    let per_step = LAYERS * COMPONENTS.len();
    // Steps 0..records/per_step: the writer refuses steps beyond max_new_tokens.
    binding.decoding.max_new_tokens = u32::try_from(records / per_step + 1)?;
    let header = Header {
        binding,
        ..Header::default()
    };
    let mut w = TraceWriter::create(Path::new(out), Algorithm::Blake3, header)?;
    for i in 0..records {
        let step = (i / per_step) as u32;
        let coord = Coord {
            step,
            position: step,
            phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
            layer: Some(((i / COMPONENTS.len()) % LAYERS) as u32),
            path: COMPONENTS[i % COMPONENTS.len()].path().into(),
        };
        let values: Vec<u8> = (0..8u32).flat_map(|k| (k + i as u32).to_le_bytes()).collect();
        let level = if i % 2 == 0 { Level::L3 } else { Level::L4 };
        let view = TensorView {
            dtype: DType::I32,
            shape: &[8],
            bytes: &values,
        };
        w.append(coord, level, view, true)?;
    }
    let s = w.finish()?;
    eprintln!("wrote {out} ({} bytes, {} records)", s.bytes, s.records);
    Ok(())
}
