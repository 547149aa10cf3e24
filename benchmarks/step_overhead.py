"""Step overhead of a real job: the Megatron and DeepSpeed examples with ccld off and on.

Each framework runs in rounds of three jobs, ``off_a, on, off_b``: the same example, the
same seed and arguments, ccld off / on (default config, sinks on: console, JSONL and W&B
offline) / off. The step time is what the examples print per step, timed by the example
around its train step in both modes (Megatron: the ``iteration i/N | ... | X ms`` line of
the last stage; DeepSpeed: the ``step i/N | ... | X ms`` line of rank 0); the first
``--warmup`` steps of every job are dropped.

Two ratios per framework, side by side:

- ``on/off``: median step time of the on jobs over that of the off jobs (both off
  arms): the overhead;
- ``off_b/off_a``: the same statistic between the two off arms: the noise band. Since
  off_a and off_b bracket every on job, a drift of the machine over a round moves this
  ratio and not the first.

The 95% intervals come from a bootstrap over jobs (jobs resampled within each arm, the
median of the pooled step times recomputed). An overhead is resolved only where the
on/off interval is narrower than what is claimed; the bound the runs support is the
upper end of the on/off interval.

    python benchmarks/step_overhead.py [--rounds 4] [--frameworks megatron deepspeed]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ccld_harness.launch import LocalJob

REPO = Path(__file__).resolve().parents[1]
MEGATRON = REPO / "examples" / "megatron" / "pretrain_gpt.py"
DEEPSPEED = REPO / "examples" / "deepspeed" / "train.py"
ENV = {
    "CUDA_VISIBLE_DEVICES": "",
    "TORCHDYNAMO_DISABLE": "1",
    "DS_ACCELERATOR": "cpu",
    "PYTHONWARNINGS": "ignore",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
}
STEP_MS = {
    "megatron": re.compile(r"^iteration \d+/\d+ \|.*\| ([0-9.]+) ms$", re.M),
    "deepspeed": re.compile(r"^step \d+/\d+ \|.*\| ([0-9.]+) ms$", re.M),
}
ARMS = ("off_a", "on", "off_b")
GOAL = 0.005  # the step-overhead goal: 0.5%


@dataclass
class Arm:
    """The step times of one arm's jobs, one list per job (warm-up dropped)."""

    jobs: list[list[float]]

    def median(self) -> float:
        return statistics.median(t for job in self.jobs for t in job)

    def resampled_median(self, rng: random.Random) -> float:
        picked = rng.choices(self.jobs, k=len(self.jobs))
        return statistics.median(t for job in picked for t in job)


