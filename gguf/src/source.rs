//! The checkpoint side of an export: the tensors of a model directory's `*.safetensors`
//! files by DeepSeek's original names, and their values **exactly as the reference runtime
//! computes with them** — read through the runtime's own loader
//! (`moeconf_reference_runtime::weights::WeightLoader`): BF16 and F32 promoted exactly, FP8
//! E4M3 and MXFP4 decoded and scaled exactly by the runtime's decoders, with every check the
//! runtime makes (NaN codes, scale ranges, shapes, the formats `config.json` declares).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use moeconf_reference_runtime::weights::{LinearFormat, Mat, WeightLoader};
use safetensors::{Dtype, SafeTensors};

use crate::GgufError;

/// One tensor of the checkpoint (its safetensors header entry).
#[derive(Debug, Clone)]
pub struct SourceTensor {
    /// On-disk dtype.
    pub dtype: Dtype,
    /// Row-major shape as stored.
    pub shape: Vec<usize>,
}

/// The tensors of a checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    entries: BTreeMap<String, SourceTensor>,
    loader: RefCell<WeightLoader>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("tensors", &self.entries.len())
            .finish()
    }
}

impl Checkpoint {
    /// Indexes every `*.safetensors` file of `dir` and opens the runtime's loader on it.
    pub fn open(dir: &Path) -> Result<Checkpoint, GgufError> {
        let loader = WeightLoader::open_dir(dir)?;
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
        let mut entries = BTreeMap::new();
        for path in paths {
            let f = moeconf_output::input::open_input(&path, "safetensors file")?;
            // SAFETY: read-only mapping of a checkpoint that is not rewritten while exported.
            let map = unsafe { Mmap::map(&f) }.map_err(io(&path))?;
            let st = SafeTensors::deserialize(&map[..]).map_err(|e| {
                GgufError::Invalid(format!("{}: not a valid safetensors file: {e:?}", path.display()))
            })?;
            for (name, view) in st.tensors() {
                entries.insert(
                    name,
                    SourceTensor {
                        dtype: view.dtype(),
                        shape: view.shape().to_vec(),
                    },
                );
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            entries,
            loader: RefCell::new(loader),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn names(&self) -> BTreeSet<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<&SourceTensor> {
        self.entries.get(name)
    }

    fn err(&self, name: &str, message: String) -> GgufError {
        GgufError::Tensor {
            path: self.dir.clone(),
            tensor: name.to_string(),
            message,
        }
    }

    /// The stored tensor `name`, which must have `shape` (for tensors the runtime reads
    /// unquantized).
    pub fn expect(&self, name: &str, shape: &[usize]) -> Result<&SourceTensor, GgufError> {
        let t = self.entries.get(name).ok_or_else(|| {
            self.err(
                name,
                format!("missing from the checkpoint (expected shape {shape:?})"),
            )
        })?;
        if t.shape != shape {
            return Err(self.err(name, format!("expected shape {shape:?}, got {:?}", t.shape)));
        }
        Ok(t)
    }

    /// Whether tensor `name` is stored as F32 (such tensors stay F32 in every export).
    pub fn is_f32(&self, name: &str) -> bool {
        self.entries.get(name).is_some_and(|t| t.dtype == Dtype::F32)
    }

    /// The matrix `name` `[rows, cols]` as the runtime loads it in `format`
    /// (`LinearFormat::Plain`: BF16/F32), every check of the runtime's loader included.
    pub fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        format: LinearFormat,
    ) -> Result<Mat, GgufError> {
        Ok(self.loader.borrow_mut().linear(name, rows, cols, format)?)
    }

    /// The values of the matrix `name` in row-major order, as the runtime computes with them.
    pub fn matrix_values(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        format: LinearFormat,
    ) -> Result<Vec<f32>, GgufError> {
        let m = self.matrix(name, rows, cols, format)?;
        let mut v = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            v.extend(m.row_f32(r));
        }
        Ok(v)
    }

    /// The values of the (small, unquantized) tensor `name` of shape `shape`.
    pub fn vector_values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, GgufError> {
        Ok(self.loader.borrow_mut().vec_f32(name, shape)?)
    }

    /// The I64 or I32 index tensor `name` (shape `shape`) as `i32`, each value in `0..bound`.
    pub fn ids(&self, name: &str, shape: &[usize], bound: usize) -> Result<Vec<i32>, GgufError> {
        let v = self.loader.borrow_mut().ids(name, shape, bound)?;
        Ok(v.into_iter().map(|x| x as i32).collect())
    }
}
