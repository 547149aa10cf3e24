"""Robust references for the slow detectors.

Medians of many values that leave a few of them out, without a pass over all of them
(:class:`RankedValues`): each link (each group) is judged against the median of its
siblings, less the ones that share a rank with it (or itself). Done naively that is a
pass per item, quadratic in the job's size: ~50 s per window at 2,048 ranks. Sorting once
and skipping the left-out positions costs a few steps per query.

A baseline of a thing's own recent values (:class:`RecentFloor`), for what has nothing
else to be compared with.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from typing import Generic, TypeVar

__all__ = ["RankedValues", "RecentFloor"]

K = TypeVar("K", bound=Hashable)


class RankedValues(Generic[K]):
    """Values sorted once, by key."""

    def __init__(self, values: Mapping[K, float]) -> None:
        order = sorted(values, key=values.__getitem__)
        self.values = [values[k] for k in order]
        self.pos = {k: i for i, k in enumerate(order)}

    def __len__(self) -> int:
        return len(self.values)

    def median_without(self, left_out: Iterable[K]) -> float:
        """The median (the mean of the two middle values for an even count) of the values
        whose keys are not in ``left_out``; some must remain."""
        skip = sorted(self.pos[k] for k in left_out)
        n = len(self.values) - len(skip)
        if n <= 0:
            raise ValueError("median of no values")

        def nth(t: int) -> float:  # the t-th value (from 0) of those not left out
            i = t
            for e in skip:
                if e > i:
                    break
                i += 1
            return self.values[i]

        return (nth((n - 1) // 2) + nth(n // 2)) / 2


class RecentFloor:
    """A low ``quantile`` of the last ``keep`` values added, rounded down to one of them
    (their lowest until there are 1 / ``quantile`` of them): a baseline that the luckiest
    few values do not set, and that a later run of high ones hardly moves."""

    def __init__(self, quantile: float, keep: int) -> None:
        self._quantile = quantile
        self._values: deque[float] = deque(maxlen=keep)
        self.value = math.nan  # none added yet

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        self._values.append(value)
        ordered = sorted(self._values)
        self.value = ordered[int(len(ordered) * self._quantile)]
