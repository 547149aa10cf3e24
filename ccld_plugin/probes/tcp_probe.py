"""TCP transport probe: per-connection kernel counters of this process's sockets.

gloo, the NCCL socket transport and the control plane move their bytes over TCP, and the
kernel already measures what the agent needs for every connection: bytes acknowledged,
bytes still queued, RTT, retransmissions, and how long the sender was stalled by the
peer's receive window or by its own send buffer. The native probe
(``csrc/tcp_probe.c``) reads them through sock_diag for this process's sockets; this
module turns the records into :class:`TcpConn` values. ``tcp_peers`` joins connections
to peer ranks, ``tcp_wait`` says from two samples what a connection waits on.

The library is loaded with ctypes, not through the nanobind extension: the probe is plain
C and must stay usable (tests, ``ccld inspect``) without the extension built.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LIBRARY_GLOB",
    "STATES_CONNECTED",
    "STATES_LISTEN",
    "Endpoint",
    "TcpConn",
    "TcpProbe",
    "find_library",
    "local_endpoints",
    "sample_connections",
]

Endpoint = tuple[str, int]
"""An (ip, port) pair; IPv4-mapped IPv6 addresses are written as plain IPv4."""

LIBRARY_GLOB = "libnccl-profiler-ccld*.so*"

# Masks of 1 << state (Linux numbering), as in tcp_probe.h.
_TCP_STATE_NAMES = {
    1: "ESTABLISHED",
    2: "SYN_SENT",
    3: "SYN_RECV",
    4: "FIN_WAIT1",
    5: "FIN_WAIT2",
    6: "TIME_WAIT",
    7: "CLOSE",
    8: "CLOSE_WAIT",
    9: "LAST_ACK",
    10: "LISTEN",
    11: "CLOSING",
}
STATES_CONNECTED = sum(1 << s for s in (1, 2, 3, 4, 5, 8, 9, 11))
STATES_LISTEN = 1 << 10


# --- Native library -----------------------------------------------------------------------

# The record layout of ccld_tcp_conn, in order; the Struct below must have the size that
# the library reports, which load() checks.
_FIELDS: tuple[tuple[str, str], ...] = (
    ("cookie", "Q"),
    ("sample_ns", "q"),
    ("inode", "I"),
    ("family", "B"),
    ("state", "B"),
    ("info_bytes", "H"),
    ("local_addr", "16s"),
    ("remote_addr", "16s"),
    ("local_port", "H"),
    ("remote_port", "H"),
    ("ifindex", "I"),
    ("bytes_acked", "Q"),
    ("bytes_received", "Q"),
    ("bytes_sent", "Q"),
    ("bytes_retrans", "Q"),
    ("busy_us", "Q"),
    ("rwnd_limited_us", "Q"),
    ("sndbuf_limited_us", "Q"),
    ("delivery_rate", "Q"),
    ("notsent_bytes", "I"),
    ("unacked_bytes", "I"),
    ("unread_bytes", "I"),
    ("unacked_segs", "I"),
    ("rtt_us", "I"),
    ("rttvar_us", "I"),
    ("min_rtt_us", "I"),
    ("total_retrans", "I"),
    ("retrans_out", "I"),
    ("lost_segs", "I"),
    ("rto_count", "I"),
    ("snd_cwnd", "I"),
    ("snd_mss", "I"),
    ("snd_wnd", "I"),
    ("sndbuf_bytes", "I"),
    ("rcvbuf_bytes", "I"),
    ("last_data_sent_ms", "I"),
    ("last_data_recv_ms", "I"),
    ("last_ack_recv_ms", "I"),
    ("_pad1", "I"),
)
_RECORD = struct.Struct("=" + "".join(fmt for _, fmt in _FIELDS))
_INDEX = {name: i for i, (name, _) in enumerate(_FIELDS)}


def find_library(path: str | os.PathLike[str] | None = None) -> Path:
    """The probe library: `path` if given, else the one installed next to this package."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"ccld probe library not found: {p}")
        return p
    here = Path(__file__).resolve().parent
    found = sorted(here.glob(LIBRARY_GLOB))
    if not found:
        raise FileNotFoundError(
            f"no {LIBRARY_GLOB} in {here}; build the package (pip install .) or pass the path"
        )
    return found[0]


