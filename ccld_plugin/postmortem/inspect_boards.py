"""Reports read from board files: each rank's state (``ccld inspect``) and the collectives
per group (the demo's table). Works on boards of live, hung and killed ranks."""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from rich.console import Console
from rich.table import Table

from ccld_plugin.board.reader import BoardError, BoardReader, board_files
from ccld_plugin.files import one_line
from ccld_plugin.wire.codes import (
    FLAG_P2P,
    OP_NAMES,
    SOURCE_NAMES,
    STATE_DONE,
    STATE_IN_FLIGHT,
    wait_name,
)

__all__ = [
    "GroupOps",
    "Inspection",
    "RankStatus",
    "collective_table",
    "corrupt_warning",
    "inspect_all",
    "inspect_boards",
    "print_collectives",
    "print_status",
]


MAX_CHANNELS_SHOWN = 3  # per rank in the table; the JSON output has all


@dataclass
class InFlight:
    op: str
    group_role: str
    group_ranks: list[int]
    seq: int
    peer: int | None
    age_s: float


@dataclass
class WaitingChannel:
    """A channel record with work outstanding: NCCL steps posted and not done, or TCP
    bytes queued (what a hung rank's transfers waited on when the board was read)."""

    source: str  # nccl or tcp
    channel: int
    direction: str
    peer: int | None
    wait: str  # none / local / peer / network
    pending: str  # "N steps" (NCCL) or bytes queued (TCP)
    group_id: str
    seq: int
    idle_s: float  # since the record last changed


@dataclass
class RankStatus:
    path: str
    rank: int
    world: int
    pid: int
    host: str
    process: str  # alive, dead, exited (closed cleanly), remote (another host)
    step: int
    heartbeat_age_s: float
    ops_recorded: int
    errors: int
    groups: list[dict] = field(default_factory=list)
    in_flight: list[InFlight] = field(default_factory=list)
    waiting_channels: list[WaitingChannel] = field(default_factory=list)
    # records left out per table (groups, ops, channels) as failing their checks
    corrupt_records: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Inspection:
    """The boards at a path: the status of each that could be read, and why the others
    could not."""

    statuses: list[RankStatus]
    unreadable: list[str]


def _process_state(pid: int, host: str, closed: bool) -> str:
    if closed:
        return "exited"
    if host and host != os.uname().nodename:
        return "remote"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except PermissionError:
        return "alive"
    return "alive"


def rank_status(reader: BoardReader, now_ns: int | None = None) -> RankStatus:
    now = time.monotonic_ns() if now_ns is None else now_ns
    h = reader.header()
    groups = reader.groups()
    table = reader.group_table()
    by_id = {g.group_id: g for g in groups}
    status = RankStatus(
        path=str(reader.path),
        rank=h.rank,
        world=h.world,
        pid=h.pid,
        host=h.host,
        process=_process_state(h.pid, h.host, h.closed),
        step=h.step,
        heartbeat_age_s=max(0.0, (now - h.heartbeat_ns) / 1e9),
        ops_recorded=h.ops_written,
        errors=h.errors,
    )
    for g, rec in zip(groups, table, strict=True):
        status.groups.append(
            {
                "role": g.role,
                "ranks": list(g.ranks),
                "group_id": f"{g.group_id:016x}",
                "entered_seq": int(rec["entered_seq"]),
                "completed_seq": int(rec["completed_seq"]),
            }
        )
    ops = reader.ops()
    for r in ops[ops["state"] == STATE_IN_FLIGHT]:
        info = by_id.get(int(r["group_id"]))  # None for a group not registered (yet)
        status.in_flight.append(
            InFlight(
                op=OP_NAMES.get(int(r["op"]), "unknown"),
                group_role=info.role if info else "?",
                group_ranks=list(info.ranks) if info else [],
                seq=int(r["seq"]),
                peer=int(r["peer"]) if int(r["flags"]) & FLAG_P2P else None,
                age_s=max(0.0, (now - int(r["enter_ns"])) / 1e9),
            )
        )
    status.waiting_channels = _waiting_channels(reader.channels(), now)
    status.corrupt_records = {table: n for table, n in reader.corrupt.items() if n}
    return status


def _waiting_channels(recs: np.ndarray, now: int) -> list[WaitingChannel]:
    out = []
    for r in recs:
        source = SOURCE_NAMES.get(int(r["source"]), "?")
        steps = int(r["steps_posted"]) - int(r["steps_done"])
        if source == "nccl" and steps > 0:
            pending = f"{steps} step{'s' if steps != 1 else ''}"
        elif source == "tcp" and int(r["bytes_queued"]) > 0:
            pending = f"{int(r['bytes_queued'])} B"
        else:
            continue
        peer = int(r["peer"])
        out.append(
            WaitingChannel(
                source=source,
                channel=int(r["channel_id"]),
                direction="recv" if int(r["direction"]) else "send",
                peer=peer if peer >= 0 else None,
                wait=wait_name(int(r["wait"]), "?"),
                pending=pending,
                group_id=f"{int(r['group_id']):016x}",
                seq=int(r["seq"]),
                idle_s=max(0.0, (now - int(r["last_progress_ns"])) / 1e9),
            )
        )
    return sorted(out, key=lambda c: -c.idle_s)


