"""``ccld demo``: launch a real training job on this machine with the plugin on, inject a
fault, print the verdicts as they come, end a hung job, and summarize.

Writes ``DIR/verdicts.jsonl``, ``DIR/faults.jsonl`` (each injected fault with its onset)
and ``DIR/summary.json`` (verdicts, faults, latency per verdict matched to its fault,
steps completed, exit code of each rank, the errors the plugin contained (each log's
``ccld: contained error`` lines: a diagnosis that raised shows there, not as a miss), and
``failure``: why the demo failed, or null),
and ``DIR/trace.json``, the run's timeline.

The boards, the verdicts file and the W&B run are where the configuration puts them
(``--set board.dir=...``, ``job=...``, ``sinks.jsonl=...`` are followed; ``summary.json``
says where the boards are). A live demo holds ``DIR`` (a lock on ``DIR/.ccld-demo``, which
the kernel releases however it ends): a second demo with the same ``--out`` is refused.

The exit code is 0 when the job ran and every fault was diagnosed (or, healthy, it trained
every step without a verdict), 1 when not (one line on stderr says why: a rank that failed
on its own, a job that stopped early or ran past the timeout, a fault not diagnosed), 2 for
bad input, refused before anything is launched or written, and 128 + the signal's number
when SIGTERM, SIGINT or SIGHUP stopped it (the job stopped, its network removed, what it
wrote kept).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ccld_harness.faults.spec import FaultSpec
from ccld_harness.frameworks import rank_argv
from ccld_harness.launch import LocalJob, free_port
from ccld_harness.netjob import NetJob, NetnsError, available
from ccld_harness.options import (
    DemoError,
    DemoOptions,
    checked_options,
    fit_layout,
    layout_text,
)
from ccld_harness.outcome import TERMINAL, Outcome, logged_errors, match_faults, why_failed
from ccld_harness.stop_signals import Stopped, StopRequest, stop_on_signals
from ccld_plugin.board.job_files import JOB_CONFIG, board_file
from ccld_plugin.board.reader import BoardError, BoardReader
from ccld_plugin.config import CcldConfig, load_config
from ccld_plugin.postmortem.inspect_boards import collective_table, print_collectives
from ccld_plugin.sinks.console import render_verdict
from ccld_plugin.sinks.jsonl import read_verdicts

__all__ = ["DemoError", "DemoOptions", "fit_layout", "run_demo"]

GRACE_S = 3.0  # after a verdict that means the job will not recover, before ending it
LEAVING_S = 20.0  # more, for a crashed rank to finish leaving (its last round, its W&B run)
DIAGNOSER_GRACE_S = 5.0  # for ``ccld diagnoser``'s last round once the job is over
WANDB_WAIT_S = 30.0  # for the W&B writer to finish the run once the job is over
MARKER = ".ccld-demo"  # in DIR: a demo's output, which the next demo may replace; its lock
_HOLDER = re.compile(r"pid (\d+)")  # the marker names the demo that holds DIR
OUTPUTS = ("boards", "logs", "verdicts.jsonl", "faults.jsonl", "summary.json", "trace.json")


@dataclass
class Followed:
    """How the job ended while the demo followed it: ``exited`` (every rank on its own),
    ``verdict`` (ended a grace period after a verdict that means it will not recover),
    ``failed`` (ended a grace period after a rank failed on its own, whether or not a
    verdict came first) or ``timeout``."""

    printed: list[dict]
    ended: str


@dataclass(frozen=True)
class Places:
    """Where a run's files are, as its configuration (overrides included) puts them."""

    boards: Path  # the job's board folder: <board.dir>/<job>
    verdicts: Path  # the JSONL sink's file
    wandb: Path | None  # the folder of the offline W&B run, if the sink is on


@dataclass(frozen=True)
class Plan:
    """A run as the options and the configuration make it, every part checked."""

    out: Path
    faults: list[FaultSpec]
    cfg: CcldConfig  # the ranks'
    overrides: list[str]  # the ranks' (and a diagnoser process's) --set
    argv: list[str]  # a rank's command
    places: Places
    cleanup: bool  # board.cleanup as the user's overrides set it, applied by the demo
    closed_network: bool


