"""``ccld demo``: launch a real training job on this machine with the plugin on, inject a
fault, print the verdicts as they come, end a hung job, and summarize.

Writes ``DIR/verdicts.jsonl``, ``DIR/faults.jsonl`` (each injected fault with its onset)
and ``DIR/summary.json`` (verdicts, faults, latency per verdict matched to its fault,
steps completed, exit code of each rank, the errors the plugin contained (each log's
``ccld: contained error`` lines: a diagnosis that raised shows there, not as a miss), and
``failure``: why the demo failed, or null),
and ``DIR/trace.json``, the run's timeline.

The exit code is 0 when the job ran and every fault was diagnosed (or, healthy, it trained
every step without a verdict), 1 when not (one line on stderr says why: a rank that failed
on its own, a job that stopped early or ran past the timeout, a fault not diagnosed), 2 for
bad input, refused before anything is launched or written.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.markup import escape

from ccld_harness.expectations import expected_verdict, match_faults
from ccld_harness.faults.spec import FaultSpec, parse_faults
from ccld_harness.frameworks import rank_argv
from ccld_harness.launch import LocalJob, free_port
from ccld_harness.netjob import NetJob, available
from ccld_plugin.board.reader import BoardError, BoardReader, board_files
from ccld_plugin.config import CcldConfig, load_config
from ccld_plugin.errors import CONTAINED
from ccld_plugin.postmortem.inspect_boards import collective_table, print_collectives
from ccld_plugin.sinks.console import render_verdict
from ccld_plugin.sinks.jsonl import read_verdicts

__all__ = ["DemoError", "DemoOptions", "fit_layout", "run_demo"]

GRACE_S = 3.0  # after a verdict that means the job will not recover, before ending it
DIAGNOSER_GRACE_S = 5.0  # for ``ccld diagnoser``'s last round once the job is over
MARKER = ".ccld-demo"  # in DIR: a demo's output, which the next demo may replace
OUTPUTS = ("boards", "logs", "verdicts.jsonl", "faults.jsonl", "summary.json", "trace.json")
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


def run_demo(opts: DemoOptions, console: Console | None = None) -> int:
    console = console or Console(highlight=False)
    out = opts.out.resolve()
    faults = _checked_options(opts)  # bad input stops here: nothing launched or written
    overrides = [
        f"board.dir={out}",
        "job=boards",
        "board.cleanup=false",
        f"sinks.jsonl={out / 'verdicts.jsonl'}",
        "sinks.console=false",
        *_wandb_overrides(out),
        *(["diagnoser.rank=-1"] if opts.diagnoser_process else []),
        *opts.overrides,
    ]
    cfg = load_config(None, overrides)  # the ranks' config, every value checked
    if cfg.diagnoser.rank >= opts.world:
        raise DemoError(
            f"ccld demo: diagnoser.rank={cfg.diagnoser.rank} is not a rank of the "
            f"{opts.world}-rank job; choose one below {opts.world}"
        )
    cleanup = load_config(None, opts.overrides).board.cleanup
    argv = [*_framework_argv(opts), *sum((["--ccld-set", o] for o in overrides), [])]
    _prepare_out(out, opts.force)
    env = {
        "CCLD_FAULTS": ";".join(str(f) for f in faults),
        "CCLD_FAULT_LOG": str(out / "faults.jsonl"),
        "TORCHDYNAMO_DISABLE": "1",
    }  # nothing here to compile; saves seconds per rank
    if not _has_cuda():
        env["DS_ACCELERATOR"] = "cpu"
    closed_network = opts.netns or any(f.is_comm for f in faults)
    # On one host the launcher hosts the store, as torchrun does; in the closed network
    # the launcher cannot be reached, and rank 0 hosts it.
    local = LocalJob(
        world=opts.world, argv=argv, log_dir=out / "logs", env=env, agent_store=not closed_network
    )
    job: LocalJob | NetJob = local
    if opts.diagnoser_process and closed_network:
        raise DemoError(
            "ccld demo: --diagnoser-process runs on this host, outside the closed network; "
            "drop --netns (and communication faults) or the option"
        )
    if closed_network:  # ranks in a closed network (netjob)
        ok, why = available()
        if not ok:
            console.print(f"[red]ccld demo: the closed network is not available: {why}[/]")
            return 2
        job = NetJob(local, faults, out / "boards", out / "faults.jsonl", cfg.diagnoser.rank)
    shown = ", ".join(map(str, faults)) or "none (healthy run)"
    console.print(
        f"[bold]ccld demo[/]: {opts.world} ranks, {_layout(opts)}, {opts.steps} steps, "
        f"fault: {shown}; logs in {out / 'logs'}"
    )
    started = time.time()
    with _termination_as_exit():
        external = None
        try:  # the job (and its network, if any) ends however the demo ends
            if opts.diagnoser_process:
                local.master_port = free_port()
                external = _start_diagnoser(local, overrides, out / "logs" / "diagnoser.log")
            job.start()
            followed = _follow(
                job, out / "verdicts.jsonl", opts.timeout_s, failed_grace_s(cfg), console
            )
        finally:
            codes = job.stop()
            if external is not None:
                _stop_diagnoser(external)
    verdicts = read_verdicts(out / "verdicts.jsonl")
    for v in verdicts[len(followed.printed) :]:  # written by the diagnoser's last round
        console.print(render_verdict(v))
    injected = _read_jsonl(out / "faults.jsonl")
    latency = match_faults(injected, verdicts)
    steps = _steps_completed(out / "boards", opts.steps)
    outcome = Outcome(faults, injected, latency, verdicts, codes, steps, followed.ended)
    failure = why_failed(outcome, opts, out / "logs")
    summary = {
        "verdicts": verdicts,
        "faults": injected,
        "latency_s": latency,
        "steps_completed": steps,
        "exit": codes,
        "contained_errors": logged_errors(out / "logs"),
        "failure": failure,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _write_trace(out, verdicts, console)
    _print_summary(console, summary, faults, out)
    _print_wandb(console, out, started)
    if cleanup:
        shutil.rmtree(out / "boards", ignore_errors=True)
    if failure is not None:
        print(f"ccld demo: failed: {failure}", file=sys.stderr)
        return 1
    return 0


def fit_layout(world: int, tp: int | None, pp: int | None) -> tuple[int, int]:
    """TP and PP sizes for ``world`` ranks, those not given chosen to fit it: TP 2 where the
    world is even, then PP 2 where what is left is (TP2xPP2 at 4 and 8 ranks, TP2 at 2 and
    6, none at 3); sizes given are kept, and checked with the rest of the options."""
    if tp is None:
        tp = 2 if world % (2 * (pp or 1)) == 0 else 1
    if pp is None:
        pp = 2 if world % (2 * tp) == 0 else 1
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
    late = next((f for f in faults if f.step >= opts.steps), None)
    if late is not None:
        raise DemoError(
            f"ccld demo: fault {late} starts at step {late.step}, after the last step "
            f"({opts.steps - 1}) of --steps {opts.steps}; lower its step or raise --steps"
        )
    return faults


def _prepare_out(out: Path, force: bool) -> None:
    """Make ``out`` ready for this run: the outputs of a previous demo are replaced, a
    folder that holds anything else is refused unless ``force`` (and even then only the
    demo's own outputs are removed)."""
    if out.exists() and not out.is_dir():
        raise DemoError(f"ccld demo: --out {out} is a file; choose a folder")
    ours = (out / MARKER).exists() or (out / "summary.json").is_file()
    if out.is_dir() and not ours and not force and any(out.iterdir()):
        raise DemoError(
            f"ccld demo: --out {out} holds files that are not a demo's output; choose a new "
            "or empty folder, or pass --force to write into it"
        )
    for name in OUTPUTS:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("ccld demo output: the next demo here replaces its results\n")


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


@contextlib.contextmanager
def _termination_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP end the demo like Ctrl-C: through its ``finally`` (the job and
    its network are stopped). Only the main thread can take signals; elsewhere, nothing
    changes (the ranks still die with the launcher: harness.launch)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _framework_argv(opts: DemoOptions) -> list[str]:
    """The command of one rank for the chosen framework."""
    try:
        return rank_argv(opts.framework, opts.tp, opts.pp, opts.steps, opts.zero_stage)
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


def _print_wandb(console: Console, out: Path, started: float) -> None:
    if not (out / "wandb").exists():
        return
    from ccld_plugin.sinks.wandb.run_file import wait_for_run

    # The writer finishes the run after the job ends (a killed job too).
    run = wait_for_run(out / "wandb", timeout_s=30, since=started)
    if run is None:
        console.print(f"[yellow]no finished W&B run under {out / 'wandb'} yet[/]")
        return
    console.print(
        f"W&B offline run: {run.file.parent} ({len(run.points)} keys, "
        f"{len(run.tables)} tables, {len(run.alerts)} alerts; see it with: ccld "
        f"wandb-summary {out / 'wandb'}; upload with: wandb sync {run.file.parent})"
    )


def _write_trace(out: Path, verdicts: list[dict], console: Console) -> None:
    """The run's timeline beside its verdicts (what ``ccld trace`` writes), from its boards."""
    from ccld_plugin.postmortem.boards import PostmortemError, load_boards
    from ccld_plugin.postmortem.timeline import write_trace

    try:
        n = write_trace(load_boards(out / "boards"), verdicts, out / "trace.json")
    except PostmortemError as exc:
        console.print(f"[yellow]no timeline: {exc}[/]")
        return
    console.print(
        f"timeline: {out / 'trace.json'} ({n} events; open it in ui.perfetto.dev or "
        "chrome://tracing)"
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class DemoError(ValueError):
    """A demo that cannot run as asked; the message is one line."""


def _start_diagnoser(job: LocalJob, overrides: list[str], log_path: Path) -> subprocess.Popen:
    """``ccld diagnoser`` beside the job, on the store its launcher hosts."""
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
        *sum((["--set", o] for o in overrides), []),
    ]
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop_diagnoser(proc: subprocess.Popen) -> None:
    """Let it run its last round (it ends by itself once every rank left), then end it."""
    try:
        proc.wait(timeout=DIAGNOSER_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=DIAGNOSER_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _follow(
    job: LocalJob | NetJob, path: Path, timeout_s: float, failed_grace_s: float, console: Console
) -> Followed:
    """Print verdicts as they come; end the job a grace period after a verdict that means
    it will not recover or after a rank failed on its own (whichever comes first), or at
    the timeout."""
    printed: list[dict] = []
    deadline = time.monotonic() + timeout_s
    end_at: float | None = None
    why = ""
    while True:
        codes = job.poll()
        if all(c is not None for c in codes):
            return Followed(printed, "exited")
        now = time.monotonic()
        if now > deadline:
            console.print(f"[red]ending the job: it ran past the timeout ({timeout_s:g} s)[/]")
            return Followed(printed, "timeout")
        for v in read_verdicts(path)[len(printed) :]:
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
    threshold and a few rounds. (The lease is services.diagnoser's LEASE_INTERVALS, 4
    intervals: not imported, as that would load torch into the demo's own process.)"""
    return cfg.diagnoser.unresponsive_s + 6 * cfg.agent.interval_s + 3.0


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps_completed(boards: Path, planned: int) -> int:
    steps = []
    for f in board_files(boards) if boards.exists() else []:
        try:
            with BoardReader(f) as r:
                h = r.header()
                steps.append(planned if h.closed and h.step == planned - 1 else h.step)
        except BoardError:
            continue
    return min(steps) if steps else 0


def _print_summary(console: Console, summary: dict, faults: list[FaultSpec], out: Path) -> None:
    try:
        print_collectives(collective_table(out / "boards"), console)
    except BoardError:
        pass
    console.print(
        f"[bold]summary[/] ({out / 'summary.json'}): "
        f"{len(summary['verdicts'])} verdict(s), steps completed "
        f"{summary['steps_completed']}, rank exit codes {summary['exit']}"
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
