"""The same compute-slow fault, seen by DeepSpeed's comms logger and by ccld, side by side.

Two real 4-rank DeepSpeed ZeRO-2 runs of examples/deepspeed/train.py on this machine, with
``compute-slow@1:factor=2,step=3``:

1. plugin off, DeepSpeed's comms logger on, its straggler summary printed every N steps
   (``deepspeed.comm.log_summary(show_straggler=True)``; it barriers, so every rank calls it);
2. plugin on (through the demo's launcher).

Prints what each reports and when (steps and seconds after the fault's onset).

    python benchmarks/vs_deepspeed_commslogger.py [--steps 40] [--every 10]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console

from ccld_harness.demo import DemoOptions, run_demo
from ccld_harness.frameworks import example_script
from ccld_harness.launch import LocalJob

FAULT = "compute-slow@1:factor=2,step=3"


def run_comms_logger(out: Path, steps: int, every: int) -> dict:
    job = LocalJob(
        world=4,
        argv=[
            str(example_script("deepspeed")),
            "--zero-stage",
            "2",
            "--steps",
            str(steps),
            "--hidden",
            "512",
            "--comms-logger-every",
            str(every),
            "--ccld-set",
            "enabled=false",
        ],
        log_dir=out / "logs",
        env={
            "CCLD_FAULTS": FAULT,
            "DS_ACCELERATOR": "cpu",
            "CCLD_FAULT_LOG": str(out / "faults.jsonl"),
        },
    )
    job.start()
    job.wait(600)
    job.stop()
    log = (out / "logs" / "rank0.log").read_text()
    onset = json.loads((out / "faults.jsonl").read_text().splitlines()[0])
    reports = []
    for block in log.split("COMMSLOG ")[1:]:
        head, _, body = block.partition("\n")
        mark = json.loads(head)
        # The straggler table: from its title to the next step line.
        table = body.split("Breakdown with straggler effect", 1)[-1].splitlines()
        lines = [ln for ln in table if ln.strip() and not ln.startswith(("step ", "[", "W"))][:10]
        reports.append(
            {
                "step": mark["step"],
                "after_onset_s": round(mark["wall_time"] - onset["wall_time"], 2),
                "lines": lines,
            }
        )
    return {"onset_step": onset["step"], "reports": reports}


def run_ccld(out: Path, steps: int) -> dict:
    opts = DemoOptions(
        framework="deepspeed",
        world=4,
        steps=steps,
        faults=[FAULT],
        out=out,
        overrides=["agent.interval_s=0.5"],
        zero_stage=2,
    )
    run_demo(opts, Console(quiet=True))
    summary = json.loads((out / "summary.json").read_text())
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = run_comms_logger(Path(tmp) / "ds", args.steps, args.every)
        ours = run_ccld(Path(tmp) / "ccld", args.steps)
    print(f"fault: {FAULT} (onset at step {base['onset_step']})\n")
    print(
        "DeepSpeed comms logger (straggler summary every "
        f"{args.every} steps; it names op types, not ranks):"
    )
    for r in base["reports"]:
        print(
            f"  step {r['step']} ({r['step'] - base['onset_step']} steps, "
            f"{r['after_onset_s']} s after onset):"
        )
        for line in r["lines"]:
            print(f"    {line.strip()}")
    print("\nccld:")
    for v, m in zip(ours["verdicts"], ours["latency_s"], strict=False):
        print(
            f"  {v['kind']} {v['cause']}-bound, ranks {v['ranks']} in {v['group']['role']}"
            f"{v['group']['ranks']}, {v['ratio']}x slower, at step {v['step']} "
            f"({m['steps_to_verdict']} steps, {m['latency_s']} s after onset)"
        )
        for e in v["evidence"]:
            print(f"    - {e['text']}")
    if not ours["verdicts"]:
        print("  no verdict")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
