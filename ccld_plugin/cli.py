"""The ``ccld`` command: a thin front over the library."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ccld", description="Diagnose slow and hung ranks.")
    sub = p.add_subparsers(dest="command", required=True)

    ins = sub.add_parser("inspect", help="show the state of rank boards (live, hung or dead)")
    ins.add_argument("path", type=Path, help="a board file or a directory of them")
    ins.add_argument("--json", action="store_true", help="machine-readable output")

    demo = sub.add_parser("demo", help="run a real training job on this machine and diagnose it")
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
    demo.add_argument("--world", type=int, default=4)
    demo.add_argument("--tp", type=int, default=2)
    demo.add_argument("--pp", type=int, default=2)
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="e.g. compute-hang@2:step=5, compute-slow@1:factor=2, mismatch@3, "
        "none (default: compute-hang@2:step=5)",
    )
    demo.add_argument(
        "--netns",
        action="store_true",
        help="run each rank in its own network namespace (needs root and "
        "iproute2; implied by a comm-slow or comm-hang fault)",
    )
    demo.add_argument("--out", type=Path, default=Path("demo-out"))
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")

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

    cfg = sub.add_parser("config", help="print the resolved configuration")
    cfg.add_argument("--config", type=Path, help="a YAML config file")
    cfg.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    from ccld_plugin.board.reader import BoardError
    from ccld_plugin.config import ConfigError
    from ccld_plugin.harness.faults.spec import FaultSpecError
    from ccld_plugin.sinks.wandb.run_file import RunFileError

    try:
        if args.command == "inspect":
            from ccld_plugin.board.report import inspect_boards, print_status

            statuses = inspect_boards(args.path)
            if args.json:
                print(json.dumps([asdict(s) for s in statuses], indent=2))
            else:
                print_status(statuses, console)
            return 0
        if args.command == "demo":
            from ccld_plugin.harness.demo import DemoOptions, run_demo

            return run_demo(
                DemoOptions(
                    framework=args.framework,
                    world=args.world,
                    tp=args.tp,
                    pp=args.pp,
                    steps=args.steps,
                    faults=args.fault,
                    out=args.out,
                    overrides=args.overrides,
                    netns=args.netns,
                    zero_stage=args.zero_stage,
                ),
                console,
            )
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
        if args.command == "config":
            from ccld_plugin.config import load_config, to_yaml

            print(to_yaml(load_config(args.config, args.overrides)), end="")
            return 0
    except (ConfigError, FaultSpecError, BoardError, RunFileError) as exc:
        print(f"ccld: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
