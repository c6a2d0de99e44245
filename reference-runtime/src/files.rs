//! Checked access to the files of a model directory: each must be a regular
//! file (symbolic links are followed; a directory, FIFO, socket or device is
//! refused by name before it is opened, so nothing blocks on a FIFO or reads
//! an endless device), and the files read into memory are size-capped
//! before and while reading (docs/operators.md §7). Files are opened with
//! `O_NONBLOCK` and the opened handle is checked again, so a FIFO swapped in
//! after the check can neither block nor be read. The same rule, in the same
//! words, as the schema crate's `input` module (which this crate cannot use).

use std::fs::{File, FileType, Metadata};
use std::io::Read;
use std::path::Path;

use crate::error::RuntimeError;

/// Largest `config.json` read (16 MiB; real configs are a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Largest `tokenizer.json` read (256 MiB; the largest public tokenizers are
/// tens of MiB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// What a non-regular file is, for messages.
fn kind_name(ft: &FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if ft.is_socket() {
            return "a socket";
        }
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
    }
    if ft.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// `n` bytes as a short human size (`16 MiB`) for limits, exact otherwise.
pub fn limit_text(n: u64) -> String {
    if n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else {
        format!("{n} bytes")
    }
}

/// The size of `path`, which must be a regular file (after following
/// symbolic links); `expected` names what it should be (`a safetensors file`).
pub fn regular_file(path: &Path, expected: &str) -> Result<u64, RuntimeError> {
    let meta = std::fs::metadata(path).map_err(|source| RuntimeError::Io {
        path: path.to_path_buf(),
        what: "access",
        source,
    })?;
    check_regular(path, expected, &meta)?;
    Ok(meta.len())
}

/// Refuses `meta` (of `path`, links followed) unless it is a regular file,
/// naming the link and its target when `path` is a symbolic link.
fn check_regular(path: &Path, expected: &str, meta: &Metadata) -> Result<(), RuntimeError> {
    let ft = meta.file_type();
    if ft.is_file() {
        return Ok(());
    }
    let kind = kind_name(&ft);
    let message = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => format!(
            "is a symbolic link to {}, which is {kind}, expected {expected}",
            std::fs::read_link(path).unwrap_or_default().display()
        ),
        _ => format!("is {kind}, expected {expected}"),
    };
    Err(RuntimeError::File {
        path: path.to_path_buf(),
        message,
    })
}

/// Opens the regular file `path` for reading ([`regular_file`] first), with
/// `O_NONBLOCK` on Unix (no effect on a regular file; a FIFO swapped in
/// after the check cannot block the open), and checks the opened handle is
/// a regular file too. Returns the file and its size.
pub fn open_regular(path: &Path, expected: &str) -> Result<(File, u64), RuntimeError> {
    regular_file(path, expected)?;
    let io = |source| RuntimeError::Io {
        path: path.to_path_buf(),
        what: "open",
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    check_regular(path, expected, &meta)?;
    Ok((file, meta.len()))
}

/// Reads the regular file `path` (`expected` names it in messages) if it
/// holds at most `cap` bytes; the read itself stops after `cap + 1` bytes,
/// so a file growing meanwhile cannot exceed the cap either.
pub fn read_capped(path: &Path, expected: &str, cap: u64) -> Result<Vec<u8>, RuntimeError> {
    let too_big = |len: u64| RuntimeError::File {
        path: path.to_path_buf(),
        message: format!("{len} bytes exceeds the {} limit for {expected}", limit_text(cap)),
    };
    let (file, len) = open_regular(path, expected)?;
    if len > cap {
        return Err(too_big(len));
    }
    let io = |source| RuntimeError::Io {
        path: path.to_path_buf(),
        what: "read",
        source,
    };
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(cap + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > cap {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_and_oversized_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = regular_file(dir.path(), "a safetensors file")
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("is a directory, expected a safetensors file"), "{e}");
        let f = dir.path().join("c.json");
        std::fs::write(&f, vec![b' '; 100]).unwrap();
        assert_eq!(read_capped(&f, "config.json", 100).unwrap().len(), 100);
        let e = read_capped(&f, "config.json", 99).unwrap_err().to_string();
        assert!(
            e.contains("100 bytes exceeds the 99 bytes limit for config.json"),
            "{e}"
        );
        assert_eq!(limit_text(16 << 20), "16 MiB");
    }
}
