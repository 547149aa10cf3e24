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

    demo = sub.add_parser("demo", help="run a real training job on this machine and "
                                       "diagnose it")
    demo.add_argument("--framework", default="torch", choices=["torch"])
    demo.add_argument("--world", type=int, default=4)
    demo.add_argument("--tp", type=int, default=2)
    demo.add_argument("--pp", type=int, default=2)
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--fault", action="append", default=[], metavar="SPEC",
                      help="e.g. compute-hang@2:step=5, compute-slow@1:factor=2, mismatch@3, "
                           "none (default: compute-hang@2:step=5)")
    demo.add_argument("--out", type=Path, default=Path("demo-out"))
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      dest="overrides")

    cfg = sub.add_parser("config", help="print the resolved configuration")
    cfg.add_argument("--config", type=Path, help="a YAML config file")
    cfg.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     dest="overrides")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    from ccld_plugin.config import ConfigError
    from ccld_plugin.faults.spec import FaultSpecError
    from ccld_plugin.probe import BoardError

    try:
        if args.command == "inspect":
            from ccld_plugin.board_report import inspect_boards, print_status

            statuses = inspect_boards(args.path)
            if args.json:
                print(json.dumps([asdict(s) for s in statuses], indent=2))
            else:
                print_status(statuses, console)
            return 0
        if args.command == "demo":
            from ccld_plugin.demo import DemoOptions, run_demo

            return run_demo(DemoOptions(framework=args.framework, world=args.world, tp=args.tp,
                                        pp=args.pp, steps=args.steps, faults=args.fault,
                                        out=args.out, overrides=args.overrides), console)
        if args.command == "config":
            from ccld_plugin.config import load_config, to_yaml

            print(to_yaml(load_config(args.config, args.overrides)), end="")
            return 0
    except (ConfigError, FaultSpecError, BoardError) as exc:
        print(f"ccld: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
