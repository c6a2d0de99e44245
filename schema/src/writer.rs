//! Streaming, atomic trace writer that writes only what its reader accepts.
//!
//! Records are appended as the runtime produces them: each tensor is
//! canonicalized and hashed in one pass and, when its payload is kept, the
//! same canonical bytes go to the file. Nothing is visible at the final path
//! until [`TraceWriter::finish`] has written index and trailer, flushed and
//! synced: the file is written under a temporary name in the same directory
//! (`.NAME.moeconf-tmp.PID.RAND`, see [`crate::output`]) and renamed into
//! place, so a crash never leaves a half-written trace, and every error
//! (including a failed flush, sync or rename in `finish`) removes the
//! temporary file.
//!
//! The writer enforces every check of the reader at write time: the header
//! must decode with the reader's decoder ([`Header::to_checked_bytes`]),
//! every record must pass [`check_record`] (byte length within a u64, step
//! and phase consistent with each other and with `max_new_tokens`), paths
//! and shapes must be valid, and no coordinate may repeat. Whatever
//! `finish` accepts, [`crate::Trace::open_verified`] accepts.

use crate::binding::Binding;
use crate::error::TraceError;
use crate::layout::{
    align_up, check_record, checksum, fingerprint_tree, Header, IndexEntry, PayloadRef, Preamble, Trailer,
    PAYLOAD_ALIGN, PREAMBLE_LEN,
};
use crate::output::{check_output, AtomicFile, CheckedOutput, Inputs};
use moeconf_fingerprint::wire::Encoder;
use moeconf_fingerprint::{record_digest_with_sink, Algorithm, Coord, Digest, Interner, Level, TensorView};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Write buffer of a trace file.
const BUFFER: usize = 1 << 20;

/// What [`TraceWriter::finish`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteSummary {
    /// Root digest of the written trace.
    pub root: Digest,
    /// Number of records.
    pub records: u64,
    /// Records that kept payloads.
    pub payloads: u64,
    /// Final file size in bytes.
    pub bytes: u64,
}

/// Appends records to a new trace file.
pub struct TraceWriter {
    path: PathBuf,
    /// The temporary file; `None` once finished or after a failed write
    /// (the temporary file is then already removed).
    out: Option<AtomicFile>,
    alg: Algorithm,
    header: Header,
    preamble_and_header: Vec<u8>,
    pos: u64,
    entries: Vec<IndexEntry>,
    /// One shared path and shape per distinct value among `entries`.
    interner: Interner,
    parallel: bool,
}

impl TraceWriter {
    /// Starts a trace at `path` (written to a temporary sibling until
    /// finished). The path is checked as an output with no known inputs
    /// ([`check_output`]); commands that read files use
    /// [`TraceWriter::create_checked`] with their inputs. A header that a
    /// reader would refuse is an error before any file is created.
    pub fn create(path: &Path, alg: Algorithm, header: Header) -> Result<TraceWriter, TraceError> {
        let out = check_output(path, &Inputs::new())?;
        TraceWriter::create_checked(&out, alg, header)
    }

    /// Starts a trace at an output already checked against the command's inputs.
    pub fn create_checked(
        out: &CheckedOutput,
        alg: Algorithm,
        header: Header,
    ) -> Result<TraceWriter, TraceError> {
        let path = out.path();
        let header_bytes = header
            .to_checked_bytes()
            .map_err(|m| TraceError::invalid(path, m))?;
        let file = AtomicFile::with_buffer(out, BUFFER)?;
        let mut w = TraceWriter {
            path: path.to_path_buf(),
            out: Some(file),
            alg,
            preamble_and_header: Vec::new(),
            header,
            pos: 0,
            entries: Vec::new(),
            interner: Interner::new(),
            parallel: true,
        };
        let pre = Preamble {
            algorithm: alg,
            header_len: header_bytes.len() as u64,
        };
        let mut ph = pre.to_bytes().to_vec();
        ph.extend_from_slice(&header_bytes);
        w.write_all(&ph.clone())?;
        w.preamble_and_header = ph;
        debug_assert_eq!(w.pos, PREAMBLE_LEN + header_bytes.len() as u64);
        w.pad_to_alignment()?;
        Ok(w)
    }

    /// Whether large tensors may be hashed on the rayon pool (default on;
    /// digests are identical either way).
    pub fn set_parallel_hashing(&mut self, on: bool) {
        self.parallel = on;
    }

    /// The binding this trace is being written under.
    pub fn binding(&self) -> &Binding {
        &self.header.binding
    }

