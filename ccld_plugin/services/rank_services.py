"""The live-diagnosis services of a session: the agent in every rank, the diagnoser on the
diagnoser rank (``services.diagnoser``) and its standby on another (``services.standby``)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccld_plugin.agent.agent import Agent, StepClock
from ccld_plugin.board.job_files import JOB_CONFIG
from ccld_plugin.config import CcldConfig, to_yaml
from ccld_plugin.control import ControlPlane
from ccld_plugin.errors import report_error
from ccld_plugin.files import open_private
from ccld_plugin.services.actions import AbortWatch
from ccld_plugin.services.diagnoser import Diagnoser
from ccld_plugin.services.standby import Standby, standby_rank
from ccld_plugin.services.verdict_stamps import who_am_i
from ccld_plugin.sinks import build_sinks

__all__ = ["Services", "ranks_per_node", "start", "store_job"]


@dataclass
class Services:
    """What runs beside training in one rank: its agent, and on the diagnoser rank the
    diagnoser thread. ``steps`` is the agent's step clock (``mark_step`` feeds it)."""

    agent: Agent
    steps: StepClock
    diagnoser: Diagnoser | None = None
    standby: Standby | None = None
    abort_watch: AbortWatch | None = None  # actions.on_hang=abort

    def stop(self, failing: bool = False, crash: list[str] | None = None) -> None:
        """The agent first, then the diagnoser or standby (a last round sees the agent's
        last summary; on a ``failing`` rank's way out it waits a moment for the evidence);
        each failure contained. ``crash``: the uncaught exception the rank leaves on (see
        ``session.crash_record``), for its last summary."""
        try:
            self.agent.stop(crash or [])
        except Exception as exc:  # noqa: BLE001
            report_error("services.stop", exc)
        if self.abort_watch is not None:
            self.abort_watch.stop()
        for svc in (self.diagnoser, self.standby):
            if svc is None:
                continue
            try:
                svc.stop(failing)
            except Exception as exc:  # noqa: BLE001
                report_error("services.stop", exc)

    @property
    def store_lost(self) -> bool:
        """Whether the store stopped answering this rank: its board is then the only
        record of its last seconds, kept at exit for ``ccld diagnose``."""
        return self.agent.store_lost is not None

    def job_seconds(self, mono_ns: int) -> float | None:
        clock = self.agent.clock
        return None if clock is None else clock.job_seconds(mono_ns)


def start(
    cfg: CcldConfig, rank: int, world: int, job: str, board_path: Path, tracer: Any, started_ns: int
) -> Services:
    """Start the agent (and on the diagnoser rank, the diagnoser) of a rank."""
    per_node = ranks_per_node(cfg, world)
    control = ControlPlane(cfg.control, rank, world, store_job(job), cfg.diagnoser.rank, per_node)
    steps = StepClock()
    timeout = cfg.control.connect_timeout_s
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
        per_node,
        who=who_am_i,
    )
    diag, standby = None, None
    if rank == cfg.diagnoser.rank:
        diag = Diagnoser(
            cfg,
            control.connect(),
            world,
            started_ns,
            build_sinks(cfg.sinks, board_path.parent),
            own_report=lambda: agent.latest,
            boards=board_path.parent,
            job=job,
        )
        diag.config_file = _write_job_config(cfg, board_path.parent)
        diag.start()  # before the agent: it serves the clock handshake
    elif cfg.diagnoser.standby and rank == standby_rank(
        cfg.diagnoser.rank,
        world,
        per_node,
        cfg.diagnoser.standby_rank,
    ):

        def take_over() -> Diagnoser:
            # On the first diagnoser's clock, through this rank's offset to it.
            clock = agent.clock
            return Diagnoser(
                cfg,
                control.connect(),
                world,
                clock.job_start_ns if clock else started_ns,
                build_sinks(cfg.sinks, board_path.parent),
                own_report=lambda: agent.latest,
                clock_ns=lambda: (
                    clock.to_diag(time.monotonic_ns()) if clock else time.monotonic_ns()
                ),
                serves_clock=False,
                boards=board_path.parent,
                job=job,
            )

        standby = Standby(cfg, control, take_over)
        standby.start()
    watch = None
    if cfg.actions.on_hang == "abort":
        watch = AbortWatch(control, cfg.agent.interval_s, lambda: agent.clock)
        watch.start()
    agent.start()
    return Services(agent, steps, diag, standby, watch)


def store_job(job: str) -> str:
    """The job's part of the store keys: its name, and, for an attempt that torchrun
    restarted (``--max-restarts``), the attempt. A restart keeps the job's name and its
    store (torchrun's agent's): without its own keys an attempt would read the last
    one's (its clock handshake's counts, the findings it reported, its abort record)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return job if restart in ("", "0") else f"{job}/attempt{restart}"


def ranks_per_node(cfg: CcldConfig, world: int) -> int:
    """``control.ranks_per_node``, else the launcher's LOCAL_WORLD_SIZE, else 1; at most
    the world."""
    size = cfg.control.ranks_per_node
    if not size:
        try:
            size = int(os.environ.get("LOCAL_WORLD_SIZE", "") or 1)
        except ValueError:
            size = 1
    return max(1, min(size, world))


def _write_job_config(cfg: CcldConfig, board_dir: Path) -> Path | None:
    """The job's configuration beside its boards: ``ccld diagnose`` reads its thresholds
    from there, so a post-mortem judges the boards as the live diagnoser did."""
    path = board_dir / JOB_CONFIG
    try:
        # not replaced by a rename: a link planted there is refused, and said, not removed
        fd = open_private(path)
    except OSError as exc:
        report_error("services.job_config", exc)
        return None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(to_yaml(cfg))
    except OSError as exc:  # no room: a config cut short would mislead the post-mortem
        path.unlink(missing_ok=True)
        report_error("services.job_config", exc)
        return None
    return path
