"""What the diagnosis costs the rank it runs on: its threads' share of the CPU (the
analysis discounts it from that rank's compute), the cap on its rounds' share, and no
garbage collection inside a round.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections import deque
from collections.abc import Iterator

__all__ = ["DIAGNOSIS_THREADS", "MAX_ROUND_SHARE", "DiagnosisLoad", "gc_paused"]

MAX_ROUND_SHARE = 0.2  # of the diagnoser rank's time spent in diagnoser rounds
LOAD_WINDOW_S = 10.0  # the diagnosis' load on its rank is measured over this long
# Threads that only the diagnoser's rank runs (its rounds, its lease, the W&B sink): their
# CPU time holds that rank's GIL, so its training is slower by up to as much.
DIAGNOSIS_THREADS = ("ccld-diagnoser", "ccld-lease", "ccld-wandb")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection during a diagnoser round. A round builds tens of
    objects per rank; at thousands of ranks the collections they trigger (each a pass over
    the detector's long-lived state) cost more than the round itself (3-4x at 2,048 ranks).
    Collection only waits until the round ends, and the collector stays off if it was off
    (frameworks that collect by hand, such as Megatron's --manual-gc)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class DiagnosisLoad:
    """The share of the CPU the diagnosis' own threads take on this rank, measured at each
    round over the last LOAD_WINDOW_S."""

    def __init__(self) -> None:
        # (when, CPU seconds) of the diagnosis' own threads, at the recent rounds
        self._cpu: deque[tuple[float, float]] = deque()

    def share(self) -> float:
        """The share of the last LOAD_WINDOW_S (or less, early on) that the threads only
        the diagnoser's rank runs spent on the CPU."""
        now = time.monotonic()
        self._cpu.append((now, _diagnosis_cpu_s()))
        while len(self._cpu) > 2 and self._cpu[1][0] <= now - LOAD_WINDOW_S:
            self._cpu.popleft()
        (t0, c0), (t1, c1) = self._cpu[0], self._cpu[-1]
        return min(1.0, max(0.0, (c1 - c0) / (t1 - t0))) if t1 - t0 >= 1.0 else 0.0


def _diagnosis_cpu_s() -> float:
    """CPU seconds so far of this process's DIAGNOSIS_THREADS (those still running)."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith(DIAGNOSIS_THREADS) and t.ident is not None:
            with contextlib.suppress(OSError, ValueError):  # a thread that just ended
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return total
