//! Partial result files: what one shard of a sweep-like command computed,
//! self-described and integrity-checked (byte layout in docs/scale.md
//! "Partial result files").
//!
//! ```text
//! "MOECONF-PARTIAL\n"     16 bytes, magic
//! manifest length        u64, little-endian
//! manifest               UTF-8 JSON (Manifest): the run, the shard, every job result, the attached files
//! attached files         their bytes, concatenated in manifest order
//! trailer                32 bytes: BLAKE3 of every byte before it
//! ```
//!
//! The manifest's [`RunIdentity`] says which run the shard belongs to: the
//! command, every argument that shapes an output, digests of the inputs
//! (model configuration and weights, tokenizer), the moeconf version and
//! the run's job list; `run_digest` is the BLAKE3 of its JSON. Opening a
//! partial ([`Partial::open`]) verifies the trailer over the whole file, the
//! run digest, and that the results are exactly the jobs the shard owns;
//! each attached file is verified again against its own digest while it is
//! copied out ([`Partial::copy_file`]).

use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use moeconf_output::input::open_input;
use moeconf_output::AtomicFile;
use moeconf_output::CheckedOutput;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, ShardError};
use crate::spec::Shard;

/// The first 16 bytes of every partial result file.
pub const MAGIC: &[u8; 16] = b"MOECONF-PARTIAL\n";

/// The manifest's `kind`.
pub const KIND: &str = "moeconf.partial";

/// The version of the layout and manifest this moeconf writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The longest manifest read (the job results of a paper-scale run are a few MiB).
pub const MAX_MANIFEST: u64 = 1 << 30;

const HEADER: u64 = MAGIC.len() as u64 + 8;
const TRAILER: u64 = 32;
const BUFFER: usize = 1 << 20;

/// One protocol's (or one command's) jobs in the run's job list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobGroup {
    /// The group's name (a protocol key, or `branches`).
    pub name: String,
    pub jobs: usize,
}

/// Which run a partial belongs to. Shards of one run have equal identities.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunIdentity {
    /// The moeconf version that computed it.
    pub moeconf_version: String,
    /// The command (`sweep`, `calibrate`).
    pub command: String,
    /// Every argument that shapes an output, and values derived from them.
    pub arguments: Value,
    /// Digests of what the run read (model, tokenizer).
    pub inputs: Value,
    /// The run's independent jobs, in order; job `j` of the concatenation
    /// belongs to shard `j mod n`.
    pub jobs: Vec<JobGroup>,
}

impl RunIdentity {
    /// The number of jobs of the run (saturating: a forged job list cannot
    /// overflow; no shard's results then match it).
    pub fn total_jobs(&self) -> usize {
        self.jobs.iter().fold(0usize, |a, g| a.saturating_add(g.jobs))
    }

    /// The job indices of group `name` in the run's job list.
    pub fn group_range(&self, name: &str) -> Option<Range<usize>> {
        let mut start = 0;
        for g in &self.jobs {
            if g.name == name {
                return Some(start..start.saturating_add(g.jobs));
            }
            start = start.saturating_add(g.jobs);
        }
        None
    }

    /// BLAKE3 (hex) of the identity's JSON: the run digest.
    pub fn digest(&self) -> String {
        let bytes = serde_json::to_vec(self).unwrap_or_default();
        blake3::hash(&bytes).to_hex().to_string()
    }
}

/// The shard a partial holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardRef {
    /// 0-based index.
    pub index: u32,
    /// Shard count of the run.
    pub count: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobResult {
    /// The job's index in the run's job list.
    pub job: usize,
    /// What the job computed (the command's own JSON form).
    pub result: Value,
}

/// A file attached to a partial: an output the unsharded command writes
/// (e.g. a trace of the fault matrix), produced by one job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Its path relative to the command's output directory (`traces/x.bin`).
    pub name: String,
    /// The job that produced it.
    pub job: usize,
    /// Its length.
    pub bytes: u64,
    /// BLAKE3 (hex) of its bytes.
    pub blake3: String,
}

/// The JSON manifest at the start of a partial result file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`KIND`].
    pub kind: String,
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    pub run: RunIdentity,
    /// [`RunIdentity::digest`] of `run`.
    pub run_digest: String,
    /// Which shard of how many.
    pub shard: ShardRef,
    /// The results of every job the shard owns, ascending by job.
    pub results: Vec<JobResult>,
    /// Attached files, in the order of their bytes.
    pub files: Vec<FileEntry>,
}

