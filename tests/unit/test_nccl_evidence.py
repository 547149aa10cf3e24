"""The NCCL wait-state reading (diagnose/links/nccl_evidence.py) on views built by hand: layouts the
harness's ring does not produce (a broadcast tree, two ranks, lost credit, two faults, a
silent culprit). The ring faults themselves are tested from the plugin's own board
records in test_nccl_profiler.py. Last, the diagnoser reports such a hang once while its
evidence fades."""

from __future__ import annotations

from builders import NOW, S, group, job_view, peer_channel, rank_summary

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose import Analyzer
from ccld_plugin.diagnose.analyzer import located_by_channels
from ccld_plugin.diagnose.links.nccl_evidence import nccl_evidence
from ccld_plugin.diagnose.records import Cause
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.codes import FLAG_CUDA, OP_CODES
from ccld_plugin.wire.peer_channels import PeerChannel, encode_channels
from ccld_plugin.wire.summary import GroupProgress, InFlightOp


def ch(peer: int, direction: str, wait: str, stalled_s: float = 5.0) -> PeerChannel:
    return peer_channel(
        peer,
        wait=wait,
        direction=direction,
        conns=2,
        queued=1 << 18,
        rtt_us=0,
        min_rtt_us=0,
        stalled_s=stalled_s,
        source="nccl",
    )


def view(
    entries: dict[int, list[PeerChannel]], silent: tuple[int, ...] = ()
) -> tuple[JobView, GroupInfo]:
    g = group("dp", sorted(entries))
    summaries = [
        rank_summary(
            r,
            NOW - (10 * S if r in silent else 0),
            pid=1,
            step=1,
            channels=encode_channels(es, 1.0, len(es)),
        )
        for r, es in entries.items()
    ]
    return job_view(summaries, {r: [g] for r in g.ranks}), g


def located(entries: dict[int, list[PeerChannel]], silent: tuple[int, ...] = ()):
    v, g = view(entries, silent)
    return nccl_evidence(v, g, list(g.ranks))


def test_broadcast_root_whose_gpu_produces_nothing() -> None:
    # Tree 0 -> {1, 2}, 1 -> 3: nothing is owed to rank 0; its sends wait for its GPU.
    found = located(
        {
            0: [ch(1, "send", "local"), ch(2, "send", "local")],
            1: [ch(0, "recv", "network"), ch(3, "send", "local")],
            2: [ch(0, "recv", "network")],
            3: [ch(1, "recv", "network")],
        }
    )
    assert found is not None and (found.ranks, found.cause) == ([0], Cause.COMPUTE)
    assert found.link is None


def test_two_ranks_gpu_stuck() -> None:
    found = located(
        {
            0: [ch(1, "send", "local"), ch(1, "recv", "local")],
            1: [ch(0, "send", "peer"), ch(0, "recv", "network")],
        }
    )
    assert found is not None and (found.ranks, found.cause) == ([0], Cause.COMPUTE)


def test_credit_and_data_waiting_for_each_other_is_the_link() -> None:
    # 2 holds data for 3 and has no credit; 3 has posted its receive and no data comes:
    # the messages between them are lost.
    found = located(
        {
            1: [ch(2, "send", "local"), ch(0, "recv", "network")],
            2: [ch(3, "send", "peer"), ch(1, "recv", "local")],
            3: [ch(2, "recv", "network"), ch(0, "send", "local")],
            0: [ch(3, "recv", "network"), ch(1, "send", "local")],
        }
    )
    assert found is not None and (found.ranks, found.link) == ([2, 3], [2, 3])
    assert found.cause == Cause.COMMUNICATION


def test_two_faults_name_both() -> None:
    # Two 2-rank rings stuck in one group's op: GPU of 0 and GPU of 3.
    found = located(
        {
            0: [ch(1, "send", "local"), ch(1, "recv", "local")],
            1: [ch(0, "send", "peer"), ch(0, "recv", "network")],
            2: [ch(3, "send", "peer"), ch(3, "recv", "network")],
            3: [ch(2, "send", "local"), ch(2, "recv", "local")],
        }
    )
    assert found is not None and found.ranks == [0, 3]


