//! Import dumps (docs/import.md) of a generated trace: its records as
//! safetensors tensors named `step.{t}.pos.{p}[.layer.{i}].{component}` in
//! one or two files, element types drawn among those the importer converts
//! exactly (f32 as F32 or, when exact, BF16; ids and counters as I32 or
//! I64; text as U8), and a `manifest.json` with given digests.

use crate::gen::{Record, TraceSpec};
use arbitrary::{Result, Unstructured};
use moeconf_fingerprint::DType;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::path::Path;

/// One tensor of a dump file: name, dtype, shape, bytes.
type DumpTensor = (String, Dtype, Vec<usize>, Vec<u8>);

pub fn dump_name(r: &Record) -> String {
    let c = &r.coord;
    match c.layer {
        Some(l) => format!("step.{}.pos.{}.layer.{l}.{}", c.step, c.position, c.path),
        None => format!("step.{}.pos.{}.{}", c.step, c.position, c.path),
    }
}

/// The dtype and bytes a dump holds for `r` (drawn among exact encodings).
fn encode(u: &mut Unstructured<'_>, r: &Record) -> Result<(Dtype, Vec<u8>)> {
    Ok(match r.dtype {
        DType::F32 => {
            let bf16_exact = r.bytes.chunks(4).all(|c| c[0] == 0 && c[1] == 0);
            if bf16_exact && u.arbitrary()? {
                (
                    Dtype::BF16,
                    r.bytes.chunks(4).flat_map(|c| [c[2], c[3]]).collect(),
                )
            } else {
                (Dtype::F32, r.bytes.clone())
            }
        }
        DType::I32 if u.arbitrary()? => {
            let wide = r
                .bytes
                .chunks(4)
                .flat_map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes());
            (Dtype::I64, wide.collect())
        }
        DType::I32 => (Dtype::I32, r.bytes.clone()),
        DType::I64 => (Dtype::I64, r.bytes.clone()),
        DType::U8 => (Dtype::U8, r.bytes.clone()),
        _ => (Dtype::F64, r.bytes.clone()),
    })
}

/// Writes `spec` as a dump directory `dir` (one or two safetensors files and
/// `manifest.json`).
pub fn write_dump(u: &mut Unstructured<'_>, spec: &TraceSpec, dir: &Path) -> Result<()> {
    let split = u.int_in_range(0..=spec.records.len())?;
    let mut files: [Vec<DumpTensor>; 2] = [Vec::new(), Vec::new()];
    for (i, r) in spec.records.iter().enumerate() {
        let (dtype, bytes) = encode(u, r)?;
        let shape = r.shape.iter().map(|&d| d as usize).collect();
        files[usize::from(i >= split)].push((dump_name(r), dtype, shape, bytes));
    }
    for (n, tensors) in files.iter().enumerate() {
        if tensors.is_empty() && n == 1 {
            continue;
        }
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .filter_map(|(name, dt, shape, bytes)| {
                TensorView::new(*dt, shape.clone(), bytes)
                    .ok()
                    .map(|v| (name.clone(), v))
            })
            .collect();
        let Ok(bytes) = safetensors::serialize(views, None) else {
            return Err(arbitrary::Error::IncorrectFormat);
        };
        if std::fs::write(dir.join(format!("part{n}.safetensors")), bytes).is_err() {
            return Err(arbitrary::Error::IncorrectFormat);
        }
    }
    let b = &spec.header.binding;
    let zeros = "0".repeat(64);
    let manifest = serde_json::json!({
        "model": {"name": b.model.name, "config_digest": b.model.config_digest.to_hex(), "weights_digest": zeros},
        "tokenizer": {"name": b.tokenizer.name, "digest": b.tokenizer.digest.to_hex()},
        "prompt": {"text": b.prompt.text, "ids": b.prompt.ids},
        "max_new_tokens": b.decoding.max_new_tokens,
        "decoding": b.decoding.strategy,
        "precision": b.precision,
        "contract": b.contract,
        "schedule": b.schedule,
        "runtime": {"name": "moeconf-testkit", "version": "0"},
    });
    if std::fs::write(dir.join("manifest.json"), manifest.to_string()).is_err() {
        return Err(arbitrary::Error::IncorrectFormat);
    }
    Ok(())
}

/// Changes one drawn byte of one drawn file of the dump; `true` when a
/// byte changed.
pub fn corrupt(u: &mut Unstructured<'_>, dir: &Path) -> Result<bool> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(false);
    };
    let mut files: Vec<_> = rd.flatten().map(|e| e.path()).collect();
    files.sort();
    if files.is_empty() {
        return Ok(false);
    }
    let f = &files[u.choose_index(files.len())?];
    let Ok(mut bytes) = std::fs::read(f) else {
        return Ok(false);
    };
    if bytes.is_empty() {
        return Ok(false);
    }
    let i = u.choose_index(bytes.len())?;
    let b: u8 = u.arbitrary()?;
    if bytes[i] == b {
        return Ok(false);
    }
    bytes[i] = b;
    Ok(std::fs::write(f, bytes).is_ok())
}
