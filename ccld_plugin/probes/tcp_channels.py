"""Channel progress of this rank's TCP connections, sampled every agent tick.

Each tick the agent calls :meth:`ChannelSampler.tick`, which

1. samples this process's TCP connections with the native probe (``tcp_probe.TcpProbe``:
   one cheap exact-lookup refresh per tick, a kernel dump only when sockets appear);
2. drops the control plane's own connections (the TCPStore's port), which are not data
   channels of the job;
3. publishes this rank's local endpoints through the control plane when they change, and
   maps each connection to the peer rank whose published endpoint is its remote end
   (``tcp_peers.map_peers``), re-reading the peers' endpoints while some connection is
   still unmapped, with back-off;
4. classifies, from the previous sample of each connection, what it waited on
   (``tcp_wait.classify_wait``: peer not reading, network, local, none);
5. writes one channel record per connection into the board's channel table (what
   ``ccld inspect`` and a post-mortem read), claiming and releasing slots as connections
   come and go;
6. returns the compact per-peer evidence for the summary (``peer_channels``).

Every failure is contained: the tick then returns no evidence and training goes on.
``CCLD_CHANNEL_TRACE=DIR`` appends each tick's per-peer entries to ``DIR/rank<r>.jsonl``
(for calibrating thresholds; off by default).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccld_plugin.errors import log, report_error
from ccld_plugin.probes.tcp_peers import map_peers
from ccld_plugin.probes.tcp_probe import LIBRARY_GLOB, TcpConn, TcpProbe, find_library
from ccld_plugin.probes.tcp_wait import classify_wait
from ccld_plugin.wire.codes import DIRECTION_RECV, DIRECTION_SEND, SOURCE_TCP, WAIT_CODES
from ccld_plugin.wire.peer_channels import (
    MAX_ENTRIES,
    WAIT_ORDER,
    PeerChannel,
    encode_channels,
    entry_order,
)

__all__ = ["ChannelSample", "ChannelSampler", "channel_fields", "store_ports"]

REMAP_MIN_S = 1.0
REMAP_MAX_S = 30.0
REMAP_YOUNG_S = 30.0  # unmapped connections younger than this are retried every REMAP_MIN_S
_NO_PEER = -1


@dataclass(frozen=True)
class ChannelSample:
    """One tick's per-peer entries (worst first), the interval they cover and how many
    connections are mapped to peer ranks."""

    entries: list[PeerChannel]
    interval_s: float
    conns: int


@dataclass
class _Conn:
    prev: TcpConn
    slot: int
    peer: int
    first_ns: int
    progress_ns: int  # last sample at which bytes moved either way
    acked_ns: int  # last sample at which nothing was queued or the peer acknowledged more
    wait: str = "none"
    written_peer: int = _NO_PEER  # the peer its board record names


def _idle(st: _Conn, prev: TcpConn, cur: TcpConn) -> bool:
    """Nothing moved, nothing is pending either way, and its board record is current."""
    return (
        st.wait == "none"
        and st.written_peer == st.peer
        and cur.queued_bytes == 0
        and cur.unread_bytes == 0
        and cur.bytes_acked == prev.bytes_acked
        and cur.bytes_received == prev.bytes_received
        and cur.retrans == prev.retrans
        and cur.state == prev.state
    )


def _key(c: TcpConn) -> tuple[int, int]:
    return (c.cookie, c.inode)


def store_ports(control: Any) -> set[int]:
    """Ports of the TCPStores the control plane and the job use: connections to them are
    the control plane's, not data channels between ranks."""
    ports = set()
    with contextlib.suppress(ValueError):
        ports.add(int(os.environ.get("MASTER_PORT", "")))
    store = getattr(control, "store", None)
    for _ in range(8):  # unwrap PrefixStores down to the TCPStore
        if store is None:
            break
        port = getattr(store, "port", None)
        if isinstance(port, int):
            ports.add(port)
            break
        store = getattr(store, "underlying_store", None)
    return ports


def _default_probe() -> TcpProbe:
    try:
        return TcpProbe()
    except FileNotFoundError:
        # An editable install keeps the built library next to the extension module.
        import ccld_plugin._native as _native

        return TcpProbe(find_library(next(Path(_native.__file__).parent.glob(LIBRARY_GLOB))))


