"""``ccld inspect`` on the boards of a live, a hung, a killed and a finished job."""

import json
import os
import signal
import subprocess
import sys
import time

from job_runner import run_job

from ccld_harness.launch import LocalJob


def _inspect(path) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "ccld_plugin.cli", "inspect", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_inspect_live_hung_and_killed_ranks(tmp_path):
    boards = tmp_path / "boards"
    job = LocalJob(
        world=2,
        argv=[
            "-m",
            "ccld_harness.workload",
            "--steps",
            "50",
            "--ccld-set",
            f"board.dir={boards}",
            "--ccld-set",
            "job=j",
        ],
        log_dir=tmp_path / "logs",
        env={"CCLD_FAULTS": "compute-hang@1:step=2"},
    )
    job.start()
    try:
        deadline = time.monotonic() + 60
        statuses = []
        while time.monotonic() < deadline:
            if len(list(boards.glob("j/*.board"))) == 2:
                statuses = _inspect(boards / "j")
                if statuses[0]["in_flight"] and statuses[0]["in_flight"][0]["age_s"] > 1.0:
                    break
            time.sleep(0.5)
        r0, r1 = statuses
        assert r0["process"] == "alive" and r1["process"] == "alive"
        (flight,) = r0["in_flight"]
        # Rank 0 is stuck in the DP all-reduce of step 2; rank 1 (hung in compute) is in none.
        assert flight["op"] == "all_reduce" and flight["group_ranks"] == [0, 1]
        assert r0["step"] == 2 and r1["step"] == 2 and r1["in_flight"] == []
        os.kill(job.procs[1].pid, signal.SIGKILL)
        job.procs[1].wait(timeout=10)
        r0, r1 = _inspect(boards / "j")
        assert r1["process"] == "dead" and r1["step"] == 2
        # The table form reads the same boards.
        text = subprocess.run(
            [sys.executable, "-m", "ccld_plugin.cli", "inspect", str(boards / "j" / "rank1.board")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert text.returncode == 0 and "dead" in text.stdout
    finally:
        job.stop()


def test_inspect_boards_left_by_a_finished_job_with_cleanup_off(tmp_path):
    boards = tmp_path / "boards"
    run_job(
        "ccld_harness.workload",
        2,
        tmp_path,
        args=(
            "--steps",
            "3",
            "--ccld-set",
            f"board.dir={boards}",
            "--ccld-set",
            "job=j",
            "--ccld-set",
            "board.cleanup=false",
        ),
    ).check()
    statuses = _inspect(boards)
    assert [s["rank"] for s in statuses] == [0, 1]
    for s in statuses:
        assert s["process"] == "exited" and s["in_flight"] == [] and s["step"] == 2
        dp = next(g for g in s["groups"] if g["ranks"] == [0, 1])
        assert dp["entered_seq"] == dp["completed_seq"] >= 4  # 3 gradient syncs + barrier


def test_inspect_error_is_one_line(tmp_path):
    bad = tmp_path / "x.board"
    bad.write_bytes(b"nope" * 1000)
    out = subprocess.run(
        [sys.executable, "-m", "ccld_plugin.cli", "inspect", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "not a ccld board" in out.stderr
