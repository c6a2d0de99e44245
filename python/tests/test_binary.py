"""moeconf.binary: finding the Rust binary and holding it to this package
(release, trace format versions), and the versions the wheel's two halves
carry agreeing."""

import os
import re
import stat
import subprocess
import sys

import pytest

import moeconf
from moeconf import binary
from moeconf.binary import BinaryError

GOOD = ("moeconf {release}\ncommit: 0123456789abcdef0123456789abcdef01234567\n"
        "trace formats read: 1 2 3\ntrace formats written: 1 2 3 (default 3)\nbaseline schema: 3\n")


def fake(tmp_path, text, code=0, name="moeconf"):
    """A stand-in binary printing ``text`` for --version and exiting ``code``."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\ncat <<'EOF'\n" + text + "EOF\nexit " + str(code) + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_real_binary_fits_this_package(moeconf_bin):
    b = binary.check(moeconf_bin)
    assert b.release == moeconf.__version__
    assert b.reads == (1, 2, 3, 4) and b.default_write == 4
    assert re.fullmatch(r"[0-9a-f]{7,64}|unknown", b.commit)


def test_module_command_says_it_fits(moeconf_bin):
    p = subprocess.run([sys.executable, "-m", "moeconf", "binary", "--path", moeconf_bin],
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == 0, p.stderr
    assert "fits this package" in p.stdout


def test_a_matching_stand_in_fits(tmp_path):
    b = binary.check(fake(tmp_path, GOOD.format(release=moeconf.__version__)))
    assert b.writes == (1, 2, 3) and b.baseline_schema == 3


def test_another_release_is_refused(tmp_path):
    with pytest.raises(BinaryError, match="its release is 9.9.9"):
        binary.check(fake(tmp_path, GOOD.format(release="9.9.9")))


def test_a_binary_that_cannot_read_what_this_package_writes_is_refused(tmp_path):
    text = GOOD.format(release=moeconf.__version__).replace("read: 1 2 3", "read: 1 2")
    with pytest.raises(BinaryError, match=r"does not read trace format version\(s\) \[3\]"):
        binary.check(fake(tmp_path, text))


def test_a_binary_writing_an_unknown_version_is_refused(tmp_path):
    text = GOOD.format(release=moeconf.__version__).replace("written: 1 2 3 (default 3)",
                                                            "written: 1 2 3 4 5 (default 5)")
    with pytest.raises(BinaryError, match="version 5 by default"):
        binary.check(fake(tmp_path, text))


@pytest.mark.parametrize("text,code,match", [
    ("moeconf 0.1.0\n", 0, "does not name commit"),
    ("ripgrep 14.1.0\n", 0, "not a moeconf binary"),
    ("", 0, "not a moeconf binary"),
    (GOOD.format(release="0.1.0"), 3, "exited 3"),
    (GOOD.format(release="0.1.0").replace("read: 1 2 3", "read: many"), 0, "holds no version number"),
])
def test_unusable_output_is_an_error(tmp_path, text, code, match):
    with pytest.raises(BinaryError, match=match):
        binary.info(fake(tmp_path, text, code))


def test_a_missing_binary_is_an_error_naming_it(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(BinaryError, match="nope"):
        binary.info(missing)
    p = subprocess.run([sys.executable, "-m", "moeconf", "binary", "--path", missing],
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == 2 and "nope" in p.stderr


def test_find_prefers_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MOECONF_BIN", "/somewhere/moeconf")
    assert binary.find() == "/somewhere/moeconf"
    assert binary.find("/explicit") == "/explicit"


def test_versions_of_both_halves_agree(repo):
    """The wheel takes its version from the Cargo workspace (maturin); the
    package's __version__ and python/pyproject.toml must say the same."""
    with open(os.path.join(repo, "Cargo.toml")) as f:
        cargo = re.search(r'^\[workspace\.package\][^\[]*?^version = "([^"]+)"', f.read(), re.M | re.S)
    with open(os.path.join(repo, "python", "pyproject.toml")) as f:
        py = re.search(r'^version = "([^"]+)"', f.read(), re.M)
    assert cargo and py
    assert cargo.group(1) == py.group(1) == moeconf.__version__
    with open(os.path.join(repo, "pyproject.toml")) as f:
        root = f.read()
    assert 'bindings = "bin"' in root and 'dynamic = ["version"]' in root


def test_a_wheel_built_from_another_commit_is_refused(tmp_path, monkeypatch):
    """The wheel's package names its commit (moeconf/_build.py, written by run_wheel.sh): a binary of
    the same release built from another commit does not fit."""
    monkeypatch.setattr(binary, "package_commit", lambda: "fedcba9876543210fedcba9876543210fedcba98")
    with pytest.raises(BinaryError, match="built from commit 0123456789abcdef"):
        binary.check(fake(tmp_path, GOOD.format(release=moeconf.__version__)))
    monkeypatch.setattr(binary, "package_commit", lambda: "0123456789abcdef0123456789abcdef01234567")
    assert binary.check(fake(tmp_path, GOOD.format(release=moeconf.__version__))).commit.startswith("0123")
