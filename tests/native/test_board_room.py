"""A board's pages are reserved when it is created: a folder without room for them is an
error there (ENOSPC), never a SIGBUS in the writer later; a board is never created
through a symbolic link; and the job's config, cut short by a full folder, is removed."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from ccld_plugin import _native, errors
from ccld_plugin.board.job_files import JOB_CONFIG
from ccld_plugin.config import CcldConfig
from ccld_plugin.services.rank_services import _write_job_config

RING, GROUPS, CHANNELS, POOL = 4096, 16, 64, 4096


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: room for 16 pages."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_board_without_room_is_refused_when_created(small_tmpfs):
    assert _native.board_size(RING, GROUPS, CHANNELS, POOL) > 64 * 1024
    # In a child: a board the folder cannot hold, written through, is a SIGBUS there.
    code = (
        "import sys\nfrom ccld_plugin import _native\n"
        f"b = _native.Board(sys.argv[1], 0, 1, 'j', 'h', {RING}, {GROUPS}, {CHANNELS}, {POOL})\n"
        "for i in range(8192):\n    b.exit(b.enter(0, 1, 0, 4), 2)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(small_tmpfs / "rank0.board")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert f"OSError: [Errno {errno.ENOSPC}] No space left on device" in out.stderr
    assert os.stat(small_tmpfs / "rank0.board").st_size == 0  # nothing half made


def test_a_board_that_fits_has_all_its_pages(small_tmpfs):
    size = _native.board_size(256, 4, 4, 16)
    assert 4 * 4096 < size < 64 * 1024  # pages that a first write would not all touch
    b = _native.Board(str(small_tmpfs / "rank0.board"), 0, 1, "j", "h", 256, 4, 4, 16)
    try:
        st = os.stat(small_tmpfs / "rank0.board")
        assert st.st_blocks * 512 >= st.st_size == size
    finally:
        b.close(unlink=True)


def test_a_board_is_not_created_through_a_link(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    (tmp_path / "rank0.board").symlink_to(target)
    with pytest.raises(OSError) as info:
        _native.Board(str(tmp_path / "rank0.board"), 0, 1, "j", "h", 16, 4, 4, 16)
    assert info.value.errno == errno.ELOOP and info.value.filename == str(tmp_path / "rank0.board")
    assert target.read_text() == "keep"


def test_a_job_config_without_room_is_removed_not_left_cut_short(small_tmpfs, caplog, monkeypatch):
    monkeypatch.setattr(errors, "_counts", Counter())  # this place's first error is logged
    (small_tmpfs / "filler").write_bytes(b"\0" * 64 * 1024)
    with caplog.at_level(logging.WARNING, logger=errors.log.name):
        assert _write_job_config(CcldConfig(), small_tmpfs) is None
    assert not (small_tmpfs / JOB_CONFIG).exists()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "contained error in services.job_config" in line and "No space left" in line
