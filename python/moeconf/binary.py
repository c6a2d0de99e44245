"""The ``moeconf`` binary this package works with: where it is and whether it
fits (``python3 -m moeconf binary``).

The wheel built from the repository (``python/run_wheel.sh``, maturin with
``bindings = "bin"``) installs the Rust ``moeconf`` command beside this
package, with the same release. :func:`check` holds a binary to that: its
``moeconf --version`` (one ``key: value`` line each, ``cli/src/version.rs``)
must name this package's release, read every trace format version this
package writes, and write (by default) one this package reads. A mismatch is
a :class:`BinaryError` that says which and what to do, never a trace that one
side misreads.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from typing import NamedTuple, Optional, Tuple

__all__ = ["BinaryError", "BinaryInfo", "find", "info", "check"]


class BinaryError(Exception):
    """The binary is missing, does not run, or does not fit this package."""


class BinaryInfo(NamedTuple):
    """What ``moeconf --version`` says of one binary."""

    path: str
    release: str
    commit: str
    reads: Tuple[int, ...]
    writes: Tuple[int, ...]
    default_write: int
    baseline_schema: int


def find(path: Optional[str] = None) -> str:
    """The binary to use: ``path`` if given, else ``$MOECONF_BIN``, else the
    ``moeconf`` installed beside this interpreter (the wheel's scripts
    directory), else ``moeconf`` on ``PATH``."""
    if path:
        return path
    env = os.environ.get("MOECONF_BIN")
    if env:
        return env
    exe = "moeconf.exe" if os.name == "nt" else "moeconf"
    beside = os.path.join(sysconfig.get_path("scripts"), exe)
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("moeconf")
    if found:
        return found
    raise BinaryError(
        "no moeconf binary: not in $MOECONF_BIN, beside this Python ("
        + beside
        + ") nor on PATH; install the wheel (python/run_wheel.sh builds it) or `cargo install --path cli`"
    )


def _numbers(path, key, value):
    words = value.split()
    out = []
    for w in words:
        if not w.isdigit():
            break
        out.append(int(w))
    if not out:
        raise BinaryError(f"{path}: --version line {key!r} holds no version number: {value!r}")
    return tuple(out)


def parse_version(path: str, text: str) -> BinaryInfo:
    """Parses the output of ``moeconf --version`` (see :func:`info`)."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("moeconf "):
        raise BinaryError(f"{path}: not a moeconf binary (--version printed {text[:80]!r})")
    fields = {}
    for line in lines[1:]:
        key, sep, value = line.partition(": ")
        if sep:
            fields[key] = value.strip()
    need = ("commit", "trace formats read", "trace formats written", "baseline schema")
    missing = [k for k in need if k not in fields]
    if missing:
        raise BinaryError(
            f"{path}: --version does not name {', '.join(missing)}: a moeconf older than this package's "
            f"binary protocol (install the matching wheel)"
        )
    written = fields["trace formats written"]
    default = None
    if "(default " in written:
        tail = written.split("(default ", 1)[1].rstrip(")")
        if tail.isdigit():
            default = int(tail)
    writes = _numbers(path, "trace formats written", written)
    if default is None:
        default = max(writes)
    return BinaryInfo(
        path=path,
        release=lines[0][len("moeconf "):].strip(),
        commit=fields["commit"],
        reads=_numbers(path, "trace formats read", fields["trace formats read"]),
        writes=writes,
        default_write=default,
        baseline_schema=_numbers(path, "baseline schema", fields["baseline schema"])[0],
    )


def info(path: Optional[str] = None, timeout: float = 30.0) -> BinaryInfo:
    """Runs ``moeconf --version`` of :func:`find`'s binary and parses it."""
    exe = find(path)
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BinaryError(f"{exe}: cannot run it: {e}") from e
    if out.returncode != 0:
        raise BinaryError(f"{exe}: --version exited {out.returncode}: {out.stderr.decode(errors='replace')[:200]}")
    return parse_version(exe, out.stdout.decode("utf-8", errors="replace"))


def check(path: Optional[str] = None) -> BinaryInfo:
    """:func:`info`, held to this package: the same release, every trace
    format version this package writes readable by the binary, and the
    binary's default written version readable here. Raises
    :class:`BinaryError` naming the mismatch."""
    from . import __version__
    from .trace import FORMAT_V1, FORMAT_VERSION, READ_VERSION

    b = info(path)
    problems = []
    if b.release != __version__:
        problems.append(f"its release is {b.release}, this Python package's is {__version__}")
    ours_commit = package_commit()
    if ours_commit and b.commit != "unknown" and b.commit != ours_commit:
        problems.append(f"it was built from commit {b.commit}, this Python package from {ours_commit}")
    ours = tuple(range(FORMAT_V1, FORMAT_VERSION + 1))
    unread = [v for v in ours if v not in b.reads]
    if unread:
        problems.append(f"it does not read trace format version(s) {unread} that this package writes")
    if b.default_write not in range(FORMAT_V1, READ_VERSION + 1):
        problems.append(f"it writes trace format version {b.default_write} by default, which this package cannot read")
    if problems:
        raise BinaryError(
            f"{b.path}: does not fit the moeconf Python package at {os.path.dirname(__file__)}: "
            + "; ".join(problems)
            + " (install the wheel of one release: it holds both)"
        )
    return b


def package_commit() -> Optional[str]:
    """The commit this package was built from: ``moeconf/_build.py``, which
    ``python/run_wheel.sh`` writes into the wheel; ``None`` for a package used
    from a checkout or installed otherwise (then only the release is held
    to the binary's)."""
    try:
        from . import _build  # type: ignore[attr-defined]
    except ImportError:
        return None
    commit = getattr(_build, "COMMIT", None)
    return commit if isinstance(commit, str) and commit else None


def main(argv=None) -> int:
    """``python3 -m moeconf binary [--path P]``: prints the binary's
    release, commit and formats, and whether it fits; exit 2 if not."""
    import argparse

    p = argparse.ArgumentParser(prog="python3 -m moeconf binary", description=main.__doc__.split("\n")[0])
    p.add_argument("--path", default=None, help="the binary (default: $MOECONF_BIN, the wheel's, then PATH)")
    a = p.parse_args(argv)
    try:
        b = check(a.path)
    except BinaryError as e:
        print(f"moeconf: {e}", file=sys.stderr)
        return 2
    commit = package_commit()
    print(f"{b.path}: moeconf {b.release} (commit {b.commit}); reads trace formats "
          f"{' '.join(map(str, b.reads))}, writes {' '.join(map(str, b.writes))} (default {b.default_write}); "
          f"fits this package ({'the same commit' if commit else 'release checked; the package names no commit'})")
    on_path = shutil.which("moeconf")
    if on_path and os.path.realpath(on_path) != os.path.realpath(b.path):
        print(f"note: the `moeconf` a shell runs here is another binary, {on_path}: check it with --path")
    return 0
