"""Channel progress of this rank's NCCL collectives, as the profiler plugin left it.

The NCCL profiler plugin (``csrc/nccl_profiler.c``) keeps one board channel record per
in-flight (collective, channel, peer, direction): steps posted and done, bytes done, the
wait state of the oldest unfinished step and when anything last happened on it; and one
persistent totals record per (communicator, peer, direction) with the bytes and the time
steps spent in each wait (``csrc/nccl_links.c``). Every agent tick
:meth:`NcclChannels.sample` folds the records of one peer and direction into one summary
entry of source "nccl" (``peer_channels.PeerChannel``): ``diagnose.links.nccl_evidence`` reads
the wait states when a collective hangs, ``diagnose.links.slow_links`` the wait times per byte
over a window. Records of kernel channels (no peer) are left out: they say a kernel runs,
not what it waits for.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ccld_plugin.wire.codes import CHANNEL_TOTAL, SOURCE_NCCL, wait_name
from ccld_plugin.wire.peer_channels import WAIT_ORDER, PeerChannel

__all__ = ["NcclChannels"]


# The fields that tell one tracked connection from the next one reusing its slot.
_IDENTITY = ("pid", "group_id", "seq", "channel_id", "peer", "direction", "first_ns")


class NcclChannels:
    """Summary entries from the board's NCCL channel records; keeps what the records said
    at the last tick to report what moved in between. Not thread-safe: the agent thread
    calls it."""

    def __init__(self) -> None:
        self._last_bytes: dict[tuple[int, ...], int] = {}
        self._last_totals: dict[tuple[int, ...], tuple[int, int, int, int]] = {}

    def sample(self, records: np.ndarray, now_ns: int) -> list[PeerChannel]:
        """Entries for the channel records in use (``BoardReader.channels()``), at
        ``now_ns`` on the board's clock (monotonic); idle peers are left out."""
        recs = records[(records["source"] == SOURCE_NCCL) & (records["peer"] >= 0)]
        total = recs["channel_id"] == CHANNEL_TOTAL
        live: dict[tuple[int, int], list[np.void]] = defaultdict(list)
        moved: dict[tuple[int, int], int] = defaultdict(int)
        last: dict[tuple[int, ...], int] = {}
        for rec in recs[~total]:
            key = (int(rec["peer"]), int(rec["direction"]))
            ident = tuple(int(rec[f]) for f in _IDENTITY)
            done = int(rec["bytes_done"])
            moved[key] += max(0, done - self._last_bytes.get(ident, 0))
            last[ident] = done
            live[key].append(rec)
        self._last_bytes = last
        waits = self._totals(recs[total], moved)
        keys = sorted(set(live) | set(waits))
        out = [
            self._entry(
                peer,
                direction,
                live.get((peer, direction), []),
                moved[(peer, direction)],
                waits.get((peer, direction)),
                now_ns,
            )
            for peer, direction in keys
        ]
        return [e for e in out if e is not None]

    def _totals(
        self, recs: np.ndarray, moved: dict[tuple[int, int], int]
    ) -> dict[tuple[int, int], tuple[int, int, int]]:
        """Per (peer, direction): the (local, peer, network) wait in us since the last tick,
        from the per-link totals; their bytes replace the in-flight records' in ``moved``
        (an op's bytes reach the totals when it completes: counting both would count it
        twice)."""
        waits: dict[tuple[int, int], list[int]] = {}
        seen: dict[tuple[int, ...], tuple[int, int, int, int]] = {}
        for rec in recs:
            key = (int(rec["peer"]), int(rec["direction"]))
            ident = (int(rec["pid"]), int(rec["group_id"]), *key, int(rec["first_ns"]))
            now = (
                int(rec["bytes_done"]),
                int(rec["sndbuf_limited_us"]),
                int(rec["rwnd_limited_us"]),
                int(rec["busy_us"]),
            )
            before = self._last_totals.get(ident, (0, 0, 0, 0))
            d = [max(0, a - b) for a, b in zip(now, before, strict=True)]
            seen[ident] = now
            if key not in waits:
                waits[key] = [0, 0, 0]
                moved[key] = 0
            moved[key] += d[0]
            for i in range(3):
                waits[key][i] += d[i + 1]
        self._last_totals = seen
        return {k: (v[0], v[1], v[2]) for k, v in waits.items()}

    @staticmethod
    def _entry(
        peer: int,
        direction: int,
        rows: list[np.void],
        moved: int,
        waits: tuple[int, int, int] | None,
        now_ns: int,
    ) -> PeerChannel | None:
        pending = 0
        wait, stalled_ns = "none", 0
        steps_done = bytes_done = 0
        for r in rows:
            steps_done += int(r["steps_done"])
            bytes_done += int(r["bytes_done"])
            live = max(0, int(r["steps_posted"]) - int(r["steps_done"]))
            pending += live
            w = wait_name(int(r["wait"])) if live else "none"
            age = max(0, now_ns - int(r["last_progress_ns"])) if live else 0
            if WAIT_ORDER[w] > WAIT_ORDER[wait]:
                wait, stalled_ns = w, age
            elif w == wait:
                stalled_ns = max(stalled_ns, age)
        local_us, peer_us, net_us = waits or (0, 0, 0)
        if not pending and not moved and not (local_us or peer_us or net_us):
            return None
        # Steps of one connection have the same size: estimate the pending bytes from the
        # completed ones (at least one byte per step, so a pending step never reads as 0).
        per_step = bytes_done // steps_done if steps_done else 0
        send = direction == 0
        return PeerChannel(
            peer=peer,
            wait=wait,
            direction="send" if send else "recv",
            conns=len(rows),
            rtos=0,
            sent=moved if send else 0,
            received=0 if send else moved,
            queued=pending * max(1, per_step),
            rtt_us=0,
            min_rtt_us=0,
            retrans=0,
            rwnd_share=0.0,
            sndbuf_share=0.0,
            busy_share=0.0,
            stalled_s=stalled_ns / 1e9,
            source="nccl",
            local_wait_us=local_us,
            peer_wait_us=peer_us,
            net_wait_us=net_us,
        )
