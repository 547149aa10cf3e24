"""Directed links' statistics over a window of channel reports, as columns.

At 16,384 ranks a window holds ~49,000 directed links (rank sends to peer). One object per
link, and a deque of them per link for its history, cost more than judging them: here a
window's links are the rows of a ``LinkTable``, their history a ring per link in
``LinkHistory``, and the sibling medians a link is judged against are bounded for every
link of a role at once (``spm_floors``); only the links a bound does not clear are judged
one by one, as ``LinkStats``.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

import numpy as np

from ccld_plugin.wire.codes import DIRECTION_SEND, SOURCE_NCCL, SOURCE_TCP
from ccld_plugin.wire.peer_channels import ChannelRows

__all__ = [
    "JIFFY_S",
    "SLOW_MIN_BYTES",
    "SLOW_MIN_TICKS",
    "LinkHistory",
    "LinkStats",
    "LinkTable",
    "nccl_links",
    "sibling_medians",
    "spm_floors",
    "tcp_links",
]

# Only intervals in which a link moved SLOW_MIN_BYTES count, and a link needs
# SLOW_MIN_TICKS of them (see slow_links).
SLOW_MIN_BYTES = 32 * 1024
SLOW_MIN_TICKS = 3
JIFFY_S = 0.004  # the coarsest kernel timer resolution in use (HZ=250)
HISTORY = 8  # windows of a link's own history kept


class LinkStats(NamedTuple):
    """One directed link (a sends to b) over a window: what a reported about it."""

    src: int
    dst: int
    ticks: int  # intervals in which it moved at least SLOW_MIN_BYTES
    rtt_us: float  # median smoothed RTT over those intervals
    floor_us: int
    s_per_mb: float  # seconds of non-empty send queue per MB acknowledged
    busy: float  # mean share of the intervals with a non-empty send queue
    queued: int  # most bytes queued at a sample
    retrans: int
    sent: int

    @property
    def pair(self) -> tuple[int, int]:
        return (min(self.src, self.dst), max(self.src, self.dst))


class LinkTable:
    """A window's directed links, one row each in (src, dst) order: the columns of
    ``LinkStats``."""

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        self.columns = columns
        self.src, self.dst = columns["src"], columns["dst"]
        self.rtt_us, self.s_per_mb = columns["rtt_us"], columns["s_per_mb"]

    def __len__(self) -> int:
        return len(self.src)

    def stats(self, i: int) -> LinkStats:
        return LinkStats(*(self.columns[f][i].item() for f in LinkStats._fields))

    def as_dict(self) -> dict[tuple[int, int], LinkStats]:
        """Every link as an object, by (src, dst) (a window with slow links: its ports)."""
        rows = zip(*(self.columns[f].tolist() for f in LinkStats._fields), strict=True)
        return {(c[0], c[1]): LinkStats(*c) for c in rows}

    def select(self, keep: np.ndarray) -> LinkTable:
        return LinkTable({f: c[keep] for f, c in self.columns.items()})


def _by_link(
    rank: np.ndarray, peer: np.ndarray, value: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The order of the rows by link (rank, peer), then by ``value`` (ties in the order
    given); each link's first row in that order and its number of rows. One sort of a
    packed key where the values' spans allow it (a sort of three keys costs several
    times more at hundreds of thousands of rows)."""
    parts = [rank.astype(np.int64), peer.astype(np.int64), value.astype(np.int64)]
    lows = [int(p.min()) for p in parts]
    spans = [int(p.max()) - lo + 1 for p, lo in zip(parts, lows, strict=True)]
    if spans[0] * spans[1] * spans[2] < 2**62:
        key = (parts[0] - lows[0]) * (spans[1] * spans[2])
        key += (parts[1] - lows[1]) * spans[2]
        key += parts[2] - lows[2]
        order = np.argsort(key, kind="stable")
    else:
        order = np.lexsort((value, peer, rank))
    r, p = rank[order], peer[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (r[1:] != r[:-1]) | (p[1:] != p[:-1])
    starts = np.flatnonzero(new)
    return order, starts, np.diff(np.append(starts, len(order)))


def tcp_links(rows: ChannelRows) -> LinkTable:
    """The TCP links that moved SLOW_MIN_BYTES in SLOW_MIN_TICKS of ``rows``' intervals."""
    e = rows.entries
    sent = e["sent"]
    rtt = e["rtt_us"]
    at = np.flatnonzero((e["source"] == SOURCE_TCP) & (sent >= SLOW_MIN_BYTES) & (rtt > 0))
    if not len(at):
        return _no_links()
    rank, peer, rtt = e["rank"][at], e["peer"][at], rtt[at]
    order, starts, counts = _by_link(rank, peer, rtt)
    at = at[order]
    rtt = e["rtt_us"][at].astype(np.float64)
    share = e["busy"][at] / 255
    # The kernel counts busy time in jiffies: an interval that moved data was busy for at
    # least about one, however little it shows.
    busy_s = np.add.reduceat(np.maximum(e["interval_s"][at] * share, JIFFY_S), starts)
    sent = np.add.reduceat(e["sent"][at].astype(np.int64), starts)
    enough = counts >= SLOW_MIN_TICKS
    columns = {
        "src": e["rank"][at][starts],
        "dst": e["peer"][at][starts],
        "ticks": counts,
        "rtt_us": (rtt[starts + (counts - 1) // 2] + rtt[starts + counts // 2]) / 2,
        "floor_us": np.minimum.reduceat(e["min_rtt_us"][at], starts),
        "s_per_mb": busy_s / (sent / 1e6),
        "busy": np.add.reduceat(share, starts) / counts,
        "queued": np.maximum.reduceat(e["queued"][at], starts),
        "retrans": np.add.reduceat(e["retrans"][at].astype(np.int64), starts),
        "sent": sent,
    }
    return LinkTable({f: c[enough] for f, c in columns.items()})


def nccl_links(rows: ChannelRows) -> LinkTable:
    """NCCL send links over ``rows``: ``s_per_mb`` is the time their steps spent handed to
    the network per MB sent, ``busy`` that time over the intervals."""
    e = rows.entries
    at = np.flatnonzero(
        (e["source"] == SOURCE_NCCL)
        & (e["direction"] == DIRECTION_SEND)
        & (e["sent"] >= SLOW_MIN_BYTES)
    )
    if not len(at):
        return _no_links()
    order, starts, counts = _by_link(e["rank"][at], e["peer"][at], e["sent"][at])
    at = at[order]
    sent = np.add.reduceat(e["sent"][at].astype(np.int64), starts)
    wait_s = np.add.reduceat(e["net_wait_us"][at].astype(np.float64), starts) / 1e6
    span_s = np.maximum(np.add.reduceat(e["interval_s"][at], starts), 1e-9)
    enough = counts >= SLOW_MIN_TICKS
    none = np.zeros(len(starts), np.int64)
    columns = {
        "src": e["rank"][at][starts],
        "dst": e["peer"][at][starts],
        "ticks": counts,
        "rtt_us": np.zeros(len(starts)),
        "floor_us": none,
        "s_per_mb": wait_s / (sent / 1e6),
        "busy": wait_s / span_s,
        "queued": none,
        "retrans": none,
        "sent": sent,
    }
    return LinkTable({f: c[enough] for f, c in columns.items()})


def _no_links() -> LinkTable:
    floats = ("rtt_us", "s_per_mb", "busy")
    return LinkTable(
        {f: np.zeros(0, np.float64 if f in floats else np.int64) for f in LinkStats._fields}
    )


def spm_floors(role: np.ndarray, links: LinkTable) -> np.ndarray:
    """Per link: a lower bound of the median time per MB of the links of its role (``role``
    per link) that share no rank with it, from counts alone: at most the links touching
    either end are left out (itself among both ends'), and leaving out more values can
    only lower the median. NaN: maybe no link is left."""
    n = len(links)
    ranks = int(max(links.src.max(initial=-1), links.dst.max(initial=-1))) + 1
    roles = int(role.max(initial=-1)) + 1
    two_ends = links.dst != links.src
    touching = np.bincount(
        np.concatenate([role * ranks + links.src, (role * ranks + links.dst)[two_ends]]),
        minlength=roles * ranks,
    )
    count = np.bincount(role, minlength=roles)
    left = count[role] - touching[role * ranks + links.src] + 1
    left -= np.where(two_ends, touching[role * ranks + links.dst], 1)
    order = np.lexsort((links.s_per_mb, role))
    start = np.searchsorted(role[order], role)
    out = np.full(n, np.nan)
    some = left >= 1
    out[some] = links.s_per_mb[order][start[some] + (left[some] - 1) // 2]
    return out


def sibling_medians(role: np.ndarray, links: LinkTable, i: int) -> tuple[float, float] | None:
    """(median RTT, median s per MB) of the links of link ``i``'s role that share no rank
    with it; None when every one does (the medians of the middle values, as
    ``statistics.median`` takes them)."""
    a, b = int(links.src[i]), int(links.dst[i])
    src, dst = links.src, links.dst
    others = (role == role[i]) & (src != a) & (dst != a) & (src != b) & (dst != b)
    if not others.any():
        return None
    return _median(links.rtt_us[others]), _median(links.s_per_mb[others])


def _median(values: np.ndarray) -> float:
    v = np.sort(values)
    n = len(v)
    return float((v[(n - 1) // 2] + v[n // 2]) / 2)


class LinkHistory:
    """Per directed link, (RTT, s per MB) of its last HISTORY windows judged healthy: the
    reference of a link without siblings. One ring row per link ever judged, found by its
    (src, dst) packed into one key."""

    def __init__(self) -> None:
        self._keys = np.zeros(0, np.int64)  # sorted
        self._rows = np.zeros(0, np.int64)  # per key: its ring
        self._rtt = np.zeros((0, HISTORY))
        self._spm = np.zeros((0, HISTORY))
        self._filled = np.zeros(0, np.int64)
        self._next = np.zeros(0, np.int64)

    def append(self, links: LinkTable, keep: np.ndarray | None = None) -> None:
        """This window's figures of ``links`` (those where ``keep``, when given)."""
        if keep is not None:
            links = links.select(keep)
        if not len(links):
            return
        rows = self._rows_of(_key(links.src, links.dst), add=True)
        at = self._next[rows]
        self._rtt[rows, at] = links.rtt_us
        self._spm[rows, at] = links.s_per_mb
        self._next[rows] = (at + 1) % HISTORY
        self._filled[rows] = np.minimum(self._filled[rows] + 1, HISTORY)

    def ref(self, src: int, dst: int) -> tuple[float, float] | None:
        """(median RTT, median s per MB) of the link's history; None: it has none."""
        (row,) = self._rows_of(_key(np.array([src]), np.array([dst])), add=False).tolist()
        n = int(self._filled[row]) if row >= 0 else 0
        if not n:
            return None
        return (
            statistics.median(self._rtt[row, :n].tolist()),
            statistics.median(self._spm[row, :n].tolist()),
        )

    def _rows_of(self, keys: np.ndarray, add: bool) -> np.ndarray:
        """The ring of each key (-1: none; with ``add``, new keys get one)."""
        if not len(self._keys) and not add:
            return np.full(len(keys), -1, np.int64)
        at = np.searchsorted(self._keys, keys)
        found = at < len(self._keys)
        found[found] = self._keys[at[found]] == keys[found]
        if add and not found.all():
            new = np.sort(keys[~found])  # a table's links are distinct
            first = len(self._filled)
            self._keys = np.concatenate([self._keys, new])
            self._rows = np.concatenate([self._rows, first + np.arange(len(new))])
            order = np.argsort(self._keys, kind="stable")
            self._keys, self._rows = self._keys[order], self._rows[order]
            grow = np.zeros((len(new), HISTORY))
            self._rtt = np.concatenate([self._rtt, grow])
            self._spm = np.concatenate([self._spm, grow])
            self._filled = np.concatenate([self._filled, np.zeros(len(new), np.int64)])
            self._next = np.concatenate([self._next, np.zeros(len(new), np.int64)])
            return self._rows_of(keys, add=False)
        return np.where(found, self._rows[np.minimum(at, len(self._rows) - 1)], -1)


def _key(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    return src.astype(np.int64) << 32 | dst.astype(np.int64)
