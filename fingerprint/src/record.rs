//! Domain-separated record digests over canonical tensor bytes.
//!
//! A record digest is the hash of the *record preimage*: the wire encoding of
//!
//! ```text
//! ( domain: String = "moeconf.record.v1",
//!   coord:  Coord,           // step u32, position u32, phase u32, layer Option<u32>, path String
//!   level:  u32,
//!   dtype:  u32,
//!   shape:  Vec<u64>,
//!   byte_len: u64 )
//! ```
//!
//! then zero bytes up to the next multiple of 64, then the canonical
//! little-endian data bytes. The padding puts the data at an aligned offset
//! of the hash stream, so BLAKE3 can hash it in whole SIMD subtrees while it
//! is canonicalized piece by piece (a misaligned stream costs ~30%).
//!
//! so two records collide only if coordinate, level, dtype, shape and every
//! canonical byte agree. The data bytes are canonicalized in chunks while they
//! stream into the hasher (and, optionally, into a payload sink), which keeps
//! fingerprinting within a few percent of hashing the raw bytes.

use crate::algorithm::{Algorithm, Digest, StreamHasher, PARALLEL_HASH_THRESHOLD};
use crate::canonical::{canonicalize_in_place, is_canonical, surely_canonical, CanonPolicy};
use crate::coord::{Coord, Level};
use crate::dtype::DType;
use crate::wire::Encoder;
use thiserror::Error;

