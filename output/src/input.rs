//! Safe inputs: the one way moeconf opens a file it reads (traces, gate
//! policies and baselines, partial result files, import manifests and dump
//! files, model files), with the rule of docs/format.md §7: **an input is a
//! regular file**.
//!
//! * **Checked before it is opened.** [`check_input`] asks
//!   `std::fs::metadata` (symbolic links followed) what the path is. A
//!   directory, FIFO, socket or character or block device is refused by
//!   name and kind; a symbolic link to one of those is refused naming the
//!   link, where it points and what is there, and so is a dangling link.
//!   Opening a FIFO for reading blocks until a writer appears, and a device
//!   may never end: neither is ever opened.
//! * **Opened without blocking, and checked again.** [`open_input`] opens
//!   with `O_NONBLOCK` on Unix (which changes nothing for a regular file),
//!   so a path replaced by a FIFO between the check and the open cannot
//!   block the open, and then checks the opened handle's own metadata
//!   (`fstat`): what is read is what was checked.
//!
//! The kinds are named as for outputs ([`crate`]): `a directory`,
//! `a FIFO (named pipe)`, `a socket`, `a character device`, `a block device`.

use crate::kind_of;
use std::fs::{File, Metadata, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Why an input file cannot be read. Every variant names the path and what
/// the file was expected to be (`role`: `trace`, `policy file`, ...).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum InputFileError {
    /// The path is something other than a regular file.
    #[error("{}: the {role} is {kind}, not a regular file", path.display())]
    NotRegular {
        path: PathBuf,
        /// What it should have been.
        role: &'static str,
        /// What is there (`a directory`, `a FIFO (named pipe)`, ...).
        kind: &'static str,
    },
    /// The path is a symbolic link to something other than a regular file.
    #[error(
        "{}: the {role} is a symbolic link to {}, which is {kind}, not a regular file",
        path.display(),
        target.display()
    )]
    LinkNotRegular {
        /// The input (the link).
        path: PathBuf,
        /// What it should have been.
        role: &'static str,
        target: PathBuf,
        /// What is there.
        kind: &'static str,
    },
    /// The path is a symbolic link whose target does not exist.
    #[error(
        "{}: the {role} is a symbolic link to {}, which does not exist",
        path.display(),
        target.display()
    )]
    DanglingLink {
        /// The input (the link).
        path: PathBuf,
        /// What it should have been.
        role: &'static str,
        target: PathBuf,
    },
    /// The operating system refused to look at, open or read the file
    /// (missing, permission denied, ...). The message names the file and
    /// what was being done; the I/O error is the source.
    #[error("{}: {what} the {role}", path.display())]
    Io {
        path: PathBuf,
        /// What it should have been.
        role: &'static str,
        /// What was being done (`opening`, `reading`).
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl InputFileError {
    /// The input the error is about.
    pub fn path(&self) -> &Path {
        match self {
            InputFileError::NotRegular { path, .. }
            | InputFileError::LinkNotRegular { path, .. }
            | InputFileError::DanglingLink { path, .. }
            | InputFileError::Io { path, .. } => path,
        }
    }

    /// The operating system's error, if the failure is one (for callers
    /// that report I/O failures in their own words).
    pub fn io_error(&self) -> Option<&std::io::Error> {
        match self {
            InputFileError::Io { source, .. } => Some(source),
            _ => None,
        }
    }

    /// The error as an owned [`std::io::Error`] when it is an I/O failure,
    /// else the error itself (a file of the wrong kind).
    pub fn into_io(self) -> Result<std::io::Error, InputFileError> {
        match self {
            InputFileError::Io { source, .. } => Ok(source),
            other => Err(other),
        }
    }

    fn io(
        path: &Path,
        role: &'static str,
        what: &'static str,
    ) -> impl FnOnce(std::io::Error) -> InputFileError {
        let path = path.to_path_buf();
        move |source| InputFileError::Io {
            path,
            role,
            what,
            source,
        }
    }
}

/// The error for `path` (expected to be a `role`) whose metadata, with
/// symbolic links followed, is `meta`: names the link when `path` is one.
fn not_regular(path: &Path, role: &'static str, meta: &Metadata) -> InputFileError {
    let kind = kind_of(meta);
    let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if is_link {
        InputFileError::LinkNotRegular {
            path: path.to_path_buf(),
            role,
            target: std::fs::read_link(path).unwrap_or_default(),
            kind,
        }
    } else {
        InputFileError::NotRegular {
            path: path.to_path_buf(),
            role,
            kind,
        }
    }
}

/// Checks that `path` is a regular file (symbolic links followed), without
/// opening it, and returns its metadata. `role` names what the file is to
/// the command (`trace`, `policy file`, `dump file`, ...), in messages.
pub fn check_input(path: &Path, role: &'static str) -> Result<Metadata, InputFileError> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Ok(target) = std::fs::read_link(path) {
                return Err(InputFileError::DanglingLink {
                    path: path.to_path_buf(),
                    role,
                    target,
                });
            }
            return Err(InputFileError::io(path, role, "opening")(e));
        }
        Err(e) => return Err(InputFileError::io(path, role, "opening")(e)),
    };
    if !meta.is_file() {
        return Err(not_regular(path, role, &meta));
    }
    Ok(meta)
}

