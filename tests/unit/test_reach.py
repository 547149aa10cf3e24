"""The handshake that tells a cut link from a wedged process (control.reach), on real
loopback sockets: a port whose kernel answers, one whose kernel drops the handshake."""

from __future__ import annotations

import socket
import time

from ccld_plugin.control.reach import ReachPort, ReachProbe, route_source


def _rounds(
    probe: ReachProbe,
    silent: set[int],
    ended: set[int],
    control: int | None = None,
    until_s: float = 3.0,
) -> dict[int, bool]:
    """Diagnoser rounds every 20 ms until the ``ended`` ranks' handshakes ended, or
    ``until_s``."""
    deadline = time.monotonic() + until_s
    got = probe.update(silent, control)
    while set(got) != ended and time.monotonic() < deadline:
        time.sleep(0.02)
        got = probe.update(silent, control)
    return got


def _full_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A listening socket whose accept queue is full: its kernel drops new handshakes,
    as a host behind a cut link never answers them."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(srv.getsockname())
        fillers.append(c)
    time.sleep(0.1)
    return srv, fillers


def test_a_reach_port_answers_and_a_dropped_handshake_does_not() -> None:
    port = ReachPort(route_source("127.0.0.1", 1))
    srv, fillers = _full_listener()
    try:
        addresses = {1: port.address, 2: srv.getsockname()}
        looked_up: list[list[int]] = []

        def read(ranks: list[int]) -> dict[int, tuple[str, int]]:
            looked_up.append(ranks)
            return {r: addresses[r] for r in ranks if r in addresses}

        # Until some handshake is answered, an unanswered one says nothing (a firewall
        # drops them all): rank 2 alone gives no result.
        probe = ReachProbe(read, timeout_s=0.3)
        assert _rounds(probe, {2}, ended={2}, until_s=0.6) == {} and not probe.verified
        # With a reporting rank (1) as the control, which answers, it does.
        got = _rounds(probe, {2, 3}, ended={2}, control=1)
        assert got == {2: False} and probe.verified  # rank 3 published no port
        assert _rounds(probe, {1, 2}, ended={1, 2}) == {1: True, 2: False}
        port.drain()  # the agent's tick: what connected is closed, the queue stays empty
        # A rank that reports again is forgotten; addresses are looked up once.
        assert probe.update({2}) == {2: False}
        assert probe.update(set()) == {}
        assert sorted(r for call in looked_up for r in call) == [1, 2, 3]
        # While nobody is silent: the control's handshake alone, with addresses looked up
        # ahead (the diagnoser's landmarks), so that a later silence needs no store.
        looked_up.clear()
        healthy = ReachProbe(read, timeout_s=0.3)
        healthy.prefetch([1, 2])
        deadline = time.monotonic() + 3.0
        while not healthy.verified and time.monotonic() < deadline:
            assert healthy.update(set(), control=1) == {}
            time.sleep(0.02)
        assert healthy.verified and looked_up == [[1, 2]]
        assert _rounds(healthy, {2}, ended={2}) == {2: False}
        healthy.close()
        probe.close()
    finally:
        port.close()
        srv.close()
        for c in fillers:
            c.close()


def test_a_store_that_does_not_answer_leaves_the_probe_without_addresses() -> None:
    def read(ranks: list[int]) -> dict[int, tuple[str, int]]:
        raise TimeoutError("store")

    probe = ReachProbe(read)
    assert probe.update({1, 2}) == {}  # contained: no probe, no verdict evidence
