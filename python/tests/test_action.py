"""The GitHub Action (``action.yml``, script ``ci/action/gate.py``; docs/ci.md §9), run here as the
runner would run it: the inputs as ``MOECONF_ACTION_*`` environment variables, a fake job summary
file, output file and ``RUNNER_TEMP``, on traces of the built-in fixture. Checked: exit codes
(0 pass, 1 fail, 2 error) propagate, the summary holds the report, the outputs parse as the runner
parses them, the annotations are single well-formed workflow commands, and hostile file names
(spaces, backticks, ``$(...)``, newlines, ``::error::``, ``##[``, ``<img>``, a leading ``-``)
neither break the script nor run a command nor issue a workflow command nor leave a Markdown code
span. ``action.yml`` and the docs' example workflow are checked against each other."""

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(REPO, "ci", "action", "gate.py")
ACTION = os.path.join(REPO, "action.yml")

PROMPT = "why the sheep"
# A file name that tries everything: a leading '-', spaces, backticks, command substitution,
# raw HTML, workflow commands (v2 `::` at the start of a line after the newline, v1 `##[`
# anywhere), percent-escapes and the property separators.
HOSTILE = "-c `x` $(touch PWNED) <img src=x> %0A,: ##[error]v1\n::error::INJECTED\r::warning::W.bin"
HOSTILE_DIR = "traces `$(touch PWNED)` & <b>"


@pytest.fixture(scope="module")
def traces(moeconf_bin, tmp_path_factory):
    """ref.bin (bf16), same.bin (its copy), f32.bin (--precision f32: fails every profile)."""
    d = tmp_path_factory.mktemp("action-traces")
    env = dict(os.environ, MOECONF_CACHE_DIR=str(d / "cache"), NO_COLOR="1")
    for name, extra in [("ref.bin", []), ("f32.bin", ["--precision", "f32"])]:
        subprocess.run([moeconf_bin, "run", "--model", "builtin:tiny-v4", "--prompt", PROMPT,
                        "--max-new-tokens", "2", "-o", str(d / name), *extra],
                       check=True, capture_output=True, env=env)
    shutil.copyfile(d / "ref.bin", d / "same.bin")
    return d


class Run:
    def __init__(self, proc, summary, outputs, cwd):
        self.code = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.summary = summary
        self.outputs = outputs
        self.cwd = cwd
        self.commands = workflow_commands(proc.stdout)

    def annotations(self):
        return [c for c in self.commands if c[0] in ("error", "warning", "notice")]


def run_action(tmp, moeconf_bin, cwd=None, path=None, extra_env=None, **inputs):
    """Runs the script with the environment a runner sets; `inputs` by input name (`_` for `-`)."""
    tmp.mkdir(parents=True, exist_ok=True)
    summary, output, temp = tmp / "step-summary.md", tmp / "github-output", tmp / "runner-temp"
    temp.mkdir(exist_ok=True)
    # A fresh summary and output file per step, as the runner gives.
    summary.write_text("")
    output.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOECONF_", "GITHUB_", "RUNNER_"))}
    env.update(GITHUB_STEP_SUMMARY=str(summary), GITHUB_OUTPUT=str(output), RUNNER_TEMP=str(temp),
               GITHUB_ACTION_PATH=REPO, GITHUB_ACTIONS="true", NO_COLOR="1",
               MOECONF_CACHE_DIR=str(tmp / "cache"), MOECONF_ACTION_MOECONF=moeconf_bin)
    if path:
        env["PATH"] = path + os.pathsep + env.get("PATH", "")
    for k, v in inputs.items():
        env["MOECONF_ACTION_" + k.upper()] = str(v)
    env.update(extra_env or {})
    cwd = cwd or tmp
    p = subprocess.run([sys.executable, SCRIPT], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=600)
    text = summary.read_text(encoding="utf-8")
    outputs = parse_outputs(output.read_text(encoding="utf-8"))
    return Run(p, text, outputs, cwd)


def parse_outputs(text):
    """$GITHUB_OUTPUT as the runner reads it: `name=value` lines and `name<<DELIMITER` blocks."""
    out, lines, i = {}, text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        if not line:
            i += 1
            continue
        eq, hd = line.find("="), line.find("<<")
        if hd >= 0 and (eq < 0 or hd < eq):
            name, delimiter = line[:hd], line[hd + 2:]
            assert delimiter, line
            end = lines.index(delimiter, i + 1)  # ValueError: an unterminated block
            value = "\n".join(lines[i + 1:end])
            i = end + 1
        else:
            assert eq > 0, "not an output line: %r" % line
            name, value = line[:eq], line[eq + 1:]
            i += 1
        assert name not in out, "output %s set twice" % name
        out[name] = value
    return out


