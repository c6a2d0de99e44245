//! GGUF metadata values (`enum gguf_type` of ggml's `gguf.h`) and their little-endian
//! encoding: a `u32` type tag, then the value; strings are a `u64` byte length and UTF-8
//! bytes; arrays are an element type tag, a `u64` count and the elements (nested arrays are
//! allowed by the format and read, never written).

/// `enum gguf_type` tags.
pub mod tag {
    /// `GGUF_TYPE_UINT8`.
    pub const U8: u32 = 0;
    /// `GGUF_TYPE_INT8`.
    pub const I8: u32 = 1;
    /// `GGUF_TYPE_UINT16`.
    pub const U16: u32 = 2;
    /// `GGUF_TYPE_INT16`.
    pub const I16: u32 = 3;
    /// `GGUF_TYPE_UINT32`.
    pub const U32: u32 = 4;
    /// `GGUF_TYPE_INT32`.
    pub const I32: u32 = 5;
    /// `GGUF_TYPE_FLOAT32`.
    pub const F32: u32 = 6;
    /// `GGUF_TYPE_BOOL`.
    pub const BOOL: u32 = 7;
    /// `GGUF_TYPE_STRING`.
    pub const STRING: u32 = 8;
    /// `GGUF_TYPE_ARRAY`.
    pub const ARRAY: u32 = 9;
    /// `GGUF_TYPE_UINT64`.
    pub const U64: u32 = 10;
    /// `GGUF_TYPE_INT64`.
    pub const I64: u32 = 11;
    /// `GGUF_TYPE_FLOAT64`.
    pub const F64: u32 = 12;
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `float32`.
    F32(f32),
    /// `bool` (one byte, 0 or 1).
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float64`.
    F64(f64),
    /// Array of values of one type tag (the tag is kept for empty arrays).
    Array(u32, Vec<Value>),
}

impl Value {
    pub fn tag(&self) -> u32 {
        match self {
            Value::U8(_) => tag::U8,
            Value::I8(_) => tag::I8,
            Value::U16(_) => tag::U16,
            Value::I16(_) => tag::I16,
            Value::U32(_) => tag::U32,
            Value::I32(_) => tag::I32,
            Value::F32(_) => tag::F32,
            Value::Bool(_) => tag::BOOL,
            Value::Str(_) => tag::STRING,
            Value::U64(_) => tag::U64,
            Value::I64(_) => tag::I64,
            Value::F64(_) => tag::F64,
            Value::Array(..) => tag::ARRAY,
        }
    }

    /// An array of `u32`.
    pub fn u32s(v: impl IntoIterator<Item = u32>) -> Value {
        Value::Array(tag::U32, v.into_iter().map(Value::U32).collect())
    }

    /// An array of `i32`.
    pub fn i32s(v: impl IntoIterator<Item = i32>) -> Value {
        Value::Array(tag::I32, v.into_iter().map(Value::I32).collect())
    }

    /// An array of `f32`.
    pub fn f32s(v: impl IntoIterator<Item = f32>) -> Value {
        Value::Array(tag::F32, v.into_iter().map(Value::F32).collect())
    }

    /// An array of strings.
    pub fn strs<S: Into<String>>(v: impl IntoIterator<Item = S>) -> Value {
        Value::Array(tag::STRING, v.into_iter().map(|s| Value::Str(s.into())).collect())
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(u64::from(v)),
            Value::U16(v) => Some(u64::from(v)),
            Value::U32(v) => Some(u64::from(v)),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as `f64`, if it is a float.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(f64::from(v)),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The string, if the value is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if the value is an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }

    /// Appends the encoding of the value (without its type tag) to `out`.
    pub(crate) fn encode_body(&self, out: &mut Vec<u8>) {
        match self {
            Value::U8(v) => out.push(*v),
            Value::I8(v) => out.push(*v as u8),
            Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::Bool(v) => out.push(u8::from(*v)),
            Value::Str(s) => encode_str(s, out),
            Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::Array(t, items) => {
                out.extend_from_slice(&t.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    item.encode_body(out);
                }
            }
        }
    }
}

/// Appends a GGUF string (`u64` length, bytes).
pub(crate) fn encode_str(s: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Fixed size in bytes of a scalar type tag (`None` for strings, arrays and unknown tags).
pub(crate) fn scalar_size(t: u32) -> Option<usize> {
    Some(match t {
        tag::U8 | tag::I8 | tag::BOOL => 1,
        tag::U16 | tag::I16 => 2,
        tag::U32 | tag::I32 | tag::F32 => 4,
        tag::U64 | tag::I64 | tag::F64 => 8,
        _ => return None,
    })
}
