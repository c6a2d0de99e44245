//! Identity of a checkpoint directory for a trace binding: the digest of
//! `config.json` and of every tensor's raw bytes in its safetensors files (each
//! tensor with its on-disk dtype, so FP8 codes, their `.scale` tensors and packed
//! MXFP4 experts are part of the identity; `ModelIdentity::weight_formats` names them).

use crate::binding::{weights_digest, ModelIdentity, TensorDigest};
use crate::error::InputError;
use moeconf_fingerprint::Algorithm;
use std::path::{Path, PathBuf};

fn read(path: &Path) -> Result<Vec<u8>, InputError> {
    Ok(moeconf_output::input::read_input(path, "model config")?)
}

/// Model identity: digest of config.json and of every tensor's raw bytes in
/// the directory's safetensors files (sorted by file name, then by tensor
/// name), as docs/format.md §4 specifies.
pub fn model_identity(name: &str, dir: &Path, alg: Algorithm) -> Result<ModelIdentity, InputError> {
    let config_digest = alg.hash(&read(&dir.join("config.json"))?);
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(InputError::io(format!("listing {}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let mut tensors = Vec::new();
    for f in &files {
        // Memory-mapped, not read: a real checkpoint is tens to hundreds of GB, and the
        // identity must not add that much anonymous memory (pages are file-backed).
        // A regular file only (a FIFO would block, a directory is no tensor file).
        let file = moeconf_output::input::open_input(f, "model file")?;
        // SAFETY: read-only mapping; the identity is computed while the model directory is
        // not being rewritten (the same assumption as the runtime's loader).
        let bytes = unsafe { memmap2::Mmap::map(&file) }
            .map_err(InputError::io(format!("memory-mapping {}", f.display())))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
            InputError::Invalid(format!("{}: not a valid safetensors file: {e}", f.display()))
        })?;
        for (tname, view) in st.tensors() {
            let mut h = alg.hasher();
            h.update_with(view.data(), true);
            tensors.push(TensorDigest {
                name: tname,
                dtype: format!("{:?}", view.dtype()).to_lowercase(),
                shape: view.shape().iter().map(|&d| d as u64).collect(),
                digest: h.finalize(),
            });
        }
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(ModelIdentity {
        name: name.to_string(),
        config_digest,
        weights_digest: weights_digest(alg, &tensors),
        tensors,
    })
}
