//! The export of a checkpoint directory to a `deepseek4` GGUF, and its verification: the GGUF
//! read back with [`crate::read::GgufFile`], every tensor dequantized with ggml's formulas and
//! compared **bit for bit** with the values the reference runtime computes with
//! ([`crate::source::Checkpoint::values`]).
//!
//! The GGUF also records the checkpoint's moeconf identity (`moeconf.source.*`: the BLAKE3
//! digests of `config.json`, of the weights and of `tokenizer.json`, computed as `moeconf run`
//! binds them, docs/format.md §4), so a capture of the GGUF can bind the checkpoint the
//! reference ran and `moeconf diff` compares the two traces without `--force`.

use std::io::Write;
use std::path::{Path, PathBuf};

use moeconf_contract::bf16::to_bf16_bits;
use moeconf_fingerprint::{Algorithm, Digest};
use moeconf_reference_runtime::config::ModelConfig;

use crate::deepseek4::{self, Class, ExportType, PlannedTensor, Recipe};
use crate::ggml::{repack_mxfp4_row, GgmlType};
use crate::read::GgufFile;
use crate::source::Checkpoint;
use crate::tokenizer::read_tokenizer;
use crate::value::Value;
use crate::write::write_gguf_checked;
use crate::GgufError;

/// Metadata key of the checkpoint's config digest (hex BLAKE3).
pub const KEY_SOURCE_CONFIG: &str = "moeconf.source.config_digest";
/// Metadata key of the checkpoint's weights digest (hex BLAKE3, docs/format.md §4).
pub const KEY_SOURCE_WEIGHTS: &str = "moeconf.source.weights_digest";
/// Metadata key of the checkpoint's tokenizer digest (hex BLAKE3).
pub const KEY_SOURCE_TOKENIZER: &str = "moeconf.source.tokenizer_digest";
/// Metadata key of the export type (`f32`, `bf16`, `native`).
pub const KEY_EXPORT_TYPE: &str = "moeconf.export.type";

/// What an export or a verification established.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSummary {
    /// The GGUF file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    pub tensors: usize,
    /// Number of tensors per GGUF type, by type name.
    pub by_type: Vec<(&'static str, usize)>,
    /// Number of values compared bit for bit with the reference's (all of them).
    pub values_verified: u64,
    /// The checkpoint's weights digest (hex), as bound by `moeconf run`.
    pub weights_digest: String,
    /// Metadata entries.
    pub metadata: usize,
    /// MXFP4 elements whose checkpoint value is −0 (E2M1 code 0b1000) and which ggml
    /// dequantizes to +0 (`kvalues_mxfp4[8] = 0`): equal values, different sign bits.
    pub mxfp4_negative_zeros: u64,
}

/// Everything the export of one checkpoint writes, before any byte is written.
struct Export {
    cfg: ModelConfig,
    ckpt: Checkpoint,
    metadata: Vec<(String, Value)>,
    tensors: Vec<PlannedTensor>,
    weights_digest: String,
}

fn hex(d: &Digest) -> String {
    d.to_hex()
}

fn context_length(config: &Path) -> Result<u32, GgufError> {
    let text = moeconf_output::input::read_input(config, "model config")?;
    let v: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| GgufError::Invalid(format!("{}: invalid JSON: {e}", config.display())))?;
    Ok(match v.get("max_position_embeddings") {
        None => 1 << 20,
        Some(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
            GgufError::Invalid(format!("{}: max_position_embeddings = {n}", config.display()))
        })?,
    })
}

