"""The job's board folder: checked (links, owners, files where folders belong) and claimed
for one job at a time. Each claim below opens the lock file anew, as another process
would: ``flock`` locks belong to an open file, so two claims in one process behave as two
ranks (and closing one's descriptors as its process dying)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
from pathlib import Path

import pytest

from ccld_plugin.services.job_folder import LOCK_FILE, FolderRefused, claim


def _claim(root: Path, token: str = "a", world: int = 2, rank: int = 0, per_user: bool = True):
    return claim(root, per_user, root / "j", token, world, rank)


def test_ranks_of_one_job_share_the_folder_and_the_last_out_removes_it(tmp_path):
    root = tmp_path / "ccld-u"
    first, second = _claim(root, rank=0), _claim(root, rank=1)
    lines = (root / "j" / LOCK_FILE).read_text().splitlines()
    assert json.loads(lines[0])["token"] == "a" and json.loads(lines[0])["world"] == 2
    assert [json.loads(line)["rank"] for line in lines[1:]] == [0, 1]
    first.release(cleanup=True)
    assert (root / "j" / LOCK_FILE).exists()  # rank 1 still holds it
    second.release(cleanup=True)
    assert not (root / "j").exists()


def test_a_folder_held_by_a_live_job_is_refused_naming_it(tmp_path):
    root = tmp_path / "ccld-u"
    held = [_claim(root, rank=1), _claim(root, rank=0)]  # pids are named in rank order
    before = (root / "j" / LOCK_FILE).read_bytes()
    for world in (2, 3):  # the same size, or another: its other ranks are refused too
        with pytest.raises(FolderRefused) as info:
            _claim(root, token="b", world=world, rank=world - 1)
        pid = os.getpid()
        assert f"in use by another live job (2 ranks, pids {pid}, {pid} on " in str(info.value)
        assert socket.gethostname() in str(info.value) and "since 20" in str(info.value)
        assert "job=" in info.value.fix
    assert (root / "j" / LOCK_FILE).read_bytes() == before
    for h in held:
        h.release(cleanup=False)


def test_a_folder_whose_job_died_is_taken_over(tmp_path):
    root = tmp_path / "ccld-u"
    _claim(root, rank=0).release(cleanup=False)  # its descriptors closed: as if killed
    taken = _claim(root, token="b", world=4, rank=3)
    head = json.loads((root / "j" / LOCK_FILE).read_text().splitlines()[0])
    assert (head["token"], head["world"]) == ("b", 4)
    taken.release(cleanup=True)


def test_a_board_dir_that_is_a_link_is_refused_naming_its_target(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "ccld-u").symlink_to(real)
    for per_user in (True, False):
        with pytest.raises(FolderRefused) as info:
            _claim(tmp_path / "ccld-u", per_user=per_user)
        assert info.value.problem == f"board.dir {tmp_path / 'ccld-u'} is a symbolic link to {real}"
        assert info.value.fix == "set board.dir to the real folder"
    assert list(real.iterdir()) == []


def test_a_job_folder_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    root = tmp_path / "ccld-u"
    root.mkdir(mode=0o700)
    (root / "j").symlink_to(other)
    with pytest.raises(FolderRefused, match=f"is a symbolic link to {other}"):
        _claim(root)
    assert list(other.iterdir()) == []


def test_a_file_where_a_folder_belongs_is_refused(tmp_path):
    root = tmp_path / "ccld-u"
    root.mkdir(mode=0o700)
    (root / "j").write_text("x")
    with pytest.raises(FolderRefused, match="is not a folder"):
        _claim(root)
    (tmp_path / "f").write_text("x")
    with pytest.raises(FolderRefused, match="board.dir .* is not a folder"):
        _claim(tmp_path / "f")


def test_folders_of_another_user_are_refused_a_shared_board_dir_is_not(tmp_path):
    root = tmp_path / "ccld-u"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    with pytest.raises(FolderRefused, match=r"ccld-u is owned by uid 12345, not by this user"):
        _claim(root)
    # board.dir without {uid}: a folder anyone may share, in which the job's is the user's
    _claim(root, per_user=False).release(cleanup=True)
    (root / "j").mkdir()
    os.chown(root / "j", 12345, 12345)
    with pytest.raises(FolderRefused, match=r"j is owned by uid 12345"):
        _claim(root, per_user=False)


def test_loose_folders_are_made_private(tmp_path):
    root = tmp_path / "ccld-u"
    (root / "j").mkdir(parents=True)
    for folder in (root, root / "j"):
        folder.chmod(0o755)
    held = _claim(root)
    for folder in (root, root / "j"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "j" / LOCK_FILE).stat().st_mode) == 0o600
    held.release(cleanup=True)


def test_a_lock_file_that_is_a_link_is_refused(tmp_path):
    root = tmp_path / "ccld-u"
    (root / "j").mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("keep")
    (root / "j" / LOCK_FILE).symlink_to(target)
    with pytest.raises(FolderRefused, match="lock file .* cannot be opened \\(a symbolic link\\)"):
        _claim(root)
    assert target.read_text() == "keep"


def test_the_holder_is_named_with_its_pids_in_rank_order(tmp_path):
    root = tmp_path / "ccld-u"
    (root / "j").mkdir(parents=True)
    lock = root / "j" / LOCK_FILE
    lines = [{"token": "x", "world": 3, "started": 0}]
    lines += [{"rank": r, "host": f"h{r % 2}", "pid": 100 + r} for r in (2, 0, 1)]
    lock.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with open(lock) as held:  # a live rank of job x
        fcntl.flock(held, fcntl.LOCK_SH)
        with pytest.raises(FolderRefused) as info:
            _claim(root, token="y")
    assert "another live job (3 ranks, pids 100, 101, 102 on h0, h1 since 19" in str(info.value)
