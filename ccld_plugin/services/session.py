"""The plugin's lifecycle in one rank: enable, register groups, mark steps, disable.

``enable`` creates the rank's board, installs the tracer and registers the world group.
Called before ``init_process_group`` it waits for it (the rank is not known before), so
a launcher can enable the plugin before the user's script imports anything.
"""

from __future__ import annotations

import atexit
import errno
import functools
import operator
import os
import re
import secrets
import socket
import stat
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import ccld_plugin._native as _native
from ccld_plugin import errors
from ccld_plugin.board.job_files import board_file
from ccld_plugin.config import (
    CcldConfig,
    ConfigError,
    ConfigSource,
    check_paths,
    check_world,
    load_config,
)
from ccld_plugin.errors import log, report_error
from ccld_plugin.services import job_folder
from ccld_plugin.services.job_folder import FolderRefused, JobFolder
from ccld_plugin.tracing.device import register_device
from ccld_plugin.tracing.tracer import Tracer
from ccld_plugin.wire.summary import MAX_FRAMES

if TYPE_CHECKING:
    from ccld_plugin.services.rank_services import Services

__all__ = [
    "Session",
    "board_path",
    "current",
    "disable",
    "enable",
    "job_name",
    "job_seconds",
    "mark_step",
    "register_device",
    "register_group",
]


@dataclass
class Session:
    config: CcldConfig
    rank: int
    world: int
    board_path: Path
    board: _native.Board
    tracer: Tracer
    started_ns: int = 0  # monotonic; on the diagnoser rank this is the job's start
    services: Services | None = None
    folder: JobFolder | None = None  # the claimed job folder, let go at disable


_session: Session | None = None
_pending_roles: list[tuple[Any, str]] = []
_lock = threading.RLock()
_deferred: dict[str, Any] = {}
# The line of a start-up problem that turned the plugin off in this rank: said once, and
# not tried again by a later enable() (the integrations call it more than once).
_off: str | None = None


MAX_STEP = 2**31 - 1  # a step is an int32 in op records and summaries


def job_name(cfg: CcldConfig) -> str:
    """The job's name: configured (checked by the config), else the launcher's run id, else
    its rendezvous port; a name from the environment is made safe for a folder name."""
    if cfg.job:
        return cfg.job
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return _safe_name(run_id)
    return _safe_name(f"job-{os.environ.get('MASTER_PORT', 'local')}")


