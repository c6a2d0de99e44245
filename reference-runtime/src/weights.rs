//! Checkpoint loading: `*.safetensors` files opened with memmap2 and parsed
//! with the `safetensors` crate, tensors looked up by DeepSeek's original
//! names (naming scheme (B), docs/deepseek-v4-architecture.md §5).
//!
//! Matrices ([`Mat`]) stay in the memory map: BF16 rows are promoted to FP32
//! inside the dot product (crate::linear), FP8 codes and packed FP4 nibbles are
//! decoded there with their UE8M0 scales (also read from the map), so weights —
//! routed experts above all — are never copied into anonymous memory. Small
//! vectors (norm weights, mHC parameters, sinks, position biases, the correction
//! bias, `tid2eid`) are copied out.
//!
//! Supported dtypes: BF16 and F32 everywhere a matrix is read; for the linears
//! the release quantizes ([`WeightLoader::linear`]) the format the config
//! declares ([`LinearFormat`]): FP8 E4M3 (`F8_E4M3`) with a `<name>.scale`
//! tensor of UE8M0 block scales (`F8_E8M0`, or `U8`) of shape
//! `[ceil(rows/128), ceil(cols/128)]`, or MXFP4 (`I8`/`U8` `[rows, cols/2]`,
//! low nibble = even element) with `<name>.scale` `[rows, cols/32]`
//! (I64/I32 for `tid2eid`). Missing, extra and mis-shaped tensors, a scale of
//! the wrong shape or dtype, NaN codes (an E4M3 `0x7F`/`0xFF` weight, a UE8M0
//! `0xFF` scale) and scales so large that a block overflows FP32 are reported by
//! name with what was expected and what was found.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use moeconf_fingerprint::bf16_to_f32;
use safetensors::{Dtype, SafeTensors};

use crate::error::RuntimeError;
use crate::files::open_regular;
use crate::quant::{self, QuantFormat, FP8_BLOCK, MXFP4_GROUP};

/// The shortest safetensors file: the 8-byte header length and `{}`.
const SAFETENSORS_MIN_BYTES: u64 = 10;

/// Element type of a memory-mapped weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightDType {
    /// bfloat16, promoted exactly to FP32 when read.
    Bf16,
    /// IEEE binary32.
    F32,
    /// FP8 E4M3 codes, one byte per element, with UE8M0 scales per 128×128 block.
    Fp8E4m3,
    /// MXFP4: two E2M1 codes per byte (low nibble = even element), UE8M0 scale per 32 inputs.
    Mxfp4,
}

impl WeightDType {
    /// Bytes of one row of `cols` elements.
    pub fn row_len(self, cols: usize) -> usize {
        match self {
            WeightDType::Bf16 => 2 * cols,
            WeightDType::F32 => 4 * cols,
            WeightDType::Fp8E4m3 => cols,
            WeightDType::Mxfp4 => cols / 2,
        }
    }

    /// The quantized format, if any.
    pub fn quant(self) -> Option<QuantFormat> {
        match self {
            WeightDType::Fp8E4m3 => Some(QuantFormat::Fp8E4m3Block128),
            WeightDType::Mxfp4 => Some(QuantFormat::Mxfp4),
            WeightDType::Bf16 | WeightDType::F32 => None,
        }
    }

    /// Short name for reports (`bf16`, `f32`, `fp8-e4m3`, `mxfp4`).
    pub fn name(self) -> &'static str {
        match self {
            WeightDType::Bf16 => "bf16",
            WeightDType::F32 => "f32",
            WeightDType::Fp8E4m3 => "fp8-e4m3",
            WeightDType::Mxfp4 => "mxfp4",
        }
    }
}

/// The on-disk format a config declares for one class of linear layers
/// (dense projections, routed experts): see `ModelConfig::weights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LinearFormat {
    /// BF16 or F32, as stored (no `quantization_config`).
    #[default]
    Plain,
    /// FP8 E4M3 with UE8M0 128×128 block scales in `<name>.scale`.
    Fp8Block128,
    /// MXFP4 with UE8M0 scales per 32 inputs in `<name>.scale`.
    Mxfp4,
}

