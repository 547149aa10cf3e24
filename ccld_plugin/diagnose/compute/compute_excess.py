"""How much slower each rank computes than its cohort, step by step, and how sure that is.

Compute times on a busy host swing by tens of percent from one step to the next, and they
swing together: whatever slows the host slows every rank of that step. So a rank is
compared with its cohort *within each step* (its compute over the median of the others'
in that same step), and the comparison is judged over a span of steps as a robust test:
the median of the per-step log ratios over the span, in units of its standard error
(1.2533 x the spread / sqrt(steps), the spread 1.4826 x the MAD of the rank's own
per-step ratios, or the job's typical spread when that is larger). A straggler's
per-step ratios sit consistently above 1; a rank that was slow in a few steps only (a
garbage collection, a checkpoint) or that merely swings more than the others does not
reach the bar. Spans are whole windows (``confirm_windows`` x ``window_steps`` steps, and
twice that), so a strong straggler is named over the shorter span and a weak one once
the longer span has gathered enough steps.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from ccld_plugin.diagnose.step_table import StepTable
from ccld_plugin.errors import log

__all__ = ["WARMUP_STEPS", "Excess", "compute_excess", "not_a_straggler"]

# Compute is judged from this step on: the first steps of a job also hold compilation,
# the data loader's first fill and the other ranks' start-up, and on a shared host they
# swing the most (healthy 8-rank jobs on 2 cores had ranks 1.6-2x their cohort over steps
# 1-14); a straggler from the start is named once this many steps have gone by.
WARMUP_STEPS = 10
MAD_TO_SIGMA = 1.4826  # the MAD of normal noise times this is its standard deviation
MEDIAN_SE = 1.2533  # the standard error of a median is this times the mean's
SPREAD_FLOOR = 0.02  # log ratio: below 2% step-to-step spread, measurement resolution
MIN_COVER = 0.8  # of a span's steps, the share a rank (and its cohort) must have
# From this size on a rank is compared with its whole cohort's median, itself included:
# leaving one of 16 or more out moves the median by at most half a place.
LARGE_COHORT = 16


class Excess(NamedTuple):
    """A rank slower than its cohort over ``steps`` steps ending at ``last``: its median
    compute per step and the median of its cohort's others (us), the median per-step
    ratio and how many standard errors it stands above 1; and the lowest median per-step
    ratio of the span's parts after its first (``part_steps`` each: how steadily it was
    slower since)."""

    rank: int
    first: int
    last: int
    steps: int
    compute_us: float
    cohort_us: float
    ratio: float
    z: float
    lowest_part: float


def compute_excess(
    table: StepTable,
    cohorts: Mapping[int, Sequence[int]],
    last: int,
    spans: Sequence[int],
    min_ratio: float,
    min_z: float,
    first: int = 0,
    baselines: Mapping[int, float] | None = None,
    part_steps: int = 0,
    fields: tuple[str, ...] = ("compute_us",),
) -> list[Excess]:
    """Ranks whose compute exceeds their cohort's by ``min_ratio`` (median per-step ratio)
    and by ``min_z`` standard errors, over one of ``spans`` steps ending at step ``last``
    (the shortest span that shows it; spans that would begin before step ``first`` are
    not judged). A rank of ``baselines`` is compared by its compute over that baseline
    (its own, earlier), with cohort members compared so too: for ranks that do different
    work, what changed is what matters. ``fields``: the step table's columns that make a
    step's compute (with ``cpu_wait_us``: the time outside communication)."""
    spans = [n for n in spans if last - n + 1 >= first]
    if not spans:
        return []
    widest = max(spans)
    ranks, compute = table.matrix(last - widest + 1, last + 1, fields)
    if len(ranks) < 2:
        return []
    scale = np.ones(len(ranks))
    if baselines:
        keys = np.fromiter(baselines.keys(), np.int64, len(baselines))
        at = np.minimum(np.searchsorted(ranks, keys), len(ranks) - 1)  # ranks ascend
        have = ranks[at] == keys
        scale[at[have]] = np.fromiter(baselines.values(), float, len(baselines))[have]
        compute = compute / scale[:, None]
    log_ratio = _log_ratio_to_cohort(ranks, compute, cohorts)
    found: dict[int, Excess] = {}
    for span in sorted(spans):
        d = log_ratio[:, widest - span :]
        have = ~np.isnan(d)
        count = have.sum(axis=1)
        ok = count >= MIN_COVER * span
        if not ok.any():
            continue
        med = _nanmedian_rows(d, ok)
        spread = MAD_TO_SIGMA * _nanmedian_rows(np.abs(d - med[:, None]), ok)
        typical = float(np.median(spread[ok]))
        sigma = np.maximum(np.maximum(spread, typical), SPREAD_FLOOR)
        z = med / (MEDIAN_SE * sigma / np.sqrt(np.maximum(count, 1)))
        hit = ok & (med >= math.log(min_ratio)) & (z >= min_z)
        for i in np.flatnonzero(hit).tolist():
            r = int(ranks[i])
            if r in found:
                continue
            mine = compute[i, widest - span :]
            others = _others_median(i, ranks, compute, cohorts)[widest - span :]
            found[r] = Excess(
                rank=r,
                first=last - span + 1,
                last=last,
                steps=int(count[i]),
                compute_us=float(np.nanmedian(mine)) * scale[i],
                cohort_us=float(np.nanmedian(others)) * scale[i],
                ratio=float(math.exp(med[i])),
                z=float(z[i]),
                lowest_part=_lowest_part(d[i], part_steps),
            )
    return list(found.values())


