"""Tracer overhead per call, measured side by side in one run; and the plugin's own CPU time.

A 4-byte all_reduce and a 4-byte broadcast on a 1-rank and a 2-rank gloo group, and a
functional (DTensor's) all_reduce with the wait on its result on the 2-rank group, called
through the original function and through the tracer's wrapper in interleaved short
batches (with, without, with, ...). The figure that counts is the median of the paired
differences: a whole call varies by +-10 us from one batch to the next, more than the
wrapper costs. The wrapper alone is also timed around a no-op collective, which resolves
tenths of a microsecond. The same for a device op, on the simulated device (ccld_harness
.simdev: its collectives return at once, as NCCL's do): a blocking and an async all_reduce
on a 2-rank group (the device drained between batches, so that its launch queue never
blocks the host), and the wrapper alone around a no-op device collective, which records
the device timeline's two events per op.

    python benchmarks/hook_overhead.py [--batches 200] [--calls 50]

``--cpu-steps N`` measures instead the CPU time of the plugin's own threads (agent,
poller, diagnoser, its lease, the W&B sink's) and of the W&B writer process (and the
processes it starts), from their CPU clocks, per second of training: 4 ranks train the
demo workload (TP2 x PP2; ``--device sim``: on the simulated device) for N steps with
the diagnoser on rank 0 and an offline W&B run.

    python benchmarks/hook_overhead.py --cpu-steps 600 [--device sim]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
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


def _paired_device(orig, traced, batches: int, calls: int, *args, **kwargs) -> tuple[float, ...]:
    """``_paired`` with the simulated device drained between batches (untimed)."""
    from ccld_harness.simdev.device import SimDevice

    device = SimDevice.get()
    base, with_tracer = [], []
    for i in range(batches):
        for fn in (orig, traced) if i % 2 == 0 else (traced, orig):
            (base if fn is orig else with_tracer).append(_batch(fn, calls, *args, **kwargs))
            device.synchronize()
    diffs = [w - b for w, b in zip(with_tracer, base, strict=True)]
    return statistics.median(base), statistics.median(with_tracer), statistics.median(diffs)


class _Done:
    """The work of a no-op device collective: complete at once."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def _get_duration(self):
        return 0.0


def _device_rows(tracer, sim_pair, args) -> list[tuple]:
    """Rows for a device op on the simulated device: through the original and the wrapper."""
    rows = []
    t = torch.zeros(1)
    orig, wrapped = tracer._originals["all_reduce"], tracer._wrappers["all_reduce"]
    blocking = dict(group=sim_pair)
    rows.append(
        (
            "all_reduce 4 B, sim device, 2-rank",
            *_paired_device(orig, wrapped, args.batches, args.calls, t, **blocking),
        )
    )

    def async_wait(fn):
        return lambda tensor, group: fn(tensor, group=group, async_op=True).wait()

    rows.append(
        (
            "async all_reduce + wait, sim device",
            *_paired_device(
                async_wait(orig), async_wait(wrapped), args.batches, args.calls, t, sim_pair
            ),
        )
    )

    def noop(tensor, op=None, group=None, async_op=False):
        return _Done()

    traced_noop = tracer._wrap_collective("all_reduce", noop)
    rows.append(
        (
            "wrapper alone (no-op device collective)",
            *_paired_device(noop, traced_noop, args.batches, args.calls * 5, t, group=sim_pair),
        )
    )
    return rows


def _two_records_us(batches: int, calls: int) -> float:
    """What the device itself charges of the wrapper: two event records (the simulated
    device's, a queue put each), median per op over batches."""
    from ccld_harness.simdev.device import SimDevice

    device = SimDevice.get()
    events = [device.event() for _ in range(2 * calls)]
    times = []
    for _ in range(batches):
        times.append(_batch(lambda: [e.record() for e in events], 1) / calls)
        device.synchronize()
    return statistics.median(times)


def rank_main(args: argparse.Namespace) -> None:
    import ccld_plugin
    from ccld_harness.simdev.backend import close_groups, register
    from ccld_plugin.services.session import current

    register()  # the simulated device: a backend and a device the plugin reads
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    solo = [dist.new_group([r]) for r in range(2)][rank]
    pair = dist.new_group([0, 1])
    sim_pair = dist.new_group([0, 1], backend="sim")
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
    rows += _device_rows(tracer, sim_pair, args)
    records_us = _two_records_us(args.batches, args.calls * 5)
    skipped = tracer.timeline.skipped if tracer.timeline is not None else 0
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
            f"median of paired differences; device ops left untimed, no event free: {skipped})"
        )
        print(
            "of a device op's added time, its two event records (the device's): "
            f"{records_us:.2f} us"
        )
    ccld_plugin.disable()
    close_groups()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the plugin's CPU time
