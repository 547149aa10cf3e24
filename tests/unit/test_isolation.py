"""The diagnoser's own rank cut off: every peer silent at once is the observer's fault, not
each peer's; on synthetic views."""

from __future__ import annotations

from builders import NOW, S, facts, group, job_view, peer_channel, rank_summary

from ccld_plugin.config import DiagnoserConfig
from ccld_plugin.diagnose import Analyzer
from ccld_plugin.diagnose.stalls.isolation import observer_isolated
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.wire.codes import OP_CODES
from ccld_plugin.wire.peer_channels import encode_channels
from ccld_plugin.wire.summary import GroupProgress, InFlightOp

INTERVAL = 0.5
DP4 = group("dp", [0, 1, 2, 3])
CUT = dict(wait="network", queued=64_000, stalled_s=4.0, rtos=3, rtt_us=200_000)


def _rank(rank: int, age_s: float, op_age_s: float | None, channels=()) -> object:
    """Rank ``rank`` whose last summary is ``age_s`` old, in all_reduce seq 9 of DP4 for
    ``op_age_s`` seconds (None: in no op)."""
    t = NOW - int(age_s * S)
    flights = (
        [InFlightOp(0, OP_CODES["all_reduce"], 0, -1, 9, 1 << 20, NOW - int(op_age_s * S))]
        if op_age_s is not None
        else []
    )
    return rank_summary(
        rank,
        t,
        groups=[GroupProgress(0, 9 if flights else 8, 8, 0, 0, 0, 0)],
        in_flight=flights,
        last_progress_ns=NOW - int((op_age_s or 0) * S),
        channels=encode_channels(list(channels), INTERVAL, len(channels)),
    )


def _view(ages: dict[int, float], observer: int = 0, **where: object) -> JobView:
    """Rank ``observer`` fresh and blocked 8 s with its links to 1 and 3 stalled; every
    other rank blocked too, its last summary ``ages[r]`` seconds old."""
    summaries = [
        _rank(observer, 0.0, 8.0, [peer_channel(1, **CUT), peer_channel(3, **CUT)]),
        *(_rank(r, age, 8.0 - age) for r, age in ages.items()),
    ]
    v = job_view(summaries, {r: [DP4] for r in range(4)}, world=4)
    v.observer = observer
    for k, value in {"store_local": True, **where}.items():
        setattr(v, k, value)
    return v


def _analyzer() -> Analyzer:
    return Analyzer(DiagnoserConfig(hang_min_s=3, unresponsive_s=4), INTERVAL)


def test_every_peer_silent_at_once_names_the_diagnosers_own_rank() -> None:
    v = _view({1: 4.0, 2: 4.1, 3: 4.2})
    (verdict,) = _analyzer().round(v)
    assert (verdict.kind, verdict.cause, verdict.ranks) == ("hang", "communication", [0])
    assert verdict.group is not None and verdict.group["role"] == "dp"
    ev = facts(verdict.evidence)
    assert ev["peers_silent_at_once"][0]["data"]["ranks"] == [1, 2, 3]
    assert {e["data"]["peer"] for e in ev["link_stalled"]} == {1, 3}
    assert ev["link_down"] and "store_unreachable" not in ev


def test_a_store_that_does_not_answer_is_evidence_of_isolation_anywhere() -> None:
    v = _view({1: 4.0, 2: 4.1, 3: 4.2}, observer=0, store_local=False, store_failed="timeout")
    (verdict,) = _analyzer().round(v)
    assert verdict.ranks == [0]
    assert facts(verdict.evidence)["store_unreachable"][0]["data"]["error"] == "timeout"


def test_a_remote_store_that_died_with_its_host_does_not_blame_the_observer() -> None:
    v = _view({1: 4.0, 2: 4.1, 3: 4.2}, store_local=False, store_failed="reset by peer")
    v.summaries[0] = _rank(0, 0.0, 8.0)  # its own connections do not stall
    assert observer_isolated(v) is None


def test_a_remote_store_that_answers_clears_the_observer() -> None:
    # The store, elsewhere, hears from the observer: peers alive and connected would have
    # been heard too. They are judged one by one, and the observer is not named.
    v = _view({1: 4.0, 2: 4.1, 3: 4.2}, store_local=False)
    assert observer_isolated(v) is None
    assert all(0 not in verdict.ranks for verdict in _analyzer().round(v))


def test_no_isolation_when_one_peer_still_speaks_or_they_stopped_apart() -> None:
    assert observer_isolated(_view({1: 4.0, 2: 4.1, 3: 0.2})) is None
    assert observer_isolated(_view({1: 4.0, 2: 9.0, 3: 4.2})) is None  # 5 s apart
    assert observer_isolated(_view({1: 4.0, 2: 4.1, 3: 4.2}, gone={2})) is None
    v = _view({1: 4.0, 2: 4.1, 3: 4.2})
    v.observer = None  # a post-mortem: nobody observes
    assert observer_isolated(v) is None


