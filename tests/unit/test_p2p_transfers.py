"""Point-to-point samples on the wire, paired end to end (diagnose/links/p2p_transfers.py), and
the slow port or link their transfers show."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from builders import MS, group, job_view, rank_summary

from ccld_plugin.diagnose.links.p2p_transfers import (
    PAIRED_MAX_RANKS,
    PENDING_TTL_NS,
    P2PJoin,
    Transfers,
)
from ccld_plugin.diagnose.links.slow_messages import LoneConnection, p2p_cleared, slow_p2p_port
from ccld_plugin.diagnose.records import Cause, Kind
from ccld_plugin.diagnose.view import GroupIndex, JobView
from ccld_plugin.postmortem.replay import replay
from ccld_plugin.recording import RoundRecorder, read_recording
from ccld_plugin.wire.summary import (
    P2PSample,
    RankSummary,
    SummaryError,
    decode_summary,
    encode_summary,
    p2p_samples,
    upgraded_summary,
)
from ccld_plugin.wire.summary_batch import SummaryTable

PP = group("pp", [0, 1, 2, 3])
PP2 = group("pp", [0, 1])  # a two-stage pipeline: one connection
KB64 = 64 * 1024


def summary(rank: int, t: int, p2p: list[P2PSample]) -> RankSummary:
    return decode_summary(encode_summary(rank_summary(rank, t, pid=1, p2p=p2p)))


def view(summaries: list[RankSummary], now: int) -> JobView:
    return job_view(summaries, {r: [PP] for r in range(4)}, now, world=4)


def test_p2p_samples_travel_after_the_channels_and_older_values_still_decode() -> None:
    t = 1000 * MS
    sent = [P2PSample(0, 3, True, 7, t - 5 * MS, 1200, KB64), P2PSample(0, 1, False, 9, t, 3, 8)]
    s = rank_summary(2, t, pid=1, p2p=sent, channels=b"\x01\x00\x00\x00\x00\x00\x00")
    back = decode_summary(encode_summary(s))
    assert p2p_samples(back) == sent and back.channels == s.channels
    table, bad = SummaryTable.decode({2: encode_summary(s)})
    assert not bad and table.p2p["peer"].tolist() == [3, 1] and table.p2p_rows.tolist() == [0, 0]
    assert table[2].channels == s.channels  # the channel span stops where the samples start
    # a version-2 value (a recording made before) has none, and is upgraded as it is
    old = bytearray(encode_summary(rank_summary(2, t, pid=1)))
    old[0] = 2
    assert decode_summary(bytes(old)).p2p_rows == b""
    assert decode_summary(upgraded_summary(bytes(old))).rank == 2


def test_impossible_p2p_samples_are_refused_by_both_decoders_alike() -> None:
    t = 1000 * MS
    good = encode_summary(rank_summary(2, t, pid=1, p2p=[P2PSample(0, 3, True, 7, t, 1, 1)]))
    row = struct.calcsize("<HiBIiII")
    for bad in (
        good[:-row] + struct.pack("<HiBIiII", 0, -1, 1, 7, 0, 1, 1),  # no peer
        good[:-row] + struct.pack("<HiBIiII", 0, 3, 2, 7, 0, 1, 1),  # no direction
        good[:-1],  # a part of a row
    ):
        with pytest.raises(SummaryError) as one:
            decode_summary(bad)
        _, why = SummaryTable.decode({2: bad})
        assert why[2] == str(one.value)


def test_the_two_ends_of_a_message_pair_across_rounds_and_lone_ends_expire() -> None:
    j = P2PJoin(GroupIndex())
    t = 1000 * MS
    first = [
        # rank 1 sent seq 4 to 2 at t-20 ms; rank 2 posted its receive before, at t-30 ms
        summary(1, t, [P2PSample(0, 2, True, 4, t - 20 * MS, 100, KB64)]),
        summary(0, t, [P2PSample(0, 1, True, 1, t - 9 * MS, 100, KB64)]),  # 1 never tells
    ]
    assert len(j.add(view(first, t), SummaryTable.of({s.rank: s for s in first})).src) == 0
    t2 = t + 500 * MS
    second = [summary(2, t2, [P2PSample(0, 1, False, 4, t - 30 * MS, 22_000, KB64)])]
    got = j.add(view(second, t2), SummaryTable.of({2: second[0]}))
    assert (got.src.tolist(), got.dst.tolist(), got.seq.tolist()) == ([1], [2], [4])
    # from the later entry (the send's) to the receive's exit (t-30 ms + 22 ms)
    assert got.transfer_ns.tolist() == [12 * MS] and got.bytes.tolist() == [KB64]
    later = t + PENDING_TTL_NS + 1
    assert len(j.add(view([], later), SummaryTable.of({})).src) == 0  # a round goes by
    late = [summary(1, later, [P2PSample(0, 0, False, 1, t - 9 * MS, 50, KB64)])]
    assert len(j.add(view(late, later), SummaryTable.of({1: late[0]})).src) == 0


def test_ends_repeated_by_the_next_summary_pair_once() -> None:
    # Each summary repeats its previous tick's samples: a message paired already is not
    # paired again when both ends come back.
    j = P2PJoin(GroupIndex())
    t, t2 = 1000 * MS, 2000 * MS

    def ends(now: int, seqs: list[int]) -> SummaryTable:
        rows = [
            summary(1, now, [P2PSample(0, 2, True, q, t - (20 - q) * MS, 100, KB64) for q in seqs]),
            summary(
                2, now, [P2PSample(0, 1, False, q, t - (21 - q) * MS, 900, KB64) for q in seqs]
            ),
        ]
        return SummaryTable.of({s.rank: s for s in rows})

    assert j.add(view([], t), ends(t, [4])).seq.tolist() == [4]
    assert j.add(view([], t2), ends(t2, [4, 5])).seq.tolist() == [5]


def pipeline(ms: dict[tuple[int, int], float], n: int = 8, window_ns: int = 2000 * MS) -> Transfers:
    """``n`` messages of 64 KB on each directed link of ``ms`` (its transfer time, ms),
    spread over the window, each a little off its link's time."""
    rng = np.random.default_rng(3)
    rows = [
        (a, b, 0, q + 1, (q + 1) * window_ns // (n + 1), int(v * MS * rng.uniform(0.8, 1.25)))
        for (a, b), v in ms.items()
        for q in range(n)
    ]
    cols = list(zip(*rows, strict=True))
    return Transfers(*(np.array(c, np.int64) for c in cols), np.full(len(rows), KB64, np.int64))


def both_ways(ms: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    return {**ms, **{(b, a): v for (a, b), v in ms.items()}}


def judge(ms: dict[tuple[int, int], float], exclude: frozenset[int] = frozenset()):
    return slow_p2p_port(pipeline(both_ways(ms)), [PP], 0, 2000 * MS, exclude)


def test_a_slow_port_in_a_lone_pipeline_names_its_rank_with_each_of_its_links() -> None:
    found = judge({(0, 1): 0.8, (1, 2): 14.0, (2, 3): 12.0})
    assert found is not None and found.ranks == [2] and found.link is None
    assert found.group == PP and found.severity >= 8
    assert {(e.data["a"], e.data["b"]) for e in found.evidence} == {(1, 2), (2, 3)}


def test_the_ranks_clock_offset_cancels_out_there_and_back() -> None:
    # Stage 2's clock reads 6 ms behind the others': its receives seem to end 6 ms early
    # (a healthy link from 1 reads -5 ms), its sends' transfers 6 ms late (7 ms).
    skewed = {(0, 1): 1.0, (1, 0): 1.0, (1, 2): -5.0, (2, 1): 7.0, (2, 3): 7.0, (3, 2): -5.0}
    assert slow_p2p_port(pipeline(skewed), [PP], 0, 2000 * MS, frozenset()) is None
    slow = {**skewed, (1, 2): 9.0, (2, 1): 21.0, (2, 3): 21.0, (3, 2): 9.0}  # +14 ms each
    found = slow_p2p_port(pipeline(slow), [PP], 0, 2000 * MS, frozenset())
    assert found is not None and (found.ranks, found.link) == ([2], None)
    assert all(25 <= e.data["ms"] <= 38 for e in found.evidence)  # 30 ms, give or take noise


def test_one_slow_connection_names_the_link_and_an_end_stage_port_is_its_one_link() -> None:
    found = judge({(0, 1): 0.8, (1, 2): 14.0, (2, 3): 1.0})
    assert found is not None and (found.ranks, found.link) == ([1, 2], [1, 2])
    # the last stage has one connection: its port cannot be told from that link
    found = judge({(0, 1): 0.8, (1, 2): 1.2, (2, 3): 15.0})
    assert found is not None and found.link == [2, 3]


def test_healthy_and_cheap_or_explained_transfers_name_nothing() -> None:
    assert judge({(0, 1): 0.5, (1, 2): 1.5, (2, 3): 1.0}) is None  # host noise: 3x apart
    # 8-9 ms there and back: under 10 ms, a busy host holds messages back that long
    port = {(0, 1): 0.3, (1, 2): 4.0, (2, 3): 4.5}
    held = Transfers.concat(
        [pipeline(both_ways(port), n=5), pipeline(both_ways({(1, 2): 0.3, (2, 3): 0.3}), n=3)]
    )
    assert slow_p2p_port(held, [PP], 0, 2000 * MS, frozenset()) is None
    # ... unless every message is slow, from 5 ms there and back (a rank's port at 100
    # Mbit/s); not where an end waited for a CPU (a crowded host delays every message)
    steady = slow_p2p_port(pipeline(both_ways(port)), [PP], 0, 2000 * MS, frozenset())
    assert steady is not None and (steady.ranks, steady.link) == ([2], None)
    t = pipeline(both_ways(port))
    assert slow_p2p_port(t, [PP], 0, 2000 * MS, frozenset(), queued=frozenset({2})) is None
    assert judge({(0, 1): 0.3, (1, 2): 2.0, (2, 3): 2.2}) is None  # 4 ms: under 5
    # a straggler drains its links late: not judged
    assert judge({(0, 1): 0.8, (1, 2): 14.0, (2, 3): 12.0}, frozenset({2})) is None
    # one message a window at 5 ms costs the job nothing
    t = pipeline(both_ways({(0, 1): 0.8, (1, 2): 5.0, (2, 3): 5.0}), n=3, window_ns=4000 * MS)
    assert slow_p2p_port(t, [PP], 0, 4000 * MS, frozenset()) is None


def test_sibling_pipelines_messages_are_paired_in_small_jobs_only() -> None:
    a, b = group("pp", [0, 2]), group("pp", [1, 3])  # two pipelines
    t = 1000 * MS
    ends = [
        summary(0, t, [P2PSample(0, 2, True, 4, t - 20 * MS, 100, KB64)]),
        summary(2, t, [P2PSample(0, 0, False, 4, t - 30 * MS, 22_000, KB64)]),
    ]
    table = SummaryTable.of({s.rank: s for s in ends})
    groups = {0: [a], 2: [a], 1: [b], 3: [b]}
    small = job_view(ends, groups, t, world=4)
    j = P2PJoin(GroupIndex())
    paired = j.add(small, table)
    assert paired.src.tolist() == [0] and not j.one_pipeline(small, paired)
    # a large job has siblings for every group: there the channel evidence judges them
    large = job_view(ends, groups, t, world=PAIRED_MAX_RANKS + 1)
    assert len(P2PJoin(GroupIndex()).add(large, table).src) == 0
    alone = job_view(ends, {0: [a], 2: [a]}, t, world=PAIRED_MAX_RANKS + 1)
    j = P2PJoin(GroupIndex())
    paired = j.add(alone, table)
    assert len(paired.src) == 1 and j.one_pipeline(alone, paired)


def test_a_slow_connection_among_sibling_pipelines_is_named_held_back_messages_are_not() -> None:
    # TP2xPP2: pipelines 0-2 and 1-3, each the other's reference
    two = [group("pp", [0, 2])]
    found = slow_p2p_port(
        pipeline(both_ways({(0, 2): 0.8, (1, 3): 14.0})), two, 0, 2000 * MS, frozenset()
    )
    assert found is not None and (found.ranks, found.link) == ([1, 3], [1, 3])
    # five of eight messages held back by a busy host: slow by the median, not by the low
    # quartile (a slow link holds back every one)
    held = Transfers.concat(
        [
            pipeline(both_ways({(0, 2): 0.8, (1, 3): 14.0}), n=5),
            pipeline(both_ways({(1, 3): 0.8}), n=3),
        ]
    )
    assert slow_p2p_port(held, two, 0, 2000 * MS, frozenset()) is None


RECORDED = Path(__file__).parent / "recorded"


def test_recorded_lone_pipelines_name_the_slow_port_and_the_slow_link() -> None:
    # torch TP1xPP4 demos in closed networks, 30 Mbit/s from step 8: rank 2's port, then
    # the connection between stages 1 and 2 alone
    _, got = replay(RECORDED / "comm-slow-30mbit-rank2-step8-tp1pp4.rec")
    (v,) = got
    assert (v.kind, v.cause, v.ranks, v.link) == (Kind.SLOW, Cause.COMMUNICATION, [2], None)
    _, got = replay(RECORDED / "comm-slow-30mbit-link1-2-step8-tp1pp4.rec")
    (v,) = got
    assert (v.kind, v.cause, v.ranks, v.link) == (Kind.SLOW, Cause.COMMUNICATION, [1, 2], [1, 2])


def test_the_middle_stage_port_of_a_three_stage_pipeline_is_named_by_its_links_past() -> None:
    # torch TP1xPP3 demo in a closed network, rank 1's port at 30 Mbit/s from step 10:
    # both connections go through rank 1, so neither is a reference for the other; each
    # against its own earlier windows (29 ms there and back, from under 2)
    _, got = replay(RECORDED / "comm-slow-30mbit-rank1-step10-tp1pp3.rec")
    (v,) = got
    assert (v.kind, v.cause, v.ranks, v.link) == (Kind.SLOW, Cause.COMMUNICATION, [1], None)
    assert {(e.data["a"], e.data["b"]) for e in v.evidence if e.fact == "p2p_transfer"} == {
        (0, 1),
        (1, 2),
    }


def test_a_lone_pipelines_links_slow_from_step_3_have_steps_1_2_for_past() -> None:
    # The demo's default onset (`--fault comm-slow@1:rate=30mbit`): the job's first link
    # window (steps 1-5) is half slow, and before steps 1-2 joined the past, a two-stage
    # pipeline's link and a three-stage one's middle port had no healthy window to be
    # judged against: no verdict.
    _, got = replay(RECORDED / "comm-slow-30mbit-rank1-step3-tp1pp2-2ranks.rec")
    assert [(v.kind, v.cause, v.ranks, v.link) for v in got] == [
        (Kind.SLOW, Cause.COMMUNICATION, [0, 1], [0, 1])
    ]
    _, got = replay(RECORDED / "comm-slow-30mbit-rank1-step3-tp1pp3.rec")
    assert [(v.kind, v.cause, v.ranks, v.link) for v in got] == [
        (Kind.SLOW, Cause.COMMUNICATION, [1], None)
    ]
    assert all(v.step is not None and v.step <= 25 for v in got)


def test_a_window_that_lost_some_links_samples_clears_only_the_ranks_it_measured() -> None:
    # Rank 2's two connections slow, the pipeline's third not measured this window (its
    # samples came late): no port can be told, nor a link, and rank 2 is not cleared.
    # Rank 2's connection to 1 alone: neither its port nor the link.
    window = (0, 2000 * MS)
    past = pipeline(both_ways({(0, 1): 0.8, (1, 2): 0.6, (2, 3): 0.7}))
    past = past._replace(time_ns=past.time_ns - window[1])  # the window before: every link

    def now(ms: dict[tuple[int, int], float], groups=(PP,)) -> tuple:
        t = Transfers.concat([past, pipeline(both_ways(ms))])
        found = slow_p2p_port(t, list(groups), *window, frozenset(), LoneConnection())
        return found, set(p2p_cleared(t, list(groups), *window, True))

    assert now({(1, 2): 14.0, (2, 3): 12.0}) == (None, set())
    assert now({(0, 1): 0.8, (1, 2): 14.0}) == (None, {0})
    found, cleared = now({(0, 1): 0.8, (1, 2): 14.0, (2, 3): 0.5})
    assert (found.ranks, found.link, cleared) == ([1, 2], [1, 2], {0, 3})
    assert now({(0, 1): 0.8, (1, 2): 0.6})[1] == {0, 1}  # 2's link to 3 not seen
    assert now({(0, 1): 0.8, (1, 2): 0.6, (2, 3): 0.5}) == (None, {0, 1, 2, 3})
    # a two-stage pipeline's one connection, judged against its own past; one of sibling
    # pipelines is not judged alone, and slow clears nothing
    one = pipeline(both_ways({(0, 1): 12.0}))
    assert p2p_cleared(one, [PP2], *window, one_pipeline=True) == {0, 1}
    assert p2p_cleared(one, [PP2], *window, one_pipeline=False) == frozenset()
    assert p2p_cleared(Transfers.empty(), [PP], *window, one_pipeline=True) == frozenset()


def _with_late_summaries(src: Path, dst: Path, share: float, seed: int) -> Path:
    """``src`` again, each rank's summary left out of a round with chance ``share`` (as
    when its agent lags the diagnoser's round: it reaches a later round, or a newer
    summary replaces it)."""
    config, rounds = read_recording(src)
    rng = np.random.default_rng(seed)
    out = RoundRecorder(dst, config)
    seen: dict[int, bytes] = {}
    for r in rounds:
        late = {k for k in r.values if rng.random() < share}
        r.values = {
            k: (seen[k] if k in late else v)
            for k, v in r.values.items()
            if k in seen or k not in late
        }
        seen.update(r.values)
        out.write(r)
    out.close()
    return dst


def test_a_lone_pipelines_slow_port_is_named_when_a_third_of_the_summaries_come_late(
    tmp_path: Path,
) -> None:
    # Windows lose the samples of a connection (the port's reference, or its own): they
    # hold the streak; a window whose channel evidence could not be judged leaves the
    # transfers to judge it.
    for seed in range(8):
        rec = _with_late_summaries(
            RECORDED / "comm-slow-30mbit-rank2-step8-tp1pp4.rec",
            tmp_path / f"{seed}.rec",
            0.3,
            seed,
        )
        _, got = replay(rec)
        assert [(v.kind, v.cause, v.ranks, v.link) for v in got] == [
            (Kind.SLOW, Cause.COMMUNICATION, [2], None)
        ], seed


def test_a_connection_whose_every_message_is_slow_needs_a_lower_ratio_and_is_not_cleared() -> None:
    two = [group("pp", [0, 2])]
    window = (0, 1000 * MS)
    ms = both_ways({(0, 2): 0.7, (1, 3): 4.0})  # 8 ms there and back: ~6x the other

    def transfers(n: int = 8, fast: float | None = None) -> Transfers:
        now = ms if fast is None else {**ms, (1, 3): fast, (3, 1): fast}
        return pipeline(now, n=n, window_ns=window[1])

    found = slow_p2p_port(transfers(), two, *window, frozenset())
    assert found is not None and found.link == [1, 3] and found.severity < 8
    assert p2p_cleared(transfers(), two, *window, one_pipeline=False) == {0, 2}
    # held back: three of eight messages fast; then not slow, and cleared
    held = Transfers.concat([transfers(5), transfers(3, fast=0.7)])
    assert slow_p2p_port(held, two, *window, frozenset()) is None
    assert p2p_cleared(held, two, *window, one_pipeline=False) == {0, 1, 2, 3}


def test_recorded_sibling_pipelines_name_a_slow_connection_and_a_slow_port() -> None:
    # torch TP2xPP2 demos in closed networks (the channels read a pipeline connection
    # shaped to 30 Mbit/s at 1.9x its sibling, under their ratio): one connection from
    # step 3 (`comm-slow@1:rate=30mbit,peer=3`), by its messages, both ends' other links
    # healthy; rank 1's port at 100 Mbit/s, its pipeline connection by its messages and
    # its TP link by the channels; rank 3's, its TP link found by the channels alone
    # (one connection: 2<->3) and its pipeline connection by its messages in one window
    cases = {
        "comm-slow-30mbit-link1-3-step3-tp2pp2.rec": ([1, 3], [1, 3], "pp"),
        "comm-slow-100mbit-rank1-step10-tp2pp2.rec": ([1], None, "pp"),
        "comm-slow-100mbit-rank3-step12-tp2pp2.rec": ([3], None, "tp"),
        # rank 0's (the diagnoser's) port: its connection 10-11 ms there and back, every
        # message alike, against a sibling whose 1-2 ms made it 4-11x: a window under the
        # ratio in between neither clears it nor restarts its wait for the channels
        "comm-slow-100mbit-rank0-step10-tp2pp2.rec": ([0], None, "pp"),
    }
    for name, (ranks, link, role) in cases.items():
        _, got = replay(RECORDED / name)
        (v,) = got
        assert (v.kind, v.cause, v.ranks, v.link) == (Kind.SLOW, Cause.COMMUNICATION, ranks, link)
        assert v.group is not None and v.group["role"] == role
        kinds = {e.fact for e in v.evidence}
        assert "p2p_transfer" in kinds and (link is not None or "link_slow" in kinds), name
        # a link: both ends' other links healthy by the channels; a port: no such line
        assert ("one_link" in kinds) == (link is not None), name


def test_a_recorded_lone_pipelines_port_at_100_mbit_is_named_by_its_steady_messages() -> None:
    # `ccld demo --tp 1 --pp 4 --fault comm-slow@2:rate=100mbit,step=11`: rank 2's two
    # connections 5.8 ms there and back, every message alike, under the 10 ms a few held
    # back messages would need
    _, got = replay(RECORDED / "comm-slow-100mbit-rank2-step11-tp1pp4.rec")
    (v,) = got
    assert (v.kind, v.cause, v.ranks, v.link) == (Kind.SLOW, Cause.COMMUNICATION, [2], None)
    assert {(e.data["a"], e.data["b"]) for e in v.evidence} == {(1, 2), (2, 3)}


def test_a_recorded_two_stage_pipeline_at_100_mbit_names_its_link() -> None:
    # `ccld demo --world 2 --tp 1 --pp 2 --fault comm-slow@1:rate=100mbit,step=10` on a
    # quiet host: 6.8 ms there and back in every window (0.4 before), every message alike;
    # the job's step 30 -> 53 ms. Its windows take turns at having enough samples.
    _, got = replay(RECORDED / "comm-slow-100mbit-rank1-step10-tp1pp2-2ranks.rec")
    (v,) = got
    assert (v.kind, v.cause, v.ranks, v.link) == (Kind.SLOW, Cause.COMMUNICATION, [0, 1], [0, 1])
    assert "its own past" in v.evidence[0].text


def test_a_two_stage_pipelines_one_connection_is_judged_against_its_own_past() -> None:
    lone = LoneConnection()
    window = 2000 * MS

    def judged(ms: float, k: int) -> object:
        t = pipeline(both_ways({(0, 1): ms}), window_ns=window)
        t = t._replace(time_ns=t.time_ns + k * window)
        return slow_p2p_port(t, [PP2], k * window, (k + 1) * window, frozenset(), lone)

    # healthy windows, then the connection at 30x; no history yet: no judgement
    assert [judged(0.6 if k % 2 else 0.4, k) for k in range(4)] == [None] * 4
    found = judged(15.0, 4)
    assert found is not None and (found.ranks, found.link) == ([0, 1], [0, 1])
    assert "its own past" in found.evidence[0].text
    # a busy host's few ms there and back are not a slow link
    assert judged(3.0, 5) is None


def one_connection(there_ms: list[float], back_ms: list[float], k: int, window_ns: int):
    """Transfers of the connection 0<->1 in window ``k``, one per time given (64 KB)."""
    rows = [
        (a, b, 0, q + 1, k * window_ns + (q + 1) * window_ns // (len(ms) + 1), int(v * MS))
        for a, b, ms in ((0, 1, there_ms), (1, 0, back_ms))
        for q, v in enumerate(ms)
    ]
    cols = list(zip(*rows, strict=True))
    return Transfers(*(np.array(c, np.int64) for c in cols), np.full(len(rows), KB64, np.int64))


def test_a_connection_slow_in_every_transfer_is_named_under_10_ms_held_back_ones_are_not() -> None:
    # 100 Mbit/s: every 64 KB message 3.4 ms one way; a busy host: some held back longer,
    # the medians higher, the low quartiles near the healthy past.
    window = 400 * MS

    def judged(lone: LoneConnection, there: list[float], back: list[float], k: int, q=()):
        t = one_connection(there, back, k, window)
        w = (k * window, (k + 1) * window)
        return slow_p2p_port(t, [PP2], *w, frozenset(), lone, queued=frozenset(q))

    healthy = [0.2, 0.3, 0.2, 0.3, 0.2, 0.3, 0.2, 0.3]
    steady, held, crowded = LoneConnection(), LoneConnection(), LoneConnection()
    for k in range(3):
        for lone in (steady, held, crowded):
            assert judged(lone, healthy, healthy, k) is None
    found = judged(steady, [3.4] * 8, [3.3] * 8, 3)
    assert found is not None and found.link == [0, 1]
    busy = [0.3, 0.2, 6.0, 0.3, 5.0, 4.5, 4.0, 5.5]  # median 4.25 each way: 8.5 ms
    assert judged(held, busy, busy, 3) is None
    # where an end queues for a CPU, every message a little late is its host's doing:
    # under 10 ms there and back, no verdict; at 30 Mbit/s' 30 ms, one
    assert judged(crowded, [3.4] * 8, [3.3] * 8, 3, q=[1]) is None
    found = judged(crowded, [15.0] * 8, [15.0] * 8, 4, q=[1])
    assert found is not None and found.link == [0, 1]


def test_a_slow_connection_is_named_after_one_healthy_window_read_on_a_busy_host() -> None:
    # An onset early in a fast job leaves one healthy window: here 4 ms there and back
    # (a busy host), then a window half slow, then 30 ms.
    lone = LoneConnection()
    window = 2000 * MS
    found = []
    for k, ms in enumerate([2.0, 8.0, 15.0, 15.0]):
        t = pipeline(both_ways({(0, 1): ms}), window_ns=window)
        t = t._replace(time_ns=t.time_ns + k * window)
        found.append(slow_p2p_port(t, [PP2], k * window, (k + 1) * window, frozenset(), lone))
    assert found[:2] == [None, None]
    assert all(f is not None and f.link == [0, 1] for f in found[2:]), found