def unescape(s):
    return s.replace("%0D", "\r").replace("%0A", "\n").replace("%3A", ":").replace("%2C", ",").replace("%25", "%")


def workflow_commands(stdout):
    """The workflow commands the runner would act on in `stdout`, as (name, properties, data):
    `::name props::data` at the start of a line (after spaces), `##[name props]data` anywhere in
    it, nothing between `::stop-commands::TOKEN` and `::TOKEN::` but the resume."""
    found, stopped = [], None
    for line in stdout.split("\n"):
        s = line.lstrip()
        if s.startswith("::") and s.find("::", 2) > 0:
            end = s.find("::", 2)
            head, data = s[2:end], s[end + 2:]
        elif "##[" in line and line.find("]", line.index("##[")) > 0:
            k = line.index("##[")
            end = line.find("]", k)
            head, data = line[k + 3:end], line[end + 1:]
        else:
            continue
        name, _, props = head.partition(" ")
        if stopped is not None:
            if name.lower() == stopped.lower():
                stopped = None
            continue
        if name == "stop-commands":
            assert len(data) >= 32, "a guessable stop token: %r" % data
            stopped = data
            continue
        props = dict(p.split("=", 1) for p in props.split(",") if p)
        found.append((name, {k: unescape(v) for k, v in props.items()}, unescape(data)))
    assert stopped is None, "commands left stopped"
    return found


def code_spans(line):
    """CommonMark inline code on one line: (the text outside code spans, the spans' contents)."""
    text, spans, i = [], [], 0
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line):
            text.append(line[i:i + 2])
            i += 2
        elif c == "`":
            j = i
            while j < len(line) and line[j] == "`":
                j += 1
            n, k, close = j - i, j, -1
            while k < len(line):
                if line[k] == "`":
                    m = k
                    while m < len(line) and line[m] == "`":
                        m += 1
                    if m - k == n:
                        close = k
                        break
                    k = m
                else:
                    k += 1
            if close < 0:
                text.append(line[i:j])
                i = j
            else:
                body = line[j:close]
                if len(body) > 2 and body[0] == " " and body[-1] == " " and body.strip(" "):
                    body = body[1:-1]
                spans.append(body)
                i = close + n
        else:
            text.append(c)
            i += 1
    return "".join(text), spans


def markdown_parts(md):
    """(text outside code, inline code span contents, fenced block bodies) of `md`."""
    text, spans, blocks, fence, body = [], [], [], None, []
    for line in md.split("\n"):
        if fence is None:
            m = re.match(r"^ {0,3}(`{3,})([^`]*)$", line)
            if m:
                fence, body = m.group(1), []
                continue
            t, s = code_spans(line)
            text.append(t)
            spans += s
        elif re.match(r"^ {0,3}(`{%d,}) *$" % len(fence), line):
            blocks.append("\n".join(body))
            fence = None
        else:
            body.append(line)
    assert fence is None, "an unclosed fenced block"
    return "\n".join(text), spans, blocks


def visible(s, keep=""):
    """The visible form moeconf (and the script) give a name: moeconf_output::escape::text
    (`keep="\n"`: ::multiline, the form of moeconf's error messages, docs/ci.md §5)."""
    out = []
    for c in s:
        o = ord(c)
        if c in keep:
            out.append(c)
        elif o < 0x20 or 0x7F <= o <= 0x9F or 0x202A <= o <= 0x202E or 0x2066 <= o <= 0x2069:
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}.get(c, "\\u{%x}" % o))
        else:
            out.append(c)
    return "".join(out)


def assert_clean_summary(run):
    """No raw HTML, every code span closed on its line; no command ran (`$(touch PWNED)`)."""
    text, spans, blocks = markdown_parts(run.summary)
    assert "<" not in text, text
    for b in blocks:
        assert not re.search(r"^ {0,3}```", b, re.M)
    assert not list(run.cwd.rglob("PWNED")) and not os.path.exists("PWNED")
    return text, spans, blocks


def assert_common(run, code, verdict):
    assert run.code == code, (run.code, run.stdout, run.stderr)
    assert run.stderr == "", run.stderr
    assert run.outputs["exit-code"] == str(code)
    assert run.outputs["verdict"] == verdict
    for name in ("reason", "report-dir", "report", "junit", "json", "html", "baseline"):
        assert name in run.outputs, name
    names = {c[0] for c in run.commands}
    assert names <= {"error", "warning", "group", "endgroup"}, run.commands
    for kind, props, data in run.annotations():
        assert set(props) == {"title"}, props
        assert "INJECTED" not in props["title"]