    /// The digest algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.alg
    }

    /// Records appended so far.
    pub fn record_count(&self) -> usize {
        self.entries.len()
    }

    /// The open temporary file, or the error of a writer that finished or failed.
    fn file(&mut self) -> Result<&mut AtomicFile, TraceError> {
        let path = &self.path;
        self.out
            .as_mut()
            .ok_or_else(|| TraceError::invalid(path, "trace writer already finished or failed"))
    }

    /// A failed write leaves the file unusable: drop it (removing the
    /// temporary file) so that nothing more is written.
    fn failed(&mut self, what: &'static str, e: std::io::Error) -> TraceError {
        self.out = None;
        TraceError::io(&self.path, what, e)
    }

    fn write_all(&mut self, bytes: &[u8]) -> Result<(), TraceError> {
        if let Err(e) = self.file()?.write_all(bytes) {
            return Err(self.failed("writing trace", e));
        }
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn pad_to_alignment(&mut self) -> Result<(), TraceError> {
        let target = align_up(self.pos).ok_or_else(|| TraceError::invalid(&self.path, "trace too large"))?;
        let zeros = [0u8; PAYLOAD_ALIGN as usize];
        let n = (target - self.pos) as usize;
        self.write_all(&zeros[..n])
    }

    /// Appends one record; keeps its canonical bytes when `keep_payload`.
    /// Returns the record digest. A record its reader would refuse (invalid
    /// path, shape that does not fit the bytes or a u64, step and phase
    /// inconsistent with each other or with the binding's `max_new_tokens`)
    /// is an error and leaves the writer as it was.
    pub fn append(
        &mut self,
        coord: Coord,
        level: Level,
        tensor: TensorView<'_>,
        keep_payload: bool,
    ) -> Result<Digest, TraceError> {
        Coord::validate_path(&coord.path).map_err(|m| TraceError::invalid(&self.path, m))?;
        check_record(&self.header.binding, &coord, tensor.dtype, tensor.shape)
            .map_err(|m| TraceError::invalid(&self.path, format!("record {coord}: {m}")))?;
        tensor
            .validate(&coord.path)
            .map_err(|e| TraceError::invalid(&self.path, e.to_string()))?;
        let canon = self.header.binding.canon;
        let (alg, parallel) = (self.alg, self.parallel);
        let payload = if keep_payload {
            Some(PayloadRef {
                offset: self.pos,
                len: tensor.bytes.len() as u64,
            })
        } else {
            None
        };
        let digest = if keep_payload {
            let out = self.file()?;
            let d =
                record_digest_with_sink(alg, canon, &coord, level, tensor, parallel, |b| out.write_all(b));
            let d = match d {
                Ok(d) => d,
                Err(moeconf_fingerprint::FingerprintError::Sink(io)) => {
                    return Err(self.failed("writing trace payload", io))
                }
                Err(other) => return Err(self.failed("writing trace payload", std::io::Error::other(other))),
            };
            self.pos += tensor.bytes.len() as u64;
            self.pad_to_alignment()?;
            d
        } else {
            record_digest_with_sink(alg, canon, &coord, level, tensor, parallel, |_| Ok(()))
                .map_err(|e| TraceError::invalid(&self.path, e.to_string()))?
        };
        let coord = Coord {
            path: self.interner.path(&coord.path),
            ..coord
        };
        self.entries.push(IndexEntry {
            coord,
            level,
            dtype: tensor.dtype,
            shape: self.interner.shape(tensor.shape),
            digest,
            payload,
        });
        Ok(digest)
    }

    /// Writes index and trailer, syncs, and renames the file into place.
    pub fn finish(mut self) -> Result<WriteSummary, TraceError> {
        let (_, tree) = fingerprint_tree(self.alg, &self.header.binding, &self.entries)
            .map_err(|e| TraceError::invalid(&self.path, e.to_string()))?;
        let mut e = Encoder::new();
        e.len(self.entries.len());
        for entry in &self.entries {
            entry.encode(&mut e);
        }
        let index = e.into_bytes();
        let index_offset = self.pos;
        let mut trailer = Trailer {
            index_offset,
            index_len: index.len() as u64,
            record_count: self.entries.len() as u64,
            root: tree.root,
            checksum: Digest::ZERO,
        };
        trailer.checksum = checksum(
            self.alg,
            &self.preamble_and_header,
            &index,
            &trailer.covered_bytes(),
        );
        self.write_all(&index)?;
        self.write_all(&trailer.to_bytes())?;
        // On any failure of the flush, sync, re-check or rename the
        // temporary file is removed (AtomicFile::commit).
        let file = self
            .out
            .take()
            .ok_or_else(|| TraceError::invalid(&self.path, "trace writer already finished or failed"))?;
        file.commit()?;
        Ok(WriteSummary {
            root: tree.root,
            records: self.entries.len() as u64,
            payloads: self.entries.iter().filter(|e| e.payload.is_some()).count() as u64,
            bytes: self.pos,
        })
    }
}
