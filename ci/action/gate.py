#!/usr/bin/env python3
"""The script of moeconf's GitHub Action (`action.yml` at the repository root; docs/ci.md §9).

Runs `moeconf gate` on a candidate trace against a reference trace or a blessed baseline (or
blesses a baseline), appends the Markdown report to the job summary ($GITHUB_STEP_SUMMARY), writes
the reports (Markdown, JUnit XML, JSON, HTML) into the report directory for the artifact step,
sets the step outputs ($GITHUB_OUTPUT), annotates the run with the reason on a failure or an
error, and exits with moeconf's exit code (0 pass, 1 fail, 2 error: docs/ci.md §1).

Inputs arrive as environment variables (`MOECONF_ACTION_*`, set by action.yml's `env:`), never
as text interpolated into a shell script, and every user string (trace, baseline and policy file
names, profile names, moeconf's own messages) reaches the log, the summary, the outputs and the
annotations escaped for where it goes:

* log: moeconf's stdout and stderr, and every line of ours that holds a user string, are printed
  between `::stop-commands::TOKEN` and `::TOKEN::` (a random token), so a file name holding
  `::error::` or `##[` cannot issue a workflow command;
* annotations: `%`, CR and LF percent-encoded in the message, and `:` and `,` too in the title
  (the workflow-command rules), so a message is one command line;
* outputs: `name<<DELIMITER` blocks with a random delimiter absent from the value;
* summary: moeconf's own Markdown report as it writes it (docs/ci.md §5 escapes every name), and
  our own lines with names as code spans whose fence outgrows any backtick run inside, other
  text with Markdown and HTML punctuation escaped, messages in a fenced block whose fence
  outgrows any backtick run inside (the rules of moeconf_output::escape, ported below).

Python 3.9 or later, standard library only.
"""

import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile

# The repository root: the action's directory ($GITHUB_ACTION_PATH), two levels above this file.
ACTION_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# GitHub refuses a step summary above 1 MiB; a larger report is left to the artifact.
SUMMARY_LIMIT = 1024 * 1024 - 4096

# File names in the report directory.
FILES = {
    "report": "gate.md",
    "junit": "gate.xml",
    "json": "gate.json",
    "html": "gate.html",
    "baseline": "baseline.json",
}


# Options of `moeconf gate` that only the action sets: given in extra-args they could write files
# (a --bless over the committed baseline), change what the exit code means or redirect a report.
RESERVED_FLAGS = frozenset(["--bless", "--baseline", "--output", "--format", "--junit", "--html",
                            "--bisect-exit-codes"])


class Failure(Exception):
    """An error of the action itself (its inputs, installing moeconf): exit 2, no verdict."""


def env(name, default=""):
    """The input `name` (MOECONF_ACTION_NAME); empty means unset."""
    v = os.environ.get("MOECONF_ACTION_" + name, "")
    return v if v != "" else default


# --- Escaping ------------------------------------------------------------------------------------


def _hidden(c):
    """A control character (C0, DEL, C1) or a Unicode bidi control (moeconf_output::escape)."""
    o = ord(c)
    return o < 0x20 or 0x7F <= o <= 0x9F or 0x202A <= o <= 0x202E or 0x2066 <= o <= 0x2069


def _visible(c):
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}.get(c, "\\u{%x}" % ord(c))


def visible(s, keep=""):
    """`s` with every hidden character not in `keep` in its visible (Rust escape) form."""
    return "".join(_visible(c) if _hidden(c) and c not in keep else c for c in s)


def md_code(s, cell=False):
    """`s` as a Markdown code span (moeconf_output::escape::md_code)."""
    body = visible(s)
    if cell and "|" in body:
        out, run = [], 0
        for c in body:
            if c == "\\":
                run += 1
            elif c == "|":
                out.append("\\" * (2 * run + 1) + "|")
                run = 0
            else:
                out.append("\\" * run + c)
                run = 0
        out.append("\\" * run)
        body = "".join(out)
    if not body:
        return "` `"
    longest = max(len(r) for r in "".join(c if c == "`" else " " for c in body).split(" "))
    fence = "`" * (longest + 1)
    pad = (body.startswith("`") or body.endswith("`")
           or (body.startswith(" ") and body.endswith(" ") and body.strip(" ") != ""))
    sp = " " if pad else ""
    return fence + sp + body + sp + fence


