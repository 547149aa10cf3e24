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
    controls: tuple[int, ...] | list[int] = (),
    until_s: float = 3.0,
) -> dict[int, bool]:
    """Diagnoser rounds every 20 ms until the ``ended`` ranks' handshakes ended, or
    ``until_s``."""
    deadline = time.monotonic() + until_s
    got = probe.update(silent, controls)
    while set(got) != ended and time.monotonic() < deadline:
        time.sleep(0.02)
        got = probe.update(silent, controls)
    return got


def _elsewhere(host: str) -> bool:
    """These loopback ports stand for other hosts' (ranks of the diagnoser's own host are
    not probed)."""
    return False


def _fill(srv: socket.socket) -> list[socket.socket]:
    """Fill the accept queue of ``srv`` (listening with backlog 0): from then on its
    kernel drops new handshakes, as a host behind a cut link never answers them."""
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(srv.getsockname())
        fillers.append(c)
    time.sleep(0.1)
    return fillers


def _full_listener() -> tuple[socket.socket, list[socket.socket]]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    return srv, _fill(srv)


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
        probe = ReachProbe(read, timeout_s=0.3, is_local=_elsewhere)
        assert _rounds(probe, {2}, ended={2}, until_s=0.6) == {} and not probe.verified
        # With a reporting rank (1) as the control, which answers, it does.
        got = _rounds(probe, {2, 3}, ended={2}, controls=[1])
        assert got == {2: False} and probe.verified  # rank 3 published no port
        assert _rounds(probe, {1, 2}, ended={1, 2}) == {1: True, 2: False}
        # A rank that reports again is forgotten; addresses are looked up once.
        assert probe.update({2}) == {2: False}
        assert probe.update(set()) == {}
        assert sorted(r for call in looked_up for r in call) == [1, 2, 3]
        # While nobody is silent: the control's handshake alone, the controls' addresses
        # looked up (the diagnoser's landmarks), so that a later silence needs no store.
        looked_up.clear()
        ctl = socket.socket()
        ctl.bind(("127.0.0.1", 0))
        ctl.listen(0)
        addresses[4] = ctl.getsockname()
        healthy = ReachProbe(read, timeout_s=0.3, is_local=_elsewhere)
        deadline = time.monotonic() + 3.0
        while not healthy.verified and time.monotonic() < deadline:
            assert healthy.update(set(), controls=[4, 2]) == {}
            time.sleep(0.02)
        assert healthy.verified and looked_up == [[4, 2]]
        # The control falls silent, its host now dropping handshakes: the answer it gave
        # while it reported does not count for it (a cut store host was taken for
        # reachable), only one made since.
        fillers += _fill(ctl)
        assert 4 not in healthy.update({2, 4})
        assert _rounds(healthy, {2, 4}, ended={2, 4}) == {2: False, 4: False}
        ctl.close()
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


def test_ranks_of_the_diagnosers_own_host_are_not_probed() -> None:
    port = ReachPort("127.0.0.1")
    try:
        probe = ReachProbe(lambda ranks: {r: port.address for r in ranks})
        assert probe.update({1}) == {}  # its address looked up: on this host
        time.sleep(0.05)
        assert probe.update({1}) == {} and not probe.verified
    finally:
        port.close()


def test_landmarks_are_looked_up_at_every_call_until_known() -> None:
    # A rank publishes its port at its first tick: a diagnoser's first round may come
    # before. Looked up again at the next round (not READDRESS_S later), the ports are
    # known before an early cut takes the store away.
    published: dict[int, tuple[str, int]] = {}
    calls: list[list[int]] = []

    def read(ranks: list[int]) -> dict[int, tuple[str, int]]:
        calls.append(ranks)
        return {r: published[r] for r in ranks if r in published}

    probe = ReachProbe(read)
    probe.prefetch([0, 1])
    published.update({0: ("10.0.0.1", 5), 1: ("10.0.0.2", 6)})
    probe.prefetch([0, 1])
    probe.prefetch([0, 1])  # all known: no lookup
    assert calls == [[0, 1], [0, 1]]


def test_a_control_handshake_in_flight_ends_though_another_rank_leads_the_controls() -> None:
    # Ranks publish their ports at their first tick, in any order: the first round may
    # know only rank 3's and start the control handshake there, the next know rank 1's
    # too. Were 3's handshake dropped for 1, none would be made for CONTROL_EVERY_S, and
    # a cut found in that time could not be told from a wedged process (a cut rank would
    # be named unresponsive).
    ports = {1: ReachPort("127.0.0.1"), 3: ReachPort("127.0.0.1")}
    published = {3: ports[3].address}
    srv, fillers = _full_listener()
    try:

        def read(ranks: list[int]) -> dict[int, tuple[str, int]]:
            return {r: published[r] for r in ranks if r in published}

        probe = ReachProbe(read, timeout_s=0.3, is_local=_elsewhere)
        assert probe.update(set(), controls=[1, 3]) == {}  # to 3, the only one known
        published.update({1: ports[1].address, 2: srv.getsockname()})
        probe.prefetch([1, 3])  # as the diagnoser does for its landmarks, each round
        got = _rounds(probe, {2}, ended={2}, controls=[1, 3])
        assert got == {2: False} and probe.verified
        probe.close()
    finally:
        for p in ports.values():
            p.close()
        srv.close()
        for c in fillers:
            c.close()
