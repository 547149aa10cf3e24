"""What a TCP connection waits on, from two samples of its kernel counters: the peer (its
receive window stays full: the peer does not read), the network (retransmissions, no
acknowledgement, an RTT inflated over the path's floor), this host (send buffer, or we do
not read), or nothing."""

from __future__ import annotations

from ccld_plugin.probes.tcp_probe import TcpConn
from ccld_plugin.wire.codes import WAIT_LOCAL, WAIT_NETWORK, WAIT_NONE, WAIT_PEER

__all__ = [
    "LOCAL_SNDBUF_SHARE",
    "PEER_RWND_SHARE",
    "RTT_EXCESS_MIN_US",
    "RTT_INFLATION",
    "classify_wait",
]

#
# PEER_RWND_SHARE: share of the interval the sender could not send because the peer's
# receive window was full. A receiver that keeps up closes its window only in short
# bursts; one that stopped reading (its process is computing, or stuck) closes it for
# good and the share goes to ~1. Half the interval separates the two with a wide margin
# on either side, and the kernel's jiffy-resolution timers (1-4 ms) do not matter at it.
PEER_RWND_SHARE = 0.5
# LOCAL_SNDBUF_SHARE: share of the interval during which everything in our send buffer
# was already in flight and the application could write no more. Same reasoning as above.
LOCAL_SNDBUF_SHARE = 0.5
# RTT inflation over the connection's own floor (the kernel's windowed min_rtt) means
# bytes sit in a queue somewhere on the path. Both conditions must hold: the ratio alone
# fires on microsecond jitter of loopback or same-rack paths, the absolute excess alone
# ignores that a long path has a high floor. Healthy datacenter fabrics add well under a
# millisecond of queueing; a link shaped to 20 Mbit/s measured 6-17 ms over a 30-40 us
# floor here, and a congested switch port adds as much or more. 2 ms sits between.
# A link that is slow without a queue (a NIC that renegotiated a lower speed: TCP small
# queues keep the local backlog short) shows no inflation; the diagnoser's bandwidth
# comparison across sibling groups catches that, not this rule.
RTT_INFLATION = 4.0
RTT_EXCESS_MIN_US = 2_000


def classify_wait(prev: TcpConn, cur: TcpConn, dt_s: float | None = None) -> str:
    """What the connection waited on between two samples: peer, network, local or none.

    `dt_s` defaults to the time between the samples. Decided from counter deltas, in this
    order (the first that holds wins):

    - **peer**: we had data to send and the peer's receive window stayed full for at least
      PEER_RWND_SHARE of the interval. The peer's kernel is alive (it acknowledges and
      advertises a window) but its application does not read: the peer is compute-bound
      or stuck outside communication.
    - **network**: we have bytes outstanding and the path shows trouble: retransmissions
      in the interval, a retransmission timeout still unrecovered, sent bytes that were
      not acknowledged at all over the interval (a cut link or a dead host: a live kernel
      acknowledges even when its process is stopped), or an RTT inflated over the path's
      floor by RTT_INFLATION and RTT_EXCESS_MIN_US (a queue builds on a slow link).
    - **local**: the cause is on this host. Either the send buffer was the limit for at
      least LOCAL_SNDBUF_SHARE of the interval (all of it in flight on a healthy path, so
      SO_SNDBUF / tcp_wmem is too small for the path's bandwidth-delay product; an RTT
      that grows until the buffer is too small is caught as "network" above), or we are
      the receiver that does not read: bytes that were waiting at the previous sample
      are still unread. The latter is the same stall as the peer's "peer", seen from the
      other end.
    - **none**: nothing queued, or bytes flowing with no sign of trouble. An application
      that simply has nothing to send looks like this too; the collective tracer, not
      this probe, tells a late arrival.
    """
    if (prev.cookie, prev.inode) != (cur.cookie, cur.inode):
        raise ValueError(
            f"samples of different sockets: {prev.local}->{prev.remote} vs "
            f"{cur.local}->{cur.remote}"
        )
    if dt_s is None:
        dt_s = (cur.sample_ns - prev.sample_ns) / 1e9
    if dt_s <= 0:
        raise ValueError(f"interval must be positive, got {dt_s} s")
    interval_us = dt_s * 1e6

    def delta(name: str) -> int:
        return max(0, getattr(cur, name) - getattr(prev, name))

    queued = cur.queued_bytes > 0
    if queued and delta("rwnd_limited_us") >= PEER_RWND_SHARE * interval_us:
        return WAIT_PEER

    if cur.unacked_bytes > 0 or cur.notsent_bytes > 0:
        if delta("retrans") > 0 or cur.consecutive_rtos > 0:
            return WAIT_NETWORK
        if prev.unacked_bytes > 0 and cur.unacked_bytes > 0 and delta("bytes_acked") == 0:
            return WAIT_NETWORK
        floor = cur.min_rtt_us
        if (
            floor > 0
            and cur.rtt_us >= RTT_INFLATION * floor
            and (cur.rtt_us - floor >= RTT_EXCESS_MIN_US)
        ):
            return WAIT_NETWORK

    if queued and delta("sndbuf_limited_us") >= LOCAL_SNDBUF_SHARE * interval_us:
        return WAIT_LOCAL

    # What the application read = what arrived minus how much the unread queue grew.
    consumed = delta("bytes_received") - (cur.unread_bytes - prev.unread_bytes)
    if prev.unread_bytes > 0 and cur.unread_bytes > 0 and consumed < prev.unread_bytes:
        return WAIT_LOCAL
    return WAIT_NONE
