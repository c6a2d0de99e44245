//! The bincode 1 wire format (fixed-width little-endian), written by hand.
//!
//! Every structured byte string moeconf hashes or stores (coordinates, digest
//! preimages, trace headers and indexes) uses the encoding that bincode 1.3
//! produces with its default `bincode::serialize` configuration:
//!
//! * `u8`/`u32`/`u64`/`i64`/`f32`/`f64`: fixed width, little-endian;
//! * `bool`: one byte, 0 or 1;
//! * `String`, `Vec<T>`, `&[u8]`: a `u64` element count, then the elements;
//! * `Option<T>`: one byte 0 (`None`) or 1 (`Some`) followed by `T`;
//! * fixed arrays `[u8; 32]`: the 32 bytes, no length;
//! * unit enum variants: the variant index as `u32`;
//! * structs and tuples: fields in declaration order, no padding.
//!
//! It is implemented here rather than through the `bincode` crate so that the
//! decoder can report the exact byte offset of every failure and cap every
//! length before allocating; a test checks byte-for-byte agreement with
//! bincode 1.3.3. See docs/format.md for why.

use thiserror::Error;

/// Appends values in the wire format to a byte vector.
#[derive(Debug, Default, Clone)]
pub struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    /// An empty encoder.
    pub fn new() -> Encoder {
        Encoder { buf: Vec::new() }
    }

    /// An empty encoder with room for `n` bytes (no reallocation while
    /// encoding up to `n`).
    pub fn with_capacity(n: usize) -> Encoder {
        Encoder {
            buf: Vec::with_capacity(n),
        }
    }

    /// The bytes written so far.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    /// Empties the encoder, keeping its allocation (for reuse in loops).
    pub fn clear(&mut self) {
        self.buf.clear();
    }

    /// Consumes the encoder, returning its bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    /// Writes a `bool` as 0 or 1.
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(u8::from(v))
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Writes an `f32` by its bits.
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.u32(v.to_bits())
    }

    /// Writes an `f64` by its bits.
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.u64(v.to_bits())
    }

    /// Writes a length prefix (`u64`).
    pub fn len(&mut self, n: usize) -> &mut Self {
        self.u64(n as u64)
    }

    /// Writes a string: `u64` byte length, then UTF-8 bytes.
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.bytes(s.as_bytes())
    }

    /// Writes a byte vector: `u64` length, then the bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.len(b.len());
        self.buf.extend_from_slice(b);
        self
    }

    /// Writes raw bytes with no length (fixed-size arrays).
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }

    pub fn opt_u32(&mut self, v: Option<u32>) -> &mut Self {
        match v {
            None => self.u8(0),
            Some(x) => self.u8(1).u32(x),
        }
    }
}

/// A failed decode: what was expected and the absolute byte offset.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("at byte {offset}: {what}")]
pub struct WireError {
    /// Absolute offset (in the enclosing file) of the first offending byte.
    pub offset: u64,
    /// What was wrong there.
    pub what: String,
}

/// Reads wire-format values from a byte slice that starts at a known file
/// offset, so every error can name the absolute position.
#[derive(Debug, Clone)]
pub struct Decoder<'a> {
    bytes: &'a [u8],
    pos: usize,
    base: u64,
}

impl<'a> Decoder<'a> {
    /// A decoder over `bytes`, which start at absolute offset `base`.
    pub fn new(bytes: &'a [u8], base: u64) -> Decoder<'a> {
        Decoder { bytes, pos: 0, base }
    }

    /// Absolute offset of the next byte to be read.
    pub fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }

    /// Bytes not yet read.
    #[inline]
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// An error at the current offset.
    pub fn error(&self, what: impl Into<String>) -> WireError {
        WireError {
            offset: self.offset(),
            what: what.into(),
        }
    }

    /// An error at an absolute offset.
    pub fn error_at(&self, offset: u64, what: impl Into<String>) -> WireError {
        WireError {
            offset,
            what: what.into(),
        }
    }

    /// Fails unless every byte was consumed.
    pub fn finish(&self, what: &str) -> Result<(), WireError> {
        if self.remaining() != 0 {
            return Err(self.error(format!("{} trailing bytes after the {what}", self.remaining())));
        }
        Ok(())
    }

