//! Which records a capture recomputed rather than observed (docs/format.md
//! §5.2.1): the provenance note [`RECOMPUTED_NOTE`], a comma-separated list
//! of record paths and path prefixes (`moe.term.*`).
//!
//! A capture that cannot read a backend's value (a fused kernel that never
//! materializes the per-slot routed terms) may recompute it from the
//! backend's weights and inputs. Such a record is the capture's value, not
//! the backend's, and a comparison that finds it equal on both sides says
//! nothing about the backend. The marker lives in the provenance, which the
//! header checksum covers but the root does not, so traces without it keep
//! their roots and verify unchanged (every record of such a trace is
//! observed).

use moeconf_fingerprint::Coord;

/// The provenance note key that lists recomputed records.
pub const RECOMPUTED_NOTE: &str = "moeconf.recomputed";

/// At most this many patterns in one note.
pub const MAX_PATTERNS: usize = 256;

/// The parsed note: record paths (exact) and prefixes (`…*`) whose values the
/// capture recomputed. Empty: every record is observed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Recomputed {
    patterns: Vec<String>,
}

impl Recomputed {
    /// Every record observed.
    pub fn none() -> Recomputed {
        Recomputed::default()
    }

    /// Parses a note value: comma-separated patterns, each a record path
    /// (docs/format.md §3.1) optionally followed by `*` (a prefix), no
    /// spaces, no duplicates, at least one. Returns what is wrong otherwise.
    pub fn parse(value: &str) -> Result<Recomputed, String> {
        let mut patterns: Vec<String> = Vec::new();
        for p in value.split(',') {
            let stem = p.strip_suffix('*').unwrap_or(p);
            if Coord::validate_path(stem).is_err() {
                return Err(format!(
                    "{RECOMPUTED_NOTE}: pattern {p:?} is not a record path (optionally ending in *)"
                ));
            }
            if patterns.iter().any(|q| q == p) {
                return Err(format!("{RECOMPUTED_NOTE}: pattern {p:?} is listed twice"));
            }
            if patterns.len() == MAX_PATTERNS {
                return Err(format!("{RECOMPUTED_NOTE}: more than {MAX_PATTERNS} patterns"));
            }
            patterns.push(p.to_string());
        }
        Ok(Recomputed { patterns })
    }

    /// A marker from patterns (validated as by [`Recomputed::parse`]).
    pub fn from_patterns<S: AsRef<str>>(patterns: &[S]) -> Result<Recomputed, String> {
        let joined: Vec<&str> = patterns.iter().map(|p| p.as_ref()).collect();
        if joined.is_empty() {
            return Ok(Recomputed::none());
        }
        Recomputed::parse(&joined.join(","))
    }

    /// The patterns, in the note's order.
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// Whether no record is marked.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// Whether the record `path` was recomputed by the capture.
    pub fn covers(&self, path: &str) -> bool {
        self.patterns.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => path.starts_with(prefix),
            None => p == path,
        })
    }

    /// The note value (`None` when empty).
    pub fn to_note(&self) -> Option<String> {
        (!self.is_empty()).then(|| self.patterns.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_cover_exact_paths_and_prefixes() {
        let r = Recomputed::parse("moe.term.*,moe.routed").unwrap();
        assert!(r.covers("moe.term.0") && r.covers("moe.term.17"));
        assert!(r.covers("moe.routed"));
        assert!(!r.covers("moe.shared") && !r.covers("moe.routed.x"));
        assert_eq!(r.to_note().as_deref(), Some("moe.term.*,moe.routed"));
        assert!(!Recomputed::none().covers("moe.term.0"));
    }

    #[test]
    fn malformed_notes_are_refused() {
        for bad in ["", "moe.term.*,", "moe term", "a,a", "*", "moe.term.**"] {
            assert!(Recomputed::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
