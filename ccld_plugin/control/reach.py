"""Whether a silent rank's host still answers: a TCP handshake from the diagnoser.

A rank whose summaries stop is either wedged (its process stopped, holding the GIL, its
agent dead) or cut off from the network. Its peers' connections tell the two apart only
while they have data outstanding toward it: a live kernel acknowledges it, a cut link does
not. A cut that lands while the peers wait to *receive* from the rank leaves nothing
outstanding, and the two look the same. Then someone has to send: every agent holds a
port of its own (:class:`ReachPort`, address published at start as ``reach/<rank>``),
and the diagnoser starts a handshake to a silent rank's port (:class:`ReachProbe`). The
rank's kernel refuses it whatever its processes do, so an answer says the host is
reachable; none within ``PROBE_TIMEOUT_S`` says its link (or the host) is down.

Only silent ranks are probed, one handshake in flight per rank (the next as the last
ends: one a round while the host answers, one per ``PROBE_TIMEOUT_S`` while it does not),
and at most ``MAX_IN_FLIGHT`` at once: the traffic is a few SYNs to the job's own hosts.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import select
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ccld_plugin.errors import report_error

__all__ = ["PROBE_TIMEOUT_S", "ReachPort", "ReachProbe", "is_local_address", "route_source"]

PROBE_TIMEOUT_S = 3.0  # SYNs retransmit at 1 s and 3 s: two chances on a lossy link
CONTROL_EVERY_S = 30.0  # a control handshake that went unanswered is tried again after this
READDRESS_S = 5.0  # a rank whose address was not found is looked up again after this
MAX_IN_FLIGHT = 256
# What a connect ends in when the host's kernel answered: refused (the reach port, never
# listened on), accepted, or reset.
_ANSWERED = {0, errno.ECONNREFUSED, errno.ECONNRESET}


def is_local_address(host: str) -> bool:
    """Whether ``host`` (a name or an address) is an address of this host, of this network
    namespace: only a local address can be bound."""
    try:
        for family, kind, proto, _, addr in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM):
            with socket.socket(family, kind, proto) as sock:
                try:
                    sock.bind(addr)
                    return True
                except OSError:
                    continue
    except OSError:
        pass
    return False


def route_source(host: str, port: int) -> str:
    """The local address this host sends from to reach ``host`` (no packet is sent): the
    address on the network the store, and so the diagnoser, sits on."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


class ReachPort:
    """A TCP port held by the rank and never listened on: a handshake to it is refused by
    the host's kernel (a reset) whatever the process does, with no queue to fill, and no
    other program can take the port while the rank lives."""

    def __init__(self, address: str) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        except OSError:
            self._sock.close()
            raise
        self.address = (address, self._sock.getsockname()[1])

    def close(self) -> None:
        self._sock.close()


@dataclass
class _Try:
    sock: socket.socket
    started: float


@dataclass(frozen=True)
class Reach:
    """The last handshake's outcome for a rank: answered or not, and when it ended."""

    answered: bool
    at: float


