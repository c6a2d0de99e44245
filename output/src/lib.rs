//! Safe files: the one way moeconf writes a file (traces, reports,
//! baselines, tables), with the guarantees of docs/format.md §10, and the
//! one way it opens a file it reads ([`input`]: regular files only, §7).
//! [`escape`] makes user strings safe in every report format. A floor-1
//! crate of its own: the trace format (`moeconf-schema`), the
//! shard partials, GGUF export and the fixtures all write through it, and
//! none of them needs the others for it.
//!
//! * **Checked before work starts.** [`check_output`] (and
//!   [`check_outputs`] for a command's whole set) refuses an output whose
//!   directory does not exist or is not a directory, an existing output that
//!   is not a regular file (a directory, FIFO, socket or device is never
//!   replaced), a symbolic link (moeconf neither writes through nor replaces
//!   one: the caller gives the target's path), an output that is the same
//!   file (same device and inode, by the same path or through a hard link)
//!   as any input of the command ([`Inputs`]), and one path given as two
//!   outputs. Commands call it before they load a model or read a trace.
//! * **Atomic.** [`AtomicFile`] writes a temporary sibling named
//!   `.NAME.moeconf-tmp.PID.RAND` (PID the writer's process id, RAND 16 hex
//!   digits), created exclusively with mode `0666 & !umask` (0644 under the
//!   usual umask 022), then flushes, syncs, re-checks the destination and
//!   renames the temporary file over it. The temporary file is removed on
//!   every error path (a failed write, flush, sync or rename, or a writer
//!   dropped unfinished), and every temporary file being written is
//!   registered so the binary removes it when interrupted
//!   ([`remove_temporaries_and`]); only `kill -9` or a crash can leave one.
//! * **Directories whole or not at all.** A command whose result is several
//!   files in one directory (`calibrate --out DIR`, `merge -o DIR`) checks
//!   it with [`check_output_dir`] and writes it into an [`AtomicDir`]: a
//!   temporary sibling directory `.NAME.moeconf-tmp.PID.RAND`, registered
//!   like a temporary file, renamed into place once complete. An existing
//!   directory is replaced only when it is empty or holds nothing but a
//!   previous result of the command. Several single-file outputs of one
//!   command are all written before any is renamed ([`write_all_checked`]).
//! * **Stale temporaries are reported.** [`check_output`] lists temporary
//!   files of the output's name left next to it by processes that no longer
//!   run ([`CheckedOutput::stale_temporaries`]), including those of the
//!   older `.NAME.tmp-PID-N` pattern; `moeconf` warns about them and leaves
//!   them alone.
#![forbid(unsafe_code)]

use std::fs::{File, Metadata, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use thiserror::Error;

pub mod escape;
pub mod input;
pub use input::InputFileError;

/// The marker between the output's name and the process id in a temporary
/// file's name: `.NAME.moeconf-tmp.PID.RAND`.
pub const TEMP_MARKER: &str = ".moeconf-tmp.";

/// Longest output name kept whole in a temporary file's name (the rest of
/// the name needs about 40 bytes of the usual 255-byte limit).
const TEMP_NAME_MAX: usize = 200;

/// Buffer of an [`AtomicFile`] unless the caller chooses one.
const DEFAULT_BUFFER: usize = 64 << 10;

/// Why an output cannot be written. Every variant names the output path.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum OutputError {
    /// The output's directory does not exist (moeconf creates no parents).
    #[error("{}: the directory {} does not exist", path.display(), dir.display())]
    MissingDirectory {
        /// The output.
        path: PathBuf,
        dir: PathBuf,
    },
    /// The output's directory is not a directory.
    #[error("{}: {} is not a directory", path.display(), dir.display())]
    NotADirectory {
        path: PathBuf,
        /// What should have been its directory.
        dir: PathBuf,
    },
    /// Something other than a regular file exists at the output path.
    #[error(
        "{}: is {kind}, not a regular file: moeconf writes outputs only as regular files and never \
         replaces anything else",
        path.display()
    )]
    NotRegular {
        path: PathBuf,
        /// What is there (`a directory`, `a FIFO (named pipe)`, ...).
        kind: &'static str,
    },
    /// The output path is a symbolic link.
    #[error(
        "{}: is a symbolic link (to {}): moeconf neither writes through nor replaces a symbolic link; \
         give the target's path, or remove the link",
        path.display(),
        target.display()
    )]
    Symlink {
        /// The output.
        path: PathBuf,
        target: PathBuf,
    },
    /// The output is the same file as one of the command's inputs.
    #[error(
        "{}: is the same file as the {role} {} (same device and inode): refusing to overwrite an input",
        path.display(),
        input.display()
    )]
    SameAsInput {
        path: PathBuf,
        /// The input it would destroy.
        input: PathBuf,
        /// What the input is (`model file`, `reference trace`, ...).
        role: String,
    },
    /// An existing output directory holds something the command does not
    /// write: it is replaced only when empty or holding nothing but a
    /// previous result of the same command ([`check_output_dir`]).
    #[error(
        "{}: the directory exists and holds {} ({why}): moeconf replaces an output directory only \
         when it is empty or holds nothing but a previous result of the same command; give a new or \
         empty directory",
        path.display(),
        entry.display()
    )]
    NotReplaceable {
        path: PathBuf,
        /// The entry that is not part of a result.
        entry: PathBuf,
        why: &'static str,
    },
    /// Something other than a directory exists at an output directory's path.
    #[error("{}: is {kind}, not a directory", path.display())]
    NotADirectoryOutput {
        path: PathBuf,
        /// What is there (`a regular file`, `a FIFO (named pipe)`, ...).
        kind: &'static str,
    },
    /// An output directory path that names no entry of its parent (`.`, `..`, `/`).
    #[error(
        "{}: names no directory entry that could be replaced as a whole; give the directory by name \
         (such as results/cal)",
        path.display()
    )]
    UnnamedDirectory {
        /// The output directory.
        path: PathBuf,
    },
    /// One file given as more than one output of a command.
    #[error("{}: given as more than one output of the same command", path.display())]
    Duplicate {
        /// The output.
        path: PathBuf,
    },
    /// The operating system refused a step of the write. The message names
    /// the output and the step; the I/O error is the source.
    #[error("{}: {what}", path.display())]
    Io {
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl OutputError {
    fn io(path: &Path, what: &'static str) -> impl FnOnce(std::io::Error) -> OutputError {
        let path = path.to_path_buf();
        move |source| OutputError::Io { path, what, source }
    }
}

/// The identity of a file: device and inode on Unix, the canonical path
/// elsewhere.
#[derive(Debug, Clone, PartialEq, Eq)]
enum FileId {
    #[cfg(unix)]
    Inode(u64, u64),
    #[cfg(not(unix))]
    Canonical(PathBuf),
}

impl FileId {
    #[cfg(unix)]
    fn of(_path: &Path, meta: &Metadata) -> Option<FileId> {
        use std::os::unix::fs::MetadataExt;
        Some(FileId::Inode(meta.dev(), meta.ino()))
    }

    #[cfg(not(unix))]
    fn of(path: &Path, _meta: &Metadata) -> Option<FileId> {
        std::fs::canonicalize(path).ok().map(FileId::Canonical)
    }
}

/// One input file of a command.
#[derive(Debug, Clone)]
struct InputFile {
    id: FileId,
    path: PathBuf,
    role: String,
}

/// The files a command reads, which none of its outputs may be.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    files: Vec<InputFile>,
}