def test_isolated_but_not_yet_stuck_past_the_threshold_gives_nothing_yet() -> None:
    v = _view({1: 4.0, 2: 4.1, 3: 4.2})
    v.summaries[0] = _rank(0, 0.0, 1.0)  # its op began 1 s ago: under hang_min_s
    d = _analyzer()
    assert observer_isolated(v) is not None
    assert d.round(v) == []  # and the silent peers are not blamed meanwhile


def test_the_isolation_holds_while_its_own_signs_come_and_go() -> None:
    # Named once; a round later the observer's links show no stall for a moment (their
    # retransmissions paused) while its store still fails and every peer stays silent:
    # the peers are not named one by one.
    d = _analyzer()
    where = {"store_local": False, "store_failed": "timeout"}
    (verdict,) = d.round(_view({1: 4.0, 2: 4.1, 3: 4.2}, **where))
    assert verdict.ranks == [0]
    later = _view({1: 5.0, 2: 5.1, 3: 5.2}, **where)
    later.summaries[0] = _rank(0, 0.0, 9.0)  # no stalled link shown this round
    assert d.round(later) == []
    # A peer that speaks again ends it: the others are judged as any rank.
    again = _view({1: 5.5, 2: 0.1, 3: 5.7}, **where)
    assert {r for v in d.round(again) for r in v.ranks} >= {1, 3}


def test_peers_silent_through_a_store_that_does_not_answer_are_not_named() -> None:
    # The store does not answer the observer and every peer fell silent at once, but its
    # own links show nothing (its connections were not mapped to peers before the cut, or
    # the store's host died): the observer cannot tell which. The peers' silence is its
    # own: none of them is named unresponsive (a live run named all three).
    v = _view({1: 12.0, 2: 12.1, 3: 12.2}, store_local=False, store_failed="timeout")
    v.summaries[0] = _rank(0, 0.0, 12.0)  # no channel evidence of its own
    assert observer_isolated(v) is None
    assert _analyzer().round(v) == []
    # Its handshakes to the peers' hosts (control.reach): none answered, though one did
    # before (a dead store host would leave the others answering): its own link is down.
    v.reach = {1: False, 2: False, 3: False}
    assert observer_isolated(v) is not None
    (h,) = _analyzer().round(v)
    assert (h.kind, h.cause, h.ranks) == ("hang", "communication", [0])
    assert facts(h.evidence)["peers_unreachable"][0]["data"]["ranks"] == [1, 2, 3]
    # One peer's host answers (another host: ranks of its own are not probed): the
    # observer's link works, the others' hosts are cut off, the store's among them.
    v.reach = {1: True, 2: False, 3: False}
    assert observer_isolated(v) is None
    got = _analyzer().round(v)
    assert [(h.kind, h.cause, h.ranks) for h in got] == [
        ("hang", "communication", [2]),
        ("hang", "communication", [3]),
    ]
    ev = facts(got[0].evidence)
    assert ev["host_unreachable"][0]["data"]["answered"] == [1] and ev["store_unreachable"]
    # No handshake ended yet: nobody named.
    v.reach = {}
    assert _analyzer().round(v) == []


def test_a_peer_that_answers_the_observers_handshake_ends_its_isolation() -> None:
    # The store (elsewhere) went silent for the observer, which has a stalled link (to the
    # peer that was cut, rank 1): it looks isolated at first. Then the other peers'
    # hosts answer its handshakes and rank 1's does not: rank 1 is the one cut off (the
    # store's host, in a live run that named the observer before).
    d = _analyzer()
    v = _view({1: 4.0, 2: 4.1, 3: 4.2}, store_local=False, store_failed="timeout")
    assert observer_isolated(v) is not None
    v.summaries[0].in_flight = []  # between ops: no verdict yet, the isolation is kept
    assert d.round(v) == []
    v = _view({1: 6.0, 2: 6.1, 3: 6.2}, store_local=False, store_failed="timeout")
    v.reach = {1: False, 2: True, 3: True}
    assert observer_isolated(v) is None
    (h,) = d.round(v)
    assert (h.kind, h.cause, h.ranks) == ("hang", "communication", [1])
    assert [e.fact for e in h.evidence][:2] == ["host_unreachable", "store_unreachable"]
    # a silence too young for the handshakes to have answered is not read as isolation
    young = _view({1: 1.5, 2: 1.6, 3: 1.7}, store_local=False, store_failed="timeout")
    assert observer_isolated(young) is None