def run_demo(opts: DemoOptions, console: Console | None = None) -> int:
    console = console or Console(highlight=False)
    with stop_on_signals() as stop:
        try:
            plan = _plan(opts)  # bad input stops here: nothing launched or written
            stop.check()
            with _holding(plan.out, opts.force):
                return _run(opts, plan, console, stop)
        except Stopped as exc:
            print(f"ccld demo: {exc} before the job started", file=sys.stderr)
            return stop.exit_code


def _plan(opts: DemoOptions) -> Plan:
    """The run the options ask for; DemoError (or ConfigError, FaultSpecError) for one
    that cannot run."""
    out = opts.out.resolve()
    faults = checked_options(opts)
    overrides = [
        f"board.dir={out}",
        "job=boards",
        f"sinks.jsonl={out / 'verdicts.jsonl'}",
        "sinks.console=false",
        *_wandb_overrides(out),
        *(["diagnoser.rank=-1"] if opts.diagnoser_process else []),
        *opts.overrides,
        # the demo reads the boards once the job is over, then applies board.cleanup itself
        "board.cleanup=false",
    ]
    cfg = load_config(None, overrides)  # the ranks' config, every value checked
    if not cfg.job:  # named by the launcher's run id: the demo is the launcher
        overrides.append(f"job=demo-{os.getpid()}")
        cfg = load_config(None, overrides)
    if cfg.diagnoser.rank >= opts.world:
        raise DemoError(
            f"ccld demo: diagnoser.rank={cfg.diagnoser.rank} is not a rank of the "
            f"{opts.world}-rank job; choose one below {opts.world}"
        )
    places = _places(cfg)
    cleanup = load_config(None, opts.overrides).board.cleanup
    argv = [*_framework_argv(opts), *sum((["--ccld-set", o] for o in overrides), [])]
    closed_network = opts.netns or any(f.is_comm for f in faults)
    if opts.diagnoser_process and closed_network:
        raise DemoError(
            "ccld demo: --diagnoser-process runs on this host, outside the closed network; "
            "drop --netns (and communication faults) or the option"
        )
    if closed_network:
        ok, why = _closed_network_available()
        if not ok:
            raise DemoError(f"ccld demo: the closed network is not available: {why}")
    return Plan(out, faults, cfg, overrides, argv, places, cleanup, closed_network)