/// Domain tag of record preimages.
pub const DOMAIN_RECORD: &str = "moeconf.record.v1";
/// Highest tensor rank accepted.
pub const MAX_RANK: usize = 8;
/// Chunk size of the canonicalizing stream on one thread (fits in L2).
const CHUNK: usize = 256 * 1024;
/// Chunk size when large tensors are hashed on the rayon pool.
const PARALLEL_CHUNK: usize = 8 * 1024 * 1024;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FingerprintError {
    /// The byte length does not equal the product of the shape times the
    /// element size, or the rank is too high.
    #[error("tensor {path}: {what}")]
    BadTensor {
        /// Component path of the offending record.
        path: String,
        /// What is inconsistent.
        what: String,
    },
    /// Two records share one coordinate and level.
    #[error("duplicate record {coord} at {level}")]
    DuplicateRecord {
        /// The repeated coordinate, rendered.
        coord: String,
        level: Level,
    },
    /// The payload sink failed while bytes were streamed into it (the I/O
    /// error is the source, not repeated in the text).
    #[error("writing payload bytes")]
    Sink(#[from] std::io::Error),
}

/// A borrowed tensor: dtype, logical shape and little-endian bytes in
/// row-major order with no padding.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub dtype: DType,
    /// Logical shape (row-major); empty for a scalar.
    pub shape: &'a [u64],
    /// Little-endian element bytes.
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Number of elements implied by the shape, if it fits in a u64: the
    /// exact product of the dimensions, so a shape with a zero dimension has
    /// 0 elements whatever the other dimensions (docs/format.md §3.2).
    pub fn element_count(shape: &[u64]) -> Option<u64> {
        if shape.contains(&0) {
            return Some(0);
        }
        shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// Bytes implied by `shape` of `dtype` (elements × element size), if
    /// that fits in a u64. Readers and writers refuse every record, with or
    /// without a payload, whose byte length does not.
    pub fn byte_len(dtype: DType, shape: &[u64]) -> Option<u64> {
        TensorView::element_count(shape).and_then(|n| n.checked_mul(dtype.size() as u64))
    }

    /// Checks rank and that the byte length matches shape × element size.
    pub fn validate(&self, path: &str) -> Result<(), FingerprintError> {
        let bad = |what: String| FingerprintError::BadTensor {
            path: path.to_string(),
            what,
        };
        if self.shape.len() > MAX_RANK {
            return Err(bad(format!(
                "rank {} exceeds the maximum {MAX_RANK}",
                self.shape.len()
            )));
        }
        let want = TensorView::byte_len(self.dtype, self.shape)
            .ok_or_else(|| bad(format!("shape {:?} overflows", self.shape)))?;
        if want != self.bytes.len() as u64 {
            return Err(bad(format!(
                "shape {:?} of {} needs {want} bytes, got {}",
                self.shape,
                self.dtype,
                self.bytes.len()
            )));
        }
        Ok(())
    }
}

/// Alignment of the data bytes inside a record preimage.
pub const PREIMAGE_ALIGN: usize = 64;

/// The fixed part of a record preimage (everything before the data bytes),
/// including its zero padding to a multiple of [`PREIMAGE_ALIGN`].
pub fn record_prefix(coord: &Coord, level: Level, dtype: DType, shape: &[u64], byte_len: u64) -> Vec<u8> {
    // Typical prefixes pad to 128 bytes and the longest (path of 128 bytes,
    // rank 8) to 320: one allocation, with room for a small payload after it.
    let mut e = Encoder::with_capacity(320);
    e.str(DOMAIN_RECORD);
    coord.encode(&mut e);
    e.u32(level.code()).u32(dtype.code()).len(shape.len());
    for &d in shape {
        e.u64(d);
    }
    e.u64(byte_len);
    let mut v = e.into_bytes();
    v.resize(v.len().div_ceil(PREIMAGE_ALIGN) * PREIMAGE_ALIGN, 0);
    v
}

/// Streams `bytes` into `hasher` in canonical form, handing the same
/// canonical bytes to `sink`. `parallel` lets BLAKE3 use the rayon pool for
/// large inputs; the digest is identical either way. `already_hashed` is the
/// number of bytes fed to `hasher` before: pieces are cut at stream offsets
/// that are multiples of the piece size, which keeps BLAKE3 on its
/// whole-chunk SIMD path (a misaligned stream costs ~30% throughput).
pub fn feed_canonical<F>(
    hasher: &mut StreamHasher,
    already_hashed: u64,
    dtype: DType,
    bytes: &[u8],
    policy: CanonPolicy,
    parallel: bool,
    mut sink: F,
) -> Result<(), FingerprintError>
where
    F: FnMut(&[u8]) -> std::io::Result<()>,
{
    let chunk = if parallel && bytes.len() >= PARALLEL_HASH_THRESHOLD {
        PARALLEL_CHUNK
    } else {
        CHUNK
    };
    let mut scratch: Vec<u8> = Vec::new();
    // Cut the first piece so later pieces start near a multiple of `chunk` in
    // the hash stream, but never inside an element: canonicalization works
    // element by element. (Being a few bytes short of the boundary costs
    // BLAKE3 one single-chunk compression per piece, nothing more.)
    let elem = dtype.size();
    let head = (chunk - (already_hashed % chunk as u64) as usize) % chunk / elem * elem;
    let (first, rest) = bytes.split_at(head.min(bytes.len()));
    let pieces = std::iter::once(first)
        .filter(|f| !f.is_empty())
        .chain(rest.chunks(chunk));
    if !dtype.is_float() {
        for c in pieces {
            hasher.update_with(c, parallel);
            sink(c)?;
        }
        return Ok(());
    }
    for c in pieces {
        // Hash first (streaming the chunk from memory into cache), then scan
        // the now cache-resident chunk; in the rare case it is not canonical,
        // roll the hasher back and hash a canonicalized copy instead. This
        // keeps the scan nearly free next to the hash.
        let snapshot = hasher.clone();
        let canonical = if chunk == PARALLEL_CHUNK {
            // Large tensor on the rayon pool: hash and scan the piece at the
            // same time (the scan in cache-sized sub-pieces), so neither waits
            // for the other. Sub-pieces are multiples of every element size.
            let (_, canonical) = rayon::join(
                || hasher.update_with(c, true),
                || {
                    use rayon::prelude::*;
                    c.par_chunks(CHUNK)
                        .all(|x| surely_canonical(dtype, x, policy) || is_canonical(dtype, x, policy))
                },
            );
            canonical
        } else {
            hasher.update_with(c, parallel);
            surely_canonical(dtype, c, policy) || is_canonical(dtype, c, policy)
        };
        if canonical {
            sink(c)?;
        } else {
            *hasher = snapshot;
            scratch.clear();
            scratch.extend_from_slice(c);
            canonicalize_in_place(dtype, &mut scratch, policy);
            hasher.update_with(&scratch, parallel);
            sink(&scratch)?;
        }
    }
    Ok(())
}

/// Digest of one record, streaming its canonical bytes into `sink` as well
/// (pass `|_| Ok(())` to keep fingerprints only).
pub fn record_digest_with_sink<F>(
    alg: Algorithm,
    policy: CanonPolicy,
    coord: &Coord,
    level: Level,
    tensor: TensorView<'_>,
    parallel: bool,
    sink: F,
) -> Result<Digest, FingerprintError>
where
    F: FnMut(&[u8]) -> std::io::Result<()>,
{
    tensor.validate(&coord.path)?;
    let mut h = alg.hasher();
    let prefix = record_prefix(
        coord,
        level,
        tensor.dtype,
        tensor.shape,
        tensor.bytes.len() as u64,
    );
    h.update(&prefix);
    feed_canonical(
        &mut h,
        prefix.len() as u64,
        tensor.dtype,
        tensor.bytes,
        policy,
        parallel,
        sink,
    )?;
    Ok(h.finalize())
}

/// Largest data length [`record_digests_in_place`] hashes side by side with
/// other records; longer tensors are left to the streaming path, which
/// already hashes their chunks in parallel.
pub const BATCH_MAX_BYTES: usize = 16 * 1024;

/// One record of a batch: what [`record_digest`] takes.
#[derive(Debug, Clone, Copy)]
pub struct RecordRef<'a> {
    /// Tensor identity.
    pub coord: &'a Coord,
    pub level: Level,
    pub tensor: TensorView<'a>,
}

