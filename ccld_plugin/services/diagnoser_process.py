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

It may start before the job: it waits up to ``control.connect_timeout_s`` for the store
to answer, then gives up with one line (exit status 2).
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import threading
import time
from types import FrameType

from ccld_plugin.config import CcldConfig
from ccld_plugin.control import ControlPlane
from ccld_plugin.errors import log
from ccld_plugin.services.diagnoser import Diagnoser
from ccld_plugin.sinks import build_sinks

__all__ = ["MAX_WORLD", "DiagnoserError", "check_world", "parse_store", "run_diagnoser"]

# The largest job one diagnoser process serves: 16 times the 65,536 ranks the project's
# scale tests simulate, above the largest training jobs run today (~100,000 GPUs). A round
# reads every rank's summary, so a larger world is a typo, or a job whose rounds would take
# minutes (and whose per-rank state would not fit in this process).
MAX_WORLD = 1 << 20
RETRY_S = 0.25  # between two connection attempts while nothing listens at the store's address
# A store that accepted the connection answers its handshake in milliseconds; this much
# is left for it even when it came up just before the connect timeout.
HANDSHAKE_S = 2.0


class DiagnoserError(ValueError):
    """``ccld diagnoser`` cannot serve the job as asked; the message is one line."""


def parse_store(text: str) -> tuple[str, int]:
    """The host and port of ``--store``: ``HOST:PORT``, or ``[ADDR]:PORT`` for an IPv6
    address (a bare ``::1:29500`` is refused: ``::1:2950`` is itself an address, so where
    the port starts cannot be told)."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not _is_ipv6(host):
            raise DiagnoserError(
                f"ccld diagnoser: --store {text!r}: {host!r} in brackets is not an IPv6 "
                "address; expected [ADDR]:PORT, e.g. [::1]:29500"
            )
    elif ":" in host:
        raise DiagnoserError(
            f"ccld diagnoser: --store {text!r}: an IPv6 address goes in brackets before "
            "its port, e.g. [::1]:29500"
        )
    if not sep or not host or not (port.isascii() and port.isdigit()):
        raise DiagnoserError(
            f"ccld diagnoser: --store {text!r}: expected HOST:PORT (the job's "
            "MASTER_ADDR:MASTER_PORT), e.g. 127.0.0.1:29500 or [::1]:29500"
        )
    if not 1 <= int(port) <= 65535:
        raise DiagnoserError(
            f"ccld diagnoser: --store {text!r}: port {int(port)} is not one a store can "
            "listen on; expected 1..65535 (the job's MASTER_PORT)"
        )
    return host, int(port)


def check_world(world: int) -> None:
    """Refuse a world this process cannot serve (one line)."""
    if not 1 <= world <= MAX_WORLD:
        raise DiagnoserError(
            f"ccld diagnoser: --world {world} is not allowed; expected the job's number of "
            f"ranks, 1..{MAX_WORLD:,} (the most one diagnoser process serves)"
        )


def run_diagnoser(
    cfg: CcldConfig,
    host: str,
    port: int,
    job: str,
    world: int,
    stop: threading.Event | None = None,
) -> int:
    """Diagnose job ``job`` of ``world`` ranks over its store at ``host:port`` until it
    ends, it ended it (``actions.on_hang=abort``), or ``stop`` is set; the exit status
    (0). DiagnoserError when the store does not answer within ``control.connect_timeout_s``."""
    check_world(world)
    stop = stop or _stop_on_signals()
    control = _connect(cfg, host, port, job, world, stop)
    if control is None:  # stopped while waiting for the store
        return 0
    # the boards are where this host keeps them: the timeline needs the job on this host
    sinks = build_sinks(cfg.sinks, cfg.board_root() / job)
    service = Diagnoser(
        cfg, control, world, time.monotonic_ns(), sinks, boards=cfg.board_root() / job, job=job
    )
    service.start()
    log.warning(
        "ccld diagnoser: job %r, %d ranks, store %s; verdicts to %s",
        job,
        world,
        _address(host, port),
        cfg.sinks.jsonl or "the console",
    )
    try:
        while not stop.wait(cfg.agent.interval_s):
            if service.job_ended() or service.actions.aborted:
                break
    finally:
        service.stop()
    return 0


def _connect(
    cfg: CcldConfig, host: str, port: int, job: str, world: int, stop: threading.Event
) -> ControlPlane | None:
    """The job's control plane, once its store answers: None when ``stop`` is set first.

    torch's TCPStore client retries for about twice its timeout, logging a stack trace
    at each try, and waits without end for a listener that never answers its handshake;
    so first a plain connection shows that something listens (tried again until the
    connect timeout: the diagnoser may start before the job), then the client is made on
    a thread of its own, waited for a bounded time."""
    timeout_s = cfg.control.connect_timeout_s
    deadline = time.monotonic() + timeout_s
    where = _address(host, port)
    while True:
        try:
            with socket.create_connection((host, port), timeout=RETRY_S * 4):
                break
        except socket.gaierror as exc:
            raise DiagnoserError(
                f"ccld diagnoser: --store {where}: cannot resolve {host!r} ({exc.strerror}); "
                "check the host name"
            ) from None
        except OSError as exc:
            why = exc.strerror or "no answer"
        if time.monotonic() + RETRY_S > deadline:
            raise DiagnoserError(
                f"ccld diagnoser: nothing answers at {where} ({why.lower()}, "
                f"{timeout_s:g} s, control.connect_timeout_s): start the job first, or check "
                "--store (the job's MASTER_ADDR:MASTER_PORT)"
            )
        if stop.wait(RETRY_S):
            return None
    made: list[ControlPlane] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            made.append(ControlPlane.client(cfg.control, host, port, job, world))
        except BaseException as exc:  # noqa: BLE001 - told in the caller's one line
            failed.append(exc)

    # a daemon: a client stuck in a handshake that never ends must not hold up the exit
    maker = threading.Thread(target=make, name="ccld-connect", daemon=True)
    maker.start()
    maker.join(max(deadline - time.monotonic(), HANDSHAKE_S))
    if made:
        return made[0]
    why = str(failed[0]).splitlines()[0] if failed else "no answer to the store's handshake"
    raise DiagnoserError(
        f"ccld diagnoser: {where} accepts connections but is not the job's store ({why}); "
        "check --store (the job's MASTER_ADDR:MASTER_PORT)"
    )


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if _is_ipv6(host) else f"{host}:{port}"


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return stop
