"""Point-to-point transfers: the two ends of each sampled message, paired (the slow port or
link they show: ``slow_messages``).

Each rank samples a few of its sends and receives per peer and tick (``agent._p2p_samples``),
the same seqs at both ends. A message whose send and receive have both been reported is
*paired*: its transfer runs from the later of the two entries (before that, one end
waited for the other to arrive: compute, not the network) to the receive's exit.

This is the evidence for the links of a pipeline with no sibling pipelines (DP=1): they
have no sibling links to be compared with, and their one-way flows leave the TCP channel
evidence ambiguous (a healthy pipeline link's send queue waits on delayed ACKs as long
as a shaped one's: ``slow_links``). Measured on TP1xPP4 (4 ranks, 2-core host), a send's
transfer took 10-19 ms on the links of a rank whose port was shaped to 30 Mbit/s, and
0.3-1.4 ms on the same links before the onset and on the pipeline's other links.

In jobs of up to PAIRED_MAX_RANKS ranks the messages of sibling pipelines are paired too:
there a pipeline connection's channel evidence against its siblings' is weak for the
same reason (TP2xPP2, one pipeline connection shaped to 30 Mbit/s: 1.9x its sibling by
the channels, 29 ms there and back against 3 ms by the messages).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np

from ccld_plugin.diagnose.view import GroupIndex, JobView
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.summary_batch import SummaryTable

__all__ = ["PAIRED_MAX_RANKS", "PENDING_TTL_NS", "P2PJoin", "Transfers"]

PENDING_TTL_NS = 20_000_000_000  # an end whose other end never comes is dropped after this
# Jobs up to this size pair the messages of every group; larger ones only those of a lone
# group (one pipeline). A job of thousands of ranks has siblings for every group, and its
# samples then cost a mask, not a sort. At this size (TP8xPP4xDP8, every rank sending the
# agent's most samples, 49 k rows a tick) pairing took 7-9 ms a round and judging a
# window 17 ms, on a 2-core VM.
PAIRED_MAX_RANKS = 256
_COLUMNS = ("group", "src", "dst", "seq", "sends", "enter_ns", "exit_ns", "bytes", "seen_ns")
Rows = dict[str, np.ndarray]


class Transfers(NamedTuple):
    """Paired messages as columns: sender, receiver, group (an index into the join's
    groups), seq, the receive's exit, the transfer time and the bytes. The two ends'
    times are on two ranks' clocks (each placed on the diagnoser's with some error: up
    to a few ms on a loaded host), so a transfer may even read below zero."""

    src: np.ndarray
    dst: np.ndarray
    group: np.ndarray
    seq: np.ndarray
    time_ns: np.ndarray
    transfer_ns: np.ndarray
    bytes: np.ndarray

    @classmethod
    def empty(cls) -> Transfers:
        return cls(*(np.zeros(0, np.int64) for _ in range(7)))

    @staticmethod
    def concat(parts: list[Transfers]) -> Transfers:
        return Transfers(*(np.concatenate(c) for c in zip(*parts, strict=True)))

    def where(self, keep: np.ndarray) -> Transfers:
        return self if keep.all() else Transfers(*(c[keep] for c in self))

    def since(self, t_ns: int) -> Transfers:
        return self.where(self.time_ns >= t_ns)

    def within(self, t0: int, t1: int) -> Transfers:
        return self.where((self.time_ns >= t0) & (self.time_ns <= t1))


class P2PJoin:
    """The ends waiting for their other end, and the groups they belong to: the messages
    of groups with no sibling group of their role (one pipeline), and in jobs of up to
    PAIRED_MAX_RANKS ranks every group's."""

    def __init__(self, index: GroupIndex) -> None:
        self.index = index
        self._pending: Rows = {c: np.zeros(0, np.int64) for c in _COLUMNS}
        self._lone: tuple[object, int, np.ndarray] | None = None  # cached per topology
        # per (rank, slot, peer, sends) packed in one int: the highest seq sampled so far
        self._taken: dict[int, int] = {}

    @property
    def groups(self) -> list[GroupInfo]:
        return self.index.groups

    def add(self, view: JobView, table: SummaryTable) -> Transfers:
        """Take in the point-to-point samples of ``table`` (summaries not seen before); the
        messages now paired."""
        rows = self._place(view, table)
        if len(self._pending["group"]):
            rows = {c: np.concatenate([self._pending[c], rows[c]]) for c in _COLUMNS}
        if not len(rows["group"]):
            return Transfers.empty()
        # by message (group, sender, receiver, seq), its receive before its send
        order = np.lexsort((rows["sends"], rows["seq"], rows["dst"], rows["src"], rows["group"]))
        o = {c: rows[c][order] for c in _COLUMNS}
        same = np.ones(len(order) - 1, bool)
        for c in ("group", "src", "dst", "seq"):
            same &= o[c][1:] == o[c][:-1]
        pair = same & (o["sends"][:-1] == 0) & (o["sends"][1:] == 1)
        recv = np.flatnonzero(pair)
        send = recv + 1
        paired = np.zeros(len(order), bool)
        paired[recv] = paired[send] = True
        waiting = ~paired & (view.now_ns - o["seen_ns"] < PENDING_TTL_NS)
        self._pending = {c: o[c][waiting] for c in _COLUMNS}
        start = np.maximum(o["enter_ns"][recv], o["enter_ns"][send])
        return Transfers(
            o["src"][recv],
            o["dst"][recv],
            o["group"][recv],
            o["seq"][recv],
            o["exit_ns"][recv],
            o["exit_ns"][recv] - start,
            np.maximum(o["bytes"][recv], o["bytes"][send]),
        )

    def _place(self, view: JobView, table: SummaryTable) -> Rows:
        p = table.p2p
        if not len(p):
            return {c: np.zeros(0, np.int64) for c in _COLUMNS}
        owner = table.p2p_rows
        rank = table.ranks[owner].astype(np.int64)
        group = self.index.lookup(view, rank, p["slot"].astype(np.int64))
        known = group >= 0
        if view.world > PAIRED_MAX_RANKS:
            known[known] = self._lone_groups(view)[group[known]]
        p, owner, rank, group = p[known], owner[known], rank[known], group[known]
        new = self._unseen(rank, p)
        p, owner, rank, group = p[new], owner[new], rank[new], group[new]
        peer = p["peer"].astype(np.int64)
        sends = p["sends"].astype(np.int64)
        enter = table.heads["time_ns"][owner] + p["rel_us"].astype(np.int64) * 1000
        return {
            "group": group,
            "src": np.where(sends == 1, rank, peer),
            "dst": np.where(sends == 1, peer, rank),
            "seq": p["seq"].astype(np.int64),
            "sends": sends,
            "enter_ns": enter,
            "exit_ns": enter + p["dur_us"].astype(np.int64) * 1000,
            "bytes": p["bytes"].astype(np.int64),
            "seen_ns": np.full(len(rank), view.now_ns, np.int64),
        }

    def _unseen(self, rank: np.ndarray, p: np.ndarray) -> np.ndarray:
        """Which samples were not taken before: a summary repeats its previous tick's (in
        case a round missed it), and a rank's seqs to (from) a peer in a group only grow,
        so a sample is new when its seq is above the highest taken before for its
        (rank, slot, peer, direction), and the first of its kind here."""
        slot, peer, sends = (p[c].astype(np.int64) for c in ("slot", "peer", "sends"))
        key = ((rank << 16 | slot) << 24 | peer) << 1 | sends
        seq = p["seq"].astype(np.int64)
        _, first = np.unique(np.stack([key, seq]), axis=1, return_index=True)
        keys, which = np.unique(key, return_inverse=True)
        taken = self._taken
        before = np.array([taken.get(k, -1) for k in keys.tolist()], np.int64)
        new = np.zeros(len(key), bool)
        new[first] = True
        new &= seq > before[which]
        top = before.copy()
        np.maximum.at(top, which, seq)
        taken.update(zip(keys.tolist(), top.tolist(), strict=True))
        return new

    def _lone_groups(self, view: JobView) -> np.ndarray:
        """Per group of the index: whether it is the only group of its role."""
        groups = self.groups
        cached = self._lone
        if cached is None or cached[0] is not view.topology or cached[1] != len(groups):
            roles = Counter(g.role for g in view.topology.groups.values())
            lone = np.array([roles[g.role] == 1 for g in groups], bool)
            cached = self._lone = (view.topology, len(groups), lone)
        return cached[2]

    def one_pipeline(self, view: JobView, transfers: Transfers) -> bool:
        """Whether every message of ``transfers`` ran in a lone group (its role's only
        one: a pipeline whose ranks have no other links)."""
        return bool(self._lone_groups(view)[np.unique(transfers.group)].all())
