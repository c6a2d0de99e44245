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

use crate::error::{GateError, PolicyError};
use moeconf_fingerprint::{DType, Level, LevelSet};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
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
    const ALL: [Mode; 3] = [Mode::Bitwise, Mode::Tolerance, Mode::Info];

    /// `bitwise`, `tolerance` or `info`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Bitwise => "bitwise",
            Mode::Tolerance => "tolerance",
            Mode::Info => "info",
        }
    }

    /// The mode called `name`.
    pub fn from_name(name: &str) -> Result<Mode, PolicyError> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == name)
            .ok_or_else(|| PolicyError::UnknownMode { name: name.into() })
    }
}

/// One entry of a profile's `required` list (docs/ci.md §2, "Coverage"):
/// which levels both sides must hold records of. A required level missing
/// from the candidate fails the gate; missing from the reference (or
/// baseline), it is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requirement {
    Level(Level),
    /// Every level the reference holds whose mode is `bitwise` or `tolerance`.
    Judged,
    /// Every level the reference holds, whatever its mode.
    Reference,
}

impl Requirement {
    /// `L0`…`L4`, `judged` or `reference`, as written in the policy.
    pub fn name(self) -> &'static str {
        match self {
            Requirement::Level(l) => l.name(),
            Requirement::Judged => "judged",
            Requirement::Reference => "reference",
        }
    }

    /// The requirement called `name`.
    pub fn from_name(name: &str) -> Result<Requirement, PolicyError> {
        match name {
            "judged" => Ok(Requirement::Judged),
            "reference" => Ok(Requirement::Reference),
            _ => Level::from_name(name)
                .map(Requirement::Level)
                .ok_or_else(|| PolicyError::UnknownRequirement { name: name.into() }),
        }
    }

    /// Parses a comma-separated list (`L0,L1,judged`); `none` is the empty list.
    pub fn parse_list(text: &str) -> Result<Vec<Requirement>, PolicyError> {
        if text.trim() == "none" {
            return Ok(Vec::new());
        }
        text.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(Requirement::from_name)
            .collect()
    }
}

impl serde::Serialize for Requirement {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
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

/// The checks a rule can name in the file, with the keys each one reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CheckKind {
    Exact,
    Elementwise,
    Ulp,
    Aggregate,
    Logits,
    Ignore,
}

impl CheckKind {
    const ALL: [CheckKind; 6] = [
        CheckKind::Exact,
        CheckKind::Elementwise,
        CheckKind::Ulp,
        CheckKind::Aggregate,
        CheckKind::Logits,
        CheckKind::Ignore,
    ];

    fn name(self) -> &'static str {
        match self {
            CheckKind::Exact => "exact",
            CheckKind::Elementwise => "elementwise",
            CheckKind::Ulp => "ulp",
            CheckKind::Aggregate => "aggregate",
            CheckKind::Logits => "logits",
            CheckKind::Ignore => "ignore",
        }
    }

    fn from_name(name: &str) -> Option<CheckKind> {
        CheckKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The rule keys the check reads.
    fn keys(self) -> &'static [&'static str] {
        match self {
            CheckKind::Exact | CheckKind::Ignore => &[],
            CheckKind::Elementwise => &["rtol", "atol"],
            CheckKind::Ulp => &["max_ulp"],
            CheckKind::Aggregate => &["cosine_min", "norm_ratio_tol", "nmse_max"],
            CheckKind::Logits => &["topk_overlap_min", "topk", "kl_max"],
        }
    }
}

impl Check {
    fn kind(&self) -> CheckKind {
        match self {
            Check::Exact => CheckKind::Exact,
            Check::Elementwise { .. } => CheckKind::Elementwise,
            Check::Ulp { .. } => CheckKind::Ulp,
            Check::Aggregate { .. } => CheckKind::Aggregate,
            Check::Logits { .. } => CheckKind::Logits,
            Check::Ignore => CheckKind::Ignore,
        }
    }

