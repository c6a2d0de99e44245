//! Helpers shared by the end-to-end tests of the `moeconf` binary.

use std::path::Path;

/// The path as UTF-8 (test paths always are).
pub fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 test path")
}

/// The arguments of `moeconf run` on the built-in model and "why the
/// sheep", generating `tokens` tokens into `out`, followed by `extra`.
pub fn run_args<'a>(out: &'a Path, tokens: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "run",
        "--model",
        "builtin:tiny-v4",
        "--prompt",
        "why the sheep",
        "--max-new-tokens",
        tokens,
        "-o",
        s(out),
    ];
    args.extend_from_slice(extra);
    args
}
