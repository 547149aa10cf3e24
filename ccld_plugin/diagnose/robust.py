"""Medians of many values that leave a few of them out, without a pass over all of them.

The slow detectors judge each link (each group) against the median of its siblings, less
the ones that share a rank with it (or itself). Done naively that is a pass per item,
quadratic in the job's size: ~50 s per window at 2,048 ranks. Sorting once and skipping
the left-out positions costs a few steps per query.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Generic, TypeVar

import numpy as np

__all__ = ["RankedValues", "medians_of_others"]

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


def medians_of_others(
    segment: np.ndarray, values: np.ndarray, query_segment: np.ndarray, own: np.ndarray
) -> np.ndarray:
    """Per query: the median of the ``values`` of the entries of its segment (``segment``
    per entry) other than its own entry (``own``: an index into the entries, or -1 for
    none), as :meth:`RankedValues.median_without` gives it; NaN where no entry is left.
    One sort for all segments: a window's cohorts at tens of thousands of ranks."""
    order = np.lexsort((values, segment))
    ordered, by_segment = values[order], segment[order]
    start = np.searchsorted(by_segment, query_segment, side="left")
    n = np.searchsorted(by_segment, query_segment, side="right") - start
    position = np.empty(len(order), np.int64)
    position[order] = np.arange(len(order))
    has_own = own >= 0
    skip = np.where(has_own, position[np.where(has_own, own, 0)] - start, n)
    left = n - has_own
    out = np.full(len(query_segment), np.nan)
    some = left > 0
    start, skip, left = start[some], skip[some], left[some]
    lo, hi = (left - 1) // 2, left // 2  # the middle ones of those left, in their order

    def nth(t: np.ndarray) -> np.ndarray:  # the t-th value left (the own one skipped)
        return ordered[start + t + (t >= skip)]

    out[some] = (nth(lo) + nth(hi)) / 2
    return out
