//! The gate policy: which levels must be bitwise equal, which may differ
//! within tolerances and which are informational, and the rules that say how
//! a differing record is judged (docs/ci.md is the reference).
//!
//! Sources, lowest to highest precedence: built-in defaults, the policy file
//! (`moeconf.toml` at the repository root or `--policy`), environment
//! variables `MOECONF_*`, command-line flags. The file holds named profiles:
//! `[profile.default]` is the base of every profile, `[profile.NAME]`
//! overrides it field by field (a profile's `rules` list replaces the base
//! list as a whole, so first-match order stays readable in one place).

use anyhow::{bail, Context};
use moeconf_fingerprint::{DType, Level};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// How a level is gated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Every record must match its reference bit for bit.
    Bitwise,
    /// A differing record passes when the first matching rule accepts it.
    Tolerance,
    /// Differences are reported and never fail the gate.
    Info,
}

impl Mode {
    fn parse(s: &str) -> Option<Mode> {
        match s {
            "bitwise" => Some(Mode::Bitwise),
            "tolerance" => Some(Mode::Tolerance),
            "info" => Some(Mode::Info),
            _ => None,
        }
    }

    /// `bitwise`, `tolerance` or `info`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Bitwise => "bitwise",
            Mode::Tolerance => "tolerance",
            Mode::Info => "info",
        }
    }
}

/// The test a rule applies to a differing record (docs/ci.md, "Tolerance semantics").
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "check", rename_all = "snake_case")]
pub enum Check {
    /// Must match bitwise (the rule only documents that it is intended).
    Exact,
    /// `|cand − ref| ≤ atol + rtol·|ref|` per element; `None` takes the dtype default.
    Elementwise {
        /// Relative tolerance.
        rtol: Option<f64>,
        /// Absolute tolerance.
        atol: Option<f64>,
    },
    /// At most `max_ulp` units in the last place per element.
    Ulp {
        /// Largest accepted distance in ULPs (integer distance for integer dtypes).
        max_ulp: u64,
    },
    /// Whole-tensor gates for layer states: cosine, norm ratio and NMSE.
    Aggregate {
        /// Smallest accepted cosine similarity.
        cosine_min: f64,
        /// Largest accepted `|‖cand‖/‖ref‖ − 1|`.
        norm_ratio_tol: f64,
        /// Largest accepted `‖cand − ref‖² / ‖ref‖²`.
        nmse_max: f64,
    },
    /// Logit gates: argmax agreement, top-k overlap and (with full logits) KL.
    Logits {
        /// Smallest accepted `|topk(ref) ∩ topk(cand)| / k`.
        topk_overlap_min: f64,
        /// k of the overlap (at most the length of the logits).
        topk: u32,
        /// Largest accepted KL(softmax(ref) ‖ softmax(cand)) in nats.
        kl_max: f64,
    },
    /// Never fails (differences reported).
    Ignore,
}

impl Check {
    /// The check's name as written in the policy.
    pub fn name(&self) -> &'static str {
        match self {
            Check::Exact => "exact",
            Check::Elementwise { .. } => "elementwise",
            Check::Ulp { .. } => "ulp",
            Check::Aggregate { .. } => "aggregate",
            Check::Logits { .. } => "logits",
            Check::Ignore => "ignore",
        }
    }
}

/// One rule: records whose path matches `path` (and whose level is `level`, when given).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Rule {
    /// Glob over the component path (`*` any run of characters, `?` one character).
    pub path: String,
    /// Restrict the rule to one level.
    #[serde(serialize_with = "ser_level")]
    pub level: Option<Level>,
    /// What the rule checks.
    #[serde(flatten)]
    pub check: Check,
}

fn ser_level<S: serde::Serializer>(l: &Option<Level>, s: S) -> Result<S::Ok, S::Error> {
    match l {
        Some(l) => s.serialize_some(l.name()),
        None => s.serialize_none(),
    }
}

impl Rule {
    /// Whether the rule applies to a record.
    pub fn matches(&self, level: Level, path: &str) -> bool {
        self.level.is_none_or(|l| l == level) && glob_match(&self.path, path)
    }