def _log_ratio_to_cohort(
    ranks: np.ndarray, compute: np.ndarray, cohorts: Mapping[int, Sequence[int]]
) -> np.ndarray:
    """Per rank and step: log(its compute / the median of its cohort's others' that step);
    NaN where either is unknown. The ranks that share a cohort are done together: one sort
    of the cohort's values per step, each member's median of the others read off it."""
    out = np.full(compute.shape, np.nan)
    row_of = np.full(int(ranks.max()) + 1, -1)
    row_of[ranks] = np.arange(len(ranks))
    # The ranks of one cohort share its list (Topology.cohorts): each list once.
    for cohort in {id(c): c for c in cohorts.values()}.values():
        members = np.asarray(cohort, np.int64)
        members = members[members < len(row_of)]
        members = members[row_of[members] >= 0]
        if len(members) < 2:
            continue
        rows = row_of[members]
        vals = compute[rows]
        if len(rows) >= LARGE_COHORT:  # one member more or less moves its median by a hair
            steps = np.ones(vals.shape[1], bool)
            others = np.broadcast_to(_nanmedian_rows(vals.T, steps)[None, :], vals.shape)
        else:
            others = _median_without_each(vals)
        with np.errstate(all="ignore"):
            ratio = np.log(vals / others)
        # judged here: the members whose cohort this is
        mine = np.fromiter((cohorts.get(m) is cohort for m in members.tolist()), bool)
        out[rows[mine]] = ratio[mine]
    out[~np.isfinite(out)] = np.nan
    return out


def _lowest_part(log_ratio: np.ndarray, part_steps: int) -> float:
    """The lowest median ratio among the parts of ``part_steps`` steps that a span's
    per-step log ratios fall into. Left out: the oldest part (a straggler's onset may lie
    in it) and parts with no known step. With no parts, the span's own median."""
    n = part_steps if 0 < part_steps < len(log_ratio) else len(log_ratio)
    parts = log_ratio[: len(log_ratio) // n * n].reshape(-1, n)
    parts = parts[1:] if len(parts) > 1 else parts
    medians = _nanmedian_rows(parts, np.ones(len(parts), bool))
    medians = medians[~np.isnan(medians)]
    return float(math.exp(medians.min())) if len(medians) else float("nan")


def _median_without_each(vals: np.ndarray) -> np.ndarray:
    """For a members x steps array (NaN: unknown): per member and step, the median of the
    other members' known values that step (NaN where it has no known value or none is
    left). Sorted once per step; leaving member k out shifts the indices at or past its
    place by one."""
    n = len(vals)
    order = np.argsort(vals, axis=0)  # NaN last
    ordered = np.take_along_axis(vals, order, axis=0)
    place = np.empty_like(order)
    np.put_along_axis(place, order, np.broadcast_to(np.arange(n)[:, None], order.shape), axis=0)
    left = (~np.isnan(vals)).sum(axis=0) - 1  # known values left once one is taken out
    lo, hi = np.maximum(left - 1, 0) // 2, np.maximum(left, 0) // 2
    a = np.minimum(lo[None, :] + (lo[None, :] >= place), n - 1)
    b = np.minimum(hi[None, :] + (hi[None, :] >= place), n - 1)
    med = (np.take_along_axis(ordered, a, axis=0) + np.take_along_axis(ordered, b, axis=0)) / 2
    med[np.isnan(vals) | (left < 1)[None, :]] = np.nan
    return med


def _others_median(
    i: int, ranks: np.ndarray, compute: np.ndarray, cohorts: Mapping[int, Sequence[int]]
) -> np.ndarray:
    r = int(ranks[i])
    cohort = set(cohorts.get(r, ())) - {r}
    rows = [j for j, m in enumerate(ranks.tolist()) if m in cohort]
    with warnings.catch_warnings():  # a step none of them has is NaN, as meant
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(compute[rows], axis=0)


def _nanmedian_rows(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per row, the median of its known values (NaN for rows not in ``rows``): one sort
    of the rows (NaN last), the middle of each row's known values read off it (numpy's
    nanmedian goes through masked arrays: ~60 ms for 65,536 ranks x 20 steps)."""
    out = np.full(len(x), np.nan)
    if not rows.any():
        return out
    ordered = np.sort(x[rows], axis=1)
    known = (~np.isnan(ordered)).sum(axis=1)
    lo, hi = np.maximum(known - 1, 0) // 2, np.maximum(known, 0) // 2
    at = np.arange(len(ordered))
    med = (ordered[at, lo] + ordered[at, hi]) / 2
    med[known == 0] = np.nan
    out[rows] = med
    return out


def not_a_straggler(e: Excess, cohort: list[int], why: str) -> None:
    """Log a rank slower than its cohort that is no straggler (yet), and why."""
    log.debug(
        "ccld steps %d-%d: rank %d computes %.2fx its cohort %s (z %.1f), not a straggler: %s",
        e.first,
        e.last,
        e.rank,
        e.ratio,
        cohort,
        e.z,
        why,
    )
