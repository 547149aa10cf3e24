"""Joining the ranks' arrival samples per collective (diagnose/arrivals.py), on summaries
encoded and decoded as the control plane carries them."""

from __future__ import annotations

from builders import MS, group, job_view, rank_summary

from ccld_plugin.diagnose.arrivals import PENDING_TTL_NS, ArrivalJoin
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.summary import (
    ArrivalSample,
    GroupProgress,
    RankSummary,
    decode_summary,
    encode_summary,
)

DP = group("dp", [0, 1, 2])
SOLO = group("other", [5])


def summary(rank: int, t: int, samples: list[tuple[int, int, int, int]]) -> RankSummary:
    """Rank ``rank``'s decoded summary at ``t`` with (slot, seq, enter, dur_us) samples."""
    s = rank_summary(
        rank,
        t,
        pid=1,
        step=1,
        groups=[GroupProgress(0, 40, 40, 1, 0, 0, 0), GroupProgress(1, 40, 40, 1, 0, 0, 0)],
        samples=[ArrivalSample(sl, q, e, d, 1 << 20) for sl, q, e, d in samples],
    )
    return decode_summary(encode_summary(s))


def view(summaries: list[RankSummary], now: int) -> JobView:
    return job_view(summaries, {r: [DP, SOLO] for r in (0, 1, 2, 5)}, now, world=6)


def test_join_across_rounds_duplicates_and_unknown_slots() -> None:
    j = ArrivalJoin()
    t = 1000 * MS
    first = [
        summary(0, t, [(0, 32, t - 30 * MS, 31_000), (0, 36, t - 9 * MS, 2_000)]),
        summary(1, t, [(0, 32, t - 29 * MS, 30_000), (7, 32, t, 1)]),
    ]  # slot 7: unknown
    assert list(j.add(view(first, t), first)) == []  # rank 2 has not reported seq 32 yet
    t2 = t + 500 * MS
    second = [
        summary(2, t2, [(0, 32, t - 1 * MS, 2_000)]),
        summary(1, t2, [(0, 32, t - 29 * MS, 30_000)]),
    ]  # the same sample again
    (got,) = j.add(view(second, t2), second)
    assert (got.group, got.seq, got.last, got.time_ns) == (DP, 32, 2, t - 1 * MS)
    assert got.waits_ns == {0: 29 * MS, 1: 28 * MS, 2: 0}
    assert got.transfer_ns == 2 * MS  # from the last arrival (t - 1 ms) to the first exit
    assert got.bytes == 1 << 20


def test_samples_repeated_by_the_next_summary_join_once() -> None:
    # Each summary repeats its previous tick's samples: those a round read already are
    # dropped, those of a summary no round read (replaced first) still join.
    j = ArrivalJoin()
    t = 1000 * MS
    first = [summary(r, t, [(0, 32, t - (30 - r) * MS, 1_000)]) for r in (0, 1, 2)]
    assert [x.seq for x in j.add(view(first, t), first)] == [32]
    t2 = t + 1000 * MS  # the tick after: seq 32 again, seq 34 new
    second = [
        summary(r, t2, [(0, 32, t - (30 - r) * MS, 1_000), (0, 34, t2 - 9 * MS, 1_000)])
        for r in (0, 1, 2)
    ]
    assert [x.seq for x in j.add(view(second, t2), second)] == [34]
    # Rank 2's summary of the next tick was replaced unread: its seq 36 comes with the one
    # after, as a repeat, and joins the others'.
    t3, t4 = t2 + 1000 * MS, t2 + 2000 * MS
    third = [summary(r, t3, [(0, 36, t3 - 5 * MS, 1_000)]) for r in (0, 1)]
    assert list(j.add(view(third, t3), third)) == []
    fourth = [summary(2, t4, [(0, 36, t3 - 4 * MS, 1_000), (0, 38, t4 - 5 * MS, 1_000)])]
    (got,) = j.add(view(fourth, t4), fourth)
    assert (got.seq, got.last) == (36, 2)


def test_single_member_groups_join_at_once_and_stale_samples_expire() -> None:
    j = ArrivalJoin()
    t = 1000 * MS
    s = [summary(5, t, [(1, 40, t - 5 * MS, 1_000)]), summary(0, t, [(0, 28, t - 4 * MS, 10)])]
    (solo,) = j.add(view(s, t), s)
    assert (solo.group, solo.last, solo.transfer_ns) == (SOLO, 5, 1 * MS)
    later = t + PENDING_TTL_NS + 1
    assert list(j.add(view([], later), [])) == []
    late = [
        summary(1, later, [(0, 28, t - 4 * MS, 10)]),
        summary(2, later, [(0, 28, t - 4 * MS, 10)]),
    ]
    assert list(j.add(view(late, later), late)) == []  # rank 0's sample of seq 28 has expired


def test_a_role_refined_by_another_rank_reaches_the_joined_samples() -> None:
    # Ranks 0-2 registered the group as "other"; later rank 5's table names it "dp". The
    # tables of 0-2 are the same objects as before; the topology that resolves roles is new.
    generic = GroupInfo(DP.group_id, "other", DP.ranks)
    tables = {r: [generic, SOLO] for r in (0, 1, 2)}
    j = ArrivalJoin()
    t = 1000 * MS
    s = [summary(r, t, [(0, 32, t - MS, 10)]) for r in (0, 1, 2)]
    (first,) = j.add(JobView({x.rank: x for x in s}, tables, t, 0, 6), s)
    assert first.group.role == "other"
    refined = {**tables, 5: [DP, SOLO]}
    t2 = t + 500 * MS
    s = [summary(r, t2, [(0, 36, t2 - MS, 10)]) for r in (0, 1, 2)]
    (second,) = j.add(JobView({x.rank: x for x in s}, refined, t2, 0, 6), s)
    assert second.group.role == "dp"


def test_waited_for_weighs_waits_by_time_not_by_count() -> None:
    # A straggler whose compute is stretched before some collectives only: last by 30 ms at
    # two of six, beaten by a hair at the other four. A third of the last arrivals, but
    # nearly all of the waiting in its collectives is its peers' waiting for it.
    import numpy as np

    from ccld_plugin.diagnose.arrivals import Joined, JoinedTable
    from ccld_plugin.diagnose.compute.confirmation import wait_balance

    def joined(last: int, waits_ms: dict[int, float]) -> Joined:
        t = 1000 * MS
        members = np.array(sorted(waits_ms))
        enters = np.array([t - int(waits_ms[m] * MS) for m in members])
        return Joined(DP, 1, t, last, 0, 1 << 20, members, enters)

    def balance(rank: int, joined: list[Joined]):  # over all of them, as a window's
        table = JoinedTable.of(joined)
        return wait_balance(rank, table.of_rank(rank, np.ones(len(table), bool)))

    straggler = [joined(1, {0: 30, 1: 0, 2: 31}) for _ in range(2)] + [
        joined(2, {0: 0.3, 1: 0.1, 2: 0}) for _ in range(4)
    ]
    assert sum(j.last == 1 for j in straggler) / len(straggler) < 0.5
    assert balance(1, straggler).share > 0.95
    # Its peers: they waited for it, and nobody waited for them long.
    assert balance(0, straggler).share < 0.05
    # A healthy rank among equals: about even.
    even = [joined(1, {0: 2, 1: 0, 2: 2}), joined(0, {0: 0, 1: 2, 2: 2})]
    assert 0.4 < balance(1, even).share < 0.6
    assert balance(1, [joined(1, {0: 0, 1: 0, 2: 0})]).share is None  # nobody waited
