//! What `moeconf --version` prints: the release, the commit the binary was
//! built from (cli/build.rs), and the file format versions it reads and
//! writes, one `key: value` line each so that scripts (the Python package's
//! `moeconf.binary`) can check a binary before handing it a trace.
//! `moeconf -V` prints the release alone.

/// The release (`moeconf -V`).
pub const SHORT: &str = env!("CARGO_PKG_VERSION");

/// The release, commit and format versions (`moeconf --version`). The
/// numbers are literals so that this is a constant; a test holds them to the
/// schema's and the gate's constants.
pub const LONG: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "\ncommit: ",
    env!("MOECONF_BUILD_COMMIT"),
    "\ntrace formats read: 1 2 3 4",
    "\ntrace formats written: 1 2 3 4 (default 4)",
    "\nbaseline schema: 3",
);

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the `key: value` line of [`LONG`].
    fn field(key: &str) -> &'static str {
        LONG.lines()
            .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(": ")))
            .unwrap_or_else(|| panic!("no {key:?} line in {LONG:?}"))
    }

    fn numbers(s: &str) -> Vec<u32> {
        s.split(' ').map_while(|w| w.parse().ok()).collect()
    }

    #[test]
    fn format_versions_are_the_schemas() {
        let all: Vec<u32> = (moeconf_schema::FORMAT_V1..=moeconf_schema::FORMAT_VERSION).collect();
        assert_eq!(numbers(field("trace formats read")), all);
        assert_eq!(numbers(field("trace formats written")), all);
        assert!(field("trace formats written")
            .ends_with(&format!("(default {})", moeconf_schema::DEFAULT_FORMAT_VERSION)));
        assert_eq!(
            numbers(field("baseline schema")),
            [moeconf_gate::baseline::BASELINE_SCHEMA_VERSION]
        );
        assert_eq!(LONG.lines().next(), Some(SHORT));
    }

    #[test]
    fn commit_is_hex_or_unknown() {
        let c = field("commit");
        assert!(
            c == "unknown" || (c.len() >= 7 && c.bytes().all(|b| b.is_ascii_hexdigit())),
            "{c:?}"
        );
    }
}
