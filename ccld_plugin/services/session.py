"""The plugin's lifecycle in one rank: enable, register groups, mark steps, disable.

``enable`` creates the rank's board, installs the tracer and registers the world group.
Called before ``init_process_group`` it waits for it (the rank is not known before), so
a launcher can enable the plugin before the user's script imports anything.
"""

from __future__ import annotations

import atexit
import functools
import operator
import os
import re
import socket
import stat
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    load_config,
    make_private_dirs,
)
from ccld_plugin.errors import log, report_error
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


_session: Session | None = None
_pending_roles: list[tuple[Any, str]] = []
_lock = threading.RLock()
_deferred: dict[str, Any] = {}


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
    after ``init_process_group``). Bad config raises :class:`ConfigError`; any other
    failure is contained and training runs untraced."""
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
        if _session is not None:
            return _session
        if not dist.is_available():
            return None
        if not dist.is_initialized():
            _defer_until_init(cfg)
            return None
        try:
            return _start(cfg)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001
            report_error("session.enable", exc)
            return None


def _start(cfg: CcldConfig) -> Session:
    global _session
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.diagnoser.rank >= world:
        raise ConfigError(
            f"ccld config: diagnoser.rank={cfg.diagnoser.rank} is not allowed; expected a rank "
            f"of this job (0..{world - 1})"
        )
    path = board_path(cfg, rank)
    _private_board_dir(cfg, path.parent)
    _private_file(path)
    board = _native.Board(
        str(path),
        rank,
        world,
        job_name(cfg),
        socket.gethostname(),
        cfg.board.ring_size,
        cfg.board.max_groups,
        cfg.board.max_channels,
        max(4 * world, 4096),
    )
    errors.on_error(board.count_error)
    tracer = Tracer(board, rank, cfg.tracer.poll_interval_ms / 1000.0)
    tracer.register_group(None, "world")
    tracer.install()
    _session = Session(cfg, rank, world, path, board, tracer, started_ns=time.monotonic_ns())
    for pg, role in _pending_roles:
        tracer.register_group(pg, role)
    _pending_roles.clear()
    atexit.register(_at_exit)
    _watch_uncaught_exceptions()
    # imported here: it needs the store, the tracer does not
    from ccld_plugin.services import rank_services as services

    _session.services = services.start(
        cfg, rank, world, job_name(cfg), path, tracer, _session.started_ns
    )
    log.info("ccld: tracing rank %d of %d, board %s", rank, world, path)
    return _session


def _private_board_dir(cfg: CcldConfig, job_dir: Path) -> None:
    """The job's board folder (and the per-user one above it, when ``board.dir`` names
    the user): created with mode 0700; an existing one must be a folder of this user, not
    a link, and is made 0700."""
    make_private_dirs(job_dir)
    per_user = "{uid}" in cfg.board.dir
    for folder in (job_dir.parent, job_dir) if per_user else (job_dir,):
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            what = "not a folder" if not stat.S_ISDIR(st.st_mode) else f"owned by uid {st.st_uid}"
            raise ConfigError(
                f"ccld config: board.dir: {folder} is {what}; remove it, or set board.dir "
                "or job to a folder of your own"
            )
        if st.st_mode & 0o077:
            os.chmod(folder, 0o700)


def _private_file(path: Path) -> None:
    """Create the board file with mode 0600 before the native writer opens it (it keeps
    the mode of the file it truncates); a board left by an earlier run is made 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


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
                except ConfigError:
                    raise
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
    global _session
    with _lock:
        _restore_init()
        s, _session = _session, None
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
            if cleanup:
                _remove_empty_dir(s.board_path.parent)


def _remove_empty_dir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # other ranks' boards are still there
