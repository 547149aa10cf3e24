"""When a rank slower than its cohort is a straggler: its peers wait for it (the arrival
order of its sampled collectives, weighed by time), or its excess is decisive, or, for a
rank that no other rank matches in work, the pipeline waits for its added time. The bars
and the measurements they were set by.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

import numpy as np

from ccld_plugin.diagnose.arrivals import MIN_ARRIVAL_SAMPLES, RankJoined
from ccld_plugin.diagnose.compute.compute_excess import Excess

__all__ = [
    "CLEAR_EXCESS_Z",
    "SOLO_EXCESS_Z",
    "SOLO_MIN_RANKS",
    "WaitBalance",
    "not_decisive",
    "not_waited_for",
    "others_gain",
    "solo_not_confirmed",
    "wait_balance",
]

# A straggler's peers wait for it: of the waiting in its sampled collectives (theirs for it
# when it arrives last, its own for others), theirs is at least this share. Weighed by time,
# not counted: a rank whose compute is stretched before some collectives only is last by a
# hair at the others, a coin toss that a share of arrivals counted (a 2x straggler of a
# 2-core TP2xPP2xDP2 job measured 33% last arrivals in a window). Injected stragglers of
# 1.2-2x had 64-100% (most above 80%); healthy ranks that a busy 2-core host held back for
# 10-20 steps, 50-56% as well (benchmarks/replay_runs.py over ~70 recorded runs).
WAITED_FOR_SHARE = 0.65
# Clear-cut: an injected straggler, slowed before every collective, had 80-100% of the
# waiting in its streak; ranks of a healthy 8-rank job on 2 cores that the host's
# scheduler held back for ~10 steps had 60-79%. Below this share a straggler is confirmed
# over the longer span only, which such an episode rarely lasts.
CLEAR_WAITED_FOR_SHARE = 0.8
# An excess of this many times ``excess_z`` is confirmed over the shorter span by an
# arrival order that is not clear-cut (WAITED_FOR_SHARE). A live 1.5x straggler of a
# two-rank cohort measured 6-8 standard errors with 72-75% of the waiting its peers';
# healthy ranks held back by the host never reached it (replayed over ~130 runs).
CLEAR_EXCESS_Z = 2.0
# Such a strong excess needs only this share: four ranks of DP4 on two cores take turns at
# the CPUs, and 1.5x stragglers sleeping their excess stood 10-11 standard errors at
# 54-64% of the waiting (one all-reduce a step); healthy ranks that a busy host held back
# reached 50-56%, but never the strong excess (replayed over 13 healthy and
# 40 faulty recordings, loaded host included: no new verdict).
STRONG_WAITED_FOR_SHARE = 0.5
# A rank that no other rank matches in work is compared by its change against its own
# baseline, the lowest of its windows: on a shared host that baseline sits low by their
# noise. Stages of healthy pipelines on 2 cores (Megatron and torch, 4 and 8 stages, 7
# runs of 200-300 steps) stood up to 1.4-1.9x theirs at 6.0-7.3 standard errors (most
# under 4.5), and a two-stage one's first stage 1.27x at 9.2, the other stage all its
# reference; 2x slow stages reached 12-15 within 10-15 steps of onset, 3x ones stood
# 19-30 from the first span judged. So such a rank is named at SOLO_EXCESS_Z x excess_z
# standard errors, among at least SOLO_MIN_RANKS of them: a two-stage pipeline's stages
# (a 2-rank TP1xPP2 job) are each other's reference. Its healthy stage that stood 9.2 is
# under that bar; healthy 300-step TP1xPP2 torch and Megatron jobs (6 runs, 2 beside busy
# processes) never stood 1.2x their baseline; 1.5x and 2x stages were named 7-12 steps
# after onset (benchmarks/sensitivity.py --layouts tp1pp2).
SOLO_MIN_RANKS = 2
SOLO_EXCESS_Z = 4.0
# ... and it is the stage its pipeline waits for: its time outside communication (compute
# and wait for a CPU) grew more, in ms per step over its own floor, than the other stages'
# did (their median). Every stage of a pipeline takes the same step time, so the others'
# wait grows by what the slow one adds; a stage that changed more by its own measure but
# added less is not what holds the pipeline up. A host that slows every stage changes each
# by its own measure: beside a busy process a healthy stage of a TP1xPP2 job went from 21
# to 53 ms/step (2.5x its floor) while the 1.5x stage's grew by more ms; by its own
# measure alone the healthy one would be named.
# A rank of a cohort that far above it (SOLO_EXCESS_Z x excess_z, where a rank with no
# arrival evidence at all is named; healthy recorded ranks stood at most 7.3 standard
# errors above their cohort or baseline) needs no share of the waiting: another fault can
# take most of it (a 5x straggler beside a 100 Mbit/s link of the same ring had 25-65%,
# the link holding everyone up in the other collectives; a 2x one of TP3xDP2, 47% over
# 125 samples). It must only be on the critical path: where it arrived last, its peers
# waited for it, on average, at least DECISIVE_WAIT_OF_EXCESS of its excess compute
# before one collective (the arrival-order test it replaces is there for compute that
# nobody waits for).
DECISIVE_WAIT_OF_EXCESS = 0.5


class WaitBalance(NamedTuple):
    """Rank r's joined collectives: its peers' waiting for it (their mean wait where r
    arrived last, summed), r's waiting for them, and how often r arrived last."""

    for_r_ns: float
    by_r_ns: float
    last_n: int

    @property
    def share(self) -> float | None:
        """Of the waiting, the share that is its peers' for it; None when nobody waited."""
        total = self.for_r_ns + self.by_r_ns
        return self.for_r_ns / total if total > 0 else None


