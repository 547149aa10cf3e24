"""Time to a verdict, measured over repeated real runs of the demo's job.

    python benchmarks/detection_latency.py [--runs 5] [--hang-min-s 10]

compute-hang: seconds from the fault's recorded onset to the verdict (target: at most
hang_min_s + 5 s). compute-slow (factor 2): steps from the onset to the verdict (target: at
most 10). Prints median and worst of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rich.console import Console

from ccld_harness.demo import DemoOptions, run_demo

CASES = {
    "compute-hang": dict(
        framework="torch", world=4, tp=2, pp=2, steps=60, faults=["compute-hang@2:step=5"]
    ),
    "compute-slow": dict(
        framework="torch", world=4, tp=1, pp=1, steps=40, faults=["compute-slow@1:factor=2,step=3"]
    ),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--hang-min-s", type=float, default=10.0)
    args = p.parse_args()
    quiet = Console(quiet=True)
    results: dict[str, list[float]] = {k: [] for k in CASES}
    for case, kw in CASES.items():
        for i in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                opts = DemoOptions(
                    **kw, out=Path(tmp), overrides=[f"diagnoser.hang_min_s={args.hang_min_s}"]
                )
                run_demo(opts, quiet)
                m = json.loads((Path(tmp) / "summary.json").read_text())["latency_s"][0]
            value = m["latency_s"] if case == "compute-hang" else m["steps_to_verdict"]
            print(f"{case} run {i + 1}: {'missed' if value is None else value}", flush=True)
            if value is not None:
                results[case].append(value)
    print(f"\nhang_min_s = {args.hang_min_s}, {args.runs} runs per case")
    for case, unit in (("compute-hang", "s"), ("compute-slow", "steps")):
        vals = results[case]
        if vals:
            print(
                f"{case}: median {statistics.median(vals):.2f} {unit}, worst {max(vals):.2f} "
                f"{unit}, diagnosed {len(vals)}/{args.runs}"
            )
        else:
            print(f"{case}: never diagnosed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
