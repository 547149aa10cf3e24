"""The ``ccld`` command: a thin front over the library."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from ccld_plugin.postmortem.inspect_boards import Inspection

__all__ = ["main"]

# One spelling per thing across the commands: --config PATH and --set KEY=VALUE for the
# plugin's configuration (--ccld-config / --ccld-set where they share a training script's
# parser), -o/--out for what a command writes.
SET_HELP = "override one config key, e.g. diagnoser.hang_min_s=30 (repeatable)"


def _parser() -> argparse.ArgumentParser:
    from ccld_plugin import __version__

    p = argparse.ArgumentParser(prog="ccld", description="Diagnose slow and hung ranks.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    ins = sub.add_parser("inspect", help="show the state of rank boards (live, hung or dead)")
    ins.add_argument("path", type=Path, help="a board file or a directory of them")
    ins.add_argument("--json", action="store_true", help="machine-readable output")

    demo = sub.add_parser(
        "demo", help="run a real training job with an injected fault, here, and diagnose it"
    )
    demo.add_argument(
        "--framework",
        default="megatron",
        choices=["megatron", "deepspeed", "torch"],
        help="megatron / deepspeed: the examples (from a source checkout); "
        "torch: the built-in plain-PyTorch workload",
    )
    demo.add_argument(
        "--zero-stage", type=int, default=2, choices=[1, 2, 3], help="ZeRO stage (deepspeed only)"
    )
    demo.add_argument(
        "--world",
        type=int,
        default=4,
        help="ranks; more than this host's free memory and process limit hold is refused",
    )
    demo.add_argument(
        "--tp", type=int, help="megatron / torch only (default: 2 where the world allows it)"
    )
    demo.add_argument(
        "--pp", type=int, help="megatron / torch only (default: 2 where the world allows it)"
    )
    demo.add_argument("--steps", type=int, default=40, help="training steps of the job")
    demo.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="e.g. compute-hang@2:step=5, compute-slow@1:factor=2, mismatch@3, "
        "kill@1:step=5, cpu-contention@1, device-slow@1:factor=2 (--device sim), none "
        "(default: compute-hang@2:step=5, on the last rank below 3 ranks)",
    )
    demo.add_argument(
        "--netns",
        action="store_true",
        help="run each rank in its own network namespace (needs root and "
        "iproute2; implied by a comm-slow or comm-hang fault)",
    )
    demo.add_argument(
        "-o",
        "--out",
        type=Path,
        default=Path("demo-out"),
        help="the run's folder (its parent must exist); a running demo holds it against others",
    )
    demo.add_argument(
        "--force",
        action="store_true",
        help="write into --out even when it holds files that are not a demo's",
    )
    demo.add_argument(
        "--diagnoser-process",
        action="store_true",
        help="run the diagnoser as a process of its own (ccld diagnoser), not on a rank",
    )
    demo.add_argument(
        "--device",
        choices=["cpu", "sim"],
        default="cpu",
        help="sim: --framework torch on the simulated device (asynchronous collectives, "
        "read from its device timeline; faults device-slow and device-hang)",
    )
    demo.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides", help=SET_HELP
    )

    wbs = sub.add_parser(
        "wandb-summary",
        help="show what an offline W&B run holds (keys, points, tables, alerts), from its run file",
    )
    wbs.add_argument(
        "path",
        type=Path,
        help="a .wandb file, or a directory with runs under it (the newest is shown)",
    )
    wbs.add_argument("--prefix", default="", help="only history keys with this prefix")
    wbs.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the run to finish being written",
    )
    wbs.add_argument("--json", action="store_true", help="machine-readable output")

    dia = sub.add_parser(
        "diagnose", help="diagnose a job from the boards it left (hung, crashed or killed)"
    )
    dia.add_argument(
        "path",
        type=Path,
        nargs="+",
        help="the job's board directory (or one board file); one per host for a job whose "
        "hosts kept their own boards",
    )
    _verdict_options(dia)

    rp = sub.add_parser(
        "replay", help="diagnose a recorded job again (diagnoser.record), e.g. with --set"
    )
    rp.add_argument("path", type=Path, help="the recording (diagnoser.record)")
    _verdict_options(rp)

    tr = sub.add_parser(
        "trace", help="write a job's timeline from its boards (Perfetto, chrome://tracing)"
    )
    tr.add_argument("path", type=Path, help="the job's board directory (live or dead)")
    tr.add_argument(
        "-o",
        "--out",
        "--output",
        type=Path,
        default=Path("trace.json"),
        dest="output",
        metavar="PATH",
        help="the timeline file to write (Trace Event JSON; --output is the same option)",
    )
    tr.add_argument(
        "--force",
        action="store_true",
        help="replace the --out file when it exists (a regular file)",
    )
    tr.add_argument(
        "--verdicts",
        type=Path,
        help="mark the verdicts of this verdicts.jsonl (default: a post-mortem diagnosis)",
    )
    tr.add_argument("--config", type=Path, help="a YAML config (default: the job's own)")
    tr.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides", help=SET_HELP
    )

    dg = sub.add_parser(
        "diagnoser",
        help="run the diagnoser as a process of its own, beside a job with diagnoser.rank=-1",
    )
    dg.add_argument(
        "--store",
        required=True,
        metavar="HOST:PORT",
        help="the job's TCPStore (MASTER_ADDR:MASTER_PORT; [ADDR]:PORT for IPv6); waited for "
        "up to control.connect_timeout_s",
    )
    dg.add_argument(
        "--world", type=int, required=True, help="the job's number of ranks (at most 1,048,576)"
    )
    dg.add_argument(
        "--job",
        help="the job's name (default: the config's job, else the launcher's run id, else "
        "job-PORT, as the ranks name it)",
    )
    dg.add_argument("--config", type=Path, help="a YAML config file (the job's)")
    dg.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides", help=SET_HELP
    )

    run = sub.add_parser(
        "run",
        help="run a launcher command with the plugin on in every rank of an unchanged script",
        usage="ccld run [--config PATH] [--set KEY=VALUE]... -- COMMAND...",
    )
    run.add_argument("--config", type=Path, help="a YAML config file")
    run.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides", help=SET_HELP
    )
    run.add_argument("launch", nargs=argparse.REMAINDER, help="e.g. -- torchrun ... train.py")

    cfg = sub.add_parser("config", help="print the resolved configuration, or explain its keys")
    cfg.add_argument("--config", type=Path, help="a YAML config file")
    cfg.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides", help=SET_HELP
    )
    cfg.add_argument(
        "--explain",
        nargs="?",
        const="",
        metavar="KEY",
        help="print what KEY (or every key under a section, or with no KEY every key) means: "
        "its type, default, unit and allowed values",
    )
    return p


def _verdict_options(p: argparse.ArgumentParser) -> None:
    """The options of the commands that diagnose a job after the fact."""
    p.add_argument(
        "-o",
        "--out",
        "--jsonl",
        type=Path,
        dest="jsonl",
        metavar="PATH",
        help="also append the verdict records to this verdicts file (created if missing, "
        "in a folder that exists; --jsonl is the same option)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="append to the --out file even when it is no verdicts file, or not a regular "
        "file (e.g. /dev/stdout)",
    )
    p.add_argument("--config", type=Path, help="a YAML config (default: the job's own)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides", help=SET_HELP
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    from ccld_plugin.board.reader import BoardError
    from ccld_plugin.config import ConfigError
    from ccld_plugin.integrations.slurm import SlurmError
    from ccld_plugin.postmortem.boards import PostmortemError
    from ccld_plugin.sinks.wandb.run_file import RunFileError

    try:
        if args.command == "inspect":
            from ccld_plugin.postmortem.inspect_boards import inspect_all, print_status

            found = inspect_all(args.path)
            if args.json:
                print(json.dumps([asdict(s) for s in found.statuses], indent=2))
            else:
                print_status(found.statuses, console)
            return _inspect_verdict(found)
        if args.command == "demo":
            return _demo(args, console)
        if args.command == "diagnoser":
            return _diagnoser(args)
        if args.command == "wandb-summary":
            from ccld_plugin.sinks.wandb.run_file import print_summary, wait_for_run

            contents = wait_for_run(args.path, args.wait)
            if contents is None:
                print(
                    f"ccld: error: no W&B run file (run-*.wandb) at or under {args.path}",
                    file=sys.stderr,
                )
                return 2
            if args.json:
                print(json.dumps(contents.to_dict(), indent=2))
            else:
                print_summary(contents, console, args.prefix)
            return 0
        if args.command == "diagnose":
            from ccld_plugin.postmortem.commands import diagnose

            return diagnose(args.path, args.config, args.overrides, args.jsonl, args.force, console)
        if args.command == "replay":
            from ccld_plugin.postmortem.commands import replay_recording

            return replay_recording(
                args.path, args.config, args.overrides, args.jsonl, args.force, console
            )
        if args.command == "trace":
            from ccld_plugin.postmortem.commands import trace

            return trace(
                args.path,
                args.output,
                args.verdicts,
                args.config,
                args.overrides,
                args.force,
                console,
            )
        if args.command == "run":
            return _run(args.config, args.overrides, args.launch)
        if args.command == "config":
            from ccld_plugin.config import load_config, to_yaml

            if args.explain is not None:
                from ccld_plugin.reference import explain

                print(explain(args.explain or None), end="")
                return 0
            print(to_yaml(load_config(args.config, args.overrides)), end="")
            return 0
    except (ConfigError, BoardError, RunFileError, PostmortemError, SlurmError) as exc:
        print(f"ccld: error: {exc}", file=sys.stderr)
        return 2
    return 1


def _demo(args: argparse.Namespace, console: Console) -> int:
    """``ccld demo``: the one place the product runs the harness (ccld_harness), imported
    here, when asked for, so that no other command loads it."""
    from ccld_harness.demo import DemoError, DemoOptions, fit_layout, run_demo
    from ccld_harness.faults.spec import FaultSpecError

    try:
        given = [f for f, v in (("--tp", args.tp), ("--pp", args.pp)) if v is not None]
        if args.framework == "deepspeed" and given:
            raise DemoError(
                f"ccld demo: {given[0]} {getattr(args, given[0][2:])} does not apply to "
                "--framework deepspeed (its example is data parallel only); drop it"
            )
        tp, pp = fit_layout(args.world, args.tp, args.pp)
        return run_demo(
            DemoOptions(
                framework=args.framework,
                world=args.world,
                tp=tp,
                pp=pp,
                steps=args.steps,
                faults=args.fault,
                out=args.out,
                overrides=args.overrides,
                netns=args.netns,
                zero_stage=args.zero_stage,
                force=args.force,
                diagnoser_process=args.diagnoser_process,
                device=args.device,
            ),
            console,
        )
    except (DemoError, FaultSpecError) as exc:
        print(f"ccld: error: {exc}", file=sys.stderr)
        return 2


def _diagnoser(args: argparse.Namespace) -> int:
    """``ccld diagnoser``: every option checked before the store is waited for; one line
    and exit status 2 for a bad one or a store that does not answer."""
    import reprlib

    # Before torch loads: c10d's warnings, each with a C++ stack trace, for a listener that
    # is not a store; this command tells what went wrong in one line.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from ccld_plugin.config import JOB_NAME_RULE, is_job_name, load_config
    from ccld_plugin.services.diagnoser_process import (
        DiagnoserError,
        check_world,
        parse_store,
        run_diagnoser,
    )
    from ccld_plugin.services.session import job_name

    try:
        host, port = parse_store(args.store)
        check_world(args.world)
        if args.job is not None and not (args.job and is_job_name(args.job)):
            shown = reprlib.Repr()
            shown.maxstring = 80  # a long name is cut, not echoed whole
            raise DiagnoserError(
                f"ccld diagnoser: --job {shown.repr(args.job)} is not allowed; expected "
                f"{JOB_NAME_RULE}"
            )
        cfg = load_config(args.config, args.overrides)
        # as the ranks name their job when neither config nor launcher does: by port
        os.environ.setdefault("MASTER_PORT", str(port))
        return run_diagnoser(cfg, host, port, args.job or job_name(cfg), args.world)
    except DiagnoserError as exc:
        print(f"ccld: error: {exc}", file=sys.stderr)
        return 2


def _inspect_verdict(found: Inspection) -> int:
    """Say on stderr which boards could not be read and which had corrupt records (left
    out of the output); 0 when none, 1 when some, 2 when no board could be read."""
    from ccld_plugin.postmortem.inspect_boards import corrupt_warning

    for why in found.unreadable:
        print(f"ccld: error: {why}", file=sys.stderr)
    damaged = [s for s in found.statuses if s.corrupt_records]
    for s in damaged:
        print(f"ccld: warning: {corrupt_warning(s.path, s.corrupt_records)}", file=sys.stderr)
    if not found.statuses:
        return 2
    return 1 if found.unreadable or damaged else 0


def _run(config: Path | None, overrides: list[str], launch: list[str]) -> int:
    """Validate the config (against the number of ranks the launcher's arguments say it
    starts, where they say), then become the launcher (its signals and exit code are the
    job's), with the plugin on when the config enables it and the environment as it is
    when it does not."""
    import os
    import shutil

    from ccld_plugin.config import check_world, load_config
    from ccld_plugin.integrations.autostart import run_env
    from ccld_plugin.integrations.launch_world import is_launcher, launch_world
    from ccld_plugin.integrations.slurm import torch_env_from_slurm

    cmd = launch[1:] if launch[:1] == ["--"] else launch
    if not cmd:
        print(
            "ccld: error: ccld run needs a command after --, e.g. ccld run -- torchrun "
            "--nproc-per-node 4 train.py",
            file=sys.stderr,
        )
        return 2
    cfg = load_config(config, overrides)
    if shutil.which(cmd[0]) is None:
        print(f"ccld: error: command not found: {cmd[0]}", file=sys.stderr)
        return 2
    if not cfg.enabled:
        os.execvpe(cmd[0], cmd, dict(os.environ))
    env = run_env(cfg, os.environ)
    # under srun, one task per rank: torch's variables from Slurm's (a launcher sets them)
    slurm = {} if is_launcher(cmd) else torch_env_from_slurm(env)
    env.update(slurm)
    world = launch_world(cmd)
    if world is not None:
        check_world(cfg, world.ranks, world.how)
    elif slurm:
        check_world(cfg, int(slurm["WORLD_SIZE"]), f"srun: {slurm['WORLD_SIZE']} tasks")
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    raise SystemExit(main())