    /// `#2 layer.* (aggregate)`.
    pub fn describe(&self, index: usize) -> String {
        let lvl = self
            .level
            .map(|l| format!(" at {}", l.name()))
            .unwrap_or_default();
        format!("#{} {}{} ({})", index + 1, self.path, lvl, self.check.name())
    }
}

/// Default `(rtol, atol)` of a floating-point dtype (PyTorch's
/// `torch.testing.assert_close` table); integers have `(0, 0)`.
pub fn builtin_dtype_tolerance(d: DType) -> (f64, f64) {
    match d {
        DType::BF16 => (1.6e-2, 1e-5),
        DType::F32 => (1.3e-6, 1e-5),
        DType::F64 => (1e-7, 1e-7),
        _ => (0.0, 0.0),
    }
}

/// A resolved profile: everything the gate needs to judge two traces.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Profile {
    /// Profile name.
    pub name: String,
    /// Mode of L0…L4.
    pub levels: [Mode; 5],
    /// Rules, first match wins; the last is the catch-all `*`.
    pub rules: Vec<Rule>,
    /// Both-NaN elements pass (otherwise any NaN fails).
    pub equal_nan: bool,
    /// A route flip whose reference `router.margin` is below this is a near-tie (0 disables).
    pub route_near_tie_margin: f64,
    /// An argmax (token) flip whose reference `lm.margin` is below this is a near-tie (0 disables).
    pub argmax_near_tie_margin: f64,
    /// `(rtol, atol)` per dtype name, overriding [`builtin_dtype_tolerance`].
    pub dtype_tolerance: BTreeMap<String, (f64, f64)>,
}

impl Profile {
    /// The built-in profile: every level bitwise, catch-all element-wise rule
    /// with dtype defaults (used when a level is switched to tolerance).
    pub fn builtin(name: &str) -> Profile {
        Profile {
            name: name.to_string(),
            levels: [Mode::Bitwise; 5],
            rules: vec![Rule {
                path: "*".into(),
                level: None,
                check: Check::Elementwise {
                    rtol: None,
                    atol: None,
                },
            }],
            equal_nan: false,
            route_near_tie_margin: 0.0,
            argmax_near_tie_margin: 0.0,
            dtype_tolerance: BTreeMap::new(),
        }
    }

    /// Mode of a level.
    pub fn mode(&self, level: Level) -> Mode {
        self.levels[level.code() as usize]
    }

    /// The first rule matching a record, with its index.
    pub fn rule_for(&self, level: Level, path: &str) -> Option<(usize, &Rule)> {
        self.rules
            .iter()
            .enumerate()
            .find(|(_, r)| r.matches(level, path))
    }

    /// `(rtol, atol)` for a dtype.
    pub fn dtype_default(&self, d: DType) -> (f64, f64) {
        self.dtype_tolerance
            .get(d.name())
            .copied()
            .unwrap_or_else(|| builtin_dtype_tolerance(d))
    }

