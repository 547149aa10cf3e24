"""The wait of a thread for a CPU, as the step clock and the fault injector measure it: the
time the host's scheduler ran others while the thread was runnable, which the agent
leaves out of a step's compute (but inside communication, where it is already the op's
time). Measured on real threads that share their one core with a busy process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from job_runner import run_job

from ccld_plugin.tracing.cpu_wait import ThreadCpuWait


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_the_wait_for_a_cpu_is_the_time_a_process_on_the_same_core_took() -> None:
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("this kernel keeps no scheduler statistics")
    cpu = min(os.sched_getaffinity(0))
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # this thread only
    rival = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        time.sleep(0.3)  # the rival is up and spinning
        mine = ThreadCpuWait()
        t0, q0 = time.monotonic_ns(), mine.ns()
        _busy(1.0)
        t1, q1 = time.monotonic_ns(), mine.ns()
    finally:
        rival.kill()
        rival.wait()
        os.sched_setaffinity(0, allowed)
    # two busy threads on one core: each waits about half the time (more on a busy host)
    assert 0.25 < (q1 - q0) / (t1 - t0) <= 1.0, (q1 - q0, t1 - t0)


def test_the_wait_is_the_thread_own_and_never_goes_back() -> None:
    mine = ThreadCpuWait()
    first = mine.ns()
    _busy(0.05)
    assert mine.ns() >= first >= 0


def test_a_wait_inside_blocking_communication_is_left_to_the_op(tmp_path) -> None:
    # The agent takes a blocking op's whole time out of the step's compute: a wait for a
    # CPU inside it (the wake-up after a recv on a crowded host) taken out again made
    # compute too low by the share of the step spent waking up, which changes with how
    # crowded the host is (a 4-stage pipeline's stages "slowed" 3x when one stage slept).
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("this kernel keeps no scheduler statistics")
    res = run_job("cpu_wait_in_ops.py", 2, tmp_path, env={"BOARD_DIR": str(tmp_path / "b")})
    (got,) = res.check().json_lines(0, "CPU_WAIT")
    inside, outside = got["inside"], got["outside"]
    assert inside["total_ns"] > 0.25 * got["busy_ns"], got  # the rival took its share
    assert outside["total_ns"] > 0.25 * got["busy_ns"], got
    # inside the op, compute is left none of it (only what falls between the reads)
    assert inside["outside_ns"] < 0.1 * inside["total_ns"], got
    # outside any op, compute's all of it
    assert outside["outside_ns"] > 0.9 * outside["total_ns"], got
