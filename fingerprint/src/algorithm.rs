//! Digest algorithms (BLAKE3-256, SHA-256) behind one streaming interface.

use sha2::Digest as _;
use std::fmt;

/// The hash function a trace uses for every digest it holds.
///
/// BLAKE3 is the default because it is several times faster than SHA-256 and
/// parallelizes over large tensors; SHA-256 is offered because the paper's
/// replay manifests used it and some organisations require it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u32)]
pub enum Algorithm {
    /// BLAKE3 in its default hash mode with 32-byte output.
    #[default]
    Blake3 = 0,
    /// SHA-256 (FIPS 180-4).
    Sha256 = 1,
}

impl Algorithm {
    /// The stable wire code of this algorithm.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The algorithm with the given wire code, if any.
    pub fn from_code(code: u32) -> Option<Algorithm> {
        match code {
            0 => Some(Algorithm::Blake3),
            1 => Some(Algorithm::Sha256),
            _ => None,
        }
    }

    /// The lowercase name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Blake3 => "blake3",
            Algorithm::Sha256 => "sha256",
        }
    }

    /// Parses `blake3` or `sha256` (also `sha-256`).
    pub fn from_name(name: &str) -> Option<Algorithm> {
        match name.to_ascii_lowercase().as_str() {
            "blake3" => Some(Algorithm::Blake3),
            "sha256" | "sha-256" => Some(Algorithm::Sha256),
            _ => None,
        }
    }

    /// A fresh streaming hasher for this algorithm.
    pub fn hasher(self) -> StreamHasher {
        match self {
            Algorithm::Blake3 => StreamHasher::Blake3(Box::new(blake3::Hasher::new())),
            Algorithm::Sha256 => StreamHasher::Sha256(sha2::Sha256::new()),
        }
    }

    /// Digest of a byte string in one call.
    pub fn hash(self, bytes: &[u8]) -> Digest {
        // One-shot paths: no boxed streaming state (tree nodes hash thousands
        // of short preimages when a trace is opened).
        match self {
            Algorithm::Blake3 => Digest(*blake3::hash(bytes).as_bytes()),
            Algorithm::Sha256 => {
                let mut d = [0u8; 32];
                d.copy_from_slice(&sha2::Sha256::digest(bytes));
                Digest(d)
            }
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Byte count above which BLAKE3 input is hashed with its multi-threaded
/// mode. The digest is identical either way; this only decides speed.
pub const PARALLEL_HASH_THRESHOLD: usize = 1 << 20;

/// An incremental hasher over either algorithm.
#[derive(Clone)]
pub enum StreamHasher {
    Blake3(Box<blake3::Hasher>),
    Sha256(sha2::Sha256),
}

impl StreamHasher {
    /// Feeds bytes. Large BLAKE3 inputs are hashed on the rayon pool when
    /// `parallel` is set; the digest does not depend on it.
    pub fn update_with(&mut self, bytes: &[u8], parallel: bool) {
        match self {
            StreamHasher::Blake3(h) => {
                if parallel && bytes.len() >= PARALLEL_HASH_THRESHOLD {
                    h.update_rayon(bytes);
                } else {
                    h.update(bytes);
                }
            }
            StreamHasher::Sha256(h) => h.update(bytes),
        }
    }

    /// Feeds bytes on the current thread.
    pub fn update(&mut self, bytes: &[u8]) {
        self.update_with(bytes, false);
    }

    /// Finishes and returns the 32-byte digest.
    pub fn finalize(self) -> Digest {
        match self {
            StreamHasher::Blake3(h) => Digest(*h.finalize().as_bytes()),
            StreamHasher::Sha256(h) => {
                let out = h.finalize();
                let mut d = [0u8; 32];
                d.copy_from_slice(&out);
                Digest(d)
            }
        }
    }
}

/// A 32-byte digest (BLAKE3-256 or SHA-256, as the trace says).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The all-zero digest, used only as a placeholder before a value is known.
    pub const ZERO: Digest = Digest([0u8; 32]);

    /// Lowercase hexadecimal, 64 characters.
    pub fn to_hex(&self) -> String {
        hex_encode(&self.0)
    }

    /// Parses 64 hexadecimal characters.
    pub fn from_hex(s: &str) -> Option<Digest> {
        if s.len() != 64 {
            return None;
        }
        Some(Digest(hex_decode(s)?.try_into().ok()?))
    }

    /// The first 12 hex characters, for compact human output.
    pub fn short(&self) -> String {
        self.to_hex()[..12].to_string()
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Lowercase hexadecimal of `bytes`.
pub fn hex_encode(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(2 * bytes.len());
    for &b in bytes {
        s.push(char::from(HEX[(b >> 4) as usize]));
        s.push(char::from(HEX[(b & 15) as usize]));
    }
    s
}

/// The bytes of hexadecimal `s` (either case); `None` when it is not an
/// even number of hex digits.
pub fn hex_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    b.chunks(2)
        .map(|p| Some((hex_val(p[0])? << 4) | hex_val(p[1])?))
        .collect()
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        // Published test vectors for the empty string and "abc".
        assert_eq!(
            Algorithm::Blake3.hash(b"").to_hex(),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
        assert_eq!(
            Algorithm::Sha256.hash(b"abc").to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn parallel_update_gives_same_digest() {
        let data: Vec<u8> = (0..(3 * PARALLEL_HASH_THRESHOLD + 17))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let mut a = Algorithm::Blake3.hasher();
        a.update_with(&data, true);
        let mut b = Algorithm::Blake3.hasher();
        b.update(&data);
        assert_eq!(a.finalize(), b.finalize());
    }

    #[test]
    fn hex_round_trip() {
        let d = Algorithm::Sha256.hash(b"x");
        assert_eq!(Digest::from_hex(&d.to_hex()), Some(d));
        assert_eq!(Digest::from_hex("zz"), None);
    }
}
