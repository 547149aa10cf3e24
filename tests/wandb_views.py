"""Synthetic inputs of the W&B panels, shared by their unit tests and the sink's job tests:
a TP2 x DP4 job's views step by step (one rank computing twice as long), joined arrival
samples, and one verdict."""

from __future__ import annotations

import numpy as np

from ccld_plugin.diagnose import JobView
from ccld_plugin.diagnose.arrivals import Joined
from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.topology import GroupInfo, group_id_of
from ccld_plugin.wire.summary import GroupProgress, RankSummary, StepStat

MS = 1_000_000
DP = GroupInfo(group_id_of([0, 1, 2, 3]), "dp", (0, 1, 2, 3))
TP = [GroupInfo(group_id_of([0, 1]), "tp", (0, 1)), GroupInfo(group_id_of([2, 3]), "tp", (2, 3))]
TABLES = {r: [DP, TP[r // 2]] for r in range(4)}
STEP_NS = 100 * MS


def panel_summary(
    rank: int,
    steps: list[int],
    now: int,
    compute_ms: float = 60.0,
    blocked_us: tuple[int, int] = (20_000, 10_000),
    flights: tuple = (),
    cpu_wait_ms: float = 0.0,
) -> RankSummary:
    """Rank ``rank``'s summary at ``now`` reporting ``steps`` of 100 ms each."""
    stats = [
        StepStat(s, s * STEP_NS, 100_000, int(compute_ms * 1000), int(cpu_wait_ms * 1000))
        for s in steps
    ]
    return RankSummary(
        rank=rank,
        pid=1,
        host=f"h{rank // 2}",
        time_ns=now,
        heartbeat_ns=now,
        step=steps[-1] if steps else 0,
        last_progress_ns=now,
        groups_version=1,
        groups=[
            GroupProgress(0, 9, 9, 2, blocked_us[0], 0, 0),
            GroupProgress(1, 9, 9, 2, blocked_us[1], 0, 0),
        ],
        in_flight=list(flights),
        steps=stats,
    )


def job_views(
    steps: int, first: int = 0, slow_rank: int = 2, queued_rank: int | None = None
) -> list[JobView]:
    """One view per step: every rank reports the step that just ended; ``slow_rank``
    computes twice as long; ``queued_rank`` waits 10 ms a step for a CPU besides."""
    views = []
    for s in range(first, first + steps):
        now = (s + 1) * STEP_NS + 1
        sums = {
            r: panel_summary(
                r,
                [s],
                now,
                120.0 if r == slow_rank else 60.0,
                cpu_wait_ms=10.0 if r == queued_rank else 0.0,
            )
            for r in range(4)
        }
        views.append(JobView(summaries=sums, tables=TABLES, now_ns=now, job_start_ns=0, world=4))
    return views


def joined_samples(step: int, last: int = 2) -> list[Joined]:
    """Two joined samples: DP ranks waited 30 ms for ``last``; TP rank 1 waited 1 ms."""
    t = step * STEP_NS + 50 * MS

    def joined(
        g: GroupInfo, t_last: int, who: int, waits: dict[int, int], transfer: int, nbytes: int
    ) -> Joined:
        return Joined(
            g,
            4 * step,
            t_last,
            who,
            transfer,
            nbytes,
            np.array(list(waits)),
            np.array([t_last - w for w in waits.values()]),
        )

    return [
        joined(
            DP, t, last, {r: (0 if r == last else 30 * MS) for r in range(4)}, 2 * MS, 4_000_000
        ),
        joined(TP[0], t - MS, 0, {0: 0, 1: 1 * MS}, 1 * MS, 1_000_000),
    ]


def slow_link_verdict() -> Verdict:
    return Verdict(
        kind=Kind.SLOW,
        cause=Cause.COMMUNICATION,
        ranks=[3],
        group=DP.to_dict(),
        link=[2, 3],
        step=9,
        detected_s=4.5,
        severity=3.1,
        evidence=[
            Evidence.of(
                "group_bandwidth",
                "{role}{members} moves {mb_s:.1f} MB/s",
                role="dp",
                members=[0, 1, 2, 3],
                mb_s=1.0,
            ),
            Evidence.of("note", "second line"),
        ],
    )
