"""No write through a symbolic link, and no open that blocks: the files a job writes (the
stack and crash files beside a board and their temporary files, the job's config, the
verdicts file, the round recording) refuse a link or a FIFO planted where they go, and
leave what it points to as it was."""

from __future__ import annotations

import logging
import os
import stat
from collections import Counter
from pathlib import Path

import pytest

from ccld_plugin import errors
from ccld_plugin.board.job_files import JOB_CONFIG, read_stack, write_crash, write_stack
from ccld_plugin.config import CcldConfig, SinksConfig
from ccld_plugin.errors import log as ccld_log
from ccld_plugin.files import open_private
from ccld_plugin.recording import RoundRecorder
from ccld_plugin.services.rank_services import _write_job_config
from ccld_plugin.sinks import JsonlSink, build_sinks


@pytest.fixture
def first_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Errors counted from zero, so that each place's first one is logged in this test."""
    monkeypatch.setattr(errors, "_counts", Counter())


@pytest.fixture
def target(tmp_path: Path) -> Path:
    t = tmp_path / "target"
    t.write_text("keep")
    return t


def _fifo_with_reader(path: Path) -> int:
    """A FIFO at ``path`` with a reader, so that an open for writing would not block (a
    writer that took it for a file would write into it)."""
    os.mkfifo(path)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK)


@pytest.mark.parametrize("append", [False, True])
def test_a_link_or_a_fifo_is_not_opened(tmp_path, target, append):
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError, match="is a symbolic link; not written through it"):
        open_private(tmp_path / "link", append=append)
    reader = _fifo_with_reader(tmp_path / "fifo")
    try:
        with pytest.raises(OSError, match="is not a regular file"):
            open_private(tmp_path / "fifo", append=append)
    finally:
        os.close(reader)
    assert target.read_text() == "keep"


def test_stack_and_crash_files_replace_a_link_and_use_no_guessable_temporary(tmp_path, target):
    board = tmp_path / "rank0.board"
    # a link where the stack goes, and one at each name a temporary file once had
    (tmp_path / "rank0.stack").symlink_to(target)
    for name in ("rank0.stack.tmp", "rank0.crash.tmp"):
        (tmp_path / name).symlink_to(target)
    write_stack(board, ["a.py:1 in f"])
    write_crash(board, ["a.py:2 in g", "MemoryError"])
    assert target.read_text() == "keep"
    assert not (tmp_path / "rank0.stack").is_symlink()
    assert read_stack(board) == ["a.py:1 in f"]
    for name in ("rank0.stack", "rank0.crash"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    leftovers = {p.name for p in tmp_path.iterdir()} - {"target", "rank0.stack", "rank0.crash"}
    assert leftovers == {"rank0.stack.tmp", "rank0.crash.tmp"}  # the planted links, unused


def test_the_job_config_is_not_written_through_a_link(tmp_path, target, caplog, first_errors):
    (tmp_path / JOB_CONFIG).symlink_to(target)
    with caplog.at_level(logging.WARNING, logger=ccld_log.name):
        assert _write_job_config(CcldConfig(), tmp_path) is None
    assert target.read_text() == "keep"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "contained error in services.job_config" in line
    assert f"is a symbolic link; not written through it: '{tmp_path / JOB_CONFIG}'" in line


def test_the_job_config_is_private(tmp_path):
    path = _write_job_config(CcldConfig(), tmp_path)
    assert path is not None and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_verdicts_file_is_not_written_through_a_link_nor_into_a_fifo(tmp_path, target):
    (tmp_path / "v.jsonl").symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        JsonlSink(tmp_path / "v.jsonl")
    assert build_sinks(SinksConfig(console=False, jsonl=str(tmp_path / "v.jsonl"))) == []
    reader = _fifo_with_reader(tmp_path / "f.jsonl")
    try:
        with pytest.raises(OSError, match="not a regular file"):
            JsonlSink(tmp_path / "f.jsonl")
    finally:
        os.close(reader)
    assert target.read_text() == "keep"


def test_the_recording_is_not_written_through_a_link_nor_into_a_fifo(tmp_path, target):
    (tmp_path / "rounds.rec").symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        RoundRecorder(tmp_path / "rounds.rec", "")
    reader = _fifo_with_reader(tmp_path / "fifo.rec")
    try:
        with pytest.raises(OSError, match="not a regular file"):
            RoundRecorder(tmp_path / "fifo.rec", "")
    finally:
        os.close(reader)
    assert target.read_text() == "keep"
    recorder = RoundRecorder(tmp_path / "new.rec", "")
    recorder.close()
    assert stat.S_IMODE((tmp_path / "new.rec").stat().st_mode) == 0o600