def inspect_all(path: str | os.PathLike[str]) -> Inspection:
    """Every board at ``path`` (a file or a directory of them). A file that is no
    readable board raises BoardError; in a directory it is listed as unreadable and the
    others are read."""
    unreadable: list[str] = []
    files = board_files(path, unreadable)
    if not files:
        raise BoardError(unreadable[0] if unreadable else f"{path}: no board files (*.board) here")
    statuses = []
    for f in files:
        try:
            with BoardReader(f) as reader:
                statuses.append(rank_status(reader))
        except BoardError as exc:
            if len(files) == 1 and not unreadable:
                raise
            unreadable.append(str(exc))
    return Inspection(sorted(statuses, key=lambda s: s.rank), unreadable)


def corrupt_warning(path: str, corrupt: dict[str, int]) -> str:
    """The line that says a board had records left out as corrupt (``corrupt``: how many
    per table), in every command that reads boards."""
    counts = ", ".join(f"{n} {table}" for table, n in corrupt.items())
    return one_line(
        f"{path}: corrupt records left out ({counts}); the board is damaged, what is shown "
        "passed its checks"
    )


def inspect_boards(path: str | os.PathLike[str]) -> list[RankStatus]:
    """Status of every board at ``path``; BoardError when one of them cannot be read."""
    found = inspect_all(path)
    if found.unreadable:
        raise BoardError(found.unreadable[0])
    return found.statuses


def print_status(statuses: Sequence[RankStatus], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="ccld boards", show_lines=False)
    columns = [
        "rank",
        "pid",
        "process",
        "step",
        "heartbeat",
        "groups (role: entered/done)",
        "in flight",
    ]
    show_channels = any(s.waiting_channels for s in statuses)
    if show_channels:
        columns.append("waiting channels")
    show_corrupt = any(s.corrupt_records for s in statuses)
    if show_corrupt:
        columns.append("corrupt records (not shown)")
    for col in columns:
        table.add_column(col)
    for s in statuses:
        groups = ", ".join(
            f"{g['role']}{g['ranks']}: {g['entered_seq']}/{g['completed_seq']}" for g in s.groups
        )
        flight = (
            "; ".join(
                f"{f.op} on {f.group_role}{f.group_ranks} seq {f.seq}"
                + (f" peer {f.peer}" if f.peer is not None else "")
                + f" for {f.age_s:.1f}s"
                for f in s.in_flight
            )
            or "-"
        )
        row = [
            str(s.rank),
            str(s.pid),
            s.process,
            str(s.step),
            f"{s.heartbeat_age_s:.1f}s ago",
            groups,
            flight,
        ]
        if show_channels:
            shown = s.waiting_channels[:MAX_CHANNELS_SHOWN]
            more = len(s.waiting_channels) - len(shown)
            row.append(
                "; ".join(
                    f"{c.source} ch{c.channel} {c.direction} "
                    f"{'->' if c.direction == 'send' else '<-'} {c.peer}: {c.pending}, waits "
                    f"{c.wait}, {c.idle_s:.1f}s"
                    for c in shown
                )
                + (f"; +{more} more" if more else "")
                or "-"
            )
        if show_corrupt:
            row.append(", ".join(f"{n} {t}" for t, n in s.corrupt_records.items()) or "-")
        table.add_row(*row)
    console.print(table)


@dataclass
class GroupOps:
    role: str
    ranks: list[int]
    group_id: str
    op_counts: dict[str, int]
    bytes: int
    mean_duration_ms: float


def collective_table(path: str | os.PathLike[str]) -> list[GroupOps]:
    """Collectives per group, over every board at ``path``: op counts and bytes as one
    member saw them, mean duration over all members' completed records."""
    counts: dict[int, Counter] = defaultdict(Counter)
    nbytes: dict[int, Counter] = defaultdict(Counter)
    durations: dict[int, list[np.ndarray]] = defaultdict(list)
    infos = {}
    for f in board_files(path):
        with BoardReader(f) as reader:
            rank = reader.header().rank
            for g in reader.groups():
                infos[g.group_id] = g
            ops = reader.ops()
            done = ops[ops["state"] == STATE_DONE]
            for gid in np.unique(ops["group_id"]):
                sel = ops[ops["group_id"] == gid]
                names = Counter(OP_NAMES.get(int(c), "unknown") for c in sel["op"])
                if sum(names.values()) > sum(counts[int(gid)].values()):
                    counts[int(gid)] = names
                nbytes[int(gid)][rank] = int(sel["bytes"].sum())
                d = done[done["group_id"] == gid]
                durations[int(gid)].append((d["exit_ns"] - d["enter_ns"]) / 1e6)
    rows = []
    for gid, info in infos.items():
        if gid not in counts:
            continue
        d = np.concatenate(durations[gid]) if durations[gid] else np.array([])
        rows.append(
            GroupOps(
                role=info.role,
                ranks=list(info.ranks),
                group_id=f"{gid:016x}",
                op_counts=dict(counts[gid]),
                bytes=max(nbytes[gid].values()),
                mean_duration_ms=float(d.mean()) if d.size else 0.0,
            )
        )
    order = {"world": 0, "tp": 1, "cp": 2, "ep": 3, "dp": 4, "pp": 5}
    return sorted(rows, key=lambda r: (order.get(r.role, 9), r.ranks))


def print_collectives(rows: Sequence[GroupOps], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="collectives per group (from the rank boards)")
    for col in ("role", "ranks", "ops", "bytes / member", "mean duration"):
        table.add_column(col)
    for r in rows:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(r.op_counts.items()))
        table.add_row(
            r.role, str(r.ranks), ops, _human_bytes(r.bytes), f"{r.mean_duration_ms:.2f} ms"
        )
    console.print(table)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
