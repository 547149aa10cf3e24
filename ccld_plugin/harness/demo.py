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
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ccld_plugin.board.job_files import JOB_CONFIG, board_file
from ccld_plugin.board.reader import BoardError, BoardReader
from ccld_plugin.board.report import collective_table, print_collectives
from ccld_plugin.config import CcldConfig, load_config
from ccld_plugin.errors import CONTAINED
from ccld_plugin.harness.capacity import host_capacity
from ccld_plugin.harness.faults.netns import MAX_RANKS
from ccld_plugin.harness.faults.spec import FaultSpec, parse_faults
from ccld_plugin.harness.launch import LocalJob, free_port
from ccld_plugin.harness.netjob import NetJob, NetnsError, available
from ccld_plugin.harness.stop_signals import Stopped, StopRequest, stop_on_signals
from ccld_plugin.sinks.console import render_verdict
from ccld_plugin.sinks.jsonl import read_verdicts

__all__ = [
    "DemoError",
    "DemoOptions",
    "expected_verdict",
    "fit_layout",
    "match_faults",
    "run_demo",
]

GRACE_S = 3.0  # after a verdict that means the job will not recover, before ending it
DIAGNOSER_GRACE_S = 5.0  # for ``ccld diagnoser``'s last round once the job is over
WANDB_WAIT_S = 30.0  # for the W&B writer to finish the run once the job is over
MARKER = ".ccld-demo"  # in DIR: a demo's output, which the next demo may replace; its lock
_HOLDER = re.compile(r"pid (\d+)")  # the marker names the demo that holds DIR
OUTPUTS = ("boards", "logs", "verdicts.jsonl", "faults.jsonl", "summary.json", "trace.json")
_EXPECTED = {
    "compute-hang": ("hang", "compute"),
    "compute-slow": ("slow", "compute"),
    "mismatch": ("mismatch", "software"),
    "comm-slow": ("slow", "communication"),
    "comm-hang": ("hang", "communication"),
    "kill": ("unresponsive", "unknown"),
    "crash": ("crash", "software"),
    "freeze": ("unresponsive", "unknown"),
    "cpu-contention": ("slow", "compute"),
}
_TERMINAL = {"hang", "deadlock", "mismatch", "unresponsive", "crash"}


@dataclass
class DemoOptions:
    framework: str = "megatron"
    world: int = 4
    tp: int = 2  # the command line fits unset sizes to the world: fit_layout
    pp: int = 2
    steps: int = 40
    faults: list[str] = field(default_factory=list)
    out: Path = Path("demo-out")
    overrides: list[str] = field(default_factory=list)
    timeout_s: float = 300.0
    zero_stage: int = 2  # deepspeed only
    netns: bool = False  # ranks in a closed network; implied by a communication fault
    force: bool = False  # write into ``out`` even when it holds files that are not a demo's
    # the diagnoser as a process of its own (``ccld diagnoser``), no rank running one
    diagnoser_process: bool = False


@dataclass
class Followed:
    """How the job ended while the demo followed it: ``exited`` (every rank on its own),
    ``verdict`` (ended a grace period after a verdict that means it will not recover),
    ``failed`` (ended a grace period after a rank failed on its own, whether or not a
    verdict came first) or ``timeout``."""

    printed: list[dict]
    ended: str


@dataclass
class Outcome:
    """What a run left, to judge it by."""

    faults: list[FaultSpec]
    injected: list[dict]
    latency: list[dict]  # match_faults(injected, verdicts)
    verdicts: list[dict]
    codes: list[int | None]
    steps: int  # completed by every rank
    ended: str  # Followed.ended


def expected_verdict(fault: FaultSpec | dict) -> tuple[str, str]:
    kind = fault.kind if isinstance(fault, FaultSpec) else fault["kind"]
    return _EXPECTED[kind]


def match_faults(faults: list[dict], verdicts: list[dict]) -> list[dict]:
    """For each injected fault, the first verdict that names its rank with the expected
    kind and cause, and the latency from the fault's onset."""
    out = []
    for f in faults:
        kind, cause = expected_verdict(f)
        hit = next(
            (
                v
                for v in verdicts
                if v["kind"] == kind and v["cause"] == cause and f["rank"] in v["ranks"]
            ),
            None,
        )
        latency = None
        if hit is not None and f.get("onset_s") is not None:
            latency = round(hit["detected_s"] - f["onset_s"], 2)
        out.append(
            {
                "fault": f["fault"],
                "verdict": hit is not None,
                "latency_s": latency,
                "steps_to_verdict": (hit["step"] - f["step"])
                if hit and hit.get("step") is not None and kind == "slow"
                else None,
            }
        )
    return out


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
    faults = _checked_options(opts)
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
        f"[bold]ccld demo[/]: {opts.world} ranks, {_layout(opts)}, {opts.steps} steps, "
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


