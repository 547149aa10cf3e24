"""The live-diagnosis services of a session: the agent in every rank, and the diagnoser
thread on the diagnoser rank, which reads every summary each round and feeds the sinks."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccld_plugin.agent.agent import Agent, StepClock
from ccld_plugin.board.job_files import JOB_CONFIG
from ccld_plugin.config import CcldConfig, to_yaml
from ccld_plugin.control import ControlPlane, resync_epoch
from ccld_plugin.diagnose import Diagnoser, JobView, Verdict
from ccld_plugin.diagnose.nccl_evidence import nccl_evidence
from ccld_plugin.diagnose.tcp_evidence import Located, channel_evidence
from ccld_plugin.diagnose.view import topology_of
from ccld_plugin.errors import log, report_error
from ccld_plugin.sinks import Sink, build_sinks
from ccld_plugin.wire.peer_channels import channel_rows
from ccld_plugin.wire.summary import RankSummary, decode_summary
from ccld_plugin.wire.topology import GroupInfo, Topology, role_index

__all__ = ["DiagnoserService", "Services", "start"]

MAX_ROUND_SHARE = 0.2  # of the diagnoser rank's time spent in diagnoser rounds


@dataclass
class Services:
    """What runs beside training in one rank: its agent, and on the diagnoser rank the
    diagnoser thread. ``steps`` is the agent's step clock (``mark_step`` feeds it)."""

    agent: Agent
    steps: StepClock
    diagnoser: DiagnoserService | None = None

    def stop(self) -> None:
        """The agent first, then the diagnoser (its last round sees the agent's last
        summary); each failure contained."""
        for svc in (self.agent, self.diagnoser):
            if svc is None:
                continue
            try:
                svc.stop()
            except Exception as exc:  # noqa: BLE001
                report_error("services.stop", exc)

    def job_seconds(self, mono_ns: int) -> float | None:
        clock = self.agent.clock
        return None if clock is None else clock.job_seconds(mono_ns)


def start(
    cfg: CcldConfig, rank: int, world: int, job: str, board_path: Path, tracer: Any, started_ns: int
) -> Services:
    """Start the agent (and on the diagnoser rank, the diagnoser) of a rank."""
    control = ControlPlane(cfg.control, rank, world, job, cfg.diagnoser.rank)
    steps = StepClock()
    timeout = cfg.control.connect_timeout_s
    diag = None
    if rank == cfg.diagnoser.rank:
        diag = DiagnoserService(cfg, control.connect(), world, started_ns, build_sinks(cfg.sinks))
        diag.config_file = _write_job_config(cfg, board_path.parent)
        diag.start()
    agent = Agent(
        cfg.agent,
        control,
        board_path,
        rank,
        socket.gethostname(),
        os.getpid(),
        tracer,
        steps,
        timeout + 5,
    )
    agent.start()
    return Services(agent, steps, diag)


