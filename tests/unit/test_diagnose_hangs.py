"""The diagnoser's stages on synthetic summaries (like Flight Recorder's analyzer tests):
wait-for graph roots, cycles, mismatches, unresponsive ranks, and the summary encoding."""

import dataclasses

import numpy as np
from builders import NOW, S, facts, group, job_view, rank_summary

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose import Analyzer
from ccld_plugin.diagnose.arrivals import Joined, JoinedTable
from ccld_plugin.diagnose.stalls.crash import find_crashes
from ccld_plugin.diagnose.stalls.hang import LAST_WORDS_TICKS, find_hangs, find_unresponsive
from ccld_plugin.diagnose.stalls.mismatch import find_left_early, find_mismatches
from ccld_plugin.services.session import crash_record
from ccld_plugin.wire.codes import FLAG_ASYNC, FLAG_P2P, FLAG_SEND, OP_CODES
from ccld_plugin.wire.summary import (
    FLAG_CRASHED,
    FLAG_ERRORED,
    FLAG_EXITED,
    FLAG_LAST_WORDS,
    ArrivalSample,
    GroupProgress,
    InFlightOp,
    StepStat,
    arrival_samples,
    decode_summary,
    encode_summary,
)


def summary(rank, entered, flights=(), idle_s=0.0, hb_age_s=0.0, flags=0, step=5):
    """entered: {slot: seq}; flights: (slot, op, seq, age_s, flags, peer)."""
    return rank_summary(
        rank,
        heartbeat_ns=NOW - int(hb_age_s * S),
        step=step,
        last_progress_ns=NOW - int(idle_s * S),
        flags=flags,
        groups=[GroupProgress(slot, seq, seq, 0, 0, 0, 0) for slot, seq in entered.items()],
        in_flight=[
            InFlightOp(slot, OP_CODES[op], fl, peer, seq, 64, NOW - int(age * S))
            for slot, op, seq, age, fl, peer in flights
        ],
    )


def view(summaries, tables, gone=()):
    return job_view(summaries, tables, gone=gone)


def test_hang_root_is_the_rank_in_no_collective_tp2_pp2():
    # TP2xPP2: tp [0,1],[2,3]; pp [0,2],[1,3]. Rank 1 is stuck in compute. Rank 0 waits in a
    # TP all-reduce for it; rank 3 waits in recv from 1; rank 2 waits in recv from 0.
    tp01, tp23, pp02, pp13 = (
        group("tp", [0, 1]),
        group("tp", [2, 3]),
        group("pp", [0, 2]),
        group("pp", [1, 3]),
    )
    tables = {0: [tp01, pp02], 1: [tp01, pp13], 2: [tp23, pp02], 3: [tp23, pp13]}
    v = view(
        [
            summary(0, {0: 41, 1: 0}, [(0, "all_reduce", 41, 12, 0, -1)], idle_s=12),
            summary(1, {0: 40, 1: 0}, idle_s=12.5),
            summary(2, {0: 30, 1: 0}, [(1, "recv", 11, 11, FLAG_P2P, 0)], idle_s=11),
            summary(3, {0: 30, 1: 0}, [(1, "recv", 11, 11.5, FLAG_P2P, 1)], idle_s=11.5),
        ],
        tables,
    )
    (h,) = find_hangs(v, lambda gid: 10.0, 1.0)
    assert (h.kind.value, h.cause.value, h.ranks) == ("hang", "compute", [1])
    assert h.group["role"] == "tp" and h.group["ranks"] == [0, 1]
    assert h.onset_s == 87.5 and h.detected_s == 100.0


def test_a_compute_hang_shows_in_the_group_that_holds_up_the_most_ranks():
    # TP2xDP2 (DTensor): tp [0,1],[2,3]; dp [0,2],[1,3]. Rank 1 stops at a step's start.
    # Rank 0 waits in the step's TP all-reduce; rank 3, whose replica ran ahead, reached the
    # step's end and waits in the DP all-reduce, longer; rank 2 waits in DP for rank 0. The
    # hang shows in TP: the op rank 1 meets first, and the one holding rank 2 up too.
    tp01, tp23, dp02, dp13 = (
        group("tp", [0, 1]),
        group("tp", [2, 3]),
        group("dp", [0, 2]),
        group("dp", [1, 3]),
    )
    tables = {0: [tp01, dp02], 1: [tp01, dp13], 2: [tp23, dp02], 3: [tp23, dp13]}
    v = view(
        [
            summary(0, {0: 11, 1: 24}, [(0, "all_reduce", 11, 11.0, 0, -1)], idle_s=11.0),
            summary(1, {0: 10, 1: 24}, idle_s=11.2),
            summary(2, {0: 11, 1: 25}, [(1, "all_reduce", 25, 11.1, 0, -1)], idle_s=11.1),
            summary(3, {0: 11, 1: 25}, [(1, "all_reduce", 25, 11.2, 0, -1)], idle_s=11.2),
        ],
        tables,
    )
    (h,) = find_hangs(v, lambda gid: 10.0, 1.0)
    assert (h.kind.value, h.cause.value, h.ranks) == ("hang", "compute", [1])
    assert (h.group["role"], h.group["ranks"], h.op) == ("tp", [0, 1], "all_reduce")
    (chain,) = facts(h.evidence)["wait_chain"]
    assert [(c["rank"], c["waits_for"]) for c in chain["data"]["chains"]] == [(2, [0]), (3, [1])]


