"""Which rank is at the other end of a TCP connection: a join of the connections' remote
endpoints with the endpoints every rank publishes (``ep/<rank>`` in the store)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping

from ccld_plugin.probes.tcp_probe import Endpoint, TcpConn

__all__ = ["map_peers"]

_AMBIGUOUS = -(2**31)


def _canonical(ep: tuple[str, int]) -> Endpoint:
    host, port = ep
    addr = ipaddress.ip_address(host)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return (str(addr), int(port))


def map_peers(
    conns: Iterable[TcpConn], endpoints_by_rank: Mapping[int, Iterable[tuple[str, int]]]
) -> dict[TcpConn, int]:
    """Join connections to the ranks at their other end.

    A connection belongs to rank r when its remote endpoint is one that r published
    (:func:`local_endpoints`). On a network without NAT the remote end of our socket is
    exactly the local end of the peer's, so the join is exact. A rank that published a
    wildcard listener (0.0.0.0:port) matches by port, and only when no other rank claims
    that port. An endpoint claimed by two ranks (stale data) maps to neither. Connections
    that match nobody (a store, a data service) are left out.
    """
    exact: dict[Endpoint, int] = {}
    wildcard: dict[int, int] = {}
    for rank, eps in endpoints_by_rank.items():
        for ep in eps:
            host, port = _canonical(ep)
            if ipaddress.ip_address(host).is_unspecified:
                seen = wildcard.get(port, rank)
                wildcard[port] = rank if seen == rank else _AMBIGUOUS
            else:
                seen = exact.get((host, port), rank)
                exact[(host, port)] = rank if seen == rank else _AMBIGUOUS
    out: dict[TcpConn, int] = {}
    for c in conns:
        if c.remote[1] == 0:
            continue
        peer = exact.get(_canonical(c.remote))
        if peer is None:
            peer = wildcard.get(c.remote[1])
        if peer is not None and peer != _AMBIGUOUS:
            out[c] = peer
    return out
