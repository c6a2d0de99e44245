//! The invariance matrix: which backend runs what request, the base
//! configuration, and every other configuration as values of the backend's
//! serving knobs (docs/invariance.md §2 is the file format's reference).
//!
//! A matrix is read from a TOML file or built from a preset
//! ([`crate::preset`]); either way it is validated as a whole before anything
//! runs: every knob is one the backend has, every value has that knob's type,
//! every placeholder of a command resolves for every configuration.

use crate::error::InvarianceError;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::time::Duration;

/// Largest matrix file read (bytes).
pub const MAX_MATRIX_BYTES: u64 = 1 << 20;
/// Most configurations besides the base.
pub const MAX_CONFIGURATIONS: usize = 256;
/// Most other prompts in one batch (`batch_with`).
pub const MAX_BATCH_WITH: usize = 64;
/// Longest configuration or knob name (characters).
pub const MAX_NAME_CHARS: usize = 128;
/// Default time a command configuration may take.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3600);

/// The knob name under which a configuration that changes nothing (a rerun
/// of the base) is judged.
pub const RERUN: &str = "rerun";

/// The reference runtime's knobs: worker threads, other sequences decoded in
/// the same batch, prefill chunk size.
pub const REFERENCE_KNOBS: [&str; 3] = ["threads", "batch_with", "prefill_chunk"];

/// One knob's value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(untagged)]
pub enum KnobValue {
    Int(i64),
    Bool(bool),
    Text(String),
    /// A list of strings (`batch_with`: the other prompts).
    List(Vec<String>),
}

impl fmt::Display for KnobValue {
    /// The value as a command-line argument (lists: their length, for names).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KnobValue::Int(n) => write!(f, "{n}"),
            KnobValue::Bool(b) => write!(f, "{b}"),
            KnobValue::Text(s) => f.write_str(s),
            KnobValue::List(v) => write!(f, "[{} item{}]", v.len(), if v.len() == 1 { "" } else { "s" }),
        }
    }
}

/// Knob name → value.
pub type Knobs = BTreeMap<String, KnobValue>;

/// What runs each configuration.
#[derive(Debug, Clone, PartialEq)]
pub enum Backend {
    /// moeconf's reference runtime, in this process: the model is loaded once.
    Reference(ReferenceRun),
    /// Any command that writes a moeconf trace (a capture of transformers,
    /// llama.cpp, vLLM, …), run once per configuration.
    Command(CommandRun),
}

impl Backend {
    /// `reference` or `command`.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Reference(_) => "reference",
            Backend::Command(_) => "command",
        }
    }
}

/// The request the reference runtime traces under every configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceRun {
    /// `builtin:NAME` or a checkpoint directory.
    pub model: String,
    pub prompt: String,
    pub max_new_tokens: u32,
    /// Precision profile name.
    pub precision: String,
    /// Capture specification (as `moeconf run --capture`).
    pub capture: String,
}

/// A command template run once per configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandRun {
    /// Program and arguments; `{output}` (required) is the trace to write,
    /// `{NAME}` a knob's value or a `[run]` value (`model`, `prompt`,
    /// `max_new_tokens`); `{{` and `}}` are literal braces.
    pub argv: Vec<String>,
    /// Environment variables set for the command (values are templates too).
    pub env: BTreeMap<String, String>,
    /// `[run]` values usable as placeholders.
    pub values: Knobs,
    /// Longest time one configuration may take.
    pub timeout: Duration,
}

/// One configuration: its name and every knob's value (the base's, overridden).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Configuration {
    pub name: String,
    /// Every knob's value in this configuration.
    pub knobs: Knobs,
    /// The knobs whose value differs from the base's (sorted).
    pub changed: Vec<String>,
}