/// A file to attach when writing a partial.
#[derive(Debug, Clone)]
pub struct Attachment {
    /// Its path relative to the output directory.
    pub name: String,
    /// The job that produced it.
    pub job: usize,
    /// Where its bytes are now.
    pub source: PathBuf,
}

/// Whether `name` may name an attached file: relative, `/`-separated
/// segments of `[A-Za-z0-9._-]` that do not start with a dot, at most 4
/// segments and 255 bytes.
pub fn valid_file_name(name: &str) -> bool {
    let segs: Vec<&str> = name.split('/').collect();
    !name.is_empty()
        && name.len() <= 255
        && segs.len() <= 4
        && segs.iter().all(|s| {
            !s.is_empty()
                && !s.starts_with('.')
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        })
}

/// A writer that hashes what goes through it.
struct Hashing<W: Write> {
    inner: W,
    hasher: blake3::Hasher,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// BLAKE3 and length of a file's bytes.
fn hash_file(path: &Path) -> Result<(u64, blake3::Hash)> {
    let f = open_input(path, "attached file").map_err(ShardError::input("opening an attached file"))?;
    let mut r = BufReader::with_capacity(BUFFER, f);
    let mut h = blake3::Hasher::new();
    let n = std::io::copy(&mut r, &mut h).map_err(ShardError::io(path, "reading an attached file"))?;
    Ok((n, h.finalize()))
}

/// Reads exactly `len` bytes from `r`, handing each chunk to `f`.
fn pump(
    r: &mut dyn Read,
    len: u64,
    path: &Path,
    what: &str,
    f: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let mut buf = vec![0u8; BUFFER.min(len as usize).max(1)];
    let mut left = len;
    while left > 0 {
        let want = left.min(buf.len() as u64) as usize;
        let got = r
            .read(&mut buf[..want])
            .map_err(ShardError::io(path, format!("reading {what}")))?;
        if got == 0 {
            return Err(ShardError::Corrupt {
                path: path.to_path_buf(),
                detail: format!("{what} end {left} bytes early"),
            });
        }
        f(&buf[..got])?;
        left -= got as u64;
    }
    Ok(())
}

/// Copies exactly `len` bytes from `r` (the file `path`) to `w`, returning their BLAKE3.
fn copy_hashed(
    r: &mut dyn Read,
    w: &mut dyn Write,
    len: u64,
    path: &Path,
    what: &str,
) -> Result<blake3::Hash> {
    let mut h = blake3::Hasher::new();
    pump(r, len, path, what, &mut |chunk| {
        h.update(chunk);
        w.write_all(chunk)
            .map_err(ShardError::io(path, format!("copying {what}")))
    })?;
    Ok(h.finalize())
}

/// Writes a partial result file to `out` (atomically): the manifest of
/// `run`, `shard`, `results` (every job the shard owns, ascending) and the
/// attached files' bytes, then the trailer digest.
pub fn write_partial(
    out: &CheckedOutput,
    run: &RunIdentity,
    shard: Shard,
    results: Vec<JobResult>,
    attachments: &[Attachment],
) -> Result<()> {
    let path = out.path();
    let invalid = |detail: String| ShardError::Invalid {
        path: path.to_path_buf(),
        detail,
    };
    let owned: Vec<usize> = shard.jobs(run.total_jobs()).collect();
    if results.iter().map(|r| r.job).ne(owned.iter().copied()) {
        return Err(invalid(format!(
            "shard {shard} must hold a result for each of its {} jobs, in order",
            owned.len()
        )));
    }
    let mut files = Vec::with_capacity(attachments.len());
    for a in attachments {
        if !valid_file_name(&a.name) || files.iter().any(|f: &FileEntry| f.name == a.name) {
            return Err(invalid(format!(
                "attached file name {:?} is invalid or repeated",
                a.name
            )));
        }
        if !shard.owns(a.job) || a.job >= run.total_jobs() {
            return Err(invalid(format!(
                "attached file {} names job {}, not one of shard {shard}",
                a.name, a.job
            )));
        }
        let (bytes, digest) = hash_file(&a.source)?;
        files.push(FileEntry {
            name: a.name.clone(),
            job: a.job,
            bytes,
            blake3: digest.to_hex().to_string(),
        });
    }
    let manifest = Manifest {
        kind: KIND.into(),
        format_version: FORMAT_VERSION,
        run_digest: run.digest(),
        run: run.clone(),
        shard: ShardRef {
            index: shard.index(),
            count: shard.count(),
        },
        results,
        files,
    };
    let json = serde_json::to_vec(&manifest).map_err(|e| invalid(format!("encoding the manifest: {e}")))?;
    let file = AtomicFile::create(out)?;
    let mut w = Hashing {
        inner: file,
        hasher: blake3::Hasher::new(),
    };
    let io = |what: &'static str| ShardError::io(path, what);
    w.write_all(MAGIC).map_err(io("writing the header"))?;
    w.write_all(&(json.len() as u64).to_le_bytes())
        .map_err(io("writing the header"))?;
    w.write_all(&json).map_err(io("writing the manifest"))?;
    for (a, e) in attachments.iter().zip(&manifest.files) {
        let f =
            open_input(&a.source, "attached file").map_err(ShardError::input("opening an attached file"))?;
        let mut r = BufReader::with_capacity(BUFFER, f);
        let d = copy_hashed(&mut r, &mut w, e.bytes, &a.source, "an attached file")?;
        if d.to_hex().as_str() != e.blake3 {
            return Err(ShardError::Corrupt {
                path: a.source.clone(),
                detail: "the attached file changed while the partial was written".into(),
            });
        }
    }
    let trailer = w.hasher.finalize();
    let mut file = w.inner;
    file.write_all(trailer.as_bytes())
        .map_err(io("writing the trailer"))?;
    file.commit()?;
    Ok(())
}

/// An opened, verified partial result file.
#[derive(Debug, Clone)]
pub struct Partial {
    path: PathBuf,
    manifest: Manifest,
    shard: Shard,
    /// Absolute offset of each attached file's bytes.
    offsets: Vec<u64>,
}

impl Partial {
    /// Opens `path` and verifies it: the magic, the lengths, the trailer
    /// digest over every byte, the manifest's rules (kind, version, run
    /// digest, exactly the shard's jobs, attached files' names and lengths).
    pub fn open(path: &Path) -> Result<Partial> {
        let not = |detail: String| ShardError::NotPartial {
            path: path.to_path_buf(),
            detail,
        };
        let corrupt = |detail: String| ShardError::Corrupt {
            path: path.to_path_buf(),
            detail,
        };
        // A regular file only: a FIFO or device is refused by kind, never opened.
        let f = open_input(path, "partial result file")
            .map_err(ShardError::input("opening the partial result file"))?;
        let len = f
            .metadata()
            .map_err(ShardError::io(path, "reading the partial result file"))?
            .len();
        let mut r = BufReader::with_capacity(BUFFER, f);
        let io = |what: &'static str| ShardError::io(path, what);
        if len < HEADER + TRAILER {
            return Err(not(format!(
                "{len} bytes, shorter than a partial's header and trailer"
            )));
        }
        let mut header = [0u8; HEADER as usize];
        r.read_exact(&mut header).map_err(io("reading the header"))?;
        if &header[..MAGIC.len()] != MAGIC {
            return Err(not("it does not start with \"MOECONF-PARTIAL\"".into()));
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&header[MAGIC.len()..]);
        let mlen = u64::from_le_bytes(n);
        if mlen > MAX_MANIFEST || mlen > len - HEADER - TRAILER {
            return Err(corrupt(format!(
                "the header gives a {mlen}-byte manifest, which does not fit in the file's {len} bytes"
            )));
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update(&header);
        let mut json = vec![0u8; mlen as usize];
        r.read_exact(&mut json).map_err(io("reading the manifest"))?;
        hasher.update(&json);
        let rest = len - HEADER - mlen - TRAILER;
        pump(&mut r, rest, path, "the attached files", &mut |chunk| {
            hasher.update(chunk);
            Ok(())
        })?;
        let mut trailer = [0u8; TRAILER as usize];
        r.read_exact(&mut trailer).map_err(io("reading the trailer"))?;
        let digest = hasher.finalize();
        if digest.as_bytes() != &trailer {
            return Err(corrupt(format!(
                "the BLAKE3 of its contents is {}, its trailer says {} (a changed or truncated copy)",
                digest.to_hex(),
                blake3::Hash::from_bytes(trailer).to_hex()
            )));
        }
        let manifest: Manifest = serde_json::from_slice(&json).map_err(|e| ShardError::Invalid {
            path: path.to_path_buf(),
            detail: format!("manifest: {e}"),
        })?;
        let (shard, offsets) = validate(path, &manifest, rest)?;
        Ok(Partial {
            path: path.to_path_buf(),
            manifest,
            shard,
            offsets: offsets.into_iter().map(|o| o + HEADER + mlen).collect(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn run(&self) -> &RunIdentity {
        &self.manifest.run
    }

    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// Copies attached file `index` (of [`Manifest::files`]) to `w`,
    /// verifying its digest; an error after a partial copy means the bytes
    /// written must be discarded.
    pub fn copy_file(&self, index: usize, w: &mut dyn Write) -> Result<()> {
        let path = &self.path;
        let entry = self
            .manifest
            .files
            .get(index)
            .ok_or_else(|| ShardError::Invalid {
                path: path.clone(),
                detail: format!("no attached file {index}"),
            })?;
        let mut f = open_input(path, "partial result file")
            .map_err(ShardError::input("opening the partial result file"))?;
        f.seek(SeekFrom::Start(self.offsets[index]))
            .map_err(ShardError::io(path, "seeking to an attached file"))?;
        let what = format!("attached file {}", entry.name);
        let d = copy_hashed(
            &mut BufReader::with_capacity(BUFFER, f),
            w,
            entry.bytes,
            path,
            &what,
        )?;
        if d.to_hex().as_str() != entry.blake3 {
            return Err(ShardError::Corrupt {
                path: path.clone(),
                detail: format!(
                    "the BLAKE3 of {what} is {}, its manifest says {} (the file changed after it was opened)",
                    d.to_hex(),
                    entry.blake3
                ),
            });
        }
        Ok(())
    }
}

/// Checks the manifest's rules; returns the shard and each attached file's
/// offset from the end of the manifest (`data` bytes follow it).
fn validate(path: &Path, m: &Manifest, data: u64) -> Result<(Shard, Vec<u64>)> {
    let invalid = |detail: String| ShardError::Invalid {
        path: path.to_path_buf(),
        detail,
    };
    if m.kind != KIND {
        return Err(invalid(format!("kind {:?}, expected {KIND:?}", m.kind)));
    }
    if m.format_version != FORMAT_VERSION {
        return Err(invalid(format!(
            "format version {} (this moeconf reads version {FORMAT_VERSION})",
            m.format_version
        )));
    }
    let shard = Shard::new(m.shard.index, m.shard.count).map_err(|_| {
        invalid(format!(
            "shard {}/{} is not a shard (0-based index below a count of 1..{})",
            m.shard.index,
            m.shard.count,
            crate::MAX_SHARDS
        ))
    })?;
    if m.run_digest != m.run.digest() {
        return Err(ShardError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("the run digest {} does not match the run described", m.run_digest),
        });
    }
    let mut names: Vec<&str> = m.run.jobs.iter().map(|g| g.name.as_str()).collect();
    names.sort_unstable();
    if names.iter().any(|n| n.is_empty()) || names.windows(2).any(|w| w[0] == w[1]) {
        return Err(invalid("the job groups' names are empty or repeated".into()));
    }
    let total = m.run.total_jobs();
    if m.results.iter().map(|r| r.job).ne(shard.jobs(total)) {
        return Err(invalid(format!(
            "shard {shard} of a run of {total} jobs must hold the results of jobs {}, it holds {}",
            job_list(shard.jobs(total), shard.job_count(total)),
            job_list(m.results.iter().map(|r| r.job), m.results.len())
        )));
    }
    let mut offsets = Vec::with_capacity(m.files.len());
    let mut at = 0u64;
    for (i, f) in m.files.iter().enumerate() {
        if !valid_file_name(&f.name) || m.files[..i].iter().any(|g| g.name == f.name) {
            return Err(invalid(format!(
                "attached file name {:?} is invalid or repeated",
                f.name
            )));
        }
        if f.job >= total || !shard.owns(f.job) {
            return Err(invalid(format!(
                "attached file {} names job {}, not one of shard {shard}",
                f.name, f.job
            )));
        }
        if f.blake3.len() != 64 || !f.blake3.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(invalid(format!(
                "attached file {}: digest {:?} is not 64 hex digits",
                f.name, f.blake3
            )));
        }
        offsets.push(at);
        at = at
            .checked_add(f.bytes)
            .ok_or_else(|| invalid("attached file lengths overflow".into()))?;
    }
    if at != data {
        return Err(ShardError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("the manifest lists {at} bytes of attached files, the file holds {data}"),
        });
    }
    Ok((shard, offsets))
}

/// `0, 3, 6` (at most 12 listed) of `count` jobs; never collects the iterator.
fn job_list(jobs: impl Iterator<Item = usize>, count: usize) -> String {
    if count == 0 {
        return "none".into();
    }
    let mut s = jobs
        .take(12)
        .map(|j| j.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    if count > 12 {
        s.push_str(&format!(", ... ({count} in all)"));
    }
    s
}