def test_silent_culprit_is_named_without_a_cause() -> None:
    found = located(
        {
            0: [ch(1, "send", "local"), ch(1, "recv", "local")],
            1: [ch(0, "send", "peer"), ch(2, "recv", "network")],
            2: [ch(0, "recv", "network"), ch(1, "send", "local")],
        },
        silent=(0,),
    )
    assert found is not None and (found.ranks, found.cause) == ([0], Cause.UNKNOWN)


def test_short_waits_and_tcp_entries_are_not_nccl_stalls() -> None:
    assert (
        located(
            {
                0: [ch(1, "send", "local", stalled_s=0.2)],
                1: [ch(0, "recv", "network", stalled_s=0.2)],
            }
        )
        is None
    )
    tcp = PeerChannel(
        peer=1,
        wait="network",
        direction="send",
        conns=1,
        rtos=3,
        sent=0,
        received=0,
        queued=1 << 16,
        rtt_us=100,
        min_rtt_us=10,
        retrans=0,
        rwnd_share=0.0,
        sndbuf_share=0.0,
        busy_share=0.0,
        stalled_s=5.0,
    )
    assert located({0: [tcp], 1: []}) is None


def ring_round(d: Analyzer, now_ns: int, culprit: int, silent: bool, cleared: bool) -> list:
    """One diagnoser round over a 3-rank NCCL all-reduce stalled on ``culprit``'s GPU
    (the entries of test_silent_culprit_is_named_without_a_cause), its summaries stale by
    3 s when ``silent``, its channel records gone when ``cleared`` (its op ended)."""
    g = group("dp", [0, 1, 2])
    entries = {
        0: [ch(1, "send", "local"), ch(1, "recv", "local")],
        1: [ch(0, "send", "peer"), ch(2, "recv", "network")],
        2: [ch(0, "recv", "network"), ch(1, "send", "local")],
    }
    summaries = []
    for r, es in entries.items():
        es = [] if cleared and r == culprit else es
        time_ns = now_ns - (3 * S if silent and r == culprit else 0)
        summaries.append(
            rank_summary(
                r,
                time_ns,
                heartbeat_ns=time_ns,
                pid=1,
                step=8,
                last_progress_ns=NOW - 8 * S,
                groups=[GroupProgress(0, 9, 8, 0, 0, 0, 0)],
                in_flight=[
                    InFlightOp(0, OP_CODES["all_reduce"], FLAG_CUDA, -1, 9, 64, NOW - 8 * S)
                ],
                channels=encode_channels(es, 1.0, len(es)),
            )
        )
    view = job_view(summaries, {r: [g] for r in g.ranks}, now_ns=now_ns)
    return [(v.kind.value, v.cause.value, v.ranks) for v in d.round(view)]


def test_a_hang_is_not_reported_again_as_its_evidence_fades() -> None:
    # The culprit's op ends (its channel records clear) or it leaves (its summaries stop)
    # after the verdict: the same stall read again is not a second verdict; a cause found
    # where the first verdict had none is.
    d = Analyzer(DiagnoserConfig(hang_min_s=3), 0.5, channel_evidence=located_by_channels)
    assert ring_round(d, NOW, 0, silent=False, cleared=False) == [("hang", "compute", [0])]
    assert ring_round(d, NOW + 3 * S, 0, silent=True, cleared=False) == []
    assert ring_round(d, NOW + 4 * S, 0, silent=False, cleared=True) == []
    d = Analyzer(DiagnoserConfig(hang_min_s=3), 0.5, channel_evidence=located_by_channels)
    assert ring_round(d, NOW, 0, silent=True, cleared=False) == [("hang", "unknown", [0])]
    assert ring_round(d, NOW + S, 0, silent=False, cleared=False) == [("hang", "compute", [0])]
    assert ring_round(d, NOW + 2 * S, 0, silent=False, cleared=True) == []
