//! Writing a GGUF version 3 file (ggml's `gguf.cpp` layout, little-endian):
//!
//! ```text
//! "GGUF"  u32 version = 3  u64 n_tensors  u64 n_kv
//! n_kv × (string key, u32 type, value)
//! n_tensors × (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
//! zero padding to `general.alignment` (32)
//! tensor data, each tensor starting at data_start + offset, padded with zeros to the alignment
//! ```
//!
//! `ne` is ggml's dimension order: `ne[0]` is the innermost (contiguous) dimension, so a
//! row-major `[rows, cols]` matrix has `ne = [cols, rows]`. The file is written to a temporary
//! sibling and renamed into place ([`write_gguf_checked`]); the data of every tensor is produced by a callback, so a
//! large checkpoint is streamed, never held in memory as a whole.

use std::io::Write;
use std::path::Path;

use moeconf_output::AtomicFile;
use moeconf_output::CheckedOutput;

use crate::ggml::GgmlType;
use crate::value::{encode_str, Value};
use crate::GgufError;

/// `GGUF` as a little-endian `u32`.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The version written and the only one read.
pub const GGUF_VERSION: u32 = 3;
/// ggml's default `general.alignment`.
pub const GGUF_DEFAULT_ALIGNMENT: u64 = 32;

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// GGUF tensor name (e.g. `blk.0.attn_q_a.weight`).
    pub name: String,
    /// Dimensions in ggml order (innermost first), 1 to 4 of them.
    pub ne: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorInfo {
    /// Number of elements (`None` on overflow).
    pub fn numel(&self) -> Option<u64> {
        self.ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }

    /// Bytes of the tensor's data, or `None` if `ne[0]` is not a whole number of blocks.
    pub fn bytes(&self) -> Option<u64> {
        let ne0 = *self.ne.first()?;
        if !ne0.is_multiple_of(self.ty.block_size() as u64) {
            return None;
        }
        self.ty.bytes_for(self.numel()?)
    }
}

fn pad_to(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

/// A sink that counts the bytes written through it.
struct Counting<'a, W: Write> {
    inner: &'a mut W,
    count: u64,
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The encoded header (everything before the data, including the padding) and each tensor's
/// offset relative to the data start.
pub fn encode_header(
    kvs: &[(String, Value)],
    tensors: &[TensorInfo],
) -> Result<(Vec<u8>, Vec<u64>), GgufError> {
    let mut h = Vec::new();
    h.extend_from_slice(&GGUF_MAGIC);
    h.extend_from_slice(&GGUF_VERSION.to_le_bytes());
    h.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    h.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        encode_str(k, &mut h);
        h.extend_from_slice(&v.tag().to_le_bytes());
        v.encode_body(&mut h);
    }
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut offset = 0u64;
    for t in tensors {
        if t.ne.is_empty() || t.ne.len() > 4 {
            return Err(GgufError::Invalid(format!(
                "tensor {}: {} dimensions (1 to 4 allowed)",
                t.name,
                t.ne.len()
            )));
        }
        let bytes = t.bytes().ok_or_else(|| {
            GgufError::Invalid(format!(
                "tensor {}: ne {:?} is not a whole number of {} blocks of {}",
                t.name,
                t.ne,
                t.ty.name(),
                t.ty.block_size()
            ))
        })?;
        encode_str(&t.name, &mut h);
        h.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
        for d in &t.ne {
            h.extend_from_slice(&d.to_le_bytes());
        }
        h.extend_from_slice(&t.ty.id().to_le_bytes());
        h.extend_from_slice(&offset.to_le_bytes());
        offsets.push(offset);
        offset = pad_to(offset + bytes, GGUF_DEFAULT_ALIGNMENT);
    }
    let padded = pad_to(h.len() as u64, GGUF_DEFAULT_ALIGNMENT) as usize;
    h.resize(padded, 0);
    Ok((h, offsets))
}

/// Writes a GGUF file to the checked output `out` atomically (`moeconf_schema`'s
/// `AtomicFile`: a temporary sibling renamed into place, never an input of the command): the
/// metadata `kvs` (in this order), the tensor infos `tensors`, and for each tensor `i` the
/// bytes `fill(i, sink)` writes, which must be exactly [`TensorInfo::bytes`] long. On any error
/// the temporary file is removed and the destination is left untouched. Returns the file size.
pub fn write_gguf_checked<F>(
    out: &CheckedOutput,
    kvs: &[(String, Value)],
    tensors: &[TensorInfo],
    mut fill: F,
) -> Result<u64, GgufError>
where
    F: FnMut(usize, &mut dyn Write) -> Result<(), GgufError>,
{
    let (header, _) = encode_header(kvs, tensors)?;
    let path = out.path().to_path_buf();
    let io = |e: std::io::Error| GgufError::Io {
        path: path.clone(),
        source: e,
    };
    let mut w = AtomicFile::with_buffer(out, 1 << 20).map_err(|e| GgufError::Output(e.to_string()))?;
    w.write_all(&header).map_err(io)?;
    let mut total = header.len() as u64;
    for (i, t) in tensors.iter().enumerate() {
        let want = t.bytes().unwrap_or(0);
        let mut c = Counting {
            inner: &mut w,
            count: 0,
        };
        fill(i, &mut c)?;
        if c.count != want {
            return Err(GgufError::Invalid(format!(
                "tensor {}: produced {} bytes, its {} ne {:?} need {want}",
                t.name,
                c.count,
                t.ty.name(),
                t.ne
            )));
        }
        let padded = pad_to(want, GGUF_DEFAULT_ALIGNMENT);
        w.write_all(&vec![0u8; (padded - want) as usize]).map_err(io)?;
        total += padded;
    }
    w.commit().map_err(|e| GgufError::Output(e.to_string()))?;
    Ok(total)
}

/// [`write_gguf_checked`] to `path`, checked against no inputs (for tools and tests; commands
/// check their outputs against their inputs first).
pub fn write_gguf<F>(
    path: &Path,
    kvs: &[(String, Value)],
    tensors: &[TensorInfo],
    fill: F,
) -> Result<u64, GgufError>
where
    F: FnMut(usize, &mut dyn Write) -> Result<(), GgufError>,
{
    let out = moeconf_output::check_output(path, &moeconf_output::Inputs::new())
        .map_err(|e| GgufError::Output(e.to_string()))?;
    write_gguf_checked(&out, kvs, tensors, fill)
}
