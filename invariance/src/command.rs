//! The command backend: a capture command run once per configuration, with
//! the configuration's knob values substituted into its arguments and
//! environment. The command is run directly (no shell), so a value is one
//! argument whatever characters it holds.

use crate::matrix::{CommandRun, KnobValue, Knobs};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A command with its placeholders filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// Substitutes `{NAME}` in `template`: `output` is `out`, then the
/// configuration's knobs, then the `[run]` values; `{{`/`}}` are braces.
fn fill(template: &str, c: &CommandRun, knobs: &Knobs, out: &Path) -> Result<String, String> {
    let mut s = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(i) = rest.find(['{', '}']) {
        s.push_str(&rest[..i]);
        let tail = &rest[i..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            s.push_str(&tail[..1]);
            rest = &tail[2..];
            continue;
        }
        if tail.starts_with('}') {
            return Err(format!("{template:?}: a lone }} (write }}}} for a brace)"));
        }
        let end = tail
            .find('}')
            .ok_or_else(|| format!("{template:?}: a {{ without its }}"))?;
        let name = &tail[1..end];
        let value = if name == "output" {
            out.to_str()
                .ok_or_else(|| format!("the output path {} is not UTF-8", out.display()))?
                .to_string()
        } else {
            match knobs.get(name).or_else(|| c.values.get(name)) {
                Some(KnobValue::List(_)) => {
                    return Err(format!("{{{name}}} is a list; a command takes scalars"))
                }
                Some(v) => v.to_string(),
                None => {
                    let mut known: Vec<&str> =
                        knobs.keys().chain(c.values.keys()).map(String::as_str).collect();
                    known.push("output");
                    return Err(format!(
                        "{template:?}: {{{name}}} is neither a knob nor a [run] value (known: {})",
                        known.join(", ")
                    ));
                }
            }
        };
        s.push_str(&value);
        rest = &tail[end + 1..];
    }
    s.push_str(rest);
    Ok(s)
}

/// The command of one configuration writing its trace to `out`.
pub fn render(c: &CommandRun, knobs: &Knobs, out: &Path) -> Result<Rendered, String> {
    let argv = c
        .argv
        .iter()
        .map(|a| fill(a, c, knobs, out))
        .collect::<Result<Vec<_>, _>>()?;
    let env = c
        .env
        .iter()
        .map(|(k, v)| {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(format!("environment variable name {k:?}"));
            }
            Ok((k.clone(), fill(v, c, knobs, out)?))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if argv
        .iter()
        .chain(env.iter().map(|(_, v)| v))
        .any(|a| a.contains('\0'))
    {
        return Err("a NUL character in the command".into());
    }
    Ok(Rendered { argv, env })
}

/// How a command ended when it did not write a trace.
#[derive(Debug)]
pub struct Failed {
    pub reason: String,
    /// The last lines of its output.
    pub tail: String,
}

/// Runs `r` with stdout and stderr going to `log`; waits at most `timeout`
/// (then kills it). Ok when it exited with status 0.
pub fn execute(r: &Rendered, log: &Path, timeout: Duration) -> Result<(), Failed> {
    let fail = |reason: String| Failed {
        reason,
        tail: tail_of(log),
    };
    let file =
        std::fs::File::create(log).map_err(|e| fail(format!("creating the log {}: {e}", log.display())))?;
    let err_file = file
        .try_clone()
        .map_err(|e| fail(format!("creating the log {}: {e}", log.display())))?;
    let mut cmd = Command::new(&r.argv[0]);
    cmd.args(&r.argv[1..])
        .envs(r.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err_file);
    let mut child = cmd
        .spawn()
        .map_err(|e| fail(format!("starting {:?}: {e}", r.argv[0])))?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(fail(format!("{:?} ended with {status}", r.argv[0]))),
            Ok(None) if start.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!(
                    "{:?} did not end within {} s and was stopped",
                    r.argv[0],
                    timeout.as_secs()
                )));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(fail(format!("waiting for {:?}: {e}", r.argv[0]))),
        }
    }
}

/// The last 2 KiB of `log`, for error messages.
fn tail_of(log: &Path) -> String {
    let Ok(mut f) = std::fs::File::open(log) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(2048)));
    let mut buf = Vec::with_capacity(2048);
    let _ = f.take(2048).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(argv: &[&str]) -> CommandRun {
        CommandRun {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: [("OMP_NUM_THREADS".to_string(), "{threads}".to_string())].into(),
            values: Knobs::from([("model".to_string(), KnobValue::Text("/m dir".into()))]),
            timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn placeholders_are_filled_as_single_arguments() {
        let c = run(&["cap", "{model}", "--t={threads}", "{{x}}", "-o", "{output}"]);
        let knobs = Knobs::from([("threads".to_string(), KnobValue::Int(2))]);
        let r = render(&c, &knobs, Path::new("/o/t.bin")).unwrap();
        assert_eq!(r.argv, ["cap", "/m dir", "--t=2", "{x}", "-o", "/o/t.bin"]);
        assert_eq!(r.env, [("OMP_NUM_THREADS".to_string(), "2".to_string())]);
    }

    #[test]
    fn bad_templates_are_refused() {
        let knobs = Knobs::new();
        let out = Path::new("o");
        assert!(render(&run(&["cap", "{x"]), &knobs, out)
            .unwrap_err()
            .contains("without"));
        assert!(render(&run(&["cap", "x}"]), &knobs, out)
            .unwrap_err()
            .contains("lone"));
        // {threads} in env has no value.
        assert!(render(&run(&["cap"]), &knobs, out)
            .unwrap_err()
            .contains("{threads}"));
    }

    #[cfg(unix)]
    #[test]
    fn a_failing_or_slow_command_reports_why_with_its_output() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        let r = Rendered {
            argv: vec!["sh".into(), "-c".into(), "echo broken >&2; exit 3".into()],
            env: vec![],
        };
        let e = execute(&r, &log, Duration::from_secs(30)).unwrap_err();
        assert!(e.reason.contains("3"), "{}", e.reason);
        assert!(e.tail.contains("broken"));
        let slow = Rendered {
            argv: vec!["sleep".into(), "30".into()],
            env: vec![],
        };
        let e = execute(&slow, &log, Duration::from_millis(200)).unwrap_err();
        assert!(e.reason.contains("stopped"), "{}", e.reason);
        let ok = Rendered {
            argv: vec!["true".into()],
            env: vec![],
        };
        assert!(execute(&ok, &log, Duration::from_secs(30)).is_ok());
    }
}
