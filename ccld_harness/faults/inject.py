"""Faults inside a rank: slow compute, a compute hang, a mismatched collective, a kill, a
crash, a freeze, contention for its CPU.

A training loop calls ``before_step`` at each step start and ``bind_groups`` once its
groups exist. A compute-slow fault then hooks into the tracer, which calls ``stretch()``
right before every communication, in any framework. Slowness is a sleep
proportional to the measured compute time, without the time the rank waited for a CPU
(busy work would slow the other ranks that share these few cores, and a slower device
stretches its own work, not the host's queue). Each fault's actual onset is appended to
the fault log (``CCLD_FAULT_LOG``) with the time on the diagnoser's clock, so detection
latency is measured, not guessed.

A cpu-contention fault is a noisy neighbour: the rank's process is pinned to one core and
a busy process, pinned there too, shares it (until the rank's process ends, or at most
CONTENTION_MAX_S).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ccld_harness.faults.spec import FaultSpec, parse_faults

__all__ = ["InjectedCrash", "Injector", "injector_for"]

CONTENTION_MAX_S = 600.0  # a cpu-contention fault's busy process ends by then at the latest


class InjectedCrash(RuntimeError):
    """The crash fault's exception: the training loop does not catch it."""


class Injector:
    def __init__(
        self,
        rank: int,
        faults: Sequence[FaultSpec],
        log_path: Path | None = None,
        world: int | None = None,
    ) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.rank == rank and not f.is_comm]
        self.log_path = log_path
        self.world = world
        self._slow_factor = 1.0
        self._started: set[FaultSpec] = set()
        self._groups: dict[str, Any] = {}
        # (time, blocked ns, CPU wait ns) at the last stretch
        self._mark: tuple[int, int, int] | None = None
        self._tracer: Any = None  # the session's: the training thread's wait for a CPU
        self._device: Any = None  # the simulated device, for its faults

    def bind_groups(self, groups: dict[str, Any]) -> None:
        """The rank's process groups by role, for the mismatch fault."""
        self._groups = {k: v for k, v in groups.items() if v is not None}

    def bind_device(self, device: Any) -> None:
        """The rank's simulated device (``ccld_harness.simdev``), for device faults."""
        self._device = device

    def before_step(self, step: int) -> None:
        for f in self.faults:
            if step < f.step or f in self._started:
                continue
            self._started.add(f)
            self._record(f, step)
            if f.kind == "compute-slow":
                self._slow_factor = max(self._slow_factor, f.factor)
                self._hook_into_tracer()
            elif f.kind == "mismatch":
                self._issue_mismatched_collective()
            elif f.kind == "kill":
                # A crash that runs no handler: no exit path, no board cleanup, no last
                # summary. The fault log line above is flushed and closed already.
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "crash":
                raise InjectedCrash(f"injected crash ({f}) at step {step}")
            elif f.kind == "cpu-contention":
                self._share_the_core()
            elif f.kind == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)  # until the launcher ends it
            elif f.is_device:
                self._break_device(f)
            elif f.kind == "compute-hang":
                while True:  # stuck in host code: the peers block in their next collective
                    time.sleep(3600)

    def _break_device(self, f: FaultSpec) -> None:
        """device-slow: the device's kernels take ``factor`` times as long from now on (the
        host goes on at its pace); device-hang: its next kernel never finishes."""
        if self._device is None:
            raise RuntimeError(f"fault {f} needs the simulated device: run with --device sim")
        if f.kind == "device-slow":
            self._device.slow_factor = max(self._device.slow_factor, f.factor)
        else:
            self._device.hang_next_kernel()

    def _hook_into_tracer(self) -> None:
        """Stretch compute right before every traced communication, in any framework."""
        from ccld_plugin.services.session import current

        s = current()
        if s is not None:
            self._mark = None
            self._tracer = s.tracer
            s.tracer.before_op = self.stretch

    def stretch(self) -> None:
        """Call right before each communication: under compute-slow, the compute since the
        previous call (wall time minus time blocked in collectives and queued for a CPU)
        is stretched to ``factor`` times its length, as a slower device would. Stretching
        every interval between collectives, not one lump per step, makes the rank arrive
        late at each."""
        if self._slow_factor <= 1.0:
            return
        board = self._board()
        blocked = board.blocked_ns if board is not None else 0
        # the wait for a CPU outside communication: one inside is part of ``blocked``
        queued = self._tracer.cpu_wait_outside_ns() if self._tracer is not None else 0
        now = time.monotonic_ns()
        if self._mark is not None:
            t_prev, blocked_prev, queued_prev = self._mark
            compute = (now - t_prev) - (blocked - blocked_prev) - (queued - queued_prev)
            self.after_compute(max(0, compute) / 1e9)
        self._mark = (time.monotonic_ns(), blocked, queued)

    def after_compute(self, seconds: float) -> None:
        """Stretch a compute segment that took ``seconds`` of pure compute."""
        if self._slow_factor > 1.0:
            time.sleep((self._slow_factor - 1.0) * seconds)

    @staticmethod
    def _share_the_core() -> None:
        """Pin the rank's process (every thread of it, and the threads they start) to one
        core and start a busy process there that ends with this process (it watches its
        parent) or after CONTENTION_MAX_S."""
        cpu = max(os.sched_getaffinity(0))
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), {cpu})
            except OSError:  # a thread that ended meanwhile
                pass
        spin = (
            "import os, time\n"
            f"os.sched_setaffinity(0, {{{cpu}}})\n"
            f"end = time.monotonic() + {CONTENTION_MAX_S}\n"
            f"while os.getppid() == {os.getpid()} and time.monotonic() < end:\n"
            "    for _ in range(100_000):\n"
            "        pass\n"
        )
        busy = subprocess.Popen([sys.executable, "-c", spin])
        atexit.register(busy.kill)

    @staticmethod
    def _board() -> Any:
        from ccld_plugin.services.session import current

        s = current()
        return s.board if s is not None else None

    def _issue_mismatched_collective(self) -> None:
        import torch
        import torch.distributed as dist

        # a group with a peer to disagree with (Megatron hands a data-parallel group of
        # one at DP=1); the world's where the rank has none
        group = next(
            (
                self._groups[r]
                for r in ("dp", "tp")
                if r in self._groups and dist.get_world_size(self._groups[r]) > 1
            ),
            None,
        )
        size = dist.get_world_size(group)
        out = torch.zeros(size * 3)
        # The peers' next op on this group is an all_reduce of another size.
        dist.all_gather_into_tensor(out, torch.ones(3), group=group)

    def _record(self, fault: FaultSpec, step: int) -> None:
        if self.log_path is None:
            return
        from ccld_plugin.services.session import job_seconds

        now = time.monotonic_ns()
        entry = {
            "fault": str(fault),
            "kind": fault.kind,
            "rank": fault.rank,
            "step": step,
            "onset_s": job_seconds(now),
            "onset_mono_ns": now,
            "wall_time": time.time(),
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as fh:  # one short O_APPEND write per line
            fh.write(json.dumps(entry) + "\n")


def injector_for(
    rank: int, specs: Sequence[str] | None = None, world: int | None = None
) -> Injector | None:
    """The injector for this rank from ``specs``, else from the ``CCLD_FAULTS`` environment
    variable (specs separated by ';'). None when no compute fault targets this rank."""
    if specs is None:
        specs = [t for t in os.environ.get("CCLD_FAULTS", "").split(";") if t.strip()]
    faults = parse_faults(specs, world)
    log = os.environ.get("CCLD_FAULT_LOG")
    inj = Injector(rank, faults, Path(log) if log else None, world)
    return inj if inj.faults else None