def md_text(s, cell=False):
    """`s` as plain Markdown text (moeconf_output::escape::md_text)."""
    out = []
    for c in s:
        if c == "&":
            out.append("&amp;")
        elif c == "<":
            out.append("&lt;")
        elif c == ">":
            out.append("&gt;")
        elif c in "\\`*_~[]":
            out.append("\\" + c)
        elif c == "|" and cell:
            out.append("\\|")
        elif _hidden(c):
            out.append(_visible(c))
        else:
            out.append(c)
    return "".join(out)


def md_block(s):
    """`s` as a fenced code block whose fence outgrows every backtick run inside (so no line of
    `s` can close it); hidden characters but newline and tab in their visible form."""
    body = visible(s, keep="\n\t").rstrip("\n")
    longest = max(len(r) for r in "".join(c if c == "`" else " " for c in body).split(" ") + [""])
    fence = "`" * max(3, longest + 1)
    return "%stext\n%s\n%s\n" % (fence, body, fence)


def command_data(s):
    """A workflow command's message: `%`, CR and LF percent-encoded (one line)."""
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def command_property(s):
    """A workflow command's property value: as `command_data`, and `:` and `,` too."""
    return command_data(s).replace(":", "%3A").replace(",", "%2C")


# --- The runner's files and log ------------------------------------------------------------------


def emit(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def log(text):
    """Prints `text` (which may hold user strings) with workflow commands stopped."""
    if not text:
        return
    token = secrets.token_hex(16)
    emit("::stop-commands::" + token)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    emit("::%s::" % token)


def annotate(kind, title, message):
    """An `error` or `warning` annotation: one workflow command line."""
    emit("::%s title=%s::%s" % (kind, command_property(title), command_data(message)))


def set_output(name, value):
    """Appends `name` = `value` to $GITHUB_OUTPUT with a delimiter absent from `value`."""
    path = os.environ.get("GITHUB_OUTPUT", "")
    if not path:
        return
    delimiter = "ghadelimiter_" + secrets.token_hex(16)
    while delimiter in value:
        delimiter = "ghadelimiter_" + secrets.token_hex(16)
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write("%s<<%s\n%s\n%s\n" % (name, delimiter, value, delimiter))
    except OSError as e:
        # The verdict stands (the exit code carries it): a broken output file is a warning.
        annotate("warning", "moeconf gate: outputs not set", visible(str(e)))


def add_summary(markdown):
    """Appends `markdown` to $GITHUB_STEP_SUMMARY (when the runner gives one)."""
    path = os.environ.get("GITHUB_STEP_SUMMARY", "")
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(markdown if markdown.endswith("\n") else markdown + "\n")
    except OSError as e:
        annotate("warning", "moeconf gate: no job summary", visible(str(e)))


# --- moeconf -------------------------------------------------------------------------------------


def run_logged(argv, title):
    """Runs `argv` in a log group with workflow commands stopped; returns its exit code."""
    emit("::group::" + command_data(title))
    token = secrets.token_hex(16)
    emit("::stop-commands::" + token)
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL).returncode
    except OSError as e:
        sys.stdout.write("%s\n" % e)
        return 127
    finally:
        sys.stdout.flush()
        emit("::%s::" % token)
        emit("::endgroup::")


def install(how, temp):
    """Installs moeconf from the action's own sources; returns the binary's path."""
    exe = "moeconf.exe" if os.name == "nt" else "moeconf"
    if how == "cargo":
        root = os.path.join(temp, "moeconf-action-cargo")
        argv = ["cargo", "install", "--locked", "--path", os.path.join(ACTION_ROOT, "cli"), "--root", root]
        binary = os.path.join(root, "bin", exe)
        steps = [argv]
    elif how == "pip":
        if not os.path.isfile(os.path.join(ACTION_ROOT, "pyproject.toml")):
            raise Failure("install: pip needs the wheel's pyproject.toml at the action's root, which this "
                          "version of the action lacks: use install: cargo")
        venv = os.path.join(temp, "moeconf-action-venv")
        bindir = os.path.join(venv, "Scripts" if os.name == "nt" else "bin")
        python = os.path.join(bindir, "python.exe" if os.name == "nt" else "python")
        # A virtual environment: the system Python of a runner may refuse `pip install` (PEP 668).
        steps = [[sys.executable, "-m", "venv", venv],
                 [python, "-m", "pip", "install", "--disable-pip-version-check", ACTION_ROOT]]
        binary = os.path.join(bindir, exe)
    else:
        raise Failure("install: %r is not one of none, cargo, pip" % how)
    for argv in steps:
        code = run_logged(argv, "install moeconf (%s): %s" % (how, " ".join(shlex.quote(a) for a in argv)))
        if code != 0:
            raise Failure("install: %s exited %d (its output is in the log above)" % (argv[0], code))
    if not os.path.isfile(binary):
        raise Failure("install: %s did not install %s" % (how, binary))
    return binary