impl LinearFormat {
    /// Short name for reports (`bf16/f32`, `fp8-e4m3-b128`, `mxfp4`).
    pub fn name(self) -> &'static str {
        match self {
            LinearFormat::Plain => "bf16/f32",
            LinearFormat::Fp8Block128 => "fp8-e4m3-b128",
            LinearFormat::Mxfp4 => "mxfp4",
        }
    }

    fn expected(self) -> &'static str {
        match self {
            LinearFormat::Plain => "BF16 or F32",
            LinearFormat::Fp8Block128 => "F8_E4M3 (FP8 block-scaled)",
            LinearFormat::Mxfp4 => "I8 or U8 packed MXFP4 (two E2M1 values per byte)",
        }
    }
}

/// The UE8M0 scales of a quantized matrix, kept in the memory map: row-major
/// `[scale_rows, scale_cols]`, one byte each.
#[derive(Debug, Clone)]
struct Scales {
    map: Arc<Mmap>,
    offset: usize,
    cols: usize,
}

/// A row-major weight matrix `[rows, cols]` living in a memory-mapped file.
#[derive(Debug, Clone)]
pub struct Mat {
    map: Arc<Mmap>,
    offset: usize,
    rows: usize,
    cols: usize,
    dtype: WeightDType,
    scales: Option<Scales>,
}

impl Mat {
    /// Number of rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns (input features, logical: unpacked for MXFP4).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// On-disk element type.
    pub fn dtype(&self) -> WeightDType {
        self.dtype
    }
    /// Bytes of the matrix body (codes only, scales excluded).
    pub fn body_bytes(&self) -> usize {
        self.rows * self.dtype.row_len(self.cols)
    }
    /// Bytes of the scale tensor (0 for BF16/F32).
    pub fn scale_bytes(&self) -> usize {
        match self.dtype {
            WeightDType::Fp8E4m3 => self.rows.div_ceil(FP8_BLOCK) * self.cols.div_ceil(FP8_BLOCK),
            WeightDType::Mxfp4 => self.rows * (self.cols / MXFP4_GROUP),
            WeightDType::Bf16 | WeightDType::F32 => 0,
        }
    }
    /// Little-endian bytes (codes, for quantized formats) of row `r` (bounds were validated at load).
    #[inline]
    pub fn row_bytes(&self, r: usize) -> &[u8] {
        let rb = self.dtype.row_len(self.cols);
        let start = self.offset + r * rb;
        &self.map[start..start + rb]
    }
    /// Little-endian bytes of rows `r0..r0 + n` (bounds were validated at load).
    #[inline]
    pub fn rows_bytes(&self, r0: usize, n: usize) -> &[u8] {
        let rb = self.dtype.row_len(self.cols);
        let start = self.offset + r0 * rb;
        &self.map[start..start + n * rb]
    }
    /// The UE8M0 scale codes that apply to row `r`: for FP8 the scale row of
    /// block row `r / 128` (one code per 128 columns), for MXFP4 row `r`'s
    /// codes (one per 32 columns); empty for BF16/F32.
    #[inline]
    pub fn row_scales(&self, r: usize) -> &[u8] {
        let Some(s) = &self.scales else {
            return &[];
        };
        let sr = match self.dtype {
            WeightDType::Fp8E4m3 => r / FP8_BLOCK,
            _ => r,
        };
        let start = s.offset + sr * s.cols;
        &s.map[start..start + s.cols]
    }
    /// Whether every row starts on a 4-byte boundary (rows can be read as 32-bit words).
    pub fn words_aligned(&self) -> bool {
        let base = self.map.as_ptr() as usize + self.offset;
        base.is_multiple_of(4) && self.dtype.row_len(self.cols).is_multiple_of(4)
    }
    /// Element `(r, c)` as FP32: promoted exactly, or decoded and scaled exactly
    /// (`decode(code) · 2^(e−127)`, docs/operators.md §8).
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let b = self.row_bytes(r);
        match self.dtype {
            WeightDType::Bf16 => bf16_to_f32(u16::from_le_bytes([b[2 * c], b[2 * c + 1]])),
            WeightDType::F32 => f32::from_le_bytes([b[4 * c], b[4 * c + 1], b[4 * c + 2], b[4 * c + 3]]),
            WeightDType::Fp8E4m3 => {
                let s = scale_value(self.row_scales(r)[c / FP8_BLOCK]);
                quant::e4m3_to_f32(b[c]) * s
            }
            WeightDType::Mxfp4 => {
                let s = scale_value(self.row_scales(r)[c / MXFP4_GROUP]);
                quant::E2M1_PAIRS[usize::from(b[c / 2])][c % 2] * s
            }
        }
    }
    /// Row `r` as FP32 values (exact), for tests and converters.
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        (0..self.cols).map(|c| self.get(r, c)).collect()
    }
}

