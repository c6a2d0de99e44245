"""Shared pytest fixtures: the package on sys.path, the repository root, and the
Rust ``moeconf`` binary (``$MOECONF_BIN`` or ``target/release/moeconf``; tests that
need it are skipped with a note when it is absent: building it is CI's job)."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYTHON_DIR)
sys.path.insert(0, PYTHON_DIR)


def require_transformers():
    """For a test module of the opt-in transformers suite, at its top: skips the module unless
    ``MOECONF_TRANSFORMERS_TESTS=1`` (python/run_interop.sh sets it) and torch and transformers
    import; returns ``(torch, transformers)``."""
    if os.environ.get("MOECONF_TRANSFORMERS_TESTS") != "1":
        pytest.skip("transformers tests are opt-in: MOECONF_TRANSFORMERS_TESTS=1 (python/run_interop.sh)",
                    allow_module_level=True)
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def repo():
    """The repository root."""
    return REPO


@pytest.fixture(scope="session")
def moeconf_bin():
    """Path of the Rust ``moeconf`` binary, or skip."""
    path = os.environ.get("MOECONF_BIN") or os.path.join(REPO, "target", "release", "moeconf")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.skip(f"moeconf binary not found at {path} (set MOECONF_BIN or run "
                    "`cargo build --release -p moeconf` first)")
    return path


@pytest.fixture
def run_moeconf(moeconf_bin, tmp_path):
    """Runs the Rust binary with a private built-in-model cache; returns the CompletedProcess."""

    def run(*args, check=True):
        env = dict(os.environ, MOECONF_CACHE_DIR=str(tmp_path / "cache"), NO_COLOR="1")
        p = subprocess.run([moeconf_bin, *map(str, args)], capture_output=True, text=True, env=env)
        if check and p.returncode != 0:
            raise AssertionError(f"moeconf {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr}")
        return p

    return run