def test_a_hang_that_ends_is_told_as_resumed_and_a_later_one_is_reported_again():
    # DP4: rank 0 stops (a checkpoint of its own) while ranks 1-3 wait in an all-reduce;
    # 14 s later it goes on; later still it stops again.
    dp = group("dp", range(4))
    tables = {r: [dp] for r in range(4)}
    diag = Analyzer(DiagnoserConfig(hang_min_s=5), interval_s=0.5)

    def at(now_s: float, stopped_s: float | None, seq: int, step: int) -> list:
        now = int(now_s * S)
        if stopped_s is None:  # every rank busy, progress just now
            ranks = [rank_summary(r, now, step=step, last_progress_ns=now) for r in range(4)]
        else:
            stop = int(stopped_s * S)
            ranks = [
                rank_summary(
                    0,
                    now,
                    step=step,
                    last_progress_ns=stop,
                    groups=[GroupProgress(0, seq - 1, seq - 1, 0, 0, 0, 0)],
                ),
                *[
                    rank_summary(
                        r,
                        now,
                        step=step,
                        last_progress_ns=stop,
                        groups=[GroupProgress(0, seq, seq - 1, 0, 0, 0, 0)],
                        in_flight=[InFlightOp(0, OP_CODES["all_reduce"], 0, -1, seq, 64, stop)],
                    )
                    for r in (1, 2, 3)
                ],
            ]
        return diag.round(job_view(ranks, tables, now_ns=now))

    (h,) = at(100, 88, seq=40, step=5)
    assert (h.kind.value, h.cause.value, h.ranks) == ("hang", "compute", [0])
    assert at(101, 88, seq=40, step=5) == []  # still stopped: nothing new
    (r,) = at(103, None, seq=41, step=6)
    assert (r.kind.value, r.cause.value, r.ranks, r.group) == ("resumed", "compute", [0], h.group)
    assert r.severity == 15.0 and r.step == 6
    (fact,) = facts(r.evidence)["resumed"]
    assert fact["data"]["reported_s"] == 100.0 and "a stall of 15.0 s" in fact["text"]
    assert at(104, None, seq=42, step=7) == []  # told once
    (again,) = at(130, 118, seq=60, step=9)  # a new stall of the same rank: reported
    assert (again.kind.value, again.ranks, again.step) == ("hang", [0], 9)


def test_a_job_that_marks_no_steps_is_told_no_step():
    # A loop with no optimizer (nothing marks its steps) stays at step 0 on every rank: its
    # verdicts and their evidence name no step; a job that marks them is told its step.
    pp = group("pp", [0, 1])
    tables = {0: [pp], 1: [pp]}
    for step, told in ((0, None), (7, 7)):
        v = view(
            [
                summary(0, {0: 0}, [(0, "recv", 9, 12, FLAG_P2P, 1)], idle_s=12, step=step),
                summary(1, {0: 0}, idle_s=12.5, step=step),
            ],
            tables,
        )
        (h,) = Analyzer(DiagnoserConfig(hang_min_s=5), interval_s=0.5).round(v)
        assert (h.kind.value, h.cause.value, h.ranks, h.step) == ("hang", "compute", [1], told)
        (idle,) = facts(h.evidence)["in_no_collective"]
        assert idle["data"]["step"] == told
        assert ("step" in idle["text"]) == (told is not None), idle["text"]


def test_a_frozen_root_is_unresponsive_not_a_compute_hang():
    # Rank 1's process froze (SIGSTOP) outside any op: its agent froze too, so its last
    # summary is 12 s old and says nothing of what it does. No compute hang is named on
    # that stale word; once its heartbeat is old enough it is unresponsive, and the
    # peers' wait is explained by it.
    dp = group("dp", [0, 1])
    tables = {0: [dp], 1: [dp]}
    frozen = summary(1, {0: 8}, idle_s=12, hb_age_s=12)
    frozen.time_ns = frozen.heartbeat_ns
    v = view([summary(0, {0: 9}, [(0, "all_reduce", 9, 12, 0, -1)], idle_s=12), frozen], tables)
    assert find_hangs(v, lambda gid: 10.0, 1.0) == []
    (u,) = Analyzer(DiagnoserConfig(unresponsive_s=10), interval_s=0.5).round(v)
    assert (u.kind.value, u.ranks) == ("unresponsive", [1])
    # Its stale summary may show it inside the op (it froze just after): still no
    # "everyone entered" communication hang on that stale word.
    inside = summary(1, {0: 9}, [(0, "all_reduce", 9, 12, 0, -1)], idle_s=12, hb_age_s=12)
    inside.time_ns = inside.heartbeat_ns
    v = view([summary(0, {0: 9}, [(0, "all_reduce", 9, 12, 0, -1)], idle_s=12), inside], tables)
    assert find_hangs(v, lambda gid: 10.0, 1.0) == []
    # The same rank with its agent alive (a compute hang in host code) is a hang.
    alive = summary(1, {0: 8}, idle_s=12)
    v = view([summary(0, {0: 9}, [(0, "all_reduce", 9, 12, 0, -1)], idle_s=12), alive], tables)
    (h,) = find_hangs(v, lambda gid: 10.0, 1.0)
    assert (h.cause.value, h.ranks) == ("compute", [1])


def test_ranks_that_go_down_with_a_reported_stall_are_not_news():
    # Rank 1 hangs in compute; ranks 0, 2, 3 wait for it in all_reduce seq 9 on dp, rank 4
    # (outside dp) runs on. Once the hang is reported, the job's timeout makes the waiters
    # leave, the scheduler kills rank 1: their processes are gone, but it is the hang's
    # fallout. Rank 4, gone too but never stuck in the stall, is named.
    dp, other = group("dp", [0, 1, 2, 3]), group("tp", [4, 5])
    tables = {**{r: [dp] for r in range(4)}, 4: [other], 5: [other]}
    waiting = [(0, "all_reduce", 9, 12, 0, -1)]
    ranks = [
        *(summary(r, {0: 9}, waiting, idle_s=12) for r in (0, 2, 3)),
        summary(1, {0: 8}, idle_s=12),
        summary(4, {0: 30}, [(0, "all_reduce", 30, 0.1, 0, -1)]),
        summary(5, {0: 30}, [(0, "all_reduce", 30, 0.1, 0, -1)]),
    ]
    d = Analyzer(DiagnoserConfig(hang_min_s=5, unresponsive_s=10), interval_s=0.5)
    (h,) = d.round(job_view(ranks, tables))
    assert (h.kind.value, h.cause.value, h.ranks) == ("hang", "compute", [1])
    ranks[4] = summary(4, {0: 80}, [(0, "all_reduce", 80, -4.9, 0, -1)])  # 4.9 s later
    later = job_view(ranks, tables, now_ns=NOW + 5 * S, gone={0, 1, 2, 3, 4})
    (u,) = d.round(later)  # and no new hang of the waiters, explained by the lost ranks
    assert (u.kind.value, u.ranks) == ("unresponsive", [4])
    # Without the stall reported first, each gone rank is named.
    fresh = Analyzer(DiagnoserConfig(hang_min_s=5, unresponsive_s=10), interval_s=0.5)
    named = [v.ranks for v in fresh.round(later) if v.kind.value == "unresponsive"]
    assert named == [[0], [1], [2], [3], [4]]


