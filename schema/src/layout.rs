//! Byte layout of the trace container: preamble, header, payload section,
//! index and trailer (docs/format.md is the normative description).

use crate::binding::{Binding, Provenance};
use moeconf_fingerprint::wire::{Decoder, Encoder, WireError};
use moeconf_fingerprint::{
    binding_digest, Algorithm, Coord, DType, Digest, FingerprintError, HashTree, Interner, Leaf, Level,
    Phase, TensorView, MAX_RANK,
};
use std::sync::Arc;

/// File magic: `MOECONF` followed by a NUL byte.
pub const MAGIC: [u8; 8] = *b"MOECONF\0";
/// Trailer magic: `MOECEND` followed by a NUL byte.
pub const END_MAGIC: [u8; 8] = *b"MOECEND\0";
/// The newest container format version this build reads and writes (and
/// the version its writers write by default); version 1 stays readable and
/// writable ([`crate::TraceWriter::create_version`]).
pub const FORMAT_VERSION: u32 = 4;
/// The first container format version (a flat index, docs/format.md §5).
pub const FORMAT_V1: u32 = 1;
/// Size of the fixed preamble.
pub const PREAMBLE_LEN: u64 = 32;
/// Size of the fixed trailer.
pub const TRAILER_LEN: u64 = 104;
/// Alignment of the payload section and of every payload.
pub const PAYLOAD_ALIGN: u64 = 64;
/// Largest header accepted.
pub const MAX_HEADER_LEN: u64 = 256 << 20;
/// Domain tag of the header-and-index checksum.
pub const DOMAIN_CHECKSUM: &str = "moeconf.checksum.v1";
/// Smallest possible encoded index entry, used to bound record counts.
pub const MIN_ENTRY_LEN: u64 = 4 + 4 + 4 + 1 + 8 + 1 + 4 + 4 + 8 + 32 + 1;

/// Rounds `x` up to a multiple of `PAYLOAD_ALIGN`.
pub fn align_up(x: u64) -> Option<u64> {
    x.checked_add(PAYLOAD_ALIGN - 1)
        .map(|v| v / PAYLOAD_ALIGN * PAYLOAD_ALIGN)
}

/// The 32-byte preamble.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preamble {
    pub algorithm: Algorithm,
    /// Length of the encoded header that follows.
    pub header_len: u64,
}

impl Preamble {
    /// The 32 bytes of the newest version ([`FORMAT_VERSION`]).
    pub fn to_bytes(&self) -> [u8; 32] {
        self.to_bytes_version(FORMAT_VERSION)
    }

    /// The 32 bytes: magic, version u32, flags u32 (0), algorithm u32,
    /// reserved u32 (0), header length u64.
    pub fn to_bytes_version(&self, version: u32) -> [u8; 32] {
        let mut e = Encoder::new();
        e.raw(&MAGIC)
            .u32(version)
            .u32(0)
            .u32(self.algorithm.code())
            .u32(0)
            .u64(self.header_len);
        let mut out = [0u8; 32];
        out.copy_from_slice(e.as_bytes());
        out
    }
}

/// Header: the binding then the provenance.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Header {
    /// Hashed binding.
    pub binding: Binding,
    /// Unhashed provenance.
    pub provenance: Provenance,
}

