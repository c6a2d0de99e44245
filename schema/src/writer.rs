//! Streaming, atomic trace writer.
//!
//! Records are appended as the runtime produces them: each tensor is
//! canonicalized and hashed in one pass and, when its payload is kept, the
//! same canonical bytes go to the file. Nothing is visible at the final path
//! until [`TraceWriter::finish`] has written index and trailer, flushed and
//! synced: the file is written under a temporary name in the same directory
//! and renamed into place, so a crash never leaves a half-written trace.

use crate::binding::Binding;
use crate::error::TraceError;
use crate::layout::{
    align_up, checksum, fingerprint_tree, Header, IndexEntry, PayloadRef, Preamble, Trailer, PAYLOAD_ALIGN,
    PREAMBLE_LEN,
};
use moeconf_fingerprint::wire::Encoder;
use moeconf_fingerprint::{record_digest_with_sink, Algorithm, Coord, Digest, Interner, Level, TensorView};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

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
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    alg: Algorithm,
    header: Header,
    preamble_and_header: Vec<u8>,
    pos: u64,
    entries: Vec<IndexEntry>,
    /// One shared path and shape per distinct value among `entries`.
    interner: Interner,
    parallel: bool,
}

fn tmp_path_for(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "trace".into());
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

impl TraceWriter {
    /// Starts a trace at `path` (written to a temporary sibling until finished).
    pub fn create(path: &Path, alg: Algorithm, header: Header) -> Result<TraceWriter, TraceError> {
        let tmp = tmp_path_for(path);
        let file =
            File::create(&tmp).map_err(|e| TraceError::io(&tmp, "creating temporary trace file", e))?;
        let mut w = TraceWriter {
            path: path.to_path_buf(),
            tmp,
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            alg,
            preamble_and_header: Vec::new(),
            header,
            pos: 0,
            entries: Vec::new(),
            interner: Interner::new(),
            parallel: true,
        };
        let header_bytes = w.header.to_bytes();
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

    fn write_all(&mut self, bytes: &[u8]) -> Result<(), TraceError> {
        let Some(out) = self.out.as_mut() else {
            return Err(TraceError::invalid(&self.path, "trace writer already finished"));
        };
        out.write_all(bytes)
            .map_err(|e| TraceError::io(&self.tmp, "writing trace", e))?;
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
    /// Returns the record digest.
    pub fn append(
        &mut self,
        coord: Coord,
        level: Level,
        tensor: TensorView<'_>,
        keep_payload: bool,
    ) -> Result<Digest, TraceError> {
        Coord::validate_path(&coord.path).map_err(|m| TraceError::invalid(&self.path, m))?;
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
            let path = self.path.clone();
            let tmp = self.tmp.clone();
            let out = self
                .out
                .as_mut()
                .ok_or_else(|| TraceError::invalid(&path, "trace writer already finished"))?;
            let d =
                record_digest_with_sink(alg, canon, &coord, level, tensor, parallel, |b| out.write_all(b))
                    .map_err(|e| match e {
                        moeconf_fingerprint::FingerprintError::Sink(io) => {
                            TraceError::io(&tmp, "writing trace payload", io)
                        }
                        other => TraceError::invalid(&path, other.to_string()),
                    })?;
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
        let out = self
            .out
            .take()
            .ok_or_else(|| TraceError::invalid(&self.path, "trace writer already finished"))?;
        let file = out
            .into_inner()
            .map_err(|e| TraceError::io(&self.tmp, "flushing trace", e.into_error()))?;
        file.sync_all()
            .map_err(|e| TraceError::io(&self.tmp, "syncing trace", e))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path)
            .map_err(|e| TraceError::io(&self.path, "renaming temporary trace into place", e))?;
        Ok(WriteSummary {
            root: tree.root,
            records: self.entries.len() as u64,
            payloads: self.entries.iter().filter(|e| e.payload.is_some()).count() as u64,
            bytes: self.pos,
        })
    }
}

impl Drop for TraceWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            // Not finished: remove the partial temporary file.
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}
