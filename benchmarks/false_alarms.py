"""False alarms, measured: healthy jobs (fault ``none``) over frameworks and layouts at the
default diagnoser config; every verdict is one too many, unless the rank really was slow.

    python benchmarks/false_alarms.py [--quick] [--loaded] [--set KEY=VALUE]...
        [--frameworks torch,megatron,deepspeed] [--layouts dp8,tp2pp2dp2,...]
        [--runs N] [--steps N] [--keep DIR]

Each run is a real ``ccld demo`` job (in-process, ``run_demo``) in its own folder under a
temporary directory. While it runs, a sampler thread reads every rank's board (op ring)
twice a second and keeps each completed op, so the benchmark has its own per-rank
compute time for every step: the span from the step's first op to the next step's first
op, minus the time blocked in synchronous ops (the agent measures from ``mark_step``; the
shift is the same for every rank of a cohort). A ``slow``/``compute`` verdict counts as
*true* only when these times show the named rank slower than its cohort by
``diagnoser.slow_ratio`` over the steps the verdict judged (the median over those steps of
its compute over the median of its cohort's others in the same step); every other
verdict on a healthy run is *false*. Every false verdict is printed with its evidence
facts.

``--loaded`` runs as many busy processes as there are cores during every run (other work
competing for the CPUs). ``--set`` is passed to the demo (``diagnoser.hang_min_s=3``).
Prints per framework and layout: runs, rank-steps, verdicts, verdicts per 1,000
rank-steps, true/false; then the total.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from ccld_harness.demo import DemoOptions, run_demo
from ccld_plugin.board.reader import BoardError, BoardReader, board_files
from ccld_plugin.config import load_config
from ccld_plugin.diagnose.compute.stragglers import BASELINE_QUANTILE, BASELINE_WINDOWS
from ccld_plugin.diagnose.robust import RecentFloor
from ccld_plugin.diagnose.slow import FIRST_STEP
from ccld_plugin.wire.codes import FLAG_ASYNC, STATE_DONE, STATE_IN_FLIGHT


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


LAYOUTS = {
    "dp8": Layout("DP8", 8, 1, 1),
    "tp2pp2dp2": Layout("TP2xPP2xDP2", 8, 2, 2),
    "tp1pp2dp4": Layout("TP1xPP2xDP4", 8, 1, 2),
    "tp1pp4dp2": Layout("TP1xPP4xDP2 (2-rank cohorts)", 8, 1, 4),
    "tp2pp2": Layout("TP2xPP2 (w4, 2-rank cohorts)", 4, 2, 2),
    "tp1pp2dp2": Layout("TP1xPP2xDP2 (w4, 2-rank cohorts)", 4, 1, 2),
    "dp2": Layout("DP2 (w2, 2-rank cohort)", 2, 1, 1),
    "tp1pp4": Layout("TP1xPP4 (w4, one pipeline)", 4, 1, 4),
    "tp1pp2": Layout("TP1xPP2 (w2, one connection)", 2, 1, 2),
}
# DeepSpeed's example is data parallel only: its layouts are DPn.
FRAMEWORK_LAYOUTS = {
    "torch": ["dp8", "tp2pp2dp2", "tp1pp2dp4", "tp1pp4dp2", "tp2pp2", "tp1pp4", "tp1pp2"],
    "megatron": ["dp8", "tp2pp2dp2", "tp1pp2dp4", "tp1pp4dp2", "tp2pp2", "tp1pp4", "tp1pp2"],
    "deepspeed": ["dp8", "dp2"],
}
# (runs, steps) per framework: full reaches > 10,000 rank-steps with torch alone.
FULL = {"torch": (2, 300), "megatron": (1, 100), "deepspeed": (1, 100)}
QUICK = {"torch": (1, 60), "megatron": (1, 30), "deepspeed": (1, 30)}
QUICK_LAYOUTS = {"torch": ["dp8", "tp2pp2"], "megatron": ["tp2pp2"], "deepspeed": ["dp2"]}


# --------------------------------------------------------------------- load
@contextlib.contextmanager
def busy_load(n: int) -> Iterator[None]:
    """``n`` busy processes competing for the CPUs while the block runs."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


