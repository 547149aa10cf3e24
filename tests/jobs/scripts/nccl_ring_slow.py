"""A real 4-rank gloo job whose ranks also run an NCCL-shaped ring all-reduce every step,
through the NCCL profiler plugin (NCCL's side played by tests/nccl_harness.c as a library,
as in nccl_ring_fault.py). From step ONSET on, the send steps of one rank spend SLOW_US
each handed to the network instead of FAST_US: its link to the next rank is slow. The
product runs as it ships (agent, control plane, diagnoser on rank 0, JSONL sink).

usage: nccl_ring_slow.py HARNESS_LIB SLOW_RANK OUT_DIR   (SLOW_RANK -1: no fault)
"""

import ctypes
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ccld_plugin
from ccld_plugin.tracing.nccl_env import nccl_plugin_path
from ccld_plugin.wire.codes import FLAG_CUDA, OP_CODES, STATE_DONE

STEPS, ONSET = 40, 5
FAST_US, SLOW_US = 200, 5000
COMPUTE_S = 0.15

lib, slow_rank, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
session = ccld_plugin.enable(
    overrides=[
        f"board.dir={out / 'boards'}",
        "job=nccl-slow",
        "diagnoser.hang_min_s=5",
        "agent.interval_s=0.5",
        f"sinks.jsonl={out / 'verdicts.jsonl'}",
        "sinks.console=false",
    ]
)
assert session is not None
harness = ctypes.CDLL(lib)
harness.ccld_harness_ring_timed.argtypes = [
    ctypes.c_char_p,
    ctypes.c_uint64,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
]
plugin = nccl_plugin_path().encode()
world_slot = session.tracer.entry(dist.group.WORLD).slot
t = torch.ones(1024)
for step in range(STEPS):
    ccld_plugin.mark_step(step)
    time.sleep(COMPUTE_S)  # the step's compute
    dist.all_reduce(t)
    # The NCCL all-reduce, entered as the tracer enters one; the host waits for it (as at
    # a stream synchronize), so its time is communication, not compute.
    index = session.board.enter(world_slot, OP_CODES["all_reduce"], FLAG_CUDA, 1 << 24)
    wait_us = SLOW_US if rank == slow_rank and step >= ONSET else FAST_US
    bad = harness.ccld_harness_ring_timed(plugin, 0xBEEF, world, rank, wait_us)
    assert bad == 0, f"{bad} plugin calls failed"
    session.board.exit(index, STATE_DONE)
ccld_plugin.mark_step(STEPS)
time.sleep(1.5)  # a last agent tick and diagnoser round see the final windows
ccld_plugin.disable()
