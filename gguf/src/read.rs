//! Reading a GGUF version 3 file, for verification and inspection. The file is untrusted:
//! every length is checked against the bytes that remain before anything is allocated,
//! counts are bounded by the smallest encoding of their elements, tensor data must lie inside
//! the file at an aligned offset, and every failure names the file, the byte offset and what
//! is wrong. Unknown ggml tensor types are kept by id (so a foreign GGUF can still be listed)
//! and refused only when their data is read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::ggml::{dequantize, GgmlType};
use crate::value::{scalar_size, tag, Value};
use crate::write::{GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION};
use crate::GgufError;

/// Largest nesting of arrays accepted (ggml writes none; the format allows them).
const MAX_ARRAY_DEPTH: usize = 2;

/// One tensor of a read file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    /// Dimensions in ggml order (innermost first).
    pub ne: Vec<u64>,
    /// The raw `enum ggml_type` value.
    pub type_id: u32,
    /// The type, if moeconf knows it.
    pub ty: Option<GgmlType>,
    /// Absolute file offset of the data.
    pub offset: u64,
    /// Bytes of data (0 for a type moeconf does not know).
    pub bytes: u64,
}

impl TensorEntry {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.ne.iter().product()
    }
}

/// A parsed GGUF file (memory-mapped).
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    /// The metadata, in file order.
    pub kvs: Vec<(String, Value)>,
    index: BTreeMap<String, usize>,
    /// The tensors, in file order.
    pub tensors: Vec<TensorEntry>,
    by_name: BTreeMap<String, usize>,
}

