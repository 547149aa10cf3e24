"""Every rank's recent step times as one table, for the slow detector's windows.

A summary repeats its rank's last steps (``agent.STEP_TICKS``), so at tens of thousands of
ranks a round brings hundreds of thousands of step records: they are kept in arrays of
rank x step (from the oldest step any window may still read), filled with one scatter per
round, and a window's per-rank medians are taken over a slice of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ccld_plugin.wire.summary import RankSummary
from ccld_plugin.wire.summary_batch import table_of

__all__ = ["StepTable", "StepWindow"]

SHIFT_STEPS = 16  # steps below the horizon are dropped this many at a time (one copy)
_FIELDS = ("start_ns", "step_us", "compute_us", "cpu_wait_us")


class StepWindow(NamedTuple):
    """The ranks with at least half of a window's steps, their median compute and step
    time per step (us), and the window's first start and last end (diagnoser clock)."""

    ranks: list[int]
    compute_us: list[float]
    step_us: list[float]
    t0: int
    t1: int


class StepTable:
    def __init__(self) -> None:
        self.base = 0  # the step of column 0
        self.has = np.zeros((0, 0), bool)  # rank x step: a record is there
        self.cols = {f: np.zeros((0, 0), np.int64) for f in _FIELDS}
        self.last = np.full(0, -1, np.int64)  # per rank: its newest step (-1: none)

    def ingest(self, fresh: Sequence[RankSummary], horizon: int) -> None:
        """Take in the steps of ``fresh`` (a newer record of a step replaces the older);
        steps before ``horizon`` are no window's any more."""
        table = table_of(fresh)
        st = table.steps
        recent = st["step"] >= horizon
        if not recent.all():
            st = st[recent]
        if horizon - self.base >= SHIFT_STEPS:
            self._shift(horizon)
        if not len(st):
            return
        rank = table.ranks[st["row"]]
        self._fit(int(rank.max()) + 1, int(st["step"].max()) + 1 - self.base)
        at = rank * self.has.shape[1] + (st["step"] - self.base)  # flat index, taken once
        self.has.put(at, True)
        for f in _FIELDS:
            self.cols[f].put(at, st[f])
        np.maximum.at(self.last, rank, st["step"])

    def ranks(self) -> list[int]:
        """The ranks with steps."""
        return np.flatnonzero(self.last >= 0).tolist()

    def all_reached(self, step: int) -> bool:
        """Whether every rank with steps has reached ``step``."""
        last = self.last[self.last >= 0]
        return bool(len(last)) and bool(last.min() >= step)

    def start_ns(self, rank: int, step: int) -> int | None:
        col = step - self.base
        if 0 <= rank < len(self.last) and 0 <= col < self.has.shape[1] and self.has[rank, col]:
            return int(self.cols["start_ns"][rank, col])
        return None

    def window(self, lo: int, hi: int) -> StepWindow | None:
        """Steps [lo, hi) of the ranks with at least half of them (None: no such rank)."""
        a, b = max(0, lo - self.base), max(0, min(hi - self.base, self.has.shape[1]))
        has = self.has[:, a:b]
        count = has.sum(axis=1)
        rows = np.flatnonzero((count > 0) & (count * 2 >= hi - lo))
        if not len(rows):
            return None
        has, count = has[rows], count[rows]
        start, step_us, compute = (self.cols[f][rows, a:b] for f in _FIELDS[:3])
        full = count == has.shape[1]
        med_compute = np.zeros(len(rows))
        med_step = np.zeros(len(rows))
        if full.any():
            med_compute[full] = np.median(compute[full], axis=1)
            med_step[full] = np.median(step_us[full], axis=1)
        for i in np.flatnonzero(~full).tolist():  # a rank that missed some of the steps
            med_compute[i] = np.median(compute[i][has[i]])
            med_step[i] = np.median(step_us[i][has[i]])
        t0 = int(np.where(has, start, np.iinfo(np.int64).max).min())
        t1 = int(np.where(has, start + step_us * 1000, np.iinfo(np.int64).min).max())
        return StepWindow(rows.tolist(), med_compute.tolist(), med_step.tolist(), t0, t1)

    def start_from_ns(self, rank: int, step: int, last: int) -> int | None:
        """When ``rank`` began the first of steps ``step``..``last`` that it has a record
        of (a record can be lost: a summary the diagnoser did not read in time)."""
        span = self.span_ns(rank, step, last)
        return None if span is None else span[0]

    def span_ns(self, rank: int, step: int, last: int) -> tuple[int, int] | None:
        """When ``rank`` began the first of steps ``step``..``last`` that it has a record
        of, and when it ended the last of them (None: it has none)."""
        if not 0 <= rank < len(self.last):
            return None
        a, b = max(0, step - self.base), max(0, min(last + 1 - self.base, self.has.shape[1]))
        known = a + np.flatnonzero(self.has[rank, a:b])
        if not len(known):
            return None
        start, step_us = self.cols["start_ns"][rank], self.cols["step_us"][rank]
        return int(start[known[0]]), int(start[known[-1]] + step_us[known[-1]] * 1000)

    def first_start_ns(self, step: int) -> int | None:
        """When the first rank began ``step`` (None: no rank has it)."""
        col = step - self.base
        if not 0 <= col < self.has.shape[1] or not self.has[:, col].any():
            return None
        return int(self.cols["start_ns"][self.has[:, col], col].min())

    def matrix(
        self, lo: int, hi: int, fields: tuple[str, ...] = ("compute_us",)
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ranks with steps, and their compute time (us; or the sum of ``fields``, e.g.
        with the wait for a CPU) in steps [lo, hi) as a ranks x steps float array, NaN where
        a rank has no record of the step."""
        ranks = np.flatnonzero(self.last >= 0)
        out = np.full((len(ranks), hi - lo), np.nan)
        a, b = max(0, lo - self.base), max(0, min(hi - self.base, self.has.shape[1]))
        if b > a:
            at = a + self.base - lo
            cols = self.cols[fields[0]][ranks, a:b].astype(float)
            for f in fields[1:]:
                cols += self.cols[f][ranks, a:b]
            cols[~self.has[ranks, a:b]] = np.nan
            out[:, at : at + b - a] = cols
        return ranks, out

    def _fit(self, n_ranks: int, width: int) -> None:
        """Grow the arrays to hold ``n_ranks`` ranks and ``width`` steps from the base."""
        old_n, old_w = self.has.shape
        if n_ranks <= old_n and width <= old_w:
            return
        n, w = max(n_ranks, old_n), max(width, 2 * old_w, SHIFT_STEPS)
        has = np.zeros((n, w), bool)
        has[:old_n, :old_w] = self.has
        self.has = has
        for f, old in self.cols.items():
            grown = np.zeros((n, w), np.int64)
            grown[:old_n, :old_w] = old
            self.cols[f] = grown
        last = np.full(n, -1, np.int64)
        last[:old_n] = self.last
        self.last = last

    def _shift(self, horizon: int) -> None:
        """Drop the columns of the steps before ``horizon``."""
        k = min(horizon - self.base, self.has.shape[1])
        self.base = horizon
        self.has = np.ascontiguousarray(np.pad(self.has[:, k:], ((0, 0), (0, k))))
        for f in _FIELDS:
            self.cols[f] = np.pad(self.cols[f][:, k:], ((0, 0), (0, k)))
