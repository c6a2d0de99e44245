"""The Python writer's output guarantees (docs/format.md section 10), the same as
the Rust writer's: the output path is checked before anything is written (its
directory exists; nothing but a regular file is replaced; a symbolic link is
refused; no input given in ``inputs`` is overwritten, by path or hard link),
the temporary file is ``.NAME.moeconf-tmp.PID.RAND`` and is removed on every
error path (including a failed fsync or rename in ``finish``), stale temporary
files of dead processes raise a warning, and files get the mode 0666 & ~umask."""

import os
import re
import socket

import numpy as np
import pytest

from moeconf import Binding, Coord, TraceWriter, read_trace
from moeconf.trace import OutputError, StaleTemporaryWarning, stale_temporaries


def _binding():
    return Binding(model_name="out", max_new_tokens=1)


def _write(path, **kw):
    w = TraceWriter(path, _binding(), **kw)
    w.append(Coord.make(0, 0, "prefill", None, "token.output"), "L0", np.array([1], np.int32), keep_payload=True)
    return w.finish()


def test_outputs_that_are_not_regular_files_are_refused(tmp_path):
    fifo = tmp_path / "f.bin"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="FIFO"):
        _write(fifo)
    d = tmp_path / "d.bin"
    d.mkdir()
    with pytest.raises(OutputError, match="is a directory"):
        _write(d)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(tmp_path / "s.bin"))
        with pytest.raises(OutputError, match="socket"):
            _write(tmp_path / "s.bin")
    finally:
        s.close()
    with pytest.raises(OutputError, match="does not exist"):
        _write(tmp_path / "missing" / "t.bin")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        _write(tmp_path / "file" / "t.bin")
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "f.bin", "file", "s.bin"]


def test_symbolic_links_are_refused_and_left_alone(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    with pytest.raises(OutputError, match="symbolic link"):
        _write(link)
    assert link.is_symlink() and target.read_text() == "keep"


def test_inputs_are_never_overwritten(tmp_path):
    ref = tmp_path / "ref.bin"
    _write(ref)
    before = ref.read_bytes()
    with pytest.raises(OutputError, match="same file as the input"):
        _write(ref, inputs=[ref])
    hard = tmp_path / "hard.bin"
    os.link(ref, hard)
    with pytest.raises(OutputError, match="same file as the input"):
        _write(hard, inputs=[ref])
    assert ref.read_bytes() == before
    _write(hard)   # without inputs, replacing an existing regular file is a normal write
    assert read_trace(hard).root == read_trace(ref).root


def test_temporary_file_name_and_cleanup_on_every_error(tmp_path, monkeypatch):
    p = tmp_path / "t.bin"
    w = TraceWriter(p, _binding())
    (tmp,) = os.listdir(tmp_path)
    assert re.fullmatch(rf"\.t\.bin\.moeconf-tmp\.{os.getpid()}\.[0-9a-f]{{16}}", tmp), tmp
    # The destination becomes a directory before finish: refused, temporary file removed.
    p.mkdir()
    with pytest.raises(OutputError, match="is a directory"):
        w.finish()
    assert os.listdir(tmp_path) == ["t.bin"]
    p.rmdir()
    # A failing fsync (disk full, I/O error) in finish.
    w = TraceWriter(p, _binding())

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space"):
        w.finish()
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    # A writer dropped without finish or ``with``.
    w = TraceWriter(p, _binding())
    del w
    assert os.listdir(tmp_path) == []


def test_stale_temporaries_are_reported(tmp_path):
    p = tmp_path / "t.bin"
    stale = tmp_path / ".t.bin.moeconf-tmp.99999999.0123456789abcdef"
    old = tmp_path / ".t.bin.tmp-99999999-0"
    stale.write_text("")
    old.write_text("")
    assert stale_temporaries(p) == sorted([(str(stale), 99999999), (str(old), 99999999)])
    with pytest.warns(StaleTemporaryWarning, match="stale temporary file"):
        _write(p)
    assert stale.exists(), "the writer does not remove what it did not create"


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_traces_get_the_umask_mode(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        _write(tmp_path / "t.bin")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "t.bin").st_mode & 0o777 == mode