def test_pass_with_hostile_names(traces, moeconf_bin, tmp_path):
    d = tmp_path / "work" / HOSTILE_DIR
    d.mkdir(parents=True)
    shutil.copyfile(traces / "ref.bin", d / ("ref " + HOSTILE))
    shutil.copyfile(traces / "same.bin", d / HOSTILE)
    cwd = tmp_path / "work"
    run = run_action(tmp_path, moeconf_bin, cwd=cwd, reference=os.path.join(HOSTILE_DIR, "ref " + HOSTILE),
                     candidate=os.path.join(HOSTILE_DIR, HOSTILE), artifact="moeconf-gate")
    assert_common(run, 0, "pass")
    assert run.annotations() == []
    assert run.summary.startswith("### moeconf gate: ✅ PASS")
    text, spans, _ = assert_clean_summary(run)
    assert visible(os.path.join(HOSTILE_DIR, HOSTILE)) in spans
    assert "`moeconf-gate`" in run.summary
    report_dir = run.outputs["report-dir"]
    assert report_dir == str(tmp_path / "runner-temp" / "moeconf-gate")
    for name, file in [("report", "gate.md"), ("junit", "gate.xml"), ("json", "gate.json"), ("html", "gate.html")]:
        assert run.outputs[name] == os.path.join(report_dir, file)
        assert os.path.getsize(run.outputs[name]) > 0
    assert run.outputs["baseline"] == ""
    with open(run.outputs["report"], encoding="utf-8") as f:
        assert f.read() in run.summary
    assert run.outputs["reason"].startswith("PASS:")
    # The log shows the report, with workflow commands stopped around it.
    assert "::stop-commands::" in run.stdout and "### moeconf gate" in run.stdout


def test_fail_annotates_the_reason(traces, moeconf_bin, tmp_path):
    shutil.copyfile(traces / "f32.bin", tmp_path / HOSTILE)
    run = run_action(tmp_path, moeconf_bin, reference=traces / "ref.bin", candidate=HOSTILE,
                     profile="strict", required="L0", extra_args="--verify-all --level 'L4=bitwise'",
                     report_dir=tmp_path / "reports dir")
    assert_common(run, 1, "fail")
    assert len(run.annotations()) == 1
    kind, props, message = run.annotations()[0]
    assert (kind, props["title"]) == ("error", "moeconf gate: FAIL")
    assert message == run.outputs["reason"]
    assert message.startswith("FAIL:") and "first divergence: step" in message
    assert re.search(r"^L\d FAIL at step \d+ pos \d+", message, re.M), message
    assert run.summary.startswith("### moeconf gate: ❌ FAIL")
    assert "Profile `strict`" in run.summary
    text, spans, _ = assert_clean_summary(run)
    assert visible(HOSTILE) in spans
    assert run.outputs["report-dir"] == str(tmp_path / "reports dir")
    assert os.path.isfile(tmp_path / "reports dir" / "gate.xml")


def test_warn_passes_with_a_warning(traces, moeconf_bin, tmp_path):
    """The `ci` policy of docs/ci.md §7 accepts f32 against bf16 with route near-ties: exit 0,
    verdict warn, a warning annotation naming the near-ties."""
    with open(os.path.join(REPO, "docs", "ci.md"), encoding="utf-8") as f:
        m = re.search(r"<!-- ci-policy:begin -->\n```toml\n(.*?)```", f.read(), re.S)
    (tmp_path / "moeconf.toml").write_text(m.group(1))
    run = run_action(tmp_path, moeconf_bin, reference=traces / "ref.bin", candidate=traces / "f32.bin",
                     policy="moeconf.toml", profile="ci")
    assert_common(run, 0, "warn")
    [(kind, props, message)] = run.annotations()
    assert (kind, props["title"]) == ("warning", "moeconf gate: WARN (passes)")
    assert message.startswith("PASS:") and "near-tie (route flip) at L3 step" in message
    assert run.summary.startswith("### moeconf gate: ✅ PASS") and "Near-ties (warnings)" in run.summary