    /// Checks the invariants: a catch-all rule `*` (any level) exists and is
    /// last, thresholds are finite and non-negative.
    pub fn validate(&self) -> anyhow::Result<()> {
        let catch_all = self.rules.iter().position(|r| r.path == "*" && r.level.is_none());
        match catch_all {
            None => bail!(
                "profile {:?}: no catch-all rule: add a last rule with path = \"*\" (and no level) so every \
                 record has a rule",
                self.name
            ),
            Some(i) if i + 1 != self.rules.len() => bail!(
                "profile {:?}: rules after the catch-all rule {} can never match",
                self.name,
                self.rules[i].describe(i)
            ),
            Some(_) => {}
        }
        for (what, v) in [
            ("route_near_tie_margin", self.route_near_tie_margin),
            ("argmax_near_tie_margin", self.argmax_near_tie_margin),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                bail!(
                    "profile {:?}: {what} must be a finite number >= 0, got {v}",
                    self.name
                );
            }
        }
        for (i, r) in self.rules.iter().enumerate() {
            let bad = |what: &str, v: f64| -> anyhow::Result<()> {
                if !(v.is_finite() && v >= 0.0) {
                    bail!(
                        "profile {:?}: rule {}: {what} must be a finite number >= 0, got {v}",
                        self.name,
                        r.describe(i)
                    );
                }
                Ok(())
            };
            match &r.check {
                Check::Elementwise { rtol, atol } => {
                    if let Some(v) = rtol {
                        bad("rtol", *v)?;
                    }
                    if let Some(v) = atol {
                        bad("atol", *v)?;
                    }
                }
                Check::Aggregate {
                    cosine_min,
                    norm_ratio_tol,
                    nmse_max,
                } => {
                    bad("cosine_min", *cosine_min)?;
                    bad("norm_ratio_tol", *norm_ratio_tol)?;
                    bad("nmse_max", *nmse_max)?;
                }
                Check::Logits {
                    topk_overlap_min,
                    topk,
                    kl_max,
                } => {
                    bad("topk_overlap_min", *topk_overlap_min)?;
                    bad("kl_max", *kl_max)?;
                    if *topk == 0 {
                        bail!(
                            "profile {:?}: rule {}: topk must be >= 1",
                            self.name,
                            r.describe(i)
                        );
                    }
                }
                Check::Exact | Check::Ulp { .. } | Check::Ignore => {}
            }
        }
        Ok(())
    }
}

/// Glob match over a whole string: `*` matches any run of characters
/// (dots included), `?` exactly one; everything else literally.
///
/// Hand-written rather than the `globset` crate: component paths are short,
/// flat (no `/` separators) and ASCII, so the ~20 lines of a backtracking
/// matcher are all that is needed and keep the dependency list short.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || (p[pi] != '*' && p[pi] == t[ti])) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

// ----- the file ------------------------------------------------------------

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    /// Profile used when neither `--profile` nor `MOECONF_PROFILE` names one.
    default_profile: Option<String>,
    #[serde(default)]
    profile: BTreeMap<String, RawProfile>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    levels: Option<BTreeMap<String, String>>,
    rules: Option<Vec<RawRule>>,
    equal_nan: Option<bool>,
    route_near_tie_margin: Option<f64>,
    argmax_near_tie_margin: Option<f64>,
    dtype_tolerance: Option<BTreeMap<String, RawTol>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTol {
    rtol: f64,
    atol: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    path: String,
    level: Option<String>,
    check: String,
    rtol: Option<f64>,
    atol: Option<f64>,
    max_ulp: Option<u64>,
    cosine_min: Option<f64>,
    norm_ratio_tol: Option<f64>,
    nmse_max: Option<f64>,
    topk_overlap_min: Option<f64>,
    topk: Option<u32>,
    kl_max: Option<f64>,
}

fn parse_level(s: &str) -> anyhow::Result<Level> {
    Level::from_name(s).with_context(|| format!("unknown level {s:?} (expected L0, L1, L2, L3 or L4)"))
}

fn parse_mode(s: &str) -> anyhow::Result<Mode> {
    Mode::parse(s).with_context(|| format!("unknown mode {s:?} (expected bitwise, tolerance or info)"))
}

