"""What the plugin writes is the user's own: board folders per user and per job (mode
0700), board files and the verdicts file 0600; ``ccld inspect`` reads them where they are."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from job_runner import run_job


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_boards_and_verdicts_are_private_and_inspectable(tmp_path):
    job = f"private-{os.getpid()}"
    root = Path(f"/dev/shm/ccld-{os.getuid()}")
    verdicts = tmp_path / "out" / "verdicts.jsonl"
    sets = [
        f"job={job}",
        "board.cleanup=false",
        f"sinks.jsonl={verdicts}",
    ]
    try:
        run_job(
            "ccld_harness.workload",
            2,
            tmp_path,
            args=("--steps", "3", *sum((["--ccld-set", s] for s in sets), [])),
        ).check()
        boards = sorted((root / job).glob("*.board"))
        assert len(boards) == 2
        assert _mode(root) == 0o700 and _mode(root / job) == 0o700
        assert all(_mode(b) == 0o600 for b in boards)
        assert _mode(verdicts.parent) == 0o700 and _mode(verdicts) == 0o600
        out = subprocess.run(
            [sys.executable, "-m", "ccld_plugin.cli", "inspect", str(root / job)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "exited" in out.stdout, out.stderr
    finally:
        shutil.rmtree(root / job, ignore_errors=True)