def _safe_name(text: str) -> str:
    """``text`` with what a job name may not hold replaced (config.JOB_NAME)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", text, flags=re.ASCII).replace("..", "__")
    return ("j" + name if not name[:1].isalnum() else name)[:63]


def board_path(cfg: CcldConfig, rank: int) -> Path:
    return board_file(cfg.board_root() / job_name(cfg), rank)


def current() -> Session | None:
    return _session


def job_seconds(mono_ns: int) -> float | None:
    """A time of this rank's monotonic clock as seconds since job start on the diagnoser's
    clock (the timebase of verdicts), or None before the clock handshake."""
    s = _session
    return None if s is None or s.services is None else s.services.job_seconds(mono_ns)


def enable(config: ConfigSource = None, overrides: Iterable[str] = ()) -> Session | None:
    """Turn the plugin on in this process. Returns the session, or None when the config
    disables it or the process group is not initialized yet (setup then completes right
    after ``init_process_group``). Bad config raises :class:`ConfigError`; a rank the job
    does not have (``diagnoser.rank``, ``diagnoser.standby_rank``) is said once, by rank
    0, and every rank exits with code 2 at start-up. A board folder that cannot be used
    (a link, another user's, another live job's, full) turns the plugin off in the ranks
    concerned, in one line each; any other failure is contained and training runs
    untraced."""
    if isinstance(config, CcldConfig) and not overrides:
        cfg = config
        check_paths(cfg)
    else:
        cfg = load_config(config, overrides)
    if not cfg.enabled:
        return None
    if cfg.nccl_profiler:  # NCCL reads it once, at its first communicator: set it early
        try:
            from ccld_plugin.tracing.nccl_env import enable_nccl_profiler_env

            enable_nccl_profiler_env()
        except Exception as exc:  # noqa: BLE001
            report_error("session.nccl_profiler", exc)
    with _lock:
        if _session is not None or _off is not None:
            return _session
        if not dist.is_available():
            return None
        if not dist.is_initialized():
            _defer_until_init(cfg)
            return None
        try:
            return _start(cfg)
        except Exception as exc:  # noqa: BLE001
            report_error("session.enable", exc)
            return None


def _start(cfg: CcldConfig) -> Session | None:
    global _session
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        check_world(cfg, world)
    except ConfigError as exc:
        _leave_job(str(exc), rank, world, cfg.control.connect_timeout_s)
    job = job_name(cfg)
    path = board_path(cfg, rank)
    token = _job_token(job)
    try:
        folder = job_folder.claim(
            cfg.board_root(), "{uid}" in cfg.board.dir, path.parent, token, world, rank
        )
    except (FolderRefused, OSError) as exc:
        _turn_off(rank, exc, path)
        return None
    try:
        board = _create_board(cfg, path, rank, world, job)
    except Exception as exc:
        _let_go(folder, cleanup=True)
        if not isinstance(exc, (FolderRefused, OSError)):
            raise
        _turn_off(rank, exc, path)
        return None
    errors.on_error(board.count_error)
    tc = cfg.tracer
    tracer = Tracer(board, rank, tc.poll_interval_ms / 1000.0, tc.device_time, tc.work_timing)
    tracer.register_group(None, "world")
    tracer.install()
    _session = Session(
        cfg, rank, world, path, board, tracer, started_ns=time.monotonic_ns(), folder=folder
    )
    for pg, role in _pending_roles:
        tracer.register_group(pg, role)
    _pending_roles.clear()
    atexit.register(_at_exit)
    _watch_uncaught_exceptions()
    # imported here: it needs the store, the tracer does not
    from ccld_plugin.services import rank_services as services

    _session.services = services.start(cfg, rank, world, job, path, tracer, _session.started_ns)
    log.info("ccld: tracing rank %d of %d, board %s", rank, world, path)
    return _session


def _turn_off(rank: int, exc: FolderRefused | OSError, board: Path) -> None:
    """Say, in one line, why the plugin is off in this rank: a problem of its folder."""
    global _off
    if isinstance(exc, FolderRefused):
        problem, fix = exc.problem, exc.fix
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        problem = f"the board folder {board.parent} is full (no room for this rank's board)"
        fix = "free space there, or set board.dir to a folder with room"
    else:
        problem = f"the board folder {board.parent} cannot be used ({exc.strerror}: {exc.filename})"
        fix = "set board.dir to a folder this user can write"
    _off = f"ccld: rank {rank}: {problem}; the plugin is off in this rank, training goes on; {fix}"
    log.warning(_off)


def _let_go(folder: JobFolder, cleanup: bool) -> None:
    try:
        folder.release(cleanup)
    except Exception as exc:  # noqa: BLE001 - the rank leaves the folder all the same
        report_error("session.folder", exc)


def _job_token(job: str) -> str:
    """What the ranks of this job, and no other, agree on: the first one's random token,
    through the job's own store (a relaunch by torchrun has a store prefix of its own, so a
    new token; its old workers are gone by then)."""
    store = c10d._get_default_store()
    return store.compare_set(f"ccld/{job}/folder", "", secrets.token_hex(8)).decode()


def _create_board(cfg: CcldConfig, path: Path, rank: int, world: int, job: str) -> _native.Board:
    """A new board file (mode 0600) in the claimed folder, its pages reserved. A board
    left there by a job that died is replaced, not emptied in place: a reader may still
    have it mapped (ccld inspect), and must not see its pages go."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise FolderRefused(f"the board file {path} is {what}", "remove it")
        path.unlink()
    try:
        return _native.Board(
            str(path),
            rank,
            world,
            job,
            socket.gethostname(),
            cfg.board.ring_size,
            cfg.board.max_groups,
            cfg.board.max_channels,
            max(4 * world, 4096),
        )
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _leave_job(message: str, rank: int, world: int, wait_s: float) -> NoReturn:
    """End this rank with exit code 2 for a config the job's size refutes: the same in
    every rank, said once, by rank 0. The ranks leave together (counted through the job's
    store, for at most ``wait_s``), so that none is left in a collective with one that has
    gone, and without the interpreter's teardown, where gloo can abort a process whose
    group is still initialized."""
    if rank == 0:
        print(f"ccld: error: {message}; every rank of the job exits with code 2", file=sys.stderr)
    try:
        store = c10d._get_default_store()
        store.add("ccld/leaving", 1)
        deadline = time.monotonic() + wait_s
        while store.add("ccld/leaving", 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store's host left first: so do we
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


_abnormal_exit = False
# The uncaught exception a rank leaves on: where it was raised (innermost last), then
# the exception itself. Empty for an interrupt (Ctrl-C reaches every rank: no culprit).
_crash: list[str] = []


def _watch_uncaught_exceptions() -> None:
    """Remember an uncaught exception, so that a crashing rank keeps its board and says
    what it died of."""
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        global _abnormal_exit, _crash
        _abnormal_exit = True
        try:
            _crash = crash_record(*exc_info)
        except Exception as exc:  # noqa: BLE001 - the job's own report comes first
            report_error("session.crash_record", exc)
        previous(*exc_info)

    sys.excepthook = hook


def crash_record(kind: type[BaseException], exc: BaseException, tb: Any) -> list[str]:
    """The frames where ``exc`` was raised (innermost last) and, last, the exception as
    one line; empty for a KeyboardInterrupt."""
    if issubclass(kind, KeyboardInterrupt):
        return []
    frames = [f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_tb(tb)]
    text = " ".join(str(exc).split())
    return [*frames[-(MAX_FRAMES - 1) :], f"{kind.__name__}: {text}" if text else kind.__name__]


def _at_exit() -> None:
    disable(keep_board=_abnormal_exit, failing=_abnormal_exit)


def _defer_until_init(cfg: CcldConfig) -> None:
    if "init" in _deferred:
        return
    orig = c10d.init_process_group

    @functools.wraps(orig)
    def init_then_enable(*args: Any, **kwargs: Any) -> Any:
        result = orig(*args, **kwargs)
        _restore_init()
        with _lock:
            if _session is None:
                try:
                    _start(cfg)
                except Exception as exc:  # noqa: BLE001
                    report_error("session.enable", exc)
        return result

    _deferred["init"] = (orig, init_then_enable)
    c10d.init_process_group = init_then_enable
    dist.init_process_group = init_then_enable


def _restore_init() -> None:
    pair = _deferred.pop("init", None)
    if pair is not None:
        c10d.init_process_group = pair[0]
        dist.init_process_group = pair[0]


def register_group(group: Any, role: str) -> None:
    """Tell the plugin which parallelism role a process group plays (tp, pp, dp, ep, etp,
    cp, dp_cp, embd, pos_embd, world, mp, other). Safe to call before ``enable``."""
    from ccld_plugin.topology import role_index

    role_index(role)  # a bad role is the caller's bug: say so at once
    with _lock:
        if _session is None:
            _pending_roles.append((group, role))
            return
        try:
            _session.tracer.register_group(group, role)
        except Exception as exc:  # noqa: BLE001
            report_error("session.register_group", exc)


def mark_step(step: int) -> None:
    """Mark the start of training step ``step`` (an iteration, an optimizer step): an
    integer in 0..2**31-1, else TypeError / ValueError, with the plugin on or off."""
    step = _checked_step(step)
    s = _session
    if s is not None:
        try:
            s.board.set_step(step)
            cpu_wait_ns = s.tracer.mark_step(step)
            if s.services is not None:
                s.services.steps.mark(step, cpu_wait_ns)
        except Exception as exc:  # noqa: BLE001
            report_error("session.mark_step", exc)


def _checked_step(step: Any) -> int:
    """A step is the caller's value: a bad one is their bug, said at once (like a bad role)."""
    try:
        value = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        value = None
    if value is None:
        raise TypeError(
            f"ccld_plugin.mark_step: step must be an integer, not {type(step).__name__} "
            f"({step!r:.40})"
        )
    if not 0 <= value <= MAX_STEP:
        raise ValueError(f"ccld_plugin.mark_step: step {value} is outside 0..{MAX_STEP}")
    return value


def disable(keep_board: bool = False, failing: bool = False) -> None:
    """Stop the services, restore every wrapped function and close the board. The board is
    removed unless ``board.cleanup`` is off or ``keep_board`` is set (the exit path of a
    crashed rank keeps it for the post-mortem), a collective of this rank raised, or the
    store stopped answering this rank (the board is then the only record). ``failing``: the
    rank is leaving on an uncaught exception, and the diagnoser's last round waits a moment
    for the evidence of why. Safe to call more than once."""
    global _session, _off
    with _lock:
        _restore_init()
        s, _session, _off = _session, None, None
        if s is None:
            return
        # A rank that saw a collective raise keeps its board, however it leaves (a script
        # that catches the error and calls sys.exit(1) ends as cleanly as a finished one).
        keep_board = keep_board or s.tracer.failed_ops > 0
        if s.services is not None:
            s.services.stop(failing, _crash if failing else [])
            keep_board = keep_board or s.services.store_lost
        try:
            s.tracer.uninstall()
        finally:
            errors.clear_callbacks()
            cleanup = s.config.board.cleanup and not keep_board
            s.board.close(unlink=cleanup)
            if s.folder is not None:
                _let_go(s.folder, cleanup)
