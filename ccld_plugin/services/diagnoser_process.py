"""The diagnoser as a process of its own (``ccld diagnoser``).

At tens of thousands of ranks a round over every summary takes a good share of a second;
on a training rank it holds that rank's GIL (the rounds are capped at a fifth of its time,
so they come less often exactly where jobs are largest). Run the job with
``diagnoser.rank=-1`` (no rank starts a diagnoser) and this process beside it, on any host
that reaches the job's store: it serves the clock handshake the ranks' agents wait for,
holds the diagnosis lease, and runs the same rounds and sinks as the diagnoser thread. If
it dies, the job's standby (rank 0 unless ``diagnoser.standby_rank`` says otherwise) takes
the diagnosis over. It ends when every rank has left through its exit path, or on SIGINT /
SIGTERM.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

from ccld_plugin.config import CcldConfig
from ccld_plugin.control import ControlPlane
from ccld_plugin.errors import log
from ccld_plugin.services.diagnoser import Diagnoser
from ccld_plugin.sinks import build_sinks

__all__ = ["run_diagnoser"]


def run_diagnoser(
    cfg: CcldConfig,
    host: str,
    port: int,
    job: str,
    world: int,
    stop: threading.Event | None = None,
) -> int:
    """Diagnose job ``job`` of ``world`` ranks over its store at ``host:port`` until it
    ends (or ``stop`` is set); the exit status (0)."""
    stop = stop or _stop_on_signals()
    control = ControlPlane.client(cfg.control, host, port, job, world)
    # the boards are where this host keeps them: the timeline needs the job on this host
    sinks = build_sinks(cfg.sinks, cfg.board_root() / job)
    service = Diagnoser(
        cfg, control, world, time.monotonic_ns(), sinks, boards=cfg.board_root() / job
    )
    service.start()
    log.warning(
        "ccld diagnoser: job %r, %d ranks, store %s:%d; verdicts to %s",
        job,
        world,
        host,
        port,
        cfg.sinks.jsonl or "the console",
    )
    try:
        while not stop.wait(cfg.agent.interval_s):
            if service.job_ended():
                break
    finally:
        service.stop()
    return 0


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return stop