impl Export {
    fn prepare(dir: &Path, ty: ExportType, name: &str) -> Result<Export, GgufError> {
        let config = dir.join("config.json");
        let cfg = ModelConfig::from_file(&config)?;
        deepseek4::check_constraints(&cfg, &config)?;
        deepseek4::check_defaults(&cfg, &config)?;
        let ckpt = Checkpoint::open(dir)?;
        let tensors = deepseek4::plan(&cfg, &ckpt, ty)?;
        let mut metadata = deepseek4::metadata(&cfg, context_length(&config)?, name, ty);
        let tokenizer = dir.join("tokenizer.json");
        let vocab = read_tokenizer(&tokenizer, cfg.vocab_size)?;
        let raw: serde_json::Value =
            serde_json::from_slice(&moeconf_output::input::read_input(&config, "model config")?)
                .map_err(|e| GgufError::Invalid(format!("{}: invalid JSON: {e}", config.display())))?;
        let id = |k: &str| {
            raw.get(k)
                .and_then(serde_json::Value::as_u64)
                .and_then(|v| u32::try_from(v).ok())
        };
        metadata.extend(vocab.metadata(id("bos_token_id"), id("eos_token_id")));
        let ident = moeconf_schema::model_identity(name, dir, Algorithm::Blake3)
            .map_err(|e| GgufError::Identity(format!("{}: {e}", dir.display())))?;
        let tok_bytes = moeconf_output::input::read_input(&tokenizer, "tokenizer file")?;
        let weights_digest = hex(&ident.weights_digest);
        metadata.push((KEY_SOURCE_CONFIG.into(), Value::Str(hex(&ident.config_digest))));
        metadata.push((KEY_SOURCE_WEIGHTS.into(), Value::Str(weights_digest.clone())));
        metadata.push((
            KEY_SOURCE_TOKENIZER.into(),
            Value::Str(hex(&Algorithm::Blake3.hash(&tok_bytes))),
        ));
        metadata.push((KEY_EXPORT_TYPE.into(), Value::Str(ty.name().into())));
        Ok(Export {
            cfg,
            ckpt,
            metadata,
            tensors,
            weights_digest,
        })
    }

    /// The reference's values of a planned tensor, in GGUF element order.
    fn reference_values(&self, p: &PlannedTensor) -> Result<Vec<f32>, GgufError> {
        match &p.recipe {
            Recipe::Single {
                src,
                shape,
                class: Class::Vector,
            } => self.ckpt.vector_values(src, shape),
            Recipe::Single {
                src,
                shape,
                class: Class::Matrix(f),
            } => self.ckpt.matrix_values(src, shape[0], shape[1], *f),
            Recipe::Stack {
                srcs,
                rows,
                cols,
                format,
            } => {
                let mut v = Vec::with_capacity(srcs.len() * rows * cols);
                for s in srcs {
                    v.extend(self.ckpt.matrix_values(s, *rows, *cols, *format)?);
                }
                Ok(v)
            }
            Recipe::Ids { .. } => Err(GgufError::Invalid(format!(
                "{}: an index tensor has no real values",
                p.info.name
            ))),
        }
    }

    fn produce(&self, p: &PlannedTensor, w: &mut dyn Write) -> Result<(), GgufError> {
        let io = |e| GgufError::Io {
            path: PathBuf::from(&p.info.name),
            source: e,
        };
        if let Recipe::Ids { src, shape, bound } = &p.recipe {
            let ids = self.ckpt.ids(src, shape, *bound)?;
            let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
            return w.write_all(&bytes).map_err(io);
        }
        if p.info.ty == GgmlType::Mxfp4 {
            // The packed codes and scales move bit for bit (docs/interop-llamacpp.md §2).
            let Recipe::Stack {
                srcs,
                rows,
                cols,
                format,
            } = &p.recipe
            else {
                return Err(GgufError::Invalid(format!(
                    "{}: MXFP4 only for stacked routed experts",
                    p.info.name
                )));
            };
            for s in srcs {
                let m = self.ckpt.matrix(s, *rows, *cols, *format)?;
                let mut bytes = Vec::with_capacity(rows * (cols / 32) * 17);
                for r in 0..*rows {
                    repack_mxfp4_row(m.row_bytes(r), m.row_scales(r), &mut bytes).map_err(|msg| {
                        GgufError::Tensor {
                            path: self.ckpt.dir().to_path_buf(),
                            tensor: s.clone(),
                            message: format!("row {r}: {msg}"),
                        }
                    })?;
                }
                w.write_all(&bytes).map_err(io)?;
            }
            return Ok(());
        }
        let values = self.reference_values(p)?;
        let src = p.recipe.sources().first().cloned().unwrap_or_default();
        let bytes: Vec<u8> = match p.info.ty {
            GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            GgmlType::Bf16 => {
                let mut b = Vec::with_capacity(values.len() * 2);
                for (i, &v) in values.iter().enumerate() {
                    let bits = to_bf16_bits(v);
                    if f32::from_bits(u32::from(bits) << 16).to_bits() != v.to_bits() {
                        return Err(GgufError::Tensor {
                            path: self.ckpt.dir().to_path_buf(),
                            tensor: src,
                            message: format!(
                                "element {i} = {v:e} is not exactly representable in BF16 (export with --type f32 to keep it)"
                            ),
                        });
                    }
                    b.extend_from_slice(&bits.to_le_bytes());
                }
                b
            }
            other => {
                return Err(GgufError::Invalid(format!(
                    "{}: no conversion of {src} to {}",
                    p.info.name,
                    other.name()
                )))
            }
        };
        w.write_all(&bytes).map_err(io)
    }
}

