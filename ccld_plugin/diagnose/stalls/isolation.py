"""The diagnoser's own rank, cut off: seen from where the diagnoser sits, a fault of its own
link looks like every other rank failing at once.

When the link of the rank that hosts the diagnoser goes down, the peers' summaries stop
arriving all together (the control plane crosses that link too, or the store it reaches
is gone), while the diagnoser's own summary, taken in this process, stays fresh. Judged
rank by rank, every peer then looks silent, cut off or unresponsive, and the one rank
that is healthy-looking is the culprit. The element all the silent ranks have in common
is the observer: :func:`observer_isolated` recognizes the pattern, and
:func:`isolation_hang` turns it into a communication hang on the observer once its own
op has waited past the hang threshold.

The pattern needs evidence that the observer's own contact is what failed, not the
peers': the store lives on the observer's host (the peers cannot reach that host), or a
remote store does not answer the observer while its own connections stall (a remote store
that still answers would have heard from peers that were alive and connected; one whose
host died silences everyone without stalling the observer's links).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ccld_plugin.diagnose.links import tcp_evidence as chan
from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.diagnose.view import JobView

__all__ = ["Isolation", "cut_off_behind_store", "isolation_hang", "observer_isolated"]

# "At once": the peers' last summaries lie within this many agent intervals of each other
# (a link cut between two ticks stops every peer within one interval; load adds a little).
AT_ONCE_INTERVALS = 3.0
MIN_PEERS = 2  # with one peer, either end of the pair may be the one cut off


@dataclass
class Isolation:
    """Every peer of ``observer`` silent at once: ``lost_ns`` is the newest of their last
    summaries (contact ended after it), ``spread_s`` how far apart they stopped."""

    observer: int
    peers: list[int]
    lost_ns: int
    spread_s: float


def observer_isolated(view: JobView) -> Isolation | None:
    """The pattern of the observer's own isolation in this view, or None."""
    obs = view.observer
    if obs is None or obs not in view.summaries:
        return None
    interval = chan.interval_s(view)
    if chan.is_silent(view, obs, interval):
        return None
    peers = sorted(r for r, s in view.summaries.items() if r != obs and not s.exited)
    if len(peers) < MIN_PEERS:
        return None
    # A process known gone is its own explanation; one still speaking breaks the pattern.
    if any(r in view.gone or not chan.is_silent(view, r, interval) for r in peers):
        return None
    last = [view.summaries[r].time_ns for r in peers]
    spread_s = (max(last) - min(last)) / 1e9
    if spread_s > AT_ONCE_INTERVALS * interval:
        return None
    if any(view.reach.get(r) for r in peers):
        return None  # a peer's host answers its handshake: its own link works
    if not view.store_local:
        if view.store_failed is None:
            return None
        # The observer's handshakes to the silent peers' hosts (control.reach) start once
        # they fall silent, and a reachable host answers within a round: give them two
        # intervals before reading the silence as the observer's own.
        if (view.now_ns - max(last)) / 1e9 < (chan.SILENT_INTERVALS + 2) * interval:
            return None
        # A remote store that went down (its host died) silences everyone too; only the
        # observer's own stalled connections, or no peer's host answering its handshakes
        # (the live hosts would), put the fault on its side.
        if not chan.stalled_links(view, [obs], to_anyone=True) and not _unreached(view, peers):
            return None
    return Isolation(obs, peers, max(last), spread_s)


def _unreached(view: JobView, peers: list[int]) -> list[int]:
    """The peers whose hosts the observer tried and none of which answered (``control.
    reach``; only counted once some handshake of the observer's was answered), or []."""
    tried = [r for r in peers if r in view.reach]
    return tried if len(tried) >= MIN_PEERS and not any(view.reach[r] for r in tried) else []


def _store_unreachable(view: JobView) -> Evidence:
    return Evidence.of(
        "store_unreachable",
        "the control-plane store does not answer rank {rank}: {error}",
        rank=view.observer,
        error=view.store_failed,
    )