impl Header {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut e = Encoder::new();
        self.binding.encode(&mut e);
        self.provenance.encode(&mut e);
        e.into_bytes()
    }

    /// The wire encoding, after checking that a reader accepts it: the
    /// header fits in [`MAX_HEADER_LEN`] and decodes with the reader's own
    /// decoder (every cap of docs/format.md §7: string lengths, the
    /// decoding strategy's and tensor dtypes' 64 bytes, tensor, prompt-id,
    /// extra and note counts, ranks, capture bits). Also the writer rule of
    /// §5.2 that the Python writer enforces too: tensors sorted by name and
    /// extras by key (bytewise; readers do not check it). The error names
    /// the field and the limit.
    pub fn to_checked_bytes(&self) -> Result<Vec<u8>, String> {
        let b = &self.binding;
        if !b.model.tensors.windows(2).all(|w| w[0].name <= w[1].name) {
            return Err("the binding's tensors must be sorted by name".into());
        }
        if !b.extra.windows(2).all(|w| w[0].0 <= w[1].0) {
            return Err("the binding's extra must be sorted by key".into());
        }
        let bytes = self.to_bytes();
        if bytes.len() as u64 > MAX_HEADER_LEN {
            return Err(format!(
                "the header is {} bytes, more than the {MAX_HEADER_LEN} a reader accepts",
                bytes.len()
            ));
        }
        Header::decode(&bytes, PREAMBLE_LEN)
            .map_err(|e| format!("header field refused by the reader: {}", e.what))?;
        Ok(bytes)
    }

    /// Decodes a header, rejecting trailing bytes.
    pub fn decode(bytes: &[u8], base: u64) -> Result<Header, WireError> {
        Header::decode_split(bytes, base).map(|(h, _)| h)
    }

    /// Decodes a header and also returns the length of its encoded binding
    /// (the first bytes of `bytes`). The encoding is canonical (fixed-width
    /// integers, strict bool and option tags, exact lengths), so those bytes
    /// are exactly what [`Binding::to_bytes`] of the decoded binding gives.
    pub fn decode_split(bytes: &[u8], base: u64) -> Result<(Header, usize), WireError> {
        let mut d = Decoder::new(bytes, base);
        let binding = Binding::decode(&mut d)?;
        let binding_len = (d.offset() - base) as usize;
        let provenance = Provenance::decode(&mut d)?;
        d.finish("header")?;
        Ok((Header { binding, provenance }, binding_len))
    }
}

/// Location of a payload inside the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadRef {
    /// Absolute offset (a multiple of 64).
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One record of the index.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexEntry {
    pub coord: Coord,
    pub level: Level,
    pub dtype: DType,
    /// Its logical shape (shared between records of the same shape, see
    /// [`Interner`]).
    pub shape: Arc<[u64]>,
    pub digest: Digest,
    /// Its canonical bytes, when kept.
    pub payload: Option<PayloadRef>,
}

impl IndexEntry {
    /// Appends the wire encoding.
    pub fn encode(&self, e: &mut Encoder) {
        self.coord.encode(e);
        e.u32(self.level.code());
        self.encode_value_fields(e);
    }

    /// Appends dtype, shape, digest and payload reference: the tail every
    /// index encoding shares (version 1's index, version 2's group blocks).
    pub(crate) fn encode_value_fields(&self, e: &mut Encoder) {
        e.u32(self.dtype.code()).len(self.shape.len());
        for &s in self.shape.iter() {
            e.u64(s);
        }
        e.raw(&self.digest.0);
        match self.payload {
            None => {
                e.u8(0);
            }
            Some(p) => {
                e.u8(1).u64(p.offset).u64(p.len);
            }
        }
    }

    /// Decodes and validates one entry (codes, rank, byte length vs shape).
    pub fn decode(d: &mut Decoder<'_>) -> Result<IndexEntry, WireError> {
        IndexEntry::decode_interned(d, &mut Interner::new())
    }