def fit_layout(world: int, tp: int | None, pp: int | None) -> tuple[int, int]:
    """TP and PP sizes for ``world`` ranks, those not given chosen to fit it: TP 2 where the
    world is even, then PP 2 where what is left is (TP2xPP2 at 4 and 8 ranks, TP2 at 2 and
    6, none at 3); sizes given are kept, and checked with the rest of the options."""
    if tp is None:
        tp = 2 if world % (2 * (pp if pp is not None and pp >= 1 else 1)) == 0 else 1
    if pp is None:
        pp = 2 if tp >= 1 and world % (2 * tp) == 0 else 1
    return tp, pp


def _default_fault(world: int) -> str:
    """The demo's fault when none is given: a compute hang on rank 2, or the last rank."""
    return f"compute-hang@{min(2, world - 1)}:step=5"


def _layout(opts: DemoOptions) -> str:
    """The job's parallel layout as the framework runs it (the DeepSpeed example is data
    parallel only: --tp and --pp do not apply to it)."""
    if opts.framework == "deepspeed":
        return f"dp={opts.world} (ZeRO-{opts.zero_stage})"
    return f"tp={opts.tp} pp={opts.pp} dp={opts.world // (opts.tp * opts.pp)}"


def _checked_options(opts: DemoOptions) -> list[FaultSpec]:
    """The faults to inject; DemoError (or FaultSpecError) for options that cannot run."""
    for flag, value in (
        ("--world", opts.world),
        ("--tp", opts.tp),
        ("--pp", opts.pp),
        ("--steps", opts.steps),
    ):
        if value < 1:
            raise DemoError(f"ccld demo: {flag} {value} is not allowed; expected a number >= 1")
    capacity = host_capacity(opts.framework)
    if opts.world > capacity.ranks:
        raise DemoError(
            f"ccld demo: --world {opts.world} is more than this host can run: at most "
            f"{capacity.ranks} {opts.framework} ranks ({capacity.why}); lower --world"
        )
    if opts.framework != "deepspeed" and opts.world % (opts.tp * opts.pp):
        raise DemoError(
            f"ccld demo: --world {opts.world} is not a multiple of --tp {opts.tp} x --pp "
            f"{opts.pp}; choose sizes whose product divides the world"
        )
    if opts.zero_stage not in (1, 2, 3):
        raise DemoError(f"ccld demo: --zero-stage {opts.zero_stage}; expected 1, 2 or 3")
    if not (math.isfinite(opts.timeout_s) and opts.timeout_s > 0):
        raise DemoError(f"ccld demo: timeout {opts.timeout_s} s; expected a number > 0")
    specs = opts.faults or [_default_fault(opts.world)]
    if any(not spec.strip() for spec in specs):
        raise DemoError(
            "ccld demo: --fault '' is empty; give a spec such as compute-hang@2:step=5, or none"
        )
    faults = parse_faults(specs, opts.world)
    if (opts.netns or any(f.is_comm for f in faults)) and opts.world > MAX_RANKS:
        raise DemoError(
            f"ccld demo: --world {opts.world} does not fit the closed network (one /24: at "
            f"most {MAX_RANKS} ranks); lower --world, or drop --netns and communication faults"
        )
    late = next((f for f in faults if f.step >= opts.steps), None)
    if late is not None:
        raise DemoError(
            f"ccld demo: fault {late} starts at step {late.step}, after the last step "
            f"({opts.steps - 1}) of --steps {opts.steps}; lower its step or raise --steps"
        )
    return faults


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


def why_failed(o: Outcome, opts: DemoOptions, logs: Path) -> str | None:
    """Why a run is not what the demo was asked for (None: it is), in one line: the job's
    failure (unless a fault that breaks the job was diagnosed: the ranks' ends are its),
    then the diagnosis'."""
    alive = [r for r, c in enumerate(o.codes) if c is None]
    if alive:
        return f"ranks {alive} did not end when killed"
    on_purpose = any(
        m["verdict"] and expected_verdict(f)[0] in _TERMINAL
        for f, m in zip(o.injected, o.latency, strict=True)
    )
    job = None if on_purpose else _job_failure(o, opts, logs)
    problems = [p for p in (job, _diagnosis_failure(o)) if p is not None]
    return "; ".join(problems) or None


def _diagnosis_failure(o: Outcome) -> str | None:
    """A fault not injected or not diagnosed, or a verdict in a healthy run."""
    injected = {f["fault"] for f in o.injected}
    for spec in o.faults:
        if str(spec) not in injected:
            return f"fault {spec} was never injected (the ranks completed {o.steps} steps)"
    for f, m in zip(o.injected, o.latency, strict=True):
        if not m["verdict"]:
            kind, cause = expected_verdict(f)
            return (
                f"fault {m['fault']} was not diagnosed: no {kind} verdict with cause {cause} "
                f"naming rank {f['rank']} among {len(o.verdicts)} verdict(s)"
            )
    if not o.faults and o.verdicts:
        kinds = ", ".join(sorted({v["kind"] for v in o.verdicts}))
        return f"the healthy run got {len(o.verdicts)} verdict(s) ({kinds})"
    return None