def _run(opts: DemoOptions, plan: Plan, console: Console, stop: StopRequest) -> int:
    """Launch, follow and stop the job, then judge and report it: the exit code."""
    out, faults, cfg, places = plan.out, plan.faults, plan.cfg, plan.places
    env = {
        "CCLD_FAULTS": ";".join(str(f) for f in faults),
        "CCLD_FAULT_LOG": str(out / "faults.jsonl"),
        "TORCHDYNAMO_DISABLE": "1",
    }  # nothing here to compile; saves seconds per rank
    if not _has_cuda():
        env["DS_ACCELERATOR"] = "cpu"
    # On one host the launcher hosts the store, as torchrun does; in the closed network
    # the launcher cannot be reached, and rank 0 hosts it.
    local = LocalJob(
        world=opts.world,
        argv=plan.argv,
        log_dir=out / "logs",
        env=env,
        agent_store=not plan.closed_network,
        stop_requested=lambda: bool(stop),
    )
    job: LocalJob | NetJob = local
    if plan.closed_network:  # ranks in a closed network (netjob)
        job = NetJob(local, faults, places.boards, out / "faults.jsonl", cfg.diagnoser.rank)
    shown = ", ".join(map(str, faults)) or "none (healthy run)"
    console.print(
        f"[bold]ccld demo[/]: {opts.world} ranks, {layout_text(opts)}, {opts.steps} steps, "
        f"fault: {shown}; logs in {out / 'logs'}"
    )
    started, started_ns = time.time(), time.monotonic_ns()
    earlier = len(read_verdicts(places.verdicts))  # a sink file outside DIR may hold some
    external = None
    followed = Followed([], "stopped")
    try:  # the job (and its network, if any) ends however the demo ends
        if opts.diagnoser_process:
            local.master_port = free_port()
            log = out / "logs" / "diagnoser.log"
            external = _start_diagnoser(local, plan.overrides, cfg.job, log)
        try:
            job.start()
        except NetnsError as exc:
            raise DemoError(f"ccld demo: the closed network could not be built: {exc}") from None
        if not stop:
            followed = _follow(
                job, places.verdicts, earlier, opts.timeout_s, failed_grace_s(cfg), console, stop
            )
    finally:
        codes = job.stop()
        if external is not None:
            _stop_diagnoser(external, 0.0 if stop else DIAGNOSER_GRACE_S)
    stopped = stop.name  # a signal that came while the job ran: what ended it
    verdicts = read_verdicts(places.verdicts)[earlier:]
    for v in verdicts[len(followed.printed) :]:  # written by the diagnoser's last round
        console.print(render_verdict(v))
    injected = _read_jsonl(out / "faults.jsonl")
    latency = match_faults(injected, verdicts)
    steps = _steps_completed(places.boards, opts.steps, opts.world, started_ns)
    outcome = Outcome(faults, injected, latency, verdicts, codes, steps, followed.ended)
    if stopped:
        at = f"after {steps} of {opts.steps} steps" if codes else "before the job started"
        failure: str | None = f"stopped by {stopped} {at}"
    else:
        failure = why_failed(outcome, opts, out / "logs")
    kept = bool(stopped) or not plan.cleanup  # stopped, it keeps them, as a crashed rank does
    summary = {
        "verdicts": verdicts,
        "faults": injected,
        "latency_s": latency,
        "steps_completed": steps,
        "exit": codes,
        "contained_errors": logged_errors(out / "logs"),
        "boards": str(places.boards) if kept else None,
        "failure": failure,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if stopped:
        ended = f"; the job was ended, its boards are in {places.boards}" if codes else ""
        print(f"ccld demo: {failure}{ended}; its results are in {out}", file=sys.stderr)
        return stop.exit_code
    _write_trace(out / "trace.json", places.boards, verdicts, console)
    _print_summary(console, summary, faults, out, places.boards)
    if places.wandb is not None:
        _print_wandb(console, places.wandb, started, stop)
    if not kept:
        _remove_boards(places.boards, out, opts.world)
    if stop:
        print(
            f"ccld demo: stopped by {stop.name} after the job ended; its results are in {out}",
            file=sys.stderr,
        )
        return stop.exit_code
    if failure is not None:
        print(f"ccld demo: failed: {failure}", file=sys.stderr)
        return 1
    return 0


def _places(cfg: CcldConfig) -> Places:
    verdicts = cfg.sinks.jsonl_file()
    if verdicts is None:
        raise DemoError(
            "ccld demo: sinks.jsonl=null: the demo follows the job through its verdicts "
            "file; leave sinks.jsonl out (DIR/verdicts.jsonl) or name a file"
        )
    wandb = cfg.sinks.wandb
    return Places(
        boards=cfg.board_root() / cfg.job,
        verdicts=verdicts,
        wandb=Path(wandb.dir) if wandb.enabled and wandb.dir else None,
    )


def _closed_network_available() -> tuple[bool, str]:
    """``netjob.available()``, tried on a thread of its own. The first network opened from
    the main thread installs netns's signal handlers, which remove every network from
    inside the handler: under ranks still running (then waiting for them), or halfway
    through building one (whose later namespaces are then never removed). Opened first
    elsewhere, it installs none, and the demo's own handling stops the job, then removes
    its network."""
    found: list[tuple[bool, str]] = []
    probe = threading.Thread(target=lambda: found.append(available()), name="ccld-netns-probe")
    probe.start()
    probe.join()
    return found[0] if found else (False, "the check of network namespaces failed")


@contextlib.contextmanager
def _holding(out: Path, force: bool) -> Iterator[None]:
    """``out`` made ready for this run and held while it lasts: the outputs of a finished
    demo are replaced; a folder that holds anything else is refused unless ``force`` (and
    even then only the demo's own outputs are removed); a folder another live demo holds
    is refused, and nothing in it touched. The hold is a lock on the marker file, which
    the kernel releases when this process ends, however it ends."""
    if not out.parent.is_dir():
        raise DemoError(
            f"ccld demo: --out {out}: the folder {out.parent} does not exist; create it "
            "first, or choose another --out"
        )
    if out.exists() and not out.is_dir():
        raise DemoError(f"ccld demo: --out {out} is a file; choose a folder")
    ours = (out / MARKER).exists() or (out / "summary.json").is_file()
    if out.is_dir() and not ours and not force and any(out.iterdir()):
        raise DemoError(
            f"ccld demo: --out {out} holds files that are not a demo's output; choose a new "
            "or empty folder, or pass --force to write into it"
        )
    try:
        out.mkdir(exist_ok=True)
        # no-follow: a marker planted as a symlink must not send the write elsewhere
        fd = os.open(out / MARKER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        why = f"{MARKER} in it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise DemoError(f"ccld demo: --out {out}: {why}; choose another --out") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _HOLDER.search(os.pread(fd, 200, 0).decode(errors="replace"))
            raise DemoError(
                f"ccld demo: --out {out} is in use by another demo still running (pid "
                f"{holder.group(1) if holder else 'unknown'}); wait for it to end, or choose "
                "another --out"
            ) from None
        for name in OUTPUTS:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            f"ccld demo output (pid {os.getpid()}): the next demo here replaces its "
            "results\n".encode(),
            0,
        )
        yield
    finally:
        os.close(fd)


def _remove_boards(boards: Path, out: Path, world: int) -> None:
    """board.cleanup after the run: the demo's own board folder whole; from one the
    configuration put elsewhere, this run's boards and job config (and the folder, if
    that empties it)."""
    if boards == out / "boards":
        shutil.rmtree(boards, ignore_errors=True)
        return
    for path in [board_file(boards, rank) for rank in range(world)] + [boards / JOB_CONFIG]:
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        boards.rmdir()


def _framework_argv(opts: DemoOptions) -> list[str]:
    """The command of one rank for the chosen framework."""
    try:
        return rank_argv(opts.framework, opts.tp, opts.pp, opts.steps, opts.zero_stage, opts.device)
    except FileNotFoundError as exc:
        raise DemoError(f"{exc}: reinstall ccld-plugin, or use --framework torch") from None
    except ValueError as exc:
        raise DemoError(str(exc)) from None


def _wandb_overrides(out: Path) -> list[str]:
    """An offline W&B run under DIR/wandb when wandb is installed (the sink would contain
    its absence anyway; this keeps the demo's output free of that error)."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        return []
    return ["sinks.wandb.enabled=true", f"sinks.wandb.dir={out / 'wandb'}"]


def _print_wandb(console: Console, root: Path, started: float, stop: StopRequest) -> None:
    if not root.exists():
        return
    from ccld_plugin.sinks.wandb.run_file import wait_for_run

    # The writer finishes the run after the job ends (a killed job too): waited for in
    # short turns, so that a stop signal is not held up.
    deadline = time.monotonic() + WANDB_WAIT_S
    run = None
    while not stop and time.monotonic() < deadline and not (run is not None and run.finished):
        run = wait_for_run(root, timeout_s=0.5, since=started)
    if run is None or not run.finished:
        console.print(f"[yellow]no finished W&B run under {root} yet[/]")
        return
    console.print(
        f"W&B offline run: {run.file.parent} ({len(run.points)} keys, "
        f"{len(run.tables)} tables, {len(run.alerts)} alerts; see it with: ccld "
        f"wandb-summary {root}; upload with: wandb sync {run.file.parent})"
    )


def _write_trace(path: Path, boards: Path, verdicts: list[dict], console: Console) -> None:
    """The run's timeline beside its verdicts (what ``ccld trace`` writes), from its boards."""
    from ccld_plugin.postmortem.boards import PostmortemError, load_boards
    from ccld_plugin.postmortem.timeline import write_trace

    try:
        n = write_trace(load_boards(boards), verdicts, path)
    except PostmortemError as exc:
        console.print(f"[yellow]no timeline: {exc}[/]")
        return
    console.print(f"timeline: {path} ({n} events; open it in ui.perfetto.dev or chrome://tracing)")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _start_diagnoser(
    job: LocalJob, overrides: list[str], name: str, log_path: Path
) -> subprocess.Popen:
    """``ccld diagnoser`` beside the job ``name``, on the store its launcher hosts."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "ccld_plugin.cli",
        "diagnoser",
        "--store",
        f"{job.master_addr}:{job.master_port}",
        "--world",
        str(job.world),
        "--job",
        name,
        *sum((["--set", o] for o in overrides), []),
    ]
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop_diagnoser(proc: subprocess.Popen, grace_s: float) -> None:
    """Let it run its last round for ``grace_s`` (it ends by itself once every rank
    left), then end it."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=DIAGNOSER_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _follow(
    job: LocalJob | NetJob,
    path: Path,
    earlier: int,
    timeout_s: float,
    failed_grace_s: float,
    console: Console,
    stop: StopRequest,
) -> Followed:
    """Print verdicts as they come (those after the first ``earlier`` of ``path``); end the
    job a grace period after a verdict that means it will not recover or after a rank
    failed on its own (whichever comes first), at the timeout, or at a stop signal."""
    printed: list[dict] = []
    deadline = time.monotonic() + timeout_s
    end_at: float | None = None
    why = ""
    leaving: set[int] = set()  # ranks a crash verdict named: their exit is theirs to finish
    while True:
        if stop:
            return Followed(printed, "stopped")
        codes = job.poll()
        if all(c is not None for c in codes):
            return Followed(printed, "exited")
        now = time.monotonic()
        if now > deadline:
            console.print(f"[red]ending the job: it ran past the timeout ({timeout_s:g} s)[/]")
            return Followed(printed, "timeout")
        for v in read_verdicts(path)[earlier + len(printed) :]:
            printed.append(v)
            console.print(render_verdict(v))
            if v["kind"] in TERMINAL:
                end_at = now + GRACE_S if end_at is None else min(end_at, now + GRACE_S)
                why = why or "verdict"
            if v["kind"] == "crash":
                leaving.update(r for r in v["ranks"] if 0 <= r < len(codes))
        # A rank that failed on its own is the job's failure, whatever verdict its loss
        # brought first (a killed rank is soon an unresponsive one): the ranks' ends say it.
        if why != "failed" and any(c not in (None, 0) for c in codes):
            if end_at is None:
                console.print("[red]a rank failed; ending the job shortly[/]")
                end_at = now + failed_grace_s
            why = "failed"
        still_leaving = any(codes[r] is None for r in leaving)
        if end_at is not None and now > end_at and not (still_leaving and now < end_at + LEAVING_S):
            console.print("[dim]ending the job (it will not recover)[/]")
            return Followed(printed, why)
        time.sleep(0.2)


