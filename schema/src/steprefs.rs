//! The step references a version 2 writer has written, kept for the root
//! block it writes last (docs/format.md §11.4). They are kept encoded, as
//! the root block holds them: in memory up to a bound, and beyond it in an
//! unnamed temporary file beside the output (the operating system removes
//! it when the writer ends, however it ends), so the writer's memory does
//! not grow with the number of steps.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use moeconf_fingerprint::wire::Encoder;

use crate::v2::StepRef;

/// References kept in memory before the rest go to the temporary file
/// (284 bytes each in version 3: 4,096 of them are 1.1 MiB).
pub(crate) const IN_MEMORY: usize = 4096;

/// The encoded references, in the order they were pushed.
pub(crate) struct StepRefLog {
    /// The first references (at most `limit`).
    memory: Vec<u8>,
    /// The later ones, once `memory` is full.
    spill: Option<BufWriter<File>>,
    /// Where the temporary file is created (the output's directory).
    dir: PathBuf,
    count: u64,
    limit: usize,
    /// Size of one encoded reference.
    ref_len: usize,
}

impl StepRefLog {
    /// An empty log of references of `ref_len` bytes that keeps `limit`
    /// of them in memory and spills the rest to a temporary file in `dir`.
    pub(crate) fn new(dir: &Path, limit: usize, ref_len: u64) -> StepRefLog {
        StepRefLog {
            memory: Vec::new(),
            spill: None,
            dir: dir.to_path_buf(),
            count: 0,
            limit,
            ref_len: ref_len as usize,
        }
    }

    /// References pushed so far.
    pub(crate) fn len(&self) -> u64 {
        self.count
    }

    pub(crate) fn push(&mut self, r: &StepRef) -> std::io::Result<()> {
        let mut e = Encoder::with_capacity(self.ref_len);
        r.encode(&mut e);
        if e.as_bytes().len() != self.ref_len {
            return Err(std::io::Error::other(
                "a step reference of another format version",
            ));
        }
        if self.count < self.limit as u64 {
            self.memory.extend_from_slice(e.as_bytes());
        } else {
            let spill = match &mut self.spill {
                Some(s) => s,
                None => self
                    .spill
                    .insert(BufWriter::new(tempfile::tempfile_in(&self.dir)?)),
            };
            spill.write_all(e.as_bytes())?;
        }
        self.count += 1;
        Ok(())
    }

    /// Calls `f` with the encoded references in order, in pieces that each
    /// hold whole references. `f`'s error stops the walk and is returned;
    /// reading the temporary file back fails with `io`'s conversion.
    pub(crate) fn for_each_piece<E>(
        &mut self,
        mut f: impl FnMut(&[u8]) -> Result<(), E>,
        io: impl Fn(std::io::Error) -> E,
    ) -> Result<(), E> {
        f(&self.memory)?;
        let Some(spill) = self.spill.take() else {
            return Ok(());
        };
        let mut file = spill.into_inner().map_err(|e| io(e.into_error()))?;
        file.seek(SeekFrom::Start(0)).map_err(&io)?;
        let per_piece = 2048usize;
        let mut buf = vec![0u8; per_piece * self.ref_len];
        let mut left = self.count.saturating_sub(self.limit as u64);
        while left > 0 {
            let n = left.min(per_piece as u64) as usize;
            let piece = &mut buf[..n * self.ref_len];
            file.read_exact(piece).map_err(&io)?;
            f(piece)?;
            left -= n as u64;
        }
        Ok(())
    }
}
