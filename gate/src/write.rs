//! Atomic file writes for reports and baselines: the text goes to a
//! temporary file in the destination's directory, is flushed to disk and
//! renamed over the destination, so a reader (a CI step, `git diff`) never
//! sees a half-written file.

use crate::error::{FileKind, GateError};
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` atomically; errors name the file as `file` says.
pub fn write_atomic(path: &Path, bytes: &[u8], file: FileKind) -> Result<(), GateError> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(|source| GateError::CreateTemporary {
        file,
        path: path.to_path_buf(),
        source,
    })?;
    tmp.write_all(bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(|source| GateError::Write {
            file,
            path: path.to_path_buf(),
            source,
        })?;
    tmp.persist(path).map_err(|source| GateError::Persist {
        file,
        path: path.to_path_buf(),
        source,
    })?;
    Ok(())
}
