"""The detector again, over the recorded rounds of kept benchmark runs: how a change of the
analysis (or of ``--set``) would have judged the same jobs, in seconds instead of hours.

    python benchmarks/replay_runs.py DIR... [--set KEY=VALUE]... [--verbose]

Every run folder under DIR that holds ``rounds.rec`` (``diagnoser.record``: the
sensitivity and false-alarm benchmarks record each run; keep them with ``--keep``) and the
demo's ``summary.json`` is replayed through a fresh diagnoser (``ccld_plugin.postmortem.
replay``). A run with a fault is scored as ``sensitivity.py`` scores it (found: a verdict
of the expected kind and cause naming the faulted rank; steps from onset; verdicts naming
another rank); a healthy run's verdicts are judged as ``false_alarms.py`` judges them,
against the run's own compute times (``compute.json``). The live run's own result is shown
beside, so that a replay can be checked against what the job gave.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ccld_harness.outcome import match_faults
from ccld_plugin.postmortem.replay import replay

sys.path.insert(0, str(Path(__file__).parent))
from false_alarms import judge  # noqa: E402
from sensitivity import LAYOUTS, names_another_rank  # noqa: E402


@dataclass
class Case:
    runs: int = 0
    found: int = 0
    live_found: int = 0
    steps: list[int] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    verdicts: int = 0
    false: list[str] = field(default_factory=list)
    rank_steps: int = 0


def _line(v: dict) -> str:
    g = v.get("group") or {}
    return (
        f"{v['kind']}/{v['cause']} ranks {v['ranks']} {g.get('role')}{g.get('ranks')} "
        f"step {v.get('step')} ratio {v.get('ratio')}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets")
    p.add_argument("--verbose", action="store_true", help="every run's verdicts")
    args = p.parse_args()
    cases: dict[str, Case] = defaultdict(Case)
    runs = sorted(f.parent for d in args.dirs for f in d.rglob("rounds.rec"))
    for run in runs:
        summary_file = run / "summary.json"
        if not summary_file.is_file():
            continue
        live = json.loads(summary_file.read_text())
        cfg, found = replay(run / "rounds.rec", overrides=args.sets)
        verdicts = [v.to_dict() for v in found]
        case = cases[re.sub(r"-\d+$", "", run.name)]
        case.runs += 1
        faults = [f for f in live["faults"] if f.get("kind") not in (None, "none")]
        if faults:
            fault = faults[0]
            (m,) = match_faults([fault], verdicts)
            (lm,) = match_faults([fault], live["verdicts"])
            case.live_found += lm["verdict"]
            if m["verdict"]:
                case.found += 1
                if m["steps_to_verdict"] is not None:
                    case.steps.append(m["steps_to_verdict"])
            # the layout from sensitivity's run names; unknown: any other rank is wrong
            layout = LAYOUTS.get(run.name.rsplit("-", 2)[-2], (0, 0, 0))
            case.wrong += [
                f"{run.name}: {_line(v)}"
                for v in verdicts
                if names_another_rank(v, fault["rank"], *layout)
            ]
            outcome = f"{m['steps_to_verdict']} steps" if m["verdict"] else "MISSED"
            live_outcome = f"{lm['steps_to_verdict']} steps" if lm["verdict"] else "missed"
            print(f"{run.name}: {fault['fault']}: {outcome} (live: {live_outcome})")
        else:
            world = len(live["exit"])
            case.rank_steps += live["steps_completed"] * world
            case.verdicts += len(verdicts)
            compute_file = run / "compute.json"
            compute = (
                {
                    int(r): {int(s): tuple(x) for s, x in steps.items()}
                    for r, steps in json.loads(compute_file.read_text()).items()
                }
                if compute_file.is_file()
                else {}
            )
            for v in verdicts:
                ok, why = judge(v, compute, cfg.diagnoser) if compute else (None, "no times")
                if ok is not True:
                    case.false.append(f"{run.name}: {_line(v)}: {why}")
                print(f"{run.name}: healthy: {_line(v)}: {'true' if ok else 'FALSE'} ({why})")
        if args.verbose:
            for v in verdicts:
                print(f"    {_line(v)}")
    print()
    print(
        f"{'case':<36} {'runs':>4} {'found':>6} {'live':>5} {'median':>6} {'worst':>5} "
        f"{'<=10':>4} {'<=20':>4} {'wrong':>5} {'healthy verdicts':>16} {'false':>5}"
    )
    for name, c in sorted(cases.items()):
        med = f"{statistics.median(c.steps):g}" if c.steps else "-"
        worst = f"{max(c.steps)}" if c.steps else "-"
        print(
            f"{name:<36} {c.runs:>4} {c.found:>6} {c.live_found:>5} {med:>6} {worst:>5} "
            f"{sum(s <= 10 for s in c.steps):>4} {sum(s <= 20 for s in c.steps):>4} "
            f"{len(c.wrong):>5} {c.verdicts:>16} {len(c.false):>5}"
        )
    for title, items in (
        ("wrong-rank verdicts", [w for c in cases.values() for w in c.wrong]),
        ("verdicts on healthy runs not shown true", [f for c in cases.values() for f in c.false]),
    ):
        if items:
            print(f"\n{title}:")
            for x in items:
                print(f"  {x}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
