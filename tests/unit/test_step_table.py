"""The slow detector's step table: a window's per-rank medians and bounds are what the
per-rank step records say, a newer record of a step replaces the older, and steps before
the horizon are dropped."""

from __future__ import annotations

import statistics

from builders import S, rank_summary

from ccld_plugin.diagnose.step_table import StepTable
from ccld_plugin.wire.summary import RankSummary, StepStat


def _summary(rank: int, steps: range, compute: dict[int, int] | None = None) -> RankSummary:
    compute = compute or {}
    return rank_summary(
        rank,
        steps=[
            StepStat(k, k * S + rank * 1000, 900_000 + 10 * k, compute.get(k, 500_000 + rank * k))
            for k in steps
        ],
    )


def test_a_window_is_the_medians_of_each_ranks_records() -> None:
    t = StepTable()
    summaries = [_summary(0, range(1, 9)), _summary(1, range(1, 9)), _summary(2, range(4, 9))]
    t.ingest(summaries, horizon=0)
    assert t.ranks() == [0, 1, 2] and t.all_reached(8) and not t.all_reached(9)
    w = t.window(1, 6)
    assert w is not None
    # rank 2 has steps 4 and 5 of 1-5: fewer than half, left out
    assert w.ranks == [0, 1]
    for r, compute, step in zip(w.ranks, w.compute_us, w.step_us, strict=True):
        stats = [st for st in summaries[r].steps if 1 <= st.step < 6]
        assert compute == statistics.median(st.compute_us for st in stats)
        assert step == statistics.median(st.step_us for st in stats)
    window_stats = [st for s in summaries[:2] for st in s.steps if 1 <= st.step < 6]
    assert w.t0 == min(st.start_ns for st in window_stats)
    assert w.t1 == max(st.start_ns + st.step_us * 1000 for st in window_stats)
    w = t.window(5, 10)  # rank 2 has 4 of these 5: an even count, the mean of the middle two
    assert w is not None and w.ranks == [0, 1, 2]
    assert w.compute_us[2] == statistics.median(500_000 + 2 * k for k in range(5, 9))


def test_newer_records_replace_older_and_the_horizon_drops_steps() -> None:
    t = StepTable()
    t.ingest([_summary(0, range(1, 6))], horizon=0)
    t.ingest([_summary(0, range(3, 6), compute={4: 800_000, 5: 800_000})], horizon=0)
    w = t.window(3, 6)
    assert w is not None and w.compute_us == [statistics.median([500_000, 800_000, 800_000])]
    assert t.start_ns(0, 2) == 2 * S
    t.ingest([_summary(0, range(30, 40))], horizon=30)
    assert t.start_ns(0, 2) is None and t.start_ns(0, 31) == 31 * S
    assert t.window(1, 6) is None
    t.ingest([_summary(1, range(1, 10))], horizon=30)  # a rank heard from late, all too old
    assert t.ranks() == [0]