    /// The check's name as written in the policy.
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// The check's thresholds that must be finite and non-negative, by key.
    fn thresholds(&self) -> Vec<(&'static str, f64)> {
        match *self {
            Check::Elementwise { rtol, atol } => [("rtol", rtol), ("atol", atol)]
                .into_iter()
                .filter_map(|(k, v)| Some((k, v?)))
                .collect(),
            Check::Aggregate {
                cosine_min,
                norm_ratio_tol,
                nmse_max,
            } => vec![
                ("cosine_min", cosine_min),
                ("norm_ratio_tol", norm_ratio_tol),
                ("nmse_max", nmse_max),
            ],
            Check::Logits {
                topk_overlap_min,
                kl_max,
                ..
            } => vec![("topk_overlap_min", topk_overlap_min), ("kl_max", kl_max)],
            Check::Exact | Check::Ulp { .. } | Check::Ignore => Vec::new(),
        }
    }
}

/// One rule: records whose path matches `path` (and whose level is `level`, when given).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Rule {
    /// Glob over the component path (`*` any run of characters, `?` one character).
    pub path: String,
    /// Restrict the rule to one level.
    pub level: Option<Level>,
    #[serde(flatten)]
    pub check: Check,
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

    /// Whether this is the catch-all rule: every path at every level.
    fn is_catch_all(&self) -> bool {
        self.path == "*" && self.level.is_none()
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
    /// Coverage: the levels both sides must hold ([`Profile::required_levels`]).
    pub required: Vec<Requirement>,
}

impl Profile {
    /// The built-in profile: every level bitwise, catch-all element-wise rule
    /// with dtype defaults (used when a level is switched to tolerance).
    /// `strict` requires every level the reference holds; every other
    /// profile starts from L0, L1 and every judged level the reference holds.
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
            required: if name == "strict" {
                vec![Requirement::Reference]
            } else {
                vec![
                    Requirement::Level(Level::L0),
                    Requirement::Level(Level::L1),
                    Requirement::Judged,
                ]
            },
        }
    }

    pub fn mode(&self, level: Level) -> Mode {
        self.levels[level.code() as usize]
    }

    pub fn set_mode(&mut self, level: Level, mode: Mode) {
        self.levels[level.code() as usize] = mode;
    }

    /// The levels both sides must hold, given the levels the reference (or
    /// baseline) holds: the named levels, plus the judged (non-`info`) or
    /// all levels of the reference for `judged` / `reference`.
    pub fn required_levels(&self, reference_holds: LevelSet) -> LevelSet {
        let mut set = LevelSet::EMPTY;
        for r in &self.required {
            match *r {
                Requirement::Level(l) => set.insert(l),
                Requirement::Judged => reference_holds
                    .iter()
                    .filter(|&l| self.mode(l) != Mode::Info)
                    .for_each(|l| set.insert(l)),
                Requirement::Reference => reference_holds.iter().for_each(|l| set.insert(l)),
            }
        }
        set
    }

    /// The `required` list as written: `L0, L1, judged` (`none` when empty).
    pub fn describe_required(&self) -> String {
        if self.required.is_empty() {
            return "none".into();
        }
        let names: Vec<&str> = self.required.iter().map(|r| r.name()).collect();
        names.join(", ")
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
    /// last, thresholds and dtype tolerances are finite and non-negative.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let profile = || self.name.clone();
        match self.rules.iter().position(Rule::is_catch_all) {
            None => return Err(PolicyError::NoCatchAll { profile: profile() }),
            Some(i) if i + 1 != self.rules.len() => {
                return Err(PolicyError::UnreachableRules {
                    profile: profile(),
                    catch_all: self.rules[i].describe(i),
                })
            }
            Some(_) => {}
        }
        for (key, value) in [
            ("route_near_tie_margin", self.route_near_tie_margin),
            ("argmax_near_tie_margin", self.argmax_near_tie_margin),
        ] {
            if !is_threshold(value) {
                return Err(PolicyError::Threshold {
                    profile: profile(),
                    key,
                    value,
                });
            }
        }
        for (dtype, &(rtol, atol)) in &self.dtype_tolerance {
            if let Some((key, value)) = [("rtol", rtol), ("atol", atol)]
                .into_iter()
                .find(|&(_, v)| !is_threshold(v))
            {
                return Err(PolicyError::DtypeThreshold {
                    profile: profile(),
                    key: format!("dtype_tolerance.{dtype}.{key}"),
                    value,
                });
            }
        }
        for (i, r) in self.rules.iter().enumerate() {
            if let Some((key, value)) = r.check.thresholds().into_iter().find(|(_, v)| !is_threshold(*v)) {
                return Err(PolicyError::RuleThreshold {
                    profile: profile(),
                    rule: r.describe(i),
                    key,
                    value,
                });
            }
            if matches!(r.check, Check::Logits { topk: 0, .. }) {
                return Err(PolicyError::ZeroTopk {
                    profile: profile(),
                    rule: r.describe(i),
                });
            }
        }
        Ok(())
    }
}

