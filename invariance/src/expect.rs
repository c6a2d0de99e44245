//! What each configuration is expected to keep: the expectation of every
//! knob it changes, from the matrix's `[expect]` table overridden by the
//! policy's `[invariance]` section (docs/invariance.md §3).

use crate::error::InvarianceError;
use crate::matrix::{check_knob_name, Configuration, RERUN};
use serde::Serialize;
use std::collections::BTreeMap;

/// What a configuration must keep against the base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "mode", content = "profile", rename_all = "snake_case")]
pub enum Expectation {
    /// Every record of every level both traces hold equal bit for bit.
    Bitwise,
    /// The gate passes under this policy profile (its tolerances and level modes).
    Profile(String),
    /// Reported, never failed.
    Info,
}

impl Expectation {
    /// Parses `bitwise`, `info` or `profile:NAME`.
    pub fn parse(text: &str) -> Result<Expectation, String> {
        match text {
            "bitwise" => Ok(Expectation::Bitwise),
            "info" => Ok(Expectation::Info),
            _ => match text.strip_prefix("profile:") {
                Some(p) if !p.is_empty() => Ok(Expectation::Profile(p.to_string())),
                _ => Err(format!(
                    "{text:?}: expected \"bitwise\", \"info\" or \"profile:NAME\" (a profile of the policy file)"
                )),
            },
        }
    }

    /// `bitwise`, `profile:NAME` or `info`.
    pub fn label(&self) -> String {
        match self {
            Expectation::Bitwise => "bitwise".into(),
            Expectation::Profile(p) => format!("profile:{p}"),
            Expectation::Info => "info".into(),
        }
    }
}

/// Knob → expectation, with where each came from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Expectations {
    map: BTreeMap<String, (Expectation, String)>,
}

impl Expectations {
    /// The matrix's table (`source` names it), then the policy's section
    /// (`policy` names the file) over it.
    pub fn new(
        matrix: &BTreeMap<String, String>,
        source: &str,
        policy: &BTreeMap<String, String>,
        policy_source: &str,
    ) -> Result<Expectations, InvarianceError> {
        let mut map = BTreeMap::new();
        for (table, from, section) in [
            (matrix, source, "[expect]"),
            (policy, policy_source, "[invariance]"),
        ] {
            for (k, v) in table {
                let bad = |message: String| InvarianceError::Expectation {
                    source_name: from.to_string(),
                    message: format!("{section} {k:?}: {message}"),
                };
                check_knob_name(k).map_err(bad)?;
                let e = Expectation::parse(v).map_err(bad)?;
                map.insert(k.clone(), (e, format!("{from} {section}")));
            }
        }
        Ok(Expectations { map })
    }

    /// The expectation of `cfg`: the weakest of the knobs it changes (a
    /// difference may come from any of them), each `bitwise` unless
    /// declared; a configuration that changes nothing is a rerun, judged by
    /// the `rerun` entry (bitwise unless declared). Two different profiles
    /// cannot be combined.
    pub fn of(&self, cfg: &Configuration) -> Result<Expectation, String> {
        let keys: Vec<&str> = if cfg.changed.is_empty() {
            vec![RERUN]
        } else {
            cfg.changed.iter().map(String::as_str).collect()
        };
        let of = |k: &str| {
            self.map
                .get(k)
                .map(|(e, _)| e.clone())
                .unwrap_or(Expectation::Bitwise)
        };
        let all: Vec<(&str, Expectation)> = keys.into_iter().map(|k| (k, of(k))).collect();
        if all.iter().any(|(_, e)| *e == Expectation::Info) {
            return Ok(Expectation::Info);
        }
        let mut profiles = all.iter().filter_map(|(k, e)| match e {
            Expectation::Profile(p) => Some((*k, p)),
            _ => None,
        });
        match profiles.next() {
            None => Ok(Expectation::Bitwise),
            Some((ka, a)) => match profiles.find(|(_, b)| *b != a) {
                Some((kb, b)) => Err(format!(
                    "it changes {ka} (profile:{a}) and {kb} (profile:{b}); a configuration is judged under one profile"
                )),
                None => Ok(Expectation::Profile(a.clone())),
            },
        }
    }

    /// Every declared knob with its expectation and source, for reports.
    pub fn declared(&self) -> Vec<(String, String, String)> {
        self.map
            .iter()
            .map(|(k, (e, s))| (k.clone(), e.label(), s.clone()))
            .collect()
    }

    /// The profiles named, sorted.
    pub fn profiles(&self) -> Vec<String> {
        let set: std::collections::BTreeSet<&String> = self
            .map
            .values()
            .filter_map(|(e, _)| match e {
                Expectation::Profile(p) => Some(p),
                _ => None,
            })
            .collect();
        set.into_iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matrix::Knobs;

    fn cfg(changed: &[&str]) -> Configuration {
        Configuration {
            name: "c".into(),
            knobs: Knobs::new(),
            changed: changed.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn table(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn undeclared_knobs_and_reruns_must_be_bitwise() {
        let e = Expectations::default();
        assert_eq!(e.of(&cfg(&["threads"])).unwrap(), Expectation::Bitwise);
        assert_eq!(e.of(&cfg(&[])).unwrap(), Expectation::Bitwise);
    }

    #[test]
    fn the_weakest_changed_knob_decides_and_the_policy_overrides_the_matrix() {
        let e = Expectations::new(
            &table(&[("threads", "info"), ("batch_with", "profile:ci")]),
            "m.toml",
            &table(&[("threads", "bitwise")]),
            "moeconf.toml",
        )
        .unwrap();
        assert_eq!(e.of(&cfg(&["threads"])).unwrap(), Expectation::Bitwise);
        assert_eq!(
            e.of(&cfg(&["threads", "batch_with"])).unwrap(),
            Expectation::Profile("ci".into())
        );
        let e = Expectations::new(
            &table(&[("a", "profile:x"), ("b", "profile:y"), ("c", "info")]),
            "m",
            &table(&[]),
            "p",
        )
        .unwrap();
        assert!(e.of(&cfg(&["a", "b"])).unwrap_err().contains("one profile"));
        assert_eq!(e.of(&cfg(&["a", "c"])).unwrap(), Expectation::Info);
    }

    #[test]
    fn bad_expectations_name_their_file() {
        let err = Expectations::new(
            &table(&[]),
            "m",
            &table(&[("threads", "tolerance")]),
            "moeconf.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("moeconf.toml") && err.contains("profile:NAME"),
            "{err}"
        );
        assert!(Expectations::new(&table(&[("x", "profile:")]), "m", &table(&[]), "p").is_err());
    }
}
