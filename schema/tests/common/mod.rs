//! A small trace with every kind of record, shared by the schema tests.

use moeconf_fingerprint::{Algorithm, Coord, DType, Level, Phase, TensorView};
use moeconf_output::{check_output, Inputs};
use moeconf_schema::{
    Binding, CaptureSpec, Decoding, Header, PromptBinding, Provenance, TraceWriter, WriteSummary,
};
use std::path::Path;

pub fn coord(step: u32, layer: Option<u32>, path: &str) -> Coord {
    Coord {
        step,
        position: 3 + step,
        phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
        layer,
        path: path.into(),
    }
}

pub fn header() -> Header {
    Header {
        binding: Binding {
            prompt: PromptBinding {
                text: "why the sheep".into(),
                ids: vec![1, 2, 3],
            },
            precision: "bf16".into(),
            contract: "native".into(),
            schedule: "identity".into(),
            decoding: Decoding {
                strategy: "greedy".into(),
                max_new_tokens: 2,
            },
            capture: CaptureSpec {
                levels: moeconf_fingerprint::LevelSet::ALL,
                payload_levels: moeconf_fingerprint::LevelSet::of_mask(0b01010),
            },
            ..Binding::default()
        },
        provenance: Provenance {
            runtime: "test".into(),
            version: "0".into(),
            threads: 1,
            notes: vec![],
        },
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes a trace of two steps with payload and fingerprint-only records,
/// including a NaN and a negative zero.
#[allow(dead_code)] // not every test binary that includes this module writes the small trace
pub fn write_small(path: &Path, alg: Algorithm) -> WriteSummary {
    write_small_version(path, alg, moeconf_schema::DEFAULT_FORMAT_VERSION)
}

/// [`write_small`] in container format `version` (1 or 2).
#[allow(dead_code)]
pub fn write_small_version(path: &Path, alg: Algorithm, version: u32) -> WriteSummary {
    let out = check_output(path, &Inputs::new()).unwrap();
    let mut w = TraceWriter::create_version(&out, alg, header(), version).unwrap();
    for step in 0..2u32 {
        let tok = (40 + step as i32).to_le_bytes();
        w.append(
            coord(step, None, "token.output"),
            Level::L0,
            TensorView {
                dtype: DType::I32,
                shape: &[1],
                bytes: &tok,
            },
            true,
        )
        .unwrap();
        let logits = f32_bytes(&[0.5, -0.0, f32::NAN, 3.0 + step as f32]);
        w.append(
            coord(step, None, "lm.logits"),
            Level::L1,
            TensorView {
                dtype: DType::F32,
                shape: &[4],
                bytes: &logits,
            },
            true,
        )
        .unwrap();
        for layer in 0..2u32 {
            let h = f32_bytes(&[layer as f32, step as f32, 1.5, -2.25, 7.0, 1e-40]);
            w.append(
                coord(step, Some(layer), "layer.post_ffn_mhc"),
                Level::L3,
                TensorView {
                    dtype: DType::F32,
                    shape: &[2, 3],
                    bytes: &h,
                },
                true,
            )
            .unwrap();
            w.append(
                coord(step, Some(layer), "moe.combine"),
                Level::L4,
                TensorView {
                    dtype: DType::F32,
                    shape: &[2, 3],
                    bytes: &h,
                },
                false,
            )
            .unwrap();
        }
        let st = f32_bytes(&[1.0, 2.0]);
        w.append(
            coord(step, Some(0), "state.window_kv"),
            Level::L2,
            TensorView {
                dtype: DType::F32,
                shape: &[1, 2],
                bytes: &st,
            },
            false,
        )
        .unwrap();
    }
    w.finish().unwrap()
}