    /// [`IndexEntry::decode`], sharing the path and shape with earlier
    /// entries through `interner` (an index of a million records then holds
    /// one allocation per distinct path and shape, not two per record).
    pub fn decode_interned(d: &mut Decoder<'_>, interner: &mut Interner) -> Result<IndexEntry, WireError> {
        let coord = Coord::decode_interned(d, interner)?;
        let at = d.offset();
        let lc = d.u32("record level")?;
        let level = Level::from_code(lc).ok_or_else(|| d.error_at(at, format!("unknown level code {lc}")))?;
        let at = d.offset();
        let dc = d.u32("record dtype")?;
        let dtype = DType::from_code(dc).ok_or_else(|| d.error_at(at, format!("unknown dtype code {dc}")))?;
        let rank = d.len("record shape", 8, MAX_RANK as u64)?;
        let mut dims = [0u64; MAX_RANK];
        for dim in dims.iter_mut().take(rank) {
            *dim = d.u64("record dimension")?;
        }
        let shape = interner.shape(&dims[..rank]);
        let digest = Digest(d.array32("record digest")?);
        let at = d.offset();
        let payload = if d.option_tag("record payload")? {
            let offset = d.u64("payload offset")?;
            let len = d.u64("payload length")?;
            let want = TensorView::byte_len(dtype, &shape);
            if want != Some(len) {
                return Err(d.error_at(
                    at,
                    format!("record {coord}: payload length {len} does not match shape {shape:?} of {dtype}"),
                ));
            }
            Some(PayloadRef { offset, len })
        } else {
            None
        };
        Ok(IndexEntry {
            coord,
            level,
            dtype,
            shape,
            digest,
            payload,
        })
    }
}

/// Checks what a reader checks of one record beyond its wire encoding
/// (docs/format.md §3): its byte length (product of the shape times the
/// element size) fits in a u64, with or without a payload, and its step and
/// phase agree with each other and with the binding ([`check_step`]).
/// Writers call it before they append a record, readers for every record of
/// the index.
pub fn check_record(binding: &Binding, coord: &Coord, dtype: DType, shape: &[u64]) -> Result<(), String> {
    if TensorView::byte_len(dtype, shape).is_none() {
        return Err(format!("shape {shape:?} of {dtype} is more than 2^64 - 1 bytes"));
    }
    check_step(binding.decoding.max_new_tokens, coord)
}

/// Step and phase consistency (docs/format.md §3.1): step 0 is the prefill
/// forward and every later step a decode forward; a run of
/// `max_new_tokens` = N has steps 0..N-1, so no record has step ≥ N.
pub fn check_step(max_new_tokens: u32, coord: &Coord) -> Result<(), String> {
    check_step_phase(max_new_tokens, coord.step, coord.phase)
}

/// [`check_step`] of a step and phase (what a version 2 root block's step
/// list is checked with, before any record of the step is read).
pub fn check_step_phase(max_new_tokens: u32, step: u32, phase: Phase) -> Result<(), String> {
    match (step, phase) {
        (0, Phase::Decode) => Err("step 0 is the prefill forward, but the record's phase is decode".into()),
        (s, Phase::Prefill) if s > 0 => Err(format!(
            "step {s} is a decode forward, but the record's phase is prefill (only step 0 is)"
        )),
        (s, _) if s >= max_new_tokens => Err(match max_new_tokens {
            0 => format!("step {s} is beyond the run: the binding's max_new_tokens = 0 allows no step"),
            n => format!(
                "step {s} is beyond the run: the binding's max_new_tokens = {n} allows steps 0..{}",
                n - 1
            ),
        }),
        _ => Ok(()),
    }
}

/// The 104-byte trailer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    /// Absolute offset of the index.
    pub index_offset: u64,
    /// Length of the encoded index.
    pub index_len: u64,
    pub record_count: u64,
    /// Root of the hash tree.
    pub root: Digest,
    /// Checksum of preamble, header, index and the trailer's first 64 bytes.
    pub checksum: Digest,
}

impl Trailer {
    /// The first 64 bytes (everything the checksum covers).
    pub fn covered_bytes(&self) -> [u8; 64] {
        let mut e = Encoder::new();
        e.raw(&END_MAGIC)
            .u64(self.index_offset)
            .u64(self.index_len)
            .u64(self.record_count)
            .raw(&self.root.0);
        let mut out = [0u8; 64];
        out.copy_from_slice(e.as_bytes());
        out
    }

    /// All 104 bytes: covered part, checksum, end magic again.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = self.covered_bytes().to_vec();
        v.extend_from_slice(&self.checksum.0);
        v.extend_from_slice(&END_MAGIC);
        v
    }
}

