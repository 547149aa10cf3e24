"""Tracer overhead per call, measured side by side in one run.

A 4-byte all_reduce and a 4-byte broadcast on a 1-rank and a 2-rank gloo group, and a
functional (DTensor's) all_reduce with the wait on its result on the 2-rank group, called
through the original function and through the tracer's wrapper in interleaved short
batches (with, without, with, ...). The figure that counts is the median of the paired
differences: a whole call varies by +-10 us from one batch to the next, more than the
wrapper costs. The wrapper alone is also timed around a no-op collective, which resolves
tenths of a microsecond.

    python benchmarks/hook_overhead.py [--batches 200] [--calls 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _batch(fn, calls: int, *args, **kwargs) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn(*args, **kwargs)
    return (time.perf_counter_ns() - t0) / calls / 1000.0


def _paired(orig, traced, batches: int, calls: int, *args, **kwargs) -> tuple[float, ...]:
    base, with_tracer = [], []
    for i in range(batches):
        first, second = (orig, traced) if i % 2 == 0 else (traced, orig)
        a = _batch(first, calls, *args, **kwargs)
        b = _batch(second, calls, *args, **kwargs)
        (base if first is orig else with_tracer).append(a)
        (with_tracer if second is traced else base).append(b)
    diffs = [w - b for w, b in zip(with_tracer, base, strict=True)]
    return statistics.median(base), statistics.median(with_tracer), statistics.median(diffs)


def rank_main(args: argparse.Namespace) -> None:
    import ccld_plugin
    from ccld_plugin.services.session import current

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    solo = [dist.new_group([r]) for r in range(2)][rank]
    pair = dist.new_group([0, 1])
    ccld_plugin.enable(overrides=[f"board.dir={args.board_dir}"])
    ccld_plugin.mark_step(0)  # as a training loop does: blocking ops then read schedstat
    tracer = current().tracer
    t = torch.zeros(1)
    rows = []
    for name, extra in (("all_reduce", {}), ("broadcast", {"src": 0})):
        orig, wrapped = tracer._originals[name], tracer._wrappers[name]
        for label, group in (("1-rank", solo), ("2-rank", pair)):
            kwargs = dict(extra, group=group)
            if label == "1-rank" and name == "broadcast":
                kwargs["src"] = rank
            _batch(orig, 100, t, **kwargs)  # warm up
            rows.append(
                (
                    f"{name} 4 B, {label} group",
                    *_paired(orig, wrapped, args.batches, args.calls, t, **kwargs),
                )
            )

    # A functional all-reduce (DTensor's) and the wait on its result, on the pair.
    originals, ns = tracer._functional._originals, torch.ops._c10d_functional

    def functional_untraced(tensor, group):
        out = originals["all_reduce"](tensor, "sum", group.group_name)
        return originals["wait_tensor"](out)

    def functional_traced(tensor, group):
        return ns.wait_tensor(ns.all_reduce(tensor, "sum", group.group_name))

    functional_traced(t, pair)  # warm up
    rows.append(
        (
            "functional all_reduce + wait 4 B, 2-rank",
            *_paired(functional_untraced, functional_traced, args.batches, args.calls, t, pair),
        )
    )

    def noop(tensor, op=None, group=None, async_op=False):
        return None

    traced_noop = tracer._wrap_collective("all_reduce", noop)
    rows.append(
        (
            "wrapper alone (no-op collective)",
            *_paired(noop, traced_noop, args.batches, args.calls * 20, t, group=pair),
        )
    )
    dist.barrier()
    if rank == 0:
        print(
            f"{'call':40s} {'untraced us':>12s} {'traced us':>10s} {'added us':>9s} {'ratio':>6s}"
        )
        for label, base, traced, added in rows:
            ratio = traced / base if base > 0 else float("nan")
            print(f"{label:40s} {base:12.2f} {traced:10.2f} {added:9.2f} {ratio:6.3f}")
        print(
            f"({args.batches} interleaved batch pairs of {args.calls} calls; 'added' is the "
            "median of paired differences)"
        )
    ccld_plugin.disable()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--board-dir", default="")
    args = p.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return 0
    from ccld_harness.launch import LocalJob

    with tempfile.TemporaryDirectory() as tmp:
        job = LocalJob(
            world=2,
            argv=[
                __file__,
                "--batches",
                str(args.batches),
                "--calls",
                str(args.calls),
                "--board-dir",
                tmp,
            ],
            log_dir=Path(tmp) / "logs",
        )
        job.start()
        ok = job.wait(600)
        codes = job.stop()
        log = (Path(tmp) / "logs" / "rank0.log").read_text()
        print(
            "\n".join(
                line
                for line in log.splitlines()
                if "Warning" not in line and "return func" not in line
            )
        )
        if not ok or any(codes):
            print((Path(tmp) / "logs" / "rank1.log").read_text(), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