def test_no_hang_below_the_threshold_and_adaptive_threshold():
    dp = group("dp", [0, 1])
    tables = {0: [dp], 1: [dp]}
    v = view(
        [
            summary(0, {0: 9}, [(0, "all_reduce", 9, 8, 0, -1)], idle_s=8),
            summary(1, {0: 8}, idle_s=8),
        ],
        tables,
    )
    assert find_hangs(v, lambda gid: 10.0, 1.0) == []
    d = Analyzer(DiagnoserConfig(hang_min_s=3), interval_s=0.5)
    assert d.threshold_s(dp.group_id) == 6  # no op completed yet: twice the floor
    d.durations.extend(dp.group_id, [100_000])  # one op of 0.1 s
    assert d.threshold_s(dp.group_id) == 3
    d.durations.extend(dp.group_id, [2_000_000] * 50)  # ops of 2 s on this group
    assert d.threshold_s(dp.group_id) == 10.0  # hang_k (5) x p99


def test_everyone_arrived_is_a_communication_hang_with_all_members_suspect():
    dp = group("dp", [0, 1, 2])
    tables = {r: [dp] for r in range(3)}
    v = view(
        [summary(r, {0: 7}, [(0, "all_reduce", 7, 20, 0, -1)], idle_s=20) for r in range(3)], tables
    )
    (h,) = find_hangs(v, lambda gid: 10.0, 1.0)
    assert (h.cause.value, h.ranks, h.group["role"]) == ("communication", [0, 1, 2], "dp")


def test_p2p_ordering_cycle_is_a_deadlock():
    pp = group("pp", [0, 1])
    tables = {0: [pp], 1: [pp]}
    # Both ranks block in a send to the other: neither posts the matching recv.
    v = view(
        [
            summary(0, {0: 0}, [(0, "send", 3, 15, FLAG_P2P | FLAG_SEND, 1)], idle_s=15),
            summary(1, {0: 0}, [(0, "send", 3, 15, FLAG_P2P | FLAG_SEND, 0)], idle_s=15),
        ],
        tables,
    )
    (h,) = find_hangs(v, lambda gid: 10.0, 1.0)
    assert (h.kind.value, h.cause.value, h.ranks) == ("deadlock", "software", [0, 1])


def test_a_deadlock_is_told_from_its_oldest_wait_whichever_rank_is_walked_first():
    # An unseen MoE script: rank 1 skipped an all-to-all of ep[0, 1] and went on to the
    # world all-reduce; rank 0 waits in the all-to-all. Two rounds walked the cycle from
    # different ranks and gave two verdicts (one at each op) for one finding.
    world, ep01, ep23 = group("world", range(4)), group("ep", [0, 1]), group("ep", [2, 3])
    tables = {r: [world, ep01 if r < 2 else ep23] for r in range(4)}
    waits = [
        summary(0, {0: 6, 1: 53}, [(1, "all_to_all_single", 53, 12, 0, -1)], idle_s=12),
        summary(1, {0: 7, 1: 52}, [(0, "all_reduce", 7, 13, 0, -1)], idle_s=13),
        *(summary(r, {0: 7, 1: 56}, [(0, "all_reduce", 7, 12, 0, -1)], idle_s=12) for r in (2, 3)),
    ]
    keys = set()
    for order in (waits, waits[::-1]):
        (d,) = find_hangs(view(order, tables), lambda gid: 10.0, 1.0)
        assert (d.kind.value, d.ranks, d.op, d.group["role"]) == (
            "deadlock",
            [0, 1],
            "all_reduce",
            "world",
        )
        assert facts(d.evidence)["cycle"][0]["data"]["cycle"] == [1, 0]
        keys.add(d.key())
    assert len(keys) == 1


def test_a_member_alone_in_a_collective_among_transfers_is_a_mismatch():
    # A four-stage pipeline: rank 2 began an all-gather over the pipeline (seq 8) that no
    # other stage entered; stages 0 and 1 wait to hand it activations, stage 3 to receive
    # from it. The waits form a cycle (2 waits for 0 to join, 0 for 1, 1 for 2), but what
    # broke is one member's order of ops: a mismatch naming rank 2 (a live Megatron
    # TP1xPP4 job was named a deadlock of ranks 0, 1, 2).
    pp = group("pp", list(range(4)))
    tables = {r: [pp] for r in range(4)}
    send, recv = FLAG_P2P | FLAG_SEND, FLAG_P2P
    flights = {
        0: (0, "send", 14, 12, send, 1),
        1: (0, "send", 13, 12, send, 2),
        2: (0, "all_gather_into_tensor", 8, 12, 0, -1),
        3: (0, "recv", 13, 12, recv, 2),
    }
    summaries = [summary(r, {0: 8 if r == 2 else 7}, [flights[r]], idle_s=12) for r in range(4)]
    (m,) = find_hangs(view(summaries, tables), lambda gid: 10.0, 1.0)
    assert (m.kind.value, m.cause.value, m.ranks) == ("mismatch", "software", [2])
    facts = {e.fact: e.data for e in m.evidence}
    assert facts["in_transfers"]["ranks"] == [0, 1, 3]
    # A stage that is not in a transfer (computing, or in another group's op) leaves the
    # cycle a deadlock: who broke the order is not told by the group alone.
    summaries[3] = summary(3, {0: 7}, idle_s=0.5)
    (d,) = find_hangs(view(summaries, tables), lambda gid: 10.0, 1.0)
    assert (d.kind.value, d.ranks) == ("deadlock", [0, 1, 2])
    # Two members: the one in the collective and the one in a transfer; no majority.
    pair = group("pp", [0, 1])
    v = view(
        [
            summary(0, {0: 3}, [(0, "all_reduce", 3, 12, 0, -1)], idle_s=12),
            summary(1, {0: 2}, [(0, "recv", 5, 12, recv, 0)], idle_s=12),
        ],
        {0: [pair], 1: [pair]},
    )
    (m,) = find_hangs(v, lambda gid: 10.0, 1.0)
    assert (m.kind.value, m.ranks) == ("mismatch", [0, 1])
    assert "no_majority" in {e.fact for e in m.evidence}


SETTLE_S = 3.0  # the group's hang threshold, as the diagnoser passes it


def settle(_gid):
    return SETTLE_S