def _descendants(pid: int) -> list[int]:
    """The processes started by ``pid`` (the W&B writer and what it starts), alive now."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process (its clock ticks: 10 ms here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plugin_cpu_s() -> dict[str, float]:
    """CPU seconds so far of the plugin's threads in this process (by name, from their
    thread CPU clocks) and of the processes it started (the W&B writer's)."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.name.startswith("ccld-") and t.ident is not None:
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):
                continue  # ended meanwhile
            out[t.name] = out.get(t.name, 0.0) + cpu
    out["W&B writer processes"] = sum(_process_cpu_s(p) for p in _descendants(os.getpid()))
    return out


def cpu_main(args: argparse.Namespace) -> None:
    """One rank: train the demo workload for ``--cpu-steps`` steps with the plugin on, and
    print its threads' CPU time over the training, per second of it."""
    import json

    import ccld_plugin

    rank = int(os.environ["RANK"])
    overrides = [
        f"board.dir={args.board_dir}",
        "sinks.console=false",
        "sinks.wandb.enabled=true",
        f"sinks.wandb.dir={args.board_dir}/wandb",
    ]
    if args.device == "sim":
        from ccld_harness.simdev import training
        from ccld_harness.simdev.backend import close_groups, register
        from ccld_harness.simdev.device import SimClock, SimDevice

        SimDevice._instance = SimDevice(SimClock(offset_ns=(rank + 1) * 7_919_000_123_457))
        register()
        ccld_plugin.enable(overrides=overrides)
        dist.init_process_group("sim")
        cfg = training.SimConfig(tp=2, pp=2, steps=args.cpu_steps)
        train = training.train
    else:
        from ccld_harness import workload

        ccld_plugin.enable(overrides=overrides)
        dist.init_process_group("gloo")
        cfg = workload.WorkloadConfig(tp=2, pp=2, steps=args.cpu_steps)
        train = workload.train
    before = plugin_cpu_s()
    t0 = time.monotonic()
    train(cfg)
    wall = time.monotonic() - t0
    after = plugin_cpu_s()
    used = {k: round(v - before.get(k, 0.0), 4) for k, v in after.items()}
    print("cpu " + json.dumps({"rank": rank, "wall_s": round(wall, 2), "cpu_s": used}))
    dist.barrier()
    ccld_plugin.disable()
    if args.device == "sim":
        close_groups()
    dist.destroy_process_group()


def _cpu_table(logs: list[str]) -> None:
    import json

    reports = [
        json.loads(line[4:]) for log in logs for line in log.splitlines() if line.startswith("cpu ")
    ]
    print(f"{'rank':>4s} {'training s':>10s} {'plugin CPU s':>12s} {'% of a core':>11s}  by part")
    for r in sorted(reports, key=lambda r: r["rank"]):
        total = sum(r["cpu_s"].values())
        parts = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in sorted(r["cpu_s"].items()) if v)
        print(
            f"{r['rank']:4d} {r['wall_s']:10.1f} {total:12.3f} "
            f"{100 * total / r['wall_s']:10.2f}%  {parts}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--board-dir", default="")
    p.add_argument("--cpu-steps", type=int, default=0, help="measure the plugin's CPU time")
    p.add_argument("--device", choices=["cpu", "sim"], default="cpu")
    args = p.parse_args()
    if "RANK" in os.environ:
        (cpu_main if args.cpu_steps else rank_main)(args)
        return 0
    from ccld_harness.launch import LocalJob

    with tempfile.TemporaryDirectory() as tmp:
        own = ["--batches", str(args.batches), "--calls", str(args.calls)]
        if args.cpu_steps:
            own = ["--cpu-steps", str(args.cpu_steps), "--device", args.device]
        world = 4 if args.cpu_steps else 2
        job = LocalJob(
            world=world,
            argv=[__file__, *own, "--board-dir", tmp],
            log_dir=Path(tmp) / "logs",
        )
        job.start()
        ok = job.wait(600)
        codes = job.stop()
        if args.cpu_steps:
            logs = [(Path(tmp) / "logs" / f"rank{r}.log").read_text() for r in range(world)]
            _cpu_table(logs)
            return 0 if ok and not any(codes) else 1
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