fn summary(path: &Path, bytes: u64, e: &Export, values_verified: u64) -> ExportSummary {
    let mut by_type: Vec<(&'static str, usize)> = Vec::new();
    for t in GgmlType::ALL {
        let n = e.tensors.iter().filter(|p| p.info.ty == t).count();
        if n > 0 {
            by_type.push((t.name(), n));
        }
    }
    ExportSummary {
        path: path.to_path_buf(),
        bytes,
        tensors: e.tensors.len(),
        by_type,
        values_verified,
        weights_digest: e.weights_digest.clone(),
        metadata: e.metadata.len(),
        mxfp4_negative_zeros: 0,
    }
}

/// Exports the checkpoint in `dir` (config.json, *.safetensors, tokenizer.json) to `out` as
/// a `deepseek4` GGUF of type `ty`, `general.name` = `name`, then verifies it
/// ([`verify`]). `out` is written atomically.
pub fn export(dir: &Path, out: &Path, ty: ExportType, name: &str) -> Result<ExportSummary, GgufError> {
    let mut inputs = moeconf_output::Inputs::new();
    inputs.dir_files(dir, "model file");
    let checked = moeconf_output::check_output(out, &inputs).map_err(|e| GgufError::Output(e.to_string()))?;
    let e = Export::prepare(dir, ty, name)?;
    let infos: Vec<_> = e.tensors.iter().map(|p| p.info.clone()).collect();
    write_gguf_checked(&checked, &e.metadata, &infos, |i, w| e.produce(&e.tensors[i], w))?;
    verify_against(&e, out)
}

/// Verifies that the GGUF `gguf` is exactly the export of the checkpoint in `dir` under the
/// type it records (`moeconf.export.type`): the same metadata (same keys, same values, same
/// order), the same tensors (names, dimensions, types, order), and every real value, read
/// back and dequantized with ggml's formulas, bit-identical to the value the reference runtime
/// computes with (one exception, counted in [`ExportSummary::mxfp4_negative_zeros`]: ggml
/// dequantizes the MXFP4 code for −0 to +0). A GGUF of another architecture, or one lacking a
/// tensor, fails naming it.
pub fn verify(dir: &Path, gguf: &Path, name: &str) -> Result<ExportSummary, GgufError> {
    let file = GgufFile::open(gguf)?;
    check_architecture(&file)?;
    let ty = match file.get(KEY_EXPORT_TYPE).and_then(Value::as_str) {
        Some(t) => ExportType::parse(t)
            .ok_or_else(|| GgufError::Mismatch(format!("{}: {KEY_EXPORT_TYPE} = {t:?} is not a moeconf export type", gguf.display())))?,
        None => {
            return Err(GgufError::Mismatch(format!(
                "{}: no {KEY_EXPORT_TYPE}: not written by `moeconf export gguf`, so it cannot be verified against the checkpoint",
                gguf.display()
            )))
        }
    };
    let name = file
        .get("general.name")
        .and_then(Value::as_str)
        .unwrap_or(name)
        .to_string();
    let e = Export::prepare(dir, ty, &name)?;
    drop(file);
    verify_against(&e, gguf)
}

/// Fails unless `general.architecture` is `deepseek4`.
pub fn check_architecture(file: &GgufFile) -> Result<(), GgufError> {
    match file.architecture() {
        Some(deepseek4::ARCH) => Ok(()),
        Some(other) => Err(GgufError::Mismatch(format!(
            "{}: general.architecture is {other:?}, not {:?} (a GGUF of another model)",
            file.path().display(),
            deepseek4::ARCH
        ))),
        None => Err(GgufError::Mismatch(format!(
            "{}: no general.architecture",
            file.path().display()
        ))),
    }
}

fn verify_against(e: &Export, gguf: &Path) -> Result<ExportSummary, GgufError> {
    let file = GgufFile::open(gguf)?;
    check_architecture(&file)?;
    let path = gguf.display();
    for (i, (k, v)) in e.metadata.iter().enumerate() {
        match file.get(k) {
            None => {
                return Err(GgufError::Mismatch(format!(
                    "{path}: metadata key {k} is missing"
                )))
            }
            Some(got) if got != v => {
                let show = |v: &Value| {
                    let s = format!("{v:?}");
                    if s.chars().count() > 120 {
                        format!("{}…", s.chars().take(120).collect::<String>())
                    } else {
                        s
                    }
                };
                return Err(GgufError::Mismatch(format!(
                    "{path}: metadata {k} = {}, the export has {}",
                    show(got),
                    show(v)
                )));
            }
            Some(_) => {}
        }
        if file.kvs.get(i).map(|(fk, _)| fk) != Some(k) {
            return Err(GgufError::Mismatch(format!(
                "{path}: metadata key {k} is not at position {i}"
            )));
        }
    }
    if file.kvs.len() != e.metadata.len() {
        let extra = file
            .kvs
            .iter()
            .find(|(k, _)| !e.metadata.iter().any(|(mk, _)| mk == k));
        return Err(GgufError::Mismatch(format!(
            "{path}: {} metadata entries, the export has {} (first extra: {:?})",
            file.kvs.len(),
            e.metadata.len(),
            extra.map(|(k, _)| k)
        )));
    }
    for p in &e.tensors {
        if file.tensor(&p.info.name).is_none() {
            return Err(GgufError::Mismatch(format!(
                "{path}: tensor {} is missing",
                p.info.name
            )));
        }
    }
    if let Some(extra) = file
        .tensors
        .iter()
        .find(|t| !e.tensors.iter().any(|p| p.info.name == t.name))
    {
        return Err(GgufError::Mismatch(format!(
            "{path}: tensor {} is not part of the export",
            extra.name
        )));
    }
    let mut verified = 0u64;
    let mut negative_zeros = 0u64;
    for (i, p) in e.tensors.iter().enumerate() {
        let t = &file.tensors[i];
        if t.name != p.info.name {
            return Err(GgufError::Mismatch(format!(
                "{path}: tensor {i} is {}, the export has {}",
                t.name, p.info.name
            )));
        }
        if t.ne != p.info.ne || t.ty != Some(p.info.ty) {
            return Err(GgufError::Mismatch(format!(
                "{path}: tensor {}: ne {:?} type {}, the export has ne {:?} type {}",
                t.name,
                t.ne,
                t.ty.map_or("unknown", GgmlType::name),
                p.info.ne,
                p.info.ty.name()
            )));
        }
        if let Recipe::Ids { src, shape, bound } = &p.recipe {
            if file.tensor_i32(&t.name)? != e.ckpt.ids(src, shape, *bound)? {
                return Err(GgufError::Mismatch(format!(
                    "{path}: tensor {}: ids differ from {src}",
                    t.name
                )));
            }
            verified += t.numel();
            continue;
        }
        let got = file.tensor_f32(&t.name)?;
        let want = e.reference_values(p)?;
        if got.len() != want.len() {
            return Err(GgufError::Mismatch(format!(
                "{path}: tensor {}: {} values, the checkpoint has {}",
                t.name,
                got.len(),
                want.len()
            )));
        }
        let mxfp4 = p.info.ty == GgmlType::Mxfp4;
        for (j, (g, w)) in got.iter().zip(&want).enumerate() {
            if g.to_bits() == w.to_bits() {
                continue;
            }
            // ggml's kvalues_mxfp4[8] is 0: the E2M1 code 0b1000 (−0) dequantizes to +0. The
            // values are equal (every product and sum is unchanged but for the sign of an
            // all-zero sum); counted and reported, not hidden.
            if mxfp4 && *g == 0.0 && *w == 0.0 {
                negative_zeros += 1;
                continue;
            }
            let (src, at) = source_element(&p.recipe, j);
            return Err(GgufError::Mismatch(format!(
                "{path}: tensor {} element {j}: {g:e} in the GGUF, {w:e} in the checkpoint ({src} element {at})",
                t.name
            )));
        }
        verified += want.len() as u64;
    }
    let bytes = std::fs::metadata(gguf).map(|m| m.len()).unwrap_or(0);
    let _ = &e.cfg;
    let mut s = summary(gguf, bytes, e, verified);
    s.mxfp4_negative_zeros = negative_zeros;
    Ok(s)
}

/// The checkpoint tensor and its element index behind element `j` of a planned tensor.
fn source_element(r: &Recipe, j: usize) -> (String, usize) {
    match r {
        Recipe::Stack { srcs, rows, cols, .. } => {
            let per = (rows * cols).max(1);
            (srcs.get(j / per).cloned().unwrap_or_default(), j % per)
        }
        Recipe::Single { src, .. } | Recipe::Ids { src, .. } => (src.clone(), j),
    }
}