def test_mismatch_names_the_minority_and_a_tie_names_both():
    dp = group("dp", [0, 1, 2, 3])
    tables = {r: [dp] for r in range(4)}
    flights = {r: [(0, "all_reduce", 12, 1, 0, -1)] for r in range(4)}
    flights[2] = [(0, "all_gather_into_tensor", 12, 1, 0, -1)]
    v = view([summary(r, {0: 12}, flights[r]) for r in range(4)], tables)
    (m,) = find_mismatches(v, settle)
    assert (m.kind.value, m.cause.value, m.ranks) == ("mismatch", "software", [2])
    pair = group("tp", [0, 1])
    v = view(
        [
            summary(0, {0: 3}, [(0, "all_reduce", 3, 1, 0, -1)]),
            summary(1, {0: 3}, [(0, "broadcast", 3, 1, 0, -1)]),
        ],
        {0: [pair], 1: [pair]},
    )
    assert find_mismatches(v, settle)[0].ranks == [0, 1]


def test_mismatch_waits_for_members_that_have_not_reported_since():
    # Ranks 1 and 3 of a DP4 group entered seq 5 with different ops; ranks 0 and 2 have not
    # reported since (their summaries are older than both entries). One against one is no
    # majority yet: nothing is judged until they report.
    dp = group("dp", [0, 1, 2, 3])
    tables = {r: [dp] for r in range(4)}

    def at(rank, op=None, age_s=0.2):
        if op is None:  # last reported a second ago, before the seq was entered
            return dataclasses.replace(summary(rank, {0: 4}), time_ns=NOW - S)
        return summary(rank, {0: 5}, [(0, op, 5, age_s, 0, -1)])

    early = [at(0), at(1, "all_reduce"), at(2), at(3, "all_gather_into_tensor")]
    assert find_mismatches(view(early, tables), settle) == []
    # Once they report, their ops make the majority and only rank 3 is named.
    late = [at(0, "all_reduce"), at(1, "all_reduce"), at(2, "all_reduce"), early[3]]
    (m,) = find_mismatches(view(late, tables), settle)
    assert m.ranks == [3]
    # Reported since, and still short of the seq but moving (a step's compute between
    # two collectives): their op is still to come, as in a live 4-rank demo where a verdict
    # named [0, 3] before the others entered and made [3] the minority.
    moving = [summary(0, {0: 4}), early[1], summary(2, {0: 4}), early[3]]
    assert find_mismatches(view(moving, tables), settle) == []
    # In compute (no progress since the entries) but for less than the settle time: the
    # race the live demo lost, since computing makes no progress either.
    computing = [summary(0, {0: 4}, idle_s=1.0), early[1], summary(2, {0: 4}, idle_s=1.0), early[3]]
    assert find_mismatches(view(computing, tables), settle) == []
    # Reported since, short of the seq and still for the settle time since the entries
    # (stuck elsewhere), or saying nothing of the group: the two seen are judged as they are.
    old = SETTLE_S + 1
    entered = [at(1, "all_reduce", old), at(3, "all_gather_into_tensor", old)]
    still = [summary(0, {0: 4}, idle_s=old + 1), entered[0], rank_summary(2), entered[1]]
    (m,) = find_mismatches(view(still, tables), settle)
    assert m.ranks == [1, 3]
    # Still for long, but the entries are recent: stillness counts from the dissent.
    recent = [summary(0, {0: 4}, idle_s=old + 1), early[1], rank_summary(2), early[3]]
    assert find_mismatches(view(recent, tables), settle) == []


def test_mismatch_tie_in_a_pair_is_broken_by_the_sibling_groups():
    # Two DP pairs, [0, 2] and [1, 3]: rank 2 runs the odd collective as seq 5. Inside its
    # pair that is a tie; the sibling pair ran all_reduce as seq 5, so rank 2 is named.
    dp02, dp13 = group("dp", [0, 2]), group("dp", [1, 3])
    tables = {0: [dp02], 2: [dp02], 1: [dp13], 3: [dp13]}
    ops = {0: "all_reduce", 1: "all_reduce", 2: "all_gather_into_tensor", 3: "all_reduce"}
    v = view([summary(r, {0: 5}, [(0, ops[r], 5, 1, 0, -1)]) for r in range(4)], tables)
    (m,) = find_mismatches(v, settle)
    assert m.ranks == [2] and m.group["ranks"] == [0, 2]
    (ev,) = facts(m.evidence)["sibling_majority"]
    assert ev["data"] == {"count": 1, "role": "dp", "op": "all_reduce", "bytes": 64, "seq": 5}
    # The same op with other bytes (an unseen script's half tensor): the siblings' size
    # decides, not whichever member's op comes first by name.
    half = [summary(r, {0: 5}, [(0, "all_reduce", 5, 1, 0, -1)]) for r in range(4)]
    half[2].in_flight[0] = half[2].in_flight[0]._replace(bytes=32)
    (m,) = find_mismatches(view(half, tables), settle)
    assert m.ranks == [2] and "(64 B)" in facts(m.evidence)["sibling_majority"][0]["text"]
    half[1].in_flight[0] = half[1].in_flight[0]._replace(bytes=16)
    assert find_mismatches(view(half, tables), settle)[0].ranks == [0, 2]  # nobody agrees


def test_mismatch_tie_in_a_pair_is_broken_by_the_groups_own_history():
    # TP2xPP2 at DP=1: the TP pair [0, 1] runs 64 B and 128 B collectives in turn; as seq
    # 9 rank 0 enters the 64 B all-reduce and rank 1 an all-gather of 24 B. The other
    # stage's pair is not at that seq (it waits for this stage's activations). The pair's
    # recent collectives (the arrival join's, with the ids of real groups) name rank 1.
    tp01, tp23, dp02 = group("tp", [0, 1]), group("tp", [2, 3]), group("dp", [0, 2])
    tables = {0: [tp01], 1: [tp01]}

    def entered(op1: str, bytes1: int):
        ops = [summary(r, {0: 9}, [(0, "all_reduce", 9, 1, 0, -1)]) for r in (0, 1)]
        ops[1].in_flight[0] = ops[1].in_flight[0]._replace(op=OP_CODES[op1], bytes=bytes1)
        return view(ops, tables)

    ran = [(tp01, seq, 64 if seq % 2 else 128) for seq in range(1, 9)]
    ran += [(tp23, 9, 24), (dp02, 9, 24)]  # other groups' (dp02's id is above 2**63)
    joined = JoinedTable.of(
        [Joined(g, seq, NOW, 0, 0, b, np.array(g.ranks), np.array([NOW, NOW])) for g, seq, b in ran]
    )
    history = joined.sizes_of(tp01.group_id)
    assert history == {seq: 64 if seq % 2 else 128 for seq in range(1, 9)}
    (m,) = find_mismatches(entered("all_gather_into_tensor", 24), settle, joined.sizes_of)
    assert (m.ranks, m.op) == ([1], "all_gather_into_tensor")
    (ev,) = facts(m.evidence)["group_history"]
    assert (ev["data"]["count"], ev["data"]["bytes"], ev["data"]["usual"]) == (3, 64, [0])
    assert ev["data"]["after"] == 128 and "a collective of 128 B with one of 64 B" in ev["text"]
    # Rank 1 skipped the 64 B collective and entered the next, 128 B: a size the pair ran
    # too, but never after a 128 B one.
    (m,) = find_mismatches(entered("all_reduce", 128), settle, joined.sizes_of)
    assert m.ranks == [1] and facts(m.evidence)["group_history"][0]["data"]["usual"] == [0]
    # Seq 8 not sampled: the sizes run at all still single out a stray size, not a skip.
    sampled = {s: b for s, b in history.items() if s != 8}
    (m,) = find_mismatches(entered("all_gather_into_tensor", 24), settle, lambda _: sampled)
    assert m.ranks == [1]
    (m,) = find_mismatches(entered("all_reduce", 128), settle, lambda _: sampled)
    assert m.ranks == [0, 1] and "no_majority" in facts(m.evidence)
    # No history: nothing tells; both named.
    (m,) = find_mismatches(entered("all_gather_into_tensor", 24), settle, lambda _: {})
    assert m.ranks == [0, 1] and "no_majority" in facts(m.evidence)