def test_errors_exit_2_with_the_message(traces, moeconf_bin, tmp_path):
    (tmp_path / "garbage.bin").write_bytes(b"not a trace\n" * 10)
    with open(traces / "ref.bin", "rb") as f:
        data = f.read()
    (tmp_path / "cut.bin").write_bytes(data[: len(data) // 2])
    for i, cand in enumerate([HOSTILE, "garbage.bin", "cut.bin"]):
        run = run_action(tmp_path / ("case%d" % i), moeconf_bin, cwd=tmp_path,
                         reference=traces / "ref.bin", candidate=cand)
        assert_common(run, 2, "error")
        [(kind, props, message)] = run.annotations()
        assert (kind, props["title"]) == ("error", "moeconf gate: ERROR (exit 2)")
        # moeconf's message keeps a newline of a name (the annotation's encoding carries it).
        assert visible(cand, keep="\n") in message and message == run.outputs["reason"] != ""
        assert "\r" not in message
        for name in ("report", "junit", "json", "html"):
            assert run.outputs[name] == ""
        assert run.summary.startswith("### moeconf gate: ⚠️ ERROR")
        text, spans, blocks = assert_clean_summary(run)
        assert visible(cand) in spans
        assert len(blocks) == 1 and visible(cand, keep="\n") in blocks[0]


def test_stale_reports_are_removed(traces, moeconf_bin, tmp_path):
    run = run_action(tmp_path, moeconf_bin, reference=traces / "ref.bin", candidate=traces / "same.bin")
    assert_common(run, 0, "pass")
    run = run_action(tmp_path, moeconf_bin, reference=traces / "ref.bin", candidate="missing.bin")
    assert_common(run, 2, "error")
    assert os.listdir(tmp_path / "runner-temp" / "moeconf-gate") == []


def test_baseline_bless_then_gate(traces, moeconf_bin, tmp_path):
    baseline = "base line `$(touch PWNED)`.json"
    run = run_action(tmp_path / "bless", moeconf_bin, cwd=tmp_path, bless="true", baseline=baseline,
                     candidate=traces / "ref.bin")
    assert_common(run, 0, "blessed")
    assert run.annotations() == []
    assert os.path.isfile(tmp_path / baseline)
    with open(tmp_path / baseline, "rb") as a, open(run.outputs["baseline"], "rb") as b:
        assert a.read() == b.read()
    assert run.summary.startswith("### moeconf gate: 📝 BLESSED")
    _, spans, blocks = assert_clean_summary(run)
    assert baseline in spans and "blessed" in blocks[0]

    run = run_action(tmp_path / "same", moeconf_bin, cwd=tmp_path, baseline=baseline, candidate=traces / "same.bin")
    assert_common(run, 0, "pass")
    assert "against baseline" in run.summary
    run = run_action(tmp_path / "f32", moeconf_bin, cwd=tmp_path, baseline=baseline, candidate=traces / "f32.bin")
    assert_common(run, 1, "fail")
    [(kind, props, message)] = run.annotations()
    assert props["title"] == "moeconf gate: FAIL" and message.startswith("FAIL:")


def test_input_errors(traces, moeconf_bin, tmp_path):
    ref, cand = traces / "ref.bin", traces / "same.bin"
    cases = [
        (dict(candidate=cand), "give either reference or baseline"),
        (dict(reference=ref, baseline=tmp_path / "b.json", candidate=cand), "give either reference or baseline"),
        (dict(reference=ref), "candidate"),
        (dict(reference=ref, candidate=cand, install="curl | sh"), "install"),
        (dict(reference=ref, candidate=cand, bless="yes"), "bless"),
        (dict(reference=ref, candidate=cand, bless="true", baseline="b.json"), "bless"),
        (dict(reference=ref, candidate=cand, extra_args="--level 'L2=info"), "extra-args"),
        (dict(reference=ref, candidate=cand, extra_args="--level L2=info --bless"), "--bless"),
        (dict(reference=ref, candidate=cand, extra_args="--baseline=x.json"), "--baseline=x.json"),
        (dict(reference=ref, candidate=cand, extra_args="--output=/tmp/x"), "--output"),
        (dict(reference=ref, candidate=cand, extra_args="--bisect-exit-codes"), "--bisect-exit-codes"),
        (dict(reference=ref, candidate=cand, extra_args="-- other.bin"), "'--'"),
        (dict(reference=ref, candidate=cand, report_dir="a\n::error::INJECTED"), "report-dir"),
        (dict(reference=ref, candidate=cand, report_dir="out*"), "report-dir"),
        (dict(reference=ref, candidate=cand, moeconf="no-such-moeconf-binary"), "not on PATH"),
        (dict(reference=ref, candidate=cand, moeconf="./no/such/moeconf"), "not an executable"),
    ]
    for i, (inputs, needle) in enumerate(cases):
        run = run_action(tmp_path / ("case%d" % i), moeconf_bin, **inputs)
        assert_common(run, 2, "error")
        [(kind, props, message)] = run.annotations()
        assert props["title"] == "moeconf gate: ERROR (exit 2)" and needle in message, (needle, message)
        assert run.summary.startswith("### moeconf gate: ⚠️ ERROR")
        assert_clean_summary(run)
        assert run.outputs["report-dir"] in ("", str(tmp_path / ("case%d" % i) / "runner-temp" / "moeconf-gate"))
        if "report_dir" in inputs:
            assert run.outputs["report-dir"] == ""


def test_a_report_dir_holding_an_input_is_refused(traces, moeconf_bin, tmp_path):
    shutil.copyfile(traces / "ref.bin", tmp_path / "gate.md")
    run = run_action(tmp_path / "run", moeconf_bin, reference=tmp_path / "gate.md",
                     candidate=traces / "same.bin", report_dir=tmp_path)
    assert_common(run, 2, "error")
    assert "is an input of the gate" in run.outputs["reason"]
    assert os.path.getsize(tmp_path / "gate.md") == os.path.getsize(traces / "ref.bin")


def test_install_cargo_runs_cargo_install_on_the_actions_cli(traces, moeconf_bin, tmp_path):
    """`install: cargo` with a stand-in cargo that records its arguments and installs the built
    binary where `cargo install --root` would."""
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "cargo-args"
    script = fake / "cargo"
    script.write_text("#!/bin/sh\nprintf '%%s\\n' \"$@\" > '%s'\nshift 5\nmkdir -p \"$1/bin\"\n"
                      "ln -s '%s' \"$1/bin/moeconf\"\necho '::error::from cargo, not a command'\n"
                      % (log, moeconf_bin))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    run = run_action(tmp_path, moeconf_bin, path=str(fake), reference=traces / "ref.bin",
                     candidate=traces / "same.bin", install="cargo", moeconf="ignored")
    assert_common(run, 0, "pass")
    root = tmp_path / "runner-temp" / "moeconf-action-cargo"
    assert log.read_text().split("\n")[:6] == ["install", "--locked", "--path", os.path.join(REPO, "cli"),
                                                "--root", str(root)]
    assert [c[0] for c in run.commands] == ["group", "endgroup"]

    script.write_text("#!/bin/sh\nexit 101\n")
    run = run_action(tmp_path / "broken", moeconf_bin, path=str(fake), reference=traces / "ref.bin",
                     candidate=traces / "same.bin", install="cargo")
    assert_common(run, 2, "error")
    assert "cargo exited 101" in run.outputs["reason"]


# --- action.yml and the docs' workflow -----------------------------------------------------------

INPUTS = ["candidate", "reference", "baseline", "bless", "policy", "profile", "required", "extra-args",
          "moeconf", "install", "report-dir", "upload", "artifact-name"]
OUTPUTS = ["exit-code", "verdict", "reason", "report-dir", "report", "junit", "json", "html", "baseline"]


def run_blocks(text):
    """The values of every `run:` key of a YAML text (single line or block scalar)."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(?:- )?run:\s*(.*)$", lines[i])
        i += 1
        if not m:
            continue
        if m.group(2) and m.group(2)[0] not in "|>":
            out.append(m.group(2))
            continue
        indent, body = len(m.group(1)), []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        out.append("\n".join(body))
    return out


def test_action_yml():
    with open(ACTION, encoding="utf-8") as f:
        text = f.read()
    # No expression in a script's text: inputs reach the script through `env:` only.
    runs = run_blocks(text)
    assert runs and all("${{" not in r for r in runs), runs
    assert any("ci/action/gate.py" in r for r in runs)
    assert os.path.isfile(SCRIPT)
    for name in INPUTS:
        assert re.search(r"^  %s:$" % re.escape(name), text, re.M), name
        if name not in ("upload", "artifact-name"):
            var = "MOECONF_ACTION_" + name.upper().replace("-", "_")
            assert "%s: ${{ inputs.%s }}" % (var, name) in text, var
    used = set(re.findall(r"inputs\.([A-Za-z0-9_-]+)", text))
    assert used <= set(INPUTS), used - set(INPUTS)
    for name in OUTPUTS:
        assert "value: ${{ steps.gate.outputs.%s }}" % name in text, name
    try:
        import yaml
    except ImportError:
        return
    doc = yaml.safe_load(text)
    assert list(doc["inputs"]) == INPUTS and list(doc["outputs"]) == OUTPUTS
    assert doc["inputs"]["candidate"]["required"] is True
    assert doc["runs"]["using"] == "composite"
    gate, upload = doc["runs"]["steps"]
    assert gate["id"] == "gate" and gate["shell"] == "bash"
    assert sorted(gate["env"]) == sorted(["MOECONF_ACTION_" + n.upper().replace("-", "_")
                                          for n in INPUTS if n not in ("upload", "artifact-name")]
                                         + ["MOECONF_ACTION_ARTIFACT"])
    assert upload["uses"].startswith("actions/upload-artifact@") and upload["if"].startswith("always()")


def docs_workflow():
    with open(os.path.join(REPO, "docs", "ci.md"), encoding="utf-8") as f:
        doc = f.read()
    m = re.search(r"<!-- action-workflow:begin -->\n```yaml\n(.*?)```\n<!-- action-workflow:end -->", doc, re.S)
    assert m, "docs/ci.md: the action's example workflow between action-workflow markers"
    return m.group(1)


def test_docs_workflow_uses_the_actions_inputs():
    text = docs_workflow()
    assert all("${{ inputs." not in r and "${{ github.event" not in r for r in run_blocks(text))
    lines = text.split("\n")
    uses = [i for i, line in enumerate(lines) if re.match(r"^\s*(- )?uses: [\w.-]+/moeconf@\S+$", line)]
    assert len(uses) >= 2, "the workflow uses the action to bless and to gate"
    blessed = 0
    for i in uses:
        indent = lines[i].index("uses:")
        step = []
        for line in lines[i + 1:]:
            if not line.strip():
                continue
            if len(line) - len(line.lstrip()) < indent or line.lstrip().startswith("- "):
                break
            step.append(line)
        keys = [line.strip().split(":")[0] for line in step if len(line) - len(line.lstrip()) == indent + 2]
        assert "with:" in [line.strip() for line in step] and set(keys) <= set(INPUTS), keys
        assert "candidate" in keys and ("baseline" in keys or "reference" in keys)
        blessed += "bless" in keys
    assert blessed == 1
    try:
        import yaml
    except ImportError:
        return
    wf = yaml.safe_load(text)
    steps = [st for job in wf["jobs"].values() for st in job["steps"]]
    ours = [st for st in steps if st.get("uses", "").split("@")[0].endswith("/moeconf")]
    assert len(ours) == len(uses)
    for st in ours:
        assert set(st["with"]) <= set(INPUTS) and "if" in st


def test_a_log_that_cannot_encode_the_report_still_passes(traces, moeconf_bin, tmp_path):
    """A runner whose stdout is not UTF-8: the pass stays exit 0 (it was a crash, exit 1)."""
    for enc in ("ascii", "cp1252"):
        run = run_action(tmp_path / enc, moeconf_bin, reference=traces / "ref.bin", candidate=traces / "same.bin",
                         extra_env={"PYTHONIOENCODING": enc})
        assert run.code == 0 and run.outputs["verdict"] == "pass", (enc, run.stderr)
        run = run_action(tmp_path / (enc + "-fail"), moeconf_bin, reference=traces / "ref.bin",
                         candidate=traces / "f32.bin", extra_env={"PYTHONIOENCODING": enc})
        assert run.code == 1 and run.outputs["verdict"] == "fail", (enc, run.stderr)


def test_a_link_in_the_report_dir_is_refused_and_not_followed(traces, moeconf_bin, tmp_path):
    reports, target = tmp_path / "reports", tmp_path / "precious.md"
    reports.mkdir()
    target.write_text("mine")
    os.symlink(target, reports / "gate.md")
    run = run_action(tmp_path / "run", moeconf_bin, reference=traces / "ref.bin", candidate=traces / "same.bin",
                     report_dir=reports)
    assert_common(run, 2, "error")
    assert "symbolic link" in run.outputs["reason"]
    assert target.read_text() == "mine"


def test_bless_into_the_report_dir_itself(traces, moeconf_bin, tmp_path):
    """The baseline written where the report copy goes (report-dir `.`): blessed, not an error."""
    run = run_action(tmp_path / "run", moeconf_bin, cwd=tmp_path, bless="true", baseline="baseline.json",
                     candidate=traces / "ref.bin", report_dir=".")
    assert_common(run, 0, "blessed")
    assert os.path.isfile(tmp_path / "baseline.json")