struct Cursor<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: impl Into<String>) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            offset: self.pos as u64,
            message: what.into(),
        }
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.err(format!("{what}: needs {n} bytes, {} remain", self.remaining())));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let at = self.pos;
        let n = self.u64(what)?;
        if n > self.remaining() as u64 {
            self.pos = at;
            return Err(self.err(format!(
                "{what}: string of {n} bytes, {} remain",
                self.remaining()
            )));
        }
        let b = self.take(n as usize, what)?;
        match String::from_utf8(b.to_vec()) {
            Ok(s) => Ok(s),
            Err(e) => {
                self.pos = at;
                Err(self.err(format!(
                    "{what}: not UTF-8 (invalid byte {} of the string)",
                    e.utf8_error().valid_up_to()
                )))
            }
        }
    }
    fn value(&mut self, t: u32, depth: usize, what: &str) -> Result<Value, GgufError> {
        Ok(match t {
            tag::U8 => Value::U8(self.take(1, what)?[0]),
            tag::I8 => Value::I8(self.take(1, what)?[0] as i8),
            tag::U16 => {
                let b = self.take(2, what)?;
                Value::U16(u16::from_le_bytes([b[0], b[1]]))
            }
            tag::I16 => {
                let b = self.take(2, what)?;
                Value::I16(i16::from_le_bytes([b[0], b[1]]))
            }
            tag::U32 => Value::U32(self.u32(what)?),
            tag::I32 => Value::I32(self.u32(what)? as i32),
            tag::F32 => Value::F32(f32::from_bits(self.u32(what)?)),
            tag::BOOL => match self.take(1, what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    self.pos -= 1;
                    return Err(self.err(format!("{what}: bool byte {b} (0 or 1 expected)")));
                }
            },
            tag::STRING => Value::Str(self.string(what)?),
            tag::U64 => Value::U64(self.u64(what)?),
            tag::I64 => Value::I64(self.u64(what)? as i64),
            tag::F64 => Value::F64(f64::from_bits(self.u64(what)?)),
            tag::ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!("{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")));
                }
                let et = self.u32(what)?;
                let n = self.u64(what)?;
                // The smallest encoding of one element bounds the count before any allocation.
                let min = match et {
                    tag::STRING => 8,
                    tag::ARRAY => 12,
                    t => scalar_size(t)
                        .ok_or_else(|| self.err(format!("{what}: unknown array element type {t}")))?,
                } as u64;
                if n.checked_mul(min).is_none_or(|b| b > self.remaining() as u64) {
                    return Err(self.err(format!(
                        "{what}: array of {n} elements cannot fit in {} bytes",
                        self.remaining()
                    )));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(et, depth + 1, what)?);
                }
                Value::Array(et, items)
            }
            t => return Err(self.err(format!("{what}: unknown value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Opens and parses `path`. Fails with a message naming the file and byte offset if it is
    /// not a GGUF version 3 file or any header field is inconsistent.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |e: std::io::Error| GgufError::Io {
            path: path.to_path_buf(),
            source: e,
        };
        // A regular file only: a FIFO or device is refused by kind, never opened.
        let file = moeconf_output::input::open_input(path, "GGUF file")?;
        // SAFETY: read-only mapping; the file is not expected to change while it is read (a
        // concurrent writer of moeconf replaces files by rename, which keeps this mapping valid).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (kvs, tensors) = parse(path, &map)?;
        let mut index = BTreeMap::new();
        for (i, (k, _)) in kvs.iter().enumerate() {
            if index.insert(k.clone(), i).is_some() {
                return Err(GgufError::Malformed {
                    path: path.to_path_buf(),
                    offset: 0,
                    message: format!("metadata key {k:?} appears twice"),
                });
            }
        }
        let mut by_name = BTreeMap::new();
        for (i, t) in tensors.iter().enumerate() {
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(GgufError::Malformed {
                    path: path.to_path_buf(),
                    offset: 0,
                    message: format!("tensor {:?} appears twice", t.name),
                });
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            kvs,
            index,
            tensors,
            by_name,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.kvs[i].1)
    }

    /// `general.architecture`, if present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(Value::as_str)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were checked at open).
    pub fn tensor_bytes(&self, t: &TensorEntry) -> &[u8] {
        &self.map[t.offset as usize..(t.offset + t.bytes) as usize]
    }

    /// A tensor's values dequantized to FP32 (ggml's formulas, [`crate::ggml::dequantize`]).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let t = self.tensor(name).ok_or_else(|| self.missing(name))?;
        let ty = t.ty.ok_or_else(|| {
            GgufError::Invalid(format!(
                "{}: tensor {name}: ggml type {} is not one moeconf reads",
                self.path.display(),
                t.type_id
            ))
        })?;
        dequantize(ty, self.tensor_bytes(t), t.numel() as usize)
            .map_err(|m| GgufError::Invalid(format!("{}: tensor {name}: {m}", self.path.display())))
    }

    /// A tensor's `I32` elements.
    pub fn tensor_i32(&self, name: &str) -> Result<Vec<i32>, GgufError> {
        let t = self.tensor(name).ok_or_else(|| self.missing(name))?;
        if t.ty != Some(GgmlType::I32) {
            return Err(GgufError::Invalid(format!(
                "{}: tensor {name}: type {} where i32 is expected",
                self.path.display(),
                t.ty.map_or("unknown", GgmlType::name)
            )));
        }
        Ok(self
            .tensor_bytes(t)
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn missing(&self, name: &str) -> GgufError {
        GgufError::Invalid(format!("{}: no tensor named {name}", self.path.display()))
    }
}

/// The metadata and tensor entries of a parsed file.
type Parsed = (Vec<(String, Value)>, Vec<TensorEntry>);

fn parse(path: &Path, buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor { path, buf, pos: 0 };
    let magic = c.take(4, "magic")?;
    if magic != GGUF_MAGIC {
        c.pos = 0;
        return Err(c.err(format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")")));
    }
    let version = c.u32("version")?;
    if version != GGUF_VERSION {
        c.pos = 4;
        return Err(c.err(format!("GGUF version {version} (only {GGUF_VERSION} is read)")));
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    // A key-value pair is at least 8 (key length) + 4 (type) + 1 bytes; a tensor info at
    // least 8 + 4 + 8 + 4 + 8.
    if n_kv.checked_mul(13).is_none_or(|b| b > c.remaining() as u64) {
        return Err(c.err(format!(
            "{n_kv} metadata entries cannot fit in {} bytes",
            c.remaining()
        )));
    }
    let mut kvs = Vec::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key {i}"))?;
        let t = c.u32(&format!("type of {key:?}"))?;
        let v = c.value(t, 0, &format!("value of {key:?}"))?;
        kvs.push((key, v));
    }
    if n_tensors.checked_mul(32).is_none_or(|b| b > c.remaining() as u64) {
        return Err(c.err(format!(
            "{n_tensors} tensor infos cannot fit in {} bytes",
            c.remaining()
        )));
    }
    let alignment = match kvs.iter().find(|(k, _)| k == "general.alignment") {
        None => GGUF_DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if a.is_power_of_two() => u64::from(*a),
        Some((_, v)) => return Err(c.err(format!("general.alignment = {v:?} (a power of two u32 expected)"))),
    };
    let mut infos = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor {i} name"))?;
        let n_dims = c.u32(&format!("tensor {name} dimension count"))?;
        if n_dims == 0 || n_dims > 4 {
            return Err(c.err(format!("tensor {name}: {n_dims} dimensions (1 to 4 allowed)")));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(c.u64(&format!("tensor {name} dimensions"))?);
        }
        let type_id = c.u32(&format!("tensor {name} type"))?;
        let offset = c.u64(&format!("tensor {name} offset"))?;
        infos.push((name, ne, type_id, offset));
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let len = buf.len() as u64;
    let mut tensors = Vec::with_capacity(infos.len());
    for (name, ne, type_id, offset) in infos {
        let numel = ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let ty = GgmlType::from_id(type_id);
        let bytes = match (ty, numel) {
            (_, None) => return Err(c.err(format!("tensor {name}: element count of {ne:?} overflows"))),
            (Some(t), Some(n)) => {
                if !ne[0].is_multiple_of(t.block_size() as u64) {
                    return Err(c.err(format!(
                        "tensor {name}: ne[0] = {} is not a multiple of the {} block size {}",
                        ne[0],
                        t.name(),
                        t.block_size()
                    )));
                }
                t.bytes_for(n)
                    .ok_or_else(|| c.err(format!("tensor {name}: size overflows")))?
            }
            (None, Some(_)) => 0,
        };
        if !offset.is_multiple_of(alignment) {
            return Err(c.err(format!(
                "tensor {name}: data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let abs = data_start.checked_add(offset);
        if abs.and_then(|a| a.checked_add(bytes)).is_none_or(|end| end > len) {
            return Err(c.err(format!(
                "tensor {name}: {bytes} bytes at data offset {offset} extend past the end of the {len}-byte file"
            )));
        }
        tensors.push(TensorEntry {
            name,
            ne,
            type_id,
            ty,
            offset: abs.unwrap_or(0),
            bytes,
        });
    }
    Ok((kvs, tensors))
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    /// A FIFO, a directory and a device are refused by kind before being
    /// opened (opening the FIFO would block: this test would hang).
    #[test]
    fn only_regular_files_are_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("m.gguf");
        let st = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(st.success());
        for (p, kind) in [
            (fifo.as_path(), "a FIFO (named pipe)"),
            (dir.path(), "a directory"),
            (Path::new("/dev/null"), "a character device"),
        ] {
            let e = GgufFile::open(p).unwrap_err();
            assert!(matches!(e, GgufError::Input(_)), "{e}");
            let e = e.to_string();
            assert!(e.starts_with(&format!("{}: ", p.display())), "{e}");
            assert!(e.contains(&format!("is {kind}, not a regular file")), "{e}");
        }
    }
}