class ReachProbe:
    """Handshakes to silent ranks, advanced one non-blocking step per diagnoser round.

    ``addresses(ranks)`` reads the published ports of ``ranks`` (missing ones left out).
    """

    def __init__(
        self,
        addresses: Callable[[list[int]], Mapping[int, tuple[str, int]]],
        timeout_s: float = PROBE_TIMEOUT_S,
        is_local: Callable[[str], bool] | None = None,
    ) -> None:
        self._addresses = addresses
        self._timeout_s = timeout_s
        # Ranks of this host are not probed: their kernel is this one (it always answers),
        # and whether their process lives is read in /proc.
        self._is_local = functools.cache(is_local or is_local_address)
        self._known: dict[int, tuple[str, int]] = {}
        self._looked_up: dict[int, float] = {}
        self._tries: dict[int, _Try] = {}
        self._last: dict[int, Reach] = {}
        self.verified = False  # some handshake was answered: the ports can be reached
        self._control_at = -CONTROL_EVERY_S
        self._control: int | None = None  # the rank of the last control handshake

    def update(self, silent: Iterable[int], controls: Iterable[int] = ()) -> dict[int, bool]:
        """Start or advance the handshakes to ``silent`` ranks (and drop those of ranks
        that report again); by rank, whether its host answered the last one that ended.

        A silent rank is probed again as soon as its last handshake ended (an answer says
        only that its host was reachable then). Until some handshake was answered, one to
        the first of ``controls`` (ranks that report) on another host is made every
        ``CONTROL_EVERY_S``, and an unanswered one counts for nothing: a firewall between
        the diagnoser and the ranks' ports drops every handshake. Ranks of this host are
        not probed.
        """
        now = time.monotonic()
        silent = {r for r in silent if not self._here(r)}
        control = None
        if not self.verified:
            controls = list(controls)
            self._look_up([r for r in controls if r not in self._known], now)
            if self._control in self._tries:
                # seen to its end, whichever rank leads the controls now: dropped, none
                # would be made for CONTROL_EVERY_S
                control = self._control
            else:
                control = next(
                    (r for r in controls if r in self._known and not self._here(r)), None
                )
        for rank in [r for r in self._tries if r not in silent and r != control]:
            self._tries.pop(rank).sock.close()
        self._poll(now)
        self.verified = self.verified or any(r.answered for r in self._last.values())
        # Only handshakes made while a rank is silent count for it: the control's answer,
        # made while it reported, says nothing of it should it fall silent later.
        for rank in [r for r in self._last if r not in silent]:
            del self._last[rank]
        due = [r for r in sorted(silent) if r not in self._tries]
        if (
            not self.verified
            and control is not None
            and control not in self._tries
            and now - self._control_at >= CONTROL_EVERY_S
        ):
            self._control_at = now
            self._control = control
            due.append(control)
        self._look_up([r for r in due if r not in self._known], now)
        for rank in due:
            if len(self._tries) >= MAX_IN_FLIGHT:
                break
            if rank in self._known:
                self._start(rank, now)
        return {
            r: reach.answered
            for r, reach in self._last.items()
            if r in silent and (reach.answered or self.verified)
        }

    def hosts(self, answered: bool) -> set[str]:
        """The addresses whose last handshake was (or went un-) ``answered``; unanswered
        ones only once some handshake was answered."""
        if not answered and not self.verified:
            return set()
        return {self._known[r][0] for r, reach in self._last.items() if reach.answered == answered}

    def _here(self, rank: int) -> bool:
        """Whether the rank's port is on this host (False while its address is unknown)."""
        return rank in self._known and self._is_local(self._known[rank][0])

    def close(self) -> None:
        for t in self._tries.values():
            t.sock.close()
        self._tries.clear()

    def prefetch(self, ranks: Iterable[int]) -> None:
        """Look up the ports of ``ranks`` not known yet, at every call: the diagnoser's
        landmarks, while the store answers, so that it has hosts to try should its own
        link go down early (a cut 0.7 s after the first round found none known)."""
        self._look_up([r for r in ranks if r not in self._known], time.monotonic(), every_s=0.0)

    def _look_up(self, ranks: list[int], now: float, every_s: float = READDRESS_S) -> None:
        ranks = [r for r in ranks if now - self._looked_up.get(r, -every_s) >= every_s]
        if not ranks:
            return
        for r in ranks:
            self._looked_up[r] = now
        try:
            self._known.update(self._addresses(ranks))
        except Exception as exc:  # noqa: BLE001 - the store may not answer: no probe now
            report_error("diagnoser.reach", exc)

    def _start(self, rank: int, now: float) -> None:
        host, port = self._known[rank]
        try:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            family, kind, proto, _, addr = info
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            report_error("diagnoser.reach", exc)
            return
        sock.setblocking(False)
        code = sock.connect_ex(addr)
        if code in (errno.EINPROGRESS, errno.EWOULDBLOCK):
            self._tries[rank] = _Try(sock, now)
            return
        sock.close()
        self._last[rank] = Reach(code in _ANSWERED, now)

    def _poll(self, now: float) -> None:
        if not self._tries:
            return
        ranks = {t.sock.fileno(): r for r, t in self._tries.items()}
        poller = select.poll()  # not select(): no limit on descriptor numbers
        for fd in ranks:
            poller.register(fd, select.POLLOUT)
        for fd, _ in poller.poll(0):
            sock = self._tries[ranks[fd]].sock
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            self._end(ranks[fd], code in _ANSWERED, now)
        for rank in [r for r, t in self._tries.items() if now - t.started >= self._timeout_s]:
            self._end(rank, False, now)

    def _end(self, rank: int, answered: bool, now: float) -> None:
        with contextlib.suppress(OSError):
            self._tries.pop(rank).sock.close()
        self._last[rank] = Reach(answered, now)
