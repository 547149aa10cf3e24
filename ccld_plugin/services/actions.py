"""Acting on a stall (``actions``): a stall verdict (hang, deadlock, mismatch,
unresponsive) that stands ``actions.abort_after_s`` with no ``resumed`` verdict ending it
is acted on. Its culprits' hosts are appended to ``actions.exclude_file``, and with
``actions.on_hang: abort`` the job is ended: the diagnoser posts an abort record in the
store, and every rank's :class:`AbortWatch` reads it at its next tick and ends its process
with ABORT_EXIT_CODE, so that the launcher's restart policy (torchrun ``--max-restarts``,
Slurm's requeue) takes over within seconds instead of after the collective timeout."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from ccld_plugin.config import ActionsConfig
from ccld_plugin.control import ClockSync, ControlPlane
from ccld_plugin.diagnose import Verdict
from ccld_plugin.diagnose.records import Cause, Culprit, Kind, iso_time
from ccld_plugin.errors import log, report_error
from ccld_plugin.files import make_private_dirs, open_private

__all__ = ["ABORT_EXIT_CODE", "STALL_KINDS", "AbortWatch", "StallActions", "abort_line"]

# EX_TEMPFAIL (sysexits.h): a temporary failure, worth a retry. Every rank of an aborted
# job exits with it (docs/actions.md; Slurm: RequeueExit=75 requeues the job on it).
ABORT_EXIT_CODE = 75
STALL_KINDS = {Kind.HANG, Kind.DEADLOCK, Kind.MISMATCH, Kind.UNRESPONSIVE}
# How long the sinks may take to send what they hold before an aborted job's ranks leave.
FLUSH_S = 5.0


class StallActions:
    """The diagnoser's side: the stalls due to be acted on (``clock``: monotonic seconds),
    the exclude file, and the abort record. ``node`` names a culprit's host as the
    scheduler knows it; ``flush`` closes the diagnoser's sinks, within the seconds given,
    before the job (this rank too) is ended."""

    def __init__(
        self,
        cfg: ActionsConfig,
        control: ControlPlane,
        node: Callable[[Culprit], str | None],
        flush: Callable[[float], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.control = control
        self.node = node
        self.flush = flush
        self.clock = clock
        self._pending: dict[str, tuple[Verdict, float]] = {}  # id -> (stall, when due)
        self.active = cfg.on_hang == "abort" or bool(cfg.exclude_file)
        self.aborted = False

    def act(self, verdicts: list[Verdict]) -> bool:
        """Take in a round's verdicts (stamped) and act on the stalls now due: whether the
        job is being ended."""
        if not self.active or self.aborted:
            return False
        try:
            due = self.take(verdicts)
            if not due:
                return False
            self.exclude(due)
            if self.cfg.on_hang != "abort":
                return False
            line = abort_line(due[0])
            log.warning(
                "ccld: the job is aborted after %s (actions.on_hang=abort): every rank exits "
                "with code %d",
                line,
                ABORT_EXIT_CODE,
            )
            self.aborted = True
            self.flush(FLUSH_S)  # what the sinks hold goes out before this rank leaves too
            when = iso_time(datetime.now(timezone.utc))
            self.control.post_abort({"stall": line, "id": due[0].id, "time": when})
        except Exception as exc:  # noqa: BLE001
            report_error("actions", exc)
        return self.aborted

    def take(self, verdicts: list[Verdict]) -> list[Verdict]:
        """Take in a round's verdicts; the stalls that stood ``abort_after_s`` by now."""
        now = self.clock()
        for v in verdicts:
            if v.kind in STALL_KINDS and v.id is not None:
                self._pending.setdefault(v.id, (v, now + self.cfg.abort_after_s))
            elif v.kind is Kind.RESUMED and v.resumes is not None:
                self._pending.pop(v.resumes, None)  # it went on: nothing to act on
        due = [(i, v) for i, (v, when) in self._pending.items() if when <= now]
        for i, _ in due:
            del self._pending[i]
        return [v for _, v in due]

    def exclude(self, stalls: list[Verdict]) -> list[str]:
        """Append the hosts of the stalls' culprits to the exclude file, one a line, those
        not in it already; the hosts appended. A stall of no one in particular (software:
        a mismatch, a deadlock; or every member of its group named, no culprit found) names
        no host to leave out."""
        path = self.cfg.exclude_file
        if not path:
            return []
        hosts: list[str] = []
        for v in stalls:
            if v.cause is Cause.SOFTWARE or (v.group and sorted(v.ranks) == v.group["ranks"]):
                continue
            hosts += [h for c in v.culprits if (h := self.node(c)) and h not in hosts]
        if not hosts:
            return []
        try:
            file = Path(path)
            make_private_dirs(file.parent)
            with open(open_private(file, append=True), "a", encoding="utf-8") as fh:
                listed = set(file.read_text(encoding="utf-8", errors="replace").split())
                new = [h for h in hosts if h not in listed]
                fh.write("".join(f"{h}\n" for h in new))
        except OSError as exc:
            report_error("actions.exclude_file", exc)
            return []
        if new:
            log.warning("ccld: %s appended to %s (actions.exclude_file)", ", ".join(new), path)
        return new