impl Inputs {
    /// No inputs.
    pub fn new() -> Inputs {
        Inputs::default()
    }

    /// Adds a file the command reads (symbolic links followed), described
    /// by `role` in messages (`reference trace`, `prompt file`, ...). A path
    /// that does not exist is skipped: the command's own read reports it.
    pub fn file(&mut self, path: &Path, role: &str) -> &mut Inputs {
        if let Ok(meta) = std::fs::metadata(path) {
            if let Some(id) = FileId::of(path, &meta) {
                self.files.push(InputFile {
                    id,
                    path: path.to_path_buf(),
                    role: role.to_string(),
                });
            }
        }
        self
    }

    /// Adds every file directly inside `dir` (a model directory, a dump
    /// directory); an unreadable directory adds nothing.
    pub fn dir_files(&mut self, dir: &Path, role: &str) -> &mut Inputs {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.filter_map(Result::ok) {
                let p = e.path();
                if p.is_file() {
                    self.file(&p, role);
                }
            }
        }
        self
    }

    /// Adds every input of `other`.
    pub fn extend(&mut self, other: &Inputs) -> &mut Inputs {
        self.files.extend(other.files.iter().cloned());
        self
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    fn same_as(&self, id: &FileId) -> Option<&InputFile> {
        self.files.iter().find(|f| &f.id == id)
    }
}

/// A temporary file left next to an output by a process that no longer runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleTemporary {
    pub path: PathBuf,
    /// The process id in its name.
    pub pid: u32,
}

/// An output path that passed [`check_output`].
#[derive(Debug, Clone)]
pub struct CheckedOutput {
    path: PathBuf,
    inputs: Inputs,
    stale: Vec<StaleTemporary>,
}

impl CheckedOutput {
    /// The output path, as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Temporary files of this output's name that processes no longer
    /// running left in its directory (for the caller to warn about; they are
    /// never removed automatically).
    pub fn stale_temporaries(&self) -> &[StaleTemporary] {
        &self.stale
    }
}

/// The directory an output is written in (`.` for a bare file name).
fn dir_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// What a non-regular file is, for messages (also of inputs: [`input`]).
pub(crate) fn kind_of(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
    }
    "not a regular file"
}