def test_a_rank_that_died_inside_a_mismatched_collective_died_of_it():
    # gloo aborts a process on a size mismatch: rank 1's process ended inside the
    # all-reduce it entered with half the bytes. One finding, the mismatch, says so.
    dp = group("dp", [0, 1])
    tables = {0: [dp], 1: [dp]}
    v = view(
        [
            summary(0, {0: 9}, [(0, "all_reduce", 9, 2, 0, -1)], idle_s=2),
            summary(1, {0: 9}, [(0, "all_reduce", 9, 2, 0, -1)], idle_s=2, hb_age_s=5),
        ],
        tables,
        gone=[1],
    )
    v.summaries[1].in_flight[0] = v.summaries[1].in_flight[0]._replace(bytes=32)
    verdicts = Analyzer(DiagnoserConfig(hang_min_s=3), interval_s=0.5).round(v)
    assert [(x.kind.value, x.ranks) for x in verdicts] == [("mismatch", [0, 1])]
    assert facts(verdicts[0].evidence)["ended_in_it"][0]["data"] == {"rank": 1}


def test_groups_stalled_behind_a_mismatch_are_not_separate_hangs():
    # DP pair [0, 1] mismatched at seq 5; TP pair [2, 3] is stuck too (all members in the
    # op, no channel evidence): an effect, folded into the mismatch verdict.
    dp, tp = group("dp", [0, 1]), group("tp", [2, 3])
    tables = {0: [dp], 1: [dp], 2: [tp], 3: [tp]}
    v = view(
        [
            summary(0, {0: 5}, [(0, "all_reduce", 5, 12, 0, -1)], idle_s=12),
            summary(1, {0: 5}, [(0, "broadcast", 5, 12, 0, -1)], idle_s=12),
            summary(2, {0: 9}, [(0, "all_reduce", 9, 11, 0, -1)], idle_s=11),
            summary(3, {0: 9}, [(0, "all_reduce", 9, 11, 0, -1)], idle_s=11),
        ],
        tables,
    )
    verdicts = Analyzer(DiagnoserConfig(hang_min_s=3), interval_s=0.5).round(v)
    assert [x.kind.value for x in verdicts] == ["mismatch"]
    (ev,) = facts(verdicts[0].evidence)["stalled_behind"]
    item = ev["data"]["item"]
    assert item["fact"] == "all_entered" and ev["text"] == "stalled behind it: " + item["text"]
    assert (item["data"]["role"], item["data"]["members"]) == ("tp", [2, 3])


def test_a_transfer_waiting_for_a_rank_held_in_a_stuck_group_is_no_hang_of_its_own():
    # An unseen script (a hand-written TP1xPP2xDP2 pipeline, `ccld run`): ranks 0, 1 (stage
    # 0) issued different collectives in their DP pair; stage 1's ranks 2, 3 wait in a recv
    # from them that they never send. Those recvs wait for a rank (not "all entered"): the
    # mismatch is the one verdict (was: a second one, a communication hang of 0 and 2).
    dp01, dp23, world = group("dp", [0, 1]), group("dp", [2, 3]), group("world", [0, 1, 2, 3])
    tables = {0: [dp01, world], 1: [dp01, world], 2: [dp23, world], 3: [dp23, world]}
    p2p = FLAG_P2P
    v = view(
        [
            summary(0, {0: 9, 1: 36}, [(0, "all_reduce", 9, 12, 0, -1)], idle_s=12),
            summary(1, {0: 9, 1: 36}, [(0, "all_gather", 9, 12, 0, -1)], idle_s=12),
            summary(2, {0: 9, 1: 37}, [(1, "recv", 37, 11, p2p, 0)], idle_s=11),
            summary(3, {0: 9, 1: 37}, [(1, "recv", 37, 11, p2p, 1)], idle_s=11),
        ],
        tables,
    )
    verdicts = Analyzer(DiagnoserConfig(hang_min_s=3), interval_s=0.5).round(v)
    assert [(x.kind.value, x.ranks) for x in verdicts] == [("mismatch", [0, 1])]
    # Alone, the stuck DP pair is the communication hang, and still the only one.
    (h,) = find_hangs(v, lambda gid: 10.0, 1.0)
    assert (h.cause.value, h.ranks, h.group["ranks"]) == ("communication", [0, 1], [0, 1])