/// Whether `v` is a usable threshold: finite and non-negative.
fn is_threshold(v: f64) -> bool {
    v.is_finite() && v >= 0.0
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
    /// `moeconf invariance`: knob → `bitwise`, `info` or `profile:NAME`
    /// (docs/invariance.md §3); read by [`invariance_section`].
    #[serde(default)]
    invariance: BTreeMap<String, String>,
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
    required: Option<Vec<String>>,
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

/// The level called `name` (`L0`…`L4`).
fn parse_level(name: &str) -> Result<Level, PolicyError> {
    Level::from_name(name).ok_or_else(|| PolicyError::UnknownLevel { name: name.into() })
}

impl RawRule {
    /// The keys the rule sets, in the order of the file format.
    fn given_keys(&self) -> Vec<&'static str> {
        [
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
        .into_iter()
        .filter(|(_, given)| *given)
        .map(|(key, _)| key)
        .collect()
    }

    /// A key the check requires.
    fn need<T>(&self, value: Option<T>, key: &'static str) -> Result<T, PolicyError> {
        value.ok_or_else(|| PolicyError::MissingKey {
            rule: self.path.clone(),
            check: self.check.clone(),
            key,
        })
    }

    fn resolve(&self) -> Result<Rule, PolicyError> {
        let level = self.level.as_deref().map(parse_level).transpose()?;
        let kind = CheckKind::from_name(&self.check).ok_or_else(|| PolicyError::UnknownCheck {
            rule: self.path.clone(),
            check: self.check.clone(),
        })?;
        if let Some(key) = self.given_keys().into_iter().find(|k| !kind.keys().contains(k)) {
            return Err(PolicyError::KeyNotApplicable {
                rule: self.path.clone(),
                key,
                check: self.check.clone(),
            });
        }
        let check = match kind {
            CheckKind::Exact => Check::Exact,
            CheckKind::Ignore => Check::Ignore,
            CheckKind::Elementwise => Check::Elementwise {
                rtol: self.rtol,
                atol: self.atol,
            },
            CheckKind::Ulp => Check::Ulp {
                max_ulp: self.need(self.max_ulp, "max_ulp")?,
            },
            CheckKind::Aggregate => Check::Aggregate {
                cosine_min: self.need(self.cosine_min, "cosine_min")?,
                norm_ratio_tol: self.need(self.norm_ratio_tol, "norm_ratio_tol")?,
                nmse_max: self.need(self.nmse_max, "nmse_max")?,
            },
            CheckKind::Logits => Check::Logits {
                topk_overlap_min: self.need(self.topk_overlap_min, "topk_overlap_min")?,
                topk: self.topk.unwrap_or(8),
                kl_max: self.need(self.kl_max, "kl_max")?,
            },
        };
        if self.path.is_empty() {
            return Err(PolicyError::EmptyPattern);
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
    fn apply(&self, base: &mut Profile) -> Result<(), PolicyError> {
        let levels = self
            .levels
            .iter()
            .flatten()
            .map(|(level, mode)| Ok((parse_level(level)?, Mode::from_name(mode)?)))
            .collect::<Result<Vec<_>, PolicyError>>()?;
        if let Some(rules) = &self.rules {
            base.rules = rules.iter().map(RawRule::resolve).collect::<Result<_, _>>()?;
        }
        let required = self
            .required
            .as_ref()
            .map(|names| names.iter().map(|n| Requirement::from_name(n)).collect())
            .transpose()?;
        // The remaining settings override the base as the environment's do.
        Overrides {
            levels,
            equal_nan: self.equal_nan,
            route_near_tie_margin: self.route_near_tie_margin,
            argmax_near_tie_margin: self.argmax_near_tie_margin,
            required,
            ..Overrides::default()
        }
        .apply(base);
        for (name, tol) in self.dtype_tolerance.iter().flatten() {
            let d = DType::from_name(name).ok_or_else(|| PolicyError::UnknownDtype { name: name.clone() })?;
            if !d.is_float() {
                return Err(PolicyError::IntegerDtype { name: name.clone() });
            }
            base.dtype_tolerance
                .insert(d.name().to_string(), (tol.rtol, tol.atol));
        }
        Ok(())
    }
}

/// Overrides from the environment or the command line (each `None` keeps the lower source).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    pub policy: Option<PathBuf>,
    pub profile: Option<String>,
    /// Level modes.
    pub levels: Vec<(Level, Mode)>,
    pub equal_nan: Option<bool>,
    pub route_near_tie_margin: Option<f64>,
    pub argmax_near_tie_margin: Option<f64>,
    /// `required` (replaces the lower source's list as a whole).
    pub required: Option<Vec<Requirement>>,
}

impl Overrides {
    /// Reads `MOECONF_POLICY`, `MOECONF_PROFILE`, `MOECONF_LEVELS`
    /// (`L2=info,L4=tolerance`), `MOECONF_EQUAL_NAN` (`1`/`true`/`0`/`false`),
    /// `MOECONF_ROUTE_NEAR_TIE_MARGIN`, `MOECONF_ARGMAX_NEAR_TIE_MARGIN`,
    /// `MOECONF_REQUIRED` (`L0,L1,judged`, or `none`) through `get` (the process environment in the binary, a map in tests).
    /// Empty values count as unset.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Overrides, PolicyError> {
        let var = |k: &str| get(k).filter(|v| !v.is_empty());
        let num = |variable: &'static str| -> Result<Option<f64>, PolicyError> {
            var(variable)
                .map(|value| {
                    value
                        .trim()
                        .parse::<f64>()
                        .map_err(|source| PolicyError::NotANumber {
                            variable,
                            value: value.clone(),
                            source,
                        })
                })
                .transpose()
        };
        Ok(Overrides {
            policy: var("MOECONF_POLICY").map(PathBuf::from),
            profile: var("MOECONF_PROFILE"),
            levels: match var("MOECONF_LEVELS") {
                Some(value) => value
                    .split(',')
                    .map(|s| {
                        parse_level_mode(s.trim()).map_err(|e| PolicyError::EnvLevels {
                            value: value.clone(),
                            source: Box::new(e),
                        })
                    })
                    .collect::<Result<_, _>>()?,
                None => Vec::new(),
            },
            equal_nan: match var("MOECONF_EQUAL_NAN").as_deref() {
                None => None,
                Some("1" | "true") => Some(true),
                Some("0" | "false") => Some(false),
                Some(v) => return Err(PolicyError::EqualNan { value: v.into() }),
            },
            route_near_tie_margin: num("MOECONF_ROUTE_NEAR_TIE_MARGIN")?,
            argmax_near_tie_margin: num("MOECONF_ARGMAX_NEAR_TIE_MARGIN")?,
            required: var("MOECONF_REQUIRED")
                .map(|value| {
                    Requirement::parse_list(&value).map_err(|e| PolicyError::EnvRequired {
                        value: value.clone(),
                        source: Box::new(e),
                    })
                })
                .transpose()?,
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
            required: self.required.or(lower.required),
        }
    }

    /// Applies the level modes and settings given here over `profile`.
    fn apply(&self, profile: &mut Profile) {
        for &(level, mode) in &self.levels {
            profile.set_mode(level, mode);
        }
        if let Some(v) = self.equal_nan {
            profile.equal_nan = v;
        }
        if let Some(v) = self.route_near_tie_margin {
            profile.route_near_tie_margin = v;
        }
        if let Some(v) = self.argmax_near_tie_margin {
            profile.argmax_near_tie_margin = v;
        }
        if let Some(r) = &self.required {
            profile.required = r.clone();
        }
    }
}

/// Parses `L3=tolerance`.
pub fn parse_level_mode(s: &str) -> Result<(Level, Mode), PolicyError> {
    let (l, m) = s
        .split_once('=')
        .ok_or_else(|| PolicyError::LevelModeSyntax { text: s.into() })?;
    Ok((parse_level(l.trim())?, Mode::from_name(m.trim())?))
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
    File(PathBuf),
}

impl Source {
    /// `built-in defaults` or the file path.
    pub fn describe(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::BuiltIn => f.write_str("built-in defaults"),
            Source::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// The policy file to read: the one the overrides name, else `moeconf.toml`
/// at the repository root of `cwd` when it exists.
fn policy_file(o: &Overrides, cwd: &Path) -> Option<PathBuf> {
    match &o.policy {
        Some(p) => Some(p.clone()),
        None => repository_root(cwd)
            .map(|r| r.join("moeconf.toml"))
            // Anything of that name is read, so a FIFO, directory or dangling
            // link there is an error, not silently the built-in policy.
            .filter(|p| std::fs::symlink_metadata(p).is_ok()),
    }
}

/// Reads and parses a policy file.
fn read_file(path: &Path) -> Result<RawFile, GateError> {
    // A regular file only: a FIFO or device is refused by kind, never opened.
    let bytes = moeconf_output::input::read_input(path, "policy file").map_err(|e| match e.into_io() {
        Ok(source) => GateError::PolicyRead {
            path: path.to_path_buf(),
            source,
        },
        Err(e) => GateError::Input(Box::new(e)),
    })?;
    let text = String::from_utf8(bytes).map_err(|e| GateError::PolicyRead {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()),
    })?;
    toml::from_str(&text).map_err(|e| GateError::PolicySyntax {
        path: path.to_path_buf(),
        source: Box::new(e),
    })
}

/// The profile `name` of the file: the built-in profile, then the file's
/// `[profile.default]`, then `[profile.NAME]` (the built-in `strict` ignores
/// the file unless the file defines `[profile.strict]`).
fn file_profile(raw: &RawFile, name: &str, source: &Source) -> Result<Profile, GateError> {
    let mut profile = Profile::builtin(name);
    if name == "strict" && !raw.profile.contains_key("strict") {
        return Ok(profile);
    }
    let invalid = |e: PolicyError| GateError::Profile {
        policy: source.clone(),
        profile: name.into(),
        source: e,
    };
    if let Some(base) = raw.profile.get("default") {
        base.apply(&mut profile).map_err(invalid)?;
    }
    if name != "default" {
        let p = raw.profile.get(name).ok_or_else(|| GateError::NoSuchProfile {
            policy: source.clone(),
            profile: name.into(),
            defined: raw.profile.keys().cloned().collect(),
        })?;
        p.apply(&mut profile).map_err(invalid)?;
    }
    Ok(profile)
}

/// The policy's `[invariance]` section (knob → expectation text, validated
/// by `moeconf invariance`) and where it came from: the file the overrides
/// name or `moeconf.toml` at the repository root of `cwd`; empty without a
/// file.
pub fn invariance_section(
    o: &Overrides,
    cwd: &Path,
) -> Result<(BTreeMap<String, String>, Source), GateError> {
    match policy_file(o, cwd) {
        Some(p) => Ok((read_file(&p)?.invariance, Source::File(p))),
        None => Ok((BTreeMap::new(), Source::BuiltIn)),
    }
}

/// Resolves the profile: built-in defaults, then the file (given by the
/// overrides or discovered as `moeconf.toml` at the repository root of
/// `cwd`), then the overrides (environment below command line, already merged).
pub fn resolve(o: &Overrides, cwd: &Path) -> Result<(Profile, Source), GateError> {
    let (raw, source) = match policy_file(o, cwd) {
        Some(p) => (read_file(&p)?, Source::File(p)),
        None => (RawFile::default(), Source::BuiltIn),
    };
    let name = o
        .profile
        .clone()
        .or_else(|| raw.default_profile.clone())
        .unwrap_or_else(|| "default".to_string());
    let mut profile = file_profile(&raw, &name, &source)?;
    o.apply(&mut profile);
    profile.validate().map_err(|e| GateError::InvalidProfile {
        policy: source.clone(),
        source: e,
    })?;
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
[profile.cov]
required = ["L0", "judged"]
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
        // `required`: the built-in list, the file's, then the environment's.
        assert_eq!(p.describe_required(), "L0, L1, judged");
        let cov = Overrides {
            profile: Some("cov".into()),
            ..Overrides::default()
        };
        let (p, _) = resolve(&cov, &sub).unwrap();
        assert_eq!(p.describe_required(), "L0, judged");
        let env = Overrides::from_env(|k| (k == "MOECONF_REQUIRED").then(|| "none".into())).unwrap();
        let (p, _) = resolve(&env.over(cov), &sub).unwrap();
        assert!(p.required.is_empty());
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

    /// The error and its sources, as the binary prints them (`{:#}` of anyhow).
    fn chain(e: &dyn std::error::Error) -> String {
        let mut s = e.to_string();
        let mut cur = e.source();
        while let Some(c) = cur {
            s.push_str(&format!(": {c}"));
            cur = c.source();
        }
        s
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
            ("[profile.default]\nrequired = [\"L0\", \"L7\"]\n", "unknown entry \"L7\""),
            ("[profile.default]\nroute_near_tie_margin = -1.0\n", "finite number"),
            ("[profile.default.dtype_tolerance]\ni32 = { rtol = 1.0, atol = 1.0 }\n", "not a floating"),
            (
                "[profile.default.dtype_tolerance]\nbf16 = { rtol = nan, atol = 0.0 }\n",
                "dtype_tolerance.bf16.rtol must be a finite number >= 0, got NaN",
            ),
            (
                "[profile.default.dtype_tolerance]\nf32 = { rtol = 0.0, atol = -1.0 }\n",
                "dtype_tolerance.f32.atol must be a finite number >= 0, got -1",
            ),
            (
                "default_profile = \"ci\"\n[profile.ci.dtype_tolerance]\nbf16 = { rtol = inf, atol = 0.0 }\n",
                "dtype_tolerance.bf16.rtol must be a finite number >= 0, got inf",
            ),
            ("[profile.default\n", "TOML"),
        ];
        for (text, want) in cases {
            let p = write(dir.path(), text);
            let o = Overrides {
                policy: Some(p),
                ..Overrides::default()
            };
            let err = chain(&resolve(&o, dir.path()).unwrap_err());
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
        assert!(chain(&resolve(&o, dir.path()).unwrap_err()).contains("no such profile"));
        assert!(Overrides::from_env(|_| Some("x".into())).is_err());
        let e = Overrides::from_env(|k| (k == "MOECONF_REQUIRED").then(|| "L0,all".into())).unwrap_err();
        assert!(chain(&e).contains("MOECONF_REQUIRED") && chain(&e).contains("\"all\""));
        assert!(parse_level_mode("L3").is_err());
    }
}