/// Checks the output's directory: it exists and is a directory.
fn check_dir(path: &Path) -> Result<(), OutputError> {
    let dir = dir_of(path);
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(OutputError::NotADirectory {
            path: path.to_path_buf(),
            dir: dir.to_path_buf(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(OutputError::MissingDirectory {
            path: path.to_path_buf(),
            dir: dir.to_path_buf(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => Err(OutputError::NotADirectory {
            path: path.to_path_buf(),
            dir: dir.to_path_buf(),
        }),
        Err(e) => Err(OutputError::io(path, "checking the output's directory")(e)),
    }
}

/// Checks what exists at the output path now: nothing, or a regular file
/// that is no input.
fn check_existing(path: &Path, inputs: &Inputs) -> Result<(), OutputError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(OutputError::io(path, "checking the output path")(e)),
    };
    if meta.file_type().is_symlink() {
        return Err(OutputError::Symlink {
            path: path.to_path_buf(),
            target: std::fs::read_link(path).unwrap_or_default(),
        });
    }
    if !meta.is_file() {
        return Err(OutputError::NotRegular {
            path: path.to_path_buf(),
            kind: kind_of(&meta),
        });
    }
    if let Some(input) = FileId::of(path, &meta).and_then(|id| inputs.same_as(&id)) {
        return Err(OutputError::SameAsInput {
            path: path.to_path_buf(),
            input: input.path.clone(),
            role: input.role.clone(),
        });
    }
    Ok(())
}

/// Checks that `path` can be written as an output of a command that reads
/// `inputs` (see the module documentation), and lists stale temporary files
/// next to it. Call it before any work starts.
pub fn check_output(path: &Path, inputs: &Inputs) -> Result<CheckedOutput, OutputError> {
    if path.file_name().is_none() || path.as_os_str().to_string_lossy().ends_with('/') {
        return Err(OutputError::NotRegular {
            path: path.to_path_buf(),
            kind: "a directory name",
        });
    }
    check_dir(path)?;
    check_existing(path, inputs)?;
    Ok(CheckedOutput {
        path: path.to_path_buf(),
        inputs: inputs.clone(),
        stale: stale_temporaries(path),
    })
}

/// [`check_output`] for every output of one command, also refusing a file
/// given as two of its outputs (by path or, for existing files, by inode).
pub fn check_outputs(paths: &[&Path], inputs: &Inputs) -> Result<Vec<CheckedOutput>, OutputError> {
    let mut seen: Vec<(PathBuf, Option<FileId>)> = Vec::new();
    let mut out = Vec::with_capacity(paths.len());
    for &p in paths {
        let checked = check_output(p, inputs)?;
        let dir = std::fs::canonicalize(dir_of(p)).unwrap_or_else(|_| dir_of(p).to_path_buf());
        let key = dir.join(p.file_name().unwrap_or_default());
        let id = std::fs::symlink_metadata(p).ok().and_then(|m| FileId::of(p, &m));
        if seen.iter().any(|(k, i)| *k == key || (id.is_some() && *i == id)) {
            return Err(OutputError::Duplicate {
                path: p.to_path_buf(),
            });
        }
        seen.push((key, id));
        out.push(checked);
    }
    Ok(out)
}

/// The output's file name as it appears in its temporary files' names.
fn temp_stem(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    if name.len() <= TEMP_NAME_MAX {
        return name;
    }
    let mut end = TEMP_NAME_MAX;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name[..end].to_string()
}

/// A random 64-bit value (std's per-process random hash keys, mixed with
/// the time and a counter), so concurrent writers never pick one name.
fn random_u64() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.finish()
}

/// The name of a new temporary file for `path`: `.NAME.moeconf-tmp.PID.RAND`.
pub fn temp_name(path: &Path) -> String {
    format!(
        ".{}{TEMP_MARKER}{}.{:016x}",
        temp_stem(path),
        std::process::id(),
        random_u64()
    )
}

/// The process id of a temporary file of `stem` named `name`, for both
/// patterns (`.NAME.moeconf-tmp.PID.RAND`, and the older `.NAME.tmp-PID-N`).
fn temp_pid(stem: &str, name: &str) -> Option<u32> {
    let rest = name.strip_prefix('.')?.strip_prefix(stem)?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if let Some(r) = rest.strip_prefix(TEMP_MARKER) {
        let (pid, rand) = r.split_once('.')?;
        let hex = rand.len() == 16 && rand.bytes().all(|b| b.is_ascii_hexdigit());
        return (digits(pid) && hex).then(|| pid.parse().ok()).flatten();
    }
    let (pid, n) = rest.strip_prefix(".tmp-")?.split_once('-')?;
    (digits(pid) && digits(n)).then(|| pid.parse().ok()).flatten()
}

/// Whether process `pid` may still be running (always true where that
/// cannot be told, i.e. without `/proc`: no false warnings).
fn may_be_running(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return true;
    }
    proc.join(pid.to_string()).exists()
}

/// Temporary files of `path`'s name in its directory whose writer no longer
/// runs.
pub fn stale_temporaries(path: &Path) -> Vec<StaleTemporary> {
    let stem = temp_stem(path);
    let Ok(entries) = std::fs::read_dir(dir_of(path)) else {
        return Vec::new();
    };
    let mut stale: Vec<StaleTemporary> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name();
            let pid = temp_pid(&stem, &name.to_string_lossy())?;
            (!may_be_running(pid)).then(|| StaleTemporary { path: e.path(), pid })
        })
        .collect();
    stale.sort_by(|a, b| a.path.cmp(&b.path));
    stale
}

/// Temporary files being written right now ([`AtomicFile`]) and temporary
/// directories a command asked to have removed ([`register_temporary`]):
/// what an interrupted process must remove before it ends
/// ([`remove_temporaries_and`]).
static TEMPORARIES: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

fn temporaries() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    TEMPORARIES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records `path` (a file or a directory) as temporary: if the process is
/// interrupted ([`remove_temporaries_and`]) it is removed. Blocks while an
/// interruption is removing the temporaries, so nothing is created after.
pub fn register_temporary(path: &Path) {
    temporaries().push(path.to_path_buf());
}

/// Forgets `path` (committed, renamed or removed by its owner).
pub fn deregister_temporary(path: &Path) {
    let mut t = temporaries();
    if let Some(i) = t.iter().rposition(|p| p == path) {
        t.swap_remove(i);
    }
}

