"""One round's picture of the job: every rank's latest summary joined with its groups."""

from __future__ import annotations

from dataclasses import dataclass, field

from ccld_plugin.wire.codes import FLAG_P2P, FLAG_SEND, OP_NAMES
from ccld_plugin.wire.summary import InFlightOp, RankSummary
from ccld_plugin.wire.topology import GroupInfo, Topology

__all__ = ["Blocked", "JobView", "topology_of"]


def topology_of(tables: dict[int, list[GroupInfo]]) -> Topology:
    """The job's topology from every rank's group table."""
    topo = Topology()
    for table in tables.values():
        for g in table:
            topo.add(g)
    return topo


@dataclass(frozen=True)
class Blocked:
    """A rank's oldest in-flight op, resolved to its group."""

    rank: int
    op: InFlightOp
    group: GroupInfo
    age_s: float

    @property
    def p2p(self) -> bool:
        return bool(self.op.flags & FLAG_P2P)

    @property
    def sends(self) -> bool:
        return bool(self.op.flags & FLAG_SEND)

    @property
    def op_name(self) -> str:
        return OP_NAMES.get(self.op.op, "unknown")

    @property
    def trace_id(self) -> str:
        return f"{self.group.group_id:016x}:{self.op.seq}"


@dataclass
class JobView:
    summaries: dict[int, RankSummary]
    tables: dict[int, list[GroupInfo]]  # per rank: its group table, by slot
    now_ns: int
    job_start_ns: int
    world: int
    gone: set[int] = field(default_factory=set)  # ranks whose process no longer exists
    # Where the view is taken from: the rank whose diagnoser reads it (None for a
    # post-mortem), whether the store lives on its host, and why the store did not answer
    # this round (None: it did). A fault of the observer's own link shows only in these.
    observer: int | None = None
    store_local: bool = False
    store_failed: str | None = None
    # Built from the tables when not given; a caller whose tables did not change since the
    # last round passes the last one (at 16 k ranks it takes ~0.1 s to build).
    topology: Topology = None  # type: ignore[assignment]
    _resolved: dict[int, list[GroupInfo]] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.topology is None:
            self.topology = topology_of(self.tables)

    def seconds(self, ns: int) -> float:
        """A diagnoser-clock time as seconds since job start."""
        return round((ns - self.job_start_ns) / 1e9, 3)

    def groups_at(self, rank: int) -> list[GroupInfo]:
        """The rank's group table, by slot, as the topology knows each group (the most
        specific role any rank registered). Resolved once per rank and view: the slow
        detector looks up every arrival sample."""
        table = self._resolved.get(rank)
        if table is None:
            table = self._resolved[rank] = [
                self.topology.get(g.group_id) or g for g in self.tables.get(rank, [])
            ]
        return table

    def group(self, rank: int, slot: int) -> GroupInfo | None:
        table = self.groups_at(rank)
        return table[slot] if 0 <= slot < len(table) else None

    def entered_seq(self, rank: int, group_id: int) -> int | None:
        s = self.summaries.get(rank)
        if s is None:
            return None
        for gp in s.groups:
            g = self.group(rank, gp.slot)
            if g is not None and g.group_id == group_id:
                return gp.entered_seq
        return None

    def ops_of(self, rank: int, state: int | None = None) -> list[tuple[InFlightOp, GroupInfo]]:
        s = self.summaries.get(rank)
        out = []
        for op in s.in_flight if s else []:
            g = self.group(rank, op.slot)
            if g is not None and (state is None or op.state == state):
                out.append((op, g))
        return out

    def blocked(self) -> dict[int, Blocked]:
        """Each rank's oldest op still in flight (ranks in no op are absent)."""
        out = {}
        for rank in self.summaries:
            flights = self.ops_of(rank, state=1)
            if flights:
                op, g = min(flights, key=lambda x: x[0].enter_ns)
                out[rank] = Blocked(rank, op, g, max(0.0, (self.now_ns - op.enter_ns) / 1e9))
        return out

    def idle_s(self, rank: int) -> float:
        """Seconds since the rank last made progress (an op completed or a step began)."""
        s = self.summaries[rank]
        return max(0.0, (self.now_ns - s.last_progress_ns) / 1e9)