def abort_line(v: Verdict) -> str:
    """What an aborted rank says it leaves for: the stall, its culprits and where."""
    where = ", ".join(
        f"rank {c.rank}" + (f" on {c.host}" if c.host else "") for c in v.culprits[:8]
    )
    more = f" and {len(v.culprits) - 8} more" if len(v.culprits) > 8 else ""
    group = f" in {v.group['role']}{v.group['ranks']}" if v.group else ""
    return f"{v.kind.value} {v.id}: {v.cause.value}-bound, {where}{more}{group}"


class AbortWatch:
    """A rank's side of ``actions.on_hang=abort``: a thread that looks for the abort record
    once a tick, at the ticks' boundaries on the job's clock (every rank looks within
    milliseconds of the others, so they all leave before a launcher that sees the first
    exit ends the rest), and ends the process with ABORT_EXIT_CODE. It needs only the
    store (``control``, the agent's): it leaves while the training thread is stuck in a
    collective or in compute."""

    def __init__(
        self,
        control: ControlPlane,
        interval_s: float,
        clock: Callable[[], ClockSync | None],
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.control = control
        self.interval_s = interval_s
        self.clock = clock
        self._exit = exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ccld-abort-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)

    def _run(self) -> None:
        # over the agent's connection (its requests give up in time when the store is
        # gone): one more connection per rank would be thousands more at the store
        while not self._stop.wait(self._until_tick()):
            try:
                record = self.control.read_abort()
            except Exception as exc:  # noqa: BLE001 - the store may be down: look again
                report_error("actions.abort_watch", exc)
                continue
            if record is not None:
                self._leave(record)
                return

    def _until_tick(self) -> float:
        """Seconds to the next tick boundary on the job's clock (the agents' ticks; a
        tenth of a tick after it, clear of the agents' own store requests)."""
        period = int(self.interval_s * 1e9)
        clock = self.clock()
        now = clock.to_diag(time.monotonic_ns()) if clock else time.monotonic_ns()
        return ((period - now % period) + period // 10) % period / 1e9 or self.interval_s

    def _leave(self, record: dict) -> None:
        rank = self.control.rank
        print(
            f"ccld: rank {rank} exits with code {ABORT_EXIT_CODE}: the job is aborted after "
            f"{record.get('stall', 'a stall')} (at {record.get('time', '?')}; "
            "actions.on_hang=abort: the launcher's restart policy takes over)",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        try:
            self.control.leave_together(max(1.0, 2 * self.interval_s))
        except Exception:  # noqa: BLE001 - the store's host left first: so do we
            pass
        self._exit(ABORT_EXIT_CODE)