/// Removes every registered temporary file and directory, then runs `end`
/// (which ends the process) while still holding the registry, so no new
/// temporary file can be registered and created in between, and no file
/// committed ([`AtomicFile::commit`], [`AtomicDir::commit`] rename while
/// holding it) into a temporary directory being removed. For the
/// binary's signal handling: SIGINT, SIGTERM and SIGHUP would otherwise
/// end the process without running any destructor, leaving the
/// temporaries behind.
pub fn remove_temporaries_and(end: impl FnOnce()) {
    let t = temporaries();
    for p in t.iter() {
        if std::fs::remove_file(p).is_err() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
    end();
    drop(t);
}

/// A file being written under a temporary name next to its destination,
/// renamed over it by [`AtomicFile::commit`]. Dropped without a commit (or
/// after a failed one), it removes its temporary file.
pub struct AtomicFile {
    dest: PathBuf,
    tmp: PathBuf,
    inputs: Inputs,
    out: Option<BufWriter<File>>,
    committed: bool,
}

impl std::fmt::Debug for AtomicFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AtomicFile")
            .field("dest", &self.dest)
            .field("tmp", &self.tmp)
            .field("committed", &self.committed)
            .finish()
    }
}

impl AtomicFile {
    /// Starts writing the checked output `out` (64 KiB buffer).
    pub fn create(out: &CheckedOutput) -> Result<AtomicFile, OutputError> {
        AtomicFile::with_buffer(out, DEFAULT_BUFFER)
    }