def test_a_member_that_left_short_of_a_collective_its_peers_wait_in_is_a_mismatch():
    # An unseen script (a hand-written TP1xPP2xDP2 pipeline under `ccld run`) whose rank 2
    # skipped one DP all-reduce: it ended its loop and left cleanly after 39 on [2, 3];
    # rank 3 waits in the 40th, which can never complete (gloo then raised and the job
    # ended). The pair ties; the sibling DP pair ran 40: rank 2 is short.
    dp01, dp23 = group("dp", [0, 1]), group("dp", [2, 3])
    tables = {0: [dp01], 1: [dp01], 2: [dp23], 3: [dp23]}
    done = dict(flags=FLAG_EXITED, hb_age_s=1)
    summaries = [
        summary(0, {0: 40}, **done),
        summary(1, {0: 40}, **done),
        summary(2, {0: 39}, **done),
        summary(3, {0: 40}, [(0, "all_reduce", 40, 2.0, 0, -1)], idle_s=2),
    ]
    v = view(summaries, tables)
    verdicts = Analyzer(DiagnoserConfig(hang_min_s=3), interval_s=0.5).round(v)
    assert [(x.kind.value, x.cause.value, x.ranks) for x in verdicts] == [
        ("mismatch", "software", [2])
    ]
    ev = facts(verdicts[0].evidence)
    assert ev["left_early"][0]["data"] == {
        "rank": 2,
        "entered": 39,
        "role": "dp",
        "members": [2, 3],
        "seq": 40,
    }
    assert ev["sibling_counts"][0]["data"]["reached"] == 1
    assert verdicts[0].group["ranks"] == [2, 3] and verdicts[0].op == "all_reduce"
    # Where the siblings do not tell (no sibling group), the job's other ranks do: still
    # running, rank 2 ended early; all gone the same way, rank 3 issued one more.
    alone = {2: [dp23], 3: [dp23]}
    running = [summary(r, {}, idle_s=0.1) for r in (0, 1)]
    (m,) = find_left_early(view([*running, *summaries[2:]], {**tables, **alone}), 1.0)
    assert m.ranks == [2] and facts(m.evidence)["job_went_on"][0]["data"]["running"] == 2
    gone = [summary(r, {}, flags=FLAG_EXITED) for r in (0, 1)]
    (m,) = find_left_early(view([*gone, *summaries[2:]], {**tables, **alone}), 1.0)
    assert m.ranks == [3]
    # Had the sibling pair ended at 39 too, rank 3 issued one more.
    ended = [
        dataclasses.replace(x, groups=[GroupProgress(0, 39, 39, 0, 0, 0, 0)]) for x in summaries[:2]
    ]
    (m,) = find_left_early(view([*ended, *summaries[2:]], tables), 1.0)
    assert m.ranks == [3]
    # One that left because an op of its raised (a peer died) left on that failure.
    failed = dataclasses.replace(summaries[2], flags=FLAG_EXITED | FLAG_ERRORED)
    assert find_left_early(view([*summaries[:2], failed, summaries[3]], tables), 1.0) == []
    # Not before the wait is min_wait_s old (a post-mortem's final view: at once).
    assert find_left_early(view(summaries, tables), 3.0) == []
    assert find_left_early(dataclasses.replace(view(summaries, tables), final=True), 3.0)


def test_a_transfer_whose_peer_left_cleanly_is_a_mismatch():
    # An unseen context-parallel script: rank 2 skipped one ring exchange of K/V blocks;
    # gloo paired the rest one off until rank 2 ended its loop and left, while rank 3
    # waited in its exchange with it (then raised), and rank 1 in the DP all-reduce rank
    # 3 never reached. No verdict from the boards: the left-early rule took collectives only.
    world, dp13 = group("world", range(4)), group("dp", [1, 3])
    tables = {0: [world], 1: [world, dp13], 2: [world], 3: [world, dp13]}
    send = FLAG_P2P | FLAG_SEND | FLAG_ASYNC
    summaries = [
        summary(0, {0: 300}, flags=FLAG_EXITED),
        summary(1, {0: 300, 1: 299}, [(1, "all_reduce", 300, 2.0, 0, -1)], idle_s=2),
        summary(2, {0: 300}, flags=FLAG_EXITED, hb_age_s=1),
        summary(3, {0: 300, 1: 299}, [(0, "isend", 1197, 2.0, send, 2)], idle_s=2),
    ]
    summaries[2] = dataclasses.replace(summaries[2], time_ns=NOW - S)  # its exit
    (m,) = find_left_early(view(summaries, tables), 1.0)
    assert (m.kind.value, m.ranks, m.op, m.group["role"]) == ("mismatch", [2], "isend", "world")
    ev = facts(m.evidence)
    assert ev["left_early"][0]["data"] == {"rank": 2, "waiting": 3, "op": "isend", "seq": 1197}
    assert ev["job_went_on"][0]["data"] == {"running": 1, "others": 2}
    # Rank 2 left short in a collective too (its DP pair with rank 0 waits): one finding.
    dp02 = group("dp", [0, 2])
    both = {**tables, 0: [world, dp02], 2: [world, dp02]}
    in_dp = summary(0, {0: 300, 1: 5}, [(1, "all_reduce", 5, 1.5, 0, -1)], idle_s=1.5)
    left = dataclasses.replace(summary(2, {0: 300, 1: 4}, flags=FLAG_EXITED), time_ns=NOW - S)
    (m,) = find_left_early(view([in_dp, summaries[1], left, summaries[3]], both), 1.0)
    assert m.ranks == [2] and m.op == "isend"  # told at the oldest wait
    assert [
        e["data"]["waiting" if "waiting" in e["data"] else "seq"]
        for e in facts(m.evidence)["left_early"]
    ] == [3, 5]
    # Every other rank gone the same way: rank 3 is the one that issued one more.
    summaries[1] = summary(1, {0: 300, 1: 300}, flags=FLAG_EXITED)
    (m,) = find_left_early(view(summaries, tables), 1.0)
    assert m.ranks == [3] and facts(m.evidence)["job_went_on"][0]["data"]["running"] == 0
    # A pair alone in its job: nothing tells; both named.
    (m,) = find_left_early(view(summaries[2:], {2: [world], 3: [world]}), 1.0)
    assert m.ranks == [2, 3] and "no_majority" in facts(m.evidence)
    # Live, a summary from before the peer left says nothing: its last send may be
    # what the rank waited for.
    summaries[3] = dataclasses.replace(summaries[3], time_ns=summaries[2].time_ns - 1)
    assert find_left_early(view(summaries, tables), 1.0) == []
    # ... nor in a diagnoser's last round on its way out (its own rank the one that left:
    # a pipeline's first stage ends while the last one's summary shows its last receive).
    last_round = dataclasses.replace(view(summaries, tables), final=True)
    assert find_left_early(last_round, 1.0) == []


