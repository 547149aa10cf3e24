"""Ranks held back by their host: slower than their cohort only with their wait for a CPU
counted, that wait theirs alone (other work on their host takes their cores: a noisy
neighbour), and how long the thread of each rank waited for a CPU per step.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose.compute.compute_excess import (
    WARMUP_STEPS,
    Excess,
    compute_excess,
    not_a_straggler,
)
from ccld_plugin.diagnose.step_table import StepTable

__all__ = ["HOST_MIN_HELD_S", "QUIET_HOST_SHARE", "HostWait", "cpu_wait", "held_by_host", "held_s"]

# A rank held back by its host: its cohort waits for a CPU less than this share of its time
# outside communication (with a core per rank, ~0), and its own excess wait makes at
# least HOST_WAIT_SHARE of its excess. Where every rank queues for a CPU (more busy threads
# than cores, as with 4-8 ranks on 2 cores) one held back for a while is the scheduler
# taking turns, not a fault of its node (healthy 8-rank jobs: 1.4-2.2x for 10-25 steps).
QUIET_HOST_SHARE = 0.15
HOST_WAIT_SHARE = 0.5
# ... and over the longer span only if that span lasted this long: the scheduler's turns
# are a matter of time, not of steps (the episodes above: ten steps of 0.1-0.2 s; an
# unseen DTensor job of 25 ms steps on 2 cores had a rank held back for 20 steps, 0.5 s,
# at 1.33x and 3.1 standard errors, with nothing else running).
HOST_MIN_HELD_S = 2.0
# Such a rank is named once it has been held back over the longer span, or by a decisive
# excess (SOLO_EXCESS_Z x excess_z, see confirmation): a busy host's scheduler also favours some
# ranks over others for about ten steps at a time (two healthy torch jobs beside two busy
# processes on 2 cores: 1.84x and 1.93x over ten steps at 3.7 and 5.1 standard errors,
# their cohorts hardly waiting), and a noisy neighbour stays (one sharing a rank's core
# stood 13-25 standard errors within 3-12 steps of its first span).


class HostWait(NamedTuple):
    """A rank's median wait for a CPU per step over a span, and its cohort's (us)."""

    mine_us: float
    cohort_us: float


def held_by_host(
    steps: StepTable,
    cfg: DiagnoserConfig,
    spans: tuple[int, int],
    cohorts: dict[int, list[int]],
    last: int,
    judged_apart: set[int],
) -> dict[int, tuple[Excess, HostWait]]:
    """Ranks slower than their cohort only with their wait for a CPU counted, that wait
    theirs alone: their cohort hardly waits (QUIET_HOST_SHARE) and their own excess wait
    makes HOST_WAIT_SHARE of their excess. ``judged_apart`` are not judged so: the
    stragglers, and the ranks compared by their change (no cohort)."""
    # Who waits for a CPU at all over the longer span (on a node with a core per rank,
    # nobody: then nothing more is done); only their cohorts are judged.
    lo = last - max(spans) + 1
    ranks, wait, share = cpu_wait(steps, lo, last + 1)
    waiting = set(ranks[share > QUIET_HOST_SHARE].tolist()) - judged_apart
    if not waiting:
        return {}
    found = compute_excess(
        steps,
        {r: cohorts[r] for r in waiting if r in cohorts},
        last,
        spans,
        cfg.slow_ratio,
        cfg.excess_z,
        first=WARMUP_STEPS,
        part_steps=cfg.window_steps,
        fields=("compute_us", "cpu_wait_us"),
    )
    out = {}
    row = {r: i for i, r in enumerate(ranks.tolist())}
    for e in found:
        span = wait[:, e.first - lo :]  # its span ends at ``last`` too
        others = [row[c] for c in cohorts.get(e.rank, ()) if c != e.rank and c in row]
        if e.rank not in row or not others:
            continue
        w = HostWait(float(np.nanmedian(span[row[e.rank]])), float(np.nanmedian(span[others])))
        if w.cohort_us > QUIET_HOST_SHARE * e.cohort_us:
            why = f"its cohort waits for a CPU too ({w.cohort_us / 1000:.1f} ms/step)"
        elif w.mine_us - w.cohort_us < HOST_WAIT_SHARE * (e.compute_us - e.cohort_us):
            why = f"its wait for a CPU ({w.mine_us / 1000:.1f} ms/step) is not its excess"
        else:
            out[e.rank] = (e, w)
            continue
        not_a_straggler(e, cohorts.get(e.rank, [e.rank]), f"with its CPU wait: {why}")
    return out


def held_s(steps: StepTable, rank: int, since: int, last: int) -> float:
    """Seconds from the start of step ``since`` to that of step ``last`` of ``rank``."""
    first = steps.start_from_ns(rank, since, last)
    end = steps.start_ns(rank, last)
    return 0.0 if first is None or end is None else (end - first) / 1e9


def cpu_wait(steps: StepTable, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranks with steps, their wait for a CPU per step in steps [lo, hi) (us, NaN
    where unknown), and its share of their time outside communication."""
    ranks, wait = steps.matrix(lo, hi, ("cpu_wait_us",))
    _, busy = steps.matrix(lo, hi, ("compute_us", "cpu_wait_us"))
    with np.errstate(all="ignore"):
        share = np.nansum(wait, axis=1) / np.nansum(busy, axis=1)
    return ranks, wait, share
