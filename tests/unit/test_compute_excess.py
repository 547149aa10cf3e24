"""compute_excess: each rank against its cohort within each step, judged over spans."""

from __future__ import annotations

import numpy as np
from builders import S, rank_summary

from ccld_plugin.diagnose.compute.compute_excess import _median_without_each, compute_excess
from ccld_plugin.diagnose.step_table import StepTable
from ccld_plugin.wire.summary import StepStat


def test_median_without_each_member_matches_the_direct_one():
    rng = np.random.default_rng(0)
    for n in (2, 3, 4, 5, 8):
        vals = rng.random((n, 6))
        vals[rng.random((n, 6)) < 0.2] = np.nan
        got = _median_without_each(vals)
        for k in range(n):
            for s in range(6):
                rest = np.delete(vals[:, s], k)
                rest = rest[~np.isnan(rest)]
                if np.isnan(vals[k, s]) or not len(rest):
                    assert np.isnan(got[k, s])
                else:
                    assert got[k, s] == np.median(rest)


def _table(compute_ms) -> StepTable:
    """Steps 0..29 of ranks 0-3, rank r computing compute_ms(r, step) ms."""
    t = StepTable()
    t.ingest(
        [
            rank_summary(
                r,
                steps=[
                    StepStat(s, s * S, 100_000, int(compute_ms(r, s) * 1000)) for s in range(30)
                ],
            )
            for r in range(4)
        ],
        horizon=0,
    )
    return t


def test_a_host_wide_swing_is_no_excess_and_a_steady_one_is():
    rng = np.random.default_rng(1)
    swing = rng.uniform(0.6, 1.6, 30)  # the whole host, step by step: every rank alike
    noise = rng.uniform(0.95, 1.05, (4, 30))

    def healthy(r, s):
        return 40 * swing[s] * noise[r, s]

    cohorts = {r: [0, 1, 2, 3] for r in range(4)}
    assert compute_excess(_table(healthy), cohorts, 29, (10, 20), 1.2, 4.0) == []

    def slow(r, s):
        return healthy(r, s) * (1.3 if r == 2 and s >= 15 else 1.0)

    (e,) = compute_excess(_table(slow), cohorts, 29, (10, 20), 1.2, 4.0)
    assert (e.rank, e.first, e.last) == (2, 20, 29)  # the shorter span shows it
    assert 1.25 < e.ratio < 1.35 and e.z >= 4


def test_a_burst_shorter_than_half_a_span_is_no_excess():
    def burst(r, s):
        return 40 * (3 if r == 1 and 24 <= s < 28 else 1)

    assert (
        compute_excess(_table(burst), {r: [0, 1, 2, 3] for r in range(4)}, 29, (10, 20), 1.2, 4.0)
        == []
    )
