"""The standby diagnoser: diagnosis survives the diagnoser rank.

The diagnoser in charge renews a lease in the store every agent interval
(``ControlPlane.renew_lease``). The standby rank watches it: when the renewals stop for
LEASE_INTERVALS intervals, or at once when the diagnoser's process is seen gone on this
host, it takes the lease over (``take_diagnosis``: compare-and-set, one claimant wins),
starts a diagnoser of its own that does not report again what was reported, and goes on.
The lost diagnoser rank is then named by that diagnoser like any lost rank
(``unresponsive``). A job that crashes right after losing its diagnoser leaves the standby
little time: at exit, a standby whose diagnoser stopped renewing runs the last round
itself. Where the store died with the diagnoser rank, nothing can be taken over: the
agents keep their boards for ``ccld diagnose``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable

from ccld_plugin.board.process import process_alive
from ccld_plugin.config import CcldConfig
from ccld_plugin.control import ControlPlane, request_timeout_s
from ccld_plugin.errors import log, report_error
from ccld_plugin.services.diagnoser import (
    FAILING_GRACE_S,
    FAILING_RETRY_S,
    LEASE_INTERVALS,
    Diagnoser,
)

__all__ = ["Standby", "standby_rank"]


def standby_rank(diagnoser: int, world: int, ranks_per_node: int, chosen: int) -> int | None:
    """The standby of ``diagnoser``: ``chosen`` when set (>= 0), else the same local rank on
    the next node, so that a node's failure does not take both; on a single node, the next
    rank. None without one (a one-rank job, or a standby that would be the diagnoser)."""
    if chosen >= 0:
        rank = chosen
    elif diagnoser < 0:  # a diagnoser of its own, outside the job
        rank = 0
    elif 0 < ranks_per_node < world:
        rank = (diagnoser + ranks_per_node) % world
    else:
        rank = (diagnoser + 1) % world
    return None if rank == diagnoser or rank >= world else rank


class Standby:
    def __init__(
        self,
        cfg: CcldConfig,
        control: ControlPlane,
        make_diagnoser: Callable[[], Diagnoser],
    ) -> None:
        self.cfg = cfg
        self.control = control
        self.rank = control.rank
        self._make_diagnoser = make_diagnoser
        self.diagnoser: Diagnoser | None = None  # once it took over
        self._host = socket.gethostname()
        self._owner: bytes | None = None  # the owner record last seen, and its beat
        self._beat = -1
        self._changed_ns = time.monotonic_ns()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ccld-standby", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, failing: bool = False) -> None:
        """Stop watching. A diagnoser that stopped renewing within the last interval (or,
        ``failing``, is seen gone within FAILING_GRACE_S) is taken over now, for one last
        round: the job may be ending because of its loss."""
        self._stop.set()
        self._thread.join(timeout=self.cfg.agent.interval_s + 5)
        # failing: the diagnoser rank may have been killed a moment ago, its process not
        # yet seen gone (see FAILING_GRACE_S); look again for a moment
        deadline = time.monotonic() + (FAILING_GRACE_S if failing else 0.0)
        while self.diagnoser is None:
            try:
                if self._lost(min_stale_s=self.cfg.agent.interval_s):
                    self._take_over(start=False)
                    break
            except Exception as exc:  # noqa: BLE001
                report_error("standby.lease", exc)
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(FAILING_RETRY_S)
        if self.diagnoser is not None:
            self.diagnoser.stop(failing)

    def _run(self) -> None:
        interval = self.cfg.agent.interval_s
        try:
            self.control = self.control.connect(request_timeout_s(interval))
        except Exception as exc:  # noqa: BLE001 - nothing to watch the lease with
            report_error("standby.lease", exc)
            return
        while not self._stop.wait(interval):
            try:
                if self._lost(min_stale_s=LEASE_INTERVALS * interval) and self._take_over():
                    return
            except Exception as exc:  # noqa: BLE001 - the store may be down: keep watching
                report_error("standby.lease", exc)

    def _lost(self, min_stale_s: float) -> bool:
        """Whether the diagnoser in charge is lost: its renewals stood still for
        ``min_stale_s``, or its process is gone from this host."""
        owner = self.control.diagnosis_owner()
        if owner is None or self.control.diagnosis_released(owner):
            return False  # no diagnoser has started yet, or it ended on purpose
        beat = self.control.lease_beat()
        now = time.monotonic_ns()
        if owner != self._owner or beat != self._beat:
            self._owner, self._beat, self._changed_ns = owner, beat, now
            return self._gone(owner)
        return (now - self._changed_ns) / 1e9 >= min_stale_s or self._gone(owner)

    def _gone(self, owner: bytes) -> bool:
        who = json.loads(owner)
        return process_alive(int(who["pid"]), str(who["host"])) is False

    def _take_over(self, start: bool = True) -> bool:
        """Claim the lease from the owner last seen; start a diagnoser (or, at exit, make
        one for its last round). False when another claimant won."""
        if not self.control.take_diagnosis(self._owner, self.rank, self._host, os.getpid()):
            self._owner = None
            return False
        lost = json.loads(self._owner) if self._owner else {}
        stale_s = (time.monotonic_ns() - self._changed_ns) / 1e9
        log.warning(
            "ccld: rank %d takes diagnosis over from rank %s (its lease was not renewed for "
            "%.1f s)",
            self.rank,
            lost.get("rank", "?"),
            stale_s,
        )
        diagnoser = self._make_diagnoser()
        diagnoser.analyzer.mark_reported(self.control.reported_keys())
        self.diagnoser = diagnoser
        if start:
            diagnoser.start()
        return True