def find_binary(name):
    if os.sep in name or (os.altsep and os.altsep in name):
        if os.path.isfile(name) and os.access(name, os.X_OK):
            return os.path.abspath(name)
        raise Failure("moeconf: %s is not an executable file (input moeconf)" % name)
    found = shutil.which(name)
    if not found:
        raise Failure("moeconf: %s is not on PATH: install it (input install: cargo or pip) or give "
                      "its path (input moeconf)" % name)
    return found


def run_moeconf(argv):
    """Runs moeconf, capturing its output; returns (exit code, stdout, stderr)."""
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True)
    except OSError as e:
        raise Failure("moeconf: cannot run %s: %s" % (argv[0], e))
    out = p.stdout.decode("utf-8", "replace")
    err = p.stderr.decode("utf-8", "replace")
    return p.returncode, out, err


def describe_location(at, level=True):
    """`L4 step 1 pos 5 (decode) layer 5 moe.combine` from a gate JSON location."""
    if not isinstance(at, dict):
        return ""
    s = "%sstep %s pos %s" % ("%s " % at.get("level") if level else "", at.get("step"), at.get("position"))
    if at.get("phase") is not None:
        s += " (%s)" % at.get("phase")
    if at.get("layer") is not None:
        s += " layer %s" % at.get("layer")
    return s + " " + str(at.get("path"))


def fail_reason(doc, most=3):
    """The reason of a failing (or warned) gate, from its JSON report: the summary line, the first
    divergence, each failing level's first failure and the first `most` near-ties."""
    parts = [str(doc.get("summary", ""))]
    loc = doc.get("localization")
    if isinstance(loc, dict):
        line = "step %s pos %s" % (loc.get("step"), loc.get("position"))
        if loc.get("layer") is not None:
            line += " layer %s" % loc.get("layer")
        line += " operator %s (%s)" % (loc.get("operator"), loc.get("level"))
        parts.append("first divergence: " + line)
    for level in doc.get("levels") or []:
        first = level.get("first_failure") if isinstance(level, dict) else None
        if isinstance(first, dict):
            parts.append("%s FAIL at %s: %s" % (level.get("level"), describe_location(first.get("at"), False),
                                                first.get("reason")))
    ties = [t for t in doc.get("near_ties") or [] if isinstance(t, dict)]
    for tie in ties[:most]:
        parts.append("near-tie (%s flip) at %s: %s, reference margin %s < %s"
                     % (tie.get("kind"), describe_location(tie.get("at")), tie.get("change"),
                        tie.get("reference_margin"), tie.get("threshold")))
    if len(ties) > most:
        parts.append("... and %d more near-ties (the report lists them)" % (len(ties) - most))
    return "\n".join(visible(p) for p in parts if p)


# --- The action ----------------------------------------------------------------------------------