def _write_job_config(cfg: CcldConfig, board_dir: Path) -> Path | None:
    """The job's configuration beside its boards: ``ccld diagnose`` reads its thresholds
    from there, so a post-mortem judges the boards as the live diagnoser did."""
    path = board_dir / JOB_CONFIG
    try:
        path.write_text(to_yaml(cfg))
    except OSError as exc:
        report_error("services.job_config", exc)
        return None
    return path


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection during a diagnoser round. A round builds tens of
    objects per rank; at thousands of ranks the collections they trigger (each a pass over
    the detector's long-lived state) cost more than the round itself (3-4x at 2,048 ranks).
    Collection only waits until the round ends, and the collector stays off if it was off
    (frameworks that collect by hand, such as Megatron's --manual-gc)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def located_by_channels(view: JobView, group: GroupInfo, members: list[int]) -> Located | None:
    """Where a hang's channels put it: NCCL wait states first (they say exactly what each
    step waits for), then the TCP connections."""
    return nccl_evidence(view, group, members) or channel_evidence(view, group, members)


class DiagnoserService:
    def __init__(
        self,
        cfg: CcldConfig,
        control: ControlPlane,
        world: int,
        job_start_ns: int,
        sinks: list[Sink],
    ) -> None:
        self.cfg = cfg
        self.control = control
        self.world = world
        self.job_start_ns = job_start_ns
        self.sinks = sinks
        self.diagnoser = Diagnoser(
            cfg.diagnoser, cfg.agent.interval_s, channel_evidence=located_by_channels
        )
        self.verdicts: list[Verdict] = []
        self.config_file: Path | None = None  # removed at exit with the boards
        self._tables: dict[int, tuple[int, list[GroupInfo]]] = {}
        self._last_good: dict[int, RankSummary] = {}  # of each rank, as decoded
        self._topology: Topology | None = None  # of the tables, until one of them changes
        self._topology_ranks = 0
        # the last clock re-sync epoch posted: the current one counts as done
        self._clock_epoch = resync_epoch(time.monotonic_ns(), cfg.agent.clock_resync_s)
        self._host = socket.gethostname()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ccld-diagnoser", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """One last round (the exit and exception paths), so the verdict that explains a
        failing job is written before this process ends."""
        self._stop.set()
        self._thread.join(timeout=self.cfg.agent.interval_s + 5)
        self._round()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                report_error("diagnoser.sink", exc)
        if self.config_file is not None and self.cfg.board.cleanup:
            self.config_file.unlink(missing_ok=True)  # else the board directory stays

    def _run(self) -> None:
        try:
            self.control.serve_clock(self.job_start_ns, self.cfg.control.connect_timeout_s)
        except Exception as exc:  # noqa: BLE001
            report_error("diagnoser.clock", exc)
        interval = self.cfg.agent.interval_s
        pause = interval / 2
        while not self._stop.wait(min(pause, self._until_clock_epoch())):
            self._post_clock_epoch()
            t0 = time.perf_counter()
            self._round()
            # The rounds run on a training rank and hold the GIL: at thousands of ranks a
            # round takes a good share of a second, and back to back they would slow this
            # rank's own training (and make it look like a straggler). Keep them to at most
            # MAX_ROUND_SHARE of the time.
            cost = time.perf_counter() - t0
            pause = max(interval / 2, cost * (1 - MAX_ROUND_SHARE) / MAX_ROUND_SHARE)

    def _until_clock_epoch(self) -> float:
        """Seconds to the next clock re-sync (the agents wait for its timestamps)."""
        period = self.cfg.agent.clock_resync_s
        if not period:
            return float("inf")
        return max(0.0, (self._clock_epoch + 1) * period - time.monotonic_ns() / 1e9)

    def _post_clock_epoch(self) -> None:
        epoch = resync_epoch(time.monotonic_ns(), self.cfg.agent.clock_resync_s)
        if epoch <= self._clock_epoch:
            return
        self._clock_epoch = epoch
        try:
            self.control.post_clock_epoch(epoch)
        except Exception as exc:  # noqa: BLE001
            report_error("diagnoser.clock_resync", exc)

    def _round(self) -> None:
        with self._lock:
            try:
                with gc_paused():
                    view = self._view()
                    verdicts = self.diagnoser.round(view) if view.summaries else []
            except Exception as exc:  # noqa: BLE001
                report_error("diagnoser.round", exc)
                return
            for v in verdicts:
                self.verdicts.append(v)
                log.info("ccld verdict: %s", v.to_dict())
                for sink in self.sinks:
                    try:
                        sink.emit(v)
                    except Exception as exc:  # noqa: BLE001
                        report_error(f"diagnoser.{type(sink).__name__}", exc)
            for sink in self.sinks:
                if hasattr(sink, "observe"):
                    try:
                        sink.observe(view, self.diagnoser)
                    except Exception as exc:  # noqa: BLE001
                        report_error(f"diagnoser.{type(sink).__name__}", exc)

    def _view(self) -> JobView:
        summaries = self._summaries(self.control.read_summaries(range(self.world)))
        for rank, s in list(summaries.items()):
            known = self._tables.get(rank)
            if known is None or known[0] != s.groups_version:
                table = self._read_table(rank)
                if table is None:
                    del summaries[rank]
                    continue
                self._tables[rank] = table
                self._topology = None
        tables = {r: t for r, (_, t) in self._tables.items() if r in summaries}
        if self._topology is None or self._topology_ranks != len(tables):
            self._topology, self._topology_ranks = topology_of(tables), len(tables)
        gone = {
            r
            for r, s in summaries.items()
            if s.host == self._host and not s.exited and not _alive(s.pid)
        }
        return JobView(
            summaries=summaries,
            tables=tables,
            now_ns=time.monotonic_ns(),
            job_start_ns=self.job_start_ns,
            world=self.world,
            gone=gone,
            topology=self._topology,
        )

    def _summaries(self, raw: dict[int, bytes]) -> dict[int, RankSummary]:
        """The summaries that decode and fit this job. A corrupt one is counted (contained
        error ``diagnoser.decode``) and the rank's last good summary stands in, so that a
        rank whose reports stay unreadable ages into an unresponsive one; channel evidence
        naming a rank outside the job is dropped the same way."""
        fresh: dict[int, RankSummary] = {}
        for rank, data in raw.items():
            try:
                s = decode_summary(data)
                _fits_job(s, rank, self.world)
            except ValueError as exc:
                report_error("diagnoser.decode", exc)
                continue
            fresh[rank] = s
        rows = channel_rows(fresh.values()).entries
        for rank in set(rows["rank"][rows["peer"] >= self.world].tolist()):
            fresh[rank].channels = b""
            report_error(
                "diagnoser.decode", ValueError(f"rank {rank}: a channel peer not in the job")
            )
        self._last_good.update(fresh)
        return {r: self._last_good[r] for r in raw if r in self._last_good}

    def _read_table(self, rank: int) -> tuple[int, list[GroupInfo]] | None:
        """A rank's group table from the store, or None (counted) when it is corrupt."""
        try:
            version, groups = self.control.read_groups(rank)
            for g in groups:
                _fits_group(g, rank, self.world)
        except (ValueError, KeyError, TypeError) as exc:
            report_error("diagnoser.groups", ValueError(f"rank {rank}'s group table: {exc}"))
            return None
        return version, groups


def _fits_job(s: RankSummary, rank: int, world: int) -> None:
    """Raise ValueError when a decoded summary does not fit the job (its own checks passed
    in decode_summary): another rank's key, a peer outside the job."""
    if s.rank != rank:
        raise ValueError(f"the summary under rank {rank}'s key is rank {s.rank}'s")
    if any(op.peer >= world for op in s.in_flight):
        raise ValueError(f"rank {rank}: an in-flight op with a peer outside the job")


def _fits_group(g: GroupInfo, rank: int, world: int) -> None:
    role_index(g.role)
    ranks = set(g.ranks)
    if (
        not all(type(r) is int and 0 <= r < world for r in g.ranks)
        or len(ranks) != len(g.ranks)
        or rank not in ranks
    ):
        raise ValueError(f"group {g.group_id:016x} has ranks {list(g.ranks)[:8]}")


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (a killed child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False
