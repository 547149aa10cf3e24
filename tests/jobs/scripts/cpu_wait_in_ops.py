"""Rank 0 shares its core with a busy process and, in a step after one that queued for a
CPU, computes inside a blocking communication block, then outside any: prints, for each
stretch, its whole wait for a CPU and the part the tracer leaves to compute
(``cpu_wait_outside_ns``)."""

import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import ccld_plugin
from ccld_plugin.services.session import current
from ccld_plugin.tracing.cpu_wait import ThreadCpuWait

BUSY_S = 0.5

dist.init_process_group("gloo")
rank = dist.get_rank()
ccld_plugin.enable(overrides=[f"board.dir={os.environ['BOARD_DIR']}", "job=j"])
tracer = current().tracer


def busy() -> None:
    if rank == 0:
        end = time.monotonic() + BUSY_S
        while time.monotonic() < end:
            pass


def in_a_blocking_op() -> None:
    # a synchronous coalesced block is one op from its start to its end
    with c10d._coalescing_manager():
        dist.all_reduce(torch.ones(4))
        busy()


def measured(body) -> dict:
    mine = ThreadCpuWait()
    total, outside = mine.ns(), tracer.cpu_wait_outside_ns()
    body()
    return {"total_ns": mine.ns() - total, "outside_ns": tracer.cpu_wait_outside_ns() - outside}


rival = None
if rank == 0:
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})  # this thread only
    spin = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    rival = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.3)  # the rival is up and spinning
ccld_plugin.mark_step(0)  # follows this thread from here
busy()
ccld_plugin.mark_step(1)  # step 0 queued for a CPU: blocking ops read the wait around them
try:
    got = {"inside": measured(in_a_blocking_op), "outside": measured(busy)}
finally:
    if rival is not None:
        rival.kill()
        rival.wait()
dist.barrier()
if rank == 0:
    print("CPU_WAIT " + json.dumps({**got, "busy_ns": int(BUSY_S * 1e9)}), flush=True)
dist.destroy_process_group()