/// A validated matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    pub backend: Backend,
    pub base: Configuration,
    pub configs: Vec<Configuration>,
    /// Compare traces whose bindings differ (the differences are reported).
    pub force: bool,
    /// Knob → expectation text from the matrix's `[expect]` table (the
    /// policy's `[invariance]` section overrides it, [`crate::expect`]).
    pub expect: BTreeMap<String, String>,
    /// Where the matrix came from: the file, or `preset NAME`.
    pub source: String,
}

/// Overrides of `[run]` values from the command line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunOverrides {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub max_new_tokens: Option<u32>,
    pub precision: Option<String>,
}

// ----- the file ------------------------------------------------------------

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatrix {
    run: RawRun,
    #[serde(default)]
    base: BTreeMap<String, toml::Value>,
    #[serde(default)]
    config: Vec<BTreeMap<String, toml::Value>>,
    #[serde(default)]
    expect: BTreeMap<String, String>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRun {
    backend: String,
    model: Option<String>,
    prompt: Option<String>,
    max_new_tokens: Option<u32>,
    precision: Option<String>,
    capture: Option<String>,
    command: Option<Vec<String>>,
    env: Option<BTreeMap<String, String>>,
    timeout_seconds: Option<u64>,
    force: Option<bool>,
}

/// Reads and validates the matrix file at `path`.
pub fn read(path: &Path, o: &RunOverrides) -> Result<Matrix, InvarianceError> {
    let file = || path.display().to_string();
    let meta = moeconf_output::input::check_input(path, "matrix file")?;
    if meta.len() > MAX_MATRIX_BYTES {
        return Err(InvarianceError::Matrix {
            source_name: file(),
            message: format!("{} bytes, more than the limit of {MAX_MATRIX_BYTES}", meta.len()),
        });
    }
    let bytes = moeconf_output::input::read_input(path, "matrix file")?;
    if bytes.len() as u64 > MAX_MATRIX_BYTES {
        return Err(InvarianceError::Matrix {
            source_name: file(),
            message: format!("more than {MAX_MATRIX_BYTES} bytes"),
        });
    }
    let text = String::from_utf8(bytes).map_err(|e| InvarianceError::Matrix {
        source_name: file(),
        message: format!("not UTF-8: {}", e.utf8_error()),
    })?;
    parse(&text, &file(), o)
}

/// Parses and validates matrix text; `source_name` names it in errors.
pub fn parse(text: &str, source_name: &str, o: &RunOverrides) -> Result<Matrix, InvarianceError> {
    let err = |message: String| InvarianceError::Matrix {
        source_name: source_name.to_string(),
        message,
    };
    let raw: RawMatrix = toml::from_str(text).map_err(|e| err(e.to_string()))?;
    let r = raw.run;
    let model = o.model.clone().or(r.model);
    let prompt = o.prompt.clone().or(r.prompt);
    let max_new_tokens = o.max_new_tokens.or(r.max_new_tokens);
    let precision = o.precision.clone().or(r.precision);
    let backend = match r.backend.as_str() {
        "reference" => {
            for (key, given) in [
                ("command", r.command.is_some()),
                ("env", r.env.is_some()),
                ("timeout_seconds", r.timeout_seconds.is_some()),
            ] {
                if given {
                    return Err(err(format!("[run] {key} applies to backend = \"command\" only")));
                }
            }
            Backend::Reference(ReferenceRun {
                model: model.unwrap_or_else(|| "builtin:tiny-v4".into()),
                prompt: prompt.ok_or_else(|| err("[run] prompt is required (or --prompt)".into()))?,
                max_new_tokens: max_new_tokens.unwrap_or(8),
                precision: precision.unwrap_or_else(|| "bf16".into()),
                capture: r.capture.unwrap_or_else(|| "all".into()),
            })
        }
        "command" => {
            for (key, given) in [
                ("precision", precision.is_some()),
                ("capture", r.capture.is_some()),
            ] {
                if given {
                    return Err(err(format!(
                        "[run] {key} applies to backend = \"reference\" only (pass it in the command)"
                    )));
                }
            }
            let argv = r
                .command
                .ok_or_else(|| err("[run] command is required for backend = \"command\"".into()))?;
            let mut values = Knobs::new();
            if let Some(m) = model {
                values.insert("model".into(), KnobValue::Text(m));
            }
            if let Some(p) = prompt {
                values.insert("prompt".into(), KnobValue::Text(p));
            }
            if let Some(n) = max_new_tokens {
                values.insert("max_new_tokens".into(), KnobValue::Int(n.into()));
            }
            Backend::Command(CommandRun {
                argv,
                env: r.env.unwrap_or_default(),
                values,
                timeout: r
                    .timeout_seconds
                    .map(Duration::from_secs)
                    .unwrap_or(DEFAULT_TIMEOUT),
            })
        }
        other => {
            return Err(err(format!(
                "[run] backend {other:?}: expected \"reference\" or \"command\""
            )))
        }
    };
    let base = knobs_of("[base]", raw.base).map_err(&err)?;
    let mut configs = Vec::with_capacity(raw.config.len().min(MAX_CONFIGURATIONS));
    for (i, mut table) in raw.config.into_iter().enumerate() {
        let at = format!("[[config]] #{}", i + 1);
        let name = match table.remove("name") {
            None => None,
            Some(toml::Value::String(s)) => Some(s),
            Some(_) => return Err(err(format!("{at}: name must be a string"))),
        };
        let knobs = knobs_of(&at, table).map_err(&err)?;
        configs.push((name, knobs));
    }
    build(
        backend,
        base,
        configs,
        r.force.unwrap_or(false),
        raw.expect,
        source_name,
    )
}

/// Validates and assembles a matrix (files and presets alike).
pub(crate) fn build(
    backend: Backend,
    base_knobs: Knobs,
    configs: Vec<(Option<String>, Knobs)>,
    force: bool,
    expect: BTreeMap<String, String>,
    source_name: &str,
) -> Result<Matrix, InvarianceError> {
    let err = |message: String| InvarianceError::Matrix {
        source_name: source_name.to_string(),
        message,
    };
    if configs.is_empty() {
        return Err(err(
            "no [[config]]: the matrix compares at least one configuration with the base".into(),
        ));
    }
    if configs.len() > MAX_CONFIGURATIONS {
        return Err(err(format!(
            "{} configurations, more than the limit of {MAX_CONFIGURATIONS}",
            configs.len()
        )));
    }
    let defaults = match &backend {
        Backend::Reference(_) => reference_defaults(),
        Backend::Command(_) => Knobs::new(),
    };
    let mut base = defaults;
    base.extend(base_knobs);
    check_knobs(&backend, "[base]", &base).map_err(&err)?;
    let base = Configuration {
        name: "base".into(),
        knobs: base,
        changed: Vec::new(),
    };
    let mut out: Vec<Configuration> = Vec::with_capacity(configs.len());
    for (i, (name, knobs)) in configs.into_iter().enumerate() {
        for key in knobs.keys() {
            if !base.knobs.contains_key(key) && matches!(backend, Backend::Command(_)) {
                return Err(err(format!(
                    "[[config]] #{}: knob {key:?} has no value in [base] (every configuration's knobs are set in the base too)",
                    i + 1
                )));
            }
        }
        let mut all = base.knobs.clone();
        all.extend(knobs);
        let changed: Vec<String> = all
            .iter()
            .filter(|(k, v)| base.knobs.get(*k) != Some(*v))
            .map(|(k, _)| k.clone())
            .collect();
        let name = match name {
            Some(n) => n,
            None if changed.is_empty() => RERUN.to_string(),
            None => changed
                .iter()
                .map(|k| format!("{k}={}", all[k]))
                .collect::<Vec<_>>()
                .join(" "),
        };
        let at = format!("[[config]] {name:?}");
        check_name(&name).map_err(|m| err(format!("{at}: {m}")))?;
        if name == "base" || out.iter().any(|c| c.name == name) {
            return Err(err(format!(
                "{at}: the name is used twice (\"base\" names the base)"
            )));
        }
        check_knobs(&backend, &at, &all).map_err(&err)?;
        out.push(Configuration {
            name,
            knobs: all,
            changed,
        });
    }
    if let Backend::Command(c) = &backend {
        if !c.argv.iter().any(|a| a.contains("{output}")) {
            return Err(err(
                "[run] command must contain {output}: the trace it writes".into()
            ));
        }
        if c.argv.is_empty() || c.argv[0].is_empty() {
            return Err(err("[run] command is empty".into()));
        }
        for cfg in std::iter::once(&base).chain(&out) {
            crate::command::render(c, &cfg.knobs, Path::new("OUT"))
                .map_err(|m| err(format!("configuration {:?}: {m}", cfg.name)))?;
        }
    }
    for key in expect.keys() {
        check_knob_name(key).map_err(|m| err(format!("[expect] {key:?}: {m}")))?;
    }
    Ok(Matrix {
        backend,
        base,
        configs: out,
        force,
        expect,
        source: source_name.to_string(),
    })
}

/// The reference runtime's knob values when the base does not set them:
/// one thread, a batch of one, the prompt in one piece.
fn reference_defaults() -> Knobs {
    Knobs::from([
        ("threads".to_string(), KnobValue::Int(1)),
        ("batch_with".to_string(), KnobValue::List(Vec::new())),
        ("prefill_chunk".to_string(), KnobValue::Text("all".into())),
    ])
}

/// Converts a TOML table of knobs.
fn knobs_of(at: &str, table: BTreeMap<String, toml::Value>) -> Result<Knobs, String> {
    table
        .into_iter()
        .map(|(k, v)| {
            check_knob_name(&k).map_err(|m| format!("{at} knob {k:?}: {m}"))?;
            let value = match v {
                toml::Value::Integer(n) => KnobValue::Int(n),
                toml::Value::Boolean(b) => KnobValue::Bool(b),
                toml::Value::String(s) => KnobValue::Text(s),
                toml::Value::Array(items) => KnobValue::List(
                    items
                        .into_iter()
                        .map(|i| match i {
                            toml::Value::String(s) => Ok(s),
                            other => Err(format!(
                                "{at} knob {k:?}: a list holds strings only, not {}",
                                other.type_str()
                            )),
                        })
                        .collect::<Result<_, _>>()?,
                ),
                other => {
                    return Err(format!(
                        "{at} knob {k:?}: expected an integer, boolean, string or list of strings, not {}",
                        other.type_str()
                    ))
                }
            };
            Ok((k, value))
        })
        .collect()
}

/// A knob name: `[A-Za-z_][A-Za-z0-9_]*`, at most [`MAX_NAME_CHARS`].
pub(crate) fn check_knob_name(k: &str) -> Result<(), String> {
    let mut chars = k.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') || k.len() > MAX_NAME_CHARS {
        return Err(format!(
            "a knob name is a letter or _ followed by letters, digits or _, at most {MAX_NAME_CHARS} characters"
        ));
    }
    Ok(())
}