def isolation_hang(
    view: JobView, iso: Isolation, threshold_s: Callable[[int], float]
) -> Verdict | None:
    """A communication hang on the isolated observer, once its own oldest op has waited
    past its group's threshold (None before: its training may still be between ops)."""
    b = view.blocked().get(iso.observer)
    if b is None or b.age_s < threshold_s(b.group.group_id):
        return None
    silent_s = (view.now_ns - iso.lost_ns) / 1e9
    evidence = [
        Evidence.of(
            "peers_silent_at_once",
            "the summaries of all {count} other ranks stopped within {spread_s:.1f} s of "
            "each other ({silent_s:.1f} s ago) while rank {rank}'s own go on: the element "
            "they have in common is rank {rank}, the diagnoser's",
            count=len(iso.peers),
            ranks=iso.peers,
            spread_s=iso.spread_s,
            silent_s=silent_s,
            rank=iso.observer,
        ),
        b.waits_in(),
    ]
    if view.store_failed is not None:
        evidence.append(_store_unreachable(view))
    unreached = _unreached(view, iso.peers)
    if unreached:
        evidence.append(
            Evidence.of(
                "peers_unreachable",
                "none of the hosts of ranks {ranks} answers a TCP handshake from rank {rank} "
                "(earlier ones from it were answered): rank {rank}'s own link is down",
                ranks=unreached,
                rank=iso.observer,
            )
        )
    stalls = chan.stalled_links(view, [iso.observer], to_anyone=True)
    evidence += [
        chan.stall_evidence(r, e, why)
        for r, e, why in sorted(stalls, key=lambda x: -x[1].stalled_s)[:4]
    ]
    if stalls and {why for _, _, why in stalls} == {"network"}:
        evidence.append(
            Evidence.of(
                "link_down",
                "the peers' kernels acknowledge nothing rank {rank} sends: a live kernel "
                "acknowledges even when its process stalls, so rank {rank}'s link is down",
                rank=iso.observer,
            )
        )
    return Verdict(
        kind=Kind.HANG,
        cause=Cause.COMMUNICATION,
        ranks=[iso.observer],
        group=b.group.to_dict(),
        op=b.op_name,
        trace_id=b.trace_id,
        step=view.summaries[iso.observer].step,
        onset_s=view.seconds(min(b.op.enter_ns, iso.lost_ns)),
        detected_s=view.seconds(view.now_ns),
        severity=round(b.age_s, 1),
        evidence=evidence,
    )


def cut_off_behind_store(view: JobView) -> list[Verdict]:
    """Every peer silent through a store that does not answer the observer, which is not
    isolated itself: the ranks whose hosts do not answer its handshakes while others'
    do (``control.reach``) are cut off, a communication hang on each (the store's host
    among them, typically: the peers' silence is the store's). Nothing where no
    handshake tells them apart."""
    obs = view.observer
    answered = sorted(r for r, ok in view.reach.items() if ok)
    lost = sorted(r for r, ok in view.reach.items() if not ok)
    if obs is None or obs not in view.summaries or not answered or not lost:
        return []
    mine = view.blocked().get(obs)
    stalls = chan.stalled_links(view, [obs], to_anyone=True)
    verdicts = []
    for rank in lost:
        s = view.summaries[rank]
        groups = view.groups_at(rank)
        group = mine.group if mine is not None and rank in mine.group.ranks else None
        if group is None and groups:
            group = max(groups, key=lambda g: g.size if g.role != "world" else 0)
        evidence = [
            Evidence.of(
                "host_unreachable",
                "rank {rank}'s host {host} does not answer a TCP handshake from the "
                "diagnoser (rank {observer}), while the hosts of ranks {answered} do: its "
                "link (or the host) is down",
                rank=rank,
                host=s.host,
                observer=obs,
                answered=answered,
            ),
            _store_unreachable(view),
            *(chan.stall_evidence(r, e, why) for r, e, why in stalls if e.peer == rank),
        ]
        verdicts.append(
            Verdict(
                kind=Kind.HANG,
                cause=Cause.COMMUNICATION,
                ranks=[rank],
                group=group.to_dict() if group is not None else None,
                op=mine.op_name if mine is not None and group is mine.group else None,
                step=s.step,
                onset_s=view.seconds(s.time_ns),
                detected_s=view.seconds(view.now_ns),
                severity=round((view.now_ns - s.time_ns) / 1e9, 1),
                evidence=evidence,
            )
        )
    return verdicts