@dataclass(frozen=True, slots=True)
class TcpConn:
    """One TCP connection of this process at one instant. Counters are cumulative.

    Byte counts are bytes, times are microseconds unless the name says otherwise, and
    `sample_ns` is CLOCK_MONOTONIC (the board's clock).
    """

    local: Endpoint
    remote: Endpoint
    state: str  # "ESTABLISHED", "CLOSE_WAIT" (peer closed), "LISTEN", ...
    inode: int
    cookie: int  # kernel socket id; with inode, tells a reused port from the same socket
    sample_ns: int
    bytes_acked: int  # sent and acknowledged by the peer (Linux counts the SYN as 1)
    bytes_received: int  # received in order (whether or not the application read it)
    notsent_bytes: int  # written by the application, not yet sent
    unacked_bytes: int  # sent, not yet acknowledged
    unread_bytes: int  # received, not yet read by the application
    rtt_us: int  # smoothed RTT
    min_rtt_us: int  # the path's floor RTT
    retrans: int  # segments retransmitted, cumulative (tcpi_total_retrans)
    retrans_in_flight: int  # retransmitted segments not yet acknowledged (tcpi_retrans)
    consecutive_rtos: int  # retransmission timeouts in a row without progress
    busy_us: int  # time with a non-empty write queue (includes the two below)
    rwnd_limited_us: int  # time stalled by the peer's full receive window
    sndbuf_limited_us: int  # time stalled by our full send buffer
    delivery_rate_bps: int  # kernel's delivery-rate estimate, in BITS per second
    snd_wnd_bytes: int  # the peer's advertised receive window (0: closed, or old kernel)
    sndbuf_bytes: int  # our send buffer size
    last_ack_recv_ms: int  # ms since the last ACK arrived

    @property
    def queued_bytes(self) -> int:
        """Bytes written by us and not yet acknowledged by the peer."""
        return self.notsent_bytes + self.unacked_bytes


