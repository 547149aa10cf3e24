"""TCP connections read as waits (classify_wait), peer mapping of endpoints, and the board
channel fields of a connection: on synthetic TcpConn values."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from ccld_plugin.probes.tcp_channels import channel_fields
from ccld_plugin.probes.tcp_peers import map_peers
from ccld_plugin.probes.tcp_probe import TcpConn
from ccld_plugin.probes.tcp_wait import classify_wait
from ccld_plugin.wire import codes


def conn(**kw: object) -> TcpConn:
    base = dict(
        local=("10.0.0.1", 40000),
        remote=("10.0.0.2", 29500),
        state="ESTABLISHED",
        inode=7,
        cookie=9,
        sample_ns=0,
        bytes_acked=0,
        bytes_received=0,
        notsent_bytes=0,
        unacked_bytes=0,
        unread_bytes=0,
        rtt_us=100,
        min_rtt_us=50,
        retrans=0,
        retrans_in_flight=0,
        consecutive_rtos=0,
        busy_us=0,
        rwnd_limited_us=0,
        sndbuf_limited_us=0,
        delivery_rate_bps=0,
        snd_wnd_bytes=65536,
        sndbuf_bytes=1 << 20,
        last_ack_recv_ms=0,
    )
    base.update(kw)
    return TcpConn(**base)  # type: ignore[arg-type]


def test_map_peers_normalizes_ipv4_mapped_addresses() -> None:
    c = conn(remote=("10.0.0.2", 29500))
    assert map_peers([c], {4: [("::ffff:10.0.0.2", 29500)]}) == {c: 4}
    assert map_peers([c], {4: [("10.0.0.3", 29500)]}) == {}


def test_classify_wait_rules() -> None:
    t0 = conn()
    one_s = dict(sample_ns=1_000_000_000)
    # Bytes outstanding, a retransmission in the interval: the path loses packets.
    assert classify_wait(t0, conn(**one_s, unacked_bytes=5000, retrans=2)) == "network"
    # Sent bytes that nothing acknowledged for a whole second: a cut link.
    stuck0 = conn(unacked_bytes=5000, bytes_acked=10)
    assert classify_wait(stuck0, dataclasses.replace(stuck0, sample_ns=10**9)) == "network"
    # Queue on the path: RTT far above its floor while data is queued.
    slow = conn(**one_s, bytes_acked=10**6, notsent_bytes=10**5, rtt_us=40_000)
    assert classify_wait(t0, slow) == "network"
    # Inflation below the absolute floor (loopback jitter) is not a network problem.
    jitter = conn(**one_s, bytes_acked=10**6, notsent_bytes=10**5, rtt_us=400, min_rtt_us=20)
    assert classify_wait(t0, jitter) == "none"
    # Our send buffer was the limit most of the interval, on a healthy path.
    capped = conn(**one_s, bytes_acked=10**6, unacked_bytes=10**5, sndbuf_limited_us=900_000)
    assert classify_wait(t0, capped) == "local"
    # rwnd beats everything else: the peer is not reading.
    peer = conn(**one_s, notsent_bytes=10**5, rwnd_limited_us=800_000, retrans=1)
    assert classify_wait(t0, peer) == "peer"
    assert classify_wait(t0, conn(**one_s)) == "none"
    with pytest.raises(ValueError):
        classify_wait(t0, conn(inode=8, sample_ns=1))
    with pytest.raises(ValueError):
        classify_wait(t0, t0)


def test_channel_fields_use_board_units() -> None:
    c = conn(bytes_acked=5000, bytes_received=10, unacked_bytes=300, notsent_bytes=200,
             delivery_rate_bps=8_000_000, remote=("127.0.0.1", 29500))  # fmt: skip
    f = channel_fields(c, codes.WAIT_NETWORK, peer=3)
    assert f["direction"] == codes.DIRECTION_SEND
    assert (f["bytes_done"], f["bytes_queued"]) == (5000, 500)
    assert f["delivery_rate"] == 1_000_000  # bytes per second on the board
    assert f["wait"] == 3 and f["peer"] == 3 and f["remote_port"] == 29500
    assert f["remote_addr"].to_bytes(4, sys.byteorder) == bytes([127, 0, 0, 1])
    r = channel_fields(conn(bytes_received=10**6, unread_bytes=7), "local")
    assert (r["direction"], r["bytes_queued"], r["wait"]) == (codes.DIRECTION_RECV, 7, 1)
