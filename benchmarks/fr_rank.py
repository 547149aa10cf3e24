"""One rank of ``benchmarks/vs_flight_recorder.py``: a training job with the plugin on and
PyTorch's Flight Recorder recording (``TORCH_FR_BUFFER_SIZE``), whose record every rank
dumps when any rank's collective times out, as NCCL's watchdog does with
``TORCH_NCCL_DUMP_ON_TIMEOUT`` (gloo has no watchdog: here a rank that times out drops a
trigger file and each rank's dump thread writes ``<TORCH_FR_DUMP_TEMP_FILE><rank>``).

Two jobs:

- ``workload ARGS...``: the demo's workload (``ccld_harness.workload``), its fault
  from ``CCLD_FAULTS`` (compute-hang, mismatch, kill);
- ``pp-deadlock --step S --steps N --timeout-s T --ccld-set ...``: two pipeline pairs
  (0->1, 2->3) that send activations forward each step, and a DP all-reduce (0,2) and
  (1,3); at step S ranks 0 and 1 both receive first: a deadlock of the first pair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import ccld_plugin

POLL_S = 0.2
DUMP_WAIT_S = 30.0


def _trigger() -> Path:
    return Path(os.environ["CCLD_FR_TRIGGER"])


def _dump_on_trigger(rank: int) -> None:
    """Wait for the trigger, then write this rank's Flight Recorder record (the pickle
    its analyzer reads) in one rename, so a reader never sees half a dump."""
    while not _trigger().exists():
        time.sleep(POLL_S)
    path = _dump_path(rank)
    data = torch._C._distributed_c10d._dump_fr_trace()
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def _dump_path(rank: int) -> Path:
    return Path(f"{os.environ['TORCH_FR_DUMP_TEMP_FILE']}{rank}")


def _timed_out(rank: int, exc: BaseException) -> None:
    print(f"fr_rank: collective failed: {type(exc).__name__}: {exc}", flush=True)
    _trigger().touch()
    # This rank's own dump thread writes its record; on gloo a dump can take seconds.
    deadline = time.monotonic() + DUMP_WAIT_S
    while not _dump_path(rank).exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    os._exit(1)


def _pp_deadlock(args: argparse.Namespace) -> None:
    ccld_plugin.enable(overrides=args.ccld_set)
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    # new_group's own default is not init's timeout
    pairs = [dist.new_group(r, timeout=timeout) for r in ([0, 1], [2, 3])]
    dps = [dist.new_group(r, timeout=timeout) for r in ([0, 2], [1, 3])]
    pp, dp = pairs[rank // 2], dps[rank % 2]
    ccld_plugin.register_group(pp, "pp")
    ccld_plugin.register_group(dp, "dp")
    peer = rank ^ 1
    w = torch.randn(256, 256)
    for step in range(args.steps):
        ccld_plugin.mark_step(step)
        x = torch.randn(64, 256)
        for _ in range(20):  # compute: a few ms
            x = torch.tanh(x @ w)
        if step == args.step and rank in (0, 1):
            if rank == 0:
                _record(f"pp-deadlock@0:step={step}", step)
            dist.recv(x, peer, group=pp)  # both ranks of the pair receive first
            dist.send(x, peer, group=pp)
        elif rank % 2 == 0:
            dist.send(x, peer, group=pp)
        else:
            dist.recv(x, peer, group=pp)
        dist.all_reduce(w, group=dp)
        w /= 2
    ccld_plugin.disable()


def _record(fault: str, step: int) -> None:
    with open(os.environ["CCLD_FAULT_LOG"], "a") as fh:
        entry = {"fault": fault, "kind": "pp-deadlock", "rank": 0, "step": step}
        fh.write(json.dumps({**entry, "wall_time": time.time()}) + "\n")


def main(argv: list[str]) -> int:
    rank = int(os.environ["RANK"])
    threading.Thread(target=_dump_on_trigger, args=(rank,), daemon=True).start()
    try:
        if argv[0] == "workload":
            from ccld_harness import workload

            return workload.main(argv[1:])
        p = argparse.ArgumentParser()
        p.add_argument("--step", type=int, default=4)
        p.add_argument("--steps", type=int, default=40)
        p.add_argument("--timeout-s", type=float, default=20)
        p.add_argument("--ccld-set", action="append", default=[])
        _pp_deadlock(p.parse_args(argv[1:]))
    except Exception as exc:  # noqa: BLE001 - a timed-out or broken collective
        _timed_out(rank, exc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
