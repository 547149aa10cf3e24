"""``ccld demo``: launch a real training job on this machine with the plugin on, and show
what the plugin saw."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from ccld_plugin.board_report import collective_table, print_collectives
from ccld_plugin.config import load_config
from ccld_plugin.faults.spec import parse_faults
from ccld_plugin.launch import LocalJob

__all__ = ["DemoOptions", "run_demo"]


@dataclass
class DemoOptions:
    framework: str = "torch"
    world: int = 4
    tp: int = 2
    pp: int = 2
    steps: int = 20
    faults: list[str] = field(default_factory=list)
    out: Path = Path("demo-out")
    overrides: list[str] = field(default_factory=list)
    timeout_s: float = 300.0


def run_demo(opts: DemoOptions, console: Console | None = None) -> int:
    console = console or Console()
    out = opts.out.resolve()
    boards = out / "boards"
    # Validate everything before launching anything: a bad key or spec is a one-line error.
    cfg = load_config(None, opts.overrides)
    parse_faults(opts.faults, opts.world)
    if out.exists():
        shutil.rmtree(out / "boards", ignore_errors=True)
    overrides = [f"board.dir={boards.parent}", f"job={boards.name}", "board.cleanup=false",
                 *opts.overrides]
    argv = ["-m", "ccld_plugin.workload", "--tp", str(opts.tp), "--pp", str(opts.pp),
            "--steps", str(opts.steps), *sum((["--ccld-set", o] for o in overrides), [])]
    job = LocalJob(world=opts.world, argv=argv, log_dir=out / "logs",
                   env={"CCLD_FAULTS": ";".join(opts.faults),
                        "CCLD_FAULT_LOG": str(out / "faults.jsonl")})
    console.print(f"[bold]ccld demo[/]: {opts.world} ranks, tp={opts.tp} pp={opts.pp} "
                  f"dp={opts.world // (opts.tp * opts.pp)}, {opts.steps} steps, logs in "
                  f"{out / 'logs'}")
    job.start()
    finished = job.wait(opts.timeout_s)
    codes = job.stop()
    if not finished:
        console.print(f"[red]the job did not finish within {opts.timeout_s:.0f}s; ended it[/]")
    print_collectives(collective_table(boards), console)
    if cfg.board.cleanup:
        shutil.rmtree(boards, ignore_errors=True)
    else:
        console.print(f"boards kept in {boards} (read them with: ccld inspect {boards})")
    failed = [r for r, c in enumerate(codes) if c != 0]
    if failed:
        console.print(f"[red]ranks {failed} exited with codes {[codes[r] for r in failed]}; "
                      f"see {out / 'logs'}[/]")
        return 1
    return 0
