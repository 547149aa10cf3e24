"""``ccld demo`` stopped by a signal at any point of its run (its folder just claimed,
ranks being launched, training, a verdict in, its closed network being built): it ends
the job in bounded time, leaves no rank (nor its diagnoser process, nor a network
namespace) behind, says so in one line and exits with 128 + the signal's number."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from job_runner import FAST

from ccld_harness.faults import netns
from ccld_plugin.board.reader import BoardError, BoardReader

TORCH = ("--framework", "torch", "--tp", "1", "--pp", "1")
STOP_S = 30  # from the signal to the demo's exit: ranks get 3 s after SIGTERM, then SIGKILL


def _start(out: Path, *args: str) -> subprocess.Popen:
    sets = sum((["--set", s] for s in FAST), [])
    return subprocess.Popen(
        [sys.executable, "-m", "ccld_plugin.cli", "demo", *TORCH, *args, "--out", str(out)] + sets,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, to kill as a whole if need be
    )


def _rank_processes(out: Path) -> list[int]:
    """Live processes of the run: its ranks and its diagnoser process (their command
    lines name its board folder)."""
    mark = f"board.dir={out}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if any(mark in arg for arg in cmdline.split(b"\0")) and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def _step(out: Path) -> int:
    try:
        with BoardReader(out / "boards" / "rank0.board") as r:
            return r.header().step
    except BoardError:
        return -1


def _runs_of(pid: int, ranks: int | None = None) -> set[str]:
    """The closed networks (run ids) whose state file names ``pid`` as their owner (and
    that have ``ranks`` ranks)."""
    runs = set()
    for f in netns.STATE_DIR.glob("*.json"):
        try:
            state = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if state.get("pid") == pid and ranks in (None, state.get("num_ranks")):
            runs.add(f.stem)
    return runs


def _stop_at(
    tmp_path: Path,
    ready: Callable[[Path, subprocess.Popen], bool],
    sig: signal.Signals,
    *args: str,
) -> tuple[subprocess.Popen, str, set[str]]:
    """Start a demo, send ``sig`` once ``ready``, and check that it stopped as it should;
    its process, stderr and the closed networks it made."""
    out = tmp_path / "out"
    demo = _start(out, *args)
    runs: set[str] = set()
    try:
        deadline = time.monotonic() + 180
        while not ready(out, demo):
            runs |= _runs_of(demo.pid)
            assert demo.poll() is None, demo.communicate()[1]
            assert time.monotonic() < deadline, "the point to stop at never came"
            time.sleep(0.01)
        runs |= _runs_of(demo.pid)
        demo.send_signal(sig)
        sent = time.monotonic()
        _, err = demo.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 128 + sig, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ccld demo: stopped by {sig.name} "), err
    assert took < STOP_S, took
    assert not _rank_processes(out), "processes of the run outlived it"
    return demo, last, runs


def test_sigterm_once_the_folder_is_claimed(tmp_path: Path) -> None:
    _, last, _ = _stop_at(
        tmp_path, lambda out, _: (out / ".ccld-demo").exists(), signal.SIGTERM,
        "--world", "2", "--fault", "none",
    )  # fmt: skip
    assert last.startswith("ccld demo: stopped by SIGTERM before the job started"), last
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["exit"] == [], summary


def test_sigterm_while_an_8_rank_world_is_launched(tmp_path: Path) -> None:
    # Its first rank's log is made just before that rank is started; the other 7 follow.
    _stop_at(
        tmp_path, lambda out, _: (out / "logs" / "rank0.log").exists(), signal.SIGTERM,
        "--world", "8", "--steps", "2000", "--fault", "none",
    )  # fmt: skip
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["failure"].startswith("stopped by SIGTERM after "), summary


def test_sigterm_after_the_first_verdict(tmp_path: Path) -> None:
    def verdict_in(out: Path, _: subprocess.Popen) -> bool:
        path = out / "verdicts.jsonl"
        return path.exists() and path.stat().st_size > 0

    _, last, _ = _stop_at(
        tmp_path, verdict_in, signal.SIGTERM,
        "--world", "2", "--steps", "2000", "--fault", "compute-hang@1:step=3",
    )  # fmt: skip
    assert f"its boards are in {tmp_path / 'out' / 'boards'}" in last, last
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["verdicts"] and summary["boards"] == str(tmp_path / "out" / "boards")


def test_sigint_while_training_ends_the_diagnoser_process_too(tmp_path: Path) -> None:
    _stop_at(
        tmp_path, lambda out, _: _step(out) >= 2, signal.SIGINT,
        "--world", "2", "--steps", "2000", "--fault", "none", "--diagnoser-process",
        "--set", "diagnoser.unresponsive_s=4",
    )  # fmt: skip


def test_sighup_while_training(tmp_path: Path) -> None:
    _stop_at(
        tmp_path, lambda out, _: _step(out) >= 2, signal.SIGHUP,
        "--world", "2", "--steps", "2000", "--fault", "none",
    )  # fmt: skip


@pytest.mark.parametrize(
    "ranks",
    [1, 4],
    ids=["while-namespaces-are-checked", "while-the-job-network-is-built"],
)
def test_sigterm_while_the_closed_network_is_set_up(tmp_path: Path, ranks: int) -> None:
    ok, why = netns.available()
    if not ok:
        pytest.skip(f"closed network not available: {why}")
    # The demo first checks that namespaces work (a 1-rank network), then builds the
    # job's; each has its state file written before anything is built.
    _, _, runs = _stop_at(
        tmp_path, lambda _, demo: bool(_runs_of(demo.pid, ranks)), signal.SIGTERM,
        "--world", "4", "--steps", "2000", "--fault", "none", "--netns",
    )  # fmt: skip
    assert runs
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [n for n in names.split() if any(n.startswith(f"ccld-{r}-") for r in runs)]
    assert not left, left
    assert not [r for r in runs if (netns.STATE_DIR / f"{r}.json").exists()]
