"""The wait of a thread for a CPU, as the step clock and the fault injector measure it: the
time the host's scheduler ran others while the thread was runnable, which the agent
leaves out of a step's compute. Measured on a real thread that shares its one core with a
busy process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ccld_plugin.agent.agent import StepClock
from ccld_plugin.agent.cpu_wait import ThreadCpuWait


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
        clock = StepClock()
        clock.mark(0)
        _busy(1.0)
        clock.mark(1)
    finally:
        rival.kill()
        rival.wait()
        os.sched_setaffinity(0, allowed)
    (_, t0, q0), (_, t1, q1) = clock.starts
    # two busy threads on one core: each waits about half the time (more on a busy host)
    assert 0.25 < (q1 - q0) / (t1 - t0) <= 1.0, (q1 - q0, t1 - t0)
    assert clock.current == 1


def test_the_wait_is_the_thread_own_and_never_goes_back() -> None:
    mine = ThreadCpuWait()
    first = mine.ns()
    _busy(0.05)
    assert mine.ns() >= first >= 0