class ChannelSampler:
    """Samples, maps, classifies and records this rank's TCP connections; see the module
    docstring. Not thread-safe: the agent thread calls it (and the exit path after the
    thread has stopped)."""

    def __init__(
        self,
        board: Any,
        control: Any,
        rank: int,
        world: int,
        probe: TcpProbe | None = None,
        exclude_ports: Iterable[int] = (),
        trace_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.board = board
        self.control = control
        self.rank = rank
        self.world = world
        self.probe = probe or _default_probe()
        self.exclude_ports = set(exclude_ports)
        self._conns: dict[tuple[int, int], _Conn] = {}
        self._published: frozenset[tuple[str, int]] | None = None
        self._endpoints: dict[int, list[tuple[str, int]]] = {}
        self._remap_at = 0.0
        self._read_at = -REMAP_MIN_S  # when the peers' endpoints were last read
        self._remap_backoff = REMAP_MIN_S
        self._trace = Path(trace_dir) / f"rank{rank}.jsonl" if trace_dir else None
        self.costs_ns: deque[int] = deque(maxlen=1024)  # wall time of each tick

    @classmethod
    def create(cls, board: Any, control: Any, rank: int, world: int) -> ChannelSampler | None:
        """A sampler for the agent, or None (logged once) where the probe cannot run."""
        try:
            return cls(
                board,
                control,
                rank,
                world,
                exclude_ports=store_ports(control),
                trace_dir=os.environ.get("CCLD_CHANNEL_TRACE") or None,
            )
        except Exception as exc:  # noqa: BLE001 - no channel evidence, training goes on
            report_error("channels.init", exc)
            return None

    # ------------------------------------------------------------------ tick
    def tick(self) -> bytes:
        """One sample as the summary's ``channels`` bytes (empty on failure)."""
        got = self.sample()
        return encode_channels(got.entries, got.interval_s, got.conns) if got else b""

    def sample(self) -> ChannelSample | None:
        """One sample; None on failure (logged once, counted)."""
        t0 = time.perf_counter_ns()
        try:
            return self._sample()
        except Exception as exc:  # noqa: BLE001
            report_error("channels.tick", exc)
            return None
        finally:
            self.costs_ns.append(time.perf_counter_ns() - t0)

    def _sample(self) -> ChannelSample:
        conns = [
            c
            for c in self.probe.sample()
            if c.local[1] not in self.exclude_ports and c.remote[1] not in self.exclude_ports
        ]
        self._publish_endpoints(conns)
        seen: set[tuple[int, int]] = set()
        fresh: list[TcpConn] = []
        deltas: list[tuple[_Conn, TcpConn | None, TcpConn]] = []
        for c in conns:
            k = _key(c)
            seen.add(k)
            st = self._conns.get(k)
            if st is None:
                slot = self.board.channel_claim(2)  # CCLD_SRC_TCP; -1 when the table is full
                st = _Conn(c, slot, _NO_PEER, c.sample_ns, c.sample_ns, c.sample_ns)
                self._conns[k] = st
                fresh.append(c)
                deltas.append((st, None, c))
            else:
                deltas.append((st, st.prev, c))
        for k in [k for k in self._conns if k not in seen]:
            self.board.channel_release(self._conns.pop(k).slot)
        self._map(fresh)
        per_peer: dict[int, list[tuple[_Conn, TcpConn | None, TcpConn]]] = {}
        n_conns: dict[int, int] = {}
        for st, prev, cur in deltas:
            if st.peer != _NO_PEER:
                n_conns[st.peer] = n_conns.get(st.peer, 0) + 1
            if prev is not None and _idle(st, prev, cur):
                # Most connections of a large job are idle in a tick: nothing to classify,
                # no record to rewrite, nothing for the summary.
                st.prev, st.acked_ns = cur, cur.sample_ns
                continue
            self._advance(st, prev, cur)
            if st.peer != _NO_PEER:
                per_peer.setdefault(st.peer, []).append((st, prev, cur))
        entries = [
            e
            for e in (self._entry(p, rows, n_conns[p]) for p, rows in per_peer.items())
            if e is not None
        ]
        entries.sort(key=entry_order)
        entries = entries[:MAX_ENTRIES]
        interval = (
            max(
                (cur.sample_ns - prev.sample_ns) / 1e9
                for _, prev, cur in deltas
                if prev is not None
            )
            if any(p is not None for _, p, _ in deltas)
            else 0.0
        )
        if self._trace is not None:
            self._write_trace(entries, interval)
        mapped = sum(1 for st in self._conns.values() if st.peer != _NO_PEER)
        return ChannelSample(entries, interval, mapped)

    def _advance(self, st: _Conn, prev: TcpConn | None, cur: TcpConn) -> None:
        if prev is not None and cur.sample_ns > prev.sample_ns:
            st.wait = classify_wait(prev, cur)
            if cur.bytes_acked > prev.bytes_acked or cur.bytes_received > prev.bytes_received:
                st.progress_ns = cur.sample_ns
            if cur.queued_bytes == 0 or cur.bytes_acked > prev.bytes_acked:
                st.acked_ns = cur.sample_ns
        st.prev, st.written_peer = cur, st.peer
        fields = channel_fields(cur, st.wait, st.peer)
        self.board.channel_write(
            st.slot, **fields, first_ns=st.first_ns, last_progress_ns=st.progress_ns
        )

    def _entry(
        self, peer: int, rows: list[tuple[_Conn, TcpConn | None, TcpConn]], conns: int
    ) -> PeerChannel | None:
        """One peer's connections over the interval, as one summary entry."""
        sent = recv = retrans = queued = unread = rtos = 0
        rwnd = sndbuf = busy = stalled = 0.0
        rtt, floor = 0, 0
        wait = "none"
        for st, prev, cur in rows:
            if prev is None or cur.sample_ns <= prev.sample_ns:
                continue
            dt_us = (cur.sample_ns - prev.sample_ns) / 1e3
            d_sent = max(0, cur.bytes_acked - prev.bytes_acked)
            d_recv = max(0, cur.bytes_received - prev.bytes_received)
            sent += d_sent
            recv += d_recv
            retrans += max(0, cur.retrans - prev.retrans)
            queued += cur.queued_bytes
            unread += cur.unread_bytes
            rtos = max(rtos, cur.consecutive_rtos)
            rwnd = max(rwnd, min(1.0, max(0, cur.rwnd_limited_us - prev.rwnd_limited_us) / dt_us))
            sndbuf = max(
                sndbuf, min(1.0, max(0, cur.sndbuf_limited_us - prev.sndbuf_limited_us) / dt_us)
            )
            busy = max(busy, min(1.0, max(0, cur.busy_us - prev.busy_us) / dt_us))
            if cur.queued_bytes > 0:
                stalled = max(stalled, (cur.sample_ns - st.acked_ns) / 1e9)
            if d_sent or cur.queued_bytes:  # the RTT of a connection that carried data
                rtt = max(rtt, cur.rtt_us)
                floor = cur.min_rtt_us if not floor else min(floor, cur.min_rtt_us)
            if WAIT_ORDER[st.wait] > WAIT_ORDER[wait]:
                wait = st.wait
        if not (sent or recv or queued or unread or wait != "none"):
            return None  # idle: absent from the summary (keeps it small)
        if wait in ("peer", "network") or (wait == "none" and sent >= recv):
            direction, pending = "send", queued
        else:
            direction, pending = "recv", unread
        return PeerChannel(
            peer=peer,
            wait=wait,
            direction=direction,
            conns=conns,
            rtos=rtos,
            sent=sent,
            received=recv,
            queued=pending,
            rtt_us=rtt,
            min_rtt_us=floor,
            retrans=retrans,
            rwnd_share=rwnd,
            sndbuf_share=sndbuf,
            busy_share=busy,
            stalled_s=stalled,
        )

    # ------------------------------------------------------------------ peers
    def _publish_endpoints(self, conns: list[TcpConn]) -> None:
        # The local end of every connection: on a network without NAT it is exactly the
        # remote end that the peer's kernel reports for the same connection.
        # The store may be down or cut off from this rank: then the sample goes on with
        # the peers mapped so far (a cut link is what it must show), and this is retried.
        mine = frozenset(c.local for c in conns if c.local[1])
        if mine != self._published:
            try:
                self.control.publish_endpoints(self.rank, sorted(mine))
            except Exception as exc:  # noqa: BLE001
                report_error("channels.endpoints", exc)
                return
            self._published = mine

    def _map(self, fresh: list[TcpConn]) -> None:
        if fresh:  # new connections (a new group): look for their peers soon, but never
            # re-read every rank's endpoints more than once a REMAP_MIN_S (a process may
            # keep opening connections that are not to ranks at all)
            self._remap_backoff = REMAP_MIN_S
            self._remap_at = min(self._remap_at, self._read_at + REMAP_MIN_S)
        unmapped = [st.prev for st in self._conns.values() if st.peer == _NO_PEER]
        if not unmapped or time.monotonic() < self._remap_at:
            return
        found = map_peers(unmapped, self._endpoints)
        if len(found) < len(unmapped):
            others = [r for r in range(self.world) if r != self.rank]
            self._read_at = time.monotonic()
            try:
                self._endpoints = self.control.read_endpoints(others)
            except Exception as exc:  # noqa: BLE001 - as in _publish_endpoints
                report_error("channels.endpoints", exc)
            found = map_peers(unmapped, self._endpoints)
        for c, peer in found.items():
            self._conns[_key(c)].peer = peer
        if len(found) < len(unmapped):  # peers not published yet, or not a rank at all
            self._remap_at = time.monotonic() + self._remap_backoff
            # Peers publish within a tick of connecting: retry at the minimum while some
            # unmapped connection is young, back off for ones that never map (not ranks).
            now_ns = time.monotonic_ns()  # first_ns is a sample time: the same clock
            young = any(
                now_ns - self._conns[_key(c)].first_ns < REMAP_YOUNG_S * 1e9
                for c in unmapped
                if c not in found
            )
            if not young:
                self._remap_backoff = min(2 * self._remap_backoff, REMAP_MAX_S)

    # ------------------------------------------------------------------ misc
    def _write_trace(self, entries: list[PeerChannel], interval: float) -> None:
        assert self._trace is not None
        line = {
            "rank": self.rank,
            "t_ns": time.monotonic_ns(),
            "interval_s": interval,
            "conns": len(self._conns),
            "entries": [e._asdict() for e in entries],
            "prev_tick_us": self.costs_ns[-1] / 1e3 if self.costs_ns else None,
        }
        try:
            self._trace.parent.mkdir(parents=True, exist_ok=True)
            with open(self._trace, "a") as fh:
                fh.write(json.dumps(line) + "\n")
        except OSError as exc:
            report_error("channels.trace", exc)

    def close(self) -> None:
        """Release the board slots (the connections are about to go with the process)."""
        for st in self._conns.values():
            with contextlib.suppress(Exception):
                self.board.channel_release(st.slot)
        self._conns.clear()

    def cost_us(self) -> dict[str, float]:
        """Median and max wall time of a tick so far, in microseconds."""
        if not self.costs_ns:
            return {}
        xs = sorted(self.costs_ns)
        out = {"ticks": len(xs), "median_us": xs[len(xs) // 2] / 1e3, "max_us": xs[-1] / 1e3}
        log.debug("ccld channel sampling cost: %s", out)
        return out


def channel_fields(conn: TcpConn, wait: str, peer: int = -1) -> dict[str, int]:
    """The TCP-derived fields of a board channel record (struct ccld_channel) for `conn`.

    The caller adds what the probe cannot know: group_id, seq, first_ns and
    last_progress_ns. The direction is the one that carries more bytes. Units follow the
    board, which differs from TcpConn in one place: delivery_rate is bytes per second.
    """
    send = conn.bytes_acked >= conn.bytes_received
    remote_addr = 0
    with contextlib.suppress(OSError):  # IPv6 peers have no IPv4 form: 0, as board.h says
        remote_addr = int.from_bytes(socket.inet_aton(conn.remote[0]), sys.byteorder)
    return {
        "source": SOURCE_TCP,
        "direction": DIRECTION_SEND if send else DIRECTION_RECV,
        "wait": WAIT_CODES[wait],
        "peer": peer,
        "bytes_done": conn.bytes_acked if send else conn.bytes_received,
        "bytes_queued": conn.queued_bytes if send else conn.unread_bytes,
        "rtt_us": conn.rtt_us,
        "retrans": conn.retrans,
        "rwnd_limited_us": conn.rwnd_limited_us,
        "sndbuf_limited_us": conn.sndbuf_limited_us,
        "busy_us": conn.busy_us,
        "delivery_rate": conn.delivery_rate_bps // 8,
        "local_port": conn.local[1],
        "remote_port": conn.remote[1],
        "remote_addr": remote_addr,
    }
