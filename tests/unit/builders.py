"""Builders of the diagnoser's inputs for synthetic tests: groups, rank summaries, per-peer
channel entries and one round's view, with the defaults a healthy rank would report."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ccld_plugin.diagnose.view import JobView
from ccld_plugin.wire.peer_channels import PeerChannel
from ccld_plugin.wire.summary import RankSummary
from ccld_plugin.wire.topology import GroupInfo, group_id_of

S = 1_000_000_000
MS = 1_000_000
NOW = 100 * S  # the diagnoser's clock in most tests


def group(role: str, ranks: Iterable[int]) -> GroupInfo:
    ranks = tuple(ranks)
    return GroupInfo(group_id_of(ranks), role, ranks)


def rank_summary(rank: int, time_ns: int = NOW, **fields: Any) -> RankSummary:
    """Rank ``rank``'s summary made at ``time_ns``: alive, at step 5, last progress now;
    ``fields`` override any of RankSummary's."""
    base: dict[str, Any] = dict(
        rank=rank,
        pid=1000 + rank,
        host="h",
        time_ns=time_ns,
        heartbeat_ns=time_ns,
        step=5,
        last_progress_ns=time_ns,
        groups_version=1,
    )
    return RankSummary(**{**base, **fields})


def peer_channel(peer: int, **fields: Any) -> PeerChannel:
    """One TCP connection to ``peer`` with nothing waiting; ``fields`` override."""
    base: dict[str, Any] = dict(
        peer=peer,
        wait="none",
        direction="send",
        conns=1,
        rtos=0,
        sent=0,
        received=0,
        queued=0,
        rtt_us=100,
        min_rtt_us=10,
        retrans=0,
        rwnd_share=0.0,
        sndbuf_share=0.0,
        busy_share=0.0,
        stalled_s=0.0,
    )
    return PeerChannel(**{**base, **fields})


def job_view(
    summaries: Iterable[RankSummary] | Mapping[int, RankSummary],
    tables: Mapping[int, list[GroupInfo]],
    now_ns: int = NOW,
    world: int | None = None,
    gone: Iterable[int] = (),
) -> JobView:
    """One diagnoser round's view of ``summaries`` (by rank) and the ranks' group tables."""
    by_rank = dict(summaries) if isinstance(summaries, Mapping) else {s.rank: s for s in summaries}
    return JobView(
        summaries=by_rank,
        tables=dict(tables),
        now_ns=now_ns,
        job_start_ns=0,
        world=len(by_rank) if world is None else world,
        gone=set(gone),
    )