impl RawRule {
    fn resolve(&self) -> anyhow::Result<Rule> {
        let level = self.level.as_deref().map(parse_level).transpose()?;
        let given: Vec<&str> = [
            ("rtol", self.rtol.is_some()),
            ("atol", self.atol.is_some()),
            ("max_ulp", self.max_ulp.is_some()),
            ("cosine_min", self.cosine_min.is_some()),
            ("norm_ratio_tol", self.norm_ratio_tol.is_some()),
            ("nmse_max", self.nmse_max.is_some()),
            ("topk_overlap_min", self.topk_overlap_min.is_some()),
            ("topk", self.topk.is_some()),
            ("kl_max", self.kl_max.is_some()),
        ]
        .iter()
        .filter(|(_, g)| *g)
        .map(|(n, _)| *n)
        .collect();
        let allowed: &[&str] = match self.check.as_str() {
            "exact" | "ignore" => &[],
            "elementwise" => &["rtol", "atol"],
            "ulp" => &["max_ulp"],
            "aggregate" => &["cosine_min", "norm_ratio_tol", "nmse_max"],
            "logits" => &["topk_overlap_min", "topk", "kl_max"],
            other => bail!(
                "rule {:?}: unknown check {other:?} (expected exact, elementwise, ulp, aggregate, logits or ignore)",
                self.path
            ),
        };
        if let Some(k) = given.iter().find(|k| !allowed.contains(k)) {
            bail!(
                "rule {:?}: key {k} does not apply to check {:?}",
                self.path,
                self.check
            );
        }
        let need = |v: Option<f64>, k: &str| {
            v.with_context(|| format!("rule {:?}: check {:?} needs {k}", self.path, self.check))
        };
        let check = match self.check.as_str() {
            "exact" => Check::Exact,
            "ignore" => Check::Ignore,
            "elementwise" => Check::Elementwise {
                rtol: self.rtol,
                atol: self.atol,
            },
            "ulp" => Check::Ulp {
                max_ulp: self
                    .max_ulp
                    .with_context(|| format!("rule {:?}: check \"ulp\" needs max_ulp", self.path))?,
            },
            "aggregate" => Check::Aggregate {
                cosine_min: need(self.cosine_min, "cosine_min")?,
                norm_ratio_tol: need(self.norm_ratio_tol, "norm_ratio_tol")?,
                nmse_max: need(self.nmse_max, "nmse_max")?,
            },
            _ => Check::Logits {
                topk_overlap_min: need(self.topk_overlap_min, "topk_overlap_min")?,
                topk: self.topk.unwrap_or(8),
                kl_max: need(self.kl_max, "kl_max")?,
            },
        };
        if self.path.is_empty() {
            bail!("rule with an empty path pattern");
        }
        Ok(Rule {
            path: self.path.clone(),
            level,
            check,
        })
    }
}

impl RawProfile {
    /// Applies this profile's fields over `base`.
    fn apply(&self, base: &mut Profile) -> anyhow::Result<()> {
        if let Some(levels) = &self.levels {
            for (k, v) in levels {
                let l = parse_level(k)?;
                base.levels[l.code() as usize] = parse_mode(v)?;
            }
        }
        if let Some(rules) = &self.rules {
            base.rules = rules
                .iter()
                .map(RawRule::resolve)
                .collect::<anyhow::Result<_>>()?;
        }
        if let Some(v) = self.equal_nan {
            base.equal_nan = v;
        }
        if let Some(v) = self.route_near_tie_margin {
            base.route_near_tie_margin = v;
        }
        if let Some(v) = self.argmax_near_tie_margin {
            base.argmax_near_tie_margin = v;
        }
        if let Some(t) = &self.dtype_tolerance {
            for (k, v) in t {
                let d =
                    DType::from_name(k).with_context(|| format!("dtype_tolerance: unknown dtype {k:?}"))?;
                if !d.is_float() {
                    bail!("dtype_tolerance: {k} is not a floating-point dtype (integers compare exactly)");
                }
                base.dtype_tolerance
                    .insert(d.name().to_string(), (v.rtol, v.atol));
            }
        }
        Ok(())
    }
}

/// Overrides from the environment or the command line (each `None` keeps the lower source).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    /// Policy file.
    pub policy: Option<PathBuf>,
    /// Profile name.
    pub profile: Option<String>,
    /// Level modes.
    pub levels: Vec<(Level, Mode)>,
    /// `equal_nan`.
    pub equal_nan: Option<bool>,
    /// `route_near_tie_margin`.
    pub route_near_tie_margin: Option<f64>,
    /// `argmax_near_tie_margin`.
    pub argmax_near_tie_margin: Option<f64>,
}

