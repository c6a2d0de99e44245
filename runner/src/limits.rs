//! Documented bounds on the work and memory a run may ask for
//! (docs/operators.md §7): worker threads, prompt files, prompt tokens and
//! generated tokens. Each check fails with a message naming the option, the
//! value and the limit.

use std::io::Read;
use std::path::Path;

use moeconf_reference_runtime::files::limit_text;

use crate::{Field, FieldMessage, RunError};

/// Largest prompt file read ([`Field::PromptFile`]) (16 MiB).
pub const MAX_PROMPT_FILE_BYTES: u64 = 16 << 20;

/// Largest `--max-new-tokens` (forward steps of one run).
pub const MAX_NEW_TOKENS: u32 = 4096;

/// Largest prompt in tokens (2^20, DeepSeek-V4's context length).
pub const MAX_PROMPT_TOKENS: usize = 1 << 20;

/// Absolute upper bound on the thread count ([`Field::Threads`]).
pub const MAX_THREADS_CEILING: usize = 1024;

/// Thread counts always allowed, however few cores the machine reports.
pub const MIN_THREADS_CEILING: usize = 64;

/// The largest thread count accepted on this machine: 4 × the available
/// parallelism, at least [`MIN_THREADS_CEILING`] and at most
/// [`MAX_THREADS_CEILING`]. Results never depend on the thread count, so
/// oversubscription beyond this only costs time.
pub fn max_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores
        .saturating_mul(4)
        .clamp(MIN_THREADS_CEILING, MAX_THREADS_CEILING)
}

/// Checks a thread count: 1..=[`max_threads`].
pub fn check_threads(n: usize) -> Result<usize, RunError> {
    let max = max_threads();
    if n == 0 {
        return Err(RunError::Field(
            FieldMessage::of(Field::Threads).text(" must be at least 1"),
        ));
    }
    if n > max {
        return Err(RunError::Field(FieldMessage::of(Field::Threads).text(format!(
            " {n}: at most {max} worker threads (4 × the available cores, at least {MIN_THREADS_CEILING}, at most {MAX_THREADS_CEILING}); results never depend on it"
        ))));
    }
    Ok(n)
}

/// Reads a prompt file: at most [`MAX_PROMPT_FILE_BYTES`] of UTF-8. A
/// regular file over the limit is refused before reading; anything else
/// (a pipe, a device) is read up to the limit and refused beyond it.
pub fn read_prompt_file(path: &Path) -> Result<String, RunError> {
    let name = path.display();
    let too_big = || {
        prompt_file(format!(
            " {name}: more than the {} limit for prompts",
            limit_text(MAX_PROMPT_FILE_BYTES)
        ))
    };
    let io = |what: &str, e: std::io::Error| prompt_file(format!(" {name}: {what}: {e}"));
    let meta = std::fs::metadata(path).map_err(|e| io("cannot access", e))?;
    if meta.is_dir() {
        return Err(prompt_file(format!(" {name}: is a directory")));
    }
    if meta.is_file() && meta.len() > MAX_PROMPT_FILE_BYTES {
        return Err(too_big());
    }
    let file = std::fs::File::open(path).map_err(|e| io("cannot open", e))?;
    let mut bytes = Vec::new();
    file.take(MAX_PROMPT_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| io("cannot read", e))?;
    if bytes.len() as u64 > MAX_PROMPT_FILE_BYTES {
        return Err(too_big());
    }
    String::from_utf8(bytes).map_err(|e| {
        prompt_file(format!(
            " {name}: not UTF-8 (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// An error about the prompt file: `detail` follows its field.
fn prompt_file(detail: String) -> RunError {
    RunError::Field(FieldMessage::of(Field::PromptFile).text(detail))
}

/// Checks the prompt's token count against [`MAX_PROMPT_TOKENS`].
pub fn check_prompt_tokens(n: usize) -> Result<(), RunError> {
    if n > MAX_PROMPT_TOKENS {
        return Err(RunError::Invalid(format!(
            "the prompt has {n} tokens, more than the limit of {MAX_PROMPT_TOKENS}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_ceiling_is_bounded_and_checked() {
        let max = max_threads();
        assert!((MIN_THREADS_CEILING..=MAX_THREADS_CEILING).contains(&max));
        assert_eq!(check_threads(1).unwrap(), 1);
        assert_eq!(check_threads(max).unwrap(), max);
        assert!(check_threads(0).is_err());
        let e = check_threads(max + 1).unwrap_err().to_string();
        assert!(e.contains(&format!("at most {max}")), "{e}");
    }

    #[test]
    fn prompt_files_are_capped_and_utf8() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.txt");
        std::fs::write(&p, "why the sheep").unwrap();
        assert_eq!(read_prompt_file(&p).unwrap(), "why the sheep");
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        assert!(read_prompt_file(&p)
            .unwrap_err()
            .to_string()
            .contains("not UTF-8"));
        std::fs::File::create(&p)
            .unwrap()
            .set_len(MAX_PROMPT_FILE_BYTES + 1)
            .unwrap();
        let e = read_prompt_file(&p).unwrap_err().to_string();
        assert!(e.contains("16 MiB"), "{e}");
        assert!(check_prompt_tokens(MAX_PROMPT_TOKENS).is_ok());
        assert!(check_prompt_tokens(MAX_PROMPT_TOKENS + 1).is_err());
    }
}