def failed_grace_s(cfg: CcldConfig) -> float:
    """How long the job goes on after a rank failed on its own, unless a verdict that means
    it will not recover comes first: time for the diagnoser (or its standby, if the
    diagnoser's rank is the one lost) to name the rank: its lease, the "unresponsive"
    threshold and a few rounds. (The lease is services.diagnoser's LEASE_INTERVALS, 4
    intervals: not imported, as that would load torch into the demo's own process.)"""
    return cfg.diagnoser.unresponsive_s + 6 * cfg.agent.interval_s + 3.0


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps_completed(boards: Path, planned: int, world: int, since_ns: int) -> int:
    """The steps every rank of this run completed, by its board: none for a rank whose
    board is missing, unreadable or older than the run (``since_ns``, on the monotonic
    clock the ranks share: a folder the configuration names may hold an earlier run's)."""
    steps = []
    for rank in range(world):
        try:
            with BoardReader(board_file(boards, rank)) as r:
                h = r.header()
        except BoardError:
            return 0
        if h.start_mono_ns < since_ns:
            return 0
        steps.append(planned if h.closed and h.step == planned - 1 else h.step)
    return min(steps)


def _print_summary(
    console: Console, summary: dict, faults: list[FaultSpec], out: Path, boards: Path
) -> None:
    try:
        print_collectives(collective_table(boards), console)
    except BoardError:
        pass
    kept = (
        f"in {boards}"
        if summary["boards"]
        else "removed (board.cleanup; --set board.cleanup=false keeps them)"
    )
    console.print(
        f"[bold]summary[/] ({out / 'summary.json'}): "
        f"{len(summary['verdicts'])} verdict(s), steps completed "
        f"{summary['steps_completed']}, rank exit codes {summary['exit']}; boards {kept}"
    )
    for m in summary["latency_s"]:
        status = "[green]diagnosed[/]" if m["verdict"] else "[red]NOT diagnosed[/]"
        extra = f" in {m['latency_s']} s" if m["latency_s"] is not None else ""
        steps = f" ({m['steps_to_verdict']} steps)" if m["steps_to_verdict"] is not None else ""
        console.print(f"  fault {m['fault']}: {status}{extra}{steps}")
    for line in summary["contained_errors"]:
        console.print(f"  [yellow]{escape(line)}[/]")
    if not faults:
        console.print(
            "  healthy run: "
            + ("[green]no verdict[/]" if not summary["verdicts"] else "[red]unexpected verdicts[/]")
        )