def _host(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    text = socket.inet_ntop(socket.AF_INET6, raw)
    # Dual-stack sockets report IPv4 peers as ::ffff:a.b.c.d; other ranks publish a.b.c.d.
    if text.startswith("::ffff:") and "." in text:
        return text[7:]
    return text


def _conn_from_record(r: tuple) -> TcpConn:
    # One positional unpack in _FIELDS order: this runs for every socket every tick.
    (cookie, sample_ns, inode, family, state, _info_bytes, laddr, raddr, lport, rport,
     _ifindex, acked, received, _sent, _bytes_retrans, busy, rwnd, sndbuf_limited, rate,
     notsent, unacked, unread, _unacked_segs, rtt, _rttvar, min_rtt, total_retrans,
     retrans_out, _lost, rtos, _cwnd, _mss, snd_wnd, sndbuf, _rcvbuf, _last_sent,
     _last_recv, last_ack, _pad1) = r  # fmt: skip
    return TcpConn(
        (_host(family, laddr), lport),
        (_host(family, raddr), rport),
        _TCP_STATE_NAMES.get(state) or str(state),
        inode,
        cookie,
        sample_ns,
        acked,
        received,
        notsent,
        unacked,
        unread,
        rtt,
        min_rtt,
        total_retrans,
        retrans_out,
        rtos,
        busy,
        rwnd,
        sndbuf_limited,
        rate * 8,
        snd_wnd,
        sndbuf,
        last_ack,
    )


class TcpProbe:
    """The native probe, loaded once, with a reusable record buffer.

    :meth:`sample` is the call to make every tick. A kernel dump walks the whole TCP hash
    table of the network namespace (milliseconds on a large host, however few sockets are
    ours), so after one dump the probe re-reads the connections it knows by exact lookup
    (microseconds each) and dumps again only when this process opened a socket it has not
    seen, or REDISCOVER_S after the last dump (a socket that was open but not yet
    connected at that dump is found then).

    Thread-safe: calls are serialized on a lock (the buffer and the cache are shared).
    """

    REDISCOVER_S = 10.0

    def __init__(self, library: str | os.PathLike[str] | None = None) -> None:
        self.path = find_library(library)
        lib = ctypes.CDLL(str(self.path))
        u32p = ctypes.POINTER(ctypes.c_uint32)
        lib.ccld_tcp_conn_size.restype = ctypes.c_size_t
        lib.ccld_tcp_conn_size.argtypes = []
        lib.ccld_tcp_sample.restype = ctypes.c_int
        lib.ccld_tcp_sample.argtypes = [
            u32p,
            ctypes.c_int,
            ctypes.c_uint32,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        lib.ccld_tcp_refresh.restype = ctypes.c_int
        lib.ccld_tcp_refresh.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.ccld_tcp_socket_inodes.restype = ctypes.c_int
        lib.ccld_tcp_socket_inodes.argtypes = [ctypes.c_int, u32p, ctypes.c_int]
        native = lib.ccld_tcp_conn_size()
        if native != _RECORD.size:
            raise RuntimeError(
                f"ccld_tcp_conn layout mismatch: library {self.path} says {native} bytes, "
                f"transport.py expects {_RECORD.size}"
            )
        self._lib = lib
        self._capacity = 0
        self._buf = ctypes.create_string_buffer(0)
        self._grow(256)
        self._inode_buf = (ctypes.c_uint32 * 1024)()
        # The cache behind sample(): records [0, _count) of _buf, and the TCP socket
        # inodes the process had at the last dump.
        self._lock = threading.Lock()
        self._count = 0
        self._seen: frozenset[int] = frozenset()
        self._dumped_at: float | None = None
        self.dumps = 0
        self.refreshes = 0

    def _grow(self, capacity: int) -> None:
        self._capacity = capacity
        self._buf = ctypes.create_string_buffer(capacity * _RECORD.size)

    def _records(self, buf: ctypes.Array, n: int) -> list[tuple]:
        return list(_RECORD.iter_unpack(memoryview(buf)[: n * _RECORD.size]))

    def _dump_into_buf(self, states: int, inodes: list[int] | None) -> int:
        """Dump into the cache buffer, growing it as needed; returns the record count."""
        arr = None
        if inodes is not None:
            arr = (ctypes.c_uint32 * max(len(inodes), 1))(*inodes)
        n_in = len(inodes) if inodes is not None else 0
        # The socket set can grow between the size report and the retry; a few rounds
        # always suffice in practice, and a truncated sample is better than none.
        for _ in range(4):
            n = self._lib.ccld_tcp_sample(arr, n_in, states, self._buf, self._capacity)
            if n < 0:
                raise OSError(-n, f"ccld_tcp_sample: {os.strerror(-n)}")
            if n <= self._capacity:
                return n
            self._grow(n + n // 4 + 16)
        return self._capacity

    def socket_inodes(self, pid: int = 0) -> list[int]:
        """Inodes of this process's TCP sockets (pid 0), or of all sockets of `pid`."""
        with self._lock:
            return self._socket_inodes(pid)

    def _socket_inodes(self, pid: int) -> list[int]:
        while True:
            cap = len(self._inode_buf)
            n = self._lib.ccld_tcp_socket_inodes(pid, self._inode_buf, cap)
            if n < 0:
                raise OSError(-n, f"ccld_tcp_socket_inodes({pid}): {os.strerror(-n)}")
            if n <= cap:
                return self._inode_buf[:n]
            self._inode_buf = (ctypes.c_uint32 * (n + n // 4 + 16))()

    def dump(
        self, states: int = STATES_CONNECTED, inodes: Iterable[int] | None = None
    ) -> list[TcpConn]:
        """One kernel dump: the sockets with these inodes (default: this process's) in
        these states. Leaves the cache behind :meth:`sample` alone."""
        ino = None if inodes is None else list(inodes)
        arr = None if ino is None else (ctypes.c_uint32 * max(len(ino), 1))(*ino)
        cap = self._capacity
        for _ in range(4):
            buf = ctypes.create_string_buffer(cap * _RECORD.size)
            n = self._lib.ccld_tcp_sample(arr, len(ino or ()), states, buf, cap)
            if n < 0:
                raise OSError(-n, f"ccld_tcp_sample: {os.strerror(-n)}")
            if n <= cap:
                break
            cap = n + n // 4 + 16
        return [_conn_from_record(r) for r in self._records(buf, min(n, cap))]

    def sample_raw(self) -> list[tuple]:
        """Like :meth:`sample`, as tuples in ``_FIELDS`` order (no objects built)."""
        with self._lock:
            return self._sample_raw()

    def _sample_raw(self) -> list[tuple]:
        inodes = self._socket_inodes(0)
        current = frozenset(inodes)
        now = time.monotonic()
        if (
            self._dumped_at is None
            or not current <= self._seen
            or now - self._dumped_at > self.REDISCOVER_S
        ):
            n = self._dump_into_buf(STATES_CONNECTED, inodes)
            self._seen, self._dumped_at = current, now
            self.dumps += 1
        else:
            n = self._lib.ccld_tcp_refresh(self._buf, self._count)
            if n < 0:
                self._dumped_at = None  # start over with a dump next time
                raise OSError(-n, f"ccld_tcp_refresh: {os.strerror(-n)}")
            self.refreshes += 1
        self._count = n
        ino = _INDEX["inode"]
        # A socket we closed can live on in a forked child that inherited it: its key and
        # inode still match, but it is not ours any more.
        return [r for r in self._records(self._buf, n) if r[ino] in current]

    def sample(self) -> list[TcpConn]:
        """This process's connected TCP sockets, with their kernel counters."""
        return [_conn_from_record(r) for r in self.sample_raw()]

    def local_endpoints(self) -> list[Endpoint]:
        """The (ip, port) pairs other ranks see as the remote end of our connections.

        The local end of every connected socket, plus listening sockets (which may be a
        wildcard address such as 0.0.0.0; :func:`map_peers` treats those by port).
        """
        eps = {c.local for c in self.dump(STATES_CONNECTED | STATES_LISTEN)}
        return sorted(ep for ep in eps if ep[1] != 0)


@functools.lru_cache(maxsize=4)
def _probe(library: str | None) -> TcpProbe:
    return TcpProbe(library)


def sample_connections(library: str | os.PathLike[str] | None = None) -> list[TcpConn]:
    """This process's connected TCP sockets, with their kernel counters."""
    return _probe(None if library is None else str(library)).sample()


def local_endpoints(library: str | os.PathLike[str] | None = None) -> list[Endpoint]:
    """The endpoints this process publishes so that peers can map connections to it."""
    return _probe(None if library is None else str(library)).local_endpoints()