/// Opens the regular file `path` for reading (see the module
/// documentation): checked first, opened without blocking, and its opened
/// handle checked to be a regular file too.
pub fn open_input(path: &Path, role: &'static str) -> Result<File, InputFileError> {
    check_input(path, role)?;
    let mut options = OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options
        .open(path)
        .map_err(InputFileError::io(path, role, "opening"))?;
    let meta = file
        .metadata()
        .map_err(InputFileError::io(path, role, "opening"))?;
    if !meta.is_file() {
        return Err(not_regular(path, role, &meta));
    }
    Ok(file)
}

/// Reads the whole regular file `path` ([`open_input`]).
pub fn read_input(path: &Path, role: &'static str) -> Result<Vec<u8>, InputFileError> {
    let mut file = open_input(path, role)?;
    let len = file.metadata().map_or(0, |m| m.len());
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.read_to_end(&mut bytes)
        .map_err(InputFileError::io(path, role, "reading"))?;
    Ok(bytes)
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn mkfifo(p: &Path) {
        let st = std::process::Command::new("mkfifo").arg(p).status().unwrap();
        assert!(st.success(), "mkfifo");
    }

    #[test]
    fn regular_files_and_links_to_them_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"bytes").unwrap();
        let l = dir.path().join("l");
        std::os::unix::fs::symlink(&f, &l).unwrap();
        assert_eq!(read_input(&f, "trace").unwrap(), b"bytes");
        assert_eq!(read_input(&l, "trace").unwrap(), b"bytes");
    }

    #[test]
    fn everything_else_is_refused_by_name_and_kind_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("p.fifo");
        mkfifo(&fifo);
        let e = open_input(&fifo, "trace").unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{}: the trace is a FIFO (named pipe), not a regular file",
                fifo.display()
            )
        );
        let e = open_input(dir.path(), "policy file").unwrap_err();
        assert!(
            matches!(
                e,
                InputFileError::NotRegular {
                    kind: "a directory",
                    ..
                }
            ),
            "{e}"
        );
        let e = open_input(Path::new("/dev/null"), "baseline").unwrap_err();
        assert!(
            e.to_string()
                .ends_with("is a character device, not a regular file"),
            "{e}"
        );

        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&fifo, &link).unwrap();
        let e = open_input(&link, "trace").unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}: ", link.display())), "{e}");
        assert!(
            e.contains(&format!("symbolic link to {}, which is a FIFO", fifo.display())),
            "{e}"
        );

        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
        let e = check_input(&dangling, "trace").unwrap_err();
        assert!(matches!(e, InputFileError::DanglingLink { .. }), "{e}");

        let missing = dir.path().join("missing");
        let e = check_input(&missing, "trace").unwrap_err();
        assert_eq!(
            e.io_error().map(std::io::Error::kind),
            Some(std::io::ErrorKind::NotFound)
        );
    }
}
