//! Report and baseline files, written through `moeconf_output`: the
//! path is checked (a regular file or nothing, no symbolic link, no input
//! of the command), the text goes to a temporary sibling
//! (`.NAME.moeconf-tmp.PID.RAND`, mode 0666 & !umask) that is flushed,
//! synced and renamed over the destination, so a reader (a CI step,
//! `git diff`) never sees a half-written file, and every error removes the
//! temporary file.

use crate::error::{FileKind, GateError};
use moeconf_output::CheckedOutput;
use std::path::Path;

/// Writes `bytes` to `path` atomically; errors name the file as `file` says.
/// The path is checked with no known inputs: commands check their outputs
/// against their inputs first and then use [`write_checked`].
pub fn write_atomic(path: &Path, bytes: &[u8], file: FileKind) -> Result<(), GateError> {
    moeconf_output::write_file(path, bytes).map_err(|source| GateError::Output {
        file,
        source: Box::new(source),
    })
}

/// Writes `bytes` to an output already checked against the command's inputs.
pub fn write_checked(out: &CheckedOutput, bytes: &[u8], file: FileKind) -> Result<(), GateError> {
    moeconf_output::write_checked(out, bytes).map_err(|source| GateError::Output {
        file,
        source: Box::new(source),
    })
}