# --------------------------------------------------------------------- op sampler
class OpSampler(threading.Thread):
    """Reads every rank's op ring every ``period_s`` and keeps each op by its ring index,
    so that the whole run's ops are known (a ring of 4096 ops holds a few seconds)."""

    def __init__(self, boards: Path, world: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.boards, self.world, self.period_s = boards, world, period_s
        self.ops: dict[int, dict[int, tuple[int, int, int, bool]]] = defaultdict(dict)
        self.lost: dict[int, int] = defaultdict(int)  # ops overwritten before a read
        self._written: dict[int, int] = {}
        self._floor: dict[int, int] = {}
        self._readers: dict[int, BoardReader] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period_s):
            self.sample()
        self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join()
        for r in self._readers.values():
            with contextlib.suppress(Exception):
                r.close()

    def sample(self) -> None:
        if len(self._readers) < self.world and self.boards.exists():
            for f in board_files(self.boards):
                try:
                    rd = BoardReader(f)
                    rank = rd.header().rank
                except (BoardError, OSError):
                    continue
                if rank in self._readers:
                    rd.close()
                else:
                    self._readers[rank] = rd
        for rank, rd in self._readers.items():
            try:
                written = rd.header().ops_written
                ring = rd.ring_size
                recs = rd.ops()
            except (BoardError, OSError, ValueError):
                continue
            prev = self._written.get(rank, 0)
            if written - prev > ring:
                self.lost[rank] += written - prev - ring
            self._written[rank] = written
            age = ((written & 0xFFFFFFFF) - recs["index_lo"].astype("int64")) % (1 << 32)
            index = written - age
            # Ops below the oldest one in flight at the last read are stored already.
            fresh = index >= self._floor.get(rank, 0)
            done = fresh & (recs["state"] == STATE_DONE)
            flying = fresh & (recs["state"] == STATE_IN_FLIGHT)
            self._floor[rank] = int(index[flying].min()) if flying.any() else written
            mine = self.ops[rank]
            for i, rec in zip(index[done], recs[done], strict=True):
                mine[int(i)] = (
                    int(rec["step"]),
                    int(rec["enter_ns"]),
                    int(rec["exit_ns"]),
                    bool(rec["flags"] & FLAG_ASYNC),
                )

    def compute_us(self) -> dict[int, dict[int, tuple[float, float]]]:
        """Per rank and step: (compute excluding sync ops, compute excluding all ops), in
        microseconds; a step's span runs from its first op to the next step's first op."""
        out: dict[int, dict[int, tuple[float, float]]] = {}
        for rank, ops in self.ops.items():
            by_step: dict[int, list[tuple[int, int, bool]]] = defaultdict(list)
            for step, enter, exit_, is_async in ops.values():
                by_step[step].append((enter, exit_, is_async))
            steps = sorted(by_step)
            starts = {s: min(e for e, _, _ in by_step[s]) for s in steps}
            mine = {}
            for s in steps:
                if s + 1 not in starts:
                    continue
                t0, t1 = starts[s], starts[s + 1]
                sync = _union([(a, b) for a, b, asy in by_step[s] if not asy], t0, t1)
                every = _union([(a, b) for a, b, _ in by_step[s]], t0, t1)
                span = t1 - t0
                mine[s] = ((span - sync) / 1000, (span - every) / 1000)
            out[rank] = mine
        return out


def _union(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    total, end = 0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end, lo), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


# --------------------------------------------------------------------- judging
@dataclass
class Judged:
    verdict: dict
    true: bool | None  # None: the benchmark's own times do not cover the windows
    why: str
    framework: str = ""
    layout: str = ""
    run_dir: str = ""