def test_who_left_short_is_named_by_the_groups_majority():
    dp = group("dp", [0, 1, 2, 3])
    tables = {r: [dp] for r in range(4)}
    left = dict(flags=FLAG_EXITED, hb_age_s=1)

    def waits(r):
        return summary(r, {0: 40}, [(0, "all_reduce", 40, 2.0, 0, -1)], idle_s=2)

    # one left after 39, three wait in the 40th: the one is short
    (m,) = find_left_early(
        view([waits(0), summary(1, {0: 39}, **left), waits(2), waits(3)], tables), 1.0
    )
    assert m.ranks == [1]
    # three left after 39, one waits in a 40th: it issued one more
    v = view([summary(r, {0: 39}, **left) for r in range(3)] + [waits(3)], tables)
    assert find_left_early(v, 1.0)[0].ranks == [3]
    # one left, one waits, two still on their way (computing before the 40th): not yet
    on_way = [summary(r, {0: 39}, idle_s=0.5) for r in (2, 3)]
    assert (
        find_left_early(view([waits(0), summary(1, {0: 39}, **left), *on_way], tables), 1.0) == []
    )
    # nobody left: nothing here (a hang, the wait-for graph's)
    assert find_left_early(view([waits(0), *on_way, waits(1)], tables), 1.0) == []


def test_a_crashed_rank_is_named_with_its_exception_and_its_fallout_is_not():
    # Rank 2 left on an uncaught exception 2.5 s ago. Rank 1's op raised when rank 2's
    # connections closed (it left on that), rank 0 waits in the all-reduce rank 2 never
    # entered, and the launcher ended rank 3 (SIGTERM: gone, no exit path) while it ran.
    dp = group("dp", [0, 1, 2, 3])
    tables = {r: [dp] for r in range(4)}
    raised_in = ["train.py:10 in main", "model.py:5 in forward", "MemoryError: out of memory"]
    at = NOW - int(2.5 * S)
    crashed = summary(2, {0: 7}, flags=FLAG_EXITED | FLAG_CRASHED)
    crashed = dataclasses.replace(crashed, time_ns=at, heartbeat_ns=at, stack=raised_in)
    fallout = summary(1, {0: 8}, flags=FLAG_EXITED | FLAG_CRASHED | FLAG_ERRORED, hb_age_s=2)
    waits = summary(0, {0: 8}, [(0, "all_reduce", 8, 5.0, 0, -1)], idle_s=5)
    ended = summary(3, {0: 7}, hb_age_s=2)
    cfg = DiagnoserConfig(hang_min_s=3)
    verdicts = Analyzer(cfg, interval_s=0.5).round(
        view([waits, fallout, crashed, ended], tables, gone=[3])
    )
    assert [(x.kind.value, x.cause.value, x.ranks) for x in verdicts] == [
        ("crash", "software", [2])
    ]
    (ev,) = facts(verdicts[0].evidence)["exception"]
    assert ev["data"] == {
        "exception": "MemoryError: out of memory",
        "where": "model.py:5 in forward",
    }
    assert verdicts[0].stack == raised_in and verdicts[0].step == 5
    # A rank gone well before the crash (its heartbeat 10 s old) went on its own.
    earlier = summary(3, {0: 7}, hb_age_s=10)
    verdicts = Analyzer(cfg, interval_s=0.5).round(
        view([waits, fallout, crashed, earlier], tables, gone=[3])
    )
    assert sorted((x.kind.value, x.ranks) for x in verdicts) == [
        ("crash", [2]),
        ("unresponsive", [3]),
    ]


def test_ranks_that_crashed_with_one_exception_are_one_finding():
    dp = group("dp", [0, 1, 2])
    oom = ["train.py:10 in main", "MemoryError: out of memory"]
    bug = ["train.py:12 in main", "KeyError: 'labels'"]
    left = dict(flags=FLAG_EXITED | FLAG_CRASHED)
    v = view(
        [
            dataclasses.replace(summary(r, {0: 7}, **left), stack=stack)
            for r, stack in ((0, oom), (1, bug), (2, oom))
        ],
        {r: [dp] for r in range(3)},
    )
    got = sorted((x.ranks, x.evidence[0].data["exception"]) for x in find_crashes(v, 1.0))
    assert got == [([0, 2], "MemoryError: out of memory"), ([1], "KeyError: 'labels'")]


