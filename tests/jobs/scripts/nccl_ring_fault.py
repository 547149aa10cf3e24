"""A real gloo job in which ranks 1..world-1 also run one NCCL-shaped ring all-reduce.

There is no GPU or NCCL here, so NCCL's side is played by tests/nccl_harness.c built as a
library: it raises the profiler events that NCCL would raise, through the plugin that this
process has loaded (the one ``ccld_plugin`` links, so the events reach this rank's board).
The all-reduce is entered on the board as the tracer enters a real NCCL collective, on
the thread that then raises the Coll event. Everything downstream is the product as it
runs: agent, control plane, diagnoser on rank 0, JSONL sink.

usage: nccl_ring_fault.py HARNESS_LIB FAULT WHERE OUT_DIR
  FAULT 0 none (the all-reduce completes), 1 gpu, 2 credit, 3 link (nccl_harness.c);
  WHERE the comm rank of the ring (global rank WHERE+1) where the fault is.
"""

import ctypes
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ccld_plugin
from ccld_plugin.sinks.jsonl import read_verdicts
from ccld_plugin.tracing.nccl_env import nccl_plugin_path
from ccld_plugin.wire.codes import FLAG_ASYNC, FLAG_CUDA, OP_CODES, STATE_DONE

HEALTHY_STEPS = 8
HOLD_S = 25.0  # how long the ranks wait for a verdict before they give up
QUIET_S = 8.0  # with no fault: how long the job runs on after the all-reduce

lib, fault, where, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
verdicts_file = out / "verdicts.jsonl"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
session = ccld_plugin.enable(
    overrides=[
        f"board.dir={out / 'boards'}",
        "job=nccl-ring",
        "diagnoser.hang_min_s=3",
        "agent.interval_s=0.5",
        "agent.stack_after_s=1",
        f"sinks.jsonl={verdicts_file}",
        "sinks.console=false",
    ]
)
assert session is not None
ring_ranks = list(range(1, world))
ring = dist.new_group(ring_ranks)
ccld_plugin.register_group(ring, "dp")

t = torch.ones(4)
for step in range(HEALTHY_STEPS):  # op durations for the adaptive hang threshold
    ccld_plugin.mark_step(step)
    dist.all_reduce(t)
    if rank in ring_ranks:
        dist.all_reduce(t, group=ring)
    time.sleep(0.05)
ccld_plugin.mark_step(HEALTHY_STEPS)

if rank in ring_ranks:
    harness = ctypes.CDLL(lib)
    harness.ccld_harness_ring.argtypes = [
        ctypes.c_char_p,
        ctypes.c_uint64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    entry = session.tracer.entry(ring)
    index = session.board.enter(entry.slot, OP_CODES["all_reduce"], FLAG_CUDA | FLAG_ASYNC, 1 << 24)
    bad = harness.ccld_harness_ring(
        nccl_plugin_path().encode(), 0xC0FFEE, len(ring_ranks), ring_ranks.index(rank), fault, where
    )
    print("HARNESS " + json.dumps({"bad_returns": bad}), flush=True)
    if fault == 0:  # the collective completed: its work is done
        session.board.exit(index, STATE_DONE)

deadline = time.monotonic() + (QUIET_S if fault == 0 else HOLD_S)
while time.monotonic() < deadline and not read_verdicts(verdicts_file):
    time.sleep(0.2)
time.sleep(1.0)  # every rank sees the verdict before any leaves
ccld_plugin.disable()