def judge(v: dict, compute: dict, cfg) -> tuple[bool | None, str]:
    """Whether a verdict on a healthy run is true: the rank's own compute times show it
    slower than its cohort by slow_ratio over the steps the verdict judged (the median,
    over those steps, of its compute over the median of its cohort's others that step:
    the detector's own measure, on the benchmark's times)."""
    if (v["kind"], v["cause"]) != ("slow", "compute"):
        return False, f"{v['kind']}/{v['cause']} on a healthy run"
    change = next((e for e in v["evidence"] if e["fact"] == "compute_change"), None)
    if change is not None and len(v["ranks"]) == 1:
        return judge_change(v["ranks"][0], change["data"], compute, cfg)
    ev = next((e for e in v["evidence"] if e["fact"] == "compute_excess"), None)
    if ev is None or len(v["ranks"]) != 1:
        return False, "no compute_excess evidence"
    r, d = v["ranks"][0], ev["data"]
    cohort = [c for c in d["cohort"] if c != r]
    lo, hi = int(d["first_step"]), int(d["last_step"])
    shown = []
    for which, label in ((0, ""), (1, " excluding async ops too")):
        ratios = []
        for s in range(lo, hi + 1):
            mine = compute.get(r, {}).get(s)
            others = [compute[c][s][which] for c in cohort if s in compute.get(c, {})]
            if mine is not None and others and statistics.median(others) > 0:
                ratios.append(mine[which] / statistics.median(others))
        if len(ratios) * 2 < hi - lo + 1:
            return None, f"own times for {len(ratios)} of steps {lo}-{hi}"
        shown.append((label, statistics.median(ratios)))
    x = shown[0][1]
    text = ", ".join(f"{y:.2f}x{label}" for label, y in shown)
    return x >= cfg.slow_ratio, (
        f"own median per-step compute ratio to cohort {cohort} over steps {lo}-{hi}: "
        f"{text}; needs >= {cfg.slow_ratio}"
    )


def judge_change(r: int, d: dict, compute: dict, cfg) -> tuple[bool | None, str]:
    """A verdict on a rank that no other rank matches in work (a pipeline stage without
    peers), true when its own times show its compute changed slow_ratio more than the
    others' did over the verdict's steps: each step's compute over the rank's baseline
    (the detector's: a low quantile of its sliding window medians before those steps),
    against the same for the others that step, as the detector measures it. Compute
    here leaves out every op: a stage's asynchronous sends and receives (Megatron's
    batched ones) are where it waits for its neighbours, and counted as compute they
    charge a healthy stage with the time a slow neighbour made it wait."""
    lo, hi = int(d["first_step"]), int(d["last_step"])
    w = cfg.window_steps
    base = {}
    for c in d["cohort"]:
        own = compute.get(c, {})
        floor = RecentFloor(BASELINE_QUANTILE, BASELINE_WINDOWS)
        for a in range(FIRST_STEP, lo - w + 1):
            if len(times := [own[s][1] for s in range(a, a + w) if s in own]) == w:
                floor.add(statistics.median(times))
        if not len(floor):
            return None, f"rank {c}: no steps before {lo} for a baseline"
        base[c] = floor.value
    ratios = []
    for s in range(lo, hi + 1):
        others = [compute[c][s][1] / base[c] for c in base if c != r and s in compute[c]]
        if s in compute.get(r, {}) and others and statistics.median(others) > 0:
            ratios.append(compute[r][s][1] / base[r] / statistics.median(others))
    if len(ratios) * 2 < hi - lo + 1:
        return None, f"own times for {len(ratios)} of steps {lo}-{hi}"
    x = statistics.median(ratios)
    return x >= cfg.slow_ratio, (
        f"own median per-step change of compute against ranks {sorted(base)} over steps "
        f"{lo}-{hi}: {x:.2f}x (baseline {base[r] / 1000:.1f} ms); needs >= {cfg.slow_ratio}"
    )


