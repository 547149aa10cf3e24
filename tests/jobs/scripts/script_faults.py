"""The faults of the unchanged test scripts (they know nothing of ccld, nor of its fault
specs): FAULT in the environment is ``hang@R:S`` (rank R blocks at step S), ``kill@R:S``
(rank R's process ends by SIGKILL at step S), ``crash@R:S`` (rank R raises an exception it
does not catch at step S), ``slow@R:X`` (rank R's compute takes X seconds more every step;
``slow@R:X:S`` from step S on), ``stall@R:S:X`` (rank R stops X seconds at step S, then
goes on), ``skip@R:S`` (rank R leaves out its gradient all-reduce at
step S: see ``skips``) or ``misuse@R:S`` (rank R calls its tensor-parallel collective
with an output of the wrong size at step S: see ``misuses``). With FAULT_ATTEMPT=N, only
attempt N of a job that torchrun restarts (TORCHELASTIC_RESTART_COUNT) has the fault."""

import os
import signal
import time


def fault(rank: int, step: int) -> None:
    kind, _, where = os.environ.get("FAULT", "").partition("@")
    attempt = os.environ.get("FAULT_ATTEMPT")
    if not kind or attempt not in (None, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        return
    who, arg, *onset = where.split(":")
    if int(who) != rank:
        return
    if kind == "hang" and step == int(arg):
        time.sleep(3600)
    if kind == "kill" and step == int(arg):
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "crash" and step == int(arg):
        raise MemoryError("out of memory (a test script's crash)")
    if kind == "stall" and step == int(arg):
        time.sleep(float(onset[0]))
    if kind == "slow" and step >= int(onset[0] if onset else 0):
        time.sleep(float(arg))


def skips(rank: int, step: int) -> bool:
    """Whether rank leaves out its gradient all-reduce at this step (``skip@R:S``)."""
    kind, _, where = os.environ.get("FAULT", "").partition("@")
    return kind == "skip" and where == f"{rank}:{step}"


def misuses(rank: int, step: int) -> bool:
    """Whether rank calls its tensor-parallel collective wrongly at this step
    (``misuse@R:S``): the call raises on that rank alone."""
    kind, _, where = os.environ.get("FAULT", "").partition("@")
    return kind == "misuse" and where == f"{rank}:{step}"
