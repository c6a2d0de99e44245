//! Checkpoint loading: `*.safetensors` files opened with memmap2 and parsed
//! with the `safetensors` crate, tensors looked up by DeepSeek's original
//! names (naming scheme (B), docs/deepseek-v4-architecture.md §5).
//!
//! Matrices ([`Mat`]) stay in the memory map: BF16 rows are promoted to FP32
//! inside the dot product (crate::linear), so routed-expert weights are never
//! copied into anonymous memory. Small vectors (norm weights, mHC parameters,
//! sinks, position biases, the correction bias, `tid2eid`) are copied out.
//!
//! Supported dtypes: BF16 and F32 (I64/I32 for `tid2eid`). Anything else —
//! FP8 E4M3 block-scaled linears, FP4 experts — is refused with a message.
//! Missing, extra and mis-shaped tensors are reported by name with the expected
//! and the found shape.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use moeconf_fingerprint::bf16_to_f32;
use safetensors::{Dtype, SafeTensors};

use crate::error::RuntimeError;
use crate::files::regular_file;

/// The shortest safetensors file: the 8-byte header length and `{}`.
const SAFETENSORS_MIN_BYTES: u64 = 10;

/// Element type of a memory-mapped weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDType {
    /// bfloat16, promoted exactly to FP32 when read.
    Bf16,
    /// IEEE binary32.
    F32,
}

impl WeightDType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            WeightDType::Bf16 => 2,
            WeightDType::F32 => 4,
        }
    }
}

/// A row-major weight matrix `[rows, cols]` living in a memory-mapped file.
#[derive(Debug, Clone)]
pub struct Mat {
    map: Arc<Mmap>,
    offset: usize,
    rows: usize,
    cols: usize,
    dtype: WeightDType,
}

impl Mat {
    /// Number of rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// On-disk element type.
    pub fn dtype(&self) -> WeightDType {
        self.dtype
    }
    /// Little-endian bytes of row `r` (bounds were validated at load).
    #[inline]
    pub fn row_bytes(&self, r: usize) -> &[u8] {
        let rb = self.cols * self.dtype.size();
        let start = self.offset + r * rb;
        &self.map[start..start + rb]
    }
    /// Little-endian bytes of rows `r0..r0 + n` (bounds were validated at load).
    #[inline]
    pub fn rows_bytes(&self, r0: usize, n: usize) -> &[u8] {
        let rb = self.cols * self.dtype.size();
        let start = self.offset + r0 * rb;
        &self.map[start..start + n * rb]
    }
    /// Whether every row starts on a 4-byte boundary (rows can be read as 32-bit words).
    pub fn words_aligned(&self) -> bool {
        let base = self.map.as_ptr() as usize + self.offset;
        base.is_multiple_of(4) && (self.cols * self.dtype.size()).is_multiple_of(4)
    }
    /// Element `(r, c)` promoted to FP32.
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let b = self.row_bytes(r);
        match self.dtype {
            WeightDType::Bf16 => bf16_to_f32(u16::from_le_bytes([b[2 * c], b[2 * c + 1]])),
            WeightDType::F32 => f32::from_le_bytes([b[4 * c], b[4 * c + 1], b[4 * c + 2], b[4 * c + 3]]),
        }
    }
}