def _job_failure(o: Outcome, opts: DemoOptions, logs: Path) -> str | None:
    """Why the job itself failed (None: it trained every step and exited cleanly)."""
    at = f"after {o.steps} of {opts.steps} steps"
    if o.ended == "timeout":
        return f"the job did not end within {opts.timeout_s:g} s ({at}); it was killed"
    if o.ended == "verdict":
        kinds = ", ".join(sorted({v["kind"] for v in o.verdicts if v["kind"] in _TERMINAL}))
        return f"the job was ended {at}, after a {kinds} verdict that no injected fault explains"
    bad = {r: c for r, c in enumerate(o.codes) if c != 0}
    if bad:
        by_reason: dict[str, list[int]] = {}
        for r, c in bad.items():
            by_reason.setdefault(_exit_reason(c, logs / f"rank{r}.log"), []).append(r)
        told = "; ".join(f"{_who(ranks)} {reason}" for reason, ranks in list(by_reason.items())[:2])
        return f"ranks {sorted(bad)} failed {at}: {told}"
    if o.steps < opts.steps:
        return f"the job ended {at}"
    return None


def logged_errors(logs: Path) -> list[str]:
    """The errors the plugin contained in the job's processes, as each log told them first
    (``errors.report_error``): "rank2: ccld: contained error in ...", one per place."""
    found = []
    for log in sorted(logs.glob("*.log")):
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                at = line.find(CONTAINED)
                if at >= 0:
                    found.append(f"{log.stem}: {line[at:].strip()}")
    return found


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _exit_reason(code: int | None, log: Path) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code} ({_last_line(log)})"


def _last_line(log: Path, limit: int = 200) -> str:
    """The last line a rank wrote (a traceback's ends with the exception), shortened."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError as exc:
        return f"no log ({exc.strerror})"
    last = next((ln for ln in reversed(lines) if ln), "its log is empty")
    return last if len(last) <= limit else last[: limit - 3] + "..."


EXAMPLE_SCRIPTS = {"megatron": "megatron/pretrain_gpt.py", "deepspeed": "deepspeed/train.py"}


def example_script(framework: str) -> Path:
    """A framework's example training script: shipped in the wheel (``ccld_plugin/examples``,
    installed by CMakeLists.txt) or, in a source checkout, ``examples/``."""
    package = Path(__file__).resolve().parents[1]
    rel = EXAMPLE_SCRIPTS[framework]
    for root in (package / "examples", package.parent / "examples"):
        if (root / rel).is_file():
            return root / rel
    raise FileNotFoundError(
        f"the {framework} example ({rel}) is neither in the installed "
        "package nor in a source checkout"
    )


def _example(framework: str) -> Path:
    try:
        return example_script(framework)
    except FileNotFoundError as exc:
        raise DemoError(f"{exc}: reinstall ccld-plugin, or use --framework torch") from None


def _framework_argv(opts: DemoOptions) -> list[str]:
    """The command of one rank for the chosen framework."""
    if opts.framework == "torch":
        return [
            "-m",
            "ccld_plugin.harness.workload",
            "--tp",
            str(opts.tp),
            "--pp",
            str(opts.pp),
            "--steps",
            str(opts.steps),
        ]
    if opts.framework == "megatron":
        # A model big enough that compute, not Python overhead, dominates a step.
        return [
            str(_example(opts.framework)),
            "--tensor-model-parallel-size",
            str(opts.tp),
            "--pipeline-model-parallel-size",
            str(opts.pp),
            "--train-iters",
            str(opts.steps),
            "--hidden-size",
            "128",
            "--seq-length",
            "64",
            "--micro-batch-size",
            "4",
            "--ccld",
        ]
    if opts.framework == "deepspeed":
        return [
            str(_example(opts.framework)),
            "--zero-stage",
            str(opts.zero_stage),
            "--steps",
            str(opts.steps),
            "--hidden",
            "512",
        ]
    raise DemoError(f"unknown framework {opts.framework!r}; choose megatron, deepspeed or torch")


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


class DemoError(ValueError):
    """A demo that cannot run as asked; the message is one line."""


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
            if v["kind"] in _TERMINAL:
                end_at = now + GRACE_S if end_at is None else min(end_at, now + GRACE_S)
                why = why or "verdict"
        # A rank that failed on its own is the job's failure, whatever verdict its loss
        # brought first (a killed rank is soon an unresponsive one): the ranks' ends say it.
        if why != "failed" and any(c not in (None, 0) for c in codes):
            if end_at is None:
                console.print("[red]a rank failed; ending the job shortly[/]")
                end_at = now + failed_grace_s
            why = "failed"
        if end_at is not None and now > end_at:
            console.print("[dim]ending the job (it will not recover)[/]")
            return Followed(printed, why)
        time.sleep(0.2)


def failed_grace_s(cfg: CcldConfig) -> float:
    """How long the job goes on after a rank failed on its own, unless a verdict that means
    it will not recover comes first: time for the diagnoser (or its standby, if the
    diagnoser's rank is the one lost) to name the rank: its lease, the "unresponsive"
    threshold and a few rounds. (The lease is runtime.diagnoser's LEASE_INTERVALS, 4
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