/// Digests of many records at once, for those whose bytes are already
/// canonical: element `i` is `Some(record_digest(..records[i]..))` when
/// record `i` is valid, its bytes are canonical as they are (so they can
/// be stored unchanged) and at most [`BATCH_MAX_BYTES`] long, the
/// algorithm is BLAKE3 and the CPU has a vector kernel for it (AVX2);
/// otherwise `None`, and the caller takes the
/// one-record path ([`record_digest_with_sink`]), which canonicalizes.
///
/// Why: a record of a few KiB is a few BLAKE3 chunks, hashed one block at
/// a time; here the chunks of up to eight records are compressed side by
/// side in SIMD lanes, the same digests several times faster (the
/// capture's writer thread hashes hundreds of such records per decode
/// step). Tests check every digest against [`record_digest`].
pub fn record_digests_in_place(
    alg: Algorithm,
    policy: CanonPolicy,
    records: &[RecordRef<'_>],
) -> Vec<Option<Digest>> {
    if alg != Algorithm::Blake3 || !crate::lanes::available() {
        return vec![None; records.len()];
    }
    let prefixes: Vec<Option<Vec<u8>>> = records
        .iter()
        .map(|r| {
            let t = r.tensor;
            let ok = t.bytes.len() <= BATCH_MAX_BYTES
                && t.validate(&r.coord.path).is_ok()
                && (surely_canonical(t.dtype, t.bytes, policy) || is_canonical(t.dtype, t.bytes, policy));
            ok.then(|| record_prefix(r.coord, r.level, t.dtype, t.shape, t.bytes.len() as u64))
                .filter(|p| crate::lanes::accepts(p.len()))
        })
        .collect();
    let messages: Vec<crate::lanes::Message<'_>> = records
        .iter()
        .zip(&prefixes)
        .filter_map(|(r, p)| {
            p.as_ref().map(|p| crate::lanes::Message {
                head: p,
                tail: r.tensor.bytes,
            })
        })
        .collect();
    let mut digests = crate::lanes::digests(&messages).unwrap_or_default().into_iter();
    prefixes
        .iter()
        .map(|p| p.as_ref().and_then(|_| digests.next()).map(Digest))
        .collect()
}

pub fn record_digest(
    alg: Algorithm,
    policy: CanonPolicy,
    coord: &Coord,
    level: Level,
    tensor: TensorView<'_>,
) -> Result<Digest, FingerprintError> {
    record_digest_with_sink(alg, policy, coord, level, tensor, true, |_| Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coord::Phase;

    fn coord(path: &str) -> Coord {
        Coord {
            step: 1,
            position: 4,
            phase: Phase::Decode,
            layer: Some(2),
            path: path.into(),
        }
    }

    /// A slow, obvious reference: canonicalize a copy, build the whole
    /// preimage in memory, hash once.
    fn reference(alg: Algorithm, p: CanonPolicy, c: &Coord, l: Level, t: TensorView<'_>) -> Digest {
        let mut data = t.bytes.to_vec();
        canonicalize_in_place(t.dtype, &mut data, p);
        let mut pre = record_prefix(c, l, t.dtype, t.shape, data.len() as u64);
        pre.extend_from_slice(&data);
        alg.hash(&pre)
    }

    #[test]
    fn batched_digests_equal_single_ones_and_leave_the_rest_to_them() {
        // Every dtype, lengths around block and chunk edges and the batch
        // limit, NaNs (not canonical as they are), -0 under both policies,
        // a shape that does not fit the bytes, and both algorithms.
        let mut owned = Vec::new();
        for (k, dtype) in DType::ALL.into_iter().enumerate() {
            let size = dtype.size();
            for n in [0usize, 1, 15, 16, 17, 255, 256, 257, 1000, 1024, 1040, 4096, 5000] {
                let bytes: Vec<u8> = (0..n * size).map(|i| (i * 31 + k * 7) as u8 & 0x3f).collect();
                if bytes.len() > BATCH_MAX_BYTES + 64 {
                    continue;
                }
                owned.push((dtype, vec![n as u64], bytes.clone(), format!("t.{k}.{n}")));
            }
            let mut nan = vec![0u8; 64 * size];
            nan[size * 3..size * 4].fill(0xff);
            owned.push((dtype, vec![64], nan, format!("nan.{k}")));
            let mut negzero = vec![0u8; 16 * size];
            negzero[size - 1] = 0x80;
            owned.push((dtype, vec![16], negzero, format!("neg.{k}")));
            owned.push((dtype, vec![3], vec![1u8; 2 * size], format!("bad.{k}")));
        }
        owned.push((
            DType::U8,
            vec![BATCH_MAX_BYTES as u64],
            vec![9; BATCH_MAX_BYTES],
            "edge".into(),
        ));
        owned.push((
            DType::U8,
            vec![BATCH_MAX_BYTES as u64 + 1],
            vec![9; BATCH_MAX_BYTES + 1],
            "over".into(),
        ));
        let coords: Vec<Coord> = owned.iter().map(|o| coord(&o.3)).collect();
        let refs: Vec<RecordRef<'_>> = owned
            .iter()
            .zip(&coords)
            .enumerate()
            .map(|(i, (o, c))| RecordRef {
                coord: c,
                level: if i % 2 == 0 { Level::L4 } else { Level::L3 },
                tensor: TensorView {
                    dtype: o.0,
                    shape: &o.1,
                    bytes: &o.2,
                },
            })
            .collect();
        for fold in [false, true] {
            let policy = CanonPolicy {
                fold_negative_zero: fold,
            };
            let got = record_digests_in_place(Algorithm::Blake3, policy, &refs);
            assert_eq!(got.len(), refs.len());
            let mut batched = 0;
            for (r, d) in refs.iter().zip(&got) {
                let t = r.tensor;
                let single = record_digest(Algorithm::Blake3, policy, r.coord, r.level, t).ok();
                let canonical = is_canonical(t.dtype, t.bytes, policy);
                let eligible = crate::lanes::available()
                    && single.is_some()
                    && canonical
                    && t.bytes.len() <= BATCH_MAX_BYTES;
                assert_eq!(d.is_some(), eligible, "{} (fold {fold})", r.coord.path);
                if let Some(d) = d {
                    assert_eq!(Some(*d), single, "{} (fold {fold})", r.coord.path);
                    batched += 1;
                }
            }
            assert!(
                batched > 80 || !crate::lanes::available(),
                "{batched} records batched"
            );
            let sha = record_digests_in_place(Algorithm::Sha256, policy, &refs);
            assert!(sha.iter().all(Option::is_none));
        }
    }

    #[test]
    fn streaming_equals_reference_across_chunk_boundaries() {
        // Sizes around the chunk size and the parallel threshold, with a
        // NaN placed in a later chunk so both the clean and rewrite paths run.
        for n in [
            0usize,
            1,
            CHUNK / 4 - 1,
            CHUNK / 4 + 1,
            PARALLEL_HASH_THRESHOLD / 4 + 3,
        ] {
            let mut vals: Vec<u32> = (0..n as u32)
                .map(|i| (i.wrapping_mul(2_654_435_761)) >> 2)
                .collect();
            if n > 10 {
                vals[n - 2] = 0xffc1_2345; // non-canonical NaN
                vals[n / 2] = 0x8000_0000; // -0
            }
            let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            let shape = [n as u64];
            let t = TensorView {
                dtype: DType::F32,
                shape: &shape,
                bytes: &bytes,
            };
            for alg in [Algorithm::Blake3, Algorithm::Sha256] {
                for p in [
                    CanonPolicy::default(),
                    CanonPolicy {
                        fold_negative_zero: true,
                    },
                ] {
                    let c = coord("layer.post_ffn_mhc");
                    let want = reference(alg, p, &c, Level::L3, t);
                    let mut sunk = Vec::new();
                    let got = record_digest_with_sink(alg, p, &c, Level::L3, t, true, |b| {
                        sunk.extend_from_slice(b);
                        Ok(())
                    })
                    .unwrap();
                    assert_eq!(got, want, "n={n} alg={alg}");
                    let serial =
                        record_digest_with_sink(alg, p, &c, Level::L3, t, false, |_| Ok(())).unwrap();
                    assert_eq!(serial, want, "n={n} alg={alg} single-threaded");
                    let mut canon = bytes.clone();
                    canonicalize_in_place(DType::F32, &mut canon, p);
                    assert_eq!(sunk, canon);
                }
            }
        }
    }

    #[test]
    fn pieces_never_split_elements_whatever_the_prefix_length() {
        // Path lengths 1..=9 give every prefix length modulo 8; the NaNs
        // land in later pieces, so a piece cut inside an element would
        // canonicalize the wrong bytes.
        let n = 3 * CHUNK / 8 + 3;
        let vals: Vec<u64> = (0..n as u64)
            .map(|i| {
                if i % 5000 == 17 {
                    0xfff8_0000_0000_0001
                } else {
                    i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 2
                }
            })
            .collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let shape = [n as u64];
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let len = bytes.len() / dtype.size() * dtype.size();
            let shape = [(len / dtype.size()) as u64];
            let t = TensorView {
                dtype,
                shape: &shape,
                bytes: &bytes[..len],
            };
            for plen in 1..=9 {
                let c = coord(&"p".repeat(plen));
                let want = reference(Algorithm::Blake3, CanonPolicy::default(), &c, Level::L4, t);
                for parallel in [false, true] {
                    let got = record_digest_with_sink(
                        Algorithm::Blake3,
                        CanonPolicy::default(),
                        &c,
                        Level::L4,
                        t,
                        parallel,
                        |_| Ok(()),
                    )
                    .unwrap();
                    assert_eq!(got, want, "{dtype} path length {plen} parallel {parallel}");
                }
            }
        }
        let _ = shape;
    }

    #[test]
    fn every_identity_field_changes_the_digest() {
        let bytes = [0u8; 8];
        let s2 = [2u64];
        let s11 = [2u64, 1];
        let t = TensorView {
            dtype: DType::F32,
            shape: &s2,
            bytes: &bytes,
        };
        let alg = Algorithm::Blake3;
        let p = CanonPolicy::default();
        let base = record_digest(alg, p, &coord("a"), Level::L3, t).unwrap();
        let mut others = vec![
            record_digest(alg, p, &coord("b"), Level::L3, t).unwrap(),
            record_digest(alg, p, &coord("a"), Level::L4, t).unwrap(),
            record_digest(
                alg,
                p,
                &coord("a"),
                Level::L3,
                TensorView {
                    dtype: DType::I32,
                    ..t
                },
            )
            .unwrap(),
            record_digest(alg, p, &coord("a"), Level::L3, TensorView { shape: &s11, ..t }).unwrap(),
        ];
        let mut c = coord("a");
        c.layer = None;
        others.push(record_digest(alg, p, &c, Level::L3, t).unwrap());
        let mut c = coord("a");
        c.position += 1;
        others.push(record_digest(alg, p, &c, Level::L3, t).unwrap());
        for o in others {
            assert_ne!(o, base);
        }
    }

    #[test]
    fn bad_shapes_are_rejected() {
        let bytes = [0u8; 6];
        let s = [2u64];
        let t = TensorView {
            dtype: DType::F32,
            shape: &s,
            bytes: &bytes,
        };
        assert!(record_digest(
            Algorithm::Blake3,
            CanonPolicy::default(),
            &coord("x"),
            Level::L0,
            t
        )
        .is_err());
        let big = [u64::MAX, 2];
        let t = TensorView {
            dtype: DType::F32,
            shape: &big,
            bytes: &bytes,
        };
        assert!(t.validate("x").is_err());
    }
}