#[derive(Debug)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// Looks tensors up by name in the safetensors files of a checkpoint
/// directory and remembers which were used, so unexpected tensors are reported.
#[derive(Debug)]
pub struct WeightLoader {
    files: Vec<(PathBuf, Arc<Mmap>)>,
    entries: BTreeMap<String, Entry>,
    used: BTreeSet<String>,
    dir: PathBuf,
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

impl WeightLoader {
    /// Memory-maps and parses every `*.safetensors` file of `dir` (sorted by
    /// name). Each must be a regular file (symbolic links are followed): a
    /// directory, FIFO, device or socket of that name, a symbolic-link loop
    /// and a file too short for a safetensors header are refused by name.
    pub fn open_dir(dir: &Path) -> Result<WeightLoader, RuntimeError> {
        let io = |path: &Path, what: &'static str| {
            let path = path.to_path_buf();
            move |source| RuntimeError::Io { path, what, source }
        };
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io(dir, "list the directory"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(RuntimeError::File {
                path: dir.to_path_buf(),
                message: "no *.safetensors file in the model directory".into(),
            });
        }
        let mut files = Vec::new();
        let mut entries = BTreeMap::new();
        for path in paths {
            let len = regular_file(&path, "a safetensors file")?;
            if len < SAFETENSORS_MIN_BYTES {
                return Err(RuntimeError::Safetensors {
                    path,
                    message: format!(
                        "{len} bytes is too short for a header (at least {SAFETENSORS_MIN_BYTES})"
                    ),
                });
            }
            let file = std::fs::File::open(&path).map_err(io(&path, "open"))?;
            // SAFETY: the file is opened read-only; the runtime assumes checkpoint
            // files are not truncated or rewritten while a model is loaded (the
            // fixture generator replaces files atomically by rename, which keeps
            // an existing mapping valid).
            let map = unsafe { Mmap::map(&file) }.map_err(io(&path, "memory-map"))?;
            let map = Arc::new(map);
            let st = SafeTensors::deserialize(&map[..]).map_err(|e| RuntimeError::Safetensors {
                path: path.clone(),
                message: format!("{e:?}"),
            })?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let data = view.data();
                let entry = Entry {
                    file: files.len(),
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    offset: data.as_ptr() as usize - base,
                    len: data.len(),
                };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(RuntimeError::Tensor {
                        path: path.clone(),
                        tensor: name,
                        message: "defined in more than one safetensors file".into(),
                    });
                }
            }
            files.push((path, map));
        }
        Ok(WeightLoader {
            files,
            entries,
            used: BTreeSet::new(),
            dir: dir.to_path_buf(),
        })
    }

    fn err(&self, entry: Option<&Entry>, name: &str, message: String) -> RuntimeError {
        let path = entry
            .map(|e| self.files[e.file].0.clone())
            .unwrap_or_else(|| self.dir.clone());
        RuntimeError::Tensor {
            path,
            tensor: name.to_string(),
            message,
        }
    }

    fn lookup(&mut self, name: &str, shape: &[usize]) -> Result<&Entry, RuntimeError> {
        let Some(e) = self.entries.get(name) else {
            return Err(self.err(
                None,
                name,
                format!("missing from the checkpoint (expected shape {shape:?})"),
            ));
        };
        if e.shape != shape {
            return Err(self.err(
                Some(e),
                name,
                format!("expected shape {shape:?}, got {:?}", e.shape),
            ));
        }
        self.used.insert(name.to_string());
        Ok(&self.entries[name])
    }

    fn unsupported(&self, e: &Entry, name: &str, allowed: &str) -> RuntimeError {
        let hint = match e.dtype {
            Dtype::F8_E4M3 | Dtype::F8_E5M2 => " (FP8 block-scaled checkpoints are not supported yet)",
            Dtype::U8 | Dtype::I8 => " (packed FP4 experts are not supported yet)",
            _ => "",
        };
        self.err(
            Some(e),
            name,
            format!(
                "unsupported dtype {}{hint}; supported: {allowed}",
                dtype_name(e.dtype)
            ),
        )
    }

    /// A BF16 or F32 matrix `[rows, cols]`, kept in the memory map.
    pub fn mat(&mut self, name: &str, rows: usize, cols: usize) -> Result<Mat, RuntimeError> {
        let e = self.lookup(name, &[rows, cols])?;
        let dtype = match e.dtype {
            Dtype::BF16 => WeightDType::Bf16,
            Dtype::F32 => WeightDType::F32,
            _ => {
                let e = &self.entries[name];
                return Err(self.unsupported(e, name, "BF16, F32"));
            }
        };
        let (file, offset) = (e.file, e.offset);
        Ok(Mat {
            map: self.files[file].1.clone(),
            offset,
            rows,
            cols,
            dtype,
        })
    }

    /// A BF16 or F32 tensor of the given shape, copied out as FP32 (small tensors only).
    pub fn vec_f32(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, RuntimeError> {
        let e = self.lookup(name, shape)?;
        let (file, offset, len, dtype) = (e.file, e.offset, e.len, e.dtype);
        let bytes = &self.files[file].1[offset..offset + len];
        match dtype {
            Dtype::BF16 => Ok(bytes
                .chunks_exact(2)
                .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect()),
            Dtype::F32 => Ok(bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            _ => {
                let e = &self.entries[name];
                Err(self.unsupported(e, name, "BF16, F32"))
            }
        }
    }

    /// An I64 or I32 index tensor whose values must lie in `0..bound`, as u32.
    pub fn ids(&mut self, name: &str, shape: &[usize], bound: usize) -> Result<Vec<u32>, RuntimeError> {
        let e = self.lookup(name, shape)?;
        let (file, offset, len, dtype) = (e.file, e.offset, e.len, e.dtype);
        let bytes = &self.files[file].1[offset..offset + len];
        let vals: Vec<i64> = match dtype {
            Dtype::I64 => bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
            Dtype::I32 => bytes
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
            _ => {
                let e = &self.entries[name];
                return Err(self.unsupported(e, name, "I64, I32"));
            }
        };
        let mut out = Vec::with_capacity(vals.len());
        for (i, v) in vals.iter().enumerate() {
            if *v < 0 || *v as u64 >= bound as u64 {
                let e = &self.entries[name];
                return Err(self.err(Some(e), name, format!("element {i} = {v} is outside 0..{bound}")));
            }
            out.push(*v as u32);
        }
        Ok(out)
    }

    /// Fails if the checkpoint holds tensors that were never requested
    /// (ignoring `mtp.*`, the multi-token-prediction block HF drops too).
    pub fn finish(self) -> Result<(), RuntimeError> {
        let extra: Vec<&String> = self
            .entries
            .keys()
            .filter(|k| !self.used.contains(*k) && !k.starts_with("mtp."))
            .collect();
        if let Some(first) = extra.first() {
            let e = &self.entries[*first];
            let more = if extra.len() > 1 {
                format!(" (and {} more)", extra.len() - 1)
            } else {
                String::new()
            };
            return Err(self.err(
                Some(e),
                first,
                format!("unexpected tensor not used by this configuration{more}"),
            ));
        }
        Ok(())
    }
}