def wait_balance(r: int, mine: RankJoined) -> WaitBalance:
    shared = mine.count >= 2
    last = shared & (mine.last == r)
    # where r arrived last, the others' mean wait; elsewhere r's own wait (sums are taken
    # in the collectives' order, one after another, as a loop over them would)
    theirs = (mine.waits_ns - mine.own_wait_ns)[last] / (mine.count[last] - 1)
    own = mine.own_wait_ns[shared & ~last].astype(np.float64)
    for_r = float(np.cumsum(theirs)[-1]) if len(theirs) else 0.0
    by_r = float(np.cumsum(own)[-1]) if len(own) else 0.0
    return WaitBalance(for_r, by_r, int(last.sum()))


def not_waited_for(
    cohort_size: int, mine: RankJoined, waited_for: float | None, longest: bool, strong: bool
) -> str:
    """Why the collectives ``mine`` of a rank slower than its cohort do not show its peers
    waiting for it (yet; empty when they do). With a cohort too small for statistics the
    arrival order has to decide, so it must have more samples; an order that is not
    clear-cut counts only over the ``longest`` span, or for a ``strong`` excess."""
    small = cohort_size < 3
    need_n = MIN_ARRIVAL_SAMPLES * (2 if small else 1)
    if not mine and not small:  # none taken: the cohort's statistics decide, over more steps
        return "" if longest else "no arrival samples: the longer span decides"
    if len(mine) < need_n:  # a few: more come while it stays slow
        return f"{len(mine)} arrival samples in its span (< {need_n})"
    floor = STRONG_WAITED_FOR_SHARE if strong else WAITED_FOR_SHARE
    if waited_for is None or waited_for < floor:
        share = "none" if waited_for is None else f"{waited_for:.0%}"
        return (
            f"its peers waiting for it are {share} of the waiting in {len(mine)} samples "
            f"(< {floor:.0%})"
        )
    if waited_for < CLEAR_WAITED_FOR_SHARE and not (longest or strong):
        return (
            f"its peers waiting for it are {waited_for:.0%} of the waiting "
            f"(< {CLEAR_WAITED_FOR_SHARE:.0%}): the longer span decides"
        )
    return ""


def not_decisive(e: Excess, mine: RankJoined, balance: WaitBalance, step_us: float) -> str:
    """Why a rank with a decisive excess is not shown on the critical path: where it
    arrived last, its peers' mean wait for it is short of DECISIVE_WAIT_OF_EXCESS of its
    excess compute before one collective (its excess a step over the collectives it runs
    a step; empty when it is not)."""
    excess_ns = (e.compute_us - e.cohort_us) * 1000 / mine.ops_per_step(step_us * 1000)
    waited_ns = balance.for_r_ns / balance.last_n if balance.last_n else 0.0
    if waited_ns >= DECISIVE_WAIT_OF_EXCESS * excess_ns:
        return ""
    return (
        f"where it arrived last ({balance.last_n} samples) its peers waited "
        f"{waited_ns / 1e6:.1f} ms for it, < {DECISIVE_WAIT_OF_EXCESS:.0%} of its excess "
        f"before a collective ({excess_ns / 1e6:.1f} ms)"
    )


def solo_not_confirmed(e: Excess, excess_z: float, gains: dict[int, float]) -> str:
    """Why a rank compared by its change (no other rank does its work) is not named. The
    collectives it has with its peers are ordered by the pipeline's drain, not by who is
    slow (a 3x middle stage of a live 4-stage Megatron pipeline arrived last in none of
    them): its excess must be clear (SOLO_EXCESS_Z), and its added time the pipeline's
    to wait for (``gains``: each such rank's growth over its floor, us per step)."""
    if e.z < SOLO_EXCESS_Z * excess_z:
        return f"compared by its change: {e.z:.1f} < {SOLO_EXCESS_Z:g} x excess_z standard errors"
    others = others_gain(gains, e.rank)
    if others is not None and gains[e.rank] <= others:
        return (
            f"its time outside communication grew {gains[e.rank] / 1000:.1f} ms/step, the "
            f"other stages' {others / 1000:.1f}: they do not wait for it"
        )
    return ""


def others_gain(gains: dict[int, float], r: int) -> float | None:
    """The median of the other ranks' ``gains``; None without r's or any other's."""
    others = [g for s, g in gains.items() if s != r]
    return statistics.median(others) if r in gains and others else None
