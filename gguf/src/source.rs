//! The checkpoint side of an export: the tensors of a model directory's `*.safetensors`
//! files, by DeepSeek's original names, and their values **as the reference runtime computes
//! with them** (BF16 and F32 are exact in FP32). Files are memory-mapped; nothing is copied
//! until a tensor is converted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use moeconf_fingerprint::bf16_to_f32;
use safetensors::{Dtype, SafeTensors};

use crate::GgufError;

/// One tensor of the checkpoint.
#[derive(Debug, Clone)]
pub struct SourceTensor {
    file: usize,
    /// On-disk dtype.
    pub dtype: Dtype,
    /// Row-major shape.
    pub shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// The tensors of a checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    entries: BTreeMap<String, SourceTensor>,
}

impl Checkpoint {
    /// Memory-maps and indexes every `*.safetensors` file of `dir` (sorted by name).
    pub fn open(dir: &Path) -> Result<Checkpoint, GgufError> {
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| GgufError::Io { path: p, source }
        };
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(GgufError::Invalid(format!(
                "{}: no *.safetensors file",
                dir.display()
            )));
        }
        let mut files = Vec::new();
        let mut entries = BTreeMap::new();
        for path in paths {
            let f = std::fs::File::open(&path).map_err(io(&path))?;
            // SAFETY: read-only mapping of a checkpoint that is not rewritten while exported.
            let map = unsafe { Mmap::map(&f) }.map_err(io(&path))?;
            let st = SafeTensors::deserialize(&map[..]).map_err(|e| {
                GgufError::Invalid(format!("{}: not a valid safetensors file: {e:?}", path.display()))
            })?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let data = view.data();
                let t = SourceTensor {
                    file: files.len(),
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    offset: data.as_ptr() as usize - base,
                    len: data.len(),
                };
                if entries.insert(name.clone(), t).is_some() {
                    return Err(GgufError::Tensor {
                        path: path.clone(),
                        tensor: name,
                        message: "defined in more than one safetensors file".into(),
                    });
                }
            }
            files.push((path, map));
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            entries,
        })
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every tensor name.
    pub fn names(&self) -> BTreeSet<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<&SourceTensor> {
        self.entries.get(name)
    }

    fn err(&self, t: Option<&SourceTensor>, name: &str, message: String) -> GgufError {
        GgufError::Tensor {
            path: t.map_or_else(|| self.dir.clone(), |t| self.files[t.file].0.clone()),
            tensor: name.to_string(),
            message,
        }
    }

    /// The tensor `name`, which must have `shape`.
    pub fn expect(&self, name: &str, shape: &[usize]) -> Result<&SourceTensor, GgufError> {
        let t = self.entries.get(name).ok_or_else(|| {
            self.err(
                None,
                name,
                format!("missing from the checkpoint (expected shape {shape:?})"),
            )
        })?;
        if t.shape != shape {
            return Err(self.err(
                Some(t),
                name,
                format!("expected shape {shape:?}, got {:?}", t.shape),
            ));
        }
        Ok(t)
    }

    /// The raw bytes of a tensor.
    pub fn bytes(&self, t: &SourceTensor) -> &[u8] {
        &self.files[t.file].1[t.offset..t.offset + t.len]
    }

    /// The values of tensor `name` (shape `shape`) as the reference runtime computes with
    /// them, in row-major order: BF16 and F32 exactly.
    pub fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, GgufError> {
        let t = self.expect(name, shape)?;
        let b = self.bytes(t);
        match t.dtype {
            Dtype::BF16 => Ok(b
                .chunks_exact(2)
                .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect()),
            Dtype::F32 => Ok(b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            d => Err(self.err(
                Some(t),
                name,
                format!("dtype {d:?} is not exported (BF16 and F32 are)"),
            )),
        }
    }

    /// Whether tensor `name` is stored as F32 on disk (such tensors stay F32 in every export).
    pub fn is_f32(&self, name: &str) -> bool {
        self.entries.get(name).is_some_and(|t| t.dtype == Dtype::F32)
    }

    /// The I64 or I32 index tensor `name` (shape `shape`) as `i32`, each value in `0..bound`.
    pub fn ids(&self, name: &str, shape: &[usize], bound: usize) -> Result<Vec<i32>, GgufError> {
        let t = self.expect(name, shape)?;
        let b = self.bytes(t);
        let vals: Vec<i64> = match t.dtype {
            Dtype::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
            Dtype::I32 => b
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
            d => {
                return Err(self.err(
                    Some(t),
                    name,
                    format!("dtype {d:?} is not an index type (I64, I32)"),
                ))
            }
        };
        vals.iter()
            .enumerate()
            .map(|(i, &v)| {
                if v < 0 || v as u64 >= bound as u64 {
                    Err(self.err(Some(t), name, format!("element {i} = {v} is outside 0..{bound}")))
                } else {
                    Ok(v as i32)
                }
            })
            .collect()
    }
}