/// The checksum over preamble + header, index and trailer's covered bytes.
pub fn checksum(
    alg: Algorithm,
    preamble_and_header: &[u8],
    index: &[u8],
    trailer_covered: &[u8; 64],
) -> Digest {
    let mut h = alg.hasher();
    let mut e = Encoder::new();
    e.str(DOMAIN_CHECKSUM);
    h.update(e.as_bytes());
    h.update(preamble_and_header);
    h.update(index);
    h.update(trailer_covered);
    h.finalize()
}

/// The fingerprint tree of a trace: the digest of `binding` and the
/// [`HashTree`] over the record digests of `entries`. The one tree builder
/// of the container: the writer stores its root in the trailer, the reader
/// rebuilds it to check that root.
pub fn fingerprint_tree(
    alg: Algorithm,
    binding: &Binding,
    entries: &[IndexEntry],
) -> Result<(Digest, HashTree), FingerprintError> {
    fingerprint_tree_encoded(alg, &binding.to_bytes(), entries)
}

/// [`fingerprint_tree`] of an already encoded binding (the reader hashes
/// the binding bytes of the file instead of re-encoding what it decoded,
/// which for a model listing 2^20 tensors would double the header in
/// memory). The leaves are read from `entries` in place.
pub fn fingerprint_tree_encoded(
    alg: Algorithm,
    encoded_binding: &[u8],
    entries: &[IndexEntry],
) -> Result<(Digest, HashTree), FingerprintError> {
    let bd = binding_digest(alg, encoded_binding);
    let tree = HashTree::build_with(alg, bd, entries.len(), |i| {
        let e = &entries[i];
        Leaf {
            coord: &e.coord,
            level: e.level,
            digest: e.digest,
        }
    })?;
    Ok((bd, tree))
}

/// Returns a copy of `bytes` whose trailer checksum is recomputed over the
/// (possibly corrupted) preamble, header, index and trailer fields, or `None`
/// when the offsets needed are out of range. Only for fuzzing: it lets
/// mutated headers and indexes reach the decoders.
#[doc(hidden)]
pub fn with_recomputed_checksum(bytes: &[u8]) -> Option<Vec<u8>> {
    let len = bytes.len() as u64;
    if len < PREAMBLE_LEN + TRAILER_LEN {
        return None;
    }
    let word = |at: usize| -> Option<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(bytes.get(at..at + 8)?);
        Some(u64::from_le_bytes(a))
    };
    let code = u32::from_le_bytes(bytes.get(16..20)?.try_into().ok()?);
    let alg = Algorithm::from_code(code)?;
    let header_end = PREAMBLE_LEN.checked_add(word(24)?)?;
    if crate::v2::is_block_format(u32::from_le_bytes(bytes.get(8..12)?.try_into().ok()?)) {
        let tlen = crate::v2::TRAILER_V2_LEN;
        if len < PREAMBLE_LEN + tlen || header_end > len - tlen {
            return None;
        }
        let t0 = (len - tlen) as usize;
        let mut covered = [0u8; 96];
        covered.copy_from_slice(bytes.get(t0..t0 + 96)?);
        let sum = crate::v2::checksum_v2(alg, bytes.get(..header_end as usize)?, &covered);
        let mut out = bytes.to_vec();
        out[t0 + 96..t0 + 128].copy_from_slice(&sum.0);
        return Some(out);
    }
    let t0 = (len - TRAILER_LEN) as usize;
    let index_offset = word(t0 + 8)?;
    let index_len = word(t0 + 16)?;
    if header_end > len || index_offset.checked_add(index_len)? > len - TRAILER_LEN {
        return None;
    }
    let mut covered = [0u8; 64];
    covered.copy_from_slice(bytes.get(t0..t0 + 64)?);
    let sum = checksum(
        alg,
        bytes.get(..header_end as usize)?,
        bytes.get(index_offset as usize..(index_offset + index_len) as usize)?,
        &covered,
    );
    let mut out = bytes.to_vec();
    out[t0 + 64..t0 + 96].copy_from_slice(&sum.0);
    Some(out)
}