    /// Starts writing the checked output `out` through a buffer of `capacity` bytes.
    pub fn with_buffer(out: &CheckedOutput, capacity: usize) -> Result<AtomicFile, OutputError> {
        let dir = dir_of(&out.path);
        let mut attempts = 0;
        loop {
            let tmp = dir.join(temp_name(&out.path));
            // Created and registered while the registry is held: an
            // interruption either removes it or has the creation wait until
            // the process ends (and nothing appears in a temporary
            // directory while an interruption removes it).
            let mut registry = temporaries();
            // create_new: O_CREAT|O_EXCL with mode 0666, so the umask gives
            // the usual 0644; never follows or reuses an existing entry.
            let created = OpenOptions::new().write(true).create_new(true).open(&tmp);
            if created.is_ok() {
                registry.push(tmp.clone());
            }
            drop(registry);
            match created {
                Ok(file) => {
                    return Ok(AtomicFile {
                        dest: out.path.clone(),
                        tmp,
                        inputs: out.inputs.clone(),
                        out: Some(BufWriter::with_capacity(capacity, file)),
                        committed: false,
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempts < 16 => attempts += 1,
                Err(e) => return Err(OutputError::io(&out.path, "creating the temporary file")(e)),
            }
        }
    }

    /// The destination path.
    pub fn path(&self) -> &Path {
        &self.dest
    }

    /// Appends `len` bytes of `src` from `offset` (in the kernel where it
    /// can: no copy through this process). What was written before is
    /// flushed first; `src`'s file position is moved.
    pub fn copy_range(&mut self, src: &File, offset: u64, len: u64) -> std::io::Result<()> {
        let out = self.out.as_mut().ok_or(std::io::ErrorKind::Other)?;
        out.flush()?;
        let mut from = src;
        from.seek(SeekFrom::Start(offset))?;
        let copied = std::io::copy(&mut from.take(len), out.get_mut())?;
        if copied != len {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }

    /// The temporary file being written.
    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }

    /// Flushes and syncs the temporary file, checks the destination again
    /// (it must still be absent or a regular file that is no input), renames
    /// the temporary file over it and syncs the directory. On any error the
    /// temporary file is removed and the destination is untouched.
    pub fn commit(mut self) -> Result<(), OutputError> {
        let dest = self.dest.clone();
        let out = self
            .out
            .take()
            .ok_or_else(|| OutputError::io(&dest, "writing")(std::io::ErrorKind::Other.into()))?;
        let file = out
            .into_inner()
            .map_err(|e| OutputError::io(&dest, "flushing the temporary file")(e.into_error()))?;
        file.sync_all()
            .map_err(OutputError::io(&dest, "syncing the temporary file"))?;
        drop(file);
        check_existing(&dest, &self.inputs)?;
        // Renamed while the registry is held, so an interruption either
        // removes the temporary file or finds the output in place, and
        // never has a file appear in a temporary directory it is removing.
        let mut registry = temporaries();
        let renamed = std::fs::rename(&self.tmp, &dest);
        if renamed.is_ok() {
            self.committed = true;
            if let Some(i) = registry.iter().rposition(|p| *p == self.tmp) {
                registry.swap_remove(i);
            }
        }
        drop(registry);
        renamed.map_err(OutputError::io(&dest, "renaming the temporary file into place"))?;
        // Make the rename durable; a directory that cannot be synced (some
        // file systems refuse) leaves the file written all the same.
        if let Ok(d) = File::open(dir_of(&dest)) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self.out.as_mut() {
            Some(o) => o.write(buf),
            None => Err(std::io::ErrorKind::Other.into()),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self.out.as_mut() {
            Some(o) => o.write_all(buf),
            None => Err(std::io::ErrorKind::Other.into()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self.out.as_mut() {
            Some(o) => o.flush(),
            None => Ok(()),
        }
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            // Close before removing (required on some platforms).
            drop(self.out.take());
            let _ = std::fs::remove_file(&self.tmp);
            deregister_temporary(&self.tmp);
        }
    }
}

/// Whether a path inside an output directory (relative, `/`-separated, such
/// as `calibration.json` or `traces/x.bin`; a directory such as `traces`
/// too) is part of a command's result, so that a previous result may be
/// replaced.
pub type ResultEntry = fn(&str) -> bool;

/// An output directory that passed [`check_output_dir`].
#[derive(Debug, Clone)]
pub struct CheckedDir {
    path: PathBuf,
    inputs: Inputs,
    is_result: ResultEntry,
    stale: Vec<StaleTemporary>,
}

impl CheckedDir {
    /// The output directory, as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Temporary files and directories of this output's name that processes
    /// no longer running left next to it (never removed automatically).
    pub fn stale_temporaries(&self) -> &[StaleTemporary] {
        &self.stale
    }
}

/// Checks what exists at an output directory's path: nothing, or a
/// directory (not a symbolic link) whose every entry, at any depth, is a
/// directory or regular file that `is_result` accepts and no input.
fn check_existing_dir(path: &Path, inputs: &Inputs, is_result: ResultEntry) -> Result<(), OutputError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(OutputError::io(path, "checking the output directory")(e)),
    };
    if meta.file_type().is_symlink() {
        return Err(OutputError::Symlink {
            path: path.to_path_buf(),
            target: std::fs::read_link(path).unwrap_or_default(),
        });
    }
    if !meta.is_dir() {
        let kind = if meta.is_file() {
            "a regular file"
        } else {
            kind_of(&meta)
        };
        return Err(OutputError::NotADirectoryOutput {
            path: path.to_path_buf(),
            kind,
        });
    }
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries =
            std::fs::read_dir(&dir).map_err(OutputError::io(path, "reading the output directory"))?;
        for e in entries {
            let e = e.map_err(OutputError::io(path, "reading the output directory"))?;
            let entry = e.path();
            let rel = entry.strip_prefix(path).unwrap_or(&entry);
            let rel_text = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            let meta =
                std::fs::symlink_metadata(&entry).map_err(OutputError::io(&entry, "checking an entry"))?;
            let refuse = |why| OutputError::NotReplaceable {
                path: path.to_path_buf(),
                entry: entry.clone(),
                why,
            };
            if meta.file_type().is_symlink() {
                return Err(refuse("a symbolic link"));
            }
            if !meta.is_dir() && !meta.is_file() {
                return Err(refuse(kind_of(&meta)));
            }
            if !is_result(&rel_text) {
                return Err(refuse("not a file this command writes"));
            }
            if meta.is_dir() {
                stack.push(entry);
            } else if let Some(input) = FileId::of(&entry, &meta).and_then(|id| inputs.same_as(&id)) {
                return Err(OutputError::SameAsInput {
                    path: entry.clone(),
                    input: input.path.clone(),
                    role: input.role.clone(),
                });
            }
        }
    }
    Ok(())
}

/// Checks that `path` can be written as an output directory of a command
/// that reads `inputs`: its parent exists; nothing is there yet, or a
/// directory that is empty or holds only a previous result (entries
/// `is_result` accepts, regular files that are no input, no symbolic link),
/// which [`AtomicDir::commit`] replaces as a whole. Lists stale temporaries
/// next to it. Call it before any work starts.
pub fn check_output_dir(
    path: &Path,
    inputs: &Inputs,
    is_result: ResultEntry,
) -> Result<CheckedDir, OutputError> {
    if path.file_name().is_none() {
        return Err(OutputError::UnnamedDirectory {
            path: path.to_path_buf(),
        });
    }
    check_dir(path)?;
    check_existing_dir(path, inputs, is_result)?;
    Ok(CheckedDir {
        path: path.to_path_buf(),
        inputs: inputs.clone(),
        is_result,
        stale: stale_temporaries(path),
    })
}

/// An output directory being written under a temporary name next to its
/// destination (`.NAME.moeconf-tmp.PID.RAND`, registered as a temporary so
/// an interruption removes it), renamed into place by [`AtomicDir::commit`]:
/// the destination holds either the complete result or what it held before
/// (nothing, or the previous result). Dropped without a commit, it removes
/// its temporary directory.
#[derive(Debug)]
pub struct AtomicDir {
    dest: CheckedDir,
    tmp: PathBuf,
    committed: bool,
}

impl AtomicDir {
    /// Creates the temporary directory of the checked output directory `out`.
    pub fn create(out: &CheckedDir) -> Result<AtomicDir, OutputError> {
        let dir = dir_of(&out.path);
        let mut attempts = 0;
        loop {
            let tmp = dir.join(temp_name(&out.path));
            // Created and registered while the registry is held, as
            // AtomicFile's temporary.
            let mut registry = temporaries();
            let created = std::fs::create_dir(&tmp);
            if created.is_ok() {
                registry.push(tmp.clone());
            }
            drop(registry);
            match created {
                Ok(()) => {
                    return Ok(AtomicDir {
                        dest: out.clone(),
                        tmp,
                        committed: false,
                    })
                }
                Err(e) => {
                    if e.kind() != std::io::ErrorKind::AlreadyExists || attempts >= 16 {
                        return Err(OutputError::io(&out.path, "creating the temporary directory")(e));
                    }
                    attempts += 1;
                }
            }
        }
    }

    /// The destination directory.
    pub fn path(&self) -> &Path {
        &self.dest.path
    }

    /// The temporary directory to write the result into.
    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }

    /// Checks the destination again (absent, or empty, or a previous result
    /// that is no input) and renames the temporary directory into place; a
    /// previous result is first renamed aside (a registered temporary) and
    /// removed after. Both renames happen while the registry of temporaries
    /// is held, so an interruption (Ctrl-C) waits for them and then removes
    /// only what is temporary: the destination is never left without both
    /// the previous and the new result. On an error the temporary directory
    /// is removed and the destination keeps what it held.
    pub fn commit(mut self) -> Result<(), OutputError> {
        let dest = self.dest.path.clone();
        check_existing_dir(&dest, &self.dest.inputs, self.dest.is_result)?;
        let aside = std::fs::symlink_metadata(&dest)
            .is_ok()
            .then(|| dir_of(&dest).join(temp_name(&dest)));
        {
            let mut registry = temporaries();
            if let Some(aside) = &aside {
                std::fs::rename(&dest, aside)
                    .map_err(OutputError::io(&dest, "renaming the previous result aside"))?;
                registry.push(aside.clone());
            }
            if let Err(e) = std::fs::rename(&self.tmp, &dest) {
                if let Some(aside) = &aside {
                    // Put the previous result back; it stays registered (and
                    // is removed on an interruption) only if that fails.
                    if std::fs::rename(aside, &dest).is_ok() {
                        if let Some(i) = registry.iter().rposition(|p| p == aside) {
                            registry.swap_remove(i);
                        }
                    }
                }
                return Err(OutputError::io(
                    &dest,
                    "renaming the temporary directory into place",
                )(e));
            }
            self.committed = true;
            if let Some(i) = registry.iter().rposition(|p| *p == self.tmp) {
                registry.swap_remove(i);
            }
        }
        if let Some(aside) = &aside {
            // Removed before it is forgotten: an interruption in between
            // still finds it registered.
            let removed = std::fs::remove_dir_all(aside);
            deregister_temporary(aside);
            removed.map_err(OutputError::io(&dest, "removing the previous result"))?;
        }
        if let Ok(d) = File::open(dir_of(&dest)) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp);
            deregister_temporary(&self.tmp);
        }
    }
}

