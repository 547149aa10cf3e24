"""Launch a job on this machine: one process per rank, the usual env:// variables, one log
file per rank, and an end that is always clean (a hung job is terminated, then killed).

The ranks end with the launcher however it ends: each asks the kernel, before it runs, for
SIGKILL when the launcher goes (``PR_SET_PDEATHSIG``; a launcher killed with SIGKILL too),
and a rank whose launcher is already gone by then leaves at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LocalJob", "free_port"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_libc = ctypes.CDLL(None, use_errno=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dies_with(launcher: int) -> Callable[[], None]:
    """The rank's last step before its program runs (in the child, after fork): SIGKILL
    when the launcher's thread that started it ends; if the launcher is gone already,
    exit now (the request would come too late to fire)."""

    def preexec() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher:
            os._exit(1)

    return preexec


@dataclass
class LocalJob:
    """``world`` processes running ``python <argv>`` (a script or ``-m module``, and args).

    Each rank is in a session of its own (``stop`` ends it with whatever it started) and
    dies with the launcher: start the job from a thread that lives as long as the job
    (the kernel's parent-death signal follows the thread that forked the rank)."""

    world: int
    argv: Sequence[str]
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # Prepended to a rank's command (e.g. ``ip netns exec ...``) and its own address.
    rank_prefix: Callable[[int], list[str]] | None = None
    # Host the job's store here, as torchrun's agent does, instead of in rank 0: the store
    # then outlives any rank (a rank that crashes or is killed takes nothing else with it).
    agent_store: bool = False
    # Asked between the ranks it starts: once true, ``start`` starts no more (the launcher
    # got a stop signal; ``stop`` ends those already started).
    stop_requested: Callable[[], bool] = lambda: False
    procs: list[subprocess.Popen] = field(default_factory=list)
    _store: Any = field(default=None, repr=False)

    def start(self) -> None:
        if self.stop_requested():
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = self.master_port or free_port()
        extra: dict[str, str] = {}
        if self.agent_store:
            import torch.distributed as dist

            self._store = dist.TCPStore(
                self.master_addr, port, self.world, True, wait_for_workers=False
            )
            extra["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # env:// then joins it
        for rank in range(self.world):
            if self.stop_requested():
                return
            env = {
                **os.environ,
                **self.env,
                **extra,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.world),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
            prefix = self.rank_prefix(rank) if self.rank_prefix else []
            log = open(self.log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 - child owns it
            self.procs.append(
                subprocess.Popen(
                    [*prefix, sys.executable, *self.argv],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_dies_with(os.getpid()),
                )
            )
            log.close()

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def running(self) -> bool:
        return any(code is None for code in self.poll())

    def wait(self, timeout_s: float) -> bool:
        """Wait until every rank exits; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def stop(self, grace_s: float = 3.0) -> list[int | None]:
        """End every rank still running: SIGTERM, then SIGKILL after ``grace_s``."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs if p.poll() is None]
            if not alive:
                break
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._store = None  # the job is over: its store closes
        return self.poll()