class Inputs:
    def __init__(self):
        self.candidate = env("CANDIDATE")
        self.reference = env("REFERENCE")
        self.baseline = env("BASELINE")
        self.bless = env("BLESS", "false").lower()
        self.policy = env("POLICY")
        self.profile = env("PROFILE")
        self.required = env("REQUIRED")
        self.extra_args = env("EXTRA_ARGS")
        self.moeconf = env("MOECONF", "moeconf")
        self.install = env("INSTALL", "none")
        self.artifact = env("ARTIFACT")
        temp = os.environ.get("RUNNER_TEMP") or tempfile.gettempdir()
        self.temp = temp
        self.report_dir = os.path.abspath(env("REPORT_DIR", os.path.join(temp, "moeconf-gate")))
        # Set once the directory is checked and made: only then is it an output (the upload's path).
        self.dir_ok = False

    def check(self):
        if self.bless not in ("true", "false"):
            raise Failure("bless: %r is not true or false" % self.bless)
        if self.install not in ("none", "cargo", "pip"):
            raise Failure("install: %r is not one of none, cargo, pip" % self.install)
        if not self.candidate:
            raise Failure("candidate: the candidate trace is required")
        if self.bless == "true":
            if not self.baseline or self.reference:
                raise Failure("bless: give baseline (the file to write) and candidate, not reference")
        elif bool(self.reference) == bool(self.baseline):
            raise Failure("give either reference or baseline (the candidate is gated against one of them)")
        # upload-artifact reads one path per line, and globs: the directory must be a plain path.
        bad = [c for c in "\n\r*?[]" if c in self.report_dir]
        if bad:
            raise Failure("report-dir: %r holds %r, which the artifact upload would read as a pattern "
                          "or a second path" % (self.report_dir, "".join(bad)))
        try:
            self.extra = shlex.split(self.extra_args)
        except ValueError as e:
            raise Failure("extra-args: %s (split as shell words, never evaluated)" % e)
        for word in self.extra:
            flag = word.split("=", 1)[0]
            if flag in RESERVED_FLAGS or word == "--":
                raise Failure("extra-args: %r is not allowed there: the action sets the traces, --bless, "
                              "--baseline, the report files and formats itself (the inputs candidate, "
                              "reference, baseline, bless)" % word)

    def options(self):
        """moeconf gate's options from the inputs (`--flag=value`: a value starting with `-`
        stays a value)."""
        opts = []
        if self.policy:
            opts.append("--policy=" + self.policy)
        if self.profile:
            opts.append("--profile=" + self.profile)
        if self.required:
            opts.append("--required=" + self.required)
        return opts + self.extra

    def against(self):
        if self.baseline:
            return "baseline %s" % md_code(self.baseline)
        return "reference %s" % md_code(self.reference)


def bless(inp, binary, paths):
    argv = [binary, "gate", "--bless", "--baseline=" + inp.baseline] + inp.options() + ["--", inp.candidate]
    code, out, err = run_moeconf(argv)
    log(out + err)
    if code == 0:
        if not (os.path.exists(paths["baseline"]) and os.path.samefile(inp.baseline, paths["baseline"])):
            shutil.copyfile(inp.baseline, paths["baseline"])
        add_summary("### moeconf gate: 📝 BLESSED\n\nBaseline %s recorded from candidate %s: review its "
                    "diff and commit it (docs/ci.md §6); it is also in the report directory as "
                    "`baseline.json`.\n\n%s" % (md_code(inp.baseline), md_code(inp.candidate), md_block(out)))
        return 0, "blessed", ""
    return code, "error", err.strip() or "moeconf gate --bless exited %d" % code


def gate(inp, binary, paths):
    sides = ["--baseline=" + inp.baseline] if inp.baseline else []
    sides += ["--"] + ([inp.reference] if inp.reference else []) + [inp.candidate]
    argv = ([binary, "gate"] + inp.options()
            + ["--format=md", "--output=" + paths["report"], "--junit=" + paths["junit"],
               "--html=" + paths["html"]] + sides)
    code, out, err = run_moeconf(argv)
    log(out + err)
    if code not in (0, 1):
        return code, "error", err.strip() or "moeconf gate exited %d" % code
    with open(paths["report"], encoding="utf-8", errors="replace") as f:
        report = f.read()
    # The JSON report: the verdict (pass, warn or fail) and the reason, for the outputs.
    jcode, _, jerr = run_moeconf([binary, "gate"] + inp.options()
                                 + ["--format=json", "--output=" + paths["json"]] + sides)
    verdict, reason = ("pass" if code == 0 else "fail"), ""
    if jcode == code:
        try:
            with open(paths["json"], encoding="utf-8") as f:
                doc = json.load(f)
            verdict = str(doc.get("verdict", verdict))
            reason = fail_reason(doc)
        except (OSError, ValueError) as e:
            jerr = str(e)
    if jcode != code or not reason:
        log(jerr)
        annotate("warning", "moeconf gate: no JSON report",
                 visible("the JSON run exited %d, the report run %d: %s" % (jcode, code, jerr.strip())))
    if len(report.encode("utf-8")) > SUMMARY_LIMIT:
        report = ("### moeconf gate: %s\n\nThe Markdown report (%d bytes) is larger than a job summary "
                  "holds: it is `gate.md` in the report directory.\n"
                  % ("✅ PASS" if code == 0 else "❌ FAIL", len(report.encode("utf-8"))))
    add_summary(report)
    return code, verdict, reason


