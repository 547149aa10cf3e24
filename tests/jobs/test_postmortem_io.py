"""The post-mortem commands on the boards a real gloo job left (rank 1 hung in compute,
both ranks killed), where the system refuses them something: corrupt records, a full or
read-only file system for their outputs, folders this user cannot read. Each is one line
naming the path; what can be written is written, and nothing written before is lost."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from job_runner import FAST

from ccld_harness.launch import LocalJob
from ccld_plugin.board.reader import HEADER_DTYPE, OP_DTYPE

ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def dead_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The board folder of a 2-rank job whose rank 1 hung in compute at step 2, killed
    (SIGKILL) once its live diagnoser had said so."""
    tmp = tmp_path_factory.mktemp("dead")
    boards, live = tmp / "boards", tmp / "live.jsonl"
    overrides = [f"board.dir={boards}", "job=j", f"sinks.jsonl={live}", *FAST]
    job = LocalJob(
        world=2,
        argv=["-m", "ccld_harness.workload", "--steps", "50"]
        + [arg for o in overrides for arg in ("--ccld-set", o)],
        log_dir=tmp / "logs",
        env={"CCLD_FAULTS": "compute-hang@1:step=2"},
    )
    job.start()
    try:
        deadline = time.monotonic() + 90
        while not (live.exists() and '"hang"' in live.read_text()):
            if time.monotonic() > deadline:
                pytest.fail("the live diagnoser never said the hang")
            time.sleep(0.5)
        # a few agent ticks more: the boards' last heartbeat is then past the threshold
        # that the live round crossed (it may lag the round by a tick)
        time.sleep(2.0)
    finally:
        for p in job.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        job.stop()
    return boards / "j"


@pytest.fixture
def job(dead_job: Path, tmp_path: Path) -> Path:
    """A copy of the dead job's folder for one test to damage."""
    return Path(shutil.copytree(dead_job, tmp_path / "j"))


def _ccld(*argv: str, user: pwd.struct_passwd | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ccld_plugin.cli", *argv]
    if user is not None:  # a real other user, no capabilities (root reads every folder)
        ids = [f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
        cmd = ["setpriv", *ids, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", ["diagnose", "trace"])
def test_corrupt_records_are_said_as_by_inspect_and_the_rest_is_written(job, tmp_path, command):
    board = job / "rank0.board"
    data = bytearray(board.read_bytes())
    ring = int(np.frombuffer(bytes(data[: HEADER_DTYPE.itemsize]), HEADER_DTYPE)[0]["ring_off"])
    at = ring + OP_DTYPE.fields["bytes"][1] + 6
    data[at] ^= 0x40  # the first op record's byte count: 2**54 more bytes than it moved
    board.write_bytes(bytes(data))
    said = _ccld("inspect", str(job))
    assert said.returncode == 1
    warning = _one_line(said.stderr)
    assert warning.startswith(f"ccld: warning: {board}: corrupt records left out (1 ops)")
    out_file = tmp_path / ("v.jsonl" if command == "diagnose" else "t.json")
    option = "--jsonl" if command == "diagnose" else "-o"
    out = _ccld(command, str(job), option, str(out_file))
    assert out.returncode == 1 and _one_line(out.stderr) == warning
    if command == "diagnose":  # the verdict still comes, from what passed its checks
        verdicts = [json.loads(line) for line in out_file.read_text().splitlines()]
        assert ("hang", [1]) in [(v["kind"], v["ranks"]) for v in verdicts]
    else:
        assert json.loads(out_file.read_text())["traceEvents"]


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A 64 KiB tmpfs mounted for the test (root only), unmounted however it ends."""
    if not ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="ccld-small-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def _fill(folder: Path) -> None:
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass  # full
    finally:
        os.close(fd)


def test_outputs_on_a_full_file_system_fail_in_one_line_and_keep_what_was_there(job, small_tmpfs):
    trace = small_tmpfs / "trace.json"
    trace.write_text("the last timeline")
    _fill(small_tmpfs)

    out = _ccld("trace", str(job), "-o", str(trace), "--force")
    assert out.returncode == 2
    assert _one_line(out.stderr) == (
        f"ccld: error: {trace}: cannot be written (No space left on device)"
    )
    assert trace.read_text() == "the last timeline"  # replaced all or nothing

    verdicts = small_tmpfs / "v.jsonl"
    out = _ccld("diagnose", str(job), "--jsonl", str(verdicts))
    assert out.returncode == 2
    assert _one_line(out.stderr) == (
        f"ccld: error: {verdicts}: cannot be written (No space left on device)"
    )
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["filler", "trace.json"]


def test_outputs_on_a_read_only_file_system_are_one_line(job, small_tmpfs, tmp_path):
    rec = tmp_path / "none.rec"  # (replay's output is checked before its input is read)
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    for argv, verb in (
        (["trace", str(job), "-o", str(small_tmpfs / "t.json")], "written"),
        (["diagnose", str(job), "--jsonl", str(small_tmpfs / "v.jsonl")], "opened"),
    ):
        out = _ccld(*argv)
        assert out.returncode == 2
        target = argv[-1]
        assert _one_line(out.stderr) == (
            f"ccld: error: {target}: cannot be {verb} (Read-only file system)"
        )
    assert not rec.exists() and list(small_tmpfs.iterdir()) == []


@pytest.fixture
def other_user() -> pwd.struct_passwd:
    """A user without root's right to read every folder."""
    if not ROOT or shutil.which("setpriv") is None:
        pytest.skip("running as another user needs root and setpriv")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' here to run as")


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder every user can reach (pytest's own are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="ccld-shared-"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.mark.parametrize("command", ["inspect", "diagnose", "trace"])
def test_a_folder_this_user_cannot_read_is_one_line(dead_job, shared_tmp, other_user, command):
    job = Path(shutil.copytree(dead_job, shared_tmp / "j"))
    argv = [command, str(job)] + (["-o", str(shared_tmp / "t.json")] if command == "trace" else [])

    job.chmod(0o700)  # not listed for others
    out = _ccld(*argv, user=other_user)
    assert out.returncode == 2
    assert _one_line(out.stderr) == f"ccld: error: {job}: cannot be listed (Permission denied)"

    job.chmod(0o744)  # listed, but no entry can be opened
    out = _ccld(*argv, user=other_user)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    first = f"{job / 'rank0.board'}: cannot be opened (Permission denied)"
    if command == "inspect":  # every board said
        assert out.stderr.strip().splitlines() == [
            f"ccld: error: {job / f'rank{r}.board'}: cannot be opened (Permission denied)"
            for r in (0, 1)
        ]
    else:
        assert _one_line(out.stderr) == (
            f"ccld: error: no readable board (*.board) at {job} (2 unreadable, the first: "
            f"{first}); boards are in <board.dir>/<job>/ (default /dev/shm/ccld-<uid>/<job>/)"
        )
