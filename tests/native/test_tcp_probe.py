"""TCP transport probe on real loopback sockets: counters, filtering, peers, wait states."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ccld_plugin.probes import tcp_probe as transport
from ccld_plugin.probes.tcp_peers import map_peers
from ccld_plugin.probes.tcp_probe import TcpConn, TcpProbe
from ccld_plugin.probes.tcp_wait import classify_wait
from ccld_plugin.wire import codes


@pytest.fixture(scope="module")
def lib_path(probe_library: tuple[Path, str]) -> Path:
    return probe_library[0]


@pytest.fixture
def probe(lib_path: Path) -> TcpProbe:
    return TcpProbe(lib_path)


def pair(
    opened: list[socket.socket], rcvbuf: int = 0, sndbuf: int = 0, listen_host: str = "127.0.0.1"
) -> tuple[socket.socket, socket.socket]:
    """A connected loopback (client, server) pair; buffer sizes apply before connecting."""
    listener = socket.create_server((listen_host, 0))
    opened.append(listener)
    client = socket.socket()
    opened.append(client)
    if sndbuf:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    if rcvbuf:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # inherited
    client.settimeout(5)
    client.connect(("127.0.0.1", listener.getsockname()[1]))
    server, _ = listener.accept()
    opened.append(server)
    return client, server


def find(conns: list[TcpConn], sock: socket.socket) -> TcpConn:
    ino = os.fstat(sock.fileno()).st_ino
    matches = [c for c in conns if c.inode == ino]
    assert len(matches) == 1, f"socket {sock.getsockname()} not sampled exactly once"
    return matches[0]


def test_record_matches_the_socket(probe: TcpProbe, sockets: list[socket.socket]) -> None:
    client, server = pair(sockets)
    client.sendall(b"x" * 1000)
    assert len(server.recv(1000, socket.MSG_WAITALL)) == 1000
    c = find(probe.sample(), client)
    assert c.local == client.getsockname()
    assert c.remote == client.getpeername()
    assert c.state == "ESTABLISHED"
    assert c.cookie != 0
    # Exact counts are the layout check: a shifted field would not read them. Linux counts
    # the acknowledged SYN in bytes_acked, hence the 1.
    assert c.bytes_acked - 1 == 1000
    s = find(probe.sample(), server)
    assert s.bytes_received == 1000
    assert s.remote == c.local


def test_receiver_that_does_not_read_is_peer_bound(
    probe: TcpProbe, sockets: list[socket.socket]
) -> None:
    client, server = pair(sockets, rcvbuf=64 * 1024, sndbuf=64 * 1024)
    client.setblocking(False)
    sent = 0
    chunk = b"x" * 65536
    while sent < 64 << 20:  # bound: small buffers fill after a few hundred KiB
        try:
            sent += client.send(chunk)
        except BlockingIOError:
            break
    assert sent < 64 << 20, "send buffer never filled"
    time.sleep(0.05)  # let the last segments and window updates settle
    before = {c.inode: c for c in probe.sample()}
    time.sleep(0.4)
    after = {c.inode: c for c in probe.sample()}
    ino_c = os.fstat(client.fileno()).st_ino
    ino_s = os.fstat(server.fileno()).st_ino

    sender0, sender1 = before[ino_c], after[ino_c]
    assert sender1.notsent_bytes + sender1.unacked_bytes > 0
    assert sender1.rwnd_limited_us - sender0.rwnd_limited_us > 0.2e6
    assert classify_wait(sender0, sender1) == codes.WAIT_PEER
    # The same stall seen from the receiving end: bytes waiting that nobody reads.
    receiver0, receiver1 = before[ino_s], after[ino_s]
    assert receiver1.unread_bytes > 0
    assert classify_wait(receiver0, receiver1) == codes.WAIT_LOCAL


def test_flowing_connection_is_none(probe: TcpProbe, sockets: list[socket.socket]) -> None:
    client, server = pair(sockets)
    server.settimeout(5)
    stop = threading.Event()

    def drain() -> None:
        while server.recv(1 << 16):
            pass

    def send_paced() -> None:
        # About 8 MB/s: far below what loopback and the reader can take, so the
        # connection flows without a standing queue.
        deadline = time.monotonic() + 3.0
        while not stop.is_set() and time.monotonic() < deadline:
            client.sendall(b"y" * 16384)
            time.sleep(0.002)
        client.shutdown(socket.SHUT_WR)

    threads = [threading.Thread(target=drain), threading.Thread(target=send_paced)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.1)
        c0 = find(probe.sample(), client)
        s0 = find(probe.sample(), server)
        time.sleep(0.4)
        c1 = find(probe.sample(), client)
        s1 = find(probe.sample(), server)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
    assert c1.bytes_acked - c0.bytes_acked > 100_000
    assert s1.bytes_received - s0.bytes_received > 100_000
    assert classify_wait(c0, c1) == codes.WAIT_NONE
    assert classify_wait(s0, s1) == codes.WAIT_NONE


CHILD = """
import socket, sys
ls = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(ls.getsockname())
s, _ = ls.accept()
print(c.getsockname()[1], s.getsockname()[1], flush=True)
sys.stdin.read()
"""


def own_socket_inodes() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(fd))
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            out.add(st.st_ino)
    return out


def test_sample_sees_only_this_process(probe: TcpProbe, sockets: list[socket.socket]) -> None:
    client, server = pair(sockets)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        child_ports = {int(p) for p in line.split()}
        assert len(child_ports) == 2, f"child said {line!r}"
        mine = probe.sample()
        ports = {c.local[1] for c in mine}
        assert client.getsockname()[1] in ports and server.getsockname()[1] in ports
        assert not ports & child_ports
        assert {c.inode for c in mine} <= own_socket_inodes()
        # The child's sockets are visible when asked for by its inodes: the filter, not a
        # blind probe, is what kept them out.
        theirs = probe.dump(inodes=probe.socket_inodes(child.pid))
        assert {c.local[1] for c in theirs} >= child_ports
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=10)


def test_refresh_follows_new_and_closed_sockets(
    probe: TcpProbe, sockets: list[socket.socket]
) -> None:
    client, _ = pair(sockets)
    probe.sample()
    dumps = probe.dumps
    probe.sample()
    assert probe.dumps == dumps and probe.refreshes >= 1  # nothing new: exact lookups only
    client2, server2 = pair(sockets)
    assert find(probe.sample(), client2)  # a new socket: found by a dump
    assert probe.dumps == dumps + 1
    ino = os.fstat(client2.fileno()).st_ino
    client2.close()
    server2.close()
    assert ino not in {c.inode for c in probe.sample()}
    assert find(probe.sample(), client)


def test_local_endpoints_include_listeners_and_connections(
    probe: TcpProbe, sockets: list[socket.socket]
) -> None:
    client, server = pair(sockets)
    eps = probe.local_endpoints()
    assert client.getsockname() in eps
    assert server.getsockname() in eps  # the accepted socket, and its listener's port
    assert transport.local_endpoints(probe.path) == eps


def test_map_peers_on_real_endpoints(probe: TcpProbe, sockets: list[socket.socket]) -> None:
    # Four "ranks" in one process: each owns some sockets and publishes their local ends.
    to1, at1 = pair(sockets)  # rank 0 connects to rank 1
    to2, at2 = pair(sockets)  # rank 0 connects to rank 2
    from1, at0 = pair(sockets)  # rank 1 connects to rank 0
    to3, at3 = pair(sockets, listen_host="0.0.0.0")  # rank 3 listens on the wildcard
    owner = {0: [to1, to2, at0], 1: [at1, from1], 2: [at2], 3: [at3]}
    conns = {c.inode: c for c in probe.sample()}

    def ino(s: socket.socket) -> int:
        return os.fstat(s.fileno()).st_ino

    endpoints = {r: [conns[ino(s)].local for s in socks] for r, socks in owner.items()}
    endpoints[3] = [("0.0.0.0", at3.getsockname()[1])]  # a wildcard listener, no more
    rank0 = [conns[ino(s)] for s in (to1, to2, at0, to3)]
    peers = map_peers(rank0, endpoints)
    assert peers == {
        conns[ino(to1)]: 1,
        conns[ino(to2)]: 2,
        conns[ino(at0)]: 1,  # the accepted end maps by rank 1's ephemeral port
        conns[ino(to3)]: 3,
    }
    # An endpoint two ranks claim is dropped rather than guessed.
    endpoints[2] = endpoints[2] + [conns[ino(at1)].local]
    assert conns[ino(to1)] not in map_peers(rank0, endpoints)