def main():
    inp = Inputs()
    paths = {k: os.path.join(inp.report_dir, v) for k, v in FILES.items()}
    code, verdict, reason = 2, "error", ""
    try:
        inp.check()
        os.makedirs(inp.report_dir, exist_ok=True)
        inp.dir_ok = True
        inputs = [p for p in (inp.candidate, inp.reference, inp.baseline, inp.policy) if p]
        for p in paths.values():
            if any(os.path.exists(i) and os.path.exists(p) and os.path.samefile(i, p) for i in inputs):
                raise Failure("report-dir: %s is an input of the gate: give another report-dir" % p)
        # Reports of an earlier run in the same directory must not pass for this run's. A link
        # there would be written through (or uploaded as its target): refused, never followed.
        for p in paths.values():
            if os.path.islink(p):
                raise Failure("report-dir: %s is a symbolic link: the action writes its reports there "
                              "and never through a link; remove it or give another report-dir" % p)
        for p in paths.values():
            if os.path.isfile(p):
                os.remove(p)
        binary = install(inp.install, inp.temp) if inp.install != "none" else find_binary(inp.moeconf)
        if inp.bless == "true":
            code, verdict, reason = bless(inp, binary, paths)
        else:
            code, verdict, reason = gate(inp, binary, paths)
    except Failure as e:
        reason = str(e)
        log("moeconf gate action: " + reason)
    except OSError as e:
        reason = "moeconf gate action: %s" % e
        log(reason)
    if verdict == "error":
        target = "" if not inp.candidate else " Candidate %s against %s." % (
            md_code(inp.candidate), inp.against() if (inp.reference or inp.baseline) else "nothing")
        add_summary("### moeconf gate: ⚠️ ERROR\n\nNo verdict (exit %d).%s\n\n%s"
                    % (code, target, md_block(reason)))
        annotate("error", "moeconf gate: ERROR (exit %d)" % code, visible(reason, keep="\n"))
    elif verdict == "fail":
        annotate("error", "moeconf gate: FAIL", reason)
    elif verdict == "warn":
        annotate("warning", "moeconf gate: WARN (passes)", reason)
    if inp.artifact:
        add_summary("\nReports (Markdown, JUnit, JSON, HTML): artifact %s.\n" % md_code(inp.artifact))
    exists = {k: (p if os.path.isfile(p) else "") for k, p in paths.items()}
    for name, value in [("exit-code", str(code)), ("verdict", verdict), ("reason", reason),
                        ("report-dir", inp.report_dir if inp.dir_ok else ""), ("report", exists["report"]),
                        ("junit", exists["junit"]), ("json", exists["json"]), ("html", exists["html"]),
                        ("baseline", exists["baseline"])]:
        set_output(name, value)
    # moeconf's own exit code; anything outside 0..255 (a signal) is an error, 2.
    return code if 0 <= code <= 255 else 2


def run():
    """:func:`main` with a log that takes any character (a runner whose stdout is not UTF-8 must
    not turn a pass into a crash) and any unexpected exception an error, exit 2, never 1 (which
    the job would read as a gate that failed)."""
    try:
        sys.stdout.reconfigure(encoding="utf-8", errors="backslashreplace")
    except (AttributeError, ValueError):
        pass
    try:
        return main()
    except Exception as e:  # noqa: BLE001 - anything unexpected is an error of the action
        try:
            log("moeconf gate action: internal error: %s: %s" % (type(e).__name__, e))
            annotate("error", "moeconf gate: ERROR (exit 2)", visible("internal error: %s" % e))
        except Exception:  # noqa: BLE001
            pass
        return 2


if __name__ == "__main__":
    sys.exit(run())
