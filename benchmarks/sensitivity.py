"""Sensitivity, measured: how often, and how many steps after the onset, a slow rank is
named, over compute-slow factors and comm-slow rates on two layouts.

    python benchmarks/sensitivity.py [--quick] [--runs 5] [--steps 50]
        [--layouts dp4,tp2pp2] [--factors 1.2,1.3,1.5,2.0] [--rates 30mbit,100mbit]
        [--set KEY=VALUE]... [--keep DIR]

Each run is a real ``ccld demo`` job (``--framework torch``, in-process ``run_demo``) with
one fault on a rank chosen per run (run i of case c: rank (c + i) mod world: with as many
runs as ranks, each rank, rank 0 the diagnoser's among them, once per case) and an onset
that moves across the detector's windows (step 10 + i mod 5).
comm-slow needs the closed network (``--netns``: root and iproute2); without it those
cases are skipped with the reason. Default diagnoser config, except ``--set``.

Per case and layout it prints: runs, detection rate (a verdict of the expected kind and
cause naming the faulted rank, as ``summary.json`` ``latency_s[].verdict``), exact
detections (naming that rank alone), median and worst steps from onset to verdict
(``steps_to_verdict``), how many were found within 10 and 20 steps, and wrong-rank
verdicts (any verdict naming a rank other than the faulted one; but a slow link named
for a rank whose only connection it is, an end stage of a lone pipeline, names all that
can be named), with every wrong one listed at the end. Goals: 1.5x in 100%
within 10 steps, 1.3x in >= 90% within 20 steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from ccld_harness.demo import DemoOptions, run_demo
from ccld_harness.netjob import available
from ccld_plugin.config import load_config

LAYOUTS = {
    "dp4": (4, 1, 1),
    "tp2pp2": (4, 2, 2),
    "dp8": (8, 1, 1),
    "tp1pp2dp2": (4, 1, 2),
    "tp1pp4": (4, 1, 4),
    "tp1pp2": (2, 1, 2),
}
LAYOUT_NAMES = {
    "dp4": "DP4 (w4)",
    "tp2pp2": "TP2xPP2 (w4, DP=1)",
    "dp8": "DP8",
    "tp1pp2dp2": "TP1xPP2xDP2 (w4)",
    "tp1pp4": "TP1xPP4 (w4, one pipeline)",
    "tp1pp2": "TP1xPP2 (w2, one connection)",
}


@dataclass
class Row:
    runs: int = 0
    found: int = 0
    exact: int = 0
    steps: list[int] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _verdict_line(v: dict) -> str:
    g = v.get("group") or {}
    facts = "; ".join(e["text"] for e in v.get("evidence", []))
    return (
        f"{v['kind']}/{v['cause']} ranks {v['ranks']} {g.get('role')}{g.get('ranks')} "
        f"link {v.get('link')} step {v.get('step')} ratio {v.get('ratio')}: {facts}"
    )


def names_another_rank(v: dict, rank: int, world: int, tp: int, pp: int) -> bool:
    """Whether verdict ``v`` blames a rank other than the faulted ``rank``. The first or
    last stage of a lone TP1 pipeline exchanges data with one rank only: its slow port is
    that one link, and naming the link names all that can be named."""
    if not set(v["ranks"]) - {rank}:
        return False
    if tp != 1 or pp != world or world < 2 or rank not in (0, world - 1):
        return True
    only = 1 if rank == 0 else world - 2
    return v.get("link") != sorted((rank, only))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one run per case and layout")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layouts", default="dp4,tp2pp2", help=",".join(LAYOUTS))
    p.add_argument("--factors", default="1.2,1.3,1.5,2.0")
    p.add_argument("--rates", default="30mbit,100mbit", help="comm-slow rates ('' for none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets")
    p.add_argument("--wandb", action="store_true", help="keep the demo's offline W&B run")
    p.add_argument("--keep", type=Path, help="keep every run's folder under DIR")
    args = p.parse_args()
    runs = 1 if args.quick else args.runs
    cfg = load_config(None, args.sets).diagnoser
    cases = [("compute-slow", f"factor={f}") for f in args.factors.split(",") if f]
    rates = [r for r in args.rates.split(",") if r]
    net_ok, why = available()
    if rates and not net_ok:
        print(f"comm-slow skipped: the closed network is not available ({why})")
    elif rates:
        cases += [("comm-slow", f"rate={r}") for r in rates]
    root = args.keep or Path(tempfile.mkdtemp(prefix="ccld-sensitivity-"))
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"sensitivity: {runs} run(s) per case and layout, {args.steps} steps, diagnoser "
        f"slow_ratio={cfg.slow_ratio} window_steps={cfg.window_steps} "
        f"confirm_windows={cfg.confirm_windows}, --set {args.sets or 'none'}; runs in {root}",
        flush=True,
    )
    rows: dict[tuple[str, str], Row] = {}
    for ci, (kind, param) in enumerate(cases):
        for lname in args.layouts.split(","):
            world, tp, pp = LAYOUTS[lname]
            row = rows.setdefault((f"{kind} {param}", lname), Row())
            for i in range(runs):
                rank, onset = (ci + i) % world, 10 + i % 5
                spec = f"{kind}@{rank}:{param},step={onset}"
                out = root / f"{kind}-{param.split('=')[1]}-{lname}-{i}"
                overrides = [*([] if args.wandb else ["sinks.wandb.enabled=false"]), *args.sets]
                # the diagnoser's rounds, for benchmarks/replay_runs.py (with --keep)
                out.mkdir(parents=True, exist_ok=True)
                overrides.append(f"diagnoser.record={out / 'rounds.rec'}")
                opts = DemoOptions(
                    framework="torch",
                    world=world,
                    tp=tp,
                    pp=pp,
                    steps=args.steps,
                    faults=[spec],
                    out=out,
                    overrides=overrides,
                    timeout_s=600.0 if kind == "comm-slow" else 300.0,
                    netns=kind == "comm-slow",
                )
                t0 = time.monotonic()
                try:
                    run_demo(opts, Console(quiet=True))
                    summary = json.loads((out / "summary.json").read_text())
                except Exception as exc:  # noqa: BLE001 - report, go on
                    row.errors.append(f"{spec}: {type(exc).__name__}: {exc}")
                    print(f"{spec} {lname}: ERROR {exc}", flush=True)
                    continue
                secs = time.monotonic() - t0
                row.runs += 1
                row.seconds += secs
                m = summary["latency_s"][0] if summary["latency_s"] else {"verdict": False}
                wrong = [
                    v for v in summary["verdicts"] if names_another_rank(v, rank, world, tp, pp)
                ]
                exact = any(
                    v["ranks"] == [rank]
                    and v["kind"] == "slow"
                    and v["cause"] == ("compute" if kind == "compute-slow" else "communication")
                    for v in summary["verdicts"]
                )
                if m["verdict"]:
                    row.found += 1
                    row.exact += exact
                    if m.get("steps_to_verdict") is not None:
                        row.steps.append(m["steps_to_verdict"])
                else:
                    why_not = summary.get("failure") or "no verdict"
                    row.missed.append(f"{spec} ({lname}): {why_not}")
                row.wrong += [f"{spec} ({lname}): {_verdict_line(v)}" for v in wrong]
                print(
                    f"{spec} {lname}: "
                    + (
                        f"found in {m.get('steps_to_verdict')} steps ({m.get('latency_s')} s)"
                        if m["verdict"]
                        else "MISSED"
                    )
                    + f", {len(summary['verdicts'])} verdict(s), {len(wrong)} wrong-rank, "
                    f"{summary['steps_completed']} steps, {secs:.0f} s",
                    flush=True,
                )
                for v in summary["verdicts"]:
                    print(f"    {_verdict_line(v)}", flush=True)
                if args.keep is None and m["verdict"] and not wrong:
                    shutil.rmtree(out, ignore_errors=True)

    print()
    hdr = (
        f"{'case':<26} {'layout':<20} {'runs':>4} {'found':>7} {'exact':>5} {'median':>6} "
        f"{'worst':>5} {'<=10':>5} {'<=20':>5} {'wrong-rank':>10} {'s/run':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for (case, lname), r in rows.items():
        med = f"{statistics.median(r.steps):g}" if r.steps else "-"
        worst = f"{max(r.steps)}" if r.steps else "-"
        rate = f"{r.found}/{r.runs}" if r.runs else "-"
        le10 = sum(1 for s in r.steps if s <= 10)
        le20 = sum(1 for s in r.steps if s <= 20)
        print(
            f"{case:<26} {LAYOUT_NAMES[lname]:<20} {r.runs:>4} {rate:>7} {r.exact:>5} "
            f"{med:>6} {worst:>5} {le10:>5} {le20:>5} {len(r.wrong):>10} "
            f"{r.seconds / max(r.runs, 1):>6.0f}"
        )
    goals = [("compute-slow factor=1.5", 10, 1.0), ("compute-slow factor=1.3", 20, 0.9)]
    print()
    for case, within, share in goals:
        for (c, lname), r in rows.items():
            if c != case or not r.runs:
                continue
            hit = sum(1 for s in r.steps if s <= within)
            ok = hit >= share * r.runs
            print(
                f"goal {case} in >= {share:.0%} within {within} steps, {LAYOUT_NAMES[lname]}: "
                f"{hit}/{r.runs} -> {'met' if ok else 'NOT met'}"
            )
    missed = [x for r in rows.values() for x in r.missed]
    wrong = [x for r in rows.values() for x in r.wrong]
    errors = [x for r in rows.values() for x in r.errors]
    for title, items in (("missed", missed), ("wrong-rank verdicts", wrong), ("errors", errors)):
        if items:
            print(f"\n{title}:")
            for x in items:
                print(f"  {x}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