impl Overrides {
    /// Reads `MOECONF_POLICY`, `MOECONF_PROFILE`, `MOECONF_LEVELS`
    /// (`L2=info,L4=tolerance`), `MOECONF_EQUAL_NAN` (`1`/`true`/`0`/`false`),
    /// `MOECONF_ROUTE_NEAR_TIE_MARGIN`, `MOECONF_ARGMAX_NEAR_TIE_MARGIN`
    /// through `get` (the process environment in the binary, a map in tests).
    /// Empty values count as unset.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> anyhow::Result<Overrides> {
        let var = |k: &str| get(k).filter(|v| !v.is_empty());
        let num = |k: &str| -> anyhow::Result<Option<f64>> {
            var(k)
                .map(|v| {
                    v.trim()
                        .parse::<f64>()
                        .with_context(|| format!("{k}={v:?}: not a number"))
                })
                .transpose()
        };
        Ok(Overrides {
            policy: var("MOECONF_POLICY").map(PathBuf::from),
            profile: var("MOECONF_PROFILE"),
            levels: match var("MOECONF_LEVELS") {
                Some(v) => v
                    .split(',')
                    .map(|s| parse_level_mode(s.trim()).with_context(|| format!("MOECONF_LEVELS={v:?}")))
                    .collect::<anyhow::Result<_>>()?,
                None => Vec::new(),
            },
            equal_nan: match var("MOECONF_EQUAL_NAN").as_deref() {
                None => None,
                Some("1" | "true") => Some(true),
                Some("0" | "false") => Some(false),
                Some(v) => bail!("MOECONF_EQUAL_NAN={v:?}: expected 1, true, 0 or false"),
            },
            route_near_tie_margin: num("MOECONF_ROUTE_NEAR_TIE_MARGIN")?,
            argmax_near_tie_margin: num("MOECONF_ARGMAX_NEAR_TIE_MARGIN")?,
        })
    }

    /// `self` over `lower`: fields set here win.
    pub fn over(self, lower: Overrides) -> Overrides {
        let mut levels = lower.levels;
        levels.extend(self.levels);
        Overrides {
            policy: self.policy.or(lower.policy),
            profile: self.profile.or(lower.profile),
            levels,
            equal_nan: self.equal_nan.or(lower.equal_nan),
            route_near_tie_margin: self.route_near_tie_margin.or(lower.route_near_tie_margin),
            argmax_near_tie_margin: self.argmax_near_tie_margin.or(lower.argmax_near_tie_margin),
        }
    }
}

/// Parses `L3=tolerance`.
pub fn parse_level_mode(s: &str) -> anyhow::Result<(Level, Mode)> {
    let (l, m) = s
        .split_once('=')
        .with_context(|| format!("{s:?}: expected LEVEL=MODE, e.g. L3=tolerance"))?;
    Ok((parse_level(l.trim())?, parse_mode(m.trim())?))
}

/// The repository root: the nearest ancestor of `start` (itself included) that contains `.git`.
pub fn repository_root(start: &Path) -> Option<PathBuf> {
    start
        .ancestors()
        .find(|d| d.join(".git").exists())
        .map(Path::to_path_buf)
}

/// Where the policy came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Built-in defaults only (no file).
    BuiltIn,
    /// This file.
    File(PathBuf),
}

impl Source {
    /// `built-in defaults` or the file path.
    pub fn describe(&self) -> String {
        match self {
            Source::BuiltIn => "built-in defaults".into(),
            Source::File(p) => p.display().to_string(),
        }
    }
}

