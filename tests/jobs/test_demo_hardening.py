"""``ccld demo`` is honest and leaves nothing behind: bad input is refused before anything
runs (exit 2, one line), a job that failed is a failed demo (exit 1, one line saying why),
and no rank or W&B writer outlives a launcher killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_runner import FAST

from ccld_plugin.board.reader import BoardError, BoardReader

# A healthy plain-torch job long enough to be interrupted (it never gets to its end).
LONG = ("--framework", "torch", "--world", "2", "--tp", "1", "--pp", "1", "--steps", "2000")


def _ccld(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ccld_plugin.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (("--world", "0"), "--world 0 is not allowed"),
        (("--steps", "-1"), "--steps -1 is not allowed"),
        (("--fault", ""), "--fault '' is empty"),
        (
            ("--framework", "torch", "--world", "4", "--tp", "3", "--pp", "2", "--fault", "none"),
            "--world 4 is not a multiple of --tp 3 x --pp 2",
        ),
        (("--fault", "compute-hang@1:step=50", "--steps", "10"), "after the last step (9)"),
        (("--set", "job=../evil"), "job='../evil' is not allowed"),
        (("--set", "sinks.jsonl=/proc/x/y.jsonl"), "sinks.jsonl='/proc/x/y.jsonl' cannot be"),
        (("--set", "diagnoser.rank=4"), "diagnoser.rank=4 is not a rank of the 4-rank job"),
        (("--tp", "0"), "--tp 0 is not allowed; expected a number >= 1"),
        (("--framework", "deepspeed", "--pp", "2"), "--pp 2 does not apply to --framework"),
        (("--world", "100000"), "--world 100000 is more than this host can run: at most"),
        (
            (
                "--framework",
                "torch",
                "--world",
                "2",
                "--fault",
                "none",
                "--set",
                "sinks.jsonl=null",
            ),
            "sinks.jsonl=null: the demo follows the job through its verdicts file",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_runs(tmp_path, args, message):
    out = _ccld("demo", *args, "--out", str(tmp_path / "out"))
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("ccld: error: ") and message in line
    assert not (tmp_path / "out").exists()


def test_a_folder_that_is_not_a_demo_output_is_left_alone(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "mine.txt").write_text("keep me")
    out = _ccld("demo", "--out", str(tmp_path))
    assert out.returncode == 2
    assert "are not a demo's output" in out.stderr and "--force" in out.stderr
    assert (tmp_path / "logs" / "mine.txt").read_text() == "keep me"


def _start_demo(out: Path) -> subprocess.Popen:
    sets = sum((["--set", s] for s in FAST), [])
    return subprocess.Popen(
        [sys.executable, "-m", "ccld_plugin.cli", "demo", *LONG, "--fault", "none"]
        + ["--out", str(out), *sets],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, to kill as a whole
    )


def _board_pid(out: Path, rank: int, min_step: int, timeout_s: float = 120) -> int:
    """The pid of a rank once its board shows it training at ``min_step``."""
    deadline = time.monotonic() + timeout_s
    path = out / "boards" / f"rank{rank}.board"
    while time.monotonic() < deadline:
        try:
            with BoardReader(path) as r:
                h = r.header()
                if h.step >= min_step:
                    return h.pid
        except BoardError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} did not reach step {min_step}")


def test_a_rank_killed_in_a_healthy_run_fails_the_demo(tmp_path):
    demo = _start_demo(tmp_path)
    try:
        os.kill(_board_pid(tmp_path, 0, min_step=3), signal.SIGKILL)
        _, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ccld demo: failed: ranks [0, 1]") and "SIGKILL" in last, err


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent, start time) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """Every process below ``root`` (pid: start time), from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        st = _stat(int(entry)) if entry.isdigit() else None
        if st is not None:
            parent[int(entry)] = st
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for pid, (_, ppid, start) in parent.items():
            if ppid == p and pid not in found:
                found[pid] = start
                frontier.append(pid)
    return found


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start and st[0] not in ("Z", "X")


def test_no_rank_or_writer_outlives_a_demo_killed_with_sigkill(tmp_path):
    demo = _start_demo(tmp_path)
    procs: dict[int, int] = {}
    try:
        ranks = {_board_pid(tmp_path, r, min_step=2) for r in (0, 1)}
        deadline = time.monotonic() + 60  # rank 0's W&B writer starts with its sink
        while time.monotonic() < deadline and len(procs) <= len(ranks):
            procs = _descendants(demo.pid)
            time.sleep(0.5)
        assert ranks <= set(procs) and len(procs) > len(ranks), procs
        os.killpg(demo.pid, signal.SIGKILL)
        demo.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p, procs[p]) for p in ranks):
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p, procs[p])], "ranks outlived the launcher"
        deadline = time.monotonic() + 60  # the writer finishes the W&B run, then ends
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in procs.items()):
            time.sleep(0.5)
        assert not [p for p, s in procs.items() if _alive(p, s)], "the W&B writer lived on"
    finally:
        for pid, start in procs.items():  # only what this test started
            if _alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