# --------------------------------------------------------------------- runs
@dataclass
class Cell:
    runs: int = 0
    rank_steps: int = 0
    failed: list[str] = field(default_factory=list)
    judged: list[Judged] = field(default_factory=list)
    seconds: float = 0.0


def one_run(
    framework: str, lay: Layout, steps: int, sets: list[str], out: Path, wandb: bool, cfg
) -> tuple[dict, list[Judged], dict, float]:
    overrides = list(sets) if wandb else ["sinks.wandb.enabled=false", *sets]
    # The diagnoser's rounds, for benchmarks/replay_runs.py (with --keep)
    out.mkdir(parents=True, exist_ok=True)
    overrides.append(f"diagnoser.record={out / 'rounds.rec'}")
    opts = DemoOptions(
        framework=framework,
        world=lay.world,
        tp=lay.tp,
        pp=lay.pp,
        steps=steps,
        faults=["none"],
        out=out,
        overrides=overrides,
        timeout_s=max(300.0, steps * 4.0),
    )
    sampler = OpSampler(out / "boards", lay.world)
    sampler.start()
    t0 = time.monotonic()
    try:
        run_demo(opts, Console(quiet=True))
    finally:
        sampler.stop()
    elapsed = time.monotonic() - t0
    summary = json.loads((out / "summary.json").read_text())
    compute = sampler.compute_us()
    (out / "compute.json").write_text(json.dumps(compute))
    judged = []
    for v in summary["verdicts"]:
        ok, why = judge(v, compute, cfg)
        judged.append(Judged(v, ok, why, framework, lay.name, str(out)))
    cover = {
        "lost_ops": dict(sampler.lost),
        "steps_timed": {r: len(c) for r, c in sorted(compute.items())},
    }
    return summary, judged, cover, elapsed