/// Resolves the profile: built-in defaults, then the file (given by the
/// overrides or discovered as `moeconf.toml` at the repository root of
/// `cwd`), then the overrides (environment below command line, already merged).
pub fn resolve(o: &Overrides, cwd: &Path) -> anyhow::Result<(Profile, Source)> {
    let file = match &o.policy {
        Some(p) => Some(p.clone()),
        None => repository_root(cwd)
            .map(|r| r.join("moeconf.toml"))
            .filter(|p| p.is_file()),
    };
    let (raw, source) = match &file {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("policy {}", p.display()))?;
            let raw: RawFile = toml::from_str(&text).with_context(|| format!("policy {}", p.display()))?;
            (raw, Source::File(p.clone()))
        }
        None => (RawFile::default(), Source::BuiltIn),
    };
    let name = o
        .profile
        .clone()
        .or_else(|| raw.default_profile.clone())
        .unwrap_or_else(|| "default".to_string());
    let ctx = || format!("policy {}: profile {name:?}", source.describe());
    let mut profile = Profile::builtin(&name);
    if name == "strict" && !raw.profile.contains_key("strict") {
        // Built-in `strict`: every level bitwise, whatever the file's default says.
    } else {
        if let Some(base) = raw.profile.get("default") {
            base.apply(&mut profile).with_context(ctx)?;
        }
        if name != "default" {
            let p = raw.profile.get(&name).with_context(|| {
                let known: Vec<&str> = raw.profile.keys().map(String::as_str).collect();
                format!(
                    "{}: no such profile (defined: {known:?}; built in: default, strict)",
                    ctx()
                )
            })?;
            p.apply(&mut profile).with_context(ctx)?;
        }
    }
    for (l, m) in &o.levels {
        profile.levels[l.code() as usize] = *m;
    }
    if let Some(v) = o.equal_nan {
        profile.equal_nan = v;
    }
    if let Some(v) = o.route_near_tie_margin {
        profile.route_near_tie_margin = v;
    }
    if let Some(v) = o.argmax_near_tie_margin {
        profile.argmax_near_tie_margin = v;
    }
    profile
        .validate()
        .with_context(|| format!("policy {}", source.describe()))?;
    Ok((profile, source))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_matches_whole_paths() {
        assert!(glob_match("*", ""));
        assert!(glob_match("*", "moe.combine"));
        assert!(glob_match("moe.*", "moe.term.3"));
        assert!(glob_match("moe.term.?", "moe.term.3"));
        assert!(!glob_match("moe.term.?", "moe.term.10"));
        assert!(glob_match("*.topk", "router.topk"));
        assert!(!glob_match("*.topk", "router.topk_ids"));
        assert!(glob_match("state.*.buffer_*", "state.compressor.buffer_kv"));
        assert!(!glob_match("layer.*", "lm.logits"));
        assert!(glob_match("a*b*c", "aXXbYbc"));
    }

    fn write(dir: &Path, text: &str) -> PathBuf {
        let p = dir.join("moeconf.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    const FILE: &str = r#"
default_profile = "ci"
[profile.default]
equal_nan = true
[profile.ci]
levels = { L1 = "tolerance", L4 = "info" }
route_near_tie_margin = 0.01
rules = [
  { path = "layer.*", level = "L3", check = "aggregate", cosine_min = 0.99, norm_ratio_tol = 0.01, nmse_max = 1e-3 },
  { path = "lm.*", check = "logits", topk_overlap_min = 0.75, kl_max = 1e-3 },
  { path = "*", check = "elementwise", rtol = 0.1 },
]
[profile.ci.dtype_tolerance]
f32 = { rtol = 1e-3, atol = 1e-4 }
"#;

    #[test]
    fn discovery_profiles_and_precedence() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(".git")).unwrap();
        let sub = dir.path().join("a/b");
        std::fs::create_dir_all(&sub).unwrap();
        let file = write(dir.path(), FILE);
        // Discovered from a subdirectory; default_profile selects ci; default's equal_nan inherited.
        let (p, src) = resolve(&Overrides::default(), &sub).unwrap();
        assert_eq!(src, Source::File(file.clone()));
        assert_eq!(p.name, "ci");
        assert!(p.equal_nan);
        assert_eq!(p.mode(Level::L1), Mode::Tolerance);
        assert_eq!(p.mode(Level::L4), Mode::Info);
        assert_eq!(p.mode(Level::L0), Mode::Bitwise);
        assert_eq!(p.route_near_tie_margin, 0.01);
        assert_eq!(p.rule_for(Level::L3, "layer.post_ffn_mhc").unwrap().0, 0);
        assert_eq!(
            p.rule_for(Level::L4, "layer.x").unwrap().0,
            2,
            "level-restricted rule skipped"
        );
        assert_eq!(p.dtype_default(DType::F32), (1e-3, 1e-4));
        assert_eq!(p.dtype_default(DType::BF16), (1.6e-2, 1e-5));
        // Environment over file, command line over environment.
        let env = Overrides::from_env(|k| match k {
            "MOECONF_LEVELS" => Some("L1=info, L2=tolerance".into()),
            "MOECONF_EQUAL_NAN" => Some("0".into()),
            "MOECONF_ARGMAX_NEAR_TIE_MARGIN" => Some("0.5".into()),
            "MOECONF_PROFILE" => Some("default".into()),
            _ => None,
        })
        .unwrap();
        let (p, _) = resolve(&env.clone(), &sub).unwrap();
        assert_eq!(p.name, "default");
        assert!(!p.equal_nan);
        assert_eq!(p.mode(Level::L1), Mode::Info);
        assert_eq!(p.argmax_near_tie_margin, 0.5);
        let cli = Overrides {
            profile: Some("ci".into()),
            levels: vec![(Level::L1, Mode::Bitwise)],
            equal_nan: Some(true),
            ..Overrides::default()
        };
        let (p, _) = resolve(&cli.over(env), &sub).unwrap();
        assert_eq!(p.name, "ci");
        assert!(p.equal_nan);
        assert_eq!(p.mode(Level::L1), Mode::Bitwise);
        assert_eq!(
            p.mode(Level::L2),
            Mode::Tolerance,
            "env level kept where the CLI is silent"
        );
        // Built-in strict ignores the file's profiles.
        let strict = Overrides {
            profile: Some("strict".into()),
            ..Overrides::default()
        };
        let (p, _) = resolve(&strict, &sub).unwrap();
        assert_eq!(p.levels, [Mode::Bitwise; 5]);
        assert!(!p.equal_nan);
    }

    #[test]
    fn no_repository_no_file_means_builtin() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(".git")).unwrap();
        let (p, src) = resolve(&Overrides::default(), dir.path()).unwrap();
        assert_eq!(src, Source::BuiltIn);
        assert_eq!(p, Profile::builtin("default"));
    }

    #[test]
    fn invalid_policies_are_named_errors() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            ("[profile.default]\nrules = [{ path = \"lm.*\", check = \"exact\" }]\n", "no catch-all"),
            (
                "[profile.default]\nrules = [{ path = \"*\", check = \"exact\" }, { path = \"lm.*\", check = \"exact\" }]\n",
                "can never match",
            ),
            ("[profile.default]\nlevels = { L9 = \"info\" }\n", "unknown level"),
            ("[profile.default]\nlevels = { L1 = \"loose\" }\n", "unknown mode"),
            ("[profile.default]\nrules = [{ path = \"*\", check = \"fuzzy\" }]\n", "unknown check"),
            ("[profile.default]\nrules = [{ path = \"*\", check = \"ulp\", rtol = 1.0 }]\n", "does not apply"),
            ("[profile.default]\nrules = [{ path = \"*\", check = \"aggregate\", cosine_min = 0.9 }]\n", "needs"),
            ("[profile.default]\nequal_nans = true\n", "unknown field"),
            ("[profile.default]\nroute_near_tie_margin = -1.0\n", "finite number"),
            ("[profile.default.dtype_tolerance]\ni32 = { rtol = 1.0, atol = 1.0 }\n", "not a floating"),
            ("[profile.default\n", "TOML"),
        ];
        for (text, want) in cases {
            let p = write(dir.path(), text);
            let o = Overrides {
                policy: Some(p),
                ..Overrides::default()
            };
            let err = format!("{:#}", resolve(&o, dir.path()).unwrap_err());
            assert!(
                err.contains(want) || (want == "TOML" && err.contains("moeconf.toml")),
                "{text}: {err}"
            );
            assert!(err.contains("moeconf.toml"), "error names the file: {err}");
        }
        let o = Overrides {
            profile: Some("nope".into()),
            policy: Some(write(dir.path(), FILE)),
            ..Overrides::default()
        };
        assert!(format!("{:#}", resolve(&o, dir.path()).unwrap_err()).contains("no such profile"));
        assert!(Overrides::from_env(|_| Some("x".into())).is_err());
        assert!(parse_level_mode("L3").is_err());
    }
}
