"""Builders of the diagnoser's inputs for synthetic tests: groups, rank summaries, per-peer
channel entries and one round's view, with the defaults a healthy rank would report; and
:func:`facts`, to read the diagnoser's evidence by fact."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ccld_plugin.diagnose.records import Evidence
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo, group_id_of
from ccld_plugin.wire.peer_channels import PeerChannel
from ccld_plugin.wire.summary import RankSummary

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
    **where: Any,
) -> JobView:
    """One diagnoser round's view of ``summaries`` (by rank) and the ranks' group tables;
    ``where``: the observer's side of it (observer, store_failed, reach, ...)."""
    by_rank = dict(summaries) if isinstance(summaries, Mapping) else {s.rank: s for s in summaries}
    return JobView(
        summaries=by_rank,
        tables=dict(tables),
        now_ns=now_ns,
        job_start_ns=0,
        world=len(by_rank) if world is None else world,
        gone=set(gone),
        **where,
    )


def facts(evidence: Iterable[Evidence | Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Evidence items by fact, in order, each as its record ``{"fact", "text", "data"}``
    (Evidence objects or the records of verdicts.jsonl): tests assert on the data."""
    out: dict[str, list[dict[str, Any]]] = {}
    for e in evidence:
        rec = e.to_dict() if isinstance(e, Evidence) else dict(e)
        out.setdefault(rec["fact"], []).append(rec)
    return out


def rank_board(
    rank: int,
    world: int,
    groups: list[GroupInfo],
    ops: Iterable[Mapping[str, Any]] = (),
    heartbeat_ns: int = NOW,
    offset_ns: int = 0,
    **header: Any,
) -> Any:
    """A post-mortem's board of rank ``rank`` (``postmortem.boards.RankBoard``), as its
    files would read: ``ops`` are dicts of op (name), slot, seq, enter_ns and exit_ns
    (None: still in flight), optionally step and state; times on the rank's own clock,
    ``offset_ns`` ahead of the diagnoser's. ``header`` overrides BoardHeader's fields."""
    # imported here: the diagnoser's tests use this module without the native module
    from pathlib import Path

    import numpy as np

    from ccld_plugin.agent.board_summary import BoardSnapshot
    from ccld_plugin.board.reader import CHANNEL_DTYPE, GROUP_DTYPE, OP_DTYPE, BoardHeader
    from ccld_plugin.postmortem.boards import RankBoard
    from ccld_plugin.wire.codes import OP_CODES, STATE_DONE, STATE_IN_FLIGHT

    ops = list(ops)
    recs = np.zeros(len(ops), OP_DTYPE)
    for rec, o in zip(recs, ops, strict=True):
        done = o.get("exit_ns") is not None
        rec["op"] = OP_CODES[o.get("op", "all_reduce")]
        rec["group_slot"] = o.get("slot", 0)
        rec["group_id"] = groups[o.get("slot", 0)].group_id
        rec["seq"], rec["step"] = o["seq"], o.get("step", 5)
        rec["enter_ns"], rec["exit_ns"] = o["enter_ns"], o.get("exit_ns") or 0
        rec["state"] = o.get("state", STATE_DONE if done else STATE_IN_FLIGHT)
    table = np.zeros(len(groups), GROUP_DTYPE)
    for slot, rec in enumerate(table):
        mine = [o for o in ops if o.get("slot", 0) == slot]
        rec["entered_seq"] = max((o["seq"] for o in mine), default=0)
        rec["completed_seq"] = max((o["seq"] for o in mine if o.get("exit_ns")), default=0)
    fields: dict[str, Any] = dict(
        rank=rank,
        world=world,
        pid=1000 + rank,
        host="h",
        job="j",
        start_wall_ns=0,
        start_mono_ns=offset_ns,
        heartbeat_ns=heartbeat_ns,
        step=5,
        step_start_ns=0,
        ops_written=len(ops),
        errors=0,
        clock_offset_ns=offset_ns,
        closed=False,
    )
    snap = BoardSnapshot(BoardHeader(**{**fields, **header}), recs, table)
    return RankBoard(
        Path(f"rank{rank}.board"),
        snap,
        list(groups),
        np.zeros(0, CHANNEL_DTYPE),
        stack=[],
        crash=[],
    )