def show_verdict(j: Judged) -> None:
    v = j.verdict
    group = v.get("group") or {}
    tag = {True: "TRUE", False: "FALSE", None: "UNJUDGED"}[j.true]
    print(
        f"  [{tag}] {j.framework} {j.layout}: {v['kind']}/{v['cause']} ranks {v['ranks']} "
        f"group {group.get('role')}{group.get('ranks')} link {v.get('link')} step {v.get('step')} "
        f"ratio {v.get('ratio')} stuck {v.get('stuck_s')} s detected {v.get('detected_s')} s  "
        f"({j.run_dir})"
    )
    print(f"      judged: {j.why}")
    for e in v["evidence"]:
        print(f"      - {e['fact']}: {e['text']}")
        print(f"        data {json.dumps(e['data'])}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few minutes: one short run each")
    p.add_argument("--loaded", action="store_true", help="busy processes on every core")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="with --loaded")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets")
    p.add_argument("--frameworks", default="torch,megatron,deepspeed")
    p.add_argument("--layouts", help=f"comma-separated of {','.join(LAYOUTS)} (default: all)")
    p.add_argument("--runs", type=int, help="runs per layout (default: per framework)")
    p.add_argument("--steps", type=int, help="steps per run (default: per framework)")
    p.add_argument("--wandb", action="store_true", help="keep the demo's offline W&B run")
    p.add_argument("--keep", type=Path, help="keep every run's folder under DIR")
    args = p.parse_args()
    cfg = load_config(None, args.sets).diagnoser
    plan = QUICK if args.quick else FULL
    root = args.keep or Path(tempfile.mkdtemp(prefix="ccld-false-alarms-"))
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"false alarms: healthy runs, diagnoser slow_ratio={cfg.slow_ratio} "
        f"window_steps={cfg.window_steps} confirm_windows={cfg.confirm_windows} "
        f"hang_min_s={cfg.hang_min_s}, --set {args.sets or 'none'}, "
        f"{'loaded: ' + str(args.busy) + ' busy processes' if args.loaded else 'unloaded'}; "
        f"runs in {root}",
        flush=True,
    )
    cells: dict[tuple[str, str], Cell] = {}
    load = busy_load(args.busy) if args.loaded else contextlib.nullcontext()
    with load:
        for fw in args.frameworks.split(","):
            runs, steps = plan[fw]
            runs, steps = args.runs or runs, args.steps or steps
            names = FRAMEWORK_LAYOUTS[fw] if not args.quick else QUICK_LAYOUTS[fw]
            if args.layouts:
                names = [n for n in args.layouts.split(",") if n in FRAMEWORK_LAYOUTS[fw]]
            for name in names:
                lay = LAYOUTS[name]
                cell = cells.setdefault((fw, lay.name), Cell())
                for i in range(runs):
                    out = root / f"{fw}-{name}-{i}"
                    try:
                        summary, judged, cover, secs = one_run(
                            fw, lay, steps, args.sets, out, args.wandb, cfg
                        )
                    except Exception as exc:  # noqa: BLE001 - report, go on
                        cell.failed.append(f"run {i}: {type(exc).__name__}: {exc}")
                        print(f"{fw} {lay.name} run {i + 1}: ERROR {exc}", flush=True)
                        continue
                    cell.runs += 1
                    cell.seconds += secs
                    done = summary["steps_completed"]
                    cell.rank_steps += done * lay.world
                    cell.judged += judged
                    if summary.get("failure") and not summary["verdicts"]:
                        cell.failed.append(f"run {i}: {summary['failure']}")
                    print(
                        f"{fw} {lay.name} run {i + 1}/{runs}: {done}/{steps} steps, "
                        f"{len(judged)} verdict(s), {secs:.0f} s, ops lost before a read "
                        f"{sum(cover['lost_ops'].values())}"
                        + (f", failure: {summary['failure']}" if summary.get("failure") else ""),
                        flush=True,
                    )
                    for j in judged:
                        show_verdict(j)
                    if not judged and args.keep is None:
                        shutil.rmtree(out, ignore_errors=True)

    print()
    hdr = (
        f"{'framework':<10} {'layout':<34} {'runs':>4} {'rank-steps':>10} {'verdicts':>8} "
        f"{'per 1k':>7} {'true':>4} {'false':>5} {'unjudged':>8} {'s/run':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    total = Cell()
    for (fw, name), c in cells.items():
        n = len(c.judged)
        t = sum(1 for j in c.judged if j.true is True)
        f = sum(1 for j in c.judged if j.true is False)
        u = n - t - f
        per = 1000 * n / c.rank_steps if c.rank_steps else float("nan")
        print(
            f"{fw:<10} {name:<34} {c.runs:>4} {c.rank_steps:>10} {n:>8} {per:>7.3f} {t:>4} "
            f"{f:>5} {u:>8} {c.seconds / max(c.runs, 1):>6.0f}"
        )
        total.runs += c.runs
        total.rank_steps += c.rank_steps
        total.judged += c.judged
        total.failed += [f"{fw} {name} {x}" for x in c.failed]
    n = len(total.judged)
    t = sum(1 for j in total.judged if j.true is True)
    f = sum(1 for j in total.judged if j.true is False)
    per = 1000 * n / total.rank_steps if total.rank_steps else float("nan")
    print("-" * len(hdr))
    print(
        f"{'total':<10} {'':<34} {total.runs:>4} {total.rank_steps:>10} {n:>8} {per:>7.3f} "
        f"{t:>4} {f:>5} {n - t - f:>8}"
    )
    false = [j for j in total.judged if j.true is not True]
    if false:
        print("\nverdicts not shown true by the benchmark's own times:")
        for j in false:
            show_verdict(j)
    if total.failed:
        print("\nruns that failed (besides their verdicts):")
        for x in total.failed:
            print(f"  {x}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
