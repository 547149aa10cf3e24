"""The steps a rank's summary carries: the new ones and those of the last few ticks.

The store keeps one summary per rank, so a summary repeats the steps of its rank's last
STEP_TICKS ticks (at most STEPS_KEPT of them): a diagnoser whose rounds come up to
STEP_TICKS ticks apart (one on a training rank of a 65,536-rank job, capped at 20% of that
rank's time, runs every 2-5 ticks) still sees every step. Bounding them by ticks, not only
by count, keeps a job of slow steps from resending each for 16 ticks: at one step per tick
they were a third of a large job's summary bytes. The steps new this tick all go (up to
MAX_NEW_STEPS): a fast job's dropped ones were holes in every rank's record (18 steps a
second at 1 s ticks lost 2 of every 18, a straggler's onset step among them). So do the
previous tick's, all of them: a summary overwritten before the diagnoser read it (a tick
and the final one at exit 50 ms apart) lost its steps beyond STEPS_KEPT (a 2-second job's
rank had its steps 0-27 lost, and a 2x stage went unnamed).
"""

from __future__ import annotations

from collections import deque

from ccld_plugin.wire.summary import StepStat

__all__ = ["MAX_NEW_STEPS", "STEPS_KEPT", "STEP_TICKS", "RecentSteps"]

STEPS_KEPT = 16
STEP_TICKS = 6
MAX_NEW_STEPS = 256


class RecentSteps:
    def __init__(self) -> None:
        self._steps: deque[tuple[int, StepStat]] = deque()  # (tick sent, step)
        self._tick = 0

    def tick(self, new: list[StepStat]) -> list[StepStat]:
        """The steps of this tick's summary, given the steps that ended since the last."""
        self._tick += 1
        while self._steps and self._steps[0][0] <= self._tick - STEP_TICKS:
            self._steps.popleft()
        fresh = new[-MAX_NEW_STEPS:]
        last = [st for t, st in self._steps if t == self._tick - 1]
        older = [st for t, st in self._steps if t < self._tick - 1]
        room = max(0, STEPS_KEPT - len(fresh) - len(last))
        self._steps.extend((self._tick, st) for st in fresh)
        return older[max(0, len(older) - room) :] + last + fresh