/// Writes every `(output, bytes)` to a temporary file first and renames
/// them into place only once all are written in full, so a failure (a full
/// disk) or an interruption while writing leaves none of a command's
/// outputs half-updated: each is either the new file or what was there.
pub fn write_all_checked(outputs: &[(&CheckedOutput, &[u8])]) -> Result<(), OutputError> {
    let mut files = Vec::with_capacity(outputs.len());
    for (out, bytes) in outputs {
        let mut f = AtomicFile::create(out)?;
        f.write_all(bytes)
            .map_err(OutputError::io(&out.path, "writing the temporary file"))?;
        files.push(f);
    }
    for f in files {
        f.commit()?;
    }
    Ok(())
}

/// Writes `bytes` to the checked output `out` atomically.
pub fn write_checked(out: &CheckedOutput, bytes: &[u8]) -> Result<(), OutputError> {
    let mut f = AtomicFile::create(out)?;
    f.write_all(bytes)
        .map_err(OutputError::io(&out.path, "writing the temporary file"))?;
    f.commit()
}

/// Checks `path` as an output with no known inputs ([`check_output`]) and
/// writes `bytes` to it atomically.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), OutputError> {
    write_checked(&check_output(path, &Inputs::new())?, bytes)
}

/// An error and its sources joined by ": ", for a message that embeds a
/// nested error (whose I/O reason, for instance, is its source, not its
/// text).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temps(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(TEMP_MARKER))
            .collect()
    }

    #[test]
    fn temporary_names_follow_the_documented_pattern() {
        let n = temp_name(Path::new("dir/out.bin"));
        let pid = std::process::id();
        assert!(n.starts_with(&format!(".out.bin.moeconf-tmp.{pid}.")), "{n}");
        assert_eq!(temp_pid("out.bin", &n), Some(pid));
        assert_eq!(temp_pid("out.bin", ".out.bin.tmp-42-7"), Some(42));
        for not in [
            ".out.bin.moeconf-tmp.12.xyz",
            ".out.bin.moeconf-tmp..0123456789abcdef",
            ".other.moeconf-tmp.1.0123456789abcdef",
            "out.bin.moeconf-tmp.1.0123456789abcdef",
            ".out.bin.tmp-1-",
        ] {
            assert_eq!(temp_pid("out.bin", not), None, "{not}");
        }
        let long = "x".repeat(300);
        assert!(temp_name(Path::new(&long)).len() < 255);
        assert_ne!(temp_name(Path::new("a")), temp_name(Path::new("a")));
    }

    /// A copied range lands after what was written before it and before
    /// what comes after; a source shorter than the range is an error.
    #[test]
    fn a_copied_range_lands_in_write_order() {
        let dir = tempfile::tempdir().unwrap();
        let src_path = dir.path().join("src");
        std::fs::write(&src_path, b"0123456789").unwrap();
        let src = File::open(&src_path).unwrap();
        let p = dir.path().join("out.bin");
        let mut f = AtomicFile::create(&check_output(&p, &Inputs::new()).unwrap()).unwrap();
        f.write_all(b"ab").unwrap();
        f.copy_range(&src, 3, 4).unwrap();
        f.write_all(b"cd").unwrap();
        f.copy_range(&src, 0, 1).unwrap();
        let short = f.copy_range(&src, 8, 5).unwrap_err();
        assert_eq!(short.kind(), std::io::ErrorKind::UnexpectedEof);
        f.commit().unwrap();
        // The short copy's two bytes were written; the writer's caller
        // drops a file after any error.
        assert_eq!(std::fs::read(&p).unwrap(), b"ab3456cd089");
    }

    #[test]
    fn commit_onto_a_directory_fails_and_removes_the_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.txt");
        let checked = check_output(&p, &Inputs::new()).unwrap();
        let mut f = AtomicFile::create(&checked).unwrap();
        f.write_all(b"report").unwrap();
        assert_eq!(temps(dir.path()).len(), 1);
        std::fs::create_dir(&p).unwrap();
        let e = f.commit().unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
        assert!(temps(dir.path()).is_empty());
        assert!(p.is_dir());
    }

    #[test]
    fn temporary_files_are_registered_while_they_exist() {
        let registered = |p: &Path| temporaries().iter().any(|t| t == p);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.txt");
        let checked = check_output(&p, &Inputs::new()).unwrap();
        // Committed: registered while written, forgotten once renamed.
        let f = AtomicFile::create(&checked).unwrap();
        let tmp = f.temp_path().to_path_buf();
        assert!(registered(&tmp));
        f.commit().unwrap();
        assert!(!registered(&tmp));
        // Dropped unfinished, and failed to commit: forgotten with the file.
        let f = AtomicFile::create(&checked).unwrap();
        let tmp = f.temp_path().to_path_buf();
        assert!(registered(&tmp));
        drop(f);
        assert!(!registered(&tmp) && !tmp.exists());
        let f = AtomicFile::create(&checked).unwrap();
        let tmp = f.temp_path().to_path_buf();
        std::fs::remove_file(&p).unwrap();
        std::fs::create_dir(&p).unwrap();
        assert!(f.commit().is_err());
        assert!(!registered(&tmp) && !tmp.exists());
    }

    #[test]
    fn dropped_unfinished_files_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.txt");
        let mut f = AtomicFile::create(&check_output(&p, &Inputs::new()).unwrap()).unwrap();
        f.write_all(&[7u8; 100_000]).unwrap();
        drop(f);
        assert!(temps(dir.path()).is_empty());
        assert!(!p.exists());
    }

    #[test]
    fn checks_refuse_what_must_not_be_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let none = Inputs::new();
        let d = dir.path().join("d");
        std::fs::create_dir(&d).unwrap();
        let e = check_output(&d, &none).unwrap_err();
        assert!(
            matches!(
                e,
                OutputError::NotRegular {
                    kind: "a directory",
                    ..
                }
            ),
            "{e}"
        );
        let e = check_output(&dir.path().join("no/x"), &none).unwrap_err();
        assert!(matches!(e, OutputError::MissingDirectory { .. }), "{e}");
        let f = dir.path().join("f");
        std::fs::write(&f, "input").unwrap();
        let e = check_output(&f.join("x"), &none).unwrap_err();
        assert!(matches!(e, OutputError::NotADirectory { .. }), "{e}");
        let mut inputs = Inputs::new();
        inputs.file(&f, "trace");
        let e = check_output(&f, &inputs).unwrap_err();
        assert!(e.to_string().contains("same file as the trace"), "{e}");
        let h = dir.path().join("h");
        std::fs::hard_link(&f, &h).unwrap();
        assert!(matches!(
            check_output(&h, &inputs).unwrap_err(),
            OutputError::SameAsInput { .. }
        ));
        assert!(
            check_output(&h, &none).is_ok(),
            "an existing regular file may be replaced"
        );
        let e = check_outputs(&[&dir.path().join("a"), &dir.path().join("./a")], &none).unwrap_err();
        assert!(matches!(e, OutputError::Duplicate { .. }), "{e}");
        #[cfg(unix)]
        {
            let l = dir.path().join("l");
            std::os::unix::fs::symlink(&f, &l).unwrap();
            assert!(matches!(
                check_output(&l, &none).unwrap_err(),
                OutputError::Symlink { .. }
            ));
        }
    }

    #[test]
    fn stale_temporaries_of_dead_processes_are_listed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.bin");
        let dead = dir.path().join(".out.bin.moeconf-tmp.99999999.0123456789abcdef");
        let mine = dir.path().join(format!(
            ".out.bin.moeconf-tmp.{}.0123456789abcdef",
            std::process::id()
        ));
        let other = dir
            .path()
            .join(".other.bin.moeconf-tmp.99999999.0123456789abcdef");
        for f in [&dead, &mine, &other] {
            std::fs::write(f, "").unwrap();
        }
        let stale = check_output(&p, &Inputs::new()).unwrap().stale;
        assert_eq!(
            stale,
            vec![StaleTemporary {
                path: dead,
                pid: 99999999
            }]
        );
    }

    /// Accepts what a calibration writes: `*.json`, `*.tsv`, `traces`, `traces/*.bin`.
    fn calibration_like(rel: &str) -> bool {
        rel == "traces"
            || rel.ends_with(".json")
            || rel.ends_with(".tsv")
            || rel.strip_prefix("traces/").is_some_and(|n| n.ends_with(".bin"))
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn write_result(d: &AtomicDir, tag: &str) {
        std::fs::create_dir(d.temp_path().join("traces")).unwrap();
        std::fs::write(d.temp_path().join("traces/a.bin"), tag).unwrap();
        std::fs::write(d.temp_path().join("r.json"), tag).unwrap();
    }

    #[test]
    fn directories_appear_whole_and_replace_only_a_previous_result() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("cal");
        let none = Inputs::new();
        // Absent: nothing at the destination until the commit.
        let d = AtomicDir::create(&check_output_dir(&out, &none, calibration_like).unwrap()).unwrap();
        assert!(temporaries().iter().any(|t| t == d.temp_path()));
        write_result(&d, "one");
        assert!(!out.exists());
        let tmp = d.temp_path().to_path_buf();
        d.commit().unwrap();
        assert_eq!(std::fs::read(out.join("traces/a.bin")).unwrap(), b"one");
        assert!(!temporaries().contains(&tmp));
        assert_eq!(names(dir.path()), ["cal"]);
        // A previous result is replaced as a whole (its extra table goes).
        std::fs::write(out.join("old.tsv"), "old").unwrap();
        let d = AtomicDir::create(&check_output_dir(&out, &none, calibration_like).unwrap()).unwrap();
        write_result(&d, "two");
        d.commit().unwrap();
        assert_eq!(std::fs::read(out.join("r.json")).unwrap(), b"two");
        assert!(!out.join("old.tsv").exists());
        assert_eq!(names(dir.path()), ["cal"], "the previous result was not removed");
        // An empty directory is replaced.
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let d = AtomicDir::create(&check_output_dir(&empty, &none, calibration_like).unwrap()).unwrap();
        write_result(&d, "three");
        d.commit().unwrap();
        assert_eq!(std::fs::read(empty.join("r.json")).unwrap(), b"three");
        // Dropped unfinished: the temporary directory goes, the result stays.
        let d = AtomicDir::create(&check_output_dir(&out, &none, calibration_like).unwrap()).unwrap();
        write_result(&d, "four");
        let tmp = d.temp_path().to_path_buf();
        drop(d);
        assert!(!tmp.exists() && !temporaries().contains(&tmp));
        assert_eq!(std::fs::read(out.join("r.json")).unwrap(), b"two");
    }

    #[test]
    fn directories_holding_anything_else_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let none = Inputs::new();
        let out = dir.path().join("cal");
        std::fs::create_dir_all(out.join("traces")).unwrap();
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        let e = check_output_dir(&out, &none, calibration_like).unwrap_err();
        assert!(matches!(e, OutputError::NotReplaceable { .. }), "{e}");
        assert!(e.to_string().contains("notes.txt"), "{e}");
        std::fs::remove_file(out.join("notes.txt")).unwrap();
        // Checked at the commit again: a file that appeared meanwhile is kept.
        let d = AtomicDir::create(&check_output_dir(&out, &none, calibration_like).unwrap()).unwrap();
        std::fs::write(out.join("traces/x.txt"), "mine").unwrap();
        let tmp = d.temp_path().to_path_buf();
        assert!(d.commit().is_err());
        assert!(!tmp.exists());
        assert_eq!(std::fs::read(out.join("traces/x.txt")).unwrap(), b"mine");
        // A file, an input, a symbolic link, `.`.
        let f = dir.path().join("f");
        std::fs::write(&f, "x").unwrap();
        let e = check_output_dir(&f, &none, calibration_like).unwrap_err();
        assert!(matches!(e, OutputError::NotADirectoryOutput { .. }), "{e}");
        let r = dir.path().join("r");
        std::fs::create_dir(&r).unwrap();
        std::fs::write(r.join("model.json"), "x").unwrap();
        let mut inputs = Inputs::new();
        inputs.file(&r.join("model.json"), "model file");
        let e = check_output_dir(&r, &inputs, calibration_like).unwrap_err();
        assert!(matches!(e, OutputError::SameAsInput { .. }), "{e}");
        #[cfg(unix)]
        {
            let l = dir.path().join("l");
            std::os::unix::fs::symlink(&r, &l).unwrap();
            let e = check_output_dir(&l, &none, calibration_like).unwrap_err();
            assert!(matches!(e, OutputError::Symlink { .. }), "{e}");
        }
        let e = check_output_dir(Path::new("."), &none, calibration_like).unwrap_err();
        assert!(matches!(e, OutputError::UnnamedDirectory { .. }), "{e}");
    }

    #[test]
    fn several_files_are_renamed_only_once_all_are_written() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.json"), dir.path().join("b.html"));
        let none = Inputs::new();
        let ca = check_output(&a, &none).unwrap();
        let cb = check_output(&b, &none).unwrap();
        write_all_checked(&[(&ca, b"a"), (&cb, b"b")]).unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"a");
        assert_eq!(std::fs::read(&b).unwrap(), b"b");
        // The second cannot be created (its directory went): the first is not replaced.
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let cc = check_output(&sub.join("c.html"), &none).unwrap();
        std::fs::remove_dir(&sub).unwrap();
        assert!(write_all_checked(&[(&ca, b"new"), (&cc, b"c")]).is_err());
        assert_eq!(std::fs::read(&a).unwrap(), b"a");
        assert!(temps(dir.path()).is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn files_get_the_umask_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.xml");
        write_file(&p, b"<x/>").unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        // Whatever the umask, group/other read bits are not stripped by the
        // writer itself: 0600 would mean a private temporary-file mode.
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        if let Some(u) = status
            .lines()
            .find_map(|l| l.strip_prefix("Umask:"))
            .and_then(|u| u32::from_str_radix(u.trim(), 8).ok())
        {
            assert_eq!(mode, 0o666 & !u);
        }
    }
}
