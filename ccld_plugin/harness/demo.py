"""``ccld demo``: launch a real training job on this machine with the plugin on, inject a
fault, print the verdicts as they come, end a hung job, and summarize.

Writes ``DIR/verdicts.jsonl``, ``DIR/faults.jsonl`` (each injected fault with its onset)
and ``DIR/summary.json`` (verdicts, faults, latency per verdict matched to its fault,
steps completed, exit code of each rank).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from ccld_plugin.board.reader import BoardError, BoardReader, board_files
from ccld_plugin.board.report import collective_table, print_collectives
from ccld_plugin.config import load_config
from ccld_plugin.harness.faults.spec import FaultSpec, parse_faults
from ccld_plugin.harness.launch import LocalJob
from ccld_plugin.harness.netjob import NetJob, available
from ccld_plugin.sinks.console import render_verdict
from ccld_plugin.sinks.jsonl import read_verdicts

__all__ = [
    "DEFAULT_FAULT",
    "DemoError",
    "DemoOptions",
    "expected_verdict",
    "match_faults",
    "run_demo",
]

DEFAULT_FAULT = "compute-hang@2:step=5"
GRACE_S = 3.0  # after a verdict that means the job will not recover, before ending it
_EXPECTED = {
    "compute-hang": ("hang", "compute"),
    "compute-slow": ("slow", "compute"),
    "mismatch": ("mismatch", "software"),
    "comm-slow": ("slow", "communication"),
    "comm-hang": ("hang", "communication"),
}
_TERMINAL = {"hang", "deadlock", "mismatch", "unresponsive"}


@dataclass
class DemoOptions:
    framework: str = "megatron"
    world: int = 4
    tp: int = 2
    pp: int = 2
    steps: int = 40
    faults: list[str] = field(default_factory=list)
    out: Path = Path("demo-out")
    overrides: list[str] = field(default_factory=list)
    timeout_s: float = 300.0
    zero_stage: int = 2  # deepspeed only
    netns: bool = False  # ranks in a closed network; implied by a communication fault


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


def run_demo(opts: DemoOptions, console: Console | None = None) -> int:
    console = console or Console(highlight=False)
    out = opts.out.resolve()
    specs = opts.faults or [DEFAULT_FAULT]
    faults = parse_faults(specs, opts.world)  # validate before launching anything
    cfg = load_config(None, opts.overrides)
    _framework_argv(opts)
    for name in ("boards", "logs", "verdicts.jsonl", "faults.jsonl", "summary.json"):
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"board.dir={out}",
        "job=boards",
        "board.cleanup=false",
        f"sinks.jsonl={out / 'verdicts.jsonl'}",
        "sinks.console=false",
        *_wandb_overrides(out),
        *opts.overrides,
    ]
    argv = [*_framework_argv(opts), *sum((["--ccld-set", o] for o in overrides), [])]
    env = {
        "CCLD_FAULTS": ";".join(str(f) for f in faults),
        "CCLD_FAULT_LOG": str(out / "faults.jsonl"),
        "TORCHDYNAMO_DISABLE": "1",
    }  # nothing here to compile; saves seconds per rank
    if not _has_cuda():
        env["DS_ACCELERATOR"] = "cpu"
    job = LocalJob(world=opts.world, argv=argv, log_dir=out / "logs", env=env)
    if opts.netns or any(f.is_comm for f in faults):  # ranks in a closed network (netjob)
        ok, why = available()
        if not ok:
            console.print(f"[red]ccld demo: the closed network is not available: {why}[/]")
            return 2
        job = NetJob(job, faults, out / "boards", out / "faults.jsonl", cfg.diagnoser.rank)
    shown = ", ".join(map(str, faults)) or "none (healthy run)"
    console.print(
        f"[bold]ccld demo[/]: {opts.world} ranks, tp={opts.tp} pp={opts.pp} "
        f"dp={opts.world // (opts.tp * opts.pp)}, {opts.steps} steps, fault: {shown}; "
        f"logs in {out / 'logs'}"
    )
    started = time.time()
    try:  # the job (and its network, if any) ends however the demo ends
        job.start()
        printed = _follow(job, out / "verdicts.jsonl", opts.timeout_s, console)
    finally:
        codes = job.stop()
    verdicts = read_verdicts(out / "verdicts.jsonl")
    for v in verdicts[len(printed) :]:  # written by the diagnoser's last round
        console.print(render_verdict(v))
    injected = _read_jsonl(out / "faults.jsonl")
    latency = match_faults(injected, verdicts)
    summary = {
        "verdicts": verdicts,
        "faults": injected,
        "latency_s": latency,
        "steps_completed": _steps_completed(out / "boards", opts.steps),
        "exit": codes,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_summary(console, summary, faults, out)
    _print_wandb(console, out, started)
    if cfg.board.cleanup:
        shutil.rmtree(out / "boards", ignore_errors=True)
    launched = all(c is not None for c in codes)
    if faults:
        diagnosed = len(injected) >= len(faults) and all(m["verdict"] for m in latency)
    else:
        diagnosed = not verdicts
    return 0 if launched and diagnosed else 1


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


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class DemoError(ValueError):
    """A demo that cannot run as asked; the message is one line."""


def _follow(job: LocalJob | NetJob, path: Path, timeout_s: float, console: Console) -> list[dict]:
    """Print verdicts as they come; end the job a grace period after a verdict that
    means it will not recover, or at the timeout."""
    printed: list[dict] = []
    deadline = time.monotonic() + timeout_s
    end_at = None
    while job.running() and time.monotonic() < deadline:
        for v in read_verdicts(path)[len(printed) :]:
            printed.append(v)
            console.print(render_verdict(v))
            if v["kind"] in _TERMINAL and end_at is None:
                end_at = time.monotonic() + GRACE_S
        if end_at is not None and time.monotonic() > end_at:
            console.print("[dim]ending the job (it will not recover)[/]")
            break
        time.sleep(0.2)
    return printed


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
    if not faults:
        console.print(
            "  healthy run: "
            + ("[green]no verdict[/]" if not summary["verdicts"] else "[red]unexpected verdicts[/]")
        )