def test_a_collective_that_raised_on_its_caller_alone_is_that_ranks_crash():
    # An unseen MoE script: rank 2 called all_to_all_single with splits that do not add
    # up; gloo raised on rank 2 alone, and its peers' ops raised when its connections
    # closed. Every rank left on an exception out of an op: none was named, live or from
    # the boards. The first to raise, on an error that is not a peer's, is the crash.
    ep, world = group("ep", [2, 3]), group("world", [0, 1, 2, 3])
    tables = {r: [world, ep] for r in range(4)}
    left = FLAG_EXITED | FLAG_CRASHED | FLAG_ERRORED
    call = ["train.py:43 in main", "/venv/site-packages/torch/distributed/c10d.py:5140 in a2a"]
    own = [*call, "RuntimeError: [enforce fail at alltoallv.cc:138] inLength == outLength."]
    lost = [*call, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:8631."]

    def crashed(rank, stack, age_s):
        at = NOW - int(age_s * S)
        s = summary(rank, {0: 8, 1: 40}, [(1, "all_to_all_single", 40, age_s, 0, -1)], flags=left)
        return dataclasses.replace(s, time_ns=at, heartbeat_ns=at, stack=stack)

    ranks = [crashed(2, own, 1.0), crashed(3, lost, 0.9), crashed(0, lost, 0.8)]
    ranks.append(summary(1, {0: 8}, hb_age_s=0.8))  # ended by the launcher: gone
    cfg = DiagnoserConfig(hang_min_s=3)
    verdicts = Analyzer(cfg, interval_s=0.5).round(view(ranks, tables, gone=[1]))
    assert [(x.kind.value, x.cause.value, x.ranks) for x in verdicts] == [
        ("crash", "software", [2])
    ]
    (ev,) = facts(verdicts[0].evidence)["exception"]
    assert ev["data"]["where"] == "train.py:43 in main"  # the call, not torch's frame
    # Its call was another collective than its peer's at that seq (a gather with an
    # output of the wrong size, among all-reduces): the crash, not also a mismatch.
    misuse = dataclasses.replace(
        ranks[0], in_flight=[ranks[0].in_flight[0]._replace(op=OP_CODES["all_gather_into_tensor"])]
    )
    peer = summary(3, {0: 8, 1: 40}, [(1, "all_reduce", 40, 1.0, 0, -1)], idle_s=1.0)
    verdicts = Analyzer(cfg, interval_s=0.5).round(
        view([misuse, peer, ranks[2], ranks[3]], tables, gone=[1])
    )
    assert [(x.kind.value, x.ranks) for x in verdicts] == [("crash", [2])]
    # The first to raise did so on a lost connection: a peer's failure, not named.
    first_lost = [crashed(3, lost, 1.0), crashed(2, lost, 0.9), crashed(0, lost, 0.8)]
    assert find_crashes(view(first_lost, tables), 1.0) == []
    # A rank seen gone well before it (killed): its death came first.
    early = [*ranks[:3], summary(1, {0: 8}, hb_age_s=5)]
    assert find_crashes(view(early, tables, gone=[1]), 1.0) == []


def test_the_exception_a_rank_leaves_on_is_recorded_but_not_an_interrupt():
    def raise_oom():
        raise MemoryError("CUDA out of memory.\n  Tried to allocate 2.0 GiB")

    try:
        raise_oom()
    except MemoryError as exc:
        record = crash_record(MemoryError, exc, exc.__traceback__)
    assert record[-1] == "MemoryError: CUDA out of memory. Tried to allocate 2.0 GiB"
    assert record[-2].endswith("in raise_oom") and "test_diagnose_hangs.py" in record[-2]
    assert crash_record(KeyboardInterrupt, KeyboardInterrupt(), None) == []
    # the summary carries it, and says the rank crashed
    s = dataclasses.replace(summary(0, {}, flags=FLAG_EXITED | FLAG_CRASHED), stack=record)
    assert decode_summary(encode_summary(s)).stack == record


def test_unresponsive_by_heartbeat_or_gone_process_but_not_after_a_clean_exit():
    dp = group("dp", [0, 1, 2])
    tables = {r: [dp] for r in range(3)}
    v = view(
        [
            summary(0, {0: 1}),
            summary(1, {0: 1}, hb_age_s=30),
            summary(2, {0: 1}, flags=FLAG_EXITED, hb_age_s=60),
        ],
        tables,
        gone=[2],
    )
    assert [u.ranks for u in find_unresponsive(v, 10.0)] == [[1]]
    # gone, and its node's leader has told its board's last state (see below)
    dead = summary(1, {0: 1}, hb_age_s=0.5, flags=FLAG_LAST_WORDS)
    v = view([summary(0, {0: 1}), dead], tables, gone=[1])
    (u,) = find_unresponsive(v, 10.0)
    assert u.ranks == [1] and u.evidence[0].fact == "process_gone"
    assert u.evidence[0].data == {"pid": 1001, "host": "h"}


def test_a_dead_ranks_verdict_waits_for_its_nodes_last_word():
    # Rank 1's process is gone; its agent last reported at T0 (an interval is 1 s). At a
    # tick after its death its node's leader brings the step and op its board kept then
    # (agent.node_share, flagged FLAG_LAST_WORDS); until that comes its verdict waits, at
    # most LAST_WORDS_TICKS intervals. Rank 0's report of a later tick does not end the
    # wait: it may predate the death.
    dp = group("dp", [0, 1])
    tables = {0: [dp], 1: [dp]}
    t0 = NOW - 5 * S

    def at(rank, t, flags=0):
        return dataclasses.replace(summary(rank, {0: 1}, flags=flags), time_ns=t, heartbeat_ns=t)

    def judged(dead, now, final=False):
        v = job_view([at(0, now), dead], tables, now_ns=now, gone={1})
        v.final = final
        return [u.ranks for u in find_unresponsive(v, 10.0)]

    assert judged(at(1, t0), t0 + S // 3) == []
    assert judged(at(1, t0), t0 + 2 * S) == []  # rank 0 reported since: no matter
    assert judged(at(1, t0, FLAG_LAST_WORDS), t0 + S + S // 10) == [[1]]  # its word came
    assert judged(at(1, t0), t0 + LAST_WORDS_TICKS * S) == [[1]]  # waited long enough
    assert judged(at(1, t0), t0 + S // 3, final=True) == [[1]]  # a post-mortem: no more
    # Alone on its host (one container per GPU): nobody can bring its word, no wait.
    alone = dataclasses.replace(at(1, t0), host="h1")
    assert judged(alone, t0 + S // 3) == [[1]]
    # A node-mate that left through the exit path may have brought it on its way out
    # (its peers fail at once when a rank dies): the wait stands.
    left = dataclasses.replace(at(0, t0 + S // 3), flags=FLAG_EXITED)
    v = job_view([left, at(1, t0)], tables, now_ns=t0 + S // 3, gone={1})
    assert find_unresponsive(v, 10.0) == []


def test_summary_round_trip_and_size_budget():
    s = summary(3, {0: 40, 1: 50, 2: 60}, [(1, "recv", 4, 1, FLAG_P2P, 2)])
    # Times in whole microseconds: the encoding keeps them relative, at that resolution.
    s.steps = [StepStat(i, NOW - 1000 * i, 50_000, 30_000, 4_000 + i) for i in range(20)]
    s.samples = [
        ArrivalSample(slot, 4 * k, NOW - 3000 * k, 1500, 65536)
        for slot in range(3)
        for k in range(8)
    ]
    s.stack = ["train.py:10 in main", "model.py:20 in forward"]
    data = encode_summary(s)
    back = decode_summary(data)
    assert arrival_samples(back) == s.samples and len(back.sample_rows) == 24 * 18
    assert dataclasses.replace(back, sample_rows=b"", samples=s.samples) == s
    assert encode_summary(back) == data  # a decoded summary encodes to the same bytes
    # A steady-state tick: 3 groups, 20 steps, 24 arrival samples, no stack: under 1 KB.
    s.stack = []
    s.in_flight = []
    assert len(encode_summary(s)) <= 1024


def test_a_summary_of_version_1_is_read_as_this_version_without_a_wait_for_a_cpu():
    # Recordings made before steps carried their wait for a CPU replay still: their values
    # are re-encoded on reading, each step with no wait.
    from pathlib import Path

    from ccld_plugin.recording import read_recording
    from ccld_plugin.wire.summary import SUMMARY_VERSION, upgraded_summary

    path = Path(__file__).parent / "recorded" / "compute-slow-1.5x-rank1-step10-tp2pp2.rec"
    _, rounds = read_recording(path)
    *_, last = rounds
    values = last.values
    assert values and all(v[0] == SUMMARY_VERSION for v in values.values())
    steps = [t for v in values.values() for t in decode_summary(v).steps]
    assert steps and all(t.cpu_wait_us == 0 and t.compute_us <= t.step_us for t in steps)
    assert upgraded_summary(b"\x01 not a summary") == b"\x01 not a summary"  # refused later