def _argv(framework: str, on: bool, out: Path, steps: int, world: int) -> list[str]:
    if framework == "megatron":
        argv = [
            str(MEGATRON),
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            str(world // 2),
            "--train-iters",
            str(steps),
        ]
        plugin = ["--ccld"] if on else []
        set_flag = "--ccld-set"
    else:
        argv = [str(DEEPSPEED), "--steps", str(steps)]
        # The example's ds_config.json has the plugin on: off is its documented switch.
        plugin = [] if on else ["--ccld-set", "enabled=false"]
        set_flag = "--ccld-set"
    if on:
        for kv in (
            f"board.dir={out / 'boards'}",
            f"sinks.jsonl={out / 'verdicts.jsonl'}",
            "sinks.console=true",
            "sinks.wandb.enabled=true",
            f"sinks.wandb.dir={out / 'wandb'}",
        ):
            plugin += [set_flag, kv]
    return argv + plugin


def run_job(
    framework: str, on: bool, out: Path, steps: int, world: int, warmup: int
) -> list[float]:
    """One job; the step times (ms) it printed after the warm-up."""
    job = LocalJob(
        world=world, argv=_argv(framework, on, out, steps, world), log_dir=out / "logs", env=ENV
    )
    job.start()
    finished = job.wait(600)
    codes = job.stop()
    logs = [(out / "logs" / f"rank{r}.log").read_text(errors="replace") for r in range(world)]
    times = [float(ms) for log in logs for ms in STEP_MS[framework].findall(log)]
    if not finished or any(codes) or len(times) != steps:
        tail = "\n".join(f"--- rank {r}\n{log[-1500:]}" for r, log in enumerate(logs))
        raise RuntimeError(
            f"{framework} job (ccld {'on' if on else 'off'}) failed: {codes}\n{tail}"
        )
    # The W&B sink's run folder shows that the plugin (and its sinks) ran in an on job only.
    if (out / "wandb").is_dir() != on:
        raise RuntimeError(f"{framework} job: ccld {'on' if on else 'off'}, but W&B dir {out}")
    return times[warmup:]


def ratio_interval(
    num: Arm, den: Arm, rng: random.Random, draws: int
) -> tuple[float, float, float]:
    """The ratio of medians and its 95% bootstrap interval over jobs."""
    ratios = sorted(num.resampled_median(rng) / den.resampled_median(rng) for _ in range(draws))
    return num.median() / den.median(), ratios[int(0.025 * draws)], ratios[int(0.975 * draws)]


def measure(args: argparse.Namespace, framework: str, tmp: Path) -> dict[str, Arm]:
    arms: dict[str, Arm] = {name: Arm([]) for name in ARMS}
    for rnd in range(args.rounds):
        for name in ARMS:
            out = tmp / f"{framework}-{rnd}-{name}"
            t0 = time.monotonic()
            times = run_job(
                framework, name == "on", out, args.steps[framework], args.world, args.warmup
            )
            arms[name].jobs.append(times)
            print(
                f"  {framework:9s} round {rnd + 1}/{args.rounds} {name:5s} "
                f"median {statistics.median(times):8.2f} ms  ({time.monotonic() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return arms


def report(results: dict[str, dict[str, Arm]], args: argparse.Namespace) -> None:
    rng = random.Random(0)
    verdicts = []
    print(
        f"{'framework':10s} {'off ms':>8s} {'on ms':>8s} {'on/off':>7s} {'95% interval':>16s}"
        f" {'off_b/off_a':>11s} {'95% interval':>16s}  per-round on/off | off_b/off_a"
    )
    for framework, arms in results.items():
        off = Arm(arms["off_a"].jobs + arms["off_b"].jobs)
        r, lo, hi = ratio_interval(arms["on"], off, rng, args.draws)
        n, nlo, nhi = ratio_interval(arms["off_b"], arms["off_a"], rng, args.draws)
        rounds = " ".join(
            f"{statistics.median(on) / statistics.median(a + b):.3f}|"
            f"{statistics.median(b) / statistics.median(a):.3f}"
            for a, on, b in zip(
                arms["off_a"].jobs, arms["on"].jobs, arms["off_b"].jobs, strict=True
            )
        )
        print(
            f"{framework:10s} {off.median():8.2f} {arms['on'].median():8.2f} {r:7.4f}"
            f" [{lo:6.4f}, {hi:6.4f}] {n:11.4f} [{nlo:6.4f}, {nhi:6.4f}]  {rounds}"
        )
        band = max(1 - nlo, nhi - 1)
        verdicts.append(
            f"{framework}: overhead {r - 1:+.1%}, at most {hi - 1:+.1%} (95%); off-vs-off band "
            f"+-{band:.1%}, so these runs {'can' if band <= GOAL else 'cannot'} resolve "
            f"the {GOAL:.1%} goal"
        )
    print(
        f"({args.rounds} rounds of off_a, on, off_b per framework, {args.world} ranks, steps a "
        f"job: {', '.join(f'{k} {v}' for k, v in args.steps.items())}, first {args.warmup} "
        f"dropped; intervals: {args.draws} "
        "bootstrap draws over jobs; on = default config, sinks console + jsonl + W&B offline)"
    )
    print("\n".join(verdicts))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--frameworks", nargs="+", choices=sorted(STEP_MS), default=["megatron", "deepspeed"]
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--megatron-steps", type=int, default=40)
    p.add_argument("--deepspeed-steps", type=int, default=200, help="its steps are ~25 ms")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--world", type=int, choices=(2, 4), default=4)
    p.add_argument("--draws", type=int, default=2000)
    args = p.parse_args(argv)
    args.steps = {"megatron": args.megatron_steps, "deepspeed": args.deepspeed_steps}
    if args.warmup >= min(args.steps.values()):
        p.error("--warmup must be below the steps of a job")
    results: dict[str, dict[str, Arm]] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ccld-step-overhead-") as tmp:
        for framework in args.frameworks:
            results[framework] = measure(args, framework, Path(tmp))
    report(results, args)
    # The host's load says how far the noise band is the machine's and not the job's.
    print(f"(1-minute load average: {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
