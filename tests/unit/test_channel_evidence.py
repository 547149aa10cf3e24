"""Channel evidence: the summary codec, the diagnoser's reading of stalled and slow
connections, and slow links over windows: on synthetic views."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from builders import S, facts, group, job_view, peer_channel, rank_summary

from ccld_plugin.diagnose.links.slow_links import ChannelHistory, LinkJudgement
from ccld_plugin.diagnose.links.tcp_evidence import channel_evidence, cut_off_rank, toward_evidence
from ccld_plugin.diagnose.records import Cause, Kind
from ccld_plugin.diagnose.stalls.hang import find_unresponsive
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.postmortem.replay import replay
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire import peer_channels as codec
from ccld_plugin.wire.codes import SOURCE_NCCL, SOURCE_TCP
from ccld_plugin.wire.peer_channels import (
    PeerChannel,
    channel_rows,
    decode_channels,
    encode_channels,
)
from ccld_plugin.wire.summary import InFlightOp

INTERVAL = 0.5


entry = peer_channel
RECORDED = Path(__file__).parent / "recorded"


DP4 = [group("world", [0, 1, 2, 3]), group("dp", [0, 1, 2, 3])]
TP2PP2 = [
    group("world", [0, 1, 2, 3]),
    group("tp", [0, 1]),
    group("tp", [2, 3]),
    group("pp", [0, 2]),
    group("pp", [1, 3]),
]


def view(
    reports: dict[int, list[PeerChannel]],
    now: int = 100 * S,
    ages: dict[int, float] | None = None,
    groups: list[GroupInfo] = DP4,
    world: int = 4,
    interval: float = INTERVAL,
) -> JobView:
    """A view in which rank r's latest summary, made ages[r] seconds ago, carries
    reports[r] as its channel evidence."""
    ages = ages or {}
    summaries = [
        rank_summary(
            r,
            now - int(ages.get(r, 0.0) * S),
            channels=encode_channels(entries, interval, len(entries)),
        )
        for r, entries in reports.items()
    ]
    return job_view(summaries, {r: groups for r in reports}, now, world=world)


# --- codec ----------------------------------------------------------------------------------


def test_codec_round_trip_and_budget() -> None:
    es = [
        entry(
            p,
            wait="network",
            sent=5 * 10**6,
            queued=123_456,
            rtt_us=40_000,
            busy_share=0.9,
            rwnd_share=0.25,
            stalled_s=3.21,
            retrans=7,
            rtos=2,
        )
        for p in range(20)
    ]
    data = encode_channels(es, INTERVAL, 40)
    assert len(data) <= 450  # a bounded share of the ~1 KB summary budget
    rep = decode_channels(3, 77, data)
    assert rep is not None and rep.rank == 3 and rep.time_ns == 77 and rep.conns == 40
    assert len(rep.entries) == codec.MAX_ENTRIES and rep.interval_s == INTERVAL
    e = rep.entries[0]
    assert (e.peer, e.wait, e.sent, e.queued, e.rtt_us, e.retrans, e.rtos) == (
        0,
        "network",
        5 * 10**6,
        123_456,
        40_000,
        7,
        2,
    )
    assert e.busy_share == pytest.approx(0.9, abs=0.01)
    assert e.stalled_s == pytest.approx(3.21)
    assert {x.source for x in rep.entries} == {"tcp"}
    mixed = [
        entry(1, source="nccl", wait="local", net_wait_us=7, peer_wait_us=8, local_wait_us=9),
        entry(2),
    ]
    nccl = decode_channels(0, 0, encode_channels(mixed, 1, 2))
    assert nccl is not None and nccl.entries == tuple(mixed)  # NCCL waits travel too
    assert decode_channels(0, 0, b"") is None and decode_channels(0, 0, b"\x09xx") is None
    assert decode_channels(0, 0, data[:-1]) is None


def test_rows_of_many_summaries_match_their_reports() -> None:
    # The diagnoser's batch decode (every rank's entries at once) reads what the per-rank
    # decoder reads, and leaves out a value whose head miscounts its NCCL entries, alone.
    mixed = [
        entry(
            1,
            source="nccl",
            wait="local",
            sent=40_000,
            net_wait_us=7,
            peer_wait_us=8,
            local_wait_us=9,
            direction="recv",
        ),
        entry(2, sent=70_000, busy_share=0.5, rtt_us=900),
        entry(3, source="nccl", sent=90_000, net_wait_us=70),
    ]
    v = view({0: mixed, 1: [entry(0, sent=5)], 2: mixed, 3: mixed[::-1]})
    corrupt = bytearray(v.summaries[2].channels)
    corrupt[2] = 1  # the head counts one NCCL entry of two, and the size agrees with it
    v.summaries[2].channels = bytes(corrupt[:-12])
    assert decode_channels(2, 0, v.summaries[2].channels) is None
    rows = channel_rows(v.summaries.values())
    assert sorted(rows.reports["rank"].tolist()) == [0, 1, 3]
    for r in (0, 1, 3):
        rep = decode_channels(r, 0, v.summaries[r].channels)
        assert rep is not None
        got = rows.entries[rows.entries["rank"] == r]
        assert [
            (
                e.peer,
                e.sent,
                e.net_wait_us,
                e.peer_wait_us,
                e.local_wait_us,
                {"tcp": SOURCE_TCP, "nccl": SOURCE_NCCL}[e.source],
                round(e.busy_share * 255),
            )
            for e in rep.entries
        ] == [
            (
                g["peer"],
                g["sent"],
                g["net_wait_us"],
                g["peer_wait_us"],
                g["local_wait_us"],
                g["source"],
                g["busy"],
            )
            for g in got
        ]
        assert (got["mid_ns"] == v.summaries[r].time_ns - int(INTERVAL * 5e8)).all()


# --- hangs ----------------------------------------------------------------------------------

CUT = dict(wait="network", queued=64_000, stalled_s=4.0, rtos=3, rtt_us=200_000)


def test_cut_link_names_the_silent_rank() -> None:
    # Rank 2's link is cut: its summaries stop; ranks 1 and 3 have bytes to it that
    # nothing acknowledges. Its stale report (before the cut) looked healthy.
    v = view(
        {
            0: [entry(3, sent=10**6)],
            1: [entry(2, **CUT)],
            2: [entry(1, sent=10**6)],
            3: [entry(2, **CUT)],
        },
        ages={2: 5.0},
    )
    found = cut_off_rank(v, 2, v.summaries)
    assert found is not None
    assert (found.ranks, found.link) == ([2], None)
    ev = facts(found.evidence)
    assert any(e["data"]["stalled_s"] == 4.0 and e["data"]["rtos"] == 3 for e in ev["link_stalled"])
    assert [e["data"] for e in ev["summaries_stopped"]] == [{"rank": 2, "silent_s": 5.0}]
    # The same stalls, seen from the hang's "nobody missing" path.
    found = channel_evidence(v, DP4[1], [0, 1, 2, 3])
    assert found is not None and found.ranks == [2]
    # A fresh rank is not cut off, whatever its peers' connections show.
    assert cut_off_rank(view({1: [entry(2, **CUT)], 2: []}), 2, [1]) is None


def test_a_cut_that_only_the_diagnoser_sees_with_nobody_else_speaking_names_both_ends() -> None:
    # Two ranks, the diagnoser on rank 0: rank 1 fell silent and rank 0's bytes to it go
    # unacknowledged. That is what rank 0 sees whichever end's port is down (a live demo
    # with rank 0's cut named rank 1): the link and both ranks are named.
    pair = [group("tp", [0, 1])]
    v = replace(
        view({0: [entry(1, **CUT)], 1: [entry(0, sent=10**6)]}, ages={1: 5.0}, groups=pair),
        observer=0,
    )
    found = cut_off_rank(v, 1, v.summaries)
    assert found is not None and (found.ranks, found.link) == ([0, 1], [0, 1])
    assert facts(found.evidence)["either_end"]
    # A third rank that still reports shows the diagnoser's own link working: rank 1 alone.
    trio = [group("tp", [0, 1, 2])]
    reports = {0: [entry(1, **CUT)], 1: [entry(0, sent=10**6)], 2: [entry(0, sent=10**6)]}
    v = replace(view(reports, ages={1: 5.0}, groups=trio, world=3), observer=0)
    found = cut_off_rank(v, 1, v.summaries)
    assert found is not None and found.ranks == [1]
    # A third rank whose process is gone, its last summary as old, shows nothing of the
    # diagnoser's link: both ends again.
    v = replace(view(reports, ages={1: 5.0, 2: 5.0}, groups=trio, world=3), observer=0, gone={2})
    found = cut_off_rank(v, 1, v.summaries)
    assert found is not None and (found.ranks, found.link) == ([0, 1], [0, 1])
    # A cut while rank 0 waits to receive: nothing of its is outstanding, no connection
    # stalls. Its handshake to rank 1's host goes unanswered (rank 1 is not merely
    # unresponsive): the link again, both ends; not before the handshake has ended.
    idle = {0: [entry(1, sent=10**6)], 1: [entry(0, sent=10**6)]}
    v = replace(view(idle, ages={1: 5.0}, groups=pair), observer=0)
    assert cut_off_rank(v, 1, v.summaries) is None
    found = cut_off_rank(replace(v, reach={1: False}), 1, v.summaries)
    assert found is not None and (found.ranks, found.link) == ([0, 1], [0, 1])
    ev = facts(found.evidence)
    assert ev["host_unreachable"] and ev["either_end"]
    # With a third rank silent as well, it is the diagnoser's own isolation: not this.
    v = replace(view({**idle, 2: []}, ages={1: 5.0, 2: 5.0}, groups=trio, world=3), observer=0)
    assert cut_off_rank(replace(v, reach={1: False, 2: False}), 1, v.summaries) is None


def test_a_silent_rank_is_not_called_wedged_before_its_peers_could_show_a_cut() -> None:
    # Rank 2 fell silent 4 s ago. Its peers' last reports (1 s interval) came 1.6 s after
    # that: under load their agents lag too, and a cut link's stall, due by one interval
    # plus STALL_S, may not be in them yet. Nothing stalled is no evidence yet.
    idle = {0: [entry(3, sent=10**6)], 1: [entry(2, sent=10**6)], 3: [entry(2, sent=10**6)]}

    def at(ages: dict[int, float], reports: dict[int, list[PeerChannel]] = idle) -> JobView:
        return view({**reports, 2: []}, ages={**ages, 2: 4.0}, interval=1.0)

    assert find_unresponsive(at({0: 2.4, 1: 2.4, 3: 2.4}), 4.0) == []
    # Once they report 2 s past it and show nothing stalled, its process is wedged.
    (u,) = find_unresponsive(at({0: 1.0, 1: 1.0, 3: 1.0}), 4.0)
    assert u.ranks == [2] and u.evidence[0].fact == "heartbeat_stopped"
    # They caught up and show the cut: a communication hang's case, not this one.
    cut = {**idle, 1: [entry(2, **CUT)]}
    assert find_unresponsive(at({0: 1.0, 1: 1.0, 3: 1.0}, cut), 4.0) == []
    # Peers silent themselves, or tracing no channels, are not waited for.
    assert [u.ranks for u in find_unresponsive(at({0: 3.0, 1: 3.0, 3: 3.0}), 4.0)] == [[2]]
    blind = job_view(
        [rank_summary(r, 100 * S - int(a * S)) for r, a in {0: 2.4, 1: 2.4, 2: 4.0}.items()],
        {r: DP4 for r in range(3)},
        100 * S,
    )
    assert [u.ranks for u in find_unresponsive(blind, 4.0)] == [[2]]


def test_a_silent_rank_waits_for_the_peer_that_entered_an_op_with_it_last() -> None:
    # Rank 2 fell silent 4 s ago (1 s interval). Ranks 0 and 3 reported 3 s after that
    # and show nothing stalled, but rank 1, the one that sends to it in the ring, entered
    # the all-reduce with it only 0.5 s ago: its data to rank 2 cannot have waited
    # STALL_S yet. (On the first peer's word alone a cut rank would be "unresponsive".)
    now = 100 * S
    idle = {0: [entry(3, sent=10**6)], 1: [entry(2, sent=10**6)], 3: [entry(2, sent=10**6)]}
    all_reduce = InFlightOp(slot=1, op=1, flags=0, peer=-1, seq=9, bytes=4096, enter_ns=0)

    def at(rank1_entered_s_ago: float, rank1_age: float) -> JobView:
        v = view({**idle, 2: []}, ages={0: 1.0, 1: rank1_age, 2: 4.0, 3: 1.0}, interval=1.0)
        s = v.summaries[1]
        s.in_flight = [all_reduce._replace(enter_ns=now - int(rank1_entered_s_ago * S))]
        return job_view(v.summaries, v.tables, now, world=4)

    assert find_unresponsive(at(0.5, 0.1), 4.0) == []
    # In the op since before the silence, its report 2 s past the silence shows no stall:
    # the rank's process is wedged.
    (u,) = find_unresponsive(at(5.0, 1.0), 4.0)
    assert u.ranks == [2] and u.evidence[0].fact == "heartbeat_stopped"


def test_a_silent_rank_whose_host_does_not_answer_is_cut_off() -> None:
    # Rank 2 fell silent with nothing of its peers outstanding toward it (they wait to
    # receive from it): the connections cannot tell a cut from a wedged process; the
    # diagnoser's handshake to its host can (control.reach).
    idle = {0: [entry(3, sent=10**6)], 1: [entry(2, sent=10**6)], 3: [entry(2, sent=10**6)]}

    def at(reach: dict[int, bool], ages: dict[int, float] | None = None, **kw: object) -> JobView:
        v = view(
            {**idle, 2: []}, ages={0: 1.0, 1: 1.0, 3: 1.0, 2: 6.0, **(ages or {})}, interval=1.0
        )
        return job_view(v.summaries, v.tables, v.now_ns, world=4, observer=0, reach=reach, **kw)

    found = cut_off_rank(at({2: False}), 2, range(4))
    assert found is not None and found.ranks == [2]
    ev = facts(found.evidence)
    assert ev["host_unreachable"][0]["data"]["rank"] == 2 and ev["summaries_stopped"]
    assert find_unresponsive(at({2: False}), 4.0) == []  # a hang on its link, not this
    # Its host answers: the process is wedged, and the verdict says so.
    assert cut_off_rank(at({2: True}), 2, range(4)) is None
    (u,) = find_unresponsive(at({2: True}), 4.0)
    assert u.ranks == [2] and "host_answers" in facts(u.evidence)
    # Not probed yet, or the observer's own store fails it, or nobody else reports (its
    # own link is as likely down): no evidence either way.
    assert cut_off_rank(at({}), 2, range(4)) is None
    assert cut_off_rank(at({2: False}, store_failed="StoreTimeout"), 2, range(4)) is None
    assert cut_off_rank(at({2: False}, {1: 6.0, 3: 6.0}), 2, range(4)) is None


def test_single_stalled_link_breaks_the_tie_by_silence() -> None:
    v = view({0: [entry(2, **CUT)], 2: []}, ages={2: 4.0})
    found = channel_evidence(v, DP4[1], [0, 2])
    assert found is not None
    ranks, link = found.ranks, found.link
    assert (ranks, link) == ([2], None)
    # Both ends fresh: one stalled link names both ends and the link.
    v = view({0: [entry(2, **CUT)], 2: []})
    found = channel_evidence(v, DP4[1], [0, 2])
    assert found is not None
    ranks, link = found.ranks, found.link
    assert (ranks, link) == ([0, 2], [0, 2])


def test_wedged_process_is_not_cut_off() -> None:
    # Its kernel still acknowledges: the peers' data waits on its closed receive window.
    peer_wait = dict(wait="peer", queued=500_000, stalled_s=4.0, rwnd_share=1.0)
    v = view({1: [entry(2, **peer_wait)], 3: [entry(2, **peer_wait)], 2: []}, ages={2: 6.0})
    assert cut_off_rank(v, 2, v.summaries) is None
    (ev,) = toward_evidence(v, 2, [1, 3])
    assert ev.fact == "data_not_read" and ev.data["rank"] == 2 and ev.data["ranks"] == [1, 3]
    assert ev.data["window_closed_share"] == 1.0


def test_compute_hang_evidence_shows_healthy_idle_links() -> None:
    v = view({0: [entry(1, sent=0, received=10)], 1: [], 3: []})
    (ev,) = toward_evidence(v, 1, [0, 3])
    assert ev.fact == "links_healthy" and ev.data["rank"] == 1


def test_no_stall_no_evidence() -> None:
    v = view({r: [entry((r + 1) % 4, sent=10**6, queued=1000, stalled_s=0.2)] for r in range(4)})
    assert channel_evidence(v, DP4[1], [0, 1, 2, 3]) is None


# --- slowness --------------------------------------------------------------------------------


def feed(
    h: ChannelHistory,
    ticks: int,
    per_tick: dict[int, list[PeerChannel]],
    groups: list[GroupInfo],
    t0: int = 10 * S,
    world: int = 4,
) -> JobView:
    v = view({r: [] for r in per_tick}, groups=groups, world=world)
    for k in range(ticks):
        t = t0 + int(k * INTERVAL * S)
        tick = view(per_tick, now=t, groups=groups, world=world)
        h.ingest(tick.summaries.values())
    return v


def healthy(peer: int, rtt: int = 300) -> PeerChannel:
    return entry(peer, sent=6 * 10**6, rtt_us=rtt, min_rtt_us=8, busy_share=0.03)


def shaped(peer: int) -> PeerChannel:
    return entry(
        peer,
        wait="network",
        sent=2_900_000,
        rtt_us=20_000,
        min_rtt_us=8,
        busy_share=0.95,
        queued=800_000,
    )


def test_dp4_ring_slow_links_have_one_rank_in_common() -> None:
    # Ring 0->3->2->1->0; rank 1's link is shaped: 1->0 and 2->1 are slow.
    h = ChannelHistory()
    v = feed(h, 10, {0: [healthy(3)], 1: [shaped(0)], 2: [shaped(1)], 3: [healthy(2)]}, DP4)
    found = h.slow_links(v, 10 * S, 15 * S).found
    assert found is not None
    assert (found.ranks, found.link, found.group.role) == ([1], None, "dp")  # type: ignore
    assert found.severity > 10
    ev = facts(found.evidence)
    assert any(
        (e["data"]["rank"], e["data"]["peer"], e["data"]["rtt_ms"]) == (1, 0, 20.0)
        for e in ev["link_slow"]
    )
    assert [e["data"] for e in ev["common_rank"]] == [{"rank": 1}]


def test_one_slow_link_is_named_as_a_link() -> None:
    h = ChannelHistory()
    v = feed(
        h,
        10,
        {0: [shaped(1), healthy(2)], 1: [healthy(3)], 2: [healthy(3), healthy(0)], 3: [healthy(2)]},
        TP2PP2,
    )
    found = h.slow_links(v, 10 * S, 15 * S).found
    assert found is not None and found.link == [0, 1] and found.ranks == [0, 1]
    assert found.group.role == "tp"  # type: ignore[union-attr]


def test_links_into_a_rank_that_computes_late_are_not_slow_on_the_network() -> None:
    # 2->1 queues as a shaped link does, but rank 1 computes slower than its cohort: it
    # posts its receives late and its sender waits for that, not for the network.
    per_tick = {0: [healthy(3)], 1: [healthy(0)], 2: [shaped(1)], 3: [healthy(2)]}
    h = ChannelHistory()
    v = feed(h, 10, per_tick, DP4)
    assert h.slow_links(v, 10 * S, 15 * S).found is not None
    h = ChannelHistory()
    v = feed(h, 10, per_tick, DP4)
    judged = h.slow_links(v, 10 * S, 15 * S, late=frozenset({1}))
    assert judged.fresh and judged.found is None
    # Its own sends are judged as any link's: a slow port of the late rank is still named.
    h = ChannelHistory()
    v = feed(h, 10, {0: [healthy(3)], 1: [shaped(0)], 2: [shaped(1)], 3: [healthy(2)]}, DP4)
    found = h.slow_links(v, 10 * S, 15 * S, late=frozenset({1})).found
    assert found is not None and found.ranks == [1]


# A pipeline link's one-way flows, as measured on TP2xPP2 in namespaces (2-core host): the
# sender of activations waits for a receiver that reads late (its delayed ACK), so its send
# queue is busy ~30% on a healthy link, more than a shaped TP link's share per byte; the
# gradients' sender, whose receiver waits for them, ~6%. A shaped port adds the link's own
# drain time: ~1.7x and ~3.7x that.
def pipeline(
    peer: int, forward: bool, port_slow: bool = False, lean: float = 1.0, rtt_lean: float = 1.0
) -> PeerChannel:
    busy = (0.52 if port_slow else 0.30 * lean) if forward else (0.22 if port_slow else 0.06)
    rtt = (
        (14_000 if port_slow else 10_000 * rtt_lean)
        if forward
        else (13_000 if port_slow else 3_000)
    )
    return entry(
        peer,
        wait="network" if forward else "none",
        sent=290_000,
        rtt_us=int(rtt),
        min_rtt_us=4,
        busy_share=busy,
        queued=48 if forward else 0,
    )


def layout_links(
    tp: int, pp: int, dp: int, port: int | None = None, pair: set[int] | None = None
) -> tuple[list[GroupInfo], dict[int, list[PeerChannel]]]:
    """A TPxPPxDP job (rank = tp index + tp x (dp index + dp x stage)) and each rank's
    channel entries per tick: TP and DP connections busy both ways, PP connections one
    way at a time. ``port``: every connection of that rank is shaped; ``pair``: only the
    connection between those two ranks."""
    world = tp * pp * dp

    def coords(r: int) -> tuple[int, int, int]:
        return r % tp, (r // tp) % dp, r // (tp * dp)

    def rank(t: int, d: int, s: int) -> int:
        return t + tp * (d + dp * s)

    groups = [group("world", range(world))]
    for d in range(dp):
        for s_ in range(pp):
            groups.append(group("tp", [rank(t, d, s_) for t in range(tp)]))
    for t in range(tp):
        for s_ in range(pp):
            groups.append(group("dp", [rank(t, d, s_) for d in range(dp)]))
        for d in range(dp):
            groups.append(group("pp", [rank(t, d, s_) for s_ in range(pp)]))
    per_tick: dict[int, list[PeerChannel]] = {r: [] for r in range(world)}
    for g in groups:
        if g.role == "world" or g.size < 2:
            continue
        for a in g.ranks:
            for b in g.ranks:
                if a == b or (g.role == "pp" and abs(coords(a)[2] - coords(b)[2]) != 1):
                    continue
                slow = port in (a, b) or pair == {a, b}
                if g.role == "pp":
                    forward = coords(a)[2] < coords(b)[2]
                    per_tick[a].append(pipeline(b, forward, slow))
                else:
                    per_tick[a].append(shaped(b) if slow else healthy(b))
    return groups, per_tick


@pytest.mark.parametrize("port", [0, 1, 2, 3])
def test_slow_port_names_its_rank_with_its_links_in_both_groups(port: int) -> None:
    # Every connection of one rank of a TP2xPP2 job is slow: its TP connection by far
    # (the slow link), its PP connection by less than the links' slow ratios (its one-way
    # flows wait on delayed ACKs on healthy links too), but 1.7x and 3.7x the time per
    # byte (1.4x and 3.5x the RTT) of the same direction of the PP sibling link. The rank
    # is named, not the TP pair, and both of its connections are shown, both ways.
    groups, per_tick = layout_links(2, 2, 1, port=port)
    h = ChannelHistory()
    v = feed(h, 10, per_tick, groups)
    found = h.slow_links(v, 10 * S, 15 * S).found
    assert found is not None
    assert (found.ranks, found.link) == ([port], None)
    assert found.group is not None and found.group.role == "tp" and port in found.group.ranks
    ev = facts(found.evidence)
    shown = {frozenset((e["data"]["rank"], e["data"]["peer"])) for e in ev["link_slow"]}
    tp_peer, pp_peer = port ^ 1, port ^ 2
    assert shown == {frozenset((port, tp_peer)), frozenset((port, pp_peer))}
    pp_lines = [e for e in ev["link_slow"] if pp_peer in (e["data"]["rank"], e["data"]["peer"])]
    assert len(pp_lines) == 2 and all(e["data"]["time_ratio"] > 1.5 for e in pp_lines)
    assert [e["data"] for e in ev["common_rank"]] == [{"rank": port}]
    assert f"rank {tp_peer}'s other connections are not slow" in ev["common_rank"][0]["text"]


def test_a_pipeline_connection_slow_by_its_messages_is_told_from_its_ends_port() -> None:
    # The messages of TP2xPP2's pipeline connection 1<->3 were slow: the channels say
    # whether an end's other connection (its TP link) is slow too, as for their own
    groups, per_tick = layout_links(2, 2, 1, port=3)
    h = ChannelHistory()
    v = feed(h, 10, per_tick, groups)
    end = h.port_end(v, [1, 3], 10 * S, 15 * S)
    assert end is not None and end[0] == 3
    ev = facts(end[1])
    shown = {frozenset((e["data"]["rank"], e["data"]["peer"])) for e in ev["link_slow"]}
    assert frozenset((2, 3)) in shown and all(3 in k for k in shown)
    assert [e["data"] for e in ev["common_rank"]] == [{"rank": 3}]
    assert "rank 1's other connections are not slow" in ev["common_rank"][0]["text"]
    groups, per_tick = layout_links(2, 2, 1, pair={1, 3})
    h = ChannelHistory()
    v = feed(h, 10, per_tick, groups)
    rank, said = h.port_end(v, [1, 3], 10 * S, 15 * S)  # type: ignore[misc]
    assert rank is None and [e.data for e in said] == [{"link": [1, 3]}]  # the link
    h = ChannelHistory()
    v = feed(h, 1, per_tick, groups)
    assert h.port_end(v, [1, 3], 10 * S, 15 * S) is None  # too few reports: not yet
    assert ChannelHistory().port_end(v, [1, 3], 10 * S, 15 * S) == (None, [])  # none at all


def test_slow_port_in_a_lone_ring_names_its_rank() -> None:
    # One TP4 group (no sibling group) of a live job, rank 2's port shaped to 50 Mbit/s:
    # its ring 0->1->2->3->0 stalls at it, so healthy 0->1 queues too (7 s per MB); 1->2
    # is slow by far, 2->3 only 2x 0->1, and the backward 3->2 and 2->1 carry little but
    # show it in their RTTs. Against all of the role's links, forward and backward in one
    # median, rank 2's other connection was no slower than that: the live job got the link
    # 1<->2. Against the links as far the same way around the ring (2->3 with 0->1, 3->2
    # with 1->0), rank 2's is slow, and rank 1's is not: rank 2 is named.
    def link(peer: int, busy: float, s_per_mb: float, rtt: int) -> PeerChannel:
        # (seconds per MB as measured at 1 s ticks: the bytes of a 0.5 s tick at half that)
        sent = int(busy * INTERVAL / (s_per_mb / 2) * 1e6)
        return entry(peer, wait="network", sent=sent, rtt_us=rtt, min_rtt_us=8, busy_share=busy)

    tp4 = [group("world", [0, 1, 2, 3]), group("tp", [0, 1, 2, 3])]
    per_tick = {
        0: [link(1, 0.80, 7.0, 244), link(3, 0.02, 0.022, 92)],
        1: [link(2, 0.87, 14.5, 1_674), link(0, 0.01, 0.011, 41)],
        2: [link(3, 0.69, 14.3, 2_084), link(1, 0.08, 0.095, 1_111)],
        3: [link(0, 0.50, 2.6, 99), link(2, 0.08, 0.093, 1_858)],
    }
    h = ChannelHistory()
    v = feed(h, 10, per_tick, tp4)
    found = h.slow_links(v, 10 * S, 15 * S).found
    assert found is not None and (found.ranks, found.link) == ([2], None)
    ev = facts(found.evidence)
    assert "rank 1's other connections are not slow" in ev["common_rank"][0]["text"]
    shown = {(e["data"]["rank"], e["data"]["peer"]) for e in ev["link_slow"]}
    assert {(1, 2), (2, 3), (3, 2)} <= shown


def test_slow_connection_of_one_of_two_pipelines_names_the_link() -> None:
    # TP1xPP2xDP2, pipelines 0->2 and 1->3, the connection 1<->3 shaped to 30 Mbit/s (a
    # live job's measurements): each direction is only 2-3x the time per byte of the
    # pipeline links in one median (forward and backward: the job's step doubled, and no
    # verdict came), but against the same direction of the other pipeline's link both
    # directions are 2-5x the time per byte and 4-12x the RTT: the link is named.
    def link(peer: int, busy: float, s_per_mb: float, rtt: int) -> PeerChannel:
        # (seconds per MB as measured at 1 s ticks: the bytes of a 0.5 s tick at half that)
        sent = int(busy * INTERVAL / (s_per_mb / 2) * 1e6)
        return entry(peer, wait="network", sent=sent, rtt_us=rtt, min_rtt_us=8, busy_share=busy)

    groups = [
        group("world", [0, 1, 2, 3]),
        group("dp", [0, 1]),
        group("dp", [2, 3]),
        group("pp", [0, 2]),
        group("pp", [1, 3]),
    ]
    healthy_pp = {0: link(2, 0.10, 0.044, 673), 2: link(0, 0.20, 0.113, 2_067)}
    per_tick = {
        0: [link(1, 0.05, 0.0023, 224), healthy_pp[0]],
        1: [link(0, 0.05, 0.0012, 264), link(3, 0.42, 0.218, 8_047)],
        2: [link(3, 0.05, 0.0009, 238), healthy_pp[2]],
        3: [link(2, 0.05, 0.0008, 103), link(1, 0.50, 0.251, 10_537)],
    }
    h = ChannelHistory()
    v = feed(h, 10, per_tick, groups)
    found = h.slow_links(v, 10 * S, 15 * S).found
    assert found is not None and (found.ranks, found.link) == ([1, 3], [1, 3])
    assert found.group is not None and found.group.role == "pp"
    ev = facts(found.evidence)
    assert {(e["data"]["rank"], e["data"]["peer"]) for e in ev["link_slow"]} == {(1, 3), (3, 1)}
    # The same connection as its sibling: nothing.
    per_tick[1][1] = link(3, 0.10, 0.044, 673)
    per_tick[3][1] = link(1, 0.20, 0.113, 2_067)
    h = ChannelHistory()
    v = feed(h, 10, per_tick, groups)
    assert h.slow_links(v, 10 * S, 15 * S).found is None


@pytest.mark.parametrize("pair", [{0, 1}, {2, 3}])
@pytest.mark.parametrize(("lean", "rtt_lean"), [(1.0, 1.0), (1.35, 1.35), (1.3, 1.8)])
def test_one_slow_connection_names_the_link(pair: set[int], lean: float, rtt_lean: float) -> None:
    # Only one TP connection is shaped: the PP connections of both its ends are as slow as
    # their siblings, up to what one direction of healthy siblings differed by (1.35x in
    # time per byte and RTT, or 1.3x and 1.8x).
    groups, per_tick = layout_links(2, 2, 1, pair=pair)
    a, b = sorted(pair)
    # The activations 1 -> 3 (a PP link of one end) lean slow, as measured.
    per_tick[1] = [
        pipeline(3, True, lean=lean, rtt_lean=rtt_lean) if e.peer == 3 else e for e in per_tick[1]
    ]
    h = ChannelHistory()
    v = feed(h, 10, per_tick, groups)
    found = h.slow_links(v, 10 * S, 15 * S).found
    assert found is not None
    assert (found.ranks, found.link) == ([a, b], [a, b])
    ev = facts(found.evidence)
    assert {(e["data"]["rank"], e["data"]["peer"]) for e in ev["link_slow"]} == {(a, b), (b, a)}
    assert [e["data"] for e in ev["one_link"]] == [{"link": [a, b]}]


def test_a_noisy_window_of_a_connection_is_judged_with_the_ones_before() -> None:
    # Only 2<->3 is shaped. In one window rank 2's PP connection leans slow both ways (as
    # measured once on a loaded host: 2 -> 0 2x the time per byte and 1.4x the RTT of its
    # sibling, 0 -> 2 1.1x and 1.5x): judged alone that is a port; with the windows since
    # the link became slow, it is not.
    groups, per_tick = layout_links(2, 2, 1, pair={2, 3})
    noisy = {r: list(es) for r, es in per_tick.items()}
    noisy[2] = [
        entry(0, sent=290_000, rtt_us=4_200, min_rtt_us=4, busy_share=0.12) if e.peer == 0 else e
        for e in per_tick[2]
    ]
    noisy[0] = [
        pipeline(2, True, lean=1.1, rtt_lean=1.5) if e.peer == 2 else e for e in per_tick[0]
    ]
    alone = ChannelHistory()
    v = feed(alone, 10, noisy, groups, t0=15 * S)
    found = alone.slow_links(v, 15 * S, 20 * S).found
    assert found is not None and (found.ranks, found.link) == ([2], None)
    h = ChannelHistory()
    feed(h, 10, per_tick, groups)
    found = h.slow_links(v, 10 * S, 15 * S).found
    assert found is not None and found.link == [2, 3]
    feed(h, 10, noisy, groups, t0=15 * S)
    found = h.slow_links(v, 15 * S, 20 * S).found
    assert found is not None and (found.ranks, found.link) == ([2, 3], [2, 3])


def test_jiffy_noise_on_idle_links_is_no_port() -> None:
    # TP2xDP2, only the DP connection 1<->3 is shaped. Rank 3's TP link moves its bytes in
    # a few jiffies per interval: 2x its sibling's time per byte there is rounding, not a
    # port (measured: up to 2.3x between healthy TP siblings busy 1-3% of the time).
    groups, per_tick = layout_links(2, 1, 2, pair={1, 3})
    per_tick[3] = [
        entry(2, sent=6 * 10**6, rtt_us=300, min_rtt_us=8, busy_share=0.06) if e.peer == 2 else e
        for e in per_tick[3]
    ]
    h = ChannelHistory()
    v = feed(h, 10, per_tick, groups)
    found = h.slow_links(v, 10 * S, 15 * S).found
    assert found is not None and (found.ranks, found.link) == ([1, 3], [1, 3])
    assert found.group is not None and found.group.role == "dp"


def test_slow_port_in_three_groups_shows_a_link_of_each() -> None:
    # TP2xPP2xDP2 (8 ranks): rank 7's TP and DP connections are slow links, its PP
    # connection (to rank 3) is slow by its same-direction sibling: all three are shown.
    groups, per_tick = layout_links(2, 2, 2, port=7)
    h = ChannelHistory()
    v = feed(h, 10, per_tick, groups, world=8)
    found = h.slow_links(v, 10 * S, 15 * S).found
    assert found is not None and (found.ranks, found.link) == ([7], None)
    ev = facts(found.evidence)
    shown = {frozenset((e["data"]["rank"], e["data"]["peer"])) for e in ev["link_slow"]}
    assert shown == {frozenset((7, 6)), frozenset((7, 5)), frozenset((7, 3))}
    # One connection of the same layout: the DP link 5<->7 alone is named.
    groups, per_tick = layout_links(2, 2, 2, pair={5, 7})
    h = ChannelHistory()
    v = feed(h, 10, per_tick, groups, world=8)
    found = h.slow_links(v, 10 * S, 15 * S).found
    assert found is not None and (found.ranks, found.link) == ([5, 7], [5, 7])
    assert found.group is not None and found.group.role == "dp"


def test_a_link_verdict_waits_a_window_in_which_a_port_can_show() -> None:
    # A link is confirmed one window later than a rank; a window in between that finds
    # one end's port slow names that rank, with the count of the link's windows.
    from ccld_plugin.config import DiagnoserConfig
    from ccld_plugin.diagnose.links.slow_links import LinkFinding
    from ccld_plugin.diagnose.slow import SlowDetector

    cfg = DiagnoserConfig()
    link = LinkFinding([2, 3], [2, 3], TP2PP2[2], 30.0, [])
    port = LinkFinding([3], None, TP2PP2[2], 30.0, [])
    v = view({})
    windows = [(1 + 5 * i, 6 + 5 * i) for i in range(6)]
    det = SlowDetector(cfg)
    seq = [link, link, port, link]
    got = [
        det.communication.channel_slow(v, f, lo, hi)
        for f, (lo, hi) in zip(seq, windows[:4], strict=True)
    ]
    assert [len(x) for x in got] == [0, 0, 1, 0]
    assert (got[2][0].ranks, got[2][0].link) == ([3], None)
    # A link alone is named, a window after a rank would have been.
    det = SlowDetector(cfg)
    got = [det.communication.channel_slow(v, link, lo, hi) for lo, hi in windows[:4]]
    assert [len(x) for x in got] == [0] * cfg.confirm_windows + [1, 0]
    assert got[cfg.confirm_windows][0].link == [2, 3]
    det = SlowDetector(cfg)
    got = [det.communication.channel_slow(v, port, lo, hi) for lo, hi in windows[:3]]
    assert [len(x) for x in got] == [0] * (cfg.confirm_windows - 1) + [1, 0]


def test_healthy_jitter_and_delayed_acks_are_not_slow() -> None:
    # One-way PP flows have several ms of smoothed RTT from delayed ACKs on both siblings;
    # ring links differ 2x in RTT on a busy host. Neither is a slow link.
    h = ChannelHistory()
    pp = dict(rtt_us=6000, busy_share=0.35, sent=1_000_000)
    v = feed(
        h,
        12,
        {
            0: [entry(2, **pp), healthy(1, 200)],
            1: [entry(3, **pp), healthy(0, 500)],
            2: [healthy(3, 300)],
            3: [healthy(2, 150)],
        },
        TP2PP2,
    )
    judged = h.slow_links(v, 10 * S, 16 * S)
    assert (judged.found, judged.fresh) == (None, True)
    # Each link that moved data was judged (healthy): a group's bandwidth drop over them
    # is then not put on the network (SlowCommunication.judge).
    assert set(judged.measured) == {(0, 2), (0, 1), (1, 3), (1, 0), (2, 3), (3, 2)}
    h = ChannelHistory()
    v = feed(
        h,
        12,
        {0: [healthy(3, 400)], 1: [healthy(0, 900)], 2: [healthy(1, 300)], 3: [healthy(2, 1800)]},
        DP4,
    )
    judged = h.slow_links(v, 10 * S, 16 * S)
    assert (judged.found, judged.fresh) == (None, True)


def test_too_few_intervals_are_judged_with_the_next_window() -> None:
    # Two agent reports per window of steps: each window alone is too short to judge (and
    # says nothing either way: it must not break a streak); two together are judged.
    h = ChannelHistory()
    ring = {0: [healthy(3)], 1: [shaped(0)], 2: [shaped(1)], 3: [healthy(2)]}
    v = feed(h, 2, ring, DP4)
    assert h.slow_links(v, 10 * S, 10 * S + int(2 * INTERVAL * S)) == LinkJudgement(
        None, False, pending=True
    )
    v = feed(h, 2, ring, DP4, t0=10 * S + int(2 * INTERVAL * S))
    judged = h.slow_links(v, 10 * S + int(2 * INTERVAL * S), 10 * S + int(4 * INTERVAL * S))
    assert judged.fresh and judged.found is not None and judged.found.ranks == [1]
    # The next short window repeats that judgement (and the links it measured), not fresh.
    v = feed(h, 1, ring, DP4, t0=10 * S + int(4 * INTERVAL * S))
    again = h.slow_links(v, 10 * S + int(4 * INTERVAL * S), 10 * S + int(5 * INTERVAL * S))
    assert again == LinkJudgement(judged.found, False, judged.measured, pending=True)
    assert set(again.measured) == {(0, 3), (1, 0), (2, 1), (3, 2)}


def test_reports_are_kept_for_a_bounded_time_while_no_window_closes() -> None:
    # Steps that do not advance close no window: the history must not grow with the job.
    from ccld_plugin.diagnose.links.slow_links import KEEP_S

    h = ChannelHistory()
    ticks = int(3 * KEEP_S / INTERVAL)
    feed(h, ticks, {0: [healthy(3)], 1: [shaped(0)], 2: [shaped(1)], 3: [healthy(2)]}, DP4)
    kept = h.between(0, 10**15).reports["mid_ns"]
    newest = 10 * S + int((ticks - 1) * INTERVAL * S)
    assert len(kept) < 4 * (KEEP_S / INTERVAL + 2) and kept.min() >= newest - KEEP_S * S - S


def test_sibling_medians_match_the_direct_computation() -> None:
    """The fast medians (each link against the links that share no rank with it) give
    what a pass over all links gives, and their cheap lower bound never exceeds them, on
    random link sets of every size: the objects' (a slow port's links) and the columns'
    (every link of a window, by role)."""
    import random
    import statistics

    import numpy as np

    from ccld_plugin.diagnose.links.link_roles import SiblingMedians
    from ccld_plugin.diagnose.links.link_stats import (
        LinkStats,
        LinkTable,
        sibling_medians,
        spm_floors,
    )

    rng = random.Random(7)
    for n_ranks in (3, 4, 5, 8, 16, 40):
        keys = {
            (a, b) for a in range(n_ranks) for b in range(n_ranks) if a != b and rng.random() < 0.4
        }
        links = {
            k: LinkStats(
                k[0],
                k[1],
                3,
                rng.choice([100.0, 250.0, rng.uniform(50, 5e4)]),
                10,
                rng.uniform(1e-4, 1.0),
                0.5,
                0,
                0,
                10**6,
            )
            for k in keys
        }
        fast = SiblingMedians(links)
        ordered = sorted(links)
        table = LinkTable(
            {f: np.array([getattr(links[k], f) for k in ordered]) for f in LinkStats._fields}
        )
        roles = np.array([rng.randrange(2) for _ in ordered], np.int64)
        floors = spm_floors(roles, table)  # the bound links are skipped on
        one_role = spm_floors(np.zeros(len(ordered), np.int64), table)
        for i, k in enumerate(ordered):
            refs = [o for ok, o in links.items() if not set(ok) & set(k)]
            got = fast.without(k)
            # the columns' medians are the objects' to the bit
            assert sibling_medians(np.zeros(len(ordered), np.int64), table, i) == got
            if not refs:
                assert got is None and np.isnan(one_role[i])
            else:
                assert got is not None
                assert np.isnan(one_role[i]) or one_role[i] <= got[1]
                assert got[0] == pytest.approx(statistics.median(o.rtt_us for o in refs))
                assert got[1] == pytest.approx(statistics.median(o.s_per_mb for o in refs))
            role_refs = [
                o
                for j, (ok, o) in enumerate((o, links[o]) for o in ordered)
                if roles[j] == roles[i] and not set(ok) & set(k)
            ]
            by_role = sibling_medians(roles, table, i)
            if not role_refs:
                assert by_role is None and np.isnan(floors[i])
                continue
            assert by_role is not None
            assert np.isnan(floors[i]) or floors[i] <= by_role[1]
            assert by_role[0] == statistics.median(o.rtt_us for o in role_refs)
            assert by_role[1] == statistics.median(o.s_per_mb for o in role_refs)


def test_a_recorded_two_rank_cut_with_nothing_outstanding_names_the_link() -> None:
    # Recorded from test_a_two_rank_cut_names_the_link_and_both_ends[diagnoser-rank]:
    # rank 0's link was cut while it waited to receive from rank 1, so none of its
    # connections stalled; rank 1's summaries stopped and its host did not answer rank 0's
    # handshake. Not unresponsive 10 s later: it is the link, both ends.
    _, got = replay(RECORDED / "cut-of-the-diagnosers-link-nothing-outstanding-2ranks.rec")
    assert [(v.kind, v.cause, v.ranks, v.link) for v in got] == [
        (Kind.HANG, Cause.COMMUNICATION, [0, 1], [0, 1])
    ]
    assert {"host_unreachable", "either_end"} <= {e.fact for e in got[0].evidence}


def test_a_recorded_slow_pipeline_connection_is_named_not_the_group_it_delays() -> None:
    # Recorded from test_slow_connection_of_one_of_two_pipelines (TP1xPP2xDP2, only the
    # connection 1<->3 shaped): rank 1, held up on it, came late to its DP all-reduce, and
    # dp[0, 1] moved 7x slower than dp[2, 3] though its own links were healthy. A window too
    # short to judge the links again carries their finding, 1<->3: the channels' link
    # outside the group is the verdict, not the DP group's two members.
    _, got = replay(RECORDED / "comm-slow-30mbit-link1-3-step8-tp1pp2dp2.rec")
    assert [(v.kind, v.cause, v.ranks, v.link) for v in got] == [
        (Kind.SLOW, Cause.COMMUNICATION, [1, 3], [1, 3])
    ]
    assert got[0].group is not None and got[0].group["ranks"] == [1, 3]