/// A validated UE8M0 code as its FP32 power of two (NaN for `0xFF`, which the
/// loader refuses, so it never reaches a product).
#[inline]
pub(crate) fn scale_value(e: u8) -> f32 {
    quant::ue8m0_to_f32(e).unwrap_or(f32::NAN)
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
            let (file, len) = open_regular(&path, "a safetensors file")?;
            if len < SAFETENSORS_MIN_BYTES {
                return Err(RuntimeError::Safetensors {
                    path,
                    message: format!(
                        "{len} bytes is too short for a header (at least {SAFETENSORS_MIN_BYTES})"
                    ),
                });
            }
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
            Dtype::F8_E4M3 | Dtype::F8_E5M2 => {
                " (FP8 is read only for the dense projections the release quantizes, with a `quantization_config` in config.json)"
            }
            Dtype::U8 | Dtype::I8 | Dtype::F4 => {
                " (packed FP4 is read only for routed experts, with `expert_dtype: \"fp4\"` in config.json)"
            }
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
            scales: None,
        })
    }

    /// A linear layer `[rows, cols]` (`name` ends in `.weight`) in the format the
    /// config declares for its class (dense projection or routed expert), with
    /// its scale tensor `<stem>.scale` for quantized formats. Codes and scales
    /// stay in the memory map; NaN codes and out-of-range scales are refused
    /// here, so the dot products never meet them.
    pub fn linear(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        format: LinearFormat,
    ) -> Result<Mat, RuntimeError> {
        let Some(found) = self.entries.get(name) else {
            let shape = match format {
                LinearFormat::Mxfp4 => vec![rows, cols / 2],
                _ => vec![rows, cols],
            };
            return Err(self.err(
                None,
                name,
                format!(
                    "missing from the checkpoint (expected {} shape {shape:?})",
                    format.expected()
                ),
            ));
        };
        let found_dtype = found.dtype;
        let mismatch = |this: &Self, why: &str| {
            let e = &this.entries[name];
            this.err(
                Some(e),
                name,
                format!(
                    "expected {}{why}, found {} {:?}",
                    format.expected(),
                    dtype_name(e.dtype),
                    e.shape
                ),
            )
        };
        match format {
            LinearFormat::Plain => {
                if matches!(
                    found_dtype,
                    Dtype::F8_E4M3 | Dtype::F8_E5M2 | Dtype::I8 | Dtype::U8 | Dtype::F4
                ) {
                    return Err(mismatch(
                        self,
                        " (config.json declares no quantization for this tensor: FP8 dense projections need a `quantization_config`, packed FP4 routed experts `expert_dtype: \"fp4\"`)",
                    ));
                }
                self.mat(name, rows, cols)
            }
            LinearFormat::Fp8Block128 => {
                if found_dtype != Dtype::F8_E4M3 {
                    return Err(mismatch(
                        self,
                        " (config.json declares FP8 E4M3 block-scaled weights here)",
                    ));
                }
                let e = self.lookup(name, &[rows, cols])?;
                let (file, offset, len) = (e.file, e.offset, e.len);
                let bytes = &self.files[file].1[offset..offset + len];
                if let Some(i) = bytes.iter().position(|&b| quant::e4m3_is_nan(b)) {
                    let e = &self.entries[name];
                    return Err(self.err(
                        Some(e),
                        name,
                        format!(
                            "element ({}, {}) is the E4M3 NaN code {:#04x}; a weight must be finite",
                            i / cols.max(1),
                            i % cols.max(1),
                            bytes[i]
                        ),
                    ));
                }
                let scales = self.scales(
                    name,
                    [rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)],
                    QuantFormat::Fp8E4m3Block128,
                )?;
                Ok(Mat {
                    map: self.files[file].1.clone(),
                    offset,
                    rows,
                    cols,
                    dtype: WeightDType::Fp8E4m3,
                    scales: Some(scales),
                })
            }
            LinearFormat::Mxfp4 => {
                if !matches!(found_dtype, Dtype::I8 | Dtype::U8 | Dtype::F4) {
                    return Err(mismatch(self, " (config.json declares `expert_dtype: \"fp4\"`)"));
                }
                if !cols.is_multiple_of(MXFP4_GROUP) {
                    let e = &self.entries[name];
                    return Err(self.err(
                        Some(e),
                        name,
                        format!(
                            "MXFP4 needs a multiple of {MXFP4_GROUP} inputs per row, the config gives {cols}"
                        ),
                    ));
                }
                // I8/U8 store the packed bytes [rows, cols/2]; a safetensors F4 tensor
                // states the logical shape [rows, cols] over the same bytes.
                let shape = if found_dtype == Dtype::F4 {
                    vec![rows, cols]
                } else {
                    vec![rows, cols / 2]
                };
                let e = self.lookup(name, &shape).map_err(|err| match err {
                    RuntimeError::Tensor {
                        path,
                        tensor,
                        message,
                    } => RuntimeError::Tensor {
                        path,
                        tensor,
                        message: format!(
                            "{message} (packed MXFP4: two values per byte, {cols} inputs per row)"
                        ),
                    },
                    other => other,
                })?;
                let (file, offset) = (e.file, e.offset);
                let scales = self.scales(name, [rows, cols / MXFP4_GROUP], QuantFormat::Mxfp4)?;
                Ok(Mat {
                    map: self.files[file].1.clone(),
                    offset,
                    rows,
                    cols,
                    dtype: WeightDType::Mxfp4,
                    scales: Some(scales),
                })
            }
        }
    }

    /// The UE8M0 scale tensor of the quantized weight `weight` (`<stem>.scale`):
    /// `F8_E8M0` (as released) or `U8`, of shape `shape`, every code finite and
    /// small enough that the format's largest value times the scale is finite.
    fn scales(
        &mut self,
        weight: &str,
        shape: [usize; 2],
        format: QuantFormat,
    ) -> Result<Scales, RuntimeError> {
        let stem = weight.strip_suffix(".weight").unwrap_or(weight);
        let name = format!("{stem}.scale");
        let Some(e) = self.entries.get(&name) else {
            return Err(self.err(
                None,
                &name,
                format!(
                    "missing from the checkpoint (expected F8_E8M0 shape {shape:?}: the UE8M0 scales of `{weight}`, {})",
                    format.name()
                ),
            ));
        };
        if !matches!(e.dtype, Dtype::F8_E8M0 | Dtype::U8) {
            return Err(self.err(
                Some(e),
                &name,
                format!(
                    "expected F8_E8M0 (UE8M0 scales; U8 accepted) shape {shape:?}, found {} {:?}",
                    dtype_name(e.dtype),
                    e.shape
                ),
            ));
        }
        if e.shape != shape {
            return Err(self.err(
                Some(e),
                &name,
                format!(
                    "expected shape {shape:?} (the scales of `{weight}`, {}), got {:?}",
                    format.name(),
                    e.shape
                ),
            ));
        }
        self.used.insert(name.clone());
        let e = &self.entries[&name];
        let bytes = &self.files[e.file].1[e.offset..e.offset + e.len];
        let limit = format.max_scale_code();
        if let Some(i) = bytes.iter().position(|&b| b > limit) {
            let code = bytes[i];
            let why = if code == 0xFF {
                "the UE8M0 NaN code 0xff".to_string()
            } else {
                format!(
                    "2^{}: the largest {} value times it overflows FP32 (codes up to {limit} = 2^{} are accepted)",
                    i32::from(code) - 127,
                    match format {
                        QuantFormat::Fp8E4m3Block128 => "E4M3",
                        QuantFormat::Mxfp4 => "E2M1",
                    },
                    i32::from(limit) - 127
                )
            };
            return Err(self.err(
                Some(e),
                &name,
                format!(
                    "element ({}, {}) = {code:#04x} is {why}",
                    i / shape[1].max(1),
                    i % shape[1].max(1)
                ),
            ));
        }
        Ok(Scales {
            map: self.files[e.file].1.clone(),
            offset: e.offset,
            cols: shape[1],
        })
    }

    /// Whether the checkpoint holds a tensor of this name.
    pub fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
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

    /// Fails if the checkpoint holds tensors that were never requested,
    /// ignoring `mtp.{j}.*` for `j ≥ mtp_layers` (multi-token-prediction blocks
    /// the config does not declare; HF drops every `mtp.*` tensor).
    pub fn finish(self, mtp_layers: usize) -> Result<(), RuntimeError> {
        let undeclared_mtp = |k: &str| {
            k.strip_prefix("mtp.")
                .and_then(|rest| rest.split('.').next())
                .is_some_and(|j| j.parse::<usize>().map_or(true, |j| j >= mtp_layers))
        };
        let extra: Vec<&String> = self
            .entries
            .keys()
            .filter(|k| !self.used.contains(*k) && !undeclared_mtp(k))
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