    /// Takes `n` raw bytes.
    ///
    /// Inlined, with the error built out of line: decoding a root block or a
    /// group block is a long run of these small reads.
    #[inline]
    pub fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        if self.remaining() < n {
            return Err(self.truncated(n, what));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// The error of a read of `n` bytes past the end.
    #[cold]
    #[inline(never)]
    fn truncated(&self, n: usize, what: &str) -> WireError {
        self.error(format!(
            "truncated {what}: needs {n} bytes, {} left",
            self.remaining()
        ))
    }

    #[inline]
    pub fn u8(&mut self, what: &str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }

    /// Reads a `bool`, rejecting bytes other than 0 and 1.
    pub fn bool(&mut self, what: &str) -> Result<bool, WireError> {
        let at = self.offset();
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.error_at(at, format!("{what}: invalid bool byte {b}"))),
        }
    }

    #[inline]
    pub fn u32(&mut self, what: &str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    #[inline]
    pub fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// Reads an `f32` by its bits.
    pub fn f32(&mut self, what: &str) -> Result<f32, WireError> {
        Ok(f32::from_bits(self.u32(what)?))
    }

    /// Reads an `f64` by its bits.
    pub fn f64(&mut self, what: &str) -> Result<f64, WireError> {
        Ok(f64::from_bits(self.u64(what)?))
    }

    /// Reads a length prefix and checks that `len × min_elem_size` bytes can
    /// still follow and that `len ≤ max`, so no allocation is sized by an
    /// unchecked field.
    pub fn len(&mut self, what: &str, min_elem_size: usize, max: u64) -> Result<usize, WireError> {
        let at = self.offset();
        let n = self.u64(what)?;
        if n > max {
            return Err(self.error_at(at, format!("{what}: length {n} exceeds the limit {max}")));
        }
        let need = n.saturating_mul(min_elem_size as u64);
        if need > self.remaining() as u64 {
            return Err(self.error_at(
                at,
                format!(
                    "{what}: length {n} needs at least {need} bytes, only {} left",
                    self.remaining()
                ),
            ));
        }
        // n <= remaining bytes here (or elements are zero-sized), so it fits in usize.
        usize::try_from(n).map_err(|_| self.error_at(at, format!("{what}: length {n} too large")))
    }

    /// Reads a UTF-8 string of at most `max` bytes.
    pub fn str(&mut self, what: &str, max: u64) -> Result<&'a str, WireError> {
        let n = self.len(what, 1, max)?;
        let at = self.offset();
        let b = self.take(n, what)?;
        std::str::from_utf8(b)
            .map_err(|e| self.error_at(at + e.valid_up_to() as u64, format!("{what}: invalid UTF-8")))
    }

    /// Reads a byte vector of at most `max` bytes.
    pub fn bytes(&mut self, what: &str, max: u64) -> Result<&'a [u8], WireError> {
        let n = self.len(what, 1, max)?;
        self.take(n, what)
    }

    #[inline]
    pub fn array32(&mut self, what: &str) -> Result<[u8; 32], WireError> {
        let b = self.take(32, what)?;
        let mut a = [0u8; 32];
        a.copy_from_slice(b);
        Ok(a)
    }

    /// Reads an `Option` tag, rejecting bytes other than 0 and 1.
    pub fn option_tag(&mut self, what: &str) -> Result<bool, WireError> {
        let at = self.offset();
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.error_at(at, format!("{what}: invalid option tag {b}"))),
        }
    }

    pub fn opt_u32(&mut self, what: &str) -> Result<Option<u32>, WireError> {
        if self.option_tag(what)? {
            Ok(Some(self.u32(what)?))
        } else {
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;

    #[derive(Serialize)]
    enum Unit {
        _A,
        B,
    }

    #[derive(Serialize)]
    struct Sample {
        a: u8,
        b: bool,
        c: u32,
        d: u64,
        e: f32,
        f: f64,
        g: String,
        h: Vec<u8>,
        i: Option<u32>,
        j: Option<u32>,
        k: [u8; 32],
        l: Unit,
        m: Vec<u64>,
    }

    #[test]
    fn agrees_with_bincode_1_3_3() {
        let s = Sample {
            a: 7,
            b: true,
            c: 0xdead_beef,
            d: u64::MAX - 3,
            e: -0.0,
            f: f64::NAN,
            g: "layer.post_mhc 中".into(),
            h: vec![1, 2, 3],
            i: None,
            j: Some(42),
            k: [9u8; 32],
            l: Unit::B,
            m: vec![3, 1 << 40],
        };
        let want = bincode::serialize(&s).unwrap();
        let mut e = Encoder::new();
        e.u8(s.a).bool(s.b).u32(s.c).u64(s.d).f32(s.e).f64(s.f);
        e.str(&s.g).bytes(&s.h).opt_u32(s.i).opt_u32(s.j).raw(&s.k);
        e.u32(1).len(s.m.len());
        for v in &s.m {
            e.u64(*v);
        }
        assert_eq!(e.as_bytes(), &want[..]);

        let mut d = Decoder::new(&want, 100);
        assert_eq!(d.u8("a").unwrap(), 7);
        assert!(d.bool("b").unwrap());
        assert_eq!(d.u32("c").unwrap(), 0xdead_beef);
        assert_eq!(d.u64("d").unwrap(), u64::MAX - 3);
        assert_eq!(d.f32("e").unwrap().to_bits(), 0x8000_0000);
        assert!(d.f64("f").unwrap().is_nan());
        assert_eq!(d.str("g", 100).unwrap(), "layer.post_mhc 中");
        assert_eq!(d.bytes("h", 10).unwrap(), &[1, 2, 3]);
        assert_eq!(d.opt_u32("i").unwrap(), None);
        assert_eq!(d.opt_u32("j").unwrap(), Some(42));
        assert_eq!(d.array32("k").unwrap(), [9u8; 32]);
        assert_eq!(d.u32("l").unwrap(), 1);
        assert_eq!(d.len("m", 8, 10).unwrap(), 2);
        assert_eq!(d.u64("m0").unwrap(), 3);
        assert_eq!(d.u64("m1").unwrap(), 1 << 40);
        d.finish("sample").unwrap();
    }

    #[test]
    fn errors_carry_absolute_offsets() {
        let bytes = [5u8, 0, 0, 0, 0, 0, 0, 0, b'a'];
        let mut d = Decoder::new(&bytes, 1000);
        let e = d.str("name", 100).unwrap_err();
        assert_eq!(e.offset, 1000);
        assert!(e.what.contains("needs at least 5 bytes"), "{}", e.what);

        let huge = u64::MAX.to_le_bytes();
        let mut d = Decoder::new(&huge, 0);
        let e = d.len("records", 80, 1 << 30).unwrap_err();
        assert!(e.what.contains("exceeds the limit"), "{}", e.what);

        let mut d = Decoder::new(&[2u8], 7);
        assert_eq!(d.bool("flag").unwrap_err().offset, 7);
        let mut d = Decoder::new(&[1u8, 0xff], 0);
        d.u8("x").unwrap();
        assert!(d.finish("header").is_err());
    }
}