/// A configuration name: printable, not empty, at most [`MAX_NAME_CHARS`].
fn check_name(n: &str) -> Result<(), String> {
    if n.trim().is_empty() {
        return Err("an empty name".into());
    }
    if n.chars().count() > MAX_NAME_CHARS {
        return Err(format!("a name longer than {MAX_NAME_CHARS} characters"));
    }
    if n.chars().any(|c| c.is_control()) {
        return Err("a name with a control character".into());
    }
    Ok(())
}

/// Checks that every knob is one the backend has, with a value of its type.
fn check_knobs(backend: &Backend, at: &str, knobs: &Knobs) -> Result<(), String> {
    match backend {
        Backend::Reference(_) => {
            for (k, v) in knobs {
                match (k.as_str(), v) {
                    ("threads", KnobValue::Int(n)) if *n >= 1 => {}
                    ("threads", _) => return Err(format!("{at}: threads must be an integer of at least 1")),
                    ("batch_with", KnobValue::List(p)) => {
                        if p.len() > MAX_BATCH_WITH {
                            return Err(format!(
                                "{at}: batch_with holds {} prompts, more than the limit of {MAX_BATCH_WITH}",
                                p.len()
                            ));
                        }
                        if p.iter().any(|s| s.is_empty()) {
                            return Err(format!("{at}: batch_with holds an empty prompt"));
                        }
                    }
                    ("batch_with", _) => {
                        return Err(format!("{at}: batch_with must be a list of prompts (strings)"))
                    }
                    ("prefill_chunk", KnobValue::Int(n)) if *n >= 1 && *n <= i64::from(u32::MAX) => {}
                    ("prefill_chunk", KnobValue::Text(s)) if s == "all" => {}
                    ("prefill_chunk", _) => {
                        return Err(format!(
                            "{at}: prefill_chunk must be a token count of at least 1, or \"all\""
                        ))
                    }
                    _ => {
                        return Err(format!(
                            "{at}: the reference runtime has no knob {k:?} (its knobs: {})",
                            REFERENCE_KNOBS.join(", ")
                        ))
                    }
                }
            }
        }
        Backend::Command(_) => {
            for (k, v) in knobs {
                if let KnobValue::List(_) = v {
                    return Err(format!(
                        "{at}: knob {k:?} is a list; a command's knobs are integers, booleans or strings"
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(text: &str) -> Matrix {
        parse(text, "m.toml", &RunOverrides::default()).unwrap()
    }

    fn parse_err(text: &str) -> String {
        parse(text, "m.toml", &RunOverrides::default())
            .unwrap_err()
            .to_string()
    }

    const REF: &str = "[run]\nbackend = \"reference\"\nprompt = \"why the sheep\"\n";

    #[test]
    fn reference_configurations_inherit_the_base_and_name_what_they_change() {
        let m = parse_ok(&format!(
            "{REF}[base]\nthreads = 1\n[[config]]\nthreads = 2\n[[config]]\nname = \"batch of 3\"\nbatch_with = [\"a\", \"b\"]\nprefill_chunk = 2\n[[config]]\n"
        ));
        assert_eq!(m.configs.len(), 3);
        assert_eq!(m.configs[0].name, "threads=2");
        assert_eq!(m.configs[0].changed, vec!["threads"]);
        assert_eq!(m.configs[1].name, "batch of 3");
        assert_eq!(m.configs[1].changed, vec!["batch_with", "prefill_chunk"]);
        assert_eq!(m.configs[1].knobs["threads"], KnobValue::Int(1));
        assert_eq!(m.configs[2].name, RERUN);
        assert!(m.configs[2].changed.is_empty());
    }

    #[test]
    fn a_value_equal_to_the_base_is_not_a_change() {
        let m = parse_ok(&format!(
            "{REF}[base]\nthreads = 2\n[[config]]\nthreads = 2\nprefill_chunk = 1\n"
        ));
        assert_eq!(m.configs[0].changed, vec!["prefill_chunk"]);
    }

    #[test]
    fn bad_matrices_are_refused_with_what_is_wrong() {
        assert!(parse_err(REF).contains("no [[config]]"));
        assert!(parse_err(&format!("{REF}[[config]]\nthread = 2\n")).contains("no knob \"thread\""));
        assert!(parse_err(&format!("{REF}[[config]]\nthreads = 0\n")).contains("at least 1"));
        assert!(parse_err(&format!("{REF}[[config]]\nthreads = \"2\"\n")).contains("integer"));
        assert!(parse_err(&format!("{REF}[[config]]\nprefill_chunk = \"some\"\n")).contains("\"all\""));
        assert!(parse_err(&format!("{REF}[[config]]\nbatch_with = [1]\n")).contains("strings only"));
        assert!(parse_err(&format!("{REF}[[config]]\nbatch_with = [\"\"]\n")).contains("empty prompt"));
        assert!(parse_err(&format!(
            "{REF}[[config]]\nthreads = 2\n[[config]]\nthreads = 2\n"
        ))
        .contains("used twice"));
        assert!(
            parse_err(&format!("{REF}[[config]]\nname = \"base\"\nthreads = 2\n")).contains("used twice")
        );
        assert!(
            parse_err(&format!("{REF}[[config]]\nname = \"a\\u0007\"\nthreads = 2\n")).contains("control")
        );
        assert!(
            parse_err("[run]\nbackend = \"reference\"\n[[config]]\nthreads = 2\n")
                .contains("prompt is required")
        );
        assert!(parse_err("[run]\nbackend = \"gpu\"\nprompt = \"x\"\n[[config]]\n").contains("\"gpu\""));
        assert!(parse_err(&format!("{REF}command = [\"x\"]\n[[config]]\n")).contains("command\" only"));
        assert!(parse_err(&format!("{REF}bogus = 1\n[[config]]\n")).contains("bogus"));
        assert!(parse_err(&format!("{REF}[[config]]\n\"bad-knob\" = 1\n")).contains("knob name"));
        assert!(parse_err(&format!("{REF}[[config]]\nthreads = 1.5\n")).contains("not float"));
        let many: String = (0..=MAX_CONFIGURATIONS)
            .map(|i| format!("[[config]]\nname = \"c{i}\"\n"))
            .collect();
        assert!(parse_err(&format!("{REF}{many}")).contains("more than the limit"));
        let wide = format!("[{}]", vec!["\"p\""; MAX_BATCH_WITH + 1].join(","));
        assert!(parse_err(&format!("{REF}[[config]]\nbatch_with = {wide}\n")).contains("more than the limit"));
    }

    const CMD: &str = "[run]\nbackend = \"command\"\nmodel = \"/m\"\ncommand = [\"cap\", \"{model}\", \"--threads\", \"{threads}\", \"-o\", \"{output}\"]\n";

    #[test]
    fn a_command_matrix_checks_every_placeholder_before_running() {
        let m = parse_ok(&format!("{CMD}[base]\nthreads = 1\n[[config]]\nthreads = 4\n"));
        assert_eq!(m.configs[0].name, "threads=4");
        assert!(parse_err(&format!("{CMD}[[config]]\nthreads = 4\n")).contains("no value in [base]"));
        let no_output = "[run]\nbackend = \"command\"\ncommand = [\"cap\"]\n[[config]]\n";
        assert!(parse_err(no_output).contains("{output}"));
        let unknown =
            "[run]\nbackend = \"command\"\ncommand = [\"cap\", \"{nope}\", \"{output}\"]\n[[config]]\n";
        assert!(parse_err(unknown).contains("{nope}"));
        assert!(parse_err(&format!("{CMD}[base]\nthreads = [\"1\"]\n[[config]]\n")).contains("is a list"));
        assert!(parse_err(&format!(
            "{CMD}precision = \"bf16\"\n[base]\nthreads = 1\n[[config]]\n"
        ))
        .contains("reference\" only"));
    }

    #[test]
    fn overrides_from_the_command_line_win() {
        let o = RunOverrides {
            prompt: Some("other".into()),
            max_new_tokens: Some(3),
            ..RunOverrides::default()
        };
        let m = parse(&format!("{REF}[[config]]\nthreads = 2\n"), "m", &o).unwrap();
        match m.backend {
            Backend::Reference(r) => {
                assert_eq!(r.prompt, "other");
                assert_eq!(r.max_new_tokens, 3);
                assert_eq!(r.model, "builtin:tiny-v4");
            }
            _ => panic!("reference backend expected"),
        }
    }
}
