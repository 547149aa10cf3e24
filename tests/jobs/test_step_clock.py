"""The step clock measures how long the training thread waited runnable for a CPU: what the
agent leaves out of a step's compute (the host's scheduler running others), measured on a
real thread that shares its one core with a busy process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ccld_plugin.agent.agent import StepClock, runnable_wait_ns


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _runnable_share(clock: StepClock, step: int, seconds: float) -> float:
    clock.mark(step)
    _busy(seconds)
    clock.mark(step + 1)
    (_, t0, q0), (_, t1, q1) = clock.starts[-2], clock.starts[-1]
    return (q1 - q0) / (t1 - t0)


def test_runnable_wait_is_the_time_a_process_on_the_same_core_took() -> None:
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
        clock = StepClock()
        shared = _runnable_share(clock, 0, 1.0)
    finally:
        rival.kill()
        rival.wait()
        os.sched_setaffinity(0, allowed)
    # two busy threads on one core: each waits about half the time (more on a busy host)
    assert 0.25 < shared <= 1.0, shared
    assert clock.current == 1


def test_no_scheduler_statistics_reads_as_no_wait() -> None:
    assert runnable_wait_ns(-1) == 0
    r, w = os.pipe()
    os.close(w)
    try:
        assert runnable_wait_ns(r) == 0  # not a schedstat file: nothing to read
    finally:
        os.close(r)
