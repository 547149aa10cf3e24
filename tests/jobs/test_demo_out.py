"""Where ``ccld demo`` writes, and what it reads back: the boards, verdicts and board
cleanup where ``--set`` puts them (the run judged by them, the summary saying where the
boards are), and an ``--out`` folder held by a live demo, refused to a second one, which
deletes nothing of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_runner import CUT_LINK, FAST, netns_demo, only

from ccld_harness.faults import netns
from ccld_plugin.board.reader import BoardError, BoardReader

TORCH = ("--framework", "torch", "--world", "2", "--tp", "1", "--pp", "1")


def _ccld_demo(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    sets = sum((["--set", s] for s in FAST), [])
    return subprocess.run(
        [sys.executable, "-m", "ccld_plugin.cli", "demo", *TORCH, "--out", str(out), *sets, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_board_dir_job_and_verdicts_elsewhere_are_read_there(tmp_path: Path) -> None:
    boards, verdicts = tmp_path / "shm", tmp_path / "elsewhere" / "v.jsonl"
    boards.mkdir()
    # a board an earlier, larger run of the same job name left: not this run's
    (boards / "myjob").mkdir()
    (boards / "myjob" / "rank5.board").write_bytes(b"\0" * 4096)
    run = _ccld_demo(
        tmp_path / "out", "--steps", "30", "--fault", "compute-hang@1:step=4",
        "--set", f"board.dir={boards}", "--set", "job=myjob",
        "--set", f"sinks.jsonl={verdicts}", "--set", "board.cleanup=false",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["boards"] == str(boards / "myjob")
    assert summary["latency_s"][0]["verdict"], summary
    assert summary["verdicts"] == [json.loads(x) for x in verdicts.read_text().splitlines()]
    assert 4 <= summary["steps_completed"] < 30 and summary["failure"] is None
    assert f"boards in {boards / 'myjob'}" in " ".join(run.stdout.split())
    assert {p.name for p in (boards / "myjob").glob("*.board")} == {
        "rank0.board",
        "rank1.board",
        "rank5.board",
    }
    assert not (tmp_path / "out" / "boards").exists()


def test_board_cleanup_set_true_is_applied_after_the_boards_are_read(tmp_path: Path) -> None:
    # the ranks removed their boards at exit, and the demo found "0 of 8 steps"
    run = _ccld_demo(
        tmp_path / "out", "--steps", "8", "--fault", "none", "--set", "board.cleanup=true"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps_completed"] == 8 and summary["boards"] is None, summary
    assert not (tmp_path / "out" / "boards").exists()


def test_a_link_fault_watches_the_boards_where_board_dir_puts_them(tmp_path: Path) -> None:
    # the launcher applies a cut when the rank's board reaches the fault's step: it read
    # DIR/boards, and the fault was never injected
    ok, why = netns.available()
    if not ok:
        pytest.skip(f"closed network not available: {why}")
    boards = tmp_path / "b"
    extra = (*CUT_LINK, f"board.dir={boards}", "job=cut")
    code, summary = netns_demo(tmp_path, 1, 1, 40, "comm-hang@2:step=4", extra=extra)
    assert [f["rank"] for f in summary["faults"]] == [2], summary["failure"]
    assert only(summary, "hang", "communication")["ranks"] == [2]
    assert code == 0 and summary["boards"] is None  # board.cleanup: removed, after reading
    assert not (boards / "cut" / "rank0.board").exists()


def _training(out: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with BoardReader(out / "boards" / "rank0.board") as r:
                if r.header().step >= 2:
                    return
        except BoardError:
            pass
        time.sleep(0.2)
    raise AssertionError("the first demo never trained")


def _kept(out: Path) -> set[str]:
    """The files in a live demo's ``out`` that stay while it runs: all but a rank's stack
    file, which the rank itself removes once it moves again (agent.stack_after_s)."""
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.suffix != ".stack"}


def test_a_second_demo_on_a_live_demos_out_is_refused_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    sets = sum((["--set", s] for s in FAST), [])
    first = subprocess.Popen(
        [sys.executable, "-m", "ccld_plugin.cli", "demo", *TORCH, "--steps", "2000"]
        + ["--fault", "none", "--out", str(out), *sets],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _training(out)
        before = _kept(out)
        second = _ccld_demo(out, "--steps", "5", "--fault", "none", timeout=60)
        assert second.returncode == 2, second.stdout + second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert line == (
            f"ccld: error: ccld demo: --out {out} is in use by another demo still running "
            f"(pid {first.pid}); wait for it to end, or choose another --out"
        )
        after = _kept(out)
        assert before <= after, before - after
        assert first.poll() is None, "the first demo was disturbed"
        with BoardReader(out / "boards" / "rank0.board") as r:
            assert r.header().pid > 0
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    # gone, its hold is gone with it: the next demo reuses the folder as a finished demo's
    third = _ccld_demo(out, "--steps", "5", "--fault", "none")
    assert third.returncode == 0, third.stdout + third.stderr


def test_an_out_whose_parent_folder_does_not_exist_is_refused(tmp_path: Path) -> None:
    run = _ccld_demo(tmp_path / "no" / "such" / "out", "--fault", "none", timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert line == (
        f"ccld: error: ccld demo: --out {tmp_path / 'no' / 'such' / 'out'}: the folder "
        f"{tmp_path / 'no' / 'such'} does not exist; create it first, or choose another --out"
    )
    assert not (tmp_path / "no").exists()
