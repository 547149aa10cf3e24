"""The live diagnoser: a thread on the diagnoser rank (or, once it took over, the standby
rank) that reads every summary each round, runs the analyzer's round and feeds the sinks. It holds
the diagnosis lease while it runs and emits verdicts only while it is the one in charge."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

from ccld_plugin.agent.agent import LocalReport
from ccld_plugin.agent.board_summary import as_board_stands
from ccld_plugin.board.job_files import board_file
from ccld_plugin.board.process import HOST_BYTES, process_alive
from ccld_plugin.config import CcldConfig, to_yaml
from ccld_plugin.control import ControlPlane, owner_record, request_timeout_s, resync_epoch
from ccld_plugin.control.reach import ReachProbe
from ccld_plugin.diagnose import Analyzer, JobView, Verdict
from ccld_plugin.diagnose.analyzer import located_by_channels
from ccld_plugin.diagnose.links.tcp_evidence import SILENT_INTERVALS
from ccld_plugin.diagnose.view import topology_of
from ccld_plugin.errors import log, report_error
from ccld_plugin.recording import RecordedRound, RoundRecorder
from ccld_plugin.services.actions import StallActions
from ccld_plugin.services.diagnosis_load import MAX_ROUND_SHARE, DiagnosisLoad, gc_paused
from ccld_plugin.services.verdict_stamps import VerdictStamps, launcher_job
from ccld_plugin.sinks import CallbackSink, Sink, close_sinks
from ccld_plugin.topology import GroupInfo, Topology, role_index
from ccld_plugin.wire.packed import PackedSummaries
from ccld_plugin.wire.summary import (
    FLAG_EXITED,
    FLAG_LAST_WORDS,
    encode_summary,
    without_channels,
)
from ccld_plugin.wire.summary_batch import SummaryTable

__all__ = ["Diagnoser"]

# Ranks whose reach ports are looked up ahead (spread over the job), to try when this
# diagnoser hears from nobody.
LANDMARKS = 8
# Renewals a standby waits for before it takes the lease over (a loaded host can delay one
# or two); the diagnoser in charge counts its lease lost one interval earlier.
LEASE_INTERVALS = 4
# A rank that leaves because its collective raised may get there before the evidence of
# why: a peer killed by a signal closes its connections before the kernel shows it gone
# (files are closed before the process becomes a zombie). Its last round then looks again,
# every FAILING_RETRY_S, for up to FAILING_GRACE_S.
FAILING_GRACE_S = 1.5
FAILING_RETRY_S = 0.1


class Diagnoser:
    def __init__(
        self,
        cfg: CcldConfig,
        control: ControlPlane,
        world: int,
        job_start_ns: int,
        sinks: list[Sink],
        own_report: Callable[[], LocalReport | None] = lambda: None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        serves_clock: bool = True,
        boards: Path | None = None,
        job: str = "",
    ) -> None:
        self.cfg = cfg
        self.control = control
        self.rank = control.rank
        # Now on the job's clock: the first diagnoser's monotonic clock, which every rank's
        # times are converted to. A standby in charge reads it through its own offset, and
        # does not serve the start-up handshake (the first diagnoser did).
        self.clock_ns = clock_ns
        self.serves_clock = serves_clock
        self.in_charge = True  # until another diagnoser holds the lease
        self._renewed_ns = time.monotonic_ns()  # the lease's last renewal
        self._lease_s = (LEASE_INTERVALS - 1) * cfg.agent.interval_s  # under the standby's wait
        # This rank's own summary, straight from its agent: the diagnoser sees itself
        # even when the store does not answer it.
        self.own_report = own_report
        self._store_failed: str | None = None  # why the store last failed, until it answers
        self._read_timeout_s = request_timeout_s(
            cfg.agent.interval_s, cfg.control.connect_timeout_s
        )
        self.world = world
        self.job_start_ns = job_start_ns
        self.sinks = [*sinks, CallbackSink()]  # and the functions given to on_verdict
        # This host's board files: a rank of this host that dies is told as its board
        # stood then (its last summary can be an interval older), read once.
        self.boards = boards
        self._words_read: set[tuple[int, int]] = set()
        # (rank, pid) whose board was seen while the process ran: only the exit path
        # removes a board (board.cleanup), so one gone since tells a clean exit
        self._boards_seen: set[tuple[int, int]] = set()
        self.analyzer = Analyzer(
            cfg.diagnoser, cfg.agent.interval_s, channel_evidence=located_by_channels
        )
        self.verdicts: list[Verdict] = []
        # Who and where of each verdict (the same from a standby: ids follow the job's start)
        self.stamps = VerdictStamps(control, launcher_job(job) or None, job_start_ns)
        self.actions = StallActions(cfg.actions, control, self.stamps.node, self._close_sinks)
        self.config_file: Path | None = None  # removed at exit with the boards
        self._tables: dict[int, tuple[int, list[GroupInfo]]] = {}
        # Of each rank, its last summary that decoded, and all of them as a table (decoded
        # again only when some value changed).
        self._last_good = PackedSummaries.of({})
        self._good_table = SummaryTable.of({})
        # of the tables, until one of them changes (kept as the same objects till then: the
        # analysis keeps what it derives from them while they stay)
        self._topology: Topology | None = None
        self._view_tables: dict[int, list[GroupInfo]] = {}
        self._groups: dict[GroupInfo, GroupInfo] = {}  # each group read, once
        # the last clock re-sync epoch posted: the current one counts as done
        self._clock_epoch = resync_epoch(clock_ns(), cfg.agent.clock_resync_s)
        self._host = socket.gethostname()
        self._owner = owner_record(self.rank, self._host, os.getpid())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._load = DiagnosisLoad()  # of its threads on this rank
        # Handshakes to silent ranks' hosts: a cut link from a wedged process (control.reach).
        # The landmarks, spread over the job (so on other hosts where there are several),
        # have their ports looked up while the store answers: they are the hosts this
        # diagnoser can still try when it hears from nobody.
        self._reach = ReachProbe(self._read_reach)
        self._landmarks = sorted({world * k // LANDMARKS for k in range(LANDMARKS)} - {self.rank})
        self._recorder: RoundRecorder | None = None
        self._last_round_ns: tuple[int, int] | None = None  # when the last round ran
        if cfg.diagnoser.record:
            try:
                self._recorder = RoundRecorder(Path(cfg.diagnoser.record), to_yaml(cfg))
            except OSError as exc:
                report_error("diagnoser.record", exc)
        self._thread = threading.Thread(target=self._run, name="ccld-diagnoser", daemon=True)
        self._lease = threading.Thread(target=self._hold_lease, name="ccld-lease", daemon=True)

    def start(self) -> None:
        self._lease.start()
        self._thread.start()

    def stop(self, failing: bool = False) -> None:
        """One last round (the exit and exception paths), so the verdict that explains a
        failing job is written before this process ends; on a ``failing`` rank's way out,
        a few more while none comes (see FAILING_GRACE_S)."""
        self._stop.set()
        for thread in (self._thread, self._lease):
            if thread.ident is not None:  # a standby taking over at exit started neither
                thread.join(timeout=self.cfg.agent.interval_s + 5)
        deadline = time.monotonic() + (FAILING_GRACE_S if failing else 0.0)
        while not self._round(last=True) and time.monotonic() < deadline and not self.job_ended():
            time.sleep(FAILING_RETRY_S)
        if self.in_charge:
            try:  # a normal end: the standby, on its own way out, must not take over
                self.control.release_diagnosis(self._owner)
            except Exception as exc:  # noqa: BLE001
                report_error("diagnoser.lease", exc)
        self._close_sinks()
        self._reach.close()
        if self._recorder is not None:
            self._recorder.close()
        if self.config_file is not None and self.cfg.board.cleanup:
            self.config_file.unlink(missing_ok=True)  # else the board directory stays

    def _close_sinks(self, within_s: float | None = None) -> None:
        sinks, self.sinks = self.sinks, []
        close_sinks(sinks, within_s)

    def job_ended(self) -> bool:
        """Whether every rank of the job left through its exit path."""
        return len(self._last_good) == self.world and bool(self._good_table.exited.all())

    def _hold_lease(self) -> None:
        """Renew the diagnosis lease every agent interval (on a connection of its own: a
        round that blocks on the store must not let it lapse), until stopped or another
        diagnoser took it over."""
        try:
            control = self.control.connect(self._read_timeout_s)
            if self.serves_clock:  # the first diagnoser; a standby took it over already
                control.take_diagnosis(
                    control.diagnosis_owner(), self.rank, self._host, os.getpid()
                )
        except Exception as exc:  # noqa: BLE001 - no lease: no standby can take over
            report_error("diagnoser.lease", exc)
            return
        while True:
            try:
                control.renew_lease()
                self._renewed_ns = time.monotonic_ns()
            except Exception as exc:  # noqa: BLE001
                report_error("diagnoser.lease", exc)
            if self._stop.wait(self.cfg.agent.interval_s):
                return

    def _still_in_charge(self) -> bool:
        """Whether this diagnoser still holds the lease. One that lost it (it froze long
        enough for the standby to take over) emits nothing more and stops its rounds."""
        if not self.in_charge:
            return False
        try:
            owner = self.control.diagnosis_owner()
        except Exception:  # noqa: BLE001 - the store does not answer us
            # As with any lease: unrenewed for as long as the standby waits, it may have
            # passed to the standby, which reaches the store where we do not. Say nothing
            # rather than twice (the standby names us; without one, we stay in charge).
            # Unless the store's own host does not answer our handshakes: then no standby
            # off that host reaches the store either, to take the lease over.
            unrenewed_s = (time.monotonic_ns() - self._renewed_ns) / 1e9
            return (
                not self.cfg.diagnoser.standby
                or unrenewed_s < self._lease_s
                or self._store_host_cut_off()
            )
        if owner is not None and owner != self._owner:
            self.in_charge = False
            self._stop.set()
            log.warning(
                "ccld: rank %d's diagnoser lost the diagnosis lease to %s; it stops",
                self.rank,
                owner.decode(errors="replace"),
            )
        return self.in_charge

    def _store_host_cut_off(self) -> bool:
        """Whether our handshakes do not reach the store's host while they reach others'
        (so it is that host's link that is down, not ours)."""
        try:
            host, port = self.control.address
            store = {str(a[4][0]) for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        except OSError:
            return False
        return bool(store & self._reach.hosts(answered=False)) and bool(
            self._reach.hosts(answered=True)
        )

    def _run(self) -> None:
        try:
            if self.serves_clock:
                self.control.serve_clock(self.job_start_ns, self.cfg.control.connect_timeout_s)
            self.control.set_timeout(self._read_timeout_s)
        except Exception as exc:  # noqa: BLE001
            report_error("diagnoser.clock", exc)
        interval = self.cfg.agent.interval_s
        pause = interval / 2
        while not self._stop.wait(min(pause, self._until_clock_epoch())):
            self._post_clock_epoch()
            t0 = time.thread_time()
            self._round()
            # On a training rank the rounds hold its GIL: at thousands of ranks a round
            # takes a good share of a second, and back to back they would slow this rank's
            # own training (and make it look like a straggler). There they take at most
            # MAX_ROUND_SHARE of the time; a diagnoser of its own (rank -1) needs no cap.
            # The round's CPU time, not its wall time: a round that waited 2 s for a store
            # cut off from it held no GIL, and paused 8 s after it the diagnoser missed
            # its own isolation (its peers' stale summaries named them unresponsive).
            cost = time.thread_time() - t0
            if self.rank >= 0:
                pause = max(interval / 2, cost * (1 - MAX_ROUND_SHARE) / MAX_ROUND_SHARE)

    def _until_clock_epoch(self) -> float:
        """Seconds to the next clock re-sync (the agents wait for its timestamps)."""
        period = self.cfg.agent.clock_resync_s
        if not period:
            return float("inf")
        return max(0.0, (self._clock_epoch + 1) * period - self.clock_ns() / 1e9)

    def _post_clock_epoch(self) -> None:
        epoch = resync_epoch(self.clock_ns(), self.cfg.agent.clock_resync_s)
        if epoch <= self._clock_epoch:
            return
        self._clock_epoch = epoch
        try:
            self.control.post_clock_epoch(epoch, self.clock_ns)
        except Exception as exc:  # noqa: BLE001
            report_error("diagnoser.clock_resync", exc)

    def _round(self, last: bool = False) -> int:
        """One diagnoser round (``last``: on this process's way out, when nothing more can
        be waited for); the number of verdicts it emitted."""
        start_ns = self.clock_ns()
        try:
            return self._round_once(last, start_ns)
        finally:
            self._last_round_ns = (start_ns, self.clock_ns())

    def _round_once(self, last: bool, start_ns: int) -> int:
        with self._lock:
            try:
                with gc_paused():
                    view = self._view(last)
                    self._record(view)
                    verdicts = self.analyzer.round(view) if view.summaries else []
            except Exception as exc:  # noqa: BLE001
                report_error("diagnoser.round", exc)
                return 0
            if verdicts and not self._still_in_charge():
                return 0
            if verdicts:
                self.stamps.stamp(verdicts, view)
            for v in verdicts:
                self.verdicts.append(v)
                try:  # a standby that takes over does not report it again
                    self.control.record_reported(v.key())
                except Exception as exc:  # noqa: BLE001
                    report_error("diagnoser.reported", exc)
                log.info("ccld verdict: %s", v.to_dict())
                for sink in self.sinks:
                    try:
                        sink.emit(v)
                    except Exception as exc:  # noqa: BLE001
                        report_error(f"diagnoser.{type(sink).__name__}", exc)
            round_s = (self.clock_ns() - start_ns) / 1e9
            for sink in self.sinks:
                if hasattr(sink, "observe"):
                    try:
                        sink.observe(view, self.analyzer, round_s)
                    except Exception as exc:  # noqa: BLE001
                        report_error(f"diagnoser.{type(sink).__name__}", exc)
            if self.actions.act(verdicts):  # the job is ended: no more rounds
                self._stop.set()
        return len(verdicts)

    def _record(self, view: JobView) -> None:
        """Append the round's input to the recording (diagnoser.record)."""
        if self._recorder is None:
            return
        try:
            self._recorder.write(
                RecordedRound(
                    now_ns=view.now_ns,
                    job_start_ns=view.job_start_ns,
                    world=view.world,
                    values=self._last_good,
                    tables=view.tables,
                    gone=view.gone,
                    observer=view.observer,
                    store_local=view.store_local,
                    store_failed=view.store_failed,
                    observer_load=view.observer_load,
                    observer_round_ns=view.observer_round_ns,
                    reach=view.reach,
                )
            )
        except Exception as exc:  # noqa: BLE001
            report_error("diagnoser.record", exc)
            self._recorder = None

    def _read_store(self) -> tuple[Mapping[int, bytes], str | None]:
        """Every rank's latest summary from the store, or ({}, why) when the store does not
        answer within the read timeout."""
        try:
            raw = self.control.read_summaries(range(self.world))
        except Exception as exc:  # noqa: BLE001 - the store is down, or cut off from us
            why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            if self._store_failed is None:  # once per outage
                report_error("diagnoser.store", exc)
            self._store_failed = why
            return {}, why
        if self._store_failed is not None:
            log.warning("ccld: the store answers the diagnoser again")
        self._store_failed = None
        return raw, None

    def _view(self, last: bool = False) -> JobView:
        raw, store_failed = self._read_store()
        own = self.own_report()
        if own is not None:
            raw = PackedSummaries.of(raw).merged({self.rank: own.summary})
            if self._tables.get(self.rank, (None,))[0] != own.groups_version:
                self._tables[self.rank] = (own.groups_version, own.groups)
                self._topology = None
        summaries = self._summaries(raw)
        versions = summaries.heads["groups_version"].tolist()
        unknown = [
            i
            for i, (rank, version) in enumerate(
                zip(summaries.ranks.tolist(), versions, strict=True)
            )
            if self._tables.get(rank, (None,))[0] != version
        ]
        if unknown:
            keep = np.ones(len(summaries), bool)
            for i in unknown:
                rank = int(summaries.ranks[i])
                table = None if store_failed else self._read_table(rank)
                if table is None:
                    keep[i] = False
                    continue
                self._tables[rank] = table
                self._topology = None
            if not keep.all():
                summaries = summaries.select(keep)
        if self._topology is None or len(self._view_tables) != len(summaries):
            tables = {r: self._tables[r][1] for r in summaries.ranks.tolist()}
            self._topology, self._view_tables = topology_of(tables), tables
        gone = self._gone(summaries)
        words = self._last_words(summaries, gone)
        if words:
            summaries = self._summaries(words)
        view = JobView(
            summaries=summaries,
            tables=self._view_tables,
            now_ns=self.clock_ns(),
            job_start_ns=self.job_start_ns,
            world=self.world,
            gone=gone,
            topology=self._topology,
            observer=self.rank if self.rank >= 0 else None,
            store_local=self.control.store_local,
            store_failed=store_failed,
            observer_load=self._load.share() if self.rank >= 0 else 0.0,
            observer_round_ns=self._last_round_ns if self.rank >= 0 else None,
            final=last,
        )
        view.reach = self._probe_silent(view)
        return view

    def _probe_silent(self, view: JobView) -> dict[int, bool]:
        """Start or advance handshakes to the ranks that fell silent (not gone, not
        exited); by rank, whether its host answered the last one."""
        t = view.columns
        silent = view.silent(SILENT_INTERVALS * self.cfg.agent.interval_s)
        silent -= {*t.ranks[t.exited].tolist(), self.rank}
        controls: list[int] = []
        try:
            if self._store_failed is None:
                # the landmarks' ports, each round until known (a few keys): the hosts to
                # try should the store cut us off
                self._reach.prefetch(self._landmarks)
                if not self._reach.verified:
                    # landmarks that report: an answer of one shows that the ranks' ports
                    # can be reached from here at all (once, while the job is healthy)
                    controls = [r for r in self._landmarks if r in t and r not in silent]
            return self._reach.update(silent, controls)
        except Exception as exc:  # noqa: BLE001 - no answer either way: as before probes
            report_error("diagnoser.reach", exc)
            return {}

    def _read_reach(self, ranks: list[int]) -> dict[int, tuple[str, int]]:
        # not while the store fails us: each read would wait out the request timeout
        return {} if self._store_failed is not None else self.control.read_reach(ranks)

    def _summaries(self, raw: Mapping[int, bytes]) -> SummaryTable:
        """The summaries that decode and fit this job. A corrupt one is counted (contained
        error ``diagnoser.decode``) and the rank's last good summary stands in, so that a
        rank whose reports stay unreadable ages into an unresponsive one; channel evidence
        naming a rank outside the job is dropped the same way. Every rank ever heard from
        is in: one that is heard from no more (its key unreadable, the store gone) ages in
        the view into a silent or unresponsive rank."""
        values = self._last_good.merged(raw)
        if values == self._last_good:  # nothing new: the last table stands
            return self._good_table
        table, bad = SummaryTable.decode(values)
        bad.update(_not_of_job(table, self.world))
        if bad:
            fixed = dict(values)
            for rank, why in sorted(bad.items()):
                report_error("diagnoser.decode", ValueError(why))
                if rank in self._last_good:
                    fixed[rank] = self._last_good[rank]
                else:
                    del fixed[rank]
            values = PackedSummaries.of(fixed)
            table, bad = SummaryTable.decode(values)  # the last good values decode
        rows = table.channel_rows().entries
        outside = set(rows["rank"][rows["peer"] >= self.world].tolist())
        for rank in sorted(outside):
            report_error(
                "diagnoser.decode", ValueError(f"rank {rank}: a channel peer not in the job")
            )
        if outside:
            values = values.merged({r: without_channels(values[r]) for r in outside})
            table.without_channels(outside)
        self._last_good, self._good_table = values, table
        return table

    def _gone(self, summaries: SummaryTable) -> set[int]:
        """The ranks whose process is seen gone without leaving through the exit path (only
        a process of this host can be looked at). The boards of those that run are noted
        (``_boards_seen``)."""
        here = os.uname().nodename[:HOST_BYTES]
        local = summaries.rows_on_hosts(lambda h: not h or h[:HOST_BYTES] == here)
        pids = summaries.heads["pid"]
        gone = set()
        for i in np.flatnonzero(local & ~summaries.exited).tolist():
            rank, pid = int(summaries.ranks[i]), int(pids[i])
            if process_alive(pid, summaries.host(i)) is False:
                gone.add(rank)
            elif (
                self.boards is not None
                and (rank, pid) not in self._boards_seen
                and board_file(self.boards, rank).exists()
            ):
                self._boards_seen.add((rank, pid))
        return gone

    def _last_words(self, summaries: SummaryTable, gone: set[int]) -> dict[int, bytes]:
        """By rank gone on this host with no last words in its summary yet: its summary as
        its board stood when it died (a node leader brings the same, but not when the job
        comes down at once: a killed diagnoser was named at step 3, killed at 6)."""
        if self.boards is None:
            return {}
        out = {}
        for rank in sorted(gone):
            last = summaries[rank]
            if last.flags & FLAG_LAST_WORDS or (rank, last.pid) in self._words_read:
                continue
            self._words_read.add((rank, last.pid))
            board = board_file(self.boards, rank)
            if (rank, last.pid) in self._boards_seen and not board.exists():
                # removed on the exit path: its final summary never reached us (the store
                # may have ended first, with the rank that hosts it)
                out[rank] = encode_summary(replace(last, flags=last.flags | FLAG_EXITED))
                continue
            try:
                now = as_board_stands(board, last.pid, last, died=True)
            except Exception as exc:  # noqa: BLE001 - its last summary stands
                report_error("diagnoser.last_words", exc)
                continue
            if now is not None:
                out[rank] = encode_summary(now)
        return out

    def _read_table(self, rank: int) -> tuple[int, list[GroupInfo]] | None:
        """A rank's group table from the store, or None (counted) when it is corrupt."""
        try:
            version, groups = self.control.read_groups(rank)
            for g in groups:
                _fits_group(g, rank, self.world)
        except (ValueError, KeyError, TypeError) as exc:
            report_error("diagnoser.groups", ValueError(f"rank {rank}'s group table: {exc}"))
            return None
        # Every member's table names the group: one object for all of them (a DP group of
        # 2,048 ranks in each of its members' tables would be ~1 GB at 65,536 ranks).
        return version, [self._groups.setdefault(g, g) for g in groups]


def _not_of_job(table: SummaryTable, world: int) -> dict[int, str]:
    """By rank, why a decoded summary does not fit the job (its own checks passed in
    decoding): another rank's key, a peer outside the job."""
    out = {}
    keys = table.ranks.tolist()
    for key, rank in zip(keys, table.heads["rank"].tolist(), strict=True):
        if key != rank:
            out[key] = f"the summary under rank {key}'s key is rank {rank}'s"
    f = table.flights
    for row in f["row"][f["peer"] >= world].tolist():
        key = keys[row]
        out.setdefault(key, f"rank {key}: an in-flight op with a peer outside the job")
    return out


def _fits_group(g: GroupInfo, rank: int, world: int) -> None:
    role_index(g.role)
    ranks = set(g.ranks)
    if (
        not all(type(r) is int and 0 <= r < world for r in g.ranks)
        or len(ranks) != len(g.ranks)
        or rank not in ranks
    ):
        raise ValueError(f"group {g.group_id:016x} has ranks {list(g.ranks)[:8]}")
